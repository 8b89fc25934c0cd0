"""The API documentation's `generate()` and `generate_async(..., streaming=True)` examples."""

import asyncio

from _model import MODEL
from kvpilot import LLM, SamplingParams

llm = LLM(model=MODEL)

outputs = llm.generate(
    inputs=["Prompt 1", "Prompt 2"],  # Single or list of prompts
    sampling_params=SamplingParams(temperature=0.7),
    use_tqdm=True,  # Show progress bar
)

for output in outputs:
    print(output.prompt)
    for sequence in output.outputs:
        print(sequence.text)


async def process_request(prompt: str):
    output = await llm.generate_async(
        inputs=prompt,
        sampling_params=SamplingParams(max_tokens=128),
        streaming=True,  # Enable streaming
    )

    # For streaming responses
    async for chunk in output:
        # `.text` is cumulative; `.text_diff` is the part this chunk added (the last one included)
        print(chunk.outputs[0].text_diff, end="", flush=True)
    print()


asyncio.run(process_request("Once upon a time"))
llm.shutdown()
