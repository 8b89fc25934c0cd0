"""The sampler's host-side inputs: `SamplingRow` (one row's parameters, read into a packed record
once) and `Upload` (a call's host arrays sent to the device in one asynchronous copy).

Why: at serving batch sizes the sampler's kernels take tens of microseconds, so its host work sets
its cost. Reading ~14 attributes of 256 rows every step, and one small pageable upload per tensor
(each of which first waits for the work queued on the stream), would cost more than the kernels.
So a row's fixed parameters become a 56-byte record at its first call (the rows of a batch are
joined with one ``bytes.join``), only the output position is read per call, and a call's index and
parameter arrays travel in one pinned, non-blocking copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

# Bits of the record's ``flags``: which transforms a row needs apart from the per-call bans.
PENALTIES = 1  # repetition, frequency or presence penalty
BIAS = 2  # a non-empty logit_bias
ALLOWED = 4  # allowed_token_ids is set

RECORD = np.dtype([("temperature", "<f4"), ("top_p", "<f4"), ("min_p", "<f4"), ("repetition", "<f4"),
                   ("frequency", "<f4"), ("presence", "<f4"), ("top_k", "<i8"), ("seed", "<i8"),
                   ("logprobs", "<i8"), ("flags", "<i8")])
"""A row's fixed parameters (logprobs -1 = none); `records` returns one per row."""


class _Param:
    """A `SamplingRow` field whose assignment drops the row's cached record and arrays (a data
    descriptor: reads return the value kept in the instance's ``__dict__``)."""

    def __init__(self, default):
        self.default = default

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self.default  # the dataclass default
        return obj.__dict__[self.name]

    def __set__(self, obj, value) -> None:
        d = obj.__dict__
        d[self.name] = value
        d["_rec"] = None
        d["_arrays"] = None


@dataclass
class SamplingRow:
    """Plain per-row inputs of the sampler (one row = one sequence that samples this step).

    ``step``, ``output_token_ids`` and ``banned_token_ids`` may change between calls (the engine
    updates them every step; ``output_token_ids`` only grows, or is replaced by a new list that
    starts with the old one's tokens: the penalty counts add only the new tail, see
    `kvpilot.sampling.logits_processors.TokenCounts`; another history needs another row). The
    other fields are read once, at the row's first call, and again only after being assigned:
    assign a new list or dict rather than editing one in place.
    """

    temperature: float = _Param(1.0)
    top_k: int = _Param(0)
    top_p: float = _Param(1.0)
    min_p: float = _Param(0.0)
    seed: int = _Param(0)
    step: int = 0  # output position of the token being drawn
    logprobs: Optional[int] = _Param(None)
    repetition_penalty: float = _Param(1.0)
    frequency_penalty: float = _Param(0.0)
    presence_penalty: float = _Param(0.0)
    prompt_token_ids: Optional[list[int]] = _Param(None)  # only when repetition_penalty != 1
    output_token_ids: list[int] = field(default_factory=list)
    logit_bias: Optional[dict[int, float]] = _Param(None)
    allowed_token_ids: Optional[list[int]] = _Param(None)
    banned_token_ids: list[int] = field(default_factory=list)
    bad_word_seqs: list[list[int]] = field(default_factory=list)
    # Structured output: the sequence's grammar state (`kvpilot.sampling.guided.Guide`), read at every
    # call (its mask changes with each accepted token), or None.
    guide: Optional[object] = field(default=None, repr=False, compare=False)
    # Penalty history as device tensors (`history`), kept across steps when the row is reused.
    _prompt_t: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    _out_t: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)

    # Caches (not fields): the packed record, per-vocabulary arrays of logit_bias and
    # allowed_token_ids, and the row's place in the penalty counts (logits_processors.TokenCounts).
    _rec = None
    _arrays = None
    _counts = None

    def __getstate__(self) -> dict:
        # Copies and pickles leave the device-side state behind (a copy counts its own tokens).
        return {k: v for k, v in self.__dict__.items() if k not in ("_counts", "_prompt_t", "_out_t", "guide")}

    def record(self) -> bytes:
        """The row's fixed parameters as one `RECORD` (cached until a parameter is assigned).

        Raises OverflowError for an integer parameter outside int64 (the caller fails this row)."""
        rec = self._rec
        if rec is None:
            flags = ((PENALTIES if (self.repetition_penalty != 1.0 or self.frequency_penalty
                                    or self.presence_penalty) else 0)
                     | (BIAS if self.logit_bias else 0) | (ALLOWED if self.allowed_token_ids is not None else 0))
            lp = -1 if self.logprobs is None else min(self.logprobs, 2 ** 62)
            rec = np.array([(self.temperature, self.top_p, self.min_p, self.repetition_penalty,
                             self.frequency_penalty, self.presence_penalty, self.top_k, self.seed, lp, flags)],
                           dtype=RECORD).tobytes()
            self.__dict__["_rec"] = rec
        return rec

    def vocab_arrays(self, V: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(logit_bias ids int64, their biases float32, allowed_token_ids int64), ids in [0, V) only;
        cached per vocabulary size until a parameter is assigned."""
        cached = self._arrays
        if cached is None or cached[0] != V:
            bias = {t: b for t, b in (self.logit_bias or {}).items() if 0 <= t < V}
            ids = np.fromiter(bias.keys(), np.int64, len(bias))
            vals = np.fromiter(bias.values(), np.float32, len(bias))
            allowed = np.array([t for t in self.allowed_token_ids or () if 0 <= t < V], dtype=np.int64)
            cached = (V, ids, vals, allowed)
            self.__dict__["_arrays"] = cached
        return cached[1], cached[2], cached[3]

    def history(self, dev: torch.device) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """(prompt ids, output ids) as int64 tensors on ``dev``, updated with the new output ids.

        Not used by the sampler (which keeps token counts instead: logits_processors.TokenCounts);
        for callers that want the history itself on the device."""
        if self._out_t is not None and self._out_t.device != dev:
            # Logits can arrive on another device than last step: rebuild there.
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

    @classmethod
    def from_record(cls, rec: bytes, step: int = 0) -> "SamplingRow":
        """A row with the fixed parameters of ``rec`` (another row's `record`, e.g. sent to another
        process) and that record cached as its own, so that the sampler reads the same bytes.

        Only records that need nothing but their scalars are accepted: penalties need the token
        history, a logit bias or allowed ids their token lists, which a record does not hold.

        Raises:
            ValueError: ``rec`` is not one `RECORD`, or its flags ask for penalties, a bias or allowed ids.
        """
        if len(rec) != RECORD.itemsize:
            raise ValueError(f"a sampling record has {RECORD.itemsize} bytes, got {len(rec)}")
        r = np.frombuffer(rec, dtype=RECORD)[0]
        if int(r["flags"]):
            raise ValueError("a sampling record with penalties, logit_bias or allowed_token_ids needs the "
                             "token lists it does not hold")
        lp = int(r["logprobs"])
        row = cls(temperature=float(r["temperature"]), top_k=int(r["top_k"]), top_p=float(r["top_p"]),
                  min_p=float(r["min_p"]), seed=int(r["seed"]), step=step, logprobs=None if lp < 0 else lp,
                  repetition_penalty=float(r["repetition"]), frequency_penalty=float(r["frequency"]),
                  presence_penalty=float(r["presence"]))
        row.__dict__["_rec"] = bytes(rec)
        return row

    @property
    def needs_processing(self) -> bool:
        """Whether any logits transform applies to this row (masks, bias, penalties)."""
        return bool(self.banned_token_ids or self.bad_word_seqs
                    or np.frombuffer(self.record(), dtype=RECORD)["flags"][0])


def records(rows: list[SamplingRow]) -> np.ndarray:
    """[S] `RECORD` array of the rows' fixed parameters (read-only; one join of cached records)."""
    return np.frombuffer(b"".join([r._rec or r.record() for r in rows]), dtype=RECORD)


_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32, np.dtype(np.bool_): torch.bool}


class Upload:
    """Host arrays of one call, sent to a device in one copy.

    `add` registers a numpy array and returns its handle; `send` packs every array into one byte
    buffer (each part 64-byte aligned, so each device view is as aligned as a fresh allocation) and
    returns the device tensors, in handle order. On CUDA the buffer is pinned (PyTorch's caching
    host allocator, which keeps a block until its copy is done) and the copy non-blocking: an upload
    from pageable memory would first wait for everything queued on the stream, e.g. the forward pass.
    On the CPU the tensors are views of the buffer (no copy).
    """

    _ALIGN = 64

    def __init__(self) -> None:
        self._parts: list[tuple[int, np.ndarray]] = []
        self._size = 0

    def add(self, a: np.ndarray) -> int:
        a = np.ascontiguousarray(a)
        if a.dtype not in _TORCH_DTYPES:
            raise TypeError(f"cannot upload a {a.dtype} array; expected one of {list(_TORCH_DTYPES)}")
        self._parts.append((self._size, a))
        self._size += -(-max(a.nbytes, 1) // self._ALIGN) * self._ALIGN
        return len(self._parts) - 1

    def send(self, dev: torch.device) -> list[torch.Tensor]:
        host = torch.empty(max(self._size, self._ALIGN), dtype=torch.uint8, pin_memory=dev.type == "cuda")
        h = host.numpy()
        for off, a in self._parts:
            h[off:off + a.nbytes] = a.reshape(-1).view(np.uint8)
        buf = host if dev.type == "cpu" else host.to(dev, non_blocking=True)
        return [buf[off:off + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape) for off, a in self._parts]


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """CPU copies of device tensors through one synchronisation (non-blocking copies, then one wait);
    CPU tensors are returned as they are."""
    if not any(t.device.type != "cpu" for t in tensors):
        return tensors
    out = [t.to("cpu", non_blocking=True) for t in tensors]
    if any(t.is_cuda for t in tensors):
        torch.cuda.current_stream(next(t.device for t in tensors if t.is_cuda)).synchronize()
    return out
