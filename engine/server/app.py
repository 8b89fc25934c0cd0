"""The FastAPI application: OpenAI routes, health probes, Prometheus metrics, bearer auth.

Routes (DESIGN.md's HTTP contract):

- ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` for SSE),
  ``GET /v1/models``: need the bearer token when an API key is set.
- ``GET /health``: 200 only once the engine can serve; 503 while it loads, after it failed to load,
  or while the server drains on SIGTERM. NVIDIA NIM's probe paths answer too:
  ``GET /v1/health/ready`` (same as ``/health``) and ``GET /v1/health/live`` (200 while the process
  is healthy, 503 only if loading failed). Probes never need the API key (kubelet sends none).
- ``GET /metrics``: Prometheus text exposition of the registry in `ServerState`.
- LoRA (``--enable-lora``; docs/lora.md): an adapter is a model name. ``/v1/models`` lists each with
  the base model as ``parent``; ``POST /v1/load_lora_adapter`` ``{lora_name, lora_path}`` and
  ``POST /v1/unload_lora_adapter`` ``{lora_name}`` add and remove adapters at run time (vLLM's
  endpoints and plain-text answers; behind the API key like every ``/v1`` route). Loading reads
  and checks the adapter before answering (400 with the reason when it does not fit the model);
  removing one lets running requests finish with it.

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
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvpilot.server.errors import APIError, install_handlers
from kvpilot.server.metrics import PrometheusStatLogger
from kvpilot.server.protocol import (ChatCompletionRequest, CompletionRequest, LoadLoRAAdapterRequest, ModelCard,
                                     ModelList, UnloadLoRAAdapterRequest)
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
        cards = [ModelCard(id=state.served_model_name, root=state.model_path, max_model_len=max_len)]
        cards += [ModelCard(id=name, root=req.lora_path, parent=state.served_model_name, max_model_len=max_len)
                  for name, req in state.lora_modules.items()]
        return ModelList(data=cards)

    def require_lora() -> None:
        if not state.lora_enabled:
            raise APIError("LoRA adapters are not enabled on this server (start it with --enable-lora)")

    @v1.post("/load_lora_adapter", dependencies=[Depends(require_ready), Depends(require_lora)])
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        name = body.lora_name
        if name in state.lora_modules:
            raise APIError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        if name == state.served_model_name:
            raise APIError(f"'{name}' is the base model's name", param="lora_name")
        from kvpilot.lora.config import LoRARequest

        probe = LoRARequest(name, state._next_lora_id, body.lora_path)
        try:
            await asyncio.to_thread(state.llm.lora_cache.get, probe)
        except (OSError, ValueError) as exc:
            raise APIError(f"could not load the lora adapter '{name}': {exc}", param="lora_path") from None
        if name in state.lora_modules:  # loaded concurrently under the same name
            raise APIError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        state.add_lora(name, body.lora_path)
        logger.info("loaded LoRA adapter %s from %s", name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @v1.post("/unload_lora_adapter", dependencies=[Depends(require_ready), Depends(require_lora)])
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        name = body.lora_name
        req = state.lora_modules.pop(name, None)
        if req is None:
            raise APIError(f"The lora adapter '{name}' cannot be found.", status=404, param="lora_name",
                           code="model_not_found")
        state.llm.lora_cache.remove(req.lora_int_id)
        logger.info("unloaded LoRA adapter %s", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

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
