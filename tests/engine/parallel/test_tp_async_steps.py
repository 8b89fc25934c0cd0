"""Asynchronous tensor-parallel steps: the front end plans and sends step N+1 before it samples step N
(`MultiprocExecutor._execute_deferred`, `await_logits` / `await_ids`, `publish_tokens`,
`abandon_steps`), the output rank waits for the sampled ids or uses its own arg-max
(`parallel_worker.InputSync`, ``SYNC_GO`` / ``SYNC_EVENT`` / ``SYNC_SELF``), and the engine defers
sampling (`EngineCore._start_inflight`, `_argmax_only`).

Everything runs on CPU with TP 2 (gloo) and ``Tuning(async_scheduling=True)``. Results are compared with
the synchronous engine on the same `LLM` (``core.async_scheduling = False``): token ids, text and
finish reasons exactly. The slow-marked ones (the HTTP server, killed workers, long mixes) run with
``-m slow``; `make test` keeps the rest."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from kvpilot import LLM, KvCacheConfig, SamplingParams
from kvpilot.llm import EngineDeadError
from kvpilot.outputs import RequestError
from support.tp_async import _LONG, _g, _s, _build, _shutdown, _script, _same_as_sync# noqa: F401

pytestmark = pytest.mark.timeout(300)

@pytest.fixture(scope="module")
def tp_llm(stories_model_dir):
    llm = _build(stories_model_dir)
    llm._loop.stop()  # steps are driven by hand
    yield llm
    _shutdown(llm)


@pytest.fixture
def fresh_llm(stories_model_dir):
    """A hand-driven TP-2 `LLM` of its own (for tests that may leave the executor broken)."""
    llm = _build(stories_model_dir)
    llm._loop.stop()
    yield llm
    _shutdown(llm)


# ---- deferred steps, step timing, failures -------------------------------------------------------


@pytest.mark.parametrize("case", ["greedy_eos", "sampled_stop_id", "stop_string_sync_output"])
def test_a_deferred_step_with_nothing_to_sample_is_still_awaited(fresh_llm, case):
    """A deferred step whose every sequence ended before it was sampled is still awaited, so the next
    request never gets its answer.

    Step N+1 is planned and sent before step N's tokens are read. If those tokens end every
    sequence of step N+1 (EOS or a stop token id in the fast part; a stop string with
    ``async_output`` off), step N+1's sampling loop keeps no row (``sample_seqs`` is empty) and
    `EngineCore.step` publishes the step with nothing sampled (engine/core/engine_core.py). It must
    still consume the step's answer (``await_ids()`` for an arg-max step, else ``await_logits()``),
    or its entry stays in `MultiprocExecutor._sent` and the next deferred step's `_await_step` pops
    it: an arg-max step would return the stale ids (a wrong first token for the next request,
    silently: 385 instead of 329 in the greedy case below), a sampled step would sample the stale
    logits, and a synchronous step would fail with "the step is an arg-max step: use await_ids" or
    "the output worker answered 1 logits rows, the plan has 2".

    The same path is taken by a deferred step that holds only a non-final prefill chunk (a prompt
    longer than ``max_num_tokens`` alone in the engine, see the test below) and, on GPUs, by a step
    whose every row is rolled back (-1 rows)."""
    llm = fresh_llm
    core = llm._core
    if case == "greedy_eos":
        first = ("She was sad", SamplingParams(temperature=0, max_tokens=30, end_id=426))  # EOS: the first "."
    elif case == "sampled_stop_id":
        first = ("She was sad", SamplingParams(temperature=0.5, seed=2, max_tokens=40, stop_token_ids=[13, 263, 426]))
    else:
        core.async_output = False
        first = ("", SamplingParams(temperature=0, max_tokens=30, stop=["Lily"]))
    events = {0: [("add", "a", *first)], 40: [("add", "b", "Once upon a time", _g(12))],
              60: [("add", "c", "The little dog", _s(10, seed=4))]}
    sync, _ = _script(llm, events, False)
    assert sync["a"][0][2] == "stop"  # the first request really ends by its stop condition
    asyn, _ = _script(llm, events, True)
    assert asyn == sync


@pytest.mark.slow  # about 20 s on 2 cores: `pytest -m slow`
def test_serve_after_a_completion_that_ends_on_a_stop_token(stories_model_dir, tp_llm, tmp_path, monkeypatch):
    """``kvpilot serve --tensor-parallel-size 2`` with asynchronous steps: after a greedy completion that
    ends on ``stop_token_ids`` (alone on the server, its last step is empty), every later completion
    gets its own tokens (a stale step answer would shift them by one: ", there was a little girl named
    Lily. She loved to play" returned as " One, there was a little girl named Lily. She loved to")."""
    import httpx

    from kvpilot.server.launcher import ServerProcess

    want, _ = _script(tp_llm, {0: [("add", "b", "Once upon a time", SamplingParams(temperature=0, max_tokens=16))]},
                      False)
    monkeypatch.setenv("KVPILOT_TUNING", '{"async_scheduling": true}')
    args = ["--tensor-parallel-size", "2", "--device", "cpu", "--served-model-name", "stories"]
    with ServerProcess(stories_model_dir, args, log_path=tmp_path / "serve.log", startup_timeout=150) as srv:
        def complete(**body) -> dict:
            r = httpx.post(srv.url + "/v1/completions", timeout=60,
                           json={"model": "stories", "temperature": 0, **body})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        texts = [complete(prompt="Once upon a time", max_tokens=16)["text"]]
        ended = complete(prompt="She was sad", max_tokens=30, stop_token_ids=[426])
        assert (ended["finish_reason"], ended["stop_reason"]) == ("stop", 426)
        texts += [complete(prompt="Once upon a time", max_tokens=16)["text"] for _ in range(2)]
    assert texts == [want["b"][0][1]] * 3


def test_step_timing_while_a_plan_waits_for_its_ids(stories_model_dir):
    """`MultiprocExecutor.step_timing` called from another thread (as a server's metrics endpoint does)
    between the send of a ``SYNC_GO`` plan and the ``publish_tokens`` that releases it returns, and the
    engine keeps running.

    `step_timing` waits for every rank's ("timing", ...) answer (`_step_timing`,
    engine/parallel/executor.py). The output rank answers from `Worker.wait_go`, but rank 1 has already
    started the step: it sits in the input-id broadcast (or the first all-reduce) of `InputSync`,
    waiting for rank 0, which waits for the ("go", ids) message that `publish_tokens` sends. Holding the
    pipe lock across that wait would deadlock until ``_step_timeout`` and kill the engine. The window is
    the engine thread's sampling of step N (await_logits -> sampler -> publish) of every step that has a
    sampled request (greedy-only batches use ``SYNC_SELF`` and do not wait).

    Here the window is forced: the engine's `publish_tokens` first lets another thread call
    `step_timing` (the step timeout is cut to 6 s so that a failure is quick)."""
    llm = _build(stories_model_dir, step_timeout_s=6, step_timing=True)
    try:
        llm._loop.stop()
        core, ex = llm._core, llm._executor
        real_publish = ex.publish_tokens
        timing: dict = {}

        def publish(tokens):
            if ex._go_pending and "thread" not in timing:
                def call():
                    t0 = time.monotonic()
                    try:
                        timing["result"] = ex.step_timing()
                    except Exception as e:  # noqa: BLE001
                        timing["error"] = e
                    timing["seconds"] = time.monotonic() - t0
                timing["thread"] = th = threading.Thread(target=call, daemon=True)
                th.start()
                time.sleep(0.5)  # the timing request is sent; rank 1 cannot answer before the go
                t0 = time.monotonic()
                try:
                    return real_publish(tokens)
                finally:
                    timing["publish_seconds"] = time.monotonic() - t0
            return real_publish(tokens)

        ex.publish_tokens = publish
        req = llm._make_request("Once upon a time", _s(20, logprobs=0), False)
        core.add_request(req)
        try:
            while core.has_work:
                core.step()
                core.flush_outputs()
        finally:
            ex.publish_tokens = real_publish
        assert "thread" in timing, "no publish_tokens call found a plan waiting for its go message"
        timing["thread"].join(timeout=15)
        assert timing["publish_seconds"] < 2
        assert "error" not in timing and timing["seconds"] < 3
        assert set(timing["result"]["ranks"]) == {0, 1}
        assert len(req.output.result(timeout=0).outputs[0].token_ids) == 20
    finally:
        _shutdown(llm)


@pytest.mark.parametrize("tp_async", ["0", "1"], ids=["settled", "async"])
def test_a_long_prompt_alone_on_cpu_tp2(stories_model_dir, tp_async):
    """A prompt longer than ``max_num_tokens`` alone in the engine is prefilled in chunks; the first
    chunk's step samples nothing, so the output rank has a ``[0, vocab]`` logits tensor. On the pipe path
    (CPU, or ``Tuning(logits_ipc=False)`` on GPUs) `parallel_worker._send_logits` sends ``b""`` for it
    (``memoryview.cast`` refuses a zero-size array, which would kill rank 0 and leave the front end
    reading the worker's pickled error as logits bytes), and with asynchronous steps the chunk's
    deferred step is awaited although nothing is sampled (the test above)."""
    ref_sp = _g(8)
    with LLM(str(stories_model_dir), device="cpu", max_batch_size=6, max_num_tokens=64,
             kv_cache_config=KvCacheConfig(tokens_per_block=16)) as one:
        want = one.generate(_LONG, ref_sp, use_tqdm=False).outputs[0].token_ids
    llm = _build(stories_model_dir, tp_async=True) if tp_async == "1" else None
    if llm is None:
        mp = pytest.MonkeyPatch()
        mp.setenv("KVPILOT_TUNING", '{"tp_async": false}')
        try:
            llm = LLM(str(stories_model_dir), tensor_parallel_size=2, device="cpu", max_batch_size=6,
                      max_num_tokens=64, kv_cache_config=KvCacheConfig(tokens_per_block=16))
        finally:
            mp.undo()
    try:
        got = [llm.generate(_LONG, ref_sp, use_tqdm=False).outputs[0].token_ids for _ in range(2)]
        assert got == [want, want]
    finally:
        _shutdown(llm)


def test_the_first_cause_of_death_is_kept(fresh_llm, monkeypatch):
    """After a worker dies while a plan waits for its go message, every later call raises the real cause
    (rank 1 killed), not "worker rank 0 exited with code -15" (the front end's own termination).

    The engine loop's final `EngineCore.fail_all` calls `MultiprocExecutor.abandon_steps`; with every
    worker already terminated by `_die`, a `_send_go` on the output rank's pipe fails (BrokenPipeError)
    and sees rank 0's exit, and must not replace ``_dead`` (what every later call raises). Forced here:
    the steps sent are awaited by hand until rank 1's death is noticed, then `fail_all` runs as the
    loop's last act."""
    llm = fresh_llm
    core, ex = llm._core, llm._executor
    req = llm._make_request("Once upon a time", _s(30, logprobs=0), False)
    core.add_request(req)
    for _ in range(4):
        core.step()
        core.flush_outputs()
    real = core._resolve_inflight
    monkeypatch.setattr(core, "_resolve_inflight", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        core.step()  # the next plan was sent and waits for its go
    monkeypatch.setattr(core, "_resolve_inflight", real)
    assert ex._go_pending and len(ex._sent) == 2
    victim = ex._procs[1]
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10)
    with pytest.raises(EngineDeadError, match="rank 1"):
        ex.await_logits()  # the step in flight (rank 1 may have died before it was answered)
        ex.await_logits()  # the step waiting for its go: the death is noticed here at the latest
    core.fail_all(EngineDeadError("worker gone"))  # as the engine loop does when it stops
    core.flush_outputs()
    assert "rank 1" in str(ex._dead)


# ---- the same results as the synchronous engine --------------------------------------------------

# Before step i: ("add", key, prompt, params) / ("abort", key). Greedy requests run arg-max steps
# (SYNC_SELF); a sampled, logprobs, penalised, beam, prompt-logprobs or generation-logits request
# arriving switches the steps to sampled (SYNC_GO) or settled ones, and back when it ends.
_MID_FLIGHT = {
    "sampled_arrives_and_leaves": {
        0: [("add", "g1", "Once upon a time", _g(40)), ("add", "g2", "The dog", _g(45))],
        5: [("add", "s", "Tom and Sue", _s(8, logprobs=0))], 20: [("add", "s2", "She", _s(4, seed=9))]},
    "eos_and_stop_ids_while_others_run": {
        0: [("add", "g1", "Once upon a time", _g(40)),
            ("add", "e", "She was sad", SamplingParams(temperature=0, max_tokens=30, end_id=426))],
        2: [("add", "e2", "She was sad", SamplingParams(temperature=0.5, seed=2, max_tokens=30,
                                                        stop_token_ids=[13, 263]))]},
    "stop_strings": {
        0: [("add", "g1", "Once upon a time", _g(40)),
            ("add", "g2", "", SamplingParams(temperature=0, max_tokens=30, stop=["Lily"]))],
        3: [("add", "g3", "", SamplingParams(temperature=0, max_tokens=40, stop=["park", "ball"],
                                             include_stop_str_in_output=True))]},
    "aborts": {
        0: [("add", "g1", "Once upon a time", _g(30)), ("add", "g2", "The dog", _g(30)), ("add", "s", "Tom", _s(30))],
        4: [("abort", "g2")], 7: [("abort", "s")], 12: [("abort", "g1")]},
    "abort_the_last_greedy": {
        0: [("add", "g1", "Once upon a time", _g(40))], 6: [("abort", "g1")]},
    "host_logits_arrive": {
        0: [("add", "g1", "Once upon a time", _g(40)), ("add", "g2", "The dog", _g(40))],
        4: [("add", "p", "The little dog", SamplingParams(temperature=0, max_tokens=8, logprobs=0, prompt_logprobs=2))],
        12: [("add", "c", "Tom", SamplingParams(temperature=0, max_tokens=5, return_context_logits=True))],
        18: [("add", "b", "One day", SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0,
                                                    max_tokens=6))],
        26: [("add", "gl", "", _g(6, return_generation_logits=True))]},
    "n_greedy_and_best_of": {
        0: [("add", "n3", "Once upon a time", _g(20, n=3)), ("add", "g", "The", _g(25))],
        4: [("add", "n2", "Tom", _g(10, n=2))],
        8: [("add", "b", "The", SamplingParams(temperature=0, n=1, best_of=2, max_tokens=6, ignore_eos=True))]},
    "greedy_with_extras_arrives": {
        0: [("add", "g1", "Once upon a time", _g(36))],
        3: [("add", "l", "The", _g(6, logprobs=2))], 10: [("add", "r", "The", _g(6, repetition_penalty=1.5))],
        17: [("add", "m", "A", _g(8, min_tokens=4))], 25: [("add", "bias", "A", _g(5, logit_bias={13: -5.0}))]},
}


@pytest.mark.parametrize("case", list(_MID_FLIGHT))
def test_mid_flight_switches_match_the_synchronous_engine(tp_llm, case):
    over, selfs = _same_as_sync(tp_llm, _MID_FLIGHT[case])
    assert over > 3  # steps really were planned ahead
    assert selfs > 0  # and some were fed by the output rank's own arg-max


def test_switching_async_scheduling_and_async_output_mid_run(tp_llm):
    """``core.async_scheduling`` flipped every 7 steps (a deferred step in flight is read first), and
    synchronous output work (``async_output`` off: stop strings end sequences in the fast part)."""
    core = tp_llm._core
    events = _MID_FLIGHT["sampled_arrives_and_leaves"]
    sync, _ = _script(tp_llm, events, False)
    real, n = core.step, [0]

    def step():
        n[0] += 1
        if n[0] % 7 == 0:
            core.async_scheduling = not core.async_scheduling
        return real()

    core.step = step
    try:
        flipped, _ = _script(tp_llm, events, True)
    finally:
        del core.step
    assert flipped == sync
    core.async_output = False
    try:
        # Stop strings end here only with another request still running (see the deferred-step test above).
        _same_as_sync(tp_llm, {**_MID_FLIGHT["stop_strings"], 1: [("add", "keep", "Tom", _g(45))]})
        _same_as_sync(tp_llm, _MID_FLIGHT["aborts"])
    finally:
        core.async_output = True


@pytest.mark.slow  # about 20 s on 2 cores: `pytest -m slow`
def test_preemption_with_a_small_pool(stories_model_dir):
    """Six 16-token blocks for four requests of up to 76 tokens: the schedule preempts (it reads the
    deferred step first) and recomputes, greedy-only and mixed with a sampled request."""
    llm = _build(stories_model_dir, kv_tokens=96)
    try:
        llm._loop.stop()
        assert llm._core.kv.num_blocks == 6
        pre = llm._core.scheduler.num_preemptions
        _same_as_sync(llm, {0: [("add", "g1", "Once upon a time", _g(60)), ("add", "g2", "The dog", _g(60)),
                                ("add", "s", "Tom", _s(60)), ("add", "g3", "She", _g(50))],
                            10: [("add", "g4", "A", _g(40))]})
        _same_as_sync(llm, {0: [(("add", f"g{i}", p, _g(60))) for i, p in
                                enumerate(["Once upon a time", "The dog", "She", "A"])]})
        assert llm._core.scheduler.num_preemptions - pre > 20
    finally:
        _shutdown(llm)


@pytest.mark.parametrize("kind", [
    pytest.param("greedy", marks=pytest.mark.slow),
    "sampled",
])
def test_generate_through_the_loop_with_step_timing_from_another_thread(stories_model_dir, tp_llm, kind):
    """`llm.generate` on the engine thread while another thread calls `step_timing` in a loop (answers
    and ids read ahead are stashed meanwhile); the tokens equal the synchronous engine's. Greedy:
    arg-max steps fed by ``SYNC_SELF``; sampled: ``SYNC_GO`` steps (the deadlock above, met within a
    few steps: the step timeout is cut to 6 s)."""
    prompts = ["Once upon a time", "The little dog", "Tom and Sue"]
    sp = _g(48) if kind == "greedy" else _s(48, seed=5)
    want, _ = _script(tp_llm, {0: [("add", p, p, sp) for p in prompts]}, False)
    llm = _build(stories_model_dir, step_timeout_s=6, step_timing=True)
    try:
        res: dict = {}

        def gen():
            try:
                res["out"] = llm.generate(prompts, sp, use_tqdm=False)
            except Exception as e:  # noqa: BLE001
                res["error"] = e

        th = threading.Thread(target=gen)
        th.start()
        calls, worst = 0, 0.0
        try:
            while th.is_alive():
                t0 = time.monotonic()
                t = llm._executor.step_timing()
                worst = max(worst, time.monotonic() - t0)
                calls += 1
                assert set(t["ranks"]) == {0, 1}
        finally:
            th.join(30)
        assert "error" not in res
        assert calls > 10 and worst < 2.0
        assert [o.outputs[0].token_ids for o in res["out"]] == [want[p][0][0] for p in prompts]
        assert not llm._executor._stash
        if kind == "greedy":
            assert llm._executor.num_self_steps > 20
    finally:
        _shutdown(llm)


@pytest.mark.slow  # make test's budget: tests/engine/parallel/test_parallel_failures.py covers the basics
@pytest.mark.parametrize("greedy", [True, False], ids=["self", "go"])
def test_shutdown_while_requests_run(stories_model_dir, greedy):
    """`llm.shutdown()` from the user's thread during a long `generate` returns within seconds, the
    caller gets an error (not a hang), and no worker is left."""
    llm = _build(stories_model_dir)
    res: dict = {}

    def gen():
        try:
            res["out"] = llm.generate(["Once upon a time", "The dog"], _g(400) if greedy else _s(400, logprobs=0), use_tqdm=False)
        except Exception as e:  # noqa: BLE001
            res["error"] = e

    th = threading.Thread(target=gen)
    th.start()
    deadline = time.monotonic() + 30
    while llm._core.num_overlapped_steps < 10 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert llm._core.num_overlapped_steps >= 10
    _shutdown(llm, limit=5.0)
    th.join(10)
    assert not th.is_alive()
    assert isinstance(res.get("error"), (EngineDeadError, RequestError))


def test_shutdown_is_not_held_by_a_stuck_step(stories_model_dir, monkeypatch):
    """`MultiprocExecutor.shutdown` while another thread holds the pipe lock (the engine thread
    inside `await_logits`, waiting up to the step timeout for a hung worker) and a plan waits for its
    go: it must still release that plan and stop the workers at once, not wait for the lock.

    With a rank stopped by SIGSTOP during a sampled `generate`, `llm.shutdown()` takes ~45 s
    (`EngineLoop.stop`'s 30 s join, then this path); if `abandon_steps` takes the lock
    inside `shutdown`, it takes the whole step timeout instead (95 s with
    a 90 s step timeout; 11 minutes by default)."""
    llm = _build(stories_model_dir)
    llm._loop.stop()
    core, ex = llm._core, llm._executor
    core.add_request(llm._make_request("Once upon a time", _s(30, logprobs=0), False))
    for _ in range(4):
        core.step()
        core.flush_outputs()
    monkeypatch.setattr(core, "_resolve_inflight", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        core.step()  # the next plan was sent and waits for its go
    assert ex._go_pending
    held, release = threading.Event(), threading.Event()

    def hold():
        with ex._lock:
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    held.wait(5)
    closer = threading.Thread(target=llm.shutdown, daemon=True)
    t0 = time.monotonic()
    closer.start()
    try:
        closer.join(15)
        assert not closer.is_alive() and time.monotonic() - t0 < 15
        assert not any(p.is_alive() for p in ex._procs)
    finally:
        release.set()
        closer.join(30)


@pytest.mark.slow  # make test's budget: tests/engine/parallel/test_parallel_failures.py covers the basics
@pytest.mark.parametrize("rank,greedy", [(1, False), (0, True)], ids=["rank1-go", "rank0-self"])
def test_a_worker_killed_mid_generation(stories_model_dir, rank, greedy):
    """A rank killed while asynchronous steps run: `generate` raises within seconds, the engine is
    dead (new submissions fail at once), and the other rank is gone too."""
    llm = _build(stories_model_dir)
    res: dict = {}

    def gen():
        try:
            res["out"] = llm.generate(["Once upon a time", "The dog"], _g(400) if greedy else _s(400, logprobs=0), use_tqdm=False)
        except Exception as e:  # noqa: BLE001
            res["error"] = e

    th = threading.Thread(target=gen)
    th.start()
    try:
        deadline = time.monotonic() + 30
        while llm._core.num_overlapped_steps < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.monotonic()
        os.kill(llm._executor._procs[rank].pid, signal.SIGKILL)
        th.join(10)
        assert not th.is_alive() and time.monotonic() - t0 < 5
        assert isinstance(res.get("error"), (EngineDeadError, RequestError))
        with pytest.raises(EngineDeadError):
            llm.generate("Once", _g(2), use_tqdm=False)
        assert not any(p.is_alive() for p in llm._executor._procs)
    finally:
        _shutdown(llm)
