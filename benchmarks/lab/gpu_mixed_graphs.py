"""Eager vs CUDA-graph step times for prefill and mixed steps, Llama-3.1-8B-shaped random bf16 model.

Builds a `ModelRunner` (decode and prefill graphs captured as in the engine) on a random checkpoint
of the 8B shape with ``--layers`` decoder layers (default 8 to keep the run short; ``--layers 32``
is the whole model), fills the KV pool with random values (so cached prefixes are attended), and
times one step, host preparation to the sampled token ids on the host (as the sampler does), for:

- ``prefill64_ctx4000``: 64 new tokens on a 4,000-token cached prefix, batch 1 (TTFT with a cached prefix);
- ``mixed512+63``: one 512-token prefill chunk plus 63 decodes at 1,000 tokens of context;
- ``prefill256``: a 256-token prompt.

Each case is run eagerly (``runner.prefill_graphs = None``) and from the graph. Two checks, either
failing exits 1:

- the graph's logits equal those of the same padded forward run eagerly on the graph's static
  buffers (``padded err``, expected 0: capture and replay change nothing);
- they agree with the plain eager step (``rel err``, relative Frobenius norm < 2e-2 in bf16). The
  padded token count changes the matmul shapes, and cuBLAS may pick another algorithm for them;
  through 32 random layers that rounding grew to 3.2e-2 for 575 vs 576 tokens on an H200 (58 of
  64 argmaxes equal), so this check is meant for the default 8 layers.

It also prints the graphs' capture count and time, and the GPU time of each graph replay (CUDA
events), i.e. what is left once launch overhead is gone.

The engine captures prefill graphs up to 256 tokens by default (`default_token_buckets` says
why); this script raises the cap to 1,024 (``--prefill-graph-tokens``, `Tuning.prefill_graph_tokens`) so that the
575-token mixed case has a graph to compare.

    python3 benchmarks/lab/gpu_mixed_graphs.py [--layers 8] [--iters 20] [--out $OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvpilot.tools.random_model import LLAMA31_8B, write_random_llama  # noqa: E402

TOL = 2e-2


def make_seqs(specs, block: int):
    """(tokens, start position) pairs -> ScheduledSeqs on disjoint fresh blocks, all sampling."""
    from kvpilot.runner.model_runner import ScheduledSeq

    seqs, nxt = [], 0
    for i, (n, start) in enumerate(specs):
        nb = -(-(start + n) // block)
        toks = torch.randint(3, 128000, (n,), generator=torch.Generator().manual_seed(i)).tolist()
        seqs.append(ScheduledSeq(i, toks, start, list(range(nxt, nxt + nb)), True))
        nxt += nb
    return seqs


def step_ms(runner, seqs, iters: int) -> list[float]:
    """Wall ms per step: execute, then read the argmax ids back (the per-step sync of the sampler)."""
    for _ in range(3):
        runner.execute(seqs)[0].argmax(-1).tolist()
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        runner.execute(seqs)[0].argmax(-1).tolist()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def replay_gpu_ms(pg, T: int, iters: int) -> float:
    """GPU ms of one replay of bucket ``T`` (inputs as left by the last step)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    pg.graphs[T].replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        pg.graphs[T].replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


@torch.inference_mode()
def padded_eager_logits(runner, pg, seqs) -> torch.Tensor:
    """The graph's computation without the graph: its body run eagerly on the static buffers."""
    T, _, rows = pg.prepare(seqs)
    pg._dev.copy_(pg._host)
    pg._body(T)
    idx = torch.tensor(rows, device=runner.device)
    return runner.model.compute_logits(pg.hidden.index_select(0, idx))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of the 8B shape (32 = the whole model)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--model-dir", default=None, help="default /tmp/kvpilot-llama8b-random[-L<layers>]")
    ap.add_argument("--out", default=None, help="folder for the JSON result")
    ap.add_argument("--prefill-graph-tokens", type=int, default=1024, help="Tuning.prefill_graph_tokens (default 1024)")
    args = ap.parse_args()

    from kvpilot.config import KvCacheConfig
    from kvpilot.tuning import Tuning
    from kvpilot.model.config import ModelConfig
    from kvpilot.runner.model_runner import ModelRunner

    cfg = dict(LLAMA31_8B, num_hidden_layers=args.layers)
    path = Path(args.model_dir or "/tmp/kvpilot-llama8b-random" + ("" if args.layers == 32 else f"-L{args.layers}"))
    if not (path / "config.json").exists():
        write_random_llama(path, cfg, dtype=torch.bfloat16, device="cuda")
    t0 = time.perf_counter()
    runner = ModelRunner(path, ModelConfig.from_dir(path), KvCacheConfig(max_tokens=262144), max_num_tokens=8192,
                         max_batch_size=256, max_seq_len=8192, device="cuda", dtype="bfloat16",
                         tuning=Tuning(prefill_graph_tokens=args.prefill_graph_tokens))
    load_s = time.perf_counter() - t0
    pg, dg = runner.prefill_graphs, runner.graphs
    if pg is None or dg is None:
        print("FAIL: graphs were not captured (see the warnings above)")
        return 1
    torch.manual_seed(0)
    for cache in runner.kv_caches:
        cache.normal_()
    result = {
        "device": torch.cuda.get_device_name(), "layers": args.layers, "runner_init_s": load_s,
        "prefill_graphs": len(pg.graphs), "prefill_capture_s": pg.capture_seconds,
        "prefill_buckets": pg.token_buckets, "decode_graphs": len(dg.graphs), "decode_capture_s": dg.capture_seconds,
        "cases": {},
    }
    cases = {
        "prefill64_ctx4000": [(64, 4000)],
        "mixed512+63": [(512, 0)] + [(1, 1000)] * 63,
        "prefill256": [(256, 0)],
    }
    ok = True
    print(f"{torch.cuda.get_device_name()}, 8B shape with {args.layers} layers, bf16; "
          f"{len(pg.graphs)} prefill graphs ({pg.token_buckets[0]}..{pg.max_tokens} tokens) in "
          f"{pg.capture_seconds:.1f} s, {len(dg.graphs)} decode graphs in {dg.capture_seconds:.1f} s")
    print("| case | tokens (bucket) | eager ms | graph ms | speed-up | graph replay GPU ms "
          "| eager-graph per layer ms | padded err | rel err | argmax agree |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, spec in cases.items():
        seqs = make_seqs(spec, runner.block_size)
        if not pg.can_run(seqs):
            print(f"FAIL: {name} does not fit the prefill graphs")
            ok = False
            continue
        tokens = sum(n for n, _ in spec)
        bucket = next(t for t in pg.token_buckets if t >= tokens)
        graph_logits = runner.execute(seqs)[0].clone()
        graph = step_ms(runner, seqs, args.iters)
        gpu = replay_gpu_ms(pg, bucket, args.iters)
        runner.prefill_graphs = None
        eager_logits = runner.execute(seqs)[0].clone()
        eager = step_ms(runner, seqs, args.iters)
        runner.prefill_graphs = pg
        padded = padded_eager_logits(runner, pg, seqs)
        padded_err = float((graph_logits - padded).norm() / padded.norm())
        err = float((graph_logits - eager_logits).norm() / eager_logits.norm())
        same_argmax = float((graph_logits.argmax(-1) == eager_logits.argmax(-1)).float().mean())
        e, g = statistics.median(eager), statistics.median(graph)
        result["cases"][name] = dict(tokens=tokens, bucket=bucket, eager_ms=e, graph_ms=g, speedup=e / g,
                                     graph_replay_gpu_ms=gpu, padded_err=padded_err, rel_err=err,
                                     argmax_agree=same_argmax,
                                     eager_all_ms=eager, graph_all_ms=graph)
        print(f"| {name} | {tokens} ({bucket}) | {e:.2f} | {g:.2f} | {e / g:.2f}x | {gpu:.2f} | "
              f"{(e - g) / args.layers:.3f} | {padded_err:.1e} | {err:.1e} | {same_argmax:.0%} |")
        if not padded_err < 1e-3:
            print(f"FAIL: {name}: graph replay differs from its eager padded forward (rel err {padded_err:.3g})")
            ok = False
        if not err < TOL:
            print(f"FAIL: {name}: graph logits differ from eager (rel err {err:.3g} >= {TOL})")
            ok = False
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "mixed_graphs.json").write_text(json.dumps(result, indent=1))
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
