"""The API documentation's Streaming Responses example."""

import asyncio

from _model import MODEL
from kvpilot import LLM, SamplingParams

llm = LLM(model=MODEL)


async def stream_response(prompt: str):
    output = await llm.generate_async(
        prompt,
        sampling_params=SamplingParams(max_tokens=512),
        streaming=True,
    )

    async for chunk in output:
        # `.text` is cumulative; `.text_diff` is the part this chunk added (the last chunk too)
        print(chunk.outputs[0].text_diff, end="", flush=True)
        if chunk.finished:
            # Final output
            print("\n--- Generation complete ---")
            print(f"Total tokens: {len(chunk.outputs[0].token_ids)}")


asyncio.run(stream_response("Tell me a story about"))
llm.shutdown()
