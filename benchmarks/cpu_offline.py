"""CPU offline throughput: kvpilot vs transformers' `generate` on the same model and prompts.

64 concurrent requests (greedy, fixed output length with ignore_eos) on the stories260K model (or
--model DIR). Prints output tokens/s of both, measured in the same run.

    .venv/bin/python benchmarks/cpu_offline.py [--num-requests 64] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: stories260K, converted)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()

    from transformers import AutoTokenizer, LlamaForCausalLM

    from kvpilot import LLM, SamplingParams
    from kvpilot.tools.convert_llama2c import ensure_stories260k

    model = args.model or str(ensure_stories260k())
    tok = AutoTokenizer.from_pretrained(model)
    seeds = ["Once upon a time", "The little dog", "Tom and Sue went to the park", "She was sad because",
             "One day, a big bird", "Lily wanted to play", "The sun was hot and", "Max had a red ball"]
    prompts = [seeds[i % len(seeds)] + ("" if i < len(seeds) else f" {i}") for i in range(args.num_requests)]
    n_out = args.max_tokens

    llm = LLM(model)
    sp = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
    llm.generate(prompts[:4], sp, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    t_kv = time.perf_counter() - t0
    kv_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.shutdown()

    hf = LlamaForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.unk_token or tok.eos_token
    enc = tok(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        hf.generate(**{k: v[:4] for k, v in enc.items()}, max_new_tokens=4, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        gen = hf.generate(**enc, max_new_tokens=n_out, min_new_tokens=n_out, do_sample=False,
                          pad_token_id=tok.pad_token_id)
        t_hf = time.perf_counter() - t0
    hf_tokens = (gen.shape[1] - enc["input_ids"].shape[1]) * gen.shape[0]

    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}")
    print(f"{args.num_requests} requests x {n_out} output tokens, greedy, model {model}")
    print("| engine | wall s | output tokens | output tokens/s |")
    print("|---|---|---|---|")
    print(f"| kvpilot LLM.generate | {t_kv:.2f} | {kv_tokens} | {kv_tokens / t_kv:.0f} |")
    print(f"| transformers generate (batch {args.num_requests}) | {t_hf:.2f} | {hf_tokens} | {hf_tokens / t_hf:.0f} |")
    print(f"speed-up: {(kv_tokens / t_kv) / (hf_tokens / t_hf):.2f}x")


if __name__ == "__main__":
    main()
