"""The "tma" GEMV kind's configurations (kernels/gemv.py): an explicit configuration with M = 0 returns
the empty ``[0, N]`` result; configurations no launch can run (``block_k > 512``, ``late_trigger`` on
the fma/dot kinds) are refused, and the error names the condition that failed; the RMSNorm K-tile pass
(K > NORM_ONE_LOAD_MAX, e.g. a hidden size of 8192) and column-sliced weights (TMA reads zeros past K,
not the neighbouring columns); a table row falls back for a misaligned weight base."""

from __future__ import annotations

import os

import pytest
import torch

from kvpilot.kernels import gemv as G
from kvpilot.kernels import sampling as KS

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpret = pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels under TRITON_INTERPRET=1")


# ---- 4. the tma kind's contract -----------------------------------------------------------------
def test_tma_configs_refused_when_no_launch_can_run_them():
    with pytest.raises(ValueError, match="block_k <= 512"):
        G.launch_config("tma", 1, 16, 1024)
    with pytest.raises(ValueError, match="late_trigger"):
        G.launch_config("fma", 1, 8, 1024, late_trigger=True)
    with pytest.raises(ValueError, match="late_trigger"):
        G.launch_config("dot", 16, 32, 256, late_trigger=True)
    assert G.launch_config("tma", 1, 16, 512, late_trigger=True)["late_trigger"]


@interpret
def test_tma_explicit_config_with_no_rows_returns_the_empty_result():
    w = torch.randn(24, 64, dtype=torch.float16)
    x = torch.empty(0, 64, dtype=torch.float16)
    for kind in ("fma", "tma"):
        y = G.gemv_triton(x, w, config=G.launch_config(kind, 1, 8, 32))
        assert y.shape == (0, 24) and y.dtype == torch.float16, kind
    y, h = G.rmsnorm_gemv_triton(x, x, torch.ones(64, dtype=torch.float16), 1e-5, w,
                                 config=G.launch_config("tma", 1, 8, 32))
    assert y.shape == (0, 24) and h.shape == (0, 64)


@interpret
def test_tma_refusal_names_the_condition():
    cfg = G.launch_config("tma", 1, 16, 32)
    x = torch.randn(1, 96, dtype=torch.float16)
    base = torch.randn(24, 136, dtype=torch.float16)
    with pytest.raises(ValueError, match="16-byte aligned base"):
        G.gemv_triton(x, base[:, 1:97], config=cfg)  # row stride 272 bytes, base 2 bytes off
    with pytest.raises(ValueError, match="M = 1"):
        G.gemv_triton(torch.randn(2, 96, dtype=torch.float16), base[:, :96], config=cfg)
    with pytest.raises(ValueError, match="16 bytes"):
        G.gemv_triton(x, base[:, :96], config=G.launch_config("tma", 1, 16, 4))
    with pytest.raises(ValueError, match="16-bit"):
        G.gemv_triton(x.float(), base[:, :96].float(), config=cfg)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@interpret
def test_tma_rmsnorm_k_tile_pass_and_column_sliced_weights(monkeypatch):
    """K > NORM_ONE_LOAD_MAX (a hidden size of 8192 on the GPU) takes the kernel's K-tile RMSNorm
    pass, where program 0 writes h tile by tile; a weight that is a column slice of a wider matrix
    must read zeros past K (TMA bounds), not the next columns (NaN here)."""
    monkeypatch.setattr(G, "NORM_ONE_LOAD_MAX", 32)
    g = torch.Generator().manual_seed(7)
    rnd = lambda *s: torch.randn(*s, generator=g).to(torch.float16)  # noqa: E731
    wide = rnd(40, 128) / 10
    wide[:, 96:] = float("nan")
    w = wide[:, :96]
    x, res, nw, b = rnd(1, 96), rnd(1, 96), 1 + 0.1 * rnd(96), rnd(40)
    cfg = G.launch_config("tma", 1, 16, 64, num_stages=2)
    y, h = G.rmsnorm_gemv_triton(x, res, nw, 1e-5, w, b, config=cfg)
    y_ref, h_ref = G.rmsnorm_gemv_ref(x, res, nw, 1e-5, w, b)
    assert torch.equal(h, h_ref)
    assert _rel(y, y_ref) < 1e-3
    y = G.rmsnorm_gemv_triton(x, None, nw, 1e-5, w, config=cfg)
    assert _rel(y, G.rmsnorm_gemv_ref(x, None, nw, 1e-5, w)) < 1e-3
    small_w, small_x = rnd(5, 24), rnd(1, 24)  # N < block_n, K < block_k
    assert _rel(G.gemv_triton(small_x, small_w, config=cfg), G.gemv_ref(small_x, small_w)) < 1e-3


@interpret
def test_tma_table_row_falls_back_for_a_misaligned_weight_base(monkeypatch):
    rows = [(1, 0, G.launch_config("tma", 1, 16, 32)), (1, 0, G.launch_config("fma", 1, 8, 32)),
            (16, 0, G.launch_config("fma", 16, 8, 32))]
    monkeypatch.setitem(G.CONFIGS, "plain", rows)
    base = torch.randn(24, 136, dtype=torch.float16)
    w = base[:, 1:97]
    x = torch.randn(1, 96, dtype=torch.float16)
    assert _rel(G.gemv_triton(x, w), G.gemv_ref(x, w)) < 1e-3
    monkeypatch.setenv("KVPILOT_GEMV_TMA", "0")  # the switch: the table's fma row, same values
    assert _rel(G.gemv_triton(x, base[:, :96]), G.gemv_ref(x, base[:, :96])) < 1e-3
