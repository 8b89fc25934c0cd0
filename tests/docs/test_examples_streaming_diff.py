"""The streaming examples print each chunk's new text (`text_diff`), so their output reads once.

Printing the cumulative `text` on every chunk repeats the story from its start at each step; the
printed stream is then much longer than the final text and begins with the first chunk's text
twice.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(name: str, model_dir: Path, cwd: Path) -> str:
    env = dict(os.environ, KVPILOT_MODEL=str(model_dir))
    proc = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py")], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_streaming_example_prints_each_piece_once(stories_model_dir, tmp_path):
    out = _run("streaming", stories_model_dir, tmp_path)
    streamed, _, tail = out.partition("\n--- Generation complete ---\n")
    assert tail.startswith("Total tokens: "), out[-500:]
    n_tokens = int(tail.split()[2])
    assert n_tokens > 20  # long enough that cumulative printing would be quadratic
    # stories260K's tok512 pieces are at most a few characters: 8 per token is a generous bound,
    # and cumulative printing of n tokens gives about n/2 times the text.
    assert 0 < len(streamed) <= 8 * n_tokens, (len(streamed), n_tokens)


def test_generate_methods_streams_the_text_once(stories_model_dir, tmp_path):
    out = _run("generate_methods", stories_model_dir, tmp_path)
    # Two prompts of at most 32 tokens (SamplingParams' default) with their prompt lines, then one
    # stream of at most 128 tokens: at most 8 characters a token, plus the prompt lines.
    assert "Prompt 1" in out and "Prompt 2" in out
    assert len(out) <= 8 * (32 + 32 + 128) + 40, len(out)
