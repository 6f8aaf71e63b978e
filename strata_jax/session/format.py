"""Session files: a slot's state as one orbax checkpoint directory plus JSON metadata.

On disk a session at `path` is a finished orbax PyTree checkpoint (OCDBT + zarr, numpy leaves)
whose `custom_metadata` (orbax's `_CHECKPOINT_METADATA` JSON) is the session header:

  {"magic": "strata-session", "version": 1 | 2, "flags": int, "n_tokens": N,
   "fingerprint": str,
   "n_stages": S,                                   # version 2 only
   "stages": [{"layers": [lo, hi],
               "arrays": {"k": {"shape": [...], "dtype": "bfloat16", "xxh3_64": "<16 hex>"},
                          "v": ..., "conv": ..., "ssm": ...,
                          "checkpoint/<name>[/<name>...]": ...}}, ...],
   "tokens": {"shape": [N], "dtype": "int32", "xxh3_64": ...},
   "meta_xxh3_64": "<16 hex>"}                      # over the canonical JSON of all the rest

and whose array tree is `{"tokens": int32 [N], "stage0": {...}, "stage1": {...}, ...}` (one
subtree per stage, the optional `checkpoint` dict nested inside its stage). Version 1 has
exactly one stage; version 2 (written only for more than one stage) keeps stage 0 exactly as
version 1 and adds `n_stages` and one block per later stage. Zero-size arrays (a stage without
attention layers, an empty token list) are described in the JSON only: orbax cannot store them.

Reads check the header and orbax's array metadata (shapes and dtypes, no data) against
`SessionReadLimits` before any array is read, then restore against an explicit abstract target
and verify every array's xxh3-64 checksum. Every problem surfaces as `SessionError`.

Saves write a complete checkpoint into a temporary directory beside `path`, verify and fsync
it, then swap it in: one atomic `renameat2(RENAME_EXCHANGE)` where the filesystem has it,
else rename-old-to-backup, rename-new-into-place, delete backup. A reader that finds `path`
missing but the backup present (a save killed between the two renames) restores the backup.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import functools
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import xxhash

from strata_jax.errors import SessionError

MAGIC = "strata-session"
SUPPORTED_VERSIONS = frozenset({1, 2})
FLAG_LORA_ON = 0b1
KNOWN_FLAGS = FLAG_LORA_ON
STATE_ARRAYS = ("k", "v", "conv", "ssm")   # required in every stage
CHECKPOINT = "checkpoint"                  # optional nested dict of extra arrays per stage
TOKENS_DTYPE = np.dtype(np.int32)

TMP_INFIX = ".strata-tmp."      # `<path>.strata-tmp.<pid>.<hex>`: a save (or erase) in flight
BACKUP_SUFFIX = ".strata-old"   # `<path>.strata-old`: the previous session during a swap

_NAME_RE = re.compile(r"[A-Za-z0-9_]+\Z")
_HEX16_RE = re.compile(r"[0-9a-f]{16}\Z")
_MAX_NDIM = 8

# Test seam: called with the name of each step of a save ("written", "exchanged", "backed_up",
# "renamed", "cleaned"), so a test can kill the process exactly there.
_step_hook: Callable[[str], None] | None = None
# Session I/O is rare and orbax is not documented as thread-safe: one at a time per process.
_IO_LOCK = threading.RLock()

ArraySpec = tuple[tuple[int | None, ...], Any]   # (shape with None on the token axis, dtype)


# ---------------------------------------------------------------------------------------------
# Public types

@dataclasses.dataclass
class SessionMeta:
  """A session's header. `tokens` is filled by `load_session` (None from `read_session_meta`)."""
  version: int
  flags: int
  fingerprint: str
  layer_ranges: list[tuple[int, int]]
  n_tokens: int
  tokens: np.ndarray | None = dataclasses.field(default=None, compare=False)

  @property
  def lora_on(self) -> bool:
    return bool(self.flags & FLAG_LORA_ON)

  @property
  def n_stages(self) -> int:
    return len(self.layer_ranges)


@dataclasses.dataclass(frozen=True)
class SessionReadLimits:
  """What the live engine can accept; every read is checked against it before any array is read.

  Attributes:
    max_tokens: K/V capacity of a slot; a session with more tokens is refused.
    max_stages: the most stages (layer-split parts) this engine runs.
    stage_layers: per stage, the engine's layer range [lo, hi); must equal the session's.
    stage_shapes: per stage, `{array path: (shape, dtype)}` for every array the engine accepts.
      Paths are "k", "v", "conv", "ssm" (required) and "checkpoint/<name>/..." (optional).
      A None dimension is the token axis and must equal the session's token count; every other
      dimension must match exactly. This bounds every read by `max_tokens` and these shapes.
    fingerprint: the model (and adapter) identity; must equal the session's.
    supported_versions: format versions this reader accepts ({1} models a v1-only reader).
  """
  max_tokens: int
  max_stages: int
  stage_layers: tuple[tuple[int, int], ...]
  stage_shapes: tuple[Mapping[str, ArraySpec], ...]
  fingerprint: str
  supported_versions: frozenset[int] = SUPPORTED_VERSIONS

  def __post_init__(self):
    layers = tuple((int(lo), int(hi)) for lo, hi in self.stage_layers)
    shapes = tuple(
        {name: (tuple(None if d is None else int(d) for d in shape), np.dtype(dtype))
         for name, (shape, dtype) in stage.items()}
        for stage in self.stage_shapes)
    if len(layers) != len(shapes):
      raise ValueError(f"SessionReadLimits: {len(layers)} stage layer ranges but "
                       f"{len(shapes)} stage shape tables")
    for s, stage in enumerate(shapes):
      missing = [n for n in STATE_ARRAYS if n not in stage]
      if missing:
        raise ValueError(f"SessionReadLimits: stage {s} shape table lacks {missing}")
    object.__setattr__(self, "stage_layers", layers)
    object.__setattr__(self, "stage_shapes", shapes)
    object.__setattr__(self, "supported_versions", frozenset(self.supported_versions))


def stage_shapes_for(cfg, dtype, *, checkpoint: Mapping[str, ArraySpec] | None = None
                     ) -> dict[str, ArraySpec]:
  """`SessionReadLimits.stage_shapes` entry for one stage of `cfg` (a `ModelConfig`, already
  cut to the stage with `cfg.stage(lo, hi)`): K/V and conv in `dtype`, ssm in float32."""
  shapes = {
      "k": ((cfg.n_attn, None, cfg.n_kv_head, cfg.head_dim), dtype),
      "v": ((cfg.n_attn, None, cfg.n_kv_head, cfg.head_dim), dtype),
      "conv": ((cfg.n_gdn, cfg.conv_kernel - 1, cfg.gdn_conv_dim), dtype),
      "ssm": ((cfg.n_gdn, cfg.gdn_n_v_heads, cfg.gdn_d_v, cfg.gdn_d_k), np.float32),
  }
  for name, spec in (checkpoint or {}).items():
    shapes[f"{CHECKPOINT}/{name}"] = spec
  return shapes


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
  tree, header = _build(path, stages, tokens, fingerprint, flags, layer_ranges)
  with _IO_LOCK:
    tmp = None
    try:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      _recover(path)
      _check_replaceable(path)
      _sweep(path)
      tmp = _tmp_name(path)
      with _quiet_orbax():
        _checkpointer().save(tmp, args=_ocp().args.PyTreeSave(tree), custom_metadata=header)
      # Read the header back before it may replace anything: orbax must have finished.
      if _read_header(tmp) != header:
        raise OSError("the written session metadata does not read back identically")
      _fsync_tree(tmp)
      _step("written")
      _replace(tmp, path)
    except Exception as e:  # noqa: BLE001 - any failure leaves the old session, reported cleanly
      if tmp is not None:
        _rmtree_quiet(tmp)
        _rmtree_quiet(tmp + ".orbax-checkpoint-tmp")
      if isinstance(e, SessionError):
        raise
      raise SessionError(f"{path}: cannot save session: {_short(e)}") from None
  return {"path": path, "bytes": _du(path), "seconds": time.perf_counter() - t0,
          "version": header["version"], "n_tokens": header["n_tokens"]}


def erase_session(path) -> bool:
  """Deletes the session at `path` (and leftovers of interrupted saves). Returns whether a
  session was there. Refuses to delete something that is not a session directory."""
  path = os.path.abspath(os.fspath(path))
  with _IO_LOCK:
    _recover(path)
    _check_replaceable(path)
    _sweep(path)
    if not os.path.lexists(path):
      return False
    doomed = _tmp_name(path)
    try:
      os.rename(path, doomed)   # gone from `path` atomically; the rest is cleanup
      _fsync_dir(os.path.dirname(path))
    except OSError as e:
      raise SessionError(f"{path}: cannot erase session: {_short(e)}") from None
    _rmtree_quiet(doomed)
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
      raise SessionError(f"{os.fspath(path)}: cannot read session: {_short(e)}") from None
  return wrapper


@_only_session_errors
def read_session_meta(path) -> SessionMeta:
  """The session header at `path`, read without touching any array."""
  path = os.path.abspath(os.fspath(path))
  with _IO_LOCK:
    where = _recover(path)
    header = _load_header(path, where)
    _check_header(path, header, SUPPORTED_VERSIONS)
    return _parse(path, header)[0]


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
    where = _recover(path)
    header = _load_header(path, where)
    _check_header(path, header, limits.supported_versions)
    meta, specs = _parse(path, header)
    expected = _check_limits(path, meta, specs, limits)
    stored = {name: spec for name, spec in expected.items() if _size(spec[0])}
    _check_stored(path, where, stored)
    arrays = _restore_arrays(where, stored)
    out = {}
    for name, (shape, dtype) in expected.items():
      a = arrays.get(name) if name in stored else np.zeros(shape, dtype)
      if a is None:
        raise SessionError(f"{path}: array {name} is missing from the restored data")
      a = np.asarray(a)
      if a.shape != shape or a.dtype != dtype:
        raise SessionError(f"{path}: array {name} restored as {a.dtype}{list(a.shape)}, "
                           f"expected {dtype}{list(shape)}")
      if _checksum(a) != specs[name][2]:
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


# ---------------------------------------------------------------------------------------------
# Building and checking headers

def _build(path, stages, tokens, fingerprint, flags, layer_ranges):
  """The orbax tree and the JSON header of a save, after checking the inputs."""
  def bad(msg):
    return SessionError(f"{path}: cannot save session: {msg}")

  if isinstance(flags, bool) or not isinstance(flags, (int, np.integer)) or flags < 0:
    raise bad(f"flags must be a non-negative int, got {flags!r}")
  if int(flags) & ~KNOWN_FLAGS:
    raise bad(f"unknown flag bits 0x{int(flags) & ~KNOWN_FLAGS:x}")
  if not isinstance(fingerprint, str):
    raise bad(f"fingerprint must be a str, got {type(fingerprint).__name__}")
  stages = list(stages)
  layer_ranges = [tuple(r) for r in layer_ranges]
  if not stages:
    raise bad("no stages")
  if len(layer_ranges) != len(stages):
    raise bad(f"{len(stages)} stages but {len(layer_ranges)} layer ranges")
  tokens = np.asarray(tokens)
  if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
    raise bad(f"tokens must be a 1-D integer array, got {tokens.dtype}{list(tokens.shape)}")
  i32 = np.iinfo(np.int32)
  if tokens.size and (tokens.min() < i32.min or tokens.max() > i32.max):
    raise bad("token ids do not fit int32")
  tokens = np.ascontiguousarray(tokens, TOKENS_DTYPE)
  n = int(tokens.shape[0])

  tree: dict[str, Any] = {}
  header_stages = []
  for s, (stage, rng) in enumerate(zip(stages, layer_ranges)):
    if (len(rng) != 2 or not all(isinstance(x, (int, np.integer)) for x in rng)
        or not 0 <= rng[0] < rng[1]):
      raise bad(f"stage {s} layer range {rng!r} is not [lo, hi) with 0 <= lo < hi")
    if not isinstance(stage, Mapping):
      raise bad(f"stage {s} is not a dict of arrays")
    missing = [k for k in STATE_ARRAYS if k not in stage]
    if missing:
      raise bad(f"stage {s} lacks {missing}")
    flat = {}
    _flatten(stage, "", flat, bad, s)
    for key in ("k", "v"):
      a = flat[key]
      if a.ndim < 2 or a.shape[1] != n:
        raise bad(f"stage {s} {key} {list(a.shape)} must have {n} tokens on axis 1")
    if flat["ssm"].dtype != np.float32:
      raise bad(f"stage {s} ssm must be float32, got {flat['ssm'].dtype}")
    subtree: dict[str, Any] = {}
    entries = {}
    for name, a in flat.items():
      entries[name] = _entry(a)
      if a.size:
        node = subtree
        *keys, last = name.split("/")
        for key in keys:
          node = node.setdefault(key, {})
        node[last] = a
    if subtree:
      tree[f"stage{s}"] = subtree
    header_stages.append({"layers": [int(rng[0]), int(rng[1])], "arrays": entries})
  if n:
    tree["tokens"] = tokens
  if not tree:
    raise bad("nothing to store: every array is empty")

  header: dict[str, Any] = {
      "magic": MAGIC, "version": 1 if len(stages) == 1 else 2, "flags": int(flags),
      "n_tokens": n, "fingerprint": fingerprint,
  }
  if len(stages) > 1:
    header["n_stages"] = len(stages)
  header["stages"] = header_stages
  header["tokens"] = _entry(tokens)
  header["meta_xxh3_64"] = _meta_checksum(header)
  return tree, header


def _flatten(node, prefix, out, bad, s):
  for key, value in node.items():
    if not isinstance(key, str) or not _NAME_RE.match(key):
      raise bad(f"stage {s} array name {key!r} must match [A-Za-z0-9_]+")
    name = f"{prefix}{key}"
    if isinstance(value, Mapping):
      if not prefix and key != CHECKPOINT:
        raise bad(f"stage {s} entry {key!r}: only {CHECKPOINT!r} may hold nested arrays")
      _flatten(value, name + "/", out, bad, s)
      continue
    if prefix == "" and key not in STATE_ARRAYS:
      raise bad(f"stage {s} has an unknown entry {key!r} (extra arrays go under {CHECKPOINT!r})")
    a = np.asarray(value)
    if a.dtype.hasobject or a.dtype.kind not in "biufc" and a.dtype.name != "bfloat16":
      raise bad(f"stage {s} array {name} has unsupported dtype {a.dtype}")
    if a.ndim > _MAX_NDIM:
      raise bad(f"stage {s} array {name} has more than {_MAX_NDIM} dimensions")
    out[name] = np.ascontiguousarray(a)


def _entry(a: np.ndarray) -> dict:
  return {"shape": [int(d) for d in a.shape], "dtype": a.dtype.name, "xxh3_64": _checksum(a)}


def _checksum(a: np.ndarray) -> str:
  # Bytes as laid out in memory (little-endian on every platform we run on).
  return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(a).view(np.uint8).data)


def _meta_checksum(header: Mapping) -> str:
  body = {k: v for k, v in header.items() if k != "meta_xxh3_64"}
  return xxhash.xxh3_64_hexdigest(
      json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode())


def _check_header(path, header, supported):
  v = header.get("version")
  if isinstance(v, bool) or not isinstance(v, int) or v not in SUPPORTED_VERSIONS:
    raise SessionError(f"{path}: unknown session format version {v!r} "
                       f"(known versions: {sorted(SUPPORTED_VERSIONS)})")
  if v not in supported:
    what = " (split model)" if v == 2 else ""
    raise SessionError(f"{path}: session format v{v}{what} is not supported by this reader "
                       f"(it reads {', '.join(f'v{x}' for x in sorted(supported))})")
  if header.get("meta_xxh3_64") != _meta_checksum(header):
    raise SessionError(f"{path}: session metadata is corrupted (checksum mismatch)")


def _parse(path, header) -> tuple[SessionMeta, dict[str, tuple[tuple[int, ...], str, str]]]:
  """SessionMeta plus `{array path: (shape, dtype name, checksum)}` from a versioned header."""
  def bad(msg):
    return SessionError(f"{path}: malformed session metadata: {msg}")

  def is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)

  def array_entry(name, e):
    if not isinstance(e, dict):
      raise bad(f"entry of {name} is not an object")
    shape, dtype, digest = e.get("shape"), e.get("dtype"), e.get("xxh3_64")
    if (not isinstance(shape, list) or len(shape) > _MAX_NDIM
        or not all(is_int(d) and d >= 0 for d in shape)):
      raise bad(f"shape of {name} is {shape!r}")
    if not isinstance(dtype, str) or not isinstance(digest, str) or not _HEX16_RE.match(digest):
      raise bad(f"dtype/checksum of {name} are {dtype!r}/{digest!r}")
    return tuple(shape), dtype, digest

  version, flags, n, fp = (header.get(k) for k in ("version", "flags", "n_tokens", "fingerprint"))
  if not is_int(flags) or flags < 0:
    raise bad(f"flags {flags!r}")
  if flags & ~KNOWN_FLAGS:
    raise SessionError(f"{path}: unknown flag bits 0x{flags & ~KNOWN_FLAGS:x} in flags "
                       f"0x{flags:x} (this reader knows 0x{KNOWN_FLAGS:x}: bit 0 = LoRA on)")
  if not is_int(n) or n < 0:
    raise bad(f"n_tokens {n!r}")
  if not isinstance(fp, str):
    raise bad(f"fingerprint {fp!r}")
  stages = header.get("stages")
  if not isinstance(stages, list) or not stages:
    raise bad("no stages")
  if version == 1 and len(stages) != 1:
    raise bad(f"version 1 holds exactly one stage, found {len(stages)}")
  if version == 2 and (header.get("n_stages") != len(stages) or len(stages) < 2):
    raise bad(f"n_stages {header.get('n_stages')!r} with {len(stages)} stage blocks")
  specs = {"tokens": array_entry("tokens", header.get("tokens"))}
  if specs["tokens"][0] != (n,) or specs["tokens"][1] != TOKENS_DTYPE.name:
    raise bad(f"tokens are {specs['tokens'][1]}{list(specs['tokens'][0])} for n_tokens {n}")
  ranges = []
  for s, block in enumerate(stages):
    if not isinstance(block, dict):
      raise bad(f"stage {s} is not an object")
    rng = block.get("layers")
    if (not isinstance(rng, list) or len(rng) != 2 or not all(is_int(x) for x in rng)
        or not 0 <= rng[0] < rng[1]):
      raise bad(f"stage {s} layers {rng!r}")
    ranges.append((rng[0], rng[1]))
    arrays = block.get("arrays")
    if not isinstance(arrays, dict):
      raise bad(f"stage {s} has no array table")
    for name, e in arrays.items():
      parts = name.split("/")
      if not all(_NAME_RE.match(p) for p in parts) or (len(parts) > 1 and parts[0] != CHECKPOINT):
        raise bad(f"stage {s} array name {name!r}")
      specs[f"stage{s}/{name}"] = array_entry(f"stage{s}/{name}", e)
  return SessionMeta(version, flags, fp, ranges, n), specs


def _check_limits(path, meta: SessionMeta, specs, limits: SessionReadLimits
                  ) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  """Checks a parsed header against `limits`; returns every array's exact (shape, dtype)."""
  if meta.fingerprint != limits.fingerprint:
    raise SessionError(f"{path}: session was saved with a different model or adapter "
                       f"(fingerprint {meta.fingerprint!r}, this engine {limits.fingerprint!r})")
  s_file, s_live = meta.n_stages, len(limits.stage_layers)
  if s_file > limits.max_stages:
    raise SessionError(f"{path}: session has {s_file} stages, more than this engine's "
                       f"maximum of {limits.max_stages}")
  if s_file != s_live:
    raise SessionError(f"{path}: stage count mismatch: session has {s_file} stage(s) "
                       f"{meta.layer_ranges}, this engine runs {s_live} "
                       f"{list(limits.stage_layers)}")
  for s, (got, want) in enumerate(zip(meta.layer_ranges, limits.stage_layers)):
    if tuple(got) != tuple(want):
      raise SessionError(f"{path}: layer range mismatch: stage {s} covers layers "
                         f"[{got[0]}, {got[1]}) in the session, [{want[0]}, {want[1]}) here")
  n = meta.n_tokens
  if n > limits.max_tokens:
    raise SessionError(f"{path}: session holds {n} tokens, over this engine's capacity of "
                       f"{limits.max_tokens} tokens")
  expected = {"tokens": ((n,), TOKENS_DTYPE)}
  for s, table in enumerate(limits.stage_shapes):
    prefix = f"stage{s}/"
    present = {name[len(prefix):] for name in specs if name.startswith(prefix)}
    extra = sorted(present - set(table))
    if extra:
      raise SessionError(f"{path}: unexpected array {prefix}{extra[0]} (not part of this "
                         f"engine's state)")
    for name, (shape, dtype) in table.items():
      full = prefix + name
      if name not in present:
        if not name.startswith(CHECKPOINT + "/"):
          raise SessionError(f"{path}: array {full} is missing")
        continue
      got_shape, got_dtype, _ = specs[full]
      if len(got_shape) != len(shape):
        raise SessionError(f"{path}: array {full} has shape {list(got_shape)}, this engine "
                           f"expects {_fmt_shape(shape)}")
      for g, w in zip(got_shape, shape):
        if w is None:   # the token axis
          if g > limits.max_tokens:
            raise SessionError(f"{path}: oversized array {full}: {g} entries on its token axis, "
                               f"beyond this engine's capacity of {limits.max_tokens} tokens")
          if g != n:
            what = "oversized array" if g > n else "array"
            raise SessionError(f"{path}: {what} {full}: {g} entries on its token axis but the "
                               f"session holds {n} tokens")
        elif g != w:
          raise SessionError(f"{path}: array {full} has shape {list(got_shape)}, this engine "
                             f"expects {_fmt_shape(shape)}")
      if got_dtype != dtype.name:
        raise SessionError(f"{path}: dtype mismatch: array {full} is {got_dtype}, this engine "
                           f"expects {dtype.name}")
      expected[full] = (tuple(n if w is None else w for w in shape), dtype)
  return expected


def _check_stored(path, where, stored):
  """Orbax's own array metadata (shapes/dtypes of what is on disk) must match, no data read."""
  try:
    with _quiet_orbax():
      tree = _ocp().PyTreeCheckpointHandler().metadata(_epath(where)).tree
    leaves = {}
    _flatten_metadata(tree, "", leaves)
  except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many kinds; all mean the same
    raise SessionError(f"{path}: array metadata unreadable (truncated or corrupted session): "
                       f"{_short(e)}") from None
  if set(leaves) != set(stored):
    extra, missing = sorted(set(leaves) - set(stored)), sorted(set(stored) - set(leaves))
    raise SessionError(f"{path}: stored arrays do not match the session metadata "
                       f"(unexpected {extra}, missing {missing})")
  for name, (shape, dtype) in stored.items():
    md = leaves[name]
    try:
      got_shape = tuple(int(d) for d in md.shape)
      got_dtype = np.dtype(md.dtype)
    except Exception:  # noqa: BLE001
      raise SessionError(f"{path}: stored array {name} has unreadable metadata") from None
    if got_shape != shape or got_dtype != dtype:
      raise SessionError(f"{path}: stored array {name} is {got_dtype}{list(got_shape)}, "
                         f"the session metadata says {dtype}{list(shape)}")


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


def _restore_arrays(where, stored: Mapping[str, tuple[tuple[int, ...], np.dtype]]
                    ) -> dict[str, np.ndarray]:
  """The one place array data is read: orbax restore against an explicit abstract target."""
  import jax

  if not stored:
    return {}
  ocp = _ocp()
  target: dict[str, Any] = {}
  for name, (shape, dtype) in stored.items():
    node = target
    *keys, last = name.split("/")
    for key in keys:
      node = node.setdefault(key, {})
    node[last] = jax.ShapeDtypeStruct(shape, dtype)
  restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
  try:
    with _quiet_orbax():
      tree = _checkpointer().restore(
          where, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args))
    out = {}
    _flatten_restored(tree, "", out)
  except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many kinds; all mean the same
    raise SessionError(f"{where}: array data unreadable (truncated or corrupted session): "
                       f"{_short(e)}") from None
  return out


def _flatten_restored(node, prefix, out):
  for key, value in node.items():
    if isinstance(value, Mapping):
      _flatten_restored(value, f"{prefix}{key}/", out)
    else:
      out[f"{prefix}{key}"] = value


def _size(shape) -> int:
  return int(np.prod(shape, dtype=np.int64)) if shape else 1


def _fmt_shape(shape) -> str:
  return "[" + ", ".join("n_tokens" if d is None else str(d) for d in shape) + "]"


# ---------------------------------------------------------------------------------------------
# Files: headers, atomic replacement, recovery, leftovers

def _read_header(where: str):
  """The session header (orbax custom_metadata) of a checkpoint directory, or None."""
  with _quiet_orbax():
    return _ocp().metadata.get_step_metadata(where).custom_metadata


def _load_header(path: str, where: str) -> dict:
  if not os.path.isdir(where):
    what = "does not exist" if not os.path.lexists(where) else "is not a directory"
    raise SessionError(f"{path}: not a session: the path {what}")
  try:
    header = _read_header(where)
  except Exception as e:  # noqa: BLE001
    raise SessionError(f"{path}: not a session: no readable checkpoint metadata "
                       f"({_short(e)})") from None
  if not isinstance(header, dict) or "magic" not in header:
    raise SessionError(f"{path}: not a session: the checkpoint carries no session metadata")
  if header["magic"] != MAGIC:
    raise SessionError(f"{path}: not a session: wrong magic {header['magic']!r} "
                       f"(expected {MAGIC!r})")
  return header


def _recover(path: str) -> str:
  """Undoes a save killed between its two renames; returns where the session now lives."""
  backup = path + BACKUP_SUFFIX
  if os.path.lexists(path) or not os.path.isdir(backup):
    return path
  try:
    os.rename(backup, path)
    _fsync_dir(os.path.dirname(path))
    return path
  except OSError:
    return backup   # read-only place: read the backup where it is


def _check_replaceable(path: str):
  """Only a session (or an empty directory) may be replaced or erased: never user data."""
  if not os.path.lexists(path):
    return
  if os.path.isdir(path) and not os.path.islink(path):
    if not os.listdir(path):
      return
    try:   # a raw look, so that a session with a damaged header can still be replaced
      with open(os.path.join(path, "_CHECKPOINT_METADATA"), "rb") as f:
        if f'"{MAGIC}"'.encode() in f.read(1 << 20):
          return
    except OSError:
      pass
  raise SessionError(f"{path}: refusing to overwrite or erase it: it exists and is not a "
                     f"session directory")


def _tmp_name(path: str) -> str:
  return f"{path}{TMP_INFIX}{os.getpid()}.{uuid.uuid4().hex[:12]}"


def _sweep(path: str):
  """Removes leftovers of saves killed earlier: temp dirs of dead processes, a stale backup."""
  parent, base = os.path.split(path)
  prefix = base + TMP_INFIX
  try:
    names = os.listdir(parent)
  except OSError:
    return
  for name in names:
    if name.startswith(prefix):
      pid = name[len(prefix):].split(".")[0]
      if pid.isdigit() and not _alive(int(pid)):
        _rmtree_quiet(os.path.join(parent, name))
  if os.path.lexists(path) and os.path.isdir(path + BACKUP_SUFFIX):
    _rmtree_quiet(path + BACKUP_SUFFIX)


def _alive(pid: int) -> bool:
  if pid == os.getpid():
    return False   # our own leftovers: this process holds the lock, none is in flight
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _replace(tmp: str, path: str):
  parent = os.path.dirname(path)
  if not os.path.lexists(path):
    os.rename(tmp, path)
    _step("renamed")
    _fsync_dir(parent)
    return
  if _exchange(tmp, path):
    # `path` is now the new session, `tmp` holds the old one.
    _step("exchanged")
    _fsync_dir(parent)
    _rmtree_quiet(tmp)
    _step("cleaned")
    return
  backup = path + BACKUP_SUFFIX
  os.rename(path, backup)
  _step("backed_up")
  try:
    os.rename(tmp, path)
  except OSError:
    os.rename(backup, path)   # put the old session back before reporting the failure
    raise
  _step("renamed")
  _fsync_dir(parent)
  _rmtree_quiet(backup)
  _step("cleaned")


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_use_exchange = sys.platform.startswith("linux")   # tests switch it off to cover the fallback


def _exchange(a: str, b: str) -> bool:
  """Atomically swaps two paths with renameat2(RENAME_EXCHANGE); False where unsupported."""
  global _use_exchange
  if not _use_exchange:
    return False
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.renameat2
  except (OSError, AttributeError):
    _use_exchange = False
    return False
  fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
  if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
    return True
  err = ctypes.get_errno()
  if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
    return False   # this filesystem cannot: use the backup-rename path
  raise OSError(err, f"renameat2 exchange failed: {os.strerror(err)}")


def _fsync_tree(root: str):
  for dirpath, _, files in os.walk(root):
    for f in files:
      fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
      try:
        os.fsync(fd)
      finally:
        os.close(fd)
    _fsync_dir(dirpath)


def _fsync_dir(d: str):
  try:
    fd = os.open(d, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass   # some filesystems refuse fsync on directories
  finally:
    os.close(fd)


def _rmtree_quiet(p: str):
  shutil.rmtree(p, ignore_errors=True)


def _du(root: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


def _step(name: str):
  if _step_hook is not None:
    _step_hook(name)


# ---------------------------------------------------------------------------------------------
# orbax plumbing

def _ocp():
  import orbax.checkpoint as ocp  # lazy: importing orbax costs ~0.4 s on top of jax

  return ocp


def _epath(p: str):
  from etils import epath

  return epath.Path(p)


_CHECKPOINTER = None


def _checkpointer():
  """A synchronous orbax Checkpointer: save() returns only when the checkpoint is final."""
  global _CHECKPOINTER
  if _CHECKPOINTER is None:
    ocp = _ocp()
    _CHECKPOINTER = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
  return _CHECKPOINTER


def _short(e: BaseException, limit: int = 240) -> str:
  text = str(e).strip().splitlines()[0] if str(e).strip() else ""
  text = f"{type(e).__name__}: {text}" if text else type(e).__name__
  return text if len(text) <= limit else text[:limit] + "..."


class _DropOrbaxRecords(logging.Filter):
  """During our orbax calls: orbax's own warnings about the bad checkpoint we are refusing."""

  def filter(self, record):
    return "orbax" not in record.pathname


class _DropOrphanedOrbaxTasks(logging.Filter):
  """Always: asyncio's reports, at garbage collection, of orbax/tensorstore tasks that a failed
  read abandoned (orbax closes its event loop on the first error; the rest is orphaned)."""

  _MARKS = ("tensorstore", "zarr", "OCDBT", "orbax")

  def filter(self, record):
    text = record.getMessage()
    if "never retrieved" not in text and "destroyed but it is pending" not in text:
      return True
    exc = record.exc_info[1] if record.exc_info else None
    text += f" {exc!r}"
    return not any(mark in text for mark in self._MARKS)


_ORPHAN_FILTER = _DropOrphanedOrbaxTasks()
_UNAWAITED_RE = r"coroutine '\w+Handler\.\w+' was never awaited"


@contextlib.contextmanager
def _quiet_orbax() -> Iterator[None]:
  """Keeps orbax's noise about a bad checkpoint off stderr while we turn it into SessionError.

  Failed orbax reads leave tensorstore callbacks and asyncio tasks behind that report
  themselves later, from other threads or at garbage collection, outside any `with` block.
  So besides muting orbax's logging for the duration of the call, this installs (once, and
  again if something replaced them) three narrow process-wide filters: a sys.unraisablehook
  wrapper dropping asyncio's "Event loop is closed" RuntimeError, an asyncio-logger filter
  dropping "exception was never retrieved" reports about orbax/tensorstore work, and a
  warnings filter for orbax handler coroutines "never awaited". Everything else passes.
  """
  _install_noise_filters()
  flt = _DropOrbaxRecords()
  absl_logger = logging.getLogger("absl")   # orbax logs through absl.logging
  absl_logger.addFilter(flt)
  try:
    yield
  finally:
    absl_logger.removeFilter(flt)


def _install_noise_filters():
  asyncio_logger = logging.getLogger("asyncio")
  if _ORPHAN_FILTER not in asyncio_logger.filters:
    asyncio_logger.addFilter(_ORPHAN_FILTER)
  if not any(getattr(f[1], "pattern", None) == _UNAWAITED_RE for f in warnings.filters):
    warnings.filterwarnings("ignore", message=_UNAWAITED_RE, category=RuntimeWarning)
  hook = sys.unraisablehook
  if getattr(hook, "_strata_session_filter", False):
    return

  def filtered(unraisable, _prev=hook):
    exc = unraisable.exc_value
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
      tb = unraisable.exc_traceback
      while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
      if tb is not None and "asyncio" in tb.tb_frame.f_code.co_filename:
        return
    _prev(unraisable)

  filtered._strata_session_filter = True
  sys.unraisablehook = filtered
