"""Sliding-window paged attention on a GPU: window 4,096 against full attention at a 32k context.

Usage (on a CUDA machine, after `make install` or `pip install -e .`; about 2 minutes on an H200):

    python3 benchmarks/lab/gpu_sliding_window.py [--context 32768] [--window 4096] [--json PATH]

Shapes: Mistral-7B / Llama-3-8B attention (32 query heads, 8 kv heads, head_dim 128), KV page 32,
bf16 cache; the soft-capped rows use Gemma 2's cap of 50. Cases:

- decode, batch 1: `paged_attention_triton` (split decode) and the engine's batch-1 path
  `kernels.rotary_decode_attention` (the fused rotary + KV write + decode kernel);
- decode, batch 64: the full-batch launch (the TMA kernel where TUNING enables it), also with the
  soft cap;
- prefill: a 2,048-token chunk after a prefix that ends at the context (chunked prefill of a long
  prompt), and an 8,192-token prompt from position 0.

Each case is timed with the window and without (`triton.testing.do_bench`, median), and every
output is checked against `kernels.reference` (on a slice of the batch, or the chunk's last 256
queries, so the reference fits in memory): the script exits 1 when an error exceeds 0.02 (max
|out - ref| / (1 + |ref|)). A window skips the pages before it, so a bandwidth-bound decode should
get close to ``context / window`` times faster; the table prints that bound next to the speedup.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton.testing

import kvpilot.kernels as K
from kvpilot.kernels.attention import paged_attention_triton

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 32
DT = torch.bfloat16
CAP = 50.0
MAX_ERR = 0.02


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / (1 + |ref|): one bf16 rounding stays below 0.004."""
    out, ref = out.float(), ref.float()
    return ((out - ref).abs() / (1 + ref.abs())).max().item()


def bench(fn) -> float:
    """Median milliseconds of ``fn`` (`triton.testing.do_bench`)."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def paged_batch(q_lens: list[int], seq_lens: list[int], seed: int = 0) -> list:
    """A random bf16 paged batch whose sequence ``i`` has ``seq_lens[i]`` keys, the last ``q_lens[i]``
    of them this step's queries, its pages shuffled over the cache: the arguments of
    `paged_attention_triton`, as a list."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = [-(-s // BLOCK) for s in seq_lens]
    perm = torch.randperm(sum(pages), device="cuda", generator=g).int()
    tables = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(pages):
        tables[i, :n] = perm[start: start + n]
        start += n
    shape = (sum(pages), BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda", generator=g, dtype=DT)
    v_cache = torch.randn(shape, device="cuda", generator=g, dtype=DT)
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, device="cuda", generator=g, dtype=DT)
    qsl = torch.tensor([0] + q_lens, device="cuda").cumsum(0).int()
    sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return [q, k_cache, v_cache, tables, sl, qsl, HEAD_DIM ** -0.5, max(q_lens), max(seq_lens)]


def check_slice(args, out, kw, seqs: int | None = None, last_queries: int | None = None) -> float:
    """Error of ``out`` against the reference on the first ``seqs`` sequences of a decode batch, or
    on the last ``last_queries`` queries of a one-sequence prefill (the same rows of attention)."""
    q, kc, vc, bt, sl, qsl, scale, max_q, max_s = args
    if seqs is not None:
        n = min(seqs, sl.shape[0])
        ref = K.paged_attention_ref(q[:n], kc, vc, bt[:n], sl[:n], qsl[: n + 1], scale, 1, max_s, **kw)
        return rel_err(out[:n], ref)
    m = min(last_queries, q.shape[0])
    sub_qsl = torch.tensor([0, m], dtype=torch.int32, device=q.device)
    ref = K.paged_attention_ref(q[-m:], kc, vc, bt, sl, sub_qsl, scale, m, max_s, **kw)
    return rel_err(out[-m:], ref)


def attention_row(name, q_lens, seq_lens, window, keys_full, keys_window, cap=None, seqs=None, last_queries=None):
    args = paged_batch(q_lens, seq_lens)
    res = {"case": name}
    for label, w in (("full", None), ("window", window)):
        kw = dict(sliding_window=w, logits_soft_cap=cap)
        out = paged_attention_triton(*args, **kw)
        res[f"err_{label}"] = check_slice(args, out, kw, seqs, last_queries)
        res[f"ms_{label}"] = bench(lambda: paged_attention_triton(*args, **kw))
    res["bound"] = keys_full / keys_window
    del args
    torch.cuda.empty_cache()
    return res


def fused_decode_row(context, window):
    """Batch-1 decode through `kernels.rotary_decode_attention` (the engine's path at small batch)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    args = paged_batch([1], [context])
    q, kc, vc, bt, sl, qsl, scale, _, max_s = args
    k = torch.randn(1, KV_HEADS, HEAD_DIM, device="cuda", generator=g, dtype=DT)
    v = torch.randn(1, KV_HEADS, HEAD_DIM, device="cuda", generator=g, dtype=DT)
    positions = torch.tensor([context - 1], device="cuda")
    slots = (bt[0, (context - 1) // BLOCK].long() * BLOCK + (context - 1) % BLOCK).reshape(1)
    cos_sin = K.build_rope_cache(HEAD_DIM, context, 500000.0, device="cuda")
    res = {"case": f"decode b=1 fused rotary, {context} keys"}
    for label, w in (("full", None), ("window", window)):
        kw = dict(sliding_window=w)
        call = lambda: K.rotary_decode_attention(q, k, v, positions, cos_sin, kc, vc, slots, bt, sl, qsl,  # noqa: E731
                                                 scale, max_s, **kw)
        out = call()
        kc_ref, vc_ref = kc.clone(), vc.clone()
        ref = K.rotary_decode_attention_ref(q, k, v, positions, cos_sin, kc_ref, vc_ref, slots, bt, sl, qsl, scale,
                                            max_s, **kw)
        res[f"err_{label}"] = rel_err(out, ref)
        res[f"ms_{label}"] = bench(call)
    res["bound"] = context / min(window, context)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=32768, help="keys per decode query (default 32768)")
    p.add_argument("--window", type=int, default=4096, help="sliding window in keys (default 4096)")
    p.add_argument("--json", help="also write the rows to this file")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    ctx, w = a.context, a.window
    rows = [
        attention_row(f"decode b=1, {ctx} keys", [1], [ctx], w, ctx, min(w, ctx), seqs=1),
        fused_decode_row(ctx, w),
        attention_row(f"decode b=64, {ctx} keys", [1] * 64, [ctx] * 64, w, ctx, min(w, ctx), seqs=4),
        attention_row(f"decode b=64, {ctx} keys, cap {CAP:g}", [1] * 64, [ctx] * 64, w, ctx, min(w, ctx), cap=CAP,
                      seqs=4),
    ]
    # Prefill: keys a query sees summed over the chunk, full against windowed.
    chunk = 2048
    full_keys = sum(ctx - chunk + j + 1 for j in range(chunk))
    win_keys = sum(min(ctx - chunk + j + 1, w) for j in range(chunk))
    rows.append(attention_row(f"prefill {chunk} after {ctx - chunk}", [chunk], [ctx], w, full_keys, win_keys,
                              last_queries=256))
    prompt = 8192
    full_keys = prompt * (prompt + 1) // 2
    win_keys = sum(min(j + 1, w) for j in range(prompt))
    rows.append(attention_row(f"prefill {prompt} from 0", [prompt], [prompt], w, full_keys, win_keys,
                              last_queries=256))
    rows.append(attention_row(f"prefill {prompt} from 0, cap {CAP:g}", [prompt], [prompt], w, full_keys, win_keys,
                              cap=CAP, last_queries=256))

    print(f"{torch.cuda.get_device_name()}: {HEADS} heads, {KV_HEADS} kv heads, head_dim {HEAD_DIM}, page {BLOCK}, "
          f"bf16; window {w}")
    print(f"{'case':42s} {'full ms':>9s} {'window ms':>10s} {'speedup':>8s} {'bound':>6s} {'err full':>9s} "
          f"{'err win':>8s}")
    bad = False
    for r in rows:
        speed = r["ms_full"] / r["ms_window"]
        r["speedup"] = speed
        print(f"{r['case']:42s} {r['ms_full']:9.4f} {r['ms_window']:10.4f} {speed:7.2f}x {r['bound']:5.1f}x "
              f"{r['err_full']:9.2e} {r['err_window']:8.2e}")
        bad |= max(r["err_full"], r["err_window"]) > MAX_ERR
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if bad:
        print(f"FAIL: an output differs from the reference by more than {MAX_ERR}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
