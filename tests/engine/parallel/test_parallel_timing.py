"""``Tuning(step_timing=True)``: the front end and every worker record per-phase step times, and the
engine's greedy output stays that of the single-process engine."""

from __future__ import annotations

import pytest
from support.engine import make_tiny_llama
from support.parallel import TINY_PROMPTS, run_tiny_workload

from kvpilot import LLM

pytestmark = pytest.mark.timeout(180)


def test_step_timing_phases_and_counts(tmp_path, monkeypatch):
    model = make_tiny_llama(tmp_path / "tiny", seed=5, vocab=385, layers=2)
    with LLM(str(model), skip_tokenizer_init=True, device="cpu") as llm:
        ref = run_tiny_workload(llm)
    monkeypatch.setenv("KVPILOT_TUNING", '{"step_timing": true}')
    with LLM(str(model), skip_tokenizer_init=True, pipeline_parallel_size=2, device="cpu") as llm:
        steps = []
        llm.add_stat_logger(lambda s: steps.append(s))
        got = run_tiny_workload(llm)
        timing = llm._executor.step_timing(reset=True)
        after = llm._executor.step_timing()
    assert got[0] == ref[0]
    assert got[1] == pytest.approx(ref[1], abs=1e-4)
    n = len(steps)
    assert n >= 24  # prefill plus one step per generated token at least
    front = timing["front_end"]
    assert set(front) == {"send", "wait_answer", "logits", "execute", "host_between_steps"}
    assert front["execute"]["n"] == n
    assert front["host_between_steps"]["n"] == n - 1
    assert front["execute"]["mean_ms"] >= front["wait_answer"]["mean_ms"] > 0
    assert sorted(timing["ranks"]) == [0, 1]
    assert set(timing["ranks"][0]) == {"idle", "recv", "prepare_launch"}
    assert set(timing["ranks"][1]) == {"idle", "recv", "prepare_launch", "answer"}  # the output rank
    assert all(p["n"] == n for r in timing["ranks"].values() for p in r.values())
    assert after == {"front_end": {}, "ranks": {0: {}, 1: {}}}  # reset cleared every process
    assert len(TINY_PROMPTS) == 4
