"""The two-rank one-shot all-reduce kernel (kernels/allreduce.py) and its engine wiring.

- CPU, ``TRITON_INTERPRET=1``: one process with the peer's data already pushed; and two processes
  that share CPU memory and run the real protocol against each other (each pushes into the other's
  receive buffers and spins on its own), several forward passes over several call sites, checked
  against the float32 sum and for identical results on both ranks and empty buffers afterwards.
- Site numbering: every row-parallel call site of a model gets its own number, and the worker's
  count of sites covers them.
- GPU (``-m gpu``, two GPUs): tests/engine/parallel/test_custom_all_reduce_gpu.py.
"""

from __future__ import annotations

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
    from kvpilot.model.config import ModelConfig
    from kvpilot.model.llama import LlamaForCausalLM, ParallelContext
    from kvpilot.parallel.worker import all_reduce_sites

    for layer_range, tie in (((0, 3), False), ((1, 3), True), ((1, 3), False)):
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


class _FakeOneShot:
    def __init__(self, limit: int) -> None:
        self.limit, self.seen = limit, []

    def fits(self, x, site):
        return x.numel() <= self.limit

    def all_reduce(self, x, site):
        self.seen.append((site, x.numel()))
        return x.mul_(2)


def test_parallel_context_routes_small_reductions_to_the_one_shot_kernel(monkeypatch):
    from kvpilot.model.llama import ParallelContext

    nccl = []
    monkeypatch.setattr("kvpilot.model.llama.dist.all_reduce", lambda x, group=None: nccl.append(x.numel()))
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
    from kvpilot.parallel.custom_all_reduce import CustomAllReduce, custom_all_reduce_max_tokens

    assert CustomAllReduce.create(None, 0, 2, torch.device("cpu"), 5, 32) is None
    assert CustomAllReduce.create(None, 0, 4, torch.device("cuda", 0), 5, 32) is None
    assert custom_all_reduce_max_tokens(65, 4096) == 256  # Llama-3.1-8B: 273 MB of buffers
    assert custom_all_reduce_max_tokens(161, 8192) == (512 << 20) // (4 * 161 * 8192) == 101  # 70B: capped
    assert custom_all_reduce_max_tokens(10**6, 10**5) == 1
    assert custom_all_reduce_max_tokens(max_tokens=16) == 16  # Tuning.tp_custom_allreduce_max_tokens
    assert CustomAllReduce.create(None, 0, 2, torch.device("cpu"), 5, 32, enabled=False) is None
