"""Gated softmax attention (Qwen3-Next full-attention layers) over a per-row K/V cache."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.attention.api import decode_attention, decode_prologue, prefill_attention
from strata_jax.config import ModelConfig
from strata_jax.model.common import linears, out_projection, rms_norm, rope_neox


# `Forms.attn_decode`'s prologue choices and the decode kernel's choice each runs with.
PROLOGUE_FORMS = {"pallas_prologue": "pallas", "pallas_prologue_interpret": "pallas_interpret"}


def attn_mixer(cfg: ModelConfig, p, x, k_cache, v_cache, pos, n_new, lora_a, lora_b, switch,
               kv_start=None, *, row_scale=None, layer=None):
  """x [B, T, D]; k_cache/v_cache [B, S, G, Hd]; pos [B] first position of x's tokens;
  n_new [B] how many of the T tokens each row adds (the rest is padding; 0: the row sits
  this call out, as an inactive decode slot does).

  The n_new real keys/values are written at pos..pos+n_new-1 (writes past S are dropped;
  padding and rows with n_new = 0 write nothing, so such a row's cache is left as is); each query
  attends causally to cache positions <= its own (and >= kv_start [B] when given: the MTP
  layer's cache starts where its row began feeding it, docs/mtp.md). Returns (y [B, T, D],
  k_cache, v_cache).

  layer: None, or an int32 scalar (may be traced): k_cache/v_cache are then every layer's
  stack [L, B, S, G, Hd], the new keys/values are scattered into layer `layer` of it and the
  whole stacks come back (a layer scan carries them: the write is in place, no per-layer copy
  of the cache in or out).
  """
  B, T, _ = x.shape
  H, G, Hd = cfg.n_head, cfg.n_kv_head, cfg.head_dim
  S = k_cache.shape[-3]
  qg, k, v = linears(x, [p.q, p.k, p.v])
  qg = qg.reshape(B, T, H, 2 * Hd)
  form = cfg.forms.attn_decode
  if T == 1 and layer is not None and form in PROLOGUE_FORMS:
    # One launch for the head norms, RoPE and the cache write, then the decode kernel.
    impl = PROLOGUE_FORMS[form]
    q, k_cache, v_cache = decode_prologue(
        qg[:, 0], k.reshape(B, G, Hd), v.reshape(B, G, Hd), p.q_norm, p.k_norm, pos, n_new > 0,
        k_cache, v_cache, layer, n_rot=cfg.n_rot, rope_base=cfg.rope_base, eps=cfg.rms_eps,
        implementation=impl)
    out = decode_attention(q, k_cache, v_cache, layer, pos, kv_start,
                           implementation=impl)[:, None]                     # [B, 1, H, Hd]
    return _gated_out(cfg, p, out, qg[..., Hd:], x, lora_a, lora_b, switch, row_scale), \
        k_cache, v_cache
  q, gate = qg[..., :Hd], qg[..., Hd:]
  k, v = k.reshape(B, T, G, Hd), v.reshape(B, T, G, Hd)
  q, k = rms_norm(q, p.q_norm, cfg.rms_eps), rms_norm(k, p.k_norm, cfg.rms_eps)
  positions = pos[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]          # [B, T]
  q = rope_neox(q, positions, cfg.n_rot, cfg.rope_base)
  k = rope_neox(k, positions, cfg.n_rot, cfg.rope_base)
  rows = jnp.arange(B)[:, None]
  real = jnp.arange(T, dtype=jnp.int32)[None, :] < n_new[:, None]
  write_at = jnp.where(real, positions, S)                    # S: out of range, dropped
  at = (rows, write_at) if layer is None else (layer, rows, write_at)
  k_cache = k_cache.at[at].set(k.astype(k_cache.dtype), mode="drop")
  v_cache = v_cache.at[at].set(v.astype(v_cache.dtype), mode="drop")
  k_all, v_all = k_cache, v_cache
  if T == 1 and form in ("pallas", "pallas_interpret", *PROLOGUE_FORMS):
    # One position a row: the kernel reads the layer's cache where it lies, only up to each
    # row's position (pallas_kernels/attention).
    stacks = (k_all, v_all, layer) if layer is not None else (k_all[None], v_all[None], 0)
    out = decode_attention(q[:, 0], *stacks, positions[:, 0], kv_start,
                           implementation=PROLOGUE_FORMS.get(form, form))[:, None]
  else:   # the layer's cache, read after its write
    stacks = (k_all, v_all, layer) if layer is not None else (k_all[None], v_all[None], 0)
    out = prefill_attention(q, *stacks, pos, kv_start,
                            implementation=cfg.forms.attn_prefill)           # [B, T, H, Hd]
  return _gated_out(cfg, p, out, gate, x, lora_a, lora_b, switch, row_scale), k_all, v_all


def _gated_out(cfg, p, out, gate, x, lora_a, lora_b, switch, row_scale):
  """The output gate and projection (with the LoRA hook): out [B, T, H, Hd] fp32."""
  B, T, H, Hd = out.shape
  out = (out * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(x.dtype).reshape(B, T, H * Hd)
  return out_projection(out, p.out, lora_a, lora_b, switch, cfg.forms.lora_impl, row_scale,
                        cfg.forms.gemv_lora, cfg.forms.proj_finish)
