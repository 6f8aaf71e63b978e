"""Pallas kernel for the router's top-k: the k largest of each row of [N, E] and their ids.

On the H200 XLA lowers `lax.top_k` of the router's [1, 512] probabilities to a full sort:
48 sort launches a step, 259 µs of the 80B-A3B Q4_K_M decode step at batch 1
(`experiments/results/device/decode_probe_a80b_run7_profile.json`). This kernel is one
launch: program i holds rows [i·bn, (i+1)·bn) whole and takes k maxima in turn.

Each of the k rounds takes, over the entries not yet taken, the maximum and the lowest
column holding it, then marks that column taken: `lax.top_k`'s values and ids exactly, ties
to the lower id, ±inf included (NaN is not supported; router probabilities have none).
Rows are padded to a multiple of bn and columns to a power of 2 (Triton's block shapes) only
when they are not already; the results are [N, k] in x's dtype and int32.

`route_pallas` is the whole routing in that launch: from the router's fp32 logits, the
softmax (`jax.nn.softmax`'s formula: exp(x - max) / sum), the top-k of the probabilities as
above, and their renormalisation (w / sum(w)), where XLA ran a softmax kernel, the top-k and a
small fusion for the division (bench-a3b at batch 1 on the H200: 61 + 119 + 52 us a step, 48
layers; experiments/results/device/decode_probe_moe_run29.json). Same ids as the reference
(`reference.route_reference`); weights to fp32 rounding (the exp and the sums' order).

`route_pallas` also takes the router GEMV's split partial sums [S, N, E] (the in-place GEMV
splits `in` S ways and XLA adds the parts, p0 + p1 + ..., in its own launch) and adds them in
that order itself, so the logits are the same fp32 values and the add's launch is gone. The
results are stored k columns wide under a mask (no slice of a padded [N, k_pad] block after
the kernel: on the H200 that slice was a memcpy launch a layer).
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import require_triton, sum_ref_partials, triton_params
from pallas_kernels.quant.gemv import masked_store

_ROWS = 16   # rows a program at most (a prefill's N rows run N / 16 programs)


def _load_rows(x_ref, n_parts):
  """The program's rows [bn, E_pad] in fp32: x, or the sum of its n_parts split partials
  [S, bn, E_pad] added in index order (`gemv.sum_partials`' order, so the same values)."""
  if n_parts == 0:
    return x_ref[...].astype(jnp.float32)
  return sum_ref_partials(x_ref, n_parts)


def _store_rows(ref, val, row0, k):
  """Store val [bn, k_pad] at rows row0.., columns 0..k-1 of ref [N_pad, k] (a whole-array
  ref; the mask keeps the padding columns out). Rows stay whole blocks: a block that started
  inside the array and ran past its end would be moved back to fit by JAX 0.11's
  interpreter (run 35), so the rows are padded, as before."""
  bn, k_pad = val.shape
  cols = lax.broadcasted_iota(jnp.int32, (bn, k_pad), 1)
  masked_store(ref.at[pl.ds(row0, bn), pl.ds(0, k_pad)], val, cols < k)


def _rows_kernel(x_ref, v_ref, i_ref, *, k, e, n_parts, pick):
  """One program of `_rows_call`: its rows [bn, E_pad] in fp32 (the partials summed), then
  pick(x, taken, col, slot, k, shape) -> (values, ids) [bn, k_pad], stored k columns wide."""
  x = _load_rows(x_ref, n_parts)                                            # [bn, E_pad]
  bn, e_pad = x.shape
  k_pad = pl.next_power_of_2(k)
  col = lax.broadcasted_iota(jnp.int32, (bn, e_pad), 1)
  slot = lax.broadcasted_iota(jnp.int32, (bn, k_pad), 1)
  vals, ids = pick(x, col >= e, col, slot, k, (bn, k_pad))                 # (padding taken)
  row0 = pl.program_id(0) * bn
  _store_rows(v_ref, vals.astype(v_ref.dtype), row0, k)
  _store_rows(i_ref, ids, row0, k)


def _rows_call(kernel, x, k, value_dtype, *, op, name, warps, interpret):
  """(values [N, k] in value_dtype, ids [N, k] int32) from `kernel(x_ref, v_ref, i_ref, k=,
  e=, n_parts=)` (`_rows_kernel` with its pick) run over x [N, E] (or split partials [S, N, E], summed in the kernel) in
  programs of up to _ROWS whole rows (rows padded to a multiple of the block, columns to a
  power of 2, only when they need it; the outputs are stored k columns wide under a mask, so
  only a padded row count, never a decode batch of 1 to 16 or a multiple of 16, is sliced)."""
  require_triton(interpret, op, "implementation='xla'")
  n_parts = x.shape[0] if x.ndim == 3 else 0
  n, e = x.shape[-2:]
  if not 0 < k <= e:
    raise ValueError(f"{op}: k={k} must be in 1..{e} (the row length)")
  bn = min(_ROWS, pl.next_power_of_2(max(n, 1)))
  n_pad, e_pad = pl.cdiv(n, bn) * bn, pl.next_power_of_2(e)
  s_pad = pl.next_power_of_2(n_parts) if n_parts else 0   # Triton blocks: powers of 2
  pads = ((0, n_pad - n), (0, e_pad - e))
  if n_parts:
    pads = ((0, s_pad - n_parts),) + pads   # padding parts are never read
  xp = x if all(p == (0, 0) for p in pads) else jnp.pad(x, pads)
  spec = (pl.BlockSpec((s_pad, bn, e_pad), lambda i: (0, i, 0)) if n_parts
          else pl.BlockSpec((bn, e_pad), lambda i: (i, 0)))
  params = None if interpret else triton_params(num_warps=warps, num_stages=1)
  vals, ids = pl.pallas_call(
      functools.partial(kernel, k=k, e=e, n_parts=n_parts), grid=(n_pad // bn,),
      in_specs=[spec], out_specs=[pl.BlockSpec()] * 2,
      out_shape=[jax.ShapeDtypeStruct((n_pad, k), value_dtype),
                 jax.ShapeDtypeStruct((n_pad, k), jnp.int32)],
      interpret=interpret, compiler_params=params, name=name,
  )(xp)
  return (vals, ids) if n_pad == n else (vals[:n], ids[:n])


@functools.partial(jax.jit, static_argnames=("k", "interpret"))
def top_k_pallas(x, k: int, *, interpret: bool = False):
  """(values [N, k] in x.dtype, ids [N, k] int32) of each row of x [N, E]: `lax.top_k`'s."""
  return _rows_call(functools.partial(_rows_kernel, pick=_take_k), x, k, x.dtype, op="top_k",
                    name="router_top_k", warps=4, interpret=interpret)


def _take_k(x, taken, col, slot, k, shape):
  """k rounds of (max over the entries not taken, the lowest column holding it): values
  [bn, k_pad] (0 past k) and ids, for `_rows_kernel`."""
  e_pad = x.shape[1]
  vals = jnp.zeros(shape, jnp.float32)
  ids = jnp.zeros(shape, jnp.int32)
  for j in range(k):
    m = jnp.max(jnp.where(taken, -jnp.inf, x), axis=1, keepdims=True)       # [bn, 1]
    i = jnp.min(jnp.where(~taken & (x == m), col, e_pad), axis=1, keepdims=True)
    vals = jnp.where(slot == j, m, vals)
    ids = jnp.where(slot == j, i, ids)
    taken = taken | (col == i)
  return vals, ids


def _route_pick(x, pad, col, slot, k, shape):
  """softmax over the real columns, their top k, renormalised (slots past k: 0)."""
  x = jnp.where(pad, -jnp.inf, x)
  ex = jnp.exp(x - jnp.max(x, axis=1, keepdims=True))                      # padding: 0
  probs = ex / jnp.sum(ex, axis=1, keepdims=True)
  vals, ids = _take_k(probs, pad, col, slot, k, shape)
  return vals / jnp.sum(vals, axis=1, keepdims=True), ids


# Warps a routing program runs: one for a program of one row (a batch-1 decode step), four
# for more. On the H200 (run 38, decode_probe.py variants base / route1w, bench-a3b), one warp
# for every program took bench-a3b's batch-1 step from 3.919 to 3.831 ms and its batch-32 step
# (16 rows a program) from 7.615 to 8.157 ms.
ROUTE_WARPS = 4
ROUTE_WARPS_ONE_ROW = 1


@functools.partial(jax.jit, static_argnames=("k", "interpret"))
def route_pallas(logits, k: int, *, interpret: bool = False):
  """(w [N, k] fp32, ids [N, k] int32) from the router's logits [N, E], or from their split
  partial sums [S, N, E] (added in index order in the kernel): the top-k of softmax(logits),
  renormalised to sum to 1, in one launch."""
  if logits.ndim not in (2, 3):
    raise ValueError(f"route: logits {logits.shape} must be [N, E] or split partials [S, N, E]")
  warps = ROUTE_WARPS_ONE_ROW if logits.shape[-2] == 1 else ROUTE_WARPS
  return _rows_call(functools.partial(_rows_kernel, pick=_route_pick),
                    logits.astype(jnp.float32), k, jnp.float32, op="route",
                    name="router_route", warps=warps, interpret=interpret)
