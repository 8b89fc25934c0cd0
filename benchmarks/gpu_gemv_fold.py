"""What folding the TP-2 all-reduce into the batch-1 GEMVs costs each GEMV, on ONE GPU (no peer).

``KVPILOT_TP_FUSED_ALLREDUCE`` (engine/custom_all_reduce.py) removes the one-shot all-reduce kernel
(about 3.3 us) after o_proj and after all but the last down_proj, and in exchange (kernels/gemv.py,
"Folded all-reduce"):

- the producers (o_proj ``gemv``, down ``silu_mul_gemv``) reset an earlier receive buffer, fence, and
  push ``float32(y)`` (here: into a local buffer standing for the peer's);
- the consumers (QKV and gate_up ``rmsnorm_gemv``) spin with volatile loads on their receive buffer
  (here already filled, so the spin ends at the first read) and add it into every read of the input.

For each of Llama-3.1-8B's TP-2 shards (``gpu_gemv_vec.TP2_SHAPES``), bf16, M = 1: us per call of the
plain kernel and of the folded one, in CUDA graphs over rotating weight copies (``gpu_gemv.Op``'s
timing, launch gaps included), alternated ``--rounds`` times (median). The push's NVLink crossing and
the wait for a peer are not in these numbers; benchmarks/gpu_tp_profile.py measures the whole step
(``--layouts 1x1,2x1,2x1:KVPILOT_TP_FUSED_ALLREDUCE=0``).

Self-check (exit 1): the folded outputs are bit for bit the plain kernel's on the all-reduced input
(``bf16(x + recv)``), the pushed values are ``float32(y)``, the reset buffer is all sentinel.

Usage (one H200, about 30 s): ``python3 benchmarks/gpu_gemv_fold.py [--rounds 3] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_gemv as GB  # noqa: E402
import gpu_gemv_vec as GV  # noqa: E402

from kvpilot.kernels import gemv as G  # noqa: E402
from kvpilot.kernels.allreduce import SENTINEL_BITS, empty_receive_buffer  # noqa: E402


class FoldOp(GV.ShardOp):
    """A TP-2 shard op with receive buffers: ``recv`` (filled with the peer's partial: what the
    consumer pulls), ``push`` (stands for the peer's buffer) and ``old`` (the site a producer resets)."""

    def __init__(self, name: str, n: int, k: int, prologue: str, gen: torch.Generator):
        super().__init__(name, n, k, prologue, gen)
        peer = torch.randn(1, k, device="cuda", dtype=GB.DT, generator=gen)
        self.recv = peer.float().flatten().contiguous()
        self.push = empty_receive_buffer(n, "cuda")
        self.old = empty_receive_buffer(n, "cuda")

    def folded(self, i=0):
        w = self.ws[i % self.copies]
        if self.prologue == "rmsnorm":
            return G.rmsnorm_gemv_triton(self.x, self.res, self.nw, GB.EPS, w, pull=self.recv)
        if self.prologue == "silu":
            return G.silu_mul_gemv_triton(self.x, w, push=self.push, reset=self.old)
        return G.gemv_triton(self.x, w, push=self.push, reset=self.old)

    def plain(self, i=0):
        return self.fused(i)

    def problems(self) -> list[str]:
        out = []
        if self.prologue == "rmsnorm":
            summed = (self.x.float() + self.recv.view(1, -1)).to(self.x.dtype)  # two_rank_all_reduce's rounding
            y, h = self.folded(0)
            want_y, want_h = G.rmsnorm_gemv_triton(summed, self.res, self.nw, GB.EPS, self.ws[0])
            if not (torch.equal(y, want_y) and torch.equal(h, want_h)):
                out.append("pulled output differs from the plain kernel on the summed input")
            if (self.recv.view(torch.int32) == SENTINEL_BITS).any():
                out.append("the consumer changed its receive buffer")
        else:
            self.old.zero_()
            y = self.folded(0)
            if not torch.equal(y, self.fused(0)):
                out.append("pushing output differs from the plain kernel")
            pushed = y.float().flatten()
            pushed = torch.where(pushed == 0, torch.zeros_like(pushed), pushed)
            if not torch.equal(self.push, pushed):
                out.append("pushed values are not float32(y)")
            if not (self.old.view(torch.int32) == SENTINEL_BITS).all():
                out.append("the reset buffer is not all sentinel")
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, bad = [], []
    for name, (n, k, prologue) in GV.TP2_SHAPES.items():
        op = FoldOp(name, n, k, prologue, gen)
        bad += [f"{name}: {m}" for m in op.problems()]
        plain, folded = [], []
        for _ in range(a.rounds):
            plain.append(op.time(op.plain))
            folded.append(op.time(op.folded))
        what = "pull (spin + x + recv)" if prologue == "rmsnorm" else "reset + fence + push"
        rows.append(dict(op=name, n=n, k=k, fold=what, plain_us=statistics.median(plain),
                         folded_us=statistics.median(folded), config=G.gemv_config(1, n, k, prologue)))
        del op
        torch.cuda.empty_cache()
    print(f"{'op':<8} {'[N, K]':<14} {'folded part':<24} {'plain us':>9} {'folded us':>10} {'delta':>7}")
    for r in rows:
        print(f"{r['op']:<8} {str([r['n'], r['k']]):<14} {r['fold']:<24} {r['plain_us']:>9.2f} {r['folded_us']:>10.2f} "
              f"{r['folded_us'] - r['plain_us']:>+7.2f}")
    per_layer = sum(r["folded_us"] - r["plain_us"] for r in rows)
    print(f"per decoder layer: {per_layer:+.2f} us of GEMV time against two all-reduce kernels removed "
          "(the last layer keeps its down_proj one)")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    for b in bad:
        print(f"MISMATCH {b}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
