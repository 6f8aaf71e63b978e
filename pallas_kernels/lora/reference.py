"""Pure-jnp fp32 oracle for the LoRA kernel."""
import jax.numpy as jnp
from jax import lax

_HI = lax.Precision.HIGHEST


def lora_reference(base, x, a, b, on, scale=1.0, rank_scale=None):
  """y[n] = base[n] + scale * b @ (s[n] * (a @ x[n])) where on[n] != 0, else base[n] (a select).

  Every operand is cast to fp32 and both products run at HIGHEST precision; the result is
  cast back to base's dtype. Off rows are returned from `base` itself, bit for bit.

  Args:
    base: [N, Dout] float (f32/f16/bf16); sets the output dtype.
    x: [N, Din] float activations.
    a: [R, Din] LoRA down projection.
    b: [Dout, R] LoRA up projection.
    on: [N] int32 (or bool) switch per row.
    scale: factor on the delta.
    rank_scale: [N, R] per-row scale s of each rank column, or None (all ones). Adapters
      stacked on the rank axis are chosen per row by it (zero columns drop an adapter).

  Returns:
    [N, Dout] in base.dtype.
  """
  f32 = jnp.float32
  h = jnp.matmul(x.astype(f32), a.astype(f32).T, precision=_HI)  # [N, R]
  if rank_scale is not None:
    h = h * rank_scale.astype(f32)
  delta = scale * jnp.matmul(h, b.astype(f32).T, precision=_HI)  # [N, Dout]
  y = (base.astype(f32) + delta).astype(base.dtype)
  return jnp.where((on != 0)[:, None], y, base)
