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
