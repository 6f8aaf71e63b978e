"""Pallas kernel: y = x @ W^T with W in the repacked quant layout, dequantised inside the kernel.

Shapes: x [G, M, in] (G groups of M rows), planes [S, out, cols] (the weight stack with its
leading dims flattened), idx [G] int32 (the matrix of each group), y [G, M, out] in x.dtype.
A plain projection is G = 1; the MoE experts are G = token x expert pairs of M = 1 row.

Grid (out tiles, G, row tiles). Program (j, g, i) reads s = idx[g] from memory, then loops
over the `in` axis one super-block (Q8_0: up to 8 blocks) per step; each step loads the
[block_out, W]-column tiles of the quant planes of matrix s straight from the whole stack
(`ref.at[s, rows, cols]`: a pointer offset, no slice copy), dequantises each tile to the
compute dtype and multiplies it with the matching [block_rows, W] tile of x, summing in fp32.
W is one sub-block (32 columns; Q6_K 16), so every scale is a per-row vector broadcast along
the tile's columns: no reshapes, gathers or shuffles on chip. The layout (layout.py) pairs
weight j with weight j + 128 of a block in one byte, so one byte tile serves two sub-blocks.

Compute dtype: 16-bit x: weights are dequantised in fp32 (exact), rounded to x.dtype and
multiplied on the tensor cores with fp32 accumulation. fp32 x: fp32 weights and an IEEE fp32
product (precision HIGHEST) unless `precision` says otherwise.

LoRA epilogue (`lora` != "none"): y = where(on[m], (acc + scale * h @ B^T), acc) per row,
a select, so an off row is the plain kernel's value bit for bit (the acc is computed by the
same code). h = x @ A^T is either computed inside the same K loop from A ("a": x tiles are
reused, but every program reads all of A) or passed in ("h": computed once outside). A row
block with no row on skips the B loads (`lax.cond`).

Every tile is a power of 2 (>= 16) and every load / store of a ragged edge is masked; the
`in` axis never is (it is whole blocks).
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import compensated_add
from pallas_kernels.lora.kernel import dot_policy, up_product
from pallas_kernels.quant import gemv
from pallas_kernels.quant.layout import BLOCK, PLANES
from pallas_kernels.quant.multi import launch

try:  # Deprecated in JAX 0.11 but the Pallas GPU path the other kernels use (lora README).
  from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - a future JAX without the Triton backend
  pltriton = None

_F32 = jnp.float32
_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_FLOATS = (jnp.dtype(jnp.float32), *_HALF)
_NT = (((1,), (1,)), ((), ()))  # lhs @ rhs^T
_MIN_TILE = 16  # tl.dot needs every dim >= 16
_MIN_ROWS_OUT = 4  # the "rows" form has no tl.dot: output tiles down to 4 rows
ROWS_MIN_PROGRAMS = 1024  # "rows" default tiles shrink until the grid has this many programs
_WHOLE = pl.BlockSpec()  # a whole array (a pointer): the kernel indexes it itself
LORA_MODES = ("none", "a", "h")


class Tiling(NamedTuple):
  """Static description of one call; the kernel body closes over it."""
  qtype: str
  groups: int  # G
  m: int  # rows per group
  d_in: int
  d_out: int
  block_rows: int  # bn
  block_out: int  # bo
  unroll: int  # units per loop step (unit: a Q8_0 32-block, or a K-quant super-block)
  form: str  # "dot" (row tiles >= 16 on the tensor cores) or "rows" (a few rows, GEMV)
  cd: object  # operand dtype of the weight product
  precision: object
  out_dtype: object
  lora: str = "none"
  rank: int = 0
  rank_pad: int = 0
  a_cd: object = None  # operand dtype / precision of x @ A^T ("a" mode)
  a_precision: object = None
  scale: float = 1.0
  k_split: int = 1  # programs per output tile along `in`, each summing its share of steps
  gated: bool = False  # an "active" flag in memory: 0 makes every program return at once
  out_tiles: int = 1  # output tiles per matrix (grid axis 0 is out_tiles * k_split)

  @property
  def row_ragged(self):
    return self.form == "dot" and self.m % self.block_rows != 0

  @property
  def out_ragged(self):
    return self.d_out % self.block_out != 0


def _and(a, b):
  if a is None:
    return b
  return a if b is None else a & b


_load = gemv.masked_load  # out-of-range elements read as 0


def _store(view, val, mask):
  if mask is None:
    view[...] = val
  elif pltriton is None:
    view[...] = jnp.where(mask, val, view[...])
  else:
    pltriton.store(view, val, mask=mask)


def _col(v):
  return None if v is None else v[:, None]


def _row(v):
  return None if v is None else v[None, :]


class _Tiles:
  """Loads of one program's tiles: rows [o0, o0 + bo) of matrix s, rows [r0, r0 + bn) of x."""

  def __init__(self, refs, s, g, o0, r0, o_ok, r_ok, t, ks=0):
    self.refs, self.s, self.g, self.o0, self.r0 = refs, s, g, o0, r0
    self.o_ok, self.r_ok, self.t = o_ok, r_ok, t
    self.ks = ks  # this program's share of `in` (k_split)

  def vec(self, name, col):
    """[bo] column `col` of a plane, as fp32."""
    view = self.refs[name].at[self.s, pl.ds(self.o0, self.t.block_out), col]
    return _load(view, self.o_ok).astype(_F32)

  def tile(self, name, col, width):
    """[bo, width] tile of a plane from column `col` (raw integer values, int32)."""
    view = self.refs[name].at[self.s, pl.ds(self.o0, self.t.block_out), pl.ds(col, width)]
    return _load(view, _col(self.o_ok)).astype(jnp.int32)

  def x(self, col, width):
    """[bn, width] tile of x in the compute dtype."""
    view = self.refs["x"].at[self.g, pl.ds(self.r0, self.t.block_rows), pl.ds(col, width)]
    return _load(view, _col(self.r_ok)).astype(self.t.cd)


def _sub_tiles(tl, b, t):
  """The weight tiles of unit b (a Q8_0 block or a K-quant super-block):
  [(x column, [bo, W] weights in fp32)].

  Every product here is exact in fp32 (f16 scale x integer sub-scale x integer quant value:
  at most 23 significant bits), so these are the exact dequantised weights.
  """
  q = t.qtype
  if q == "q8_0":
    return [(b * 32, tl.vec("d", b)[:, None] * tl.tile("qs", b * 32, 32).astype(_F32))]
  c0 = b * 256  # first column of super-block b
  d = tl.vec("d", b)
  if q in ("q4_k", "q5_k"):
    dmin = tl.vec("dmin", b)
    qh = tl.tile("qh", b * 32, 32) if q == "q5_k" else None  # bit i: weight 32 i + l
    out = []
    for k in range(4):
      byte = tl.tile("qs", b * 128 + 32 * k, 32)  # weights 32k + l (low), 128 + 32k + l
      for half in range(2):
        sub = 4 * half + k  # sub-block of 32 weights
        v = byte & 15 if half == 0 else byte >> 4
        if qh is not None:
          v = v | (((qh >> sub) & 1) << 4)
        scale = d * tl.vec("sc", b * 8 + sub)
        mins = dmin * tl.vec("mn", b * 8 + sub)
        out.append((c0 + 32 * sub, scale[:, None] * v.astype(_F32) - mins[:, None]))
    return out
  # q6_k: 16-column tiles; weight 128 h + 16 u + l (u < 8, l < 16) has its low 4 bits in byte
  # 16 u + l (nibble h) and its top 2 in byte 32 h + 16 (u % 2) + l (bits 2 (u // 2)).
  qh = [[tl.tile("qh", b * 64 + 32 * half + 16 * p, 16) for p in range(2)] for half in range(2)]
  out = []
  for u in range(8):
    byte = tl.tile("qs", b * 128 + 16 * u, 16)
    for half in range(2):
      v = byte & 15 if half == 0 else byte >> 4
      v = v | (((qh[half][u % 2] >> (2 * (u // 2))) & 3) << 4)
      scale = d * tl.vec("sc", b * 16 + 8 * half + u)
      out.append((c0 + 128 * half + 16 * u, scale[:, None] * (v - 32).astype(_F32)))
  return out


def _units(qtype, d_in):
  return d_in // BLOCK[qtype]


def _unroll(qtype, d_in, block_in):
  """Blocks per loop step: block_in's worth, rounded down to a power of 2 dividing the row."""
  want = max(1, block_in // BLOCK[qtype])
  return next(u for u in (64, 32, 16, 8, 4, 2, 1) if u <= want and _units(qtype, d_in) % u == 0)


def _kernel(*refs, t):
  pids = (pl.program_id(0), pl.program_id(1), pl.program_id(2))  # outside any branch
  if t.gated:   # a call that only runs when its flag is set (one group of a mixed stack)
    active_ref, *refs = refs
    pl.when(active_ref[0] != 0)(lambda: _program(refs, pids, t))
  else:
    _program(refs, pids, t)


def _program(refs, pids, t):
  names = PLANES[t.qtype]
  idx_ref, x_ref, *rest = refs
  planes = dict(zip(names, rest[:len(names)]))
  rest = rest[len(names):]
  if t.lora == "none":
    (o_ref,) = rest
    lora_refs = None
  else:
    *lora_refs, o_ref = rest
  bn, bo = t.block_rows, t.block_out
  j, g, i = pids
  ks = j // t.out_tiles  # this program's share of `in` (0 without a split)
  j = j % t.out_tiles
  o0, r0 = j * bo, i * bn
  o_ok = (o0 + jnp.arange(bo)) < t.d_out if t.out_ragged else None
  r_ok = (r0 + jnp.arange(bn)) < t.m if t.row_ragged else None
  s = idx_ref[g]
  tl = _Tiles({**planes, "x": x_ref}, s, g, o0, r0, o_ok, r_ok, t, ks)
  form = _dot_form if t.form == "dot" else _rows_form
  form(tl, lora_refs, o_ref, t)


def _k_loop(tl, t, body, init):
  """fori_loop over this program's loop steps: all of them, or its 1/k_split share (its
  partial sum goes to output block ks * G + g, and the caller sums the k_split blocks)."""
  n = _units(t.qtype, t.d_in) // t.unroll // t.k_split
  if t.k_split == 1:
    return lax.fori_loop(0, n, body, init)
  return lax.fori_loop(0, n, lambda step, c: body(tl.ks * n + step, c), init)


def _out_group(tl, t):
  return tl.g if t.k_split == 1 else tl.ks * t.groups + tl.g


def _step_tiles(tl, step, t):
  tiles = []
  for u in range(t.unroll):  # all of a step's loads first: more bytes in flight
    tiles += _sub_tiles(tl, step * t.unroll + u, t)
  return tiles


def _dot_form(tl, lora_refs, o_ref, t):
  """Rows padded to a >= 16-row tile; one tl.dot per weight tile (tensor cores)."""
  bn, bo, rp = t.block_rows, t.block_out, t.rank_pad
  r_in = (jnp.arange(rp) < t.rank) if t.rank != rp else None
  if lora_refs is not None:
    on_ref, ah_ref, b_ref = lora_refs

  # fp32 operands: the tiles' products are summed compensated (a plain sum over 64 Q6_K tiles
  # missed the fp32 bound on the H200; compensated, run 8 passed)
  kahan = t.cd == jnp.dtype(_F32)

  def body(step, carry):
    acc, comp, h = carry
    for col, w in _step_tiles(tl, step, t):
      xk = tl.x(col, w.shape[1])
      part = lax.dot_general(xk, w.astype(t.cd), _NT, precision=t.precision,
                             preferred_element_type=_F32)
      acc, comp = compensated_add(acc, comp, part) if kahan else (acc + part, comp)
      if t.lora == "a":
        ak = _load(ah_ref.at[pl.ds(0, rp), pl.ds(col, w.shape[1])], _col(r_in))
        h = h + lax.dot_general(xk.astype(t.a_cd), ak.astype(t.a_cd), _NT,
                                precision=t.a_precision, preferred_element_type=_F32)
    return acc, comp, h

  acc0 = jnp.zeros((bn, bo), _F32)
  comp0 = jnp.zeros((bn, bo), _F32) if kahan else jnp.zeros((), _F32)
  h0 = jnp.zeros((bn, rp), _F32) if t.lora == "a" else jnp.zeros((), _F32)
  acc, _, h = _k_loop(tl, t, body, (acc0, comp0, h0))
  y = plain = acc.astype(t.out_dtype)
  if t.lora != "none":
    on = _load(on_ref.at[pl.ds(tl.r0, bn)], tl.r_ok) != 0  # [bn]; padded rows read 0: off
    if t.lora == "h":
      h = _load(ah_ref.at[pl.ds(tl.r0, bn), pl.ds(0, rp)], _and(_col(tl.r_ok), _row(r_in)))

    def with_lora():
      bt = _load(b_ref.at[pl.ds(tl.o0, bo), pl.ds(0, rp)], _and(_col(tl.o_ok), _row(r_in)))
      delta = up_product(h, bt)  # [bn, bo] fp32
      if t.scale != 1.0:
        delta = delta * t.scale
      # A select, never acc + 0 * delta: off rows keep the plain kernel's bits.
      return jnp.where(on[:, None], (acc + delta).astype(t.out_dtype), plain)

    any_on = jnp.max(on.astype(jnp.int32)) > 0
    y = lax.cond(any_on, with_lora, lambda: plain)
  _store(o_ref.at[_out_group(tl, t), pl.ds(tl.r0, bn), pl.ds(tl.o0, bo)], y,
         _and(_col(tl.r_ok), _row(tl.o_ok)))


def _rows_form(tl, lora_refs, o_ref, t):
  """A few rows (block_rows divides M: no row masks), each a GEMV on the CUDA cores.

  Row r keeps a [bo, W] fp32 accumulator of weight x activation products (both rounded to
  the compute dtype, so each product is exact in fp32) and sums it over W once at the end:
  no padded rows, no layout change for a dot, no per-step reductions.
  """
  bn, bo, rp = t.block_rows, t.block_out, t.rank_pad
  r_in = (jnp.arange(rp) < t.rank) if t.rank != rp else None
  if lora_refs is not None:
    on_ref, ah_ref, b_ref = lora_refs
  width = 16 if t.qtype == "q6_k" else 32

  def xrow(r, col, w):
    view = tl.refs["x"].at[tl.g, tl.r0 + r, pl.ds(col, w)]
    return view[...].astype(t.cd).astype(_F32)  # [w]

  def body(step, carry):
    accs, hs = carry
    accs, hs = list(accs), list(hs)
    for col, w in _step_tiles(tl, step, t):
      wc = w.astype(t.cd).astype(_F32)
      if t.lora == "a":
        ak = _load(ah_ref.at[pl.ds(0, rp), pl.ds(col, width)], _col(r_in)).astype(_F32)
      for r in range(bn):
        xr = xrow(r, col, width)
        accs[r] = accs[r] + wc * xr[None, :]
        if t.lora == "a":
          hs[r] = hs[r] + ak * xr[None, :]
    return tuple(accs), tuple(hs)

  acc0 = tuple(jnp.zeros((bo, width), _F32) for _ in range(bn))
  h0 = tuple(jnp.zeros((rp, width), _F32) for _ in range(bn if t.lora == "a" else 0))
  accs, hs = _k_loop(tl, t, body, (acc0, h0))
  accs = [jnp.sum(a, axis=1) for a in accs]  # [bo] each
  plain = [a.astype(t.out_dtype) for a in accs]
  ys = plain
  if t.lora != "none":
    ons = [on_ref[tl.r0 + r] != 0 for r in range(bn)]
    if t.lora == "a":
      hs = [jnp.sum(h, axis=1) for h in hs]  # [Rp]
    else:
      hs = [_load(ah_ref.at[tl.r0 + r, pl.ds(0, rp)], r_in) for r in range(bn)]

    def with_lora():
      bt = _load(b_ref.at[pl.ds(tl.o0, bo), pl.ds(0, rp)],
                 _and(_col(tl.o_ok), _row(r_in))).astype(_F32)
      out = []
      for r in range(bn):
        delta = jnp.sum(bt * hs[r][None, :], axis=1)  # [bo] fp32
        if t.scale != 1.0:
          delta = delta * t.scale
        # A select, never acc + 0 * delta: off rows keep the plain kernel's bits.
        out.append(jnp.where(ons[r], (accs[r] + delta).astype(t.out_dtype), plain[r]))
      return tuple(out)

    any_on = ons[0]
    for v in ons[1:]:
      any_on = any_on | v
    ys = lax.cond(any_on, with_lora, lambda: tuple(plain))
  for r in range(bn):
    _store(o_ref.at[_out_group(tl, t), tl.r0 + r, pl.ds(tl.o0, bo)], ys[r], tl.o_ok)


def _pow2_at_least(v, lo=_MIN_TILE):
  return max(lo, pl.next_power_of_2(int(v)))


ROWS_MAX = 4  # "auto" form: a GEMV form ("blocks", or "rows" with the LoRA epilogue) up to here
FORMS = ("dot", "rows", "blocks")


def default_form(m, lora="none"):
  """The form a call without `form=` runs: "blocks" for a few rows (with the LoRA epilogue
  from h; x @ A^T inside the K loop, lora="a", keeps "rows"), "dot" above ROWS_MAX."""
  if m > ROWS_MAX:
    return "dot"
  return "rows" if lora == "a" else "blocks"


BLOCKS_MIN_PROGRAMS = 512  # "blocks": split `in` until the grid has this many programs


def blocks_defaults(d_out, d_in, qtype, *, groups=1, interpret=False):
  """(block_out, block_in, k_split) of the "blocks" form when not given.

  Compiled: 16-row tiles, 512 columns (two K-quant super-blocks, 16 Q8_0 blocks) a loop
  step, and `in` split (a power of 2 up to 8 dividing the steps) until the grid has
  BLOCKS_MIN_PROGRAMS programs. Interpret (CPU): big tiles, whole rows a step.
  """
  units = d_in // BLOCK[qtype]
  if interpret:
    return min(128, _pow2_at_least(d_out)), min(d_in, 2048), 1
  bo, bk = 16, 512
  steps = units // _unroll(qtype, d_in, bk)
  tiles = -(-d_out // bo) * groups
  ks = 1
  while ks < 8 and tiles * ks < BLOCKS_MIN_PROGRAMS and steps % (2 * ks) == 0:
    ks *= 2
  return bo, bk, ks


def tiling_defaults(m, d_out, *, form="dot", interpret=False, groups=1):
  """(block_rows, block_out, block_in) when not given.

  Compiled: "rows" form: all M rows in one program, 1024 columns per loop step, bo = 32; for
  the experts (groups > 1: one matrix per (token, expert) pair) bo halves, down to 4, until
  the grid has `ROWS_MIN_PROGRAMS` programs. On the H200 that took the 80B decode step from
  10.9 to 8.9 ms at batch 1 (decode_probe_a80b_run1/run2.json), while a single ssm_out
  matrix got slower with 4-row tiles (36.9 -> 49.8 us, quant_probe_run1/run2.json), so one
  matrix keeps 32-row tiles.
  "dot" form: M <= 16 padded to one 16-row tile with bo = 16 (out / 16 programs) and 1024
  columns a step; larger M take bn = 32 / 64, bo = 32 / 64 and 256 columns (tensor-core
  tiles). Interpret (CPU): large tiles, as each interpreted grid step costs time.
  `experiments/bench/quant_probe.py --sweep` times the alternatives.
  """
  if form == "rows":
    if interpret:
      return m, min(128, _pow2_at_least(d_out)), 256
    bo = min(32, _pow2_at_least(d_out, _MIN_ROWS_OUT))
    while groups > 1 and bo > _MIN_ROWS_OUT and -(-d_out // bo) * groups < ROWS_MIN_PROGRAMS:
      bo //= 2
    return m, bo, 1024
  if interpret:
    return min(128, _pow2_at_least(m)), min(128, _pow2_at_least(d_out)), 256
  if m <= 16:
    bn, bo, bk = 16, 16, 1024
  elif m <= 32:
    bn, bo, bk = 32, 32, 512
  else:
    bn, bo, bk = 64, 64, 256
  return bn, min(bo, _pow2_at_least(d_out)), bk


SPLIT_BELOW_TILES = 128  # a single matrix with fewer 32-row output tiles splits `in` 4 ways
SPLIT_FROM_OUT = 32768   # ... and one this tall (the output head) 2 ways


def split_defaults(d_out, d_in, qtype, *, groups=1):
  """(block_in, k_split) of the compiled "rows" form without an epilogue, when not given.

  Measured on the H200 at batch 1 (`experiments/bench/gemv_sweep.py`,
  results/device/gemv_sweep_run1.json; µs per call, default -> this):
  ssm_out [2048, 4096] Q4_K 43.6 -> 19.2 (512 columns a step, 4 splits); the shared
  expert's [512, 2048] 21.0 -> 12.1 (the same); the experts' [512, 2048] over 10 pairs
  25.5 -> 23.2 (2 splits); the Q6_K output head [151936, 2048] 260.8 -> 207.8 (256 columns,
  2 splits). A matrix with many output tiles and a short `in` gains nothing (the GDN qkv
  [8192, 2048]: 25.6, the best setting 23.7), so it keeps one program per tile.
  """
  bk, ks = 1024, 1
  if groups > 1:
    ks = 2
  elif d_out >= SPLIT_FROM_OUT:
    bk, ks = 256, 2
  elif -(-d_out // 32) < SPLIT_BELOW_TILES:
    bk, ks = 512, 4
  steps = _units(qtype, d_in) // _unroll(qtype, d_in, bk)
  while ks > 1 and steps % ks:
    ks //= 2
  return bk, ks


def default_split(m, d_out, d_in, qtype, *, groups=1, form=None, interpret=False,
                  lora="none", block_in=None, k_split=None):
  """(block_in, k_split) a call with these arguments runs with (None block_in: the tiling's)."""
  form = form or default_form(m, lora)
  if k_split is not None:
    return block_in, int(k_split)
  if form == "blocks":
    _, bk, ks = blocks_defaults(d_out, d_in, qtype, groups=groups, interpret=interpret)
    return block_in or bk, ks
  if form == "rows" and not interpret and lora == "none" and block_in is None:
    return split_defaults(d_out, d_in, qtype, groups=groups)
  return block_in, 1


def epilogue_outside(m, d_out, d_in, qtype, *, form=None, interpret=False, block_in=None,
                     k_split=None, lora_down="h"):
  """Whether `qmatmul_lora` adds the LoRA delta in XLA to the plain call's fp32 sum: when
  that call runs the "blocks" form and the delta is asked from A (lora_down="a", which only
  "rows" and "dot" fuse), or another form that splits `in` (their epilogue needs the whole
  sum; "blocks" adds it to the first share's partial). Either way an off row is the plain
  call's value."""
  if (form or default_form(m)) == "blocks":
    return lora_down != "h"
  return default_split(m, d_out, d_in, qtype, form=form, interpret=interpret,
                       block_in=block_in, k_split=k_split)[1] > 1


def check_planes(planes, qtype, d_out, d_in):
  """Plane shapes [S, out, cols] against the logical [out, in]."""
  from pallas_kernels.quant.layout import PLANE_RATIO
  if qtype not in PLANES:
    raise ValueError(f"quant kernel: unknown quant type {qtype!r}")
  if d_in % BLOCK[qtype]:
    raise ValueError(f"quant kernel: in={d_in} is not a multiple of {qtype}'s block "
                     f"{BLOCK[qtype]}")
  s = None
  for name in PLANES[qtype]:
    p = planes[name]
    want = (d_out, int(d_in * PLANE_RATIO[qtype][name]))
    if p.ndim != 3 or tuple(p.shape[1:]) != want or (s is not None and p.shape[0] != s):
      raise ValueError(f"quant kernel: plane {name} has shape {p.shape}, expected "
                       f"[S, {want[0]}, {want[1]}]")
    s = p.shape[0]
  return s


@functools.partial(jax.jit, static_argnames=(
    "qtype", "d_out", "lora", "scale", "form", "block_rows", "block_out", "block_in",
    "num_warps", "num_stages", "interpret", "precision", "out_dtype", "k_split"))
def qmatmul_pallas(x, planes, idx, *, qtype, d_out, on=None, a=None, h=None, b=None,
                   lora="none", scale=1.0, form=None, block_rows=None, block_out=None,
                   block_in=None, num_warps=None, num_stages=None, interpret=False,
                   precision=None, out_dtype=None, k_split=None, active=None):
  """y[g] = x[g] @ W[idx[g]]^T (+ the LoRA epilogue), reading the weight stack in place.

  Args:
    x: [G, M, in] float32 / bfloat16 / float16 activations (sets y's dtype).
    planes: {name: [S, out, cols]} repacked planes (layout.py) of a flattened weight stack.
    idx: [G] int32 matrix of each group (clamped to [0, S)).
    qtype: one of layout.QUANT_TYPES.
    d_out: out (the planes' second dim; static).
    on: [M] int32 LoRA switch per row (lora != "none"; G must be 1).
    a: [R, in] LoRA A (lora="a"); h: [M, R] fp32 x @ A^T computed outside (lora="h").
    b: [out, R] LoRA B, adapter scale folded in.
    lora: "none", "a" (x @ A^T inside the kernel) or "h" (h passed in).
    scale: static factor on the LoRA delta.
    form: "dot" (rows padded to tiles >= 16, tl.dot on the tensor cores), "rows" (each of
      a few rows a GEMV on the CUDA cores, no padding, one sub-block a load), "blocks"
      (gemv.py: a few rows over whole quant blocks a load, scales outside the inner sums;
      LoRA epilogue from h only) or None: `default_form`.
    block_rows: "dot": a power of 2 >= 16; "rows": rows per program (rounded down to a
      divisor of M). block_out: a power of 2 >= 16 (>= 4 in the "rows" form). None:
      `tiling_defaults`.
    block_in: columns per loop step, a power of 2 (None: `tiling_defaults`); rounded down
      to a power-of-2 number of blocks that divides the row (at least one block).
    num_warps, num_stages: Triton compiler parameters (ignored in interpret mode).
    interpret: run the Pallas interpreter (CPU).
    precision: of the weight product for fp32 x (None: HIGHEST, IEEE fp32).
    out_dtype: of y (None: x.dtype); the accumulation is fp32 either way.
    k_split: programs per output tile along `in` (a power of 2 dividing the loop steps;
      lora "none" only). Each writes its fp32 partial sum and one XLA sum over the k_split
      partials (a fixed order) gives y: more programs for a matrix with few output tiles,
      each with a shorter K loop. None: `split_defaults` for the compiled "rows" form with
      no epilogue and no block_in given, else 1.
    active: None, or an int32 scalar: 0 makes every program return at once and y is left
      unspecified (the caller selects another call's result). One launch per type of a
      mixed-type stack, without an XLA conditional (a host round trip on the GPU).

  Returns:
    [G, M, out] in out_dtype.
  """
  if lora not in LORA_MODES:
    raise ValueError(f"quant kernel: lora={lora!r} is not one of {LORA_MODES}")
  if x.ndim != 3 or jnp.dtype(x.dtype) not in _FLOATS:
    raise ValueError(f"quant kernel: x must be [G, M, in] float, got {x.shape} {x.dtype}")
  groups, m, d_in = x.shape
  n_mats = check_planes(planes, qtype, d_out, d_in)
  if idx.shape != (groups,):
    raise ValueError(f"quant kernel: idx {idx.shape} must be [G] = [{groups}]")
  form = form or default_form(m, lora)
  if form not in FORMS:
    raise ValueError(f"quant kernel: form={form!r} is not one of {FORMS}")
  if form == "blocks" and lora == "a":
    raise ValueError("quant kernel: the 'blocks' form's LoRA epilogue takes h (lora='h'), "
                     "not A")
  tiles = [("block_out", block_out), ("block_in", block_in)]
  if form == "dot":
    tiles.append(("block_rows", block_rows))
  elif block_rows is not None and block_rows < 1:
    raise ValueError(f"quant kernel: block_rows={block_rows} must be >= 1")
  for name, v in tiles:
    lo = _MIN_ROWS_OUT if form != "dot" and name == "block_out" else _MIN_TILE
    if v is not None and (v < lo or v & (v - 1)):
      raise ValueError(f"quant kernel: {name}={v} must be a power of 2 >= {lo}")
  if not interpret and pltriton is None:
    raise RuntimeError("quant kernel: this JAX has no Pallas Triton backend; use 'xla'")
  if form == "blocks":
    bo0, bk0, _ = blocks_defaults(d_out, d_in, qtype, groups=groups, interpret=interpret)
    bn0 = m
  else:
    bn0, bo0, bk0 = tiling_defaults(m, d_out, form=form, interpret=interpret, groups=groups)
  bk_split, k_split = default_split(m, d_out, d_in, qtype, groups=groups, form=form,
                                    interpret=interpret, lora=lora, block_in=block_in,
                                    k_split=k_split)
  bk0 = bk_split or bk0
  bn, bo = block_rows or bn0, block_out or bo0
  if form == "rows":  # unrolled rows: a divisor of M, so no row is ever out of range
    bn = next(v for v in range(min(bn, max(m, 1)), 0, -1) if m % v == 0) if m else 1
  od = jnp.dtype(out_dtype or x.dtype)
  if jnp.dtype(x.dtype) in _HALF:
    cd, prec = jnp.dtype(x.dtype), lax.Precision.DEFAULT
  else:
    cd, prec = jnp.dtype(_F32), precision or lax.Precision.HIGHEST
  units = _units(qtype, d_in)
  unroll = _unroll(qtype, d_in, block_in or bk0)
  k_split = int(k_split or 1)
  if k_split < 1 or k_split & (k_split - 1) or (units // unroll) % k_split:
    raise ValueError(f"quant kernel: k_split={k_split} must be a power of 2 dividing the "
                     f"{units // unroll} loop steps")
  if k_split > 1 and lora != "none" and form != "blocks":
    raise ValueError("quant kernel: k_split needs lora='none' (the epilogue needs the sum)")
  n_out = pl.cdiv(d_out, bo)
  t = Tiling(qtype=qtype, groups=groups, m=m, d_in=d_in, d_out=d_out, block_rows=bn,
             block_out=bo, unroll=unroll, form=form, cd=cd, precision=prec, out_dtype=od,
             lora=lora, scale=float(scale), k_split=k_split, out_tiles=n_out)
  idx = jnp.clip(idx.astype(jnp.int32), 0, n_mats - 1)
  args = [idx, x, *(planes[n] for n in PLANES[qtype])]
  if lora != "none":
    if groups != 1:
      raise ValueError("quant kernel: the LoRA epilogue needs G = 1")
    rank = b.shape[1]
    if b.shape != (d_out, rank) or on.shape != (m,):
      raise ValueError(f"quant kernel: b {b.shape} must be [out, R], on {on.shape} [M]")
    t = t._replace(rank=rank, rank_pad=_pow2_at_least(rank))
    if lora == "a":
      if a.shape != (rank, d_in):
        raise ValueError(f"quant kernel: a {a.shape} must be [R, in] = {(rank, d_in)}")
      a_cd, a_prec = dot_policy(x.dtype, a.dtype)
      t = t._replace(a_cd=jnp.dtype(a_cd), a_precision=a_prec)
      args += [on.astype(jnp.int32), a, b]
    else:
      if h.shape != (m, rank):
        raise ValueError(f"quant kernel: h {h.shape} must be [M, R] = {(m, rank)}")
      args += [on.astype(jnp.int32), h.astype(_F32), b]
  if groups == 0 or m == 0 or d_out == 0:
    return jnp.zeros((groups, m, d_out), od)
  params = None if interpret else gemv.triton_params(num_warps, num_stages)
  if form == "blocks":
    lora_kw = {} if lora == "none" else dict(on=on, h=h, b=b, scale=scale)
    y = gemv.blocks_call(x, planes, idx, qtype=qtype, d_out=d_out, block_out=bo,
                         unroll=unroll, k_split=k_split, cd=cd, out_dtype=od, active=active,
                         interpret=interpret, compiler_params=params, **lora_kw)
    if k_split > 1:   # in index order, as the LoRA rows' finish (`qmatmul_lora_rows`)
      y = gemv.sum_partials(y.reshape(k_split, groups, m, d_out)).astype(od)
    return y
  if active is not None:
    t = t._replace(gated=True)
    args = [jnp.reshape(jnp.asarray(active, jnp.int32), (1,)), *args]
  if k_split > 1:
    t = t._replace(out_dtype=jnp.dtype(_F32))
  y = pl.pallas_call(
      functools.partial(_kernel, t=t),
      grid=(n_out * k_split, groups, pl.cdiv(m, bn)),
      out_shape=jax.ShapeDtypeStruct((k_split * groups, m, d_out), t.out_dtype),
      in_specs=[_WHOLE] * len(args), out_specs=_WHOLE,
      interpret=interpret, compiler_params=params, name=f"qmatmul_{qtype}",
  )(*args)
  if k_split > 1:
    y = jnp.sum(y.reshape(k_split, groups, m, d_out), axis=0).astype(od)
  return y


def groups_tiling(qtypes, d_out, d_in, *, groups=1, interpret=False):
  """(block_out, k_split, unroll per part) of one "blocks" launch over a mixed-type stack, or
  None when the parts' default tilings differ in block_out or k_split (then each part runs
  its own call): for llama.cpp's K-quant mixes they agree (the same 256-weight units)."""
  tilings = []
  for qtype in qtypes:
    if d_in % BLOCK[qtype]:
      return None
    bo, bk, ks = blocks_defaults(d_out, d_in, qtype, groups=groups, interpret=interpret)
    tilings.append((bo, ks, _unroll(qtype, d_in, bk)))
  if len({t[:2] for t in tilings}) != 1:
    return None
  return tilings[0][0], tilings[0][1], tuple(t[2] for t in tilings)


def _groups_plan(qtypes, parts, group, idx, *, d_out, d_in, groups=1, interpret=False):
  """(block_out, k_split, ((qtype, planes, unroll), ...), group, idx clamped to the part's
  matrices) of one launch over a mixed-type stack; ValueError where the parts' tilings
  differ (`groups_tiling`)."""
  sizes = [check_planes(p, q, d_out, d_in) for q, p in zip(qtypes, parts)]
  tiling = groups_tiling(qtypes, d_out, d_in, groups=groups, interpret=interpret)
  if tiling is None:
    raise ValueError(f"quant kernel: the parts {qtypes} have different tilings")
  bo, k_split, unrolls = tiling
  group = jnp.asarray(group, jnp.int32)
  idx = jnp.clip(jnp.reshape(idx, (-1,)).astype(jnp.int32), 0,
                 jnp.asarray(sizes, jnp.int32)[group] - 1)
  return bo, k_split, tuple(zip(qtypes, parts, unrolls)), group, idx


@functools.partial(jax.jit, static_argnames=(
    "qtypes", "d_out", "scale", "interpret", "out_dtype", "num_warps", "num_stages"))
def qmatmul_groups_pallas(x, parts, group, idx, *, qtypes, d_out, on=None, h=None, b=None,
                          scale=1.0, interpret=False, out_dtype=None, num_warps=None,
                          num_stages=None, more=()):
  """The "blocks" form over a mixed-type stack in one launch (gemv.groups_call).

  Args:
    x: [G, M, in]; parts: one {name: [S_p, out, cols]} per type; qtypes: their types.
    group: int32 scalar, the part holding the matrices; idx [G]: their indices in it.
    on, h, b, scale: the LoRA epilogue from h (as `qmatmul_pallas` with lora="h").
    more: further stacks shaped as `parts` (one {name: planes} per type), multiplied by the
      same x at the same indices in the same launch (`multi.launch` of `gemv.groups_part`,
      an expert's gate with its up); then a list [y, *y_more] (no LoRA).
  Each part computes what `qmatmul_pallas(..., form="blocks")` on that part alone would, bit
  for bit. Raises ValueError when the parts' tilings differ (`groups_tiling`).
  """
  groups, m, d_in = x.shape
  if more and on is not None:
    raise ValueError("quant kernel: more stacks in one launch do not take the LoRA epilogue")
  plans = [_groups_plan(qtypes, p, group, idx, d_out=d_out, d_in=d_in, groups=groups,
                        interpret=interpret) for p in (parts, *more)]
  bo, k_split, _, group, idx = plans[0]   # one tiling: the same types and shapes
  od = jnp.dtype(out_dtype or x.dtype)
  cd = jnp.dtype(x.dtype) if jnp.dtype(x.dtype) in _HALF else jnp.dtype(_F32)
  if groups == 0 or m == 0 or d_out == 0:
    y = jnp.zeros((groups, m, d_out), od)
    return [y] * len(plans) if more else y
  params = None if interpret else gemv.triton_params(num_warps, num_stages)
  tiles = dict(d_out=d_out, block_out=bo, k_split=k_split, cd=cd, out_dtype=od)
  if more:
    ys = launch([gemv.groups_part(x, mat, g, i, **tiles) for _, _, mat, g, i in plans],
                name="qgemv_groups", interpret=interpret, compiler_params=params)
  else:
    ys = [gemv.groups_call(x, plans[0][2], group, idx, interpret=interpret,
                           compiler_params=params, on=on, h=h, b=b, scale=scale, **tiles)]
  if k_split > 1:   # in index order, as the LoRA rows' finish (`qmatmul_lora_rows`)
    ys = [gemv.sum_partials(y.reshape(k_split, groups, m, d_out)).astype(od) for y in ys]
  return ys if more else ys[0]


class MultiMat(NamedTuple):
  """One product of `qmatmul_multi_pallas`: a stack's planes {name: [S, out, cols]} and its
  type, or (a mixed-type stack) a tuple of each and `group`, the part holding the matrix;
  `index` the matrix (int32, traced OK; in that part)."""
  qtype: object
  planes: object
  index: object
  d_out: int
  group: object = None


def qmatmul_multi_pallas(x, mats, *, interpret=False):
  """[y = x @ W^T for each MultiMat] in one launch (`multi.launch`), for a few rows x [M, in]
  (M <= ROWS_MAX): each product runs the programs and tiling of its own call (the "blocks"
  form, `qmatmul_pallas`; a mixed-type stack's `qmatmul_groups_pallas`), so each result is
  that call's, bit for bit. Raises ValueError where one cannot (a mixed stack's parts with
  different tilings)."""
  m, d_in = x.shape
  if m > ROWS_MAX:
    raise ValueError(f"quant kernel: {m} rows are more than the one-launch form's {ROWS_MAX}")
  od = jnp.dtype(x.dtype)
  cd = od if od in _HALF else jnp.dtype(_F32)
  parts, splits = [], []
  for mat in mats:
    if isinstance(mat.qtype, tuple):
      bo, ks, stack, group, idx = _groups_plan(mat.qtype, mat.planes, mat.group, mat.index,
                                               d_out=mat.d_out, d_in=d_in,
                                               interpret=interpret)
      parts.append(gemv.groups_part(x[None], stack, group, idx, d_out=mat.d_out,
                                    block_out=bo, k_split=ks, cd=cd, out_dtype=od))
    else:
      n_mats = check_planes(mat.planes, mat.qtype, mat.d_out, d_in)
      bo, bk, ks = blocks_defaults(mat.d_out, d_in, mat.qtype, interpret=interpret)
      idx = jnp.clip(jnp.reshape(mat.index, (1,)).astype(jnp.int32), 0, n_mats - 1)
      parts.append(gemv.blocks_part(x, mat.planes, idx, qtype=mat.qtype, d_out=mat.d_out,
                                    block_out=bo, unroll=_unroll(mat.qtype, d_in, bk),
                                    k_split=ks, cd=cd, out_dtype=od))
    splits.append(ks)
  if m == 0:
    return [jnp.zeros((0, mat.d_out), od) for mat in mats]
  ys = launch(parts, name="qgemv_multi", interpret=interpret,
              compiler_params=None if interpret else gemv.triton_params())
  # in index order, as each call's own sum (`qmatmul_pallas`, `qmatmul_groups_pallas`)
  return [gemv.sum_partials(y).astype(od) if ks > 1 else y[0] for y, ks in zip(ys, splits)]


def qmatmul_lora_rows(x, planes, idx, a_stack, b_stack, lidx, on, rank_scale=None, *, qtype,
                      d_out, scale=1.0, interpret=False, num_warps=None, num_stages=None):
  """y [M, out] = x W^T + where(on, scale * B (A x)) for a few rows x [M, in] (M <= ROWS_MAX)
  in the "blocks" form's default tiling, W = planes[idx] and the adapter's A = a_stack[lidx]
  [R, in], B = b_stack[lidx] [out, R] all read in place: A's rows join the GEMV's launch,
  then one finishing kernel (gemv.blocks_lora_call). Off rows are `qmatmul_pallas`'s bits."""
  m, d_in = x.shape
  n_mats = check_planes(planes, qtype, d_out, d_in)
  bo, bk, k_split = blocks_defaults(d_out, d_in, qtype, interpret=interpret)
  cd = jnp.dtype(x.dtype) if jnp.dtype(x.dtype) in _HALF else jnp.dtype(_F32)
  idx = jnp.clip(jnp.reshape(idx, (1,)).astype(jnp.int32), 0, n_mats - 1)
  params = None if interpret else gemv.triton_params(num_warps, num_stages)
  return gemv.blocks_lora_call(x, planes, idx, a_stack, b_stack, lidx, on, rank_scale,
                               qtype=qtype, d_out=d_out, block_out=bo,
                               unroll=_unroll(qtype, d_in, bk), k_split=k_split, cd=cd,
                               out_dtype=x.dtype, scale=scale, interpret=interpret,
                               compiler_params=params)


def qmatmul_groups_lora_rows(x, parts, group, idx, a_stack, b_stack, lidx, on,
                             rank_scale=None, *, qtypes, d_out, scale=1.0, interpret=False,
                             num_warps=None, num_stages=None):
  """`qmatmul_lora_rows` over a mixed-type stack (as `qmatmul_groups_pallas`: part `group`,
  matrix idx [1] in it): every part's program and A's rows in one launch, then the finish."""
  m, d_in = x.shape
  bo, k_split, stack, group, idx = _groups_plan(qtypes, parts, group, idx, d_out=d_out,
                                                d_in=d_in, interpret=interpret)
  cd = jnp.dtype(x.dtype) if jnp.dtype(x.dtype) in _HALF else jnp.dtype(_F32)
  params = None if interpret else gemv.triton_params(num_warps, num_stages)
  return gemv.groups_lora_call(x, stack, group, idx, a_stack,
                               b_stack, lidx, on, rank_scale, d_out=d_out, block_out=bo,
                               k_split=k_split, cd=cd, out_dtype=x.dtype, scale=scale,
                               interpret=interpret, compiler_params=params)
