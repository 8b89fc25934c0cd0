"""The two-rank one-shot all-reduce kernel (kernels/allreduce.py) and its engine wiring.

- CPU, ``TRITON_INTERPRET=1``: one process with the peer's data already pushed; and two processes
  that share CPU memory and run the real protocol against each other (each pushes into the other's
  receive buffers and spins on its own), several forward passes over several call sites, checked
  against the float32 sum and for identical results on both ranks and empty buffers afterwards.
- Site numbering: every row-parallel call site of a model gets its own number, and the worker's
  count of sites covers them.
- Folded into the batch-1 GEMVs (kernels/gemv.py, "Folded all-reduce"): two processes run a 3-layer
  chain of GEMVs with the all-reduces folded (producer push, consumer pull, reset by the next
  producer) and with the separate kernel, in float32 and bf16: bit for bit equal, the reference's
  sum, buffers empty afterwards. Engine wiring: tests/test_fused_allreduce.py.
- GPU (``-m gpu``, two GPUs): tests/test_custom_all_reduce_gpu.py, tests/test_fused_allreduce_gpu.py.
"""

from __future__ import annotations

import io
import os

import pytest
import torch
import torch.multiprocessing as mp

from kvpilot.kernels import allreduce as A

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")


def _is_empty(buf: torch.Tensor) -> torch.Tensor:
    return buf.view(torch.int32) == A.SENTINEL_BITS


@needs_interpreter
@pytest.mark.parametrize("dtype,shape", [(torch.bfloat16, (1, 1500)), (torch.float32, (3, 700)),
                                         (torch.float16, (2, 1024))])
def test_peer_data_already_pushed(dtype, shape):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g).to(dtype)
    x[0, :5] = -0.0  # must reach the peer as +0.0, never as the empty marker
    peer_x = torch.randn(shape, generator=g).to(dtype)
    n = x.numel()
    recv = A.empty_receive_buffer(n + 100, "cpu")
    recv[:n] = peer_x.float().flatten()  # what the peer's kernel would have stored
    peer_recv = A.empty_receive_buffer(n + 100, "cpu")
    want = A.two_rank_all_reduce_ref(x, peer_x)
    sent = x.float().flatten().clone()
    out = A.two_rank_all_reduce(x, recv, peer_recv)
    assert out is x
    if dtype == torch.float32:
        assert torch.equal(out, want)
    else:  # the interpreter's 16-bit store truncates where the GPU rounds: within one unit in the last place
        ulp = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype]
        torch.testing.assert_close(out.float(), want.float(), rtol=ulp, atol=0)
    assert _is_empty(recv).all()  # reset for the next forward pass
    pushed = peer_recv[:n]
    assert torch.equal(pushed, sent)
    assert not _is_empty(pushed).any()
    assert (pushed[:5].view(torch.int32) == 0).all()  # +0.0 bits
    assert _is_empty(peer_recv[n:]).all()  # nothing past n written


@needs_interpreter
def test_out_argument_and_empty_input():
    x = torch.arange(10, dtype=torch.float32).reshape(2, 5)
    recv, peer_recv = A.empty_receive_buffer(10, "cpu"), A.empty_receive_buffer(10, "cpu")
    recv[:] = 1.0
    out = torch.empty_like(x)
    res = A.two_rank_all_reduce(x, recv, peer_recv, out=out)
    assert res is out and torch.equal(out, x + 1) and torch.equal(x, torch.arange(10.0).reshape(2, 5))
    empty = torch.empty(0, 5)
    assert A.two_rank_all_reduce(empty, recv, peer_recv) is empty


def test_block_size_keeps_grids_small():
    assert A.block_size(4096) == 256 and A.block_size(1) == 256
    assert A.block_size(256 * 1024) == 256 and A.block_size(256 * 1024 + 1) == 512
    assert A.block_size(1 << 20) == 1024
    for n in (1, 4096, 300_000, 1 << 20, 3 << 20):
        b = A.block_size(n)
        assert b & (b - 1) == 0 and -(-n // b) <= max(A.MAX_PROGRAMS, -(-n // 4096))


def test_bad_arguments_raise():
    x = torch.ones(4, 8)
    ok = A.empty_receive_buffer(32, "cpu")
    with pytest.raises(ValueError, match="at least 32"):
        A.two_rank_all_reduce(x, A.empty_receive_buffer(31, "cpu"), ok)
    with pytest.raises(ValueError, match="float32"):
        A.two_rank_all_reduce(x, torch.zeros(32, dtype=torch.bfloat16), ok)
    with pytest.raises(ValueError, match="contiguous"):
        A.two_rank_all_reduce(x.t(), ok, ok)
    with pytest.raises(ValueError, match="out must"):
        A.two_rank_all_reduce(x, ok, ok, out=torch.ones(4, 8, dtype=torch.float64))


SITES, ROUNDS = 3, 3
SIZES = [1, 2048 + 7, 3 * 1024]  # elements per forward pass: one partial block, several blocks


def _data(rank: int, rnd: int, site: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 100 * rnd + site)
    return torch.randn(n, generator=g)  # float32: the sum is exact under the interpreter too


def _rank(rank: int, bufs: list[torch.Tensor], outs: torch.Tensor) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    mine, peer = bufs[rank], bufs[1 - rank]
    for rnd, n in enumerate(SIZES[:ROUNDS]):
        for site in range(SITES):
            x = _data(rank, rnd, site, n)
            A.two_rank_all_reduce(x, mine[site], peer[site])
            outs[rank, rnd, site, :n] = x.float()


@needs_interpreter
def test_two_processes_run_the_protocol():
    """Two CPU processes exchange through shared memory exactly as two GPUs do over NVLink."""
    width = max(SIZES)
    bufs = [A.empty_receive_buffer(SITES * width, "cpu").view(SITES, width).share_memory_() for _ in range(2)]
    outs = torch.full((2, ROUNDS, SITES, width), float("nan")).share_memory_()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, bufs, outs)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    alive = [p.is_alive() for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not any(alive), "a rank never saw its peer's data"
    assert [p.exitcode for p in procs] == [0, 0]
    for rnd, n in enumerate(SIZES[:ROUNDS]):
        for site in range(SITES):
            want = A.two_rank_all_reduce_ref(_data(0, rnd, site, n), _data(1, rnd, site, n)).float()
            assert torch.equal(outs[0, rnd, site, :n], want), (rnd, site)
            assert torch.equal(outs[1, rnd, site, :n], want), (rnd, site)
    for b in bufs:
        assert _is_empty(b).all()


def test_every_row_parallel_site_has_its_own_number():
    from kvpilot.config import ModelConfig
    from kvpilot.llama import LlamaForCausalLM, ParallelContext
    from kvpilot.parallel_worker import all_reduce_sites

    for layer_range, tie in (((0, 3), False), ((1, 3), True), ((1, 3), False), ((0, 1), False)):
        cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
                          rope_theta=10000.0, rope_scaling=None, max_position_embeddings=128,
                          tie_word_embeddings=tie, torch_dtype="float32", bos_token_id=1, eos_token_ids=[2])
        pc = ParallelContext(0, 2, None)
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg, pc, layer_range)
        sites = [m.ar_site for m in model.modules() if hasattr(m, "ar_site")]
        assert sorted(sites) == list(range(pc.num_sites))
        layers = layer_range[1] - layer_range[0]
        assert pc.num_sites == 2 * layers + (1 if model.embed_tokens is not None else 0)
        assert pc.num_sites <= all_reduce_sites(layer_range)  # the worker's buffer count
        # Folded all-reduces (engine/llama.py): only the last layer's down_proj site is the last site
        # (its output is not pushed), and a layer's o_proj site follows the previous layer's down_proj
        # site (the next layer pulls it: `take_pushed(o_site - 1)`).
        downs = [layer.mlp.ar_site for layer in model.layers]
        assert [pc.is_last_site(s) for s in downs] == [False] * (layers - 1) + [True]
        assert not any(pc.is_last_site(layer.self_attn.ar_site) for layer in model.layers)
        assert all(layer.self_attn.ar_site - 1 == prev.mlp.ar_site
                   for prev, layer in zip(model.layers, model.layers[1:]))


class _FakeOneShot:
    def __init__(self, limit: int) -> None:
        self.limit, self.seen = limit, []

    def fits(self, x, site):
        return x.numel() <= self.limit

    def all_reduce(self, x, site):
        self.seen.append((site, x.numel()))
        return x.mul_(2)


def test_parallel_context_routes_small_reductions_to_the_one_shot_kernel(monkeypatch):
    from kvpilot.llama import ParallelContext

    nccl = []
    monkeypatch.setattr("kvpilot.llama.dist.all_reduce", lambda x, group=None: nccl.append(x.numel()))
    pc = ParallelContext(0, 2, None, custom_all_reduce=_FakeOneShot(8))
    a = torch.ones(2, 4)
    assert pc.all_reduce(a, site=3) is a and torch.equal(a, torch.full((2, 4), 2.0))
    pc.all_reduce(torch.ones(3, 4), site=3)  # too large: NCCL
    pc.all_reduce(torch.ones(1, 4))  # no site: NCCL
    assert pc.custom_all_reduce.seen == [(3, 8)] and nccl == [12, 4]
    # row_parallel hands its site through, in the fp32 mode too
    w = torch.eye(4)
    out = pc.row_parallel(torch.ones(1, 4, dtype=torch.bfloat16), w.bfloat16(), None,
                          lambda x, w, b, dt: torch.nn.functional.linear(x, w).to(dt or x.dtype), True, site=5)
    assert out.dtype == torch.bfloat16 and torch.equal(out.float(), torch.full((1, 4), 2.0))
    assert pc.custom_all_reduce.seen[-1] == (5, 4)


def test_create_declines_without_two_cuda_ranks(monkeypatch):
    from kvpilot.custom_all_reduce import CustomAllReduce, custom_all_reduce_max_tokens

    assert CustomAllReduce.create(None, 0, 2, torch.device("cpu"), 5, 32) is None
    assert CustomAllReduce.create(None, 0, 4, torch.device("cuda", 0), 5, 32) is None
    monkeypatch.delenv("KVPILOT_TP_CUSTOM_ALLREDUCE_MAX_TOKENS", raising=False)
    assert custom_all_reduce_max_tokens(65, 4096) == 256  # Llama-3.1-8B: 273 MB of buffers
    assert custom_all_reduce_max_tokens(161, 8192) == (512 << 20) // (4 * 161 * 8192) == 101  # 70B: capped
    assert custom_all_reduce_max_tokens(10**6, 10**5) == 1
    monkeypatch.setenv("KVPILOT_TP_CUSTOM_ALLREDUCE_MAX_TOKENS", "0")
    with pytest.raises(ValueError, match="positive integer"):
        custom_all_reduce_max_tokens()
    monkeypatch.setenv("KVPILOT_TP_CUSTOM_ALLREDUCE_MAX_TOKENS", "16")
    assert custom_all_reduce_max_tokens() == 16


# ---- the all-reduce folded into the batch-1 GEMVs (kernels/gemv.py, "Folded all-reduce") ------------
FOLD_LAYERS, FOLD_H, FOLD_Q, FOLD_I, FOLD_EPS = 3, 32, 32, 32, 1e-5
# (input, mode) per forward pass: folded, then with the separate kernel (which spins forever, or sums
# stale values, unless the folded pass left every buffer empty), then folded again after it.
FOLD_STEPS = [(0, "fold"), (0, "plain"), (1, "fold")]
FOLD_DTYPES = (torch.float32, torch.bfloat16)


def _fold_configs():
    """Per layer, the launches of (RMSNorm->GEMV, o_proj's GEMV, SiLU->GEMV): the table's (for the
    RMSNorm: one-load pass and early weight tile), then vec tiles, then a K-tile RMSNorm pass (as for
    hidden sizes above 4096: the spin runs per K tile) and 2-D o_proj tiles, each producer program
    resetting and pushing two column tiles. Few programs: the interpreter's time goes with them."""
    from kvpilot.kernels import gemv as G

    c = G.launch_config
    return [(None, None, None),
            (c("fma", 1, 8, 32, programs_per_sm=1, norm_one_load=True, vec=8), c("fma", 1, 16, 32, vec=8),
             c("fma", 1, 16, 32)),
            (c("fma", 1, 8, 16, programs_per_sm=1), c("fma", 1, 16, 16, programs_per_sm=1),
             c("fma", 1, 16, 16, programs_per_sm=1))]


def _fold_weights(rank: int, dtype: torch.dtype) -> list[dict]:
    """Per layer: norm weights (the same on both ranks) and this rank's shards of a layer's four
    projections (QKV / gate_up column-parallel, o_proj / down row-parallel)."""
    out = []
    for layer in range(FOLD_LAYERS):
        g = torch.Generator().manual_seed(50 + layer)
        shared = {k: (1 + 0.1 * torch.randn(FOLD_H, generator=g)).to(dtype) for k in ("nw1", "nw2")}
        g = torch.Generator().manual_seed(500 + 10 * layer + rank)
        rnd = lambda *s: (torch.randn(*s, generator=g) / s[-1] ** 0.5).to(dtype)  # noqa: E731
        out.append(dict(shared, qkv=rnd(FOLD_Q, FOLD_H), o=rnd(FOLD_H, FOLD_Q), gu=rnd(2 * FOLD_I, FOLD_H),
                        down=rnd(FOLD_H, FOLD_I)))
    return out


def _fold_input(i: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(1, FOLD_H, generator=torch.Generator().manual_seed(900 + i)).to(dtype)


def _fold_chain(x, weights, cfgs, mine, peer, fold: bool, rec: dict) -> torch.Tensor:
    """One forward pass of ``FOLD_LAYERS`` layers at M = 1 (attention left out: QKV's output feeds
    o_proj): folded (producer push / consumer pull / reset by the next producer; the last down_proj
    reduced by the kernel) or with a separate `two_rank_all_reduce` per site. Sites: o_proj of layer l
    is 2l, its down_proj 2l + 1. Records per layer what the checks need in ``rec``."""
    from kvpilot.kernels import gemv as G

    hidden, res = x, None
    for layer, (w, (cfg, cfg_o, cfg_down)) in enumerate(zip(weights, cfgs)):
        o_site, d_site, last = 2 * layer, 2 * layer + 1, layer == FOLD_LAYERS - 1
        prev = 2 * layer - 1
        if res is None:
            qkv, res = G.rmsnorm_gemv_triton(hidden, None, w["nw1"], FOLD_EPS, w["qkv"], config=cfg), hidden
        else:
            qkv, res = G.rmsnorm_gemv_triton(hidden, res, w["nw1"], FOLD_EPS, w["qkv"], config=cfg,
                                             pull=mine[prev] if fold else None)
        if fold:
            o = G.gemv_triton(qkv, w["o"], config=cfg_o, push=peer[o_site], reset=mine[prev] if layer else None)
        else:
            o = A.two_rank_all_reduce(G.gemv_triton(qkv, w["o"], config=cfg_o), mine[o_site], peer[o_site])
        rec.setdefault("qkv", []).append(qkv.clone())
        rec.setdefault("o", []).append(o.clone())  # folded: this rank's partial; else the sum
        rec.setdefault("res_in", []).append(res.clone())
        gu, res = G.rmsnorm_gemv_triton(o, res, w["nw2"], FOLD_EPS, w["gu"], config=cfg,
                                        pull=mine[o_site] if fold else None)
        rec.setdefault("gu", []).append(gu.clone())
        rec.setdefault("res", []).append(res.clone())
        if fold:
            hidden = G.silu_mul_gemv_triton(gu, w["down"], config=cfg_down, push=None if last else peer[d_site],
                                            reset=mine[o_site])
            if last:
                A.two_rank_all_reduce(hidden, mine[d_site], peer[d_site])
        else:
            hidden = A.two_rank_all_reduce(G.silu_mul_gemv_triton(gu, w["down"], config=cfg_down), mine[d_site],
                                           peer[d_site])
    return hidden


def _fold_rank(rank: int, bufs: list[torch.Tensor], q) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    from kvpilot.kernels import gemv as G

    G._sm_count = lambda device: 1  # persistent grids of a one-SM GPU: few programs, a fast interpreter
    out = {}
    for dtype in FOLD_DTYPES:
        weights, cfgs = _fold_weights(rank, dtype), _fold_configs()
        for i, mode in FOLD_STEPS:
            rec: dict = {}
            final = _fold_chain(_fold_input(i, dtype), weights, cfgs, bufs[rank], bufs[1 - rank], mode == "fold", rec)
            out.setdefault(str(dtype), []).append({k: torch.cat(v) for k, v in rec.items()} | {"final": final})
    q.put((rank, _to_bytes(out)))


def _to_bytes(obj) -> bytes:
    # By value: a tensor put on a queue as is lives in the sender's shared memory, gone when it exits.
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _run_two(target, *args) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(2):
            rank, res = q.get(timeout=300)
            got[rank] = torch.load(io.BytesIO(res)) if isinstance(res, bytes) else res
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    return got


@needs_interpreter
def test_folded_all_reduce_is_bit_identical_to_the_separate_kernel():
    """Two CPU processes run forward passes of a 3-layer chain (QKV, o_proj, gate_up, down at M = 1)
    with the all-reduces folded into the GEMVs and with the separate kernel, on the same buffers:

    - every output (both ranks' GEMV outputs and residual streams, the final reduced hidden state) is
      bit for bit the unfolded one, whichever path ran before;
    - the folded sum is the reference's: the residual stream after gate_up is
      ``two_rank_all_reduce_ref(o_0, o_1) + residual`` (bit for bit in float32; the interpreter
      truncates 16-bit roundings, so bf16 is compared with the interpreter's unfolded path only), and
      gate_up's output matches `rmsnorm_gemv_ref` of that sum;
    - both ranks end with the same residual stream and every receive buffer is empty again."""
    bufs = [A.empty_receive_buffer(2 * FOLD_LAYERS * FOLD_H, "cpu").view(2 * FOLD_LAYERS, FOLD_H).share_memory_()
            for _ in range(2)]
    got = _run_two(_fold_rank, bufs)
    for dtype in FOLD_DTYPES:
        _check_fold_runs(dtype, got[0][str(dtype)], got[1][str(dtype)])
    for b in bufs:
        assert _is_empty(b).all()


def _check_fold_runs(dtype: torch.dtype, runs0: list[dict], runs1: list[dict]) -> None:
    from kvpilot.kernels import gemv as G

    for rank, runs in enumerate((runs0, runs1)):
        by_input: dict = {}
        for (i, mode), run in zip(FOLD_STEPS, runs):
            by_input.setdefault(i, {}).setdefault(mode, []).append(run)
        for i, modes in by_input.items():
            ref = modes["plain"][0] if "plain" in modes else modes["fold"][0]
            for run in modes.get("fold", []) + modes.get("plain", []):
                for key in ("qkv", "gu", "res", "res_in", "final"):
                    assert torch.equal(run[key], ref[key]), (rank, i, key)
    for (i, mode), r0, r1 in zip(FOLD_STEPS, runs0, runs1):
        assert torch.equal(r0["res"], r1["res"]) and torch.equal(r0["final"], r1["final"]), (i, mode)
        if mode != "fold":
            continue
        weights = _fold_weights(0, dtype)
        for layer in range(FOLD_LAYERS):
            ar = A.two_rank_all_reduce_ref(r0["o"][layer:layer + 1], r1["o"][layer:layer + 1])
            res_in = r0["res_in"][layer:layer + 1]
            want_y, want_h = G.rmsnorm_gemv_ref(ar, res_in, weights[layer]["nw2"], FOLD_EPS, weights[layer]["gu"])
            if dtype == torch.float32:
                assert torch.equal(r0["res"][layer:layer + 1], want_h), (i, layer)
                torch.testing.assert_close(r0["gu"][layer:layer + 1], want_y, rtol=1e-5, atol=1e-5)
