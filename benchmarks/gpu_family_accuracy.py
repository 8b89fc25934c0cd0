"""Every supported model family against transformers on the GPU, same random weights.

Usage (one GPU, after ``pip install -e .``; about a minute):

    python3 benchmarks/gpu_family_accuracy.py [--families qwen3,gemma3] [--json PATH]

Per family: a random-weight model built from the family's transformers config class (4 layers,
hidden 1024, 16 query / 4 KV heads of 64, a 128-token window where the family has one, a 512-token
prompt), saved as a checkpoint. kvpilot's `ModelRunner` (CUDA graphs, Triton kernels) computes the
teacher-forced log-probabilities of the prompt (prefill in 192-token chunks) and of 32 greedy decode
steps, in float32 and in bf16; transformers (eager attention) computes them on the same sequence in
float32 (the reference) and bf16. Reported: mean and max |log-prob difference| of kvpilot fp32,
kvpilot bf16 and transformers bf16 from the reference, and whether the float32 greedy tokens agree.
Checks (exit status 1 when one fails): kvpilot fp32 mean error below 1e-4 with identical greedy
tokens, and kvpilot bf16 mean error at most 2e-3 or at most transformers bf16's own.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch


def configs():
    import transformers as T

    base = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-6)
    return {
        "llama": (T.LlamaConfig(**base), T.LlamaForCausalLM, 1.0),
        "mistral": (T.MistralConfig(**base, head_dim=64, sliding_window=128), T.MistralForCausalLM, 1.0),
        "qwen2": (T.Qwen2Config(**base, tie_word_embeddings=True), T.Qwen2ForCausalLM, 1.0),
        "qwen3": (T.Qwen3Config(**base, head_dim=64), T.Qwen3ForCausalLM, 1.0),
        "gemma2": (T.Gemma2Config(**base, head_dim=64, sliding_window=128, query_pre_attn_scalar=64),
                   T.Gemma2ForCausalLM, 0.0),
        "gemma3": (T.Gemma3TextConfig(**base, head_dim=64, sliding_window=128, query_pre_attn_scalar=64,
                                      layer_types=["sliding_attention"] * 3 + ["full_attention"]),
                   T.Gemma3ForCausalLM, 0.0),
        "phi3": (T.Phi3Config(**base, partial_rotary_factor=0.75, pad_token_id=0), T.Phi3ForCausalLM, 1.0),
        # Mixture of experts: kvpilot's Triton MoE kernels on the GPU (kernels/fused_moe.py).
        "mixtral": (T.MixtralConfig(**base, num_local_experts=8, num_experts_per_tok=2), T.MixtralForCausalLM, 1.0),
        "qwen3_moe": (T.Qwen3MoeConfig(**base, head_dim=64, moe_intermediate_size=512, num_experts=32,
                                       num_experts_per_tok=4, norm_topk_prob=True), T.Qwen3MoeForCausalLM, 1.0),
        "qwen2_moe": (T.Qwen2MoeConfig(**base, moe_intermediate_size=512, shared_expert_intermediate_size=1408,
                                       num_experts=16, num_experts_per_tok=4), T.Qwen2MoeForCausalLM, 1.0),
    }


def write(path: Path, cfg, cls, norm_center: float) -> None:
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(norm_center + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.02)
    model.save_pretrained(str(path))


def run_kvpilot(path: Path, dtype: str, prompt: list[int], steps: int, device: str, chunk: int = 192):
    from kvpilot import KvCacheConfig
    from kvpilot.model.config import ModelConfig
    from kvpilot.runner.model_runner import ModelRunner, ScheduledSeq

    runner = ModelRunner(path, ModelConfig.from_dir(path), KvCacheConfig(tokens_per_block=32, max_tokens=4096),
                         max_num_tokens=512, max_batch_size=8, max_seq_len=1024, device=device, dtype=dtype)
    table = list(range(-(-(len(prompt) + steps) // 32)))
    rows = []
    for start in range(0, len(prompt), chunk):
        logits, _ = runner.execute([ScheduledSeq(0, prompt[start:start + chunk], start, table,
                                                 start + chunk >= len(prompt), all_logits=True)])
        rows.append(logits.float().clone())
    tokens = [int(rows[-1][-1].argmax())]
    for i in range(steps - 1):
        logits, _ = runner.execute([ScheduledSeq(0, [tokens[-1]], len(prompt) + i, table, True)])
        rows.append(logits.float().clone())
        tokens.append(int(logits[-1].argmax()))
    del runner
    if device != "cpu":
        torch.cuda.empty_cache()
    return torch.log_softmax(torch.cat(rows), -1), tokens


@torch.no_grad()
def run_hf(path: Path, cls, dtype, seq: list[int], device: str) -> torch.Tensor:
    model = cls.from_pretrained(str(path), dtype=dtype, attn_implementation="eager").to(device).eval()
    out = torch.log_softmax(model(torch.tensor([seq], device=device)).logits[0].float(), -1).cpu()
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default=",".join(configs()))
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a slow dry run)")
    args = ap.parse_args()
    torch.manual_seed(1)
    prompt = torch.randint(3, 4096, (512,)).tolist()
    steps, results, ok = 32, {}, True
    for name in args.families.split(","):
        cfg, cls, center = configs()[name]
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / name
            write(path, cfg, cls, center)
            k32, toks32 = run_kvpilot(path, "float32", prompt, steps, args.device)
            k16, _ = run_kvpilot(path, "bfloat16", prompt, steps, args.device)
            seq = prompt + toks32[:-1]
            ref = run_hf(path, cls, torch.float32, seq, args.device)
            h16 = run_hf(path, cls, torch.bfloat16, seq, args.device)
            ref_greedy = ref[len(prompt) - 1:].argmax(-1).tolist()
        k32, k16 = k32.cpu(), k16.cpu()
        r = {"kvpilot_fp32_mean": (k32 - ref).abs().mean().item(), "kvpilot_fp32_max": (k32 - ref).abs().max().item(),
             "kvpilot_bf16_mean": (k16 - ref).abs().mean().item(), "kvpilot_bf16_max": (k16 - ref).abs().max().item(),
             "hf_bf16_mean": (h16 - ref).abs().mean().item(), "greedy_fp32_equal": toks32 == ref_greedy}
        r["pass"] = (r["kvpilot_fp32_mean"] < 1e-4 and r["greedy_fp32_equal"]
                     and (r["kvpilot_bf16_mean"] <= 2e-3 or r["kvpilot_bf16_mean"] <= r["hf_bf16_mean"]))
        ok &= r["pass"]
        results[name] = r
        print(f"{name:8s} fp32 mean {r['kvpilot_fp32_mean']:.2e} max {r['kvpilot_fp32_max']:.2e} | bf16 mean "
              f"{r['kvpilot_bf16_mean']:.2e} (transformers bf16 {r['hf_bf16_mean']:.2e}) | greedy fp32 "
              f"{'same' if r['greedy_fp32_equal'] else 'DIFFERENT'} | {'ok' if r['pass'] else 'FAIL'}", flush=True)
    if args.json:
        device = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
        Path(args.json).write_text(json.dumps({"device": device, "results": results}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
