"""Tensor/pipeline parallelism on two GPUs (NCCL): the early answer through the interprocess logits
event gives the same tokens and logprobs as the synchronizing answer, and step timing reports the
GPU phases; pipeline stages replaying decode CUDA graphs give the eager stages' greedy tokens.
Skipped without two CUDA GPUs; ``benchmarks/lab/gpu_tp_profile.py`` has the 8B-shape numbers."""

from __future__ import annotations

import json

import pytest
import torch

from kvpilot import LLM, KvCacheConfig, SamplingParams
from support.parallel_gpu import SHAPE, model_dir  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

def _run(model_dir, tp, pp, monkeypatch, env):
    monkeypatch.setenv("KVPILOT_TUNING", json.dumps(env))
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
    monkeypatch.delenv("KVPILOT_TUNING")
    return ([o.outputs[0].token_ids for o in outs], [o.outputs[0].cumulative_logprob for o in outs], single,
            timing, mode)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_event_answer_matches_synchronized_answer(model_dir, monkeypatch, tp, pp):
    from kvpilot.parallel.worker import LOGITS_EVENT, LOGITS_SYNC

    new = _run(model_dir, tp, pp, monkeypatch, {"step_timing": True})
    old = _run(model_dir, tp, pp, monkeypatch, {"logits_event": False, "pipe_spin_us": 0})
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


def _run_graphs(model_dir, tp, pp, monkeypatch, env):
    """float32 PP run: (batch tokens, batch per-token top-2 logprob dicts, single-request tokens, step timing)."""
    monkeypatch.setenv("KVPILOT_TUNING", json.dumps({"step_timing": True, **env}))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, SHAPE["vocab_size"], (n,), generator=g).tolist() for n in (5, 33, 120, 9, 64, 17, 3)]
    with LLM(str(model_dir), skip_tokenizer_init=True, tensor_parallel_size=tp, pipeline_parallel_size=pp,
             device="cuda", dtype="float32", max_batch_size=16, max_seq_len=1024,
             kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=0.3)) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
                            use_tqdm=False)
        # Single requests: every decode step is one sequence (graph batch 1, no padding), and the
        # steps are the same in both runs, so the tokens must agree exactly.
        single = [llm.generate(p, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)).outputs[0].token_ids
                  for p in prompts[:3]]
        timing = llm._executor.step_timing()
    monkeypatch.delenv("KVPILOT_TUNING")
    return ([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs], single, timing)


@pytest.mark.parametrize("tp,pp", [(1, 2), pytest.param(2, 2, marks=pytest.mark.skipif(
    torch.cuda.device_count() < 4, reason="TP 2 x PP 2 needs four CUDA GPUs"))])
def test_pipeline_stage_graphs_match_eager_stages(model_dir, monkeypatch, tp, pp):
    graph = _run_graphs(model_dir, tp, pp, monkeypatch, {})
    eager = _run_graphs(model_dir, tp, pp, monkeypatch, {"pp_cuda_graphs": False})
    ranks_g, ranks_e = graph[3]["ranks"], eager[3]["ranks"]
    assert sorted(ranks_g) == list(range(tp * pp))
    # Graphs replayed on every rank (3 single requests x 15 decode steps at least), none when off.
    assert all(ranks_g[r].get("stage_graph", {}).get("n", 0) >= 45 for r in ranks_g), ranks_g
    assert all("stage_graph" not in ranks_e[r] for r in ranks_e), ranks_e
    assert graph[2] == eager[2]
    # The batch's requests reach the engine while it runs, so their grouping into steps (and with it
    # the padding and the rounding of each step) can differ between the runs: tokens must agree up
    # to a near-tie, where both runs' tokens are the eager run's top two within 1e-3 in logprob.
    for toks_g, toks_e, lps_g, lps_e in zip(graph[0], eager[0], graph[1], eager[1]):
        assert len(toks_g) == len(toks_e) == 24
        i = next((j for j, (a, b) in enumerate(zip(toks_g, toks_e)) if a != b), 24)
        for j in range(i):
            assert lps_g[j][toks_g[j]].logprob == pytest.approx(lps_e[j][toks_e[j]].logprob, abs=1e-3)
        if i < 24:
            top = lps_e[i]
            assert toks_g[i] in top, (i, toks_g[i], toks_e[i], top)
            assert abs(top[toks_g[i]].logprob - top[toks_e[i]].logprob) < 1e-3, (i, top)
