"""The fused Triton MoE kernels against the PyTorch reference, on Qwen3-30B-A3B's MoE layer shape.

Usage (one GPU, after ``pip install -e .``):

    python3 benchmarks/gpu_moe.py [--layers 4] [--tokens 1,64,1024] [--prefill 8192] [--json PATH]
    python3 benchmarks/gpu_moe.py --model [--model-layers 4] [--requests 1000] [--ref-requests 100]
    python3 benchmarks/gpu_moe.py --dry-run [--model]   # CPU, tiny shapes, kernels under TRITON_INTERPRET=1

Model: ``--layers`` MoE layers of Qwen3-30B-A3B's shape (hidden 2048, 128 experts of intermediate
768, top 8, renormalised) with random bf16 weights, each layer its own weights (1.2 GB per layer,
so one layer's experts are not in L2 when the next runs). Routing: random router logits through
`kvpilot.kernels.moe.select_experts`, fixed per token count.

Per token count ``T`` (``--tokens``, plus ``--prefill``): the experts' time per layer (routing
excluded) of ``fused_moe_triton`` (``path="auto"``: the small-token path up to 8 tokens, the grouped
GEMM above) and of ``fused_moe_ref`` (loop over experts), CUDA events over all layers in turn;
the bandwidth floor: bytes of the distinct experts the tokens chose (3 * I * H * 2 bytes each)
over the measured device-to-device copy bandwidth, and the kernels' share of it; the grouped
GEMM's TFLOP/s (``2 * T * K * 3 * I * H`` flops) against ``torch.mm``'s on a dense bf16
``[T*K, 2048] x [2048, 1536]`` product; and the largest |difference| between the two outputs.

``--model`` (instead): a whole Qwen3-30B-A3B-shaped model with ``--model-layers`` layers (attention
32 query / 4 KV heads of 128, q/k norm; vocabulary 151,936) and random bf16 weights, written as a
checkpoint and run through `kvpilot.LLM` with ``MoeConfig(backend="TRITON")`` and ``"TORCH"``:
batch-1 decode time per token (one 16-token prompt, 256 tokens, CUDA graphs) against its
bandwidth floor (bytes of the attention weights, the router and the 8 chosen experts of every
layer, the final norm and LM head, per token, over the copy bandwidth), and offline throughput of
``--requests`` (Triton) / ``--ref-requests`` (reference) random 1,024-token prompts x 1,024
generated tokens (output tokens per second).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", default="1,64,1024", help="comma-separated token counts")
    p.add_argument("--prefill", type=int, default=8192, help="one more token count, fused only (0: none)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton interpreter")
    p.add_argument("--model", action="store_true", help="whole-model decode and offline throughput instead")
    p.add_argument("--model-layers", type=int, default=4)
    p.add_argument("--requests", type=int, default=1000, help="offline requests, Triton backend")
    p.add_argument("--ref-requests", type=int, default=100, help="offline requests, reference backend")
    return p.parse_args(argv)


def copy_bandwidth(torch, device: str, numel: int) -> float:
    """Bytes per second of a device-to-device copy (read + write)."""
    src = torch.empty(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * numel * 4 * 10 / (time.perf_counter() - t0)


def write_checkpoint(path: Path, dims: dict, dtype, device: str) -> dict:
    """A random-weight Qwen3-MoE checkpoint (safetensors, per-expert names) at ``path``; returns the
    per-token decode bytes ``{"attention", "router", "experts", "head"}`` (weights read per token)."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(**dims, norm_topk_prob=True, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         architectures=["Qwen3MoeForCausalLM"])
    cfg.save_pretrained(str(path))
    h, i, e, hd = dims["hidden_size"], dims["moe_intermediate_size"], dims["num_experts"], dims["head_dim"]
    q, kv = dims["num_attention_heads"] * hd, dims["num_key_value_heads"] * hd
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, device=device, generator=g) * 0.02).to(dtype).cpu()

    tensors = {"model.embed_tokens.weight": rnd(dims["vocab_size"], h), "lm_head.weight": rnd(dims["vocab_size"], h),
               "model.norm.weight": torch.ones(h, dtype=dtype)}
    for layer in range(dims["num_hidden_layers"]):
        pre = f"model.layers.{layer}."
        tensors.update({pre + "input_layernorm.weight": torch.ones(h, dtype=dtype),
                        pre + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
                        pre + "self_attn.q_proj.weight": rnd(q, h), pre + "self_attn.k_proj.weight": rnd(kv, h),
                        pre + "self_attn.v_proj.weight": rnd(kv, h), pre + "self_attn.o_proj.weight": rnd(h, q),
                        pre + "self_attn.q_norm.weight": torch.ones(hd, dtype=dtype),
                        pre + "self_attn.k_norm.weight": torch.ones(hd, dtype=dtype),
                        pre + "mlp.gate.weight": rnd(e, h)})
        for x in range(e):
            tensors.update({pre + f"mlp.experts.{x}.gate_proj.weight": rnd(i, h),
                            pre + f"mlp.experts.{x}.up_proj.weight": rnd(i, h),
                            pre + f"mlp.experts.{x}.down_proj.weight": rnd(h, i)})
    save_file(tensors, str(path / "model.safetensors"))
    elt = torch.tensor([], dtype=dtype).element_size()
    layers = dims["num_hidden_layers"]
    return {"attention": layers * (2 * q * h + 2 * kv * h) * elt, "router": layers * e * h * elt,
            "experts": layers * dims["num_experts_per_tok"] * 3 * i * h * elt, "head": dims["vocab_size"] * h * elt}


def run_model(args) -> int:
    """The ``--model`` section (module docstring)."""
    import tempfile

    import torch

    from kvpilot.llmapi import LLM, MoeConfig, SamplingParams

    if args.dry_run:
        device, dtype = "cpu", torch.float32
        dims = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                    num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, max_position_embeddings=256)
        prompt_len, out_len, requests, ref_requests, decode_len = 16, 16, 4, 2, 8
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA GPU (or --dry-run)", file=sys.stderr)
            return 2
        device, dtype = "cuda", torch.bfloat16
        dims = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                    num_experts=128, num_experts_per_tok=8, num_hidden_layers=args.model_layers,
                    num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=4096)
        prompt_len, out_len, requests, ref_requests, decode_len = 1024, 1024, args.requests, args.ref_requests, 256
    bandwidth = copy_bandwidth(torch, device, 2 ** 20 if args.dry_run else 256 * 2 ** 20)
    results = {"dims": dims, "copy_bandwidth_GBps": bandwidth / 1e9, "backends": {}}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "qwen3-moe"
        path.mkdir()
        decode_bytes = write_checkpoint(path, dims, dtype, device)
        floor_s = sum(decode_bytes.values()) / bandwidth
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, dims["vocab_size"], (prompt_len,), generator=g).tolist()
                   for _ in range(max(requests, ref_requests))]
        print(f"{dims['num_hidden_layers']} layers; decode bytes per token {sum(decode_bytes.values()) / 1e6:.1f} MB "
              f"({', '.join(f'{k} {v / 1e6:.1f}' for k, v in decode_bytes.items())}); copy bandwidth "
              f"{bandwidth / 1e9:.0f} GB/s; floor {floor_s * 1e6:.1f} us/token")
        for backend, n in (("TRITON", requests), ("TORCH", ref_requests)):
            with LLM(str(path), device=device, skip_tokenizer_init=True, max_seq_len=prompt_len + out_len + 8,
                     moe_config=MoeConfig(backend=backend)) as llm:
                def single(tokens: int) -> float:
                    t0 = time.perf_counter()
                    llm.generate([prompts[0][:16]], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True),
                                 use_tqdm=False)
                    return time.perf_counter() - t0

                single(decode_len)  # warm-up (kernels compiled, graphs replayed once)
                itl = (single(decode_len) - single(1)) / (decode_len - 1)
                params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
                t0 = time.perf_counter()
                outs = llm.generate(prompts[:n], params, use_tqdm=False)
                elapsed = time.perf_counter() - t0
                generated = sum(len(o.outputs[0].token_ids) for o in outs)
            row = dict(decode_us_per_token=itl * 1e6, floor_fraction=floor_s / itl, requests=n,
                       output_tokens_per_s=generated / elapsed, seconds=elapsed)
            results["backends"][backend] = row
            print(f"{backend:6s}: batch-1 decode {itl * 1e6:8.1f} us/token ({100 * floor_s / itl:5.1f}% of the floor); "
                  f"offline {n} x ({prompt_len} + {out_len}): {row['output_tokens_per_s']:9.1f} output tok/s "
                  f"in {elapsed:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    from kvpilot import envs

    if args.model:
        return run_model(args)
    if args.dry_run:
        envs.set_external("TRITON_INTERPRET", "1")  # before the kernels' module is imported
    import torch

    from kvpilot.kernels.fused_moe import fused_moe_triton
    from kvpilot.kernels.moe import fused_moe_ref, select_experts

    if args.dry_run:
        device, dtype = "cpu", torch.float32
        hidden, inter, experts, top_k, layers = 64, 32, 8, 2, 2
        tokens, prefill, iters = [1, 4, 16], 0, 1
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA GPU (or --dry-run)", file=sys.stderr)
            return 2
        device, dtype = "cuda", torch.bfloat16
        hidden, inter, experts, top_k, layers = 2048, 768, 128, 8, args.layers
        tokens = [int(t) for t in args.tokens.split(",") if t]
        prefill, iters = args.prefill, args.iters
    g = torch.Generator(device=device).manual_seed(0)
    weights = [(torch.randn(experts, 2 * inter, hidden, device=device, dtype=dtype, generator=g) / hidden ** 0.5,
                torch.randn(experts, hidden, inter, device=device, dtype=dtype, generator=g) / inter ** 0.5)
               for _ in range(layers)]
    elt = torch.tensor([], dtype=dtype).element_size()

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(fn, n) -> float:
        """Seconds per call of ``fn()`` (mean of ``n`` after one warm-up)."""
        fn()
        sync()
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / n
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n

    bandwidth = copy_bandwidth(torch, device, 2 ** 20 if args.dry_run else 256 * 2 ** 20)
    results = {"shape": dict(hidden=hidden, inter=inter, experts=experts, top_k=top_k, layers=layers,
                             dtype=str(dtype)), "copy_bandwidth_GBps": bandwidth / 1e9, "rows": []}
    print(f"device copy bandwidth {bandwidth / 1e9:.0f} GB/s; layer: {experts} experts of {inter}, top {top_k}, "
          f"hidden {hidden}, {dtype}")
    print(f"{'tokens':>7} {'fused us':>10} {'ref us':>10} {'speedup':>8} {'floor us':>9} {'floor %':>8} "
          f"{'TFLOP/s':>8} {'mm TFLOP/s':>10} {'max diff':>9}")
    for t in tokens + ([prefill] if prefill else []):
        x = torch.randn(t, hidden, device=device, dtype=dtype, generator=g)
        w, ids = select_experts(torch.randn(t, experts, device=device, generator=g), top_k, renormalize=True)

        def run(fn):
            def all_layers():
                for w13, w2 in weights:
                    fn(x, w13, w2, w, ids)
            return all_layers

        fused_s = timed(run(fused_moe_triton), iters) / layers
        with_ref = t in tokens
        ref_s = timed(run(fused_moe_ref), max(1, iters // 4)) / layers if with_ref else None
        distinct = int(torch.unique(ids).numel())
        floor_s = distinct * 3 * inter * hidden * elt / bandwidth
        flops = 2 * t * top_k * 3 * inter * hidden
        a = torch.randn(t * top_k, hidden, device=device, dtype=dtype, generator=g)
        b = torch.randn(hidden, 2 * inter, device=device, dtype=dtype, generator=g)
        mm_rate = 2 * a.shape[0] * hidden * 2 * inter / timed(lambda: torch.mm(a, b), iters)
        diff = None
        if with_ref:
            diff = (fused_moe_triton(x, *weights[0], w, ids).float() - fused_moe_ref(x, *weights[0], w, ids).float()
                    ).abs().max().item()
        row = dict(tokens=t, fused_us=fused_s * 1e6, ref_us=None if ref_s is None else ref_s * 1e6,
                   distinct_experts=distinct, floor_us=floor_s * 1e6, floor_fraction=floor_s / fused_s,
                   tflops=flops / fused_s / 1e12, mm_tflops=mm_rate / 1e12, max_diff=diff)
        results["rows"].append(row)
        ref_txt = f"{row['ref_us']:10.1f} {ref_s / fused_s:8.2f}" if ref_s else f"{'-':>10} {'-':>8}"
        print(f"{t:7d} {row['fused_us']:10.1f} {ref_txt} {row['floor_us']:9.1f} {100 * row['floor_fraction']:7.1f}% "
              f"{row['tflops']:8.1f} {row['mm_tflops']:10.1f} {'-' if diff is None else f'{diff:9.2e}':>9}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    bad = [r for r in results["rows"] if r["max_diff"] is not None and r["max_diff"] > (1e-4 if args.dry_run else 5e-2)]
    if bad:
        print(f"fused and reference outputs differ at {[r['tokens'] for r in bad]} tokens", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
