"""The API documentation's Runtime Statistics and Async Statistics examples."""

import asyncio

from _model import MODEL
from kvpilot import LLM, SamplingParams

llm = LLM(model=MODEL)
prompts = ["Once upon a time", "The little dog"] * 4
sampling_params = SamplingParams(max_tokens=32)

# Enable performance metrics
llm.generate(prompts, sampling_params)

# Get statistics
stats = llm.get_stats(timeout=2.0)
for stat in stats[-3:]:
    print(f"Iteration {stat['iter']}:")
    print(f"  GPU Memory: {stat['gpuMemUsage'] / 1e9:.2f} GB")
    print(f"  KV Cache Hit Rate: {stat['kvCacheStats']['cacheHitRate']:.2%}")
    print(f"  Active Requests: {stat['numActiveRequests']}")


async def monitor_stats():
    async for stats in llm.get_stats_async(timeout=2.0):
        print(f"Iteration latency: {stats['iterLatencyMS']:.2f}ms")
        print(f"Free KV blocks: {stats['kvCacheStats']['freeNumBlocks']}")


async def main():
    request = llm.generate_async("Once upon a time", SamplingParams(max_tokens=8))
    await asyncio.gather(request.aresult(), monitor_stats())


asyncio.run(main())
llm.shutdown()
