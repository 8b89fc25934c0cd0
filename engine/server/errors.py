"""HTTP errors in OpenAI's shape, and the handlers that turn every failure into one.

Every 4xx carries ``{"error": {"message", "type", "param", "code"}}``: ``message`` says which field
was wrong and why, ``param`` names the field (dotted path, e.g. ``messages[0].content``). A 5xx means
a bug in the server; its body has the same shape so that clients can still parse it.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpilot.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

# OpenAI's error `type` for each status the server returns.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


RETRY_AFTER_S = 5  # the ``Retry-After`` of a 503 (model loading, server draining), seconds


class APIError(Exception):
    """An error to send to the client as OpenAI's error body with HTTP ``status``."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None,
                 code: Optional[str] = None, type: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        if self.status == 503:  # loading or draining: worth retrying, elsewhere or a little later
            headers = {"Retry-After": str(RETRY_AFTER_S)}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready (nothing is sent back)."""


# pydantic error types whose `loc` ends in a union member's tag rather than a field name.
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def loc_to_param(loc: tuple) -> Optional[str]:
    """A pydantic error location as a dotted parameter path (``("messages", 0, "role")`` ->
    ``messages[0].role``); the leading ``"body"`` and union member tags are dropped."""
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
            continue
        item = str(item)
        if not parts and item == "body":
            continue
        if item in _TYPE_TAGS or "[" in item or "-" in item:
            break  # the rest names the union member tried, not a field
        parts.append(item if not parts else f".{item}")
    return "".join(parts) or None


def validation_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error of a request body, as a 400 naming the field."""
    errors = exc.errors()
    if not errors:
        return APIError("invalid request body")
    err = errors[0]
    if err.get("type") == "json_invalid":
        ctx = err.get("ctx") or {}
        return APIError(f"the request body is not valid JSON: {ctx.get('error', err.get('msg'))}")
    param = loc_to_param(tuple(err.get("loc", ())))
    if param is None and err.get("type") in ("model_attributes_type", "dict_type"):
        return APIError("the request body must be a JSON object")
    msg = str(err.get("msg", "invalid value"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    elif param:
        got = err.get("input")
        msg = f"{param}: {msg}" + (f", got {got!r}" if got is not None and err.get("type") != "missing" else "")
    if err.get("type") == "missing":
        msg = f"{param} is required" if param else "the request body must be a JSON object"
    return APIError(msg, param=param)


def install_handlers(app: FastAPI) -> None:
    """Route `APIError`, request-validation failures, HTTP errors and crashes to OpenAI's body."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(str(exc.detail), status=exc.status_code).response()

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        logger.info("client disconnected from %s; its request was aborted", request.url.path)
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error serving %s %s", request.method, request.url.path)
        return APIError(f"internal server error: {type(exc).__name__}: {exc}", status=500).response()
