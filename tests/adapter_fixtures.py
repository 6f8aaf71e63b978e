"""Tiny LoRA adapter GGUFs, written directly with `gguf.GGUFWriter` (no llama.cpp, no network).

`write_adapter` writes a well-formed adapter for a `ModelConfig` and returns the A/B values as
stored (after rounding to the file's dtype), so tests can compare exactly. `write_raw` writes
anything, for the malformed cases.
"""
from __future__ import annotations

import gguf
import ml_dtypes
import numpy as np

from strata_jax.config import GDN, ModelConfig

QT = gguf.GGMLQuantizationType
DTYPES = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0}


def tiny_config(layer_types: str = "GGGA") -> ModelConfig:
  """A small geometry whose LoRA input widths (64) are multiples of the Q8_0 block (32)."""
  return ModelConfig(
      vocab_size=96, d_model=64, layer_types=layer_types, n_head=4, n_kv_head=2, head_dim=16,
      n_rot=8, rope_base=1e4, gdn_n_k_heads=2, gdn_n_v_heads=4, gdn_d_k=16, gdn_d_v=16,
      conv_kernel=4, n_experts=4, n_experts_used=2, d_ff_expert=32, d_ff_shared=48)


def base_shape(cfg: ModelConfig, base: str) -> tuple[int, int]:
  """numpy [n_out, n_in] of a 2-D base weight named like `blk.{i}.<w>.weight`."""
  w = base.split(".")[2]
  D = cfg.d_model
  return {
      "ssm_out": (D, cfg.gdn_value_dim), "attn_output": (D, cfg.attn_out_dim),
      "attn_qkv": (cfg.gdn_conv_dim, D), "attn_gate": (cfg.gdn_value_dim, D),
      "ssm_ba": (2 * cfg.gdn_n_v_heads, D), "attn_q": (2 * cfg.n_head * cfg.head_dim, D),
      "attn_k": (cfg.n_kv_head * cfg.head_dim, D), "attn_v": (cfg.n_kv_head * cfg.head_dim, D),
      "ffn_gate_shexp": (cfg.d_ff_shared, D), "ffn_up_shexp": (cfg.d_ff_shared, D),
      "ffn_down_shexp": (D, cfg.d_ff_shared),
  }[w]


def output_projections(cfg: ModelConfig, layers=None) -> list[str]:
  """The applied base names (`ssm_out` / `attn_output`) of the given layers (default: all)."""
  layers = range(cfg.n_layers) if layers is None else layers
  return [f"blk.{i}.ssm_out.weight" if cfg.layer_types[i] == GDN else f"blk.{i}.attn_output.weight"
          for i in layers]


def random_pairs(cfg: ModelConfig, bases, rank: int, seed: int = 0) -> dict[str, tuple]:
  """{base: (A [r, n_in], B [n_out, r])} float32, random normal (B non-zero, unlike PEFT init)."""
  rng = np.random.default_rng(seed)
  out = {}
  for base in bases:
    n_out, n_in = base_shape(cfg, base)
    a = (rng.standard_normal((rank, n_in)) / np.sqrt(n_in)).astype(np.float32)
    b = (0.5 * rng.standard_normal((n_out, rank))).astype(np.float32)
    out[base] = (a, b)
  return out


def encode(x: np.ndarray, dtype: str) -> tuple[np.ndarray, object, np.ndarray]:
  """(data to write, raw_dtype or None, the float32 values a reader gets back).

  Like llama.cpp's converter, a Q8_0 tensor whose rows are not a multiple of 32 is written F16.
  """
  x = np.asarray(x, np.float32)
  if dtype == "q8_0" and x.shape[-1] % 32:
    dtype = "f16"
  if dtype == "f32":
    return x, None, x
  if dtype == "f16":
    h = x.astype(np.float16)
    return h, None, h.astype(np.float32)
  if dtype == "bf16":
    h = x.astype(ml_dtypes.bfloat16)
    return h.view(np.uint16), QT.BF16, h.astype(np.float32)
  if dtype == "q8_0":
    q = gguf.quants.quantize(x, QT.Q8_0)
    return q, QT.Q8_0, gguf.quants.dequantize(q, QT.Q8_0).reshape(x.shape).astype(np.float32)
  raise ValueError(dtype)


def write_raw(path, tensors, *, arch: str = "qwen3next", general_type="adapter",
              adapter_type="lora", alpha=None, name=None, extra_kv=None):
  """Write a GGUF with exactly these keys and tensors.

  Args:
    tensors: {tensor name: array} or {tensor name: (array, raw_dtype)}; float32/float16/int
      arrays are written as their numpy type.
    general_type / adapter_type / alpha / name: None leaves the key out.
    extra_kv: {key: (value, GGUFValueType[, sub_type])} written as well.
  """
  w = gguf.GGUFWriter(str(path), arch=arch)
  if general_type is not None:
    w.add_type(general_type)
  if adapter_type is not None:
    w.add_string("adapter.type", adapter_type)
  if alpha is not None:
    w.add_float32("adapter.lora.alpha", float(alpha))
  if name is not None:
    w.add_name(name)
  for key, spec in (extra_kv or {}).items():
    w.add_key_value(key, *spec)
  for tname, x in tensors.items():
    data, raw = x if isinstance(x, tuple) else (x, None)
    w.add_tensor(tname, data, raw_dtype=raw)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)


def write_adapter(path, cfg: ModelConfig, *, rank: int = 8, alpha=16.0, layers=None,
                  dtype: str = "f32", seed: int = 0, bases=None, extra=(), name=None):
  """Write a well-formed adapter on the output projections of `layers` (default all).

  Args:
    extra: more base names (other model weights) to give random A/B too.
    bases: overrides the full list of base names.

  Returns:
    (path, {base: (A, B)} float32 as a reader gets them back).
  """
  bases = list(bases) if bases is not None else output_projections(cfg, layers) + list(extra)
  pairs = random_pairs(cfg, bases, rank, seed)
  tensors, stored = {}, {}
  for base, (a, b) in pairs.items():
    da, ra, a_back = encode(a, dtype)
    db, rb, b_back = encode(b, dtype)
    tensors[base + ".lora_a"] = (da, ra)
    tensors[base + ".lora_b"] = (db, rb)
    stored[base] = (a_back, b_back)
  write_raw(path, tensors, alpha=alpha, name=name)
  return str(path), stored


def stacked_delta(lora_set, cfg: ModelConfig) -> dict[str, np.ndarray]:
  """{base: B_stack @ A_stack} in float64, per applied base weight of the model."""
  p = lora_set.params
  out, g, a = {}, 0, 0
  for i, kind in enumerate(cfg.layer_types):
    if kind == GDN:
      out[f"blk.{i}.ssm_out.weight"] = (np.asarray(p.gdn_b[g], np.float64)
                                        @ np.asarray(p.gdn_a[g], np.float64))
      g += 1
    else:
      out[f"blk.{i}.attn_output.weight"] = (np.asarray(p.attn_b[a], np.float64)
                                            @ np.asarray(p.attn_a[a], np.float64))
      a += 1
  return out


def longhand_delta(cfg: ModelConfig, files) -> dict[str, np.ndarray]:
  """sum_i s_i B_i A_i per applied base, float64, from [(stored pairs, alpha, user scale)].

  s_i = user_scale * alpha / rank, or user_scale alone when alpha is 0 or absent.
  """
  out = {}
  for base in output_projections(cfg):
    n_out, n_in = base_shape(cfg, base)
    d = np.zeros((n_out, n_in))
    for pairs, alpha, user in files:
      if base in pairs:
        a, b = (np.asarray(x, np.float64) for x in pairs[base])
        s = user * alpha / b.shape[1] if alpha else user
        d += s * (b @ a)
    out[base] = d
  return out
