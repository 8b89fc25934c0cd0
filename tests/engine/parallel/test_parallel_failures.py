"""A failing or vanishing worker stops the engine with a clear error, and nothing hangs; the
missing ``if __name__ == "__main__":`` guard is named; a LeaderWorkerSet group forms from LWS's env."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
from support.parallel import lws_worker_pod, run_tiny_workload

from kvpilot import LLM, EngineDeadError, RequestError, SamplingParams
from kvpilot.runner.model_runner import ScheduledSeq
from support.parallel import tiny_model_dir, tiny_single_reference  # noqa: F401  (fixtures)

pytestmark = pytest.mark.timeout(120)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_worker_exception_raises_engine_dead_with_its_traceback(stories_model_dir):
    llm = LLM(str(stories_model_dir), tensor_parallel_size=2, device="cpu")
    try:
        expected = llm.generate("Once", GREEDY).outputs[0].text
        assert expected  # the engine worked before the failure
        # A block id far outside the pool makes rank 0's KV write fail while rank 1 waits in a collective.
        bad = [ScheduledSeq(seq_id=0, token_ids=[1], start_pos=0, block_table=[10 ** 9], sample=True)]
        t0 = time.monotonic()
        ex = llm._executor

        def step(plan):  # an asynchronous executor reports the step's failure when its logits are awaited
            ex.execute(plan)
            if ex.defers_logits:
                ex.await_logits()

        with pytest.raises(EngineDeadError, match=r"(?s)worker rank \d failed:.*Traceback") as info:
            step(bad)
        assert time.monotonic() - t0 < 30
        assert "tensor/pipeline-parallel engine stopped" in str(info.value)
        assert all(not p.is_alive() for p in llm._executor._procs)
        with pytest.raises(EngineDeadError, match="worker rank"):
            step(bad)
        llm._loop._thread.join(timeout=10)  # the executor stopped the engine loop
        with pytest.raises(EngineDeadError, match="worker rank"):
            llm.generate("Once", GREEDY)
    finally:
        llm.shutdown()


def test_killed_worker_fails_requests_and_engine(stories_model_dir):
    llm = LLM(str(stories_model_dir), pipeline_parallel_size=2, device="cpu")
    try:
        llm._executor._procs[1].kill()
        llm._executor._procs[1].join(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(RequestError, match=r"worker rank 1 exited with code -9"):
            llm.generate("Once", GREEDY)
        assert time.monotonic() - t0 < 30
        llm._loop._thread.join(timeout=10)
        with pytest.raises(EngineDeadError):
            llm.generate_async("Once", GREEDY)
    finally:
        llm.shutdown()


def test_layout_errors_before_any_process_starts(stories_model_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide num_attention_heads 8"):
        LLM(str(stories_model_dir), tensor_parallel_size=3, device="cpu")
    with pytest.raises(ValueError, match="pipeline_parallel_size 6 exceeds the model's 5 layers"):
        LLM(str(stories_model_dir), pipeline_parallel_size=6, device="cpu")


def _run_script(tmp_path, body: str, env=None, timeout=90) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout,
                          cwd=str(tmp_path), env={**os.environ, **(env or {})})


def test_missing_main_guard_is_named(tmp_path, stories_model_dir):
    proc = _run_script(tmp_path, f"""
        from kvpilot import LLM
        llm = LLM({str(stories_model_dir)!r}, tensor_parallel_size=2, device="cpu")
        print("SHOULD NOT GET HERE")
        """)
    assert proc.returncode != 0
    assert "SHOULD NOT GET HERE" not in proc.stdout
    assert "if __name__ == '__main__':" in proc.stderr
    assert "EngineDeadError" in proc.stderr and "while starting" in proc.stderr


def test_leader_worker_set_group_from_env(tmp_path, tiny_model_dir, tiny_single_reference, monkeypatch):
    """Two 'pods' on localhost: the leader (this process, stage 0) and worker 1 (stage 1)."""
    with lws_worker_pod(tmp_path, tiny_model_dir, monkeypatch, pp=2):
        with LLM(str(tiny_model_dir), skip_tokenizer_init=True, pipeline_parallel_size=2, device="cpu") as llm:
            assert llm._executor.spec.multi_node and llm._executor.spec.ranks_per_node == 1
            toks, lps = run_tiny_workload(llm)
        assert toks == tiny_single_reference[0]
        assert lps == pytest.approx(tiny_single_reference[1], abs=1e-4)


