"""Pallas kernel: y = x @ W^T for a few rows (2 to `ROWS_MAX`) and a plain 16-bit weight
stack read in place, on the tensor cores.

Why: inside the decode step's layer scan, XLA multiplies a matrix taken at a traced layer
index by copying it out of the stack first (a dynamic-slice fusion, then the dot). At batch 8
on bench-a3b those copies took 1.74 of the step's 8.54 ms on the H200
(experiments/results/device/decode_probe_lora_profile_run24.json, `loop_dynamic_slice_fusion`
rows). The one-row GEMV (`gemv.dense_call`) reads in place but multiplies on the CUDA cores,
one row at a time, and lost to XLA at 4 rows.

Shapes: x [M, in] (M <= ROWS_MAX), stack [S, out, in], idx [1] int32 (the matrix), y [M, out]
in x's dtype. Grid: out tiles x k_split. Program (ks * tiles + j) reads matrix idx[0] in place
(`ref.at[s, rows, cols]`, a pointer offset), walks its 1/k_split share of `in` in
[block_out, block_in] weight tiles, and multiplies each with the matching [rows_pad,
block_in] tile of x by one `tl.dot` (rows padded to 16, the least a dot takes; the padded
rows are masked loads of zeros, never stored), summing in fp32. With k_split > 1 each
program writes an fp32 partial sum and `gemv.sum_partials` adds them in index order.

LoRA (`lora=`): y = W x + where(on, scale * B (A x)) per row, the adapter's A [R, in] and
B [out, R] read in place from their stacks at `lidx`, in the same launch. Each program also
sums h_s = x A^T over its own share s of `in` (A's [R, block_in] tile beside each weight
tile, from L2 after the first program reads it), then adds scale * B_j h_s to its own output
tile, because W x + B A x = sum over shares of (W_s x_s + B A_s x_s): no second launch and no
finishing kernel. Rows with on == 0 take the plain acc by a select, so their partial sums,
and the split sum over them, are the plain call's bit for bit; a program whose rows are all
off skips A's and B's loads (`lax.cond`). Per-row rank scales [M, R] multiply h_s.

Numerics: both operands in x's 16-bit dtype, exact products summed in fp32 (the tensor
cores' order), rounded once: the numbers of XLA's dot to summation order. The jnp oracles
are `api.dense_reference` and `api.dense_lora_reference`. 16-bit x only (an fp32
dot on the tensor cores would be TF32); `api.dense_matmul` sends fp32 rows to XLA.
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.lora.kernel import dot_policy, up_product
from pallas_kernels.quant.gemv import (masked_load, masked_store, sum_partials, tile_mask,
                                       triton_params)
from pallas_kernels.quant.multi import Part, launch

_F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))  # lhs @ rhs^T
_MIN_TILE = 16  # tl.dot needs every dim >= 16
_WHOLE = pl.BlockSpec()  # a whole array (a pointer): the kernel indexes it itself
ROWS_MAX = 64
HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class Tiling(NamedTuple):
  """Static description of one call."""
  m: int
  rows_pad: int
  d_in: int
  d_out: int
  block_out: int
  block_in: int
  k_split: int
  out_tiles: int
  out_dtype: object
  lora: bool = False
  rank: int = 0
  rank_pad: int = 0
  scaled: bool = False
  a_cd: object = None
  a_precision: object = None
  scale: float = 1.0


# Shared memory a program may plan for (an H200 SM has 227 KiB): the x and weight tiles of
# each pipelined stage plus the adapter's A tile, which sits under a branch and is loaded once.
SMEM_BUDGET = 200 * 1024
STAGES = 3   # gemv.triton_params' default num_stages
# Output rows a program with an adapter: every program of a share of `in` computes that
# share's h = A x again, so wider tiles mean fewer copies of that work. On the H200,
# bench-a3b rank 50 padded to 64: 128 rows took the adapter's cost from 4.1-4.5 % of a decode
# step to 2.0 % at batch 8 and from 4.3-4.5 % to 1.1 % at 32, against 64 rows
# (experiments/results/device/run63/decode_probe_s12b_b8.json, decode_probe "lorabo128").
LORA_BLOCK_OUT = 128


def defaults(m, d_out, d_in, *, rank_pad=0, interpret=False):
  """(block_out, block_in, k_split): 64 x 256 weight tiles, `in` split (up to 8 ways, while
  each share keeps 2 or more loop steps) until the grid has 256 programs, two per SM of an
  H200. An adapted call (rank_pad > 0) keeps that split, so its off rows sum in the plain
  call's order, on LORA_BLOCK_OUT output rows a program, with `in` tiles halved while the x,
  weight and A tiles of a program would pass SMEM_BUDGET (the tensor cores chain a program's
  K tiles into one accumulator, so the order within a share is the same). Interpret: one big
  tile (the interpreter's cost is per program)."""
  if interpret:
    return (min(256, max(_MIN_TILE, pl.next_power_of_2(d_out))),
            _largest_block(d_in, 2048), 1)
  bk = _largest_block(d_in, 256)
  tiles, steps, ks = -(-d_out // 64), d_in // bk, 1
  while ks < 8 and tiles * ks < 256 and steps % (2 * ks) == 0 and steps // (2 * ks) >= 2:
    ks *= 2
  bo, rp = (LORA_BLOCK_OUT if rank_pad else 64), _rows_pad(m)
  while bk > 32 and ((rp + bo) * STAGES + rank_pad) * bk * 2 > SMEM_BUDGET:
    bk //= 2
  return bo, bk, ks


def _rows_pad(m):
  """x's rows padded to a power of 2 of at least a dot's 16."""
  return max(_MIN_TILE, pl.next_power_of_2(m))


def _largest_block(d_in, want):
  """The largest power of 2 <= want (>= 16) dividing d_in."""
  b = want
  while b > _MIN_TILE and d_in % b:
    b //= 2
  if d_in % b:
    raise ValueError(f"dense dot: `in` = {d_in} is not a multiple of {_MIN_TILE}")
  return b


def _kernel(*refs, t: Tiling):
  _program(refs, pl.program_id(0), t=t)


def _program(refs, pid, *, t: Tiling):
  """Program `pid` of one call (`_kernel`; or of a part in `multi.launch`)."""
  idx_ref, x_ref, w_ref, *rest = refs
  if t.lora:
    lidx_ref, on_ref, a_ref, b_ref, *rest = rest
    rs_ref, o_ref = rest if t.scaled else (None, *rest)
  else:
    (o_ref,) = rest
  bo, bk, rp, rr = t.block_out, t.block_in, t.rows_pad, t.rank_pad
  ks, j = pid // t.out_tiles, pid % t.out_tiles
  o0 = j * bo
  o_ok = (o0 + jnp.arange(bo)) < t.d_out if t.d_out % bo else None
  r_ok = jnp.arange(rp) < t.m if t.m != rp else None
  x_mask = tile_mask(r_ok, None, rp, bk)
  w_mask = tile_mask(o_ok, None, bo, bk)
  s = idx_ref[0]
  n = t.d_in // bk // t.k_split
  if t.lora:
    lay = lidx_ref[0]
    rank_ok = (jnp.arange(rr) < t.rank) if t.rank != rr else None
    on = masked_load(on_ref.at[pl.ds(0, rp)], r_ok) != 0  # [rp]; padded rows read 0: off
    any_on = jnp.max(on.astype(jnp.int32)) > 0

  def body(step, carry):
    acc, h = carry
    k0 = (ks * n + step) * bk
    xk = masked_load(x_ref.at[pl.ds(0, rp), pl.ds(k0, bk)], x_mask)
    wk = masked_load(w_ref.at[s, pl.ds(o0, bo), pl.ds(k0, bk)], w_mask)
    acc = acc + lax.dot_general(xk, wk, _NT, preferred_element_type=_F32)
    if t.lora:
      def down():
        ak = masked_load(a_ref.at[lay, pl.ds(0, rr), pl.ds(k0, bk)],
                         tile_mask(rank_ok, None, rr, bk))
        return h + lax.dot_general(xk.astype(t.a_cd), ak.astype(t.a_cd), _NT,
                                   precision=t.a_precision, preferred_element_type=_F32)
      h = lax.cond(any_on, down, lambda: h)
    return acc, h

  h0 = jnp.zeros((rp, rr), _F32) if t.lora else jnp.zeros((), _F32)
  acc, h = lax.fori_loop(0, n, body, (jnp.zeros((rp, bo), _F32), h0))
  y = plain = acc.astype(t.out_dtype)
  if t.lora:
    def with_lora():
      hs = h
      if t.scaled:
        hs = hs * masked_load(rs_ref.at[pl.ds(0, rp), pl.ds(0, rr)],
                              tile_mask(r_ok, rank_ok, rp, rr))
      bt = masked_load(b_ref.at[lay, pl.ds(o0, bo), pl.ds(0, rr)],
                       tile_mask(o_ok, rank_ok, bo, rr))
      delta = up_product(hs, bt)  # [rp, bo] fp32
      if t.scale != 1.0:
        delta = delta * t.scale
      # A select, never acc + 0 * delta: an off row keeps the plain product's bits.
      return jnp.where(on[:, None], (acc + delta).astype(t.out_dtype), plain)
    y = lax.cond(any_on, with_lora, lambda: plain)
  view = (o_ref.at[ks, pl.ds(0, rp), pl.ds(o0, bo)] if t.k_split > 1
          else o_ref.at[pl.ds(0, rp), pl.ds(o0, bo)])
  masked_store(view, y, tile_mask(r_ok, o_ok, rp, bo))


def dense_dot_call(x, stack, idx, *, lora=None, scale=1.0, block_out=None, block_in=None,
                   k_split=None, interpret=False, compiler_params=None, partials=False):
  """y = x @ stack[idx]^T for x [M, in] (16-bit, M <= ROWS_MAX) and a stack [S, out, in] of
  x's dtype, matrix idx ([1] or scalar int32, traced OK, clipped) read in place.

  lora: None, or (a_stack [L, R, in], b_stack [L, out, R], lidx int32, on [M] int32,
  rank_scale [M, R] or None): plus scale * B (A x) on the rows whose switch is on, with
  A = a_stack[lidx] and B = b_stack[lidx] read in place (module docstring).
  partials: the split partial sums [k_split, M, out] unsummed (fp32 when split), for a
  consumer kernel that adds them (`sum_partials`, then x's dtype: the result above)."""
  m, d_in = x.shape
  n_mats, d_out, w_in = stack.shape
  if w_in != d_in or stack.dtype != x.dtype or jnp.dtype(x.dtype) not in HALF:
    raise ValueError(f"dense dot: x {x.shape} {x.dtype} and stack {stack.shape} {stack.dtype}"
                     " need a shared `in` and one 16-bit dtype")
  if not 0 < m <= ROWS_MAX:
    raise ValueError(f"dense dot: {m} rows; it takes 1 to {ROWS_MAX}")
  lora_kw, lora_args, rank_pad = {}, [], 0
  if lora is not None:
    a_stack, b_stack, lidx, on, rank_scale = lora
    n_ad, rank, a_in = a_stack.shape
    rank_pad = _rows_pad(rank)   # A's rows: the same dot minimum
    if a_in != d_in or b_stack.shape != (n_ad, d_out, rank) or on.shape != (m,) or (
        rank_scale is not None and rank_scale.shape != (m, rank)):
      raise ValueError(f"dense dot lora: A {a_stack.shape}, B {b_stack.shape}, on {on.shape}"
                       f" must be [L, R, {d_in}], [L, {d_out}, R], [{m}] (rank_scale [{m}, R])")
    a_cd, a_prec = dot_policy(x.dtype, a_stack.dtype)
    lora_kw = dict(lora=True, rank=rank, rank_pad=rank_pad,
                   scaled=rank_scale is not None, a_cd=jnp.dtype(a_cd), a_precision=a_prec,
                   scale=float(scale))
    lidx = jnp.clip(jnp.reshape(jnp.asarray(lidx, jnp.int32), (1,)), 0, n_ad - 1)
    lora_args = [lidx, on.astype(jnp.int32), a_stack, b_stack]
    if rank_scale is not None:
      lora_args.append(rank_scale.astype(_F32))
  bo, bk, ks = defaults(m, d_out, d_in, rank_pad=rank_pad, interpret=interpret)
  bo, ks = block_out or bo, int(k_split or ks)
  bk = _largest_block(d_in, block_in) if block_in else bk
  if (d_in // bk) % ks:
    raise ValueError(f"dense dot: k_split={ks} does not divide the {d_in // bk} loop steps")
  t = Tiling(m=m, rows_pad=_rows_pad(m), d_in=d_in, d_out=d_out,
             block_out=bo, block_in=bk, k_split=ks, out_tiles=pl.cdiv(d_out, bo),
             out_dtype=jnp.dtype(x.dtype) if ks == 1 else jnp.dtype(_F32), **lora_kw)
  if compiler_params is None and not interpret:
    compiler_params = triton_params()
  idx = jnp.clip(jnp.reshape(jnp.asarray(idx, jnp.int32), (1,)), 0, n_mats - 1)
  out_shape = (ks, m, d_out) if ks > 1 else (m, d_out)
  args = [idx, x, stack, *lora_args]
  y = pl.pallas_call(
      functools.partial(_kernel, t=t),
      grid=(t.out_tiles * ks,),
      out_shape=jax.ShapeDtypeStruct(out_shape, t.out_dtype),
      in_specs=[_WHOLE] * len(args), out_specs=_WHOLE,
      interpret=interpret, compiler_params=compiler_params,
      name="dense_dot_lora" if lora is not None else "dense_dot",
  )(*args)
  if partials:
    return y if ks > 1 else y[None]
  return sum_partials(y).astype(x.dtype) if ks > 1 else y


def dense_dot_multi_call(x, stacks, idx, *, tiles=None, interpret=False,
                         compiler_params=None, partials=False):
  """[dense_dot_call(x, s, idx) for s in stacks] in one launch (`multi.launch`): x [M, in]
  16-bit, every stack [S_m, out_m, in] of x's dtype. Each part keeps its own call's tiling
  (`defaults`, or tiles[m]: {block_out, block_in, k_split}), so each result is that call's
  bit for bit. partials: each part's split partial sums [k_split, M, out] unsummed (fp32
  when split), for a consumer kernel that adds them (`sum_partials`, then x's dtype)."""
  m, d_in = x.shape
  if jnp.dtype(x.dtype) not in HALF or not 0 < m <= ROWS_MAX:
    raise ValueError(f"dense dot: x {x.shape} {x.dtype}: 1 to {ROWS_MAX} rows of a 16-bit "
                     "dtype")
  if compiler_params is None and not interpret:
    compiler_params = triton_params()
  parts, splits = [], []
  for j, stack in enumerate(stacks):
    n_mats, d_out, w_in = stack.shape
    if w_in != d_in or stack.dtype != x.dtype:
      raise ValueError(f"dense dot: x {x.shape} {x.dtype} and stack {stack.shape} "
                       f"{stack.dtype} need a shared `in` and one 16-bit dtype")
    bo, bk, ks = defaults(m, d_out, d_in, interpret=interpret)
    given = tiles[j] if tiles else {}
    bo, ks = given.get("block_out") or bo, int(given.get("k_split") or ks)
    bk = _largest_block(d_in, given["block_in"]) if given.get("block_in") else bk
    if (d_in // bk) % ks:
      raise ValueError(f"dense dot: k_split={ks} does not divide the {d_in // bk} loop steps")
    t = Tiling(m=m, rows_pad=_rows_pad(m), d_in=d_in, d_out=d_out, block_out=bo, block_in=bk,
               k_split=ks, out_tiles=pl.cdiv(d_out, bo),
               out_dtype=jnp.dtype(x.dtype) if ks == 1 else jnp.dtype(_F32))
    i = jnp.clip(jnp.reshape(jnp.asarray(idx, jnp.int32), (1,)), 0, n_mats - 1)
    parts.append(Part(functools.partial(_program, t=t), t.out_tiles * ks, (i, x, stack),
                      jax.ShapeDtypeStruct((ks, m, d_out) if ks > 1 else (m, d_out),
                                           t.out_dtype)))
    splits.append(ks)
  ys = launch(parts, name="dense_dot_multi", interpret=interpret,
              compiler_params=compiler_params)
  if partials:
    return [y if ks > 1 else y[None] for y, ks in zip(ys, splits)]
  return [sum_partials(y).astype(x.dtype) if ks > 1 else y for y, ks in zip(ys, splits)]
