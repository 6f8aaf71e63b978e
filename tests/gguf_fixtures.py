"""Hermetic fixtures for the GGUF tests: the tiny random transformers Qwen3-Next checkpoint and
its tokenizer (from `strata_jax.testing`, shared with the notebooks), small GGUF writers, and
numpy K-quant encoders (gguf-py only decodes Q4_K/Q5_K/Q6_K)."""
from __future__ import annotations

import gguf
import numpy as np

from strata_jax.config import ModelConfig
from strata_jax.gguf import convert_hf as conv
from strata_jax.testing import (  # noqa: F401 (the fixtures the GGUF tests use)
    CHATML,
    HF_DIMS,
    SENTENCES,
    SPECIALS,
    save_tiny_hf,
    save_tokenizer,
    tiny_hf_config,
    train_tokenizer,
)

T = gguf.GGMLQuantizationType
QK_K = 256


# --- tiny ModelConfig and raw GGUF writing --------------------------------------------------------

def tiny_cfg(**overrides) -> ModelConfig:
  """D = 256 so that rows of [*, D] matrices are whole K-quant blocks."""
  dims = dict(vocab_size=256, d_model=256, layer_types="GAG", n_head=2, n_kv_head=1, head_dim=32,
              n_rot=8, rope_base=1e6, gdn_n_k_heads=2, gdn_n_v_heads=4, gdn_d_k=16, gdn_d_v=16,
              conv_kernel=4, n_experts=4, n_experts_used=2, d_ff_expert=32, d_ff_shared=32,
              rms_eps=1e-6, context_length=512)
  return ModelConfig(**{**dims, **overrides})


def write_raw_gguf(path, cfg: ModelConfig, tensors: dict[str, np.ndarray], *,
                   arch: str = "qwen3next", types: dict[str, T] | None = None,
                   tokenizer_kv: dict | None = None, set_kv=None, drop_keys=()) -> str:
  """A GGUF with no consistency checks (for bad-input tests).

  Args:
    tensors: {name: float32 array}, written in `types[name]` (default F32); a type whose
      encoder is unknown gets zero bytes of the right size.
    set_kv: called with the writer after the standard keys (overrides).
    drop_keys: metadata keys removed before writing.
  """
  w = gguf.GGUFWriter(str(path), arch)
  conv.add_model_metadata(w, cfg, name="bad")
  if tokenizer_kv:
    conv.add_tokenizer_metadata(w, tokenizer_kv)
  if set_kv:
    set_kv(w)
  for k in drop_keys:
    w.kv_data[0].pop(k)
  for name, x in tensors.items():
    qt = (types or {}).get(name, T.F32)
    if qt in (T.F32, T.F16):
      w.add_tensor(name, conv.encode_tensor(x, qt))
    else:
      try:
        data = quantize(x, qt)
      except NotImplementedError:
        data = np.zeros(gguf.quant_shape_to_byte_shape(x.shape, qt), np.uint8)
      w.add_tensor(name, data, raw_dtype=qt)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)


# --- K-quant encoders (numpy; layouts as gguf.quants' decoders read them) -------------------------

def _f16(x):
  return x.astype(np.float16)


def _pack_scales_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
  """8 six-bit scales and mins per block -> the 12-byte Q4_K/Q5_K scale field."""
  lo_d = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
  lo_m = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
  hi = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
  return np.concatenate([lo_d, lo_m, hi], axis=1).astype(np.uint8)


def _affine_k(blocks: np.ndarray, qmax: int):
  """Per 32-element sub-block affine fit x ~ d*sc*q - dmin*m, q in [0, qmax]."""
  nb = blocks.shape[0]
  sub = blocks.reshape(nb, 8, 32)
  lo = np.minimum(sub.min(-1), 0.0)
  scale_f = (sub.max(-1) - lo) / qmax
  min_f = -lo
  d = _f16(scale_f.max(-1) / 63)
  dmin = _f16(min_f.max(-1) / 63)
  df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
  with np.errstate(divide="ignore", invalid="ignore"):
    sc = np.clip(np.where(df > 0, np.rint(scale_f / df), 0), 0, 63).astype(np.uint8)
    mn = np.clip(np.where(dminf > 0, np.rint(min_f / dminf), 0), 0, 63).astype(np.uint8)
    step = (df * sc)[..., None]
    q = np.where(step > 0, np.rint((sub + (dminf * mn)[..., None]) / step), 0)
  q = np.clip(q, 0, qmax).astype(np.uint8)
  return d, dmin, sc, mn, q


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
  blocks = x.reshape(-1, QK_K).astype(np.float32)
  nb = blocks.shape[0]
  d, dmin, sc, mn, q = _affine_k(blocks, 15)
  q = q.reshape(nb, 4, 2, 32)
  qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(nb, 128)
  out = np.concatenate([d.view(np.uint8).reshape(nb, 2), dmin.view(np.uint8).reshape(nb, 2),
                        _pack_scales_k4(sc, mn), qs], axis=1)
  return out.reshape(*x.shape[:-1], -1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
  blocks = x.reshape(-1, QK_K).astype(np.float32)
  nb = blocks.shape[0]
  d, dmin, sc, mn, q = _affine_k(blocks, 31)
  low = (q & 0xF).reshape(nb, 4, 2, 32)
  qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(nb, 128)
  high = (q >> 4).astype(np.uint16)  # [nb, 8, 32]
  qh = sum(high[:, s] << s for s in range(8)).astype(np.uint8)
  out = np.concatenate([d.view(np.uint8).reshape(nb, 2), dmin.view(np.uint8).reshape(nb, 2),
                        _pack_scales_k4(sc, mn), qh, qs], axis=1)
  return out.reshape(*x.shape[:-1], -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
  blocks = x.reshape(-1, QK_K).astype(np.float32)
  nb = blocks.shape[0]
  sub = blocks.reshape(nb, 16, 16)
  scale_f = np.abs(sub).max(-1) / 31
  d = _f16(scale_f.max(-1) / 127)
  df = d.astype(np.float32)[:, None]
  with np.errstate(divide="ignore", invalid="ignore"):
    sc = np.clip(np.where(df > 0, np.rint(scale_f / df), 0), -128, 127).astype(np.int8)
    step = (df * sc)[..., None]
    q = np.where(step != 0, np.rint(sub / step), 0)
  q6 = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(nb, 2, 4, 32)  # [h, k, l]
  low, high = q6 & 0xF, q6 >> 4
  ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4),
                       low[:, :, 1] | (low[:, :, 3] << 4)], axis=2).reshape(nb, 128)
  qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4)
        | (high[:, :, 3] << 6)).reshape(nb, 64)
  out = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(nb, 2)], axis=1)
  return out.reshape(*x.shape[:-1], -1)


_K_ENCODERS = {T.Q4_K: quantize_q4_k, T.Q5_K: quantize_q5_k, T.Q6_K: quantize_q6_k}


def quantize(x: np.ndarray, qtype: T) -> np.ndarray:
  """float32 -> GGUF bytes for any type used in the tests (uint16 bits for BF16)."""
  x = np.ascontiguousarray(x, np.float32)
  if qtype in _K_ENCODERS:
    return _K_ENCODERS[qtype](x)
  if qtype in (T.F32, T.F16, T.BF16):
    return conv.encode_tensor(x, qtype)
  return gguf.quants.quantize(x, qtype)


def block_size(qtype: T) -> int:
  return gguf.GGML_QUANT_SIZES[qtype][0]
