"""Identity of a set of LoRA adapters: a 64-bit id from their contents, scales and order.

The id keys the prefix cache (`block_hashes(..., adapter_id=)`) and names the adapter in session
files; `load_lora` stores it as `LoraSet.adapter_id`.
"""
from __future__ import annotations

import math
import os
import struct
from typing import Any

import xxhash

from strata_jax.errors import AdapterError

_ADAPTER_DOMAIN = b"strata-lora-v1"
_READ_CHUNK = 1 << 20


def _content_digest(source: Any, index: int) -> tuple[int, int]:
  """(xxh3_64 of the bytes, byte length) of an adapter given as bytes or a file path."""
  if isinstance(source, (bytes, bytearray, memoryview)):
    data = memoryview(source).cast("B")
    return xxhash.xxh3_64_intdigest(data, seed=0), data.nbytes
  if isinstance(source, (str, os.PathLike)):
    h = xxhash.xxh3_64(seed=0)
    size = 0
    try:
      with open(source, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
          h.update(chunk)
          size += len(chunk)
    except OSError as e:
      raise AdapterError(
          f"{os.fspath(source)}: cannot read adapter file: {e.strerror or e}") from None
    return h.intdigest(), size
  raise AdapterError(
      f"adapter {index}: expected file bytes or a path, got {type(source).__name__}")


def adapter_identity(files: list[tuple[Any, float]]) -> int:
  """Non-zero 64-bit identity of a set of LoRA adapters, for prefix-cache keys.

  Derived from each file's contents (not its path, so the same adapter shares cache across
  paths and instances, and a file rewritten in place under the same name gets a new id), its
  byte length, its user scale, and the files' order. The encoding is domain-separated and
  fixed-width so that no other input can produce the same hashed buffer.

  Args:
    files: `(contents_or_path, scale)` pairs in load order; contents as bytes, or a path read
      in 1 MiB chunks.

  Returns:
    0 for an empty list (the base model), otherwise an id in [1, 2**64).

  Raises:
    AdapterError: an unreadable file, an entry that is not a pair, or a non-finite scale.
  """
  if not files:
    return 0
  h = xxhash.xxh3_64(seed=0)
  h.update(struct.pack("<Q", len(_ADAPTER_DOMAIN)) + _ADAPTER_DOMAIN)
  h.update(struct.pack("<Q", len(files)))
  for i, item in enumerate(files):
    try:
      source, scale = item
    except (TypeError, ValueError):
      raise AdapterError(f"adapter {i}: expected a (contents_or_path, scale) pair") from None
    content, size = _content_digest(source, i)
    try:
      scale = float(scale)
    except (TypeError, ValueError):
      raise AdapterError(f"adapter {i}: scale must be a number, got {scale!r}") from None
    if not math.isfinite(scale):
      raise AdapterError(f"adapter {i}: scale must be finite, got {scale}")
    scale += 0.0  # -0.0 -> 0.0: the same adapter math, so the same id
    h.update(struct.pack("<QQd", content, size, scale))
  return h.intdigest() or 1


_CHOICE_DOMAIN = b"strata-lora-choice-v1"
_PARAMS_DOMAIN = b"strata-lora-params-v1"


def params_identity(arrays) -> int:
  """Non-zero 64-bit identity of adapter arrays given in memory (no file): their dtypes,
  shapes and bytes, in order. For a `LoraSet` built without `load_lora` (adapter_id 0)."""
  import numpy as np  # noqa: PLC0415

  h = xxhash.xxh3_64(seed=0)
  h.update(struct.pack("<Q", len(_PARAMS_DOMAIN)) + _PARAMS_DOMAIN)
  for a in arrays:
    a = np.ascontiguousarray(np.asarray(a))
    meta = f"{a.dtype.str}|{','.join(map(str, a.shape))}".encode()
    h.update(struct.pack("<Q", len(meta)) + meta)
    h.update(a.view(np.uint8).reshape(-1))
  return h.intdigest() or 1


def choice_identity(pairs) -> int:
  """Identity of one request's adapters: `(content_id, scale)` pairs, order-normalised.

  `content_id` is each adapter's own identity (`LoraSet.adapter_id`: from its files' contents
  and load scales, never from a name, an id number or a table slot, so a reused id or slot
  cannot alias another adapter's cache: the property vLLM lost in its issue 42125). Pairs with
  scale 0 drop out; the rest are sorted, so the order a request lists its adapters in does not
  matter. One adapter at scale 1.0 is its content id itself: what a single `LoraSet` switched
  on has always hashed as.

  Returns:
    0 for no adapter (the base chain), else an id in [1, 2**64).

  Raises:
    AdapterError: a scale that is not a finite number.
  """
  norm = []
  for i, (cid, scale) in enumerate(pairs):
    try:
      scale = float(scale)
    except (TypeError, ValueError):
      raise AdapterError(f"adapter {i}: scale must be a number, got {scale!r}") from None
    if not math.isfinite(scale):
      raise AdapterError(f"adapter {i}: scale must be finite, got {scale}")
    if scale != 0.0:
      norm.append((int(cid), scale + 0.0))
  norm.sort()
  if not norm:
    return 0
  if len(norm) == 1 and norm[0][1] == 1.0:
    return norm[0][0]
  h = xxhash.xxh3_64(seed=0)
  h.update(struct.pack("<Q", len(_CHOICE_DOMAIN)) + _CHOICE_DOMAIN)
  h.update(struct.pack("<Q", len(norm)))
  for cid, scale in norm:
    h.update(struct.pack("<Qd", cid, scale))
  return h.intdigest() or 1
