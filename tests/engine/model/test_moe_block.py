"""`SparseMoeBlock` on its own: per-expert checkpoint tensors stacked into ``w13`` / ``w2``, the
tensor-parallel split of every expert (the ranks' partial outputs sum to the whole block's output,
shared expert included), the backend switch, missing experts and bad layouts named in errors."""

from __future__ import annotations

import pytest
import torch

from kvpilot.model.layers import ParallelContext
from kvpilot.model.moe import SparseMoeBlock

H, I, E, SHARED = 16, 12, 5, 8


class _NoReduce(ParallelContext):
    """A tensor-parallel rank whose all-reduce is left to the test (it sums the ranks' outputs)."""

    def all_reduce(self, x, site=None):
        return x


def _checkpoint(seed=0):
    g = torch.Generator().manual_seed(seed)
    t = {"gate.weight": torch.randn(E, H, generator=g), "shared_expert_gate.weight": torch.randn(1, H, generator=g)}
    for e in range(E):
        t[f"experts.{e}.gate_proj.weight"] = torch.randn(I, H, generator=g) / 4
        t[f"experts.{e}.up_proj.weight"] = torch.randn(I, H, generator=g) / 4
        t[f"experts.{e}.down_proj.weight"] = torch.randn(H, I, generator=g) / 4
    t["shared_expert.gate_proj.weight"] = torch.randn(SHARED, H, generator=g) / 4
    t["shared_expert.up_proj.weight"] = torch.randn(SHARED, H, generator=g) / 4
    t["shared_expert.down_proj.weight"] = torch.randn(H, SHARED, generator=g) / 4
    return t


def _block(tensors, pc, backend="TORCH", skip=()):
    block = SparseMoeBlock(H, I, E, 2, False, pc, shared_intermediate_size=SHARED, backend=backend)
    params = dict(block.named_parameters())

    def put(name, value, index=None):
        (params[name] if index is None else params[name][index]).copy_(value)

    with torch.no_grad():
        for name, value in tensors.items():
            if name not in skip:
                assert block.load_checkpoint_tensor(name, value, put), name
    block.process_weights_after_loading()
    return block


def _want(t, x):
    """The block's value written out from the checkpoint tensors (transformers' Qwen2-MoE formula)."""
    probs = torch.softmax(x @ t["gate.weight"].T, -1)
    w, ids = torch.topk(probs, 2, -1)
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for k in range(2):
            e = int(ids[n, k])
            h = torch.nn.functional.silu(x[n] @ t[f"experts.{e}.gate_proj.weight"].T) * (x[n] @ t[f"experts.{e}.up_proj.weight"].T)
            out[n] += w[n, k] * (h @ t[f"experts.{e}.down_proj.weight"].T)
    s = torch.nn.functional.silu(x @ t["shared_expert.gate_proj.weight"].T) * (x @ t["shared_expert.up_proj.weight"].T)
    return out + torch.sigmoid(x @ t["shared_expert_gate.weight"].T) * (s @ t["shared_expert.down_proj.weight"].T)


@torch.no_grad()
def test_stacked_experts_compute_the_per_expert_formula():
    t = _checkpoint()
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(1))
    block = _block(t, ParallelContext())
    assert block.w13.shape == (E, 2 * I, H) and block.w2.shape == (E, H, I)
    torch.testing.assert_close(block.w13[3, I:], t["experts.3.up_proj.weight"])
    torch.testing.assert_close(block(x), _want(t, x), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_tensor_parallel_ranks_sum_to_the_whole_block():
    t = _checkpoint(2)
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(3))
    ranks = [_block(t, _NoReduce(tp_rank=r, tp_size=2)) for r in range(2)]
    assert ranks[0].w13.shape == (E, I, H) and ranks[1].w2.shape == (E, H, I // 2)
    torch.testing.assert_close(ranks[1].w13[2, : I // 2], t["experts.2.gate_proj.weight"][I // 2:])
    torch.testing.assert_close(ranks[0](x) + ranks[1](x), _want(t, x), atol=1e-5, rtol=1e-5)


def test_missing_expert_and_bad_layouts_are_named():
    t = _checkpoint()
    with pytest.raises(KeyError, match=r"experts\.4\.down_proj"):
        _block(t, ParallelContext(), skip={"experts.4.down_proj.weight"})
    with pytest.raises(ValueError, match="tensor_parallel_size 5 must divide moe_intermediate_size 12"):
        SparseMoeBlock(H, I, E, 2, False, ParallelContext(tp_size=5))
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in \[1, num_experts=5\]"):
        SparseMoeBlock(H, I, E, 6, False, ParallelContext())
    with pytest.raises(ValueError, match="'TRITON', 'TORCH'"):
        SparseMoeBlock(H, I, E, 2, False, ParallelContext(), backend="CUTLASS")
    block = SparseMoeBlock(H, I, E, 2, False, ParallelContext())
    assert not block.load_checkpoint_tensor("experts.0.w9.weight", None, None)
