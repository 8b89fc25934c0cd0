"""Beam requests in the scheduler: preempted and admitted all-or-nothing, `RequestTooLargeError` for a
beam wider than the step's token budget or ``max_batch_size``, a beam request that fits alone is never
preempted out of the pool or starved by a stream of small requests, and aborts while its beams are
preempted free everything (engine/core/scheduler.py).

The ``sim`` tests drive the scheduler and KV cache manager without a model (`support.beams._SimEngine`);
the others run the tiny random Llama on CPU, with and without asynchronous scheduling."""

from __future__ import annotations


import pytest

from kvpilot import RequestAborted, RequestTooLargeError, SamplingParams
from kvpilot.core.sequence import SequenceStatus

from support.beams import _drive, _llm, _SimEngine
from support.beams import PROMPTS, tiny  # noqa: F401 (tiny: the model fixture)


# ==== 3. beam requests in the scheduler =========================================================
def test_sim_beam_wider_than_the_step_token_budget_fails():
    """A beam request wider than ``max_num_tokens`` fails with RequestTooLargeError instead of stepping
    forever.

    A new beam request enters the queue as ONE sequence and forks to its width W after its first
    token. With W > max_num_tokens the step never has a token for every beam: the beams that got one
    roll back (`BeamSearch.step`) and the request would step forever. `Scheduler._admit_group` refuses a
    lockstep request whose ``max_num_seqs > self.max_num_tokens`` (the engine's "nothing can ever run"
    path fails it), and `unfit_error` compares ``width`` (not ``len(group)``) with max_num_tokens."""
    sim = _SimEngine(num_blocks=16, block_size=4, max_num_tokens=2, max_batch_size=8, reuse=True)
    sim.add(0, 3, 5, use_beam_search=True, n=1, best_of=3)
    ok = sim.add(1, 3, 5)
    sim.run(max_steps=200)  # AssertionError "livelock" if the request steps forever
    assert list(sim.errors) == [0] and "max_num_tokens is 2" in str(sim.errors[0])
    assert ok.seqs[0].num_output_tokens == 5


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_beam_wider_than_max_num_tokens_is_refused(tiny, monkeypatch, async_scheduling):
    """The same with the engine (tiny Llama): 3 beams with ``max_num_tokens=2`` are refused at submit
    (ValueError naming max_num_tokens) or fail with RequestTooLargeError; the other request is served
    (`_drive` stops a livelock)."""
    d, _model = tiny
    llm = _llm(d, monkeypatch, async_scheduling, pool_tokens=256, max_num_tokens=2)
    beam = SamplingParams(use_beam_search=True, best_of=3, n=1, max_tokens=6)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    try:
        try:
            llm._make_request(PROMPTS[1], beam, False)
        except ValueError as e:
            assert "max_num_tokens" in str(e)
            outs = _drive(llm, [(PROMPTS[2], greedy)])
        else:
            outs = _drive(llm, [(PROMPTS[1], beam), (PROMPTS[2], greedy)])
            with pytest.raises(RequestTooLargeError, match="max_num_tokens"):
                outs.pop(0).result(timeout=0)
    finally:
        llm.shutdown()
    assert len(outs[0].result(timeout=0).outputs[0].token_ids) == 6


# A beam request (3 beams, a 16-token prompt = 4 full blocks of 4, 8 new tokens) fits a 12-block
# pool alone: 4 shared blocks + the beams' own. A greedy request admitted before it (20-token
# prompt, 24 new tokens, up to 11 blocks) grows into the beams' blocks and preempts them. Re-
# admitted, the beams share their prompt blocks only through the prefix cache: with block reuse off
# they never do (3 x 5 = 15 blocks > 12), with it on the growing request has evicted most of them.
BEAM_PROMPT = [1] + list(range(10, 25))
GREEDY_PROMPT = [1] + list(range(30, 49))
BEAM8 = SamplingParams(use_beam_search=True, best_of=3, n=1, max_tokens=8, ignore_eos=True)
GREEDY24 = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("reuse", [False, True], ids=["no reuse", "reuse"])
def test_sim_beam_request_that_fits_alone_is_not_preempted_out_of_the_pool(reuse):
    """A beam request that fits the pool alone finishes behind a growing greedy request that preempts it
    (`_SimEngine`; the random workloads of test_beam_preemption.py keep every request fitting the pool
    alone even when its sequences share no block, so they do not reach this case).

    Forked beams share their parent's blocks by reference, which preemption throws away; counted
    unshared, the re-admitted group would need more blocks than the pool has. The scheduler re-admits a
    lockstep group with its common full-block prefixes shared inside the group (each distinct full block
    allocated once; the later beams take it by reference and compute their own tokens only once the
    first beam has computed it; engine/core/scheduler.py `_group_plan`, `_admit_group`)."""
    def run(items):
        sim = _SimEngine(num_blocks=12, block_size=4, max_num_tokens=64, max_batch_size=8, reuse=reuse)
        reqs = [sim.add(rid, prompt, max_tokens, **kw) for rid, (prompt, max_tokens, kw) in enumerate(items)]
        sim.run(max_steps=400)
        return sim, reqs

    beam = (16, 8, dict(use_beam_search=True, n=1, best_of=3))
    alone, _ = run([beam])
    assert not alone.errors
    sim, (greedy, beam_req) = run([(20, 24, {}), beam])
    assert sim.sched.num_preemptions > 0
    assert greedy.seqs[0].num_output_tokens == 24
    assert not sim.errors, {k: str(v) for k, v in sim.errors.items()}
    assert beam_req.seqs[0].num_output_tokens == 8


@pytest.mark.parametrize("reuse", [False, True], ids=["no reuse", "reuse"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_beam_request_that_fits_alone_finishes_behind_a_growing_request(tiny, monkeypatch, async_scheduling, reuse):
    """End to end (tiny Llama, CPU): the beam request alone returns its beams; behind a growing greedy
    request (its 3 beams of 17 tokens need 15 blocks unshared, 13 with reuse, the pool has 12) it
    finishes too, and both requests return what they return alone. See the scheduler-level test above."""
    d, _model = tiny

    def run(items):
        llm = _llm(d, monkeypatch, async_scheduling, pool_tokens=48, reuse=reuse, block=4, max_batch_size=8)
        try:
            outs = _drive(llm, items)
            return outs, llm._core.scheduler.num_preemptions
        finally:
            llm.shutdown()

    (beam_alone,), _ = run([(BEAM_PROMPT, BEAM8)])
    (greedy_alone,), _ = run([(GREEDY_PROMPT, GREEDY24)])
    (greedy, beam), preemptions = run([(GREEDY_PROMPT, GREEDY24), (BEAM_PROMPT, BEAM8)])
    assert preemptions > 0
    assert greedy.result(timeout=0).outputs[0].token_ids == greedy_alone.result(timeout=0).outputs[0].token_ids
    got, want = beam.result(timeout=0), beam_alone.result(timeout=0)  # raises RequestTooLargeError
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
    assert ([o.cumulative_logprob for o in got.outputs]
            == pytest.approx([o.cumulative_logprob for o in want.outputs], abs=1e-4))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_abort_of_a_beam_request_while_its_beams_are_preempted(tiny, monkeypatch, async_scheduling):
    """A beam request preempted by a growing greedy request admitted before it (a 20-block pool:
    re-admitted, even unshared, its beams would fit), aborted while all three beams wait without
    blocks: the request ends with RequestAborted, its sequences leave the queue, no batch slots stay
    reserved for it, the greedy request returns what it returns alone, and every block comes back."""
    d, _model = tiny
    greedy_prompt = [1] + list(range(30, 69))  # 10 blocks
    greedy = SamplingParams(temperature=0, max_tokens=36, ignore_eos=True)  # up to 19 blocks
    llm = _llm(d, monkeypatch, async_scheduling, pool_tokens=2048, reuse=True, block=4, max_batch_size=8)
    try:
        (greedy_alone,) = _drive(llm, [(greedy_prompt, greedy)])
    finally:
        llm.shutdown()
    llm = _llm(d, monkeypatch, async_scheduling, pool_tokens=80, reuse=True, block=4, max_batch_size=8)
    core, sched = llm._core, llm._core.scheduler
    try:
        reqs = [llm._make_request(greedy_prompt, greedy, False), llm._make_request(BEAM_PROMPT, BEAM8, False)]
        for r in reqs:
            core.add_request(r)
        beam = reqs[1]
        for _ in range(60):
            core.step()
            core.flush_outputs()
            if sched.num_preemptions and all(s.status is SequenceStatus.WAITING for s in beam.seqs):
                break
        assert len(beam.seqs) == 3 and all(s.status is SequenceStatus.WAITING for s in beam.seqs)
        assert not any(s.block_table for s in beam.seqs)
        core.abort_request(beam.request_id)
        assert not any(s.request is beam for s in sched.waiting)
        assert sched._reserved_slots() == 0
        for _ in range(200):
            if not core.has_work:
                break
            core.step()
            core.flush_outputs()
        core.flush_outputs()
        assert not core.has_work and core.kv.num_used_blocks == 0
    finally:
        llm.shutdown()
    with pytest.raises(RequestAborted):
        reqs[1].output.result(timeout=0)
    assert (reqs[0].output.result(timeout=0).outputs[0].token_ids
            == greedy_alone.result(timeout=0).outputs[0].token_ids)


def test_sim_beam_request_is_not_starved_by_a_stream_of_small_requests():
    """A beam request (3 beams) queued behind a pool kept full by a new small request every step is
    admitted in first-come order (small requests queued after it never overtake it, and those admitted
    after it are preempted before it), so it finishes while the stream goes on."""
    sim = _SimEngine(num_blocks=12, block_size=4, max_num_tokens=16, max_batch_size=8, reuse=True)
    rid = 0
    for _ in range(3):
        sim.add(rid, 6, 10)
        rid += 1
    beam = sim.add(rid, 5, 6, use_beam_search=True, n=1, best_of=3)
    rid += 1
    done_at = None
    for step in range(300):
        if step < 200:
            sim.add(rid, 3, 8)
            rid += 1
        sim.step()
        if done_at is None and all(s.status is SequenceStatus.FINISHED for s in beam.seqs):
            done_at = step
    assert not sim.errors and sim.sched.num_preemptions > 20  # the pool was under pressure throughout
    assert done_at is not None and done_at < 60, done_at
    assert beam.seqs[0].num_output_tokens == 6
