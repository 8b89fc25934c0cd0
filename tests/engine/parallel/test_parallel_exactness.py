"""Tensor/pipeline-parallel ranks compute what one GPU computes, on CPU with gloo.

- TP 2, bf16, random tiny Llama with attention and MLP biases (`test_llama_fused_gemv`'s): with the
  float32 row-parallel reduction (``Tuning(tp_reduce_fp32=True)``, default off) the logits of a prefill step
  and of greedy decode steps are much closer to the single-process model's than with the bf16
  reduction of rounded partials (a measured ratio), and the greedy tokens are the single process's. Every rank holds
  the whole row-parallel bias and it is added once (float32: TP 2 matches one process to 1e-4).
- The switch is read once, when the model is built.
- Padded eager prefill (`model_runner.prefill_padding`): the decision and the padded inputs are those
  of one GPU's prefill graphs (`PrefillGraphs`, through its CPU double), and the padded eager forward
  gives that graph's logits bit for bit; PP 2 stages padding their prefill steps give, for a request
  alone, bit for bit the logits of the single-process model replaying prefill graphs, and with
  micro-batches the right rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.graphs import cpu_graph_class
from support.parallel_exact import BLOCK, DECODE_STEPS, PROMPTS, pp_padding_rank, spawn_ranks, tp_reduce_rank
from support.engine import _checkpoint
from kvpilot.config import KvCacheConfig
from kvpilot.model.config import ModelConfig
from kvpilot.runner.cuda_graphs import PrefillGraphs
from kvpilot.runner.model_runner import ScheduledSeq, prefill_padding
from support.parallel_exact import BUCKETS, MAX_BS, MAX_SEQ, MAX_TOKENS, exactness_runner

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def biased_model(tmp_path_factory) -> Path:
    # 2 layers, hidden 64, GQA 4/2 heads of 16, intermediate 96, vocab 128, random biases.
    return _checkpoint(tmp_path_factory.mktemp("exact") / "biased", bias=True)


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("exact") / "plain", bias=False)


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor], steps: int) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a[:steps], b[:steps]))


def _mean_diff(a: list[torch.Tensor], b: list[torch.Tensor], steps: int) -> float:
    return float(torch.stack([(x - y).abs().mean() for x, y in zip(a[:steps], b[:steps])]).mean())


def _common_steps(ta: list[list[int]], tb: list[list[int]]) -> int:
    """Steps whose inputs agree: the prefill, then each decode step fed the same tokens so far."""
    return next((i + 1 for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))


# ---- tensor parallelism: float32 reduction -------------------------------------------------------

@pytest.fixture(scope="module")
def tp_results(biased_model):
    from kvpilot.server.launcher import free_port

    init = f"tcp://127.0.0.1:{free_port()}"
    return spawn_ranks(tp_reduce_rank, lambda rank: (init, str(biased_model)))


def test_tp2_fp32_reduce_matches_single_process_far_closer_than_bf16_reduce(tp_results):
    res = tp_results[0]
    single_logits, single_toks = res["single"]["bfloat16"]
    fp32_logits, fp32_toks, fp32_flag = res["tp"][("bfloat16", "1")]
    bf16_logits, bf16_toks, bf16_flag = res["tp"][("bfloat16", None)]
    assert (fp32_flag, bf16_flag) == (True, False)  # "1" turns it on; unset it is off (the default)
    assert len(single_toks) == DECODE_STEPS + 1
    # The fp32 reduction leaves only fp32 summation order: the greedy tokens are one process's.
    assert fp32_toks == single_toks
    common = _common_steps(bf16_toks, single_toks)
    d_bf16 = _mean_diff(bf16_logits, single_logits, common)
    d_fp32 = _mean_diff(fp32_logits, single_logits, common)
    # The logits are bf16 values (ulp 1/64 at 2..4), so their largest difference counts ulps, and one
    # bf16 rounding flipped by the fp32 summation order would move many logits by one ulp; the mean
    # difference measures how many move. Measured here (x86 CPU, one thread): bf16 reduction 3.7e-3
    # (its greedy tokens leave the single process's after 5 steps), fp32 reduction 0.
    assert d_bf16 > 1e-3, d_bf16
    assert d_bf16 >= 4 * d_fp32, (d_bf16, d_fp32)
    # Biases added once on both paths (after the fp32 all-reduce; in rank 0's GEMM): an extra or a
    # missing bias (random, std 0.08) would move logits by far more than these few ulps.
    assert _max_diff(fp32_logits, single_logits, len(single_logits)) <= 0.05
    assert _max_diff(bf16_logits, single_logits, common) <= 0.1
    # Both ranks computed the same (gathered) logits.
    assert all(torch.equal(a, b) for a, b in zip(fp32_logits, tp_results[1]["tp"][("bfloat16", "1")][0]))


def test_tp2_float32_model_adds_the_bias_once(tp_results, biased_model):
    from safetensors import safe_open

    res = tp_results[0]
    logits, toks, _ = res["tp"][("float32", "1")]
    single_logits, single_toks = res["single"]["float32"]
    assert toks == single_toks
    # A bias added twice (or lost on a rank) moves logits by ~0.1; fp32 summation order by ~1e-6.
    assert _max_diff(logits, single_logits, len(logits)) < 1e-4
    # Every rank holds the whole row-parallel bias (added once, by `ParallelContext.row_parallel`).
    with safe_open(str(biased_model / "model.safetensors"), framework="pt") as f:
        o_bias = f.get_tensor("model.layers.0.self_attn.o_proj.bias")
        down_bias = f.get_tensor("model.layers.0.mlp.down_proj.bias")
    assert o_bias.abs().sum() > 0
    for rank in (0, 1):
        assert torch.equal(tp_results[rank]["o_bias"], o_bias.float())
        assert torch.equal(tp_results[rank]["down_bias"], down_bias.float())


def test_reduce_switch_reaches_every_layer(plain_model):
    from kvpilot.model import llama
    from kvpilot.tuning import Tuning

    cfg = ModelConfig.from_dir(plain_model)
    assert not Tuning().tp_reduce_fp32  # off by default (engine/model/llama.py: measured gain small)
    for tuning, want in ((None, False), (Tuning(tp_reduce_fp32=False), False), (Tuning(tp_reduce_fp32=True), True)):
        with torch.device("meta"):
            model = llama.LlamaForCausalLM(cfg, tuning=tuning)
        assert model.tp_reduce_fp32 is want
        assert all(l.self_attn.reduce_fp32 is want and l.mlp.reduce_fp32 is want for l in model.layers)


def test_row_parallel_with_one_rank_is_the_plain_projection():
    from kvpilot.kernels import gemv as KG
    from kvpilot.model.llama import ParallelContext

    torch.manual_seed(0)
    x = torch.randn(5, 32).bfloat16()
    w, b = torch.randn(16, 32).bfloat16(), torch.randn(16).bfloat16()
    for reduce_fp32 in (True, False):
        got = ParallelContext().row_parallel(x, w, b, KG.gemv_ref, reduce_fp32)
        assert got.dtype == torch.bfloat16 and torch.equal(got, torch.nn.functional.linear(x, w, b))


# ---- padded eager prefill ------------------------------------------------------------------------

def _seq(sid: int, n: int, start: int, first_block: int, **kw) -> ScheduledSeq:
    nb = -(-(start + n) // BLOCK)
    return ScheduledSeq(sid, [(7 * sid + 3 * j) % 120 + 3 for j in range(n)], start,
                        list(range(first_block, first_block + nb)), True, **kw)


def _padding_cases() -> list[list[ScheduledSeq]]:
    """Steps and whether one GPU graphs them; the first four use disjoint blocks (of the pool's 36)."""
    return [
        [_seq(0, 5, 0, 0)],  # 5 tokens -> bucket 16, 4 sequences
        [_seq(1, 13, 20, 1), _seq(2, 1, 9, 6), _seq(3, 1, 30, 8)],  # chunk on a prefix + decodes -> 16
        [_seq(4, 33, 0, 12)],  # -> 48
        [_seq(5, 64, 0, 17)],  # a full bucket: nothing padded
        [_seq(6, 1, 5, 25), _seq(7, 1, 6, 26)],  # decodes only: one GPU runs them from decode graphs
        [_seq(8, 40, 0, 0), _seq(9, 30, 0, 5)],  # more tokens than the largest bucket: eager on one GPU too
        [_seq(10, 6, 0, 0, all_logits=True)],  # prompt logprobs: eager on one GPU too
        [_seq(11 + i, 2, 0, i) for i in range(5)],  # 5 sequences > max_batch_size 4
    ]


def test_prefill_padding_decides_and_pads_as_the_prefill_graphs(plain_model):
    runner = exactness_runner(plain_model)
    graphs = cpu_graph_class(PrefillGraphs)(runner, token_buckets=BUCKETS)
    graphs.capture()
    for seqs in _padding_cases():
        pad = prefill_padding(seqs, BUCKETS, MAX_BS, runner.max_blocks_per_seq)
        assert (pad is not None) == graphs.can_run(seqs), seqs
        if pad is None:
            continue
        T, real, rows = graphs.prepare(seqs)
        assert pad == (T, min(T, MAX_BS))
        runner.prefill_pad_buckets = BUCKETS
        ids, pos, meta, sample_idx = runner.prepare(seqs)
        runner.prefill_pad_buckets = None
        S = pad[1]
        h = graphs._h
        assert ids.tolist() == h["ids"][:T].tolist() and pos.tolist() == h["pos"][:T].tolist()
        assert meta.slot_mapping.tolist() == h["slots"][:T].tolist()
        assert meta.seq_lens.tolist() == h["seq_lens"][:S].tolist()
        assert meta.query_start_loc.tolist() == h["qsl"][:S + 1].tolist()
        width = meta.block_tables.shape[1]
        assert meta.block_tables.shape[0] == S
        assert meta.block_tables[:len(seqs)].tolist() == h["tables"][:len(seqs), :width].tolist()
        assert (meta.max_query_len, meta.max_seq_len) == (T, MAX_SEQ)
        assert sample_idx == rows and real == sum(len(s.token_ids) for s in seqs)
        # Unpadded without the buckets.
        ids, _, meta, _ = runner.prepare(seqs)
        assert ids.shape[0] == real and meta.max_query_len == max(len(s.token_ids) for s in seqs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_padded_eager_prefill_is_the_prefill_graph_bit_for_bit(plain_model, dtype):
    graph_runner, eager_runner = exactness_runner(plain_model, dtype), exactness_runner(plain_model, dtype)
    graphs = cpu_graph_class(PrefillGraphs)(graph_runner, token_buckets=BUCKETS)
    graphs.capture()
    graph_runner.prefill_graphs = graphs
    eager_runner.prefill_pad_buckets = BUCKETS
    with torch.inference_mode():
        for seqs in _padding_cases()[:4]:
            want, want_rows = graph_runner.execute(seqs)
            got, rows = eager_runner.execute(seqs)
            assert rows == want_rows and torch.equal(got, want)
        for a, b in zip(graph_runner.kv_caches, eager_runner.kv_caches):
            assert torch.equal(a, b)


# ---- pipeline parallelism: padded prefill on the stages ------------------------------------------

def _pp_plans() -> list[list[ScheduledSeq]]:
    p0, p1 = PROMPTS[0], PROMPTS[2]
    t0, t1 = list(range(0, 4)), list(range(4, 8))
    return [
        [ScheduledSeq(0, p0, 0, t0, True)],  # one request alone: 9 tokens -> bucket 16
        [ScheduledSeq(0, [5], len(p0), t0, True)],  # its decode step
        [ScheduledSeq(0, [7], len(p0) + 1, t0, True), ScheduledSeq(1, p1, 0, t1, True)],  # decode + prefill
    ]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_pp2_padded_prefill_matches_single_process_prefill_graphs(plain_model, dtype):
    from kvpilot.parallel.executor import make_worker_spec

    spec = make_worker_spec(plain_model, ModelConfig.from_dir(plain_model), KvCacheConfig(tokens_per_block=BLOCK, max_tokens=512),
                            MAX_TOKENS, MAX_BS, MAX_SEQ, "cpu", dtype, 1, 2, None)
    spec.timeout_s = 120
    plans = _pp_plans()
    res = spawn_ranks(pp_padding_rank, lambda rank: (spec, BUCKETS, plans))
    first, last = res[0], res[1]
    # Both stages padded the lone prefill to 16 tokens; the mixed step is two micro-batches: the
    # decode (1 token, not padded) and the 12-token prefill (padded to 16).
    assert first["tokens"] == last["tokens"] == [16, 1, 1, 16]
    assert all(r is None for r in first["pp"])
    assert last["single_graph_steps"] == 2  # one GPU replays prefill graphs for steps 0 and 2
    for i, ((got, rows), (want, want_rows)) in enumerate(zip(last["pp"], last["single"])):
        assert rows == want_rows, i
        if i < 2:  # the request alone: the same kernels at the same shapes as one process
            assert torch.equal(got, want), (i, float((got - want).abs().max()))
        else:  # micro-batches: other shapes than one process's step (module docstring of parallel_worker)
            tol = 1e-5 if dtype == "float32" else 0.1
            torch.testing.assert_close(got, want, rtol=0, atol=tol)
