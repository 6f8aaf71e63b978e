"""llama.cpp slot sessions: POST /slots/{id}?action=save|restore|erase (needs --slot-save-path).

Session calls run on the worker as barriers (the engine is idle while a slot is written or read).
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Annotated, Literal

from fastapi import APIRouter, Body, Query

from strata_jax.errors import StrataError
from strata_jax.serve import schemas
from strata_jax.serve.errors import ApiError, unavailable
from strata_jax.serve.generation import ServerDep
from strata_jax.serve.worker import WorkerUnavailable

router = APIRouter()


def session_path(root: str, filename) -> str:
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


@router.post("/slots/{id_slot}")
async def slot_action(id_slot: int,
                      action: Annotated[Literal["save", "restore", "erase"], Query()],
                      srv: ServerDep,
                      body: Annotated[schemas.SlotRequest | None, Body()] = None):
  n_slots = srv.engine.n_slots
  if not 0 <= id_slot < n_slots:
    raise ApiError(404, f"no slot {id_slot}: this server has slots 0..{n_slots - 1}",
                   param="id_slot", code="slot_not_found")
  if srv.slot_save_path is None:
    raise ApiError(400, "slot save/restore/erase is disabled: start the server with "
                   "--slot-save-path DIR", code="slots_disabled")
  filename = body.filename if body is not None else None
  if filename is None:
    raise ApiError(400, f"action={action} needs a body {{\"filename\": \"...\"}}",
                   param="filename")
  path = session_path(srv.slot_save_path, filename)
  t0 = time.perf_counter()
  try:
    if action == "save":
      def save(eng):
        n = eng.slot_info(id_slot)["n_tokens"]
        if n == 0:
          raise ApiError(400, f"slot {id_slot} holds no conversation to save")
        return eng.save_session(id_slot, path)
      out = await srv.worker.call(save)
      return {"id_slot": id_slot, "filename": filename, "n_saved": int(out["n_tokens"]),
              "n_written": int(out.get("bytes", 0)),
              "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}}
    if not os.path.lexists(path):
      raise ApiError(404, f"no saved session {filename!r} in the slot save path",
                     param="filename", code="session_not_found")
    if action == "restore":
      out = await srv.worker.call(lambda eng: eng.load_session(id_slot, path))
      return {"id_slot": id_slot, "filename": filename, "n_restored": int(out["n_tokens"]),
              "n_read": _du(path), "lora": bool(out.get("lora", False)),
              "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}}

    def erase(eng):
      from strata_jax.session import read_session_meta  # noqa: PLC0415
      try:
        n = int(read_session_meta(path).n_tokens)
      except StrataError:
        n = 0
      eng.erase_session(path)
      return n
    n = await srv.worker.call(erase)
    return {"id_slot": id_slot, "filename": filename, "n_erased": n}
  except WorkerUnavailable as e:
    raise unavailable(e) from None
