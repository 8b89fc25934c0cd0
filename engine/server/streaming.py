"""Plumbing between engine results and HTTP: per-choice deltas, SSE framing, client disconnects.

The engine's `RequestOutput` is updated in place on every ``async for`` step, so each step's news
is copied out at once into `ChoiceDelta` records; several prompts of one completions request are
merged into one stream of them. SSE framing follows OpenAI: ``data: {json}\\n\\n`` per chunk and
``data: [DONE]\\n\\n`` at the end.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Optional, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvpilot.outputs import Logprob, RequestAborted, RequestOutput
from kvpilot.server.errors import ClientDisconnected

logger = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"

T = TypeVar("T")


def sse(payload: str) -> str:
    """One server-sent event carrying ``payload`` (a JSON document on one line)."""
    return f"data: {payload}\n\n"


@dataclass
class ChoiceDelta:
    """What one engine step added to one choice of one prompt.

    ``prompt_index`` is the prompt's position in the request, ``index`` the choice's among ``n``.
    ``logprobs`` has one {token id: Logprob} per entry of ``token_ids``.
    """

    prompt_index: int
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None


def _take_deltas(prompt_index: int, out: RequestOutput, reported: set[int]) -> list[ChoiceDelta]:
    deltas = []
    for c in out.outputs:
        if c.index in reported:
            continue
        text, toks = c.text_diff, c.token_ids_diff
        if not text and not toks and c.finish_reason is None:
            continue
        if c.finish_reason is not None:
            reported.add(c.index)
        deltas.append(ChoiceDelta(prompt_index, c.index, text, list(toks), list(c.logprobs_diff),
                                  c.finish_reason, c.stop_reason))
    return deltas


async def _deltas_of(prompt_index: int, out: RequestOutput) -> AsyncIterator[list[ChoiceDelta]]:
    reported: set[int] = set()
    try:
        async for chunk in out:
            deltas = _take_deltas(prompt_index, chunk, reported)
            if deltas:
                yield deltas
    except RequestAborted:
        # Aborted by the server (drain deadline): the choices end with finish_reason "abort".
        deltas = _take_deltas(prompt_index, out, reported)
        if deltas:
            yield deltas


async def stream_deltas(outputs: list[RequestOutput]) -> AsyncIterator[list[ChoiceDelta]]:
    """Yield, after each engine step of any of ``outputs``, the deltas of the choices that changed.

    Ends when every request has finished (an aborted request's choices end with finish_reason
    "abort"). Raises the engine's `RequestError` if a request failed. Cancelling the consumer
    aborts the requests (their KV blocks go back to the pool).
    """
    if len(outputs) == 1:
        try:
            async for deltas in _deltas_of(0, outputs[0]):
                yield deltas
        finally:
            outputs[0].abort(wait=False)
        return

    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, out: RequestOutput) -> None:
        try:
            async for deltas in _deltas_of(i, out):
                queue.put_nowait(deltas)
        except BaseException as exc:  # handed to the consumer, which re-raises it
            queue.put_nowait(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(i, o)) for i, o in enumerate(outputs)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        for o in outputs:
            o.abort(wait=False)


async def wait_all(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Wait for every request to finish; an aborted one is returned as it stands (its unfinished
    choices have finish_reason "abort"). Raises the first other `RequestError`."""
    results = await asyncio.gather(*(o.aresult() for o in outputs), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, RequestAborted):
            raise r
    return outputs


class EngineStreamingResponse(StreamingResponse):
    """An SSE response that counts as in flight (for the drain) from creation until it is sent, and
    aborts its engine requests however it ends: finished, client gone, or cancelled before the
    first chunk (when the body generator never ran and so cannot clean up itself).

    Args:
        content: async iterator of SSE strings.
        state: the server state (a `ServerState`), whose in-flight count this response holds.
        outputs: the engine requests behind the stream.
    """

    def __init__(self, content: AsyncIterator[str], state: Any, outputs: list[RequestOutput]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._state = state
        self._outputs = outputs
        state.begin()

    async def __call__(self, scope, receive, send) -> None:
        try:
            with self._state.tracking(self._outputs):
                await super().__call__(scope, receive, send)
        finally:
            for out in self._outputs:
                out.abort(wait=False)
            self._state.end()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` unless the client disconnects first; then cancel it (which aborts the
    engine requests it waits on) and raise `ClientDisconnected`.

    The request body must already be read (FastAPI has parsed it), so the only message left to
    receive is ``http.disconnect``.
    """
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        watcher.cancel()
    if work in done:
        return work.result()
    work.cancel()
    raise ClientDisconnected()


def token_text(tokenizer: Any, token_id: int, lp: Optional[Logprob] = None) -> str:
    """The text of one token for logprobs output: the engine's decoded piece, else decode([id])."""
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])
