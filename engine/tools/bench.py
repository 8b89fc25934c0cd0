"""``kvpilot bench ...``: benchmarks as commands (their results go into BENCHMARKS.md).

``kvpilot bench serve --url URL --concurrency N --num-prompts M`` drives a running OpenAI-compatible
server (kvpilot, vLLM, ...) with ``N`` clients in a closed loop, each sending streamed
``/v1/completions`` requests until ``M`` have been sent, and reports what the vLLM serving benchmark
reports: time to first token (TTFT), inter-token latency (ITL, the gap between consecutive streamed
chunks), time per output token (TPOT, per request: (e2e - TTFT) / (output tokens - 1)), end-to-end
latency, as mean / p50 / p90 / p99 in milliseconds, plus request and output-token throughput.

Prompts are synthetic: ``--prompt-len`` words drawn from a fixed list of simple English words
(about one token per word for Llama-style tokenizers), seeded by ``--seed``. ``ignore_eos`` is sent
(vLLM's extra field) so that every request generates exactly ``--max-tokens`` tokens.

Subcommands register in ``_SUBCOMMANDS``; each has a ``configure`` and a ``run`` function.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from typing import Callable

from kvpilot import envs
from kvpilot.tools import bench_figures as _figures
from kvpilot.tools import bench_offline as _offline
from kvpilot.tools.bench_serve import (BenchmarkError, RequestResult, format_summary, make_prompts,  # noqa: F401
                                      run_serve_benchmark, summarize)

logger = logging.getLogger(__name__)

# ---- subcommands ----------------------------------------------------------------------------------

def _configure_serve(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1],
                   help="clients in flight; several values run one benchmark each (default: 1)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per benchmark run")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (ignore_eos is sent)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt length in words (about tokens)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts")
    p.add_argument("--api-key", default=envs.api_key() or None,
                   help="bearer token sent as 'Authorization: Bearer KEY' (default: $KVPILOT_API_KEY, else none)")
    p.add_argument("--warmup", type=int, default=2, help="requests sent first and not measured")
    p.add_argument("--output-json", default=None, help="also write the figures to this JSON file (default: no file)")


def _run_serve(args: argparse.Namespace) -> int:
    for name in ("num_prompts", "max_tokens", "prompt_len"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if any(c < 1 for c in args.concurrency):
        raise SystemExit("--concurrency must be >= 1")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    try:
        return _serve_benchmarks(args)
    except BenchmarkError as exc:
        sys.stderr.write(f"kvpilot bench serve: {exc}\n")
        return 1


def _serve_benchmarks(args: argparse.Namespace) -> int:
    prompts = make_prompts(args.num_prompts, args.prompt_len, args.seed)
    runs = []
    if args.warmup:
        asyncio.run(run_serve_benchmark(args.url, args.model, prompts[:args.warmup], 1, args.max_tokens,
                                        args.api_key, args.temperature))
    for conc in args.concurrency:
        results, duration = asyncio.run(run_serve_benchmark(args.url, args.model, prompts, conc, args.max_tokens,
                                                             args.api_key, args.temperature))
        summary = summarize(results, duration)
        for r in results:
            if not r.ok:
                logger.warning("request failed: %s", r.error)
        sys.stdout.write(format_summary(summary, conc) + "\n")
        runs.append({"concurrency": conc, "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
                     "prompt_len_words": args.prompt_len, **summary})
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"url": args.url, "runs": runs}, f, indent=2)
    return 0 if all(r["failed"] == 0 for r in runs) else 1


# (name, help, configure, run): the offline benchmarks (`latency`, `throughput`) and the figures of
# BENCHMARKS.md's current-results table (`all`, one per figure; `kvpilot.tools.bench_figures`).
_SUBCOMMANDS: list[tuple[str, str, Callable[[argparse.ArgumentParser], None],
                         Callable[[argparse.Namespace], int]]] = [
    ("serve", "latency and throughput of a running OpenAI-compatible server", _configure_serve, _run_serve),
    *_offline.SUBCOMMANDS,
    *_figures.SUBCOMMANDS,
]


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark subcommands to ``kvpilot bench``."""
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    for name, help_text, configure, run_fn in _SUBCOMMANDS:
        p = sub.add_parser(name, help=help_text, description=help_text)
        configure(p)
        p.set_defaults(_bench_run=run_fn)


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark; returns its exit code (2 when none was named)."""
    fn = getattr(args, "_bench_run", None)
    if fn is None:
        sys.stderr.write("kvpilot bench: name a benchmark: " + ", ".join(n for n, *_ in _SUBCOMMANDS) + "\n")
        return 2
    return int(fn(args) or 0)
