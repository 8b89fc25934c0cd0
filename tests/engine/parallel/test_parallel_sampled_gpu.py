"""Sampled requests drawn by the TP output rank on two GPUs (NCCL, CUDA graphs, the Triton sampler).

The same batch of seeded, filtered requests (top-p, top-k, min-p, plain temperature, greedy; n > 1;
different lengths) on TP 2 with asynchronous steps, once with the output rank drawing every step
(`Worker.own_step`, the default) and once with the front end's sampler (``Tuning(tp_rank_sampling=False)``).
Both run the same plans, so the same logits: the tokens must be equal bit for bit, and the first
run's steps really were drawn (and fed to the next step) by the output rank. The second test drives
the engine by hand (the same events at the same steps in both runs): arrivals and aborts mid-flight,
chunked prefill, a logprobs request (``SYNC_GO`` steps and back), flat distributions and preemption
in a small pool. Skipped without two CUDA GPUs. Run:
``python3 -m pytest -q -s -m gpu tests/engine/parallel/test_parallel_sampled_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from support.parallel_gpu import SHAPE, model_dir  # noqa: F401  (the module fixture)

from kvpilot import LLM, KvCacheConfig, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

_PARAMS = [SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=48, ignore_eos=True),
           SamplingParams(temperature=1.0, top_k=50, seed=2, max_tokens=30, ignore_eos=True),
           SamplingParams(temperature=0.7, min_p=0.05, seed=3, max_tokens=40, ignore_eos=True),
           SamplingParams(n=2, temperature=0.9, top_k=100, top_p=0.8, seed=4, max_tokens=36, ignore_eos=True),
           SamplingParams(temperature=1.1, seed=5, max_tokens=20, ignore_eos=True),
           SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]


def _run(model_dir, monkeypatch, rank_sampling: str):  # noqa: F811
    monkeypatch.setenv("KVPILOT_TUNING", '{"tp_rank_sampling": %s}' % ("true" if rank_sampling == "1" else "false"))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, SHAPE["vocab_size"], (n,), generator=g).tolist() for n in (5, 33, 120, 9, 64, 17)]
    with LLM(str(model_dir), skip_tokenizer_init=True, tensor_parallel_size=2, device="cuda", max_batch_size=16,
             max_seq_len=1024, kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=0.3)) as llm:
        ex = llm._executor
        assert ex.defers_logits and ex.samples_on_output_rank == (rank_sampling == "1")
        alone = llm.generate(prompts[0], _PARAMS[0], use_tqdm=False).outputs[0].token_ids
        batch = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, _PARAMS, use_tqdm=False)]
        counts = (ex.num_rank_sampled_steps, ex.num_self_steps, ex.num_rank_redrawn_rows)
    return alone, batch, counts


def test_output_rank_draws_the_front_ends_tokens(model_dir, monkeypatch):  # noqa: F811
    own_alone, own_batch, (sampled, selfs, _redrawn) = _run(model_dir, monkeypatch, "1")
    fe_alone, fe_batch, (fe_sampled, _, _) = _run(model_dir, monkeypatch, "0")
    assert sampled >= 47 + 47 and selfs >= 80 and fe_sampled == 0
    assert own_alone == fe_alone
    assert own_batch == fe_batch
    assert [len(t) for o in own_batch for t in o] == [48, 30, 40, 36, 36, 20, 24]


def _mixed_events() -> dict:
    """Before step i: ("add", key, prompt ids, params) / ("abort", key): arrivals and aborts while the
    output rank draws, a long prompt prefilled in chunks, a request that needs the front end's
    sampler (logprobs) for a while, flat distributions (temperature 3) and a pool small enough to
    preempt."""
    g = torch.Generator().manual_seed(7)

    def p(n: int) -> list[int]:
        return torch.randint(3, SHAPE["vocab_size"], (n,), generator=g).tolist()

    def sp(m: int, seed: int, **kw) -> SamplingParams:
        return SamplingParams(max_tokens=m, seed=seed, ignore_eos=True, **{"temperature": 0.8, **kw})

    return {0: [("add", "a", p(5), sp(60, 1, top_p=0.9)), ("add", "b", p(120), sp(40, 2, top_k=50, n=2))],
            3: [("add", "c", p(33), sp(50, 3, min_p=0.05))],
            5: [("add", "flat", p(9), sp(40, 4, temperature=3.0, top_p=0.999)),
                ("add", "flat2", p(12), sp(40, 5, temperature=2.0, top_k=5000))],
            9: [("abort", "a")],
            12: [("add", "lp", p(17), sp(8, 6, logprobs=1))],
            16: [("add", "long", p(700), sp(30, 7, top_p=0.95)), ("add", "one", p(3), sp(1, 8))],
            24: [("add", "n3", p(64), sp(30, 9, n=3, top_k=100, top_p=0.8))],
            30: [("abort", "b")],
            34: [("add", "g", p(20), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))]}


def _script_run(model_dir, monkeypatch, rank_sampling: str):  # noqa: F811
    from support.tp_async import _script

    monkeypatch.setenv("KVPILOT_TUNING", '{"tp_rank_sampling": %s, "async_scheduling": true}'
                       % ("true" if rank_sampling == "1" else "false"))
    try:
        with LLM(str(model_dir), skip_tokenizer_init=True, tensor_parallel_size=2, device="cuda", max_batch_size=8,
                 max_num_tokens=256, max_seq_len=1024,
                 kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=1024)) as llm:
            llm._loop.stop()  # the same events at the same steps in both runs
            got, over = _script(llm, _mixed_events(), True)
            ex, core = llm._executor, llm._core
            counts = (ex.num_rank_sampled_steps, ex.num_self_steps, ex.num_rank_redrawn_rows,
                      core.scheduler.num_preemptions, over)
    finally:
        monkeypatch.delenv("KVPILOT_TUNING")
    return got, counts


def test_arrivals_aborts_and_preemption_draw_the_front_ends_tokens(model_dir, monkeypatch):  # noqa: F811
    """Hand-driven TP 2 with requests arriving and aborted mid-flight, chunked prefill, a logprobs
    request (steps go back to the front end's sampler and return) and preemption: the output rank's
    draws equal the front end's bit for bit, aborted requests included (the same steps)."""
    own, (sampled, selfs, redrawn, pre, over) = _script_run(model_dir, monkeypatch, "1")
    front, (fe_sampled, _, _, fe_pre, _) = _script_run(model_dir, monkeypatch, "0")
    print(f"output rank: {sampled} steps drawn, {selfs} fed by its own ids, {redrawn} rows drawn again; "
          f"{pre} preemptions, {over} steps overlapped")
    assert own == front
    assert sampled > 40 and selfs > 20 and fe_sampled == 0 and pre == fe_pre > 0 and over > 60
    assert own["a"][0] == "RequestAborted" and own["lp"][0][2] == "length"
