"""Paths of the repository a test reads (examples, charts, benchmarks), independent of where the test file lies."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
BENCHMARKS = REPO / "benchmarks"
EXAMPLES = REPO / "examples"
