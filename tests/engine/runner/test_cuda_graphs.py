"""The model runner's CUDA path: decode and prefill/mixed graph replay equal eager, stories260K golden
and HF parity on a GPU; the decode graphs' host-side logic (padding, context buckets, slots) on CPU
with fake graphs (the prefill graphs' is in test_prefill_graphs.py)."""

from __future__ import annotations

import pytest
import torch

from support.engine import GOLDEN, hf_greedy, make_tiny_llama
from support.graphs import cpu_graph_class
from kvpilot import LLM, KvCacheConfig, SamplingParams
from kvpilot.runner.model_runner import ScheduledSeq

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("g") / "m", seed=7, layers=2)


def _decode_seqs(n: int, ctx: int, block: int) -> list[ScheduledSeq]:
    nb = -(-ctx // block)
    return [ScheduledSeq(-1 - i, [3 + i], ctx - 1, list(range(i * nb, (i + 1) * nb)), True) for i in range(n)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_graph_replay_matches_eager(tiny_dir, dtype, tol):
    with LLM(str(tiny_dir), skip_tokenizer_init=True, device="cuda", dtype=dtype, max_batch_size=24,
             max_seq_len=256, kv_cache_config=KvCacheConfig(max_tokens=8192)) as llm:
        runner = llm._executor
        assert runner.graphs is not None and runner.graphs.batch_sizes == [1, 2, 4, 8, 16, 24]
        torch.manual_seed(0)
        for cache in runner.kv_caches:  # non-zero context so attention matters
            cache.normal_()
        for n, ctx in ((1, 5), (3, 40), (9, 200), (24, 77)):  # 3 -> padded 4, 9 -> padded 16
            seqs = _decode_seqs(n, ctx, runner.block_size)
            graph = runner.execute(seqs)[0].clone()
            saved, runner.graphs = runner.graphs, None
            eager = runner.execute(seqs)[0]
            runner.graphs = saved
            assert graph.shape == eager.shape == (n, 384)
            err = (graph - eager).norm() / eager.norm()
            assert err < tol, (n, ctx, float(err))


def _mixed_seqs(specs, block: int) -> list[ScheduledSeq]:
    """(tokens, start, sample) triples -> sequences with disjoint block tables."""
    seqs, nxt = [], 0
    for i, (n, start, sample) in enumerate(specs):
        nb = -(-(start + n) // block)
        seqs.append(ScheduledSeq(100 + i, [(11 * i + j) % 380 + 3 for j in range(n)], start,
                                 list(range(nxt, nxt + nb)), sample))
        nxt += nb
    return seqs


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_prefill_graph_replay_matches_eager(tiny_dir, dtype, tol, monkeypatch):
    monkeypatch.setenv("KVPILOT_TUNING", '{"prefill_graph_tokens": 512}')  # above the 256 default: larger buckets too
    with LLM(str(tiny_dir), skip_tokenizer_init=True, device="cuda", dtype=dtype, max_batch_size=24,
             max_num_tokens=512, max_seq_len=256, kv_cache_config=KvCacheConfig(max_tokens=16384)) as llm:
        runner = llm._executor
        pg = runner.prefill_graphs
        assert runner.graphs is not None and pg is not None
        assert pg.token_buckets == [16, 32, 64, 96] + list(range(128, 513, 32)) and pg.max_seqs == 24
        torch.manual_seed(0)
        for cache in runner.kv_caches:  # non-zero cached prefixes
            cache.normal_()
        cases = [
            [(5, 0, True)],  # short prompt: bucket 16
            [(40, 100, True)] + [(1, 7 * i + 3, True) for i in range(20)],  # chunk on a cached prefix + decodes
            [(200, 0, False), (60, 33, True)] + [(1, 150 + i, True) for i in range(22)],  # 2 chunks + 22 decodes
            [(250, 0, True), (2, 64, True)],  # 252 tokens: bucket 256
            [(64, 190, True)],  # a full bucket, block-aligned cached prefix
        ]
        for spec in cases:
            seqs = _mixed_seqs(spec, runner.block_size)
            assert pg.can_run(seqs)
            graph, rows = runner.execute(seqs)
            graph = graph.clone()
            runner.prefill_graphs = None
            eager, eager_rows = runner.execute(seqs)
            runner.prefill_graphs = pg
            assert rows == eager_rows and graph.shape == eager.shape == (len(rows), 384)
            err = (graph - eager).norm() / eager.norm()
            assert err < tol, (spec[:2], float(err))


@pytest.mark.gpu
@needs_gpu
def test_prefill_graphs_env_switch(tiny_dir, monkeypatch):
    monkeypatch.setenv("KVPILOT_TUNING", '{"prefill_graphs": false}')
    with LLM(str(tiny_dir), skip_tokenizer_init=True, device="cuda", max_batch_size=4, max_seq_len=256,
             kv_cache_config=KvCacheConfig(max_tokens=4096)) as llm:
        assert llm._executor.graphs is not None and llm._executor.prefill_graphs is None
    monkeypatch.setenv("KVPILOT_TUNING", '{"cuda_graphs": false}')
    with LLM(str(tiny_dir), skip_tokenizer_init=True, device="cuda", max_batch_size=4, max_seq_len=256,
             kv_cache_config=KvCacheConfig(max_tokens=4096)) as llm:
        assert llm._executor.graphs is None and llm._executor.prefill_graphs is None


@pytest.mark.gpu
@needs_gpu
def test_stories_golden_on_gpu(stories_model_dir):
    with LLM(str(stories_model_dir), device="cuda", dtype="float32", max_batch_size=4,
             kv_cache_config=KvCacheConfig(max_tokens=4096)) as llm:
        assert llm._executor.graphs is not None
        text = llm.generate("", SamplingParams(temperature=0, max_tokens=80)).outputs[0].text
    assert text.startswith(GOLDEN) or GOLDEN.startswith(text) and len(text) > 100, text


@pytest.mark.gpu
@needs_gpu
def test_random_checkpoint_matches_transformers_on_gpu(tiny_dir):
    prompts = [[1, 20, 30, 40, 50], [1, 7], [1] + list(range(100, 160))]
    expected = hf_greedy(tiny_dir, prompts, 24)
    with LLM(str(tiny_dir), skip_tokenizer_init=True, device="cuda", dtype="float32", max_batch_size=8,
             max_seq_len=256) as llm:
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == expected


@pytest.mark.parametrize("lm_head_in_graph", [True, False])
def test_decode_graph_host_logic_on_cpu(tiny_dir, lm_head_in_graph, monkeypatch):
    import kvpilot.runner.cuda_graphs as cg
    from kvpilot.runner.cuda_graphs import DecodeGraphs

    monkeypatch.setattr(cg, "_CONTEXT_BUCKETS", (64, 128))
    with LLM(str(tiny_dir), skip_tokenizer_init=True, device="cpu", max_batch_size=20, max_seq_len=256,
             kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=8192)) as llm, torch.inference_mode():
        runner = llm._executor
        g = cpu_graph_class(DecodeGraphs)(runner, lm_head_in_graph=lm_head_in_graph)
        assert g.batch_sizes == [1, 2, 4, 8, 16, 20]
        g.capture()
        assert g.buckets[1] == g.buckets[2] == [64, 128, 256] and g.buckets[4] == [256]
        assert g.captured[0] == (20, 256) and len(g.captured) == 4 * 1 + 2 * 3
        torch.manual_seed(0)
        for cache in runner.kv_caches:
            cache.normal_()
        for n, ctx, want in ((1, 5, (1, 64)), (2, 100, (2, 128)), (3, 40, (4, 256)), (9, 200, (16, 256)),
                             (20, 77, (20, 256)), (1, 256, (1, 256))):
            assert g._pick(n, ctx) == want
            seqs = _decode_seqs(n, ctx, runner.block_size)
            got = g.run(seqs).clone()
            eager = runner.execute(seqs)[0]
            torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
            slots = g.slots[:n].tolist()
            assert slots == [s.block_table[(ctx - 1) // 8] * 8 + (ctx - 1) % 8 for s in seqs]
            b = want[0]
            assert g.slots[n:b].tolist() == [-1] * (b - n) and g.qsl[:b + 1].tolist() == list(range(n + 1)) + [n] * (b - n)
            assert g.seq_lens[:n].tolist() == [ctx] * n
        with pytest.raises(ValueError, match="max_seq_len"):
            g.run(_decode_seqs(1, 300, runner.block_size))
