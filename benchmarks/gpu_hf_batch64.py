"""transformers' `generate` at batch 64 (512 prompt tokens, 256 generated) with its default settings.

The batch-64 figure compares kvpilot with transformers' `generate` at batch 64. `gpu_bench.py` timed it
with ``cache_implementation="static"`` (transformers' compile and CUDA graphs, 2,297 output tok/s on
an H200); this times the call a user writes by default: a dynamic cache, no compile, SDPA
attention. Same random-weight Llama-3.1-8B-shaped checkpoint and prompts as `kvpilot bench
batch64` (64 prompts of 512 tokens, seed 64), greedy, ``min_new_tokens`` = 256 so every
row generates 256 tokens. One untimed warm-up call of 8 tokens, then ``--runs`` timed calls.

    python3 benchmarks/gpu_hf_batch64.py [--runs 2] [--static]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvpilot.tools.random_model import LLAMA31_8B, write_random_llama  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default="/tmp/kvpilot-llama8b-random")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--static", action="store_true", help="also time cache_implementation='static'")
    a = ap.parse_args()
    import transformers
    from transformers import LlamaForCausalLM

    from kvpilot.tools.bench_offline import random_prompts

    path = Path(a.model_dir)
    if not (path / "config.json").exists():
        write_random_llama(path, LLAMA31_8B, dtype=torch.bfloat16, device="cuda")
    model = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, device_map="cuda").eval()
    ids = torch.tensor(random_prompts(64, 512, LLAMA31_8B["vocab_size"], seed=64), device="cuda")
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0,
              temperature=None, top_p=None, top_k=None)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}, "
          f"attention {model.config._attn_implementation}")
    modes = [("default (dynamic cache, no compile)", {})] + (
        [("cache_implementation='static'", {"cache_implementation": "static"})] if a.static else [])
    with torch.inference_mode():
        for name, extra in modes:
            model.generate(ids, max_new_tokens=8, min_new_tokens=8, **kw, **extra)
            times = []
            for _ in range(a.runs):
                torch.cuda.synchronize()
                t = time.perf_counter()
                out = model.generate(ids, max_new_tokens=256, min_new_tokens=256, **kw, **extra)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
                assert out.shape == (64, 512 + 256)
            med = statistics.median(times)
            print(f"{name}: {', '.join(f'{t:.2f}' for t in times)} s -> {64 * 256 / med:.0f} output tok/s", flush=True)


if __name__ == "__main__":
    main()
