"""Beam requests under KV-cache pressure: a request's beams are preempted and admitted together.

A beam-search step needs the logits of every beam of a request at once, so a beam that runs while a
sibling waits only recomputes its last token. Preempted and admitted one at a time, a running beam
would hold blocks while its siblings waited behind a request that only those blocks would let in,
and the engine would step forever.

- Scheduler level (no model): a simulated engine over random workloads checks the invariants
  (a beam request's sequences are all running or all waiting, batch slots reserved for its width,
  the step's budget, block reference counts, every attended KV slot holding the sequence's own
  prefix) and that every request finishes. Re-admission with shared blocks:
  tests/engine/core/test_beam_readmission.py.
- Engine level (a tiny random Llama, CPU): beams under preemption equal transformers' beam search,
  with async scheduling on and off, block reuse on and off (beams share their parents' full blocks)
  and several pool sizes; seeded n>1 / best_of sampling under preemption equals an unpressured run;
  a beam request that can never fit fails with `RequestTooLargeError` (never hangs) while the other
  requests are served.
- On a GPU (``-m gpu``): 48 requests (beam, seeded n>1 sampling, long greedy) in a pool a sixth of
  their demand, CUDA ModelRunner with graphs, async scheduling on and off: every request finishes,
  beams equal transformers, the others equal an unpressured run.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvpilot import LLM, KvCacheConfig, RequestTooLargeError, SamplingParams
from kvpilot.core.sequence import SequenceStatus

from support.beams import PROMPTS, _check, _hf_beams, tiny  # noqa: F401 (tiny: the model fixture)
from support.beams import _SimEngine, _llm, _drive, _alone, _same_tokens# noqa: F401

RUNNING, WAITING, FINISHED = SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.FINISHED


def test_sim_the_livelock_case_finishes():
    """In scheduler terms: a beam request (width 3) and a long request that, once preempted, fits only if
    the beams give their blocks back; both finish."""
    sim = _SimEngine(num_blocks=8, block_size=16, max_num_tokens=64, max_batch_size=8, reuse=True)
    sim.add(0, 2, 60)
    sim.add(1, 2, 28, use_beam_search=True, n=2, best_of=3)
    sim.add(2, 1, 100)
    sim.run(max_steps=2000)
    assert sim.sched.num_preemptions > 0 and not sim.errors


@pytest.mark.parametrize("seed", range(12))
def test_sim_random_workloads_finish_with_invariants(seed):
    rng = random.Random(seed)
    B = rng.choice([4, 8, 16])
    num_blocks = rng.randint(6, 14)
    sim = _SimEngine(num_blocks, B, max_num_tokens=rng.choice([8, 16, 64]), max_batch_size=rng.choice([4, 6, 8]),
                     reuse=rng.random() < 0.5)
    total = 0
    for rid in range(rng.randint(3, 7)):
        kind = rng.choice(["plain", "n", "beam"])
        width = 1 if kind == "plain" else rng.randint(2, 3)
        # Every request fits the pool alone even when its sequences share no block.
        cap = num_blocks // width * B
        prompt = rng.randint(1, max(1, cap // 3))
        max_tokens = rng.randint(1, max(1, cap - prompt))
        if kind == "beam":
            sim.add(rid, prompt, max_tokens, use_beam_search=True, n=1, best_of=width)
        else:
            sim.add(rid, prompt, max_tokens, n=width)
        total += width * (prompt + max_tokens)
    sim.run(max_steps=40 * total)
    assert not sim.errors


def test_sim_preempting_a_beam_gives_back_what_the_step_gave_its_siblings():
    """Running order [plain, beam 0, beam 1 (the fork, next to its sibling: `Scheduler.add_forks`)]:
    when the fork's next token needs a block that is not there, its request is the victim (admitted
    last), and beam 0, already scheduled in this step, is preempted with it: its tokens leave the
    step's output; the plain request keeps its own."""
    sim = _SimEngine(num_blocks=8, block_size=4, max_num_tokens=32, max_batch_size=8, reuse=False)
    plain = sim.add(1, 3, 12)
    beam = sim.add(0, 3, 12, use_beam_search=True, n=2, best_of=2)
    outs = []
    schedule = sim.sched.schedule
    sim.sched.schedule = lambda *a, **k: outs.append(schedule(*a, **k)) or outs[-1]
    while not any(o.preempted for o in outs):
        sim.step()
        assert len(outs) < 50
    out = outs[-1]
    assert [s.request for s in out.preempted] == [beam, beam]
    assert [(s.request, n) for s, n in out.scheduled] == [(plain, 1)]
    assert {s.status for s in beam.seqs} == {WAITING} and not any(s.block_table for s in beam.seqs)
    assert list(sim.sched.waiting)[:2] == beam.seqs  # back at the head, in their order
    sim.run(max_steps=500)
    assert not sim.errors and beam.seqs[0].num_tokens == 15


def test_sim_beams_wider_than_the_batch_fail_with_a_clear_error():
    sim = _SimEngine(num_blocks=16, block_size=4, max_num_tokens=32, max_batch_size=2, reuse=True)
    sim.add(0, 3, 5, use_beam_search=True, n=1, best_of=3)
    ok = sim.add(1, 3, 5)
    sim.run(max_steps=100)
    assert list(sim.errors) == [0]
    assert "beam search with 3 beams needs 3 sequences in one batch, but max_batch_size is 2" in str(sim.errors[0])
    assert ok.seqs[0].num_output_tokens == 5


def test_sim_beams_that_outgrow_the_pool_fail_instead_of_looping():
    """Three beams that diverge at once need their own blocks: alone, they outgrow the pool; the
    request fails (after giving its blocks back) and the next request runs."""
    sim = _SimEngine(num_blocks=6, block_size=4, max_num_tokens=32, max_batch_size=8, reuse=False)
    sim.add(0, 2, 20, use_beam_search=True, n=1, best_of=3)
    ok = sim.add(1, 2, 10)
    sim.run(max_steps=300)
    assert list(sim.errors) == [0]
    assert "its 3 beams of" in str(sim.errors[0]) and "the pool has 6 blocks of 4 tokens" in str(sim.errors[0])
    assert ok.seqs[0].num_output_tokens == 10


BEAM = SamplingParams(use_beam_search=True, best_of=3, n=2, max_tokens=16)
LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, seed=5, n=2, best_of=3, max_tokens=14, ignore_eos=True)


def _mix():
    return [(PROMPTS[0], SEEDED), (PROMPTS[1], BEAM), (PROMPTS[2], LONG), (PROMPTS[0], BEAM),
            (PROMPTS[2], SEEDED)]


@pytest.fixture(scope="module")
def unpressured(tiny, tmp_path_factory):
    """Every request of `_mix` alone in a large pool (no preemption): the seeded and greedy results."""
    return _alone(tiny[0], _mix())


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("pool_tokens,reuse", [(64, True), (64, False), (96, True), (128, False)])
def test_beams_under_preemption_equal_transformers(tiny, unpressured, monkeypatch, async_scheduling, pool_tokens,
                                                   reuse):
    d, model = tiny
    llm = _llm(d, monkeypatch, async_scheduling, pool_tokens, reuse=reuse)
    try:
        outs = _drive(llm, _mix())
        preemptions = llm._core.scheduler.num_preemptions
        overlapped = llm._core.num_overlapped_steps
    finally:
        llm.shutdown()
    assert preemptions > 0
    assert (overlapped > 0) is async_scheduling
    for (prompt, sp), out, ref in zip(_mix(), outs, unpressured):
        out = out.result(timeout=0)
        if sp.use_beam_search:
            ref_beams = _hf_beams(model, prompt, sp.best_of, sp.n, sp.length_penalty, sp.max_tokens)
            _check(out, *ref_beams, sp.length_penalty)
        else:  # seeded n>1 / best_of sampling and greedy: batch- and preemption-independent
            _same_tokens(out, ref)


PRESSURE_SEEDED = SamplingParams(temperature=1.0, seed=9, top_p=0.5, max_tokens=60, ignore_eos=True)
PRESSURE_BEAM = SamplingParams(max_tokens=30, use_beam_search=True, n=2, best_of=3)


@pytest.fixture(scope="module")
def pressure_refs(tiny):
    """The seeded request and a 100-token greedy run of the case below, alone in a large pool."""
    d, _model = tiny
    mp = pytest.MonkeyPatch()
    try:
        llm = _llm(d, mp, False, pool_tokens=2048, block=16)
        try:
            items = [([1, 5, 9], PRESSURE_SEEDED), ([1], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))]
            return [_drive(llm, [item])[0].result(timeout=0) for item in items]
        finally:
            llm.shutdown()
    finally:
        mp.undo()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("pool_tokens,block", [(64, 4), (80, 8), (96, 16), (112, 16)])
def test_beam_request_behind_a_request_that_needs_its_blocks_finishes(tiny, pressure_refs, monkeypatch,
                                                                      async_scheduling, pool_tokens, block):
    """test_async_scheduling_aborts.py's beam case on the tiny model, over pool and block sizes where
    the long greedy request, preempted, fits again only once the beam request's beams give their blocks
    back: every request finishes with what it returns alone."""
    d, model = tiny
    llm = _llm(d, monkeypatch, async_scheduling, pool_tokens, block=block, max_batch_size=8)
    long_tokens = min(100, pool_tokens - 1)
    try:
        outs = _drive(llm, [([1, 5, 9], PRESSURE_SEEDED), ([1, 40, 41], PRESSURE_BEAM),
                            ([1], SamplingParams(temperature=0, max_tokens=long_tokens, ignore_eos=True))])
        preemptions = llm._core.scheduler.num_preemptions
    finally:
        llm.shutdown()
    assert preemptions > 0
    seeded, beam, greedy = (o.result(timeout=0) for o in outs)
    _same_tokens(seeded, pressure_refs[0])
    _check(beam, *_hf_beams(model, [1, 40, 41], 3, 2, 1.0, 30), 1.0)
    assert greedy.outputs[0].token_ids == pressure_refs[1].outputs[0].token_ids[:long_tokens]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_beam_request_wider_than_the_batch_fails_and_others_are_served(tiny, unpressured, monkeypatch,
                                                                      async_scheduling):
    """`LLM` refuses the request when it is submitted (ValueError); a request that reaches the
    scheduler anyway (built past that check) fails with RequestTooLargeError at its first step.
    The other request is served either way."""
    d, _model = tiny
    llm = _llm(d, monkeypatch, async_scheduling, pool_tokens=256, max_batch_size=2)
    try:
        with pytest.raises(ValueError, match="3 beams needs that many batch slots and tokens per step; "
                                             "max_batch_size is 2"):
            llm._make_request(PROMPTS[1], BEAM, False)
        llm.max_batch_size = 3  # past the submit check only: the scheduler still has 2 slots
        outs = _drive(llm, [(PROMPTS[1], BEAM), (PROMPTS[2], LONG)])
    finally:
        llm.shutdown()
    with pytest.raises(RequestTooLargeError, match="3 beams needs 3 sequences in one batch, but max_batch_size is 2"):
        outs[0].result(timeout=0)
    _same_tokens(outs[1].result(timeout=0), unpressured[2])


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_beams_that_can_never_fit_the_pool_fail_and_others_are_served(tiny, unpressured, monkeypatch,
                                                                     async_scheduling):
    """Eight beams of up to 39 tokens in a pool of 40 tokens (one sequence of the request fits it,
    so the request is accepted): they cannot all hold their own last blocks."""
    d, _model = tiny
    wide = SamplingParams(use_beam_search=True, best_of=8, n=1, max_tokens=36)
    llm = _llm(d, monkeypatch, async_scheduling, pool_tokens=40)
    try:
        outs = _drive(llm, [(PROMPTS[0], wide), (PROMPTS[2], SamplingParams(temperature=0, max_tokens=30,
                                                                              ignore_eos=True))])
    finally:
        llm.shutdown()
    with pytest.raises(RequestTooLargeError, match=r"its 8 beams of \d+ tokens need \d+ KV-cache blocks together, "
                                                   r"but the pool has 10 blocks of 4 tokens"):
        outs[0].result(timeout=0)
    assert outs[1].result(timeout=0).outputs[0].token_ids == unpressured[2].outputs[0].token_ids[:30]


# ---- GPU: the CUDA ModelRunner (graphs, async scheduling) at batch scale ----------------------
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_gpu_beams_under_preemption_at_batch_scale(tiny, monkeypatch, async_scheduling):
    d, model = tiny
    monkeypatch.setenv("KVPILOT_TUNING", '{"async_scheduling": %s}' % ("true" if async_scheduling else "false"))
    prompts = [[1, 5, 9, 11], [1, 40, 41], [1, 7], [1, 60, 61, 62, 63]]
    beam = SamplingParams(use_beam_search=True, best_of=4, n=2, max_tokens=24)
    seeded = SamplingParams(temperature=0.9, seed=5, n=2, best_of=3, max_tokens=48, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    items = [(prompts[i % 4], sp) for i in range(16) for sp in (beam, seeded, greedy)]

    def run(pool_tokens):
        llm = LLM(str(d), skip_tokenizer_init=True, device="cuda", dtype="float32", max_batch_size=64,
                  max_num_tokens=512, kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=pool_tokens))
        llm._loop.stop()
        try:
            outs = _drive(llm, items, max_idle=100)
            core = llm._core
            return [o.result(timeout=0) for o in outs], core.scheduler.num_preemptions, core.num_overlapped_steps
        finally:
            llm.shutdown()

    ref, ref_preemptions, _ = run(16384)  # about 6,300 tokens of demand: no preemption
    outs, preemptions, overlapped = run(1024)
    assert ref_preemptions == 0 and preemptions > 16
    assert (overlapped > 0) is async_scheduling
    hf = {tuple(p): _hf_beams(model, p, 4, 2, 1.0, 24) for p in prompts}
    for (prompt, sp), out, alone in zip(items, outs, ref):
        if sp.use_beam_search:
            _check(out, *hf[tuple(prompt)], 1.0)
        else:
            _same_tokens(out, alone)
