"""Session files: save, inspect, load with limits, erase. What a session is on disk is written
in `schema`; the steps of a save and a read are here, each from its own module:

Reads check the header (`validate`) and orbax's array metadata (shapes and dtypes, no data)
against `SessionReadLimits` before any array is read, then restore against an explicit abstract
target (`orbax_io.restore_arrays`) and verify every array's xxh3-64 checksum. Every problem
surfaces as `SessionError`.

Saves write a complete checkpoint into a temporary directory beside `path`, verify and fsync
it, then swap it in atomically (`atomic`). A reader that finds `path` missing but the backup
present (a save killed between two renames) restores the backup.
"""
from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from strata_jax.errors import SessionError
from strata_jax.session import atomic, orbax_io, validate
from strata_jax.session.orbax_io import short_error
from strata_jax.session.schema import (
    MAGIC,
    SUPPORTED_VERSIONS,
    SessionMeta,
    SessionReadLimits,
    build,
    checksum,
    size,
)

# Session I/O is rare and orbax is not documented as thread-safe: one at a time per process.
_IO_LOCK = threading.RLock()


# ---------------------------------------------------------------------------------------------
# Save

def save_session(path, stages: Sequence[Mapping[str, Any]], tokens, *, fingerprint: str,
                 flags: int, layer_ranges: Sequence[tuple[int, int]]) -> dict:
  """Writes a session atomically; an existing session at `path` is replaced only when whole.

  Args:
    path: the session directory (created; its parent is created when missing).
    stages: per stage a dict of numpy arrays: "k", "v" [La_s, n_tokens, G, Hd], "conv"
      [Lg_s, K-1, C], "ssm" [Lg_s, Hv, Dv, Dk] float32, and optionally "checkpoint" (a nested
      dict of arrays). La_s / Lg_s may be 0.
    tokens: int [n_tokens] token ids (stored as int32).
    fingerprint: model (and adapter) identity the state was computed with.
    flags: bit 0 = LoRA switch on; other bits must be 0.
    layer_ranges: per stage its layer range [lo, hi).

  Returns:
    {"path", "bytes" (on disk), "seconds", "version", "n_tokens"}.
  """
  t0 = time.perf_counter()
  path = os.path.abspath(os.fspath(path))
  tree, header = build(path, stages, tokens, fingerprint, flags, layer_ranges)
  with _IO_LOCK:
    tmp = None
    try:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      atomic.recover(path)
      atomic.check_replaceable(path)
      atomic.sweep(path)
      tmp = atomic.tmp_name(path)
      orbax_io.write(tmp, tree, header)
      # Read the header back before it may replace anything: orbax must have finished.
      if orbax_io.read_header(tmp) != header:
        raise OSError("the written session metadata does not read back identically")
      atomic.fsync_tree(tmp)
      atomic.step("written")
      atomic.replace(tmp, path)
    except Exception as e:  # noqa: BLE001 - any failure leaves the old session, reported cleanly
      if tmp is not None:
        atomic.rmtree_quiet(tmp)
        atomic.rmtree_quiet(tmp + ".orbax-checkpoint-tmp")
      if isinstance(e, SessionError):
        raise
      raise SessionError(f"{path}: cannot save session: {short_error(e)}") from None
  return {"path": path, "bytes": atomic.du(path), "seconds": time.perf_counter() - t0,
          "version": header["version"], "n_tokens": header["n_tokens"]}


def erase_session(path) -> bool:
  """Deletes the session at `path` (and leftovers of interrupted saves). Returns whether a
  session was there. Refuses to delete something that is not a session directory."""
  path = os.path.abspath(os.fspath(path))
  with _IO_LOCK:
    atomic.recover(path)
    atomic.check_replaceable(path)
    atomic.sweep(path)
    if not os.path.lexists(path):
      return False
    doomed = atomic.tmp_name(path)
    try:
      os.rename(path, doomed)   # gone from `path` atomically; the rest is cleanup
      atomic.fsync_dir(os.path.dirname(path))
    except OSError as e:
      raise SessionError(f"{path}: cannot erase session: {short_error(e)}") from None
    atomic.rmtree_quiet(doomed)
    return True


# ---------------------------------------------------------------------------------------------
# Read

def _only_session_errors(fn):
  """Whatever a hostile or damaged file provokes reaches callers as SessionError, never as a
  traceback from inside orbax, tensorstore or json."""
  @functools.wraps(fn)
  def wrapper(path, *args, **kwargs):
    try:
      return fn(path, *args, **kwargs)
    except SessionError:
      raise
    except Exception as e:  # noqa: BLE001
      raise SessionError(f"{os.fspath(path)}: cannot read session: {short_error(e)}") from None
  return wrapper


@_only_session_errors
def read_session_meta(path) -> SessionMeta:
  """The session header at `path`, read without touching any array."""
  path = os.path.abspath(os.fspath(path))
  with _IO_LOCK:
    where = atomic.recover(path)
    header = _load_header(path, where)
    validate.check_header(path, header, SUPPORTED_VERSIONS)
    return validate.parse_header(path, header)[0]


@_only_session_errors
def load_session(path, limits: SessionReadLimits
                 ) -> tuple[SessionMeta, list[dict[str, Any]], np.ndarray]:
  """Reads a session, refusing anything `limits` does not allow before reading any array.

  Returns:
    (meta, stages, tokens): `stages` has per stage the dict `save_session` was given (numpy
    arrays; "checkpoint" only when the session has checkpoint arrays); `tokens` int32 [N]
    (also set as `meta.tokens`).

  Raises:
    SessionError: the path is not a session, or the session does not fit `limits`, or its
      data is truncated or corrupted. The message names the path and the problem.
  """
  path = os.path.abspath(os.fspath(path))
  with _IO_LOCK:
    where = atomic.recover(path)
    header = _load_header(path, where)
    validate.check_header(path, header, limits.supported_versions)
    meta, specs = validate.parse_header(path, header)
    expected = validate.check_limits(path, meta, specs, limits)
    stored = {name: spec for name, spec in expected.items() if size(spec[0])}
    validate.check_stored(path, orbax_io.stored_arrays(path, where), stored)
    arrays = orbax_io.restore_arrays(where, stored)
    out = {}
    for name, (shape, dtype) in expected.items():
      a = arrays.get(name) if name in stored else np.zeros(shape, dtype)
      if a is None:
        raise SessionError(f"{path}: array {name} is missing from the restored data")
      a = np.asarray(a)
      if a.shape != shape or a.dtype != dtype:
        raise SessionError(f"{path}: array {name} restored as {a.dtype}{list(a.shape)}, "
                           f"expected {dtype}{list(shape)}")
      if checksum(a) != specs[name][2]:
        raise SessionError(f"{path}: array data of {name} is corrupted (checksum mismatch)")
      out[name] = a
  tokens = out.pop("tokens")
  stages = [{} for _ in meta.layer_ranges]
  for name, a in out.items():
    stage, *keys = name.split("/")
    node = stages[int(stage[len("stage"):])]
    for key in keys[:-1]:
      node = node.setdefault(key, {})
    node[keys[-1]] = a
  meta.tokens = tokens
  return meta, stages, tokens


def _load_header(path: str, where: str) -> dict:
  """The session header at `where`, refused unless it is a strata session's."""
  if not os.path.isdir(where):
    what = "does not exist" if not os.path.lexists(where) else "is not a directory"
    raise SessionError(f"{path}: not a session: the path {what}")
  try:
    header = orbax_io.read_header(where)
  except Exception as e:  # noqa: BLE001
    raise SessionError(f"{path}: not a session: no readable checkpoint metadata "
                       f"({short_error(e)})") from None
  if not isinstance(header, dict) or "magic" not in header:
    raise SessionError(f"{path}: not a session: the checkpoint carries no session metadata")
  if header["magic"] != MAGIC:
    raise SessionError(f"{path}: not a session: wrong magic {header['magic']!r} "
                       f"(expected {MAGIC!r})")
  return header
