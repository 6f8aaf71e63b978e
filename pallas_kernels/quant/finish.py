"""Pallas kernel: the end of a decode step's mixer, one launch after its output projection.

    y    = round(sum_k yp[k])                     (the projection's split partial sums)
    y    = round(sum_k yp[k] + s * B h)           on the rows whose adapter switch is on,
           h = (sum_k hp[k]) * rank_scale          (A x, from the projection's own launch)
    x'   = round(x + y)                           (the residual add)

returns x'. The next RMSNorm is the model's own, in XLA (one reduction fusion over x').

Why: XLA reads a GEMV's fp32 partials straight into the residual add and the norm's
reduction, so a plain projection ends in those fusions, while an adapted one needs one more
launch for B h (`gemv.lora_finish`, 3.2 us a call on the H200, a launch's floor;
experiments/results/device/run50). With this kernel in every path (no adapter, off, on), it
takes the place of XLA's add fusion: the adapted step has the plain step's launches, and its
cost is B's reads. An off row runs the same instructions as a row of the no-adapter program
(a select, never `+ 0 * d`), and every one of them is elementwise, so its bits are that
program's whatever layout Triton gives the tile.

No reduction on an off row's path: until run 56 the kernel also wrote x'^2's sums per column
tile for the norm, and compiled, a switched-off row's logits moved by up to 1.7e-6 from the
no-adapter program's (experiments/results/device/run56/s11: off_bits_probe.py, with and
without XLA's autotuning; the "xla" form stayed bit-identical). The likely mechanism: the
adapter's [block, rank] product sets the layout of the tile it meets, so the bare and the
adapted kernel added the squares in different orders. Without the sums, run 57 found the
bits equal.

Grid: one program per tile of `block` columns, all rows in it (as `lora_finish`), so B's
tile is read once per program. On the H200 at bench-a3b batch 1 it took 1.4 us a call with
no adapter and 3.6 with it (run 53: B's tile waits on the layer index, a second round trip).
Two other forms measured slower (experiments/results/device/run52, run54): one program per
row over the whole row, the norm included, 5.2 us with no adapter (XLA's fusion: 2.9) and 48
with a rank-50 B (its [512, 64] tiles spilled registers); and B h moved into the projection's
launch (A x's programs multiplying their tile of h by B's columns, this kernel adding those
partials), which made the adapted step 4.18 ms against 3.96 with XLA's finish: those
programs became the GEMV launch's tail. `Forms.proj_finish="gemv_b"` takes the index wait out
of this launch: the projection's launch copies B = b_stack[lidx] out (a [block, R] tile per
extra program, beside its products; `gemv.dense_lora_rows(copy_b=True)`) and this kernel
reads that copy at a static index. On the H100 it saves nothing (run 86: 4.468 against
4.454 ms a bench-a3b step at batch 1, adapter on), so it stays opt-in.

Numerics: the jnp oracle is `finish_reference` (the same roundings; with no adapter the same
bits).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import masked_load, sum_partials, sum_ref_partials
from pallas_kernels.quant.gemv import masked_store, tile_mask, triton_params

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
  h_split: int = 0
  rank: int = 0
  rank_pad: int = 0
  scaled: bool = False
  scale: float = 1.0
  indexed: bool = True   # B read at a layer index loaded first; False: a stack of one


def _kernel(*refs, t: Finish):
  yp_ref, res_ref, *rest = refs
  if t.lora:
    if t.indexed:
      lidx_ref, on_ref, hp_ref, b_ref, *rest = rest
    else:
      on_ref, hp_ref, b_ref, *rest = rest
    rs_ref, xo_ref = rest if t.scaled else (None, *rest)
  else:
    (xo_ref,) = rest
  j = pl.program_id(0)
  bo, rp = t.block, t.rank_pad
  c0 = j * bo
  ok = (c0 + jnp.arange(bo)) < t.d if t.d % bo else None
  if t.lora:
    r_in = (jnp.arange(rp) < t.rank) if t.rank != rp else None
    lay = lidx_ref[0] if t.indexed else jnp.int32(0)   # static: B's load waits for no index
    bt = masked_load(b_ref.at[lay, pl.ds(c0, bo), pl.ds(0, rp)],
                     tile_mask(ok, r_in, bo, rp)).astype(_F32)  # [bo, Rp], once a program
  for r in range(t.m):
    ri = jnp.int32(r)   # static indices as int32 (the interpreter's indexers)
    y = sum_ref_partials(yp_ref, t.k_split, ri, pl.ds(c0, bo), mask=ok)
    plain = y.astype(t.out_dtype)
    if t.lora:
      h = sum_ref_partials(hp_ref, t.h_split, ri, pl.ds(0, rp), mask=r_in)
      if t.scaled:
        h = h * masked_load(rs_ref.at[ri, pl.ds(0, rp)], r_in).astype(_F32)
      delta = jnp.sum(bt * h[None, :], axis=1)  # [bo]
      if t.scale != 1.0:
        delta = delta * t.scale
      # A select, never y + 0 * delta: an off row keeps the plain projection's bits.
      plain = jnp.where(on_ref[ri] != 0, (y + delta).astype(t.out_dtype), plain)
    res = masked_load(res_ref.at[ri, pl.ds(c0, bo)], ok)
    xn = (res.astype(_F32) + plain.astype(_F32)).astype(t.out_dtype)
    masked_store(xo_ref.at[ri, pl.ds(c0, bo)], xn, ok)


def _block(d):
  """Columns a program: 128 (16 programs over a 2,048-wide row), fewer for a narrower row."""
  return min(128, pl.next_power_of_2(d))


def finish_call(yp, res, *, lora=None, scale=1.0, block=None, interpret=False,
                compiler_params=None):
  """x' [M, D] in res's dtype (module docstring). yp [S, M, D]:
  the projection's split partial sums (fp32; S = 1 may be the product in res's dtype); res
  [M, D]. lora: (hp [S', M, R] fp32 partial sums of A x, b_stack [L, D, R], lidx [1] int32,
  on [M] int32, rank_scale [M, R] or None), B = b_stack[lidx] read in place; a stack of one
  (L = 1: B copied out by the projection's launch, `gemv.dense_lora_rows(copy_b=True)`) is
  read at a static index, with no index load before B's tile."""
  ks, m, d = yp.shape
  if res.shape != (m, d):
    raise ValueError(f"finish: partials {yp.shape} and residual {res.shape} must be "
                     "[S, M, D] and [M, D]")
  if compiler_params is None and not interpret:
    compiler_params = triton_params()
  t = Finish(m=m, d=d, block=block or _block(d), k_split=ks, out_dtype=jnp.dtype(res.dtype))
  args = [yp, res]
  if lora is not None:
    hp, b_stack, lidx, on, rank_scale = lora
    n_ad, b_out, rank = b_stack.shape
    if b_out != d or hp.shape[1:] != (m, rank) or on.shape != (m,):
      raise ValueError(f"finish: B {b_stack.shape}, h {hp.shape} and on {on.shape} must be "
                       f"[L, {d}, R], [S, {m}, R] and [{m}]")
    t = t._replace(lora=True, h_split=hp.shape[0], rank=rank,
                   rank_pad=max(1, pl.next_power_of_2(rank)),
                   scaled=rank_scale is not None, scale=float(scale), indexed=n_ad > 1)
    if n_ad > 1:
      args.append(jnp.clip(jnp.reshape(lidx, (1,)).astype(jnp.int32), 0, n_ad - 1))
    args += [on.astype(jnp.int32), hp.astype(_F32), b_stack]
    if rank_scale is not None:
      args.append(rank_scale.astype(_F32))
  n_tiles = pl.cdiv(d, t.block)
  return pl.pallas_call(
      functools.partial(_kernel, t=t), grid=(n_tiles,),
      out_shape=jax.ShapeDtypeStruct((m, d), res.dtype),
      in_specs=[_WHOLE] * len(args), out_specs=_WHOLE,
      interpret=interpret, compiler_params=compiler_params, name="proj_finish",
  )(*args)


def finish_reference(yp, res, *, lora=None, scale=1.0):
  """`finish_call` in jnp: the same roundings."""
  y = sum_partials(yp.astype(_F32))
  plain = y.astype(res.dtype)
  if lora is not None:
    hp, b_stack, lidx, on, rank_scale = lora
    b = lax.dynamic_index_in_dim(b_stack, jnp.reshape(lidx, ()), 0, False).astype(_F32)
    h = sum_partials(hp.astype(_F32))
    if rank_scale is not None:
      h = h * rank_scale.astype(_F32)
    delta = lax.dot_general(h, b, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                            preferred_element_type=_F32)
    if scale != 1.0:
      delta = delta * scale
    plain = jnp.where((on != 0)[:, None], (y + delta).astype(res.dtype), plain)
  return (res.astype(_F32) + plain.astype(_F32)).astype(res.dtype)
