"""GPU check (tests/engine/parallel/test_parallel_prefill_padding.py on the CPU): padded eager prefill
is one GPU's prefill-graph replay, bit for bit, on CUDA; and the ``out_dtype=float32`` cuBLAS path of
the row-parallel reduction in fp16 and bf16.

Tensor/pipeline-parallel ranks run prefill steps eagerly but pad them to one GPU's prefill-graph
shapes (`model_runner.prefill_padding`), so that cuBLAS and the Triton attention kernels pick one
GPU's algorithms and context splits. The premise is checked here on one GPU, on a Llama-3.1-8B-shaped
random model cut to ``--layers`` layers (bf16): one `ModelRunner` with its CUDA graphs runs a random
engine-like schedule (chunked prefill at any offset, several sequences, decodes mixed in, chunks
that do not sample, prompt-logprob chunks, steps past the largest bucket); every step that is not
decode-only runs three ways on the same KV state:

- ``graph``: as one GPU runs it (a prefill graph where `PrefillGraphs.can_run`, else eagerly);
- ``padded``: eagerly with ``prefill_pad_buckets`` (what a rank runs);
- ``unpadded``: eagerly at the real token count (what ranks ran before e378c58; informative).

Self-check (exit status 1): ``padded`` logits differ in any bit from ``graph`` on any step, or the
KV cache it leaves differs; or ``out_dtype=torch.float32`` of `gemv` / `silu_mul_gemv` (fp16 and
bf16, rows past the Triton GEMV's limit, so ``torch.mm(..., out_dtype=float32)``) is not the fp32
product (rel. error vs float64 above 1e-5) or is not float32. Prints how many steps ``unpadded``
differs on, and the median step time of each variant per kind of step. About a minute on an H200
(model writing included).

    python3 benchmarks/lab/gpu_prefill_padding.py [--layers 4] [--steps 60]
    python3 benchmarks/lab/gpu_prefill_padding.py --device cpu     # dry run with the CPU graph doubles
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from kvpilot.tools.random_model import LLAMA31_8B, TINY, write_random_llama  # noqa: E402

BLOCK = 16


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _run(runner, plan, mode: str, pg, buckets, device: str):
    """(logits float32 clone, rows, seconds) of ``plan`` in ``mode`` (graph / padded / unpadded)."""
    runner.prefill_graphs = pg if mode == "graph" else None
    runner.prefill_pad_buckets = buckets if mode == "padded" else None
    _sync(device)
    t = time.perf_counter()
    logits, rows = runner.execute(plan)
    logits = logits.float().clone()
    _sync(device)
    return logits, list(rows), time.perf_counter() - t


class RandomSchedule:
    """A random engine-like schedule of prefill chunks and decodes over a block pool (also used by
    tests/engine/parallel/test_parallel_prefill_padding.py on the CPU).

    Up to ``max_seqs`` sequences live at once, each with ``width`` blocks of ``block`` tokens of the
    pool ``[0, num_blocks)``; a prompt is 2..40 tokens, or up to ``long_prompt``; each step takes a
    random subset of the live sequences, each a random chunk of what it has left, within a budget
    drawn from ``budgets``; a first chunk asks for prompt logprobs (``all_logits``) with probability
    ``logprobs``; a sequence leaves after ``decodes`` generated tokens (or at ``max_seq - 1``).
    Token ids are drawn from ``[3, vocab)``. Call `plan`, run it, then `advance` with it.
    """

    def __init__(self, num_blocks: int, width: int, max_seqs: int, block: int, max_seq: int, vocab: int,
                 long_prompt: int, budgets: list[int], decodes: int = 3, logprobs: float = 0.1, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.free = list(range(num_blocks))
        self.rng.shuffle(self.free)
        self.live: dict[int, list] = {}  # seq_id -> [tokens, computed, blocks, prompt length]
        self.ids = itertools.count()
        self.width, self.max_seqs, self.block, self.max_seq, self.vocab = width, max_seqs, block, max_seq, vocab
        self.long_prompt, self.budgets, self.decodes, self.logprobs = long_prompt, budgets, decodes, logprobs

    def plan(self) -> list:
        """The next step's ``list[ScheduledSeq]`` (empty when nothing is left to compute)."""
        from kvpilot.runner.model_runner import ScheduledSeq

        rng, live = self.rng, self.live
        while len(live) < self.max_seqs and len(self.free) >= self.width:
            n = rng.choice([rng.randint(2, 40), rng.randint(40, self.long_prompt)])
            toks = [rng.randrange(3, self.vocab) for _ in range(n)]
            live[next(self.ids)] = [toks, 0, [self.free.pop() for _ in range(self.width)], n]
        plan, budget = [], rng.choice(self.budgets)
        for sid in rng.sample(sorted(live), rng.randint(1, len(live))):
            toks, done, blocks, _ = live[sid]
            n = min(len(toks) - done, rng.randint(1, len(toks) - done), budget)
            if n <= 0:
                break
            budget -= n
            plan.append(ScheduledSeq(sid, toks[done:done + n], done, blocks[:-(-(done + n) // self.block)],
                                     done + n == len(toks), rng.random() < self.logprobs and done == 0))
        return plan

    def advance(self, plan: list) -> None:
        """Account for ``plan`` having run: computed tokens, a random sampled token, retirements."""
        for s in plan:
            entry = self.live[s.seq_id]
            entry[1] += len(s.token_ids)
            if s.sample:
                entry[0].append(self.rng.randrange(3, self.vocab))
            if len(entry[0]) >= min(self.max_seq - 1, entry[3] + self.decodes):
                self.free.extend(entry[2])
                del self.live[s.seq_id]


def check_padding(model: Path, device: str, steps: int) -> tuple[bool, list[str]]:
    """Run ``steps`` steps of a `RandomSchedule` on ``model`` (bf16) three ways (module docstring);
    returns (all padded steps equal one GPU's, report lines)."""
    from kvpilot.config import KvCacheConfig
    from kvpilot.model.config import ModelConfig
    from kvpilot.runner.cuda_graphs import PrefillGraphs
    from kvpilot.runner.model_runner import ModelRunner, prefill_padding

    max_bs, max_seq = 4, 1024
    runner = ModelRunner(model, ModelConfig.from_dir(model), KvCacheConfig(tokens_per_block=BLOCK, max_tokens=4 * max_seq),
                         max_num_tokens=1024, max_batch_size=max_bs, max_seq_len=max_seq, device=device,
                         dtype="bfloat16")
    pg = runner.prefill_graphs
    if device == "cpu":  # dry run: the CPU double of the prefill graphs (tests/support/graphs.py)
        sys.path.insert(0, str(HERE.parent / "tests"))
        from support.graphs import cpu_graph_class

        pg = cpu_graph_class(PrefillGraphs)(runner)
        pg.capture()
    if pg is None:
        return False, ["FAIL: no prefill graphs were captured (see the warnings above)"]
    buckets = list(pg.token_buckets)
    width = runner.max_blocks_per_seq
    sched = RandomSchedule(runner.num_blocks, width, max_bs, BLOCK, max_seq, 30000, 600,
                           [16, 48, 100, 200, 256, 400, 700], decodes=4, logprobs=0.08, seed=11)
    times = {k: {m: [] for m in ("graph", "padded", "unpadded")} for k in ("graphed", "eager")}
    counts = {"graphed": 0, "eager": 0, "decode": 0, "unpadded_differs": 0}
    lines, ok = [], True
    for step in range(steps):
        plan = sched.plan()
        if not plan:
            continue
        if max(len(s.token_ids) for s in plan) <= 1:  # decode-only: the decode graphs, one way
            _run(runner, plan, "graph", pg, buckets, device)
            counts["decode"] += 1
            sched.advance(plan)
            continue
        kind = "graphed" if prefill_padding(plan, buckets, max_bs, width) is not None else "eager"
        counts[kind] += 1
        # The unpadded run first: the two others then overwrite its KV writes of this step.
        u, u_rows, tu = _run(runner, plan, "unpadded", pg, buckets, device)
        p, p_rows, tp = _run(runner, plan, "padded", pg, buckets, device)
        kv_p = [c.clone() for c in runner.kv_caches]
        g, g_rows, tg = _run(runner, plan, "graph", pg, buckets, device)
        for m, t in (("graph", tg), ("padded", tp), ("unpadded", tu)):
            times[kind][m].append(t * 1e3)
        counts["unpadded_differs"] += not torch.equal(u, g)
        if p_rows != g_rows or not torch.equal(p, g):
            diff = float((p - g).abs().max()) if p.shape == g.shape else float("nan")
            lines.append(f"FAIL: step {step} ({kind}, {sum(len(s.token_ids) for s in plan)} tokens, "
                         f"{len(plan)} sequences): padded eager logits differ from one GPU's (max {diff:.3g})")
            ok = False
        if not all(torch.equal(a, b) for a, b in zip(kv_p, runner.kv_caches)):
            lines.append(f"FAIL: step {step} ({kind}): padded eager left another KV cache than one GPU's step")
            ok = False
        sched.advance(plan)
    lines.insert(0, f"steps: {counts['graphed']} one GPU graphs, {counts['eager']} one GPU runs eagerly, "
                    f"{counts['decode']} decode-only; unpadded eager differs from one GPU on "
                    f"{counts['unpadded_differs']} of {counts['graphed'] + counts['eager']}")
    lines.insert(1, "| steps | n | graph ms | padded eager ms | unpadded eager ms |")
    lines.insert(2, "|---|---:|---:|---:|---:|")
    for i, kind in enumerate(("graphed", "eager")):
        t = times[kind]
        if t["graph"]:
            lines.insert(3 + i, f"| {kind} on one GPU | {len(t['graph'])} | {statistics.median(t['graph']):.2f} | "
                                f"{statistics.median(t['padded']):.2f} | {statistics.median(t['unpadded']):.2f} |")
    if counts["graphed"] < 5 or counts["eager"] < 2:
        lines.append(f"FAIL: the schedule did not exercise both kinds of step: {counts}")
        ok = False
    return ok, lines


def check_out_dtype(device: str) -> tuple[bool, list[str]]:
    """``out_dtype=torch.float32`` of the GEMV dispatchers past the Triton rows (cuBLAS), fp16 and bf16,
    against float64; returns (all within tolerance, report lines)."""
    from kvpilot.kernels import gemv as G
    from kvpilot.kernels import silu_and_mul_ref

    ok, lines = True, []
    g = torch.Generator(device=device).manual_seed(5)
    m, k, n = G.MAX_TRITON_ROWS + 8, 1792, 4096  # past the Triton GEMV: torch.mm(..., out_dtype)
    dtypes = (torch.float16, torch.bfloat16) if device == "cuda" else (torch.bfloat16,)
    for dt in dtypes:
        rnd = lambda *s: torch.randn(*s, device=device, generator=g).to(dt)  # noqa: E731
        x, w, b, gu = rnd(m, k), rnd(n, k) / k**0.5, rnd(n), rnd(m, 2 * k)
        for name, got, want in (
            ("gemv", G.gemv(x, w, b, out_dtype=torch.float32), torch.nn.functional.linear(x.double(), w.double(), b.double())),
            ("silu_mul_gemv", G.silu_mul_gemv(gu, w, b, out_dtype=torch.float32),
             torch.nn.functional.linear(silu_and_mul_ref(gu).double(), w.double(), b.double())),
        ):
            err = float((got.double() - want).norm() / want.norm())
            # silu_mul_gemv: above the Triton GEMV's rows the activation comes from the Triton
            # silu_and_mul, a rare bf16 ulp apart from the reference's (test_gemv_out_dtype.py)
            good = got.dtype == torch.float32 and err < (1e-5 if name == "gemv" else 1e-3)
            lines.append(f"{'ok  ' if good else 'FAIL'} {name} {dt} M={m} out_dtype=float32: {got.dtype}, rel err {err:.1e}")
            ok &= good
    return ok, lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the 8B shape")
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("FAIL: no CUDA device")
        return 1
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        shape = dict(LLAMA31_8B, num_hidden_layers=args.layers, max_position_embeddings=8192) if args.device == "cuda" \
            else dict(TINY, vocab_size=32000)
        model = write_random_llama(Path(tmp) / "m", shape, device=args.device, std=0.05)
        ok1, lines1 = check_padding(model, args.device, args.steps)
    ok2, lines2 = check_out_dtype(args.device)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{name}: 8B shape, {args.layers} layers, bf16" if args.device == "cuda" else "cpu dry run (TINY shape)")
    print("\n".join(lines1 + lines2))
    ok = ok1 and ok2
    print(f"{'OK' if ok else 'FAILED'} in {time.perf_counter() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
