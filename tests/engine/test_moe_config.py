"""`MoeConfig` and the MoE layout arguments of `LLM` (TensorRT-LLM's names): accepted values reach
the model's MoE blocks, the others are errors that name what is supported, before any weight loads."""

from __future__ import annotations

import pytest

from support.hf_compare import random_checkpoint


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=64, bos_token_id=1)
    return random_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), Qwen3MoeForCausalLM, cfg, seed=1, std=0.2)


def test_moe_config_is_importable_where_tensorrt_llm_has_it():
    from kvpilot import MoeConfig as top
    from kvpilot.llmapi import MoeConfig

    assert MoeConfig is top and MoeConfig().backend == "TRITON" and MoeConfig(backend="torch").backend == "TORCH"
    for seed_value in ("CUTLASS", "TRTLLM", "DEEPGEMM"):
        with pytest.raises(ValueError, match=f"MoE backend '{seed_value}' is not supported; kvpilot implements "
                                             f"'TRITON', 'TORCH'"):
            MoeConfig(backend=seed_value)


@pytest.mark.parametrize("kwargs,match", [
    (dict(moe_expert_parallel_size=2), "moe_expert_parallel_size=2 must divide tensor_parallel_size=1"),
    (dict(moe_tensor_parallel_size=2), "moe_tensor_parallel_size=2 must divide tensor_parallel_size=1"),
    (dict(tensor_parallel_size=4, moe_tensor_parallel_size=4, moe_expert_parallel_size=2),
     "moe_tensor_parallel_size=4 x moe_expert_parallel_size=2 must equal tensor_parallel_size=4"),
    (dict(moe_expert_parallel_size=0), "moe_expert_parallel_size must be an integer >= 1"),
    (dict(moe_config="TRITON"), "moe_config must be a kvpilot.llmapi.MoeConfig"),
])
def test_unsupported_moe_layouts_fail_before_loading(kwargs, match):
    from kvpilot.llmapi import LLM

    with pytest.raises((ValueError, TypeError), match=match):
        LLM("/nonexistent/model", device="cpu", **kwargs)  # raised before the path is looked at


def test_expert_parallel_size_follows_from_the_other_two():
    from kvpilot.config import check_moe_parallelism

    assert check_moe_parallelism(4, None, None) == 1
    assert check_moe_parallelism(4, None, 1) == 4 and check_moe_parallelism(4, 2, None) == 2
    assert check_moe_parallelism(8, 4, 2) == 4


def test_expert_parallelism_of_a_dense_model_is_refused(qwen3_moe):
    from dataclasses import replace

    from kvpilot.model.config import ModelConfig
    from kvpilot.model.moe import check_moe_layout

    cfg = replace(ModelConfig.from_dir(qwen3_moe), moe_expert_parallel_size=2)
    check_moe_layout(cfg, 2)
    with pytest.raises(ValueError, match="moe_expert_parallel_size=2 needs a mixture-of-experts model; "
                                         "LlamaForCausalLM is dense"):
        check_moe_layout(replace(cfg, architecture="LlamaForCausalLM"), 2)


def test_llm_moe_backend_reaches_the_blocks(qwen3_moe):
    from kvpilot.llmapi import LLM, MoeConfig, SamplingParams
    from kvpilot.model.moe import SparseMoeBlock

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(qwen3_moe), device="cpu", skip_tokenizer_init=True, max_seq_len=32,
             moe_config=MoeConfig(backend="torch"), moe_expert_parallel_size=1, moe_tensor_parallel_size=1) as llm:
        blocks = [m for m in llm._executor.model.modules() if isinstance(m, SparseMoeBlock)]
        assert len(blocks) == 1 and blocks[0].backend == "TORCH" and llm.model_config.moe_backend == "TORCH"
        out = llm.generate([[1, 5, 9, 13]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == 8


def test_serve_flags_become_the_llm_arguments():
    import argparse

    from kvpilot.server.cli import _engine_kwargs, configure_parser, preflight

    parser = argparse.ArgumentParser()
    configure_parser(parser)
    kw = _engine_kwargs(parser.parse_args(["some/model", "--moe-backend", "torch", "--tensor-parallel-size", "4",
                                           "--moe-expert-parallel-size", "2"]))
    assert kw["moe_config"].backend == "TORCH" and kw["moe_expert_parallel_size"] == 2
    assert "moe_tensor_parallel_size" not in kw
    assert _engine_kwargs(parser.parse_args(["some/model"]))["moe_config"].backend == "TRITON"
    with pytest.raises(SystemExit):  # argparse's usage error names the choices
        parser.parse_args(["some/model", "--moe-backend", "CUTLASS"])
    bad = parser.parse_args(["some/model", "--device", "cpu", "--tensor-parallel-size", "2",
                             "--moe-expert-parallel-size", "4"])
    with pytest.raises(ValueError, match="moe_expert_parallel_size=4 must divide tensor_parallel_size=2"):
        preflight(bad)
