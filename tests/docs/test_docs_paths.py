"""Every repository file that docs/*.md names exists (a moved test or script is renamed in the docs too)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATH = re.compile(r"\b((?:tests|benchmarks|engine|kernels|operator|examples|images|charts|crds|docs)/"
                  r"[A-Za-z0-9_./-]+\.(?:py|md|yaml|json|png|sh|jinja|Dockerfile))\b")
DOCS = sorted((ROOT / "docs").glob("*.md"))


def test_docs_are_found():
    assert {"serving.md", "kernels.md", "operator.md", "parallelism.md"} <= {d.name for d in DOCS}


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_cited_files_exist(doc):
    cited = set(PATH.findall(doc.read_text(encoding="utf-8")))
    missing = sorted(p for p in cited if not (ROOT / p).exists())
    assert not missing, f"{doc.name} names files that do not exist: {missing}"
