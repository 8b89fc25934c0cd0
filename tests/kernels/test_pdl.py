"""Programmatic dependent launch switch (kernels/pdl.py): on for small launches on a Hopper GPU,
never on the CPU or under the interpreter; the GPU path is compiled by tools/compile_kernels.py (cases "pdl=")
and measured by benchmarks/lab/gpu_pdl_ab.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")


def test_pdl_mode_off_on_the_cpu(monkeypatch):
    from kvpilot.kernels import pdl

    assert pdl.pdl_mode(torch.device("cpu"), 1) == 0  # a CPU tensor: no PDL launch option
    assert pdl.launch_options(0) == {}
    assert pdl.launch_options(1) == {"launch_pdl": True}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pdl_mode_on_a_hopper_gpu(monkeypatch):
    from kvpilot.kernels import pdl

    dev = torch.device("cuda")
    hopper = torch.cuda.get_device_capability()[0] >= 9 and pdl.HAS_GDC
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert pdl.pdl_mode(dev, 1) == pdl.pdl_mode(dev, pdl.PDL_MAX_ROWS) == (1 if hopper else 0)
    assert pdl.pdl_mode(dev, pdl.PDL_MAX_ROWS + 1) == 0  # larger launches: not measured, off


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda-graph"])
def test_decode_chain_with_pdl_equals_without(monkeypatch, graph):
    """One Llama-3.1-8B decoder layer's batch-1 kernel chain (RMSNorm + QKV GEMV, rotary + FP8 KV
    write, split decode attention and its reduction, o GEMV, RMSNorm + gate/up GEMV, SiLU + down
    GEMV, final RMSNorm), twice in a row so each kernel follows another PDL kernel, eagerly and
    replayed from a CUDA graph: with PDL the outputs are the same bits as without (it changes when
    kernels start, never what they compute)."""
    from kvpilot.kernels import (build_rope_cache, paged_attention_triton, rms_norm,
                                 rotary_write_kv_cache_triton)
    from kvpilot.kernels import gemv as G

    g = torch.Generator(device="cuda").manual_seed(0)
    H, KV, D, HID, INTER, BS, CTX = 32, 8, 128, 4096, 14336, 16, 700
    bf = torch.bfloat16

    def rnd(*shape, scale=0.02):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(bf)

    w_qkv, w_o = rnd((H + 2 * KV) * D, HID), rnd(HID, H * D)
    w_gu, w_down, nw = rnd(2 * INTER, HID), rnd(HID, INTER), rnd(HID, scale=1.0)
    nblocks = CTX // BS + 2
    k_cache = rnd(nblocks, BS, KV, D, scale=1.0).to(torch.float8_e4m3fn)
    v_cache = rnd(nblocks, BS, KV, D, scale=1.0).to(torch.float8_e4m3fn)
    cos_sin = build_rope_cache(D, 4096, 500000.0, None).cuda()
    block_tables = torch.arange(nblocks, dtype=torch.int32, device="cuda")[None, :]
    seq_lens = torch.tensor([CTX + 1], dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    pos = torch.tensor([CTX], dtype=torch.int64, device="cuda")
    slots = torch.tensor([CTX], dtype=torch.int64, device="cuda")
    x0, r0 = rnd(1, HID, scale=1.0), rnd(1, HID, scale=1.0)

    def layer(x, res):
        qkv, res = G.rmsnorm_gemv(x, res, nw, 1e-5, w_qkv)
        q, k, v = qkv.view(1, H + 2 * KV, D).split([H, KV, KV], dim=1)
        q = rotary_write_kv_cache_triton(q, k, v, pos, cos_sin, k_cache, v_cache, slots)
        attn = paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, qsl, D ** -0.5, 1, CTX + 1)
        h = G.gemv(attn.reshape(1, H * D), w_o)
        gu, res = G.rmsnorm_gemv(h, res, nw, 1e-5, w_gu)
        return G.silu_mul_gemv(gu, w_down), res

    def chain():
        x, res = layer(x0, r0)
        x, res = layer(x, res)
        return rms_norm(x, nw, 1e-5, res)[0]

    from support.pdl import pdl_forced

    outs = {}
    for mode in ("0", "1"):
        with pdl_forced(0 if mode == "0" else None):
            chain()  # compile outside the graph
            if graph:
                cg = torch.cuda.CUDAGraph()
                with torch.cuda.graph(cg):
                    out = chain()
                cg.replay()
                torch.cuda.synchronize()
                outs[mode] = out.clone()
            else:
                outs[mode] = chain()
    assert torch.isfinite(outs["0"].float()).all()
    assert torch.equal(outs["0"], outs["1"])
