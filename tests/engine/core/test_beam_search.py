"""Beam search (engine/core/beam_search.py) equals transformers' `generate(num_beams=...)` on a tiny
random Llama, in plain runs, mixed batches, small KV blocks and under preemption."""

from __future__ import annotations


import pytest

from kvpilot import KvCacheConfig, LLM, SamplingParams
from support.beams import PROMPTS, tiny, _hf_beams, _check  # noqa: F401  (fixtures)

EOS, PAD = 2, 0
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
