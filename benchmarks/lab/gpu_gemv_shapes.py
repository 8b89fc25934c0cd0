"""GPU checks of the batch-1 GEMV options (kernels/gemv.py): checks at other models'
shapes and dtypes, and the one-load RMSNorm pass's register cost at K = 8192 and 16384.

Usage (one H200 after `pip install -e .`; under a minute):

    python3 benchmarks/lab/gpu_gemv_shapes.py [--json PATH]

1. Checks (compiled paths the CPU interpreter never runs with real tile sizes): the dispatchers at
   M = 1 (so the launch table's batch-1 rows) for qkv, gate_up, o_proj and down at Llama-3.1-8B,
   its tensor-parallel-8 shard (o_proj K = 512, down K = 1792: partial K tiles on the vec and fma
   paths), a hidden size of 5120 (NORM_PAD 8192 with a masked tail), 70B at tp 2 and 405B at tp 4
   (K = 8192 / 16384: the one-load pass and the early weight tile at their largest), each in bf16,
   fp16 and fp32; ``h`` bit-exact, ``y`` within 1e-2 (16-bit) / 1e-5 (fp32) relative L2; o_proj
   also with a strided bias and as an fp32 partial product.
2. Timing (bf16, CUDA graphs over rotating weight copies, `gpu_gemv.Op`): the table's rmsnorm
   configuration (``norm_one_load``) against the same configuration with the K-tile norm pass.
   ptxas (tools/compile_kernels.py) gives the vec row 58 registers at K <= 4096 but 79 at 8192 and
   164 at 16384 with the one-load pass (58 with the loop), and the early_weight row 128 / 248 at
   8192 / 16384: fewer resident programs than ``programs_per_sm`` asks (8 and 4 per SM). A ratio
   above 1 in the last column says the one-load pass loses at that K. (``NORM_ONE_LOAD_MAX`` keeps
   the engine on the K-tile pass above K = 4096 until this says otherwise; it is lifted here.)
Exits 1 on a mismatch, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_gemv as GB  # noqa: E402

from kvpilot.kernels import gemv as G  # noqa: E402

# (label, hidden, q heads, kv heads, intermediate) per GPU; head_dim 128.
MODELS = [
    ("8B", 4096, 32, 8, 14336),
    ("8B tp8", 4096, 4, 1, 1792),
    ("hidden 5120", 5120, 40, 8, 13824),
    ("70B tp2", 8192, 32, 4, 14336),
    ("405B tp4", 16384, 32, 2, 13312),
]
# (label, K, N): the rmsnorm products whose table row uses norm_one_load, at K = 4096 (measured
# for the table), 8192 and 16384.
TIMED = [
    ("8B qkv", 4096, 6144), ("8B gate_up", 4096, 28672),
    ("70B qkv tp2", 8192, 5120), ("70B gate_up tp2", 8192, 28672),
    ("405B qkv tp8", 16384, 2560), ("405B gate_up tp4", 16384, 26624),
]


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return GB.rel_l2(out, ref)


def check_model(label: str, hidden: int, heads: int, kv: int, inter: int, dtype: torch.dtype) -> list[str]:
    """Failures (strings) of the batch-1 dispatchers against the references at one model's shapes."""
    g = torch.Generator(device="cuda").manual_seed(hidden + heads)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=g).to(dtype)  # noqa: E731
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    bad = []
    x, res, nw = rnd(1, hidden), rnd(1, hidden), 1 + 0.1 * rnd(hidden)
    for name, n in (("qkv", (heads + 2 * kv) * 128), ("gate_up", 2 * inter)):
        w = rnd(n, hidden) / hidden**0.5
        y, h = G.rmsnorm_gemv(x, res, nw, 1e-5, w)
        yr, hr = G.rmsnorm_gemv_ref(x, res, nw, 1e-5, w)
        if not torch.equal(h, hr):
            bad.append(f"{label} {dtype} {name}: h not bit-exact")
        e = max(rel(y, yr), rel(G.rmsnorm_gemv(x, None, nw, 1e-5, w), G.rmsnorm_gemv_ref(x, None, nw, 1e-5, w)))
        if not e < tol:
            bad.append(f"{label} {dtype} {name}: rel err {e:.2g}")
        del w
    a = rnd(1, heads * 128)
    w = rnd(hidden, heads * 128) / (heads * 128) ** 0.5
    b = rnd(hidden, 2)[:, 0]  # stride 2
    for what, got, ref, t in (("o_proj+strided bias", G.gemv(a, w, b), G.gemv_ref(a, w, b), tol),
                              ("o_proj fp32 partial", G.gemv(a, w, None, torch.float32),
                               G.gemv_ref(a, w, None, torch.float32), 1e-5)):
        if not rel(got, ref) < t:
            bad.append(f"{label} {dtype} {what}: rel err {rel(got, ref):.2g}")
    gu, wd = rnd(1, 2 * inter), rnd(hidden, inter) / inter**0.5
    e = rel(G.silu_mul_gemv(gu, wd), G.silu_mul_gemv_ref(gu, wd))
    if not e < tol:
        bad.append(f"{label} {dtype} down: rel err {e:.2g}")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    print(f"GPU {torch.cuda.get_device_name()}")
    bad: list[str] = []
    for model in MODELS:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            bad += check_model(*model, dtype)
        torch.cuda.empty_cache()
    print(f"checks: {len(MODELS) * 3} model x dtype cases, {len(bad)} failures")
    for b in bad:
        print("  MISMATCH", b)

    copy_bps = GB.copy_bandwidth()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print("\n| product | K | N | floor us | table (one-load pass) us | K-tile pass us | one-load / K-tile |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, k, n in TIMED:
        GB.SHAPES[label] = (k, n, "rmsnorm")
        o = GB.Op(label, 1, gen)
        table = G.gemv_config(1, n, k, "rmsnorm")
        loop = dict(table, norm_one_load=False)
        us = {}
        limit = G.NORM_ONE_LOAD_MAX
        G.NORM_ONE_LOAD_MAX = 1 << 20  # the table's one-load pass (and early tile) at every K timed here
        try:
            for name, cfg in (("one", table), ("loop", loop)):
                err = o.check(cfg)
                if not err < 1e-2:
                    bad.append(f"{label} {name}: rel err {err:.2g} (inf: h not bit-exact)")
                us[name] = o.time(o.fused, config=cfg)
        finally:
            G.NORM_ONE_LOAD_MAX = limit
        floor = o.bytes() / copy_bps * 1e6
        print(f"| {label} | {k} | {n} | {floor:.1f} | {us['one']:.2f} | {us['loop']:.2f} | "
              f"{us['one'] / us['loop']:.3f} |", flush=True)
        rows.append(dict(op=label, k=k, n=n, floor_us=floor, one_load_us=us["one"], loop_us=us["loop"]))
        del o
        torch.cuda.empty_cache()
    print(f"mismatches: {len(bad)}")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(rows=rows, failures=bad), indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
