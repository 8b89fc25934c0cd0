"""`SparseMoeBlock` on its own: per-expert checkpoint tensors stacked into ``w13`` / ``w2``, the
tensor- and expert-parallel splits (the ranks' partial outputs sum to the whole block's output,
shared expert included), the backend switch, missing experts and bad layouts named in errors."""

from __future__ import annotations

import pytest
import torch

from kvpilot.model.layers import ParallelContext
from kvpilot.model.moe import SparseMoeBlock

H, I, E, SHARED = 16, 12, 4, 8


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


def _block(tensors, pc, backend="TORCH", skip=(), ep=1):
    block = SparseMoeBlock(H, I, E, 2, False, pc, shared_intermediate_size=SHARED, backend=backend,
                           expert_parallel_size=ep)
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


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
@torch.no_grad()
def test_expert_parallel_ranks_sum_to_the_whole_block(backend):
    """TP 4 = 2 expert groups x 2 slices of each expert: rank r holds experts of group r % 2 and
    slice r // 2 of each; the four partial outputs sum to the block's."""
    t = _checkpoint(4)
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(5))
    ranks = [_block(t, _NoReduce(tp_rank=r, tp_size=4), backend=backend, ep=2) for r in range(4)]
    assert [(b.first_expert, b.local_experts, b.moe_tp_rank) for b in ranks] == [(0, 2, 0), (2, 2, 0), (0, 2, 1),
                                                                                 (2, 2, 1)]
    assert ranks[3].w13.shape == (2, I, H)
    torch.testing.assert_close(ranks[3].w2[1], t["experts.3.down_proj.weight"][:, I // 2:])
    torch.testing.assert_close(sum(b(x) for b in ranks), _want(t, x), atol=1e-5, rtol=1e-5)


def test_missing_expert_and_bad_layouts_are_named():
    t = _checkpoint()
    with pytest.raises(KeyError, match=r"experts\.3\.down_proj"):
        _block(t, ParallelContext(), skip={"experts.3.down_proj.weight"})
    with pytest.raises(KeyError, match=r"experts\.3\.down_proj"):  # rank 1 of EP 2 holds experts 2, 3
        _block(t, ParallelContext(tp_rank=1, tp_size=2), skip={"experts.3.down_proj.weight"}, ep=2)
    _block(t, ParallelContext(tp_rank=0, tp_size=2), skip={"experts.3.down_proj.weight"}, ep=2)  # not rank 0's
    with pytest.raises(ValueError, match=r"moe_tensor_parallel_size 5 \(tensor_parallel_size 5 / "
                                         r"moe_expert_parallel_size 1\) must divide the experts' intermediate size 12"):
        SparseMoeBlock(H, I, E, 2, False, ParallelContext(tp_size=5))
    with pytest.raises(ValueError, match="moe_expert_parallel_size 4 must divide tensor_parallel_size 6"):
        SparseMoeBlock(H, I, E, 2, False, ParallelContext(tp_size=6), expert_parallel_size=4)
    with pytest.raises(ValueError, match="moe_expert_parallel_size 8 must divide num_experts 4"):
        SparseMoeBlock(H, I, E, 2, False, ParallelContext(tp_size=8), expert_parallel_size=8)
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in \[1, num_experts=4\]"):
        SparseMoeBlock(H, I, E, 6, False, ParallelContext())
    with pytest.raises(ValueError, match="'TRITON', 'TORCH'"):
        SparseMoeBlock(H, I, E, 2, False, ParallelContext(), backend="CUTLASS")
    block = SparseMoeBlock(H, I, E, 2, False, ParallelContext())
    assert not block.load_checkpoint_tensor("experts.0.w9.weight", None, None)


@torch.no_grad()
def test_stacked_checkpoint_layout_loads_like_per_expert_tensors():
    """transformers 5 names the experts ``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj``
    [E, H, I]; rank 1 of TP 2 with EP 2 reads the same values from either layout."""
    t = _checkpoint(6)
    stacked = {k: v for k, v in t.items() if not k.startswith("experts.")}
    stacked["experts.gate_up_proj"] = torch.stack(
        [torch.cat([t[f"experts.{e}.gate_proj.weight"], t[f"experts.{e}.up_proj.weight"]]) for e in range(E)])
    stacked["experts.down_proj"] = torch.stack([t[f"experts.{e}.down_proj.weight"] for e in range(E)])
    for tp, ep in ((1, 1), (2, 1), (2, 2)):
        pc = ParallelContext(tp_rank=1 if tp > 1 else 0, tp_size=tp)
        a, b = _block(t, pc, ep=ep), _block(stacked, pc, ep=ep)
        assert torch.equal(a.w13, b.w13) and torch.equal(a.w2, b.w2)
