"""`HostBlockTables` (the runner's persistent host copy of block tables) against a rebuild from the
lists, through random appends, frees, preemptions, beam-style forks and row reuse; the engine's
lazily compacted running list; and that the runner's input paths read tables through it."""

from __future__ import annotations

import types

import random
from dataclasses import dataclass

import numpy as np
import pytest

from kvpilot.runner.block_tables import HostBlockTables
from kvpilot.core.kv_cache_manager import KVCacheManager
from kvpilot.runner.model_runner import ScheduledSeq


@dataclass
class _Seq:
    seq_id: int
    block_table: list


def _check(tables: HostBlockTables, seqs) -> None:
    """The rows equal a rebuild from the lists: each table, then zeros."""
    rows, longest = tables.sync(seqs)
    assert longest == max((len(s.block_table) for s in seqs), default=0)
    owner = {}
    for r, s in zip(rows.tolist(), seqs):  # never two different tables in one row
        assert owner.setdefault(r, s.block_table) is s.block_table
    for r, s in zip(rows, seqs):
        want = np.zeros(tables.array.shape[1], np.int32)
        want[:len(s.block_table)] = s.block_table
        np.testing.assert_array_equal(tables.array[r], want)
    out = np.full((len(seqs) + 2, tables.array.shape[1] + 3), -7, np.int64)
    w = tables.gather(seqs, out)
    assert w == longest
    for i, s in enumerate(seqs):
        assert out[i, :w].tolist() == s.block_table + [0] * (w - len(s.block_table))
    assert (out[len(seqs):] == -7).all() and (out[:, w:] == -7).all()  # nothing else written


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rows_follow_random_appends_frees_and_forks(seed):
    rng = random.Random(seed)
    tables = HostBlockTables(width=4, rows=3)  # tiny: forces widening, row reuse and growth
    live: list[_Seq] = []
    next_id = 0
    next_block = 0
    for _step in range(300):
        op = rng.random()
        if op < 0.15 or not live:  # admit (maybe with a reused seq_id: a recreated runner input)
            live.append(_Seq(next_id if rng.random() < 0.9 else rng.randrange(max(next_id, 1)), []))
            next_id += 1
        elif op < 0.25:  # finish
            live.pop(rng.randrange(len(live)))
        elif op < 0.35:  # preempt: blocks freed (a new, empty list), later re-admitted
            live[rng.randrange(len(live))].block_table = []
        elif op < 0.42:  # beam fork: a new list holding a prefix of another sequence's table
            src = live[rng.randrange(len(live))]
            dst = live[rng.randrange(len(live))]
            dst.block_table = src.block_table[:rng.randrange(len(src.block_table) + 1)]
        truncated = None
        if 0.42 <= op < 0.45:  # truncated in place (then not appended to before the next sync)
            truncated = live[rng.randrange(len(live))]
            del truncated.block_table[rng.randrange(len(truncated.block_table) + 1):]
        for s in live:  # decode: some sequences get a block (now and then several)
            if s is not truncated and rng.random() < 0.3:
                for _ in range(1 if rng.random() < 0.9 else rng.randrange(2, 12)):
                    s.block_table.append(next_block % 1000)
                    next_block += 7
        # a step schedules a random subset, in any order (duplicates of a seq_id included)
        step = rng.sample(live, rng.randrange(len(live) + 1))
        _check(tables, step)
    assert tables.array.shape[1] >= 12 and tables.num_rows >= 3


def test_same_seq_id_twice_in_one_step_gets_two_rows():
    tables = HostBlockTables(width=4, rows=2)
    a, b = _Seq(5, [1, 2]), _Seq(5, [3])
    _check(tables, [a, b])
    _check(tables, [b, a, a])


def test_rows_of_idle_sequences_are_reused():
    tables = HostBlockTables(width=2, rows=4)
    for i in range(50):  # each step a new sequence: old rows are reclaimed, not grown without end
        rows, _ = tables.sync([_Seq(i, [i, i + 1])])
        assert tables.array[rows[0]].tolist() == [i, i + 1]
    assert tables.num_rows == 8  # grew once (the last _KEEP_CALLS calls' rows are kept), then reused


def test_kv_cache_manager_tables_through_the_mirror():
    """The KV manager's real block tables (allocate, free, preempt, prefix reuse) stay mirrored."""
    rng = random.Random(3)
    kv = KVCacheManager(num_blocks=64, tokens_per_block=4, enable_block_reuse=True)
    tables = HostBlockTables(width=2, rows=2)

    class _P:
        prompt_logprobs = None
        return_context_logits = False

    class _KvSeq:  # what the KV manager reads and writes of a Sequence
        def __init__(self, sid, tokens):
            self.seq_id, self.token_ids, self.block_table = sid, tokens, []
            self.num_computed_tokens = self.num_cached_blocks = 0
            self.params = _P()
            self.request = types.SimpleNamespace(lora=None)  # no adapter: the plain prefix-cache key

        @property
        def num_tokens(self):
            return len(self.token_ids)

    running: list[_KvSeq] = []
    for step in range(200):
        if rng.random() < 0.2 and len(running) < 6:
            s = _KvSeq(step, [rng.randrange(4) for _ in range(rng.randrange(1, 9))])
            cached = kv.match_prefix(s)
            if kv.can_allocate(s, s.num_tokens, cached):
                kv.admit(s, cached)
                kv.allocate(s, s.num_tokens - s.num_computed_tokens)
                s.num_computed_tokens = s.num_tokens
                running.append(s)
        for s in list(running):
            s.token_ids.append(rng.randrange(4))
            if not kv.can_allocate(s, 1) or rng.random() < 0.03:  # preempt or finish
                kv.free(s)
                running.remove(s)
                continue
            kv.allocate(s, 1)
            s.num_computed_tokens += 1
            kv.cache_full_blocks(s)
        if running:
            plan = [ScheduledSeq(s.seq_id, [s.token_ids[-1]], s.num_tokens - 1, s.block_table, True) for s in running]
            _check(tables, plan)


def test_runner_prepare_reads_the_mirror(tmp_path):
    """The eager input path gives the same slots and tables as a rebuild, across steps where tables grow."""
    from support.engine import make_tiny_llama
    from kvpilot import LLM, KvCacheConfig

    path = make_tiny_llama(tmp_path / "m", seed=3, layers=1)
    with LLM(str(path), skip_tokenizer_init=True, device="cpu", max_batch_size=4, max_seq_len=64,
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=512)) as llm:
        runner = llm._executor
        tabs = [[3, 9], [4], [7, 1, 2]]
        pos = [6, 3, 9]
        for _ in range(6):
            seqs = [ScheduledSeq(10 + i, [5], p, t, True) for i, (t, p) in enumerate(zip(tabs, pos))]
            seqs.append(ScheduledSeq(20, [1, 2, 3], 0, [30], False))  # a prefill chunk, not sampled
            ids, positions, meta, sample_idx = runner.prepare(seqs)
            width = max(len(t) for t in tabs)
            want = [t + [0] * (width - len(t)) for t in tabs] + [[30] + [0] * (width - 1)]
            assert meta.block_tables.tolist() == want
            flat_pos = pos + [0, 1, 2]
            flat_tab = tabs + [[30]] * 3
            assert positions.tolist() == flat_pos
            assert meta.slot_mapping.tolist() == [t[p // 4] * 4 + p % 4 for t, p in zip(flat_tab, flat_pos)]
            assert sample_idx == [0, 1, 2]
            for i in range(3):  # decode: the next position, a new block when one fills
                pos[i] += 1
                if pos[i] % 4 == 0:
                    tabs[i].append(40 + 3 * i + pos[i])


def test_decode_graph_buffers_across_steps_on_cpu(tmp_path):
    """`DecodeGraphs.prepare` over steps whose tables grow in place, get replaced (preemption) and
    change order: the static buffers equal a rebuild, and the replayed logits equal eager ones."""
    import torch
    from support.block_tables import DecodeTables, copies
    from support.engine import make_tiny_llama
    from support.graphs import cpu_graph_class
    from kvpilot import LLM, KvCacheConfig
    from kvpilot.runner.cuda_graphs import DecodeGraphs

    B = 4
    path = make_tiny_llama(tmp_path / "m", seed=5, layers=1)
    with LLM(str(path), skip_tokenizer_init=True, device="cpu", max_batch_size=8, max_seq_len=64,
             kv_cache_config=KvCacheConfig(tokens_per_block=B, max_tokens=1024)) as llm, torch.inference_mode():
        runner = llm._executor
        g = cpu_graph_class(DecodeGraphs)(runner)
        g.capture()
        torch.manual_seed(0)
        for cache in runner.kv_caches:
            cache.normal_()
        work = DecodeTables(runner.num_blocks, B, num_seqs=7, lo=1, hi=30)
        for step in range(12):
            seqs = work.step()
            got = g.run(seqs).clone()
            n = len(seqs)
            w = max(len(s.block_table) for s in seqs)
            assert g.tables[:n, :w].tolist() == [s.block_table + [0] * (w - len(s.block_table)) for s in seqs]
            assert g.slots[:n].tolist() == [s.block_table[s.start_pos // B] * B + s.start_pos % B for s in seqs]
            assert g.seq_lens[:n].tolist() == [s.start_pos + 1 for s in seqs]
            torch.testing.assert_close(got, runner.execute(copies(seqs, 100))[0], rtol=1e-5, atol=1e-5)
            work.advance(seqs, preempt=step % 4 == 3)


def test_scheduler_running_list_after_finishes_and_preemptions():
    """`Scheduler.finish` marks a running sequence and `running` drops it lazily: the list equals the
    admission order without the finished ones, preemption still takes the most recent, and a finished
    waiting sequence leaves the queue."""
    from kvpilot import SamplingParams
    from kvpilot.outputs import RequestOutput
    from kvpilot.core.scheduler import Scheduler
    from kvpilot.core.sequence import Request, Sequence, SequenceStatus

    kv = KVCacheManager(num_blocks=12, tokens_per_block=4, enable_block_reuse=False)
    sched = Scheduler(kv, max_num_tokens=64, max_batch_size=8)
    seqs = []
    for i in range(6):
        ids = [1, 10 + i, 20 + i]
        req = Request(i, ids, SamplingParams(), RequestOutput(i, None, ids, 1))
        req.seqs.append(Sequence(request=req, index=0, token_ids=list(ids), seed=0))
        seqs.append(req.seqs[0])
        sched.add(req.seqs[0])
    out = sched.schedule()
    assert [s for s, _ in out.scheduled] == seqs and sched.running == seqs
    for s, n in out.scheduled:  # as the engine does after the step
        s.num_computed_tokens += n
        s.token_ids.append(7)
    sched.finish(seqs[1])
    sched.finish(seqs[4])
    sched.finish(seqs[4])  # twice: nothing more happens
    assert sched.running == [seqs[0], seqs[2], seqs[3], seqs[5]]
    assert seqs[1].status is SequenceStatus.FINISHED and not seqs[1].block_table
    assert kv.num_used_blocks == 4  # one block each for the four left
    for s in sched.running:  # grow the rest until the pool is short: the newest is preempted first
        s.token_ids += [7] * 12
    out = sched.schedule()
    assert out.preempted == [seqs[5]] and sched.running == [seqs[0], seqs[2], seqs[3]]
    assert list(sched.waiting) == [seqs[5]] and seqs[5].status is SequenceStatus.WAITING
    sched.finish(seqs[5])  # a waiting sequence (an abort) leaves the queue
    assert not sched.waiting and sched.running == [seqs[0], seqs[2], seqs[3]]
    for s in list(sched.running):
        sched.finish(s)
    assert sched.running == [] and not sched.has_work and kv.num_used_blocks == 0


def test_runner_inputs_are_16_byte_aligned(tmp_path):
    """Every input tensor of an eager step starts on a 16-byte boundary (Triton compiles a separate
    kernel variant for a misaligned pointer), whatever the token and sequence counts, and holds
    exactly its own values."""
    from support.engine import make_tiny_llama
    from kvpilot import LLM, KvCacheConfig

    path = make_tiny_llama(tmp_path / "m", seed=3, layers=1)
    with LLM(str(path), skip_tokenizer_init=True, device="cpu", max_batch_size=4, max_seq_len=64,
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=512)) as llm:
        runner = llm._executor
        for q_lens in ([1], [3], [1, 2], [5, 1, 1], [2, 2, 3]):  # odd and even token/sequence counts
            seqs = [ScheduledSeq(50 + i, list(range(7, 7 + q)), 0, [10 + i, 20 + i], True)
                    for i, q in enumerate(q_lens)]
            ids, pos, meta, sample_idx, sample_t = runner._prepare(seqs)
            for t in (ids, pos, meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                      sample_t):
                assert t.data_ptr() % 16 == 0
            assert ids.tolist() == [t for q in q_lens for t in range(7, 7 + q)]
            assert pos.tolist() == [p for q in q_lens for p in range(q)]
            assert meta.seq_lens.tolist() == q_lens
            assert meta.query_start_loc.tolist() == np.concatenate([[0], np.cumsum(q_lens)]).tolist()
            assert sample_t.tolist() == sample_idx == (np.cumsum(q_lens) - 1).tolist()
