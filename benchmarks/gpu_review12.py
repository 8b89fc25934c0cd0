"""GPU check of the twelfth session's review (tests/engine/sampling/test_greedy_argmax.py): the greedy rows' Triton
arg-max and the "tma" GEMV kind on an H200, against CUDA's own references.

1. ``kvpilot.kernels.sampling.argmax`` / ``kvpilot.sampling.sampler.greedy_ids`` against ``torch.argmax(dim=-1)``
   on the GPU (the reference whose ids the engine promised to keep): vocabularies 1, 4,097, 32,000,
   128,256, 152,064, 262,144, 8,388,613 and 300,000,001 (more than 65,535 chunks of 4,096 before the
   review: a grid CUDA refuses), float32/bfloat16/float16, rows with ties, NaNs, -0.0/0.0 and +inf on
   4,096-column chunk boundaries, all -inf rows, rows of the IPC logits buffer's slot layout written
   into a prefix of an id buffer, and replays of a CUDA graph with new logits. Then a table of
   microseconds per call (CUDA graph of 50 calls) against ``torch.argmax`` at 128,256 columns.
2. The "tma" GEMV kind (explicit configurations, PDL on and off) against the references and the fma
   kernel where the reviewed tests did not reach: the RMSNorm K-tile pass (K = 8,192, Llama-70B's
   hidden size: h bit-exact), N and K tails (N = 4,100, K = 4,104), a column-sliced weight whose
   next columns hold NaN, M = 0, and a misaligned weight base falling back from a "tma" table row.

Prints one line per check and the timing table; exits 1 on any mismatch. About 30 s on an H200.

    python3 benchmarks/gpu_review12.py
"""

from __future__ import annotations

import os
import sys

import torch

BAD: list[str] = []


def check(ok: bool, what: str) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {what}")
    if not ok:
        BAD.append(what)


def hard_rows(S: int, V: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(S, V, device="cuda", generator=g)
    c = 4096

    def put(row: int, cols, value: float) -> None:
        if row < S:
            for col in cols:
                if 0 <= col < V:
                    x[row, col] = value

    put(0, [V - 1], 1e4)  # the last column
    put(1, [c - 1, c], 50.0)  # a tie across a chunk boundary: the first
    put(2, [2 * c, c + 7, V - 1], float("nan"))  # the first NaN
    if S > 3:
        x[3] = float("-inf")  # -> 0
    if S > 4:
        x[4] = -1.0
        put(4, [3 * c - 1], -0.0)
        put(4, [3 * c], 0.0)  # -0.0 == 0.0: the first
    put(5, [V - 1, 5], float("inf"))
    put(6, [c, 2 * c - 1, 2 * c], float("inf"))
    if S > 7:
        x[7] = x[7].round()  # many ties
    return x.to(dtype)


def argmax_checks() -> None:
    from kvpilot.kernels import sampling as KS
    from kvpilot.sampling.sampler import greedy_ids

    for V in (1, 4097, 32000, 128256, 152064, 262144):
        for S in (1, 8, 64):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                x = hard_rows(S, V, dtype, seed=V + S)
                want = torch.argmax(x, dim=-1)
                ok = torch.equal(KS.argmax(x), want) and torch.equal(greedy_ids(x), want)
                if not ok:
                    check(False, f"argmax V={V} S={S} {dtype}")
    check(not BAD, "argmax = torch.argmax: V in 1 .. 262144, S 1/8/64, fp32/bf16/fp16, hard rows")
    for V, S in ((8388613, 3), (300000001, 1)):
        x = hard_rows(S, V, torch.float32 if V < 10**8 else torch.bfloat16, seed=V)
        check(torch.equal(KS.argmax(x), torch.argmax(x, dim=-1)), f"argmax V={V} S={S} (chunks grown to <= 1024)")
        del x
    torch.cuda.empty_cache()
    # the output rank: rows of a [2, max_batch, V] logits slot, ids into a prefix of tok_buf
    V = 128256
    buf = torch.zeros(2, 64, V, device="cuda")
    buf[1, :9] = hard_rows(9, V, torch.float32, seed=1)
    tok = torch.full((64,), -3, dtype=torch.int64, device="cuda")
    greedy_ids(buf[1, :9], out=tok[:9])
    check(torch.equal(tok[:9], torch.argmax(buf[1, :9], dim=-1)) and bool((tok[9:] == -3).all()),
          "greedy_ids(logits_buf[slot][:9], out=tok_buf[:9]); the rest of tok_buf untouched")
    # inside a CUDA graph, replayed with new logits
    x = hard_rows(5, V, torch.float32, seed=2)
    ids = torch.empty(5, dtype=torch.int64, device="cuda")
    greedy_ids(x, out=ids)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        greedy_ids(x, out=ids)
    ok = True
    for seed in range(5):
        x.copy_(hard_rows(5, V, torch.float32, seed=100 + seed).roll(seed, dims=1))
        graph.replay()
        torch.cuda.synchronize()
        ok &= torch.equal(ids, torch.argmax(x, dim=-1))
    check(ok, "greedy_ids captured in a CUDA graph, 5 replays with new logits")


def graph_us(fn, calls: int = 50, replays: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


def argmax_times() -> None:
    from kvpilot.kernels import sampling as KS

    print("\n| rows | dtype | torch.argmax us | kernels.sampling.argmax us |")
    print("|---|---|---|---|")
    for S in (1, 8, 64):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(S, 128256, device="cuda").to(dtype)
            out = torch.empty(S, dtype=torch.int64, device="cuda")
            t_torch = graph_us(lambda: torch.argmax(x, dim=-1, out=out))
            t_ours = graph_us(lambda: KS.argmax(x, out=out))
            print(f"| {S} | {str(dtype).split('.')[1]} | {t_torch:.1f} | {t_ours:.1f} |")


def gemv_checks() -> None:
    from kvpilot.kernels import gemv as G

    bf = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*s):
        return torch.randn(*s, device="cuda", generator=g).to(bf)

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    cfgs = [G.launch_config("tma", 1, 16, 256, num_stages=4), G.launch_config("tma", 1, 8, 512, num_stages=4),
            G.launch_config("tma", 1, 16, 256, num_stages=4, late_trigger=True)]
    fma = G.launch_config("fma", 1, 8, 512)
    for pdl in ("1", "0"):
        os.environ["KVPILOT_PDL"] = pdl
        # RMSNorm K-tile pass: K = 8192 > NORM_ONE_LOAD_MAX (Llama-70B's QKV shard at TP 1: N = 10240)
        k, n = 8192, 10240
        x, res, nw, w, b = rnd(1, k), rnd(1, k), 1 + 0.1 * rnd(k), rnd(n, k) / k**0.5, rnd(n)
        y_ref, h_ref = G.rmsnorm_gemv_ref(x, res, nw, 1e-5, w, b)
        for cfg in cfgs:
            y, h = G.rmsnorm_gemv_triton(x, res, nw, 1e-5, w, b, config=cfg)
            y_fma, _ = G.rmsnorm_gemv_triton(x, res, nw, 1e-5, w, b, config=fma)
            check(torch.equal(h, h_ref) and rel(y, y_ref) < 1e-2 and rel(y, y_fma) < 1e-2,
                  f"pdl={pdl} rmsnorm K=8192 residual+bias {cfg['block_n']}x{cfg['block_k']} "
                  f"late={cfg['late_trigger']}: rel {rel(y, y_ref):.2e}")
        del w
        # N and K tails; a column-sliced weight whose next columns are NaN
        n, k = 4100, 4104
        wide = rnd(n, 4160) / k**0.5
        wide[:, k:] = float("nan")
        w = wide[:, :k]
        x, gu, b = rnd(1, k), rnd(1, 2 * k), rnd(n)
        for cfg in cfgs:
            for name, got, ref in (
                ("plain bias", lambda c: G.gemv_triton(x, w, b, config=c), G.gemv_ref(x, w, b)),
                ("plain fp32", lambda c: G.gemv_triton(x, w, b, config=c, out_dtype=torch.float32),
                 G.gemv_ref(x, w, b, out_dtype=torch.float32)),
                ("silu", lambda c: G.silu_mul_gemv_triton(gu, w, config=c), G.silu_mul_gemv_ref(gu, w)),
            ):
                y = got(cfg)
                check(y.dtype == ref.dtype and rel(y, ref) < 1e-2 and rel(y, got(fma)) < 1e-2,
                      f"pdl={pdl} {name} N={n} K={k} sliced weight {cfg['block_n']}x{cfg['block_k']}: "
                      f"rel {rel(y, ref):.2e}")
        y = G.gemv_triton(torch.empty(0, k, dtype=bf, device="cuda"), w, config=cfgs[0])
        check(y.shape == (0, n), f"pdl={pdl} M = 0 -> [0, N]")
    os.environ.pop("KVPILOT_PDL", None)
    # a "tma" table row gives way to the next row for a weight with a misaligned base
    saved = G.CONFIGS["plain"]
    G.CONFIGS["plain"] = [(1, 0, cfgs[0])] + saved
    try:
        base = rnd(4096, 4104)
        w = base[:, 1:4097]
        x = rnd(1, 4096)
        check(rel(G.gemv(x, w), G.gemv_ref(x, w)) < 1e-2, "tma table row, misaligned weight base: fma fallback")
        w = base[:, :4096]
        check(rel(G.gemv(x, w), G.gemv_ref(x, w)) < 1e-2, "tma table row, aligned weight: tma")
    finally:
        G.CONFIGS["plain"] = saved


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}")
    argmax_checks()
    gemv_checks()
    argmax_times()
    if BAD:
        print(f"\n{len(BAD)} FAILED: " + "; ".join(BAD))
        return 1
    print("\nall checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
