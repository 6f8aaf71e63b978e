"""Pallas LoRA kernel: y[n] = base[n] + scale * B @ (s[n] * (A @ x[n])) where on[n] != 0,
else base[n].

Shapes: x [N, Din], base [N, Dout], a [R, Din], b [Dout, R], on [N] int32, and the optional
per-row rank scale s [N, R] float32 (punica/BGMV-style adapter table: several adapters share the
rank axis, and each row scales each adapter's columns; None means all ones). The math, the
backend choice (Pallas Triton lowering) and the measured numbers are in this folder's README.

The file reads top to bottom: two shared pieces of kernel math (`_down`: h = x @ A^T over Din
tiles; `_up_store`: y = select(on, base + h @ B^T, base) over Dout tiles), the three kernel
bodies that use them (fused, and the two halves of the split-Din form), then the jitted
wrapper with its input checks and block-size choice.

Everything a Triton program touches is a power-of-2 tile: rows are padded to `block_rows`,
the rank to `Rp = next_pow2(R)`, Din and Dout to whole tiles. Padding is never materialized:
every load is masked (out-of-range elements read as 0, which is exact for the contraction
dims) and every store is masked, so any N, R, Din and Dout work. In interpret mode the
same masks apply to blocks Pallas pads with NaN, which the tests rely on to catch leaks.
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (SQUEEZED, compensated_add, pltriton, require_triton,
                                    triton_params)

_F32 = jnp.float32
_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_FLOATS = (jnp.dtype(jnp.float32), *_HALF)
_NT = (((1,), (1,)), ((), ()))  # lhs @ rhs^T without materializing a transpose
_MIN_TILE = 16  # tl.dot needs every dim >= 16
# Default tiling (`tiling`), chosen from the probe's sweep on an H200 (README, "Tiling").
_SMEM_BUDGET = 160 * 1024  # bytes of pipelined x/A tiles per program (H200: 227 KiB)
_DIN_SPLITS = 8  # Din splits (programs per row block in the down kernel)
_F32_CHAIN = 1024  # fp32 operands: at most this many Din columns summed in one chain
_DECODE_DOUT_SPLITS = 5  # Dout splits for one row block, and the floor otherwise
_UP_PROGRAMS = 100  # row blocks x Dout splits to aim at when there are several row blocks
_MAX_DIN_SPLITS = 32  # the up kernel sums the partials unrolled


def dot_policy(x_dtype, a_dtype):
  """Operand dtype and precision of the x @ A^T product (accumulation is always fp32).

  Two 16-bit operands of one dtype multiply natively (their products are exact in fp32);
  anything else is promoted to fp32 and multiplied at HIGHEST precision (IEEE fp32, not
  TF32). The second product keeps h in fp32 (`up_product`).
  """
  cd = jnp.promote_types(x_dtype, a_dtype)
  if cd in _HALF:
    return cd, lax.Precision.DEFAULT
  return jnp.dtype(_F32), lax.Precision.HIGHEST


def up_product(h, b):
  """h [M, Rp] fp32 times b [Bo, Rp] transposed -> [M, Bo] fp32.

  bf16 b: h is split as hi + lo, both bf16 (together h to 2^-17 relative), and the two
  products run on the tensor cores with fp32 accumulation; b itself is exact, so this is
  an fp32 product to ~1e-5 relative, not a bf16 one. Other b: fp32 at HIGHEST.
  """
  if b.dtype == jnp.bfloat16:
    hi = h.astype(jnp.bfloat16)
    lo = (h - hi.astype(_F32)).astype(jnp.bfloat16)
    return (lax.dot_general(hi, b, _NT, preferred_element_type=_F32)
            + lax.dot_general(lo, b, _NT, preferred_element_type=_F32))
  return lax.dot_general(h, b.astype(_F32), _NT, precision=lax.Precision.HIGHEST,
                         preferred_element_type=_F32)


def _and(*masks):
  """AND of the masks that are not None (None: statically all-true)."""
  out = None
  for m in masks:
    if m is not None:
      out = m if out is None else out & m
  return out


def _col(v):
  return None if v is None else v[:, None]


def _row(v):
  return None if v is None else v[None, :]


def _load(ref, mask):
  """Masked load: out-of-range elements read as 0 (exact for the contraction dims)."""
  if mask is None:
    return ref[...]
  zero = jnp.zeros((), ref.dtype)
  if pltriton is None:  # interpret-only fallback: Pallas pads blocks, so a plain read is safe
    return jnp.where(mask, ref[...], zero)
  return pltriton.load(ref, mask=mask, other=zero)


def _store(ref, val, mask):
  if mask is None:
    ref[...] = val
  elif pltriton is None:
    ref[...] = jnp.where(mask, val, ref[...])
  else:
    pltriton.store(ref, val, mask=mask)


def _row_flags(on_ref, n_rows, block_rows):
  """Row validity (None when N divides into blocks) and the on flag of this row block."""
  rows = pl.program_id(0) * block_rows + jnp.arange(block_rows)
  row_ok = rows < n_rows if n_rows % block_rows else None
  on = _load(on_ref, row_ok) != 0  # [bn] bool; padded rows read 0: off
  any_on = jnp.max(on.astype(jnp.int32)) > 0
  return row_ok, on, any_on


def _down(x_ref, a_ref, row_ok, col0, t):
  """h = x @ A^T over this program's `t.in_tiles` Din tiles from column `col0`. -> [bn, Rp]."""
  bn, rp, bk = t.block_rows, t.rank_pad, t.block_in
  r_ok = jnp.arange(rp) < t.rank if t.rank != rp else None

  # fp32 operands: a long Din chain (one split over 4096 columns) is summed compensated
  kahan = jnp.dtype(t.cd) == jnp.dtype(_F32)

  def body(k, carry):
    h, comp = carry
    cols = col0 + k * bk + jnp.arange(bk)
    col_ok = cols < t.d_in if t.in_ragged else None
    sl = pl.ds(k * bk, bk)
    xk = _load(x_ref.at[:, sl], _and(_col(row_ok), _row(col_ok)))  # [bn, bk]
    ak = _load(a_ref.at[:, sl], _and(_col(r_ok), _row(col_ok)))  # [Rp, bk]
    part = lax.dot_general(xk.astype(t.cd), ak.astype(t.cd), _NT, precision=t.precision,
                           preferred_element_type=_F32)
    return compensated_add(h, comp, part) if kahan else (h + part, comp)

  zeros = jnp.zeros((bn, rp), _F32)
  h, _ = lax.fori_loop(0, t.in_tiles, body, (zeros, zeros if kahan else jnp.zeros((), _F32)))
  return h


def _up_store(h, b_ref, base_ref, o_ref, row_ok, on, out0, t):
  """o = select(on, base + scale * h @ B^T, base) over `t.out_tiles` Dout tiles from `out0`."""
  rp, bo, scale = t.rank_pad, t.block_out, t.scale
  r_ok = jnp.arange(rp) < t.rank if t.rank != rp else None

  def body(j, carry):
    outs = out0 + j * bo + jnp.arange(bo)
    out_ok = outs < t.d_out if t.out_ragged else None
    sl = pl.ds(j * bo, bo)
    bj = _load(b_ref.at[sl, :], _and(_col(out_ok), _row(r_ok)))  # [bo, Rp]
    d = up_product(h, bj)  # [bn, bo] fp32
    if scale != 1.0:
      d = d * scale
    m = _and(_col(row_ok), _row(out_ok))
    base = _load(base_ref.at[:, sl], m)
    # A select, never base + 0 * delta: off rows keep base's bits (-0.0, and no inf/NaN).
    y = jnp.where(on[:, None], (base.astype(_F32) + d).astype(o_ref.dtype), base)
    _store(o_ref.at[:, sl], y, m)
    return carry

  lax.fori_loop(0, t.out_tiles, body, 0)


def _scale_rows(h, rs_ref, row_ok, t):
  """h [bn, Rp] times the row block's rank scales (s[n, r]; padding reads 0); no-op without."""
  if rs_ref is None:
    return h
  r_ok = jnp.arange(t.rank_pad) < t.rank if t.rank != t.rank_pad else None
  return h * _load(rs_ref, _and(_col(row_ok), _row(r_ok))).astype(_F32)


def _split_refs(refs, t):
  """(on_ref, rs_ref or None, the other refs): the rank-scale operand follows `on` when used."""
  if t.row_scaled:
    return refs[0], refs[1], refs[2:]
  return refs[0], None, refs[1:]


def _fused_kernel(*refs, t):
  """One program: a row block x a range of Dout tiles; h is recomputed per Dout range."""
  on_ref, rs_ref, (x_ref, a_ref, b_ref, base_ref, o_ref) = _split_refs(refs, t)
  row_ok, on, any_on = _row_flags(on_ref, t.n, t.block_rows)
  out0 = pl.program_id(1) * t.out_span  # program ids are read outside `when` (interpret)

  @pl.when(any_on)  # an all-off block writes nothing: o aliases base
  def _():
    h = _scale_rows(_down(x_ref, a_ref, row_ok, 0, t), rs_ref, row_ok, t)
    _up_store(h, b_ref, base_ref, o_ref, row_ok, on, out0, t)


def _split_down_kernel(on_ref, x_ref, a_ref, h_ref, *, t):
  """One program: a row block x one Din split; writes that split's partial h [bn, Rp]."""
  row_ok, _, any_on = _row_flags(on_ref, t.n, t.block_rows)
  col0 = pl.program_id(1) * t.in_span

  @pl.when(any_on)  # all-off: the partial stays unwritten, and the up kernel skips it too
  def _():
    h_ref[...] = _down(x_ref, a_ref, row_ok, col0, t)


def _split_up_kernel(*refs, t):
  """One program: a row block x a range of Dout tiles; sums the Din partials in order, then
  applies the rank scales (when given) to the sum."""
  on_ref, rs_ref, (h_ref, b_ref, base_ref, o_ref) = _split_refs(refs, t)
  row_ok, on, any_on = _row_flags(on_ref, t.n, t.block_rows)
  out0 = pl.program_id(1) * t.out_span

  @pl.when(any_on)
  def _():
    h = h_ref[0]  # unrolled, fixed order: every load can be in flight at once
    for s in range(1, t.din_splits):
      h = h + h_ref[s]
    h = _scale_rows(h, rs_ref, row_ok, t)
    _up_store(h, b_ref, base_ref, o_ref, row_ok, on, out0, t)


class Tiling(NamedTuple):
  """Static tiling of one call; `tiling()` derives it, the kernel bodies close over it."""
  n: int
  d_in: int
  d_out: int
  rank: int
  rank_pad: int  # Rp: rank rounded up to a power of 2 >= 16
  block_rows: int  # bn
  block_in: int  # bk: Din tile
  block_out: int  # bo: Dout tile
  din_splits: int  # programs along Din (1: fused kernel)
  dout_splits: int  # programs along Dout
  in_tiles: int  # Din tiles per program
  out_tiles: int  # Dout tiles per program
  cd: object = jnp.float32  # operand dtype of x @ A^T
  precision: object = None
  scale: float = 1.0
  row_scaled: bool = False  # a per-row rank scale operand s [N, R] follows `on`

  @property
  def in_span(self):
    return self.in_tiles * self.block_in

  @property
  def out_span(self):
    return self.out_tiles * self.block_out

  @property
  def in_ragged(self):
    return self.din_splits * self.in_span != self.d_in

  @property
  def out_ragged(self):
    return self.dout_splits * self.out_span != self.d_out

  @property
  def row_blocks(self):
    return pl.cdiv(self.n, self.block_rows)


def tiling(n, d_in, d_out, rank, *, interpret=False, in_itemsize=2, b_itemsize=2,
           num_stages=3, block_rows=None, block_in=None, block_out=None, din_splits=None,
           dout_splits=None):
  """Pick tiles: given values win; None means the defaults measured on an H200 (README).

  Compiled (GPU): bn = 16 / 32 / 64 by N; bk the largest power of 2 <= 256 whose x and A
  tiles, num_stages deep, fit `_SMEM_BUDGET`; bo = 128, halved while the up pass's [bo, Rp] B
  tiles (num_stages deep, plus one converted copy) exceed it: with 4 rank-50 adapters on one
  table (Rp 256) the H200 refused 280-336 KiB requests (gpu_tests_run7_failures.txt). Din
  splits: `_DIN_SPLITS` (fp32 operands: also at most `_F32_CHAIN` columns per split, which
  bounds the sequential fp32 accumulation). Dout splits: `_DECODE_DOUT_SPLITS` for a single
  row block, else about `_UP_PROGRAMS` programs in all, at least `_DECODE_DOUT_SPLITS`.
  Interpret (CPU): few,
  large steps, as each interpreted grid step costs ~0.1 ms and splits only add steps.
  """
  rp = _pow2_at_least(rank)
  if interpret:
    bn = block_rows or min(128, _pow2_at_least(n))
    bk = block_in or min(512, _pow2_at_least(d_in))
    bo = block_out or min(512, _pow2_at_least(d_out))
  else:
    bn = block_rows or (16 if n <= 16 else 32 if n <= 64 else 64)
    bk = block_in or 256
    while block_in is None and bk > _MIN_TILE and (
        (bn + rp) * bk * in_itemsize * num_stages > _SMEM_BUDGET):
      bk //= 2
    bk = min(bk, _pow2_at_least(d_in))
    bo = block_out or min(128, _pow2_at_least(d_out))
    while block_out is None and bo > _MIN_TILE and (
        bo * rp * b_itemsize * (num_stages + 1) > _SMEM_BUDGET):
      bo //= 2
  row_blocks = pl.cdiv(n, bn)
  in_all, out_all = pl.cdiv(d_in, bk), pl.cdiv(d_out, bo)
  if interpret:
    din_splits, dout_splits = din_splits or 1, dout_splits or 1
  if din_splits is None:
    din_splits = _DIN_SPLITS
    if in_itemsize == 4:
      din_splits = max(din_splits, pl.cdiv(d_in, _F32_CHAIN))
  if dout_splits is None:
    dout_splits = _DECODE_DOUT_SPLITS
    if row_blocks > 1:
      dout_splits = max(dout_splits, _UP_PROGRAMS // row_blocks)
  s = min(din_splits, in_all, _MAX_DIN_SPLITS)
  g = min(dout_splits, out_all)
  in_tiles, out_tiles = pl.cdiv(in_all, s), pl.cdiv(out_all, g)
  return Tiling(n=n, d_in=d_in, d_out=d_out, rank=rank, rank_pad=rp, block_rows=bn,
                block_in=bk, block_out=bo, din_splits=pl.cdiv(in_all, in_tiles),
                dout_splits=pl.cdiv(out_all, out_tiles), in_tiles=in_tiles,
                out_tiles=out_tiles)


def check_lora_inputs(base, x, a, b, on, rank_scale=None):
  """Validate shapes and dtypes; raise ValueError naming the offending operand."""
  for name, arr in (("base", base), ("x", x), ("a", a), ("b", b)):
    if arr.ndim != 2:
      raise ValueError(f"lora: {name} must be 2-D, got shape {arr.shape}")
    if jnp.dtype(arr.dtype) not in _FLOATS:
      raise ValueError(f"lora: {name} dtype {arr.dtype} is not float32, float16 or bfloat16")
  if on.ndim != 1:
    raise ValueError(f"lora: on must be 1-D [N], got shape {on.shape}")
  if not (jnp.issubdtype(on.dtype, jnp.integer) or on.dtype == jnp.bool_):
    raise ValueError(f"lora: on must be int32 (bool or another integer dtype is accepted), "
                     f"got {on.dtype}")
  n, d_in = x.shape
  r, d_out = a.shape[0], base.shape[1]
  if base.shape[0] != n or on.shape[0] != n:
    raise ValueError(f"lora: row counts differ: x {x.shape}, base {base.shape}, on {on.shape}")
  if a.shape[1] != d_in:
    raise ValueError(f"lora: a {a.shape} must be [R, Din] with Din = x.shape[1] = {d_in}")
  if b.shape != (d_out, r):
    raise ValueError(f"lora: b {b.shape} must be [Dout, R] = {(d_out, r)} "
                     f"(Dout from base {base.shape}, R from a {a.shape})")
  if rank_scale is not None:
    if rank_scale.shape != (n, r):
      raise ValueError(f"lora: rank_scale {rank_scale.shape} must be [N, R] = {(n, r)}")
    if jnp.dtype(rank_scale.dtype) not in _FLOATS:
      raise ValueError(f"lora: rank_scale dtype {rank_scale.dtype} is not a float dtype")


def _pow2_at_least(v, lo=_MIN_TILE):
  return max(lo, pl.next_power_of_2(v))


@functools.partial(jax.jit, static_argnames=(
    "scale", "block_rows", "block_in", "block_out", "din_splits", "dout_splits", "num_warps",
    "num_stages", "interpret", "backend"))
def lora_pallas(base, x, a, b, on, rank_scale=None, *, scale=1.0, block_rows=None,
                block_in=None, block_out=None, din_splits=None, dout_splits=None,
                num_warps=None, num_stages=None, interpret=False, backend="triton"):
  """y = where(on != 0, base + scale * (rank_scale * (x @ a^T)) @ b^T, base), fp32 accumulation.

  Args:
    base: [N, Dout] float32/float16/bfloat16; the output has its dtype. Its buffer is
      aliased to the output (in place inside jit when base is not used again).
    x: [N, Din] float activations.
    a: [R, Din] LoRA down projection (any of the three float dtypes).
    b: [Dout, R] LoRA up projection, adapter scale(s) already folded in.
    on: [N] int32 switch per row (bool or other integers are compared with 0).
    rank_scale: [N, R] float per-row scale of each rank column (h = x @ a^T is multiplied by
      it in fp32 before the up projection), or None (all ones: exactly the unscaled kernel).
      Several adapters stacked on the rank axis become per-row choices this way.
    scale: static extra factor on the delta (the model passes 1.0).
    block_rows, block_in, block_out: power-of-2 tiles (>= 16) over N, Din and Dout.
    din_splits: programs along Din. 1 runs one fused kernel; > 1 runs two (partial h per
      Din split, then sum + up projection + select), spreading decode work over the GPU.
    dout_splits: programs along Dout. None picks any of these from the shapes (`tiling`).
    num_warps, num_stages: Triton compiler parameters (ignored in interpret mode).
    interpret: run the Pallas interpreter (CPU).
    backend: "triton", the Pallas GPU lowering this kernel is written for (README).

  Returns:
    [N, Dout] in base.dtype; rows with on == 0 are bit-identical to base.
  """
  check_lora_inputs(base, x, a, b, on, rank_scale)
  if backend != "triton":
    raise ValueError(f"lora: backend {backend!r} is not supported; only 'triton' (README)")
  for name, v in (("block_rows", block_rows), ("block_in", block_in), ("block_out", block_out)):
    if v is not None and (v < _MIN_TILE or v & (v - 1)):
      raise ValueError(f"lora: {name}={v} must be a power of 2 >= {_MIN_TILE}")
  for name, v in (("din_splits", din_splits), ("dout_splits", dout_splits)):
    if v is not None and v < 1:
      raise ValueError(f"lora: {name}={v} must be >= 1")
  require_triton(interpret, "lora", "implementation='xla'")
  on = on.astype(jnp.int32)
  n, d_in = x.shape
  rank, d_out = a.shape[0], base.shape[1]
  if n == 0 or rank == 0:  # a zero delta; still a select, so off rows keep their bits
    return jnp.where((on != 0)[:, None], (base.astype(_F32) + 0.0).astype(base.dtype), base)

  cd, precision = dot_policy(x.dtype, a.dtype)
  stages, warps = num_stages or 3, num_warps or 8
  t = tiling(n, d_in, d_out, rank, interpret=interpret, in_itemsize=jnp.dtype(cd).itemsize,
             b_itemsize=jnp.dtype(b.dtype).itemsize, num_stages=stages, block_rows=block_rows,
             block_in=block_in, block_out=block_out, din_splits=din_splits,
             dout_splits=dout_splits)._replace(cd=cd, precision=precision, scale=float(scale),
                                               row_scaled=rank_scale is not None)
  bn, rp = t.block_rows, t.rank_pad
  params = None if interpret else triton_params(warps, stages)
  call = functools.partial(pl.pallas_call, interpret=interpret, compiler_params=params)

  on_spec = pl.BlockSpec((bn,), lambda i, j: (i,))
  b_spec = pl.BlockSpec((t.out_span, rp), lambda i, j: (j, 0))
  out_spec = pl.BlockSpec((bn, t.out_span), lambda i, j: (i, j))
  out_shape = jax.ShapeDtypeStruct(base.shape, base.dtype)
  # the rank scales, when given, ride right after `on` ([bn, Rp] tiles of s [N, R])
  rs_in = [rank_scale.astype(_F32)] if rank_scale is not None else []
  rs_spec = [pl.BlockSpec((bn, rp), lambda i, j: (i, 0))] if rank_scale is not None else []
  if t.din_splits == 1:
    return call(
        functools.partial(_fused_kernel, t=t), grid=(t.row_blocks, t.dout_splits),
        out_shape=out_shape,
        in_specs=[on_spec, *rs_spec,
                  pl.BlockSpec((bn, t.in_span), lambda i, j: (i, 0)),  # x
                  pl.BlockSpec((rp, t.in_span), lambda i, j: (0, 0)),  # a
                  b_spec, out_spec],  # b, base
        out_specs=out_spec, input_output_aliases={4 + len(rs_in): 0}, name="lora_fused",
    )(on, *rs_in, x, a, b, base)

  h_part = call(  # [S, row_blocks * bn, Rp] fp32 partial sums of h over Din splits
      functools.partial(_split_down_kernel, t=t), grid=(t.row_blocks, t.din_splits),
      out_shape=jax.ShapeDtypeStruct((t.din_splits, t.row_blocks * bn, rp), _F32),
      in_specs=[on_spec,
                pl.BlockSpec((bn, t.in_span), lambda i, k: (i, k)),  # x
                pl.BlockSpec((rp, t.in_span), lambda i, k: (0, k))],  # a
      out_specs=pl.BlockSpec((SQUEEZED, bn, rp), lambda i, k: (k, i, 0)), name="lora_down",
  )(on, x, a)
  return call(
      functools.partial(_split_up_kernel, t=t), grid=(t.row_blocks, t.dout_splits),
      out_shape=out_shape,
      in_specs=[on_spec, *rs_spec,
                pl.BlockSpec((t.din_splits, bn, rp), lambda i, j: (0, i, 0)), b_spec, out_spec],
      out_specs=out_spec, input_output_aliases={3 + len(rs_in): 0}, name="lora_up",
  )(on, *rs_in, h_part, b, base)
