"""The multi-process executor stays alive, or fails fast and clearly: step timing in a multi-node
group, after a worker died and after shutdown (`EngineDeadError`), a dead tensor-parallel peer on a
GPU, beam search with preemption and aborts through the plan encoding, and the logits event wait
(returns once the event completes, stops when a worker dies, reports a worker's error, times out,
keeps an answer that runs ahead)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support.parallel import lws_worker_pod, run_tiny_workload

from kvpilot import LLM, EngineDeadError

pytestmark = pytest.mark.timeout(180)


# The tiny model and its single-process outputs (module-scoped fixtures of the LWS tests).
from support.parallel import tiny_model_dir, tiny_single_reference  # noqa: E402, F401


def test_step_timing_in_a_multi_node_group_keeps_the_engine_alive(tmp_path, tiny_model_dir,
                                                                   tiny_single_reference, monkeypatch):
    """Two 'pods' of two ranks each (TP 2 x PP 2): the leader pod's rank 1 has a pipe too, but only
    rank 0 answers ``step_timing`` (an extra answer would be read as an unexpected message at the next
    step, and the engine would die)."""
    with lws_worker_pod(tmp_path, tiny_model_dir, monkeypatch, tp=2, pp=2):
        with LLM(str(tiny_model_dir), skip_tokenizer_init=True, tensor_parallel_size=2, pipeline_parallel_size=2,
                 device="cpu") as llm:
            ex = llm._executor
            assert ex.spec.multi_node and ex.spec.ranks_per_node == 2
            timing = ex.step_timing()
            assert timing == {"front_end": {}, "ranks": {0: {}}}  # only the leader's rank 0 reports
            toks, lps = run_tiny_workload(llm)
            assert ex.step_timing()["ranks"] == {0: {}}
        assert toks == tiny_single_reference[0]
        assert lps == pytest.approx(tiny_single_reference[1], abs=1e-4)


def test_step_timing_after_a_worker_died_raises_engine_dead(tiny_model_dir):
    """``step_timing`` documents EngineDeadError for a failed worker, not a BrokenPipeError."""
    llm = LLM(str(tiny_model_dir), skip_tokenizer_init=True, pipeline_parallel_size=2, device="cpu")
    try:
        ex = llm._executor
        ex._procs[1].kill()
        ex._procs[1].join(timeout=10)
        with pytest.raises(EngineDeadError, match="worker rank 1"):
            ex.step_timing()
        assert ex._dead is not None
    finally:
        llm.shutdown()


def _beam_and_pressure_workload(llm):
    """Beam search (forks share blocks, spare sequences are reused for forks) in one batch with
    seeded n=2 sampling, in a small pool (preemptions), then an abort in the middle of a batch."""
    from kvpilot import SamplingParams

    beams = SamplingParams(use_beam_search=True, best_of=3, n=2, max_tokens=14)
    sampled = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=3, n=2, max_tokens=20, ignore_eos=True)
    outs = llm.generate([[1, 5, 9, 11], [1, 40, 41, 42, 43, 44, 45, 46, 47], [1, 7]],
                        [beams, sampled, beams], use_tqdm=False)
    res = [[c.token_ids for c in o.outputs] for o in outs]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    a = llm.generate_async([1, 17, 99], greedy)
    b = llm.generate_async([1, 300, 301, 302], greedy)
    llm.abort(a.request_id)
    res.append(b.result().outputs[0].token_ids)
    res.append(llm.generate([1, 17, 99], greedy).outputs[0].token_ids)
    return res


def test_beam_search_preemption_and_abort_through_plan_encoding(tiny_model_dir):
    """The pipeline-parallel engine (plans with block-table deltas) equals the single process."""
    from kvpilot import KvCacheConfig

    kv = KvCacheConfig(tokens_per_block=4, max_tokens=96)
    with LLM(str(tiny_model_dir), skip_tokenizer_init=True, device="cpu", kv_cache_config=kv) as llm:
        stats = []
        llm.add_stat_logger(lambda s: stats.append(s.num_preemptions))
        ref = _beam_and_pressure_workload(llm)
    assert sum(stats) > 0  # the pool is small enough to preempt
    with LLM(str(tiny_model_dir), skip_tokenizer_init=True, device="cpu", kv_cache_config=kv,
             pipeline_parallel_size=2) as llm:
        got = _beam_and_pressure_workload(llm)
    assert got == ref


# ---- GPU: a tensor-parallel peer dying while the output rank answers early -----------------------
_FAULT_SCRIPT = r"""
import os, sys, time
from kvpilot import LLM, KvCacheConfig, SamplingParams

if __name__ == "__main__":
    with LLM(sys.argv[1], skip_tokenizer_init=True, tensor_parallel_size=2, device="cuda", max_batch_size=16,
             max_seq_len=4096, kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=0.3)) as llm:
        ex = llm._executor
        print("MODE", ex.logits_mode, flush=True)
        llm.generate([1, 5, 9], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm
        out = llm.generate_async([1, 5, 9], SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True))
        time.sleep(2.0)  # mid-generation
        ex._procs[1].kill()  # the non-output TP rank: rank 0 is left inside an all-reduce
        t0 = time.monotonic()
        try:
            out.result(timeout=float(sys.argv[2]))
            print("RESULT finished", flush=True)
        except TimeoutError:
            print("RESULT timeout", flush=True)
        except Exception as e:  # noqa: BLE001 - the expected RequestError / EngineDeadError
            print("RESULT failed %.1f %s" % (time.monotonic() - t0, type(e).__name__), flush=True)
        for p in ex._procs:  # never leave a rank holding the GPU
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        os._exit(0)  # do not wait for a stuck engine thread
"""


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available() or __import__("torch").cuda.device_count() < 2,
                    reason="needs two CUDA GPUs")
@pytest.mark.parametrize("event", ["1", "0"])
def test_gpu_dead_tp_peer_fails_requests_quickly(tmp_path, event):
    """A killed tensor-parallel rank fails the running request within seconds, with the early (event)
    answer as with the synchronizing one. With the event, rank 0 answers right after launching its
    step, so the front end can be blocked in a CUDA wait behind rank 0's all-reduce (which never ends
    now) instead of watching the worker processes; the NCCL timeout is set far above the bound here."""
    import torch

    from kvpilot.tools.random_model import write_random_llama

    shape = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                 num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-5,
                 rope_theta=10000.0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = write_random_llama(tmp_path / "m", shape, device="cuda", std=0.05)
    torch.cuda.empty_cache()
    script = tmp_path / "fault.py"
    script.write_text(_FAULT_SCRIPT)
    env = {**os.environ, "KVPILOT_TUNING": '{"logits_event": %s}' % ("true" if event == "1" else "false"),
           "KVPILOT_DIST_TIMEOUT_S": "300"}
    proc = subprocess.run([sys.executable, str(script), str(model), "45"], capture_output=True, text=True,
                          timeout=240, cwd=str(tmp_path), env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("MODE", "RESULT"))]
    assert lines and lines[0] == f"MODE {2 if event == '1' else 1}", (proc.stdout, proc.stderr[-3000:])
    result = lines[-1].split()
    assert result[:2] == ["RESULT", "failed"], (lines, proc.stderr[-3000:])
    assert float(result[2]) < 30, lines


class _Event:
    """Stands in for the output rank's interprocess CUDA event: complete after ``n`` queries."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.queries > self.n


class _Proc:
    def __init__(self, sentinel) -> None:
        self.sentinel = sentinel


def _front_end(event, procs, conns, timeout=30.0):
    """A `MultiprocExecutor` with only what `_await_logits_event` reads (no workers started)."""
    from kvpilot.parallel.executor import MultiprocExecutor

    ex = MultiprocExecutor.__new__(MultiprocExecutor)
    ex._logits_events = [event, event]
    ex.defers_logits = False
    ex._out_conn = conns[0]
    ex._procs = procs
    ex._conns = conns
    ex._step_timeout = timeout
    ex._dead = None
    died = []

    def die(reason):
        died.append(reason)
        raise EngineDeadError(reason)

    ex._die = die
    ex._worker_gone = lambda rank, starting: die(f"worker rank {rank} exited")
    return ex, died


def test_logits_event_wait_returns_once_the_event_completes():
    import multiprocessing as mp

    r, w = mp.Pipe(duplex=False)
    sentinel_r, sentinel_w = os.pipe()
    try:
        event = _Event(2000)
        ex, died = _front_end(event, [_Proc(sentinel_r)], [r])
        ex._await_logits_event(0)
        assert event.queries == 2001 and not died
    finally:
        os.close(sentinel_r)
        os.close(sentinel_w)


def test_logits_event_wait_stops_when_a_worker_dies():
    """A peer that exits mid-step (its sentinel becomes readable) ends the wait with EngineDeadError,
    although the event never completes: the front end must not wait on it forever."""
    import multiprocessing as mp

    r, w = mp.Pipe(duplex=False)
    alive_r, alive_w = os.pipe()
    dead_r, dead_w = os.pipe()
    os.write(dead_w, b"x")  # rank 1 "exited"
    try:
        ex, died = _front_end(_Event(10**12), [_Proc(alive_r), _Proc(dead_r)], [r, None])
        with pytest.raises(EngineDeadError, match="worker rank 1 exited"):
            ex._await_logits_event(0)
    finally:
        for fd in (alive_r, alive_w, dead_r, dead_w):
            os.close(fd)


def test_logits_event_wait_reports_a_worker_error_message():
    """An error a worker sends while the step runs (its traceback) ends the wait with that text."""
    import multiprocessing as mp

    from kvpilot.parallel.worker import MSG_ERROR

    r, w = mp.Pipe(duplex=False)
    sentinel_r, sentinel_w = os.pipe()
    w.send((MSG_ERROR, 0, "Traceback: boom"))
    try:
        ex, died = _front_end(_Event(10**12), [_Proc(sentinel_r)], [r])
        with pytest.raises(EngineDeadError, match="boom"):
            ex._await_logits_event(0)
    finally:
        os.close(sentinel_r)
        os.close(sentinel_w)


def test_logits_event_wait_times_out():
    import multiprocessing as mp

    r, w = mp.Pipe(duplex=False)
    sentinel_r, sentinel_w = os.pipe()
    try:
        ex, died = _front_end(_Event(10**12), [_Proc(sentinel_r)], [r], timeout=0.05)
        with pytest.raises(EngineDeadError, match="did not finish within"):
            ex._await_logits_event(0)
    finally:
        os.close(sentinel_r)
        os.close(sentinel_w)


def test_executor_after_shutdown_raises_engine_dead(tiny_model_dir):
    """A shut-down executor refuses steps and timing requests with EngineDeadError (not OSError from
    its closed pipes)."""
    llm = LLM(str(tiny_model_dir), skip_tokenizer_init=True, pipeline_parallel_size=2, device="cpu")
    ex = llm._executor
    llm.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        ex.step_timing()
    with pytest.raises(EngineDeadError, match="shut down"):
        ex.execute([])


def test_logits_event_wait_keeps_an_answer_that_runs_ahead():
    """Asynchronous steps: with greedy rows the output rank runs the next step before the front end
    has read the current one, so its answer arrives while the current step's event is polled. It is
    kept for the next `await_logits` (with its logits bytes when they come on the pipe), not taken
    for a protocol error; anything else on that pipe still ends the engine."""
    import multiprocessing as mp

    from kvpilot.parallel.worker import MSG_OK

    r, w = mp.Pipe(duplex=False)
    sentinel_r, sentinel_w = os.pipe()
    try:
        ex, died = _front_end(None, [_Proc(sentinel_r)], [r])

        class Done:  # the step completes only once the early answer was kept
            def query(self) -> bool:
                return bool(ex._stash)

        ex._logits_events = [Done()]
        ex.defers_logits = True
        ex._sent, ex._stash = [[1, None, False, 1]], []
        w.send((MSG_OK, (1, 8), [0], False))
        w.send_bytes(b"\0" * 32)
        ex._await_logits_event(0)
        assert not died
        assert ex._stash == [((MSG_OK, (1, 8), [0], False), b"\0" * 32)]
        ex._stash = []
        ex._logits_events = [_Event(10**12)]
        w.send(("timing", 0, {}))
        with pytest.raises(EngineDeadError, match="unexpected message 'timing' from the output worker"):
            ex._await_logits_event(0)
    finally:
        os.close(sentinel_r)
        os.close(sentinel_w)
