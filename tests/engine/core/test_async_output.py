"""Asynchronous output processing (engine_core's fast/slow split): the same results as the
synchronous engine (``Tuning(async_output=False)``), dropped tokens after late stop strings, aborts
between the two parts, and final results that never wait for another step.

The tests drive an `EngineCore` by hand on the test thread (its loop thread is stopped), so that
every step is known and both modes see the same submissions; the threaded loop runs the new default
path in every other engine, sampling and server test.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from support.engine import GOLDEN
from kvpilot import LLM, KvCacheConfig, RequestAborted, SamplingParams
from kvpilot.core.detokenizer import hold_back_len
from kvpilot.core.engine_core import EngineCore
from kvpilot.tuning import Tuning
from support.async_engine import _choice, _close

GREEDY_LONG = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(stories_model_dir):
    """An LLM whose core the tests drive by hand (the engine thread is stopped)."""
    llm = LLM(str(stories_model_dir), max_batch_size=8, kv_cache_config=KvCacheConfig(tokens_per_block=16))
    llm._loop.stop()
    yield llm
    close = getattr(llm._executor, "shutdown", None)
    if close is not None:
        close()


class _Recorder:
    """Wraps the executor: the seq ids of every step's plan."""

    def __init__(self, executor) -> None:
        self.executor = executor
        self.plans: list[list[int]] = []

    def __getattr__(self, name):
        return getattr(self.executor, name)

    def execute(self, plan):
        self.plans.append([p.seq_id for p in plan])
        return self.executor.execute(plan)


@pytest.fixture
def core(llm):
    core = llm._core
    rec = _Recorder(core.executor)
    core.executor = rec
    saved = core.async_output
    yield core
    core.executor = rec.executor
    core.async_output = saved
    assert not core.has_work and not core._pending and core.kv.num_used_blocks == 0


def _step(core) -> None:
    core.step()
    core.flush_outputs()


def _drain(core) -> int:
    steps = 0
    while core.has_work:
        _step(core)
        steps += 1
    return steps


def _updates(out) -> list:
    """The updates pushed to a handle so far (consumed: the handle applies them)."""
    ups = list(out._updates)
    out._apply_all()
    return ups


def test_tuning_switch(monkeypatch):
    """On by default; ``Tuning(async_output=False)`` (or ``KVPILOT_TUNING``, read by `LLM`) turns it
    off; the constructor argument wins over both."""
    ex = SimpleNamespace(num_blocks=8, block_size=4)
    assert EngineCore(ex, None, [0], 16, 2, 32, True).async_output
    assert not EngineCore(ex, None, [0], 16, 2, 32, True, tuning=Tuning(async_output=False)).async_output
    assert EngineCore(ex, None, [0], 16, 2, 32, True, async_output=True, tuning=Tuning(async_output=False)).async_output
    monkeypatch.setenv("KVPILOT_TUNING", '{"async_output": false}')
    assert Tuning.from_env() == Tuning(async_output=False)


@pytest.mark.parametrize("streaming", [True, False])
def test_stop_string_found_late_drops_the_next_token(llm, core, streaming):
    sp = SamplingParams(temperature=0, max_tokens=60, stop=["Lily"])
    results, plans = {}, {}
    for mode in (False, True):
        core.async_output = mode
        core.executor.plans.clear()
        req = llm._make_request("", sp, streaming)
        other = llm._make_request("Once upon a time", GREEDY_LONG, False)  # keeps the batch busy
        core.add_request(req)
        core.add_request(other)
        ups = []
        while not req.output._done_received:
            _step(core)
            ups.extend(_updates(req.output))
        _drain(core)
        _updates(req.output)
        results[mode] = (_choice(req.output), ups)
        plans[mode] = sum(req.seqs[0].seq_id in p for p in core.executor.plans)
    (sync, sync_ups), (asyn, asyn_ups) = results[False], results[True]
    assert asyn == sync
    token_ids, text, reason, stop_reason = sync[0][:4]
    assert text == GOLDEN[:GOLDEN.index("Lily")]
    assert (reason, stop_reason) == ("stop", "Lily")
    # The last token is the one that completed "Lily": nothing after it was kept.
    assert "Lily" in llm.tokenizer.decode(token_ids) and "Lily" not in llm.tokenizer.decode(token_ids[:-1])
    # The sequence ran one more step in the asynchronous engine (its token there was dropped).
    assert plans[False] == len(token_ids) and plans[True] == len(token_ids) + 1
    for ups in (sync_ups, asyn_ups):
        sent = [t for u in ups for d in u.deltas for t in d.new_token_ids]
        assert sent == token_ids
        assert "".join(d.new_text for u in ups for d in u.deltas) == text
        assert [u.finished for u in ups] == [False] * (len(ups) - 1) + [True]
    if streaming:  # a chunk per token, the asynchronous one a step later
        assert len(sync_ups) == len(asyn_ups) >= len(token_ids) - 1


def test_stop_string_on_the_last_allowed_token_wins_over_length(llm, core):
    full = llm._make_request("", SamplingParams(temperature=0, max_tokens=60, stop=["Lily"]), False)
    core.async_output = False
    core.add_request(full)
    _drain(core)
    _updates(full.output)
    n = len(full.output.outputs[0].token_ids)
    for mode in (False, True):
        core.async_output = mode
        req = llm._make_request("", SamplingParams(temperature=0, max_tokens=n, stop=["Lily"]), True)
        core.add_request(req)
        _drain(core)
        _updates(req.output)
        assert _choice(req.output) == _choice(full.output)
        assert req.output.outputs[0].stop_reason == "Lily"


@pytest.mark.parametrize("streaming", [True, False])
def test_abort_between_the_two_parts(llm, core, streaming):
    # "girl named Bob" is never generated, but "girl" and "girl named" are held back while pending.
    sp = SamplingParams(temperature=0, max_tokens=60, stop=["girl named Bob"])
    probe = llm._make_request("", sp, True)
    core.async_output = False
    core.add_request(probe)
    k, text = 0, ""
    while True:  # the first step after which the text ends in a held-back prefix
        _step(core)
        k += 1
        text = probe.seqs[0].text
        if hold_back_len(text, sp.stop):
            break
    core.abort_request(probe.request_id)
    core.flush_outputs()
    _updates(probe.output)

    results = {}
    for mode in (False, True):
        core.async_output = mode
        req = llm._make_request("", sp, streaming)
        other = llm._make_request("Once upon a time", SamplingParams(temperature=0, max_tokens=30), True)
        core.add_request(req)
        core.add_request(other)
        for _ in range(k):
            _step(core)
        if mode:  # really between the two parts: the last token's output work is still to do
            assert [e.seq for e in core._pending if e.seq.request is req] == req.seqs
        core.abort_request(req.request_id)
        core.flush_outputs()
        ups = _updates(req.output)
        with pytest.raises(RequestAborted):
            req.output._raise_if_failed()
        _drain(core)
        _updates(other.output)
        results[mode] = (_choice(req.output), _choice(other.output), [t for u in ups for d in u.deltas
                                                                       for t in d.new_token_ids])
    assert results[True] == results[False]
    (token_ids, got, reason, _stop, _lp, _lps), = results[True][0]
    assert reason == "abort" and len(token_ids) == k
    assert got == text[:len(text) - hold_back_len(text, sp.stop)] and GOLDEN.startswith(got) and got
    if not streaming:
        assert results[True][2] == token_ids  # everything in the one final update


def test_abort_after_a_pending_stop_string_comes_too_late(llm, core):
    sp = SamplingParams(temperature=0, max_tokens=60, stop=["Lily"])
    results = {}
    for mode in (False, True):
        core.async_output = mode
        req = llm._make_request("", sp, True)
        other = llm._make_request("Once upon a time", SamplingParams(temperature=0, max_tokens=30), False)
        core.add_request(req)
        core.add_request(other)
        k = 0
        while not (req.seqs[0].output_token_ids and "Lily" in llm.tokenizer.decode(req.seqs[0].output_token_ids)):
            _step(core)
            k += 1
        assert (mode and core._pending) or (not mode and req.output._done_received)
        core.abort_request(req.request_id)  # in the asynchronous engine the stop string is found now
        core.flush_outputs()
        _drain(core)
        req.output.result(timeout=0)  # finished normally: no RequestAborted
        results[mode] = (k, _choice(req.output))
    assert results[True] == results[False]
    assert results[True][1][0][1:4] == (GOLDEN[:GOLDEN.index("Lily")], "stop", "Lily")


def test_lone_request_result_arrives_in_the_step_that_finished_it(llm, core):
    core.async_output = True
    period = llm.tokenizer.encode(".", add_special_tokens=False)[-1]
    for sp, n in ((SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), 5),
                  (SamplingParams(temperature=0, max_tokens=60, end_id=period), None)):
        req = llm._make_request("", sp, True)
        core.add_request(req)
        steps = 0
        while not req.output._done_received:
            _step(core)
            steps += 1
        assert not core.has_work  # no further step was needed to deliver it
        _updates(req.output)
        out = req.output.outputs[0]
        assert steps == len(out.token_ids) == (n or out.token_ids.index(period) + 1)
        assert GOLDEN.startswith(out.text) and out.text


def test_request_finishing_beside_running_ones_is_not_delayed(llm, core):
    core.async_output = True
    long = llm._make_request("Once upon a time", GREEDY_LONG, True)
    short = llm._make_request("", SamplingParams(temperature=0, max_tokens=7), False)
    core.add_request(long)
    core.add_request(short)
    steps = 0
    while not short.output._done_received:
        _step(core)
        steps += 1
    assert steps == 7 and core.has_work and core._pending  # the long request's token is pending
    _drain(core)
    _updates(short.output)
    _updates(long.output)
    assert len(short.output.outputs[0].token_ids) == 7
    assert len(long.output.outputs[0].token_ids) == 80


def test_fail_all_delivers_the_pending_outputs_first(llm, core):
    core.async_output = True
    req = llm._make_request("", GREEDY_LONG, True)
    core.add_request(req)
    for _ in range(4):
        _step(core)
    assert core._pending
    core.fail_all(RuntimeError("boom"))
    core.flush_outputs()
    ups = _updates(req.output)
    assert [t for u in ups for d in u.deltas for t in d.new_token_ids] == req.seqs[0].output_token_ids
    assert len(req.seqs[0].output_token_ids) == 4 and ups[-1].finished and ups[-1].error is not None
    assert GOLDEN.startswith(req.output.outputs[0].text)


# ---- a mixed batch gives the same results in both modes -------------------------------------------
# Requests that end in the fast part only (max_tokens, EOS / end_id, stop token ids): the schedule is
# the same in both modes, so everything must be bit-identical.
_FAST_ENDS = [
    ("Once upon a time", SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=25), True),
    ("Once upon a time", SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=30), False),
    ("The little dog", SamplingParams(temperature=0.7, seed=11, max_tokens=30, logprobs=3), True),
    ("The little dog", SamplingParams(temperature=0, max_tokens=12, logprobs=0, prompt_logprobs=2), False),
    ("Tom and Sue", SamplingParams(n=1, best_of=3, temperature=0.9, seed=5, max_tokens=20), False),
    ("She was sad", SamplingParams(temperature=0, max_tokens=3), True),
    ("She was sad", SamplingParams(temperature=0.5, seed=2, max_tokens=60, stop_token_ids=[13, 263]), False),
    ("", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, return_generation_logits=True), True),
    ("One day", SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0, max_tokens=10), False),
    ("Tom and Sue", SamplingParams(temperature=0.6, seed=9, max_tokens=50, logprobs=1), True),
]
# Stop strings are found in the slow part: a sequence then runs one more (dropped) step, so batches
# differ by that row and float32 rounding of log-probabilities may differ in the last bits.
_STOP_STRINGS = [
    ("", SamplingParams(temperature=0, max_tokens=40, stop=["Lily"]), True),
    ("", SamplingParams(temperature=0, max_tokens=40, stop=["park", "ball"], include_stop_str_in_output=True), False),
    ("Once upon a time", SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=25, stop=[" the"]), True),
    ("The little dog", SamplingParams(temperature=0.7, seed=11, max_tokens=30, logprobs=3, stop=["."]), True),
    ("Tom and Sue", SamplingParams(temperature=0, max_tokens=50, min_tokens=10, stop=["."]), True),
    ("Tom and Sue", SamplingParams(n=1, best_of=3, temperature=0.9, seed=5, max_tokens=20, stop=["ed"]), False),
]


class _SplitSampler:
    """The real sampler behind the optional ``launch(...) -> handle``, ``handle.finish()`` interface
    that `EngineCore` uses when a sampler has it; ``log`` records the calls."""

    def __init__(self, sampler, log: list, core) -> None:
        self.sampler, self.log, self.core = sampler, log, core

    def __call__(self, logits, rows):
        return self.sampler(logits, rows)

    def launch(self, logits, rows):
        self.log.append("launch-pending" if self.core._pending else "launch")
        out = self.sampler(logits, rows)
        log = self.log

        class _Handle:
            def finish(self):
                log.append("finish")
                return out

        return _Handle()


def _hand_llm(model_dir, kv_tokens=None) -> LLM:
    llm = LLM(str(model_dir), max_batch_size=6, max_num_tokens=64,
              kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=kv_tokens))
    llm._loop.stop()
    return llm


def _run_batch(llm, mix, mode: bool, split: bool = False):
    """Submit ``mix`` twice at once, step until done; (results, plans, preemptions). ``split``:
    through `_SplitSampler`, checking that the pending output work runs between launch and finish."""
    core = llm._core
    core.async_output = mode
    rec = _Recorder(core.executor)
    core.executor = rec
    sampler = core.sampler
    log: list[str] = []
    if split:
        core.sampler = _SplitSampler(sampler, log, core)
        finish_outputs = core._finish_outputs

        def logged(sampled):
            log.append("outputs")
            finish_outputs(sampled)

        core._finish_outputs = logged
    preempted = core.scheduler.num_preemptions
    try:
        reqs = [llm._make_request(p, sp, s) for p, sp, s in mix * 2]
        for r in reqs:
            core.add_request(r)
        _drain(core)
    finally:
        core.executor = rec.executor
        core.sampler = sampler
        core.__dict__.pop("_finish_outputs", None)
    if split:  # the pending output work always ran between the launch and the read
        at = [i for i, x in enumerate(log) if x == "launch-pending"]
        assert at and all(log[i + 1:i + 3] == ["outputs", "finish"] for i in at)
        assert all(log[i + 1] == "finish" for i, x in enumerate(log) if x == "launch")
    assert core.kv.num_used_blocks == 0 and not core.requests
    res = []
    for r in reqs:
        o = r.output
        if o.streaming:  # every chunk the stream would yield, in order
            texts, toks = [[] for _ in o.outputs], [[] for _ in o.outputs]
            for chunk in o:
                for i, c in enumerate(chunk.outputs):
                    texts[i].append(c.text_diff)
                    toks[i].extend(c.token_ids_diff)
            assert ["".join(t) for t in texts] == [c.text for c in o.outputs]
            assert toks == [c.token_ids for c in o.outputs]
        else:
            o.result(timeout=0)
        gl = [None if c.generation_logits is None else c.generation_logits.tolist() for c in o.outputs]
        pl = None if o.prompt_logprobs is None else [
            None if e is None else {t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in o.prompt_logprobs]
        res.append((_choice(o), gl, pl))
    # Sequences are renumbered per run: compare plans as positions of first appearance.
    ids: dict[int, int] = {}
    plans = [[ids.setdefault(i, len(ids)) for i in p] for p in rec.plans]
    return res, plans, core.scheduler.num_preemptions - preempted


def _both_modes(model_dir, mix, kv_tokens, split):
    """`_run_batch` synchronously, then asynchronously, on one fresh engine."""
    llm = _hand_llm(model_dir, kv_tokens)
    try:
        return _run_batch(llm, mix, False), _run_batch(llm, mix, True, split)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kv_tokens, split", [(None, False), (128, False), (None, True)],
                         ids=["roomy", "preempting", "split-sampler"])
def test_requests_ending_in_the_fast_part_are_bit_identical(stories_model_dir, kv_tokens, split):
    (sync, sync_plans, sync_pre), (asyn, asyn_plans, asyn_pre) = _both_modes(
        stories_model_dir, _FAST_ENDS, kv_tokens, split)
    assert asyn_plans == sync_plans and asyn_pre == sync_pre  # the same schedule, step by step
    assert (sync_pre > 0) == (kv_tokens is not None)  # the small pool really preempted
    for (p, sp, _s), a, b in zip(_FAST_ENDS * 2, sync, asyn):
        assert a == b, (p, sp)
    assert {c[2] for r in sync for c in r[0]} == {"stop", "length"}


@pytest.mark.parametrize("kv_tokens, split", [(None, False), (128, False), (128, True)],
                         ids=["roomy", "preempting", "preempting-split-sampler"])
def test_mixed_batch_with_stop_strings_matches_the_synchronous_engine(stories_model_dir, kv_tokens, split):
    mix = _FAST_ENDS + _STOP_STRINGS
    (sync, sync_plans, sync_pre), (asyn, asyn_plans, asyn_pre) = _both_modes(stories_model_dir, mix, kv_tokens, split)
    if kv_tokens is not None:
        assert sync_pre > 0 and asyn_pre > 0
    for (p, sp, _s), a, b in zip(mix * 2, sync, asyn):
        # token ids, text, finish and stop reasons exactly; log-probabilities to float32 rounding
        assert [c[:4] for c in a[0]] == [c[:4] for c in b[0]], (p, sp)
        assert _close(a, b), (p, sp)
    stop_reasons = {c[3] for r in sync for c in r[0]}
    assert {"Lily", "park", " the", "."} <= stop_reasons
    assert sum(len(p) for p in asyn_plans) > sum(len(p) for p in sync_plans)  # some tokens were dropped
