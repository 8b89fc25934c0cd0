"""Rotary position embeddings: the cos/sin tables of every ``rope_type`` the supported families use.

`rope_parameters` reads a Hugging Face config (the ``rope_parameters`` dict of transformers 5, per
layer type where a family has several, or the older ``rope_theta`` / ``rope_scaling`` /
``partial_rotary_factor`` / ``rope_local_base_freq`` keys). `build_cos_sin_cache` turns it into the
``[max_positions, rotary_dim]`` float32 table the kernels read: ``cos(p * inv_freq) * a`` in the
first half, ``sin(p * inv_freq) * a`` in the second, ``a`` the type's attention factor (1 except
yarn and longrope). Formulas follow transformers' ``modeling_rope_utils`` (the YaRN paper,
arXiv:2309.00071; Llama 3.1's frequency-dependent scaling; Phi-3's LongRoPE, arXiv:2402.13753):

- ``default``: ``inv_freq[i] = theta ** (-2i / d)`` over the rotary dimension ``d``.
- ``linear``: ``inv_freq / factor``.
- ``llama3``: per-frequency interpolation between ``inv_freq / factor`` and ``inv_freq``.
- ``yarn``: ramp between interpolated and extrapolated frequencies; ``a`` from ``mscale``.
- ``dynamic`` (NTK): transformers recomputes the base for each sequence longer than
  ``max_position_embeddings``. A static table cannot follow a per-sequence base, so positions within
  ``max_position_embeddings`` use the unscaled base (exactly transformers' values for sequences that
  fit) and an engine whose ``max_positions`` exceeds it uses the base transformers computes for a
  sequence of ``max_positions`` tokens, for every row (vLLM's choice).
- ``longrope``: ``short_factor`` rows below ``original_max_position_embeddings``, ``long_factor``
  rows from there on (transformers switches a whole sequence to the long factors once it passes
  that length; the two agree for sequences that fit the original context), ``a`` =
  ``sqrt(1 + ln(s) / ln(original))`` with ``s = max_position_embeddings / original``.

Partial rotary (``partial_rotary_factor < 1``, Phi-4-mini): only the first ``rotary_dim`` of each
head's ``head_dim`` features rotate (half-split within them); `RotaryEmbedding.rotary_dim` says how
many, and the attention layer passes the rest through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


def rope_parameters(raw: dict[str, Any], layer_type: Optional[str] = None) -> dict[str, Any]:
    """The rope settings of ``raw`` (a ``config.json`` dict) for ``layer_type`` (e.g.
    ``"sliding_attention"``; None: the model's only set), with ``rope_type``, ``rope_theta`` and
    ``partial_rotary_factor`` always present."""
    params = raw.get("rope_parameters")
    out: dict[str, Any]
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        key = layer_type if layer_type in params else ("full_attention" if "full_attention" in params
                                                         else next(iter(params)))
        out = dict(params[key])
    elif isinstance(params, dict) and params:
        out = dict(params)
    else:
        out = dict(raw.get("rope_scaling") or {})
        if layer_type == "sliding_attention" and raw.get("rope_local_base_freq") is not None:
            out = {"rope_theta": raw["rope_local_base_freq"]}  # Gemma 3: local layers unscaled
    if "type" in out and "rope_type" not in out:
        out["rope_type"] = out.pop("type")
    out.setdefault("rope_type", "default")
    if out.get("rope_theta") is None:
        out["rope_theta"] = raw.get("rope_theta", 10000.0)
    if out.get("partial_rotary_factor") is None:
        out["partial_rotary_factor"] = raw.get("partial_rotary_factor", 1.0)
    return out


def _default_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn(dim: int, theta: float, p: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    orig = p.get("original_max_position_embeddings") or max_pos
    factor = p.get("factor") or max_pos / orig

    def mscale_of(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = p.get("attention_factor")
    if attn is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attn = float(mscale_of(factor, m) / mscale_of(factor, m_all)) if m and m_all else mscale_of(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attn)


def _llama3(dim: int, theta: float, p: dict) -> torch.Tensor:
    inv = _default_inv_freq(dim, theta)
    factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_ctx = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_ctx / high) * ~(wavelen > old_ctx / low)
    return torch.where(medium, smoothed, scaled)


@dataclass
class RotaryEmbedding:
    """One rope setting of a model: ``head_dim``, the rotated ``rotary_dim``, the parameters."""

    head_dim: int
    params: dict[str, Any]
    max_position_embeddings: int

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * float(self.params.get("partial_rotary_factor", 1.0)))

    @property
    def is_partial(self) -> bool:
        return self.rotary_dim != self.head_dim

    def build_cache(self, max_positions: int, device=None) -> torch.Tensor:
        """``[max_positions, rotary_dim]`` float32 table (module docstring).

        Raises:
            ValueError: an unsupported ``rope_type``, an odd rotary dimension or ``max_positions < 1``.
            KeyError: a scaling dict without a key its type needs.
        """
        return build_cos_sin_cache(self.rotary_dim, max_positions, self.params, self.max_position_embeddings,
                                   device)


def build_cos_sin_cache(dim: int, max_positions: int, params: dict[str, Any], max_position_embeddings: int,
                        device=None) -> torch.Tensor:
    """The cos/sin table of `RotaryEmbedding.build_cache` for rotary dimension ``dim``."""
    if dim <= 0 or dim % 2:
        raise ValueError(f"rotary dimension must be a positive even number, got {dim}")
    if max_positions < 1:
        raise ValueError(f"max_positions must be >= 1, got {max_positions}")
    rope_type = params.get("rope_type", "default")
    theta = float(params.get("rope_theta", 10000.0))
    attn = 1.0
    pos = torch.arange(max_positions, dtype=torch.float32)
    if rope_type == "default":
        inv = _default_inv_freq(dim, theta)
    elif rope_type == "linear":
        inv = _default_inv_freq(dim, theta) / float(params["factor"])
    elif rope_type == "llama3":
        inv = _llama3(dim, theta, params)
    elif rope_type == "yarn":
        inv, attn = _yarn(dim, theta, params, max_position_embeddings)
    elif rope_type == "dynamic":
        factor = float(params["factor"])
        seq = max(max_positions, max_position_embeddings)
        base = theta * ((factor * seq / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
        inv = _default_inv_freq(dim, base)
    elif rope_type == "longrope":
        orig = int(params["original_max_position_embeddings"])
        factor = params.get("factor") or max_position_embeddings / orig
        attn = params.get("attention_factor")
        if attn is None:
            attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        short = 1.0 / (torch.tensor(params["short_factor"], dtype=torch.float32) * theta ** shape)
        long = 1.0 / (torch.tensor(params["long_factor"], dtype=torch.float32) * theta ** shape)
        freqs = torch.where((pos < orig)[:, None], torch.outer(pos, short), torch.outer(pos, long))
        return torch.cat([freqs.cos() * attn, freqs.sin() * attn], dim=-1).to(device)
    else:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    freqs = torch.outer(pos, inv)
    if attn == 1.0:
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)
    return torch.cat([freqs.cos() * attn, freqs.sin() * attn], dim=-1).to(device)
