"""Pure-jnp oracle for the routed experts: the gather form of `strata_jax/model/moe.py`."""
import jax
import jax.numpy as jnp

from pallas_kernels._common import sum_partials


def moe_reference(x, wg, wu, wd, idx, w, precision=None, round_y=False):
  """routed[n] = sum_j w[n, j] * wd[e] @ (silu(wg[e] @ x[n]) * (wu[e] @ x[n])), e = idx[n, j].

  The same ops, dtypes and order as the `N * k <= E` branch of `strata_jax/model/moe.py`:
  the chosen experts' weights are gathered (`wg[idx]`, a copy), cast to x.dtype, and
    h_g, h_u = x @ wg^T, x @ wu^T                  fp32 accumulation
    h        = silu(h_g).astype(xdt) * h_u.astype(xdt)   in x.dtype
    y        = wd @ h                             fp32 accumulation
    routed   = sum_j y_j * w_j                     fp32
  round_y: each y_j rounded to x.dtype first (the many-token contract, `routed_experts_many`:
  transformers rounds each expert's output so; a no-op for fp32 x).
  With precision=None this is bit for bit what the model computes today. The tests pass
  `lax.Precision.HIGHEST` on GPU for fp32 inputs (the default there may use TF32; the
  kernel's products are IEEE fp32); it changes nothing for 16-bit inputs or on CPU.

  Args:
    x: [N, D] activations (f32/bf16/f16).
    wg, wu: [E, F, D] expert gate / up weights (any float dtype; cast to x.dtype).
    wd: [E, D, F] expert down weights.
    idx: [N, k] int32 expert ids (jnp indexing: negative ids wrap, others are clamped).
    w: [N, k] float32 routing weights.
    precision: passed to the three einsums.

  Returns:
    [N, D] float32.
  """
  f32 = jnp.float32
  g, u, d = wg[idx], wu[idx], wd[idx]                                      # [N, k, F, D] ...
  h_g = jnp.einsum("nd,nkfd->nkf", x, g.astype(x.dtype), precision=precision,
                   preferred_element_type=f32)
  h_u = jnp.einsum("nd,nkfd->nkf", x, u.astype(x.dtype), precision=precision,
                   preferred_element_type=f32)
  h = jax.nn.silu(h_g).astype(x.dtype) * h_u.astype(x.dtype)               # [N, k, F]
  y = jnp.einsum("nkf,nkdf->nkd", h, d.astype(x.dtype), precision=precision,
                 preferred_element_type=f32)
  if round_y:
    y = y.astype(x.dtype).astype(f32)
  return jnp.sum(y * w.astype(f32)[..., None], axis=1)


def route_reference(logits, k):
  """The router's oracle: (w [N, k] fp32, ids [N, k] int32), the top-k of softmax(logits)
  (ties to the lower id) renormalised to sum to 1 (the model's routing). logits [N, E], or
  split partial sums [S, N, E], added in index order first (p0 + p1 + ...)."""
  logits = logits.astype(jnp.float32)
  if logits.ndim == 3:
    logits = sum_partials(logits)
  probs = jax.nn.softmax(logits, axis=-1)
  w, idx = jax.lax.top_k(probs, k)
  return w / jnp.sum(w, axis=-1, keepdims=True), idx


def top_k_reference(x, k):
  """The router's top-k oracle: `lax.top_k` (values [N, k], ids [N, k] int32; ties to the
  lower id)."""
  return jax.lax.top_k(x, k)
