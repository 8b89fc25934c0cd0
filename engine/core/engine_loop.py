"""`EngineLoop`: runs `EngineCore.step` on a background thread; callers talk to it through a queue."""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from typing import Any, Callable, Optional

from kvpilot.core.engine_core import EngineCore
from kvpilot.core.sequence import Request
from kvpilot.core.stats import IterationStats
from kvpilot.outputs import ENGINE_THREAD_NAME, EngineDeadError

logger = logging.getLogger(__name__)

_STATS_KEPT = 1000


class EngineLoop:
    """Runs `EngineCore.step` on a daemon thread; other threads talk to it through a queue."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.inbox: "queue.SimpleQueue[tuple[str, Any]]" = queue.SimpleQueue()
        self.stat_loggers: list[Callable[[IterationStats], None]] = []
        self._stats: deque[dict[str, Any]] = deque(maxlen=_STATS_KEPT)
        self._stats_cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=ENGINE_THREAD_NAME, daemon=True)
        self._stopped = threading.Event()
        self._submit_lock = threading.Lock()
        self.error: Optional[BaseException] = None

    def start(self) -> None:
        self._thread.start()

    def submit(self, req: Request) -> None:
        # Under the lock, so that a request can never slip in after the loop's final drain.
        with self._submit_lock:
            if self._stopped.is_set():
                raise EngineDeadError(f"the engine is not running{f': {self.error!r}' if self.error else ''}")
            self.inbox.put(("add", req))

    def abort(self, request_id: int) -> None:
        self.inbox.put(("abort", request_id))

    def stop(self) -> None:
        if not self._stopped.is_set():
            self.inbox.put(("stop", None))
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout=30)

    def take_stats(self, timeout: float) -> list[dict[str, Any]]:
        with self._stats_cond:
            self._stats_cond.wait_for(lambda: bool(self._stats), timeout=timeout)
            out = list(self._stats)
            self._stats.clear()
        return out

    def _handle(self, kind: str, payload) -> bool:
        if kind == "add":
            self.core.add_request(payload)
        elif kind == "abort":
            self.core.abort_request(payload)
        elif kind == "stop":
            return False
        return True

    def _report(self, stats: Optional[IterationStats]) -> None:
        if stats is None:
            self.core.flush_outputs()
            return
        with self._stats_cond:
            self._stats.append(stats.to_dict())
            self._stats_cond.notify_all()
        for fn in self.stat_loggers:
            try:
                fn(stats)
            except Exception:
                logger.exception("stat logger failed")
        self.core.flush_outputs()

    def _run(self) -> None:
        running = True
        try:
            # This thread samples on the device the logits come back on; with pipeline parallelism
            # that is the last stage's GPU, not this process's default one (Triton needs it current).
            dev = getattr(self.core.executor, "output_device", None)
            if dev is not None and dev.type == "cuda":
                import torch

                torch.cuda.set_device(dev)
            while running:
                # Block for input only when there is nothing to compute.
                try:
                    item = self.inbox.get_nowait() if self.core.has_work else self.inbox.get()
                except queue.Empty:
                    item = None
                handled = False
                while item is not None:
                    handled = True
                    if not self._handle(*item):
                        running = False
                        break
                    try:
                        item = self.inbox.get_nowait()
                    except queue.Empty:
                        item = None
                if not running:
                    break
                if self.core.has_work:
                    try:
                        self._report(self.core.step())
                    except EngineDeadError as e:  # a worker died: nothing can be served any more
                        self.error = e
                        logger.error("engine stopped: %s", e)
                        break
                    except Exception as e:  # a bug or device error: fail what is in flight, keep serving
                        logger.exception("engine step failed")
                        self.core.fail_all(e)
                        self._report(self.core.idle_stats())
                elif handled:
                    self._report(self.core.idle_stats())
        except BaseException as e:  # pragma: no cover - last resort
            self.error = e
            logger.exception("engine loop died")
        finally:
            with self._submit_lock:
                self._stopped.set()
            self.core.fail_all(self.error or EngineDeadError("the engine was shut down"))
            self.core.flush_outputs()
            while True:
                try:
                    kind, payload = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "add":
                    self.core.add_request(payload)
                    self.core.fail_all(EngineDeadError("the engine was shut down"))
                    self.core.flush_outputs()
