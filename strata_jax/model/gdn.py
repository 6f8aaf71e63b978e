"""Gated DeltaNet mixer (Qwen3-Next linear attention)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.gdn import api as gdn_api
from strata_jax.config import ModelConfig
from strata_jax.model.common import l2_norm, linear, out_projection, rms_norm


def causal_conv(x, conv_state, w, n_valid):
  """Depthwise causal conv (tap K-1 on the current token), then SiLU.

  x [B, T, C] raw rows; conv_state [B, K-1, C] previous raw rows; w [C, K]; n_valid [B].
  Returns (y [B, T, C], new conv_state = the last K-1 raw rows up to the last valid token).
  """
  K = w.shape[1]
  ext = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)             # [B, K-1+T, C]
  T = x.shape[1]
  wf = w.astype(jnp.float32)
  acc = sum(ext[:, j:j + T].astype(jnp.float32) * wf[:, j] for j in range(K))
  y = jax.nn.silu(acc).astype(x.dtype)
  if K == 1:
    return y, conv_state
  new_state = jax.vmap(lambda e, n: lax.dynamic_slice_in_dim(e, n, K - 1, axis=0))(ext, n_valid)
  return y, new_state.astype(conv_state.dtype)


def gdn_mixer(cfg: ModelConfig, p, x, conv_state, ssm, n_valid, lora_a, lora_b, switch, *,
              row_scale=None):
  """x [B, T, D]; p one layer's GDNParams; conv_state [B, K-1, C]; ssm [B, Hv, Dv, Dk] f32;
  n_valid [B] tokens of the T that are real (the rest is padding and leaves state unchanged).
  Returns (y [B, T, D], conv_state, ssm)."""
  B, T, _ = x.shape
  Hk, Hv, Dk, Dv = cfg.gdn_n_k_heads, cfg.gdn_n_v_heads, cfg.gdn_d_k, cfg.gdn_d_v
  r = Hv // Hk
  qkv = linear(x, p.qkv)                                                     # [B, T, C]
  z = linear(x, p.gate).reshape(B, T, Hv, Dv)
  ba = linear(x, p.ba).astype(jnp.float32).reshape(B, T, Hk, 2 * r)
  b, a = ba[..., :r].reshape(B, T, Hv), ba[..., r:].reshape(B, T, Hv)
  qkv, conv_state = causal_conv(qkv, conv_state, p.conv, n_valid)
  kd = cfg.gdn_key_dim
  q_raw = qkv[..., :kd].reshape(B, T, Hk, Dk)
  k_raw = qkv[..., kd:2 * kd].reshape(B, T, Hk, Dk)
  v = qkv[..., 2 * kd:].reshape(B, T, Hv, Dv).astype(jnp.float32)
  beta = jax.nn.sigmoid(b)
  g = p.a.astype(jnp.float32) * jax.nn.softplus(a + p.dt_bias.astype(jnp.float32))
  valid = (jnp.arange(T)[None, :] < n_valid[:, None])[..., None]             # [B, T, 1]
  beta, g = jnp.where(valid, beta, 0.0), jnp.where(valid, g, 0.0)
  if T == 1 and cfg.forms.gdn_decode in gdn_api.FUSED_CHOICES:
    # One launch from the raw inputs: gates, L2 norms, head expansion, the delta rule; the
    # state of a row with no valid token is not stored (it is unchanged).
    o, ssm = gdn_api.step_fused(q_raw[:, 0], k_raw[:, 0], v[:, 0], a[:, 0], b[:, 0], p.a,
                                p.dt_bias, ssm, n_valid > 0, implementation=cfg.forms.gdn_decode)
    o = o[:, None]
  elif T == 1:
    # One fused step (L2 norms, head expansion, the delta rule) on the GPU.
    o, ssm = gdn_api.step_raw(q_raw[:, 0], k_raw[:, 0], v[:, 0], g[:, 0], beta[:, 0], ssm,
                               implementation=cfg.forms.gdn_decode)
    o = o[:, None]
  else:
    q = jnp.repeat(l2_norm(q_raw) * (Dk ** -0.5), r, axis=2)   # v-head h <- k-head h//r
    k = jnp.repeat(l2_norm(k_raw), r, axis=2)
    chunked = functools.partial(gdn_api.chunked, implementation=cfg.forms.gdn_chunked,
                                pallas_chunk=cfg.forms.gdn_pallas_chunk)
    o, ssm = jax.vmap(chunked)(q, k, v, g, beta, ssm)
  o = rms_norm(o, p.norm, cfg.rms_eps).astype(jnp.float32)                   # [B, T, Hv, Dv]
  o = (o * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype).reshape(B, T, Hv * Dv)
  return (out_projection(o, p.out, lora_a, lora_b, switch, cfg.forms.lora_impl,
                         row_scale), conv_state,
          ssm)
