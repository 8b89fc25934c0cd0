"""Generation parameters end to end on stories260K: stops, streaming hold-back, seeds and n,
logprobs, penalties (against transformers' generate), context/generation logits, best_of."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from transformers import LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

from kvpilot import LLM, SamplingParams

PROMPT = "Once upon a time"
# Greedy continuation of PROMPT (40 tokens); its tokens include ' g' 'ir' 'l' and ' little'.
GREEDY = ", there was a little girl named Lily. She loved to play outside in the park. One day, she saw a big, red ball."


@pytest.fixture(scope="module")
def llm(stories_model_dir):
    with LLM(str(stories_model_dir), device="cpu") as engine:
        yield engine


@pytest.fixture(scope="module")
def hf_model(stories_model_dir):
    return LlamaForCausalLM.from_pretrained(stories_model_dir, torch_dtype=torch.float32).eval()


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 40, **kw})


def test_greedy_reference(llm):
    out = llm.generate(PROMPT, _greedy(), use_tqdm=False).outputs[0]
    assert out.text == GREEDY and out.finish_reason == "length" and out.stop_reason is None


@pytest.mark.parametrize("stop,text", [
    ("rl na", ", there was a little gi"),      # starts inside 'ir', spans 'l' and ' named'
    ("ttl", ", there was a li"),                # inside the single token ' little'
    ("Lily.", ", there was a little girl named "),
])
def test_stop_string_inside_and_across_tokens(llm, stop, text):
    out = llm.generate(PROMPT, _greedy(stop=[stop, "never seen"]), use_tqdm=False).outputs[0]
    assert out.text == text and out.finish_reason == "stop" and out.stop_reason == stop
    inc = llm.generate(PROMPT, _greedy(stop=stop, include_stop_str_in_output=True), use_tqdm=False).outputs[0]
    assert inc.text == text + stop


@pytest.mark.parametrize("stop,final", [("Lily. She x", GREEDY), ("Lily.", ", there was a little girl named ")])
def test_streaming_never_sends_text_of_a_stop_string(llm, stop, final):
    async def run():
        seen = []
        async for chunk in llm.generate_async(PROMPT, _greedy(stop=stop), streaming=True):
            seen.append((chunk.outputs[0].text, chunk.outputs[0].text_diff))
        return seen
    seen = asyncio.run(run())
    assert seen[-1][0] == final
    assert "".join(d for _, d in seen) == final
    for text, _ in seen:
        assert final.startswith(text)  # nothing sent is ever retracted
        assert "Lily." not in text or stop != "Lily."
    assert len(seen) > 3  # it really streamed


def test_min_tokens_ignores_an_early_stop_string(llm):
    out = llm.generate(PROMPT, _greedy(stop="."), use_tqdm=False).outputs[0]
    assert out.text == ", there was a little girl named Lily"
    late = llm.generate(PROMPT, _greedy(stop=".", min_tokens=12), use_tqdm=False).outputs[0]
    assert late.text == ", there was a little girl named Lily. She loved to play outside in the park"
    assert late.finish_reason == "stop" and late.stop_reason == "."


def test_stop_token_ids_and_min_tokens(llm):
    ids = llm.generate(PROMPT, _greedy(), use_tqdm=False).outputs[0].token_ids
    period = ids[10]  # '.'
    out = llm.generate(PROMPT, _greedy(stop_token_ids=[period]), use_tqdm=False).outputs[0]
    assert out.token_ids == ids[:11] and out.stop_reason == period and out.finish_reason == "stop"
    late = llm.generate(PROMPT, _greedy(stop_token_ids=[period], min_tokens=11), use_tqdm=False).outputs[0]
    assert len(late.token_ids) >= 12 and period not in late.token_ids[:11]
    assert late.token_ids[-1] == period or late.finish_reason == "length"


def test_n_with_seed_distinct_and_reproducible(llm):
    sp = SamplingParams(temperature=1.0, n=4, seed=7, max_tokens=20)
    a = llm.generate(PROMPT, sp, use_tqdm=False)
    texts = [o.text for o in a.outputs]
    assert len(set(texts)) == 4
    # Same seed, same set, even when other requests share the batches.
    noise = [SamplingParams(temperature=0.7, seed=s, max_tokens=25) for s in range(5)]
    outs = llm.generate([PROMPT] + ["Tom had a dog"] * 5, [sp] + noise, use_tqdm=False)
    assert [o.text for o in outs[0].outputs] == texts
    other = llm.generate(PROMPT, SamplingParams(temperature=1.0, n=4, seed=8, max_tokens=20), use_tqdm=False)
    assert [o.text for o in other.outputs] != texts


def test_logprobs_top_n_under_top_p_and_cumulative(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.05, logprobs=5, seed=1, max_tokens=12)
    out = llm.generate(PROMPT, sp, use_tqdm=False).outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 12
    total = 0.0
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and len(entry) in (5, 6)  # top 5, plus the chosen one if outside them
        ranked = sorted((lp.rank, lp.logprob) for t, lp in entry.items() if lp.rank <= 5)
        assert [r for r, _ in ranked] == [1, 2, 3, 4, 5]
        assert all(a >= b for (_, a), (_, b) in zip(ranked, ranked[1:]))
        assert math.fsum(math.exp(lp.logprob) for lp in entry.values()) <= 1.0 + 1e-5
        total += entry[tok].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_prompt_logprobs_and_context_logits_equal_transformers(llm, hf_model):
    sp = SamplingParams(temperature=0.0, max_tokens=5, prompt_logprobs=2, return_context_logits=True,
                        return_generation_logits=True)
    out = llm.generate("Tom had a red ball", sp, use_tqdm=False)
    ids = out.prompt_token_ids
    gen = out.outputs[0].token_ids
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids + gen])).logits[0].float()
    assert out.context_logits.shape == (len(ids), ref.shape[1])
    torch.testing.assert_close(out.context_logits, ref[:len(ids)], atol=1e-4, rtol=1e-4)
    lps = torch.log_softmax(ref, -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert entry[ids[pos]].logprob == pytest.approx(float(lps[pos - 1, ids[pos]]), abs=1e-4)


def test_generation_logits_equal_transformers(llm, hf_model):
    sp = SamplingParams(temperature=0.0, max_tokens=5, return_generation_logits=True)
    out = llm.generate("Tom had a red ball", sp, use_tqdm=False)
    ids, gen = out.prompt_token_ids, out.outputs[0].token_ids
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids + gen])).logits[0].float()
    gl = out.outputs[0].generation_logits
    assert gl.shape == (5, ref.shape[1])
    torch.testing.assert_close(gl, ref[len(ids) - 1:len(ids) + 4], atol=1e-4, rtol=1e-4)


class _OpenAIPenalties(LogitsProcessor):
    """Reference: logit -= frequency * count + presence * (count > 0) over generated tokens."""

    def __init__(self, prompt_len: int, frequency: float, presence: float, count_prompt: bool = False):
        self.start = 0 if count_prompt else prompt_len
        self.f, self.p = frequency, presence

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        counts.scatter_add_(1, input_ids[:, self.start:], torch.ones_like(input_ids[:, self.start:], dtype=scores.dtype))
        return scores - self.f * counts - self.p * (counts > 0).to(scores.dtype)


def _hf_greedy(hf_model, ids, n, **kw):
    out = hf_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                            eos_token_id=None, **kw)
    return out[0, len(ids):].tolist()


def test_openai_penalties_skip_prompt_tokens(llm, hf_model):
    prompt = "Lily and Lily saw the park. The park was big"
    sp = SamplingParams(temperature=0.0, max_tokens=30, frequency_penalty=0.6, presence_penalty=1.2, ignore_eos=True)
    out = llm.generate(prompt, sp, use_tqdm=False)
    ids = out.prompt_token_ids
    ours = out.outputs[0].token_ids
    ref = _hf_greedy(hf_model, ids, 30, logits_processor=LogitsProcessorList([_OpenAIPenalties(len(ids), 0.6, 1.2)]))
    wrong = _hf_greedy(hf_model, ids, 30, logits_processor=LogitsProcessorList(
        [_OpenAIPenalties(len(ids), 0.6, 1.2, count_prompt=True)]))
    assert ours == ref
    assert wrong != ref  # the prompt matters here, so the test tells the two semantics apart


def test_repetition_penalty_counts_prompt_like_transformers(llm, hf_model):
    prompt = "Lily and Lily saw the park. The park was big"
    sp = SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.5, ignore_eos=True)
    out = llm.generate(prompt, sp, use_tqdm=False)
    ref = _hf_greedy(hf_model, out.prompt_token_ids, 30, repetition_penalty=1.5)
    assert out.outputs[0].token_ids == ref


def test_logit_bias_bad_words_allowed_ids(llm):
    ids = llm.generate(PROMPT, _greedy(), use_tqdm=False).outputs[0].token_ids
    biased = llm.generate(PROMPT, _greedy(logit_bias={ids[0]: -100.0}), use_tqdm=False).outputs[0]
    assert biased.token_ids[0] != ids[0]
    bad = llm.generate(PROMPT, _greedy(bad_words=["Lily", "park"]), use_tqdm=False).outputs[0]
    assert "Lily" not in bad.text and "park" not in bad.text
    allowed = sorted(set(ids[:6]))
    only = llm.generate(PROMPT, _greedy(allowed_token_ids=allowed, max_tokens=15), use_tqdm=False).outputs[0]
    assert set(only.token_ids) <= set(allowed)


def test_best_of_returns_top_n_by_cumulative_logprob(llm):
    sp = SamplingParams(temperature=1.0, n=2, best_of=5, seed=11, max_tokens=10, ignore_eos=True)
    out = llm.generate(PROMPT, sp, use_tqdm=False)
    cands = llm.generate(PROMPT, SamplingParams(temperature=1.0, n=5, seed=11, max_tokens=10, ignore_eos=True,
                                                logprobs=0), use_tqdm=False)
    ranked = sorted(cands.outputs, key=lambda o: o.cumulative_logprob, reverse=True)[:2]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in ranked]
    assert [o.cumulative_logprob for o in out.outputs] == pytest.approx([o.cumulative_logprob for o in ranked])


def test_skip_special_tokens_and_detokenize(llm):
    raw = llm.generate(PROMPT, _greedy(detokenize=False, max_tokens=8), use_tqdm=False).outputs[0]
    assert raw.text == "" and len(raw.token_ids) == 8
