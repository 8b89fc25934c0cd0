"""Tensor x pipeline parallel `LLM` on CPU (gloo) reproduces the single-process engine.

One `LLM` per layout; each runs the same workloads as the single-process reference: greedy text of
stories260K (with preemption and block reuse), seeded sampling with logprobs, prompt logprobs, and
greedy tokens of a random tiny Llama (odd vocabulary, untied head, sharded checkpoint), which are
also checked against transformers.
"""

from __future__ import annotations

import pytest
from support.engine import GOLDEN, hf_greedy, make_tiny_llama
from support.parallel import (TINY_PROMPTS, TINY_STEPS, run_stories_workload, run_tiny_workload,
                              stories_kv_config)

from kvpilot import LLM

pytestmark = pytest.mark.timeout(180)

LAYOUTS = [(2, 1), (1, 2), (2, 2)]


@pytest.fixture(scope="module")
def stories_reference(stories_model_dir):
    with LLM(str(stories_model_dir), kv_cache_config=stories_kv_config(), max_seq_len=256, device="cpu") as llm:
        ref = run_stories_workload(llm)
    # The workload must exercise what it claims to.
    assert ref.greedy_text[0] == GOLDEN[:len(ref.greedy_text[0])] and len(ref.greedy_text[0]) > 50
    assert ref.preemptions > 0
    assert ref.reused_blocks > 0
    return ref


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    # vocab 385 does not split evenly (padded shards); 3 layers give PP 2 stages of 2 + 1.
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_par"), seed=3, vocab=385, layers=3, shards=True)


@pytest.fixture(scope="module")
def tiny_reference(tiny_model):
    with LLM(str(tiny_model), skip_tokenizer_init=True, device="cpu") as llm:
        toks, lps = run_tiny_workload(llm)
    assert toks == hf_greedy(tiny_model, TINY_PROMPTS, TINY_STEPS)
    return toks, lps


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{t}pp{p}" for t, p in LAYOUTS])
def test_stories_layout_matches_single_process(stories_model_dir, stories_reference, tp, pp):
    with LLM(str(stories_model_dir), tensor_parallel_size=tp, pipeline_parallel_size=pp,
             kv_cache_config=stories_kv_config(), max_seq_len=256, device="cpu") as llm:
        assert llm._executor.num_blocks == 16
        got = run_stories_workload(llm)
    ref = stories_reference
    assert got.greedy_text == ref.greedy_text
    assert got.greedy == ref.greedy
    assert got.reused == ref.reused
    assert got.preemptions == ref.preemptions
    assert got.reused_blocks == ref.reused_blocks
    assert got.sampled == ref.sampled
    assert got.sampled_logprobs == pytest.approx(ref.sampled_logprobs, abs=1e-4)
    assert got.prompt_logprobs == pytest.approx(ref.prompt_logprobs, abs=1e-4)


@pytest.mark.parametrize("tp,pp", LAYOUTS + [pytest.param(4, 1, marks=pytest.mark.slow)],
                         ids=[f"tp{t}pp{p}" for t, p in LAYOUTS] + ["tp4pp1"])
def test_tiny_llama_layout_matches_single_process(tiny_model, tiny_reference, tp, pp):
    # tp 4 > 2 KV heads: each KV head is replicated on two ranks.
    with LLM(str(tiny_model), skip_tokenizer_init=True, tensor_parallel_size=tp, pipeline_parallel_size=pp,
             device="cpu") as llm:
        toks, lps = run_tiny_workload(llm)
    assert toks == tiny_reference[0]
    assert lps == pytest.approx(tiny_reference[1], abs=1e-4)
