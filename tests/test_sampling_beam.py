"""Beam search (engine/core/beam_search.py) equals transformers' `generate(num_beams=...)` on a tiny
random Llama, in plain runs, mixed batches, small KV blocks and under preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvpilot import KvCacheConfig, LLM, SamplingParams

EOS, PAD = 2, 0
PROMPTS = [[1, 5, 9, 11], [1, 40, 41], [1, 7]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, LlamaForCausalLM]:
    torch.manual_seed(0)
    # initializer_range 0.2 makes the distributions peaked enough that float32 rounding of a
    # different (paged) attention never reorders two candidates.
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.2, bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    d = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(d)
    return d, model


def _hf_beams(model, prompt, width, n, length_penalty, max_tokens):
    out = model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=n,
                         length_penalty=length_penalty, max_new_tokens=max_tokens, do_sample=False,
                         early_stopping=False, return_dict_in_generate=True, output_scores=True,
                         pad_token_id=PAD, eos_token_id=EOS)
    return [out.sequences[i, len(prompt):].tolist() for i in range(n)], out.sequences_scores.tolist()


def _check(out, ref_seqs, ref_scores, length_penalty):
    assert len(out.outputs) == len(ref_seqs)
    for o, hf, score in zip(out.outputs, ref_seqs, ref_scores):
        # HF pads finished hypotheses with pad_token_id, or EOS when the pad id is 0.
        assert hf[:len(o.token_ids)] == o.token_ids
        assert all(t in (PAD, EOS) for t in hf[len(o.token_ids):])
        assert o.cumulative_logprob / len(o.token_ids) ** length_penalty == pytest.approx(score, abs=1e-3)
        assert o.finish_reason == ("stop" if o.token_ids[-1] == EOS else "length")


CASES = [(4, 2, 1.0, 12), (3, 3, 0.5, 20), (2, 1, 2.0, 30), (5, 5, -1.0, 16)]


@pytest.mark.parametrize("width,n,length_penalty,max_tokens", CASES)
def test_beam_search_equals_transformers(tiny, width, n, length_penalty, max_tokens):
    d, model = tiny
    with LLM(str(d), skip_tokenizer_init=True, device="cpu") as llm:
        sp = SamplingParams(use_beam_search=True, best_of=width, n=n, length_penalty=length_penalty,
                            max_tokens=max_tokens)
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    saw_stop = False
    for prompt, out in zip(PROMPTS, outs):
        ref_seqs, ref_scores = _hf_beams(model, prompt, width, n, length_penalty, max_tokens)
        _check(out, ref_seqs, ref_scores, length_penalty)
        saw_stop |= any(o.finish_reason == "stop" for o in out.outputs)
    if (width, n) in ((3, 3), (5, 5)):
        assert saw_stop  # these cases exercise finished hypotheses and the early-stop heuristic


def test_beam_search_small_blocks_preemption_and_mixed_batch(tiny):
    """Blocks of 4 tokens (forks share full blocks, recompute the partial one), a pool small
    enough to preempt, and sampled requests in the same batches: beams still equal HF's."""
    d, model = tiny
    kv = KvCacheConfig(tokens_per_block=4, max_tokens=96)
    with LLM(str(d), skip_tokenizer_init=True, device="cpu", kv_cache_config=kv) as llm:
        beam = SamplingParams(use_beam_search=True, best_of=4, n=2, max_tokens=14)
        other = SamplingParams(temperature=0.8, seed=3, max_tokens=14, ignore_eos=True)
        outs = llm.generate(PROMPTS + PROMPTS, [beam] * 3 + [other] * 3, use_tqdm=False)
        alone = llm.generate(PROMPTS[0], other, use_tqdm=False)
        stats = llm._core.kv
        assert stats.num_used_blocks == 0  # every block of every beam was returned
        preemptions = llm._core.scheduler.num_preemptions
    for prompt, out in zip(PROMPTS, outs[:3]):
        _check(out, *_hf_beams(model, prompt, 4, 2, 1.0, 14), 1.0)
    assert outs[3].outputs[0].token_ids == alone.outputs[0].token_ids  # seeded, batch-independent
    assert preemptions > 0
