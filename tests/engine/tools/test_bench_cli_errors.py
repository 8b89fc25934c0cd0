"""`kvpilot bench` errors are one line: `bench serve` against a server with an API key (the key from --api-key or
$KVPILOT_API_KEY; a refusal, HTTP 401, is one line, not a traceback) and offline benchmarks with bad arguments."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpilot.server.launcher import ServerProcess, free_port

KVPILOT = str(Path(sys.executable).with_name("kvpilot"))


@pytest.fixture(scope="module")
def keyed_server(stories_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("bench-auth") / "server.log"
    with ServerProcess(stories_model_dir, ["--api-key", "s3cret", "--served-model-name", "stories260K"],
                       log_path=log) as srv:
        yield srv


def _bench(url: str, *extra: str, key_env: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KVPILOT_API_KEY"}
    if key_env is not None:
        env["KVPILOT_API_KEY"] = key_env
    return subprocess.run([KVPILOT, "bench", "serve", "--url", url, "--num-prompts", "2", "--max-tokens", "4",
                           "--warmup", "0", *extra], capture_output=True, text=True, timeout=120, cwd="/", env=env)


def _one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def test_no_key_is_one_line_naming_the_flag_and_variable(keyed_server):
    proc = _bench(keyed_server.url)
    assert proc.returncode == 1
    line = _one_line(proc.stderr)
    assert "HTTP 401" in line and "--api-key" in line and "KVPILOT_API_KEY" in line


def test_no_key_with_a_named_model_also_stops_at_the_first_request(keyed_server):
    proc = _bench(keyed_server.url, "--model", "stories260K")
    assert proc.returncode == 1
    assert "/v1/completions answered HTTP 401" in _one_line(proc.stderr)


def test_wrong_key_is_refused_in_one_line(keyed_server):
    proc = _bench(keyed_server.url, "--api-key", "wrong")
    assert proc.returncode == 1
    assert "refused the API key" in _one_line(proc.stderr)


def test_key_from_the_environment(keyed_server):
    proc = _bench(keyed_server.url, key_env="s3cret")
    assert proc.returncode == 0, proc.stderr
    assert "concurrency 1: 2 requests ok, 0 failed" in proc.stdout


def test_key_from_the_flag(keyed_server):
    proc = _bench(keyed_server.url, "--api-key", "s3cret")
    assert proc.returncode == 0, proc.stderr
    assert "2 requests ok" in proc.stdout


def test_unreachable_server_is_one_line():
    proc = _bench(f"http://127.0.0.1:{free_port()}")
    assert proc.returncode == 1
    assert "cannot reach" in _one_line(proc.stderr)


def test_offline_benchmark_bad_arguments_are_one_line(stories_model_dir):
    """`kvpilot bench latency` on stories260K (512 positions) with 1,000 + 1,000 tokens: one line."""
    proc = subprocess.run([KVPILOT, "bench", "latency", "--model", str(stories_model_dir), "--device", "cpu",
                           "--input-len", "1000", "--output-len", "1000"], capture_output=True, text=True,
                          timeout=120, cwd="/")
    assert proc.returncode == 1
    problems = "\n".join(ln for ln in proc.stderr.splitlines() if " INFO " not in ln)  # the engine's start-up log
    assert "kvpilot bench: max_seq_len 2000 is beyond this model's 512 positions" in _one_line(problems)
