"""Asynchronous tensor-parallel steps on two GPUs (NCCL, CUDA graphs, CUDA IPC ids and events).

TP 2 with asynchronous steps (the default on CUDA) against the same layout with settled steps
(``Tuning(tp_async=False)``): a request alone in the engine gets exactly the same tokens and logprobs
(the same graphs at the same shapes), steps really overlapped (greedy ones fed by the output
rank's own arg-max, `SYNC_SELF`), and a batch of seeded, filtered and
greedy requests finishes with the same lengths (its batches differ by the dropped step computed for
a sequence that ends, so bf16 rounding may differ). Skipped without two CUDA GPUs.
"""

from __future__ import annotations

import pytest
import torch
from support.parallel_gpu import SHAPE, model_dir  # noqa: F401  (the module fixture)

from kvpilot import LLM, KvCacheConfig, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


def _run(model_dir, monkeypatch, tp_async: str):  # noqa: F811
    monkeypatch.setenv("KVPILOT_TUNING", '{"tp_async": %s}' % ("true" if tp_async == "1" else "false"))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, SHAPE["vocab_size"], (n,), generator=g).tolist() for n in (5, 33, 120, 9, 64, 17)]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True, top_p=0.9),
              SamplingParams(temperature=1.0, seed=4, max_tokens=12, ignore_eos=True, top_k=50),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.7, seed=5, max_tokens=20, ignore_eos=True, min_p=0.05),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    with LLM(str(model_dir), skip_tokenizer_init=True, tensor_parallel_size=2, device="cuda",
             max_batch_size=16, max_seq_len=1024, kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=0.3)) as llm:
        deferred = llm._executor.defers_logits
        single = []
        for p in prompts[:3]:  # with logprobs: the front end samples (and the ids go back to the workers)
            o = llm.generate(p, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1),
                             use_tqdm=False).outputs[0]
            single.append((o.token_ids, [next(iter(lp.values())).logprob for lp in o.logprobs]))
        for p in prompts[3:]:  # ids only: arg-max steps on the output rank
            o = llm.generate(p, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                             use_tqdm=False).outputs[0]
            single.append((o.token_ids, []))
        overlapped = llm._core.num_overlapped_steps
        self_steps = getattr(llm._executor, "num_self_steps", 0)
        batch = llm.generate(prompts, params, use_tqdm=False)
    return deferred, (overlapped, self_steps), single, [len(o.outputs[0].token_ids) for o in batch]


def test_async_tp2_matches_settled_tp2(model_dir, monkeypatch):  # noqa: F811
    deferred, overlapped, single, lengths = _run(model_dir, monkeypatch, "1")
    s_deferred, s_overlapped, s_single, s_lengths = _run(model_dir, monkeypatch, "0")
    assert deferred and not s_deferred
    assert overlapped[0] >= 6 * 30 and s_overlapped[0] == 0
    assert overlapped[1] >= 3 * 28  # ids only: the output rank's own arg-max fed the next step
    assert [t for t, _ in single] == [t for t, _ in s_single]
    for (_, lp), (_, slp) in zip(single, s_single):
        assert lp == pytest.approx(slp, abs=1e-5)
    assert lengths == s_lengths == [24, 30, 12, 40, 20, 8]
