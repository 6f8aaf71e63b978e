"""Pallas kernel for one decode step of the gated delta rule, fused (README, "Decode kernel").

For batch row b and v-head h (k-head h // r, r = Hv // Hk), with raw post-conv q, k:
    qn = l2norm(q[b, h // r]) * Dk**-0.5;   kn = l2norm(k[b, h // r])
    S = exp(g[b, h]) state[b, h];   u = beta[b, h] (v[b, h] - S kn);   S = S + u knᵀ
    o[b, h] = S qn;   new_state[b, h] = S
`reference.delta_rule_step_raw` is the oracle. One program per (b, h, Dv tile): it holds a
[block_v, Dk] fp32 tile of the state in registers, reads it once and writes it once (in
place: the state buffer is aliased to the output). Each program recomputes the l2norm of its
q/k row (Dk elements), which is cheaper than a second launch. The two matvecs have M = 1,
so they are elementwise products and row sums, not `tl.dot` (which needs M >= 16).

Backend and JAX 0.10/0.11 idioms as in `pallas_kernels/lora/kernel.py` (its README).
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import SQUEEZED, pow2, require_triton, triton_params

_F32 = jnp.float32
_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_EPS = 1e-6  # l2norm's eps, as strata_jax.model.common.l2_norm (the model's definition)
_MIN_DIM = 16  # smallest Dk / Dv / block_v: Triton tiles are powers of 2, 16 keeps them sane
# Compiled defaults from the README's H200 sweep: a [32, 128] fp32 tile (16 KiB) with 8 warps
# was best or tied at every batch; 16 or 64 rows were 3-8% slower, 128 rows more.
_BLOCK_V = 32
_NUM_WARPS = 8


def _l2norm(x):
  """x * rsqrt(sum(x^2) + eps) in fp32, the same op order as the model's l2_norm."""
  x = x.astype(_F32)
  return x * jax.lax.rsqrt(jnp.sum(x * x) + _EPS)


def _decode_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, *rest, scale, stacked):
  """One program: batch row b, v-head h, a [block_v, Dk] tile of that head's state (of
  layer `layer_ref[0]` of the [L, block_v, Dk] stack when `stacked`; then a row whose valid
  is 0 is not stored: the stack's other rows are the caller's, bit for bit)."""
  if stacked:
    valid_ref, layer_ref, s_in, o_ref, s_out = rest
    layer = layer_ref[0]
    s_ref, s_out_ref = s_in.at[layer], s_out.at[layer]
  else:
    s_ref, o_ref, s_out_ref = rest
  qn = _l2norm(q_ref[...]) * scale  # [Dk]
  kn = _l2norm(k_ref[...])  # [Dk]
  s = s_ref[...] * jnp.exp(g_ref[...].astype(_F32))  # [bv, Dk]
  kv = jnp.sum(s * kn[None, :], axis=1)  # [bv]: S kn, M = 1 so no tl.dot
  u = beta_ref[...].astype(_F32) * (v_ref[...].astype(_F32) - kv)
  s = s + u[:, None] * kn[None, :]
  o_ref[...] = jnp.sum(s * qn[None, :], axis=1)
  if stacked:
    @pl.when(valid_ref[...] != 0)
    def _():
      s_out_ref[...] = s
  else:
    s_out_ref[...] = s


def check_ranks_and_dtypes(what, operands):
  """(name, array, ndim) triples: each of that rank and a float dtype; the last (the state)
  float32. Raises ValueError naming the operand."""
  for name, arr, nd in operands:
    if arr.ndim != nd:
      raise ValueError(f"{what}: {name} must be {nd}-D, got shape {arr.shape}")
    if jnp.dtype(arr.dtype) not in _FLOATS:
      raise ValueError(f"{what}: {name} dtype {arr.dtype} is not float32, float16 or bfloat16")
  name, state, _ = operands[-1]
  if state.dtype != _F32:
    raise ValueError(f"{what}: {name} must be float32, got {state.dtype}")


def check_decode_inputs(q, k, v, g, beta, state):
  """Validate shapes and dtypes; raise ValueError naming the offending operand."""
  check_ranks_and_dtypes("gdn decode", (("q", q, 3), ("k", k, 3), ("v", v, 3), ("g", g, 2),
                                        ("beta", beta, 2), ("state", state, 4)))
  b, hk, dk = q.shape
  _, hv, dv = v.shape
  if k.shape != q.shape:
    raise ValueError(f"gdn decode: k {k.shape} must match q {q.shape} ([B, Hk, Dk])")
  if v.shape[0] != b or hv % hk:
    raise ValueError(f"gdn decode: v {v.shape} must be [B, Hv, Dv] with B = {b} and Hv a "
                     f"multiple of Hk = {hk} (q {q.shape})")
  for name, arr in (("g", g), ("beta", beta)):
    if arr.shape != (b, hv):
      raise ValueError(f"gdn decode: {name} {arr.shape} must be [B, Hv] = {(b, hv)}")
  if state.shape != (b, hv, dv, dk):
    raise ValueError(f"gdn decode: state {state.shape} must be [B, Hv, Dv, Dk] = "
                     f"{(b, hv, dv, dk)}")
  for name, d in (("Dk", dk), ("Dv", dv)):
    if d < _MIN_DIM or not pow2(d):
      raise ValueError(f"gdn decode: {name}={d} must be a power of 2 >= {_MIN_DIM} "
                       f"(Triton tiles are powers of 2)")


@functools.partial(jax.jit, static_argnames=("interpret", "block_v", "num_warps"))
def gdn_decode_pallas(q, k, v, g, beta, state, layer=None, valid=None, *, interpret=False,
                      block_v=None, num_warps=None):
  """One gated-delta-rule decode step for every batch row and v-head, fused.

  Args:
    q, k: [B, Hk, Dk] raw (post-conv, not yet l2-normalised) rows, any float dtype.
    v: [B, Hv, Dv] any float dtype; Hv a multiple of Hk (v-head h reads k-head h // r).
    g, beta: [B, Hv] log decay and write strength (cast to float32).
    state: [B, Hv, Dv, Dk] float32; aliased to the new state (in place when donated). With
      `layer`: the whole stack [L, B, Hv, Dv, Dk] of every layer's state, of which layer
      `layer` is read and written in place (the others are neither read nor written).
    layer: None, or an int32 scalar (traced: e.g. a scan's layer index) selecting the layer
      of a stacked `state`, read in the kernel (no slice of the stack is copied).
    valid: with `layer`, [B] (any int or bool dtype) or None (every row valid): rows with
      valid == 0 are not stored (a layer scan carrying the stack then needs no select).
    interpret: run the Pallas interpreter (CPU).
    block_v: power-of-2 Dv tile (>= 16, <= Dv); None: 32 compiled, Dv interpreted (each
      interpreted grid step has a fixed cost, so fewer, larger steps).
    num_warps: Triton warps per program; None: 8 (ignored in interpret mode).

  Returns:
    (o [B, Hv, Dv] float32, new_state float32 of `state`'s shape).
  """
  stacked = layer is not None
  if stacked and state.ndim != 5:
    raise ValueError(f"gdn decode: with `layer`, state must be the [L, B, Hv, Dv, Dk] stack, "
                     f"got shape {state.shape}")
  if valid is not None and not stacked:
    raise ValueError("gdn decode: `valid` goes with a stacked state (`layer`)")
  check_decode_inputs(q, k, v, g, beta, state[0] if stacked else state)
  require_triton(interpret, "gdn decode", "'xla'")
  b, hk, dk = q.shape
  _, hv, dv = v.shape
  r = hv // hk
  bv = block_v or (dv if interpret else min(_BLOCK_V, dv))
  if bv < _MIN_DIM or not pow2(bv) or bv > dv:
    raise ValueError(f"gdn decode: block_v={bv} must be a power of 2 in [{_MIN_DIM}, Dv={dv}]")
  g, beta = g.astype(_F32), beta.astype(_F32)

  sq = SQUEEZED
  qk_spec = pl.BlockSpec((sq, sq, dk), lambda i, h, j: (i, h // r, 0))
  vo_spec = pl.BlockSpec((sq, sq, bv), lambda i, h, j: (i, h, j))
  gb_spec = pl.BlockSpec((sq, sq), lambda i, h, j: (i, h))
  specs = [qk_spec, qk_spec, vo_spec, gb_spec, gb_spec]
  operands = [q, k, v, g, beta]
  if stacked:  # every layer in the block; the kernel indexes the one it updates
    if valid is not None and valid.shape != (b,):
      raise ValueError(f"gdn decode: valid {valid.shape} must be [B] = {(b,)}")
    valid = (jnp.ones((b,), jnp.int32) if valid is None
             else jnp.asarray(valid).astype(jnp.int32))
    s_spec = pl.BlockSpec((state.shape[0], sq, sq, bv, dk), lambda i, h, j: (0, i, h, j, 0))
    specs += [pl.BlockSpec((sq,), lambda i, h, j: (i,)), pl.BlockSpec((1,), lambda i, h, j: (0,))]
    operands += [valid, jnp.asarray(layer, jnp.int32).reshape(1)]
  else:
    s_spec = pl.BlockSpec((sq, sq, bv, dk), lambda i, h, j: (i, h, j, 0))
  return pl.pallas_call(
      functools.partial(_decode_kernel, scale=dk ** -0.5, stacked=stacked),
      grid=(b, hv, dv // bv),
      in_specs=[*specs, s_spec],
      out_specs=[vo_spec, s_spec],
      out_shape=[jax.ShapeDtypeStruct((b, hv, dv), _F32),
                 jax.ShapeDtypeStruct(state.shape, _F32)],
      input_output_aliases={len(operands): 1},
      interpret=interpret,
      # One tile per program: nothing to pipeline (num_stages 1).
      compiler_params=None if interpret else triton_params(num_warps or _NUM_WARPS, 1),
      name="gdn_decode",
  )(*operands, state)
