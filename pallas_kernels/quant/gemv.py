"""Pallas kernel: few-row y = x @ W^T over whole quant blocks (the "blocks" form).

The "rows" form (kernel.py) walks a weight one 32-column sub-block at a time and loads every
sub-block's scale as its own [bo] vector: ~20 small loads per K-quant super-block and row
tile, and on the H200 0.05-0.25 TB/s. This form loads, per loop step, U whole units (a Q8_0
block of 32 weights, a K-quant super-block of 256) of `block_out` rows as one tile per plane,
shaped by the unit's own structure, and takes the scales out of the inner sum:

    y[o] = sum_units sum_sub (d * s)[o, sub] * (sum_l q[o, sub, l] * x[sub, l])
                           - (dmin * m)[o, sub] * (sum_l x[sub, l])        (Q4_K / Q5_K)

with q the integer quant value (exact in fp32), x rounded to the compute dtype, the products
and sums in fp32. The planes are reshaped outside the kernel (free: row-major views) so that
every load is one N-D tile with no reshapes, slices or shuffles on chip:

    Q8_0  qs [S, out, NB, 32]           d [S, out, NB]
    Q4_K  qs [S, out, NB, 4, 32]        sc, mn [S, out, NB, 2, 4]   d, dmin [S, out, NB]
    Q5_K  + qh [S, out, NB, 32]
    Q6_K  qs [S, out, NB, 4, 2, 16]     qh [S, out, NB, 2, 2, 16]   sc [S, out, NB, 2, 4, 2]

(layout.py: K-quant byte j < 128 holds weight j low, j + 128 high; so "half" h in {0, 1}
picks the nibble, and x is viewed the same way: [G, M, NB, 2, 4, 32], Q6_K
[G, M, NB, 2, 4, 2, 16], Q8_0 [G, M, NB, 32].)

Numerics differ from the "rows" form (which rounds each dequantised weight to the compute
dtype before the product): here the weights stay exact and only the sums round, so a bf16
result is closer to the float64 product.

LoRA epilogue (`lora=True`, h = x A^T passed in): the program that sums the first share of
`in` (ks = 0) adds scale * B h to the rows whose switch is on, a select after the K loop, so
an off row's partial sums, and the XLA sum over them, are the plain call's bit for bit. A
program whose rows are all off, or with ks > 0, skips the B loads (`lax.cond`).

Grid (out tiles x k_split, G): program (ks * tiles + j, g) reads matrix idx[g] in place (a
traced layer / expert index; no slice copies) and runs its 1/k_split share of the loop
steps for all M rows; with k_split > 1 its fp32 partial sum goes to block ks * G + g and the
caller sums the blocks in a fixed order.

`groups_call` runs one launch over a stack whose layers come in several types (llama.cpp's
Q4_K_M gives some layers' ffn_down / attn_v more bits: `strata_jax.params.QGroups`, one stack
per type): every part's program is compiled in, and a flag in memory picks the layer's part
(`pl.when`), so the layer costs one launch, not one per part (`Forms.quant_groups="fused"`).

`dense_call` runs the same program over a plain float weight stack [S, out, in] (viewed as
[S, out, in / 32, 32]): a few-row GEMV that reads layer `idx[g]` of the stack in place, for
the dense projections of a decode step (`Forms.dense_weights="kernel"`); no slice of the
stack is copied, which XLA does for a matrix taken at a traced index inside the layer scan.
`dense_lora_call` adds a LoRA delta to it: A's rows as extra programs of the same launch,
then one finishing kernel (B h, the switch's select, the split sums; see there).
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (  # noqa: F401 (re-exported)
    masked_load,
    masked_store,
    sum_partials,
)
from pallas_kernels.lora.kernel import dot_policy
from pallas_kernels.quant.layout import BLOCK, PLANES
from pallas_kernels.quant.multi import Part, launch

try:  # the Triton lowering, as kernel.py
  from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover
  pltriton = None

_F32 = jnp.float32
_WHOLE = pl.BlockSpec()

# Trailing shape of each plane per unit, and of x per unit (module docstring).
UNIT_VIEW = {
    "q8_0": {"qs": (32,), "d": ()},
    "q4_k": {"qs": (4, 32), "sc": (2, 4), "mn": (2, 4), "d": (), "dmin": ()},
    "q5_k": {"qs": (4, 32), "qh": (32,), "sc": (2, 4), "mn": (2, 4), "d": (), "dmin": ()},
    "q6_k": {"qs": (4, 2, 16), "qh": (2, 2, 16), "sc": (2, 4, 2), "d": ()},
}
X_VIEW = {"q8_0": (32,), "q4_k": (2, 4, 32), "q5_k": (2, 4, 32), "q6_k": (2, 4, 2, 16)}
# A plain float weight ("dense"): one plane, units of 32 columns.
DENSE, DENSE_UNIT = "dense", 32
UNIT_VIEW[DENSE] = {"w": (DENSE_UNIT,)}
X_VIEW[DENSE] = (DENSE_UNIT,)
_PLANES = {**PLANES, DENSE: ("w",)}
_BLOCK = {**BLOCK, DENSE: DENSE_UNIT}


class Blocks(NamedTuple):
  """Static description of one call."""
  qtype: str
  groups: int  # G
  m: int  # rows per group, all in one program
  units: int  # NB: units per row
  d_out: int
  block_out: int  # bo
  unroll: int  # U: units per loop step
  k_split: int
  out_tiles: int
  cd: object  # x is rounded to this dtype
  out_dtype: object
  gated: bool = False
  lora: bool = False
  rank: int = 0
  rank_pad: int = 0
  scale: float = 1.0
  norm: bool = False  # x is the raw residual: its RMSNorm is made here (`dense_multi_call`)
  eps: float = 0.0
  glu: bool = False  # x is a GLU's gate g, with its up u beside it: x = silu(g) * u, made here


def triton_params(num_warps=None, num_stages=None):
  """Compiler params selecting the Triton lowering (without them JAX 0.11 picks Mosaic GPU)."""
  cls = getattr(pltriton, "CompilerParams", None) or pltriton.TritonCompilerParams
  return cls(num_warps=num_warps or 4, num_stages=num_stages or 3)


def plane_views(planes, qtype, units):
  """{name: [S, out, cols]} -> the N-D views the kernel indexes (free reshapes)."""
  return {name: p.reshape(p.shape[0], p.shape[1], units, *UNIT_VIEW[qtype][name])
          for name, p in planes.items()}


def tile_mask(row_ok, col_ok, rows, cols):
  """[rows, cols] mask from per-row / per-column masks (None: all in), or None if both are."""
  if row_ok is None and col_ok is None:
    return None
  row_ok = jnp.ones((rows,), jnp.bool_) if row_ok is None else row_ok
  col_ok = jnp.ones((cols,), jnp.bool_) if col_ok is None else col_ok
  return row_ok[:, None] & col_ok[None, :]


def _expand(v, ndim):
  """[bo] -> [bo, 1, ..., 1] of rank ndim."""
  return v[(slice(None),) + (None,) * (ndim - 1)]


def _sum_to_rows(v):
  """[bo, ...] -> [bo], one axis at a time (single-axis reductions lower everywhere)."""
  while v.ndim > 1:
    v = jnp.sum(v, axis=-1)
  return v


def _kernel(*refs, t: Blocks):
  pid, g = pl.program_id(0), pl.program_id(1)  # outside any branch
  if t.gated:
    active_ref, *refs = refs
    pl.when(active_ref[0] != 0)(lambda: _program(refs, pid, g, t))
  else:
    _program(refs, pid, g, t)


def _program(refs, pid, g, t: Blocks):
  names = _PLANES[t.qtype]
  idx_ref, x_ref, *rest = refs
  if t.glu:
    u_ref, *rest = rest
  if t.norm:
    nw_ref, *rest = rest
  planes = dict(zip(names, rest[:len(names)]))
  rest = rest[len(names):]
  if t.lora:
    on_ref, h_ref, b_ref, o_ref = rest
  else:
    (o_ref,) = rest
  bo, U = t.block_out, t.unroll
  ks, j = pid // t.out_tiles, pid % t.out_tiles
  o0 = j * bo
  o_ok = (o0 + jnp.arange(bo)) < t.d_out if t.d_out % bo else None
  s = idx_ref[g]
  n_steps = t.units // U // t.k_split

  # Static indices go in as int32 scalars: the interpreter's load / store discharge rules
  # reject plain Python ints among the indexers.
  def load(name, u0, *lead):
    """[bo, U, *rest] tile of a plane; `lead` fixes the first per-unit dims."""
    view = planes[name].at[(s, pl.ds(o0, bo), pl.ds(u0, U), *map(jnp.int32, lead))]
    shape = (bo, U, *UNIT_VIEW[t.qtype][name][len(lead):])
    mask = None if o_ok is None else jnp.broadcast_to(_expand(o_ok, len(shape)), shape)
    return masked_load(view, mask)

  inv = _row_inv_rms(x_ref, g, t) if t.norm else None

  def xload(r, u0, *lead):
    """[U, *rest] of row r of x, rounded to the compute dtype, as fp32."""
    ix = (g, jnp.int32(r), pl.ds(u0, U), *map(jnp.int32, lead))
    if t.norm:
      xn = _normed(x_ref.at[ix][...], inv[r], nw_ref.at[pl.ds(u0, U)][...])
      return xn.astype(t.cd).astype(_F32)
    if t.glu:
      return glu_product(x_ref.at[ix][...], u_ref.at[ix][...]).astype(t.cd).astype(_F32)
    return x_ref.at[ix][...].astype(t.cd).astype(_F32)

  def body(step, accs):
    u0 = (ks * n_steps + step) * U
    accs = list(accs)
    if t.qtype == DENSE:
      w = load("w", u0).astype(t.cd).astype(_F32)  # [bo, U, 32]
      for r in range(t.m):
        accs[r] = accs[r] + _sum_to_rows(w * xload(r, u0)[None])
      return tuple(accs)
    if t.qtype == "q8_0":
      q = load("qs", u0).astype(_F32)  # [bo, U, 32]
      d = load("d", u0).astype(_F32)  # [bo, U]
      for r in range(t.m):
        accs[r] = accs[r] + _sum_to_rows(d * jnp.sum(q * xload(r, u0)[None], axis=-1))
      return tuple(accs)
    d = load("d", u0).astype(_F32)  # [bo, U]
    qs = load("qs", u0).astype(jnp.int32)
    if t.qtype == "q6_k":
      shifts = (2 * jnp.arange(4, dtype=jnp.int32))[None, None, :, None, None]
      for h in range(2):
        v = qs & 15 if h == 0 else qs >> 4  # [bo, U, 4, 2, 16]
        top = (load("qh", u0, h).astype(jnp.int32)[:, :, None] >> shifts) & 3
        val = ((v | (top << 4)) - 32).astype(_F32)
        scale = d[:, :, None, None] * load("sc", u0, h).astype(_F32)  # [bo, U, 4, 2]
        for r in range(t.m):
          dot = jnp.sum(val * xload(r, u0, h)[None], axis=-1)
          accs[r] = accs[r] + _sum_to_rows(scale * dot)
      return tuple(accs)
    dmin = load("dmin", u0).astype(_F32)
    qh = load("qh", u0).astype(jnp.int32)[:, :, None] if t.qtype == "q5_k" else None
    for half in range(2):
      v = qs & 15 if half == 0 else qs >> 4  # [bo, U, 4, 32]
      if qh is not None:  # bit 4 half + k of byte l: the 5th bit of sub-block 4 half + k
        sh = (4 * half + jnp.arange(4, dtype=jnp.int32))[None, None, :, None]
        v = v | (((qh >> sh) & 1) << 4)
      vf = v.astype(_F32)
      scale = d[:, :, None] * load("sc", u0, half).astype(_F32)  # [bo, U, 4]
      mins = dmin[:, :, None] * load("mn", u0, half).astype(_F32)
      for r in range(t.m):
        xh = xload(r, u0, half)  # [U, 4, 32]
        dot = jnp.sum(vf * xh[None], axis=-1)  # [bo, U, 4]
        accs[r] = accs[r] + _sum_to_rows(scale * dot - mins * jnp.sum(xh, axis=-1)[None])
    return tuple(accs)

  accs = lax.fori_loop(0, n_steps, body, tuple(jnp.zeros((bo,), _F32) for _ in range(t.m)))
  if t.lora:
    accs = _lora_epilogue(accs, on_ref, h_ref, b_ref, ks, o0, o_ok, t)
  out = ks * t.groups + g
  for r in range(t.m):
    masked_store(o_ref.at[out, jnp.int32(r), pl.ds(o0, bo)], accs[r].astype(t.out_dtype), o_ok)


def glu_product(g, u):
  """A SiLU-GLU's hidden row in the model's roundings: silu(g) in fp32, rounded to g's dtype,
  times u (one rounding of the exact product of two values of that dtype). The shared
  expert's XLA form (`strata_jax.model.moe._glu`) and the GEMV that makes it as it loads its
  x (`Forms.shared_glu` "in_down") both call this."""
  h = jax.nn.silu(g.astype(_F32)).astype(g.dtype)
  return (h.astype(_F32) * u.astype(_F32)).astype(g.dtype)


def _normed(x, inv, w):
  """rms_norm's roundings on a tile of x (any float dtype): (x * inv) * w in fp32, rounded
  once to x's dtype."""
  return (x.astype(_F32) * inv * w.astype(_F32)).astype(x.dtype)


def _row_inv_rms(x_ref, g, t: Blocks):
  """[rsqrt(mean(x[r]^2) + eps) for each row r] (fp32 scalars) of a dense call's x [G, M,
  units, 32]: every program reads the whole row (a few KB, from L2), U units a step, so that
  its share of the product can normalise its share of x."""
  U = t.unroll

  def body(step, sums):
    return tuple(s + jnp.sum(jnp.square(x_ref.at[g, jnp.int32(r), pl.ds(step * U, U)][...]
                                        .astype(_F32)), axis=0)
                 for r, s in enumerate(sums))

  sums = lax.fori_loop(0, t.units // U, body,
                       tuple(jnp.zeros((DENSE_UNIT,), _F32) for _ in range(t.m)))
  return [lax.rsqrt(jnp.sum(s) / (t.units * DENSE_UNIT) + t.eps) for s in sums]


def _groups_kernel(*refs, ts):
  """One launch over a mixed-type stack: part `group` (read from memory) runs its program."""
  pid, g = pl.program_id(0), pl.program_id(1)  # outside any branch
  _groups_program(refs, pid, g, ts)


def _groups_program(refs, pid, g, ts):
  group_ref, idx_ref, *rest = refs
  tail = rest[-4:] if ts[0].lora else rest[-1:]  # (LoRA refs,) output
  start = 0
  for gi, t in enumerate(ts):
    n = 1 + len(_PLANES[t.qtype])  # x's view of this part's type, then its planes
    part = rest[start:start + n]
    start += n
    pl.when(group_ref[0] == gi)(
        functools.partial(_program, [idx_ref, *part, *tail], pid, g, t))


def _lora_epilogue(accs, on_ref, h_ref, b_ref, ks, o0, o_ok, t: Blocks):
  """accs[r] + scale * B h[r] where row r's switch is on (in the ks = 0 program only)."""
  rp = t.rank_pad
  r_in = (jnp.arange(rp) < t.rank) if t.rank != rp else None
  ons = [on_ref[jnp.int32(r)] != 0 for r in range(t.m)]
  any_on = ons[0]
  for v in ons[1:]:
    any_on = any_on | v

  def with_delta(accs):
    mask = tile_mask(o_ok, r_in, t.block_out, rp)
    bt = masked_load(b_ref.at[pl.ds(o0, t.block_out), pl.ds(0, rp)], mask).astype(_F32)
    out = []
    for r in range(t.m):
      h = masked_load(h_ref.at[jnp.int32(r), pl.ds(0, rp)], r_in).astype(_F32)  # [Rp]
      delta = jnp.sum(bt * h[None, :], axis=1)  # [bo]
      if t.scale != 1.0:
        delta = delta * t.scale
      # A select, never acc + 0 * delta: off rows keep the plain kernel's bits.
      out.append(jnp.where(ons[r], accs[r] + delta, accs[r]))
    return tuple(out)

  return lax.cond(any_on & (ks == 0), with_delta, lambda a: tuple(a), tuple(accs))


def blocks_call(x, planes, idx, *, qtype, d_out, block_out, unroll, k_split, cd, out_dtype,
                active=None, interpret=False, compiler_params=None, on=None, h=None, b=None,
                scale=1.0, up=None):
  """[k_split * G, M, out] (fp32 partials when k_split > 1) of the "blocks" form; the caller
  (kernel.qmatmul_pallas) validates the arguments and sums the partials. With `on` [M], `h`
  [M, R] fp32 and `b` [out, R]: the LoRA epilogue (G must be 1). With `up` (x's shape and
  dtype): the product is of `glu_product(x, up)`, made as each program loads its x."""
  groups, m, d_in = x.shape
  t = _blocks(x.shape, qtype, d_out=d_out, block_out=block_out, unroll=unroll,
              k_split=k_split, cd=cd, out_dtype=out_dtype)._replace(gated=active is not None)
  units, n_out = t.units, t.out_tiles
  if on is not None:
    rank = b.shape[1]
    t = t._replace(lora=True, rank=rank, rank_pad=max(1, pl.next_power_of_2(rank)),
                   scale=float(scale))
  views = plane_views(planes, qtype, units)
  xs = [x.reshape(groups, m, units, *X_VIEW[qtype])]
  if up is not None:
    if up.shape != x.shape or up.dtype != x.dtype:
      raise ValueError(f"gemv: the GLU's up {up.shape} {up.dtype} must be x's "
                       f"{x.shape} {x.dtype}")
    t = t._replace(glu=True)
    xs.append(up.reshape(xs[0].shape))
  args = [idx, *xs, *(views[n] for n in _PLANES[qtype])]
  if on is not None:
    args += [on.astype(jnp.int32), h.astype(_F32), b]
  if active is not None:
    args = [jnp.reshape(jnp.asarray(active, jnp.int32), (1,)), *args]
  return pl.pallas_call(
      functools.partial(_kernel, t=t),
      grid=(n_out * k_split, groups),
      out_shape=jax.ShapeDtypeStruct((k_split * groups, m, d_out), t.out_dtype),
      in_specs=[_WHOLE] * len(args), out_specs=_WHOLE,
      interpret=interpret, compiler_params=compiler_params, name=f"qgemv_{qtype}",
  )(*args)


def _blocks(x_shape, qtype, *, d_out, block_out, unroll, k_split, cd, out_dtype):
  """The Blocks of a "blocks" call of x [G, M, in] (fp32 partials when k_split > 1)."""
  groups, m, d_in = x_shape
  return Blocks(qtype=qtype, groups=groups, m=m, units=d_in // _BLOCK[qtype], d_out=d_out,
                block_out=block_out, unroll=unroll, k_split=k_split,
                out_tiles=pl.cdiv(d_out, block_out), cd=cd,
                out_dtype=_F32 if k_split > 1 else out_dtype)


def _groups_inputs(x, parts, group, idx, *, d_out, block_out, k_split, cd, out_dtype):
  """(Blocks per part, the inputs in the order `_groups_program` reads them) of a groups
  launch: `parts` ((qtype, planes, unroll), ...)."""
  ts, args = [], [jnp.reshape(jnp.asarray(group, jnp.int32), (1,)), idx]
  for qtype, planes, unroll in parts:
    t = _blocks(x.shape, qtype, d_out=d_out, block_out=block_out, unroll=unroll,
                k_split=k_split, cd=cd, out_dtype=out_dtype)
    views = plane_views(planes, qtype, t.units)
    ts.append(t)
    args += [x.reshape(t.groups, t.m, t.units, *X_VIEW[qtype]),
             *(views[n] for n in _PLANES[qtype])]
  return ts, args


def groups_call(x, parts, group, idx, *, d_out, block_out, k_split, cd, out_dtype,
                interpret=False, compiler_params=None, on=None, h=None, b=None, scale=1.0):
  """`blocks_call` over a mixed-type stack in one launch: `parts` ((qtype, planes, unroll),
  ...), `group` an int32 scalar (which part holds the matrices), idx [G] their indices in that
  part. Every part shares block_out and k_split, so each computes what its own `blocks_call`
  would."""
  groups, m, _ = x.shape
  ts, args = _groups_inputs(x, parts, group, idx, d_out=d_out, block_out=block_out,
                            k_split=k_split, cd=cd, out_dtype=out_dtype)
  if on is not None:
    rank = b.shape[1]
    ts = [t._replace(lora=True, rank=rank, rank_pad=max(1, pl.next_power_of_2(rank)),
                     scale=float(scale)) for t in ts]
    args += [on.astype(jnp.int32), h.astype(_F32), b]
  return pl.pallas_call(
      functools.partial(_groups_kernel, ts=tuple(ts)),
      grid=(ts[0].out_tiles * k_split, groups),
      out_shape=jax.ShapeDtypeStruct((k_split * groups, m, d_out), ts[0].out_dtype),
      in_specs=[_WHOLE] * len(args), out_specs=_WHOLE,
      interpret=interpret, compiler_params=compiler_params, name="qgemv_groups",
  )(*args)


def blocks_part(x, planes, idx, *, qtype, d_out, block_out, unroll, k_split, cd, out_dtype):
  """`blocks_call`'s programs for x [M, in] (one group, idx [1]) as a `multi.Part` of a
  launch with other products: its output [k_split, M, out] is that call's, bit for bit."""
  m, _ = x.shape
  t = _blocks((1, *x.shape), qtype, d_out=d_out, block_out=block_out, unroll=unroll,
              k_split=k_split, cd=cd, out_dtype=out_dtype)
  views = plane_views(planes, qtype, t.units)
  args = (idx, x.reshape(1, m, t.units, *X_VIEW[qtype]), *(views[n] for n in _PLANES[qtype]))
  return Part(functools.partial(_one_group_program, t=t), t.out_tiles * k_split, args,
              jax.ShapeDtypeStruct((k_split, m, d_out), t.out_dtype))


def groups_part(x, parts, group, idx, *, d_out, block_out, k_split, cd, out_dtype):
  """`groups_call`'s programs for x [G, M, in] as a `multi.Part` (its 2-D grid laid out
  flat, tiles first as there): the output [k_split * G, M, out] is that call's, bit for bit."""
  groups, m, _ = x.shape
  ts, args = _groups_inputs(x, parts, group, idx, d_out=d_out, block_out=block_out,
                            k_split=k_split, cd=cd, out_dtype=out_dtype)
  n_tiles = ts[0].out_tiles * k_split
  return Part(functools.partial(_groups_flat_program, ts=tuple(ts), n_tiles=n_tiles),
              n_tiles * groups, tuple(args),
              jax.ShapeDtypeStruct((k_split * groups, m, d_out), ts[0].out_dtype))


def _groups_flat_program(refs, pid, *, ts, n_tiles):
  _groups_program(refs, pid % n_tiles, pid // n_tiles, ts)


def _dense_unroll(units, block_in):
  """Units of 32 columns a step: block_in's worth, a power of 2 dividing the row."""
  want = max(1, block_in // DENSE_UNIT)
  return next(u for u in (64, 32, 16, 8, 4, 2, 1) if u <= want and units % u == 0)


# The least columns a GEMV loop step takes when `dense_defaults` narrows it to fill the grid.
MIN_STEP_COLS = 128


def dense_defaults(d_out, d_in, *, groups=1, interpret=False):
  """(block_out, unroll, k_split) of `dense_call`: 16-row tiles, 512 columns a step, `in`
  split until the grid has 512 programs (as `kernel.blocks_defaults`); a matrix too small for
  that (the shared expert's down projection, 512 columns: 128 programs of one step) takes
  narrower steps, down to MIN_STEP_COLS, so that `in` splits further. Interpret: big tiles."""
  units = d_in // DENSE_UNIT
  bo, bk = (min(128, max(16, pl.next_power_of_2(d_out))), 2048) if interpret else (16, 512)
  unroll = _dense_unroll(units, bk)
  tiles = -(-d_out // bo) * groups
  while True:
    steps, ks = units // unroll, 1
    while not interpret and ks < 8 and tiles * ks < 512 and steps % (2 * ks) == 0:
      ks *= 2
    if (interpret or tiles * ks >= 512 or unroll * DENSE_UNIT <= MIN_STEP_COLS
        or units % (unroll // 2)):
      return bo, unroll, ks
    unroll //= 2


def _dense_tiling(d_out, d_in, *, groups=1, block_out=None, block_in=None, k_split=None,
                  interpret=False):
  """(block_out, unroll, k_split) of a dense GEMV call: `dense_defaults` with what was given."""
  bo, unroll, ks = dense_defaults(d_out, d_in, groups=groups, interpret=interpret)
  if block_in is not None:
    unroll = _dense_unroll(d_in // DENSE_UNIT, block_in)
  ks = int(k_split or ks)
  if (d_in // DENSE_UNIT // unroll) % ks:
    raise ValueError(f"dense gemv: k_split={ks} does not divide the loop steps")
  return block_out or bo, unroll, ks


def _dense_cd(dtype):
  """The dense GEMV's compute dtype: x's if 16-bit, else fp32 (exact IEEE products)."""
  dt = jnp.dtype(dtype)
  return dt if dt in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) else jnp.dtype(_F32)


def dense_call(x, stack, idx, *, block_out=None, block_in=None, k_split=None,
               interpret=False, compiler_params=None, partials=False, up=None):
  """y[g] = x[g] @ stack[idx[g]]^T for x [G, M, in] and a float stack [S, out, in] (in a
  multiple of 32), in x's dtype, fp32 sums (split partials added in index order); the matrix
  is read in place. The weight and x are rounded to the compute dtype (x's if 16-bit, else
  fp32: exact IEEE products) first. (`dense_lora_call`: with the LoRA delta.)
  partials: return the split partial sums [k_split, G, M, out] unsummed (fp32 when split;
  `sum_partials` of them, cast to x's dtype, is the plain result), for a consumer kernel that
  adds them itself. up (x's shape): the product is of `glu_product(x, up)` (a SiLU-GLU's
  gate and up), made in the kernel as it loads x."""
  groups, m, d_in = x.shape
  n_mats, d_out, w_in = stack.shape
  if w_in != d_in or d_in % DENSE_UNIT:
    raise ValueError(f"dense gemv: x {x.shape} and stack {stack.shape} need a shared `in` "
                     f"that is a multiple of {DENSE_UNIT}")
  bo, unroll, ks = _dense_tiling(d_out, d_in, groups=groups, block_out=block_out,
                                 block_in=block_in, k_split=k_split, interpret=interpret)
  if compiler_params is None and not interpret:
    compiler_params = triton_params()
  dt, cd = jnp.dtype(x.dtype), _dense_cd(x.dtype)
  idx = jnp.clip(idx.astype(jnp.int32), 0, n_mats - 1)
  y = blocks_call(x, {"w": stack}, idx, qtype=DENSE, d_out=d_out, block_out=bo,
                  unroll=unroll, k_split=ks, cd=cd, out_dtype=dt, interpret=interpret,
                  compiler_params=compiler_params, up=up)
  if partials:
    return y.reshape(ks, groups, m, d_out)
  if ks > 1:
    y = sum_partials(y.reshape(ks, groups, m, d_out)).astype(dt)
  return y


def _one_group_program(refs, pid, *, t):
  _program(refs, pid, jnp.int32(0), t)


def dense_multi_call(x, stacks, idx, *, tiles=None, interpret=False, compiler_params=None,
                     partials=False, norm=None, x_dtypes=None, normed_out=False):
  """[dense_call(x[None], s, idx)[0] for s in stacks] in one launch (`multi.launch`): x
  [M, in], every stack [S_m, out_m, in], idx [1] int32. Each part keeps its own call's tiling
  (`dense_defaults`, or tiles[m]: {block_out, block_in, k_split}), so each result is that
  call's bit for bit. partials: each part's split partial sums [k_split, M, out] unsummed
  (fp32 when split), for a consumer kernel that adds them (`sum_partials`, then x's dtype).
  norm: (w [in], eps): x is the raw residual and the products are of rms_norm(x, w, eps),
  made in each program (`_row_inv_rms`; the reference's roundings, its sum of squares in
  another order), so no XLA kernels make it first (`Forms.input_norm` "in_proj").
  x_dtypes (with norm): per part, the dtype its call's x has: the normed row (x's dtype)
  converted to it, exactly, as `dense_call(h.astype(x_dtype))` (the router's fp32 product,
  `Forms.moe_norm`). normed_out (with norm): one program more writes the normed rows
  h [M, in] in x's dtype, returned after the products, for the readers outside the launch."""
  m, d_in = x.shape
  if d_in % DENSE_UNIT:
    raise ValueError(f"dense gemv: x {x.shape}: `in` must be a multiple of {DENSE_UNIT}")
  if norm is not None and jnp.shape(norm[0]) != (d_in,):
    raise ValueError(f"dense gemv: norm weight {jnp.shape(norm[0])} must be [{d_in}]")
  if norm is None and (x_dtypes is not None or normed_out):
    raise ValueError("dense gemv: x_dtypes and normed_out are for a launch that makes the norm")
  if compiler_params is None and not interpret:
    compiler_params = triton_params()
  units = d_in // DENSE_UNIT
  xv = x.reshape(1, m, units, DENSE_UNIT)
  nw = () if norm is None else (jnp.reshape(norm[0], (units, DENSE_UNIT)),)
  eps = 0.0 if norm is None else float(norm[1])
  parts, splits, dts = [], [], []
  for j, stack in enumerate(stacks):
    n_mats, d_out, w_in = stack.shape
    if w_in != d_in:
      raise ValueError(f"dense gemv: x {x.shape} and stack {stack.shape} need a shared `in`")
    dt = jnp.dtype(x.dtype if x_dtypes is None else x_dtypes[j])
    bo, unroll, ks = _dense_tiling(d_out, d_in, interpret=interpret,
                                   **(tiles[j] if tiles else {}))
    t = Blocks(qtype=DENSE, groups=1, m=m, units=units, d_out=d_out, block_out=bo,
               unroll=unroll, k_split=ks, out_tiles=pl.cdiv(d_out, bo), cd=_dense_cd(dt),
               out_dtype=_F32 if ks > 1 else dt, norm=norm is not None, eps=eps)
    i = jnp.clip(jnp.reshape(idx, (1,)).astype(jnp.int32), 0, n_mats - 1)
    parts.append(Part(functools.partial(_one_group_program, t=t), t.out_tiles * ks,
                      (i, xv, *nw, stack.reshape(n_mats, d_out, units, DENSE_UNIT)),
                      jax.ShapeDtypeStruct((ks, m, d_out), t.out_dtype)))
    splits.append(ks)
    dts.append(dt)
  if normed_out:
    t = Blocks(qtype=DENSE, groups=1, m=m, units=units, d_out=0, block_out=0,
               unroll=_dense_unroll(units, 512), k_split=1, out_tiles=1, cd=x.dtype,
               out_dtype=x.dtype, norm=True, eps=eps)
    parts.append(Part(functools.partial(_normed_rows_program, t=t), 1, (xv, *nw),
                      jax.ShapeDtypeStruct((m, units, DENSE_UNIT), x.dtype)))
  ys = list(launch(parts, name="qgemv_dense_multi", interpret=interpret,
                   compiler_params=compiler_params))
  extra = [ys.pop().reshape(m, d_in)] if normed_out else []
  if partials:
    return ys + extra
  return [sum_partials(y).astype(dt) if ks > 1 else y[0]
          for y, ks, dt in zip(ys, splits, dts)] + extra


def _normed_rows_program(refs, pid, *, t):
  """h = rms_norm(x, w, eps) [M, units, 32] in x's dtype: the rows the products of the launch
  read, for readers outside it (one program)."""
  del pid
  x_ref, nw_ref, h_ref = refs
  inv = _row_inv_rms(x_ref, jnp.int32(0), t)
  U = t.unroll

  def body(step, carry):
    cols = pl.ds(step * U, U)
    w = nw_ref.at[cols][...]
    for r in range(t.m):
      h_ref.at[jnp.int32(r), cols][...] = _normed(x_ref.at[0, jnp.int32(r), cols][...],
                                                  inv[r], w)
    return carry

  lax.fori_loop(0, t.units // U, body, 0)


# The LoRA rows in the GEMV's launch: the adapter's down projection h = A x is R more output
# rows of the same few-row product, so it rides in the projection's launch as extra programs
# reading the adapter's A stack in place; the partial sums of both then go to one finishing
# kernel that adds them in order, adds B h (B read in place) on the rows whose switch is on,
# and rounds once. A decode step's adapted projection is two launches (the GEMV and the
# finish), where the plain projection with split sums is two as well (the GEMV and XLA's sum
# of its partials) and the LoRA ops apart from the GEMV add the slices of A and B, the dots
# and a select.
def _lora_rows_kernel(*refs, n_main, main, main_tiles, ta, b_copy):
  """Grid (main_tiles + A's tiles) x k_split: `main(refs, pid, g)` (the weight's program,
  writing the first output) for the first main_tiles of each share of `in`, A's dense
  program (the second output) for the rest; then, with `b_copy` (block, tiles), that many
  programs copying B = b_stack[lidx] into the third output, a tile of rows each."""
  pid, g = pl.program_id(0), pl.program_id(1)  # outside any branch
  main_refs = list(refs[:n_main])
  lidx_ref, xa_ref, a_ref, *rest = refs[n_main:]
  b_ref, yp_ref, hp_ref, bc_ref = rest if b_copy else (None, *rest, None)
  tiles = main_tiles + ta.out_tiles
  ks, j = pid // tiles, pid % tiles
  products = pid < tiles * ta.k_split

  pl.when(products & (j < main_tiles))(
      lambda: main([*main_refs, yp_ref], ks * main_tiles + j, g))
  pl.when(products & (j >= main_tiles))(lambda: _program(
      [lidx_ref, xa_ref, a_ref, hp_ref], ks * ta.out_tiles + (j - main_tiles), g, ta))
  if b_copy:
    pl.when(jnp.logical_not(products))(
        lambda: _copy_b_tile(lidx_ref, b_ref, bc_ref, pid - tiles * ta.k_split, b_copy[0]))


def _copy_b_tile(lidx_ref, b_ref, bc_ref, i, block):
  """Rows [i * block, (i + 1) * block) of b_stack[lidx] [out, R] into bc [1, out, R]: what
  the finishing kernel then reads at a static index, so B's tile does not wait on the layer
  index there (this launch waits on it instead, beside the products)."""
  _, d_out, rank = bc_ref.shape
  rp = max(1, pl.next_power_of_2(rank))
  r0 = i * block
  ok = (r0 + jnp.arange(block)) < d_out if d_out % block else None
  mask = tile_mask(ok, (jnp.arange(rp) < rank) if rank != rp else None, block, rp)
  tile = masked_load(b_ref.at[lidx_ref[0], pl.ds(r0, block), pl.ds(0, rp)], mask)
  masked_store(bc_ref.at[jnp.int32(0), pl.ds(r0, block), pl.ds(0, rp)], tile, mask)


def _a_unroll(units, k_split, block_in=512):
  """A's units of 32 columns a loop step: block_in's worth, fewer until k_split divides the
  steps (A's share of `in` is then the weight's)."""
  u = _dense_unroll(units, block_in)
  while u > 1 and (units // u) % k_split:
    u //= 2
  return u


def lora_rows_call(main, main_args, main_tiles, x, a_stack, lidx, *, d_out, k_split,
                   block_out, interpret, compiler_params, name, b_stack=None):
  """(yp [k_split, M, d_out], hp [k_split, M, R]) fp32 partial sums: `main` over
  `main_args` (the weight's program and inputs, its out_dtype fp32), and h = A x with A =
  a_stack[lidx] [R, in] read in place, both in one launch. x [M, in]: A's products are over
  x and A rounded to x's 16-bit dtype when A has it too, else fp32 (`lora.kernel.dot_policy`).
  With b_stack [L, d_out, R], the launch also copies B = b_stack[lidx] out, and returns it
  third, [1, d_out, R] (`_copy_b_tile`)."""
  m, d_in = x.shape
  n_ad, rank, a_in = a_stack.shape
  if a_in != d_in or d_in % DENSE_UNIT:
    raise ValueError(f"lora rows: x {x.shape} and A {a_stack.shape} need a shared `in` "
                     f"that is a multiple of {DENSE_UNIT}")
  units = d_in // DENSE_UNIT
  unroll = _a_unroll(units, k_split)
  if (units // unroll) % k_split:
    raise ValueError(f"lora rows: k_split={k_split} does not divide A's loop steps")
  cd_a = jnp.dtype(dot_policy(x.dtype, a_stack.dtype)[0])
  bo_a = min(block_out, max(1, pl.next_power_of_2(rank))) if interpret else block_out
  ta = Blocks(qtype=DENSE, groups=1, m=m, units=units, d_out=rank, block_out=bo_a,
              unroll=unroll, k_split=k_split, out_tiles=pl.cdiv(rank, bo_a), cd=cd_a,
              out_dtype=_F32)
  lidx = jnp.clip(jnp.reshape(lidx, (1,)).astype(jnp.int32), 0, n_ad - 1)
  args = [*main_args, lidx, x.reshape(1, m, units, DENSE_UNIT),
          a_stack.reshape(n_ad, rank, units, DENSE_UNIT)]
  outs = [jax.ShapeDtypeStruct((k_split, m, d_out), _F32),
          jax.ShapeDtypeStruct((k_split, m, rank), _F32)]
  b_copy = None
  if b_stack is not None:
    if b_stack.shape != (n_ad, d_out, rank):
      raise ValueError(f"lora rows: B {b_stack.shape} must be [{n_ad}, {d_out}, {rank}]")
    block = min(128, pl.next_power_of_2(d_out))
    b_copy = (block, pl.cdiv(d_out, block))
    args.append(b_stack)
    outs.append(jax.ShapeDtypeStruct((1, d_out, rank), b_stack.dtype))
  return pl.pallas_call(
      functools.partial(_lora_rows_kernel, n_main=len(main_args), main=main,
                        main_tiles=main_tiles, ta=ta, b_copy=b_copy),
      grid=((main_tiles + ta.out_tiles) * k_split + (b_copy[1] if b_copy else 0), 1),
      out_shape=tuple(outs),
      in_specs=[_WHOLE] * len(args), out_specs=tuple(_WHOLE for _ in outs),
      interpret=interpret, compiler_params=compiler_params, name=name,
  )(*args)


class Finish(NamedTuple):
  """Static description of the LoRA finishing kernel."""
  m: int
  d_out: int
  block_out: int
  k_split: int
  rank: int
  rank_pad: int
  out_dtype: object
  scaled: bool
  scale: float = 1.0


def _lora_finish_kernel(lidx_ref, on_ref, yp_ref, hp_ref, b_ref, *rest, t: Finish):
  rs_ref, o_ref = rest if t.scaled else (None, *rest)
  o0 = pl.program_id(0) * t.block_out
  o_ok = (o0 + jnp.arange(t.block_out)) < t.d_out if t.d_out % t.block_out else None
  r_in = (jnp.arange(t.rank_pad) < t.rank) if t.rank != t.rank_pad else None
  mask = tile_mask(o_ok, r_in, t.block_out, t.rank_pad)
  lay = lidx_ref[0]
  bt = masked_load(b_ref.at[lay, pl.ds(o0, t.block_out), pl.ds(0, t.rank_pad)], mask)
  bt = bt.astype(_F32)  # [bo, Rp]
  for r in range(t.m):
    ri = jnp.int32(r)
    y = masked_load(yp_ref.at[jnp.int32(0), ri, pl.ds(o0, t.block_out)], o_ok)
    h = masked_load(hp_ref.at[jnp.int32(0), ri, pl.ds(0, t.rank_pad)], r_in)
    for k in range(1, t.k_split):  # in index order, as `sum_partials`
      y = y + masked_load(yp_ref.at[jnp.int32(k), ri, pl.ds(o0, t.block_out)], o_ok)
      h = h + masked_load(hp_ref.at[jnp.int32(k), ri, pl.ds(0, t.rank_pad)], r_in)
    if t.scaled:
      h = h * masked_load(rs_ref.at[ri, pl.ds(0, t.rank_pad)], r_in)
    delta = jnp.sum(bt * h[None, :], axis=1)  # [bo]
    if t.scale != 1.0:
      delta = delta * t.scale
    # A select, never y + 0 * delta: an off row keeps the plain projection's bits.
    val = jnp.where(on_ref[ri] != 0, (y + delta).astype(t.out_dtype), y.astype(t.out_dtype))
    masked_store(o_ref.at[ri, pl.ds(o0, t.block_out)], val, o_ok)


def lora_finish(yp, hp, b_stack, lidx, on, rank_scale=None, *, out_dtype, scale=1.0,
                block=None, interpret=False, compiler_params=None):
  """y [M, out] in out_dtype from `lora_rows_call`'s partials: y = sum(yp), h = sum(hp) (each
  in index order, as `sum_partials`), times rank_scale [M, R] when given; on rows
  round(y + scale * B h) with B = b_stack[lidx] [out, R] read in place, off rows round(y)."""
  ks, m, d_out = yp.shape
  n_ad, b_out, rank = b_stack.shape
  if b_out != d_out or hp.shape != (ks, m, rank) or on.shape != (m,):
    raise ValueError(f"lora finish: B {b_stack.shape}, h {hp.shape} and on {on.shape} must "
                     f"be [L, {d_out}, R], [{ks}, {m}, R] and [{m}]")
  fb = block or (min(1024, pl.next_power_of_2(d_out)) if interpret else 128)
  t = Finish(m=m, d_out=d_out, block_out=fb, k_split=ks, rank=rank,
             rank_pad=max(1, pl.next_power_of_2(rank)), out_dtype=jnp.dtype(out_dtype),
             scaled=rank_scale is not None, scale=float(scale))
  lidx = jnp.clip(jnp.reshape(lidx, (1,)).astype(jnp.int32), 0, n_ad - 1)
  args = [lidx, on.astype(jnp.int32), yp, hp, b_stack]
  if rank_scale is not None:
    args.append(rank_scale.astype(_F32))
  return pl.pallas_call(
      functools.partial(_lora_finish_kernel, t=t),
      grid=(pl.cdiv(d_out, fb),),
      out_shape=jax.ShapeDtypeStruct((m, d_out), t.out_dtype),
      in_specs=[_WHOLE] * len(args), out_specs=_WHOLE,
      interpret=interpret, compiler_params=compiler_params, name="lora_finish",
  )(*args)


def dense_lora_call(x, stack, idx, a_stack, b_stack, lidx, on, rank_scale=None, *,
                    block_out=None, block_in=None, k_split=None, finish_block=None,
                    interpret=False, compiler_params=None):
  """y = x @ stack[idx]^T, plus B h on the rows whose switch is on, h = A x (times
  rank_scale [M, R] when given), with A = a_stack[lidx] [R, in] and B = b_stack[lidx]
  [out, R] read in place, like the weight: x [M, in] (one group), idx and lidx [1] int32,
  on [M] int32. Two launches: the GEMV with A's rows as extra programs (fp32 partials of
  both, `dense_lora_rows`), then `lora_finish`. Off rows are `dense_call`'s bits."""
  if compiler_params is None and not interpret:
    compiler_params = triton_params()
  yp, hp = dense_lora_rows(x, stack, idx, a_stack, b_stack, lidx, on, block_out=block_out,
                           block_in=block_in, k_split=k_split, interpret=interpret,
                           compiler_params=compiler_params)
  return lora_finish(yp, hp, b_stack, lidx, on, rank_scale, out_dtype=x.dtype,
                     block=finish_block, interpret=interpret, compiler_params=compiler_params)


def dense_lora_rows(x, stack, idx, a_stack, b_stack, lidx, on, *, block_out=None,
                    block_in=None, k_split=None, interpret=False, compiler_params=None,
                    copy_b=False):
  """`dense_lora_call`'s first launch: (yp [k_split, M, out], hp [k_split, M, R]) fp32 split
  partial sums of x @ stack[idx]^T (`dense_call`'s tiling, so that `sum_partials` of yp,
  rounded to x's dtype, is its result bit for bit) and of h = A x, for a kernel that
  finishes them (`lora_finish`, `finish.finish_call`); with copy_b, third, B =
  b_stack[lidx] as [1, out, R], copied by the same launch (`lora_rows_call`)."""
  m, d_in = x.shape
  n_mats, d_out, w_in = stack.shape
  if w_in != d_in or d_in % DENSE_UNIT:
    raise ValueError(f"dense lora gemv: x {x.shape} and stack {stack.shape} need a shared "
                     f"`in` that is a multiple of {DENSE_UNIT}")
  if b_stack.shape != (a_stack.shape[0], d_out, a_stack.shape[1]) or on.shape != (m,):
    raise ValueError(f"dense lora gemv: A {a_stack.shape}, B {b_stack.shape} and on "
                     f"{on.shape} must be [L, R, {d_in}], [L, {d_out}, R] and [{m}]")
  bo, unroll, ks = _dense_tiling(d_out, d_in, block_out=block_out, block_in=block_in,
                                 k_split=k_split, interpret=interpret)
  units = d_in // DENSE_UNIT
  if compiler_params is None and not interpret:
    compiler_params = triton_params()
  cd = _dense_cd(x.dtype)
  tw = Blocks(qtype=DENSE, groups=1, m=m, units=units, d_out=d_out, block_out=bo,
              unroll=unroll, k_split=ks, out_tiles=pl.cdiv(d_out, bo), cd=cd, out_dtype=_F32)
  idx = jnp.clip(jnp.reshape(idx, (1,)).astype(jnp.int32), 0, n_mats - 1)
  main_args = [idx, x.reshape(1, m, units, DENSE_UNIT),
               stack.reshape(n_mats, d_out, units, DENSE_UNIT)]
  return lora_rows_call(functools.partial(_program, t=tw), main_args, tw.out_tiles, x,
                        a_stack, lidx, d_out=d_out, k_split=ks, block_out=bo,
                        interpret=interpret, compiler_params=compiler_params,
                        name="qgemv_dense_lora_rows", b_stack=b_stack if copy_b else None)


def blocks_lora_call(x, planes, idx, a_stack, b_stack, lidx, on, rank_scale=None, *, qtype,
                     d_out, block_out, unroll, k_split, cd, out_dtype, scale=1.0,
                     interpret=False, compiler_params=None):
  """`blocks_call` on one group (x [M, in], idx [1]) with the LoRA delta in two launches: the
  "blocks" program of `qtype` with A's rows beside it (`lora_rows_call`), then `lora_finish`.
  Off rows are the plain call's bits when its split partials are added by `sum_partials`."""
  m, d_in = x.shape
  units = d_in // _BLOCK[qtype]
  tw = Blocks(qtype=qtype, groups=1, m=m, units=units, d_out=d_out, block_out=block_out,
              unroll=unroll, k_split=k_split, out_tiles=pl.cdiv(d_out, block_out), cd=cd,
              out_dtype=_F32)
  views = plane_views(planes, qtype, units)
  main_args = [idx, x.reshape(1, m, units, *X_VIEW[qtype]), *(views[n] for n in _PLANES[qtype])]
  yp, hp = lora_rows_call(functools.partial(_program, t=tw), main_args, tw.out_tiles, x,
                          a_stack, lidx, d_out=d_out, k_split=k_split, block_out=block_out,
                          interpret=interpret, compiler_params=compiler_params,
                          name=f"qgemv_{qtype}_lora_rows")
  return lora_finish(yp, hp, b_stack, lidx, on, rank_scale, out_dtype=out_dtype, scale=scale,
                     interpret=interpret, compiler_params=compiler_params)


def groups_lora_call(x, parts, group, idx, a_stack, b_stack, lidx, on, rank_scale=None, *,
                     d_out, block_out, k_split, cd, out_dtype, scale=1.0, interpret=False,
                     compiler_params=None):
  """`groups_call` on one group (x [M, in]) with the LoRA delta as `blocks_lora_call`: every
  part's program and A's rows in one launch, then `lora_finish`."""
  n_out = pl.cdiv(d_out, block_out)
  ts, main_args = _groups_inputs(x[None], parts, group, idx, d_out=d_out, block_out=block_out,
                                 k_split=k_split, cd=cd, out_dtype=_F32)
  yp, hp = lora_rows_call(functools.partial(_groups_program, ts=tuple(ts)), main_args, n_out,
                          x, a_stack, lidx, d_out=d_out, k_split=k_split,
                          block_out=block_out, interpret=interpret,
                          compiler_params=compiler_params, name="qgemv_groups_lora_rows")
  return lora_finish(yp, hp, b_stack, lidx, on, rank_scale, out_dtype=out_dtype, scale=scale,
                     interpret=interpret, compiler_params=compiler_params)
