"""Hand-driven tensor-parallel `LLM`s with asynchronous steps (TP 2, gloo, CPU): building one, driving
its engine through a script of arrivals and aborts, and comparing with the synchronous engine."""

from __future__ import annotations

import time

import pytest

from kvpilot import LLM, KvCacheConfig, SamplingParams
from kvpilot.tuning import Tuning


_LONG = "Once upon a time there was a little girl named Lily. " * 9  # ~120 tokens: two prefill chunks at 64



def _g(m: int, **kw) -> SamplingParams:
    """Greedy, arg-max only (the output rank computes the ids: ``SYNC_SELF`` steps)."""
    return SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, **kw)



def _s(m: int, seed: int = 1, **kw) -> SamplingParams:
    """Seeded sampling: the output rank samples (``SYNC_SELF``) unless a row also asks for
    logprobs (``logprobs=0``), which the front end's sampler computes (``SYNC_GO`` steps)."""
    return SamplingParams(temperature=0.8, seed=seed, max_tokens=m, ignore_eos=True, **kw)



def _build(model_dir, kv_tokens=None, env=None, step_timeout_s=None, **tuning) -> LLM:
    """A TP-2 CPU `LLM` with asynchronous steps: `Tuning` fields ``tuning`` over
    ``async_scheduling=True``, the environment variables ``env`` set while it is built (the workers
    inherit them), the front end's step timeout cut to ``step_timeout_s`` when given."""
    mp = pytest.MonkeyPatch()
    for k, v in (env or {}).items():
        mp.setenv(k, v)
    try:
        llm = LLM(str(model_dir), tensor_parallel_size=2, device="cpu", max_batch_size=6, max_num_tokens=64,
                  kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=kv_tokens),
                  tuning=Tuning(**{"async_scheduling": True, **tuning}))
    finally:
        mp.undo()
    if step_timeout_s is not None:
        llm._executor._step_timeout = step_timeout_s
    assert llm._executor.defers_logits and llm._core.async_scheduling
    return llm



def _shutdown(llm: LLM, limit: float = 10.0) -> None:
    t0 = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - t0 < limit
    assert not any(p.is_alive() for p in llm._executor._procs)



def _results(reqs: dict) -> dict:
    out = {}
    for k, r in reqs.items():
        try:
            o = r.output.result(timeout=0)
            out[k] = [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
        except Exception as e:  # noqa: BLE001 - aborts: what was generated before the abort
            out[k] = (type(e).__name__, [(c.token_ids, c.finish_reason) for c in r.output.outputs])
    return out



def _script(llm: LLM, events: dict, async_sched: bool, max_steps: int = 600):
    """Drive ``llm``'s engine by hand: before step i, apply ``events[i]`` (("add", key, prompt,
    params) or ("abort", key)); step until idle. Returns (per key: choices, or the abort error and
    what was generated), steps overlapped in this run). Checks that nothing is left in flight."""
    core = llm._core
    core.async_scheduling = async_sched
    over = core.num_overlapped_steps
    reqs: dict = {}
    last = max(events)
    i = 0
    while i <= last or core.has_work:
        for ev in events.get(i, []):
            if ev[0] == "add":
                reqs[ev[1]] = r = llm._make_request(ev[2], ev[3], False)
                core.add_request(r)
            else:
                core.abort_request(reqs[ev[1]].request_id)
            core.flush_outputs()
        if core.has_work:
            core.step()
            core.flush_outputs()
        i += 1
        assert i < max_steps
    ex = core.executor
    assert not ex._sent and ex._unpublished == 0 and not ex._stash and not ex._go_pending
    assert core._inflight is None and core.kv.num_used_blocks == 0 and not core.requests
    return _results(reqs), core.num_overlapped_steps - over



def _same_as_sync(llm: LLM, events: dict) -> tuple[int, int]:
    """Run ``events`` synchronously, then asynchronously; assert equal results. Returns (steps
    overlapped, steps fed by the output rank's own arg-max) of the asynchronous run."""
    sync, n_sync = _script(llm, events, False)
    selfs = llm._executor.num_self_steps
    asyn, n_async = _script(llm, events, True)
    assert n_sync == 0
    assert asyn == sync
    return n_async, llm._executor.num_self_steps - selfs
