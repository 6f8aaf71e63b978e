"""`strata-jax serve`: OpenAI- and Anthropic-compatible HTTP API over one Engine.

Endpoints (one module per family):
  POST /v1/chat/completions, POST /v1/completions    OpenAI (stream: SSE `data:` lines, [DONE])
                                                     -> openai_api
  POST /v1/messages                                  Anthropic (stream: Anthropic's event types)
                                                     -> anthropic_api
  GET  /v1/models, GET /v1/models/{id}, GET /health  -> info_api
  POST /slots/{id}?action=save|restore|erase         llama.cpp slot sessions (--slot-save-path)
                                                     -> slots_api
  GET|POST /lora-adapters, POST /lora-adapters/load|unload
                                                     llama.cpp adapter list and default scales,
                                                     hot load / unload -> lora_api

Every generation body takes `"lora": true|false` (absent: the config's default, else on when an
adapter is loaded) or llama.cpp's `"lora": [{"id": 0, "scale": 0.5}, ...]`. Requests under any
adapters share the slots and batch together.
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
import os
import sys

from fastapi import FastAPI

from strata_jax.errors import StrataError
from strata_jax.serve import anthropic_api, info_api, lora_api, openai_api, slots_api
from strata_jax.serve.config import check_sampling_defaults, load_config
from strata_jax.serve.errors import install_error_handlers
from strata_jax.serve.generation import Server
from strata_jax.serve.worker import EngineWorker


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

  @contextlib.asynccontextmanager
  async def lifespan(_app):
    worker.start()
    yield
    worker.stop()

  app = FastAPI(title="strata-jax", version="0.1.0", lifespan=lifespan,
                description=(__doc__ or "").split("\n\n")[0])
  app.state.server = Server(engine, worker, model_name, slot_save_path, defaults,
                            max_tokens_cap)
  app.add_middleware(_JsonBodies)
  install_error_handlers(app)
  for family in (info_api, openai_api, anthropic_api, slots_api, lora_api):
    app.include_router(family.router)
  worker.start()
  return app


# ---------------------------------------------------------------------------------------------
# `strata-jax serve`

def serve_main(args) -> int:
  """Load the model (and adapters), build the Engine, serve until interrupted."""
  import uvicorn  # noqa: PLC0415

  import strata_jax as sj  # noqa: PLC0415
  from strata_jax.loading import control_vector_from_args, load_from_args  # noqa: PLC0415

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
  cvec = control_vector_from_args(args, model)
  if getattr(args, "lora_off", False):
    defaults["lora"] = False          # the command line wins over the config file
  if defaults.get("lora") and not lora:
    raise StrataError(f"{args.config}: sampling.lora is true but no adapter is loaded "
                      "(pass --lora FILE)")
  from strata_jax.speculative import check_spec  # noqa: PLC0415
  check_spec(getattr(args, "spec", 0), None, True)
  engine = sj.Engine(model, lora=lora, slots=args.slots, max_seq=args.ctx_size,
                     control_vector=cvec, lora_rank=getattr(args, "lora_rank", None),
                     spec=getattr(args, "spec", 0), draft=getattr(args, "draft", None))
  print("compiling the engine's steps...", file=sys.stderr)
  for sw in ([False, True] if lora else [False]):
    engine.generate(tokens=[0], max_tokens=2, lora=sw)
  app = create_app(engine, model_name=os.path.basename(model.path),
                   slot_save_path=args.slot_save_path, defaults=defaults)
  uvicorn.run(app, host=args.host, port=args.port, log_level="info")
  return 0
