"""Two GPUs (NCCL), bf16, a Llama-shaped random model: PP 2 gives one GPU's greedy tokens
and logprobs exactly (its stages pad prefill steps as one GPU's prefill graphs do, so every kernel
sees one GPU's shapes), and TP 2 with the float32 row-parallel reduction (``Tuning(tp_reduce_fp32=True)``,
off by default) is closer to one GPU than without. One request at a time, so every layout runs the same
steps. Skipped without two CUDA GPUs; the Llama-3.1-8B-shape numbers: ``benchmarks/gpu_tp_greedy.py``."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from kvpilot import LLM, KvCacheConfig, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-5,
             rope_theta=10000.0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
LENGTHS = (5, 33, 120, 9, 250)  # prefill buckets 16, 64, 128, 16, 256
TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kvpilot.tools.random_model import write_random_llama

    return write_random_llama(tmp_path_factory.mktemp("exact_gpu") / "m", SHAPE, device="cuda", std=0.05)


def _greedy(model_dir, tp, pp, monkeypatch, env=None):
    monkeypatch.setenv("KVPILOT_TUNING", json.dumps(env or {}))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, SHAPE["vocab_size"], (n,), generator=g).tolist() for n in LENGTHS]
    with LLM(str(model_dir), skip_tokenizer_init=True, tensor_parallel_size=tp, pipeline_parallel_size=pp,
             device="cuda", dtype="bfloat16", max_batch_size=8, max_seq_len=1024,
             kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=0.3)) as llm:
        outs = [llm.generate(p, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=0))
                for p in prompts]
    monkeypatch.delenv("KVPILOT_TUNING")
    return ([o.outputs[0].token_ids for o in outs],
            [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in outs])


def _logprob_diffs(ref, got) -> list[float]:
    """|logprob difference| of the chosen tokens over each prompt's common prefix."""
    out = []
    for ta, tb, la, lb in zip(ref[0], got[0], ref[1], got[1]):
        d = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        out += [abs(u - v) for u, v in zip(la[:d], lb[:d])]
    return out


@pytest.fixture(scope="module")
def one_gpu(model_dir):
    mp = pytest.MonkeyPatch()
    try:
        return _greedy(model_dir, 1, 1, mp)
    finally:
        mp.undo()


def test_pp2_bf16_is_one_gpu_exactly(model_dir, one_gpu, monkeypatch):
    got = _greedy(model_dir, 1, 2, monkeypatch)
    assert got[0] == one_gpu[0]
    assert got[1] == one_gpu[1]


def test_tp2_fp32_reduce_is_closer_to_one_gpu_than_bf16_reduce(model_dir, one_gpu, monkeypatch):
    fp32 = _greedy(model_dir, 2, 1, monkeypatch, {"tp_reduce_fp32": True})
    bf16 = _greedy(model_dir, 2, 1, monkeypatch, {"tp_reduce_fp32": False})
    d32, d16 = _logprob_diffs(one_gpu, fp32), _logprob_diffs(one_gpu, bf16)
    same32 = sum(a == b for a, b in zip(fp32[0], one_gpu[0]))
    same16 = sum(a == b for a, b in zip(bf16[0], one_gpu[0]))
    msg = (f"identical prompts fp32 {same32} bf16 {same16}; logprob diff max/mean fp32 {max(d32):.2e}/"
           f"{statistics.fmean(d32):.2e} bf16 {max(d16):.2e}/{statistics.fmean(d16):.2e}")
    assert same32 >= same16, msg
    assert max(d32) < max(d16) and statistics.fmean(d32) < statistics.fmean(d16), msg
