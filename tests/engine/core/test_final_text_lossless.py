"""The final text of a choice is the tokenizer's decode of its output ids, also when generation ends
in the middle of a multi-byte character (a byte-level BPE model emitting random byte sequences).

Fuzz: a random-weight Llama over a byte-level BPE vocabulary trained on multi-byte text, sampled at
high temperature with many seeds, ended by ``max_tokens`` or by a stop token id; streaming and not.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from support.engine import make_tiny_llama
from kvpilot import LLM, KvCacheConfig, SamplingParams

CORPUS = ["héllo wörld café naïve", "日本語のテキストです", "emoji 😀🎉👍 mixed ✓ ünïcödé", "Ελληνικά και русский",
          "a€b£c¥d", "ascii only text here"]


def _byte_level_tokenizer(path, vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 50, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   clean_up_tokenization_spaces=False)
    fast.save_pretrained(str(path))
    return fast


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("bytebpe")
    tokenizer = _byte_level_tokenizer(path, vocab=384)
    assert tokenizer.get_vocab()["<s>"] == 1 and tokenizer.get_vocab()["</s>"] == 2
    make_tiny_llama(path, seed=5, vocab=len(tokenizer))
    with LLM(str(path), max_num_tokens=512, device="cpu", kv_cache_config=KvCacheConfig(tokens_per_block=8)) as llm:
        yield llm, tokenizer


def _cases(tokenizer, seed: int, count: int):
    rng = random.Random(seed)
    vocab = len(tokenizer)
    cases = []
    for i in range(count):
        stop_ids = rng.sample(range(3, vocab), 8) if rng.random() < 0.4 else None
        cases.append(SamplingParams(temperature=2.0, seed=seed * 1000 + i, max_tokens=rng.randint(1, 24),
                                    ignore_eos=rng.random() < 0.5, stop_token_ids=stop_ids))
    return cases


def _expected(tokenizer, ids: list[int], params: SamplingParams, finish_reason: str) -> str:
    if finish_reason == "stop" and ids and ids[-1] in params.stop_token_ids:
        ids = ids[:-1]  # a stop token's own text is not part of the output
    return tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("seed", range(6))
def test_final_text_equals_decode_of_output_ids(byte_model, seed):
    llm, tokenizer = byte_model
    params = _cases(tokenizer, seed, 40)
    prompts = ["日本", "café ", "😀", ""] * 10
    outs = llm.generate(prompts, params, use_tqdm=False)
    partial = 0
    for out, p in zip(outs, params):
        c = out.outputs[0]
        expected = _expected(tokenizer, c.token_ids, p, c.finish_reason)
        partial += expected.endswith("\ufffd")
        assert c.text == expected, (c.token_ids, c.finish_reason)
    assert partial > 0  # the fuzz really ended inside multi-byte characters


@pytest.mark.parametrize("seed", range(6, 10))
def test_streamed_final_text_equals_decode_of_output_ids(byte_model, seed):
    llm, tokenizer = byte_model
    params = _cases(tokenizer, seed, 30)

    async def one(p):
        diffs, last = [], None
        async for chunk in llm.generate_async("é", p, streaming=True):
            diffs.append(chunk.outputs[0].text_diff)
            last = chunk
        return "".join(diffs), last

    async def main():
        return await asyncio.gather(*(one(p) for p in params))

    for (joined, out), p in zip(asyncio.run(main()), params):
        c = out.outputs[0]
        expected = _expected(tokenizer, c.token_ids, p, c.finish_reason)
        assert joined == c.text == expected, (c.token_ids, c.finish_reason)


def test_stop_string_still_cuts_the_final_text(byte_model):
    llm, tokenizer = byte_model
    for seed in range(20):
        base = llm.generate("", SamplingParams(temperature=2.0, seed=seed, max_tokens=16, ignore_eos=True))
        full = base.outputs[0].text
        assert full == tokenizer.decode(base.outputs[0].token_ids, skip_special_tokens=True)
        cut = full[:-1].rstrip("\ufffd")
        stop = cut[-1:] if cut else None
        if not stop:
            continue
        out = llm.generate("", SamplingParams(temperature=2.0, seed=seed, max_tokens=16, ignore_eos=True, stop=[stop]))
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == stop
        assert c.text == full[:full.index(stop)]
