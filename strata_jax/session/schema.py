"""The session format: its constants, public types, and the header a save writes.

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
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
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

NAME_RE = re.compile(r"[A-Za-z0-9_]+\Z")
HEX16_RE = re.compile(r"[0-9a-f]{16}\Z")
MAX_NDIM = 8

ArraySpec = tuple[tuple[int | None, ...], Any]   # (shape with None on the token axis, dtype)


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
# The header of a save

def build(path, stages, tokens, fingerprint, flags, layer_ranges):
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
    _flatten_stage(stage, "", flat, bad, s)
    for key in ("k", "v"):
      a = flat[key]
      if a.ndim < 2 or a.shape[1] != n:
        raise bad(f"stage {s} {key} {list(a.shape)} must have {n} tokens on axis 1")
    if flat["ssm"].dtype != np.float32:
      raise bad(f"stage {s} ssm must be float32, got {flat['ssm'].dtype}")
    subtree: dict[str, Any] = {}
    entries = {}
    for name, a in flat.items():
      entries[name] = entry(a)
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
  header["tokens"] = entry(tokens)
  header["meta_xxh3_64"] = meta_checksum(header)
  return tree, header


def _flatten_stage(node, prefix, out, bad, s):
  for key, value in node.items():
    if not isinstance(key, str) or not NAME_RE.match(key):
      raise bad(f"stage {s} array name {key!r} must match [A-Za-z0-9_]+")
    name = f"{prefix}{key}"
    if isinstance(value, Mapping):
      if not prefix and key != CHECKPOINT:
        raise bad(f"stage {s} entry {key!r}: only {CHECKPOINT!r} may hold nested arrays")
      _flatten_stage(value, name + "/", out, bad, s)
      continue
    if prefix == "" and key not in STATE_ARRAYS:
      raise bad(f"stage {s} has an unknown entry {key!r} (extra arrays go under {CHECKPOINT!r})")
    a = np.asarray(value)
    if a.dtype.hasobject or a.dtype.kind not in "biufc" and a.dtype.name != "bfloat16":
      raise bad(f"stage {s} array {name} has unsupported dtype {a.dtype}")
    if a.ndim > MAX_NDIM:
      raise bad(f"stage {s} array {name} has more than {MAX_NDIM} dimensions")
    out[name] = np.ascontiguousarray(a)


def entry(a: np.ndarray) -> dict:
  """An array's header entry: shape, dtype name, checksum."""
  return {"shape": [int(d) for d in a.shape], "dtype": a.dtype.name, "xxh3_64": checksum(a)}


def checksum(a: np.ndarray) -> str:
  """xxh3-64 (hex) of an array's bytes."""
  # Bytes as laid out in memory (little-endian on every platform we run on).
  return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(a).view(np.uint8).data)


def meta_checksum(header: Mapping) -> str:
  """xxh3-64 (hex) of the canonical JSON of every header field but `meta_xxh3_64`."""
  body = {k: v for k, v in header.items() if k != "meta_xxh3_64"}
  return xxhash.xxh3_64_hexdigest(
      json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode())


def size(shape) -> int:
  """Elements of an array of `shape`."""
  return int(np.prod(shape, dtype=np.int64)) if shape else 1


def fmt_shape(shape) -> str:
  """A limits shape for messages, the token axis as `n_tokens`."""
  return "[" + ", ".join("n_tokens" if d is None else str(d) for d in shape) + "]"
