"""Host (CPU) time of one engine step outside the model: scheduling, sampling bookkeeping, stops,
detokenization, outputs and stats.

On a GPU the engine loop is synchronous, so this time adds to every step while the GPU waits (at
batch 256 a CUDA-graph decode step of an 8B model takes about 11 ms on an H200). The model is
replaced by an executor that returns zero logits at once, so only the engine's own work is timed.

    .venv/bin/python benchmarks/engine_host_overhead.py [--batch 1 64 256] [--steps 100] [--tokenizer]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


class _ZeroLogitsExecutor:
    """Stands in for the model: zero logits (greedy picks token 0) for every sampled row."""

    def __init__(self, num_blocks: int, block_size: int, vocab: int) -> None:
        self.num_blocks, self.block_size, self.vocab = num_blocks, block_size, vocab

    def execute(self, plan):
        rows = sum(len(p.token_ids) if p.all_logits else int(p.sample) for p in plan)
        return torch.zeros(rows, self.vocab), None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--streaming", action="store_true", help="streamed requests (a chunk per step)")
    ap.add_argument("--tokenizer", action="store_true", help="detokenize (default: token ids only)")
    args = ap.parse_args()

    from kvpilot import LLM, SamplingParams
    from kvpilot.convert_llama2c import ensure_stories260k

    llm = LLM(str(ensure_stories260k()), skip_tokenizer_init=not args.tokenizer, max_batch_size=max(args.batch))
    core = llm._core
    core.executor = _ZeroLogitsExecutor(core.executor.num_blocks, core.executor.block_size,
                                        llm.model_config.vocab_size)
    llm._loop.stop()  # drive the core directly, on this thread
    sp = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True)
    print(f"| batch | ms per step (median) | us per sequence |")
    print(f"|---:|---:|---:|")
    for batch in args.batch:
        reqs = [llm._make_request([1, 300 + i % 200, 7], sp, args.streaming) for i in range(batch)]
        for r in reqs:
            core.add_request(r)
        times = []
        while core.has_work:
            t = time.perf_counter()
            core.step()
            core.flush_outputs()
            times.append(time.perf_counter() - t)
        ms = statistics.median(times[1:]) * 1e3
        print(f"| {batch} | {ms:.3f} | {ms * 1e3 / batch:.1f} |")


if __name__ == "__main__":
    main()
