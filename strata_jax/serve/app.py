"""`strata-jax serve`: OpenAI- and Anthropic-compatible HTTP API over one Engine.

Endpoints:
  POST /v1/chat/completions, POST /v1/completions    OpenAI (stream: SSE `data:` lines, [DONE])
  POST /v1/messages                                  Anthropic (stream: Anthropic's event types)
  GET  /v1/models, GET /v1/models/{id}, GET /health
  POST /slots/{id}?action=save|restore|erase         llama.cpp slot sessions (--slot-save-path)

Every generation body takes `"lora": true|false` (absent: the config's default, else on when an
adapter is loaded). Requests in both switch states share the slots and batch together.
Beyond the two APIs: non-stream responses carry `"lora"` (the state that served them) and an
`X-Slot-Id` header (the slot to save afterwards); `/v1/completions` takes a prompt of token ids
and `"return_tokens": true` adds the sampled ids to the choice; `top_k` and `seed` are accepted
by every endpoint. Stop strings: text-level, and a one-token string also stops the engine.

Errors use each API's own shape: OpenAI `{"error": {"message", "type", "param", "code"}}`,
Anthropic `{"type": "error", "error": {"type", "message"}}` (for /v1/messages). Statuses: 400
bad request or malformed JSON, 404 unknown route / slot / session file, 413 prompt over the
engine's capacity, 422 wrong field types, 503 engine worker dead or overloaded.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import secrets
import time
import uuid
from typing import Annotated, Literal

from fastapi import Body, FastAPI, Query
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from strata_jax.engine.engine import Request
from strata_jax.errors import StrataError
from strata_jax.serve import schemas
from strata_jax.serve.worker import EngineWorker, WorkerUnavailable

log = logging.getLogger("strata_jax.serve")

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000
# Below this temperature sampling is greedy: logits / T would overflow float64 for T -> 0.
MIN_TEMPERATURE = 1e-5
SAMPLING_KEYS = ("lora", "temperature", "top_k", "top_p", "max_tokens")


class ApiError(Exception):
  """An error answered with `status`; shaped per API by the exception handler."""

  def __init__(self, status: int, message: str, *, kind: str | None = None,
               param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.kind, self.param, self.code = (status, message, kind, param,
                                                                   code)


# ---------------------------------------------------------------------------------------------
# Config

def check_sampling_defaults(sampling, where: str = "config") -> dict:
  """Validate a {"lora", "temperature", "top_k", "top_p", "max_tokens"} dict of defaults.

  Raises:
    StrataError: naming `where`, the key and what was expected.
  """
  if not isinstance(sampling, dict):
    raise StrataError(f"{where}: \"sampling\" must be a JSON object, got {_json_type(sampling)}")
  unknown = sorted(set(sampling) - set(SAMPLING_KEYS))
  if unknown:
    raise StrataError(f"{where}: unknown sampling key(s) {', '.join(map(repr, unknown))}; "
                      f"allowed: {', '.join(SAMPLING_KEYS)}")

  def number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

  def integer(v):
    return isinstance(v, int) and not isinstance(v, bool)

  rules = {
      "lora": (lambda v: isinstance(v, bool), "true or false"),
      "temperature": (lambda v: number(v) and v >= 0, "a number >= 0"),
      "top_k": (lambda v: integer(v) and v >= 0, "an integer >= 0"),
      "top_p": (lambda v: number(v) and 0 <= v <= 1, "a number in [0, 1]"),
      "max_tokens": (lambda v: integer(v) and v >= 1, "an integer >= 1"),
  }
  for key, value in sampling.items():
    ok, expected = rules[key]
    if not ok(value):
      raise StrataError(f"{where}: sampling.{key} must be {expected}, got {json.dumps(value)}")
  return dict(sampling)


def load_config(path: str) -> dict:
  """Read `--config FILE`: {"sampling": {...defaults}}; returns the sampling defaults."""
  try:
    with open(path, encoding="utf-8") as f:
      raw = json.load(f)
  except OSError as e:
    raise StrataError(f"{path}: cannot read the server config: {e.strerror or e}") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise StrataError(f"{path}: the server config is not valid JSON: {e}") from None
  if not isinstance(raw, dict):
    raise StrataError(f"{path}: the server config must be a JSON object, got {_json_type(raw)}")
  unknown = sorted(set(raw) - {"sampling"})
  if unknown:
    raise StrataError(f"{path}: unknown config key(s) {', '.join(map(repr, unknown))}; "
                      "allowed: sampling")
  return check_sampling_defaults(raw.get("sampling", {}), where=path)


def _json_type(v) -> str:
  return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
          type(None): "null"}.get(type(v), "a number")


# ---------------------------------------------------------------------------------------------
# Errors

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    422: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error"}
_OPENAI_TYPES = {404: "not_found_error", 503: "server_error"}


def _is_anthropic(request: HttpRequest) -> bool:
  return request.url.path.rstrip("/") == "/v1/messages"


def _error_body(anthropic: bool, status: int, message: str, kind: str | None = None,
                param: str | None = None, code: str | None = None) -> dict:
  if anthropic:
    return {"type": "error", "error": {"type": kind or _ANTHROPIC_TYPES.get(status, "api_error"),
                                       "message": message}}
  return {"error": {"message": message,
                    "type": kind or _OPENAI_TYPES.get(status, "invalid_request_error"
                                                      if status < 500 else "server_error"),
                    "param": param, "code": code}}


def _error(request: HttpRequest, status: int, message: str, **kw) -> JSONResponse:
  return JSONResponse(_error_body(_is_anthropic(request), status, message, **kw),
                      status_code=status)


def _unavailable(e: WorkerUnavailable) -> ApiError:
  return ApiError(503, str(e), kind="overloaded_error" if e.overloaded else "api_error",
                  code="overloaded" if e.overloaded else "engine_unavailable")


def _install_error_handlers(app: FastAPI):
  @app.exception_handler(ApiError)
  async def _api_error(request, e: ApiError):
    kind = e.kind
    if kind in ("overloaded_error", "api_error") and not _is_anthropic(request):
      kind = "server_error"
    return _error(request, e.status, e.message, kind=kind, param=e.param, code=e.code)

  @app.exception_handler(StrataError)
  async def _strata_error(request, e: StrataError):
    return _error(request, 400, str(e))

  @app.exception_handler(WorkerUnavailable)
  async def _worker_error(request, e: WorkerUnavailable):
    return await _api_error(request, _unavailable(e))

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


class _JsonBodies:
  """POST bodies are JSON whatever their Content-Type says (as llama.cpp reads `curl -d`)."""

  def __init__(self, app):
    self.app = app

  async def __call__(self, scope, receive, send):
    if scope["type"] == "http" and scope["method"] == "POST":
      headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
      ctype = dict(scope["headers"]).get(b"content-type", b"")
      headers.append((b"content-type", ctype if b"json" in ctype else b"application/json"))
      scope = dict(scope, headers=headers)
    await self.app(scope, receive, send)


# ---------------------------------------------------------------------------------------------
# Generation

@dataclasses.dataclass
class _Gen:
  """One resolved generation: prompt ids, sampling, stops."""
  ids: list[int]
  max_tokens: int
  temperature: float
  top_k: int
  top_p: float
  seed: int
  lora: bool | None
  stop_ids: frozenset
  stops: list[str]               # text-level stop strings
  stop_id_text: dict             # stop-string tokens -> their string


def _first(*values):
  return next((v for v in values if v is not None), None)


def _cut_stop(text: str, stops: list[str], start: int = 0) -> tuple[str, str | None]:
  """Cut `text` at the earliest stop string found at or after `start`."""
  best, which = None, None
  for s in stops:
    i = text.find(s, start)
    if i >= 0 and (best is None or i < best):
      best, which = i, s
  return (text, None) if best is None else (text[:best], which)


class _TextStream:
  """Incremental detokenizer for streaming: emits text only when it is final (no partial UTF-8
  sequence, no possible start of a stop string), and cuts at the first stop string."""

  def __init__(self, model, spec: _Gen):
    self.model, self.spec = model, spec
    self.ids: list[int] = []
    self.text = ""
    self.sent = 0
    self.matched: str | None = None
    self._prefix = self._read = 0
    self._maxstop = max((len(s) for s in spec.stops), default=0)

  def push(self, tok: int) -> str:
    if self.matched is not None or tok in self.spec.stop_ids or self.model.tokenizer is None:
      return ""
    self.ids.append(tok)
    # Decode a window starting a few tokens back, so merges at the seam come out right.
    before = self.model.decode(self.ids[self._prefix:self._read]) or ""
    after = self.model.decode(self.ids[self._prefix:]) or ""
    if len(after) > len(before) and after.startswith(before) and not after.endswith("\ufffd"):
      self.text += after[len(before):]
      self._prefix, self._read = self._read, len(self.ids)
    return self._emit(final=False)

  def _holdback(self) -> int:
    for k in range(min(self._maxstop - 1, len(self.text) - self.sent), 0, -1):
      tail = self.text[-k:]
      if any(s.startswith(tail) for s in self.spec.stops):
        return k
    return 0

  def _emit(self, final: bool) -> str:
    if self.spec.stops and self.matched is None:
      self.text, self.matched = _cut_stop(self.text, self.spec.stops,
                                          max(0, self.sent - self._maxstop))
    end = len(self.text)
    if not final and self.matched is None:
      end -= self._holdback()
    out = self.text[self.sent:end] if end > self.sent else ""
    self.sent = max(self.sent, end)
    return out

  def finish(self, full_text: str) -> str:
    """The rest of the text, given the exact (whole-sequence) decode, stops applied."""
    sent = self.text[:self.sent]
    if full_text.startswith(sent):
      self.text = full_text
    self.matched = None
    return self._emit(final=True)


@dataclasses.dataclass
class _Outcome:
  text: str
  finish: str            # "stop" | "length"
  stop_sequence: str | None
  prompt_tokens: int
  completion_tokens: int
  cached_tokens: int
  tokens: list[int]
  lora: bool
  slot: int


class _Server:
  """Per-app state and the generation plumbing shared by the endpoints."""

  def __init__(self, engine, worker: EngineWorker, model_name: str, slot_save_path: str | None,
               defaults: dict, max_tokens_cap: int | None):
    self.engine, self.worker, self.model = engine, worker, engine.model
    self.model_name, self.defaults = model_name, defaults
    self.slot_save_path = os.path.abspath(slot_save_path) if slot_save_path else None
    self.max_tokens_cap = max_tokens_cap
    self.created = int(time.time())

  # ----- prompts ---------------------------------------------------------------------------
  def chat_ids(self, messages: list[dict], prefill: str | None = None) -> list[int]:
    tok = self.model.tokenizer
    if tok is None or not hasattr(tok, "apply_chat_template"):
      raise ApiError(400, "this model has no tokenizer or chat template: use /v1/completions "
                     "with a prompt of token ids")
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    return self.model.encode(text + (prefill or ""))

  def text_ids(self, text: str) -> list[int]:
    if self.model.tokenizer is None:
      raise ApiError(400, "this model has no tokenizer: give the prompt as a list of token ids",
                     param="prompt")
    return self.model.encode(text)

  # ----- sampling --------------------------------------------------------------------------
  def resolve(self, ids: list[int], body, max_tokens: int | None, stops) -> _Gen:
    d, eng = self.defaults, self.engine
    if len(ids) >= eng.max_seq:
      raise ApiError(413, f"the prompt has {len(ids)} tokens; this server holds at most "
                     f"{eng.max_seq - 1} prompt tokens per slot (--ctx-size {eng.max_seq})",
                     code="context_length_exceeded", param="prompt")
    lora = _first(body.lora, d.get("lora"))
    if lora and not eng.has_lora:
      raise ApiError(400, "the request asks for the LoRA adapter (\"lora\": true) but this "
                     "server has none loaded (start it with --lora FILE)", param="lora")
    temperature = float(_first(body.temperature, d.get("temperature"), 1.0))
    if temperature < MIN_TEMPERATURE:
      temperature = 0.0
    mt = int(_first(max_tokens, d.get("max_tokens"), eng.max_seq))
    if self.max_tokens_cap is not None:
      mt = min(mt, self.max_tokens_cap)
    stops = [stops] if isinstance(stops, str) else list(stops or [])
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
      raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings of at most "
                     f"{MAX_STOP_CHARS} characters each", param="stop")
    stops = [s for s in stops if s]
    stop_ids, stop_id_text = set(self.model.stop_ids()), {}
    for s in stops:
      if self.model.tokenizer is None:
        raise ApiError(400, "stop strings need a tokenizer; this model has none", param="stop")
      one = self.model.encode(s)
      if len(one) == 1 and one[0] not in stop_ids:   # the engine stops on it directly
        stop_ids.add(one[0])
        stop_id_text[one[0]] = s
    seed = body.seed % (1 << 63) if body.seed is not None else secrets.randbits(63)
    return _Gen(ids=[int(t) for t in ids], max_tokens=mt, temperature=temperature,
                top_k=int(_first(body.top_k, d.get("top_k"), 0)),
                top_p=float(_first(body.top_p, d.get("top_p"), 1.0)), seed=seed, lora=lora,
                stop_ids=frozenset(stop_ids), stops=stops, stop_id_text=stop_id_text)

  # ----- running ---------------------------------------------------------------------------
  async def start(self, spec: _Gen):
    """Submit; returns the event queue once the engine has accepted the request."""
    req = Request(tokens=spec.ids, max_tokens=spec.max_tokens, temperature=spec.temperature,
                  top_k=spec.top_k, top_p=spec.top_p, seed=spec.seed,
                  stop=tuple(sorted(spec.stop_ids)), lora=spec.lora)
    try:
      events = self.worker.submit(req)
    except WorkerUnavailable as e:
      raise _unavailable(e) from None
    kind, payload = await events.get()
    if kind == "error":
      raise _event_error(payload)
    return events

  def outcome(self, spec: _Gen, result) -> _Outcome:
    toks = list(result.tokens)
    stopped = result.finish_reason == "stop"
    gen = toks[:-1] if stopped and toks else toks
    text = (self.model.decode(gen) or "") if self.model.tokenizer is not None else ""
    text, matched = _cut_stop(text, spec.stops)
    if matched is None and stopped and toks:
      matched = spec.stop_id_text.get(toks[-1])
    return _Outcome(text=text, finish="stop" if matched is not None or stopped else "length",
                    stop_sequence=matched, prompt_tokens=len(spec.ids),
                    completion_tokens=len(toks), cached_tokens=int(result.cached_tokens),
                    tokens=toks, lora=bool(result.lora), slot=int(result.slot))

  async def run(self, spec: _Gen) -> _Outcome:
    events = await self.start(spec)
    ts = _TextStream(self.model, spec) if spec.stops else None
    try:
      while True:
        kind, payload = await events.get()
        if kind == "token" and ts is not None:
          ts.push(payload)
          if ts.matched is not None:
            events.cancel.set()     # the text has its stop string: no need to go on
        elif kind == "done":
          return self.outcome(spec, payload)
        elif kind == "error":
          raise _event_error(payload)
    finally:
      events.cancel.set()         # a no-op once done; ends the generation if the client left

  async def stream(self, spec: _Gen, events):
    """Yields ("text", delta) ... then ("done", _Outcome) or ("error", ApiError)."""
    ts = _TextStream(self.model, spec)
    try:
      async for item in self._stream(spec, events, ts):
        yield item
    finally:
      events.cancel.set()         # a no-op once done; ends the generation if the client left

  async def _stream(self, spec: _Gen, events, ts):
    while True:
      kind, payload = await events.get()
      if kind == "token":
        delta = ts.push(payload)
        if ts.matched is not None:
          events.cancel.set()
        if delta:
          yield "text", delta
      elif kind == "done":
        out = self.outcome(spec, payload)
        rest = ts.finish(out.text)
        if rest:
          yield "text", rest
        yield "done", out
        return
      elif kind == "error":
        yield "error", _event_error(payload)
        return


def _event_error(e) -> ApiError:
  if isinstance(e, ApiError):
    return e
  if isinstance(e, WorkerUnavailable):
    return _unavailable(e)
  if isinstance(e, StrataError):
    return ApiError(400, str(e))
  return ApiError(500, f"internal error: {type(e).__name__}: {e}")


def _sse(obj) -> str:
  return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _sse_event(event: str, obj) -> str:
  return f"event: {event}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _openai_usage(o: _Outcome) -> dict:
  return {"prompt_tokens": o.prompt_tokens, "completion_tokens": o.completion_tokens,
          "total_tokens": o.prompt_tokens + o.completion_tokens,
          "prompt_tokens_details": {"cached_tokens": o.cached_tokens}}


def _anthropic_usage(o: _Outcome) -> dict:
  return {"input_tokens": o.prompt_tokens - o.cached_tokens, "output_tokens": o.completion_tokens,
          "cache_read_input_tokens": o.cached_tokens, "cache_creation_input_tokens": 0}


def _openai_text(content) -> str:
  if content is None or isinstance(content, str):
    return content or ""
  parts = []
  for p in content:
    if p.type != "text" or p.text is None:
      raise ApiError(400, f"content part type {p.type!r} is not supported: only text parts",
                     param="messages")
    parts.append(p.text)
  return "".join(parts)


def _anthropic_text(content, param: str) -> str:
  if isinstance(content, str):
    return content
  parts = []
  for b in content:
    if b.type != "text" or b.text is None:
      raise ApiError(400, f"content block type {b.type!r} is not supported: only text blocks",
                     param=param)
    parts.append(b.text)
  return "".join(parts)


def _one(value, name: str):
  if value not in (None, 1):
    raise ApiError(400, f"{name}={value} is not supported: this server returns one choice",
                   param=name)


# ---------------------------------------------------------------------------------------------
# The app

def create_app(engine, *, model_name: str, slot_save_path: str | None = None,
               defaults: dict | None = None, max_pending: int = 256,
               max_tokens_cap: int | None = None) -> FastAPI:
  """The HTTP app over `engine`; starts the worker thread that owns it (stopped at shutdown).

  Args:
    engine: a `strata_jax.Engine`; the app's worker owns it from now on.
    model_name: the model id reported by /v1/models and in responses.
    slot_save_path: directory for slot sessions; None disables /slots actions.
    defaults: sampling defaults {"lora", "temperature", "top_k", "top_p", "max_tokens"}.
    max_pending: requests queued or running at once before 503 (overloaded).
    max_tokens_cap: upper bound on any request's max_tokens (None: the slot's capacity).
  """
  defaults = check_sampling_defaults(dict(defaults or {}), where="defaults")
  if defaults.get("lora") and not engine.has_lora:
    raise StrataError("defaults: sampling.lora is true but no LoRA adapter is loaded")
  if slot_save_path is not None:
    os.makedirs(slot_save_path, exist_ok=True)
  worker = EngineWorker(engine, max_pending=max_pending)
  srv = _Server(engine, worker, model_name, slot_save_path, defaults, max_tokens_cap)

  @contextlib.asynccontextmanager
  async def lifespan(_app):
    worker.start()
    yield
    worker.stop()

  app = FastAPI(title="strata-jax", version="0.1.0", lifespan=lifespan,
                description=(__doc__ or "").split("\n\n")[0])
  app.state.server = srv
  app.add_middleware(_JsonBodies)
  _install_error_handlers(app)
  worker.start()

  # ----- info ----------------------------------------------------------------------------
  def model_card() -> dict:
    return {"id": model_name, "object": "model", "created": srv.created, "owned_by": "strata-jax",
            "type": "model", "display_name": model_name,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(srv.created)),
            "lora": engine.has_lora}

  @app.get("/health")
  async def health():
    if not worker.alive:
      return JSONResponse({"status": "error", "error": worker.error or "not running"}, 503)
    return {"status": "ok", "slots": engine.n_slots, "pending": worker.pending,
            "lora": engine.has_lora}

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [model_card()], "has_more": False,
            "first_id": model_name, "last_id": model_name}

  @app.get("/v1/models/{model_id:path}")
  async def model(model_id: str):
    if model_id != model_name:
      raise ApiError(404, f"no model {model_id!r}: this server serves {model_name!r}",
                     code="model_not_found", param="model")
    return model_card()

  # ----- OpenAI --------------------------------------------------------------------------
  @app.post("/v1/chat/completions")
  async def chat_completions(body: schemas.ChatCompletionRequest):
    _one(body.n, "n")
    messages = []
    for m in body.messages:
      msg = {"role": "system" if m.role == "developer" else m.role,
             "content": _openai_text(m.content)}
      if m.name is not None:
        msg["name"] = m.name
      messages.append(msg)
    spec = srv.resolve(srv.chat_ids(messages), body,
                       _first(body.max_completion_tokens, body.max_tokens), body.stop)
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if not body.stream:
      o = await srv.run(spec)
      return JSONResponse({
          "id": cid, "object": "chat.completion", "created": created, "model": model_name,
          "choices": [{"index": 0, "message": {"role": "assistant", "content": o.text},
                       "logprobs": None, "finish_reason": o.finish}],
          "usage": _openai_usage(o), "lora": o.lora}, headers={"X-Slot-Id": str(o.slot)})
    events = await srv.start(spec)
    usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(delta, finish=None):
      return {"id": cid, "object": "chat.completion.chunk", "created": created,
              "model": model_name, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                "finish_reason": finish}]}

    async def gen():
      yield _sse(chunk({"role": "assistant", "content": ""}))
      async for kind, x in srv.stream(spec, events):
        if kind == "text":
          yield _sse(chunk({"content": x}))
        elif kind == "done":
          yield _sse(chunk({}, x.finish))
          if usage:
            yield _sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                        "model": model_name, "choices": [], "usage": _openai_usage(x)})
        else:
          yield _sse(_error_body(False, x.status, x.message, code=x.code))
      yield "data: [DONE]\n\n"

    return StreamingResponse(gen(), media_type="text/event-stream", headers=_SSE_HEADERS)

  @app.post("/v1/completions")
  async def completions(body: schemas.CompletionRequest):
    _one(body.n, "n")
    _one(body.best_of, "best_of")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
      if len(prompt) != 1:
        raise ApiError(400, f"{len(prompt)} prompts given: this server takes one prompt per "
                       "request", param="prompt")
      prompt = prompt[0]
    ids = srv.text_ids(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
      raise ApiError(400, "the prompt is empty: at least one token is needed", param="prompt")
    spec = srv.resolve(ids, body, body.max_tokens, body.stop)
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    if not body.stream:
      o = await srv.run(spec)
      choice = {"text": o.text, "index": 0, "logprobs": None, "finish_reason": o.finish}
      if body.return_tokens:
        choice["tokens"] = o.tokens
      return JSONResponse({
          "id": cid, "object": "text_completion", "created": created, "model": model_name,
          "choices": [choice], "usage": _openai_usage(o), "lora": o.lora},
          headers={"X-Slot-Id": str(o.slot)})
    events = await srv.start(spec)
    usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(text, finish=None):
      return {"id": cid, "object": "text_completion", "created": created, "model": model_name,
              "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}

    async def gen():
      async for kind, x in srv.stream(spec, events):
        if kind == "text":
          yield _sse(chunk(x))
        elif kind == "done":
          last = chunk("", x.finish)
          if body.return_tokens:
            last["choices"][0]["tokens"] = x.tokens
          yield _sse(last)
          if usage:
            yield _sse({"id": cid, "object": "text_completion", "created": created,
                        "model": model_name, "choices": [], "usage": _openai_usage(x)})
        else:
          yield _sse(_error_body(False, x.status, x.message, code=x.code))
      yield "data: [DONE]\n\n"

    return StreamingResponse(gen(), media_type="text/event-stream", headers=_SSE_HEADERS)

  # ----- Anthropic -----------------------------------------------------------------------
  @app.post("/v1/messages")
  async def messages(body: schemas.MessagesRequest):
    msgs = []
    if body.system is not None:
      system = _anthropic_text(body.system, "system")
      if system:
        msgs.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
      msgs.append({"role": m.role, "content": _anthropic_text(m.content, f"messages.{i}")})
    # A final assistant turn is a prefill: the reply continues it.
    prefill = None
    if msgs[-1]["role"] == "assistant":
      prefill = msgs.pop()["content"]
    spec = srv.resolve(srv.chat_ids(msgs, prefill), body, body.max_tokens, body.stop_sequences)
    mid = f"msg_{uuid.uuid4().hex}"

    def reason(o: _Outcome) -> str:
      if o.stop_sequence is not None:
        return "stop_sequence"
      return "end_turn" if o.finish == "stop" else "max_tokens"

    if not body.stream:
      o = await srv.run(spec)
      return JSONResponse({
          "id": mid, "type": "message", "role": "assistant", "model": model_name,
          "content": [{"type": "text", "text": o.text}], "stop_reason": reason(o),
          "stop_sequence": o.stop_sequence, "usage": _anthropic_usage(o), "lora": o.lora},
          headers={"X-Slot-Id": str(o.slot)})
    events = await srv.start(spec)

    async def gen():
      yield _sse_event("message_start", {"type": "message_start", "message": {
          "id": mid, "type": "message", "role": "assistant", "model": model_name,
          "content": [], "stop_reason": None, "stop_sequence": None,
          "usage": {"input_tokens": len(spec.ids), "output_tokens": 0,
                    "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}}})
      yield _sse_event("content_block_start", {"type": "content_block_start", "index": 0,
                                               "content_block": {"type": "text", "text": ""}})
      async for kind, x in srv.stream(spec, events):
        if kind == "text":
          yield _sse_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                   "delta": {"type": "text_delta", "text": x}})
        elif kind == "done":
          yield _sse_event("content_block_stop", {"type": "content_block_stop", "index": 0})
          yield _sse_event("message_delta", {
              "type": "message_delta",
              "delta": {"stop_reason": reason(x), "stop_sequence": x.stop_sequence},
              "usage": _anthropic_usage(x)})
          yield _sse_event("message_stop", {"type": "message_stop"})
        else:
          yield _sse_event("error", _error_body(True, x.status, x.message, kind=x.kind if
                                                x.kind == "overloaded_error" else None))

    return StreamingResponse(gen(), media_type="text/event-stream", headers=_SSE_HEADERS)

  # ----- slots (llama.cpp) ---------------------------------------------------------------
  @app.post("/slots/{id_slot}")
  async def slot_action(id_slot: int,
                        action: Annotated[Literal["save", "restore", "erase"], Query()],
                        body: Annotated[schemas.SlotRequest | None, Body()] = None):
    if not 0 <= id_slot < engine.n_slots:
      raise ApiError(404, f"no slot {id_slot}: this server has slots 0..{engine.n_slots - 1}",
                     param="id_slot", code="slot_not_found")
    if srv.slot_save_path is None:
      raise ApiError(400, "slot save/restore/erase is disabled: start the server with "
                     "--slot-save-path DIR", code="slots_disabled")
    filename = body.filename if body is not None else None
    if filename is None:
      raise ApiError(400, f"action={action} needs a body {{\"filename\": \"...\"}}",
                     param="filename")
    path = _session_path(srv.slot_save_path, filename)
    t0 = time.perf_counter()
    try:
      if action == "save":
        def save(eng):
          n = eng.slot_info(id_slot)["n_tokens"]
          if n == 0:
            raise ApiError(400, f"slot {id_slot} holds no conversation to save")
          return eng.save_session(id_slot, path)
        out = await worker.call(save)
        return {"id_slot": id_slot, "filename": filename, "n_saved": int(out["n_tokens"]),
                "n_written": int(out.get("bytes", 0)),
                "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}}
      if not os.path.lexists(path):
        raise ApiError(404, f"no saved session {filename!r} in the slot save path",
                       param="filename", code="session_not_found")
      if action == "restore":
        out = await worker.call(lambda eng: eng.load_session(id_slot, path))
        return {"id_slot": id_slot, "filename": filename, "n_restored": int(out["n_tokens"]),
                "n_read": _du(path), "lora": bool(out.get("lora", False)),
                "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}}

      def erase(eng):
        from strata_jax.session import read_session_meta
        try:
          n = int(read_session_meta(path).n_tokens)
        except StrataError:
          n = 0
        eng.erase_session(path)
        return n
      n = await worker.call(erase)
      return {"id_slot": id_slot, "filename": filename, "n_erased": n}
    except WorkerUnavailable as e:
      raise _unavailable(e) from None

  return app


def _session_path(root: str, filename) -> str:
  """`root/filename` for a plain file name; anything that could leave `root` is refused."""
  bad = (not isinstance(filename, str) or not filename or len(filename) > 255
         or filename in (".", "..") or filename.startswith(".")
         or any(c in filename for c in "/\\") or any(ord(c) < 32 for c in filename))
  path = os.path.join(root, filename) if not bad else ""
  if bad or os.path.dirname(os.path.realpath(path)) != os.path.realpath(root):
    raise ApiError(400, f"invalid filename {filename!r}: give a plain file name (no path "
                   "separators, not starting with '.') inside the slot save path",
                   param="filename", code="invalid_filename")
  return path


def _du(path: str) -> int:
  total = 0
  for dirpath, _, files in os.walk(path):
    for f in files:
      with contextlib.suppress(OSError):
        total += os.path.getsize(os.path.join(dirpath, f))
  return total


# ---------------------------------------------------------------------------------------------
# `strata-jax serve`

def serve_main(args) -> int:
  """Load the model (and adapters), build the Engine, serve until interrupted."""
  import sys

  import uvicorn

  import strata_jax as sj
  from strata_jax.cli import load_from_args

  defaults = load_config(args.config) if args.config else {}
  if args.slots < 1:
    raise StrataError(f"--slots must be >= 1, got {args.slots}")
  if args.ctx_size < 2:
    raise StrataError(f"--ctx-size must be >= 2, got {args.ctx_size}")
  if not 0 <= args.port <= 65535:
    raise StrataError(f"--port must be in 0..65535, got {args.port}")
  if args.slot_save_path and os.path.exists(args.slot_save_path) and not os.path.isdir(
      args.slot_save_path):
    raise StrataError(f"--slot-save-path {args.slot_save_path}: not a directory")
  model, lora = load_from_args(args)
  if getattr(args, "lora_off", False):
    defaults["lora"] = False          # the command line wins over the config file
  if defaults.get("lora") and lora is None:
    raise StrataError(f"{args.config}: sampling.lora is true but no adapter is loaded "
                      "(pass --lora FILE)")
  engine = sj.Engine(model, lora=lora, slots=args.slots, max_seq=args.ctx_size)
  print("compiling the engine's steps...", file=sys.stderr)
  for sw in ([False, True] if lora is not None else [False]):
    engine.generate(tokens=[0], max_tokens=2, lora=sw)
  app = create_app(engine, model_name=os.path.basename(model.path),
                   slot_save_path=args.slot_save_path, defaults=defaults)
  uvicorn.run(app, host=args.host, port=args.port, log_level="info")
  return 0
