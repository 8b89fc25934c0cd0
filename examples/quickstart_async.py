"""The API documentation's asynchronous Quick Start: concurrent generate_async calls share batches."""

import asyncio

from _model import MODEL
from kvpilot import LLM, SamplingParams

llm = LLM(model=MODEL)
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)


async def generate_async(prompt: str):
    output = await llm.generate_async(prompt, sampling_params)
    print(f"Prompt: {output.prompt!r}, Generated: {output.outputs[0].text!r}")


async def main():
    prompts = ["Hello", "The capital of France is", "AI is"]
    tasks = [generate_async(prompt) for prompt in prompts]
    await asyncio.gather(*tasks)


asyncio.run(main())
llm.shutdown()
