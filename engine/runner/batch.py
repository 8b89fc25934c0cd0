"""`ScheduledSeq`: one sequence's share of a step, the plain record the engine core hands the runner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class ScheduledSeq:
    """One sequence's share of a step (plain data, picklable for worker processes)."""

    seq_id: int
    token_ids: list[int]  # the tokens to compute now (a prefill chunk, or the last sampled token)
    start_pos: int  # position of token_ids[0] (= tokens already in the cache)
    # Block ids of the sequence. The runner mirrors it by identity: between steps a list may only
    # grow (or shrink); any other change must pass a new list (`HostBlockTables`).
    block_table: list[int]
    sample: bool  # this chunk reaches the end of the sequence: produce logits for its last token
    all_logits: bool = False  # return logits for every token of the chunk (prompt logprobs)
    # >= 0: token_ids is one placeholder; the real id is this row of the tensor given to
    # `ModelRunner.set_inflight_tokens` (the previous step's sampled ids, not read on the host yet).
    inflight_row: int = -1
    # Speculative decoding: token_ids is the last token and drafts to verify, with all_logits (its
    # logits at every position). Unlike prompt-logprob chunks, prefill CUDA graphs cover it.
    verify: bool = False
    # The `kvpilot.lora.adapter.LoRAAdapter` this sequence runs with, or None (the base model).
    lora: Optional[Any] = None
