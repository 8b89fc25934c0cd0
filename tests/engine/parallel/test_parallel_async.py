"""Asynchronous tensor-parallel steps (`MultiprocExecutor.defers_logits`) on CPU (gloo), TP 2.

The front end plans and sends step N+1 before it samples step N; the output rank waits for step N's
ids (a "go" message) and broadcasts the input ids to the other rank. Each test drives
`EngineCore.step` by hand (as tests/engine/core/test_async_scheduling.py does) and compares the
asynchronous engine with the synchronous one on the same `LLM`: token ids, text and finish reasons
exactly, log-probabilities to float32 rounding; and checks that steps really were planned ahead
(an ``execute`` of step N+1 before the logits of step N were awaited).
"""

from __future__ import annotations

import time

import pytest
from support.async_engine import _choice
from support.async_engine import _FILTERED, _MIX, _PENALTIES, _assert_same, _drain, _minus_ones

from kvpilot import LLM, KvCacheConfig, SamplingParams
from kvpilot.tuning import Tuning

pytestmark = pytest.mark.timeout(300)

# Requests whose steps may all be deferred (no beams, prompt logprobs or generation logits).
_DEFERRABLE = [r for r in _MIX if not (r[1].use_beam_search or r[1].prompt_logprobs is not None
                                       or r[1].return_generation_logits)]


class _Calls:
    """Wraps the executor: the order of execute / await_logits / publish_tokens calls."""

    def __init__(self, executor) -> None:
        self.executor = executor
        self.calls: list[str] = []

    def __getattr__(self, name):
        return getattr(self.executor, name)

    def __setattr__(self, name, value):
        if name == "own_ids_hint":  # the engine's per-step hint goes to the executor
            setattr(self.executor, name, value)
        else:
            super().__setattr__(name, value)

    def execute(self, plan):
        self.calls.append("x" + ("i" if any(p.inflight_row >= 0 for p in plan) else ""))
        return self.executor.execute(plan)

    def await_logits(self):
        self.calls.append("a")
        return self.executor.await_logits()

    def publish_tokens(self, tokens):
        self.calls.append("p")
        return self.executor.publish_tokens(tokens)

    def planned_ahead(self) -> int:
        """Executes sent while the previous step's logits were not awaited yet."""
        n, pending = 0, 0
        for c in self.calls:
            if c.startswith("x"):
                n += pending > 0
                pending += 1
            elif c == "a":
                pending -= 1
        return n


def _run(llm, mix, async_sched: bool):
    core = llm._core
    core.async_scheduling = async_sched
    calls = _Calls(core.executor)
    core.executor = calls
    try:
        reqs = [llm._make_request(p, sp, s) for p, sp, s in mix]
        for r in reqs:
            core.add_request(r)
        _drain(core)
    finally:
        core.executor = calls.executor
    assert core.kv.num_used_blocks == 0 and not core.requests and core._inflight is None
    ex = core.executor
    assert ex._unpublished == 0 and not ex._sent and not ex._go_pending  # every step awaited and published
    res = []
    for r in reqs:
        o = r.output
        chunks = [[(c.token_ids_diff, c.text_diff) for c in chunk.outputs] for chunk in o] if o.streaming else []
        if not o.streaming:
            o.result(timeout=0)
        gl = [None if c.generation_logits is None else c.generation_logits.tolist() for c in o.outputs]
        res.append((_choice(o), chunks, gl))
    return res, calls


@pytest.fixture(scope="module")
def tp_llm(stories_model_dir):
    mp = pytest.MonkeyPatch()
    mp.setenv("KVPILOT_TUNING", '{"async_scheduling": true}')
    try:
        llm = LLM(str(stories_model_dir), tensor_parallel_size=2, device="cpu", max_batch_size=6,
                  max_num_tokens=64, kv_cache_config=KvCacheConfig(tokens_per_block=16))
    finally:
        mp.undo()
    llm._loop.stop()
    assert llm._executor.defers_logits and llm._core.async_scheduling
    yield llm
    t0 = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("mix", [_DEFERRABLE, _PENALTIES, _MIX], ids=["deferrable", "penalties", "full_mix"])
def test_async_tp2_matches_the_synchronous_tp2(tp_llm, mix):
    (sync, sc), (asyn, ac) = _run(tp_llm, mix, False), _run(tp_llm, mix, True)
    assert sc.planned_ahead() == 0 and "xi" not in sc.calls
    assert ac.planned_ahead() > 5 and "xi" in ac.calls
    _assert_same(mix, sync, asyn)


def test_async_tp2_matches_one_process(tp_llm, stories_model_dir, monkeypatch):
    monkeypatch.setenv("KVPILOT_TUNING", '{"async_scheduling": true}')
    greedy = [(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), False)
              for p in ("Once upon a time", "The little dog", "", "Tom and Sue")]
    self_steps = tp_llm._executor.num_self_steps
    asyn, calls = _run(tp_llm, greedy, True)
    assert calls.planned_ahead() > 30
    # Plain greedy rows: the output rank's own arg-max fed most steps (no wait for the front end).
    assert tp_llm._executor.num_self_steps - self_steps > 30
    with LLM(str(stories_model_dir), device="cpu", max_batch_size=6, max_num_tokens=64,
             kv_cache_config=KvCacheConfig(tokens_per_block=16)) as one:
        ref = [o.outputs[0].token_ids for o in one.generate([p for p, _, _ in greedy], greedy[0][1])]
    assert [r[0][0][0] for r in asyn] == ref


def test_redrawn_rows_are_rolled_back_on_tp2(tp_llm, monkeypatch):
    """Rows the sampler leaves to the host (-1 on the device) reach the output rank as -1: it clamps
    them, and the engine drops that row and computes the position again."""
    (sync, _), _ = _run(tp_llm, _FILTERED, False), None
    _minus_ones(monkeypatch)
    asyn, calls = _run(tp_llm, _FILTERED, True)
    assert calls.planned_ahead() > 5
    _assert_same(_FILTERED, sync, asyn)


@pytest.mark.parametrize("kind", ["go", "self", "self_sampled"])
def test_a_failed_step_is_abandoned_and_the_engine_keeps_serving(tp_llm, monkeypatch, kind):
    core = tp_llm._core
    core.async_scheduling = True
    # go: logprobs, the front end samples; self: the output rank's arg-max; self_sampled: its sampler.
    greedy = kind != "go"
    sp = SamplingParams(temperature=0 if kind == "self" else 0.8, seed=3, max_tokens=30, ignore_eos=True,
                        logprobs=1 if kind == "go" else None)
    sampled0 = core.executor.num_rank_sampled_steps
    req = tp_llm._make_request("Once upon a time", sp, False)
    core.add_request(req)
    for _ in range(4):
        core.step()
        core.flush_outputs()
    ex = core.executor
    assert core._inflight is not None and core._inflight.handle is None  # a deferred step in flight
    real = core._resolve_inflight
    monkeypatch.setattr(core, "_resolve_inflight", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        core.step()  # the next plan was sent (it waits for ids); then the read failed
    # Rows with logprobs: the output rank waits for the front end's ids; the others: it has its own.
    assert ex._go_pending != greedy and ex._unpublished == 2
    monkeypatch.setattr(core, "_resolve_inflight", real)
    core.fail_all(RuntimeError("boom"))
    core.flush_outputs()
    assert not ex._go_pending and ex._unpublished == 0 and all(e[2] for e in ex._sent)
    with pytest.raises(Exception):
        req.output.result(timeout=0)
    again = tp_llm._make_request("Once upon a time", sp, False)
    core.add_request(again)
    _drain(core)
    assert not ex._sent and ex._unpublished == 0
    assert (ex.num_rank_sampled_steps - sampled0 > 25) == (kind == "self_sampled")  # the output rank drew them
    sync, _ = _run(tp_llm, [("Once upon a time", sp, False)], False)
    assert again.output.result(timeout=0).outputs[0].token_ids == sync[0][0][0][0]


def test_step_timing_between_asynchronous_steps(stories_model_dir, monkeypatch):
    """A timing request while a step's answer is due (and, for the output rank, while it waits for
    the ids of the step before) is answered without losing the step."""
    monkeypatch.setenv("KVPILOT_TUNING", '{"async_scheduling": true, "step_timing": true}')
    with LLM(str(stories_model_dir), tensor_parallel_size=2, device="cpu", max_batch_size=4) as llm:
        llm._loop.stop()
        core, ex = llm._core, llm._executor
        sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        req = llm._make_request("The little dog", sp, False)
        core.add_request(req)
        timings = 0
        while core.has_work:
            core.step()
            core.flush_outputs()
            if ex._sent:
                time.sleep(0.05)  # the answer is in the pipe before the timing request
                t = ex.step_timing()
                timings += 1
                assert set(t["ranks"]) == {0, 1}
        got = req.output.result(timeout=0).outputs[0].token_ids
        assert timings > 10 and ex._stash == []
        core.async_scheduling = False
        ref = llm._make_request("The little dog", sp, False)
        core.add_request(ref)
        _drain(core)
    assert got == ref.output.result(timeout=0).outputs[0].token_ids


def test_switch(stories_model_dir):
    with LLM(str(stories_model_dir), tensor_parallel_size=2, device="cpu", max_batch_size=2,
             tuning=Tuning(tp_async=False)) as llm:
        assert not llm._executor.defers_logits and not llm._executor.supports_async_scheduling
        assert llm.generate("Once", SamplingParams(temperature=0, max_tokens=4)).outputs[0].token_ids
    with LLM(str(stories_model_dir), pipeline_parallel_size=2, device="cpu", max_batch_size=2) as llm:
        assert not llm._executor.defers_logits  # pipeline stages keep settled steps
