"""Verification of drafted tokens: speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023).

For a sequence with drafts ``d_1..d_k`` and the target's distributions ``p_1..p_{k+1}`` at those
positions (``p_j`` is the target's distribution of the token at the position of ``d_j``; ``p_{k+1}``
the one after the last draft), and the draft's distributions ``q_j`` that drew them:

- ``d_j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``, in order, until the first
  rejection;
- at the first rejected position ``j`` the token is drawn from ``norm(max(0, p_j - q_j))``;
- if every draft is accepted, a bonus token is drawn from ``p_{k+1}``.

Each emitted token is then distributed exactly as the target's sampler would draw it. A
deterministic draft (n-gram lookup, a greedy draft model) has ``q_j`` = a point mass at ``d_j``: the
acceptance probability is ``p_j(d_j)`` and the residual is ``p_j`` without ``d_j``. A greedy request
has a point-mass ``p_j`` at the arg-max (the lowest id among equal maxima, as the sampler picks), so
it accepts exactly the longest prefix of drafts equal to the target's arg-max and then emits the
arg-max: the greedy output without speculation.

``p_j`` is the target sampler's distribution: ``softmax`` of the logits divided by the temperature
after top-k, top-p and min-p (`kvpilot.sampling.sampler.top_k_top_p_min_p`, the sampler's exact
semantics). Randomness is counter-based (`kvpilot.sampling.sampler`'s hash of seed, output position
and token id): the uniform of the acceptance test and the Gumbel noise of the residual / bonus draws
at output position ``t`` are functions of (request seed, ``t``) only, so a request's tokens do not
depend on what else is in the batch. The bonus and residual draws use the sampler's own noise for
that position; the acceptance uniforms and the draft model's own draws use keys salted apart from
it (independent streams, as the proof of exactness requires).
"""

from __future__ import annotations

from typing import Optional

import torch

from kvpilot.sampling.sampler import _gumbel_from_keys, _hash32, _row_keys, top_k_top_p_min_p

ACCEPT_SALT = 0x5EC0DEC1
"""XORed into the seed for the acceptance uniforms."""
DRAFT_SALT = 0x0D4AF7ED
"""XORed into the seed for a draft model's own draws."""


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor) -> torch.Tensor:
    """The sampler's distribution of each row: [N, V] float32, rows summing to 1.

    Args:
        logits: [N, V] raw logits (any float dtype).
        temperature: [N] float32; a row with temperature <= 0 is greedy and gets a point mass at its
            arg-max (the first maximum).
        top_k: [N] int64 (<= 0 off); top_p: [N] float32 (1 off); min_p: [N] float32 (0 off).
    """
    x = logits.float()
    N, V = x.shape
    out = torch.zeros(N, V, dtype=torch.float32, device=x.device)
    greedy = temperature <= 0
    if greedy.any():
        g = torch.nonzero(greedy).squeeze(1)
        out[g, x[g].argmax(dim=-1)] = 1.0
    s = torch.nonzero(~greedy).squeeze(1)
    if s.numel():
        z = x[s] / temperature[s, None]
        filt = (top_k[s] > 0) | (top_p[s] < 1) | (min_p[s] > 0)
        if bool(filt.any()):
            z = torch.where(filt[:, None], top_k_top_p_min_p(z, top_k[s].clamp(min=0), top_p[s], min_p[s]), z)
        out[s] = torch.softmax(z, dim=-1)
    return out


def uniforms(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Uniform(0, 1) float64 per (seed, output position): [N], the acceptance test's randomness."""
    keys = _row_keys(seeds ^ ACCEPT_SALT, steps)
    bits = _hash32((keys + 0x27D4EB2F) & 0xFFFFFFFF)
    bits2 = _hash32(bits ^ 0x165667B1)
    u = ((bits >> 8).to(torch.float64) * float(1 << 24) + (bits2 >> 8).to(torch.float64) + 0.5)
    return u / float(1 << 48)


def sample_from(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, salt: int = 0) -> torch.Tensor:
    """One token per row drawn from ``probs`` ([N, V], rows need not be normalised) by Gumbel-max with
    the sampler's noise for (seed ^ salt, output position): [N] int64. A row without positive mass
    returns its arg-max (token 0 when all are zero)."""
    N, V = probs.shape
    keys = _row_keys(seeds ^ salt if salt else seeds, steps)
    g = _gumbel_from_keys(keys, torch.arange(V, device=probs.device, dtype=torch.int64)[None, :])
    y = torch.where(probs > 0, torch.log(probs.clamp(min=1e-38)) + g, float("-inf"))
    tok = y.argmax(dim=-1)
    empty = ~(probs > 0).any(dim=-1)
    if bool(empty.any()):
        tok = torch.where(empty, probs.argmax(dim=-1), tok)
    return tok


def verify(p: torch.Tensor, drafts: list[list[int]], q: Optional[list[Optional[torch.Tensor]]],
           seeds: list[int], first_steps: list[int]) -> list[list[int]]:
    """Rejection-sample each sequence's drafts; returns the emitted tokens of each (accepted drafts,
    then one corrected or bonus token: between 1 and ``len(drafts[i]) + 1`` tokens).

    Args:
        p: [sum(len(d) + 1), V] float32, the target distributions (`target_probs`), sequence after
            sequence: ``len(drafts[i]) + 1`` rows for sequence ``i`` (one per draft, then the bonus).
        drafts: the drafted ids of each sequence (may be empty: then only a token drawn from its
            single row).
        q: per sequence None (point-mass drafts) or [len(drafts[i]), V] float32 draft distributions
            (each draft was drawn from its row); None for all point masses.
        seeds: each sequence's seed; first_steps: the output position of each sequence's first
            emitted token (draft j is at ``first_steps[i] + j``).
    """
    dev = p.device
    V = p.shape[1]
    n = [len(d) for d in drafts]
    S = len(drafts)
    offs = [0] * (S + 1)  # first row of p of each sequence
    doffs = [0] * (S + 1)  # first draft of each sequence in the flat draft list
    for i in range(S):
        offs[i + 1] = offs[i] + n[i] + 1
        doffs[i + 1] = doffs[i] + n[i]
    counts = torch.tensor([k + 1 for k in n], device=dev)
    row_seed = torch.repeat_interleave(torch.tensor(seeds, dtype=torch.int64, device=dev), counts)
    row_step = (torch.repeat_interleave(torch.tensor(first_steps, dtype=torch.int64, device=dev), counts)
                + torch.arange(offs[-1], device=dev)
                - torch.repeat_interleave(torch.tensor(offs[:-1], dtype=torch.int64, device=dev), counts))
    flat = [t for d in drafts for t in d]
    D = len(flat)
    if D:
        d_t = torch.tensor(flat, dtype=torch.int64, device=dev)
        draft_rows = torch.tensor([offs[i] + j for i in range(S) for j in range(n[i])], dtype=torch.int64, device=dev)
        # The draft distribution of every draft: q's rows, or a point mass at the draft.
        qflat = torch.zeros(D, V, dtype=torch.float32, device=dev)
        qflat[torch.arange(D, device=dev), d_t] = 1.0
        if q is not None:
            for i, x in enumerate(q):
                if x is not None and n[i]:
                    qflat[doffs[i]:doffs[i + 1]] = x[:n[i]].float()
        p_d = p[draft_rows, d_t].double()
        q_d = qflat[torch.arange(D, device=dev), d_t].double()
        u = uniforms(row_seed[draft_rows], row_step[draft_rows])
        accept = (u * q_d < p_d).tolist()
    else:
        accept = []
    out: list[list[int]] = []
    draw_rows: list[int] = []
    resid: list[int] = []  # per drawn row: its rejected draft's index in the flat list, or -1 (bonus)
    for i in range(S):
        a = doffs[i]
        k = 0
        while k < n[i] and accept[a + k]:
            k += 1
        out.append(list(drafts[i][:k]))
        draw_rows.append(offs[i] + k)
        resid.append(a + k if k < n[i] else -1)
    rows_t = torch.tensor(draw_rows, dtype=torch.int64, device=dev)
    probs = p[rows_t].float()
    if D:
        r_t = torch.tensor(resid, dtype=torch.int64, device=dev)
        has = r_t >= 0
        sub = torch.where(has[:, None], qflat[r_t.clamp(min=0)], torch.zeros_like(probs))
        res = (probs - sub).clamp(min=0)
        ok = (res > 0).any(dim=-1)  # else p == q up to rounding: p itself
        probs = torch.where(ok[:, None], res, probs)
    toks = sample_from(probs, row_seed[rows_t], row_step[rows_t]).tolist()
    for i in range(S):
        out[i].append(int(toks[i]))
    return out
