"""Batched sampling: logits processors, then greedy or seeded random choice, for all rows at once.

Order of the transforms (Hugging Face `generate`'s order, so each can be checked against its
logits processors): forbidden tokens (``min_tokens``, ``bad_words``, ``allowed_token_ids``), logit
bias, repetition penalty (HF: over prompt and output tokens; positive logits divided, negative
multiplied), frequency/presence penalties (OpenAI: output tokens only,
``logit -= frequency * count + presence * (count > 0)``), then temperature, top-k, top-p, min-p.
Every transform is one tensor operation over the whole batch: ragged per-row lists (token ids,
biases) become padded index tensors whose padding points at an extra scratch column.

Randomness is a counter-based hash of (request seed, output position, token id) turned into Gumbel
noise, so a row's draw never depends on what else is in the batch (same seed, same text), and no
per-row generator state has to live anywhere: ``argmax(logits / T + Gumbel)`` samples from
``softmax(logits / T)`` (the Gumbel-max trick). Because the noise of a token depends only on its
id, the draw can be made among a short candidate list (the top-k, or the vocabulary sorted once for
top-p) with the same result as over the whole vocabulary.

Log-probabilities are taken from the unmodified distribution (``log_softmax`` of the raw logits),
as vLLM's default and OpenAI's API do, so top-p/top-k never shrink the ``logprobs`` lists.
"""

from __future__ import annotations

import functools
import itertools
import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

logger = logging.getLogger(__name__)

_M32 = 0xFFFFFFFF
# Rows whose top_k is at most this take their candidates from torch.topk instead of a full sort.
_TOPK_CANDIDATES_MAX = 1024


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
    # Penalty history as device tensors, kept across steps when the engine reuses the row of a
    # sequence (its output only grows): prompt ids once, output ids appended as they come.
    _prompt_t: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    _out_t: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)

    def history(self, dev: torch.device) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """(prompt ids, output ids) as int64 tensors on ``dev``, updated with the new output ids."""
        if self._out_t is not None and self._out_t.device != dev:
            # Logits can arrive on another device than last step (the multi-process executor
            # returns large batches through a pipe, on the CPU): rebuild there.
            self._prompt_t = self._out_t = None
        if self._prompt_t is None and self.prompt_token_ids is not None:
            self._prompt_t = torch.tensor(self.prompt_token_ids, dtype=torch.int64).to(dev, non_blocking=True)
        have = 0 if self._out_t is None else self._out_t.numel()
        if self._out_t is None or have > len(self.output_token_ids):
            self._out_t = torch.tensor(self.output_token_ids, dtype=torch.int64).to(dev, non_blocking=True)
        elif have < len(self.output_token_ids):
            new = torch.tensor(self.output_token_ids[have:], dtype=torch.int64).to(dev, non_blocking=True)
            self._out_t = torch.cat([self._out_t, new])
        return self._prompt_t, self._out_t

    @property
    def needs_processing(self) -> bool:
        return bool(self.allowed_token_ids is not None or self.banned_token_ids or self.bad_word_seqs
                    or self.logit_bias or self.repetition_penalty != 1.0 or self.frequency_penalty
                    or self.presence_penalty)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[Optional[float]]  # log-probability of each chosen token (raw distribution)
    top_logprobs: list[Optional[tuple[list[int], list[float], int]]]  # (ids, logprobs, chosen rank)


# ---- counter-based random numbers --------------------------------------------------------------
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


def _row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row from (seed, step): [rows] int64 in [0, 2**32)."""
    s = seeds.to(torch.int64)
    lo, hi = s & _M32, (s >> 32) & _M32
    return _hash32(_hash32(lo) ^ _mul32(steps.to(torch.int64) & _M32, 0x9E3779B1) ^ _hash32(hi ^ 0x5BD1E995))


def _gumbel_from_keys(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) float32 for each (row key, token id); keys [rows], token_ids [rows or 1, K]."""
    bits = _hash32((keys[:, None] + _mul32(token_ids.to(torch.int64), 0x85EBCA77)) & _M32)
    u = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # uniform in (0, 1)
    return -torch.log(-torch.log(u))


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int,
                 token_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Gumbel(0, 1) noise, a pure function of (seed, step, token id); float32.

    Args:
        seeds: [rows] int64 (any 64-bit value); steps: [rows] int64 >= 0.
        vocab_size: V; the result is ``[rows, V]`` (noise of token ids 0..V-1) unless ``token_ids``.
        token_ids: optional [rows, K] int64: the result is ``[rows, K]``, the noise of those ids
            (equal to the matching columns of the full ``[rows, V]`` noise).
    On CUDA the full-vocabulary case runs as one Triton kernel (same bits as the PyTorch version).
    """
    keys = _row_keys(seeds, steps)
    if token_ids is None:
        return _full_noise(keys, vocab_size)
    return _gumbel_from_keys(keys, token_ids)


@functools.lru_cache(maxsize=None)
def _triton_gumbel():
    """The full-vocabulary noise as a Triton kernel (uint32 arithmetic wraps natively), or None."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def _kernel(keys_ptr, out_ptr, V, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        key = tl.load(keys_ptr + row).to(tl.uint32)
        x = key + cols.to(tl.uint32) * 0x85EBCA77
        # lowbias32, as _hash32 (the interpreter does not resolve helper functions from a closure)
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        bits = x ^ (x >> 16)
        u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        g = -tl.log(-tl.log(u))
        tl.store(out_ptr + row.to(tl.int64) * V + cols, g, mask=cols < V)

    def run(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
        out = torch.empty(keys.shape[0], vocab_size, device=keys.device, dtype=torch.float32)
        if keys.shape[0]:
            block = 1024
            _kernel[(keys.shape[0], triton.cdiv(vocab_size, block))](keys, out, vocab_size, BLOCK=block)
        return out

    return run


# ---- logits processors -------------------------------------------------------------------------
def _padded(lists: list[list[int]], vocab_size: int, dev: torch.device) -> torch.Tensor:
    """[rows, max_len] int64 of the ragged lists; padding and ids outside [0, V) become V."""
    lens = [len(x) for x in lists]
    width = max(max(lens, default=0), 1)
    out = torch.full((len(lists), width), vocab_size, dtype=torch.int64)
    flat = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.int64)
    if flat.numel():
        out[torch.arange(width)[None, :] < torch.tensor(lens)[:, None]] = flat
        out.masked_fill_((out < 0) | (out > vocab_size), vocab_size)
    return out.to(dev, non_blocking=True)


def _bad_word_bans(r: SamplingRow) -> list[int]:
    out = list(r.banned_token_ids)
    for seq in r.bad_word_seqs:
        prefix = seq[:-1]
        if not prefix or r.output_token_ids[-len(prefix):] == prefix:
            out.append(seq[-1])
    return out


def apply_penalties_and_masks(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Forbidden tokens, logit bias and repetition/frequency/presence penalties, in place on [S, V].

    Token ids >= V are ignored. Each kind is one scatter over the batch (padding hits column V of a
    [S, V + 1] scratch tensor, which is dropped).
    """
    S, V = logits.shape
    dev = logits.device

    def clip(ids):
        return [t for t in ids if 0 <= t < V]

    allowed = [r.allowed_token_ids is not None for r in rows]
    if any(allowed):
        ids = _padded([r.allowed_token_ids if a else [] for r, a in zip(rows, allowed)], V, dev)
        keep = torch.zeros(S, V + 1, dtype=torch.bool, device=dev).scatter_(1, ids, True)[:, :V]
        keep |= ~torch.tensor(allowed, device=dev)[:, None]
        logits.masked_fill_(~keep, float("-inf"))
    banned = [_bad_word_bans(r) for r in rows]
    if any(banned):
        mask = torch.zeros(S, V + 1, dtype=torch.bool, device=dev).scatter_(1, _padded(banned, V, dev), True)
        logits.masked_fill_(mask[:, :V], float("-inf"))
    if any(r.logit_bias for r in rows):
        keys = [clip(r.logit_bias or {}) for r in rows]
        vals = torch.zeros(S, max(max(len(k) for k in keys), 1), dtype=logits.dtype)
        for i, (r, k) in enumerate(zip(rows, keys)):
            if k:
                vals[i, :len(k)] = torch.tensor([r.logit_bias[t] for t in k], dtype=logits.dtype)
        bias = torch.zeros(S, V + 1, dtype=logits.dtype, device=dev)
        bias.scatter_add_(1, _padded(keys, V, dev), vals.to(dev))
        logits += bias[:, :V]
    pen_rows = [i for i, r in enumerate(rows)
                if r.repetition_penalty != 1.0 or r.frequency_penalty or r.presence_penalty]
    if pen_rows:
        _apply_history_penalties(logits, rows, pen_rows)
    return logits


def _apply_history_penalties(logits: torch.Tensor, rows: list[SamplingRow], idx: list[int]) -> None:
    """Repetition (HF: over prompt and output) and frequency/presence (OpenAI: output only) penalties.

    Sparse: only the (row, token) pairs of the rows' histories are touched, through flat indices
    ``row * V + token`` into ``logits`` ([S, V], modified in place); no [S, V] temporaries.
    """
    S, V = logits.shape
    dev = logits.device
    if not logits.is_contiguous():
        raise ValueError("penalties are applied in place through a flat view: logits must be contiguous")
    flat = logits.view(-1)
    prompts, outs = zip(*(rows[i].history(dev) for i in idx))

    def keys(tensors) -> torch.Tensor:
        lens = torch.tensor([0 if t is None else t.numel() for t in tensors], device=dev)
        ids = torch.cat([t for t in tensors if t is not None] or [torch.empty(0, dtype=torch.int64, device=dev)])
        row = torch.repeat_interleave(torch.tensor(idx, device=dev), lens)
        ok = (ids >= 0) & (ids < V)
        return (row * V + ids)[ok]

    out_keys = keys(outs)
    rep = [rows[i].repetition_penalty for i in idx]
    if any(p != 1.0 for p in rep):
        seen = torch.unique(torch.cat([keys([p if rows[i].repetition_penalty != 1.0 else None
                                             for i, p in zip(idx, prompts)]), out_keys]))
        pen = torch.tensor([r.repetition_penalty for r in rows], dtype=logits.dtype, device=dev)[seen // V]
        vals = flat[seen]
        flat[seen] = torch.where(vals > 0, vals / pen, vals * pen)
    if out_keys.numel() and any(rows[i].frequency_penalty or rows[i].presence_penalty for i in idx):
        uniq, counts = torch.unique(out_keys, return_counts=True)
        r = uniq // V
        freq = torch.tensor([x.frequency_penalty for x in rows], dtype=logits.dtype, device=dev)[r]
        pres = torch.tensor([x.presence_penalty for x in rows], dtype=logits.dtype, device=dev)[r]
        flat.index_add_(0, uniq, -(freq * counts.to(logits.dtype) + pres))


def mask_sorted_candidates(values: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                           min_p: torch.Tensor, full_lse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Top-k, top-p and min-p on candidates sorted in descending order; returns masked ``values``.

    Args:
        values: [S, K] float32 logits already divided by the temperature, each row sorted
            descending (the K best of the row's vocabulary, K >= every row's top_k).
        top_k: [S] int64 (<= 0 = off); top_p: [S] float32 (1 = off); min_p: [S] float32 (0 = off).
        full_lse: [S] logsumexp of each row's whole vocabulary, needed when K < V for rows whose
            top_k is off or above K (their top-p probabilities are relative to the whole row).
    Semantics of Hugging Face's TopK/TopP/MinP logits warpers, applied in that order: top-p keeps
    the smallest prefix whose probability reaches ``top_p`` (a token is dropped when the mass
    strictly above it already reaches ``top_p``), min-p drops tokens whose probability is below
    ``min_p`` times the largest; the best token always survives. Ties at the k-th value are cut by
    sort order (HF keeps every token equal to the k-th value).
    """
    K = values.shape[1]
    rank = torch.arange(K, device=values.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, K))[:, None]
    values = values.masked_fill(rank >= k, float("-inf"))
    lse = torch.logsumexp(values, dim=-1)
    if full_lse is not None:
        lse = torch.where((top_k > 0) & (top_k <= K), lse, full_lse)
    probs = torch.exp(values - lse[:, None])
    mass_above = probs.cumsum(dim=-1) - probs
    # top_p == 1 must keep everything even where rounding lets the cumulative mass reach 1 early.
    drop = (mass_above >= top_p[:, None]) & (rank > 0) & (top_p[:, None] < 1.0)
    values = values.masked_fill(drop, float("-inf"))
    # probs_i < min_p * probs_max  <=>  logit_i < logit_max + log(min_p); the max is column 0.
    thresh = values[:, :1] + torch.log(min_p.clamp(min=1e-30))[:, None]
    return values.masked_fill((values < thresh) & (min_p[:, None] > 0), float("-inf"))


def top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      min_p: torch.Tensor) -> torch.Tensor:
    """Mask ([S, V] float32, already divided by temperature) to -inf outside top-k, top-p, min-p.

    Full-vocabulary form of `mask_sorted_candidates` (same arguments and semantics), for callers
    and tests that want the masked logits in vocabulary order.
    """
    values, order = torch.sort(logits, dim=-1, descending=True)
    masked = mask_sorted_candidates(values, top_k, top_p, min_p)
    return torch.empty_like(logits).scatter_(1, order, masked)


# ---- the sampler ----------------------------------------------------------------------------
class Sampler:
    """Chooses the next token of every row of a ``[S, V]`` float32 logits matrix.

    Greedy rows (temperature 0) take the arg-max of the processed logits; the others draw by
    Gumbel-max (see `_sample` for how the candidates are chosen). Raises ValueError when the
    number of rows and of logits rows differ.
    """

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        S, V = logits.shape
        dev = logits.device
        if S != len(rows):
            raise ValueError(f"got {S} logits rows for {len(rows)} sampling rows")
        lp_rows = [i for i, r in enumerate(rows) if r.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[lp_rows].float(), dim=-1) if lp_rows else None
        if any(r.needs_processing for r in rows):
            logits = apply_penalties_and_masks(logits.clone(), rows)
        chosen = logits.argmax(dim=-1)
        rand = [i for i, r in enumerate(rows) if r.temperature != 0.0]
        if rand:
            sampled = self._sample(logits[rand] if len(rand) < S else logits, [rows[i] for i in rand])
            if len(rand) < S:
                chosen[torch.tensor(rand, device=dev)] = sampled
            else:
                chosen = sampled
        token_ids = chosen.tolist()
        logprobs: list[Optional[float]] = [None] * S
        top: list[Optional[tuple[list[int], list[float], int]]] = [None] * S
        if raw_logprobs is not None:
            sel_chosen = torch.tensor([token_ids[i] for i in lp_rows], device=dev)[:, None]
            chosen_lp = raw_logprobs.gather(1, sel_chosen)
            ranks = ((raw_logprobs > chosen_lp).sum(dim=-1) + 1).tolist()
            kmax = max(rows[i].logprobs for i in lp_rows)
            if kmax > 0:
                top_vals, top_ids = raw_logprobs.topk(min(kmax, V), dim=-1)
                top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
            else:
                top_vals = top_ids = [[] for _ in lp_rows]
            chosen_lp = chosen_lp.squeeze(1).tolist()
            for j, i in enumerate(lp_rows):
                k = rows[i].logprobs
                logprobs[i] = chosen_lp[j]
                top[i] = (top_ids[j][:k], top_vals[j][:k], ranks[j])
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=top)

    @staticmethod
    def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Seeded Gumbel-max draw for rows that all have temperature > 0; [S] int64.

        Rows without top-k/top-p/min-p add noise to the whole vocabulary (no sort). Filtered rows
        first try the best ``_TOPK_CANDIDATES_MAX`` tokens (one ``topk``): that is exact for a row
        whose kept set provably lies inside them (its top_k fits, or those candidates already hold
        ``top_p`` of the mass, or the last candidate is below the min-p threshold); the other
        filtered rows (rare: flat distributions) sort their whole vocabulary.
        """
        S, V = logits.shape
        dev = logits.device
        # Per-row scalars travel in two host->device copies; the row keys are hashed on the host.
        fl = torch.tensor([[r.temperature, r.top_p, r.min_p] for r in rows], dtype=torch.float32)
        ks = [r.top_k if r.top_k > 0 else 0 for r in rows]
        keys = _row_keys(torch.tensor([r.seed for r in rows], dtype=torch.int64),
                         torch.tensor([r.step for r in rows], dtype=torch.int64))
        ints = torch.stack([torch.tensor(ks, dtype=torch.int64), keys], dim=1)
        fl, ints = fl.to(dev, non_blocking=True), ints.to(dev, non_blocking=True)
        temps, top_p, min_p = fl[:, 0], fl[:, 1], fl[:, 2]
        top_k, keys = ints[:, 0], ints[:, 1]
        scaled = logits.float() / temps[:, None]
        filt = [k > 0 or r.top_p < 1.0 or r.min_p > 0.0 for k, r in zip(ks, rows)]
        out = torch.empty(S, dtype=torch.int64, device=dev)
        plain = [i for i in range(S) if not filt[i]]
        if plain:
            sel = plain if len(plain) < S else slice(None)
            out[sel] = (scaled[sel] + _full_noise(keys[sel], V)).argmax(dim=-1)
        if len(plain) == S:
            return out
        f_idx = [i for i in range(S) if filt[i]]
        f_sel = torch.tensor(f_idx, device=dev) if len(f_idx) < S else slice(None)
        x, fk, fp, fm, fkeys = scaled[f_sel], top_k[f_sel], top_p[f_sel], min_p[f_sel], keys[f_sel]
        f_ks = [ks[i] for i in f_idx]
        kc = min(V, max(f_ks) if all(0 < k <= _TOPK_CANDIDATES_MAX for k in f_ks) else _TOPK_CANDIDATES_MAX)
        values, cand = x.topk(kc, dim=-1)
        full_lse = None
        if kc < V and not all(0 < k <= kc for k in f_ks):
            full_lse = torch.logsumexp(x, dim=-1)
            mass = torch.exp(torch.logsumexp(values, dim=-1) - full_lse)
            covered = (((fk > 0) & (fk <= kc)) | ((fp < 1.0) & (mass >= fp))
                       | ((fm > 0) & (values[:, -1] < values[:, 0] + torch.log(fm.clamp(min=1e-30)))))
            if not bool(covered.all()):  # rare: sort these rows' whole vocabulary
                full_rows = (~covered).nonzero().squeeze(1)
                fv, fc = torch.sort(x[full_rows], dim=-1, descending=True)
                fv = mask_sorted_candidates(fv, fk[full_rows], fp[full_rows], fm[full_rows])
                noise = _full_noise(fkeys[full_rows], V).gather(1, fc)
                picked_full = fc.gather(1, (fv + noise).argmax(dim=-1, keepdim=True)).squeeze(1)
        values = mask_sorted_candidates(values, fk, fp, fm, full_lse)
        noise = _gumbel_from_keys(fkeys, cand)
        picked = cand.gather(1, (values + noise).argmax(dim=-1, keepdim=True)).squeeze(1)
        if kc < V and not all(0 < k <= kc for k in f_ks) and not bool(covered.all()):
            picked[full_rows] = picked_full
        out[f_sel] = picked
        return out


def _full_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel noise [rows, V] for row keys (Triton on CUDA, PyTorch elsewhere)."""
    if keys.is_cuda and _triton_gumbel() is not None:
        return _triton_gumbel()(keys, vocab_size)
    return _gumbel_from_keys(keys, torch.arange(vocab_size, device=keys.device, dtype=torch.int64)[None, :])
