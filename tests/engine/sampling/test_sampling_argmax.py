"""`kvpilot.kernels.sampling.argmax` (the greedy rows' arg-max, `kvpilot.sampling.sampler.greedy_ids`) returns
``torch.argmax``'s ids: the first maximum, the first NaN of a row that has one, all -inf rows -> 0.

CPU: the Triton kernels under TRITON_INTERPRET=1 with a shrunken chunk, so that rows span several
chunks and ties, NaNs and the maximum fall on chunk boundaries; GPU: the serving shape (128,256).
"""

from __future__ import annotations

import os

import pytest
import torch

from kvpilot.kernels import sampling as KS
from kvpilot.sampling.sampler import Sampler, SamplingRow, greedy_ids

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpret = pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels under TRITON_INTERPRET=1")


@pytest.fixture
def small_chunks():
    saved = dict(KS.CONFIG)
    KS.CONFIG.update(chunk=32, block=8)
    yield
    KS.CONFIG.clear()
    KS.CONFIG.update(saved)


def _hard_rows(V: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(9, V, generator=g)
    x[1] = x[1].mul(2).round()  # many ties: the first maximum wins
    x[2, V // 2] = float("nan")
    x[3] = float("-inf")  # -> 0
    x[4] = 3.0  # all tied -> 0
    x[5, -1] = 100.0  # the maximum in the last (partial) chunk
    if V > 40:
        x[6, 31] = x[6, 32] = 50.0  # tie across a chunk boundary (chunk 32)
        x[7, 1] = x[7, 35] = float("nan")  # two NaNs in two chunks: the first
        x[7, 0] = float("inf")
        x[8, 33] = float("inf")
        x[8, 40] = float("inf")
    return x.to(dtype)


@interpret
@pytest.mark.parametrize("V", [1, 7, 32, 33, 100, 257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_equals_torch(small_chunks, V, dtype):
    x = _hard_rows(V, dtype, seed=V)
    want = torch.argmax(x, dim=-1)
    got = KS.argmax(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, want), (got, want)
    out = torch.full((x.shape[0],), -5, dtype=torch.int64)
    assert KS.argmax(x, out=out) is out
    assert torch.equal(out, want)


@interpret
def test_argmax_row_stride_and_default_chunks():
    """A row-strided view (every other row of a wider buffer) and the default chunk sizes."""
    g = torch.Generator().manual_seed(3)
    buf = torch.randn(6, 5000, generator=g)
    x = buf[::2, :4500]
    assert torch.equal(KS.argmax(x), torch.argmax(x, dim=-1))
    assert KS.argmax(torch.empty(0, 10)).shape == (0,)


def test_argmax_errors():
    x = torch.randn(2, 10)
    with pytest.raises(ValueError, match="contiguous"):
        KS.argmax(x.t())
    with pytest.raises(ValueError, match="contiguous"):
        KS.argmax(torch.randn(10))
    with pytest.raises(ValueError, match="vocabulary"):
        KS.argmax(torch.empty(2, 0))
    with pytest.raises(ValueError, match="out"):
        KS.argmax(x, out=torch.empty(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="out"):
        KS.argmax(x, out=torch.empty(2, dtype=torch.int32))


@interpret
def test_greedy_ids_and_sampler_greedy_batch(small_chunks):
    """`greedy_ids` takes the kernels when asked (and torch.argmax otherwise); an all-greedy batch of
    the "triton" sampler backend returns the same tokens as the "torch" backend."""
    x = _hard_rows(100, torch.float32, seed=1)[[0, 1, 4, 5, 6]]  # NaN-free rows: the sampler's input
    want = torch.argmax(x, dim=-1)
    assert torch.equal(greedy_ids(x, use_triton=True), want)
    assert torch.equal(greedy_ids(x, use_triton=False), want)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    assert greedy_ids(x, out=out, use_triton=True) is out and torch.equal(out, want)
    rows = [SamplingRow(temperature=0.0) for _ in range(x.shape[0])]
    assert Sampler("triton").choose(x, rows) == want.tolist() == Sampler("torch").choose(x, rows)


# ---- GPU ---------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_gpu_argmax_serving_shape(rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 128256, device="cuda", generator=g)
    x[0, 128255] = 1e4  # the last column
    if rows > 1:
        x[1, 7] = x[1, 70000] = 1e4  # a tie: the first
    if rows > 2:
        x[2, 99999] = float("nan")
    for dtype in (torch.float32, torch.bfloat16):
        y = x.to(dtype)
        assert torch.equal(KS.argmax(y), torch.argmax(y, dim=-1))
        assert torch.equal(greedy_ids(y), torch.argmax(y, dim=-1))
