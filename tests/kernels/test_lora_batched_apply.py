"""Batched LoRA: the Triton shrink/expand kernels (TRITON_INTERPRET=1 on CPU) match the PyTorch
per-segment reference and a plain per-token loop, for mixed slots including -1 (no adapter)."""

import pytest
import torch

from kvpilot.kernels import lora as KL


def _per_token(x, out, a, b, slot):
    want = out.clone().float()
    for t, s in enumerate(slot.tolist()):
        if s >= 0:
            want[t] += (x[t].float() @ a[s].float().t()) @ b[s].float().t()
    return want.to(out.dtype)


def _case(T, K, N, S, R, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(dtype)
    out = torch.randn(T, N, generator=g).to(dtype)
    a = torch.randn(S, R, K, generator=g).to(dtype)
    b = torch.randn(S, N, R, generator=g).to(dtype)
    slot = torch.randint(-1, S, (T,), generator=g, dtype=torch.int32)
    return x, out, a, b, slot


@pytest.mark.parametrize("T,K,N,S,R", [(7, 24, 40, 3, 6), (5, 130, 20, 2, 48), (1, 16, 300, 4, 8)])
def test_reference_matches_per_token_loop(T, K, N, S, R):
    x, out, a, b, slot = _case(T, K, N, S, R)
    want = _per_token(x, out, a, b, slot)
    got = KL.lora_apply_ref(x, out.clone(), a, b, slot)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("T,K,N,S,R", [(7, 24, 40, 3, 6), (5, 130, 20, 2, 48), (3, 16, 150, 4, 8)])
def test_triton_matches_reference(T, K, N, S, R):
    pytest.importorskip("triton")
    x, out, a, b, slot = _case(T, K, N, S, R, seed=1)
    want = KL.lora_apply_ref(x, out.clone(), a, b, slot)
    got = KL.lora_apply_triton(x, out.clone(), a, b, slot)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_triton_leaves_rows_without_adapter_untouched_and_handles_all_none():
    pytest.importorskip("triton")
    x, out, a, b, _ = _case(4, 16, 12, 2, 4, seed=2)
    slot = torch.tensor([-1, 1, -1, 0], dtype=torch.int32)
    got = KL.lora_apply_triton(x, out.clone(), a, b, slot)
    assert torch.equal(got[0], out[0]) and torch.equal(got[2], out[2])
    assert not torch.allclose(got[1], out[1])
    none = torch.full((4,), -1, dtype=torch.int32)
    assert torch.equal(KL.lora_apply_triton(x, out.clone(), a, b, none), out)


def test_triton_bf16_rounds_once():
    pytest.importorskip("triton")
    x, out, a, b, slot = _case(6, 32, 24, 3, 8, seed=3, dtype=torch.bfloat16)
    want = KL.lora_apply_ref(x, out.clone(), a, b, slot)
    got = KL.lora_apply_triton(x, out.clone(), a, b, slot)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=2e-2)


def test_shape_mismatch_is_a_value_error():
    x, out, a, b, slot = _case(4, 16, 12, 2, 4)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        KL.lora_apply_ref(x, out, a[:, :, :8], b, slot)


def test_tiles_group_tokens_by_slot_in_order():
    t = KL.lora_tiles([1, -1, 0, 1, 1, 0, -1, 1], torch.device("cpu"), block_m=2)
    assert t.order.tolist() == [2, 5, 0, 3, 4, 7]
    assert t.tiles.tolist() == [[0, 2, 0], [2, 2, 1], [4, 2, 1]]
    none = KL.lora_tiles([-1, -1], torch.device("cpu"))
    assert none.num_tiles == 0


def test_triton_prefill_chunks_span_several_tiles():
    """Two 20-token chunks of two adapters between decode tokens: tiles of 16 split each chunk."""
    pytest.importorskip("triton")
    x, out, a, b, _ = _case(45, 24, 36, 3, 8, seed=4)
    slot = torch.tensor([2] * 20 + [-1, 0, 1] + [0] * 20 + [-1, 2], dtype=torch.int32)
    tiles = KL.lora_tiles(slot.tolist(), x.device)
    assert tiles.num_tiles == 5  # slots 0 and 2: 21 tokens each (2 tiles each), slot 1: one token
    want = _per_token(x, out, a, b, slot)
    got = KL.lora_apply_triton(x, out.clone(), a, b, slot, tiles=tiles)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
