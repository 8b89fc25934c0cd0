"""Pure pieces of the parallel executor: stage split, micro-batches, LWS environment, layout checks."""

from __future__ import annotations

import pytest

from kvpilot.config import KvCacheConfig, ModelConfig
from kvpilot.model_runner import ScheduledSeq
from kvpilot.parallel import LwsGroup, make_worker_spec, validate_layout
from kvpilot.parallel_worker import split_microbatches, stage_layers


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
