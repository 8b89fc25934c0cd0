"""The Triton MoE kernels (``kernels/fused_moe.py``) against the loop-over-experts reference (which
the family tests, tests/engine/model/test_moe_families.py, check against transformers), routing
and token alignment.

On CPU the kernels run under ``TRITON_INTERPRET=1`` with tiny shapes: both paths (small-token and
grouped), experts that receive no token, experts chosen by several tokens, a hidden / intermediate
size that is not a multiple of the tiles.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvpilot.kernels import triton_available
from kvpilot.kernels.moe import check_backend, fused_moe, fused_moe_ref, moe_align, select_experts

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"
needs_triton = pytest.mark.skipif(not (HAS_CUDA or INTERPRET) or not triton_available(),
                                  reason="needs a CUDA GPU or TRITON_INTERPRET=1")


def _problem(t, e, k, h, i, dtype=torch.float32, seed=0, skew=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=g) / i ** 0.5
    logits = torch.randn(t, e, generator=g)
    if skew:  # the last experts never chosen; expert 0 by every token
        logits[:, e // 2:] -= 100.0
        logits[:, 0] += 100.0
    w, ids = select_experts(logits, k, renormalize=True)
    to = dict(device=DEVICE)
    return x.to(dtype).to(**to), w13.to(dtype).to(**to), w2.to(dtype).to(**to), w.to(**to), ids.to(**to)


def test_moe_align_sorts_pairs_by_expert_padded_to_blocks():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])
    pairs, block_e = moe_align(ids, num_experts=5, block_m=2)
    pad = ids.numel()
    # expert 0: pairs 1, 4; expert 2: pairs 0, 2, 5 (+1 pad); expert 3: pair 3 (+1 pad); 1 and 4: none
    assert block_e.tolist()[:4] == [0, 2, 2, 3] and all(b == -1 for b in block_e.tolist()[4:])
    assert pairs.tolist()[:8] == [1, 4, 0, 2, 5, pad, 3, pad]
    assert all(p == pad for p in pairs.tolist()[8:])


def test_select_experts_without_renormalisation_keeps_softmax_weights():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    w, ids = select_experts(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)[0]
    assert ids.tolist() == [[3, 2]]
    torch.testing.assert_close(w[0], probs[[3, 2]])
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        select_experts(logits, 5, renormalize=False)


def test_backend_names_are_checked():
    assert check_backend("triton") == "TRITON"
    with pytest.raises(ValueError, match="'TRITON', 'TORCH'"):
        check_backend("CUTLASS")


@needs_triton
@pytest.mark.parametrize("path,t,e,k,h,i,skew", [
    ("small", 3, 6, 2, 40, 24, True),     # shared experts across tokens, unchosen experts
    ("small", 1, 8, 4, 33, 20, False),    # batch-1 decode, H and I off the tiles
    ("grouped", 13, 5, 2, 40, 36, True),  # padded runs, experts with no token
])
def test_triton_matches_reference(path, t, e, k, h, i, skew):
    from kvpilot.kernels import fused_moe as FM

    x, w13, w2, w, ids = _problem(t, e, k, h, i, skew=skew)
    old = dict(FM.TUNING)
    FM.TUNING["grouped"] = [(None, 16, 16, 16, 2, 4, 2)]  # small tiles: several row blocks per expert
    FM.TUNING["small_tile"] = 256
    try:
        got = FM.fused_moe_triton(x, w13, w2, w, ids, path=path)
    finally:
        FM.TUNING.update(old)
    want = fused_moe_ref(x, w13, w2, w, ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("tma", [True, False])
def test_grouped_fp16_weight_tiles_by_tma_and_by_pointers(tma):
    """16-bit weights: the grouped kernels read weight tiles by TMA (a tile past an expert's rows
    reads the next expert's: I = 24 and H = 40 are not multiples of the 16-row tile) or by
    pointer loads; both match the float32 reference to fp16 rounding."""
    from kvpilot.kernels import fused_moe as FM

    x, w13, w2, w, ids = _problem(9, 5, 2, 40, 24, dtype=torch.float16, seed=3, skew=True)
    old = dict(FM.TUNING)
    FM.TUNING.update(grouped=[(None, 16, 16, 16, 2, 4, 2)], tma=tma)
    try:
        assert FM._use_tma(w13, w2, 16) == (tma and (INTERPRET or torch.cuda.get_device_capability()[0] >= 9))
        got = FM.fused_moe_triton(x, w13, w2, w, ids, path="grouped")
    finally:
        FM.TUNING.update(old)
    want = fused_moe_ref(x.float(), w13.float(), w2.float(), w, ids)
    torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3)


@needs_triton
def test_triton_bf16_within_rounding_of_reference():
    from kvpilot.kernels import fused_moe as FM

    x, w13, w2, w, ids = _problem(4, 4, 2, 32, 16, dtype=torch.bfloat16, seed=1)
    want = fused_moe_ref(x.float(), w13.float(), w2.float(), w, ids)
    got = FM.fused_moe_triton(x, w13, w2, w, ids, path="small")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=5e-2)


def test_dispatcher_torch_backend_is_the_reference():
    x, w13, w2, w, ids = _problem(5, 4, 2, 16, 8)
    torch.testing.assert_close(fused_moe(x, w13, w2, w, ids, backend="TORCH"), fused_moe_ref(x, w13, w2, w, ids))


@needs_triton
@pytest.mark.parametrize("path", ["small", "grouped"])
def test_choices_of_another_expert_parallel_rank_contribute_zero(path):
    """Ids of -1 (experts another rank holds): the kernels skip them and their rows add nothing."""
    from kvpilot.kernels import fused_moe as FM

    x, w13, w2, w, ids = _problem(5, 4, 2, 24, 16, seed=2)
    ids = torch.where(ids >= 2, ids - 2, -1)  # rank 1 of EP 2: experts 2, 3 as local 0, 1
    got = FM.fused_moe_triton(x, w13[:2], w2[:2], w, ids, path=path, partial=True)
    want = fused_moe_ref(x, w13[:2], w2[:2], w, ids)
    assert (ids == -1).any() and (ids >= 0).any()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
