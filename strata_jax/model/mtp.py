"""The multi-token-prediction (MTP) head of Qwen3-Next: one gated-attention + MoE block that
drafts the token after next from the trunk's hidden state (docs/mtp.md defines it)."""
from __future__ import annotations

import jax.numpy as jnp

from strata_jax.config import ModelConfig
from strata_jax.model.attention import attn_mixer
from strata_jax.model.common import QRef, linear, residual_norm, rms_norm
from strata_jax.model.forward import _is_q, _layer, _split_quant, embed
from strata_jax.model.moe import moe


def mtp_forward(cfg: ModelConfig, params, tokens, hidden, k_cache, v_cache, pos, n_new,
                kv_start):
  """The MTP block over T positions of every row.

  Entry t of a row pairs the trunk's hidden state at position p = pos + t (before the output
  norm) with the token at position p + 1, and predicts the token at p + 2.

  Args:
    params: the model's Params (`params.mtp` the head; the embedding and LM head are shared).
    tokens: int32 [B, T] the tokens at positions p + 1.
    hidden: [B, T, D] the trunk's (or, drafting further, the MTP's own) pre-norm hidden state
      at positions p.
    k_cache, v_cache: the MTP layer's K/V [B, S, G, Hd]; entry t is written at position p.
    pos: int32 [B] position of entry 0; n_new: int32 [B] real entries (the rest is padding
      and writes nothing); kv_start: int32 [B] the row's first cached MTP position (its
      attention reads positions kv_start..p).
  Returns:
    (logits float32 [B, T, V], h [B, T, D] the block's pre-norm output, which feeds the next
    draft step as `hidden`, k_cache, v_cache).
  """
  mp = params.mtp
  B, T, D = hidden.shape
  e = embed(params, tokens).astype(hidden.dtype)
  x = jnp.concatenate([rms_norm(e, mp.enorm, cfg.rms_eps),
                       rms_norm(hidden, mp.hnorm, cfg.rms_eps)], axis=-1)    # [B, T, 2D]
  x = linear(x, mp.eh_proj if not _is_q(mp.eh_proj)
             else QRef(mp.eh_proj, None, cfg.forms.quant_impl))
  attn_d, attn_q = _split_quant(mp.attn)
  moe_d, moe_q = _split_quant(mp.moe)
  h = rms_norm(x, mp.attn_norm[0], cfg.rms_eps)
  off = jnp.zeros((B,), jnp.int32)      # never adapted, whatever the row's switch
  y, k_cache, v_cache = attn_mixer(cfg, _layer(cfg, attn_d, attn_q, 0, 0), h, k_cache, v_cache,
                                   pos, n_new, None, None, off, kv_start=kv_start)
  x, h = residual_norm(x, y, mp.post_norm[0], cfg.rms_eps)
  h = h.reshape(B * T, D)
  stacks = (mp.moe.gate_exps, mp.moe.up_exps, mp.moe.down_exps)
  x = x + moe(cfg, _layer(cfg, moe_d, moe_q, 0, 0), h, stacks, 0).reshape(B, T, D)
  w = params.lm_head
  if _is_q(w):
    w = QRef(w, None, cfg.forms.quant_impl)
  logits = linear(rms_norm(x, mp.head_norm, cfg.rms_eps), w).astype(jnp.float32)
  return logits, x, k_cache, v_cache
