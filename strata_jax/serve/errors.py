"""HTTP errors in each API's own shape, and the handlers that answer them.

OpenAI: `{"error": {"message", "type", "param", "code"}}`; Anthropic (any /v1/messages path):
`{"type": "error", "error": {"type", "message"}}`.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from strata_jax.errors import StrataError
from strata_jax.serve.worker import WorkerUnavailable

log = logging.getLogger("strata_jax.serve")

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    422: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error"}
_OPENAI_TYPES = {404: "not_found_error", 503: "server_error"}


class ApiError(Exception):
  """An error answered with `status`; shaped per API by the exception handler."""

  def __init__(self, status: int, message: str, *, kind: str | None = None,
               param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.kind, self.param, self.code = (status, message, kind, param,
                                                                   code)


def is_anthropic(request: HttpRequest) -> bool:
  return request.url.path.rstrip("/") == "/v1/messages"


def error_body(anthropic: bool, status: int, message: str, kind: str | None = None,
               param: str | None = None, code: str | None = None) -> dict:
  """The JSON error object of one API (also sent as a stream's last event)."""
  if anthropic:
    return {"type": "error", "error": {"type": kind or _ANTHROPIC_TYPES.get(status, "api_error"),
                                       "message": message}}
  return {"error": {"message": message,
                    "type": kind or _OPENAI_TYPES.get(status, "invalid_request_error"
                                                      if status < 500 else "server_error"),
                    "param": param, "code": code}}


def _error(request: HttpRequest, status: int, message: str, **kw) -> JSONResponse:
  return JSONResponse(error_body(is_anthropic(request), status, message, **kw),
                      status_code=status)


def unavailable(e: WorkerUnavailable) -> ApiError:
  """The 503 for a dead, stopping or overloaded worker."""
  return ApiError(503, str(e), kind="overloaded_error" if e.overloaded else "api_error",
                  code="overloaded" if e.overloaded else "engine_unavailable")


def event_error(e) -> ApiError:
  """An exception the worker handed back for a request, as the ApiError to answer."""
  if isinstance(e, ApiError):
    return e
  if isinstance(e, WorkerUnavailable):
    return unavailable(e)
  if isinstance(e, StrataError):
    return ApiError(400, str(e))
  return ApiError(500, f"internal error: {type(e).__name__}: {e}")


def install_error_handlers(app: FastAPI):
  @app.exception_handler(ApiError)
  async def _api_error(request, e: ApiError):
    kind = e.kind
    if kind in ("overloaded_error", "api_error") and not is_anthropic(request):
      kind = "server_error"
    return _error(request, e.status, e.message, kind=kind, param=e.param, code=e.code)

  @app.exception_handler(StrataError)
  async def _strata_error(request, e: StrataError):
    return _error(request, 400, str(e))

  @app.exception_handler(WorkerUnavailable)
  async def _worker_error(request, e: WorkerUnavailable):
    return await _api_error(request, unavailable(e))

  @app.exception_handler(RequestValidationError)
  async def _validation_error(request, e: RequestValidationError):
    errors = list(e.errors())
    if any(err.get("type") == "json_invalid" for err in errors):
      return _error(request, 400, "the request body is not valid JSON")
    if any(err.get("type") == "missing" and tuple(err.get("loc", ())) == ("body",)
           for err in errors):
      return _error(request, 400, "the request body is empty: expected a JSON object")
    parts = []
    for err in errors[:5]:
      loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
      parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    first = errors[0].get("loc", ()) if errors else ()
    param = ".".join(str(x) for x in first if x != "body") or None
    return _error(request, 422, "; ".join(parts) or "invalid request", param=param)

  @app.exception_handler(StarletteHTTPException)
  async def _http_error(request, e: StarletteHTTPException):
    if e.status_code == 404:
      msg = f"no route {request.method} {request.url.path}"
    elif e.status_code == 405:
      msg = f"method {request.method} is not allowed on {request.url.path}"
    else:
      msg = str(e.detail)
    return _error(request, e.status_code, msg)

  @app.exception_handler(Exception)
  async def _unexpected(request, e: Exception):
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return _error(request, 500, f"internal error: {type(e).__name__}: {e}")
