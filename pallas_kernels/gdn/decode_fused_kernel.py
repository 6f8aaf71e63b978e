"""One-launch GDN decode step from raw inputs, gates included (README, "Fused decode kernel").

For batch row b and v-head h (k-head h // r, r = Hv // Hk), from the raw post-conv q, k, v
and the raw gate inputs a, b (the `ba` projection's two halves):
    qn = l2norm(q[b, h // r]) * Dk**-0.5;   kn = l2norm(k[b, h // r])
    g = A[h] softplus(a[b, h] + dt_bias[h]);   beta = sigmoid(b[b, h])   (0 and 0 if row b
        is not valid: the state is then unchanged)
    S = exp(g) state[b, h];   u = beta (v[b, h] - S kn);   S = S + u knᵀ
    o[b, h] = S qn;   new_state[b, h] = S
`reference.delta_rule_step_fused` is the oracle (the model's gates, then
`delta_rule_step_raw`). Differences from `decode_kernel.py`:

- the gates are computed in the kernel (no separate softplus / sigmoid / mask fusions);
- a row that is not valid (`valid[b] == 0`) skips the state store: the state buffer is
  aliased to the output, so its rows stay as they were, with no full-state select and no
  write (issue 17, item 4). Its o is S qn of the unchanged state, as in the oracle;
- any power-of-2 `block_v` from 1 (fla's fused_recurrent runs small V tiles at 1 warp;
  the compiled defaults are untimed, `experiments/bench/gdn_probe.py` sweeps them) and any
  power-of-2 Dk, Dv (no `tl.dot`, so no 16 floor; the tiny test model has Dv = 8).

One program per (b, h, Dv tile), holding a [block_v, Dk] fp32 tile of the state, read once
and written once. The two matvecs have M = 1: elementwise products and row sums.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import SQUEEZED, pow2, require_triton, triton_params
from pallas_kernels.gdn.decode_kernel import _l2norm, check_ranks_and_dtypes

_F32 = jnp.float32
# Compiled defaults, untimed: a [16, 128] fp32 tile (8 KiB) per program, 4 warps: 256
# programs at one sequence of 32 heads of 128 (two per H200 SM).
_BLOCK_V = 16
_NUM_WARPS = 4


def softplus(x):
  """log(1 + e^x) as `jax.nn.softplus` computes it (max(x, 0) + log1p(e^-|x|))."""
  return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


def sigmoid(x):
  return 1.0 / (1.0 + jnp.exp(-x))


def _fused_kernel(q_ref, k_ref, v_ref, a_ref, b_ref, acoef_ref, dtb_ref, valid_ref, *rest,
                  scale, stacked):
  """One program: batch row b, v-head h, a [block_v, Dk] tile of that head's state (of
  layer `layer_ref[0]` of the [L, block_v, Dk] stack when `stacked`)."""
  if stacked:
    layer_ref, s_in, o_ref, s_out = rest
    layer = layer_ref[0]
    s_ref, s_out_ref = s_in.at[layer], s_out.at[layer]
  else:
    s_ref, o_ref, s_out_ref = rest
  ok = valid_ref[...] != 0
  o, s = _step(s_ref[...], q_ref[...], k_ref[...], v_ref[...], a_ref[...], b_ref[...],
               acoef_ref[...], dtb_ref[...], ok, scale)
  o_ref[...] = o

  @pl.when(ok)
  def _():
    s_out_ref[...] = s


def _step(s, q, k, v, a, b, acoef, dtb, ok, scale):
  """One step on a [bv, Dk] state tile (the math of both kernels, so a verification's steps
  round as decode steps do): returns (o [bv], the state after the step; the caller keeps the
  old one for an invalid row)."""
  g = acoef.astype(_F32) * softplus(a.astype(_F32) + dtb.astype(_F32))
  beta = sigmoid(b.astype(_F32))
  g, beta = jnp.where(ok, g, 0.0), jnp.where(ok, beta, 0.0)
  qn = _l2norm(q) * scale  # [Dk]
  kn = _l2norm(k)  # [Dk]
  s = s * jnp.exp(g)  # [bv, Dk]
  kv = jnp.sum(s * kn[None, :], axis=1)  # [bv]: S kn
  u = beta * (v.astype(_F32) - kv)
  s = s + u[:, None] * kn[None, :]
  return jnp.sum(s * qn[None, :], axis=1), s


def _steps_kernel(q_ref, k_ref, v_ref, a_ref, b_ref, acoef_ref, dtb_ref, valid_ref, s_ref,
                  o_ref, steps_ref, *, scale, n_steps):
  """One program: batch row b, v-head h, a [block_v, Dk] state tile, carried through the
  row's T steps in registers; the state after each step is written (an invalid step keeps
  the state it was given, as the one-step kernel leaves it unstored)."""
  s = s_ref[...]
  for t in range(n_steps):   # static: T is small (a verification's N + 1); padding untouched
    ok = valid_ref[t] != 0
    o, s_new = _step(s, q_ref[t, :], k_ref[t, :], v_ref[t, :], a_ref[t], b_ref[t],
                     acoef_ref[...], dtb_ref[...], ok, scale)
    o_ref[t, :] = o
    s = jnp.where(ok, s_new, s)
    steps_ref[t, :, :] = s


def check_fused_inputs(q, k, v, a, b, a_coef, dt_bias, valid, state):
  """Validate shapes and dtypes; raise ValueError naming the offending operand."""
  check_ranks_and_dtypes("gdn decode", (("q", q, 3), ("k", k, 3), ("v", v, 3), ("a", a, 2),
                                        ("b", b, 2), ("a_coef", a_coef, 1),
                                        ("dt_bias", dt_bias, 1), ("state", state, 4)))
  bsz, hk, dk = q.shape
  _, hv, dv = v.shape
  if k.shape != q.shape:
    raise ValueError(f"gdn decode: k {k.shape} must match q {q.shape} ([B, Hk, Dk])")
  if v.shape[0] != bsz or hv % hk:
    raise ValueError(f"gdn decode: v {v.shape} must be [B, Hv, Dv] with B = {bsz} and Hv a "
                     f"multiple of Hk = {hk} (q {q.shape})")
  for name, arr in (("a", a), ("b", b)):
    if arr.shape != (bsz, hv):
      raise ValueError(f"gdn decode: {name} {arr.shape} must be [B, Hv] = {(bsz, hv)}")
  for name, arr in (("a_coef", a_coef), ("dt_bias", dt_bias)):
    if arr.shape != (hv,):
      raise ValueError(f"gdn decode: {name} {arr.shape} must be [Hv] = {(hv,)}")
  if valid is not None and valid.shape != (bsz,):
    raise ValueError(f"gdn decode: valid {valid.shape} must be [B] = {(bsz,)}")
  if state.shape != (bsz, hv, dv, dk):
    raise ValueError(f"gdn decode: state {state.shape} must be [B, Hv, Dv, Dk] = "
                     f"{(bsz, hv, dv, dk)}")
  for name, d in (("Dk", dk), ("Dv", dv)):
    if not pow2(d):
      raise ValueError(f"gdn decode: {name}={d} must be a power of 2 (Triton tiles are)")


@functools.partial(jax.jit, static_argnames=("interpret", "block_v", "num_warps"))
def gdn_decode_fused(q, k, v, a, b, a_coef, dt_bias, state, valid=None, layer=None, *,
                     interpret=False, block_v=None, num_warps=None):
  """One gated-delta-rule decode step from raw inputs, gates and state update in one launch.

  Args:
    q, k: [B, Hk, Dk] raw post-conv rows (not yet l2-normalised), any float dtype.
    v: [B, Hv, Dv] any float dtype; Hv a multiple of Hk (v-head h reads k-head h // r).
    a, b: [B, Hv] raw gate inputs: g = a_coef softplus(a + dt_bias), beta = sigmoid(b).
    a_coef, dt_bias: [Hv] (the layer's `ssm_a` = -exp(A_log) and `ssm_dt.bias`).
    state: [B, Hv, Dv, Dk] float32; aliased to the new state (in place when donated). With
      `layer`: the whole stack [L, B, Hv, Dv, Dk] of every layer's state, of which layer
      `layer` is read and written in place (the others are neither read nor written).
    valid: [B] (any int or bool dtype) or None (every row valid). Rows with valid == 0 keep
      their state untouched (no store) and get o = S qn of that state.
    layer: None, or an int32 scalar (traced: e.g. a scan's layer index) selecting the layer
      of a stacked `state`, read in the kernel (no slice of the stack is copied).
    interpret: run the Pallas interpreter (CPU).
    block_v: power-of-2 Dv tile (<= Dv); None: 16 compiled (or Dv if smaller), Dv
      interpreted (fewer grid steps).
    num_warps: Triton warps per program; None: 4 (ignored in interpret mode).

  Returns:
    (o [B, Hv, Dv] float32, new_state float32 of `state`'s shape).
  """
  stacked = layer is not None
  if stacked and state.ndim != 5:
    raise ValueError(f"gdn decode: with `layer`, state must be the [L, B, Hv, Dv, Dk] stack, "
                     f"got shape {state.shape}")
  check_fused_inputs(q, k, v, a, b, a_coef, dt_bias, valid, state[0] if stacked else state)
  require_triton(interpret, "gdn decode", "'xla'")
  bsz, hk, dk = q.shape
  _, hv, dv = v.shape
  r = hv // hk
  bv = block_v or (dv if interpret else min(_BLOCK_V, dv))
  if not pow2(bv) or bv > dv:
    raise ValueError(f"gdn decode: block_v={bv} must be a power of 2 <= Dv={dv}")
  valid = (jnp.ones((bsz,), jnp.int32) if valid is None
           else jnp.asarray(valid).astype(jnp.int32))

  sq = SQUEEZED
  qk_spec = pl.BlockSpec((sq, sq, dk), lambda i, h, j: (i, h // r, 0))
  vo_spec = pl.BlockSpec((sq, sq, bv), lambda i, h, j: (i, h, j))
  ab_spec = pl.BlockSpec((sq, sq), lambda i, h, j: (i, h))
  head_spec = pl.BlockSpec((sq,), lambda i, h, j: (h,))
  row_spec = pl.BlockSpec((sq,), lambda i, h, j: (i,))
  specs = [qk_spec, qk_spec, vo_spec, ab_spec, ab_spec, head_spec, head_spec, row_spec]
  operands = [q, k, v, a, b, a_coef, dt_bias, valid]
  if stacked:  # every layer in the block; the kernel indexes the one it updates
    n_layers = state.shape[0]
    s_spec = pl.BlockSpec((n_layers, sq, sq, bv, dk), lambda i, h, j: (0, i, h, j, 0))
    specs.append(pl.BlockSpec((1,), lambda i, h, j: (0,)))
    operands.append(jnp.asarray(layer, jnp.int32).reshape(1))
  else:
    s_spec = pl.BlockSpec((sq, sq, bv, dk), lambda i, h, j: (i, h, j, 0))
  return pl.pallas_call(
      functools.partial(_fused_kernel, scale=dk ** -0.5, stacked=stacked),
      grid=(bsz, hv, dv // bv),
      in_specs=[*specs, s_spec],
      out_specs=[vo_spec, s_spec],
      out_shape=[jax.ShapeDtypeStruct((bsz, hv, dv), _F32),
                 jax.ShapeDtypeStruct(state.shape, _F32)],
      input_output_aliases={len(operands): 1},
      interpret=interpret,
      # One tile per program: nothing to pipeline (num_stages 1).
      compiler_params=None if interpret else triton_params(num_warps or _NUM_WARPS, 1),
      name="gdn_decode_fused",
  )(*operands, state)


@functools.partial(jax.jit, static_argnames=("interpret", "block_v", "num_warps"))
def gdn_decode_fused_steps(q, k, v, a, b, a_coef, dt_bias, state, valid=None, *,
                           interpret=False, block_v=None, num_warps=None):
  """T decode steps of one row batch in one launch, keeping the state after each step (a
  speculative verification's GDN layer). Step t is `gdn_decode_fused` on q[:, t], ..., with
  the state the previous step left, bit for bit in the interpreter (`_step` is both kernels'
  math).

  Args:
    q, k: [B, T, Hk, Dk] raw post-conv rows; v: [B, T, Hv, Dv]; a, b: [B, T, Hv] raw gate
      inputs; a_coef, dt_bias: [Hv]; state: [B, Hv, Dv, Dk] float32, the state before step 0.
    valid: [B, T] or None (all valid). An invalid step leaves the state as it was.
    interpret, block_v, num_warps: as `gdn_decode_fused`.

  Returns:
    (o [B, T, Hv, Dv] float32, steps [B, T, Hv, Dv, Dk] float32: the state after each step).
  """
  for name, arr in (("q", q), ("k", k), ("v", v)):
    if arr.ndim != 4:
      raise ValueError(f"gdn decode steps: {name} {arr.shape} must be [B, T, H, D]")
  for name, arr in (("a", a), ("b", b)):
    if arr.ndim != 3:
      raise ValueError(f"gdn decode steps: {name} {arr.shape} must be [B, T, Hv]")
  bsz, n_t = q.shape[:2]
  if valid is not None and valid.shape != (bsz, n_t):
    raise ValueError(f"gdn decode steps: valid {valid.shape} must be [B, T] = {(bsz, n_t)}")
  check_fused_inputs(q[:, 0], k[:, 0], v[:, 0], a[:, 0], b[:, 0], a_coef, dt_bias,
                     None if valid is None else valid[:, 0], state)
  require_triton(interpret, "gdn decode", "'xla'")
  _, _, hk, dk = q.shape
  hv, dv = v.shape[2:]
  r = hv // hk
  bv = block_v or (dv if interpret else min(_BLOCK_V, dv))
  if not pow2(bv) or bv > dv:
    raise ValueError(f"gdn decode: block_v={bv} must be a power of 2 <= Dv={dv}")
  valid = (jnp.ones((bsz, n_t), jnp.int32) if valid is None
           else jnp.asarray(valid).astype(jnp.int32))
  tp = 1 << max(n_t - 1, 0).bit_length()    # Triton blocks are powers of 2: pad T
  if tp != n_t:   # the kernel runs the T real steps; the padding is neither read nor written
    pad = lambda x: jnp.pad(x, [(0, 0), (0, tp - n_t)] + [(0, 0)] * (x.ndim - 2))
    q, k, v, a, b, valid = map(pad, (q, k, v, a, b, valid))

  sq = SQUEEZED
  qk_spec = pl.BlockSpec((sq, tp, sq, dk), lambda i, h, j: (i, 0, h // r, 0))
  vo_spec = pl.BlockSpec((sq, tp, sq, bv), lambda i, h, j: (i, 0, h, j))
  ab_spec = pl.BlockSpec((sq, tp, sq), lambda i, h, j: (i, 0, h))
  head_spec = pl.BlockSpec((sq,), lambda i, h, j: (h,))
  row_spec = pl.BlockSpec((sq, tp), lambda i, h, j: (i, 0))
  s_spec = pl.BlockSpec((sq, sq, bv, dk), lambda i, h, j: (i, h, j, 0))
  steps_spec = pl.BlockSpec((sq, tp, sq, bv, dk), lambda i, h, j: (i, 0, h, j, 0))
  o, steps = pl.pallas_call(
      functools.partial(_steps_kernel, scale=dk ** -0.5, n_steps=n_t),
      grid=(bsz, hv, dv // bv),
      in_specs=[qk_spec, qk_spec, vo_spec, ab_spec, ab_spec, head_spec, head_spec, row_spec,
                s_spec],
      out_specs=[vo_spec, steps_spec],
      out_shape=[jax.ShapeDtypeStruct((bsz, tp, hv, dv), _F32),
                 jax.ShapeDtypeStruct((bsz, tp, hv, dv, dk), _F32)],
      interpret=interpret,
      compiler_params=None if interpret else triton_params(num_warps or _NUM_WARPS, 1),
      name="gdn_decode_fused_steps",
  )(q, k, v, a, b, a_coef, dt_bias, valid, state)
  return o[:, :n_t], steps[:, :n_t]
