"""The client of ``kvpilot bench serve``: synthetic prompts, closed-loop streamed
``/v1/completions`` requests against a running OpenAI-compatible server, and the vLLM serving
benchmark's summary (TTFT, ITL, TPOT, end-to-end latency; request and token throughput). The
command itself is `kvpilot.tools.bench`; `kvpilot.tools.bench_figures` drives it in process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx
import numpy as np

_WORDS = ("once upon a time there was little girl named lily she loved to play outside in the park one day "
          "saw big red ball wanted with it but too high tom and his friend went sun happy dog cat tree bird "
          "mom said look at this they ran home good fun toy box water fish boat sky blue green").split()


@dataclass
class RequestResult:
    """Timings of one streamed request, seconds (``time.perf_counter`` differences)."""

    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


class BenchmarkError(RuntimeError):
    """The benchmark cannot run against this server at all (unreachable, or it refuses the API key):
    every request would fail the same way, so it stops with one message instead."""


def _auth_error(url: str, status: int, api_key: Optional[str]) -> BenchmarkError:
    if api_key:
        return BenchmarkError(f"{url} answered HTTP {status}: the server refused the API key "
                              f"(--api-key / KVPILOT_API_KEY)")
    return BenchmarkError(f"{url} answered HTTP {status}: the server wants an API key; "
                          f"pass --api-key KEY or set KVPILOT_API_KEY")


def make_prompts(num: int, words: int, seed: int) -> list[str]:
    """``num`` synthetic prompts of ``words`` words each (deterministic for a seed)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(words)) for _ in range(num)]


async def _one_request(client: httpx.AsyncClient, url: str, body: dict,
                       api_key: Optional[str] = None) -> RequestResult:
    """One streamed completion. Raises `BenchmarkError` on HTTP 401/403 (no request can succeed)."""
    start = time.perf_counter()
    last = None
    res = RequestResult(ok=False)
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code in (401, 403):
                raise _auth_error(url, r.status_code, api_key)
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error")
                    return res
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                # A token's chunk has text, or (token-id prompts on a server without a tokenizer, or a
                # partial UTF-8 character) empty text and no finish_reason; the finish chunk is skipped.
                if not any(c.get("text") or c.get("finish_reason") is None for c in chunk.get("choices") or []):
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                last = now
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.e2e = time.perf_counter() - start
    res.ok = last is not None
    if not res.ok:
        res.error = "no token was streamed"
    return res


async def run_serve_benchmark(url: str, model: Optional[str], prompts: list[str], concurrency: int,
                              max_tokens: int, api_key: Optional[str] = None, temperature: float = 0.0,
                              timeout: float = 600.0) -> tuple[list[RequestResult], float]:
    """Send ``prompts`` with at most ``concurrency`` in flight; returns the results and the wall time (s).

    Raises:
        BenchmarkError: the server cannot be reached, refuses the API key (HTTP 401/403), or ``model``
            is None and its ``/v1/models`` cannot say which model it serves.
    """
    base = url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) as client:
        if model is None:
            try:
                r = await client.get(base + "/models")
            except httpx.HTTPError as exc:
                raise BenchmarkError(f"cannot reach {base}/models: {type(exc).__name__}: {exc}") from None
            if r.status_code in (401, 403):
                raise _auth_error(base + "/models", r.status_code, api_key)
            try:
                data = r.json().get("data") if r.status_code == 200 else None
            except ValueError:
                data = None
            if not data:
                raise BenchmarkError(f"cannot list models at {base}/models: HTTP {r.status_code} {r.text[:200]}")
            model = data[0]["id"]
        queue: asyncio.Queue = asyncio.Queue()
        for p in prompts:
            queue.put_nowait(p)
        results: list[RequestResult] = []

        async def worker() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
                results.append(await _one_request(client, base + "/completions", body, api_key))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - start


def _dist(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    a = np.asarray(values) * 1e3
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}


def summarize(results: list[RequestResult], duration: float) -> dict:
    """Aggregate figures: latency distributions in ms, throughputs per second of wall time."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_prompt_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_token_throughput": out_tokens / duration if duration else 0.0,
        "ttft_ms": _dist([r.ttft for r in ok]),
        "tpot_ms": _dist(tpots),
        "itl_ms": _dist([x for r in ok for x in r.itls]),
        "e2e_ms": _dist([r.e2e for r in ok]),
    }


def format_summary(s: dict, concurrency: int) -> str:
    """A plain-text table of a `summarize` result."""
    lines = [f"concurrency {concurrency}: {s['completed']} requests ok, {s['failed']} failed "
             f"in {s['duration_s']:.2f} s",
             f"  request throughput      {s['request_throughput']:.2f} req/s",
             f"  output token throughput {s['output_token_throughput']:.1f} tok/s "
             f"({s['total_output_tokens']} tokens; {s['total_prompt_tokens']} prompt tokens)",
             f"  {'ms':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        d = s[key]
        lines.append(f"  {label:<6}{d['mean']:>10.2f}{d['p50']:>10.2f}{d['p90']:>10.2f}{d['p99']:>10.2f}")
    return "\n".join(lines)
