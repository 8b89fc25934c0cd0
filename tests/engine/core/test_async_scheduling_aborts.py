"""Aborts and preemption under asynchronous scheduling (``Tuning(async_scheduling=True)``), compared with
the synchronous engine on CPU.

- An abort that reads the in-flight step (`EngineCore.abort_request`) runs on the engine thread
  outside the step's error handling: a failed read there leaves the engine serving later requests.
- Tokens read by an abort (or `fail_all`) of the in-flight step are counted in the iteration's
  ``num_generation_tokens`` (the Prometheus generation-token counter matches the synchronous engine).
- A beam request whose beam was preempted behind a request at the head of the waiting queue that does
  not fit finishes: a beam request's sequences are preempted and admitted together
  (engine/core/scheduler.py; more cases in test_beam_preemption.py)."""

from __future__ import annotations

import pytest

from kvpilot import LLM, KvCacheConfig, SamplingParams
from kvpilot.core.engine_loop import EngineLoop


@pytest.fixture(autouse=True)
def _forced_on(monkeypatch):
    monkeypatch.setenv("KVPILOT_TUNING", '{"async_scheduling": true}')


def _hand_llm(model_dir, kv_tokens=None) -> LLM:
    llm = LLM(str(model_dir), max_batch_size=6, max_num_tokens=64,
              kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=kv_tokens))
    llm._loop.stop()
    assert llm._core.async_scheduling
    return llm


class _FailingReads:
    """Wraps the engine's sampler: once ``fail`` is set, reading a launched call raises (as a device
    error surfacing at the read would)."""

    def __init__(self, sampler) -> None:
        self.sampler = sampler
        self.fail = False

    def __call__(self, logits, rows):
        return self.launch(logits, rows).finish()

    def launch(self, logits, rows):
        outer = self
        inner = self.sampler.launch(logits, rows)

        class Handle:
            tokens = inner.tokens

            def detach(self):
                inner.detach()

            @property
            def redrawn(self):
                return inner.redrawn

            def finish(self):
                if outer.fail:
                    raise RuntimeError("device error at the read")
                return inner.finish()

        return Handle()


def test_abort_whose_in_flight_read_fails_leaves_the_engine_serving(stories_model_dir):
    llm = _hand_llm(stories_model_dir)
    core = llm._core
    wrapper = _FailingReads(core.sampler)
    core.sampler = wrapper
    try:
        sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        victim = llm._make_request("Once upon a time", sp, True)
        other = llm._make_request("Tom", sp, False)
        core.add_request(victim)
        core.add_request(other)
        for _ in range(4):
            core.step()
            core.flush_outputs()
        assert core._inflight is not None and victim.seqs[0] in core._inflight.seqs
        wrapper.fail = True
        # The engine thread handles the abort before its next step.
        loop = EngineLoop(core)
        llm._loop = loop
        loop.abort(victim.request_id)
        loop.start()
        with pytest.raises(Exception):
            other.output.result(timeout=30)  # failed (the step's tokens are lost), not hung
        wrapper.fail = False
        assert loop.error is None and not loop._stopped.is_set()  # the engine thread is alive
        out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        assert out.outputs[0].text and len(out.outputs[0].token_ids) == 8
        assert core.kv.num_used_blocks == 0 and core._inflight is None
    finally:
        llm.shutdown()


@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])
def test_tokens_read_by_an_abort_are_counted_in_the_stats(stories_model_dir, async_sched):
    """Every generated token a client receives is counted once in some iteration's stats, as the
    synchronous engine does, also those an abort read from the in-flight step."""
    llm = _hand_llm(stories_model_dir)
    core = llm._core
    core.async_scheduling = async_sched
    try:
        sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        reqs = [llm._make_request(p, sp, False) for p in ("Once upon a time", "Tom", "The dog")]
        for r in reqs:
            core.add_request(r)
        counted = 0
        for _ in range(6):
            counted += core.step().num_generation_tokens
            core.flush_outputs()
        assert (core._inflight is not None) == async_sched
        core.abort_request(reqs[0].request_id)
        counted += core.idle_stats().num_generation_tokens  # what the engine loop reports after an abort
        while core.has_work:
            counted += core.step().num_generation_tokens
        core.flush_outputs()
        aborted = reqs[0].output
        delivered = sum(len(d.new_token_ids) for u in aborted._updates for d in u.deltas)
        delivered += sum(len(r.output.result(timeout=0).outputs[0].token_ids) for r in reqs[1:])
    finally:
        llm.shutdown()
    assert delivered == 6 + 30 + 30 and counted == delivered


def test_beam_request_preempted_behind_a_request_that_does_not_fit_finishes(stories_model_dir, monkeypatch):
    monkeypatch.setenv("KVPILOT_TUNING", '{"async_scheduling": false}')  # the synchronous engine hangs the same way
    llm = LLM(str(stories_model_dir), max_batch_size=8, max_num_tokens=64,
              kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=128))
    llm._loop.stop()
    core = llm._core
    try:
        mix = [("Tom", SamplingParams(temperature=1.0, seed=9, top_p=0.5, max_tokens=60, repetition_penalty=1.3,
                                      presence_penalty=0.5)),
               ("Lily", SamplingParams(temperature=0, max_tokens=30, use_beam_search=True, n=2, best_of=3)),
               ("", SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))]
        reqs = [llm._make_request(p, sp, False) for p, sp in mix]
        for r in reqs:
            core.add_request(r)
        idle, last = 0, 0
        while core.has_work and idle < 30:  # 30 steps in a row without a new token: livelocked
            core.step()
            core.flush_outputs()
            total = sum(len(s.token_ids) for r in reqs for s in r.seqs)
            idle, last = (idle + 1 if total == last else 0), total
        assert core.scheduler.num_preemptions > 0
        assert not core.has_work, (len(core.scheduler.waiting), len(core.scheduler.running))
        for r in reqs:
            r.output.result(timeout=0)
    finally:
        llm.shutdown()
