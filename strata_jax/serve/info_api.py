"""Server and model information: GET /health, GET /v1/models, GET /v1/models/{id}."""
from __future__ import annotations

import time

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from strata_jax.serve.errors import ApiError
from strata_jax.serve.generation import Server, ServerDep

router = APIRouter()


def _model_card(srv: Server) -> dict:
  """One model object, readable by the OpenAI and the Anthropic clients alike."""
  name = srv.model_name
  return {"id": name, "object": "model", "created": srv.created, "owned_by": "strata-jax",
          "type": "model", "display_name": name,
          "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(srv.created)),
          "lora": srv.engine.has_lora}


@router.get("/health")
async def health(srv: ServerDep):
  if not srv.worker.alive:
    return JSONResponse({"status": "error", "error": srv.worker.error or "not running"}, 503)
  return {"status": "ok", "slots": srv.engine.n_slots, "pending": srv.worker.pending,
          "lora": srv.engine.has_lora}


@router.get("/v1/models")
async def models(srv: ServerDep):
  name = srv.model_name
  return {"object": "list", "data": [_model_card(srv)], "has_more": False,
          "first_id": name, "last_id": name}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, srv: ServerDep):
  if model_id != srv.model_name:
    raise ApiError(404, f"no model {model_id!r}: this server serves {srv.model_name!r}",
                   code="model_not_found", param="model")
  return _model_card(srv)
