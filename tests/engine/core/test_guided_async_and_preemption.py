"""Guided decoding under async scheduling (each mask is filled after the previous token is read),
preemption (a recomputed sequence keeps its grammar state) and prefix reuse: the same tokens as the
synchronous engine with a roomy pool, and every output valid."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvpilot import KvCacheConfig, LLM
from kvpilot.llmapi import GuidedDecodingParams, SamplingParams
from support.async_engine import _drain

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "pet": {"enum": ["cat", "dog"]}}, "required": ["name", "pet"]}
REGEX = r"[a-z]{3}-[0-9]{2}"
PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play"


def _params():
    return ([SamplingParams(max_tokens=40, seed=s, n=2, guided_decoding=GuidedDecodingParams(json=SCHEMA))
             for s in range(2)]
            + [SamplingParams(max_tokens=20, seed=s, guided_decoding=GuidedDecodingParams(regex=REGEX))
               for s in range(2)]
            + [SamplingParams(max_tokens=20, seed=9)])  # an unguided neighbour


def _run(llm, async_sched: bool):
    core = llm._core
    core.async_scheduling = async_sched
    pre, over = core.scheduler.num_preemptions, core.num_overlapped_steps
    reqs = [llm._make_request(PROMPT, sp, False) for sp in _params()]
    for r in reqs:
        core.add_request(r)
    _drain(core)
    assert core.kv.num_used_blocks == 0 and not core.requests
    outs = [[(c.token_ids, c.text, c.finish_reason) for c in r.output.result(timeout=0).outputs] for r in reqs]
    return outs, core.scheduler.num_preemptions - pre, core.num_overlapped_steps - over


@pytest.fixture
def _async_on(monkeypatch):
    monkeypatch.setenv("KVPILOT_TUNING", '{"async_scheduling": true}')


@pytest.mark.slow  # three engine runs of ~100 tokens, one under preemption: ~30 s on two idle cores
def test_guided_outputs_same_async_sync_and_under_preemption(stories_model_dir, _async_on):
    roomy = LLM(str(stories_model_dir), device="cpu", max_batch_size=16, max_num_tokens=128,
                kv_cache_config=KvCacheConfig(tokens_per_block=16))
    tight = LLM(str(stories_model_dir), device="cpu", max_batch_size=16, max_num_tokens=128,
                kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=112))
    try:
        for llm in (roomy, tight):
            llm._loop.stop()
        ref, _, _ = _run(roomy, False)
        reused = roomy._core.kv.stats.reused_blocks
        got, _, overlapped = _run(roomy, True)  # the shared prompt's blocks come from the prefix cache
        assert got == ref and overlapped > 0 and roomy._core.kv.stats.reused_blocks > reused
        got, preempted, _ = _run(tight, True)
        assert preempted > 0 and got == ref
    finally:
        roomy.shutdown()
        tight.shutdown()
    for choices in ref[:2]:
        for _, text, reason in choices:
            assert reason == "stop"
            jsonschema.validate(json.loads(text), SCHEMA)
    for ((_, text, reason),) in ref[2:4]:
        assert reason == "stop" and re.fullmatch(REGEX, text)
