"""Read a qwen3next model GGUF into (ModelConfig, Params per stage, Tokenizer), checking
everything first.

Loading streams: each tensor goes from the memory map through host memory (decoded, or
repacked when it stays quantised) straight onto the device of the stage that owns its layer.
Every problem with the file surfaces as one `GGUFError` whose message starts with the path,
raised before any device memory is touched; no numpy/jax traceback escapes for a bad file.
"""
from __future__ import annotations

import dataclasses
import logging
import mmap
import os
import sys
import warnings
from typing import Any

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import xxhash
from tqdm import tqdm

from strata_jax import config as config_lib
from strata_jax.config import ModelConfig
from strata_jax.errors import DeviceMemoryError, GGUFError
from strata_jax.gguf import names
from strata_jax.gguf.tokenizer import Tokenizer, UnsupportedTokenizer
from strata_jax.parallel import plan as plan_lib
from strata_jax.params import Params, QGroups, leaf_dtype, param_shapes, params_from_flat

log = logging.getLogger("strata_jax")

ARCH = "qwen3next"
GGUF_MAGIC = b"GGUF"
T = gguf.GGMLQuantizationType
FLOAT_TYPES = frozenset({T.F32, T.F16, T.BF16})
# GGUF types that stay in their (repacked) blocks on the device under weights="keep": the
# types of llama.cpp's Q4_K_M / Q5_K_M / Q6_K / Q8_0 mixes. Names as `pallas_kernels.quant`.
KEEP_TYPES = {T.Q8_0: "q8_0", T.Q4_K: "q4_k", T.Q5_K: "q5_k", T.Q6_K: "q6_k"}
WEIGHTS_MODES = ("keep", "dequantize")
# Leaves that may stay quantised: the big projections (read by the quantised matmuls) and the
# embedding (its rows are gathered, then dequantised). Norms, conv taps, decay rates and the
# routers are small and precision-critical: always dequantised.
QUANT_LEAVES = frozenset({
    "embed", "lm_head", "layers.gdn.qkv", "layers.gdn.gate", "layers.gdn.ba", "layers.gdn.out",
    "layers.attn.q", "layers.attn.k", "layers.attn.v", "layers.attn.out",
    "layers.moe.gate_exps", "layers.moe.up_exps", "layers.moe.down_exps",
    "layers.moe.shared_gate", "layers.moe.shared_up", "layers.moe.shared_down"})
# Tokenizer arrays kept out of `ModelFile.metadata` (huge; the Tokenizer holds them).
TOKENIZER_ARRAYS = frozenset(f"tokenizer.ggml.{k}" for k in (
    "tokens", "token_type", "merges", "scores", "precompiled_charsmap"))

_FULL_HASH_BYTES = 256 << 20
_SAMPLES, _SAMPLE_BYTES = 64, 1 << 20


@dataclasses.dataclass(frozen=True, eq=False)
class ModelFile:
  """A loaded model GGUF.

  Attributes:
    cfg: the geometry, from `qwen3next.*` metadata.
    stages: the weights, one Params per stage, each on its stage's device: layers [lo, hi) of
      `ranges`, the embedding on the first stage, the final norm and head on the last (None
      elsewhere). Leaves are in the compute dtype (FP32_LEAVES stay fp32), or `QTensor`s where
      a quantised tensor stays quantised (`weights="keep"`).
    ranges: each stage's layer range [lo, hi).
    devices: each stage's device, or None (one stage on the default device).
    tokenizer: from `tokenizer.ggml.*`, or None when the file has none (or an unsupported one).
    metadata: every KV field as plain python values, except the big tokenizer arrays.
    fingerprint: xxh3-128 hex digest identifying the file's contents.
    path: the file path.
    add_bos: `tokenizer.ggml.add_bos_token` (False when absent).
    bos_id: `tokenizer.ggml.bos_token_id` or None.
    eos_id: `tokenizer.ggml.eos_token_id` or None.
    file_bytes: bytes of the tensors the model reads, as stored in the file.
  """
  cfg: ModelConfig
  stages: list
  ranges: list
  devices: list | None
  tokenizer: Tokenizer | None
  metadata: dict[str, Any]
  fingerprint: str
  path: str
  add_bos: bool
  bos_id: int | None
  eos_id: int | None
  file_bytes: int = 0

  @property
  def params(self) -> Params:
    """The whole model's Params (one stage only: a split has no whole copy anywhere)."""
    if len(self.stages) != 1:
      raise AttributeError(f"{self.path}: loaded as {len(self.stages)} stages; no whole-model "
                           "params exist (use .stages)")
    return self.stages[0]


class _Reader(gguf.GGUFReader):
  """GGUFReader that checks each tensor's type, row length and data extent first, so a bad
  tensor is named instead of surfacing as a reshape error inside the reader."""

  def _build_tensors(self, start_offs, fields):
    size = int(self.data.shape[0])
    for field in fields:
      try:
        _, name_data, _, dims, raw_dtype, offset = field.parts
        name = bytes(name_data).decode("utf-8", "replace")
        raw, dims, offset = int(raw_dtype[0]), [int(d) for d in dims], int(offset[0])
      except Exception:  # noqa: BLE001 (another gguf version's layout: leave it to the reader)
        break
      try:
        qt = T(raw)
        block, type_size = gguf.GGML_QUANT_SIZES[qt]
      except (ValueError, KeyError):
        raise _TensorProblem(name, f"has unsupported type id {raw}: no decoder for it") from None
      if not decodable(qt):
        raise _TensorProblem(name, f"has unsupported type {qt.name}: no decoder for it "
                             "(neither strata_jax nor the gguf package)")
      row = dims[0] if dims else 1
      if row % block:
        raise _TensorProblem(name, f"({qt.name}) has rows of {row} values, not a multiple of "
                             f"the {qt.name} block of {block}")
      n_bytes = int(np.prod(dims)) // block * type_size
      end = int(start_offs) + offset + n_bytes
      if end > size:
        raise _TensorProblem(name, f"({qt.name}) data is shorter than its blocks need "
                             f"(truncated file): {n_bytes} bytes from byte "
                             f"{end - n_bytes}, file has {size}")
    super()._build_tensors(start_offs, fields)


class _TensorProblem(Exception):
  def __init__(self, name, what):
    super().__init__(f"tensor {name!r} {what}")


def open_gguf(path: str) -> gguf.GGUFReader:
  """Open (memory-map) a GGUF, turning format errors into `GGUFError`."""
  path = os.fspath(path)
  try:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      magic = f.read(4)
  except OSError as e:
    raise GGUFError(f"{path}: cannot open: {e.strerror or e}") from e
  if magic != GGUF_MAGIC:
    raise GGUFError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
  try:
    reader = _Reader(path)
  except _TensorProblem as e:
    raise GGUFError(f"{path}: {e}") from None
  except Exception as e:  # the reader fails in many ways on a short or damaged file
    raise GGUFError(f"{path}: truncated or corrupt GGUF file ({size} bytes): "
                    f"{type(e).__name__}: {e}") from e
  for t in reader.tensors:
    end = int(t.data_offset) + int(t.n_bytes)
    if end > size or t.data.nbytes != t.n_bytes:
      raise GGUFError(f"{path}: truncated GGUF file: tensor {t.name!r} data ends at byte {end}, "
                      f"file has {size} bytes")
  return reader


def read_kv(reader: gguf.GGUFReader, path: str) -> dict[str, Any]:
  """All KV fields as plain python values (tokenizer arrays included)."""
  kv = {}
  for key, field in reader.fields.items():
    if key.startswith("GGUF."):  # the reader's pseudo-fields (version, counts)
      continue
    try:
      kv[key] = field.contents()
    except Exception as e:
      raise GGUFError(f"{path}: metadata key {key!r} is corrupt: {e}") from e
  return kv


class _Meta:
  """Typed access to `qwen3next.*` keys with path-prefixed errors."""

  def __init__(self, kv: dict[str, Any], path: str):
    self.kv, self.path = kv, path

  def get(self, key: str, kind=int, default=None):
    """The value of `qwen3next.<key>`; a key without a default is required."""
    full = f"{ARCH}.{key}"
    if full not in self.kv:
      if default is None:
        raise GGUFError(f"{self.path}: missing metadata key {full!r}")
      return default
    v = self.kv[full]
    try:
      if isinstance(v, list):
        raise TypeError("an array")
      return kind(v)
    except (TypeError, ValueError) as e:
      raise GGUFError(f"{self.path}: metadata key {full!r} = {v!r} is not "
                      f"{kind.__name__}-valued ({e})") from e


def config_from_kv(kv: dict[str, Any], path: str, vocab_size: int) -> ModelConfig:
  """ModelConfig from GGUF metadata; raises GGUFError on missing or inconsistent keys."""
  arch = kv.get("general.architecture")
  if arch is None:
    raise GGUFError(f"{path}: missing metadata key 'general.architecture'")
  if arch != ARCH:
    raise GGUFError(f"{path}: architecture is {arch!r}, expected {ARCH!r}")
  if kv.get("general.type", "model") != "model":
    raise GGUFError(f"{path}: general.type is {kv['general.type']!r}, expected 'model' "
                    "(a LoRA adapter is loaded with load_lora)")
  m = _Meta(kv, path)
  n_blocks = m.get("block_count")
  # llama.cpp counts the MTP block(s) in block_count: the trunk is the first n_layers blocks.
  n_mtp = m.get("nextn_predict_layers", default=0)
  if not 0 <= n_mtp < n_blocks:
    raise GGUFError(f"{path}: inconsistent metadata: {ARCH}.nextn_predict_layers is {n_mtp}, "
                    f"block_count is {n_blocks}")
  n_layers = n_blocks - n_mtp
  rec = kv.get(f"{ARCH}.attention.recurrent_layers")
  if rec is not None:
    if not isinstance(rec, list) or len(rec) not in (n_blocks, n_layers):
      n = len(rec) if isinstance(rec, list) else "a scalar"
      raise GGUFError(f"{path}: inconsistent metadata: {ARCH}.attention.recurrent_layers has "
                      f"{n} entries, block_count is {n_blocks}")
    layer_types = "".join(config_lib.GDN if r else config_lib.ATTN for r in rec[:n_layers])
  else:
    interval = m.get("full_attention_interval", default=4)
    if interval < 1:
      raise GGUFError(f"{path}: inconsistent metadata: {ARCH}.full_attention_interval is "
                      f"{interval}")
    layer_types = config_lib.layer_pattern_from_interval(n_layers, interval)

  d_model = m.get("embedding_length")
  n_head = m.get("attention.head_count")
  head_dim = m.get("attention.key_length", default=d_model // max(n_head, 1))
  v_len = m.get("attention.value_length", default=head_dim)
  inner, rank = m.get("ssm.inner_size"), m.get("ssm.time_step_rank")
  bad = []
  if v_len != head_dim:
    bad.append(f"attention.value_length {v_len} != attention.key_length {head_dim}")
  if rank <= 0 or inner % rank:
    bad.append(f"ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {rank}")
  if bad:
    raise GGUFError(f"{path}: inconsistent metadata: " + "; ".join(bad))

  cfg = ModelConfig(
      vocab_size=vocab_size, d_model=d_model, layer_types=layer_types,
      n_head=n_head, n_kv_head=m.get("attention.head_count_kv", default=n_head),
      head_dim=head_dim, n_rot=m.get("rope.dimension_count", default=head_dim),
      rope_base=m.get("rope.freq_base", float, default=10000.0),
      gdn_n_k_heads=m.get("ssm.group_count"), gdn_n_v_heads=rank,
      gdn_d_k=m.get("ssm.state_size"), gdn_d_v=inner // rank,
      conv_kernel=m.get("ssm.conv_kernel"),
      n_experts=m.get("expert_count"), n_experts_used=m.get("expert_used_count"),
      d_ff_expert=m.get("expert_feed_forward_length"),
      d_ff_shared=m.get("expert_shared_feed_forward_length"),
      rms_eps=m.get("attention.layer_norm_rms_epsilon", float),
      context_length=m.get("context_length"), n_mtp=n_mtp)
  bad = cfg.validate()
  if bad:
    raise GGUFError(f"{path}: inconsistent metadata: " + "; ".join(bad))
  return cfg


def _numpy_shape(t) -> tuple[int, ...]:
  return tuple(int(x) for x in reversed(t.shape))


def _strip_ones(shape: tuple[int, ...]) -> tuple[int, ...]:
  # ggml pads ne with trailing 1s (leading in numpy order): {D} and {D, 1} are the same tensor.
  i = 0
  while i < len(shape) - 1 and shape[i] == 1:
    i += 1
  return shape[i:]


def decodable(qtype) -> bool:
  """Whether some decoder here (ours or the `gguf` package's) turns this type into floats."""
  return qtype in FLOAT_TYPES or qtype in KEEP_TYPES or qtype in gguf.quants._type_traits


def _check_type(t, path: str) -> None:
  if not decodable(t.tensor_type):
    raise GGUFError(f"{path}: tensor {t.name!r} has unsupported type {t.tensor_type.name}: "
                    "no decoder for it (neither strata_jax nor the gguf package)")


def dequantize(t, path: str) -> np.ndarray:
  """A reader tensor as a float32 numpy array in numpy order."""
  _check_type(t, path)
  if t.tensor_type == T.F32:
    return t.data
  if t.tensor_type == T.F16:
    return t.data.astype(np.float32)
  if t.tensor_type == T.BF16:
    bits = np.ascontiguousarray(t.data).view(np.uint16).astype(np.uint32) << 16
    return bits.view(np.float32)
  return gguf.quants.dequantize(t.data, t.tensor_type)


def _check_shape(t, want: tuple[int, ...], path: str) -> None:
  got = _numpy_shape(t)
  if _strip_ones(got) != _strip_ones(tuple(want)):
    raise GGUFError(f"{path}: tensor {t.name!r} has shape {got}, expected {tuple(want)} "
                    "(numpy order, from the metadata)")


# ----- the load plan: what goes where, in which form, checked before any device allocation ---

@dataclasses.dataclass
class LeafPlan:
  """One Params leaf: its GGUF tensors and the form it takes on the device.

  Attributes:
    path: dotted leaf path ("layers.moe.gate_exps").
    layers: absolute layer index of each entry (None for a top-level leaf).
    tensors: the reader tensors, one per entry.
    qtypes: per entry, the `pallas_kernels.quant` type name when the leaf stays quantised,
      else None. Entries of several types (llama.cpp's mixes give some layers' attn_v /
      ffn_down more bits) become a `QGroups` of one stack per type.
    keys: per entry, the group it is stacked in (its type; for the three expert stacks the
      triple of the layer's types, so the three share one grouping).
    dtype: the float dtype of a dequantised leaf.
    entry_bytes: device bytes of each entry.
    shape: the numpy shape of one entry (one layer's tensor).
  """
  path: str
  shape: tuple
  layers: list
  tensors: list
  qtypes: list | None
  dtype: object
  entry_bytes: list[int]
  keys: list | None = None

  @property
  def stacked(self) -> bool:
    return self.layers != [None]


def _quant_entry_bytes(qtype: str, shape: tuple[int, ...]) -> int:
  """Device bytes of one tensor in the repacked layout (packing one zero row, exact per row)."""
  from pallas_kernels.quant import layout as qlayout  # noqa: PLC0415 (kernel package is lazy)
  rows = int(np.prod(shape[:-1]))
  row_bytes = qlayout.file_nbytes(qtype, (1, shape[-1]))
  one = qlayout.pack(np.zeros((1, row_bytes), np.uint8), qtype, (1, shape[-1]))
  return rows * sum(int(a.nbytes) for a in jax.tree.leaves(one))


def _group_experts(plans) -> None:
  """The routed experts run as one kernel over the three stacks: all quantised, or none; the
  three are grouped alike, by the triple of each layer's types."""
  exps = [lp for lp in plans if lp.path.endswith("_exps")]
  if any(lp.qtypes is None for lp in exps):
    for lp in exps:
      lp.qtypes = lp.keys = None
  else:
    trio = list(zip(*(lp.qtypes for lp in exps)))
    for lp in exps:
      lp.keys = trio


def plan_leaves(reader: gguf.GGUFReader, cfg: ModelConfig, path: str, dtype=jnp.float32,
                weights: str = "keep") -> list[LeafPlan]:
  """Match every leaf to its tensors and choose its device form; shapes and types are checked
  here, before any data is read or any device memory is touched."""
  if weights not in WEIGHTS_MODES:
    raise GGUFError(f"{path}: weights={weights!r}: expected one of {', '.join(WEIGHTS_MODES)}")
  tensors = {t.name: t for t in reader.tensors}
  shapes = param_shapes(cfg)
  plans = []
  for spec in names.MODEL_TENSORS:
    idx = names.layer_indices(cfg, spec.over)
    want = shapes[spec.path] if idx is None else shapes[spec.path][1:]
    todo = []
    for i in [None] if idx is None else idx:
      name = spec.gguf if i is None else spec.gguf.format(i=i)
      if name not in tensors and spec.fallback in tensors:
        name = spec.fallback
      if name not in tensors:
        raise GGUFError(f"{path}: missing tensor {name!r}")
      _check_shape(tensors[name], want, path)
      _check_type(tensors[name], path)
      todo.append(tensors[name])
    qtypes = None
    if (weights == "keep" and spec.path in QUANT_LEAVES
        and all(t.tensor_type in KEEP_TYPES for t in todo)):
      qtypes = [KEEP_TYPES[t.tensor_type] for t in todo]
    ldt = jnp.dtype(leaf_dtype(spec.path, dtype))
    plans.append(LeafPlan(path=spec.path, shape=tuple(want),
                          layers=[None] if idx is None else list(idx), tensors=todo,
                          qtypes=qtypes, dtype=ldt, entry_bytes=[], keys=qtypes))
  _group_experts(plans)
  for lp in plans:
    if lp.qtypes is None:
      lp.entry_bytes = [int(np.prod(lp.shape)) * lp.dtype.itemsize] * len(lp.tensors)
    else:
      lp.entry_bytes = [_quant_entry_bytes(q, lp.shape) for q in lp.qtypes]
  plans += _plan_mtp(tensors, cfg, path, dtype, weights)
  if weights == "keep":
    dq = [t.name for lp in plans if lp.qtypes is None for t in lp.tensors
          if t.tensor_type not in FLOAT_TYPES]
    if dq:
      log.info("%s: %d tensors dequantised at load to %s (a type not kept on the device, a "
               "stack with such a tensor, or a small leaf): %s", path, len(dq),
               jnp.dtype(dtype).name, ", ".join(dict.fromkeys(dq)))
  return plans


def _plan_mtp(tensors: dict, cfg: ModelConfig, path: str, dtype, weights: str
              ) -> list[LeafPlan]:
  """The MTP head's leaves (block `cfg.n_layers`), or none. `nextn_predict_layers` and the
  tensors present must agree: a head declared but missing, or present but undeclared, is an
  error naming the file."""
  stray = sorted(n for n in tensors if ".nextn." in n)
  if not cfg.n_mtp:
    if stray:
      raise GGUFError(f"{path}: inconsistent metadata: {ARCH}.nextn_predict_layers is 0 (or "
                      f"absent) but the file has MTP tensors ({stray[0]!r}, ...)")
    return []
  N = cfg.n_layers
  want_names = names.mtp_tensor_shapes(cfg)
  outside = [n for n in stray if not n.startswith(f"blk.{N}.")]
  if outside:
    raise GGUFError(f"{path}: inconsistent metadata: MTP tensor {outside[0]!r} is not in block "
                    f"{N} (block_count - nextn_predict_layers)")
  plans = []
  for spec in names.MTP_TENSORS:
    name = spec.gguf.format(i=N)
    if name not in tensors:
      raise GGUFError(f"{path}: inconsistent metadata: {ARCH}.nextn_predict_layers is "
                      f"{cfg.n_mtp} but tensor {name!r} of the MTP block is missing")
    t = tensors[name]
    _check_shape(t, want_names[name], path)
    _check_type(t, path)
    trunk_leaf = "layers." + spec.path.removeprefix("mtp.")
    qtypes = None
    if (weights == "keep" and trunk_leaf in QUANT_LEAVES and t.tensor_type in KEEP_TYPES):
      qtypes = [KEEP_TYPES[t.tensor_type]]
    head = spec.path in names.MTP_HEAD_LEAVES
    plans.append(LeafPlan(path=spec.path, shape=tuple(want_names[name]),
                          layers=[None] if head else [N], tensors=[t], qtypes=qtypes,
                          dtype=jnp.dtype(leaf_dtype(spec.path, dtype)), entry_bytes=[],
                          keys=qtypes))
  _group_experts(plans)
  return plans


def plan_bytes(cfg: ModelConfig, plans: list[LeafPlan]) -> tuple[np.ndarray, int, int]:
  """(device bytes of each layer's weights [L], of the embedding, of the final norm + head
  (+ the MTP head, which lives with them on the last stage))."""
  per_layer = np.zeros(cfg.n_layers, np.float64)
  top = {}
  mtp = 0
  for lp in plans:
    if lp.path.startswith("mtp."):
      mtp += sum(lp.entry_bytes)
      continue
    for layer, nb in zip(lp.layers, lp.entry_bytes):
      if layer is None:
        top[lp.path] = nb
      else:
        per_layer[layer] += nb
  return per_layer, top["embed"], top["final_norm"] + top["lm_head"] + mtp


def _gib(n: float) -> str:
  return f"{n / 2**30:.2f}"


def _is_oom(e: Exception) -> bool:
  msg = str(e)
  return "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower()


def _entry(lp: LeafPlan, k: int, path: str, put):
  """Entry k on its device: decoded on the host to the leaf's dtype, or (kept quantised) its
  raw block bytes sent as they are and repacked on the device (`device_pack`)."""
  t = lp.tensors[k]
  if lp.qtypes is not None:
    from strata_jax.gguf import device_pack  # noqa: PLC0415 (imports the kernel layout)
    raw = put(np.asarray(t.data).reshape(-1))
    return device_pack.pack(raw, lp.qtypes[k], tuple(lp.shape))
  return put(_host_entry(lp, t, path))


def _host_entry(lp: LeafPlan, t, path: str):
  """One tensor decoded on the host: a numpy array of the leaf's dtype."""
  try:
    x = np.reshape(dequantize(t, path), lp.shape)  # reshape drops ggml's 1-dims
    return x.astype(lp.dtype, copy=False) if x.dtype != lp.dtype else x
  except GGUFError:
    raise
  except Exception as e:
    raise GGUFError(f"{path}: tensor {t.name!r} ({t.tensor_type.name}) cannot be "
                    f"decoded: {type(e).__name__}: {e}") from e


def _release(reader: gguf.GGUFReader, t) -> None:
  """Drop a tensor's pages from this process's mapping once read (the page cache keeps them):
  the resident set then holds one tensor of the file at a time, not all it has read."""
  mm = getattr(reader.data, "_mmap", None)
  if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
    return
  page = mmap.PAGESIZE
  lo = int(t.data_offset) // page * page
  hi = int(t.data_offset) + int(t.n_bytes)
  try:
    mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
  except (OSError, ValueError):
    pass


# A leaf's [n, ...] buffer and one part written into it at an index, in place (donated):
# one compile per part shape and dtype.
_zeros_stack = jax.jit(lambda x, n: jnp.zeros((n, *x.shape), x.dtype), static_argnums=1)
_put_at = jax.jit(lambda buf, x, j: jax.lax.dynamic_update_index_in_dim(buf, x, j, 0),
                  donate_argnums=0)


class StackInPlace:
  """One stacked leaf built on its device as its parts arrive, in layer order.

  The first part of each type allocates that type's [n, ...] arrays, and every part is written
  at its index and then dropped. So a device holds its stage plus one tensor while loading, not
  its stage plus a whole leaf: the 80B's largest leaf is 6 GiB, and stacking it from its parts
  (`jnp.stack`) ran an 80 GB H100 out of memory (run 85). The result is `jnp.stack`'s (or
  `qlayout.stack`'s) bit for bit. Quantised parts of several types (keys) make a QGroups of one
  stack per type, in order of first appearance.
  """

  def __init__(self, n: int, keys=None):
    order = [None] if keys is None else list(dict.fromkeys(keys))
    self.group = [0] * n if keys is None else [order.index(k) for k in keys]
    self.pos = [self.group[:j].count(self.group[j]) for j in range(n)]
    self.count = [self.group.count(g) for g in range(len(order))]
    self.bufs: list = [None] * len(order)
    self.structs: list = [None] * len(order)
    self.added = 0

  def add(self, part) -> None:
    g, j = self.group[self.added], self.pos[self.added]
    if not all(x.is_fully_addressable for x in jax.tree.leaves(part)):
      # another process's device (a stage per process): this process holds no data there,
      # only the stack's handle, as `distributed.call_on_stage` makes them (a jitted write
      # into another process's buffer crashes JAX 0.10 on CPU)
      if self.bufs[g] is None:
        self.bufs[g] = jax.tree.map(lambda x: jax.make_array_from_single_device_arrays(
            (self.count[g], *x.shape), x.sharding, [], dtype=x.dtype), part)
      self.added += 1
      return
    if self.bufs[g] is None:
      self.structs[g] = jax.tree.structure(part)
      self.bufs[g] = jax.tree.map(lambda x: _zeros_stack(x, self.count[g]), part)
    elif jax.tree.structure(part) != self.structs[g]:
      from pallas_kernels.quant.layout import QuantLayoutError  # noqa: PLC0415
      raise QuantLayoutError(f"stack: parts differ: {jax.tree.structure(part)} vs "
                             f"{self.structs[g]}")
    self.bufs[g] = jax.tree.map(lambda b, x: _put_at(b, x, j), self.bufs[g], part)
    self.added += 1

  def result(self):
    if self.added != len(self.group):
      raise ValueError(f"stack: {self.added} of {len(self.group)} parts added")
    from pallas_kernels.quant.layout import QTensor  # noqa: PLC0415
    stacks = [b.replace(shape=(n, *b.shape)) if isinstance(b, QTensor) else b
              for b, n in zip(self.bufs, self.count)]
    if len(stacks) == 1:
      return stacks[0]
    return QGroups(parts=tuple(stacks), group=tuple(self.group), pos=tuple(self.pos))


def _empty_leaf(lp: LeafPlan, device):
  """A stacked leaf with no layer on this stage (e.g. no attention layer in its range)."""
  x = jnp.zeros((0, *lp.shape), lp.dtype)
  return jax.device_put(x, device) if device is not None else x


def place_stages(reader: gguf.GGUFReader, cfg: ModelConfig, plans: list[LeafPlan], path: str,
                 ranges: list[tuple[int, int]], devices: list | None,
                 progress: bool | None = None) -> list[Params]:
  """Stream every tensor from the memory map onto the device of the stage that owns it.

  One tensor at a time goes through host memory (decoded there, or its raw blocks sent as they
  are and repacked on the device); a stacked leaf is written on its device one layer at a time
  (`StackInPlace`), so a device peaks at its stage plus one tensor and no buffer anywhere
  holds the whole model. Stage 0 gets the embedding, the last stage
  the final norm and the head.
  """
  per_layer, embed_b, head_b = plan_bytes(cfg, plans)
  last = len(ranges) - 1
  need = [per_layer[lo:hi].sum() + (embed_b if i == 0 else 0) + (head_b if i == last else 0)
          for i, (lo, hi) in enumerate(ranges)]
  devs = list(devices) if devices else [None] * len(ranges)
  for i, dev in enumerate(devs):  # refuse before placing anything
    free = plan_lib.free_bytes(_device(dev))
    if free is not None and need[i] > free:
      raise DeviceMemoryError(f"{path} needs {_gib(need[i])} GiB on {_dev_name(dev)}, "
                              f"{_gib(free)} GiB free{plan_lib.allocator_hint(_device(dev))}")
  read_total = sum(int(t.n_bytes) for lp in plans for t, layer in zip(lp.tensors, lp.layers)
                   if _owner(layer, lp.path, ranges) is not None)
  disable = not sys.stderr.isatty() if progress is None else not progress
  stages = []
  with tqdm(total=read_total, desc="loading", unit="B", unit_scale=True, unit_divisor=1024,
            disable=disable, leave=False) as bar:
    for i, ((lo, hi), dev) in enumerate(zip(ranges, devs)):
      put = (lambda x: jax.device_put(x, dev)) if dev is not None else jax.device_put
      flat = {}
      try:
        for lp in plans:
          if lp.path.startswith("mtp."):   # the MTP head: on the last stage, beside the LM head
            if i == last:
              x = _entry(lp, 0, path, put)
              if lp.stacked:
                stack = StackInPlace(1, lp.keys)
                stack.add(x)
                x = stack.result()
              flat[lp.path] = x
              _release(reader, lp.tensors[0])
              bar.update(int(lp.tensors[0].n_bytes))
            continue
          if not lp.stacked:
            own = ((lp.path == "embed" and i == 0)
                   or (lp.path in ("final_norm", "lm_head") and i == last))
            if not own:
              flat[lp.path] = None
              continue
            t = lp.tensors[0]
            flat[lp.path] = _entry(lp, 0, path, put)
            _release(reader, t)
            bar.update(int(t.n_bytes))
            continue
          idx = [k for k, layer in enumerate(lp.layers) if lo <= layer < hi]
          if not idx:
            flat[lp.path] = _empty_leaf(lp, dev)
            continue
          stack = StackInPlace(len(idx), None if lp.keys is None else [lp.keys[k] for k in idx])
          for k in idx:
            stack.add(_entry(lp, k, path, put))
            _release(reader, lp.tensors[k])
            bar.update(int(lp.tensors[k].n_bytes))
          flat[lp.path] = stack.result()
      except Exception as e:
        if not _is_oom(e):
          raise
        d = _device(dev)
        free = plan_lib.free_bytes(d)
        have = f"{_gib(free)} GiB free" if free is not None else "free memory unknown"
        raise DeviceMemoryError(f"{path} needs {_gib(need[i])} GiB on {_dev_name(dev)}, {have} "
                                f"(out of device memory while loading)"
                                f"{plan_lib.allocator_hint(d)}") from None
      stages.append(params_from_flat(flat))
  return stages


def _owner(layer, leaf: str, ranges) -> int | None:
  if layer is None or leaf.startswith("mtp."):
    return 0
  for i, (lo, hi) in enumerate(ranges):
    if lo <= layer < hi:
      return i
  return None


def _device(dev):
  return dev if dev is not None else jax.devices()[0]


def _dev_name(dev) -> str:
  d = _device(dev)
  return f"{d.platform}:{d.id}"


def load_params(reader: gguf.GGUFReader, cfg: ModelConfig, path: str, dtype=jnp.float32,
                progress: bool | None = None, weights: str = "dequantize") -> Params:
  """Every leaf on the default device, one stage (kept for callers that want a Params)."""
  plans = plan_leaves(reader, cfg, path, dtype, weights)
  return place_stages(reader, cfg, plans, path, [(0, cfg.n_layers)], None, progress)[0]


def fingerprint(reader: gguf.GGUFReader) -> str:
  """xxh3-128 hex digest of the header (metadata + tensor infos) and the data.

  The whole file when it is under 256 MiB; else the header, 64 evenly spaced 1 MiB samples of
  the data region and the file size.
  """
  mm, size = reader.data, int(reader.data.shape[0])
  h = xxhash.xxh3_128()
  if size < _FULL_HASH_BYTES:
    h.update(memoryview(mm))
    return h.hexdigest()
  start = int(reader.data_offset)
  h.update(memoryview(mm[:start]))
  span = max(size - start - _SAMPLE_BYTES, 0)
  for k in range(_SAMPLES):
    off = start + span * k // (_SAMPLES - 1)
    h.update(memoryview(mm[off:off + _SAMPLE_BYTES]))
  h.update(size.to_bytes(8, "little"))
  return h.hexdigest()


def read_model_gguf(path, dtype=jnp.float32, progress: bool | None = None,
                    weights: str = "keep", layer_split=None, devices=None) -> ModelFile:
  """Load a qwen3next model GGUF, streaming each tensor onto its stage's device.

  Args:
    path: the .gguf file.
    dtype: compute dtype of the weights (float32 or bfloat16); small precision-critical leaves
      (`params.FP32_LEAVES`) stay float32.
    progress: show a tqdm bar over the bytes read (default: when stderr is a terminal).
    weights: "keep" (Q8_0/Q4_K/Q5_K/Q6_K projections stay quantised on the device as
      `QTensor`s; other types are dequantised per tensor, named in one log line) or
      "dequantize" (every leaf in the compute dtype).
    layer_split: None (one stage on the default device), "auto" (ranges sized from the
      tensors' device bytes and the devices' free memory, before any weight is placed) or
      per-stage layer counts ("24,24" or [24, 24]).
    devices: the stages' devices with a split (default: all devices).

  Returns:
    The ModelFile.

  Raises:
    GGUFError: the file is not a GGUF, is truncated, is not a qwen3next model, lacks a key or a
      tensor, has a tensor of the wrong shape, row length or an undecodable type, or
      inconsistent metadata. DeviceMemoryError (a GGUFError): a stage does not fit its device.
  """
  path = os.fspath(path)
  reader = open_gguf(path)
  kv = read_kv(reader, path)
  tensors = {t.name: t for t in reader.tensors}
  arch = kv.get("general.architecture")
  if arch is not None and arch != ARCH:  # say "wrong architecture" before any missing tensor
    raise GGUFError(f"{path}: architecture is {arch!r}, expected {ARCH!r}")
  embd = tensors.get("token_embd.weight")
  if embd is None:
    raise GGUFError(f"{path}: missing tensor 'token_embd.weight'")
  cfg = config_from_kv(kv, path, vocab_size=_numpy_shape(embd)[0])
  n_tokens = len(kv.get("tokenizer.ggml.tokens") or ())
  if n_tokens and n_tokens != cfg.vocab_size:  # llama.cpp refuses this too
    raise GGUFError(f"{path}: inconsistent metadata: tokenizer.ggml.tokens has {n_tokens} "
                    f"entries, token_embd.weight has {cfg.vocab_size} rows")
  tokenizer = None
  if "tokenizer.ggml.model" in kv:
    try:
      tokenizer = Tokenizer.from_gguf_kv(kv)
    except UnsupportedTokenizer as e:  # the model still runs on token ids
      warnings.warn(f"{path}: tokenizer not loaded: {e}", stacklevel=2)
    except Exception as e:
      raise GGUFError(f"{path}: bad tokenizer metadata: {e}") from e
  plans = plan_leaves(reader, cfg, path, dtype=dtype, weights=weights)
  if layer_split is None:
    ranges, devices = [(0, cfg.n_layers)], None
  else:
    devices = list(devices) if devices is not None else jax.devices()
    spec = plan_lib.parse_split(layer_split, cfg.n_layers, len(devices))
    if spec == "auto":
      per_layer, embed_b, head_b = plan_bytes(cfg, plans)
      cost = per_layer + plan_lib.stage_reserve_bytes(cfg, dtype)
      ranges = plan_lib.plan_ranges(cost, embed_b, head_b, devices, what=path)
      how = "auto, from the file's tensor bytes and the devices' free memory"
    else:
      ranges, how = spec, "given"
    devices = devices[:len(ranges)]
    log.info("layer split (%s): %s", how, plan_lib.describe(ranges, devices))
  stages = place_stages(reader, cfg, plans, path, ranges, devices, progress)

  def opt_id(key):
    v = kv.get(f"tokenizer.ggml.{key}")
    return None if v is None or isinstance(v, list) else int(v)

  return ModelFile(
      cfg=cfg, stages=stages, ranges=[tuple(r) for r in ranges], devices=devices,
      tokenizer=tokenizer, metadata={k: v for k, v in kv.items() if k not in TOKENIZER_ARRAYS},
      fingerprint=fingerprint(reader), path=path,
      add_bos=bool(kv.get("tokenizer.ggml.add_bos_token", False)),
      bos_id=opt_id("bos_token_id"), eos_id=opt_id("eos_token_id"),
      file_bytes=sum(int(t.n_bytes) for t in {id(t): t for lp in plans
                                              for t in lp.tensors}.values()))


def load_tokenizer(path) -> Tokenizer | None:
  """Only the tokenizer of a GGUF (None when the file has none)."""
  path = os.fspath(path)
  kv = read_kv(open_gguf(path), path)
  if "tokenizer.ggml.model" not in kv:
    return None
  try:
    return Tokenizer.from_gguf_kv(kv)
  except Exception as e:
    raise GGUFError(f"{path}: bad tokenizer metadata: {e}") from e
