"""`make demo`: start `kvpilot serve` on the stories260K model, call it with the openai client, stop it.

Sends one completion and one streamed chat request and prints them. stories260K has no chat
template, so the server gets kvpilot's bundled `plain` one (the messages' contents, in order).
Run it with the project's interpreter: `.venv/bin/python examples/demo_server.py`.
"""

from __future__ import annotations

import logging
import sys
import time

import openai

from kvpilot.tools.convert_llama2c import ensure_stories260k
from kvpilot.server.launcher import ServerProcess


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per HTTP request
    model_dir = ensure_stories260k()
    t0 = time.monotonic()
    with ServerProcess(model_dir, ["--served-model-name", "stories260K", "--chat-template", "plain"]) as srv:
        print(f"kvpilot serve is up at {srv.url} after {time.monotonic() - t0:.1f} s")
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused")

        completion = client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=60,
                                               temperature=0)
        print("\n== POST /v1/completions (prompt 'Once upon a time', greedy) ==")
        print("Once upon a time" + completion.choices[0].text)
        print(f"[finish_reason={completion.choices[0].finish_reason}, usage={completion.usage.model_dump()}]")

        print("\n== POST /v1/chat/completions, streamed (one empty user message = BOS only, greedy) ==")
        stream = client.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": ""}],
                                                max_completion_tokens=80, temperature=0, stream=True,
                                                stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
            if chunk.usage is not None:
                print(f"\n[usage={chunk.usage.model_dump()}]")
        print("\nstopping the server (SIGTERM: drain, then exit)")
    print(f"server exited with code {srv.proc.returncode}")
    return 0 if srv.proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
