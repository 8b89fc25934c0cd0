"""Paths of the repository a test reads (examples, charts, benchmarks), independent of where the test file lies."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
BENCHMARKS = REPO / "benchmarks"
BENCHMARK_LAB = BENCHMARKS / "lab"
EXAMPLES = REPO / "examples"
TOOLS = REPO / "tools"


def load_benchmark(name: str) -> ModuleType:
    """Import ``benchmarks/<name>.py``, else ``benchmarks/lab/<name>.py``, by its path (tests that check
    a benchmark script, or reuse a GPU harness of one), without putting benchmarks/ on ``sys.path``. The module is registered under
    ``name`` (dataclasses and pickling look it up there); loaded once per process."""
    if name in sys.modules:
        return sys.modules[name]
    path = BENCHMARKS / f"{name}.py"
    if not path.is_file():
        path = BENCHMARK_LAB / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
