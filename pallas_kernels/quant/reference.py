"""Pure-jnp oracle: dequantise the repacked planes, then multiply in fp32.

`dequantize` is exact against `gguf.quants.dequantize` of the same file bytes: every product
of an f16 scale, an integer sub-block scale and an integer quant value is exact in fp32 (at
most 23 significant bits), so the only rounding is Q4_K / Q5_K's final `- dmin * m`, which
both compute the same way.
"""
import jax.numpy as jnp
from jax import lax

from pallas_kernels.quant.layout import BLOCK, QTensor

_F32 = jnp.float32
_HI = lax.Precision.HIGHEST


def _nibbles(qs, nb):
  """[.., in/2] uint8 paired nibbles -> [.., nb, 256] int32 in weight order (j, j + 128)."""
  qs = qs.reshape(*qs.shape[:-1], nb, 128).astype(jnp.int32)
  return jnp.concatenate([qs & 15, qs >> 4], axis=-1)


def dequantize(qt: QTensor, dtype=_F32):
  """The weight as a dense array of `qt.shape` (computed in fp32, then cast to `dtype`)."""
  rows, n_in = qt.shape[:-1], qt.shape[-1]
  nb = n_in // BLOCK[qt.qtype]
  d = qt.d.astype(_F32)
  if qt.qtype == "q8_0":
    q = qt.qs.reshape(*rows, nb, 32).astype(_F32)
    w = d[..., None] * q
  elif qt.qtype in ("q4_k", "q5_k"):
    q = _nibbles(qt.qs, nb)  # [.., nb, 256]
    if qt.qtype == "q5_k":
      qh = qt.qh.reshape(*rows, nb, 1, 32).astype(jnp.int32)
      bits = (qh >> jnp.arange(8, dtype=jnp.int32)[:, None]) & 1  # weight 32 i + l
      q = q | (bits.reshape(*rows, nb, 256) << 4)
    sc = qt.sc.reshape(*rows, nb, 8).astype(_F32)
    mn = qt.mn.reshape(*rows, nb, 8).astype(_F32)
    scale = d[..., None] * sc  # [.., nb, 8]
    mins = qt.dmin.astype(_F32)[..., None] * mn
    w = scale[..., None] * q.reshape(*rows, nb, 8, 32).astype(_F32) - mins[..., None]
  elif qt.qtype == "q6_k":
    q = _nibbles(qt.qs, nb)
    qh = qt.qh.reshape(*rows, nb, 2, 1, 32).astype(jnp.int32)
    top = (qh >> (2 * jnp.arange(4, dtype=jnp.int32))[:, None]) & 3  # weight 128 h + 32 i + l
    q = (q | (top.reshape(*rows, nb, 256) << 4)) - 32
    scale = d[..., None] * qt.sc.reshape(*rows, nb, 16).astype(_F32)
    w = scale[..., None] * q.reshape(*rows, nb, 16, 16).astype(_F32)
  else:
    raise ValueError(f"dequantize: unknown quant type {qt.qtype!r}")
  return w.reshape(qt.shape).astype(dtype)


def select_matrix(qt: QTensor, index):
  """The matrix at flat stack `index` (traced OK) as a QTensor of shape [out, in]."""
  if not qt.lead:
    return qt
  s = qt.num_matrices
  fields = {name: lax.dynamic_index_in_dim(p.reshape(s, *p.shape[len(qt.lead):]), index,
                                           keepdims=False)
            for name, p in qt.planes.items()}
  return QTensor(**fields, qtype=qt.qtype, shape=qt.shape[-2:])


def qmatmul_reference(x, qt: QTensor, *, index=None, precision=_HI):
  """y = x @ W^T with W dequantised to fp32; fp32 accumulation; y in x.dtype.

  Args:
    x: [N, in] activations.
    qt: weight of logical shape [..., out, in].
    index: int32 scalar (traced OK) picking one matrix of the flattened leading dims (e.g.
      layer * E + expert for [L, E, out, in]); required when qt is stacked.
    precision: of the fp32 product (HIGHEST: IEEE fp32).

  Returns:
    [N, out] in x.dtype.
  """
  if qt.lead and index is None:
    raise ValueError(f"qmatmul_reference: weight of shape {qt.shape} is stacked; pass index")
  w = dequantize(select_matrix(qt, 0 if index is None else index))  # [out, in]
  y = jnp.matmul(x.astype(_F32), w.T, precision=precision)
  return y.astype(x.dtype)
