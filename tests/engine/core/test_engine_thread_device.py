"""Fifth session: cases found on the GPU machines, reproduced without a GPU where possible."""

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
    """With pipeline parallelism on one node the output rank is the last GPU, and the front end's
    sampler launched Triton kernels on its logits from the engine thread, whose current device was
    still GPU 0: every sampled request failed with "Pointer argument (at 0) cannot be accessed from
    Triton (cpu tensor?)" (tests/test_parallel_gpu.py, PP 2, two H200s). The engine thread now makes
    the executor's output device current before its first step."""
    calls: list[tuple[object, str]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((d, threading.current_thread().name)))
    loop = EngineLoop(_Core(device))
    loop.start()
    loop.inbox.put(("stop", None))
    loop._thread.join(10)
    assert not loop._thread.is_alive()
    assert [d for d, _ in calls] == expected
    assert all(name == "kvpilot-engine" for _, name in calls)  # the engine thread, not the caller's
