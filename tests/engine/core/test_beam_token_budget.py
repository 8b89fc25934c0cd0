"""Beam requests re-admitted after preemption share their common full blocks again
(engine/core/scheduler.py `_group_plan`, `_admit_group`, `_shared_prefix_ready`), and beam requests
interleaved across a token budget as small as their width all finish.

Pinned: reference counts when a request is aborted, preempted again or finished while a beam waits
for shared blocks; a waiting beam's source is always a running sequence of its request; uncomputed
shared blocks are never registered in the prefix cache, and cached blocks are taken before any
allocation can evict them; the plan's block count equals what admission takes from the free queue;
chunked recompute; async scheduling (readiness is read from counts advanced after the step that
computes the blocks is launched). CPU tests take seconds (the scheduler simulation
`support.beams._SimEngine`, or stories260K); the ``gpu`` test needs a CUDA GPU."""

from __future__ import annotations

import random

import pytest
import torch

from kvpilot import LLM, KvCacheConfig, SamplingParams

from support.beams import _alone, _drive, _llm, _same_tokens, _SimEngine
from support.beams import _alone_then_mixed, _mix_failed, _workload
from support.beams import tiny  # noqa: F401 (tiny: the model fixture)

# Two beam requests (3 beams, 16-token prompts) as in tests/engine/core/test_beam_readmission.py.
BEAM8 = SamplingParams(use_beam_search=True, best_of=3, n=2, max_tokens=8, ignore_eos=True)
PAIR = [([1] + list(range(10, 25)), BEAM8), ([1] + list(range(50, 65)), BEAM8)]


@pytest.fixture(scope="module")
def pair_alone(stories_model_dir):
    """stories260K's results for `PAIR`, each request alone in a large pool."""
    return _alone(stories_model_dir, PAIR)


# ---- livelock: beams of two requests interleaved across the step's token budget ----------------
def test_sim_two_beam_requests_wider_than_the_token_budget_both_finish():
    """Two beam requests of width 3 with a budget of 3 tokens both finish: a fork joins the running list
    right after its request's other sequences (`Scheduler.add_forks`), so a request's beams are
    contiguous and the first one in running order always gets its whole width (at most
    ``max_num_tokens``, checked at admission). Forks appended at the end would give the running order
    [a0, b0, a1, a2, b1, b2]: each step the budget would reach a0, b0 and a1, never every beam of either
    request (the others compute their last token again: `BeamSearch.step`), and the engine would step
    forever."""
    sim = _SimEngine(num_blocks=64, block_size=4, max_num_tokens=3, max_batch_size=8, reuse=False)
    a = sim.add(0, 5, 6, use_beam_search=True, n=1, best_of=3)
    b = sim.add(1, 5, 6, use_beam_search=True, n=1, best_of=3)
    sim.run(max_steps=200)
    assert not sim.errors
    assert [len(s.token_ids) for s in a.seqs + b.seqs] == [11] * 6


def test_engine_two_beam_requests_wider_than_the_token_budget_equal_their_runs_alone(stories_model_dir, pair_alone,
                                                                                     monkeypatch):
    """The same in the engine (stories260K, ``max_num_tokens`` 3, two width-3 beam requests, one of them
    preempted and re-admitted with shared blocks): both return what they return alone."""
    llm = _llm(stories_model_dir, monkeypatch, False, pool_tokens=48, reuse=False, block=4, max_batch_size=8,
               max_num_tokens=3)
    try:
        outs = _drive(llm, PAIR)
    finally:
        llm.shutdown()
    for out, alone in zip(outs, pair_alone):
        _same_tokens(out.result(timeout=0), alone)


def test_sim_random_mixes_with_budgets_down_to_the_beam_width_finish_as_alone():
    """120 random pools and mixes (`support.beams._workload`) with ``max_num_tokens`` of 3, 4 or 8 (beam
    widths up to it): every request that finishes alone finishes in the mix, each beam request with the
    beams it has alone (without `Scheduler.add_forks`, 13 of these mixes step forever)."""
    failed = []
    for seed in range(120):
        rng = random.Random(seed)
        B = rng.choice([2, 4, 8])
        num_blocks = rng.randint(8, 16)
        budget = rng.choice([3, 4, 8])
        cfg = dict(num_blocks=num_blocks, block_size=B, max_num_tokens=budget, max_batch_size=rng.choice([6, 8]),
                   reuse=rng.random() < 0.5)
        workload = _workload(rng, num_blocks, B)
        for _prompt, _max_tokens, kw in workload:
            if kw.get("best_of", 0) > budget:
                kw["best_of"] = budget
        try:
            alone, sim = _alone_then_mixed(cfg, workload, 3000)
        except AssertionError as e:  # a livelock, or an invariant of `_SimEngine.check`
            failed.append((seed, str(e)[:80]))
            continue
        if _mix_failed(alone, sim):
            failed.append((seed, {k: str(v) for k, v in sim.errors.items()}))
    assert not failed


# ---- checked and found right -----------------------------------------------------------------
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_abort_while_a_readmitted_beam_waits_frees_every_block(stories_model_dir, pair_alone, monkeypatch,
                                                               async_scheduling):
    """A beam request aborted while one of its re-admitted beams waits for blocks a sibling has not
    computed yet (``Sequence.shared_prefix`` set; the re-admission is given 2 tokens of budget so
    that the sibling needs several steps): every block comes back, and both requests submitted
    again (prefix cache on: an uncomputed shared block registered in it would be read) return what
    they return alone; the other request of the first round is not disturbed."""
    items, want = PAIR, pair_alone
    llm = _llm(stories_model_dir, monkeypatch, async_scheduling, pool_tokens=48, reuse=True, block=4,
               max_batch_size=8)
    core, sched = llm._core, llm._core.scheduler
    admit_group = sched._admit_group
    sched._admit_group = lambda budget, *a: admit_group(min(budget, 2) if len(sched._waiting_group()) > 1 else budget,
                                                        *a)
    try:
        reqs = [llm._make_request(p, sp, False) for p, sp in items]
        for r in reqs:
            core.add_request(r)
        aborted = None
        for _ in range(300):
            if not core.has_work:
                break
            core.step()
            core.flush_outputs()
            waiting = [s for s in sched.running if s.shared_prefix is not None
                       and s.shared_prefix[0].num_computed_tokens < s.shared_prefix[1]]
            if aborted is None and waiting:
                aborted = waiting[0].request
                core.abort_request(aborted.request_id)
                core.flush_outputs()
        assert aborted is not None and not core.has_work
        assert core.kv.num_used_blocks == 0 and all(b.ref_count == 0 for b in core.kv.blocks)
        (other,) = [r for r in reqs if r is not aborted]
        _same_tokens(other.output.result(timeout=0), want[reqs.index(other)])
        sched._admit_group = admit_group
        for out, alone in zip(_drive(llm, items), want):
            _same_tokens(out.result(timeout=0), alone)
    finally:
        llm.shutdown()


# ---- GPU: the CUDA ModelRunner (graphs, async scheduling) ------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_gpu_beam_requests_with_a_budget_of_their_width(tiny, monkeypatch, async_scheduling):
    """8 beam requests of width 4 (41-token prompts) with ``max_num_tokens`` 4 on the CUDA engine: each
    returns what it returns with a large budget."""
    d, _model = tiny
    monkeypatch.setenv("KVPILOT_TUNING", '{"async_scheduling": %s}' % ("true" if async_scheduling else "false"))
    beam = SamplingParams(use_beam_search=True, best_of=4, n=2, max_tokens=16, ignore_eos=True)
    items = [([1] + [(7 * i + j) % 90 + 3 for j in range(40)], beam) for i in range(8)]

    def run(max_num_tokens):
        llm = LLM(str(d), skip_tokenizer_init=True, device="cuda", dtype="float32", max_batch_size=64,
                  max_num_tokens=max_num_tokens, kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=4096))
        llm._loop.stop()
        try:
            return [o.result(timeout=0) for o in _drive(llm, items, max_idle=200)]
        finally:
            llm.shutdown()

    for out, want in zip(run(4), run(512)):
        _same_tokens(out, want)
