"""The engine thread makes the logits' device its current CUDA device (Triton launches on the current
device), reproduced without a GPU."""

from __future__ import annotations

import threading

import pytest
import torch

from kvpilot.core.engine_loop import EngineLoop


class _Core:
    """The least an `EngineLoop` needs: no work, and an executor with an output device."""

    def __init__(self, device) -> None:
        self.executor = type("Ex", (), {"output_device": device})()
        self.has_work = False

    def fail_all(self, error) -> None:
        pass

    def flush_outputs(self) -> None:
        pass


@pytest.mark.parametrize("device,expected", [(torch.device("cuda", 1), [torch.device("cuda", 1)]),
                                             (None, []), (torch.device("cpu"), [])])
def test_engine_thread_makes_the_logits_device_current(monkeypatch, device, expected):
    """With pipeline parallelism on one node the output rank is the last GPU, and the front end's sampler
    launches Triton kernels on its logits from the engine thread: the engine thread makes the executor's
    output device current before its first step (on GPU 0 every sampled request would fail with
    "Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)"; test_parallel_gpu.py runs
    PP 2 on two GPUs)."""
    calls: list[tuple[object, str]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((d, threading.current_thread().name)))
    loop = EngineLoop(_Core(device))
    loop.start()
    loop.inbox.put(("stop", None))
    loop._thread.join(10)
    assert not loop._thread.is_alive()
    assert [d for d, _ in calls] == expected
    assert all(name == "kvpilot-engine" for _, name in calls)  # the engine thread, not the caller's
