"""FP8 checkpoints in their producers' layouts load and compute what their format defines.

Each checkpoint is built from a random-weight tiny Llama (tests/support/fp8_checkpoints.py): ModelOpt
FP8 (per-tensor weights, static per-tensor inputs, ``lm_head`` and other ``exclude_modules`` in
float32, FP8 KV scales present), compressed-tensors made by its library (FP8_DYNAMIC: per-channel
weights + dynamic per-token inputs; FP8: per-tensor static; weight-only per-channel) and block-wise
FP8 (``weight_block_size: [128, 128]``, ``weight_scale_inv``). kvpilot's teacher-forced
log-probabilities (CPU, float32, chunked prefill then greedy decode over the paged cache) are checked
against transformers running the dequantized weights with each quantized layer's input rounded
through FP8 as the format prescribes (max error 1e-4); the error against the dequantized weights
without input rounding (what activation quantization costs) is measured and bounded. The slow tests
run ModelOpt and block-wise checkpoints with tensor parallelism 2 on CPU against one rank.
"""

from __future__ import annotations

import json

import pytest
import torch

from support.fp8_checkpoints import (block_fp8_checkpoint, compressed_tensors_checkpoint, modelopt_checkpoint,
                                     reference_model)
from support.hf_compare import kvpilot_runner, run_kvpilot

from kvpilot.model.quantization import Fp8LinearMethod, UnquantizedLinearMethod

torch.manual_seed(1)
CALIB = [torch.randint(3, 256, (24,)).tolist() for _ in range(2)]
PROMPT = torch.randint(3, 256, (20,)).tolist()
STEPS = 6


def _check(ckpt, ref, act, bound_unrounded):
    runner = kvpilot_runner(ckpt, max_seq_len=48)
    got, tokens = run_kvpilot(runner, PROMPT, STEPS, chunk=7)
    ids = torch.tensor([PROMPT + tokens[:-1]])
    with torch.no_grad():
        want = reference_model(ref, act)(ids).logits[0]
        plain = reference_model(ref, {"mode": None})(ids).logits[0]
    lp = torch.log_softmax(got, -1)
    err = (lp - torch.log_softmax(want, -1)).abs()
    assert err.max() <= 1e-4, f"max |log-prob error| {err.max():.3g}"
    assert tokens[:-1] == [int(t) for t in want[len(PROMPT) - 1:-1].argmax(-1)]
    unrounded = (lp - torch.log_softmax(plain, -1)).abs().mean().item()
    assert unrounded <= bound_unrounded, f"mean error against unrounded inputs {unrounded:.3g}"
    return runner


def test_modelopt_fp8_with_excluded_modules_and_kv_scales(tmp_path):
    ckpt, ref, act = modelopt_checkpoint(tmp_path, CALIB, kv_fp8=True, exclude=("model.layers.1.mlp.down_proj",))
    runner = _check(ckpt, ref, act, bound_unrounded=0.08)  # measured 0.038 (static per-tensor inputs)
    layers = runner.model.layers
    assert isinstance(layers[0].mlp.down_proj.quant_method, Fp8LinearMethod)
    assert isinstance(layers[1].mlp.down_proj.quant_method, UnquantizedLinearMethod)
    assert layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert layers[0].self_attn.qkv_proj.input_scale.shape == ()
    assert runner.model.kv_cache_scales[0] == {"k": 1.0, "v": 1.0}


@pytest.mark.parametrize("preset, bound", [("FP8_DYNAMIC", 0.07), ("FP8", 0.08), ("W8A16_FP8", 1e-6)])
def test_compressed_tensors_fp8(tmp_path, preset, bound):
    ckpt, ref, act = compressed_tensors_checkpoint(tmp_path, preset, CALIB)
    qc = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    # measured mean errors against unrounded inputs: 0.033 (per token), 0.038 (static), 3e-7 (weight-only)
    _check(ckpt, ref, act, bound_unrounded=bound)


def test_block_fp8_weight_scale_inv(tmp_path):
    ckpt, ref, act = block_fp8_checkpoint(tmp_path)
    runner = _check(ckpt, ref, act, bound_unrounded=1e-5)
    qkv = runner.model.layers[0].self_attn.qkv_proj
    assert qkv.scale_block == (128, 128) and qkv.weight_scale_inv.shape == (4, 2)  # [256 + 128 + 128] x 256


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["modelopt", "block"])
def test_fp8_checkpoints_under_tensor_parallelism_match_one_rank(tmp_path, fmt):
    """TP 2 on CPU (gloo): per-tensor scales sliced with their rows, row-parallel scales whole,
    block scales split by K blocks; greedy tokens and prompt log-probs as one rank's."""
    from kvpilot import LLM, KvCacheConfig, SamplingParams

    if fmt == "modelopt":
        ckpt, _, _ = modelopt_checkpoint(tmp_path, CALIB, kv_fp8=True)
    else:  # 512 intermediate rows: each rank's down projection reads whole 128-column blocks
        ckpt, _, _ = block_fp8_checkpoint(tmp_path, inter=512)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    outs = []
    for tp in (1, 2):
        with LLM(str(ckpt), skip_tokenizer_init=True, tensor_parallel_size=tp, device="cpu", dtype="float32",
                 kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=256), max_batch_size=2) as llm:
            outs.append(llm.generate([PROMPT], params)[0])
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    lp = [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs]
    assert max(abs(a - b) for a, b in zip(*lp)) < 1e-4


@pytest.mark.slow
def test_block_scales_that_a_rank_would_split_are_refused(tmp_path):
    from kvpilot import LLM, KvCacheConfig

    ckpt, _, _ = block_fp8_checkpoint(tmp_path)  # 320 intermediate columns: 160 per rank
    with pytest.raises(Exception, match="scale block"):
        LLM(str(ckpt), skip_tokenizer_init=True, tensor_parallel_size=2, device="cpu", dtype="float32",
            kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=256), max_batch_size=2)
