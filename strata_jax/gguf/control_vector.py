"""Control vectors (llama.cpp's control-vector GGUF) read into one [L, D] array per model.

The format, as llama.cpp's `cvector-generator` (and repeng's `export_gguf`) write it:

* metadata: `general.architecture = "controlvector"`, `controlvector.model_hint` (the model's
  architecture name, a hint only), `controlvector.layer_count` (the generator writes
  n_layer - 1; repeng the number of directions in the file);
* tensors `direction.<il>`: 1-D, f32, `n_embd` values each, il >= 1.

The semantics follow llama.cpp's loader and graph exactly (`common_control_vector_load`,
`llama_adapter_cvec::apply` / `tensor_for`, and `build_cvec(cur, il)` in
`src/models/qwen3next.cpp`):

* `direction.<il>` is added to the output of layer `il` (0-based graph index), after that
  layer's MoE residual add: `x_out[il] = h + moe(post_norm(h)) + direction.<il>`. Layer 0
  never receives one (llama.cpp refuses `direction.0` and keeps no tensor for layer 0).
  Note that `cvector-generator` derives `direction.<il+1>` from layer il's output: the loader
  adds it one layer later; we reproduce the loader, not the generator's intent.
* Each file's directions are multiplied by its scale in float32 (`dst += src * strength`,
  several tensors for one layer in one file summed in file order); files are then summed in
  the order given (`result += cur`). A layer a file lacks contributes zeros.
* Layer range `[start, end]`, inclusive, in graph layer indices: `start <= 0` means 1 and
  `end <= 0` means n_layer (llama.cpp's defaults); layers outside get nothing.

Checks (each a `ControlVectorError` naming the file): llama.cpp's (unparsable tensor name,
`direction.0`, non-f32 or non-1-D tensor, n_embd differing within a file or between files, no
direction tensor at all) and ours: `general.architecture` must be "controlvector" (a model or
LoRA file is refused), n_embd must equal the model's, no direction for a layer the model does
not have (llama.cpp drops those silently), `controlvector.layer_count` at most n_layer - 1,
finite values and scales (negative scales are llama.cpp semantics: they steer the other way),
and a layer range that selects at least one layer. A `model_hint` naming another architecture,
or a file that looks like a complete vector for a shallower model, is reported as a
`ControlVectorWarning`.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import struct
import warnings
from collections.abc import Sequence

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import xxhash

from strata_jax.config import ModelConfig
from strata_jax.errors import ControlVectorError, GGUFError

ARCH = "controlvector"
KEY_ARCH = "general.architecture"
KEY_MODEL_HINT = f"{ARCH}.model_hint"
KEY_LAYER_COUNT = f"{ARCH}.layer_count"
MODEL_HINTS = frozenset({"qwen3next", "qwen3_next"})  # llama.cpp's arch name, transformers'
_DIRECTION = re.compile(r"^direction\.(\d+)$")
_ID_DOMAIN = b"strata-cvec-v1"


class ControlVectorWarning(UserWarning):
  """A control vector that loads but may not have been made for this model."""


@dataclasses.dataclass(frozen=True)
class ControlVectorFileInfo:
  """What one control-vector file contributed.

  Attributes:
    path: the file, as given.
    scale: the user scale (llama.cpp's `strength`).
    model_hint: `controlvector.model_hint`, or None.
    layer_count: `controlvector.layer_count`, or None.
    layers: the layer indices of its `direction.<il>` tensors, sorted, each once.
  """
  path: str
  scale: float
  model_hint: str | None
  layer_count: int | None
  layers: tuple[int, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class ControlVector:
  """Every loaded control vector, summed with its scale, as one per-layer array.

  Attributes:
    vectors: [L, D] in the compute dtype; row il is added to layer il's output. Row 0 and the
      rows outside `layer_range` are zero.
    files: one `ControlVectorFileInfo` per file, in the order given.
    layer_range: the layers that receive a vector, inclusive, after llama.cpp's defaults and
      clipped to the model's 1..L-1.
    control_vector_id: non-zero 64-bit identity of the files' contents, scales and the range
      (keys the conversation cache, the prefix cache and session files).
  """
  vectors: jax.Array
  files: tuple[ControlVectorFileInfo, ...]
  layer_range: tuple[int, int]
  control_vector_id: int

  @property
  def n_layers(self) -> int:
    return int(self.vectors.shape[0])

  @property
  def nbytes(self) -> int:
    return int(self.vectors.nbytes)

  def stage(self, lo: int, hi: int) -> jax.Array:
    """The rows of layers [lo, hi) (a layer-split stage's slice)."""
    return self.vectors[lo:hi]


def _check_scale(path: str, scale) -> float:
  try:
    s = float(scale)
  except (TypeError, ValueError):
    raise ControlVectorError(
        f"control vector '{path}': scale {scale!r} is not a number") from None
  if not math.isfinite(s):
    raise ControlVectorError(f"control vector '{path}': scale {s} is not finite")
  return s + 0.0  # -0.0 -> 0.0: the same vector, so the same identity


def effective_layer_range(n_layers: int, layer_range=None) -> tuple[int, int]:
  """llama.cpp's range defaults (start <= 0 -> 1, end <= 0 -> n_layer), clipped to the layers
  that can receive a vector (1..n_layer-1). Raises ControlVectorError when nothing is left."""
  start, end = (0, 0) if layer_range is None else _range_pair(layer_range)
  start = 1 if start <= 0 else start
  end = n_layers if end <= 0 else end
  lo, hi = max(start, 1), min(end, n_layers - 1)
  if lo > hi:
    raise ControlVectorError(
        f"control vector layer range {start} {end} selects no layer: this model's layers "
        f"1..{n_layers - 1} can take a control vector (layer 0 never does)")
  return lo, hi


def _range_pair(layer_range) -> tuple[int, int]:
  try:
    start, end = layer_range
  except (TypeError, ValueError):
    raise ControlVectorError(
        f"control vector layer range must be two integers (start, end), got {layer_range!r}"
    ) from None
  out = []
  for v in (start, end):
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
      raise ControlVectorError(
          f"control vector layer range must be two integers (start, end), got {layer_range!r}")
    out.append(int(v))
  return out[0], out[1]


def _n_dims(t) -> int:
  """ggml_n_dims: the number of dimensions of ne without its trailing 1s (at least 1)."""
  ne = [int(x) for x in t.shape]
  n = len(ne)
  while n > 1 and ne[n - 1] == 1:
    n -= 1
  return n


def _field(reader, key):
  f = reader.get_field(key)
  return None if f is None else f.contents()


def _read_file(cfg: ModelConfig, path: str, scale: float
               ) -> tuple[np.ndarray, ControlVectorFileInfo, bytes]:
  """One file: its scaled directions [L, D] float32 (llama.cpp's `load_one`), its info and its
  bytes (for the identity)."""
  from strata_jax.gguf.reader import open_gguf  # noqa: PLC0415 (keeps import light)

  where = f"control vector '{path}'"
  if not os.path.isfile(path):
    raise ControlVectorError(f"{where}: no such file")
  try:
    reader = open_gguf(path)
  except GGUFError as e:
    raise ControlVectorError(f"{where}: {e}") from None
  arch = _field(reader, KEY_ARCH)
  if arch != ARCH:
    what = ("a model or adapter file" if arch else "a GGUF without general.architecture")
    raise ControlVectorError(
        f"{where}: not a control vector: general.architecture is {arch!r}, expected {ARCH!r} "
        f"(this looks like {what})")
  hint = _field(reader, KEY_MODEL_HINT)
  if hint is not None and not isinstance(hint, str):
    raise ControlVectorError(f"{where}: {KEY_MODEL_HINT} = {hint!r} is not a string")
  layer_count = _field(reader, KEY_LAYER_COUNT)
  if layer_count is not None:
    if isinstance(layer_count, (bool, list)) or not isinstance(layer_count, (int, np.integer)):
      raise ControlVectorError(f"{where}: {KEY_LAYER_COUNT} = {layer_count!r} is not an integer")
    layer_count = int(layer_count)
  L, D = cfg.n_layers, cfg.d_model
  if layer_count is not None and layer_count > L - 1:
    raise ControlVectorError(
        f"{where}: made for a model with more layers: {KEY_LAYER_COUNT} = {layer_count}, this "
        f"model has {L} layers (at most {L - 1} directions, layers 1..{L - 1})")
  if not reader.tensors:
    raise ControlVectorError(f"{where}: no direction tensors found")

  out = np.zeros((L, D), np.float32)
  s32 = np.float32(scale)
  n_embd = None
  layers = set()
  for t in reader.tensors:
    m = _DIRECTION.match(t.name)
    if m is None:
      raise ControlVectorError(
          f"{where}: invalid/unparsable direction tensor layer index in tensor {t.name!r} "
          "(expected direction.<layer>)")
    il = int(m.group(1))
    if il == 0:
      raise ControlVectorError(f"{where}: invalid (zero) direction tensor layer index in tensor "
                               f"{t.name!r} (layer 0 never takes a control vector)")
    if t.tensor_type != gguf.GGMLQuantizationType.F32:
      raise ControlVectorError(
          f"{where}: invalid (non-F32) direction tensor type {t.tensor_type.name} in {t.name!r}")
    if _n_dims(t) != 1:
      raise ControlVectorError(
          f"{where}: invalid (non-1D) direction tensor shape {[int(x) for x in t.shape]} in "
          f"{t.name!r}")
    n = int(t.n_elements)
    if n_embd is None:
      n_embd = n
    elif n != n_embd:
      raise ControlVectorError(f"{where}: direction tensor {t.name!r} has {n} values, the file's "
                               f"previous directions {n_embd}")
    if n != D:
      raise ControlVectorError(f"{where}: control vector n_embd {n} does not match the model's "
                               f"n_embd {D} (tensor {t.name!r})")
    if il >= L:
      raise ControlVectorError(
          f"{where}: tensor {t.name!r} is for layer {il}, this model has {L} layers (directions "
          f"1..{L - 1}); the control vector was made for a model with more layers")
    src = np.asarray(t.data, np.float32).reshape(D)
    if not np.all(np.isfinite(src)):
      raise ControlVectorError(f"{where}: tensor {t.name!r} holds non-finite values")
    out[il] += src * s32   # llama.cpp: dst[j] += src[j] * strength, in float32
    layers.add(il)

  if hint is not None and hint.lower() not in MODEL_HINTS:
    warnings.warn(f"{where}: {KEY_MODEL_HINT} is {hint!r}, this model is qwen3next; applying it "
                  "anyway (n_embd and layers fit)", ControlVectorWarning, stacklevel=3)
  if (layer_count is not None and layer_count < L - 1
      and sorted(layers) == list(range(1, layer_count + 1))):
    warnings.warn(f"{where}: holds directions 1..{layer_count} only ({KEY_LAYER_COUNT} = "
                  f"{layer_count}), as a complete vector for a {layer_count + 1}-layer model "
                  f"would; this model has {L} layers", ControlVectorWarning, stacklevel=3)
  raw = np.asarray(reader.data).tobytes()   # the bytes the directions were read from
  info = ControlVectorFileInfo(path=path, scale=scale, model_hint=hint, layer_count=layer_count,
                               layers=tuple(sorted(layers)))
  return out, info, raw


def control_vector_identity(files: Sequence[tuple[object, float]],
                            layer_range: tuple[int, int]) -> int:
  """Non-zero 64-bit identity of control vectors, for cache keys and session files.

  The LoRA identity scheme (`adapter_identity`: per file, in load order, the xxh3-64 of its
  bytes, its byte length and its scale as an IEEE double; never a path) gives `inner`; the
  control vector's id is then xxh3-64 (seed 0) of `u64 len(b"strata-cvec-v1") ‖
  b"strata-cvec-v1" ‖ u64 inner ‖ i64 start ‖ i64 end` (little-endian, the effective inclusive
  layer range), 0 mapped to 1. The domain keeps it apart from any adapter id.

  Args:
    files: `(contents_or_path, scale)` per file, in load order.
    layer_range: the effective inclusive range (`effective_layer_range`).
  """
  from strata_jax.adapter_id import adapter_identity  # noqa: PLC0415

  inner = adapter_identity([(c, float(s)) for c, s in files])
  buf = (struct.pack("<Q", len(_ID_DOMAIN)) + _ID_DOMAIN
         + struct.pack("<Qqq", inner, int(layer_range[0]), int(layer_range[1])))
  return xxhash.xxh3_64_intdigest(buf, seed=0) or 1


def read_control_vectors(cfg: ModelConfig, paths: Sequence[str | os.PathLike],
                         scales: Sequence[float] | None = None, layer_range=None,
                         dtype=jnp.float32) -> ControlVector:
  """Reads llama.cpp control-vector GGUFs for the model described by `cfg`.

  Args:
    cfg: the model (layer count and n_embd).
    paths: one or more control-vector files.
    scales: one scale per file (default 1.0 each); finite, may be negative or 0.
    layer_range: `(start, end)` inclusive (llama.cpp's `--control-vector-layer-range`), or None
      for every layer; `<= 0` takes llama.cpp's default for that end.
    dtype: the compute dtype of the returned array (the sum is formed in float32 first).

  Returns:
    The `ControlVector`.

  Raises:
    ControlVectorError: a file fails a check (see the module docstring), a scale is not a
      finite number, or the range selects no layer.
  """
  paths = [os.fspath(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
  if not paths:
    raise ControlVectorError("no control vector file given")
  scales = [1.0] * len(paths) if scales is None else list(scales)
  if len(scales) != len(paths):
    raise ControlVectorError(f"got {len(scales)} control vector scale(s) for {len(paths)} "
                             f"file(s) ({', '.join(paths)}); give one scale per file")
  scales = [_check_scale(p, s) for p, s in zip(paths, scales)]
  lo, hi = effective_layer_range(cfg.n_layers, layer_range)
  total, infos, ids = None, [], []
  for path, s in zip(paths, scales):
    data, info, raw = _read_file(cfg, path, s)
    total = data if total is None else total + data   # llama.cpp: result.data[i] += cur.data[i]
    infos.append(info)
    ids.append((raw, s))
  keep = np.zeros((cfg.n_layers, 1), bool)
  keep[lo:hi + 1] = True
  total = np.where(keep, total, np.float32(0.0))
  return ControlVector(vectors=jnp.asarray(total, dtype), files=tuple(infos),
                       layer_range=(lo, hi),
                       control_vector_id=control_vector_identity(ids, (lo, hi)))


def write_control_vector(path, directions: dict[int, np.ndarray], *, model_hint="qwen3next",
                         layer_count: int | None = None) -> None:
  """Write a control-vector GGUF as llama.cpp's `cvector-generator` does (tests, tools).

  Args:
    directions: {layer il >= 1: float32 [n_embd]}.
    layer_count: `controlvector.layer_count` (default: the number of directions).
  """
  w = gguf.GGUFWriter(os.fspath(path), ARCH)
  w.add_string(KEY_MODEL_HINT, model_hint)
  w.add_int32(KEY_LAYER_COUNT, len(directions) if layer_count is None else int(layer_count))
  for il, v in sorted(directions.items()):
    w.add_tensor(f"direction.{il}", np.asarray(v, np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
