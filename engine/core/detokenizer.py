"""Incremental, UTF-8-safe detokenization with stop strings and hold-back.

Decoding one token at a time breaks multi-byte characters (byte-fallback tokens) and the
leading-space rules of SentencePiece-style tokenizers. So each step decodes a short window of ids
twice, with and without the new ones, and emits the difference, and only when it does not end in
an incomplete character (U+FFFD) — the prefix/read-offset method of vLLM and TGI.

Stop strings are searched in the text (so they match across token boundaries and inside one
token). Text that could still become a stop string (a suffix that is a prefix of one) is held back
from the caller until it is decided, so nothing sent is ever retracted.
"""

from __future__ import annotations

from typing import Optional

from kvpilot.core.sequence import Sequence

_INITIAL_WINDOW = 5  # prompt tokens decoded as context before the first output token


def init_offsets(seq: Sequence) -> None:
    n = seq.num_prompt_tokens
    seq.prefix_offset = max(n - _INITIAL_WINDOW, 0)
    seq.read_offset = n


def decode_new_text(tokenizer, seq: Sequence, skip_special_tokens: bool = True, final: bool = False,
                    end: Optional[int] = None) -> str:
    """Text added by the sequence's latest token(s); '' while a character is incomplete.

    Args:
        final: the sequence ends here: flush everything held back, an incomplete trailing byte
            sequence decoded as the tokenizer decodes it (U+FFFD), so that the joined text equals
            ``tokenizer.decode`` of the output ids.
        end: decode ``token_ids[:end]`` only (a final stop token whose text is not wanted).
    """
    ids = seq.token_ids if end is None else seq.token_ids[:end]
    prefix = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(ids[seq.prefix_offset:], skip_special_tokens=skip_special_tokens)
    if not final and (full.endswith("\ufffd") or len(full) < len(prefix)):
        return ""
    seq.prefix_offset = seq.read_offset
    seq.read_offset = len(ids)
    return full[len(prefix):]


def find_stop(text: str, new_len: int, stops: list[str]) -> Optional[tuple[int, str]]:
    """Earliest stop string that ends inside the last ``new_len`` characters: (start index, string)."""
    best = None
    for s in stops:
        start = text.find(s, max(0, len(text) - new_len - len(s) + 1))
        if start != -1 and (best is None or start < best[0]):
            best = (start, s)
    return best


def hold_back_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
