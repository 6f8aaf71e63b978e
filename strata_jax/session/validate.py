"""Checks of what a read finds, before any array data is read: the header, the header against
the engine's `SessionReadLimits`, and orbax's array metadata against the header.

Every check raises `SessionError` naming the path and the problem.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from strata_jax.errors import SessionError
from strata_jax.session.schema import (
    CHECKPOINT,
    HEX16_RE,
    KNOWN_FLAGS,
    MAX_NDIM,
    NAME_RE,
    SUPPORTED_VERSIONS,
    TOKENS_DTYPE,
    SessionMeta,
    SessionReadLimits,
    fmt_shape,
    meta_checksum,
)


def check_header(path, header, supported):
  v = header.get("version")
  if isinstance(v, bool) or not isinstance(v, int) or v not in SUPPORTED_VERSIONS:
    raise SessionError(f"{path}: unknown session format version {v!r} "
                       f"(known versions: {sorted(SUPPORTED_VERSIONS)})")
  if v not in supported:
    what = " (split model)" if v == 2 else ""
    raise SessionError(f"{path}: session format v{v}{what} is not supported by this reader "
                       f"(it reads {', '.join(f'v{x}' for x in sorted(supported))})")
  if header.get("meta_xxh3_64") != meta_checksum(header):
    raise SessionError(f"{path}: session metadata is corrupted (checksum mismatch)")


def parse_header(path, header) -> tuple[SessionMeta, dict[str, tuple[tuple[int, ...], str, str]]]:
  """SessionMeta plus `{array path: (shape, dtype name, checksum)}` from a versioned header."""
  def bad(msg):
    return SessionError(f"{path}: malformed session metadata: {msg}")

  def is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)

  def array_entry(name, e):
    if not isinstance(e, dict):
      raise bad(f"entry of {name} is not an object")
    shape, dtype, digest = e.get("shape"), e.get("dtype"), e.get("xxh3_64")
    if (not isinstance(shape, list) or len(shape) > MAX_NDIM
        or not all(is_int(d) and d >= 0 for d in shape)):
      raise bad(f"shape of {name} is {shape!r}")
    if not isinstance(dtype, str) or not isinstance(digest, str) or not HEX16_RE.match(digest):
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
      if not all(NAME_RE.match(p) for p in parts) or (len(parts) > 1 and parts[0] != CHECKPOINT):
        raise bad(f"stage {s} array name {name!r}")
      specs[f"stage{s}/{name}"] = array_entry(f"stage{s}/{name}", e)
  return SessionMeta(version, flags, fp, ranges, n), specs


def check_limits(path, meta: SessionMeta, specs, limits: SessionReadLimits
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
                           f"expects {fmt_shape(shape)}")
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
                             f"expects {fmt_shape(shape)}")
      if got_dtype != dtype.name:
        raise SessionError(f"{path}: dtype mismatch: array {full} is {got_dtype}, this engine "
                           f"expects {dtype.name}")
      expected[full] = (tuple(n if w is None else w for w in shape), dtype)
  return expected


def check_stored(path, leaves: Mapping, stored: Mapping[str, tuple[tuple[int, ...], np.dtype]]):
  """Orbax's own array metadata (`leaves`: shapes/dtypes of what is on disk, from
  `orbax_io.stored_arrays`) must match the arrays the header describes; no data is read."""
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
