"""``kvpilot serve --tensor-parallel-size 2 --pipeline-parallel-size 2`` on CPU answers with the
single-process engine's greedy text (subprocess server, OpenAI completions API)."""

from __future__ import annotations

import httpx
import pytest

from kvpilot import LLM, SamplingParams
from kvpilot.server.launcher import ServerProcess

pytestmark = pytest.mark.timeout(180)
PROMPTS = ["Once upon a time", "The little dog"]


def test_serve_tp2_pp2_matches_single_process(stories_model_dir, tmp_path):
    with LLM(str(stories_model_dir), device="cpu") as llm:
        want = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24),
                                                        use_tqdm=False)]
    args = ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--device", "cpu",
            "--served-model-name", "stories"]
    with ServerProcess(stories_model_dir, args, log_path=tmp_path / "serve.log", startup_timeout=150) as srv:
        got = []
        for p in PROMPTS:
            r = httpx.post(srv.url + "/v1/completions", timeout=60,
                           json={"model": "stories", "prompt": p, "max_tokens": 24, "temperature": 0})
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["text"])
        assert got == want
        stream = httpx.post(srv.url + "/v1/completions", timeout=60,
                            json={"model": "stories", "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0,
                                  "stream": True})
        assert stream.status_code == 200
        assert stream.text.rstrip().endswith("data: [DONE]")
    assert "workers ready" in (tmp_path / "serve.log").read_text()
