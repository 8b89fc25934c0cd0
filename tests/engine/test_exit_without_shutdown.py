"""A script that never calls `LLM.shutdown()` exits cleanly: the engine is shut down at exit.

The engine freezes its start-up heap (`gc.freeze`); objects left in the permanent generation are
not collected while the interpreter finalizes, and Triton's nanobind bindings then print
``nanobind: leaked ...`` lines. `kvpilot.llm._shutdown_at_exit` shuts engines down and unfreezes.
"""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import sys
from kvpilot import LLM, SamplingParams
llm = LLM(model=sys.argv[1])
out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=8, temperature=0))
print("generated", len(out[0].outputs[0].token_ids))
"""


def test_script_without_shutdown_leaks_nothing_at_exit(stories_model_dir, tmp_path):
    # Without the interpreter: the compiled-kernel path is the one whose objects leaked.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(stories_model_dir)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "generated 8" in proc.stdout
    assert "leaked" not in proc.stderr, proc.stderr[-3000:]


def test_shutdown_removes_the_engine_from_the_exit_list(stories_model_dir):
    from kvpilot import LLM
    from kvpilot import llm as llm_module

    llm = LLM(model=str(stories_model_dir))
    try:
        assert llm in llm_module._live_engines
    finally:
        llm.shutdown()
    assert llm not in llm_module._live_engines
