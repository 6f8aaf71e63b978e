"""Orbax plumbing: the one synchronous checkpointer, header and array-metadata reads, the one
place array data is read, and the scope that keeps orbax's noise about a bad file off stderr.

Orbax is imported lazily (it costs ~0.4 s on top of jax). Nothing here touches process-wide
state outside a `quiet()` block.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from strata_jax.errors import SessionError


def ocp():
  import orbax.checkpoint as ocp  # noqa: PLC0415 (lazy: see the module docstring)

  return ocp


def _epath(p: str):
  from etils import epath  # noqa: PLC0415

  return epath.Path(p)


_CHECKPOINTER = None


def checkpointer():
  """A synchronous orbax Checkpointer: save() returns only when the checkpoint is final."""
  global _CHECKPOINTER
  if _CHECKPOINTER is None:
    _CHECKPOINTER = ocp().Checkpointer(ocp().PyTreeCheckpointHandler())
  return _CHECKPOINTER


def short_error(e: BaseException, limit: int = 240) -> str:
  """One line naming an exception from orbax, tensorstore or the OS, for a SessionError."""
  text = str(e).strip().splitlines()[0] if str(e).strip() else ""
  text = f"{type(e).__name__}: {text}" if text else type(e).__name__
  return text if len(text) <= limit else text[:limit] + "..."


# ---------------------------------------------------------------------------------------------
# Reads and writes

def write(where: str, tree: Mapping[str, Any], header: dict):
  """A finished checkpoint of `tree` at `where`, with `header` as its custom metadata."""
  with quiet():
    checkpointer().save(where, args=ocp().args.PyTreeSave(tree), custom_metadata=header)


def read_header(where: str):
  """The session header (orbax custom_metadata) of a checkpoint directory, or None."""
  with quiet():
    return ocp().metadata.get_step_metadata(where).custom_metadata


def stored_arrays(path: str, where: str) -> dict[str, Any]:
  """`{array path: orbax metadata leaf (shape, dtype)}` of what is on disk; no data is read."""
  try:
    with quiet():
      tree = ocp().PyTreeCheckpointHandler().metadata(_epath(where)).tree
    leaves = {}
    _flatten_metadata(tree, "", leaves)
  except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many kinds; all mean the same
    raise SessionError(f"{path}: array metadata unreadable (truncated or corrupted session): "
                       f"{short_error(e)}") from None
  return leaves


def _flatten_metadata(node, prefix, out):
  if not isinstance(node, Mapping):
    raise TypeError(f"unexpected {type(node).__name__} in the array tree")
  for key, value in node.items():
    name = f"{prefix}{key}"
    if isinstance(value, Mapping):
      _flatten_metadata(value, name + "/", out)
    elif hasattr(value, "shape") and hasattr(value, "dtype"):
      out[name] = value
    else:
      raise TypeError(f"leaf {name} is {type(value).__name__}, not an array")


def restore_arrays(where, stored: Mapping[str, tuple[tuple[int, ...], np.dtype]]
                   ) -> dict[str, np.ndarray]:
  """The one place array data is read: orbax restore against an explicit abstract target."""
  import jax  # noqa: PLC0415

  if not stored:
    return {}
  target: dict[str, Any] = {}
  for name, (shape, dtype) in stored.items():
    node = target
    *keys, last = name.split("/")
    for key in keys:
      node = node.setdefault(key, {})
    node[last] = jax.ShapeDtypeStruct(shape, dtype)
  restore_args = jax.tree.map(lambda _: ocp().RestoreArgs(restore_type=np.ndarray), target)
  try:
    with quiet():
      tree = checkpointer().restore(
          where, args=ocp().args.PyTreeRestore(item=target, restore_args=restore_args))
    out = {}
    _flatten_restored(tree, "", out)
  except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many kinds; all mean the same
    raise SessionError(f"{where}: array data unreadable (truncated or corrupted session): "
                       f"{short_error(e)}") from None
  return out


def _flatten_restored(node, prefix, out):
  for key, value in node.items():
    if isinstance(value, Mapping):
      _flatten_restored(value, f"{prefix}{key}/", out)
    else:
      out[f"{prefix}{key}"] = value


# ---------------------------------------------------------------------------------------------
# Keeping orbax's noise about a bad checkpoint off stderr, for the duration of our calls

# A failed orbax read abandons work: orbax closes its event loop on the first error, and the
# tensorstore reads still in flight finish moments later on tensorstore's threads, where their
# asyncio callbacks raise "Event loop is closed" (reported through sys.unraisablehook); the
# abandoned tasks and coroutines report themselves when collected. After a failure, `quiet()`
# waits until these reports stop (measured: within a millisecond) and collects garbage, so they
# arrive while its filters are up; then it takes the filters down.
_DRAIN_QUIET_S = 0.02    # no report for this long: the abandoned work has finished
_DRAIN_MAX_S = 0.5
_UNAWAITED_RE = r"coroutine '\w+Handler\.\w+' was never awaited"
_ORBAX_MARKS = ("tensorstore", "zarr", "OCDBT", "orbax")


class _DropOrbaxRecords(logging.Filter):
  """orbax's own warnings (through absl logging) about the bad checkpoint we are refusing."""

  def filter(self, record):
    return "orbax" not in record.pathname


class _DropOrphanedOrbaxTasks(logging.Filter):
  """asyncio's reports of orbax/tensorstore tasks that a failed read abandoned."""

  def filter(self, record):
    text = record.getMessage()
    if "never retrieved" not in text and "destroyed but it is pending" not in text:
      return True
    exc = record.exc_info[1] if record.exc_info else None
    text += f" {exc!r}"
    if any(mark in text for mark in _ORBAX_MARKS):
      _scope.dropped()
      return False
    return True


def _closed_loop_report(unraisable) -> bool:
  """An "Event loop is closed" RuntimeError raised inside asyncio (a tensorstore callback)."""
  exc = unraisable.exc_value
  if not (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"):
    return False
  tb = unraisable.exc_traceback
  while tb is not None and tb.tb_next is not None:
    tb = tb.tb_next
  return tb is not None and "asyncio" in tb.tb_frame.f_code.co_filename


class _Scope:
  """The filters, installed while at least one `quiet()` block is open (blocks may nest)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._depth = 0
    self._last_drop = 0.0
    self._absl = _DropOrbaxRecords()
    self._asyncio = _DropOrphanedOrbaxTasks()
    self._warnings = None
    self._prev_hook = None

  def dropped(self):
    self._last_drop = time.perf_counter()

  def _hook(self, unraisable):
    if _closed_loop_report(unraisable):
      self.dropped()
      return
    (self._prev_hook or sys.__unraisablehook__)(unraisable)

  def enter(self):
    with self._lock:
      self._depth += 1
      if self._depth > 1:
        return
      logging.getLogger("absl").addFilter(self._absl)   # orbax logs through absl.logging
      logging.getLogger("asyncio").addFilter(self._asyncio)
      self._warnings = warnings.catch_warnings()
      self._warnings.__enter__()
      warnings.filterwarnings("ignore", message=_UNAWAITED_RE, category=RuntimeWarning)
      self._prev_hook = sys.unraisablehook
      sys.unraisablehook = self._hook

  def exit(self):
    with self._lock:
      self._depth -= 1
      if self._depth > 0:
        return
      if sys.unraisablehook == self._hook:   # else someone chained theirs on top: leave both
        sys.unraisablehook = self._prev_hook
      self._warnings.__exit__(None, None, None)
      self._warnings = None
      logging.getLogger("asyncio").removeFilter(self._asyncio)
      logging.getLogger("absl").removeFilter(self._absl)

  def drain(self):
    """Waits (at most `_DRAIN_MAX_S`) until the abandoned work has stopped reporting."""
    t0 = time.perf_counter()
    while True:
      time.sleep(_DRAIN_QUIET_S / 4)
      now = time.perf_counter()
      if now - max(t0, self._last_drop) >= _DRAIN_QUIET_S or now - t0 >= _DRAIN_MAX_S:
        break
    gc.collect(1)   # abandoned tasks and coroutines report as they are collected


_scope = _Scope()


@contextlib.contextmanager
def quiet() -> Iterator[None]:
  """Around one orbax call: its noise about a bad checkpoint stays off stderr while we turn the
  failure into SessionError. Drops only reports about orbax / tensorstore work (orbax's absl
  records, asyncio's orphaned-task reports, "Event loop is closed" from asyncio callbacks,
  "never awaited" warnings of orbax handler coroutines); everything else passes. The filters
  are process-wide only while a block is open."""
  _scope.enter()
  try:
    yield
  except BaseException:
    _scope.drain()
    raise
  finally:
    _scope.exit()
