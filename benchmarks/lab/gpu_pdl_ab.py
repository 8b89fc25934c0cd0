"""Batch-1 decode with and without programmatic dependent launch (kernels/pdl.py), or with one
`kvpilot.tuning.Tuning` field (``--field``, e.g. ``fused_gemv``) or decode launch-table options
(``--field decode_tuning``) set to each of ``--modes``.

Builds the engine of `gpu_recheck.py` (Llama-3.1-8B-shaped random bf16 weights, FP8 KV cache) once
per setting, in the order ``--modes`` gives (alternated, to show drift), and for each:

- batch-1 inter-token latency, 128 prompt tokens, 512 generated (median of 3 runs), against the
  bandwidth floor (weights read per step + mean KV bytes) / the device copy rate measured here;
- greedy tokens of 4 prompts x 48 tokens at batch 1 and together (batch 4), which must equal the
  first setting's exactly: PDL changes when kernels start, never what they compute.

    python3 benchmarks/lab/gpu_pdl_ab.py [--modes 0 1 0 1]      # exits 1 if any tokens differ
    python3 benchmarks/lab/gpu_pdl_ab.py --field fused_gemv --allow-diff
    python3 benchmarks/lab/gpu_pdl_ab.py --field decode_tuning --modes '{}' '{"fused_num_warps": 1}' --allow-diff

``--allow-diff`` is for switches that change the fp32 summation order (not only timing): tokens are
then compared per prompt (first differing step) and only reported.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_decode_profile import copy_bandwidth  # noqa: E402
from kvpilot.tools.random_model import LLAMA31_8B, write_random_llama  # noqa: E402
from gpu_recheck import StepLog, build  # noqa: E402


@contextlib.contextmanager
def pdl_off(off: bool):
    """Within the block no kernel launch uses PDL (``off``): every kernel module's ``pdl_mode`` returns 0."""
    from kvpilot.kernels import pdl
    from kvpilot.kernels import allreduce, decode_attention, fused_decode_attention, gemv, kv_cache, pointwise  # noqa: F401

    original = pdl.pdl_mode
    mods = [m for n, m in list(sys.modules.items())
            if off and n.startswith("kvpilot.kernels") and getattr(m, "pdl_mode", None) is original]
    for m in mods:
        m.pdl_mode = lambda device, rows: 0
    try:
        yield
    finally:
        for m in mods:
            m.pdl_mode = original


def setting(field: str, mode: str):
    """(the `Tuning` of one engine, whether PDL is off, decode launch-table overrides) for ``--field``'s ``mode``."""
    from kvpilot.kernels.attention_common import decode_tuning_from_json
    from kvpilot.tuning import Tuning, parse_overrides

    if field == "pdl":
        from kvpilot.envs import parse_bool

        return Tuning(), not parse_bool("--modes", mode), {}
    if field == "decode_tuning":
        return Tuning(), False, decode_tuning_from_json(mode)
    return parse_overrides(f"{field}={mode}"), False, {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default="/tmp/kvpilot-llama8b-random")
    ap.add_argument("--modes", nargs="+", default=["0", "1", "0", "1"])
    ap.add_argument("--kv-dtype", default="fp8")
    ap.add_argument("--field", default="pdl", help="what the modes set: pdl (on/off), decode_tuning (JSON "
                    "objects) or a kvpilot.tuning.Tuning field (default pdl)")
    ap.add_argument("--allow-diff", action="store_true", help="report differing tokens instead of failing")
    args = ap.parse_args()
    from kvpilot import SamplingParams
    from kvpilot.tools.bench_offline import random_prompts, run_latency

    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    path = Path(args.model_dir)
    if not (path / "config.json").exists():
        write_random_llama(path, LLAMA31_8B, dtype=torch.bfloat16, device="cuda")
    cfg = LLAMA31_8B
    prompts = random_prompts(4, 100, cfg["vocab_size"], seed=7)
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, detokenize=False)
    want = None
    bad = 0
    rows = []
    print(f"| {args.field} | ITL ms (median of 3) | % of floor speed | best run ms | load s | greedy tokens vs first |")
    print("|---|---:|---:|---:|---:|---|")
    from kvpilot.kernels import attention

    base_tuning = dict(attention.TUNING["decode"])
    for mode in args.modes:
        tuning, no_pdl, decode = setting(args.field, mode)
        attention.TUNING["decode"] = dict(base_tuning, **decode)
        with pdl_off(no_pdl):
            llm, load_s = build(path, args.kv_dtype, StepLog(), tuning=tuning)
            try:
                runner = llm._executor
                per_tok = runner.bytes_per_block // runner.block_size
                weight_read = runner.weight_bytes - cfg["vocab_size"] * cfg["hidden_size"] * 2
                lat = run_latency(llm, 128, 512, batch_size=1, num_iters=3)
                floor = (weight_read + per_tok * (128 + 511 / 2)) / bw
                one = [llm.generate(p, greedy, use_tqdm=False).outputs[0].token_ids for p in prompts]
                together = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
            finally:
                llm.shutdown()
                del llm
                torch.cuda.empty_cache()
        got = (one, together)
        want = want or got
        same = got == want
        bad += not same and not args.allow_diff
        if not same:
            first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                     for x, y in zip(got[0] + got[1], want[0] + want[1])]
            print(f"  first differing step per run (batch 1 x4, batch 4 x4): {first}")
        itl = lat["itl_s"] * 1e3
        rows.append((mode, itl))
        print(f"| {mode} | {itl:.3f} | {100 * floor / lat['itl_s']:.1f}% | {min(lat['itl_s_all']) * 1e3:.3f} | "
              f"{load_s:.1f} | {'same' if same else 'DIFFERENT'} |", flush=True)
    for mode in dict.fromkeys(args.modes):
        vals = [v for m, v in rows if m == mode]
        print(f"mode {mode}: mean ITL {statistics.fmean(vals):.3f} ms over {len(vals)} engines")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
