"""Offline benchmarks on the in-process `LLM`: ``kvpilot bench latency`` and ``kvpilot bench throughput``.

Both use random prompt token ids, ``ignore_eos`` and fixed output lengths (vLLM's ``benchmark_latency``
/ ``benchmark_throughput`` and TensorRT-LLM's ``trtllm-bench`` conventions), so checkpoints without a
tokenizer run with ``skip_tokenizer_init=True``.

- latency: ``batch_size`` identical-length requests at once, repeated; reports time to first token,
  inter-token latency (ITL = (finish - first token) / (output_len - 1)) and output tokens/s.
- throughput: ``num_prompts`` requests with at most ``max_concurrency`` in flight (default: as many
  as the KV pool holds at full length, TensorRT-LLM's guaranteed-no-evict policy, capped by
  ``max_batch_size``); reports output and total tokens/s over the whole run.

`engine/tools/bench.py` (``kvpilot bench serve``) registers these subcommands from `SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def random_prompts(num: int, length: int, vocab_size: int, seed: int = 0, low: int = 10) -> list[list[int]]:
    """``num`` prompts of ``length`` token ids drawn uniformly from ``[low, vocab_size)``.

    ``low`` keeps clear of the special ids at the start of most vocabularies (BOS, EOS, pad).

    Raises:
        ValueError: non-positive sizes or ``vocab_size <= low``.
    """
    import torch

    if num < 1 or length < 1 or vocab_size <= low:
        raise ValueError(f"need num >= 1, length >= 1 and vocab_size > {low}; got {num}, {length}, {vocab_size}")
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab_size, (num, length), generator=g).tolist()


def _fixed_params(output_len: int, temperature: float = 0.0):
    from kvpilot import SamplingParams

    # ignore_eos alone fixes the length; min_tokens would add a per-row ban list to every sampler call.
    return SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=temperature, detokenize=False)


def run_latency(llm, input_len: int, output_len: int, batch_size: int = 1, num_iters: int = 3,
                num_warmup: int = 1, seed: int = 0) -> dict[str, Any]:
    """Time ``num_iters`` batches of ``batch_size`` requests (after ``num_warmup`` untimed ones).

    Returns medians over iterations: ``ttft_s``, ``itl_s`` (seconds per generated token after the
    first, per request, averaged over the batch), ``e2e_s`` and ``output_tokens_per_s`` (batch
    output tokens / e2e); plus ``itl_s_all`` (every iteration's value).

    Raises:
        ValueError: ``output_len < 2`` (no inter-token interval to time).
    """
    if output_len < 2:
        raise ValueError(f"output_len must be >= 2 to time inter-token latency, got {output_len}")
    vocab = llm.model_config.vocab_size
    params = _fixed_params(output_len)
    ttft, itl, e2e = [], [], []
    for it in range(num_warmup + num_iters):
        prompts = random_prompts(batch_size, input_len, vocab, seed=seed + it)
        t0 = time.monotonic()
        outs = [llm.generate_async(p, params) for p in prompts]
        for o in outs:
            o.result()
        t1 = time.monotonic()
        for o in outs:
            if len(o.outputs[0].token_ids) != output_len:
                raise RuntimeError(f"expected {output_len} tokens, got {len(o.outputs[0].token_ids)}")
        if it < num_warmup:
            continue
        m = [o.metrics for o in outs]
        ttft.append(statistics.fmean(x.first_token_time - x.arrival_time for x in m))
        itl.append(statistics.fmean((x.finished_time - x.first_token_time) / (output_len - 1) for x in m))
        e2e.append(t1 - t0)
    med_e2e = statistics.median(e2e)
    return {"input_len": input_len, "output_len": output_len, "batch_size": batch_size, "num_iters": num_iters,
            "ttft_s": statistics.median(ttft), "itl_s": statistics.median(itl), "itl_s_all": itl,
            "e2e_s": med_e2e, "output_tokens_per_s": batch_size * output_len / med_e2e,
            "decode_tokens_per_s_per_seq": 1.0 / statistics.median(itl)}


def auto_concurrency(llm, input_len: int, output_len: int) -> int:
    """Requests that fit the KV pool at full length at once, capped by ``max_batch_size`` (>= 1)."""
    block = llm.kv_cache_config.tokens_per_block
    per_seq_blocks = -(-(input_len + output_len) // block)
    fit = (llm.pool_tokens // block) // per_seq_blocks
    return max(1, min(llm.max_batch_size, fit))


def run_throughput(llm, prompts: list[list[int]], output_len: int,
                   max_concurrency: Optional[int] = None) -> dict[str, Any]:
    """Generate ``output_len`` tokens for every prompt, keeping ``max_concurrency`` requests in flight.

    Requests are all the same length, so they finish in submission order: the driver waits for the
    oldest and submits the next prompt in its place (no asyncio loop competing with the engine thread).

    Returns ``elapsed_s``, ``output_tokens_per_s``, ``total_tokens_per_s``, ``requests_per_s`` and
    the counts used.
    """
    input_len = max(len(p) for p in prompts)
    conc = max_concurrency or auto_concurrency(llm, input_len, output_len)
    params = _fixed_params(output_len)
    pending = iter(prompts)
    inflight: deque = deque()
    t0 = time.monotonic()
    for p in pending:
        inflight.append(llm.generate_async(p, params))
        if len(inflight) >= conc:
            break
    out_tokens = 0
    while inflight:
        out = inflight.popleft().result()
        out_tokens += len(out.outputs[0].token_ids)
        nxt = next(pending, None)
        if nxt is not None:
            inflight.append(llm.generate_async(nxt, params))
    elapsed = time.monotonic() - t0
    in_tokens = sum(len(p) for p in prompts)
    return {"num_prompts": len(prompts), "input_len": input_len, "output_len": output_len,
            "max_concurrency": conc, "elapsed_s": elapsed, "output_tokens": out_tokens,
            "output_tokens_per_s": out_tokens / elapsed, "total_tokens_per_s": (out_tokens + in_tokens) / elapsed,
            "requests_per_s": len(prompts) / elapsed}


# ---- command line ------------------------------------------------------------------------------
def _common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="load no tokenizer (automatic when the model directory has none)")
    p.add_argument("--dtype", default="auto", help="weights' dtype: auto, bfloat16, float16, float32")
    p.add_argument("--device", default="auto", help="auto (CUDA when available, else CPU), cuda, cuda:N or cpu")
    p.add_argument("--max-batch-size", type=int, default=256, help="most sequences in one engine step")
    p.add_argument("--max-num-tokens", type=int, default=8192, help="most tokens in one engine step")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="context limit in tokens (default: input + output length)")
    p.add_argument("--allow-long-max-seq-len", action="store_true",
                   help="accept a context limit beyond the model's max_position_embeddings")
    p.add_argument("--free-gpu-memory-fraction", type=float, default=0.9,
                   help="fraction of the GPU memory left after loading that the KV cache takes (0-1)")
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: quantize the weights at load (QuantConfig(quant_algo='FP8'), docs/quantization.md); "
                        "default: the checkpoint's weights")
    p.add_argument("--kv-cache-dtype", default="auto", help="KV-cache element type: auto, fp8, bfloat16, ...")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt token ids")
    p.add_argument("--output-json", default=None, help="also write the result as JSON here (default: no file)")


def configure_latency(p: argparse.ArgumentParser) -> None:
    """Arguments of ``kvpilot bench latency``."""
    _common_args(p)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--output-len", type=int, default=512, help="generated tokens per sequence")
    p.add_argument("--batch-size", type=int, default=1, help="sequences generated together")
    p.add_argument("--num-iters", type=int, default=3, help="measured repetitions")
    p.add_argument("--num-iters-warmup", type=int, default=1, help="unmeasured repetitions first")


def configure_throughput(p: argparse.ArgumentParser) -> None:
    """Arguments of ``kvpilot bench throughput``."""
    _common_args(p)
    p.add_argument("--num-prompts", type=int, default=1000, help="requests submitted")
    p.add_argument("--input-len", type=int, default=1000, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=1000, help="generated tokens per request")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight (default: what the KV pool holds at full length)")


def add_subcommands(subparsers) -> None:
    """Add ``latency`` and ``throughput`` to a subparsers object; each sets ``args._bench_run``."""
    for name, help_text, configure, fn in SUBCOMMANDS:
        p = subparsers.add_parser(name, help=help_text)
        configure(p)
        p.set_defaults(_bench_run=fn)


def _make_llm(args, min_seq_len: int):
    from kvpilot import LLM, KvCacheConfig, QuantConfig

    model = Path(args.model)
    tok_dir = Path(args.tokenizer) if args.tokenizer else model
    skip = args.skip_tokenizer_init or not any((tok_dir / f).is_file() for f in _TOKENIZER_FILES)
    try:
        return LLM(str(model), tokenizer=args.tokenizer, skip_tokenizer_init=skip, dtype=args.dtype,
                   device=args.device, max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens,
                   max_seq_len=args.max_seq_len or min_seq_len,
                   allow_long_max_seq_len=args.allow_long_max_seq_len,
                   kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=args.free_gpu_memory_fraction,
                                                 dtype=getattr(args, "kv_cache_dtype", "auto")),
                   quant_config=QuantConfig(quant_algo="FP8") if getattr(args, "quantization", None) else None)
    except (FileNotFoundError, ValueError) as exc:  # bad arguments (DeviceUnavailableError included): one line
        raise SystemExit(f"kvpilot bench: {exc}") from None


def _finish(args, result: dict[str, Any]) -> int:
    import torch

    result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result["date"] = time.strftime("%Y-%m-%d")
    text = json.dumps(result, indent=2)
    print(text)
    if args.output_json:
        Path(args.output_json).write_text(text + "\n")
    return 0


def run_latency_cli(args) -> int:
    """``kvpilot bench latency``: prints the `run_latency` result as JSON."""
    llm = _make_llm(args, args.input_len + args.output_len)
    try:
        res = run_latency(llm, args.input_len, args.output_len, args.batch_size, args.num_iters,
                          args.num_iters_warmup, args.seed)
    finally:
        llm.shutdown()
    return _finish(args, res)


def run_throughput_cli(args) -> int:
    """``kvpilot bench throughput``: prints the `run_throughput` result as JSON."""
    llm = _make_llm(args, args.input_len + args.output_len)
    try:
        prompts = random_prompts(args.num_prompts, args.input_len, llm.model_config.vocab_size, args.seed)
        res = run_throughput(llm, prompts, args.output_len, args.max_concurrency)
    finally:
        llm.shutdown()
    return _finish(args, res)


# (name, help, configure, run), in engine/tools/bench.py's `_SUBCOMMANDS` format.
SUBCOMMANDS = [
    ("latency", "batch decode latency on the in-process engine (TTFT, inter-token latency)", configure_latency,
     run_latency_cli),
    ("throughput", "offline throughput of the in-process engine over fixed-length requests", configure_throughput,
     run_throughput_cli),
]
