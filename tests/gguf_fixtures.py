"""Hermetic fixtures for the GGUF tests: a tiny random transformers Qwen3-Next checkpoint with a
trained byte-level BPE tokenizer, small GGUF writers, and numpy K-quant encoders (gguf-py only
decodes Q4_K/Q5_K/Q6_K)."""
from __future__ import annotations

import json
import pathlib

import gguf
import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from strata_jax.config import ModelConfig
from strata_jax.gguf import convert_hf as conv
from strata_jax.gguf.tokenizer import PRE_PATTERNS

T = gguf.GGMLQuantizationType
QK_K = 256

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Gated delta networks keep a fixed-size recurrent state per head.",
    "Hybrid models mix linear attention with a few softmax attention layers.",
    "Numbers like 12345 and 3.14159 are split digit by digit.",
    "Ünïcödé text, emojis 🙂 and 日本語 also round-trip through bytes.",
    "Don't, can't, won't: contractions are split as in GPT-2.",
    "tabs\tand\nnewlines\n\n  and   spaces",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{%- for m in messages %}"
          "{%- if m['role'] == 'bad' %}{{ raise_exception('bad role') }}{%- endif %}"
          "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{%- endfor %}"
          "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


# --- tokenizer ------------------------------------------------------------------------------------

def train_tokenizer(vocab_size: int = 300) -> tokenizers.Tokenizer:
  """A tiny byte-level BPE with Qwen2's pre-tokenizer, ChatML specials and one user token."""
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(PRE_PATTERNS["qwen2"]), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(SENTENCES * 4, trainer)
  tok.add_tokens([tokenizers.AddedToken("<think>", special=False, normalized=False)])
  return tok


def save_tokenizer(d: pathlib.Path, vocab_size: int = 300, chat_template: str | None = CHATML):
  """tokenizer.json + tokenizer_config.json (eos <|im_end|>, pad <|endoftext|>) into `d`."""
  tok = train_tokenizer(vocab_size)
  tok.save(str(d / "tokenizer.json"))
  cfg = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
         "add_bos_token": False}
  if chat_template:
    cfg["chat_template"] = chat_template
  (d / "tokenizer_config.json").write_text(json.dumps(cfg))
  return tok


# --- transformers checkpoint ----------------------------------------------------------------------

HF_DIMS = dict(
    vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
    partial_rotary_factor=0.25, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=2048,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
)


def tiny_hf_config(**overrides):
  from transformers import Qwen3NextConfig
  return Qwen3NextConfig(**{**HF_DIMS, **overrides})


def save_tiny_hf(d: pathlib.Path, *, seed: int = 0, tokenizer: bool = True, **overrides):
  """Save a random fp32 Qwen3NextForCausalLM to `d`; returns its state dict as numpy.

  Every parameter is randomised (HF initialises norms, A_log and dt_bias to constants, which
  would hide a missing +1 or a wrong sign).
  """
  import torch
  from transformers import Qwen3NextForCausalLM
  torch.manual_seed(seed)
  model = Qwen3NextForCausalLM(tiny_hf_config(**overrides)).float()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("linear_attn.norm.weight"):
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif "norm" in name:
        p.copy_(0.2 * torch.randn_like(p))
      elif name.endswith("A_log"):
        p.uniform_(-1.0, 1.0)
      elif name.endswith("dt_bias"):
        p.uniform_(-0.5, 0.5)
      else:
        p.normal_(0.0, 0.05)
  d.mkdir(parents=True, exist_ok=True)
  model.save_pretrained(str(d))
  if tokenizer:
    save_tokenizer(d)
  return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}, model


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
