"""The router's view of a prompt's prefix: its leading full token blocks, hashed as the engine does.

The engine's prefix cache keys a full block of ``tokens_per_block`` tokens by a chained hash
(:func:`kvpilot.core.kv_cache_manager.hash_block`: blake2b over the parent block's hash and the
block's token ids) and reuses at most ``num_tokens - 1`` tokens of a prompt. The router tokenizes
the prompt the way the engine does (the model's tokenizer; chat messages through the same chat
template code, :func:`kvpilot.server.chat_template.render_chat`) and hashes the same blocks, so a
block hash the router has seen sent to a replica is a block that replica's cache has held.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpilot.core.kv_cache_manager import hash_block


def block_hashes(token_ids: Sequence[int], tokens_per_block: int, max_blocks: int | None = None) -> list[bytes]:
    """Chained hashes of the leading full blocks of ``token_ids`` that the engine could reuse.

    Args:
        token_ids: the prompt's token ids.
        tokens_per_block: the engine's ``--tokens-per-block``.
        max_blocks: hash at most this many leading blocks (None: all).

    Returns:
        one 16-byte hash per block, ``(len(token_ids) - 1) // tokens_per_block`` of them (capped).

    Raises:
        ValueError: ``tokens_per_block`` < 1.
    """
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    n = max(0, (len(token_ids) - 1) // tokens_per_block)
    if max_blocks is not None:
        n = min(n, max_blocks)
    out, parent = [], None
    for i in range(n):
        parent = hash_block(parent, tuple(int(t) for t in token_ids[i * tokens_per_block:(i + 1) * tokens_per_block]))
        out.append(parent)
    return out


class PromptTokenizer:
    """Token ids of an OpenAI request body's prompt, as the engine would compute them.

    Args:
        tokenizer: a transformers tokenizer (the model's), or None to use only token-id prompts.
        chat_template: the engine's ``--chat-template`` text, or None for the tokenizer's own.
    """

    def __init__(self, tokenizer: Any = None, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    @classmethod
    def from_pretrained(cls, path: str, chat_template: str | None = None,
                        revision: str | None = None) -> "PromptTokenizer":
        """The tokenizer of a model directory or Hub id (at ``revision``), as the engine loads it."""
        from transformers import AutoTokenizer

        from kvpilot.server.chat_template import load_chat_template

        return cls(AutoTokenizer.from_pretrained(path, revision=revision), load_chat_template(chat_template))

    def token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids for ``/v1/completions`` or ``/v1/chat/completions``, or None when
        they cannot be known here (no tokenizer, a batch of prompts, a body the engine will refuse:
        the engine answers that request itself)."""
        try:
            if path.endswith("/chat/completions"):
                if self.tokenizer is None:
                    return None
                from kvpilot.server.chat_template import render_chat
                from kvpilot.server.protocol import ChatCompletionRequest

                req = ChatCompletionRequest.model_validate(body)
                return render_chat(self.tokenizer, req.messages, self.chat_template,
                                   add_generation_prompt=bool(req.add_generation_prompt),
                                   template_kwargs=req.chat_template_kwargs,
                                   tools=req.tools, documents=req.documents,
                                   continue_final_message=bool(req.continue_final_message))
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return list(prompt)
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return list(prompt)
            if isinstance(prompt, str) and self.tokenizer is not None:
                return list(self.tokenizer.encode(prompt, add_special_tokens=body.get("add_special_tokens", True)))
        except Exception:  # the engine validates and answers; routing falls back to load only
            return None
        return None
