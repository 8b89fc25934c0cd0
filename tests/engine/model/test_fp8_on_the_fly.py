"""On-the-fly FP8 (``QuantConfig(quant_algo="FP8")``, ``kvpilot serve --quantization fp8``) and the
refusal of quantization schemes kvpilot does not run.

On the fly, every linear layer's weight is quantized at load with one scale per output channel
(``amax(|W[n]|) / 448``) and inputs per token; checked against transformers on the same
dequantized weights with per-token FP8 input rounding (max log-prob error 1e-4, CPU float32), the
LM head left in float32. ``kv_cache_quant_algo="FP8"`` selects the FP8 KV cache."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from support.engine import make_tiny_llama
from support.fp8_checkpoints import per_channel_fp8_reference

from kvpilot import LLM, KvCacheConfig, SamplingParams
from kvpilot.llmapi import QuantAlgo, QuantConfig
from kvpilot.model.quantization import UnsupportedQuantizationError, get_quantization_method

def test_quant_config_fp8_matchesper_channel_fp8_reference(tmp_path):
    path = make_tiny_llama(tmp_path / "m", layers=2)
    prompt = [1, 17, 33, 5, 90, 41, 7, 250, 12, 3]
    llm = LLM(str(path), skip_tokenizer_init=True, device="cpu", dtype="float32",
              kv_cache_config=KvCacheConfig(max_tokens=256, tokens_per_block=8),
              quant_config=QuantConfig(quant_algo=QuantAlgo.FP8, kv_cache_quant_algo="FP8"))
    try:
        assert llm.kv_cache_config.dtype == "fp8"
        runner = llm._executor
        qkv = runner.model.layers[0].self_attn.qkv_proj
        assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale.shape == (qkv.output_size,)
        assert runner.model.lm_head.dtype == torch.float32
        out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True))[0]
    finally:
        llm.shutdown()
    tokens = out.outputs[0].token_ids
    assert len(tokens) == 6
    # (the FP8 KV cache rounds keys and values as well; the exact-cache test below checks log-probs)
    with torch.no_grad():
        logits = per_channel_fp8_reference(path)(torch.tensor([prompt])).logits[0]
    assert tokens[0] == int(logits[-1].argmax())


def test_quant_config_fp8_logprobs_exact_cache(tmp_path):
    from support.hf_compare import run_kvpilot
    from kvpilot.model.config import ModelConfig
    from kvpilot.runner.model_runner import ModelRunner

    path = make_tiny_llama(tmp_path / "m", layers=2)
    cfg = ModelConfig.from_dir(path)
    cfg.quantization = QuantConfig(quant_algo="FP8").to_dict()
    runner = ModelRunner(path, cfg, KvCacheConfig(tokens_per_block=8, max_tokens=256), max_num_tokens=64,
                         max_batch_size=2, max_seq_len=48, device="cpu", dtype="float32")
    prompt = [1, 17, 33, 5, 90, 41, 7, 250, 12, 3, 77, 4]
    got, tokens = run_kvpilot(runner, prompt, 6, chunk=5)
    with torch.no_grad():
        want = per_channel_fp8_reference(path)(torch.tensor([prompt + tokens[:-1]])).logits[0]
    err = (torch.log_softmax(got, -1) - torch.log_softmax(want, -1)).abs().max()
    assert err <= 1e-4, f"max |log-prob error| {err:.3g}"


def test_serve_quantization_flag_builds_quant_config():
    from kvpilot.server.cli import _engine_kwargs, configure_parser

    parser = argparse.ArgumentParser()
    configure_parser(parser)
    kw = _engine_kwargs(parser.parse_args(["some/model", "--quantization", "fp8"]))
    assert kw["quant_config"].quant_algo == "FP8"
    assert "quant_config" not in _engine_kwargs(parser.parse_args(["some/model"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["some/model", "--quantization", "awq"])


@pytest.mark.parametrize("algo", ["NVFP4", QuantAlgo.W4A16_AWQ, "W8A8_SQ_PER_CHANNEL"])
def test_quant_config_refuses_other_algorithms(algo):
    with pytest.raises(UnsupportedQuantizationError, match="quant_algo='FP8' only"):
        QuantConfig(quant_algo=algo)
    with pytest.raises(UnsupportedQuantizationError, match="kv_cache_quant_algo"):
        QuantConfig(kv_cache_quant_algo="INT8")


@pytest.mark.parametrize("bad", [5, "model.layers.0.*", ["lm_head", 3]])
def test_exclude_modules_of_the_wrong_type_is_a_value_error_naming_the_field(bad):
    with pytest.raises(ValueError, match="exclude_modules must be a list of module names"):
        QuantConfig(quant_algo="FP8", exclude_modules=bad)
    assert QuantConfig(quant_algo="FP8", exclude_modules=("lm_head",)).exclude_modules == ["lm_head"]


def test_kv_cache_quant_algo_conflicting_with_kv_dtype():
    with pytest.raises(ValueError, match="conflicts"):
        QuantConfig(kv_cache_quant_algo="FP8").kv_cache_dtype(KvCacheConfig(dtype="bfloat16"))
    assert QuantConfig().kv_cache_dtype(KvCacheConfig(dtype="bfloat16")) == "bfloat16"


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, r"'awq' \(4-bit\) is not supported; supported: ModelOpt"),
    ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "quant_algo 'NVFP4' is not supported"),
    ({"quant_method": "modelopt", "quant_algo": "W4A16_AWQ"}, "'W4A16_AWQ'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}, "'pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"type": "int", "num_bits": 8, "strategy": "channel"}}}}, "int 8-bit"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "e5m2"),
])
def test_unsupported_checkpoint_schemes_name_what_is_supported(qc, match):
    with pytest.raises(UnsupportedQuantizationError, match=match):
        get_quantization_method({"quantization_config": qc})


def test_unsupported_checkpoint_fails_llm_construction(tmp_path):
    path = make_tiny_llama(tmp_path / "m", layers=1)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedQuantizationError, match="awq"):
        LLM(str(path), skip_tokenizer_init=True, device="cpu")


def test_partly_ignored_merged_layer_is_refused(tmp_path):
    from kvpilot.model.config import ModelConfig
    from kvpilot.model.llama import LlamaForCausalLM

    path = make_tiny_llama(tmp_path / "m", layers=1)
    cfg = ModelConfig.from_dir(path)
    cfg.raw["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8",
                                      "exclude_modules": ["lm_head", "model.layers.0.self_attn.k_proj"]}
    with torch.device("meta"), pytest.raises(UnsupportedQuantizationError, match="k_proj"):
        LlamaForCausalLM(cfg)
