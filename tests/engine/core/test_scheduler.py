"""`Scheduler` (engine/core/scheduler.py) on its own, driven step by step without a model: the token
budget (decodes first, then chunked prefills), first-come admission within ``max_batch_size``,
out-of-blocks waiting, recompute preemption of the most recently admitted sequence, prefix-cache hits
and evictions at admission, ``schedule(preempt=False)``, in-flight tokens, lockstep (beam) requests'
reserved batch slots and `unfit_error`."""

from __future__ import annotations

import itertools

import pytest

from kvpilot import RequestTooLargeError, SamplingParams
from kvpilot.core.kv_cache_manager import KVCacheManager
from kvpilot.core.scheduler import Scheduler, SchedulerOutput
from kvpilot.core.sequence import Request, Sequence, SequenceStatus

B = 4  # tokens per block
RUNNING, WAITING, FINISHED = SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.FINISHED
_ids = itertools.count()


def _make(num_blocks: int, max_num_tokens: int, max_batch_size: int, reuse: bool = True) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, B, enable_block_reuse=reuse), max_num_tokens, max_batch_size)


def _add(sched: Scheduler, prompt: list[int], max_tokens: int = 16, **params) -> Sequence:
    """Queue a one-sequence request (for a beam request: its first sequence)."""
    req = Request(next(_ids), list(prompt), SamplingParams(max_tokens=max_tokens, **params), output=None)
    seq = Sequence(request=req, index=0, token_ids=list(prompt), seed=0)
    seq.length_limit = len(prompt) + max_tokens
    req.seqs.append(seq)
    sched.add(seq)
    return seq


def _run(sched: Scheduler, out: SchedulerOutput, new_token: int = 7) -> None:
    """What the engine does with a step: the scheduled tokens are computed, their full blocks
    registered, and a sequence with every token computed gets one more token."""
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        sched.kv.cache_full_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(new_token)


def _plan(out: SchedulerOutput) -> list[tuple[Sequence, int]]:
    return list(out.scheduled)


def test_prefill_is_chunked_to_the_token_budget_and_admission_is_first_come():
    sched = _make(num_blocks=16, max_num_tokens=8, max_batch_size=4)
    a, b = _add(sched, list(range(1, 11))), _add(sched, list(range(20, 25)))
    out = sched.schedule()
    assert _plan(out) == [(a, 8)] and out.num_tokens == 8 and not out.preempted
    assert a.status is RUNNING and list(sched.waiting) == [b]
    assert a.block_table == [0, 1]  # blocks for the 8 tokens of this step only
    _run(sched, out)
    out = sched.schedule()
    assert _plan(out) == [(a, 2), (b, 5)]  # the rest of a's prompt first, then b in what is left
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4]
    _run(sched, out)
    out = sched.schedule()
    assert _plan(out) == [(a, 1), (b, 1)]  # decodes
    assert sched.running == [a, b] and not sched.waiting


def test_running_sequences_are_served_before_new_ones():
    sched = _make(num_blocks=16, max_num_tokens=6, max_batch_size=4)
    a = _add(sched, [1, 2, 3])
    _run(sched, sched.schedule())
    b = _add(sched, list(range(10, 20)))
    out = sched.schedule()
    assert _plan(out) == [(a, 1), (b, 5)]


def test_admission_stops_at_max_batch_size():
    sched = _make(num_blocks=16, max_num_tokens=64, max_batch_size=2)
    seqs = [_add(sched, [1 + i, 2, 3]) for i in range(3)]
    out = sched.schedule()
    assert _plan(out) == [(seqs[0], 3), (seqs[1], 3)]
    assert list(sched.waiting) == [seqs[2]]
    _run(sched, out)
    sched.finish(seqs[0])
    assert seqs[0].status is FINISHED and seqs[0].block_table == []
    out = sched.schedule()
    assert _plan(out) == [(seqs[1], 1), (seqs[2], 3)]


def test_a_request_waits_while_the_pool_cannot_hold_it():
    sched = _make(num_blocks=2, max_num_tokens=64, max_batch_size=4)
    a = _add(sched, list(range(1, 9)))  # 8 tokens: the whole pool
    b = _add(sched, [50, 51])
    out = sched.schedule()
    assert _plan(out) == [(a, 8)] and not out.preempted
    assert list(sched.waiting) == [b] and b.status is WAITING and sched.kv.num_free_blocks == 0
    sched.finish(a)
    assert sched.kv.num_free_blocks == 2
    out = sched.schedule()
    assert _plan(out) == [(b, 2)]


def test_the_most_recently_admitted_sequence_is_preempted_and_recomputed():
    sched = _make(num_blocks=2, max_num_tokens=64, max_batch_size=4)
    a, b = _add(sched, [1, 2, 3, 4]), _add(sched, [5, 6, 7, 8])
    out = sched.schedule()
    assert _plan(out) == [(a, 4), (b, 4)]
    _run(sched, out)  # both now hold 5 tokens: each needs a second block, and none is free
    assert sched.kv.num_free_blocks == 0
    out = sched.schedule()
    assert _plan(out) == [(a, 1)] and out.preempted == [b]
    assert sched.num_preemptions == 1
    assert b.status is WAITING and sched.waiting[0] is b
    assert (b.block_table, b.num_computed_tokens) == ([], 0)
    assert b.token_ids == [5, 6, 7, 8, 7]  # keeps what it generated
    assert a.block_table == [0, 1]  # b's freed block, hash and all, was evicted for a
    _run(sched, out)
    sched.finish(a)
    out = sched.schedule()
    # b recomputes prompt and output; its cached block was evicted, so nothing is a hit.
    assert _plan(out) == [(b, 5)] and out.prefix_hits == 0 and out.prefix_queries == 5


def test_nothing_new_is_admitted_in_a_step_that_preempts():
    sched = _make(num_blocks=3, max_num_tokens=64, max_batch_size=4)
    a, b = _add(sched, [1, 2, 3, 4]), _add(sched, [5, 6, 7, 8])
    _run(sched, sched.schedule())
    c = _add(sched, [9])
    out = sched.schedule()  # a takes the last block; b needs one: b is preempted; c must wait too
    assert _plan(out) == [(a, 1)] and out.preempted == [b]
    assert list(sched.waiting) == [b, c]


def test_schedule_without_preemption_returns_none_where_it_would_preempt():
    sched = _make(num_blocks=2, max_num_tokens=64, max_batch_size=4)
    a, b = _add(sched, [1, 2, 3, 4]), _add(sched, [5, 6, 7, 8])
    _run(sched, sched.schedule())
    assert sched.schedule(preempt=False) is None
    assert sched.num_preemptions == 0 and sched.running == [a, b]
    sched.finish(b)  # (as if b's in-flight token had finished it)
    out = sched.schedule(preempt=False)
    assert _plan(out) == [(a, 1)] and a.block_table == [0, 1]


def test_a_prefix_hit_at_admission_computes_only_the_rest():
    sched = _make(num_blocks=8, max_num_tokens=64, max_batch_size=4)
    prompt = list(range(1, 10))  # 9 tokens: 2 full blocks
    a = _add(sched, prompt)
    _run(sched, sched.schedule())
    sched.finish(a)
    b = _add(sched, prompt)
    out = sched.schedule()
    assert _plan(out) == [(b, 1)]
    assert (out.prefix_queries, out.prefix_hits) == (9, 8)
    assert b.num_computed_tokens == 8 and b.block_table[:2] == [0, 1]
    assert sched.kv.stats.reused_blocks == 2


def test_without_block_reuse_a_repeated_prompt_is_computed_again():
    sched = _make(num_blocks=8, max_num_tokens=64, max_batch_size=4, reuse=False)
    prompt = list(range(1, 10))
    a = _add(sched, prompt)
    _run(sched, sched.schedule())
    sched.finish(a)
    b = _add(sched, prompt)
    out = sched.schedule()
    assert _plan(out) == [(b, 9)] and (out.prefix_queries, out.prefix_hits) == (0, 0)


def test_an_inflight_token_counts_as_one_more_to_compute():
    sched = _make(num_blocks=8, max_num_tokens=64, max_batch_size=4)
    a = _add(sched, [1, 2, 3, 4], max_tokens=2)  # stops at 6 tokens
    out = sched.schedule()
    assert _plan(out) == [(a, 4)]
    a.num_computed_tokens = 4  # computed; its first output token is still on the device
    a.inflight_row = 0
    out = sched.schedule()
    assert _plan(out) == [(a, 1)] and a.block_table == [0, 1]  # the in-flight token needs a slot
    a.token_ids.append(9)  # read back: 5 tokens, and the next in flight is the last (6 = limit)
    a.num_computed_tokens = 5
    out = sched.schedule()
    assert _plan(out) == [] and not out


def test_finish_removes_a_waiting_sequence_from_the_queue():
    sched = _make(num_blocks=1, max_num_tokens=64, max_batch_size=4)
    a, b = _add(sched, [1, 2, 3, 4]), _add(sched, [5])
    sched.schedule()
    assert list(sched.waiting) == [b] and sched.has_work
    sched.finish(b)
    assert not sched.waiting and b.status is FINISHED
    sched.finish(a)
    assert not sched.has_work and sched.running == [] and sched.kv.num_free_blocks == 1


def test_a_beam_request_reserves_the_batch_slots_of_its_width():
    sched = _make(num_blocks=32, max_num_tokens=64, max_batch_size=4)
    beam = _add(sched, [1, 2, 3], use_beam_search=True, n=3)
    small = [_add(sched, [10 + i]) for i in range(2)]
    out = sched.schedule()
    # The beam request runs one sequence but holds 3 slots: one slot is left for the others.
    assert _plan(out) == [(beam, 3), (small[0], 1)]
    assert list(sched.waiting) == [small[1]]


def test_unfit_error_says_what_the_request_lacks():
    sched = _make(num_blocks=2, max_num_tokens=2, max_batch_size=2)
    plain = _add(sched, list(range(1, 12)))
    err = sched.unfit_error(plain)
    assert isinstance(err, RequestTooLargeError)
    assert str(err) == f"request {plain.request.request_id} needs more KV-cache blocks than the pool has"
    wide = _add(sched, [1, 2], use_beam_search=True, n=3)
    assert f"beam search with 3 beams needs 3 sequences in one batch, but max_batch_size is 2" in str(
        sched.unfit_error(wide))
    sched2 = _make(num_blocks=2, max_num_tokens=2, max_batch_size=4)
    wide2 = _add(sched2, [1, 2], use_beam_search=True, n=3)
    assert "its 3 beams need 3 tokens in one step, but max_num_tokens is 2" in str(sched2.unfit_error(wide2))


@pytest.mark.parametrize("reuse", [True, False])
def test_blocks_are_all_returned_after_a_mixed_run(reuse):
    """Twelve requests of assorted lengths through a small pool (preemptions on the way): every one
    finishes after ``max_tokens`` tokens, and every block is free at the end."""
    sched = _make(num_blocks=10, max_num_tokens=16, max_batch_size=4, reuse=reuse)
    seqs = [_add(sched, [1 + (i * 5 + j) % 30 for j in range(3 + i % 7)], max_tokens=4 + i % 5) for i in range(12)]
    for _ in range(500):
        if not sched.has_work:
            break
        out = sched.schedule()
        _run(sched, out)
        for seq in list(sched.running):
            if seq.num_tokens >= seq.length_limit and seq.num_computed_tokens == seq.num_tokens - 1:
                sched.finish(seq)
        used = sum(len(s.block_table) for s in sched.running)
        assert sched.kv.num_used_blocks <= used  # shared cached blocks count once
    assert not sched.has_work
    assert sched.num_preemptions > 0
    assert [s.num_tokens for s in seqs] == [s.length_limit for s in seqs]
    assert sched.kv.num_free_blocks == 10 and all(b.ref_count == 0 for b in sched.kv.blocks)
