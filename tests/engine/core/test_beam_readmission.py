"""A preempted beam request is re-admitted with its beams sharing blocks again (engine/core/scheduler.py).

Before this, re-admitted beams each got their own copy of every block (shared only through the
prefix cache, if it still held them), so a beam request that ran in the pool could fail with
`RequestTooLargeError` after a preemption; the scheduler merely avoided choosing such a request as
the victim while it had another candidate. Now each re-admitted beam takes the leading full blocks
it has in common with an earlier beam by reference, waits until that beam has computed them, and
recomputes only its own tokens.

- Scheduler level (no model): the block tables of a re-admitted group form the trie of the beams'
  token prefixes (checked against a count of the distinct prefixes), beams wait for their shared
  blocks, cached prefix blocks are taken from the prefix cache first; random workloads whose beams
  are chosen as a beam search chooses them (`BeamSearch._reassign`): every request that finishes
  alone finishes, with the same beams, in any mix, and every attended KV slot holds the sequence's
  own prefix (`_SimEngine._check_kv`).
- Engine level (the tiny random Llama and stories260K, CPU): two beam requests that fit the pool
  only while their beams share blocks, the later one preempted: both return what they return
  alone in a big pool, async scheduling on and off, block reuse on and off; blocks computed after
  the re-admission are reused by a later request.
- On a GPU (``-m gpu``): 16 requests (beam and long greedy) in a pool a quarter of their demand,
  CUDA ModelRunner with graphs, async scheduling on and off: every request returns what it returns
  unpressured, and re-admitted beams share blocks.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvpilot import LLM, KvCacheConfig, SamplingParams
from kvpilot.core.sequence import Request, Sequence, SequenceStatus

from support.beams import _alone, _drive, _llm, _prefix_keys, _same_tokens, _SimEngine
from support.beams import tiny  # noqa: F401 (tiny: the model fixture)
from support.beams import _workload, _alone_then_mixed, _mix_failed

FINISHED = SequenceStatus.FINISHED


# ---- scheduler level ------------------------------------------------------------------------
def _trie_blocks(token_lists: list[list[int]], B: int) -> int:
    """Reference: the blocks a group needs when equal leading full blocks are stored once: one per
    distinct prefix ending at a shareable full block (at most ``(len - 1) // B`` per sequence, as the
    scheduler shares), plus each sequence's remaining blocks."""
    prefixes = {tuple(t[:(k + 1) * B]) for t in token_lists for k in range((len(t) - 1) // B)}
    return len(prefixes) + sum(-(-len(t) // B) - (len(t) - 1) // B for t in token_lists)


def _waiting_group(sim: _SimEngine, rid: int, prompt: list[int], beams: list[list[int]], limit: int) -> Request:
    """A beam request whose beams (full token lists) wait at the tail of the queue, as a preempted
    request's beams do."""
    req = Request(rid, list(prompt), SamplingParams(use_beam_search=True, n=1, best_of=len(beams), max_tokens=64),
                  output=None)
    for i, toks in enumerate(beams):
        req.seqs.append(Sequence(request=req, index=i, token_ids=list(toks), seed=0))
    sim.reqs.append(req)
    sim.limits[rid] = limit
    for s in req.seqs:
        sim.sched.add(s)
    return req


# Blocks of 4; an 8-token prompt (2 blocks); three 17-token beams: beam 1 shares 2 blocks with beam 0,
# beam 2 shares 3 with beam 1 (and 2 with beam 0).
PROMPT = list(range(1, 9))
BEAMS = [PROMPT + list(range(20, 29)), PROMPT + [30, 31, 32, 33] + list(range(34, 39)),
         PROMPT + [30, 31, 32, 33] + list(range(40, 45))]


def _recording(sim: _SimEngine) -> list:
    outs = []
    schedule = sim.sched.schedule
    sim.sched.schedule = lambda *a, **k: outs.append(schedule(*a, **k)) or outs[-1]
    return outs


def test_readmitted_beams_share_their_common_blocks_and_wait_for_them():
    B = 4
    need = _trie_blocks(BEAMS, B)
    assert need == 10 and sum(-(-len(t) // B) for t in BEAMS) == 15  # shared vs. one copy per beam
    sim = _SimEngine(num_blocks=need, block_size=B, max_num_tokens=64, max_batch_size=8, reuse=False)
    req = _waiting_group(sim, 0, PROMPT, BEAMS, limit=18)
    b0, b1, b2 = req.seqs
    outs = _recording(sim)
    sim.step()
    # Admitted into a pool that one copy per beam would overflow: the tables form the prefix trie.
    assert b1.block_table[:2] == b0.block_table[:2] and b2.block_table[:3] == b1.block_table[:3]
    assert len({b for s in req.seqs for b in s.block_table}) == need and sim.kv.num_free_blocks == 0
    assert [sim.kv.blocks[b].ref_count for b in b2.block_table] == [3, 3, 2, 1, 1]
    # Beam 0 computes the shared blocks; the others count them and wait.
    assert [(s, n) for s, n in outs[0].scheduled] == [(b0, 17)]
    assert (b1.num_computed_tokens, b2.num_computed_tokens) == (8, 12)
    assert b1.shared_prefix == (b0, 8) and b2.shared_prefix == (b1, 12)
    sim.step()  # beam 1 computes its own 9 tokens (beam 0 its last one again: not every beam had logits)
    assert [(s, n) for s, n in outs[1].scheduled] == [(b0, 1), (b1, 9)]
    assert b1.shared_prefix is None and b2.shared_prefix == (b1, 12)
    sim.step()  # beam 2 only once beam 1 has computed the block beam 2 shares with it alone
    assert [(s, n) for s, n in outs[2].scheduled] == [(b0, 1), (b1, 1), (b2, 5)]
    assert all(s.status is FINISHED for s in req.seqs)  # the step gave every beam its logits: done
    assert sim.kv.num_free_blocks == need


def test_readmitted_beams_take_cached_prefix_blocks_first():
    """With block reuse, cached blocks come from the prefix cache (no wait: they are computed) and
    only blocks beyond them are shared inside the group; each cached block is counted once."""
    B = 4
    sim = _SimEngine(num_blocks=10, block_size=B, max_num_tokens=64, max_batch_size=8, reuse=True)
    plain = Request(9, BEAMS[0][:13], SamplingParams(max_tokens=1), output=None)
    seq = Sequence(request=plain, index=0, token_ids=list(plain.prompt_token_ids), seed=0)
    plain.seqs.append(seq)
    sim.kv.allocate(seq, 13)
    seq.num_computed_tokens = 13
    sim.kv.cache_full_blocks(seq)
    cached = seq.block_table[:3]  # the prompt's 2 blocks and beam 0's next one
    sim.kv.free(seq)
    # (what the sim's KV check expects those blocks to hold)
    sim.slots.update({cached[p // B] * B + p % B: k for p, k in enumerate(_prefix_keys(BEAMS[0][:12]))})

    req = _waiting_group(sim, 0, PROMPT, BEAMS, limit=18)
    b0, b1, b2 = req.seqs
    plan = sim.sched._group_plan(req.seqs)
    assert plan.cached == [cached, cached[:2], cached[:2]]
    assert plan.shared == [(-1, 3), (-1, 2), (1, 3)]  # beam 1: all it shares is cached; beam 2: b1's block
    assert plan.need == _trie_blocks(BEAMS, B) == 10  # 7 new blocks + the 3 cached ones, in the free queue
    outs = _recording(sim)
    sim.step()
    assert [(s, n) for s, n in outs[0].scheduled] == [(b0, 5), (b1, 9)]
    assert (outs[0].prefix_queries, outs[0].prefix_hits) == (3 * 17, (3 + 2 + 2) * B)
    assert b0.block_table[:3] == cached and b1.block_table[:2] == cached[:2]
    assert b2.block_table[:3] == b1.block_table[:3] and b2.shared_prefix == (b1, 12)
    sim.step()
    assert [(s, n) for s, n in outs[1].scheduled] == [(b0, 1), (b1, 1), (b2, 5)]
    assert all(s.status is FINISHED for s in req.seqs)


def test_sim_a_request_that_finishes_alone_finishes_in_any_mix():
    """200 random pools, block sizes, budgets and mixes of requests; beam requests are not limited to
    those that fit the pool without sharing. Each request runs alone first: those that fail alone
    (they can never fit) are left out, the others must all finish together, each beam request with
    the beams it has alone. (Before re-admitted beams shared blocks, 11 of these mixes failed a
    request with RequestTooLargeError despite the victim rule that passed over such requests.)"""
    failed, beam_preemptions = [], 0
    for seed in range(200):
        rng = random.Random(seed)
        B = rng.choice([2, 4, 8])
        num_blocks = rng.randint(8, 16)
        cfg = dict(num_blocks=num_blocks, block_size=B, max_num_tokens=rng.choice([8, 16, 64]),
                   max_batch_size=rng.choice([6, 8]), reuse=rng.random() < 0.5)

        def count_preemptions(sim):
            preempt = sim.sched._preempt

            def counted(seq, out):
                nonlocal beam_preemptions
                beam_preemptions += seq.request.lockstep and seq.index == 0 and seq.num_output_tokens > 0
                preempt(seq, out)

            sim.sched._preempt = counted

        alone, sim = _alone_then_mixed(cfg, _workload(rng, num_blocks, B), 2000, count_preemptions)
        if _mix_failed(alone, sim):
            failed.append((seed, {k: str(v) for k, v in sim.errors.items()}))
    assert not failed
    assert beam_preemptions > 100  # beam requests preempted after their first token, then re-admitted


# ---- engine level ---------------------------------------------------------------------------
# Two beam requests (3 beams, a 16-token prompt = 4 full blocks of 4, 8 new tokens) in a 12-block
# pool. Each fits alone only with its beams sharing the prompt's blocks (4 + 3 x 2 = 10 blocks at
# most; one copy per beam: 3 x 6 = 18). Together they are admitted (5 + 5 blocks), then the forks of
# the first need blocks and preempt the second, which must be re-admitted shared: one copy per beam
# (3 x 5 = 15 blocks) never fits, the old code failed it with RequestTooLargeError.
PROMPT_A = [1] + list(range(10, 25))
PROMPT_B = [1] + list(range(50, 65))
BEAM8 = SamplingParams(use_beam_search=True, best_of=3, n=2, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module", params=["tiny", "stories260K"])
def model_dir(request, tiny):
    """The tiny random Llama's directory, or stories260K's."""
    if request.param == "tiny":
        return tiny[0]
    return request.getfixturevalue("stories_model_dir")


@pytest.fixture(scope="module")
def alone(model_dir):
    """Both beam requests, each alone in a large pool."""
    return model_dir, _alone(model_dir, [(PROMPT_A, BEAM8), (PROMPT_B, BEAM8)])


@pytest.mark.parametrize("async_scheduling,reuse", [(False, False), (False, True), (True, False), (True, True)],
                         ids=["sync-no reuse", "sync-reuse", "async-no reuse", "async-reuse"])
def test_two_beam_requests_that_fit_only_shared_equal_their_runs_alone(alone, monkeypatch, async_scheduling, reuse):
    d, want = alone
    llm = _llm(d, monkeypatch, async_scheduling, pool_tokens=48, reuse=reuse, block=4, max_batch_size=8)
    core, sched = llm._core, llm._core.scheduler
    shared, readmitted = [], []
    share_prefix, admit_group = core.kv.share_prefix, sched._admit_group
    core.kv.share_prefix = lambda seq, src, n: (shared.append(n), share_prefix(seq, src, n))

    def admit(*args):
        group = sched._waiting_group()
        used = admit_group(*args)
        if used and len(group) > 1:  # a preempted beam request: its blocks, and the trie's count
            readmitted.append((len({b for s in group for b in s.block_table}),
                               _trie_blocks([s.token_ids for s in group], 4)))
        return used

    sched._admit_group = admit
    try:
        outs = _drive(llm, [(PROMPT_A, BEAM8), (PROMPT_B, BEAM8)])
    finally:
        llm.shutdown()
    assert readmitted and all(got == want for got, want in readmitted), readmitted
    # With reuse, the prompt blocks the first request's growth did not evict come from the prefix
    # cache; without it, every shared block is shared inside the group.
    assert shared or reuse
    for out, alone in zip(outs, want):
        _same_tokens(out.result(timeout=0), alone)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_blocks_recomputed_after_readmission_are_reused_by_a_later_request(tiny, monkeypatch, async_scheduling):
    """Prefix caching with re-admitted beams: the blocks the beams compute after their re-admission
    are registered (by whichever beam computed them) and a later request whose prompt is the
    second request's prompt and best beam takes them from the cache, returning what it returns
    alone."""
    d, _hf = tiny
    llm = _llm(d, monkeypatch, async_scheduling, pool_tokens=48, reuse=True, block=4, max_batch_size=8)
    core = llm._core
    try:
        _a, b = (o.result(timeout=0) for o in _drive(llm, [(PROMPT_A, BEAM8), (PROMPT_B, BEAM8)]))
        assert core.scheduler.num_preemptions > 0
        follow = PROMPT_B + b.outputs[0].token_ids
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        hits = core.kv.stats.hits
        (out,) = _drive(llm, [(follow, greedy)])
        got_hits = core.kv.stats.hits - hits
    finally:
        llm.shutdown()
    assert got_hits == (len(follow) - 1) // 4 * 4  # every full block but the one holding the last token
    assert out.result(timeout=0).outputs[0].token_ids == _alone(d, [(follow, greedy)])[0].outputs[0].token_ids


# ---- GPU: the CUDA ModelRunner (graphs, async scheduling) at batch scale ----------------------
def _batch_scale(d, device: str, async_scheduling: bool, reuse: bool, monkeypatch) -> None:
    """8 beam requests (4 beams, 41-token prompts: 2 full blocks of 16 to share) and 8 long greedy
    requests in a 40-block pool (a quarter of their demand): every request returns what it returns
    in a pool that needs no preemption, and re-admitted beams share blocks inside their group."""
    monkeypatch.setenv("KVPILOT_TUNING", '{"async_scheduling": %s}' % ("true" if async_scheduling else "false"))
    beam = SamplingParams(use_beam_search=True, best_of=4, n=2, max_tokens=24, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    items = [([1] + [(7 * i + j) % 90 + 3 for j in range(40)], sp) for i in range(8) for sp in (beam, greedy)]

    def run(pool_tokens):
        llm = LLM(str(d), skip_tokenizer_init=True, device=device, dtype="float32", max_batch_size=64,
                  max_num_tokens=512, kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=pool_tokens,
                                                                    enable_block_reuse=reuse))
        llm._loop.stop()
        shared = []
        share_prefix = llm._core.kv.share_prefix
        llm._core.kv.share_prefix = lambda seq, src, n: (shared.append(n), share_prefix(seq, src, n))
        try:
            outs = _drive(llm, items, max_idle=100)
            core = llm._core
            return [o.result(timeout=0) for o in outs], core.scheduler.num_preemptions, len(shared)
        finally:
            llm.shutdown()

    ref, ref_preemptions, _ = run(16384)
    outs, preemptions, shared = run(640)
    assert ref_preemptions == 0 and preemptions > 8 and shared > 0
    for out, want in zip(outs, ref):
        _same_tokens(out, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("async_scheduling,reuse", [(False, False), (True, False), (True, True)],
                         ids=["sync-no reuse", "async-no reuse", "async-reuse"])
def test_gpu_readmitted_beams_at_batch_scale(tiny, monkeypatch, async_scheduling, reuse):
    _batch_scale(tiny[0], "cuda", async_scheduling, reuse, monkeypatch)
