"""Guided decoding (structured output) with xgrammar: grammars compiled once, token masks per step.

Pieces:

- `GuidedDecodingBackend`: one per engine (built at the first guided request, from the Hugging
  Face tokenizer, the model's logits width and its end-of-sequence ids). `compile` turns a
  `kvpilot.GuidedDecodingParams` into an xgrammar ``CompiledGrammar``; compiled grammars are cached
  by their kind and text (a JSON schema's canonical JSON), so the same schema is compiled once for
  all its requests. A grammar that does not compile raises `GuidedDecodingError` (a ValueError
  naming the problem) in the caller's thread, before the request is queued.
- `Guide`: one grammar matcher per sequence (``n`` choices get one each). The engine advances it
  with every accepted token (`Guide.accept`); `Guide.terminated` ends the sequence.
- `apply_guides`: the sampler's hook. Before a step's draw, the masks of the guided rows are filled
  on the host (xgrammar's ``BatchGrammarMatcher``, several threads), packed as int32 bitmasks
  ``[G, ceil(V / 32)]`` (bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed), sent to the
  logits' device in one pinned non-blocking copy and applied there by xgrammar's
  ``apply_token_bitmask_inplace`` (a Triton kernel on CUDA, a C++ loop on the CPU): forbidden
  tokens get ``-inf`` in the sampler's processed copy of the logits, so greedy, seeded and filtered
  draws all choose among allowed tokens only, while log-probabilities still come from the raw
  distribution (as vLLM's default does).

Where the host work runs: the engine launches a step's forward pass (on a GPU the executor returns at
once), reads the previous step's tokens and advances the matchers, then launches the sampler, whose
first act is this hook; so on a GPU the mask filling overlaps the forward pass of the same step
(on the CPU everything is sequential).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from typing import Any, Optional

import numpy as np
import torch

logger = logging.getLogger(__name__)

BACKENDS = ("xgrammar",)
"""Accepted values of ``LLM(guided_decoding_backend=...)`` (None switches guided decoding off)."""

_CACHE_SIZE = 1024  # compiled grammars kept (least recently used dropped first)


class GuidedDecodingError(ValueError):
    """A guided-decoding constraint that cannot be used: a JSON schema, regex, EBNF grammar or
    structural tag that does not compile (the message names the constraint and xgrammar's reason),
    or guided decoding switched off on this engine."""


def _clean(exc: BaseException) -> str:
    """xgrammar's message without its C++ source prefix (``[12:00:00] /project/cpp/x.cc:94: ``)."""
    msg = str(exc).strip()
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", msg)


def grammar_key(gd) -> tuple[str, str]:
    """(kind, text) of a `GuidedDecodingParams`: the cache key, and what `compile` compiles.

    Kinds: "json" (the schema's JSON text; key order kept: it is the order properties are written
    in), "json_object", "regex", "grammar" (EBNF), "choice" (the choices as a JSON list),
    "structural_tag" (JSON text)."""
    kind = gd.kind
    value = getattr(gd, kind)
    if kind == "json_object":
        return kind, ""
    if kind == "choice":
        return kind, json.dumps(list(value))
    if kind in ("json", "structural_tag") and not isinstance(value, str):
        return kind, json.dumps(value)
    return kind, value


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar (xgrammar's GBNF dialect) whose language is exactly ``choices``."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GuidedDecodingBackend:
    """xgrammar behind one engine: tokenizer info, compiler, grammar cache, batched mask filling.

    Args:
        tokenizer: the engine's Hugging Face tokenizer.
        vocab_size: width V of the model's logits (may exceed the tokenizer's vocabulary: padded
            rows are always masked).
        stop_token_ids: the model's end-of-sequence ids (what a finished grammar allows).
        max_threads: threads for compiling and for filling a batch's masks (default: the CPU
            count, at most 8).

    Thread-safe: `compile` may be called from any thread (the server's request handlers).
    """

    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_threads: Optional[int] = None) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        max_threads = max_threads or max(1, min(8, os.cpu_count() or 1))
        self.vocab_size = int(vocab_size)
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                       stop_token_ids=list(stop_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads)
        self._batch = xgr.BatchGrammarMatcher(max_threads)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self._vocab = None  # decoded vocabulary, read at the first `token_bytes`
        self.compile_seconds: dict[tuple[str, str], float] = {}  # per cached grammar, for benchmarks

    def compile(self, gd) -> Any:
        """The compiled grammar of ``gd`` (a `GuidedDecodingParams`), from the cache when its text
        was compiled before.

        Raises:
            GuidedDecodingError: the constraint does not compile (message: kind and reason).
        """
        import time

        key = grammar_key(gd)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        kind, text = key
        t0 = time.perf_counter()
        c = self.compiler
        try:
            if kind == "json":
                compiled = c.compile_json_schema(text, any_whitespace=False)
            elif kind == "json_object":
                compiled = c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            elif kind == "regex":
                compiled = c.compile_regex(text)
            elif kind == "grammar":
                compiled = c.compile_grammar(text)
            elif kind == "choice":
                compiled = c.compile_grammar(choice_grammar(json.loads(text)))
            else:  # structural_tag
                compiled = self._structural_tag(json.loads(text))
        except (RuntimeError, ValueError, TypeError, KeyError) as exc:
            label = {"json": "JSON schema", "grammar": "EBNF grammar", "structural_tag": "structural tag"}.get(kind, kind)
            raise GuidedDecodingError(f"guided_decoding: the {label} does not compile: {_clean(exc)}") from None
        elapsed = time.perf_counter() - t0
        with self._lock:
            self._cache[key] = compiled
            self.compile_seconds[key] = elapsed
            while len(self._cache) > _CACHE_SIZE:
                old, _ = self._cache.popitem(last=False)
                self.compile_seconds.pop(old, None)
        logger.debug("guided decoding: compiled a %s grammar in %.1f ms", kind, elapsed * 1e3)
        return compiled

    def _structural_tag(self, tag: dict) -> Any:
        """A structural tag: xgrammar's format (``{"type": "structural_tag", "format": {...}}``), or
        the begin/schema/end form TensorRT-LLM and vLLM document (``{"structures": [{"begin",
        "schema", "end"}], "triggers": [...]}``)."""
        xgr = self._xgr
        if not isinstance(tag, dict):
            raise TypeError("a structural tag is a JSON object")
        if "structures" in tag:
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
                     for s in tag["structures"]]
            triggers = tag.get("triggers") or sorted({s["begin"] for s in tag["structures"]})
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                return self.compiler.compile_structural_tag(items, list(triggers))
        return self.compiler.compile_structural_tag(json.dumps(tag))

    def guide(self, compiled, stop_token_ids: Optional[list[int]] = None,
              start_after: Optional[str] = None) -> "Guide":
        """A fresh matcher of ``compiled`` for one sequence; ``stop_token_ids`` replaces the
        tokens a finished grammar accepts (a request's own ``end_id``); with ``start_after`` the
        grammar waits (every token allowed) until the output's bytes contain that text."""
        m = self._xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)
        return Guide(self, m, start_after.encode("utf-8") if start_after else None)

    def token_bytes(self, token: int) -> bytes:
        """The bytes ``token`` stands for (xgrammar's decoded vocabulary; b"" for special tokens)."""
        vocab = self._vocab
        if vocab is None:
            vocab = self._vocab = self.info.decoded_vocab
        return vocab[token] if 0 <= token < len(vocab) else b""

    def fill(self, guides: list["Guide"], bitmask: torch.Tensor) -> None:
        """Fill row j of ``bitmask`` (host int32 ``[G, ceil(V / 32)]``) with ``guides[j]``'s mask
        (all ones for a guide still waiting for its ``after_token_ids``)."""
        if all(g.active for g in guides):
            if len(guides) == 1:
                guides[0].matcher.fill_next_token_bitmask(bitmask, 0)
            else:
                self._batch.batch_fill_next_token_bitmask([g.matcher for g in guides], bitmask)
            return
        for j, g in enumerate(guides):
            if g.active:
                g.matcher.fill_next_token_bitmask(bitmask, j)
            else:
                bitmask[j].fill_(-1)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """``logits[i, t] = -inf`` where bit t of ``bitmask[i]`` is 0 (same device, in place)."""
        self._xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=min(logits.shape[-1], self.vocab_size))


class Guide:
    """The grammar state of one sequence (an xgrammar ``GrammarMatcher``). With ``after`` (bytes)
    the grammar is inactive until the output's bytes contain it (a reasoning model's
    ``</think>``, however it was tokenized): until then every token is allowed and none is fed to
    the matcher; the grammar starts with the token after the one that completed ``after``."""

    __slots__ = ("backend", "matcher", "after", "active", "_window")

    def __init__(self, backend: GuidedDecodingBackend, matcher, after: Optional[bytes] = None) -> None:
        self.backend = backend
        self.matcher = matcher
        self.after = after or None
        self.active = self.after is None
        self._window = b""

    def accept(self, token: int) -> bool:
        """Advance by one generated token; False if the grammar does not allow it (state kept)."""
        if not self.active:
            w = self._window + self.backend.token_bytes(int(token))
            self.active = self.after in w
            self._window = w[-(len(self.after) - 1):] if len(self.after) > 1 else b""
            return True
        return bool(self.matcher.accept_token(int(token)))

    @property
    def terminated(self) -> bool:
        """True once the grammar has accepted a stop token (nothing more may follow)."""
        return self.active and bool(self.matcher.is_terminated())


def apply_guides(x: torch.Tensor, raw: torch.Tensor, rows: list) -> torch.Tensor:
    """The sampler's hook: mask the guided rows of ``x`` ([S, V] float32, the processed logits).

    Rows whose `SamplingRow.guide` is None are left as they are. ``raw`` is the caller's logits
    tensor, which is never written: when ``x`` is ``raw`` a copy is masked and returned. Returns
    ``x`` itself when no row is guided. Queues device work only (the bitmask and the row indices
    travel in pinned, non-blocking copies)."""
    idx = [i for i, r in enumerate(rows) if r.guide is not None]
    if not idx:
        return x
    guides = [rows[i].guide for i in idx]
    backend = guides[0].backend
    if x is raw:
        x = raw.clone()
    S, V = x.shape
    dev = x.device
    cuda = dev.type == "cuda"
    words = (backend.vocab_size + 31) // 32
    host = torch.empty(len(idx), words, dtype=torch.int32, pin_memory=cuda)
    backend.fill(guides, host)
    bitmask = host.to(dev, non_blocking=True) if cuda else host
    if len(idx) == S:
        backend.apply(x, bitmask)
        return x
    from kvpilot.sampling.sampler_inputs import Upload

    up = Upload()
    h = up.add(np.asarray(idx, dtype=np.int64))
    sel = up.send(dev)[h]
    sub = x.index_select(0, sel)
    backend.apply(sub, bitmask)
    x.index_copy_(0, sel, sub)
    return x
