"""Engine-side state of a request and of each of its sequences (one per choice)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any, Optional

from kvpilot.outputs import Logprob, RequestOutput
from kvpilot.sampling.sampler import SamplingRow
from kvpilot.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_counter = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One choice being generated: the prompt plus its output tokens, and its place in the KV pool.

    ``num_computed_tokens`` tokens have their K/V in the cache (blocks ``block_table``); the rest of
    ``token_ids`` still need a forward pass (a prefill chunk, or the last sampled token).
    """

    request: "Request"
    index: int
    token_ids: list[int]
    seed: int
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks of block_table already registered in the prefix cache
    # (sequence, tokens) after a lockstep request's re-admission: this sequence's first ``tokens``
    # tokens lie in blocks it shares with that (earlier) sequence of its request, which computes
    # them; ``num_computed_tokens`` counts them, but the scheduler gives this sequence nothing to
    # compute until they are computed (`Scheduler._shared_prefix_ready`), then resets this to None.
    shared_prefix: Optional[tuple["Sequence", int]] = None
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    cumulative_logprob: float = 0.0
    # Detokenizer state: the text so far and how much of it has been sent to the caller.
    text: str = ""
    sent_text_len: int = 0
    sent_token_len: int = 0
    prefix_offset: int = 0
    read_offset: int = 0
    pending_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    pending_logits: list = field(default_factory=list)
    last_token_time: Optional[float] = None
    sampling_row: Optional[SamplingRow] = None  # built at the first sampled token, then updated
    # True once `sampling_row` changes only in its ``step`` (no penalties, past ``min_tokens``).
    sampling_row_fixed: bool = False
    # The engine's per-token checks: ids that end the sequence (stop token ids, and the end ids
    # unless ignore_eos; cached at the first sampled token) and the length it stops at (set when the
    # request is added: the scheduler reads it for in-flight tokens).
    stop_ids: Optional[frozenset[int]] = None
    length_limit: int = 0
    # Async scheduling: >= 0 while a token sampled for this sequence is still on the device (not in
    # ``token_ids`` yet): the row of the in-flight step's sampled-id tensor that holds it. The
    # scheduler counts it as a token to compute; the engine resets it when it reads the step.
    inflight_row: int = -1
    # Speculative decoding: this step's drafted tokens (after ``token_ids``; not part of them until
    # verified). The scheduler counts them as tokens to compute (`kvpilot.spec_decode.decoder`).
    spec_token_ids: tuple | list = ()
    # Structured output: the grammar state (`kvpilot.sampling.guided.Guide`), advanced by every
    # appended token; None without ``guided_decoding``.
    guide: Optional[object] = None

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.request.num_prompt_tokens  # fixed; read many times per step

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass(eq=False)
class Request:
    """A submitted prompt with its sampling parameters, its sequences and its result handle."""

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    output: RequestOutput
    seqs: list[Sequence] = field(default_factory=list)
    aborted: bool = False
    prompt_logprobs_acc: Optional[list] = None  # [None, {token id: Logprob}, ...] when asked for
    lora: Optional[Any] = None  # the request's `kvpilot.lora.adapter.LoRAAdapter`, None for the base model

    @property
    def lora_id(self) -> Optional[int]:
        """The adapter's ``lora_int_id``, None for the base model."""
        return None if self.lora is None else self.lora.int_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def lockstep(self) -> bool:
        """Whether the request's sequences must all be computed in the same steps (beam search: the
        next beams are chosen from every beam's logits at once). The scheduler then preempts and
        admits them together (vLLM v0's sequence group); other requests' sequences are independent
        (vLLM v1's parallel-sampling child requests)."""
        return self.params.use_beam_search

    @property
    def max_num_seqs(self) -> int:
        """Sequences the request can hold at once: a beam request grows from one to its width."""
        return self.params.num_candidates

    @property
    def finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:  # the common case, checked for every request every step
            return seqs[0].status is SequenceStatus.FINISHED
        return all(s.status is SequenceStatus.FINISHED for s in seqs)
