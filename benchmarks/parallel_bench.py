"""Tensor/pipeline-parallel benchmark: greedy agreement, batch-1 inter-token latency, offline throughput.

For each layout ``TPxPP`` (one `LLM` each, loaded in turn) it measures, on a random-weight model of
Llama-3.1-8B's shape (``kvpilot.tools.random_model``; ``--tiny`` for a CPU dry run):

- greedy tokens of fixed random prompts, compared with the first layout's (TP 1 is the reference);
- batch-1 inter-token latency: (time of a 1+N-token request - time of a 1-token request) / N,
  median of three, after a warm-up;
- offline throughput: ``--num-prompts`` random prompts of ``--input-len`` tokens, ``--output-len``
  generated tokens each (ignore_eos), all submitted at once; output and total tokens per second.

Results go to ``$OUT/parallel_bench.json`` after every layout (a timeout keeps what was done).
Usage: ``python benchmarks/parallel_bench.py --layouts 1x1,2x1,1x2`` (run it from outside the repo root
or by path, never ``python -m`` in the repo root).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvpilot.tools.random_model import LLAMA31_8B, TINY, write_random_llama  # noqa: E402


def _layout(text: str) -> tuple[int, int, dict]:
    """'2x1' or '2x1:KEY=VAL;KEY=VAL' (environment for that layout's workers)."""
    shape, _, env = text.partition(":")
    tp, pp = (int(v) for v in shape.split("x"))
    return tp, pp, dict(kv.split("=", 1) for kv in env.split(";") if kv)


def run_layout(model: Path, tp: int, pp: int, a, prompts, tput_prompts) -> dict:
    from kvpilot import LLM, KvCacheConfig, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(str(model), tensor_parallel_size=tp, pipeline_parallel_size=pp, skip_tokenizer_init=True,
              max_seq_len=a.max_seq_len, max_batch_size=a.max_batch_size, device=a.device,
              kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=0.85))
    res: dict = {"tp": tp, "pp": pp, "load_s": time.perf_counter() - t0,
                 "kv_blocks": llm._executor.num_blocks}
    try:
        greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=a.greedy_len, ignore_eos=True),
                              use_tqdm=False)
        res["greedy"] = [o.outputs[0].token_ids for o in greedy]

        def timed(n: int) -> float:
            t = time.perf_counter()
            llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            return time.perf_counter() - t

        timed(a.itl_tokens + 1)  # warm-up (graphs, allocator, kernels' autotuning)
        itl = [(timed(a.itl_tokens + 1) - timed(1)) / a.itl_tokens for _ in range(3)]
        res["itl_ms"] = statistics.median(itl) * 1e3
        res["itl_ms_all"] = [x * 1e3 for x in itl]
        sp = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(tput_prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        res.update(tput_wall_s=wall, output_tok_s=out_tokens / wall,
                   total_tok_s=(out_tokens + sum(len(p) for p in tput_prompts)) / wall)
    finally:
        llm.shutdown()
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/parallel_bench"))
    p.add_argument("--model-dir", default="/tmp/kvpilot_random_8b")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="auto")
    p.add_argument("--layouts", default="1x1,2x1,1x2")
    p.add_argument("--greedy-len", type=int, default=64)
    p.add_argument("--itl-tokens", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--max-batch-size", type=int, default=256)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = TINY if a.tiny else LLAMA31_8B
    model = Path(a.model_dir)
    if not (model / "config.json").is_file():
        t = time.perf_counter()
        write_random_llama(model, cfg, device="cuda" if torch.cuda.is_available() else "cpu")
        logging.info("wrote %s in %.1f s", model, time.perf_counter() - t)
    g = torch.Generator().manual_seed(0)
    V = cfg["vocab_size"]
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (16, 40, 7, 100)]
    tput = [torch.randint(3, V, (a.input_len,), generator=g).tolist() for _ in range(a.num_prompts)]
    report: dict = {"machine": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                    "gpus": torch.cuda.device_count(), "torch": torch.__version__, "args": vars(a),
                    "date": time.strftime("%Y-%m-%d"), "layouts": []}
    for text in a.layouts.split(","):
        tp, pp, env = _layout(text)
        os.environ.update(env)
        try:
            res = run_layout(model, tp, pp, a, prompts, tput)
        except Exception as e:  # keep going: the next layout may still run
            logging.exception("layout %s failed", text)
            res = {"tp": tp, "pp": pp, "error": repr(e)[:2000]}
        finally:
            for k in env:
                os.environ.pop(k, None)
        res["layout"] = text
        ref = report["layouts"][0].get("greedy") if report["layouts"] else None
        if ref is not None and "greedy" in res:
            same = [next((i for i, (x, y) in enumerate(zip(r, o)) if x != y), len(r)) for r, o in zip(ref, res["greedy"])]
            res["greedy_first_divergence"] = same
            res["greedy_identical"] = res["greedy"] == ref
        report["layouts"].append(res)
        (out / "parallel_bench.json").write_text(json.dumps(report, indent=1))
        logging.info("layout %s: %s", text, {k: v for k, v in res.items() if k != "greedy"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
