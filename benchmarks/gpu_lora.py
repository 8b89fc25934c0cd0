"""LoRA on one GPU: the batched shrink/expand kernels per projection, and decode with many adapters.

Usage (one GPU, after ``pip install -e .``):

    python3 benchmarks/gpu_lora.py [--rank 16] [--adapters 8] [--tokens 1,64,1024,8192] [--json PATH]
    python3 benchmarks/gpu_lora.py --model [--model-layers 32] [--steps 128]
    python3 benchmarks/gpu_lora.py --dry-run [--model]   # CPU, tiny shapes (kernels under TRITON_INTERPRET=1)

Kernels: the four projections of Llama-3.1-8B's layer shape (qkv 4096 -> 6144 in 3 parts,
o 4096 -> 4096, gate/up 4096 -> 2 x 14336, down 14336 -> 4096), ``--adapters`` slots of rank
``--rank`` (`kvpilot.lora.layers.LoRAProjection`'s layout), random bf16 weights. Per token count
``T``, the tokens go round-robin over ``min(T, adapters)`` adapters. For each projection the
script reports:

- the time of `kvpilot.kernels.lora.lora_apply_triton` (slot tiles built once, as the engine does
  per step) and of the PyTorch reference `lora_apply_ref`, over CUDA events;
- the bytes moved: the distinct adapters' ``a`` and ``b`` read once, ``x`` read, ``out`` read
  and written. Divided by the kernels' time, that gives their achieved bandwidth, set against the
  measured device-to-device copy bandwidth.

``--model``: a random-weight Llama-3.1-8B-shaped checkpoint (``--model-layers`` layers) and
``--adapters`` random rank-``--rank`` PEFT adapters on all seven projections. The script measures
decode time per step at batch 1 and batch 64 through `kvpilot.LLM` in three cases:

- ``base``: no ``lora_config``;
- ``lora-off``: ``lora_config`` set, but no request uses an adapter (CUDA graphs);
- ``lora-8``: every request uses an adapter, round-robin.

The decode time per step is the difference of two runs (``--steps`` and ``2 * --steps``
generated tokens) divided by ``--steps``, so prefill is excluded. The issue's targets are
``lora-8`` within 15% of ``base`` at batch 64 and within 10% at batch 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

LLAMA_LAYER = {"hidden": 4096, "q": 4096, "kv": 1024, "inter": 14336}
TINY_LAYER = {"hidden": 64, "q": 64, "kv": 32, "inter": 160}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--tokens", default="1,64,1024,8192", help="comma-separated token counts")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton interpreter")
    p.add_argument("--model", action="store_true", help="whole-model decode instead of the kernels")
    p.add_argument("--model-layers", type=int, default=32)
    p.add_argument("--steps", type=int, default=128)
    return p.parse_args(argv)


def copy_bandwidth(torch, device: str, numel: int) -> float:
    """Bytes per second of a device-to-device copy (read + write)."""
    src = torch.empty(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(torch, device)
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync(torch, device)
    return 2 * numel * 4 * 10 / (time.perf_counter() - t0)


def sync(torch, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(torch, device: str, fn, iters: int) -> float:
    """Seconds per call of ``fn`` (CUDA events on the GPU, wall clock on CPU), after one warm-up call."""
    fn()
    sync(torch, device)
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def run_kernels(args, device: str) -> dict:
    import torch

    from kvpilot.kernels.lora import lora_apply_ref, lora_apply_triton, lora_tiles

    dims = TINY_LAYER if args.dry_run else LLAMA_LAYER
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    h, q, kv, inter = dims["hidden"], dims["q"], dims["kv"], dims["inter"]
    shapes = {"qkv_proj": (h, q + 2 * kv, 3), "o_proj": (q, h, 1), "gate_up_proj": (h, 2 * inter, 2),
              "down_proj": (inter, h, 1)}
    S, R = args.adapters, args.rank
    bw = copy_bandwidth(torch, device, 1 << (16 if args.dry_run else 28))
    tokens = [int(t) for t in args.tokens.split(",")] if not args.dry_run else [1, 5, 40]
    iters = 2 if args.dry_run else args.iters
    results = {"copy_bandwidth_GBps": bw / 1e9, "rank": R, "adapters": S, "dtype": str(dtype), "rows": []}
    torch.manual_seed(0)
    for name, (K, N, parts) in shapes.items():
        a = (torch.randn(S, parts * R, K, device=device) * 0.02).to(dtype)
        b = (torch.randn(S, N, parts * R, device=device) * 0.02).to(dtype)
        for T in tokens:
            used = min(T, S)
            slot_host = [t % used for t in range(T)]
            slot = torch.tensor(slot_host, dtype=torch.int32, device=device)
            x = torch.randn(T, K, device=device).to(dtype)
            out = torch.zeros(T, N, device=device, dtype=dtype)
            tiles = lora_tiles(slot_host, torch.device(device))
            t_tri = timed(torch, device, lambda: lora_apply_triton(x, out, a, b, slot, tiles=tiles), iters)
            t_ref = timed(torch, device, lambda: lora_apply_ref(x, out, a, b, slot, list(range(used))), iters)
            el = a.element_size()
            moved = used * (a[0].numel() + b[0].numel()) * el + x.numel() * el + 2 * out.numel() * el
            want = lora_apply_ref(x, torch.zeros_like(out), a, b, slot, list(range(used))).float()
            got = lora_apply_triton(x, torch.zeros_like(out), a, b, slot, tiles=tiles).float()
            row = {"projection": name, "tokens": T, "adapters_used": used, "triton_us": t_tri * 1e6,
                   "reference_us": t_ref * 1e6, "bytes": moved, "achieved_GBps": moved / t_tri / 1e9,
                   "share_of_copy_bw": moved / t_tri / bw, "max_abs_diff": float((got - want).abs().max())}
            results["rows"].append(row)
            print(f"{name:13s} T={T:5d} adapters={used}: triton {row['triton_us']:8.1f} us "
                  f"({row['achieved_GBps']:6.1f} GB/s, {100 * row['share_of_copy_bw']:5.1f}% of copy), "
                  f"reference {row['reference_us']:8.1f} us, max|diff| {row['max_abs_diff']:.2e}")
    return results


def write_adapter(path: Path, cfg: dict, rank: int, seed: int) -> None:
    """A random PEFT LoRA adapter (all seven projections, rank ``rank``, alpha ``2 * rank``)."""
    import torch
    from safetensors.torch import save_file

    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
              "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter),
              "mlp.down_proj": (inter, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        for mod, (k, n) in shapes.items():
            base = f"base_model.model.model.layers.{i}.{mod}"
            tensors[f"{base}.lora_A.weight"] = (torch.randn(rank, k, generator=g) * 0.01).to(torch.bfloat16)
            tensors[f"{base}.lora_B.weight"] = (torch.randn(n, rank, generator=g) * 0.01).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": sorted(m.split(".")[1] for m in shapes)}))


def run_model(args, device: str) -> dict:
    from kvpilot import LLM, KvCacheConfig, SamplingParams
    from kvpilot.executor import LoRARequest
    from kvpilot.llmapi import LoraConfig
    from kvpilot.tools.random_model import LLAMA31_8B, TINY, write_random_llama

    cfg = dict(TINY if args.dry_run else LLAMA31_8B)
    cfg["num_hidden_layers"] = 2 if args.dry_run else args.model_layers
    steps = 4 if args.dry_run else args.steps
    results = {"layers": cfg["num_hidden_layers"], "rank": args.rank, "adapters": args.adapters, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        model = write_random_llama(Path(tmp) / "model", cfg, device=device)
        adapters = []
        for i in range(args.adapters):
            write_adapter(Path(tmp) / f"lora{i}", cfg, args.rank, seed=i)
            adapters.append(LoRARequest(f"lora{i}", i + 1, str(Path(tmp) / f"lora{i}")))
        kw = dict(skip_tokenizer_init=True, device=device, max_batch_size=64, max_num_tokens=8192,
                  max_seq_len=1024, kv_cache_config=KvCacheConfig(max_tokens=64 * 1024))
        for case in ("base", "lora-off", f"lora-{args.adapters}"):
            lora_cfg = None if case == "base" else LoraConfig(max_loras=args.adapters, max_lora_rank=args.rank)
            with LLM(str(model), lora_config=lora_cfg, **kw) as llm:
                for batch in (1, 64):
                    prompts = [[1 + (7 * j + k) % 1000 for k in range(16)] for j in range(batch)]
                    loras = [adapters[j % len(adapters)] for j in range(batch)] if case.startswith("lora-") and \
                        case != "lora-off" else None

                    def run(n):
                        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                        t0 = time.perf_counter()
                        llm.generate(prompts, sp, use_tqdm=False, lora_request=loras)
                        return time.perf_counter() - t0

                    run(steps)  # warm-up: compiles, first adapter loads
                    per_step = (run(2 * steps) - run(steps)) / steps
                    row = {"case": case, "batch": batch, "decode_ms_per_step": per_step * 1e3}
                    results["rows"].append(row)
                    print(f"{case:9s} batch {batch:3d}: {per_step * 1e3:7.2f} ms per decode step")
    base = {r["batch"]: r["decode_ms_per_step"] for r in results["rows"] if r["case"] == "base"}
    for r in results["rows"]:
        r["vs_base"] = r["decode_ms_per_step"] / base[r["batch"]] - 1
    for r in results["rows"]:
        if r["case"] != "base":
            print(f"{r['case']:9s} batch {r['batch']:3d}: {100 * r['vs_base']:+.1f}% vs base")
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU: use --dry-run on CPU", file=sys.stderr)
        return 2
    results = run_model(args, device) if args.model else run_kernels(args, device)
    results["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
