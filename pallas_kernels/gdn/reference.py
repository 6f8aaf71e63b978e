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

from pallas_kernels._common import sum_partials
from pallas_kernels.attention.reference import rms_norm  # the model's (the gated norm's)

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


def l2norm(x, eps=1e-6):
  """x · rsqrt(Σx² + eps) over the last axis, in float32 (the model's `l2_norm` is this one):
  the form the model was trained with (fla / transformers). ggml's x / max(‖x‖, eps) agrees to
  ~4e-6 on real activations but by ~3e-4 on tiny random models whose q/k norms are small; we
  follow the model's definition."""
  xf = x.astype(jnp.float32)
  return xf * lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)


def delta_rule_step_raw(q, k, v, g, beta, state):
  """One decode step for a batch from raw q/k: the contract of `decode_kernel`.

  q, k [B, Hk, Dk] raw post-conv rows (normalised here: q to l2norm * Dk**-0.5, k to l2norm);
  v [B, Hv, Dv]; g, beta [B, Hv]; state [B, Hv, Dv, Dk]. v-head h reads k-head h // (Hv // Hk).
  Returns o [B, Hv, Dv] float32 and the new state [B, Hv, Dv, Dk] float32.
  """
  r = v.shape[1] // q.shape[1]
  q = l2norm(q) * (q.shape[-1] ** -0.5)
  k = l2norm(k)
  q, k = jnp.repeat(q, r, axis=1), jnp.repeat(k, r, axis=1)
  return jax.vmap(delta_rule_step)(q, k, v, g, beta, state.astype(jnp.float32))


def gates(a, b, a_coef, dt_bias):
  """The model's gates from the raw `ba` halves: g = a_coef softplus(a + dt_bias) (log decay,
  a_coef = -exp(A_log) < 0) and beta = sigmoid(b), in float32. a, b [..., Hv]; a_coef,
  dt_bias [Hv]."""
  f32 = jnp.float32
  g = a_coef.astype(f32) * jax.nn.softplus(a.astype(f32) + dt_bias.astype(f32))
  return g, jax.nn.sigmoid(b.astype(f32))


def delta_rule_step_fused(q, k, v, a, b, a_coef, dt_bias, state, valid=None):
  """One decode step from raw inputs: the contract of `decode_fused_kernel`.

  q, k [B, Hk, Dk] raw; v [B, Hv, Dv]; a, b [B, Hv] raw gate inputs; a_coef, dt_bias [Hv];
  state [B, Hv, Dv, Dk]; valid [B] or None. Rows with valid == 0 get g = beta = 0, which
  leaves their state unchanged. Returns (o [B, Hv, Dv], new state), float32."""
  g, beta = gates(a, b, a_coef, dt_bias)
  if valid is not None:
    ok = (jnp.asarray(valid) != 0)[:, None]
    g, beta = jnp.where(ok, g, 0.0), jnp.where(ok, beta, 0.0)
  return delta_rule_step_raw(q, k, v, g, beta, state)


def delta_rule_steps_fused(q, k, v, a, b, a_coef, dt_bias, state, valid=None, *,
                           step=delta_rule_step_fused):
  """T decode steps from raw inputs, the state after each kept: the contract of
  `decode_fused_kernel.gdn_decode_fused_steps`. q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv];
  a, b [B, T, Hv]; state [B, Hv, Dv, Dk]; valid [B, T] or None. Step t is `step` (default
  `delta_rule_step_fused`) on the state step t-1 left (an invalid step leaves it as it was).
  Returns (o [B, T, Hv, Dv], steps [B, T, Hv, Dv, Dk]), float32."""
  n_t = q.shape[1]
  valid = jnp.ones(q.shape[:2], jnp.int32) if valid is None else jnp.asarray(valid)

  def body(s, xs):
    qt, kt, vt, at, bt, ok = xs
    o, s_new = step(qt, kt, vt, at, bt, a_coef, dt_bias, s, ok)
    s = jnp.where((ok != 0)[:, None, None, None], s_new, s)
    return s, (o, s)
  tm = lambda x: jnp.moveaxis(x, 1, 0)
  _, (o, steps) = lax.scan(body, state.astype(jnp.float32),
                           tuple(map(tm, (q, k, v, a, b, valid))), length=n_t)
  return jnp.moveaxis(o, 0, 1), jnp.moveaxis(steps, 0, 1)


def causal_conv_step(x, conv_state, conv_w, valid=None):
  """One token of the model's depthwise causal conv (`strata_jax.model.gdn.causal_conv` at
  T = 1): x [B, C]; conv_state [B, K-1, C]; conv_w [C, K]; valid [B] or None. Returns
  (silu(sum_j ext[:, j] w[:, j]) in x's dtype [B, C], the new conv state: the rows moved up
  with x last, in conv_state's dtype, the old state where valid is 0)."""
  ext = jnp.concatenate([conv_state.astype(x.dtype), x[:, None]], axis=1)     # [B, K, C]
  wf = conv_w.astype(jnp.float32)
  acc = sum(ext[:, j].astype(jnp.float32) * wf[:, j] for j in range(conv_w.shape[1]))
  new = ext[:, 1:].astype(conv_state.dtype)
  if valid is not None:
    new = jnp.where((jnp.asarray(valid) != 0)[:, None, None], new, conv_state)
  return jax.nn.silu(acc).astype(x.dtype), new


def gated_rms_norm(o, z, norm_w, eps, out_dtype):
  """The GDN layer's gated norm of the delta rule's output, as the model applies it: o
  [..., Dv] fp32 RMS-normalised over Dv (`rms_norm`, fp32), times silu(z) in fp32, rounded to
  out_dtype once."""
  y = rms_norm(o.astype(jnp.float32), norm_w, eps)
  return (y * jax.nn.silu(z.astype(jnp.float32))).astype(out_dtype)


def decode_layer_reference(x, conv_state, conv_w, z, ba, a_coef, dt_bias, norm_w, state, valid,
                           layer, *, n_k_heads, eps, out_dtype=None):
  """The oracle of `decode_layer_kernel.gdn_decode_layer`: a GDN layer's decode core as the
  model computes it (the conv, the q / k / v and b / a slices, `delta_rule_step_fused`, the
  gated RMSNorm). Shapes as there (z and ba whole or as split partials); `state` the
  [L, B, Hv, Dv, Dk] stack, layer `layer` (clamped) updated, invalid rows' state kept bit for
  bit."""
  f32 = jnp.float32
  _, bsz, hv, dv, dk = state.shape
  r, kd = hv // n_k_heads, n_k_heads * dk

  # split partials [S, ...] -> their index-order sum in x's dtype (the projection's result)
  whole = lambda v, ndim: v if v.ndim == ndim else sum_partials(v.astype(f32)).astype(x.dtype)
  z, ba = whole(z, 3), whole(ba, 2)
  c, conv_new = causal_conv_step(x, conv_state, conv_w, valid)
  q = c[:, :kd].reshape(bsz, n_k_heads, dk)
  k = c[:, kd:2 * kd].reshape(bsz, n_k_heads, dk)
  v = c[:, 2 * kd:].reshape(bsz, hv, dv).astype(f32)
  ba = ba.astype(x.dtype).astype(f32).reshape(bsz, n_k_heads, 2 * r)
  b, a = ba[..., :r].reshape(bsz, hv), ba[..., r:].reshape(bsz, hv)
  layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, state.shape[0] - 1)
  old = state[layer]
  o, s = delta_rule_step_fused(q, k, v, a, b, a_coef, dt_bias, old, valid)
  s = jnp.where((jnp.asarray(valid) != 0)[:, None, None, None], s, old)
  y = gated_rms_norm(o, z.astype(x.dtype), norm_w, eps, out_dtype or x.dtype)   # o: fp32
  return (y, conv_new, state.at[layer].set(s))


def decode_conv_reference(qkv, ba, conv_state, conv_w, a_coef, dt_bias, state, valid, layer,
                          conv_layer=None, weight_layer=None, *, n_k_heads, x_dtype=None):
  """The oracle of `decode_conv_kernel.gdn_decode_conv`: a GDN layer's decode step from its
  projections' outputs as the model's fused form computes it (the split sums, the conv, the
  q / k / v and b / a slices, `delta_rule_step_fused`). Shapes as there: qkv / ba whole or
  as split partials, conv_state / conv_w / a_coef / dt_bias one layer's or stacks read at
  their layer index (None: `layer`, clamped), `state` the [L, B, Hv, Dv, Dk] stack. Returns
  (o [B, Hv, Dv] fp32, the conv state as given with its layer updated, the state stack);
  invalid rows keep both states bit for bit."""
  f32 = jnp.float32
  _, bsz, hv, dv, dk = state.shape
  r, kd = hv // n_k_heads, n_k_heads * dk
  x_dtype = jnp.dtype(x_dtype or qkv.dtype)
  whole = lambda v, ndim: (v if v.ndim == ndim else sum_partials(v.astype(f32))).astype(x_dtype)
  x, ba = whole(qkv, 2), whole(ba, 2)
  at = lambda i, n: jnp.clip(jnp.asarray(layer if i is None else i, jnp.int32), 0, n - 1)
  if conv_w.ndim == 3:
    wl = at(weight_layer, conv_w.shape[0])
    conv_w, a_coef, dt_bias = conv_w[wl], a_coef[wl], dt_bias[wl]
  cs = conv_state
  if conv_state.ndim == 4:
    cl = at(conv_layer, conv_state.shape[0])
    cs = conv_state[cl]
  c, conv_new = causal_conv_step(x, cs, conv_w, valid)
  if conv_state.ndim == 4:
    conv_new = conv_state.at[cl].set(conv_new)
  q = c[:, :kd].reshape(bsz, n_k_heads, dk)
  k = c[:, kd:2 * kd].reshape(bsz, n_k_heads, dk)
  v = c[:, 2 * kd:].reshape(bsz, hv, dv).astype(f32)
  ba = ba.astype(f32).reshape(bsz, n_k_heads, 2 * r)
  b, a = ba[..., :r].reshape(bsz, hv), ba[..., r:].reshape(bsz, hv)
  sl = at(None, state.shape[0])
  old = state[sl]
  o, s = delta_rule_step_fused(q, k, v, a, b, a_coef, dt_bias, old, valid)
  s = jnp.where((jnp.asarray(valid) != 0)[:, None, None, None], s, old)
  return o, conv_new, state.at[sl].set(s)


def delta_rule_recurrent(q, k, v, g, beta, state):
  """Token-by-token oracle (see module docstring for shapes)."""
  def body(s, xs):
    o, s = delta_rule_step(*xs, s)
    return s, o
  state, o = lax.scan(body, state.astype(jnp.float32), (q, k, v, g, beta))
  return o, state


@jax.custom_batching.sequential_vmap
def _solve_one(a, rhs):
  """a [C, C] unit lower triangular, rhs [C, D]: one LAPACK / cuBLAS triangular solve. Batched
  (by `jax.vmap`, the model's too), it runs as a loop of single solves."""
  return lax.linalg.triangular_solve(a, rhs, left_side=True, lower=True, unit_diagonal=True)


def _unit_lower_solve(m, rhs):
  """x with (I + m) x = rhs, for m [..., C, C] strictly lower and rhs [..., C, D], one matrix
  at a time. A batched `lax.linalg.triangular_solve` on CPU is jaxlib 0.10's LAPACK trsm over
  the batch, which splits it over XLA's intra-op thread pool while blocking a pool thread on
  the parts: as many batched solves in flight as pool threads (two on a 2-core machine: two
  programs at once, as an engine's async dispatch or a server gives) and none can finish (a
  hung process: `bench_engine.py --smoke`, under gdb; most likely the earlier
  `tests/test_server.py` hangs). One matrix a call never splits, and each matrix is solved
  by the same routine as in the batched call, so the numbers are the same."""
  C, D = m.shape[-1], rhs.shape[-1]
  a = (jnp.eye(C, dtype=m.dtype) + m).reshape(-1, C, C)
  return jax.vmap(_solve_one)(a, rhs.reshape(-1, C, D)).reshape(rhs.shape)


def _intra_chunk(q, k, v, g, beta):
  """Everything that does not depend on the carried state, for every chunk and head at once.

  q, k [..., C, Dk]; v [..., C, Dv]; g, beta [..., C] (leading dims: chunks, heads).
  With G the in-chunk cumulative log decay and T = (I + strictly_lower(β_t e^{G_t-G_s} k_t·k_s))⁻¹
  (the UT transform), the chunk's updates are u = ū - w S₀ᵀ with ū = T(β v), w = T(β e^G k).
  Returns ū, w, the decayed causal q·k matrix, q e^G, k e^{G_last-G} and G_last.
  """
  C = q.shape[-2]
  G = jnp.cumsum(g, axis=-1)                                    # [..., C]
  diff = G[..., :, None] - G[..., None, :]                      # G_t - G_s
  strict = jnp.tril(jnp.ones((C, C), bool), -1)
  causal = jnp.tril(jnp.ones((C, C), bool))
  # exp only where used: above the diagonal G_t - G_s > 0 can overflow.
  decay_strict = jnp.where(strict, jnp.exp(jnp.where(strict, diff, 0.0)), 0.0)
  decay_causal = jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)
  kk = jnp.einsum("...id,...jd->...ij", k, k, precision=_HI)
  m = beta[..., :, None] * decay_strict * kk                    # strictly lower
  rhs = jnp.concatenate([beta[..., None] * v, (beta * jnp.exp(G))[..., None] * k], axis=-1)
  sol = _unit_lower_solve(m, rhs)
  Dv = v.shape[-1]
  u_bar, w = sol[..., :Dv], sol[..., Dv:]
  qk = jnp.einsum("...id,...jd->...ij", q, k, precision=_HI) * decay_causal
  g_last = G[..., -1]
  q_dec = q * jnp.exp(G)[..., None]
  k_dec = k * jnp.exp(g_last[..., None] - G)[..., None]
  return u_bar, w, qk, q_dec, k_dec, g_last


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = 64):
  """Chunked (WY/UT) form of `delta_rule_recurrent`. T is padded to a multiple of `chunk`
  with g = 0, beta = 0 rows, which leave the state unchanged. The intra-chunk work runs for
  all chunks at once; only the state's pass from chunk to chunk is sequential."""
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
  # [n, H, c, ...]: chunks outer, heads inside.
  split = lambda t: jnp.moveaxis(t.reshape(n, c, H, *t.shape[2:]), 2, 1)
  u_bar, w, qk, q_dec, k_dec, g_last = _intra_chunk(*(split(t) for t in (q, k, v, g, beta)))

  def body(s, xs):                                              # s [H, Dv, Dk]
    u_bar, w, qk, q_dec, k_dec, g_last = xs
    u = u_bar - jnp.einsum("hck,hvk->hcv", w, s, precision=_HI)
    o = (jnp.einsum("hck,hvk->hcv", q_dec, s, precision=_HI)
         + jnp.einsum("hcs,hsv->hcv", qk, u, precision=_HI))
    s = jnp.exp(g_last)[:, None, None] * s + jnp.einsum("hcv,hck->hvk", u, k_dec, precision=_HI)
    return s, o
  state, o = lax.scan(body, state.astype(f32), (u_bar, w, qk, q_dec, k_dec, g_last))
  o = jnp.moveaxis(o, 1, 2).reshape(n * c, H, Dv)[:T]
  return o, state
