"""Pipeline-stage decode graphs on CPU (CUDA graphs cannot run here; `graph_helpers.cpu_graph_class`
replays a graph by re-running its captured body on the static buffers).

- In one process: stage-mode `DecodeGraphs` of two `ModelRunner` stages, chained through their static
  activation buffers, give the whole model's eager logits (padding rows, context buckets, LM head in
  and outside the graph), and the buffer layout helpers.
- Across processes (gloo): `Worker.execute` with PP 3 (first, middle and last stage) gives the same
  logits and rows through the stage graphs as eagerly, for decode-only plans, padded micro-batches,
  and micro-batches that mix graph and eager runs in one step.
- `rank_graphs_enabled`: the `Tuning` switches.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.engine import make_tiny_llama
from support.graphs import cpu_graph_class
from kvpilot.config import KvCacheConfig
from kvpilot.model.config import ModelConfig
from kvpilot.runner.cuda_graphs import DecodeGraphs
from kvpilot.runner.model_runner import ModelRunner, ScheduledSeq

BLOCK = 8
MAX_BS = 6  # graph batch sizes 1, 2, 4, 6
MAX_SEQ = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # 3 layers: PP 3 has a first, a middle and a last stage of one layer each.
    return make_tiny_llama(tmp_path_factory.mktemp("stage_graphs") / "m", seed=5, layers=3)


def _kv() -> KvCacheConfig:
    return KvCacheConfig(tokens_per_block=BLOCK, max_tokens=4096)


class _Seqs:
    """The sequences of one plan, with disjoint block tables: decodes (one token at context ``ctx``)
    and prefill chunks. ``first_id`` keeps sequence ids distinct across plans."""

    def __init__(self, first_id: int = 0) -> None:
        self.next_block = 0
        self.next_id = first_id

    def _table(self, tokens: int) -> list[int]:
        nb = -(-tokens // BLOCK)
        self.next_block += nb
        return list(range(self.next_block - nb, self.next_block))

    def decode(self, ctx: int) -> ScheduledSeq:
        self.next_id += 1
        return ScheduledSeq(self.next_id, [(13 * self.next_id) % 380 + 3], ctx - 1, self._table(ctx), True)

    def chunk(self, n: int, start: int, sample: bool = True) -> ScheduledSeq:
        self.next_id += 1
        toks = [(5 * self.next_id + 3 * j) % 380 + 3 for j in range(n)]
        return ScheduledSeq(self.next_id, toks, start, self._table(start + n), sample)


def _runner(model_dir: Path, layer_range=None) -> ModelRunner:
    cfg = ModelConfig.from_dir(model_dir)
    return ModelRunner(model_dir, cfg, _kv(), 64, MAX_BS, MAX_SEQ, device="cpu", dtype="float32",
                       layer_range=layer_range)


@pytest.mark.parametrize("lm_head_in_graph", [True, False])
def test_chained_stage_graphs_match_whole_model(model_dir, lm_head_in_graph, monkeypatch):
    import kvpilot.runner.cuda_graphs as cg

    monkeypatch.setattr(cg, "_CONTEXT_BUCKETS", (64, 128))
    whole = _runner(model_dir)
    first, last = _runner(model_dir, (0, 2)), _runner(model_dir, (2, 3))
    assert (first.model.is_first, first.model.is_last, last.model.is_first, last.model.is_last) == (
        True, False, False, True)
    torch.manual_seed(0)
    for cache in whole.kv_caches:
        cache.normal_()
    first.kv_caches, last.kv_caches = whole.kv_caches[:2], whole.kv_caches[2:]
    G = cpu_graph_class(DecodeGraphs)
    with torch.inference_mode():
        g0, g1 = G(first, lm_head_in_graph=lm_head_in_graph), G(last, lm_head_in_graph=lm_head_in_graph)
        g0.capture()
        g1.capture()
        H = whole.cfg.hidden_size
        # Layout: contiguous [2, b, H] views at the start of flat static buffers.
        assert g0.out.shape == (2 * MAX_BS * H,) and g1.out.shape == (MAX_BS, 384 if lm_head_in_graph else H)
        for b in (1, 4, 6):
            o, i = g0.stage_output(b), g1.stage_input(b)
            assert o.shape == i.shape == (2, b, H) and o.is_contiguous() and i.is_contiguous()
            assert o.data_ptr() == g0.out.data_ptr()
        with pytest.raises(ValueError, match="first pipeline stage"):
            g0.stage_input(1)
        with pytest.raises(ValueError, match="last pipeline stage"):
            g1.stage_output(1)
        for k, (n, ctx, want) in enumerate( ((1, 5, (1, 64)), (2, 100, (2, 128)), (3, 40, (4, 256)), (5, 200, (6, 256)),
                             (6, 77, (6, 256)), (1, 256, (1, 256)))):
            seqs = _Seqs(100 * k)
            plan = [seqs.decode(ctx - i) for i in range(n)]  # differing contexts
            eager, rows = whole.execute(plan)
            key = g0.load(plan)
            assert key == want
            g0.replay(key)
            assert g1.load(plan) == key
            b = key[0]
            g1.stage_input(b).copy_(g0.stage_output(b))
            g1.replay(key)
            got = g1.logits(n)
            assert rows == list(range(n)) and got.shape == eager.shape == (n, 384)
            torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
            # Padding rows write no KV and attend nothing.
            assert g1.slots[n:b].tolist() == [-1] * (b - n)
            assert g1.qsl[:b + 1].tolist() == list(range(n + 1)) + [n] * (b - n)


def _plans() -> list[list[ScheduledSeq]]:
    s = [_Seqs(100 * k) for k in range(6)]
    return [
        [s[0].decode(5)],  # batch 1: one micro-batch, graph (1, 64)
        [s[1].decode(c) for c in (9, 70, 130, 200, 17, 64, 3, 250, 41)],  # 3 micro-batches of 3, padded to 4
        [s[2].chunk(6, 0)] + [s[2].decode(c) for c in (33, 90, 12, 150)],  # eager prefill, graph 1, graph 3 -> 4
        [s[3].decode(c) for c in (20, 21, 22)] + [s[3].chunk(6, 16)],  # graph 2, graph 1, eager prefill
        # Graphs of one decode each, then a one-token prefill chunk that samples nothing (eager).
        [s[4].decode(c) for c in (60, 61)] + [s[4].chunk(1, 30, sample=False)],
        [s[5].decode(c) for c in range(40, 54)],  # 14 decodes: micro-batches 5, 5, 4 -> graphs 6, 6, 4
    ]


# Graph micro-batches per plan above (every stage replays the same ones).
_REPLAYS = [1, 3, 2, 2, 2, 3]


def test_pipeline_worker_stage_graphs_match_eager(model_dir):
    from kvpilot.parallel.executor import make_worker_spec
    from kvpilot.parallel.worker import split_microbatches
    from support.parallel_exact import spawn_ranks
    from support.stage_graphs import stage_graph_rank

    plans = _plans()
    assert [len(mb) for mb in split_microbatches(plans[1], 3)] == [3, 3, 3]
    assert [[len(s.token_ids) for s in mb] for mb in split_microbatches(plans[2], 3)] == [[6], [1], [1, 1, 1]]
    pp = 3
    spec = make_worker_spec(model_dir, ModelConfig.from_dir(model_dir), _kv(), 64, MAX_BS, MAX_SEQ, "cpu", "float32",
                            1, pp, None)
    spec.timeout_s = 120
    answers = spawn_ranks(stage_graph_rank, lambda rank: (spec, plans), world=pp, timeout_s=180)
    for rank in range(pp):
        for i, (eager, graphed) in enumerate(answers[rank]):
            assert [n for _, n in graphed] == [_REPLAYS[i]] * 2, (rank, i)
            if rank < pp - 1:
                assert eager is None and all(r is None for r, _ in graphed)
                continue
            want, want_rows = eager
            n_rows = sum(1 for s in plans[i] if s.sample)
            assert want.shape == (n_rows, 384) and len(want_rows) == n_rows
            for (got, rows), _ in graphed:
                assert rows == want_rows
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_rank_graphs_enabled():
    from kvpilot.parallel.worker import rank_graphs_enabled
    from kvpilot.tuning import Tuning

    layouts = [(2, False), (1, True), (2, True)]  # TP, PP, TP x PP
    assert [rank_graphs_enabled(t, p, Tuning()) for t, p in layouts] == [True, True, True]
    off = Tuning(pp_cuda_graphs=False)
    assert [rank_graphs_enabled(t, p, off) for t, p in layouts] == [True, False, False]
    off = Tuning(tp_cuda_graphs=False)
    assert [rank_graphs_enabled(t, p, off) for t, p in layouts] == [False, True, False]
    off = Tuning(cuda_graphs=False)
    assert [rank_graphs_enabled(t, p, off) for t, p in layouts] == [False, False, False]
