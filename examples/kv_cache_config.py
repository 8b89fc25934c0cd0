"""The API documentation's "KV Cache Configuration": pool size, block reuse, an FP8 KV cache and the block size."""

from _model import MODEL
from kvpilot import LLM, SamplingParams
from kvpilot.llmapi import KvCacheConfig

llm = LLM(
    model=MODEL,
    kv_cache_config=KvCacheConfig(
        free_gpu_memory_fraction=0.95,  # Use 95% of free GPU memory
        enable_block_reuse=True,        # Enable KV cache reuse
        dtype="fp8",                    # FP8 quantization for KV cache
        tokens_per_block=32,            # Tokens per cache block
    )
)

output = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=32))
print(f"KV pool: {llm.pool_tokens} tokens; generated: {output.outputs[0].text!r}")
llm.shutdown()
