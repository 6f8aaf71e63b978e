"""LoRA delta on Mosaic GPU (Hopper WGMMA + TMA): the same contract as `kernel.lora_pallas`.

y[n] = where(on[n] != 0, base[n] + scale * B @ (A @ x[n]), base[n]), fp32 accumulation.

A port of the fused form of `kernel.py` to `jax.experimental.pallas.mosaic_gpu` (`plgpu`),
the Pallas GPU backend JAX 0.11 keeps while it deprecates the Triton lowering. The README's
"Backend" section has the measured comparison and which one is the GPU default.

One `plgpu.kernel` launch, grid (row blocks of 64, G Dout splits); each program:
  1. down: h [64, Rp] = x[rows] @ A^T, a TMA pipeline over Din tiles of `block_in` columns
     (x and A tiles in swizzled SMEM, one WGMMA per tile, fp32 accumulator);
  2. h stays fp32: it is split as hi + lo (both bf16, together h to 2^-17 relative);
  3. up: for each of its Dout tiles, acc = hi @ B^T + lo @ B^T (two WGMMAs, h from
     registers, B tile from SMEM), then out = select(on, base + scale * acc, base), stored
     through SMEM by TMA.
h is recomputed by each of the G programs of a row block (A and x re-read from L2); G trades
that against parallelism (`mosaic_tiling`).

Mosaic GPU has no masked loads, so the shapes it takes are narrower than the Triton kernel's:
x, a and b bf16 (base any float dtype); Din a multiple of 64; Dout a multiple of 64. N and R
are padded here (rows to a multiple of 64, with `on = 0`; R to a multiple of 64 with zero
rows of A / columns of B, which is exact); padding copies x / base / on (N) or A / B (R), so
callers that care pad once (the model pads R when stacking adapters). `mosaic_supported`
says whether a call fits; the api falls back to another implementation when it does not.

No rows are skipped: every program computes and writes its block (an all-off block writes
base's bits back). Off rows are a select, so they are bit-identical to base.
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.lora.kernel import check_lora_inputs

try:  # Hopper-only backend; a JAX without it leaves `plgpu` None (CPU: interpreter only).
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
  plgpu = None

_F32 = jnp.float32
_BF16 = jnp.dtype(jnp.bfloat16)
_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), _BF16)
BLOCK_ROWS = 64  # one warpgroup's WGMMA M
_RANK_MULTIPLE = 64  # R is the K of the up product: whole 128-byte swizzle rows of bf16
_MAX_RANK = 256  # WGMMA N of the down product
_SMEM_BUDGET = 200 * 1024  # bytes for both pipelines' buffers (H200: 227 KiB per block)
_TARGET_PROGRAMS = 132  # H200 SMs: aim at about one wave


class MosaicTiling(NamedTuple):
  """Static tiling of one call (`mosaic_tiling` derives it; the kernel closes over it)."""
  n_pad: int  # rows padded to BLOCK_ROWS
  d_in: int
  d_out: int
  rank_pad: int  # Rp: R rounded up to a multiple of 64
  block_in: int  # bk: Din tile (TMA step of the down pipeline)
  block_out: int  # bo: Dout tile (TMA step of the up pipeline)
  dout_splits: int  # G: programs along Dout per row block
  in_stages: int  # buffers in flight, down pipeline
  out_stages: int  # buffers in flight, up pipeline
  scale: float = 1.0
  interpret: bool = False  # Mosaic GPU interpreter (CPU): no register layouts

  @property
  def row_blocks(self):
    return self.n_pad // BLOCK_ROWS

  @property
  def out_tiles(self):  # Dout tiles per program
    return self.d_out // (self.block_out * self.dout_splits)

  @property
  def out_span(self):
    return self.out_tiles * self.block_out


def mosaic_supported(base, x, a, b):
  """None if `lora_mosaic` takes these operands, else the reason it does not."""
  if not all(getattr(v, "ndim", 0) == 2 for v in (base, x, a, b)):
    return "operands must be 2-D"
  if any(jnp.dtype(v.dtype) != _BF16 for v in (x, a, b)):
    return f"x, a, b must be bfloat16 (got {x.dtype}, {a.dtype}, {b.dtype})"
  if jnp.dtype(base.dtype) not in _FLOATS:
    return f"base dtype {base.dtype} is not a float dtype"
  if x.shape[1] % 64:
    return f"Din = {x.shape[1]} is not a multiple of 64"
  if base.shape[1] % 64:
    return f"Dout = {base.shape[1]} is not a multiple of 64"
  if _round_up(a.shape[0], _RANK_MULTIPLE) > _MAX_RANK:
    return f"rank {a.shape[0]} pads past {_MAX_RANK}"
  return None


def mosaic_tiling(n, d_in, d_out, rank, *, base_itemsize=2, block_in=None, block_out=None,
                  dout_splits=None, in_stages=None, out_stages=None, num_sms=_TARGET_PROGRAMS):
  """Pick tiles: given values win. bk = 128 (64 when Din is not a multiple of 128), bo = 128
  (64 likewise); G = the largest divisor of the Dout tile count that keeps row blocks x G at
  most ~`num_sms` programs (at least 1); stages: as many as fit `_SMEM_BUDGET`, 2..4."""
  rp = _round_up(rank, _RANK_MULTIPLE)
  n_pad = _round_up(max(n, 1), BLOCK_ROWS)
  bk = block_in or (128 if d_in % 128 == 0 else 64)
  bo = block_out or (128 if d_out % 128 == 0 else 64)
  if d_in % bk or d_out % bo:
    raise ValueError(f"lora mosaic: block_in {bk} / block_out {bo} must divide "
                     f"Din {d_in} / Dout {d_out}")
  tiles = d_out // bo
  rows = n_pad // BLOCK_ROWS
  if dout_splits is None:
    dout_splits = max([g for g in range(1, tiles + 1) if tiles % g == 0
                       and rows * g <= max(num_sms, rows)] or [1])
  if tiles % dout_splits:
    raise ValueError(f"lora mosaic: dout_splits {dout_splits} must divide the {tiles} "
                     f"Dout tiles of {bo}")
  in_step = (BLOCK_ROWS + rp) * bk * 2
  out_step = bo * rp * 2 + 2 * BLOCK_ROWS * bo * base_itemsize  # B tile, base in, out
  if in_stages is None:
    in_stages = 4
    while in_stages > 2 and in_stages * in_step + 2 * out_step > _SMEM_BUDGET:
      in_stages -= 1
  in_stages = max(1, min(in_stages, d_in // bk))
  if out_stages is None:
    out_stages = 2
  out_stages = max(1, min(out_stages, tiles // dout_splits))
  return MosaicTiling(n_pad=n_pad, d_in=d_in, d_out=d_out, rank_pad=rp, block_in=bk,
                      block_out=bo, dout_splits=dout_splits, in_stages=in_stages,
                      out_stages=out_stages)


def _round_up(v, m):
  return -(-v // m) * m


def _smem_transforms(minor, dtype):
  """Tiling + swizzle for an SMEM tile whose minor dim holds `minor` elements of dtype."""
  bits = minor * jnp.dtype(dtype).itemsize * 8
  swizzle = plgpu.find_swizzle(bits)
  elems = swizzle // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def _dot_nt(lhs, rhs):
  """lhs [M, K] @ rhs [N, K]^T -> [M, N] fp32 (interpreter path only)."""
  return lax.dot_general(lhs, rhs, (((1,), (1,)), ((), ())), preferred_element_type=_F32)


def _lora_kernel(on_gmem, x_gmem, a_gmem, b_gmem, base_gmem, o_gmem, *, t):
  bm, rp, bk, bo = BLOCK_ROWS, t.rank_pad, t.block_in, t.block_out
  m = lax.axis_index("m")
  g = lax.axis_index("g")
  rows = pl.ds(m * bm, bm)
  col0 = g * t.out_span
  cols = pl.ds(col0, t.out_span)
  in_tr = _smem_transforms(bk, _BF16)  # x and A tiles: bk bf16 columns
  b_tr = _smem_transforms(rp, _BF16)  # B tile [bo, Rp]
  io_tr = _smem_transforms(bo, base_gmem.dtype)  # base and out tiles [64, bo]

  # 1. h = x[rows] @ A^T over Din (WGMMA, fp32 accumulator; A^T is a transposed SMEM view).
  release = 1 if t.in_stages > 1 else 0
  down_specs = [plgpu.BlockSpec((bm, bk), lambda k: (0, k), transforms=in_tr,
                                delay_release=release),
                plgpu.BlockSpec((rp, bk), lambda k: (0, k), transforms=in_tr,
                                delay_release=release)]

  def down(acc_ref):
    def step(_, x_smem, a_smem):
      plgpu.wgmma(acc_ref, x_smem, plgpu.transpose_ref(a_smem, (1, 0)))
      plgpu.wgmma_wait(1)  # the previous step's WGMMA is done: its buffers may refill

    plgpu.emit_pipeline(step, grid=(t.d_in // bk,), max_concurrent_steps=t.in_stages,
                        in_specs=down_specs)(x_gmem.at[rows], a_gmem)
    return acc_ref[...]

  def down_interpret():  # the interpreter has no WGMMA on a transposed ref: a jnp dot
    return plgpu.emit_pipeline(
        lambda _, x_smem, a_smem, h: h + _dot_nt(x_smem[...], a_smem[...]),
        grid=(t.d_in // bk,), max_concurrent_steps=t.in_stages, in_specs=down_specs,
        init_carry=jnp.zeros((bm, rp), _F32))(x_gmem.at[rows], a_gmem)

  h = down_interpret() if t.interpret else pl.run_scoped(down, plgpu.ACC((bm, rp), _F32))
  hi = h.astype(_BF16)
  lo = (h - hi.astype(_F32)).astype(_BF16)

  # 2. This row block's switch, one int32 per row, as a row vector of the WGMMA layout.
  def load_on(on_smem, bar):
    plgpu.copy_gmem_to_smem(on_gmem.at[rows], on_smem, bar)
    plgpu.barrier_wait(bar)
    v = on_smem[...]  # the interpreter has no layouts (nor plgpu.load / layout_cast)
    return v if t.interpret else plgpu.layout_cast(v, plgpu.Layout.WGMMA.reduce(1))

  on = pl.run_scoped(load_on, plgpu.SMEM((bm,), jnp.int32), plgpu.Barrier(num_arrivals=1))
  on_tile = lax.broadcast_in_dim(on != 0, (bm, bo), [0])

  # 3. For each Dout tile: acc = (hi + lo) @ B^T; out = select(on, base + scale * acc, base),
  #    stored by TMA from one of two SMEM slots (a store overlaps the next tile's work).
  def up(o_smem):
    def step(idx, b_smem, base_smem):
      (j,) = idx
      if t.interpret:
        b_tile = b_smem[...]
        d = _dot_nt(hi, b_tile) + _dot_nt(lo, b_tile)
      else:
        def prod(acc_ref):
          b_t = plgpu.transpose_ref(b_smem, (1, 0))
          plgpu.wgmma(acc_ref, hi, b_t)
          plgpu.wgmma(acc_ref, lo, b_t)
          return acc_ref[...]
        d = pl.run_scoped(prod, plgpu.ACC((bm, bo), _F32))
      if t.scale != 1.0:
        d = d * t.scale
      base = base_smem[...]
      y = jnp.where(on_tile, (base.astype(_F32) + d).astype(base.dtype), base)
      slot = lax.rem(j, 2)
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # this slot's last store has read it
      o_smem[slot] = y
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem.at[slot], o_gmem.at[rows, pl.ds(col0 + j * bo, bo)])

    plgpu.emit_pipeline(
        step, grid=(t.out_tiles,), max_concurrent_steps=t.out_stages,
        in_specs=[plgpu.BlockSpec((bo, rp), lambda j: (j, 0), transforms=b_tr),
                  plgpu.BlockSpec((bm, bo), lambda j: (0, j), transforms=io_tr)],
    )(b_gmem.at[cols], base_gmem.at[rows, cols])
    plgpu.wait_smem_to_gmem(0)

  pl.run_scoped(up, plgpu.SMEM((2, bm, bo), base_gmem.dtype, transforms=io_tr))


@functools.partial(jax.jit, static_argnames=(
    "scale", "block_in", "block_out", "dout_splits", "in_stages", "out_stages", "interpret"))
def lora_mosaic(base, x, a, b, on, *, scale=1.0, block_in=None, block_out=None,
                dout_splits=None, in_stages=None, out_stages=None, interpret=None):
  """y = where(on != 0, base + scale * (x @ a^T) @ b^T, base) on Mosaic GPU (Hopper).

  Same arguments and result as `kernel.lora_pallas` for the shapes `mosaic_supported`
  accepts (ValueError otherwise). Tiles: `mosaic_tiling`. `interpret`: None compiles for the
  GPU; the Mosaic GPU interpreter's params (`interpret_params()`) run it on the CPU, with
  jnp dots in place of the WGMMAs (the interpreter has no WGMMA on a transposed ref).
  """
  check_lora_inputs(base, x, a, b, on)
  if plgpu is None:
    raise ValueError("lora mosaic: this JAX has no jax.experimental.pallas.mosaic_gpu")
  why = mosaic_supported(base, x, a, b)
  if why:
    raise ValueError(f"lora mosaic: unsupported operands: {why}")
  n, d_in = x.shape
  r, d_out = a.shape[0], base.shape[1]
  t = mosaic_tiling(n, d_in, d_out, r, base_itemsize=jnp.dtype(base.dtype).itemsize,
                    block_in=block_in, block_out=block_out, dout_splits=dout_splits,
                    in_stages=in_stages, out_stages=out_stages)._replace(
                        scale=float(scale), interpret=interpret is not None)
  on = (on != 0).astype(jnp.int32)
  if t.rank_pad != r:  # zero rows of A / columns of B add exact zeros
    a = jnp.pad(a, ((0, t.rank_pad - r), (0, 0)))
    b = jnp.pad(b, ((0, 0), (0, t.rank_pad - r)))
  pad_rows = t.n_pad - n
  base_in = base
  if pad_rows:  # padded rows are off; they are sliced away below
    x = jnp.pad(x, ((0, pad_rows), (0, 0)))
    base_in = jnp.pad(base, ((0, pad_rows), (0, 0)))
    on = jnp.pad(on, (0, pad_rows))
  call = plgpu.kernel(
      functools.partial(_lora_kernel, t=t),
      out_type=jax.ShapeDtypeStruct(base_in.shape, base_in.dtype),
      grid=(t.row_blocks, t.dout_splits), grid_names=("m", "g"),
      compiler_params=plgpu.CompilerParams(),
      **({} if interpret is None else {"interpret": interpret}),
  )
  y = call(on, x, a, b, base_in)
  return y[:n] if pad_rows else y


def interpret_params():
  """The Mosaic GPU interpreter's params (CPU runs of `lora_mosaic`), or None if absent."""
  try:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  except ImportError:  # pragma: no cover - a JAX without the Mosaic GPU interpreter
    return None
  return InterpretGPUParams()
