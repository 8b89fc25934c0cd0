"""An MoE model split over two CPU processes (gloo) gives the single-process float32 greedy tokens:
tensor parallelism of the experts (each expert's intermediate dimension halved) and expert
parallelism 2 (each rank two whole experts of four); layouts that do not split fail before any
worker starts, naming the constraint. The two-process runs are marked slow (``make test`` skips them;
``pytest -m slow tests/engine/model/test_moe_parallel.py`` runs them, about a minute)."""

from __future__ import annotations

import pytest

from support.hf_compare import random_checkpoint

PROMPTS = [[1, 5, 9, 13, 2, 40], [1, 7, 7, 30, 22, 11, 3, 60, 8]]


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                         shared_expert_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                         bos_token_id=1)
    return random_checkpoint(tmp_path_factory.mktemp("qwen2_moe") / "m", Qwen2MoeForCausalLM, cfg, seed=4, std=0.2)


def _tokens(path, ep=1, **kwargs):
    from kvpilot.llmapi import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(str(path), device="cpu", dtype="float32", skip_tokenizer_init=True, max_seq_len=32, **kwargs) as llm:
        assert llm.model_config.moe_expert_parallel_size == ep  # what the workers build from
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def one_process(qwen2_moe):
    want = _tokens(qwen2_moe)
    assert all(len(t) == 12 for t in want) and len({x for t in want for x in t}) > 3
    return want


@pytest.mark.slow  # two worker processes (~10 s of CPU); the split's arithmetic: test_moe_block.py
def test_ep2_reproduces_one_process(qwen2_moe, one_process):
    assert _tokens(qwen2_moe, ep=2, tensor_parallel_size=2, moe_expert_parallel_size=2) == one_process


@pytest.mark.slow
def test_tp2_of_every_expert_reproduces_one_process(qwen2_moe, one_process):
    assert _tokens(qwen2_moe, tensor_parallel_size=2) == one_process
    assert _tokens(qwen2_moe, ep=1, tensor_parallel_size=2, moe_tensor_parallel_size=2) == one_process


def test_layouts_that_do_not_split_fail_before_workers_start(qwen2_moe):
    from kvpilot.llmapi import LLM

    with pytest.raises(ValueError, match="moe_expert_parallel_size 8 must divide num_experts 4"):
        LLM(str(qwen2_moe), device="cpu", tensor_parallel_size=8, moe_expert_parallel_size=8, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="moe_tensor_parallel_size=2 x moe_expert_parallel_size=2 must equal "
                                         "tensor_parallel_size=2"):
        LLM(str(qwen2_moe), device="cpu", tensor_parallel_size=2, moe_expert_parallel_size=2,
            moe_tensor_parallel_size=2, skip_tokenizer_init=True)
