"""Tensor/pipeline-parallel ranks pad their eager prefill steps like one GPU's prefill graphs
(`model_runner.prefill_padding`, `parallel_worker.single_gpu_prefill_buckets`).

CPU only: the tiny random Llama of `support.engine._checkpoint`, the CPU doubles of the CUDA-graph sets
(tests/support/graphs.py) and, for pipeline parallelism, two gloo ranks (tests/support/parallel_exact.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.graphs import cpu_graph_class
from support.parallel_exact import BLOCK, pp_padding_rank, spawn_ranks
from support.engine import _checkpoint
from support.parallel_exact import BUCKETS, MAX_BS, MAX_SEQ, MAX_TOKENS, exactness_runner
from kvpilot.config import KvCacheConfig
from kvpilot.model.config import ModelConfig
from kvpilot.runner.cuda_graphs import PrefillGraphs
from kvpilot.runner.model_runner import ScheduledSeq, prefill_padding
from kvpilot.parallel.worker import single_gpu_prefill_buckets
from kvpilot.tuning import Tuning
from support.paths import load_benchmark

RandomSchedule = load_benchmark("gpu_prefill_padding").RandomSchedule

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # 2 layers, hidden 64, GQA 4/2 heads of 16, intermediate 96, vocab 128, random attention and MLP biases.
    return _checkpoint(tmp_path_factory.mktemp("prefill_padding") / "biased", bias=True)


def _seq(sid: int, n: int, first_block: int, start: int = 0, **kw) -> ScheduledSeq:
    nb = -(-(start + n) // BLOCK)
    return ScheduledSeq(sid, [(5 * sid + 3 * j) % 120 + 3 for j in range(n)], start,
                        list(range(first_block, first_block + nb)), True, **kw)


# ---- pipeline micro-batches of a step that one GPU runs eagerly -------------------------------------
def test_pp2_microbatches_are_padded_only_where_one_gpu_pads_the_step(model_dir):
    """Micro-batches are padded only when one GPU would pad the whole step (`Worker.execute`, ``pad_ok``
    of `ModelRunner.prepare`): a step of more tokens than the largest bucket (40 + 30 > 64), or one with
    a prompt-logprob sequence, that one GPU runs eagerly and unpadded, cut into micro-batches that each
    fit a bucket, runs unpadded on every stage too (the padding exists only to give the kernels one
    GPU's shapes); a step that is not split is unchanged. The logits stay those of the single-process
    model (other shapes: a few fp32 ulps apart)."""
    from kvpilot.parallel.executor import make_worker_spec

    kv = KvCacheConfig(tokens_per_block=BLOCK, max_tokens=512)
    spec = make_worker_spec(model_dir, ModelConfig.from_dir(model_dir), kv, MAX_TOKENS, MAX_BS, MAX_SEQ, "cpu",
                            "float32", 1, 2, None)
    spec.timeout_s = 120
    plans = [
        [_seq(0, 40, 0), _seq(1, 30, 5)],  # 70 tokens: eager on one GPU; micro-batches of 40 and 30
        [_seq(2, 6, 9, all_logits=True), _seq(3, 5, 10)],  # prompt logprobs: eager on one GPU
        [_seq(4, 9, 11), _seq(5, 12, 13)],  # 21 tokens: one GPU's bucket 32; micro-batches 9 -> 16, 12 -> 16
        [_seq(6, 20, 15)],  # one sequence, not split: padded as one GPU pads it (20 -> 32)
    ]
    res = spawn_ranks(pp_padding_rank, lambda rank: (spec, BUCKETS, plans))
    first, last = res[0], res[1]
    assert first["tokens"] == last["tokens"] == [40, 30, 6, 5, 16, 16, 32]
    assert last["single_graph_steps"] == 2  # one GPU replays graphs for the last two steps only
    for i, ((got, rows), (want, want_rows)) in enumerate(zip(last["pp"], last["single"])):
        assert rows == want_rows, i
        assert got.shape == want.shape and got.shape[0] == (7 if i == 1 else len(plans[i]))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# ---- which buckets the ranks pad to ---------------------------------------------------------------
@pytest.mark.parametrize("fields", [{}, {"prefill_graph_tokens": 40}, {"prefill_graph_tokens": 1000},
                                    {"prefill_graphs": False}, {"cuda_graphs": False}])
def test_rank_buckets_are_the_single_gpu_prefill_graphs_buckets(model_dir, fields):
    """Checked, right: the buckets a CUDA rank pads to are those one GPU's `PrefillGraphs` captures
    at the same ``max_num_tokens`` and `Tuning`, and None exactly where one GPU captures no prefill graphs."""
    tuning = Tuning(**fields)
    got = single_gpu_prefill_buckets(MAX_TOKENS, tuning)
    if not (tuning.cuda_graphs and tuning.prefill_graphs):  # one GPU captures none (`ModelRunner`)
        assert got is None
        return
    runner = exactness_runner(model_dir)
    runner.tuning = tuning
    graphs = cpu_graph_class(PrefillGraphs)(runner)
    assert got == graphs.token_buckets and got[-1] == min(MAX_TOKENS, tuning.prefill_graph_tokens)


def test_bad_prefill_graph_tokens_is_refused_before_any_engine_starts():
    """A prefill-graph cap below one token is refused by `Tuning` itself, so one GPU and the ranks
    of a tensor/pipeline-parallel engine never disagree about it."""
    with pytest.raises(ValueError, match="prefill_graph_tokens"):
        Tuning(prefill_graph_tokens=0)
    with pytest.raises(TypeError, match="prefill_graph_tokens"):
        Tuning(prefill_graph_tokens="lots")


# ---- padded eager prefill = one GPU's prefill graph, over an engine-like run ---------------------
def test_padded_eager_steps_equal_prefill_graph_replays_over_a_random_run(model_dir):
    """Checked, right: over 40 random steps (chunked prefill at any offset, several sequences,
    decodes mixed in, chunks that do not sample, prompt-logprob chunks, steps past the largest
    bucket; `gpu_prefill_padding.RandomSchedule`), a runner padding its eager steps
    (``prefill_pad_buckets``) returns the logits and rows of a runner replaying prefill graphs (CPU
    double), bit for bit, and leaves the same KV cache: padded tokens write no slot and padded
    sequences read none. (benchmarks/lab/gpu_prefill_padding.py checks the same on an H200, with cuBLAS
    and the Triton attention kernels.)"""
    graph_runner, eager_runner = exactness_runner(model_dir), exactness_runner(model_dir)
    graphs = cpu_graph_class(PrefillGraphs)(graph_runner, token_buckets=BUCKETS)
    graphs.capture()
    graph_runner.prefill_graphs = graphs
    eager_runner.prefill_pad_buckets = BUCKETS
    width = graph_runner.max_blocks_per_seq
    sched = RandomSchedule(graph_runner.num_blocks, width, MAX_BS, BLOCK, MAX_SEQ, 120, 40, [8, 16, 24, 48, 80],
                           seed=7)
    padded = graphed = 0
    with torch.inference_mode():
        for _ in range(40):
            plan = sched.plan()
            pad = prefill_padding(plan, BUCKETS, MAX_BS, width)
            padded += pad is not None and pad[0] > sum(len(s.token_ids) for s in plan)
            graphed += pad is not None
            want, want_rows = graph_runner.execute(plan)
            got, rows = eager_runner.execute(plan)
            assert rows == want_rows and torch.equal(got, want)
            sched.advance(plan)
        for a, b in zip(graph_runner.kv_caches, eager_runner.kv_caches):
            assert torch.equal(a, b)
    assert padded >= 10 and 40 - graphed >= 5, (padded, graphed)  # padded steps and eager ones
