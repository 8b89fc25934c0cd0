"""Pure pieces of the parallel executor: stage split, micro-batches, LWS environment, layout checks."""

from __future__ import annotations

import pytest

from kvpilot.config import KvCacheConfig

from kvpilot.model.config import ModelConfig
from kvpilot.runner.model_runner import ScheduledSeq
from kvpilot.parallel.executor import LwsGroup, make_worker_spec, validate_layout
from kvpilot.parallel.worker import split_microbatches, stage_layers


def test_stage_layers_contiguous_and_uneven():
    assert stage_layers(5, 2) == [(0, 3), (3, 5)]
    assert stage_layers(32, 3) == [(0, 11), (11, 22), (22, 32)]
    assert stage_layers(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert stage_layers(7, 1) == [(0, 7)]
    with pytest.raises(ValueError, match="exceeds the model's 3 layers"):
        stage_layers(3, 4)


def _plan(lengths):
    return [ScheduledSeq(i, [1] * n, 0, [i], True) for i, n in enumerate(lengths)]


@pytest.mark.parametrize("lengths,parts,want", [
    ([1, 1, 1, 1], 2, [[0, 1], [2, 3]]),
    ([100, 1, 1, 1], 2, [[0], [1, 2, 3]]),
    ([1, 1, 1, 100], 2, [[0, 1, 2], [3]]),
    ([5, 5, 5], 4, [[0], [1], [2]]),
    ([7], 2, [[0]]),
    ([3, 3, 3, 3], 1, [[0, 1, 2, 3]]),
    ([10, 1, 1, 1, 1, 10], 3, [[0], [1, 2, 3, 4], [5]]),
])
def test_split_microbatches(lengths, parts, want):
    plan = _plan(lengths)
    got = split_microbatches(plan, parts)
    assert [[s.seq_id for s in mb] for mb in got] == want
    assert [s for mb in got for s in mb] == plan  # contiguous, order kept, nothing lost


def test_lws_group_from_env():
    assert LwsGroup.from_env({}) is None
    assert LwsGroup.from_env({"LWS_GROUP_SIZE": "1", "LWS_LEADER_ADDRESS": "x"}) is None
    g = LwsGroup.from_env({"LWS_GROUP_SIZE": "2", "LWS_LEADER_ADDRESS": "llm-0.llm", "LWS_WORKER_INDEX": "1"})
    assert g == LwsGroup("llm-0.llm", 2, 1, 29500)
    g = LwsGroup.from_env({"LWS_GROUP_SIZE": "4", "LWS_LEADER_ADDRESS": "h", "MASTER_PORT": "1234"})
    assert (g.index, g.port) == (0, 1234)
    with pytest.raises(ValueError, match="LWS_LEADER_ADDRESS is not set"):
        LwsGroup.from_env({"LWS_GROUP_SIZE": "2"})


def test_layout_validation(stories_model_dir):
    cfg = ModelConfig.from_dir(stories_model_dir)  # 8 heads, 4 KV heads, intermediate 172, 5 layers
    validate_layout(cfg, 2, 2)
    validate_layout(cfg, 4, 5)
    with pytest.raises(ValueError, match="must divide num_attention_heads 8"):
        validate_layout(cfg, 3, 1)
    with pytest.raises(ValueError, match="must divide intermediate_size 172"):
        validate_layout(cfg, 8, 1)
    cfg.num_key_value_heads = 2
    validate_layout(cfg, 4, 1)  # KV heads replicated
    cfg.num_key_value_heads = 3
    cfg.num_attention_heads = 12
    with pytest.raises(ValueError, match="must divide, or be a multiple of, num_key_value_heads 3"):
        validate_layout(cfg, 2, 1)


def test_worker_spec_for_a_leader_worker_set(stories_model_dir):
    cfg = ModelConfig.from_dir(stories_model_dir)
    group = LwsGroup("leader.svc", 2, 1, 29511)
    spec = make_worker_spec(stories_model_dir, cfg, KvCacheConfig(), 512, 8, 256, "cpu", "auto", 2, 2, group)
    assert (spec.world_size, spec.ranks_per_node, spec.multi_node) == (4, 2, True)
    assert spec.init_method == "tcp://leader.svc:29511"
    with pytest.raises(ValueError, match="do not split evenly over 3 pods"):
        make_worker_spec(stories_model_dir, cfg, KvCacheConfig(), 512, 8, 256, "cpu", "auto", 2, 1,
                         LwsGroup("h", 3, 0, 1))
    local = make_worker_spec(stories_model_dir, cfg, KvCacheConfig(), 512, 8, 256, "cpu", "auto", 2, 1, None)
    assert local.init_method.startswith("tcp://127.0.0.1:") and not local.multi_node


def _roundtrip(enc, dec, plan):
    import pickle

    got = dec.decode(pickle.loads(pickle.dumps(enc.encode(plan))))
    assert [(s.seq_id, s.token_ids, s.start_pos, s.block_table, s.sample, s.all_logits) for s in got] == \
        [(s.seq_id, s.token_ids, s.start_pos, s.block_table, s.sample, s.all_logits) for s in plan]
    return got


def test_plan_encoding_sends_block_table_deltas_and_keeps_worker_lists():
    from kvpilot.parallel.worker import PlanDecoder, PlanEncoder

    enc, dec = PlanEncoder(), PlanDecoder()
    a, b = [3, 4], [9]
    plan = [ScheduledSeq(0, [1, 2, 3], 0, a, False), ScheduledSeq(1, [7], 5, b, True, True)]
    first = _roundtrip(enc, dec, plan)
    a.append(5)  # grows in place: only the new block is sent, the worker extends its own list
    plan = [ScheduledSeq(0, [8], 3, a, True), ScheduledSeq(1, [2], 6, b, True)]
    encoded = enc.encode(plan)
    assert [e[3:5] for e in encoded] == [(1, [5]), (1, [])]
    second = dec.decode(encoded)
    assert [s.block_table for s in second] == [[3, 4, 5], [9]]
    assert second[0].block_table is first[0].block_table  # identity kept: HostBlockTables appends
    # A replaced list, a sequence that skipped a step, and a duplicate id all travel in full.
    a2 = [6, 7]
    plan = [ScheduledSeq(0, [1], 4, a2, True)]
    assert enc.encode(plan)[0][3:5] == (0, a2)
    enc, dec = PlanEncoder(), PlanDecoder()
    lists = {0: [1], 1: [2], 2: [3]}
    for step in range(6):
        ids = [i for i in range(3) if (i + step) % 3]  # each sequence is absent every third step
        for i in ids:
            lists[i].append(10 * step + i)
        plan = [ScheduledSeq(i, [i], step, lists[i], True) for i in ids]
        if step == 4:
            plan.append(ScheduledSeq(ids[0], [0], step, [99, 98], False))  # same id twice (a fork)
        _roundtrip(enc, dec, plan)


def test_step_timer_summary_matches_statistics():
    import statistics

    from kvpilot.parallel.executor import format_step_timing
    from kvpilot.parallel.worker import StepTimer

    t = StepTimer(keep=3)
    for x in (0.001, 0.004, 0.002, 0.010):
        t.add("send", x)
    t.add("wait", 0.5)
    got = t.summary()
    kept = [4.0, 2.0, 10.0]  # the last 3, in milliseconds
    assert list(got) == ["send", "wait"]
    assert got["send"]["n"] == 3
    assert got["send"]["mean_ms"] == pytest.approx(statistics.fmean(kept))
    assert got["send"]["median_ms"] == pytest.approx(statistics.median(kept))
    text = format_step_timing({"front_end": got, "ranks": {1: {"idle": got["wait"]}}})
    assert "front end  send" in text and "rank 1" in text and "500.000" in text
    t.reset()
    assert t.summary() == {}


def test_plan_encoding_keeps_each_sequence_verify_all_logits_and_inflight_fields():
    """Every field of a front-end `ScheduledSeq` reaches the worker's copy in its own place (the
    adapter's round trip: tests/engine/lora/test_lora_tensor_parallel_shards.py)."""
    from kvpilot.parallel.worker import PlanDecoder, PlanEncoder

    plan = [ScheduledSeq(0, [1, 2], 0, [3], True, True, -1, True),
            ScheduledSeq(1, [5], 4, [6], True),
            ScheduledSeq(2, [7], 2, [8], True, inflight_row=0)]
    got = PlanDecoder().decode(PlanEncoder().encode(plan))
    assert got == plan
