"""Pallas kernel for the routed experts of an MoE FFN at decode, reading expert weights in place.

routed[n] = sum_j w[n, j] * wd[e] @ (silu(wg[e] @ x[n]) * (wu[e] @ x[n])),  e = idx[n, j].

Shapes: x [N, D], wg / wu [E, F, D], wd [E, D, F], idx [N, k] int32, w [N, k] float32;
the result is [N, D] float32. The math and the numbers are in this folder's README.

Two launches (Pallas Triton lowering, as in `pallas_kernels/lora`):

  moe_up    grid (N, k, F // block_f). Program (n, j, f) reads e = idx[n, j] from memory,
            then x[n] and the [block_f, D] rows f of wg[e] and wu[e] straight from the
            [E, F, D] arrays (in `chunk_d` column steps), and writes
            h[n, j, f-block] = silu(h_g).astype(xdt) * h_u.astype(xdt)   (h [N, k, F] in xdt).
  moe_down  grid (N, k, D // block_d). Program (n, j, d) reads e = idx[n, j], the [block_d, F]
            rows d of wd[e] (in `chunk_f` column steps) and h[n, j], and writes
            y[n, j, d-block] = wd_tile . h in fp32 (y [N, k, D]). Then, in jnp, the
            reference's last step: routed = sum_j w[n, j] * y[n, j].
            (One program per expert tile: the earlier form, one program per D block
            looping over the k experts, had 128 programs at N = 1 each waiting on k loads
            in turn, and read wd at 1.1 TB/s on the H200.)

The weights are never gathered: every weight input is passed whole (a full-array BlockSpec,
i.e. a pointer) and indexed by the expert id loaded inside the kernel, e.g.
`wg_ref[e, pl.ds(f0, block_f), pl.ds(d0, chunk_d)]`. Each program reads only its tile of the
chosen experts, so the weight traffic is N * k * 3 * F * D elements, once.

M = 1 per (row, expert), so no tl.dot: each product is a broadcast multiply and a row sum,
in fp32 (weights cast to x.dtype first, as the model does, then to fp32: two 16-bit numbers
multiply exactly in fp32). D and F must be powers of 2 (>= 16): every tile is then a power
of 2 that divides its dim, so no load or store needs a mask.
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import SQUEEZED, pow2, require_triton, triton_params

_F32 = jnp.float32
_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_MIN_DIM = 16
# Compiled defaults (H200, bench-a3b shapes N 1, k 10, F 512, D 2048; README "Tiling").
_BLOCK_F = 16  # up: F rows per program (8 at N = 1): N * k * F / block_f programs (640 at N = 1)
_CHUNK_D = 512  # up: D columns per loop step ([16, 512] bf16 tiles of wg and wu: 16 KiB each)
_BLOCK_D = 16  # down: D rows per program -> N * k * D / 16 programs (1,280 at N = 1)
_CHUNK_F = 512  # down: F columns per step ([16, 512] bf16 tile of wd: 16 KiB)
_NUM_WARPS = 8  # 8 beat 4 by 5-10% at N = 1..4 and 2 by more (README)
_NUM_STAGES = 3


class Tiling(NamedTuple):
  """Static tiling of one call; `tiling()` derives it, the kernel bodies close over it."""
  n: int
  k: int
  n_experts: int
  f: int
  d: int
  block_f: int
  chunk_d: int
  block_d: int
  chunk_f: int
  cd: object = jnp.float32  # x.dtype: weights are cast to it before the products


def tiling(n, k, n_experts, f, d, *, interpret=False, block_f=None, chunk_d=None,
           block_d=None, chunk_f=None):
  """Pick tiles: given values win; None means the H200 defaults (README), or on the
  interpreter the whole dim (each interpreted grid step costs ~0.1 ms; fewer is faster)."""
  if interpret:
    dflt = dict(block_f=f, chunk_d=d, block_d=d, chunk_f=f)
  else:
    bf = _BLOCK_F // 2 if n == 1 else _BLOCK_F  # N = 1: twice the programs, 6% faster
    dflt = dict(block_f=min(bf, f), chunk_d=min(_CHUNK_D, d),
                block_d=min(_BLOCK_D, d), chunk_f=min(_CHUNK_F, f))
  given = dict(block_f=block_f, chunk_d=chunk_d, block_d=block_d, chunk_f=chunk_f)
  limit = dict(block_f=f, chunk_d=d, block_d=d, chunk_f=f)
  out = {}
  for name, v in given.items():
    if v is None:
      v = dflt[name]
    elif not pow2(v) or v > limit[name]:
      raise ValueError(f"moe: {name}={v} must be a power of 2 <= {limit[name]}")
    out[name] = v
  return Tiling(n=n, k=k, n_experts=n_experts, f=f, d=d, **out)


def check_moe_inputs(x, wg, wu, wd, idx, w, layer=None):
  """Validate shapes and dtypes; raise ValueError naming the offending operand.

  With `layer`, wg / wu / wd carry a leading layer dim ([L, E, F, D], [L, E, D, F]) and
  `layer` is an integer scalar; it is checked here and the leading dim is then dropped.
  """
  if layer is not None:
    if jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
      raise ValueError(f"moe: layer must be an integer scalar, got {layer!r}")
    for name, arr in (("wg", wg), ("wu", wu), ("wd", wd)):
      if arr.ndim != 4 or arr.shape[0] != wg.shape[0]:
        raise ValueError(f"moe: with layer=, {name} must be 4-D [L, ...] with wg's L, got "
                         f"shape {arr.shape}")
    wg, wu, wd = (jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in (wg, wu, wd))
  if x.ndim != 2:
    raise ValueError(f"moe: x must be 2-D [N, D], got shape {x.shape}")
  for name, arr in (("x", x), ("wg", wg), ("wu", wu), ("wd", wd)):
    if jnp.dtype(arr.dtype) not in _FLOATS:
      raise ValueError(f"moe: {name} dtype {arr.dtype} is not float32, float16 or bfloat16")
  for name, arr in (("wg", wg), ("wu", wu), ("wd", wd)):
    if arr.ndim != 3:
      raise ValueError(f"moe: {name} must be 3-D, got shape {arr.shape}")
  n, d = x.shape
  e, f = wg.shape[0], wg.shape[1]
  if wg.shape != (e, f, d) or wu.shape != (e, f, d):
    raise ValueError(f"moe: wg {wg.shape} and wu {wu.shape} must both be [E, F, D] with "
                     f"D = x.shape[1] = {d}")
  if wd.shape != (e, d, f):
    raise ValueError(f"moe: wd {wd.shape} must be [E, D, F] = {(e, d, f)}")
  if idx.ndim != 2 or idx.shape[0] != n:
    raise ValueError(f"moe: idx must be [N, k] with N = {n}, got shape {idx.shape}")
  if not jnp.issubdtype(idx.dtype, jnp.integer):
    raise ValueError(f"moe: idx must be int32, got {idx.dtype}")
  if w.shape != idx.shape:
    raise ValueError(f"moe: w {w.shape} must have idx's shape {idx.shape}")
  if not jnp.issubdtype(w.dtype, jnp.floating):
    raise ValueError(f"moe: w must be float32, got {w.dtype}")
  for name, v in (("D", d), ("F", f)):
    if v < _MIN_DIM or not pow2(v):
      raise ValueError(f"moe: {name}={v} must be a power of 2 >= {_MIN_DIM} (the kernel's "
                       f"tiles divide it exactly); use implementation='xla' otherwise")
  if e < 1:
    raise ValueError(f"moe: no experts (E = {e})")


def _expert(idx_ref, first_ref, n, j, n_experts):
  """Row of the (layer-flattened) weight stack for idx[n, j]: first + e, with e read as jnp
  indexing reads it (negative ids wrap, then clamp to [0, E)); first = layer * E."""
  e = idx_ref[n, j]
  e = jnp.where(e < 0, e + n_experts, e)
  return first_ref[0] + jnp.clip(e, 0, n_experts - 1)


def _f32(v, cd):
  """Weights as the model uses them (cast to x.dtype), then fp32 for an exact product."""
  return v.astype(cd).astype(_F32)


def _up_kernel(idx_ref, first_ref, x_ref, wg_ref, wu_ref, h_ref, *, t):
  """Program (n, j, fb): h[n, j, fb-block] from rows fb of wg[e], wu[e], e = idx[n, j]."""
  n, j, fb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  e = _expert(idx_ref, first_ref, n, j, t.n_experts)
  rows = pl.ds(pl.multiple_of(fb * t.block_f, t.block_f), t.block_f)

  def body(c, acc):
    cols = pl.ds(pl.multiple_of(c * t.chunk_d, t.chunk_d), t.chunk_d)
    xv = x_ref[n, cols].astype(_F32)[None, :]  # [1, chunk_d]
    g = jnp.sum(_f32(wg_ref[e, rows, cols], t.cd) * xv, axis=1)  # [block_f]
    u = jnp.sum(_f32(wu_ref[e, rows, cols], t.cd) * xv, axis=1)
    return acc[0] + g, acc[1] + u

  zero = jnp.zeros((t.block_f,), _F32)
  h_g, h_u = lax.fori_loop(0, t.d // t.chunk_d, body, (zero, zero))
  h_ref[...] = jax.nn.silu(h_g).astype(t.cd) * h_u.astype(t.cd)


def _down_kernel(idx_ref, first_ref, h_ref, wd_ref, y_ref, *, t):
  """Program (n, j, db): y[n, j, db-block] = wd[e][db-block] @ h[n, j], e = idx[n, j], fp32."""
  n, j, db = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  e = _expert(idx_ref, first_ref, n, j, t.n_experts)
  rows = pl.ds(pl.multiple_of(db * t.block_d, t.block_d), t.block_d)
  y = jnp.zeros((t.block_d,), _F32)
  for c in range(t.f // t.chunk_f):  # usually one step (F <= chunk_f)
    cols = pl.ds(c * t.chunk_f, t.chunk_f)
    hv = h_ref[n, j, cols].astype(_F32)[None, :]  # [1, chunk_f], exact (h is in x.dtype)
    y = y + jnp.sum(_f32(wd_ref[e, rows, cols], t.cd) * hv, axis=1)
  y_ref[...] = y


@functools.partial(jax.jit, static_argnames=(
    "block_f", "chunk_d", "block_d", "chunk_f", "num_warps", "num_stages", "interpret"))
def moe_pallas(x, wg, wu, wd, idx, w, layer=None, *, block_f=None, chunk_d=None, block_d=None,
               chunk_f=None, num_warps=None, num_stages=None, interpret=False):
  """Routed experts, reading each chosen expert's weights in place: [N, D] float32.

  Args:
    x: [N, D] activations, float32/bfloat16/float16 (sets the compute dtype of h).
    wg, wu: [E, F, D] gate / up expert weights (any of the three float dtypes).
    wd: [E, D, F] down expert weights.
    idx: [N, k] int32 expert ids (negative ids wrap and others clamp, as jnp indexing).
    w: [N, k] float32 routing weights.
    layer: optional integer scalar (may be traced). When given, wg / wu / wd are whole
      layer stacks, [L, E, F, D] / [L, E, D, F], and the kernel reads layer `layer`'s
      experts from them in place (clamped to [0, L)). Inside a `lax.scan` over layers this
      is what keeps the read in place: a per-layer slice made by the scan would be copied
      into its own buffer before any custom call could read it (README).
    block_f, chunk_d: up kernel: F rows per program, D columns per loop step.
    block_d, chunk_f: down kernel: D rows per program, F columns per step.
      All powers of 2 no larger than their dim; None picks `tiling()`'s defaults.
    num_warps, num_stages: Triton compiler parameters (ignored in interpret mode).
    interpret: run the Pallas interpreter (CPU).

  Returns:
    routed [N, D] float32.
  """
  check_moe_inputs(x, wg, wu, wd, idx, w, layer)
  require_triton(interpret, "moe", "implementation='xla'")
  n, d = x.shape
  n_experts, f = wg.shape[-3:-1]
  k = idx.shape[1]
  if layer is None:
    first = jnp.zeros((1,), jnp.int32)
  else:  # [L, E, ...] -> [L * E, ...] is a free reshape; expert e of layer l is row l * E + e
    n_layers = wg.shape[0]
    first = (jnp.clip(jnp.asarray(layer, jnp.int32), 0, n_layers - 1) * n_experts)[None]
    wg, wu, wd = (a.reshape(n_layers * n_experts, *a.shape[2:]) for a in (wg, wu, wd))
  if n == 0 or k == 0:
    return jnp.zeros((n, d), _F32)
  t = tiling(n, k, n_experts, f, d, interpret=interpret, block_f=block_f, chunk_d=chunk_d,
             block_d=block_d, chunk_f=chunk_f)._replace(cd=jnp.dtype(x.dtype))
  idx = idx.astype(jnp.int32)
  w = w.astype(_F32)
  params = None if interpret else triton_params(num_warps or _NUM_WARPS,
                                                 num_stages or _NUM_STAGES)
  call = functools.partial(pl.pallas_call, interpret=interpret, compiler_params=params)
  h = _up_call(call, t, idx, first, x, wg, wu)
  return _down_call(call, t, idx, first, w, h, wd)


_WHOLE = pl.BlockSpec()  # the full array: indexed in the kernel by the loaded expert id


def _up_call(call, t, idx, first, x, wg, wu):
  """h [N, k, F] in x.dtype."""
  return call(
      functools.partial(_up_kernel, t=t), grid=(t.n, t.k, t.f // t.block_f),
      out_shape=jax.ShapeDtypeStruct((t.n, t.k, t.f), x.dtype),
      in_specs=[_WHOLE] * 5,  # idx, first, x, wg, wu
      out_specs=pl.BlockSpec((SQUEEZED, SQUEEZED, t.block_f), lambda i, j, c: (i, j, c)),
      name="moe_up",
  )(idx, first, x, wg, wu)


def _down_call(call, t, idx, first, w, h, wd):
  """routed [N, D] fp32: y [N, k, D] from one program per (row, expert, D block), then the
  reference's own sum over j (XLA fuses it with what follows)."""
  y = call(
      functools.partial(_down_kernel, t=t), grid=(t.n, t.k, t.d // t.block_d),
      out_shape=jax.ShapeDtypeStruct((t.n, t.k, t.d), _F32),
      in_specs=[_WHOLE] * 4,  # idx, first, h, wd
      out_specs=pl.BlockSpec((SQUEEZED, SQUEEZED, t.block_d), lambda i, j, c: (i, j, c)),
      name="moe_down",
  )(idx, first, h, wd)
  return jnp.sum(y * w[..., None], axis=1)
