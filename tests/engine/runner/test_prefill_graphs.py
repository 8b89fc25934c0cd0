"""`PrefillGraphs`' host logic on CPU: bucket choice, padding, slot mapping and static buffers, and that
the static-buffer forward (what a graph replays) gives the eager path's logits for mixed batches,
with the reference attention and with the Triton kernel under TRITON_INTERPRET=1."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from support.engine import make_tiny_llama
from support.graphs import cpu_graph_class
from kvpilot import LLM, KvCacheConfig
from kvpilot.runner.cuda_graphs import DecodeGraphs, PrefillGraphs, capture_all, default_token_buckets
from kvpilot.tuning import Tuning
from kvpilot.runner.model_runner import ScheduledSeq

BLOCK = 8


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("pg") / "m", seed=11, layers=2)
    with LLM(str(path), skip_tokenizer_init=True, device="cpu", max_batch_size=6, max_num_tokens=64,
             max_seq_len=256, kv_cache_config=KvCacheConfig(tokens_per_block=BLOCK, max_tokens=4096)) as llm:
        yield llm


class _Blocks:
    """Hands out disjoint block tables."""

    def __init__(self) -> None:
        self.next = 0

    def seq(self, sid: int, n_tokens: int, start: int, sample: bool = True, **kw) -> ScheduledSeq:
        nb = -(-(start + n_tokens) // BLOCK)
        table = list(range(self.next, self.next + nb))
        self.next += nb
        return ScheduledSeq(sid, [(7 * sid + 3 * j) % 380 + 3 for j in range(n_tokens)], start, table, sample, **kw)


def _cases():
    b = _Blocks()
    return [
        # (seqs, expected bucket)
        ([b.seq(0, 5, 0)], 16),  # a short prompt: 11 padded tokens, 5 padded sequences
        ([b.seq(1, 13, 37), b.seq(2, 1, 19), b.seq(3, 1, 99), b.seq(4, 1, 8)], 16),  # chunk on a cached prefix + decodes
        ([b.seq(5, 24, 16, sample=False), b.seq(6, 9, 0), b.seq(7, 1, 50), b.seq(8, 1, 3), b.seq(9, 1, 70)], 64),
        ([b.seq(10, 2, 30)] + [b.seq(11 + i, 1, 10 * i + 5) for i in range(5)], 16),  # all six sequence slots
        ([b.seq(16, 64, 100)], 64),  # a full bucket: no padded token
        ([b.seq(17, 10, 0, sample=False)], 16),  # nothing sampled
    ]


def test_default_token_buckets(llm, monkeypatch):
    assert default_token_buckets(8192) == [16, 32, 64, 96, 128, 160, 192, 224, 256]
    assert default_token_buckets(8192, cap=1024) == [16, 32, 64, 96] + list(range(128, 513, 32)) + list(range(576, 1025, 64))
    assert default_token_buckets(100) == [16, 32, 64, 96, 100]
    assert default_token_buckets(8192, cap=300) == [16, 32, 64, 96, 128, 160, 192, 224, 256, 288, 300]
    # The runner's Tuning sets the cap; max_num_tokens (64 here) still bounds it.
    runner = llm._executor
    monkeypatch.setattr(runner, "tuning", Tuning(prefill_graph_tokens=40))
    assert cpu_graph_class(PrefillGraphs)(runner).token_buckets == [16, 32, 40]
    monkeypatch.setattr(runner, "tuning", Tuning(prefill_graph_tokens=1024))
    assert cpu_graph_class(PrefillGraphs)(runner).token_buckets == [16, 32, 64]
    monkeypatch.setenv("KVPILOT_TUNING", '{"prefill_graph_tokens": "lots"}')
    with pytest.raises(ValueError, match="KVPILOT_TUNING: .*prefill_graph_tokens"):
        Tuning.from_env()


@pytest.mark.parametrize("attention", ["reference", "triton"])
def test_prefill_graph_matches_eager_on_cpu(llm, attention, monkeypatch):
    import kvpilot.kernels as K

    if attention == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel runs on CPU only under TRITON_INTERPRET=1")
    runner = llm._executor
    assert runner.graphs is None and runner.prefill_graphs is None  # CPU: eager
    g = cpu_graph_class(PrefillGraphs)(runner)
    assert g.token_buckets == [16, 32, 64] and g.max_seqs == 6 and g.width == 256 // BLOCK
    with torch.inference_mode():
        g.capture()
        assert g.captured == [(64,), (32,), (16,)]
        torch.manual_seed(0)
        for cache in runner.kv_caches:  # random "cached prefix" contents
            cache.normal_()
        ref_attention = K.paged_attention
        for seqs, bucket in _cases():
            assert g.can_run(seqs)
            if attention == "triton":
                monkeypatch.setattr(K, "paged_attention", K.paged_attention_triton)
            got, rows = g.run(seqs)
            got = got.clone()
            monkeypatch.setattr(K, "paged_attention", ref_attention)
            eager, eager_rows = runner.execute(seqs)
            assert rows == eager_rows
            assert got.shape == eager.shape
            torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
            _check_static_buffers(g, seqs, bucket)


def _check_static_buffers(g, seqs, bucket):
    n = len(seqs)
    real = sum(len(s.token_ids) for s in seqs)
    S = min(bucket, g.max_seqs)
    qlens = [len(s.token_ids) for s in seqs]
    pos = [s.start_pos + j for s in seqs for j in range(len(s.token_ids))]
    tables = [s.block_table for s in seqs for _ in s.token_ids]
    assert g.ids[:real].tolist() == [t for s in seqs for t in s.token_ids]
    assert g.pos[:bucket].tolist() == pos + [0] * (bucket - real)
    assert g.slots[:bucket].tolist() == [t[p // BLOCK] * BLOCK + p % BLOCK for t, p in zip(tables, pos)] + [-1] * (bucket - real)
    assert g.qsl[:S + 1].tolist() == list(np.cumsum([0] + qlens)) + [real] * (S - n)
    assert g.seq_lens[:S].tolist() == [s.start_pos + len(s.token_ids) for s in seqs] + [0] * (S - n)
    for i, s in enumerate(seqs):
        assert g.tables[i, :len(s.block_table)].tolist() == s.block_table


def test_prefill_graph_can_run(llm):
    runner = llm._executor
    g = cpu_graph_class(PrefillGraphs)(runner)
    b = _Blocks()
    chunk = [b.seq(0, 8, 0), b.seq(1, 1, 5)]
    assert not g.can_run(chunk)  # nothing captured yet
    with torch.inference_mode():
        g.capture()
    assert g.can_run(chunk)
    assert not g.can_run([])
    assert not g.can_run([b.seq(2, 1, 5), b.seq(3, 1, 9)])  # decode-only: the decode graphs' job
    assert not g.can_run([b.seq(4, 8, 0, all_logits=True)])  # prompt logprobs: eager
    assert not g.can_run([b.seq(5, 65, 0)])  # more tokens than the largest bucket
    assert not g.can_run([b.seq(6, 2, 0)] + [b.seq(7 + i, 1, 4) for i in range(6)])  # 7 sequences > 6
    long = b.seq(20, 2, 0)
    long.block_table = long.block_table + list(range(300, 300 + g.width))
    assert not g.can_run([long])  # wider block table than max_seq_len allows


def test_capture_all_falls_back_when_prefill_capture_fails(llm, caplog):
    runner = llm._executor

    class Broken(cpu_graph_class(PrefillGraphs)):
        def _body(self, T):
            raise RuntimeError("capture failed")

    Decode = cpu_graph_class(DecodeGraphs)
    with torch.inference_mode(), caplog.at_level(logging.WARNING, logger="kvpilot.runner.cuda_graphs"):
        dg, pg = capture_all(runner, decode_cls=Decode, prefill_cls=Broken)
        assert pg is None and isinstance(dg, Decode) and dg.graphs
        assert "prefill CUDA graph capture failed" in caplog.text
        dg, pg = capture_all(runner, prefill=False, decode_cls=Decode, prefill_cls=Broken)
        assert pg is None and dg.graphs
        dg, pg = capture_all(runner, decode_cls=Decode, prefill_cls=cpu_graph_class(PrefillGraphs))
        assert sorted(pg.graphs) == [16, 32, 64] and dg.graphs
