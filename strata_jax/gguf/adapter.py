"""LoRA adapter GGUFs (llama.cpp's format) read into one stacked `LoraSet`.

The format and every check follow llama.cpp's `llama_adapter_lora_init_impl`
(`reference/anchors-mission.md` §A1):

* metadata: `general.type == "adapter"`, `general.architecture == "qwen3next"`,
  `adapter.type == "lora"`, `adapter.lora.alpha` (f32; absent means 0);
* tensors `<base>.lora_a` (numpy [r, n_in], ggml ne {n_in, r}) and `<base>.lora_b`
  (numpy [n_out, r], ggml ne {r, n_out}); names ending `_norm.weight` are skipped silently,
  any other name without one of the two suffixes is an error;
* per tensor `scale = user_scale * alpha / rank` (rank = B's last numpy dim), or `user_scale`
  alone when alpha is 0.

strata-jax applies adapters to the mixer output projections only: `blk.{i}.ssm_out.weight` on
GDN layers and `blk.{i}.attn_output.weight` on attention layers. Adapter tensors for any other
weight of the model are checked like the rest, reported in one `AdapterWarning` per file and
left out (never silently mixed in).

Several files stack along the rank axis: file i owns rows [off_i, off_i + r_i) of the stacked
A and columns of B, where r_i is the file's largest rank over its applied tensors and off_i the
sum of the ranks before it. A tensor of smaller rank, or a layer the file lacks, leaves zeros in
its slot, so `B_stack @ A_stack == sum_i s_i B_i A_i` per layer.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import warnings
from collections.abc import Sequence

import gguf
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from strata_jax.config import ATTN, GDN, ModelConfig
from strata_jax.errors import AdapterError
from strata_jax.gguf.names import gguf_tensor_shapes
from strata_jax.params import LoraParams, LoraSet  # noqa: F401 (LoraSet re-exported)

ARCH = "qwen3next"
SUFFIX_A = ".lora_a"
SUFFIX_B = ".lora_b"
KEY_ALPHA = "adapter.lora.alpha"
KEY_ALORA_TOKENS = "adapter.alora.invocation_tokens"

_QT = gguf.GGMLQuantizationType
SUPPORTED_TYPES = (_QT.F32, _QT.F16, _QT.BF16, _QT.Q8_0)

# The base weights strata-jax applies an adapter to (LoraParams.gdn_* / attn_*).
_APPLIED = re.compile(r"^blk\.(\d+)\.(ssm_out|attn_output)\.weight$")


class AdapterWarning(UserWarning):
  """Adapter tensors that are valid for the model but that strata-jax does not apply."""


@dataclasses.dataclass(frozen=True)
class AdapterFileInfo:
  """What one adapter file contributed.

  Attributes:
    path: the file, as given.
    name: its `general.name`, or None.
    alpha: `adapter.lora.alpha` (0.0 when absent).
    user_scale: the scale the user asked for.
    rank: this file's slot width in the stacked rank axis (its largest applied rank).
    rank_offset: the first row of its slot.
    ranks: (base tensor, rank) for each applied tensor, in file order.
    scales: (base tensor, scale folded into B) for each applied tensor.
    ignored: base tensors present in the file but not applied.
  """
  path: str
  name: str | None
  alpha: float
  user_scale: float
  rank: int
  rank_offset: int
  ranks: tuple[tuple[str, int], ...]
  scales: tuple[tuple[str, float], ...]
  ignored: tuple[str, ...]

  @property
  def n_applied(self) -> int:
    return len(self.ranks)


def read_adapters(cfg: ModelConfig, paths: Sequence[str | os.PathLike],
                  scales: Sequence[float] | None = None, dtype=jnp.float32) -> LoraSet:
  """Reads llama.cpp LoRA GGUFs and stacks them for the model described by `cfg`.

  Args:
    cfg: the model the adapters must fit (layer pattern and geometry).
    paths: adapter GGUF files; may be empty (R = 0).
    scales: one user scale per file (default 1.0 each); finite, may be negative or 0.
    dtype: storage dtype of the stacked A and B (the scale is folded into B in float32 first).

  Returns:
    The `LoraSet`.

  Raises:
    AdapterError: a file is unreadable or fails one of llama.cpp's loader checks; the message
      names the file, the tensor and the shapes involved.
  """
  paths = [os.fspath(p) for p in paths]
  if scales is None:
    scales = [1.0] * len(paths)
  scales = list(scales)
  if len(scales) != len(paths):
    raise AdapterError(f"got {len(scales)} LoRA scale(s) for {len(paths)} adapter file(s) "
                       f"({', '.join(paths) or 'none'}); give one scale per file")
  user_scales = []
  for path, s in zip(paths, scales):
    try:
      s = float(s)
    except (TypeError, ValueError):
      raise AdapterError(f"adapter '{path}': LoRA scale {s!r} is not a number") from None
    if not math.isfinite(s):
      raise AdapterError(f"adapter '{path}': LoRA scale {s} is not finite")
    user_scales.append(s)

  # Every weight the model has (`output.weight` included: a tied model's head is still a
  # weight an adapter may name).
  shapes = gguf_tensor_shapes(cfg)
  loaded = []
  for path, s in zip(paths, user_scales):
    f = _read_file(path, s, shapes, mtp_block=cfg.n_layers if cfg.n_mtp else None)
    if f.ignored:
      warnings.warn(
          f"adapter '{path}': {len(f.ignored)} LoRA tensor(s) target weights strata-jax does not "
          f"adapt (only ssm_out and attn_output are applied); not applied: {', '.join(f.ignored)}",
          AdapterWarning, stacklevel=2)
    loaded.append(f)

  # Slots along R: each file gets its largest applied rank.
  offsets, total = [], 0
  for f in loaded:
    offsets.append(total)
    total += f.rank

  kind_index = {}  # layer -> (kind, index among the layers of that kind)
  counts = {GDN: 0, ATTN: 0}
  for i, kind in enumerate(cfg.layer_types):
    kind_index[i] = (kind, counts[kind])
    counts[kind] += 1
  D = cfg.d_model
  gdn_a = np.zeros((cfg.n_gdn, total, cfg.gdn_value_dim), np.float32)  # [Lg, R, Hv*Dv]
  gdn_b = np.zeros((cfg.n_gdn, D, total), np.float32)                  # [Lg, D, R]
  attn_a = np.zeros((cfg.n_attn, total, cfg.attn_out_dim), np.float32)  # [La, R, H*Hd]
  attn_b = np.zeros((cfg.n_attn, D, total), np.float32)                 # [La, D, R]

  infos, ignored = [], {}
  for f, off in zip(loaded, offsets):
    for base, (a, b, s) in f.applied.items():
      layer = int(_APPLIED.match(base).group(1))
      kind, j = kind_index[layer]
      r = a.shape[0]
      dst_a, dst_b = (gdn_a, gdn_b) if kind == GDN else (attn_a, attn_b)
      dst_a[j, off:off + r] = a
      dst_b[j, :, off:off + r] = b * np.float32(s)
    infos.append(AdapterFileInfo(
        path=f.path, name=f.name, alpha=f.alpha, user_scale=f.user_scale, rank=f.rank,
        rank_offset=off, ranks=tuple((k, v[0].shape[0]) for k, v in f.applied.items()),
        scales=tuple((k, float(v[2])) for k, v in f.applied.items()), ignored=f.ignored))
    ignored.update(dict.fromkeys(f.ignored))

  params = LoraParams(gdn_a=jnp.asarray(gdn_a, dtype), gdn_b=jnp.asarray(gdn_b, dtype),
                      attn_a=jnp.asarray(attn_a, dtype), attn_b=jnp.asarray(attn_b, dtype))
  return LoraSet(params=params, files=tuple(infos), ignored=tuple(ignored), rank_total=total)


@dataclasses.dataclass
class _Loaded:
  path: str
  name: str | None
  alpha: float
  user_scale: float
  applied: dict[str, tuple[np.ndarray, np.ndarray, np.float32]]  # base -> (A, B, scale), f32
  ignored: tuple[str, ...]

  @property
  def rank(self) -> int:
    return max((a.shape[0] for a, _, _ in self.applied.values()), default=0)


def _fmt(shape) -> str:
  return "[" + ", ".join(str(int(n)) for n in shape) + "]"


def _np_shape(t) -> tuple[int, ...]:
  """A reader tensor's shape in numpy order (the reader reports ggml `ne`, reversed)."""
  return tuple(int(n) for n in reversed(list(t.shape)))


def _field(reader, key):
  f = reader.get_field(key)
  return None if f is None else f.contents()


def _scale(user_scale: float, alpha: float, rank: int) -> np.float32:
  """llama.cpp's `get_scale`, in float32 as there."""
  if alpha == 0.0:
    return np.float32(user_scale)
  return np.float32(user_scale) * np.float32(alpha) / np.float32(rank)


def _read_file(path: str, user_scale: float, shapes: dict[str, tuple[int, ...]],
               mtp_block: int | None = None) -> _Loaded:
  where = f"adapter '{path}'"
  if not os.path.isfile(path):
    raise AdapterError(f"{where}: no such file")
  try:
    reader = gguf.GGUFReader(path)
  except Exception as e:  # the reader raises ValueError, KeyError, struct errors, OSError...
    raise AdapterError(f"{where}: not a readable GGUF file ({type(e).__name__}: {e})") from None

  # Metadata, in llama.cpp's order.
  gtype = _field(reader, "general.type")
  if gtype != "adapter":
    raise AdapterError(f"{where}: expect general.type to be 'adapter', but got {gtype!r} "
                       "(is this a model file rather than a LoRA adapter?)")
  arch = _field(reader, "general.architecture")
  if arch != ARCH:
    raise AdapterError(f"{where}: model arch and LoRA arch mismatch: general.architecture is "
                       f"{arch!r}, the model is {ARCH!r}")
  atype = _field(reader, "adapter.type")
  if atype != "lora":
    raise AdapterError(f"{where}: expect adapter.type to be 'lora', but got {atype!r}")
  if reader.get_field(KEY_ALORA_TOKENS) is not None:
    # llama.cpp applies an activated LoRA only after its invocation tokens; applying it
    # everywhere would silently change its meaning.
    raise AdapterError(f"{where}: activated LoRA ({KEY_ALORA_TOKENS}) is not supported")
  alpha = _field(reader, KEY_ALPHA)
  try:
    alpha = 0.0 if alpha is None else float(alpha)
  except (TypeError, ValueError):
    raise AdapterError(f"{where}: {KEY_ALPHA} = {alpha!r} is not a number") from None
  if not math.isfinite(alpha):
    raise AdapterError(f"{where}: {KEY_ALPHA} = {alpha} is not finite")
  name = _field(reader, "general.name")

  # Pair tensors by suffix.
  pairs: dict[str, dict[str, object]] = {}
  for t in reader.tensors:
    if t.name.endswith(SUFFIX_A):
      pairs.setdefault(t.name[:-len(SUFFIX_A)], {})["a"] = t
    elif t.name.endswith(SUFFIX_B):
      pairs.setdefault(t.name[:-len(SUFFIX_B)], {})["b"] = t
    elif t.name.endswith("_norm.weight"):
      continue  # llama.cpp skips norm vectors (mergekit-extract-lora writes them)
    else:
      raise AdapterError(f"{where}: LoRA tensor '{t.name}' (shape {_fmt(_np_shape(t))}) has "
                         f"unexpected suffix; expected '{SUFFIX_A}' or '{SUFFIX_B}'")

  applied, ignored = {}, []
  for base, ab in pairs.items():
    if "a" not in ab or "b" not in ab:
      have, miss = ("lora_a", "lora_b") if "a" in ab else ("lora_b", "lora_a")
      t = ab["a"] if "a" in ab else ab["b"]
      raise AdapterError(f"{where}: LoRA tensor '{base}' is missing one component: has "
                         f"{have} {_fmt(_np_shape(t))}, no {miss}")
    ta, tb = ab["a"], ab["b"]
    if base not in shapes:
      raise AdapterError(f"{where}: LoRA tensor '{base}' (lora_a {_fmt(_np_shape(ta))}, lora_b "
                         f"{_fmt(_np_shape(tb))}) does not exist in base model "
                         "(hint: maybe wrong base model?)")
    for which, t in (("lora_a", ta), ("lora_b", tb)):
      if t.tensor_type not in SUPPORTED_TYPES:
        raise AdapterError(f"{where}: LoRA tensor '{base}.{which}' {_fmt(_np_shape(t))} has "
                           f"unsupported type {_type_name(t.tensor_type)}; supported: "
                           f"{', '.join(q.name for q in SUPPORTED_TYPES)}")
    _check_shapes(where, base, shapes[base], _np_shape(ta), _np_shape(tb))
    hit = _APPLIED.match(base)
    # the MTP block (block n_layers) is never adapted: reported as not applied
    if not hit or (mtp_block is not None and int(hit.group(1)) == mtp_block):
      ignored.append(base)
      continue
    a, b = _to_f32(ta), _to_f32(tb)
    applied[base] = (a, b, _scale(user_scale, alpha, b.shape[1]))

  return _Loaded(path=path, name=name, alpha=alpha, user_scale=user_scale, applied=applied,
                 ignored=tuple(ignored))


def _type_name(qtype) -> str:
  try:
    return _QT(int(qtype)).name
  except ValueError:
    return f"#{int(qtype)}"


def _check_shapes(where: str, base: str, w_shape, a_shape, b_shape) -> None:
  """llama.cpp's shape checks, written in numpy order.

  W is numpy [..., n_out, n_in] (ggml ne {n_in, n_out, ...}); A must be [r, n_in], B [n_out, r].
  `token_embd` is the exception: A and B are flipped there (the converter transposes lora_a).
  """
  ne = list(reversed(w_shape)) + [1]
  n_in, n_out = ne[0], ne[1]
  expect = f"base tensor '{base}' is {_fmt(w_shape)}"
  got = f"lora_a {_fmt(a_shape)}, lora_b {_fmt(b_shape)}"
  if len(a_shape) != 2 or len(b_shape) != 2 or 0 in a_shape or 0 in b_shape:
    raise AdapterError(f"{where}: LoRA tensor '{base}' has incorrect shape: {got}; both must be "
                       f"2-D and non-empty ({expect})")
  if base == "token_embd.weight":
    if b_shape[0] != n_in or a_shape[0] != n_out or a_shape[1] != b_shape[1]:
      raise AdapterError(f"{where}: LoRA tensor '{base}' has incorrect shape: {got}; {expect}, so "
                         f"expected lora_a [{n_out}, r] and lora_b [{n_in}, r] "
                         "(hint: maybe wrong base model?)")
    return
  if a_shape[1] != n_in or b_shape[0] != n_out:
    if a_shape[0] == n_in and b_shape[0] == n_out and a_shape[1] == b_shape[1]:
      raise AdapterError(f"{where}: lora_a tensor is not transposed: LoRA tensor '{base}' has "
                         f"{got}; {expect}, so expected lora_a [{b_shape[1]}, {n_in}]")
    raise AdapterError(f"{where}: LoRA tensor '{base}' has incorrect shape: {got}; {expect}, so "
                       f"expected lora_a [r, {n_in}] and lora_b [{n_out}, r] "
                       "(hint: maybe wrong base model?)")
  if a_shape[0] != b_shape[1]:
    raise AdapterError(f"{where}: LoRA tensor '{base}' has a rank mismatch: lora_a {_fmt(a_shape)} "
                       f"has rank {a_shape[0]}, lora_b {_fmt(b_shape)} has rank {b_shape[1]} "
                       "(lora_a tensor is not transposed?)")


def _to_f32(t) -> np.ndarray:
  """A reader tensor as a float32 numpy array in numpy order (a copy, off the memmap)."""
  shape = _np_shape(t)
  if t.tensor_type == _QT.F32:
    x = np.array(t.data, np.float32)
  elif t.tensor_type == _QT.F16:
    x = t.data.astype(np.float32)
  elif t.tensor_type == _QT.BF16:
    # The reader hands BF16 back as raw bytes.
    x = np.ascontiguousarray(t.data).view(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
  else:
    x = gguf.quants.dequantize(np.ascontiguousarray(t.data), t.tensor_type).astype(np.float32)
  return x.reshape(shape)
