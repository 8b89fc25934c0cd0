"""What the HTTP server knows about its one engine: loaded or not, draining or not, what is in flight."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from prometheus_client import CollectorRegistry

from kvpilot.outputs import RequestOutput

logger = logging.getLogger(__name__)


@dataclass
class ServerState:
    """Shared state of one server process (one engine per process).

    Attributes:
        served_model_name: the name clients pass as ``model`` (and the metrics' ``model_name``).
        model_path: where the weights came from (shown as ``root`` in ``/v1/models``).
        llm: the `kvpilot.LLM`, None while it loads.
        chat_template: ``--chat-template`` text, overriding the tokenizer's own.
        api_key: bearer token required on ``/v1/*`` (health probes excepted), or None.
        registry: the Prometheus registry ``/metrics`` renders.
        load_error: why loading failed, if it did (``/health`` stays 503).
        draining: set on SIGTERM: ``/health`` and new requests get 503 while running ones finish.
        lora_enabled: ``--enable-lora``: requests may name a LoRA adapter as their ``model``.
        lora_modules: adapter name -> `kvpilot.executor.LoRARequest` (``--lora-modules`` and
            ``/v1/load_lora_adapter``); each gets an id never used before in this process.
        tool_call_parser: ``--tool-call-parser`` (`kvpilot.server.tool_parsers.TOOL_PARSERS`), or None.
        reasoning_parser: ``--reasoning-parser`` (`kvpilot.server.reasoning.REASONING_PARSERS`), or None.
    """

    served_model_name: str
    model_path: str
    llm: Any = None
    chat_template: Optional[str] = None
    api_key: Optional[str] = None
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    load_error: Optional[BaseException] = None
    draining: bool = False
    lora_enabled: bool = False
    lora_modules: dict[str, Any] = field(default_factory=dict)
    tool_call_parser: Optional[str] = None
    reasoning_parser: Optional[str] = None
    _next_lora_id: int = 1
    _active_http: int = 0
    _outputs: set = field(default_factory=set)
    _idle: Optional[asyncio.Event] = None

    @property
    def ready(self) -> bool:
        """True when requests can be served: the engine is loaded and the server is not draining."""
        return self.llm is not None and not self.draining

    def add_lora(self, name: str, path: str) -> Any:
        """Register adapter ``name`` at ``path`` under a fresh ``lora_int_id``; returns its `LoRARequest`."""
        from kvpilot.lora.config import LoRARequest

        req = LoRARequest(name, self._next_lora_id, path)
        self._next_lora_id += 1
        self.lora_modules[name] = req
        return req

    def lora_request(self, model: Optional[str]) -> Any:
        """The `LoRARequest` of the adapter named ``model``, or None (the base model, or unknown)."""
        return self.lora_modules.get(model) if model is not None else None

    @property
    def num_active(self) -> int:
        """HTTP generation requests not yet answered in full (streams count until their last chunk)."""
        return self._active_http

    def _idle_event(self) -> asyncio.Event:
        if self._idle is None:
            self._idle = asyncio.Event()
            if self._active_http == 0:
                self._idle.set()
        return self._idle

    def begin(self) -> None:
        """Count one generation request as in flight (call `end` exactly once when it is done)."""
        self._active_http += 1
        self._idle_event().clear()

    def end(self) -> None:
        self._active_http -= 1
        if self._active_http == 0:
            self._idle_event().set()

    @contextlib.contextmanager
    def tracking(self, outputs: list[RequestOutput]) -> Iterator[None]:
        """Remember ``outputs`` so that a drain past its deadline can abort them."""
        self._outputs.update(outputs)
        try:
            yield
        finally:
            self._outputs.difference_update(outputs)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for in-flight requests to finish; True if they all did."""
        try:
            await asyncio.wait_for(self._idle_event().wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def abort_all(self) -> int:
        """Abort every tracked engine request; returns how many were aborted."""
        outs = list(self._outputs)
        for out in outs:
            out.abort(wait=False)
        return len(outs)
