"""The greedy rows' Triton arg-max (`kvpilot.kernels.sampling.argmax`, `kvpilot.sampling.sampler.greedy_ids`).

- `sampling.argmax` refuses float64 and integer logits (it compares in float32), and `greedy_ids`
  gives them to ``torch.argmax``.
- `greedy_ids(logits, out=...)` is a drop-in for ``torch.argmax(dim=-1, out=)``: it falls back to
  ``torch.argmax`` wherever the kernel's contract does not hold (a strided int64 ``out``, V >= 2**31).
- `sampling.argmax` keeps at most 1,024 programs per row (chunks grow past ``CONFIG["chunk"]``; CUDA
  caps the grid's second dimension at 65,535).
- First maximum / first NaN / all -inf -> 0 across chunk boundaries, -0.0 == 0.0 ties, +inf, V = 1,
  rows of stride 0 and overlapping rows, bf16/fp16, ``out`` a slice of a larger id buffer (the output
  rank's ``tok_buf[:n]``); the "torch"/"exact" sampler backends never reach the kernel.
- The sampler kernels refuse vocabularies past their grid, and the sampler then takes torch.

GPU (``-m gpu``): the arg-max against CUDA's ``torch.argmax`` at
serving vocabularies with ties and NaNs on 4096-column chunk boundaries, inside a CUDA graph."""

from __future__ import annotations

import os

import pytest
import torch

from kvpilot.kernels import gemv as G
from kvpilot.kernels import sampling as KS
from kvpilot.sampling.sampler import Sampler, SamplingRow, greedy_ids

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpret = pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels under TRITON_INTERPRET=1")


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setitem(KS.CONFIG, "chunk", 32)
    monkeypatch.setitem(KS.CONFIG, "block", 8)


# ---- 1. dtypes the kernels cannot compare exactly --------------------------------------------------
@interpret
def test_argmax_refuses_float64_and_greedy_ids_keeps_torch_ids(small_chunks):
    x = torch.zeros(2, 40, dtype=torch.float64)
    x[0, 2], x[0, 35] = 1.0, 1.0 + 1e-12  # equal in float32: the kernel would answer 2
    x[1, 3], x[1, 38] = 1e300, 2e300  # both +inf in float32
    want = torch.argmax(x, dim=-1)
    assert want.tolist() == [35, 38]
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        KS.argmax(x)
    assert torch.equal(greedy_ids(x, use_triton=True), want)
    big = torch.full((1, 40), 2**24, dtype=torch.int64)
    big[0, 33] += 1  # 2**24 + 1 rounds to 2**24 in float32
    with pytest.raises(ValueError, match="float32"):
        KS.argmax(big)
    assert greedy_ids(big, use_triton=True).tolist() == torch.argmax(big, dim=-1).tolist() == [33]


# ---- 2. greedy_ids is torch.argmax for every out torch.argmax takes -------------------------------
@interpret
def test_greedy_ids_takes_every_out_torch_argmax_takes(small_chunks):
    g = torch.Generator().manual_seed(12)
    x = torch.randn(3, 70, generator=g)
    want = torch.argmax(x, dim=-1)
    strided = torch.full((6,), -1, dtype=torch.int64)[::2]
    assert greedy_ids(x, out=strided, use_triton=True) is strided
    assert torch.equal(strided, want)
    # the output rank's case: a prefix of a larger id buffer; the rest stays as it was
    buf = torch.full((8,), -7, dtype=torch.int64)
    assert greedy_ids(x, out=buf[:3], use_triton=True).data_ptr() == buf.data_ptr()
    assert torch.equal(buf[:3], want) and buf[3:].tolist() == [-7] * 5
    # errors are torch.argmax's own
    with pytest.raises(type(_torch_error(lambda: torch.argmax(torch.empty(2, 0), dim=-1)))):
        greedy_ids(torch.empty(2, 0), use_triton=True)


def _torch_error(fn) -> BaseException:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the type is what the test compares
        return e
    raise AssertionError("expected torch to raise")


# ---- 3. programs per row stay within the grid -------------------------------------------------------
@interpret
def test_argmax_caps_programs_per_row(small_chunks, monkeypatch):
    monkeypatch.setattr(KS, "_ARGMAX_MAX_CHUNKS", 4)
    grids = []
    real = KS._argmax_chunk_kernel

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return real[grid]

    monkeypatch.setattr(KS, "_argmax_chunk_kernel", Recorder())
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 1000, generator=g)
    x[0, 127], x[0, 128] = 9.0, 9.0  # a tie on the boundary of the grown chunks (128 columns)
    x[1, 700] = float("nan")
    x[2] = float("-inf")
    assert torch.equal(KS.argmax(x), torch.argmax(x, dim=-1))
    assert grids == [(3, 4)]  # 1000 columns: 4 chunks of 256, not 32 of 32
    grids.clear()
    assert torch.equal(KS.argmax(x[:, :100]), torch.argmax(x[:, :100], dim=-1))
    assert grids == [(3, 4)]  # 100 columns: the configured 32-column chunks (4 of them)


# ---- values the kernels must order as torch does ------------------------------------------
@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_signed_zeros_infinities_and_odd_strides(small_chunks, dtype):
    x = torch.full((6, 97), -1.0)
    x[0, 31], x[0, 32] = -0.0, 0.0  # -0.0 == 0.0: the first, across a chunk boundary
    x[1, 5], x[1, 64] = 0.0, -0.0
    x[2, 40], x[2, 90] = float("inf"), float("inf")
    x[3, 96], x[3, 95] = float("nan"), float("inf")  # a NaN wins over +inf
    x[4] = float("nan")
    x[5, 63] = 65504.0  # float16's largest
    x = x.to(dtype)
    assert torch.equal(KS.argmax(x), torch.argmax(x, dim=-1))
    rows = x[2:3].expand(4, 97)  # stride 0 between rows
    assert rows.stride(0) == 0 and torch.equal(KS.argmax(rows), torch.argmax(rows, dim=-1))
    flat = x.flatten()
    overlap = flat.as_strided((5, 97), (13, 1))  # rows overlapping in memory
    assert torch.equal(KS.argmax(overlap), torch.argmax(overlap, dim=-1))


@interpret
@pytest.mark.parametrize("backend,calls", [("torch", 0), ("exact", 0), ("triton", 1)])
def test_only_the_triton_backends_reach_the_arg_max_kernel(monkeypatch, backend, calls):
    seen = []
    real = KS.argmax

    def counting(logits, out=None):
        seen.append(tuple(logits.shape))
        return real(logits, out=out)

    monkeypatch.setattr(KS, "argmax", counting)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 50, generator=g)
    rows = [SamplingRow(temperature=0.0) for _ in range(3)]
    assert Sampler(backend).choose(x, rows) == torch.argmax(x, dim=-1).tolist()
    assert len(seen) == calls


# ---- GPU ---------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _gpu_hard_rows(S: int, V: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(S + V)
    x = torch.randn(S, V, device="cuda", generator=g)
    c = KS.CONFIG["chunk"]
    specials = [
        lambda r: r.index_fill_(0, torch.tensor([c - 1, c], device="cuda"), 50.0),  # tie across chunks
        lambda r: r.index_fill_(0, torch.tensor([2 * c, c + 7], device="cuda"), float("nan")),
        lambda r: r.fill_(float("-inf")),
        lambda r: r.fill_(-1.0).index_fill_(0, torch.tensor([3 * c - 1], device="cuda"), -0.0)
        .index_fill_(0, torch.tensor([3 * c], device="cuda"), 0.0),
        lambda r: r.index_fill_(0, torch.tensor([V - 1, 5], device="cuda"), float("inf")),
    ]
    for i, f in enumerate(specials[:S]):
        f(x[i])
    return x.to(dtype)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("V", [128256, 152064, 32000])
def test_gpu_argmax_hard_rows_equal_cuda_torch(dtype, V):
    x = _gpu_hard_rows(64, V, dtype)
    assert torch.equal(KS.argmax(x), torch.argmax(x, dim=-1))
    buf = torch.zeros(2, 128, V, device="cuda", dtype=dtype)  # the IPC logits buffer's slot rows
    buf[1, :64] = x
    ids = torch.full((256,), -3, dtype=torch.int64, device="cuda")
    greedy_ids(buf[1, :64], out=ids[:64])
    assert torch.equal(ids[:64], torch.argmax(x, dim=-1)) and bool((ids[64:] == -3).all())


@gpu
@pytest.mark.gpu
def test_gpu_argmax_in_a_cuda_graph():
    x = _gpu_hard_rows(5, 128256, torch.float32)
    ids = torch.empty(5, dtype=torch.int64, device="cuda")
    greedy_ids(x, out=ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        greedy_ids(x, out=ids)
    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(x.shape, device="cuda", generator=g))
        x[seed, 4095] = x[seed, 4096] = 1e4
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(ids, torch.argmax(x, dim=-1)), seed


# ---- the sampler kernels' vocabulary bound -------------------------------------------------------
def test_sampler_kernels_refuse_vocabularies_past_their_grid_and_the_sampler_takes_torch():
    """`draw`, `raw_logprobs` and `apply_penalties` launch one program per 4,096-column chunk on the
    grid's second dimension (at most 65,535) and reduce every chunk's partial in one program: past
    ``MAX_VOCAB`` they raise ValueError, and the "auto" sampler takes its PyTorch path instead."""
    from kvpilot.sampling.sampler import Sampler

    V = KS.MAX_VOCAB + 1
    meta = torch.empty(2, V, device="meta")
    idx = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="at most"):
        KS.draw(meta, torch.empty(2, 4), torch.empty(2, 4, dtype=torch.int64), idx, idx[:0])
    with pytest.raises(ValueError, match="at most"):
        KS.raw_logprobs(meta, idx, idx, 0)
    with pytest.raises(ValueError, match="at most"):
        KS.apply_penalties(meta, idx, idx, torch.empty(1, V, dtype=torch.int32, device="meta"),
                           torch.empty(1, 3))

    class CudaLogits:  # what Sampler._use_triton reads of a CUDA logits tensor
        is_cuda = True

        def __init__(self, v: int) -> None:
            self.shape = (2, v)

    assert Sampler("auto")._use_triton(CudaLogits(KS.MAX_VOCAB)) is True
    assert Sampler("auto")._use_triton(CudaLogits(V)) is False
