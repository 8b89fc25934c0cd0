"""The README's "Environment variables" table is the registry of `kvpilot.envs`: the same names in
the same order, each row as `envs.markdown_table` writes it; no other ``KVPILOT_*`` name appears in
the README."""

from __future__ import annotations

import re
from pathlib import Path

from kvpilot import envs

README = Path(__file__).resolve().parents[2] / "README.md"


def _section() -> str:
    text = README.read_text()
    start = text.index("## Environment variables")
    return text[start:text.index("\n## ", start + 1)]


def test_readme_env_table_is_the_registry():
    rows = [line for line in _section().splitlines() if line.startswith("| `KVPILOT_")]
    names = [re.match(r"\| `(KVPILOT_\w+)`", row).group(1) for row in rows]
    assert names == list(envs.REGISTRY)
    assert "\n".join(line for line in _section().splitlines() if line.startswith("|")) == envs.markdown_table()


def test_readme_names_no_other_kvpilot_variable():
    named = set(re.findall(r"\bKVPILOT_[A-Z0-9_]+", README.read_text()))
    assert named <= set(envs.REGISTRY), sorted(named - set(envs.REGISTRY))
