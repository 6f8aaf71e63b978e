"""Grouped-GEMM Pallas kernel for the routed experts of an MoE FFN over many tokens (prefill).

routed[n] = sum_j w[n, j] * wd[e] @ (silu(wg[e] @ x[n]) * (wu[e] @ x[n])),  e = idx[n, j],

with the same numerics as `reference.moe_reference` (fp32 accumulation, h rounded to x.dtype),
computing only the chosen experts (megablocks style) instead of all E on every token.

Shapes: x [N, D], wg / wu [E, F, D], wd [E, D, F], idx [N, k] int32, w [N, k] float32;
the result is [N, D] float32. NOT YET COMPILED OR TIMED ON A GPU (README, "Grouped kernel").

Routing (plain jnp in the jitted wrapper, static shapes):
  The P = N * k (token, expert) pairs are sorted by expert (stable argsort). Each expert's
  group is padded to a multiple of `block_rows`, so every row tile of the sorted, padded
  rows belongs to exactly one expert. Used tiles <= (P + min(E, P) * (block_rows - 1)) /
  block_rows, which fixes the static row count R = n_tiles * block_rows. The wrapper builds
    tile_expert [n_tiles] int32   the expert of each tile (tiles past `n_used` are skipped)
    row_tok     [R]               token of each padded row; padding rows -> a zero row N
    pair_row    [P]               padded row of each (n, j) pair
  and gathers the activations xs = [x; 0][row_tok] ([R, D]: activations only, cheap).

Two launches (Pallas Triton lowering, idioms as in `kernel.py` and `pallas_kernels/lora`):
  moe_grouped_up    grid (F // block_f, n_tiles). Program (f, t) loads e = tile_expert[t],
                    then loops over D in `chunk_d` steps: xs tile [block_rows, chunk_d] and
                    the [block_f, chunk_d] tiles wg[e, f-block, chunk], wu[e, f-block, chunk]
                    (read in place from the [E, F, D] arrays), two tl.dot with fp32
                    accumulators; writes h[t-rows, f-block] = silu(h_g).astype(xdt) *
                    h_u.astype(xdt)  (h [R, F] in x.dtype).
  moe_grouped_down  grid (D // block_d, n_tiles). Program (d, t): wd[e, d-block, chunk] times
                    the h tile over F in `chunk_f` steps -> y[t-rows, d-block] fp32 ([R, D]).
The F- (or D-) block is grid axis 0, the fastest-launched (Triton's program_id(0) is CUDA's
blockIdx.x): programs running together share a row tile and its expert, so the xs / h tile
and the expert's weights are re-read from L2, not HBM (README).

Then, in jnp, in the reference's own order: routed = sum_j w[n, j] * y[pair_row[n, j]]
(a gather of y rows and a sum over j; no scatter-add, so no atomics and a fixed order).
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import argsort_ids, pow2, require_triton, triton_params
from pallas_kernels.moe.kernel import check_moe_inputs

_F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))  # lhs @ rhs^T without materializing a transpose
_MIN_TILE = 16  # tl.dot needs every dim >= 16
# Compiled defaults: usual Triton GEMM tiles, NOT measured (README, "Grouped kernel").
# M: rows per tile at most (also the group padding), for 16-bit operands: 128. On the H100,
# bench-a3b's 2,500-token prefill (391 pairs a group: 128-row tiles) took 77.47 / 76.75 ms
# against 80.20 / 79.71 at 64 (alternating in one process, the same logits bit for bit;
# run 73, experiments/results/device/run73/decode_probe_prefill_s17.json; 4 stages: 79.32).
_BLOCK_ROWS = 128
# fp32 operands keep 64: twice the bytes a tile, and 128-row fp32 tiles at the default widths
# were never compiled on the device (shared memory: an SM has 227 KiB).
_BLOCK_ROWS_F32 = 64
_BLOCK_F = 64  # up: N of the dot; two [64, 64] fp32 accumulators (gate and up)
_CHUNK_D = 64  # up: K step over D
_BLOCK_D = 128  # down: N of the dot; one [64, 128] fp32 accumulator
_CHUNK_F = 64  # down: K step over F
_NUM_WARPS = 4
# Warps for 64-row tiles and wider (a prefill's groups): 8. On the H200, bench-a3b's
# 2,500-token prefill took 80.8 ms at 8 against 82.3-82.6 at 4
# (experiments/results/device/run70/decode_probe_prefill_grouped.json, "grows128+gw8"). That
# row was 128-row tiles, not 64: 25,000 pairs over 64 experts average 391 rows a group, so the
# cap picks the tile (259 tiles at 128 rows, 454 at 64). Run 73 (H100) timed 64 and 128 rows,
# both at 8 warps, side by side: 128 is now the default (`_BLOCK_ROWS` above).
_NUM_WARPS_WIDE = 8
_NUM_STAGES = 3
# Where the up launch gets its rows: "xla" gathers xs = [x; 0][row_tok] ([R, D], written then
# read: 48 x 81 us of bench-a3b's 2,500-token prefill on the H200, "loop_gather_fusion" in
# experiments/results/device/run70); "kernel" loads each tile's rows of x in place by their
# tokens (a gather load). "kernel" by default: bench-a3b's 2,500-token prefill took 79.6 ms
# against 80.4 / 80.6 with "xla" (run 71, on an H100: the lent card that day,
# experiments/results/device/run71/decode_probe_prefill_s15.json, variant "ggk"); the up
# launch's scattered loads cost back most of the 3.5 ms gather.
GATHERS = ("xla", "kernel")
_GATHER = "kernel"
# The down launch's rows y, one per (token, expert) pair, rounded to x's dtype (as
# transformers rounds each expert's output) before the weighted fp32 sum over a token's
# experts: a 16-bit prefill writes and reads half the bytes. bench-a3b's 2,500-token prefill
# on the H100: 69.97 against 73.3-73.4 ms with fp32 rows (run 75, decode_probe "gy16",
# experiments/results/device/run75). False: fp32 rows (decode_probe's "gy32").
_ROUND_Y = True


class GroupedTiling(NamedTuple):
  """Static tiling of one call; the kernel bodies close over it."""
  n_experts: int
  f: int
  d: int
  block_rows: int
  n_tiles: int
  block_f: int
  chunk_d: int
  block_d: int
  chunk_f: int
  cd: object = jnp.float32  # x.dtype: operand dtype of both products
  precision: object = None  # HIGHEST for fp32 operands (IEEE, never TF32)
  n_tok: int = 0  # gather="kernel": x's rows (the up launch loads its rows by token), else 0

  @property
  def rows(self):
    return self.n_tiles * self.block_rows


def default_block_rows(n_pairs, n_experts, dtype=jnp.bfloat16):
  """Rows per tile when none is given: the mean group's size (pairs per touched expert) as a
  power of 2, from 16 (`tl.dot`'s least) to 128 (64 for fp32 operands, `dtype`). Every group
  pads to whole tiles, so at decode sizes wide tiles are mostly zeros: bench-a3b at batch 8
  has 80 pairs over 64 experts, and 64-row tiles gather, multiply and write ~4,160 rows a
  layer for them."""
  cap = _BLOCK_ROWS_F32 if jnp.dtype(dtype).itemsize >= 4 else _BLOCK_ROWS
  mean = -(-max(n_pairs, 1) // max(1, min(n_experts, n_pairs)))
  return int(min(cap, max(_MIN_TILE, pl.next_power_of_2(mean))))


def max_tiles(n_pairs, n_experts, block_rows):
  """Static bound on the row tiles the padded groups use: each non-empty group (at most
  min(E, P) of them) pads by at most block_rows - 1 rows."""
  if n_pairs == 0:
    return 0
  return pl.cdiv(n_pairs + min(n_experts, n_pairs) * (block_rows - 1), block_rows)


def grouped_tiling(n, k, n_experts, f, d, *, block_rows=None, interpret=False,
                   block_f=None, chunk_d=None, block_d=None, chunk_f=None,
                   dtype=jnp.bfloat16):
  """Given tiles win; None means the compiled defaults, or under the interpreter the whole
  dim (each interpreted grid step costs ~0.1 ms; fewer is faster). Every tile must be a
  power of 2 >= 16 (tl.dot) and no larger than its dim. block_rows None:
  `default_block_rows` of the call's pairs and operand dtype."""
  if block_rows is None:
    block_rows = default_block_rows(n * k, n_experts, dtype)
  if not isinstance(block_rows, int) or block_rows < _MIN_TILE or not pow2(block_rows):
    raise ValueError(f"moe grouped: block_rows={block_rows} must be a power of 2 >= "
                     f"{_MIN_TILE} (tl.dot needs every dim >= 16)")
  if interpret:
    dflt = dict(block_f=f, chunk_d=d, block_d=d, chunk_f=f)
  else:
    dflt = dict(block_f=min(_BLOCK_F, f), chunk_d=min(_CHUNK_D, d),
                block_d=min(_BLOCK_D, d), chunk_f=min(_CHUNK_F, f))
  given = dict(block_f=block_f, chunk_d=chunk_d, block_d=block_d, chunk_f=chunk_f)
  limit = dict(block_f=f, chunk_d=d, block_d=d, chunk_f=f)
  out = {}
  for name, v in given.items():
    if v is None:
      v = dflt[name]
    elif v < _MIN_TILE or not pow2(v) or v > limit[name]:
      raise ValueError(f"moe grouped: {name}={v} must be a power of 2, >= {_MIN_TILE} and "
                       f"<= {limit[name]}")
    out[name] = v
  return GroupedTiling(n_experts=n_experts, f=f, d=d, block_rows=block_rows,
                       n_tiles=max_tiles(n * k, n_experts, block_rows), **out)


class Routing(NamedTuple):
  """The sorted, padded row layout of one call (all int32 device arrays)."""
  tile_expert: jax.Array  # [n_tiles] expert of each row tile (clamped for unused tiles)
  n_used: jax.Array  # [1] tiles actually used; the kernels skip the rest
  row_tok: jax.Array  # [R] token of each padded row; N (a zero row) for padding rows
  pair_row: jax.Array  # [N * k] padded row of pair (n, j), flattened n-major


# Pair counts up to this rank each pair within its expert's group by a [P, P] compare
# instead of a sort: a few fused XLA kernels in place of a sort, its gathers and scatters
# (bench-a3b at batch 8 spent ~0.6 ms of a 7.2 ms step routing the 48 MoE layers). The
# layout is the sorted one, exactly.
RANK_BY_COMPARE_MAX = 1024


def route(idx, n_experts, block_rows, n_tiles):
  """Sort the (token, expert) pairs by expert and pad each group to whole row tiles.

  Expert ids are read as jnp indexing reads them (negative wrap, then clamp to [0, E)),
  as `moe_reference` and `kernel.py` do. Sorting is stable: within a group, pairs keep
  (n, j) order. Up to RANK_BY_COMPARE_MAX pairs, a pair's place in its group is the count of
  earlier pairs with its expert (no sort); above, a stable argsort gives the same layout.
  """
  n, k = idx.shape
  p = n * k
  bm = block_rows
  e = idx.reshape(-1).astype(jnp.int32)
  e = jnp.clip(jnp.where(e < 0, e + n_experts, e), 0, n_experts - 1)  # [P]
  pairs = jnp.arange(p, dtype=jnp.int32)
  sizes = jnp.sum(e[:, None] == jnp.arange(n_experts, dtype=jnp.int32)[None, :], axis=0,
                  dtype=jnp.int32)  # pairs per expert
  tiles = (sizes + bm - 1) // bm  # row tiles per expert
  tile_end = jnp.cumsum(tiles)
  first_row = (tile_end - tiles) * bm  # padded row of each group's first pair
  if p <= RANK_BY_COMPARE_MAX:
    rank = jnp.sum((e[None, :] == e[:, None]) & (pairs[None, :] < pairs[:, None]), axis=1,
                   dtype=jnp.int32)  # earlier pairs in the same group
    pair_row = first_row[e] + rank
    row_tok = jnp.full((n_tiles * bm,), n, jnp.int32).at[pair_row].set(pairs // k)
  else:
    order = argsort_ids(e, n_experts)  # sorted position -> pair
    e_sorted = e[order]
    first_pair = jnp.cumsum(sizes) - sizes  # sorted position of each group's first pair
    prow = first_row[e_sorted] + pairs - first_pair[e_sorted]
    row_tok = jnp.full((n_tiles * bm,), n, jnp.int32).at[prow].set(order // k)
    pair_row = jnp.zeros((p,), jnp.int32).at[order].set(prow)
  # Expert of tile t: the number of groups ending at or before t ([n_tiles, E] compares).
  tile_ids = jnp.arange(n_tiles, dtype=jnp.int32)
  tile_expert = jnp.sum(tile_end[None, :] <= tile_ids[:, None], axis=1, dtype=jnp.int32)
  tile_expert = jnp.minimum(tile_expert, n_experts - 1)
  return Routing(tile_expert=tile_expert, n_used=tile_end[-1:].astype(jnp.int32),
                 row_tok=row_tok, pair_row=pair_row)


def _dot_nt(a, b, t):
  """a [M, K] @ b[N, K]^T -> [M, N] fp32; operands in x.dtype (weights cast as the model
  casts them), fp32 accumulation, IEEE for fp32 operands."""
  return lax.dot_general(a.astype(t.cd), b.astype(t.cd), _NT, precision=t.precision,
                         preferred_element_type=_F32)


def _up_kernel(n_used_ref, te_ref, first_ref, *refs, t):
  """Program (fb, tile): h[tile rows, fb-block] from rows fb of wg[e], wu[e]. The tile's rows:
  xs_ref's block, or (t.n_tok) rows tok_ref of the whole x_ref, loaded in place; a padding
  row (token N) loads row N - 1 instead of zeros: its h and y rows are never read."""
  if t.n_tok:
    tok_ref, x_ref, wg_ref, wu_ref, h_ref = refs
  else:
    xs_ref, wg_ref, wu_ref, h_ref = refs
  fb, tile = pl.program_id(0), pl.program_id(1)  # read outside `when` (interpreter)
  e = first_ref[0] + te_ref[tile]
  rows = pl.ds(pl.multiple_of(fb * t.block_f, t.block_f), t.block_f)

  @pl.when(tile < n_used_ref[0])
  def _():
    if t.n_tok:
      tok = jnp.minimum(tok_ref[...], t.n_tok - 1)  # [block_rows]

    def body(c, acc):
      cols = pl.ds(pl.multiple_of(c * t.chunk_d, t.chunk_d), t.chunk_d)
      xc = x_ref[tok, cols] if t.n_tok else xs_ref[:, cols]  # [block_rows, chunk_d]
      return (acc[0] + _dot_nt(xc, wg_ref[e, rows, cols], t),
              acc[1] + _dot_nt(xc, wu_ref[e, rows, cols], t))

    zero = jnp.zeros((t.block_rows, t.block_f), _F32)
    h_g, h_u = lax.fori_loop(0, t.d // t.chunk_d, body, (zero, zero))
    h_ref[...] = jax.nn.silu(h_g).astype(t.cd) * h_u.astype(t.cd)


def _down_kernel(n_used_ref, te_ref, first_ref, h_ref, wd_ref, y_ref, *, t):
  """Program (db, tile): y[tile rows, db-block] = h tile @ wd[e][db-block]^T, fp32."""
  db, tile = pl.program_id(0), pl.program_id(1)
  e = first_ref[0] + te_ref[tile]
  rows = pl.ds(pl.multiple_of(db * t.block_d, t.block_d), t.block_d)

  @pl.when(tile < n_used_ref[0])
  def _():
    def body(c, acc):
      cols = pl.ds(pl.multiple_of(c * t.chunk_f, t.chunk_f), t.chunk_f)
      return acc + _dot_nt(h_ref[:, cols], wd_ref[e, rows, cols], t)

    zero = jnp.zeros((t.block_rows, t.block_d), _F32)
    y_ref[...] = lax.fori_loop(0, t.f // t.chunk_f, body, zero).astype(y_ref.dtype)


_WHOLE = pl.BlockSpec()  # the full array: indexed in the kernel by the loaded expert id


@functools.partial(jax.jit, static_argnames=(
    "block_rows", "block_f", "chunk_d", "block_d", "chunk_f", "num_warps", "num_stages",
    "interpret", "gather"))
def routed_experts_grouped(x, wg, wu, wd, idx, w, *, layer=None, block_rows=None,
                           block_f=None, chunk_d=None, block_d=None, chunk_f=None,
                           num_warps=None, num_stages=None, interpret=False, gather=None):
  """Routed experts for many tokens as a grouped GEMM: [N, D] float32.

  Args:
    x: [N, D] activations, float32/bfloat16/float16 (the operand dtype of both products).
    wg, wu: [E, F, D] gate / up expert weights (any of the three float dtypes; cast to
      x.dtype inside the kernel, as the model casts them).
    wd: [E, D, F] down expert weights.
    idx: [N, k] int32 expert ids (negative ids wrap and others clamp, as jnp indexing).
    w: [N, k] float32 routing weights.
    layer: optional integer scalar (may be traced): wg / wu / wd are then whole layer stacks
      [L, E, F, D] / [L, E, D, F] and layer `layer`'s experts are read in place (as
      `moe_pallas(layer=)`: a slice made by a layer scan would be copied for the kernel).
    block_rows: rows per tile; every expert's group is padded to a multiple of it. A power
      of 2 >= 16; None: `default_block_rows` (16 at decode batches, 128 for a 16-bit
      prefill, 64 for fp32).
    block_f, chunk_d: up kernel: F columns of h per program, D step of the product.
    block_d, chunk_f: down kernel: D columns of y per program, F step of the product.
      Powers of 2, >= 16, no larger than their dim; None: the compiled defaults (64, 64,
      128, 64) or, interpreted, the whole dim.
    num_warps, num_stages: Triton compiler parameters (ignored in interpret mode).
    interpret: run the Pallas interpreter (CPU).
    gather: "xla" (the activations gathered into sorted rows first) or "kernel" (the up
      launch loads its rows of x by token); None: `_GATHER`. The same result either way.

  Returns:
    routed [N, D] float32: sum_j w_j y_j in fp32, each y_j rounded to x's dtype first
    (`_ROUND_Y`; `moe_reference(round_y=True)`).
  """
  check_moe_inputs(x, wg, wu, wd, idx, w, layer)
  require_triton(interpret, "moe grouped", "'xla'")
  n, d = x.shape
  n_experts, f = wg.shape[-3:-1]
  k = idx.shape[1]
  t = grouped_tiling(n, k, n_experts, f, d, block_rows=block_rows, interpret=interpret,
                     block_f=block_f, chunk_d=chunk_d, block_d=block_d, chunk_f=chunk_f,
                     dtype=x.dtype)
  if layer is None:
    first = jnp.zeros((1,), jnp.int32)
  else:  # [L, E, ...] -> [L * E, ...] is a free reshape; expert e of layer l is row l * E + e
    n_layers = wg.shape[0]
    first = (jnp.clip(jnp.asarray(layer, jnp.int32), 0, n_layers - 1) * n_experts)[None]
    wg, wu, wd = (a.reshape(n_layers * n_experts, *a.shape[2:]) for a in (wg, wu, wd))
  if n == 0 or k == 0:
    return jnp.zeros((n, d), _F32)
  cd = jnp.dtype(x.dtype)
  t = t._replace(cd=cd, precision=lax.Precision.HIGHEST if cd == _F32 else None)

  gather = gather or _GATHER
  if gather not in GATHERS:
    raise ValueError(f"moe grouped: gather={gather!r}: expected one of {GATHERS}")
  r = route(idx, n_experts, t.block_rows, t.n_tiles)
  bm = t.block_rows
  if gather == "kernel":
    t = t._replace(n_tok=n)
    rows_in = [r.row_tok, x]
    rows_specs = [pl.BlockSpec((bm,), lambda fb, i: (i,)), _WHOLE]  # tokens; x in place
  else:
    rows_in = [jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])[r.row_tok]]  # [R, D]; pad: 0
    rows_specs = [pl.BlockSpec((bm, d), lambda fb, i: (i, 0))]  # xs: the tile's rows
  warps = num_warps or (_NUM_WARPS_WIDE if t.block_rows >= 64 else _NUM_WARPS)
  params = None if interpret else triton_params(warps, num_stages or _NUM_STAGES)
  call = functools.partial(pl.pallas_call, interpret=interpret, compiler_params=params)
  h = call(
      functools.partial(_up_kernel, t=t), grid=(f // t.block_f, t.n_tiles),
      out_shape=jax.ShapeDtypeStruct((t.rows, f), x.dtype),
      in_specs=[_WHOLE, _WHOLE, _WHOLE,  # n_used, tile_expert, first
                *rows_specs,
                _WHOLE, _WHOLE],  # wg, wu: read in place at the loaded expert
      out_specs=pl.BlockSpec((bm, t.block_f), lambda fb, i: (i, fb)),
      name="moe_grouped_up",
  )(r.n_used, r.tile_expert, first, *rows_in, wg, wu)
  y = call(
      functools.partial(_down_kernel, t=t), grid=(d // t.block_d, t.n_tiles),
      out_shape=jax.ShapeDtypeStruct((t.rows, d), cd if _ROUND_Y else _F32),
      in_specs=[_WHOLE, _WHOLE, _WHOLE,  # n_used, tile_expert, first
                pl.BlockSpec((bm, f), lambda db, i: (i, 0)),  # h: the tile's rows
                _WHOLE],  # wd
      out_specs=pl.BlockSpec((bm, t.block_d), lambda db, i: (i, db)),
      name="moe_grouped_down",
  )(r.n_used, r.tile_expert, first, h, wd)
  # The reference's last step, in its order: sum over j of y_j * w_j (fp32).
  y_pairs = y[r.pair_row].reshape(n, k, d).astype(_F32)
  return jnp.sum(y_pairs * w.astype(_F32)[..., None], axis=1)
