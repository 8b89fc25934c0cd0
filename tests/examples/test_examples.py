"""The seed's API examples in examples/ run as written (each in its own process) against stories260K.

The seed's API is the contract, so its examples are executed, not just imported: each must exit 0
and print what it generated.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support.paths import EXAMPLES

EXAMPLES = EXAMPLES
# name -> (stdin, a string its output must contain)
CASES = {
    "quickstart": (None, "Generated:"),
    "quickstart_async": (None, ""),
    "generate_methods": (None, ""),
    "sampling_params": (None, ""),
    "stats": (None, ""),
    "streaming": (None, ""),
    "context_manager": (None, ""),
    "kv_cache_config": (None, "KV pool:"),
    "chatbot": ("Hello there\nquit\n", "Chatbot ready!"),
    "lora": (None, "adapter2: "),
}


def test_every_example_is_covered():
    scripts = {p.stem for p in EXAMPLES.glob("*.py")} - {"_model", "demo", "demo_server"}
    assert scripts == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_runs(name, stories_model_dir, tmp_path):
    stdin, expect = CASES[name]
    env = dict(os.environ, KVPILOT_MODEL=str(stories_model_dir))
    # cwd outside the repository: its top-level operator/ would shadow the standard library's.
    proc = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py")], input=stdin, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip(), f"{name} printed nothing"
    assert expect in proc.stdout
