"""Pallas kernel: the end of a decode step's mixer, one launch after its output projection.

    y    = round(sum_k yp[k])                     (the projection's split partial sums)
    y    = round(sum_k yp[k] + s * sum_k dp[k])   on the rows whose adapter switch is on
                                                  (dp: B h's partials, from the projection's
                                                  own launch, `gemv.lora_rows_call(up=)`)
    x'   = round(x + y)                           (the residual add)
    ss_j = sum over tile j of x'^2                (fp32, per row and column tile)

returns (x', ss). `rms_norm_from_tiles` then gives the next RMSNorm from x' and ss, adding the
tiles' sums in index order (XLA fuses it into one elementwise pass).

Why: XLA reads a GEMV's fp32 partials straight into the residual add and the norm's
reduction, so a plain projection ends in those fusions, while an adapted one needs one more
launch for B h (`gemv.lora_finish`, 3.2 us a call on the H200, a launch's floor;
experiments/results/device/run50). With this kernel in every path (no adapter, off, on), it
takes the place of XLA's reduction fusion: the adapted step has the plain step's launches,
and its cost is the adapter's reads. An off row runs the same instructions as a row of the
no-adapter program (a select, never `+ 0 * d`), so it is that program's bits by construction.

Grid: one program per tile of `block` columns, all rows in it (as `lora_finish`). Earlier
forms, on the H200 at bench-a3b batch 1: one program per row over the whole row, norm
included, took 5.2 us a call with no adapter against XLA's 2.9, and 48 with a rank-50 B (its
[512, 64] tiles spilled registers; run 52); per column tile with B h here, 1.4 us with no
adapter and 3.6 with it (run 53): B's tile waits on the layer index, a second round trip.
So B h moved into the projection's launch, whose programs for A x multiply their tile of h
by B's columns too; here it is one more set of partials read with the others.

Numerics: the jnp oracle is `finish_reference` (the same roundings; its sums of squares in
XLA's order within a tile, so the two agree to fp32 summation order).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import sum_partials
from pallas_kernels.quant.gemv import masked_load, masked_store, triton_params

_F32 = jnp.float32
_WHOLE = pl.BlockSpec()


class Finish(NamedTuple):
  """Static description of one call."""
  m: int
  d: int
  block: int
  k_split: int
  out_dtype: object
  lora: bool = False
  d_split: int = 0
  scale: float = 1.0


def _kernel(*refs, t: Finish):
  yp_ref, res_ref, *rest = refs
  if t.lora:
    on_ref, dp_ref, xo_ref, ss_ref = rest
  else:
    xo_ref, ss_ref = rest
  j = pl.program_id(0)
  bo = t.block
  c0 = j * bo
  ok = (c0 + jnp.arange(bo)) < t.d if t.d % bo else None
  for r in range(t.m):
    ri = jnp.int32(r)   # static indices as int32 (the interpreter's indexers)
    y = sum_ref_partials(yp_ref, t.k_split, ri, pl.ds(c0, bo), mask=ok)
    plain = y.astype(t.out_dtype)
    if t.lora:
      delta = sum_ref_partials(dp_ref, t.d_split, ri, pl.ds(c0, bo), mask=ok)
      if t.scale != 1.0:
        delta = delta * t.scale
      # A select, never y + 0 * delta: an off row keeps the plain projection's bits.
      plain = jnp.where(on_ref[ri] != 0, (y + delta).astype(t.out_dtype), plain)
    res = masked_load(res_ref.at[ri, pl.ds(c0, bo)], ok)
    xn = (res.astype(_F32) + plain.astype(_F32)).astype(t.out_dtype)
    masked_store(xo_ref.at[ri, pl.ds(c0, bo)], xn, ok)
    xf = xn.astype(_F32)   # masked columns: 0 + 0
    ss_ref.at[ri, pl.ds(j, 1)][...] = jnp.reshape(jnp.sum(xf * xf), (1,))


def sum_ref_partials(ref, n, ri, cols, mask):
  """ref[k, ri, cols] for k < n in fp32, added in index order (`sum_partials`'), masked."""
  total = masked_load(ref.at[jnp.int32(0), ri, cols], mask).astype(_F32)
  for k in range(1, n):
    total = total + masked_load(ref.at[jnp.int32(k), ri, cols], mask).astype(_F32)
  return total


def _block(d):
  """Columns a program: 128 (16 programs over a 2,048-wide row), fewer for a narrower row."""
  return min(128, pl.next_power_of_2(d))


def finish_call(yp, res, *, lora=None, scale=1.0, block=None, interpret=False,
                compiler_params=None):
  """(x' [M, D] in res's dtype, ss [M, D / block] fp32) (module docstring). yp [S, M, D]:
  the projection's split partial sums (fp32; S = 1 may be the product in res's dtype); res
  [M, D]. lora: (dp [S', M, D] fp32 partial sums of B h, on [M] int32): scale times their
  sum is added on the rows that are on."""
  ks, m, d = yp.shape
  if res.shape != (m, d):
    raise ValueError(f"finish: partials {yp.shape} and residual {res.shape} must be "
                     "[S, M, D] and [M, D]")
  if compiler_params is None and not interpret:
    compiler_params = triton_params()
  t = Finish(m=m, d=d, block=block or _block(d), k_split=ks, out_dtype=jnp.dtype(res.dtype))
  args = [yp, res]
  if lora is not None:
    dp, on = lora
    if dp.shape[1:] != (m, d) or on.shape != (m,):
      raise ValueError(f"finish: B h's partials {dp.shape} and on {on.shape} must be "
                       f"[S, {m}, {d}] and [{m}]")
    t = t._replace(lora=True, d_split=dp.shape[0], scale=float(scale))
    args += [on.astype(jnp.int32), dp.astype(_F32)]
  n_tiles = pl.cdiv(d, t.block)
  return pl.pallas_call(
      functools.partial(_kernel, t=t), grid=(n_tiles,),
      out_shape=(jax.ShapeDtypeStruct((m, d), res.dtype),
                 jax.ShapeDtypeStruct((m, n_tiles), _F32)),
      in_specs=[_WHOLE] * len(args), out_specs=(_WHOLE, _WHOLE),
      interpret=interpret, compiler_params=compiler_params, name="proj_finish",
  )(*args)


def rms_norm_from_tiles(xn, ss, norm_w, eps):
  """RMSNorm(x') * norm_w in x''s dtype from `finish_call`'s (x', ss): the tiles' sums added
  in index order (a fixed order in every program, so equal inputs give equal bits), then the
  model's `rms_norm` arithmetic (x' * rsqrt(mean + eps), times the weight, rounded)."""
  total = ss[:, 0]
  for j in range(1, ss.shape[1]):
    total = total + ss[:, j]
  xf = xn.astype(_F32)
  inv = lax.rsqrt(total / xn.shape[-1] + eps)[:, None]
  return ((xf * inv) * norm_w.astype(_F32)).astype(xn.dtype)


def finish_reference(yp, res, *, lora=None, scale=1.0, block=None):
  """`finish_call` in jnp: the same roundings, each tile's sum of squares in XLA's order."""
  y = sum_partials(yp.astype(_F32))
  plain = y.astype(res.dtype)
  if lora is not None:
    dp, on = lora
    delta = sum_partials(dp.astype(_F32))
    if scale != 1.0:
      delta = delta * scale
    plain = jnp.where((on != 0)[:, None], (y + delta).astype(res.dtype), plain)
  xn = (res.astype(_F32) + plain.astype(_F32)).astype(res.dtype)
  m, d = xn.shape
  block = block or _block(d)
  n_tiles = -(-d // block)
  xf = jnp.pad(xn.astype(_F32), ((0, 0), (0, n_tiles * block - d)))
  return xn, jnp.sum((xf * xf).reshape(m, n_tiles, block), axis=-1)
