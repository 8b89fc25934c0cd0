"""Speculative rejection sampling keeps the target's distribution: chi-square over a small vocabulary."""

from __future__ import annotations

import torch

from kvpilot.spec_decode.rejection import sample_from, target_probs, uniforms, verify

V = 6
N = 12000
# df = 5: P(chi2 > 25.7) = 1e-4, so a correct sampler fails this with fixed seeds essentially never,
# while one that keeps the draft's distribution (or forgets the residual) is off by thousands.
CHI2_LIMIT = 25.7


def _chi2(tokens: list[int], p: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=V).double()
    expected = p.double() * len(tokens)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _draw_drafts(q: torch.Tensor, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.multinomial(q, n, replacement=True, generator=g).tolist()


def test_first_and_second_tokens_follow_target_with_draft_distributions():
    p1 = torch.tensor([0.05, 0.40, 0.10, 0.25, 0.20, 0.00])
    p2 = torch.tensor([0.30, 0.05, 0.05, 0.10, 0.20, 0.30])
    p3 = torch.tensor([0.10, 0.10, 0.10, 0.10, 0.10, 0.50])  # the bonus row
    q1 = torch.tensor([0.30, 0.10, 0.30, 0.10, 0.10, 0.10])  # far from p1: many rejections
    q2 = torch.tensor([0.25, 0.10, 0.10, 0.10, 0.20, 0.25])
    d1, d2 = _draw_drafts(q1, N, 1), _draw_drafts(q2, N, 2)
    p = torch.stack([p1, p2, p3]).repeat(N, 1)
    q = [torch.stack([q1, q2])] * N
    out = verify(p, [[a, b] for a, b in zip(d1, d2)], q, seeds=list(range(N)), first_steps=[7] * N)
    assert all(1 <= len(o) <= 3 for o in out)
    assert _chi2([o[0] for o in out], p1) < CHI2_LIMIT
    second = [o[1] for o in out if len(o) >= 2]
    assert len(second) > N // 3
    assert _chi2(second, p2) < CHI2_LIMIT
    third = [o[2] for o in out if len(o) == 3]
    assert _chi2(third, p3) < CHI2_LIMIT
    # Accepted drafts are a prefix: a row that emitted 2+ tokens kept its first draft.
    assert all(o[0] == a for o, a in zip(out, d1) if len(o) >= 2)
    # The acceptance rate of draft 1 is sum(min(p, q)) (Leviathan et al., Theorem 3.5).
    rate = sum(len(o) >= 2 for o in out) / N
    assert abs(rate - float(torch.minimum(p1, q1).sum())) < 0.02


def test_point_mass_drafts_follow_target():
    """An n-gram draft is a point mass: accepted with probability p(d), else drawn from p without d."""
    p1 = torch.tensor([0.10, 0.50, 0.15, 0.05, 0.20, 0.00])
    p2 = torch.tensor([0.20, 0.20, 0.20, 0.20, 0.10, 0.10])
    drafts = [[1, 4]] * (N // 2) + [[5, 0]] * (N // 2)  # 5 has p1 = 0: never accepted
    p = torch.stack([p1, p2, p2]).repeat(N, 1)
    out = verify(p, drafts, None, seeds=[10 ** 6 + i for i in range(N)], first_steps=[0] * N)
    assert _chi2([o[0] for o in out[:N // 2]], p1) < CHI2_LIMIT
    assert _chi2([o[0] for o in out[N // 2:]], p1) < CHI2_LIMIT
    assert all(len(o) == 1 for o in out[N // 2:])
    assert abs(sum(len(o) > 1 for o in out[:N // 2]) / (N // 2) - 0.5) < 0.03


def test_greedy_accepts_longest_matching_prefix_then_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.0], [2.0, 0.0, 0.0, 5.0], [1.0, 1.0, 4.0, 0.0], [9.0, 0.0, 0.0, 0.0]])
    zero = torch.zeros(4)
    p = target_probs(logits, zero, zero.long(), torch.ones(4), zero)
    assert p.argmax(-1).tolist() == [1, 3, 2, 0] and (p.max(-1).values == 1).all()
    out = verify(p[[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]],
                 [[1, 3, 2], [1, 0, 2], [2, 3, 2]], None, seeds=[1, 2, 3], first_steps=[0, 0, 0])
    assert out == [[1, 3, 2, 0], [1, 3], [1]]


def test_randomness_is_a_function_of_seed_and_position():
    seeds = torch.tensor([5, 5, 6], dtype=torch.int64)
    steps = torch.tensor([3, 3, 3], dtype=torch.int64)
    u = uniforms(seeds, steps)
    assert u[0] == u[1] and u[0] != u[2] and ((u > 0) & (u < 1)).all()
    probs = torch.full((3, 50), 0.02)
    t = sample_from(probs, seeds, steps)
    assert t[0] == t[1]
    p = torch.tensor([[0.2, 0.3, 0.5]] * 4)
    a = verify(p, [[1], [1]], None, seeds=[42, 42], first_steps=[9, 9])
    assert a[0] == a[1]
