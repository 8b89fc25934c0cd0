"""`make demo`: convert stories260K, run the API documentation's quick start through the Python API, then (when
the server is installed) start `kvpilot serve` and talk to it with the official `openai` client."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main() -> None:
    from _model import MODEL

    print(f"== model: {MODEL}\n")
    print("== the API documentation's Quick Start (Python API)\n")
    runpy.run_path(str(HERE / "quickstart.py"), run_name="__main__")
    from kvpilot import LLM, SamplingParams

    with LLM(model=MODEL) as llm:
        out = llm.generate("", SamplingParams(temperature=0, max_tokens=60))
        print(f"greedy from BOS: {out.outputs[0].text!r}\n")
    server_demo = HERE / "demo_server.py"
    if server_demo.exists():
        print("== the OpenAI-compatible server\n")
        runpy.run_path(str(server_demo), run_name="__main__")


if __name__ == "__main__":
    main()
