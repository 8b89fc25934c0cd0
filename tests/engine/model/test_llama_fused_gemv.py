"""The Llama decoder layer routed through the fused decode GEMVs (``Tuning.fused_gemv``).

- CPU: the dispatchers run the unfused ops, so a tiny random Llama (with and without
  ``attention_bias`` / ``mlp_bias``) gives bit-identical logits and KV caches with the switch on and
  off, over prefill, batch-2 and batch-1 decode steps; the biased checkpoint also matches
  transformers.
- ``TRITON_INTERPRET=1``: the dispatchers' device check is patched so CPU tensors take the
  ``*_triton`` kernels at their usual row limits (``FUSED_MAX_ROWS``); batch-1 and batch-2 decode
  steps then match the unfused path within fp32 / bf16 tolerances.
- GPU (``gpu`` marker): one Llama-3.1-8B-shaped decoder layer in bf16 at M = 1, fused against
  unfused, eager and replayed from a CUDA graph; the engine's decode graphs with the switch on and off.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvpilot import KvCacheConfig
from kvpilot.model import llama
from kvpilot.model.config import ModelConfig
from kvpilot.kernels import gemv as G
from kvpilot.runner.model_runner import ModelRunner, ScheduledSeq
from kvpilot.tuning import Tuning
from support.engine import _checkpoint

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()
BLOCK = 8
PROMPTS = [[1, 17, 40, 3, 99, 5, 60, 7, 8], [1, 2, 30, 44, 5]]
TABLES = [[0, 1, 2], [3, 4]]  # disjoint, with room for the decode steps


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused_gemv")
    return {bias: _checkpoint(root / f"bias{int(bias)}", bias) for bias in (False, True)}


def _runner(path: Path, fused: bool, monkeypatch, dtype: str = "float32") -> ModelRunner:
    runner = ModelRunner(path, ModelConfig.from_dir(path), KvCacheConfig(tokens_per_block=BLOCK, max_tokens=256),
                         max_num_tokens=64, max_batch_size=4, max_seq_len=64, device="cpu", dtype=dtype,
                         tuning=Tuning(fused_gemv=fused))
    assert runner.model.fused_gemv is fused and all(layer.fused_gemv is fused for layer in runner.model.layers)
    return runner


def _run_steps(runner: ModelRunner, pair_decodes: int, solo_decodes: int, tokens: list[list[int]] | None = None):
    """Prefill both prompts in one step, decode both ``pair_decodes`` times (M = 2), then the first
    alone ``solo_decodes`` times (M = 1). Decode inputs are the greedy tokens, or ``tokens`` (one
    list per step) to replay another run's schedule exactly. Returns (logits per step, tokens per step)."""
    lens = [len(p) for p in PROMPTS]
    logits, _ = runner.execute([ScheduledSeq(i, p, 0, TABLES[i], True) for i, p in enumerate(PROMPTS)])
    all_logits, all_tokens = [logits.clone()], []
    nxt = logits.argmax(-1).tolist()
    for step in range(pair_decodes + solo_decodes):
        active = [0, 1] if step < pair_decodes else [0]
        toks = tokens[step] if tokens is not None else [nxt[i] for i in active]
        seqs = [ScheduledSeq(i, [t], lens[i], TABLES[i], True) for i, t in zip(active, toks)]
        logits, _ = runner.execute(seqs)
        all_logits.append(logits.clone())
        all_tokens.append(toks)
        for j, i in enumerate(active):
            lens[i] += 1
            nxt[i] = int(logits[j].argmax())
    return all_logits, all_tokens


# ---------------------------------------------------------------------------------------------
# CPU: the dispatchers are the unfused ops, bit for bit
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
def test_switch_on_and_off_give_identical_logits_on_cpu(ckpts, bias, monkeypatch):
    on = _runner(ckpts[bias], True, monkeypatch)
    off = _runner(ckpts[bias], False, monkeypatch)
    assert on.cfg.attention_bias is bias and on.cfg.mlp_bias is bias
    if bias:  # the biases were loaded (they are random, not zero)
        attn = on.model.layers[1].self_attn
        assert attn.qkv_proj.bias.abs().sum() > 0 and attn.o_proj.bias.abs().sum() > 0
        assert on.model.layers[1].mlp.down_proj.bias.abs().sum() > 0
    logits_on, toks_on = _run_steps(on, pair_decodes=2, solo_decodes=2)
    logits_off, toks_off = _run_steps(off, pair_decodes=2, solo_decodes=2)
    assert toks_on == toks_off
    assert [tuple(t.shape) for t in logits_on] == [(2, 128)] * 3 + [(1, 128)] * 2
    for a, b in zip(logits_on, logits_off):
        assert torch.equal(a, b)
    for a, b in zip(on.kv_caches, off.kv_caches):
        assert torch.equal(a, b)


def test_biased_checkpoint_matches_transformers(ckpts, monkeypatch):
    # The fused routing's bias handling against an independent implementation (prefill logits of
    # the last prompt token, then the greedy continuation).
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(ckpts[True]), dtype=torch.float32).eval()
    runner = _runner(ckpts[True], True, monkeypatch)
    logits, toks = _run_steps(runner, pair_decodes=0, solo_decodes=3)
    with torch.no_grad():
        for i, p in enumerate(PROMPTS):
            ref = hf(torch.tensor([p])).logits[0, -1]
            torch.testing.assert_close(logits[0][i], ref, atol=1e-4, rtol=1e-4)
        seq = PROMPTS[0] + [t[0] for t in toks]
        ref = hf(torch.tensor([seq])).logits[0, len(PROMPTS[0]) - 1:]
    for step, got in enumerate(logits[1:]):
        torch.testing.assert_close(got[0], ref[step + 1], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# TRITON_INTERPRET=1: the Triton kernels on CPU tensors
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def triton_gemv_calls(monkeypatch):
    """Send CPU tensors of at most FUSED_MAX_ROWS[op] rows to the *_triton kernels; count the launches."""
    calls = {"rmsnorm": 0, "silu": 0, "plain": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(G, "_use_triton", lambda x, op: x.dim() == 2 and x.shape[0] <= G.FUSED_MAX_ROWS[op])
    monkeypatch.setattr(G, "rmsnorm_gemv_triton", counted("rmsnorm", G.rmsnorm_gemv_triton))
    monkeypatch.setattr(G, "silu_mul_gemv_triton", counted("silu", G.silu_mul_gemv_triton))
    monkeypatch.setattr(G, "gemv_triton", counted("plain", G.gemv_triton))
    return calls


@pytest.mark.skipif(not INTERPRET or G.triton is None, reason="runs the Triton kernels under TRITON_INTERPRET=1")
@pytest.mark.parametrize("bias,dtype,tol", [(True, "float32", 1e-5), (False, "bfloat16", 5e-2)])
def test_triton_decode_steps_match_unfused(ckpts, bias, dtype, tol, triton_gemv_calls, monkeypatch):
    off = _runner(ckpts[bias], False, monkeypatch, dtype)
    ref_logits, toks = _run_steps(off, pair_decodes=1, solo_decodes=2)
    assert triton_gemv_calls == {"rmsnorm": 0, "silu": 0, "plain": 0}  # the switch keeps the module calls
    on = _runner(ckpts[bias], True, monkeypatch, dtype)
    logits, _ = _run_steps(on, pair_decodes=1, solo_decodes=2, tokens=toks)
    layers = len(on.model.layers)
    # Per layer: two RMSNorm->GEMVs, one SiLU->GEMV, one GEMV, each on Triton when its step's rows
    # (14 prefill, then 2, 1, 1) are at most FUSED_MAX_ROWS[op] (today: o_proj at M = 2, all at M = 1).
    per_layer = {"rmsnorm": 2, "silu": 1, "plain": 1}
    assert triton_gemv_calls == {op: n * layers * sum(m <= G.FUSED_MAX_ROWS[op] for m in (14, 2, 1, 1))
                                 for op, n in per_layer.items()}
    assert triton_gemv_calls["rmsnorm"] > 0 and triton_gemv_calls["silu"] > 0
    assert torch.equal(logits[0], ref_logits[0])  # the prefill step took the unfused path
    for step, (got, ref) in enumerate(zip(logits[1:], ref_logits[1:])):
        err = float((got - ref).norm() / ref.norm())
        assert err < tol, (step, err)
        assert torch.isfinite(got).all()


# ---------------------------------------------------------------------------------------------
# GPU: Llama-3.1-8B layer shape, bf16
# ---------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA GPU")


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _llama8b_layer_config(bias: bool) -> ModelConfig:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
    return ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=1,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=scaling, max_position_embeddings=131072,
        tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=128000, eos_token_ids=[128001],
        attention_bias=bias, mlp_bias=bias,
    )  # fmt: skip


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_llama8b_layer_fused_matches_unfused(bias, triton_gemv_calls):
    # triton_gemv_calls only counts here: its device check still sends CUDA tensors of <= FUSED_MAX_ROWS
    # rows to Triton, as the real one does.
    from kvpilot import kernels as K

    cfg = _llama8b_layer_config(bias)
    dt, dev, ctx = torch.bfloat16, "cuda", 1000
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.device("meta"):
        layer = llama.LlamaDecoderLayer(cfg, 0, llama.ParallelContext(), fused_gemv=True)
    layer = layer.to(dt).to_empty(device=dev).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, device=dev, generator=g))
            else:
                p.normal_(0.0, 0.02, generator=g)
    blocks, bs = -(-ctx // 32), 32
    num_blocks = blocks + 4
    kv = torch.randn(2, num_blocks, bs, 8, 128, device=dev, dtype=dt, generator=g)
    pristine = kv.clone()
    table = torch.randperm(num_blocks, device=dev, generator=g)[:blocks].int()[None]
    pos = ctx - 1
    slot = int(table[0, pos // bs]) * bs + pos % bs
    meta = llama.AttentionMetadata(
        slot_mapping=torch.tensor([slot], device=dev), block_tables=table,
        seq_lens=torch.tensor([ctx], dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=dev), max_query_len=1, max_seq_len=ctx,
    )  # fmt: skip
    positions = torch.tensor([pos], device=dev)
    cos_sin = K.build_rope_cache(128, 131072, 500000.0, cfg.rope_scaling, device=dev)
    hidden = torch.randn(1, 4096, device=dev, dtype=dt, generator=g)
    residual_in = torch.randn(1, 4096, device=dev, dtype=dt, generator=g)

    def run(fused, residual):
        kv.copy_(pristine)
        layer.fused_gemv = fused
        with torch.inference_mode():
            h, r = layer(positions, hidden, residual, meta, kv, cos_sin)
        return h.clone(), r.clone(), kv[:, table[0, pos // bs].long()].clone()

    for residual in (None, residual_in):
        before = dict(triton_gemv_calls)
        fused = run(True, residual)
        assert {k: triton_gemv_calls[k] - before[k] for k in before} == {"rmsnorm": 2, "silu": 1, "plain": 1}
        unfused = run(False, residual)
        # hidden, the residual stream (x + attention output) and the block holding the new token's
        # K and V: the products' summation order differs, nothing else.
        errs = [_rel(f, u) for f, u in zip(fused, unfused)]
        assert max(errs) < 2e-2, errs
        assert torch.isfinite(fused[0]).all()

    # Graph capture: the fused layer replays from a CUDA graph with the eager result.
    layer.fused_gemv = True
    kv.copy_(pristine)
    eager = run(True, residual_in)
    kv.copy_(pristine)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        layer(positions, hidden, residual_in, meta, kv, cos_sin)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode():
        with torch.cuda.graph(graph, stream=stream):
            out_h, out_r = layer(positions, hidden, residual_in, meta, kv, cos_sin)
    kv.copy_(pristine)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_h, eager[0]) and torch.equal(out_r, eager[1])
    assert torch.equal(kv[:, table[0, pos // bs].long()], eager[2])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_engine_decode_graphs_switch_on_and_off(ckpts, bias, monkeypatch):
    # The engine's captured decode graphs (batch 1 and 2 use the Triton kernels) against the
    # unfused model, fp32: the same greedy tokens and logits within fp32 summation-order noise.
    def runner(fused):
        path = ckpts[bias]
        r = ModelRunner(path, ModelConfig.from_dir(path), KvCacheConfig(tokens_per_block=BLOCK, max_tokens=256),
                        max_num_tokens=64, max_batch_size=4, max_seq_len=64, device="cuda", dtype="float32",
                        tuning=Tuning(fused_gemv=fused))
        assert r.graphs is not None and r.model.fused_gemv is fused
        return r

    off = runner(False)
    ref_logits, toks = _run_steps(off, pair_decodes=2, solo_decodes=3)
    off.shutdown()
    on = runner(True)
    logits, toks_on = _run_steps(on, pair_decodes=2, solo_decodes=3)
    assert toks_on == toks
    for got, ref in zip(logits, ref_logits):
        assert _rel(got, ref) < 1e-5
