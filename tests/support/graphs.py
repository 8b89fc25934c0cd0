"""CPU doubles of the CUDA-graph sets (`kvpilot.runner.cuda_graphs`): their device hooks are replaced so the
host-side logic (padding, buckets, slots, copies) runs on CPU, and "replay" re-runs the captured
body eagerly on the static buffers."""

from __future__ import annotations

import torch


class _Event:
    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Replay:
    def __init__(self, fn) -> None:
        self.replay = fn


def cpu_graph_class(cls: type) -> type:
    """A subclass of ``cls`` (`DecodeGraphs` or `PrefillGraphs`) that runs on CPU; ``captured`` lists
    the keys its capture visited, in order."""

    class CpuGraphs(cls):
        _needs_cuda = False
        _host_buffer = staticmethod(lambda n, dtype: torch.zeros(n, dtype=dtype))
        _new_event = staticmethod(_Event)
        _capture_resources = staticmethod(lambda: (None, None))
        _sync = staticmethod(lambda: None)
        _reserved_bytes = staticmethod(lambda: 0)

        def __init__(self, *args, **kwargs) -> None:
            self.captured: list[tuple] = []
            super().__init__(*args, **kwargs)

        def _num_sms(self) -> int:
            return 4  # with 2 KV heads: decode batches 1..3 get context buckets

        def _capture_one(self, key, pool, stream):
            self.captured.append(key)
            self._body(*key)  # the warm-up run of a real capture (it raises where a capture would)
            return _Replay(lambda: self._body(*key))

    return CpuGraphs
