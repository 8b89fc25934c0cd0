"""The seed's Streaming Responses example."""

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
        if not chunk.finished:
            # Print incremental tokens (as the seed writes it; `.text_diff` holds only the new part)
            print(chunk.outputs[0].text, end="", flush=True)
        else:
            # Final output
            print("\n--- Generation complete ---")
            print(f"Total tokens: {len(chunk.outputs[0].token_ids)}")


asyncio.run(stream_response("Tell me a story about"))
llm.shutdown()
