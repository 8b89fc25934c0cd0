"""Where a batch-1 decode step's GPU time goes: per-kernel profile and ITL against context length.

Builds a `ModelRunner` of Llama-3.1-8B's shape with random bf16 weights drawn on the GPU (no
checkpoint is written: only ``config.json``; the weights' values do not change speed), then

1. times one CUDA-graph decode step (argmax read back, as the sampler does) at batch 1 for several
   context lengths, next to the bandwidth floor (weights read + KV read) / measured copy rate;
2. profiles one eager step and one graph replay with `torch.profiler` and prints the kernels that
   take the time (per step, summed over layers), at a short and a long context;
3. times the decode attention kernel alone on the runner's own caches and block tables.

    python3 benchmarks/lab/gpu_decode_profile.py [--layers 32] [--contexts 128 4096 32768]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvpilot.tools.random_model import LLAMA31_8B  # noqa: E402


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy of 2 GiB (read + write counted)."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * n * 10 / (time.perf_counter() - t)


def build_runner(layers: int, max_seq_len: int, max_batch_size: int, kv_dtype: str = "auto",
                 free_gpu_memory_fraction: float = 0.5, tuning=None):
    """A `ModelRunner` of Llama-3.1-8B's shape (``layers`` layers) with random weights on the GPU;
    ``tuning``: its `kvpilot.tuning.Tuning` (default: the defaults)."""
    from transformers import LlamaConfig

    import kvpilot.runner.model_runner as mr
    from kvpilot import KvCacheConfig
    from kvpilot.model.config import ModelConfig

    path = Path("/tmp/kvpilot-profile-model")
    path.mkdir(exist_ok=True)
    cfg = dict(LLAMA31_8B, num_hidden_layers=layers)
    c = LlamaConfig(**cfg)
    c.architectures = ["LlamaForCausalLM"]
    c.dtype = "bfloat16"
    c.to_json_file(str(path / "config.json"))

    def random_weights(model, _dir):
        g = torch.Generator(device="cuda").manual_seed(0)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.data.fill_(1.0)
            else:
                p.data.copy_(torch.randn(p.shape, generator=g, device="cuda", dtype=torch.float32) * 0.02)

    mr.load_weights = random_weights
    mcfg = ModelConfig.from_dir(path)
    kv = KvCacheConfig(free_gpu_memory_fraction=free_gpu_memory_fraction, dtype=kv_dtype)
    return mr.ModelRunner(path, mcfg, kv, max_num_tokens=8192,
                          max_batch_size=max_batch_size, max_seq_len=max_seq_len, device="cuda", dtype="bfloat16",
                          tuning=tuning)


def decode_seqs(runner, b: int, ctx: int, scatter: bool):
    """``b`` one-token decodes at context ``ctx``; blocks consecutive or scattered over the pool."""
    from kvpilot.runner.model_runner import ScheduledSeq

    nb = -(-ctx // runner.block_size)
    g = torch.Generator().manual_seed(ctx)
    ids = torch.randperm(runner.num_blocks, generator=g)[: b * nb].tolist() if scatter else list(range(b * nb))
    return [ScheduledSeq(-1 - i, [5], ctx - 1, ids[i * nb:(i + 1) * nb], True) for i in range(b)]


def step_ms(runner, seqs, iters: int = 20) -> float:
    for _ in range(3):
        runner.execute(seqs)[0].argmax(-1).tolist()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        runner.execute(seqs)[0].argmax(-1).tolist()
    return (time.perf_counter() - t) / iters * 1e3


def kernel_table(runner, seqs, label: str, top: int = 24) -> None:
    from torch.profiler import ProfilerActivity, profile

    runner.execute(seqs)[0].argmax(-1).tolist()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            runner.execute(seqs)[0].argmax(-1).tolist()
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type.name == "CUDA":
            per[e.name][0] += e.device_time_total / 3
            per[e.name][1] += 1
    total = sum(v[0] for v in per.values())
    print(f"\n{label}: {total / 1e3:.3f} ms of kernel time per step, {sum(v[1] for v in per.values()) // 3} kernels")
    print("| kernel | us/step | launches/step |")
    print("|---|---:|---:|")
    for name, (us, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"| {name[:90]} | {us:.1f} | {n // 3} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096, 8192, 16384, 32768])
    ap.add_argument("--max-seq-len", type=int, default=33024)
    args = ap.parse_args()

    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.3f} TB/s")
    t = time.perf_counter()
    runner = build_runner(args.layers, args.max_seq_len, max_batch_size=8)
    print(f"runner: {args.layers} layers, {runner.weight_bytes / 1e9:.2f} GB, {runner.num_blocks} blocks, "
          f"graphs {len(runner.graphs.graphs) if runner.graphs else 0}, built in {time.perf_counter() - t:.1f} s")
    for cache in runner.kv_caches:
        cache.normal_()
    cfg = runner.cfg
    embed = cfg.vocab_size * cfg.hidden_size * 2
    per_tok = runner.bytes_per_block // runner.block_size

    print("\n| context | blocks | graph ms | eager ms | floor ms | graph % of floor speed |")
    print("|---:|---|---:|---:|---:|---:|")
    for ctx in args.contexts:
        for scatter in (False, True):
            seqs = decode_seqs(runner, 1, ctx, scatter)
            g = step_ms(runner, seqs)
            saved, runner.graphs = runner.graphs, None
            e = step_ms(runner, seqs, iters=5)
            runner.graphs = saved
            floor = (runner.weight_bytes - embed + per_tok * ctx) / bw * 1e3
            print(f"| {ctx} | {'scattered' if scatter else 'consecutive'} | {g:.3f} | {e:.3f} | {floor:.3f} | "
                  f"{100 * floor / g:.1f}% |", flush=True)

    for ctx in (512, args.contexts[-1]):
        seqs = decode_seqs(runner, 1, ctx, True)
        kernel_table(runner, seqs, f"graph replay, batch 1, context {ctx}")
        saved, runner.graphs = runner.graphs, None
        kernel_table(runner, seqs, f"eager, batch 1, context {ctx}")
        runner.graphs = saved

    # The attention kernel alone, on layer 0's cache, with the same sequences.
    import triton.testing

    from kvpilot.kernels import paged_attention_triton

    print("\n| attention alone: context | max_seq_len arg | ms | % of copy bandwidth |")
    print("|---:|---:|---:|---:|")
    kv = runner.kv_caches[0]
    H, D = cfg.num_attention_heads, cfg.head_dim
    for ctx in args.contexts:
        seqs = decode_seqs(runner, 1, ctx, True)
        _, _, meta, _ = runner.prepare(seqs)
        q = torch.randn(1, H, D, dtype=torch.bfloat16, device="cuda")
        for bound in (ctx, args.max_seq_len):
            ms = triton.testing.do_bench(lambda: paged_attention_triton(
                q, kv[0], kv[1], meta.block_tables, meta.seq_lens, meta.query_start_loc, D ** -0.5, 1, bound))
            print(f"| {ctx} | {bound} | {ms:.4f} | {100 * per_tok / args.layers * ctx / (ms / 1e3) / bw:.1f}% |")


if __name__ == "__main__":
    main()
