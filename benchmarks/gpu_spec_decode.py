"""Speculative decoding on one GPU: tokens/s against acceptance rate and draft length, batch 1 to 64.

Random weights make real drafts meaningless (a Llama-3.1-8B-shaped random model's continuation has
nothing an n-gram lookup or a small draft could predict), so the acceptance rate is set by the
benchmark with an *oracle* proposer: the target's own greedy continuation (from a run without
speculation), each drafted token replaced by a random other id with probability ``corrupt``. What
it measures is the engine's cost of speculation: the verification pass over ``k + 1`` positions per
sequence (a prefill CUDA graph replay up to 256 tokens, eager beyond), the rejection sampler and the host work,
against the tokens each step emits. The measured acceptance (accepted / drafted tokens) is reported
next to each setting; the verification's numerics may differ slightly from the decode graphs', so
it can sit a little below ``1 - corrupt``.

Runs (all greedy, ``--output-len`` tokens per request, after one warm-up request):

- ``baseline``: no speculation, batch 1;
- ``oracle``: max_draft_len 1..8 x corrupt 0, 0.1, 0.2, 0.4 at batch 1 (tokens/s vs acceptance);
- ``batch``: max_draft_len 4, corrupt 0.2, at batch 1, 4, 16, 64, against the baseline at the same
  batch (where speculation stops paying);
- ``self_draft``: `DraftTargetDecodingConfig` with the target as its own draft (acceptance 1,
  draft cost = target cost: the verification overhead plus a worst-case draft);
- ``ngram``: `NGramDecodingConfig` on a prompt that repeats one random block (prompt-copy workload;
  with random weights the continuation rarely copies, so this records the cost of rejected drafts).

    python3 benchmarks/gpu_spec_decode.py --out $OUT          # GPU: Llama-3.1-8B shape, bf16
    .venv/bin/python benchmarks/gpu_spec_decode.py --tiny     # CPU dry run on a tiny random model

Writes ``spec_decode.json`` into ``--out`` (when given) and prints one line per run. ``corrupt`` sets
the per-token acceptance probability (1 - corrupt, Leviathan et al.'s alpha); ``acceptance`` is
accepted / drafted tokens, lower than alpha since drafts after the first rejection count as drafted.
About 40 runs of ``--output-len`` tokens and four engine start-ups (``--skip`` shortens it).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvpilot.tools.random_model import LLAMA31_8B, TINY, write_random_llama  # noqa: E402


def _oracle(spec, refs: dict[tuple, list[int]], k_max: int, corrupt: float, vocab: int, seed: int):
    """Replace ``spec.propose`` by the oracle: drafts from each request's reference continuation
    (``refs``: prompt ids as a tuple -> output ids), corrupted with probability ``corrupt``."""
    rng = random.Random(seed)

    def propose(running) -> None:
        for seq in running:
            seq.spec_token_ids = ()
            L = len(seq.token_ids)
            if seq.num_computed_tokens != L - 1 or L <= seq.num_prompt_tokens:
                continue
            k = min(k_max, seq.length_limit - L - 1)
            ref = refs.get(tuple(seq.request.prompt_token_ids))
            if k < 1 or ref is None:
                continue
            o = seq.num_output_tokens
            d = list(ref[o:o + k])
            for i in range(len(d)):
                if rng.random() < corrupt:
                    d[i] = (d[i] + 1 + rng.randrange(vocab - 1)) % vocab
            seq.spec_token_ids = d

    spec.propose = propose


def _run(llm, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    from kvpilot import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    return dt, [o.outputs[0].token_ids for o in outs]


def _reset(spec, k: int) -> None:
    from kvpilot.core.stats import SpecDecodeStats

    spec.totals = SpecDecodeStats(accepted_per_pos=[0] * k)


def _prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    """Random prompts (distinct: the oracle's key)."""
    rng = random.Random(seed)
    return [[1] + [rng.randrange(2, vocab) for _ in range(prompt_len - 1)] for _ in range(batch)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU dry run on a tiny random model")
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--model-dir", default="/tmp/kvpilot-llama8b-random")
    ap.add_argument("--skip", default="", help="comma-separated runs to skip (oracle,batch,self_draft,ngram)")
    ap.add_argument("--out", default=None, help="folder for spec_decode.json")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))

    from kvpilot import LLM, KvCacheConfig
    from kvpilot.llmapi import DraftTargetDecodingConfig, NGramDecodingConfig

    cfg, device = (TINY, "cpu") if args.tiny else (LLAMA31_8B, "cuda")
    if args.tiny:
        args.output_len = min(args.output_len, 64)
        args.prompt_len = min(args.prompt_len, 32)
    path = Path(args.model_dir + ("-tiny" if args.tiny else ""))
    if not (path / "config.json").exists():
        write_random_llama(path, cfg, dtype=torch.float32 if args.tiny else torch.bfloat16, device=device)
    vocab = cfg["vocab_size"]
    max_seq_len = args.prompt_len + args.output_len + 16
    common = dict(skip_tokenizer_init=True, device=device, max_seq_len=max_seq_len, max_batch_size=64,
                  max_num_tokens=4096, kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=0.4,
                                                                      enable_block_reuse=False))
    results: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                     "model": "tiny" if args.tiny else "Llama-3.1-8B shape, random bf16 weights",
                     "output_len": args.output_len, "prompt_len": args.prompt_len, "runs": []}

    def record(kind: str, batch: int, dt: float, n_tokens: int, spec=None, **kw) -> None:
        row = dict(kind=kind, batch=batch, seconds=round(dt, 4), tokens_per_s=round(n_tokens / dt, 1), **kw)
        if spec is not None:
            t = spec.totals
            row.update(drafted=t.num_draft_tokens, accepted=t.num_accepted_tokens,
                       acceptance=round(t.num_accepted_tokens / t.num_draft_tokens, 4) if t.num_draft_tokens else 0.0,
                       mean_accepted_length=round(t.mean_accepted_length, 3))
        results["runs"].append(row)
        print(json.dumps(row), flush=True)

    batches = [1] if "batch" in skip else [1, 4, 16, 64]
    prompts = {b: _prompts(b, args.prompt_len, vocab, seed=b) for b in batches}
    refs: dict[tuple, list[int]] = {}
    base_tps: dict[int, float] = {}
    with LLM(str(path), **common) as llm:
        _run(llm, prompts[1], 16)  # warm-up
        for b in batches:
            dt, outs = _run(llm, prompts[b], args.output_len)
            for p, o in zip(prompts[b], outs):
                refs[tuple(p)] = o
            base_tps[b] = b * args.output_len / dt
            record("baseline", b, dt, b * args.output_len)

    def spec_llm(k: int):
        return LLM(str(path), speculative_config=NGramDecodingConfig(max_draft_len=k), **common)

    # One engine for the oracle runs: drafts of up to 8 tokens, the oracle sets each run's length.
    if not {"oracle", "batch"} <= skip:
        with spec_llm(8) as llm:
            spec = llm._core.spec
            _oracle(spec, refs, 8, 0.0, vocab, seed=0)
            _run(llm, prompts[1], 16)  # warm-up
            if "oracle" not in skip:
                for k in range(1, 9):
                    for corrupt in (0.0, 0.1, 0.2, 0.4):
                        _oracle(spec, refs, k, corrupt, vocab, seed=k)
                        _reset(spec, 8)
                        dt, _ = _run(llm, prompts[1], args.output_len)
                        record("oracle", 1, dt, args.output_len, spec, max_draft_len=k, corrupt=corrupt,
                               speedup=round(args.output_len / dt / base_tps[1], 3))
            if "batch" not in skip:
                for b in batches:
                    _oracle(spec, refs, 4, 0.2, vocab, seed=b)
                    _reset(spec, 8)
                    dt, _ = _run(llm, prompts[b], args.output_len)
                    record("batch", b, dt, b * args.output_len, spec, max_draft_len=4, corrupt=0.2,
                           speedup=round(b * args.output_len / dt / base_tps[b], 3))
    if "self_draft" not in skip:
        k = 4
        with LLM(str(path), speculative_config=DraftTargetDecodingConfig(max_draft_len=k, speculative_model=str(path)),
                 **common) as llm:
            _run(llm, prompts[1], 16)
            _reset(llm._core.spec, k)
            dt, _ = _run(llm, prompts[1], args.output_len)
            record("self_draft", 1, dt, args.output_len, llm._core.spec, max_draft_len=k,
                   speedup=round(args.output_len / dt / base_tps[1], 3))
    if "ngram" not in skip:
        rng = random.Random(7)
        block = [rng.randrange(2, vocab) for _ in range(32)]
        copy_prompt = [[1] + block * max(1, (args.prompt_len - 1) // 32)]
        with spec_llm(4) as llm:
            _run(llm, prompts[1], 16)
            _reset(llm._core.spec, 4)
            dt, _ = _run(llm, copy_prompt, args.output_len)
            record("ngram_prompt_copy", 1, dt, args.output_len, llm._core.spec, max_draft_len=4)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "spec_decode.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
