"""Gated delta rule oracles (pure jnp, float32).

Per v-head, state S [Dv, Dk]; for each token t (g_t = log decay, beta_t in [0, 1]):
    S <- exp(g_t) S;   u_t = beta_t (v_t - S k_t);   S <- S + u_t k_tᵀ;   o_t = S q_t
`delta_rule_recurrent` is that loop; `delta_rule_chunked` is the same map computed chunk by
chunk with the WY/UT transform (README.md has the derivation). They agree to float32 rounding.

Shapes (one sequence; vmap for a batch):
  q, k [T, H, Dk] (already L2-normalised and scaled, heads already expanded to the v-heads)
  v [T, H, Dv]; g, beta [T, H]; state [H, Dv, Dk]  ->  o [T, H, Dv], state [H, Dv, Dk]
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_HI = lax.Precision.HIGHEST


def delta_rule_step(q, k, v, g, beta, state):
  """One token for every head. q, k [H, Dk]; v [H, Dv]; g, beta [H]; state [H, Dv, Dk]."""
  f32 = jnp.float32
  q, k, v, g, beta = (t.astype(f32) for t in (q, k, v, g, beta))
  s = state * jnp.exp(g)[:, None, None]
  kv = jnp.einsum("hvk,hk->hv", s, k, precision=_HI)
  u = beta[:, None] * (v - kv)                                  # [H, Dv]
  s = s + u[:, :, None] * k[:, None, :]
  o = jnp.einsum("hvk,hk->hv", s, q, precision=_HI)
  return o, s


def delta_rule_recurrent(q, k, v, g, beta, state):
  """Token-by-token oracle (see module docstring for shapes)."""
  def body(s, xs):
    o, s = delta_rule_step(*xs, s)
    return s, o
  state, o = lax.scan(body, state.astype(jnp.float32), (q, k, v, g, beta))
  return o, state


def _chunk(q, k, v, g, beta, s0):
  """One chunk for one head. q, k [C, Dk]; v [C, Dv]; g, beta [C]; s0 [Dv, Dk]."""
  C = q.shape[0]
  G = jnp.cumsum(g)                                             # cumulative log decay
  diff = G[:, None] - G[None, :]                                # [C, C]  G_t - G_s
  strict = jnp.tril(jnp.ones((C, C), bool), -1)
  causal = jnp.tril(jnp.ones((C, C), bool))
  # exp only where used: above the diagonal G_t - G_s > 0 can overflow.
  decay_strict = jnp.where(strict, jnp.exp(jnp.where(strict, diff, 0.0)), 0.0)
  decay_causal = jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)
  kk = jnp.dot(k, k.T, precision=_HI)
  m = beta[:, None] * decay_strict * kk                         # strictly lower
  # T = (I + M)^-1 applied by forward substitution (unit lower-triangular solve).
  eye = jnp.eye(C, dtype=q.dtype)
  rhs_u = beta[:, None] * v                                     # [C, Dv]
  rhs_w = (beta * jnp.exp(G))[:, None] * k                      # [C, Dk]
  sol = jax.scipy.linalg.solve_triangular(
      eye + m, jnp.concatenate([rhs_u, rhs_w], axis=1), lower=True, unit_diagonal=True)
  u_bar, w = sol[:, :v.shape[1]], sol[:, v.shape[1]:]
  u = u_bar - jnp.dot(w, s0.T, precision=_HI)                   # [C, Dv]
  qk = jnp.dot(q, k.T, precision=_HI) * decay_causal            # [C, C]
  o = jnp.exp(G)[:, None] * jnp.dot(q, s0.T, precision=_HI) + jnp.dot(qk, u, precision=_HI)
  g_last = G[-1]
  s1 = jnp.exp(g_last) * s0 + jnp.dot((u * jnp.exp(g_last - G)[:, None]).T, k, precision=_HI)
  return o, s1


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = 64):
  """Chunked (WY/UT) form of `delta_rule_recurrent`. T is padded to a multiple of `chunk`
  with g = 0, beta = 0 rows, which leave the state unchanged."""
  f32 = jnp.float32
  q, k, v, g, beta = (t.astype(f32) for t in (q, k, v, g, beta))
  T, H, Dk = q.shape
  Dv = v.shape[-1]
  c = min(chunk, T)
  n = -(-T // c)
  pad = n * c - T
  if pad:
    q, k, v = (jnp.pad(t, ((0, pad), (0, 0), (0, 0))) for t in (q, k, v))
    g, beta = (jnp.pad(t, ((0, pad), (0, 0))) for t in (g, beta))
  # [n, H, c, ...]: chunks outer, heads batched inside each chunk.
  split = lambda t: jnp.moveaxis(t.reshape(n, c, H, *t.shape[2:]), 2, 1)
  per_head = jax.vmap(_chunk)

  def body(s, xs):
    o, s = per_head(*xs, s)
    return s, o
  state, o = lax.scan(body, state.astype(f32), tuple(split(t) for t in (q, k, v, g, beta)))
  o = jnp.moveaxis(o, 1, 2).reshape(n * c, H, Dv)[:T]
  return o, state
