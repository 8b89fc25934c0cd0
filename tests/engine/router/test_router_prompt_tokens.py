"""The router tokenizes prompts as the engine does (its tokenizer, its chat-template code), so two
chats with one system prompt share their leading block hashes, and a body it cannot read is routed
on load alone."""

from __future__ import annotations

import pytest

from kvpilot.router.prefix import PromptTokenizer, block_hashes
from kvpilot.server.chat_template import render_chat
from kvpilot.server.protocol import ChatCompletionRequest

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|im_start|>": 3, "<|im_end|>": 4}
    vocab.update({c: i + 5 for i, c in enumerate(chars)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<s>", "</s>", "<|im_start|>", "<|im_end|>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = TEMPLATE
    return fast


def test_chat_prompt_ids_are_the_engines(tokenizer):
    pt = PromptTokenizer(tokenizer)
    system = "You are a careful assistant for the accounting team. " * 4
    a = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "What is VAT?"}]}
    b = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Close the books."}]}
    ids_a = pt.token_ids("/v1/chat/completions", a)
    req = ChatCompletionRequest.model_validate(a)
    assert ids_a == render_chat(tokenizer, req.messages, None, add_generation_prompt=True)
    ha, hb = block_hashes(ids_a, 16), block_hashes(pt.token_ids("/v1/chat/completions", b), 16)
    shared = sum(x == y for x, y in zip(ha, hb))
    assert shared >= len(system) // 16 and ha[shared:] != hb[shared:]


def test_completion_prompts(tokenizer):
    pt = PromptTokenizer(tokenizer)
    assert pt.token_ids("/v1/completions", {"prompt": "hi"}) == tokenizer.encode("hi")
    assert pt.token_ids("/v1/completions", {"prompt": "hi", "add_special_tokens": False}) == \
        tokenizer.encode("hi", add_special_tokens=False)
    assert pt.token_ids("/v1/completions", {"prompt": [[5, 6, 7]]}) == [5, 6, 7]
    assert pt.token_ids("/v1/completions", {"prompt": ["a", "b"]}) is None  # a batch: load only
    assert pt.token_ids("/v1/chat/completions", {"messages": "not a list"}) is None  # the engine answers 400
    assert PromptTokenizer().token_ids("/v1/completions", {"prompt": "hi"}) is None
    assert PromptTokenizer().token_ids("/v1/completions", {"prompt": [1, 2]}) == [1, 2]
