"""Prompt-lookup drafts: the tokens that followed the last earlier occurrence of the sequence's suffix."""

from __future__ import annotations

import numpy as np


def ngram_draft(token_ids: list[int], max_draft_len: int, max_ngram: int, min_ngram: int = 1) -> list[int]:
    """The draft for a sequence whose tokens are ``token_ids`` (prompt and output).

    For ``n`` from ``max_ngram`` down to ``min_ngram``: the last ``n`` tokens are searched for in
    ``token_ids[:-1]`` (an occurrence may overlap the suffix, never be it); at the most recent
    occurrence, starting at ``i``, the draft is ``token_ids[i + n : i + n + max_draft_len]``. The first
    ``n`` with an occurrence wins. Returns [] when no suffix occurs earlier (or ``max_draft_len`` < 1).
    Cost: O(len(token_ids) * max_ngram) numpy comparisons.
    """
    L = len(token_ids)
    if max_draft_len < 1 or L < 2:
        return []
    a = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        suffix = a[L - n:]
        # candidate starts i in [0, L - n - 1]: windows a[i:i+n] that end before the last token
        m = L - n
        ok = a[:m] == suffix[0]
        for j in range(1, n):
            ok &= a[j:m + j] == suffix[j]
        hits = np.flatnonzero(ok)
        if hits.size:
            i = int(hits[-1])
            return a[i + n:i + n + max_draft_len].tolist()
    return []
