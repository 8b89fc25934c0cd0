"""What a request gives back: `RequestOutput` (one per prompt) and `CompletionOutput` (one per choice).

As in TensorRT-LLM's LLM API, `generate_async` returns the `RequestOutput` at once and the engine
fills it in: ``await output`` (or ``output.result()`` / ``await output.aresult()``) waits for the end;
``async for chunk in output`` (or ``for chunk in output``) yields it after every engine step that
produced something, with ``CompletionOutput.text`` cumulative and ``text_diff`` the new part.

The engine thread pushes `RequestUpdate` records into a thread-safe queue; they are applied on the
consumer's side, one per streamed chunk, so that the joined ``text_diff`` of all chunks equals the
final ``text`` however slowly the consumer reads.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

# The engine loop's thread (`kvpilot.core.engine_loop`): an abort called there cannot wait for itself.
ENGINE_THREAD_NAME = "kvpilot-engine"
_ABORT_WAIT_S = 10.0  # how long `RequestOutput.abort` waits for the engine to end the request


class RequestError(RuntimeError):
    """The engine could not complete a request (the message says why)."""


class RequestAborted(RequestError):
    """The request was aborted before it finished."""


class RequestTooLargeError(RequestError):
    """A request that can never be scheduled: even alone, its sequences need more KV-cache blocks,
    batch slots or tokens per step than the engine has."""


@dataclass
class Logprob:
    """Log-probability of one token (natural log) and its rank in the distribution (1 = most likely)."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    """One generated choice of a request.

    Attributes:
        index: position of this choice among the request's ``n``.
        text: all text generated so far (cumulative); ``text_diff`` is what the last chunk added.
        token_ids: all generated token ids; ``token_ids_diff`` is what the last chunk added.
        cumulative_logprob: sum of the chosen tokens' log-probabilities (natural log), or None.
        logprobs: per generated token, {token id: Logprob} with the top-N and the chosen token,
            when ``SamplingParams.logprobs`` is set.
        finish_reason: None while running, then "stop" (EOS, stop token or stop string), "length"
            (``max_tokens`` or the context limit) or "abort".
        stop_reason: the stop string or stop token id that ended the choice, else None.
        generation_logits: [num_generated, vocab] float32 when ``return_generation_logits``.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: Optional[float] = None
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    generation_logits: Any = None
    _prev_text_len: int = field(default=0, repr=False)
    _prev_token_len: int = field(default=0, repr=False)
    _prev_logprobs_len: int = field(default=0, repr=False)

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def text_diff(self) -> str:
        return self.text[self._prev_text_len:]

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._prev_token_len:]

    @property
    def logprobs_diff(self) -> list[dict[int, Logprob]]:
        return self.logprobs[self._prev_logprobs_len:]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SequenceDelta:
    """What one engine step added to one choice (plain data, engine thread -> consumer)."""

    index: int
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    generation_logits: Any = None
    replace: bool = False  # the choice's whole output is replaced (best_of selection)


@dataclass
class RequestUpdate:
    """One engine step's news for one request."""

    deltas: list[SequenceDelta]
    finished: bool = False
    error: Optional[BaseException] = None
    context_logits: Any = None
    prompt_logprobs: Optional[list] = None


@dataclass
class RequestMetrics:
    """Timestamps of one request, `time.monotonic()` seconds; with speculative decoding, the drafted
    tokens its sequences verified and how many of them were accepted (docs/speculative_decoding.md)."""

    arrival_time: float = 0.0
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class RequestOutput:
    """The result handle of one request; filled in by the engine while it runs.

    Attributes:
        request_id: engine-wide unique id (int).
        prompt: the prompt text (None when the prompt was given as token ids and not decoded).
        prompt_token_ids: the token ids the engine ran, BOS included.
        outputs: one `CompletionOutput` per choice (``n`` of them).
        finished: True once every choice has finished.
        context_logits: [prompt_len, vocab] float32 when ``return_context_logits``.
        prompt_logprobs: per prompt token (the first is None), {token id: Logprob}, when asked.
        metrics: `RequestMetrics` timestamps.
    """

    def __init__(self, request_id: int, prompt: Optional[str], prompt_token_ids: list[int], n: int,
                 streaming: bool = False, abort_fn: Optional[Callable[[int], None]] = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.outputs = [CompletionOutput(index=i) for i in range(n)]
        self.finished = False
        self.context_logits = None
        self.prompt_logprobs = None
        self.streaming = streaming
        self.metrics = RequestMetrics(arrival_time=time.monotonic())
        self._error: Optional[BaseException] = None
        self._abort_fn = abort_fn
        self._updates: deque[RequestUpdate] = deque()
        self._cond = threading.Condition()
        self._done_received = False
        self._yielded_final = False
        try:
            self._loop: Optional[asyncio.AbstractEventLoop] = asyncio.get_running_loop()
            self._event: Optional[asyncio.Event] = asyncio.Event()
        except RuntimeError:
            self._loop = None
            self._event = None

    # ---- engine side -------------------------------------------------------------------------
    def _push(self, update: RequestUpdate) -> None:
        """Called by the engine thread; wakes synchronous and asynchronous waiters."""
        with self._cond:
            self._updates.append(update)
            if update.finished:
                self._done_received = True
            self._cond.notify_all()
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._event.set)
            except RuntimeError:  # the consumer's loop is closed: nobody is waiting there
                pass

    # ---- consumer side -----------------------------------------------------------------------
    def _apply(self, update: RequestUpdate) -> None:
        for out in self.outputs:
            out._prev_text_len = len(out.text)
            out._prev_token_len = len(out.token_ids)
            out._prev_logprobs_len = len(out.logprobs)
        for d in update.deltas:
            out = self.outputs[d.index]
            if d.replace:
                out.text, out.token_ids, out.logprobs = "", [], []
                out._prev_text_len = out._prev_token_len = out._prev_logprobs_len = 0
            out.text += d.new_text
            out.token_ids.extend(d.new_token_ids)
            out.logprobs.extend(d.new_logprobs)
            if d.cumulative_logprob is not None:
                out.cumulative_logprob = d.cumulative_logprob
            if d.finish_reason is not None:
                out.finish_reason = d.finish_reason
                out.stop_reason = d.stop_reason
            if d.generation_logits is not None:
                if out.generation_logits is None or d.replace:
                    out.generation_logits = d.generation_logits
                else:
                    import torch

                    out.generation_logits = torch.cat([out.generation_logits, d.generation_logits])
        if update.context_logits is not None:
            self.context_logits = update.context_logits
        if update.prompt_logprobs is not None:
            self.prompt_logprobs = update.prompt_logprobs
        if update.error is not None:
            self._error = update.error
        if update.finished:
            self.finished = True
            self.metrics.finished_time = time.monotonic()

    def _apply_all(self) -> None:
        with self._cond:
            updates = list(self._updates)
            self._updates.clear()
        for u in updates:
            self._apply(u)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def result(self, timeout: Optional[float] = None) -> "RequestOutput":
        """Block until the request finishes; return self. Raises TimeoutError or the request's error."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._done_received, timeout=timeout):
                raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        self._apply_all()
        self._raise_if_failed()
        return self

    async def aresult(self) -> "RequestOutput":
        """Wait (asynchronously) until the request finishes; return self."""
        await self._wait_async(lambda: self._done_received)
        self._apply_all()
        self._raise_if_failed()
        return self

    async def _wait_async(self, ready: Callable[[], bool]) -> None:
        try:
            await self._wait_async_inner(ready)
        except asyncio.CancelledError:
            self.abort(wait=False)  # a cancelled waiter means nobody wants the result: free the KV blocks
            raise

    async def _wait_async_inner(self, ready: Callable[[], bool]) -> None:
        if self._event is None or self._loop is not asyncio.get_running_loop():
            # Created outside this loop: poll the condition from a thread instead.
            await asyncio.get_running_loop().run_in_executor(None, self._wait_sync, ready)
            return
        while True:
            with self._cond:
                if ready():
                    return
                self._event.clear()
            await self._event.wait()

    def _wait_sync(self, ready: Callable[[], bool]) -> None:
        with self._cond:
            self._cond.wait_for(ready)

    def __await__(self):
        # Streaming handles are returned at once so that the caller can iterate them.
        if self.streaming:
            async def _self():
                return self
            return _self().__await__()
        return self.aresult().__await__()

    def __aiter__(self) -> "_AsyncStream":
        # A separate iterator object, so that leaving the loop (which drops it) can abort the request.
        return _AsyncStream(self)

    async def __anext__(self) -> "RequestOutput":
        if self._yielded_final:
            raise StopAsyncIteration
        await self._wait_async(self._chunk_ready)
        return self._next_chunk()

    def __iter__(self):
        # A generator: leaving the loop closes it (at once, or when it is garbage-collected), and
        # the ``finally`` aborts a request that has not finished.
        try:
            while not self._yielded_final:
                self._wait_sync(self._chunk_ready)
                yield self._next_chunk()
        finally:
            if not self._yielded_final:
                self.abort(wait=False)

    def _chunk_ready(self) -> bool:
        return bool(self._updates) or (self.finished and not self._yielded_final)

    def _next_chunk(self) -> "RequestOutput":
        with self._cond:
            update = self._updates.popleft() if self._updates else None
        if update is not None:
            self._apply(update)
        self._raise_if_failed()
        if self.finished:
            self._yielded_final = True
        return self

    def abort(self, wait: bool = True) -> None:
        """Cancel the request.

        With ``wait`` (the default), returns once the engine has ended it: ``finished`` is True, the
        unfinished choices have finish_reason "abort" and their KV blocks are back in the pool (a
        streaming consumer's next chunk then raises `RequestAborted`). Without ``wait`` the abort is
        queued and takes effect before the engine's next step. A request that has already finished
        is left as it is.
        """
        if self._abort_fn is None or self._done_received:
            return
        self._abort_fn(self.request_id)
        if not wait or threading.current_thread().name == ENGINE_THREAD_NAME:
            return
        with self._cond:
            self._cond.wait_for(lambda: self._done_received, timeout=_ABORT_WAIT_S)
        if self._done_received:
            self._apply_merged()

    def _apply_merged(self) -> None:
        """Apply every pending update as one chunk (``text_diff`` and the like span all of them)."""
        with self._cond:
            updates = list(self._updates)
            self._updates.clear()
        if not updates:
            return
        prev = {o.index: (len(o.text), len(o.token_ids), len(o.logprobs)) for o in self.outputs}
        replaced = set()
        for u in updates:
            self._apply(u)
            replaced.update(d.index for d in u.deltas if d.replace)
        for o in self.outputs:
            if o.index in replaced:
                o._prev_text_len = o._prev_token_len = o._prev_logprobs_len = 0
            else:
                o._prev_text_len, o._prev_token_len, o._prev_logprobs_len = prev[o.index]

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
                f"outputs={self.outputs!r}, finished={self.finished})")


class _AsyncStream:
    """``async for`` over a `RequestOutput`: yields it after every engine step.

    Leaving the loop early (``break``, an exception, the iterator garbage-collected) aborts the
    request, as leaving a vLLM or TensorRT-LLM stream does: its KV blocks go back to the pool.
    """

    __slots__ = ("_out", "__weakref__")

    def __init__(self, out: RequestOutput) -> None:
        self._out = out

    def __aiter__(self) -> "_AsyncStream":
        return self

    async def __anext__(self) -> RequestOutput:
        return await self._out.__anext__()

    async def aclose(self) -> None:
        self._close()

    def _close(self) -> None:
        if not self._out._yielded_final:
            self._out.abort(wait=False)

    def __del__(self) -> None:
        self._close()


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shut down, or a worker failed); no request can be served."""
