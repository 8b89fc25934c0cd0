"""The FastAPI application: OpenAI routes, health probes, Prometheus metrics, bearer auth.

Routes (DESIGN.md's HTTP contract):

- ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` for SSE),
  ``GET /v1/models``: need the bearer token when an API key is set.
- ``GET /health``: 200 only once the engine can serve; 503 while it loads, after it failed to load,
  or while the server drains on SIGTERM. NVIDIA NIM's probe paths answer too:
  ``GET /v1/health/ready`` (same as ``/health``) and ``GET /v1/health/live`` (200 while the process
  is healthy, 503 only if loading failed). Probes never need the API key (kubelet sends none).
- ``GET /metrics``: Prometheus text exposition of the registry in `ServerState`.

The engine is created by ``load`` in a worker thread once the app starts, so the port answers
(``/health`` = 503) while weights load.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from contextlib import asynccontextmanager
from typing import Any, Callable, Optional

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvpilot.server.errors import APIError, install_handlers
from kvpilot.server.metrics import PrometheusStatLogger
from kvpilot.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from kvpilot.server.serving_chat import create_chat_completion
from kvpilot.server.serving_completion import create_completion
from kvpilot.server.state import ServerState
from kvpilot.text import find_invalid_text

logger = logging.getLogger(__name__)


def attach_engine(state: ServerState, llm: Any, metrics_prefixes: tuple[str, ...] = ("kvpilot:",)) -> None:
    """Make ``llm`` the server's engine and feed its per-step stats into ``state.registry``."""
    stat_logger = PrometheusStatLogger(state.served_model_name, llm.max_seq_len, state.registry, metrics_prefixes)
    llm.add_stat_logger(stat_logger)
    state.llm = llm
    logger.info("engine ready: serving %s (context %d tokens)", state.served_model_name, llm.max_seq_len)
    gd = getattr(llm, "generation_defaults", None)
    if gd is not None:
        logger.info("sampling defaults for unset request fields (generation_config.json): %s", gd.describe())


def create_app(state: ServerState, load: Optional[Callable[[], Any]] = None,
               metrics_prefixes: tuple[str, ...] = ("kvpilot:",)) -> FastAPI:
    """Build the app around ``state``.

    Args:
        state: the server's shared state; ``state.llm`` may already be set (then ``load`` is None).
        load: creates the `kvpilot.LLM` (blocking; run in a worker thread at startup). Its failure
            is stored in ``state.load_error`` and keeps ``/health`` at 503.
        metrics_prefixes: ``("kvpilot:",)`` or ``("kvpilot:", "vllm:")`` for ``--metrics-compat vllm``.
    """

    async def _load() -> None:
        try:
            llm = await asyncio.to_thread(load)
            attach_engine(state, llm, metrics_prefixes)
        except Exception as exc:
            state.load_error = exc
            logger.exception("failed to load the model %s", state.model_path)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.ensure_future(_load()) if load is not None and state.llm is None else None
        try:
            yield
        finally:
            if task is not None and not task.done():
                await asyncio.shield(task)  # a half-loaded engine must still be shut down
            if state.llm is not None and load is not None:
                state.llm.shutdown()

    app = FastAPI(title="kvpilot", lifespan=lifespan)
    app.state.server = state
    install_handlers(app)

    def require_auth(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError("missing API key: send it as 'Authorization: Bearer <key>'", status=401,
                           code="invalid_api_key")
        if not secrets.compare_digest(token.strip().encode(), state.api_key.encode()):
            raise APIError("Incorrect API key provided", status=401, code="invalid_api_key")

    def require_ready() -> None:
        if state.draining:
            raise APIError("the server is shutting down and accepts no new requests", status=503)
        if state.llm is None:
            why = f"failed to load: {state.load_error}" if state.load_error else "still loading"
            raise APIError(f"the model is {why}", status=503)

    def _check_body(body: Any) -> None:
        """Refuse text that is not valid Unicode (400 naming the field); log unknown fields."""
        bad = find_invalid_text(body.model_dump())
        if bad is not None:
            raise APIError(bad[1], param=bad[0])
        extra = body.unknown_fields()
        if extra:
            logger.warning("ignoring unknown request fields: %s", ", ".join(extra))

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_auth)])

    @v1.post("/completions", dependencies=[Depends(require_ready)])
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        _check_body(body)
        return await create_completion(state, body, raw)

    @v1.post("/chat/completions", dependencies=[Depends(require_ready)])
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        _check_body(body)
        return await create_chat_completion(state, body, raw)

    @v1.get("/models")
    async def models() -> ModelList:
        max_len = state.llm.max_seq_len if state.llm is not None else None
        return ModelList(data=[ModelCard(id=state.served_model_name, root=state.model_path, max_model_len=max_len)])

    def _probe(ok: bool, message: str) -> JSONResponse:
        if ok:
            return JSONResponse({"object": "health.response", "message": message})
        why = ("shutting down" if state.draining else
               f"failed to load: {state.load_error}" if state.load_error else "loading")
        return APIError(f"not ready: {why}", status=503).response()

    @app.get("/health")
    async def health() -> JSONResponse:
        return _probe(state.ready, "Service is ready.")

    @app.get("/v1/health/ready")
    async def nim_ready() -> JSONResponse:
        return _probe(state.ready, "Service is ready.")

    @app.get("/v1/health/live")
    async def nim_live() -> JSONResponse:
        return _probe(state.load_error is None, "Service is live.")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(v1)
    return app
