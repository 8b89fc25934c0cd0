"""Tensor/pipeline parallelism on two GPUs (NCCL): the early answer through the interprocess logits
event gives the same tokens and logprobs as the synchronizing answer, and step timing reports the
GPU phases. Skipped without two CUDA GPUs; ``benchmarks/gpu_tp_profile.py`` has the 8B-shape numbers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvpilot import LLM, KvCacheConfig, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

# Llama-shaped and big enough that a step's GPU time dwarfs the launch (so an answer before the
# GPU finished is actually exercised), small enough to load in seconds.
SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-5,
             rope_theta=10000.0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from gpu_random_model import write_random_llama

    return write_random_llama(tmp_path_factory.mktemp("par_gpu") / "m", SHAPE, device="cuda", std=0.05)


def _run(model_dir, tp, pp, monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, SHAPE["vocab_size"], (n,), generator=g).tolist() for n in (5, 33, 120, 9, 64, 17)]
    with LLM(str(model_dir), skip_tokenizer_init=True, tensor_parallel_size=tp, pipeline_parallel_size=pp,
             device="cuda", max_batch_size=16, max_seq_len=1024,
             kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=0.3)) as llm:
        ex = llm._executor
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0),
                            use_tqdm=False)
        # Single requests too: batch-1 steps answer fastest, before most of the GPU work.
        single = [llm.generate(p, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)).outputs[0].token_ids
                  for p in prompts[:2]]
        timing = ex.step_timing()
        mode = ex.logits_mode
    for k in env:
        monkeypatch.delenv(k)
    return ([o.outputs[0].token_ids for o in outs], [o.outputs[0].cumulative_logprob for o in outs], single,
            timing, mode)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_event_answer_matches_synchronized_answer(model_dir, monkeypatch, tp, pp):
    from kvpilot.parallel_worker import LOGITS_EVENT, LOGITS_SYNC

    new = _run(model_dir, tp, pp, monkeypatch, {"KVPILOT_STEP_TIMING": "1"})
    old = _run(model_dir, tp, pp, monkeypatch, {"KVPILOT_LOGITS_EVENT": "0", "KVPILOT_PIPE_SPIN_US": "0"})
    assert (new[4], old[4]) == (LOGITS_EVENT, LOGITS_SYNC)
    # The batch's requests reach the engine one by one while it runs, so how they are grouped into
    # steps (and so the bf16 rounding of each step's matrix products) depends on timing: on these
    # random weights greedy tokens may then part at a near-tie.
    # Only the lengths are compared there; single requests run alone, in the same steps each time.
    assert [len(t) for t in new[0]] == [len(t) for t in old[0]] == [24] * 6
    assert new[2] == old[2]
    out_rank = (pp - 1) * tp
    ranks = new[3]["ranks"]
    assert "gpu_done_after_answer" in ranks[out_rank]
    assert all("gpu_done" in ranks[r] for r in ranks if r != out_rank)
    assert old[3] == {"front_end": {}, "ranks": {r: {} for r in ranks}}  # timing off: nothing recorded
