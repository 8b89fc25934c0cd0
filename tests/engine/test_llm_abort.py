"""Ending a request from the Python API: leaving a stream (sync or async), dropping its iterator, or
calling `RequestOutput.abort()` stops generation at once and gives the KV blocks back to the pool."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

from kvpilot import LLM, KvCacheConfig, SamplingParams
from kvpilot.outputs import RequestAborted

LONG = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(stories_model_dir):
    with LLM(str(stories_model_dir), max_num_tokens=256, kv_cache_config=KvCacheConfig(tokens_per_block=16)) as llm:
        yield llm


def _engine_state(llm) -> tuple[int, int]:
    """(requests the engine holds, KV blocks in use), read on the engine's behalf after its last step."""
    core = llm._core
    return len(core.requests), core.scheduler.kv.num_used_blocks


def _wait_idle(llm, within: float = 1.0) -> tuple[int, int]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if _engine_state(llm) == (0, 0):
            break
        time.sleep(0.01)
    return _engine_state(llm)


def test_breaking_a_sync_stream_aborts_and_frees_kv(llm):
    out = llm.generate_async("", LONG, streaming=True)
    for i, chunk in enumerate(out):
        if i == 5:
            assert _engine_state(llm)[0] == 1 and _engine_state(llm)[1] > 0
            break
    assert _wait_idle(llm) == (0, 0)
    assert len(out.outputs[0].token_ids) < 100


def test_breaking_an_async_stream_aborts_and_frees_kv(llm):
    async def run():
        out = llm.generate_async("", LONG, streaming=True)
        n = 0
        async for _chunk in out:
            n += 1
            if n == 5:
                assert _engine_state(llm)[0] == 1
                break
        return out, _wait_idle(llm)

    out, state = asyncio.run(run())
    assert state == (0, 0)
    assert len(out.outputs[0].token_ids) < 100


def test_exception_inside_an_async_stream_aborts(llm):
    async def run():
        with pytest.raises(KeyError):
            async for _chunk in llm.generate_async("", LONG, streaming=True):
                raise KeyError("consumer failed")
        return _wait_idle(llm)

    assert asyncio.run(run()) == (0, 0)


def test_stream_left_inside_an_async_generator_aborts(llm):
    async def numbered(it):
        i = 0
        async for x in it:
            yield i, x
            i += 1

    async def run():
        async for i, _chunk in numbered(llm.generate_async("", LONG, streaming=True)):
            if i == 5:
                break
        # asyncio closes the abandoned generator on its next turn of the loop.
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and _engine_state(llm) != (0, 0):
            await asyncio.sleep(0.01)
        return _engine_state(llm)

    assert asyncio.run(run()) == (0, 0)


def test_async_stream_iterator_garbage_collected_aborts(llm):
    async def run():
        out = llm.generate_async("", LONG, streaming=True)
        it = out.__aiter__()
        for _ in range(3):
            await it.__anext__()
        assert _engine_state(llm)[0] == 1
        del it
        gc.collect()
        state = _wait_idle(llm)
        return out, state

    out, state = asyncio.run(run())
    assert state == (0, 0)
    assert len(out.outputs[0].token_ids) < 100


def test_sync_stream_iterator_garbage_collected_aborts(llm):
    out = llm.generate_async("", LONG, streaming=True)
    it = iter(out)
    for _ in range(3):
        next(it)
    del it
    gc.collect()
    assert _wait_idle(llm) == (0, 0)


def test_abort_is_immediate(llm):
    out = llm.generate_async("", LONG, streaming=True)
    it = iter(out)
    next(it)
    t0 = time.monotonic()
    out.abort()
    # When abort() returns the request is over: finished with "abort", its blocks back in the pool.
    assert out.finished
    assert out.outputs[0].finish_reason == "abort"
    assert _engine_state(llm) == (0, 0)
    assert time.monotonic() - t0 < 1.0
    # The stream then ends the way an aborted stream does.
    with pytest.raises(RequestAborted):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_abort_of_a_non_streaming_request_is_immediate(llm):
    out = llm.generate_async("", LONG)
    time.sleep(0.05)
    out.abort()
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert _engine_state(llm) == (0, 0)
    with pytest.raises(RequestAborted):
        out.result(timeout=1)


def test_abort_from_async_code_is_immediate(llm):
    async def run():
        out = llm.generate_async("", LONG, streaming=True)
        await out.__aiter__().__anext__()
        out.abort()
        return out.finished, out.outputs[0].finish_reason, _engine_state(llm)

    assert asyncio.run(run()) == (True, "abort", (0, 0))


def test_finished_stream_left_early_is_not_aborted(llm):
    out = llm.generate_async("", SamplingParams(temperature=0, max_tokens=8), streaming=True)
    chunks = list(out)
    assert chunks[-1].finished and out.outputs[0].finish_reason == "length"
    out.abort()  # too late: nothing changes
    assert out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 8


def test_engine_keeps_serving_after_aborts(llm):
    for _ in range(3):
        for i, _chunk in enumerate(llm.generate_async("", LONG, streaming=True)):
            if i == 2:
                break
    out = llm.generate("", SamplingParams(temperature=0, max_tokens=20))
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 20
    assert _wait_idle(llm) == (0, 0)
