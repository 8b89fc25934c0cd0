"""`kvpilot bench serve`'s arithmetic and command line (the run against a live server is in
test_server_openai.py, which already has one)."""

from __future__ import annotations

import argparse

import pytest

from kvpilot.tools.bench import RequestResult, configure_parser, format_summary, make_prompts, run, summarize


def test_prompts_are_deterministic():
    a = make_prompts(3, 5, seed=4)
    assert a == make_prompts(3, 5, seed=4) != make_prompts(3, 5, seed=5)
    assert [len(p.split()) for p in a] == [5, 5, 5]


def test_summarize_exact():
    results = [
        RequestResult(ok=True, ttft=0.1, e2e=1.1, itls=[0.2, 0.3], output_tokens=3, prompt_tokens=4),
        RequestResult(ok=True, ttft=0.3, e2e=0.5, itls=[0.1], output_tokens=2, prompt_tokens=4),
        RequestResult(ok=False, error="HTTP 500"),
    ]
    s = summarize(results, duration=2.0)
    assert (s["completed"], s["failed"], s["total_output_tokens"], s["total_prompt_tokens"]) == (2, 1, 5, 8)
    assert s["output_token_throughput"] == pytest.approx(2.5)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["ttft_ms"]["p90"] == pytest.approx(280.0)  # linear interpolation between 100 and 300
    assert s["itl_ms"]["p50"] == pytest.approx(200.0)
    # TPOT per request: (1.1 - 0.1) / 2 = 0.5 s and (0.5 - 0.3) / 1 = 0.2 s
    assert s["tpot_ms"]["mean"] == pytest.approx(350.0)
    assert s["e2e_ms"]["p99"] == pytest.approx(500 + 0.99 * 600)
    table = format_summary(s, concurrency=4)
    assert "concurrency 4: 2 requests ok, 1 failed" in table and "2.5 tok/s" in table


def test_cli_parsing():
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    args = parser.parse_args(["serve", "--url", "http://x", "--concurrency", "1", "8", "32", "--num-prompts", "5"])
    assert (args.concurrency, args.num_prompts, args.max_tokens, args.prompt_len) == ([1, 8, 32], 5, 128, 32)
    assert run(parser.parse_args([])) == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["serve"])  # --url is required
