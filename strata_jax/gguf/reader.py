"""Read a qwen3next model GGUF into (ModelConfig, Params, Tokenizer), checking everything first.

Every problem with the file surfaces as one `GGUFError` whose message starts with the path;
no numpy/jax traceback escapes for a bad file.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from typing import Any

import gguf
import jax.numpy as jnp
import numpy as np
import xxhash
from tqdm import tqdm

from strata_jax import config as config_lib
from strata_jax.config import ModelConfig
from strata_jax.errors import GGUFError
from strata_jax.gguf import names
from strata_jax.gguf.tokenizer import Tokenizer, UnsupportedTokenizer
from strata_jax.params import Params, leaf_dtype, param_shapes, params_from_flat

ARCH = "qwen3next"
GGUF_MAGIC = b"GGUF"
T = gguf.GGMLQuantizationType
# Dequantised at load. Q4_0/Q4_1/Q5_0/Q5_1 are llama.cpp's fallbacks inside K-quant mixes.
SUPPORTED_TYPES = frozenset({T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K,
                             T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1})
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
    params: the weights, dequantised, in the requested compute dtype (FP32_LEAVES stay fp32).
    tokenizer: from `tokenizer.ggml.*`, or None when the file has none (or an unsupported one).
    metadata: every KV field as plain python values, except the big tokenizer arrays.
    fingerprint: xxh3-128 hex digest identifying the file's contents.
    path: the file path.
    add_bos: `tokenizer.ggml.add_bos_token` (False when absent).
    bos_id: `tokenizer.ggml.bos_token_id` or None.
    eos_id: `tokenizer.ggml.eos_token_id` or None.
  """
  cfg: ModelConfig
  params: Params
  tokenizer: Tokenizer | None
  metadata: dict[str, Any]
  fingerprint: str
  path: str
  add_bos: bool
  bos_id: int | None
  eos_id: int | None


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
    reader = gguf.GGUFReader(path)
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
  n_layers = m.get("block_count")
  rec = kv.get(f"{ARCH}.attention.recurrent_layers")
  if rec is not None:
    if not isinstance(rec, list) or len(rec) != n_layers:
      n = len(rec) if isinstance(rec, list) else "a scalar"
      raise GGUFError(f"{path}: inconsistent metadata: {ARCH}.attention.recurrent_layers has "
                      f"{n} entries, block_count is {n_layers}")
    layer_types = "".join(config_lib.GDN if r else config_lib.ATTN for r in rec)
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
      context_length=m.get("context_length"))
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


def _check_type(t, path: str) -> None:
  if t.tensor_type not in SUPPORTED_TYPES:
    raise GGUFError(f"{path}: tensor {t.name!r} has unsupported type {t.tensor_type.name} "
                    f"(supported: {', '.join(sorted(x.name for x in SUPPORTED_TYPES))})")


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


def load_params(reader: gguf.GGUFReader, cfg: ModelConfig, path: str, dtype=jnp.float32,
                progress: bool | None = None) -> Params:
  """Dequantise and stack the tensors into Params (shapes checked before any data is read)."""
  tensors = {t.name: t for t in reader.tensors}
  shapes = param_shapes(cfg)
  plan = []  # (leaf path, stacked?, [(layer slot, reader tensor)])
  for spec in names.MODEL_TENSORS:
    idx = names.layer_indices(cfg, spec.over)
    want = shapes[spec.path] if idx is None else shapes[spec.path][1:]
    todo = []
    for slot, i in enumerate([None] if idx is None else idx):
      name = spec.gguf if i is None else spec.gguf.format(i=i)
      if name not in tensors and spec.fallback in tensors:
        name = spec.fallback
      if name not in tensors:
        raise GGUFError(f"{path}: missing tensor {name!r}")
      _check_shape(tensors[name], want, path)
      _check_type(tensors[name], path)
      todo.append((slot, tensors[name]))
    plan.append((spec.path, idx is not None, todo))

  total = sum(len(todo) for _, _, todo in plan)
  disable = not sys.stderr.isatty() if progress is None else not progress
  flat = {}
  with tqdm(total=total, desc="loading", unit="tensor", disable=disable, leave=False) as bar:
    for leaf, stacked, todo in plan:
      out = np.empty(shapes[leaf], dtype=np.dtype(leaf_dtype(leaf, dtype)))
      for slot, t in todo:
        dst = out[slot] if stacked else out
        try:
          dst[...] = np.reshape(dequantize(t, path), dst.shape)  # reshape drops ggml's 1-dims
        except Exception as e:
          raise GGUFError(f"{path}: tensor {t.name!r} ({t.tensor_type.name}) cannot be "
                          f"decoded: {type(e).__name__}: {e}") from e
        bar.update(1)
      flat[leaf] = jnp.asarray(out)
  return params_from_flat(flat)


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


def read_model_gguf(path, dtype=jnp.float32, progress: bool | None = None) -> ModelFile:
  """Load a qwen3next model GGUF.

  Args:
    path: the .gguf file.
    dtype: compute dtype of the weights (float32 or bfloat16); small precision-critical leaves
      (`params.FP32_LEAVES`) stay float32.
    progress: show a tqdm bar (default: when stderr is a terminal).

  Returns:
    The ModelFile.

  Raises:
    GGUFError: the file is not a GGUF, is truncated, is not a qwen3next model, lacks a key or a
      tensor, has a tensor of the wrong shape or an unsupported type, or inconsistent metadata.
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
  params = load_params(reader, cfg, path, dtype=dtype, progress=progress)

  def opt_id(key):
    v = kv.get(f"tokenizer.ggml.{key}")
    return None if v is None or isinstance(v, list) else int(v)

  return ModelFile(
      cfg=cfg, params=params, tokenizer=tokenizer,
      metadata={k: v for k, v in kv.items() if k not in TOKENIZER_ARRAYS},
      fingerprint=fingerprint(reader), path=path,
      add_bos=bool(kv.get("tokenizer.ggml.add_bos_token", False)),
      bos_id=opt_id("bos_token_id"), eos_id=opt_id("eos_token_id"))


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
