"""Batched sampling: logits processors, then greedy or seeded random choice, for all rows at once.

Order of the transforms (Hugging Face `generate`'s order, so each can be checked against its
logits processors): forbidden tokens (``min_tokens``, ``bad_words``, ``allowed_token_ids``), logit
bias, repetition penalty (HF: over prompt and output tokens; positive logits divided, negative
multiplied), frequency/presence penalties (OpenAI: output tokens only,
``logit -= frequency * count + presence * (count > 0)``), then temperature, top-k, top-p, min-p.

Randomness is a counter-based hash of (request seed, output position, token id) turned into Gumbel
noise, so a row's draw never depends on what else is in the batch (same seed, same text), and no
per-row generator state has to live anywhere: ``argmax(logits / T + Gumbel)`` samples from
``softmax(logits / T)`` (the Gumbel-max trick).

Log-probabilities are taken from the unmodified distribution (``log_softmax`` of the raw logits),
as vLLM's default and OpenAI's API do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

_M32 = 0xFFFFFFFF


@dataclass
class SamplingRow:
    """Plain per-row inputs of the sampler (one row = one sequence that samples this step)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    step: int = 0  # output position of the token being drawn
    logprobs: Optional[int] = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    prompt_token_ids: Optional[list[int]] = None  # only when repetition_penalty != 1
    output_token_ids: list[int] = field(default_factory=list)
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    banned_token_ids: list[int] = field(default_factory=list)
    bad_word_seqs: list[list[int]] = field(default_factory=list)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[Optional[float]]  # log-probability of each chosen token (raw distribution)
    top_logprobs: list[Optional[tuple[list[int], list[float], int]]]  # (ids, logprobs, chosen rank)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32), without int64 overflow."""
    lo = (x * (c & 0xFFFF)) & _M32
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (the "lowbias32" mixer), elementwise on int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise ``[rows, vocab]`` float32, a pure function of (seed, step, token id).

    Args:
        seeds: [rows] int64 (any 64-bit value); steps: [rows] int64 >= 0.
    """
    s = seeds.to(torch.int64)
    lo, hi = s & _M32, (s >> 32) & _M32
    base = _hash32(_hash32(lo) ^ _mul32(steps.to(torch.int64) & _M32, 0x9E3779B1) ^ _hash32(hi ^ 0x5BD1E995))
    idx = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _hash32((base[:, None] + _mul32(idx, 0x85EBCA77)[None, :]) & _M32)
    u = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # uniform in (0, 1)
    return -torch.log(-torch.log(u))


def apply_penalties_and_masks(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Forbidden tokens, logit bias and repetition/frequency/presence penalties, in place on [S, V]."""
    V = logits.shape[1]
    dev = logits.device
    for i, r in enumerate(rows):
        if r.allowed_token_ids is not None:
            keep = torch.full((V,), float("-inf"), device=dev)
            keep[torch.tensor([t for t in r.allowed_token_ids if t < V], device=dev, dtype=torch.long)] = 0.0
            logits[i] += keep
        banned = [t for t in r.banned_token_ids if t < V]
        for seq in r.bad_word_seqs:
            prefix = seq[:-1]
            if not prefix or r.output_token_ids[-len(prefix):] == prefix:
                banned.append(seq[-1])
        if banned:
            logits[i, torch.tensor(banned, device=dev, dtype=torch.long)] = float("-inf")
        if r.logit_bias:
            ids = torch.tensor([t for t in r.logit_bias if t < V], device=dev, dtype=torch.long)
            vals = torch.tensor([r.logit_bias[t] for t in r.logit_bias if t < V], device=dev, dtype=logits.dtype)
            logits[i, ids] += vals
        if r.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.prompt_token_ids or []) | set(r.output_token_ids)),
                                device=dev, dtype=torch.long)
            if seen.numel():
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / r.repetition_penalty, vals * r.repetition_penalty)
        if (r.frequency_penalty or r.presence_penalty) and r.output_token_ids:
            counts = torch.bincount(torch.tensor(r.output_token_ids, device=dev, dtype=torch.long), minlength=V)[:V]
            logits[i] -= r.frequency_penalty * counts + r.presence_penalty * (counts > 0)
    return logits


def top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      min_p: torch.Tensor) -> torch.Tensor:
    """Mask ([S, V] float32, already divided by temperature) to -inf outside top-k, top-p, min-p.

    top_k: [S] int64 (<= 0 = off); top_p: [S] float32 (1 = off); min_p: [S] float32 (0 = off).
    Semantics of Hugging Face's TopK/TopP/MinP logits warpers (top-p keeps the smallest set whose
    probability reaches ``top_p``; at least one token always survives).
    """
    V = logits.shape[1]
    if bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
        kth = torch.sort(logits, dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if bool((top_p < 1.0).any()):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cum <= (1.0 - top_p).unsqueeze(1)
        remove[:, -1] = False
        logits = logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        thresh = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    return logits


class Sampler:
    """Chooses the next token of every row of a ``[S, V]`` float32 logits matrix."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        S, V = logits.shape
        dev = logits.device
        want_logprobs = [r.logprobs is not None for r in rows]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        needs_processing = any(r.allowed_token_ids is not None or r.banned_token_ids or r.bad_word_seqs
                               or r.logit_bias or r.repetition_penalty != 1.0 or r.frequency_penalty
                               or r.presence_penalty for r in rows)
        if needs_processing:
            logits = apply_penalties_and_masks(logits.clone(), rows)
        temps = torch.tensor([r.temperature for r in rows], device=dev, dtype=torch.float32)
        greedy = temps == 0
        chosen = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            scaled = logits / torch.where(greedy, torch.ones_like(temps), temps).unsqueeze(1)
            scaled = top_k_top_p_min_p(
                scaled,
                torch.tensor([r.top_k for r in rows], device=dev, dtype=torch.int64),
                torch.tensor([r.top_p for r in rows], device=dev, dtype=torch.float32),
                torch.tensor([r.min_p for r in rows], device=dev, dtype=torch.float32),
            )
            noise = gumbel_noise(torch.tensor([r.seed for r in rows], device=dev, dtype=torch.int64),
                                 torch.tensor([r.step for r in rows], device=dev, dtype=torch.int64), V)
            sampled = (scaled + noise).argmax(dim=-1)
            chosen = torch.where(greedy, chosen, sampled)
        token_ids = chosen.tolist()
        logprobs: list[Optional[float]] = [None] * S
        top: list[Optional[tuple[list[int], list[float], int]]] = [None] * S
        if raw_logprobs is not None:
            idx = [i for i in range(S) if want_logprobs[i]]
            sel = raw_logprobs[idx]
            chosen_lp = sel.gather(1, chosen[idx].unsqueeze(1))
            ranks = ((sel > chosen_lp).sum(dim=-1) + 1).tolist()
            kmax = max(rows[i].logprobs for i in idx)
            top_vals, top_ids = (sel.topk(kmax, dim=-1) if kmax > 0 else (sel[:, :0], sel[:, :0].long()))
            top_vals, top_ids, chosen_lp = top_vals.tolist(), top_ids.tolist(), chosen_lp.squeeze(1).tolist()
            for j, i in enumerate(idx):
                k = rows[i].logprobs
                logprobs[i] = chosen_lp[j]
                top[i] = (top_ids[j][:k], top_vals[j][:k], ranks[j])
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=top)
