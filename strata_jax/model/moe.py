"""Mixture of experts with a shared expert (softmax router, top-k renormalised, SiLU-GLU)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from strata_jax.config import ModelConfig
from strata_jax.model.common import linear


def _glu(x, wg, wu, wd):
  return linear(jax.nn.silu(linear(x, wg).astype(jnp.float32)).astype(x.dtype) * linear(x, wu), wd)


def moe(cfg: ModelConfig, p, x):
  """x [N, D] -> [N, D]; p one layer's MoEParams."""
  N, D = x.shape
  k = cfg.n_experts_used
  logits = linear(x.astype(jnp.float32), p.router)                          # [N, E] f32
  probs = jax.nn.softmax(logits, axis=-1)
  w, idx = jax.lax.top_k(probs, k)
  w = w / jnp.sum(w, axis=-1, keepdims=True)                                # [N, k]
  if N * k <= cfg.n_experts:
    # Few tokens: read only the chosen experts' weights.
    wg, wu, wd = p.gate_exps[idx], p.up_exps[idx], p.down_exps[idx]          # [N, k, F, D] ...
    f32 = jnp.float32
    h_g = jnp.einsum("nd,nkfd->nkf", x, wg.astype(x.dtype), preferred_element_type=f32)
    h_u = jnp.einsum("nd,nkfd->nkf", x, wu.astype(x.dtype), preferred_element_type=f32)
    h = (jax.nn.silu(h_g).astype(x.dtype) * h_u.astype(x.dtype))
    y = jnp.einsum("nkf,nkdf->nkd", h, wd.astype(x.dtype), preferred_element_type=f32)
    routed = jnp.sum(y * w[..., None], axis=1)
  else:
    # Many tokens: every expert over every token, weighted by the (sparse) routing weights.
    dense_w = jnp.zeros((N, cfg.n_experts), jnp.float32).at[jnp.arange(N)[:, None], idx].set(w)
    f32 = jnp.float32
    h_g = jnp.einsum("nd,efd->nef", x, p.gate_exps.astype(x.dtype), preferred_element_type=f32)
    h_u = jnp.einsum("nd,efd->nef", x, p.up_exps.astype(x.dtype), preferred_element_type=f32)
    h = jax.nn.silu(h_g).astype(x.dtype) * h_u.astype(x.dtype)
    y = jnp.einsum("nef,edf->ned", h, p.down_exps.astype(x.dtype), preferred_element_type=f32)
    routed = jnp.einsum("ned,ne->nd", y, dense_w)
  shared = _glu(x, p.shared_gate, p.shared_up, p.shared_down).astype(jnp.float32)
  gate = jax.nn.sigmoid(linear(x.astype(jnp.float32), p.shared_gate_inp))  # [N, 1]
  return (routed + gate * shared).astype(x.dtype)
