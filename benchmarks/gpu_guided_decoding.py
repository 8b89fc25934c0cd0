"""Guided decoding's cost on one GPU: decode throughput with a JSON schema against unconstrained, batch 64.

A Llama-3.1-8B-shaped model with random bf16 weights and a synthetic 128,256-token vocabulary
(every string of 1-3 characters over a 48-character JSON-ish alphabet, then filler tokens; a
Hugging Face fast tokenizer written next to the weights: the GPU machine reaches no Hub). Random
weights decide nothing about the grammar's cost, which is the mask work per step (xgrammar's fill
on the host, overlapped with the forward pass; the bitmask upload and the Triton apply kernel).

Runs (greedy, ``--batch`` requests of ``--prompt-len`` random tokens, ``--output-len`` tokens each,
``ignore_eos``, after one warm-up run of each kind):

- ``plain``: no constraint;
- ``json_long``: a JSON schema whose shortest document is longer than ``--output-len`` tokens (a
  list of at least 4 x output-len one-digit integers), so every request decodes the same number of
  tokens as ``plain`` under an active grammar;
- ``json_object``: a typical object schema (strings, enum, integer, nested list); requests end when
  their document does, so it reports tokens/s and the mean length.

Also recorded: compile seconds per schema (first compile and the cache hit), the host time of the
mask fill per step (mean over the ``json_long`` run) and the token-bitmask bytes uploaded per step.

    python3 benchmarks/gpu_guided_decoding.py --out $OUT      # GPU: Llama-3.1-8B shape, bf16
    .venv/bin/python benchmarks/gpu_guided_decoding.py --tiny # CPU dry run on a tiny random model

Writes ``guided_decoding.json`` into ``--out`` (when given) and prints it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvpilot.tools.random_model import LLAMA31_8B, TINY, write_random_llama  # noqa: E402

_ALPHABET = list('abcdefghijklmnopqrstuvwxyz0123456789 {}[]":,.-_\n')


def write_synthetic_tokenizer(path: Path, vocab_size: int, bos: int, eos: int) -> None:
    """A WordLevel fast tokenizer of ``vocab_size`` tokens (1-3 character strings, then fillers)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    special = {bos: "<s>", eos: "</s>"}
    strings = ("".join(t) for n in (1, 2, 3) for t in itertools.product(_ALPHABET, repeat=n))
    filler = (f"<extra_{i}>" for i in itertools.count())
    for i in range(vocab_size):
        vocab[special[i] if i in special else next(strings, None) or next(filler)] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<s>"))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true", help="CPU dry run on a tiny random model")
    ap.add_argument("--model-dir", default="/tmp/kvpilot-guided-model")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    args = ap.parse_args()

    from kvpilot import LLM, KvCacheConfig, SamplingParams
    from kvpilot.llmapi import GuidedDecodingParams

    cfg, device = (TINY, "cpu") if args.tiny else (LLAMA31_8B, "cuda")
    if args.tiny:
        args.batch, args.output_len, args.prompt_len = min(args.batch, 8), min(args.output_len, 32), 16
    path = Path(args.model_dir + ("-tiny" if args.tiny else ""))
    if not (path / "config.json").exists():
        write_random_llama(path, cfg, dtype=torch.float32 if args.tiny else torch.bfloat16, device=device)
    if not (path / "tokenizer.json").exists():
        write_synthetic_tokenizer(path, cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"])
    llm = LLM(str(path), device=device, max_seq_len=args.prompt_len + args.output_len + 16,
              max_batch_size=max(64, args.batch), max_num_tokens=8192,
              kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=0.5, enable_block_reuse=False))
    rng = random.Random(0)
    V = cfg["vocab_size"]
    prompts = [[rng.randrange(3, V) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    long_schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                   "minItems": 4 * args.output_len}
    obj_schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4}},
        "required": ["name", "kind", "age", "tags"]}

    backend = llm.guided_backend()
    compile_s = {}
    for name, schema in (("json_long", long_schema), ("json_object", obj_schema)):
        t0 = time.perf_counter()
        backend.compile(GuidedDecodingParams(json=schema))
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        backend.compile(GuidedDecodingParams(json=schema))
        compile_s[name] = {"first_s": round(first, 4), "cached_s": round(time.perf_counter() - t0, 6)}

    fill_times: list[float] = []
    fill = backend.fill

    def timed_fill(guides, bitmask):
        t0 = time.perf_counter()
        fill(guides, bitmask)
        fill_times.append(time.perf_counter() - t0)

    backend.fill = timed_fill

    def run(gd) -> tuple[float, int]:
        sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, guided_decoding=gd)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)

    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
               "model": "tiny" if args.tiny else "Llama-3.1-8B shape, random bf16 weights, synthetic 128k vocab",
               "batch": args.batch, "prompt_len": args.prompt_len, "output_len": args.output_len,
               "compile": compile_s, "runs": {}}
    for name, gd in (("plain", None), ("json_long", GuidedDecodingParams(json=long_schema)),
                     ("json_object", GuidedDecodingParams(json=obj_schema))):
        run(gd)  # warm-up (graphs, caches)
        fill_times.clear()
        dt, n = run(gd)
        row = {"seconds": round(dt, 4), "tokens": n, "tokens_per_s": round(n / dt, 1),
               "mean_output_len": round(n / args.batch, 1)}
        if fill_times:
            row["mask_fill_ms_per_step"] = round(1e3 * sum(fill_times) / len(fill_times), 3)
            row["bitmask_bytes_per_step"] = args.batch * ((V + 31) // 32) * 4
        results["runs"][name] = row
        print(name, row, flush=True)
    plain, guided = results["runs"]["plain"], results["runs"]["json_long"]
    results["json_long_throughput_vs_plain"] = round(guided["tokens_per_s"] / plain["tokens_per_s"], 4)
    llm.shutdown()
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "guided_decoding.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
