"""Every benchmark script the repository's text cites (README, docs, BENCHMARKS.md, code, tests)
exists, so does every test file BENCHMARKS.md and benchmarks/ cite, and the commands of
BENCHMARKS.md's results table are `kvpilot bench` figures."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
_CITED = re.compile(r"benchmarks/[A-Za-z0-9_./-]*[A-Za-z0-9_]\.(?:py|sh|json|md)")
_ROOTS = ("README.md", "BENCHMARKS.md", "Makefile", "docs", "engine", "kernels", "operator", "tests", "benchmarks",
          "examples", "tools", "charts", "images")


def _text_files():
    for root in _ROOTS:
        p = REPO / root
        if p.is_file():
            yield p
        elif p.is_dir():
            for f in p.rglob("*"):
                if f.suffix in (".py", ".md", ".sh", ".txt", ".yaml") and f.is_file() and "__pycache__" not in f.parts:
                    yield f


def test_every_cited_benchmark_script_exists():
    missing = []
    for f in _text_files():
        for m in _CITED.finditer(f.read_text(errors="replace")):
            if not (REPO / m.group(0)).exists():
                missing.append(f"{f.relative_to(REPO)}: {m.group(0)}")
    assert not missing, "cited but absent:\n" + "\n".join(sorted(set(missing)))


def test_test_files_cited_by_the_benchmarks_exist():
    cited = re.compile(r"tests/[A-Za-z0-9_/]*[A-Za-z0-9_]\.py")
    missing = []
    for f in [REPO / "BENCHMARKS.md", *(REPO / "benchmarks").rglob("*.py"), *(REPO / "benchmarks").rglob("*.md")]:
        for m in cited.finditer(f.read_text()):
            if not (REPO / m.group(0)).exists():
                missing.append(f"{f.relative_to(REPO)}: {m.group(0)}")
    assert not missing, "cited but absent:\n" + "\n".join(sorted(set(missing)))


def test_results_table_commands_are_kvpilot_bench_figures():
    from kvpilot.tools.bench_figures import FIGURES

    text = (REPO / "BENCHMARKS.md").read_text()
    table = text.split("## Current results", 1)[1].split("\n# History", 1)[0]
    figures = set(re.findall(r"kvpilot bench ([a-z0-9-]+)", table))
    assert {"all", "decode-b1", "offline", "offline-bf16", "batch64", "http", "ttft", "capacity"} <= figures
    assert figures - {"all", "serve", "latency", "throughput"} <= set(FIGURES), figures - set(FIGURES)
