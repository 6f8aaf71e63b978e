"""Small building blocks shared by the layers: projections, RMSNorm, RoPE, the LoRA hook."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.gdn.reference import l2norm as l2_norm  # noqa: F401 (the model's L2 norm)


def linear(x, w):
  """x [..., in] @ w[out, in]ᵀ with float32 accumulation, result in x's dtype.

  The dot returns x's dtype itself (the GEMM accumulates in fp32 and rounds once, the same
  numbers as an fp32 result cast down): asked for an fp32 result at decode, XLA rewrote some
  bf16 GEMVs to read fp32 copies of their weights (H200: 7.30 -> 6.56 ms a token,
  experiments/bench/README.md).
  """
  return lax.dot_general(x, w.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())),
                         preferred_element_type=x.dtype)


def rms_norm(x, w, eps):
  """RMSNorm over the last axis in float32; `w` already carries GGUF's +1."""
  xf = x.astype(jnp.float32)
  y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (y * w.astype(jnp.float32)).astype(x.dtype)


def rope_neox(x, positions, n_rot, base):
  """NEOX (rotate-half) RoPE on the first n_rot dims; pairs (i, i + n_rot/2).

  x [B, T, H, Hd]; positions [B, T] int32.
  """
  half = n_rot // 2
  inv = base ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / n_rot)       # [half]
  ang = positions.astype(jnp.float32)[..., None] * inv                     # [B, T, half]
  cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
  xf = x.astype(jnp.float32)
  x1, x2, rest = xf[..., :half], xf[..., half:n_rot], xf[..., n_rot:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
  return out.astype(x.dtype)


def out_projection(x, w, lora_a, lora_b, switch, implementation=None):
  """The mixer output projection with the LoRA hook.

  x [B, T, in]; w [D, in]; lora_a [R, in] / lora_b [D, R] or None; switch [B] int32.
  Rows with the switch off get the base projection exactly (a select, never `+ 0·delta`).
  `implementation`: the LoRA kernel's (`Forms.lora_impl`).
  """
  y = linear(x, w)
  if lora_a is None:
    return y
  from pallas_kernels.lora import api as lora_api  # noqa: PLC0415 (kernel package loads lazily)
  B, T, _ = x.shape
  on = jnp.repeat(switch.astype(jnp.int32), T)                               # [B*T]
  out = lora_api.lora_apply(y.reshape(B * T, -1), x.reshape(B * T, -1), lora_a, lora_b, on,
                            implementation=implementation)
  return out.reshape(y.shape)
