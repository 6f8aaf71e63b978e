"""LoRA adapters, as llama.cpp's server: GET /lora-adapters (id, path, scale), POST
/lora-adapters (default scales), plus hot load and unload: POST /lora-adapters/load
{"path", "scale"?} and POST /lora-adapters/unload {"id"}.

Every call runs on the worker thread between two engine steps (not a barrier): requests in
flight go on with the adapters they were submitted with. Rules: docs/adapters.md.
"""
from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Body

from strata_jax.errors import AdapterError, StrataError
from strata_jax.serve import schemas
from strata_jax.serve.errors import ApiError, unavailable
from strata_jax.serve.generation import ServerDep
from strata_jax.serve.worker import WorkerUnavailable

router = APIRouter()


async def _on_worker(srv, fn):
  try:
    return await srv.worker.call(fn, barrier=False)
  except WorkerUnavailable as e:
    raise unavailable(e) from None
  except StrataError as e:
    raise ApiError(400, str(e), param="lora") from None


@router.get("/lora-adapters")
async def list_adapters(srv: ServerDep):
  return await _on_worker(srv, lambda eng: eng.lora_adapters())


@router.post("/lora-adapters")
async def set_scales(srv: ServerDep,
                     body: Annotated[list[schemas.LoraChoice], Body()]):
  items = [c.model_dump(include={"id", "scale"}) for c in body]
  for c in items:
    if c["scale"] is None:
      raise ApiError(400, f"POST /lora-adapters: adapter {c['id']} needs a \"scale\"",
                     param="scale")
  await _on_worker(srv, lambda eng: eng.set_lora_scales(items))
  return {"success": True}


@router.post("/lora-adapters/load")
async def load(srv: ServerDep, body: schemas.LoraLoadRequest):
  from strata_jax.api import load_lora  # noqa: PLC0415

  from strata_jax.engine.adapters import check_scale  # noqa: PLC0415

  # The scale first (no file is read for a call that is refused anyway); then read and check
  # the file off the worker thread (steps go on meanwhile), then place it.
  try:
    check_scale(body.scale, f"POST /lora-adapters/load {body.path}")
  except StrataError as e:
    raise ApiError(400, str(e), param="scale") from None
  try:
    lora = await asyncio.to_thread(load_lora, srv.model, [body.path])
  except AdapterError as e:
    raise ApiError(400, str(e), param="path") from None
  aid = await _on_worker(srv, lambda eng: eng.load_adapter(lora, body.scale))
  return {"success": True, "id": aid, "path": body.path, "scale": body.scale}


@router.post("/lora-adapters/unload")
async def unload(srv: ServerDep, body: schemas.LoraUnloadRequest):
  freed = await _on_worker(srv, lambda eng: eng.unload_adapter(body.id))
  return {"success": True, "id": body.id, "deferred": not freed}
