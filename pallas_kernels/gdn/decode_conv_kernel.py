"""One launch for a GDN layer's decode step from its qkv projection's partials: the causal conv,
the gates and the delta rule, a program per Dv tile (README, "Conv kernel"), issue 17 item 1.

Between the qkv / ba projections and the gated norm, the fused step form ran XLA kernels for
the qkv and ba split sums, the conv (q / k, then v in fp32), and copies of the layer's conv
weights, conv state, A and dt_bias sliced out of the scanned block for the step kernel (run
77's decode HLO: about 6 of a GDN layer's 7.3 us of glue on the H100, bench README
"twenty-second"). The layer kernel (`decode_layer_kernel.py`) took all of it and the gated norm
too, but its norm needs a whole head, so it runs a program per (row, v-head): 32 programs at
batch 1, slower than the fused kernel's 256 (run 43). This kernel keeps the fused kernel's grid
and leaves the gated norm to XLA (which adds z's partials in the same fusion).

Program (b, h, j): v-head h of row b (k-head hk = h // r, r = Hv / Hk), Dv rows j bv ..
(j + 1) bv. With C = 2 Hk Dk + Hv Dv channels (q at hk Dk, k at Hk Dk + hk Dk, v at
2 Hk Dk + h Dv + j bv):

    x[ch]  = sum_s qkv[s, b, ch] rounded to x's dtype       (the projection's result)
    c[ch]  = silu(0 + sum_i ext[i, ch] w[ch, i]) in x's dtype, ext = [conv rows ; x]
    q, k, v = c at the head's channels (q / k recomputed by each of the k-head's programs:
              2 Dk channels of K taps, from L2)
    b, a   = ba's partials summed, rounded to x's dtype, at hk 2r + h % r and + r
    o, S'  = the fused step (`decode_fused_kernel._step`) on the tile's [bv, Dk] state
    conv'  = [conv rows[1:], x]: q / k channels written by (h % r == 0, j == 0), the tile's v
             channels by its own program; a row whose valid flag is 0 writes its old rows back
             and does not store its state.

The state, the conv state, the conv weights, A and dt_bias may each be a stack with a layer axis
read at that operand's layer index, in place: a layer scan carries the state and conv stacks and
the weights stay whole, so nothing is sliced out of a block for the launch.

The recurrent state is updated in place (aliased): each program reads and writes only its own
tile. The conv state is not: a k-head's q / k channels are read by all of its 2 x 8 programs
(bench-a3b) and written by one, and programs run in no fixed order, so an in-place shift could
reach some readers before they load the old rows. The kernel writes the layer's new conv state
to a fresh [B, K-1, C] buffer instead, and a stacked conv state takes it as a dynamic update
of its layer (one small XLA kernel, in place in a scan's carry).

`reference.decode_conv_reference` is the oracle (the model's conv, slices and
`delta_rule_step_fused`); the interpreter matches it bit for bit.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import pow2, require_triton, sum_ref_partials, triton_params
from pallas_kernels.gdn.decode_checks import check_shapes, state_dims
from pallas_kernels.gdn.decode_fused_kernel import _step

_F32 = jnp.float32
# Compiled defaults, as the fused kernel's (untimed here): [16, 128] fp32 state tiles, 4 warps.
_BLOCK_V = 16
_NUM_WARPS = 4
_WHOLE = pl.BlockSpec()   # whole arrays: the program indexes them itself


def _kernel(at_ref, valid_ref, qkv_ref, ba_ref, cs_ref, w_ref, acoef_ref, dtb_ref, s_in,
            o_ref, cs_out, s_out, *, hk_n, r, dk, dv, bv, n_taps, x_dtype):
  # cs_out [B, K-1, C]: this layer's new conv state, a buffer apart from cs_ref (never aliased:
  # module docstring)
  b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  hk = h // r
  s_layer, c_layer, w_layer = at_ref[0], at_ref[1], at_ref[2]
  ok = valid_ref[b] != 0
  kd = hk_n * dk
  n_qkv, n_ba = qkv_ref.shape[0], ba_ref.shape[0]

  def conv(c0, n):
    """(silu-conv output [n] in x's dtype, raw x [n] in x's dtype) of channels c0 .. c0 + n."""
    ch = pl.ds(c0, n)
    xv = sum_ref_partials(qkv_ref, n_qkv, b, ch).astype(x_dtype)
    acc = jnp.zeros((n,), _F32)   # `sum` starts from 0, as the model's
    for i in range(n_taps - 1):   # static indices as int32 (the interpreter's indexers)
      tap = jnp.int32(i)
      acc = acc + (cs_ref[c_layer, b, tap, ch].astype(x_dtype).astype(_F32)
                   * w_ref[w_layer, ch, tap].astype(_F32))
    acc = acc + xv.astype(_F32) * w_ref[w_layer, ch, jnp.int32(n_taps - 1)].astype(_F32)
    return jax.nn.silu(acc).astype(x_dtype), xv

  def shift_state(c0, n, xv):
    """conv' of channels c0 .. c0 + n: the rows moved up and x last (valid rows), the old
    rows (others)."""
    ch = pl.ds(c0, n)
    dt = cs_out.dtype
    for i in range(n_taps - 1):
      old = cs_ref[c_layer, b, jnp.int32(i), ch]
      nxt = cs_ref[c_layer, b, jnp.int32(i + 1), ch] if i + 1 < n_taps - 1 else xv
      cs_out[b, jnp.int32(i), ch] = jnp.where(ok, nxt.astype(dt), old)

  q, qx = conv(hk * dk, dk)
  k, kx = conv(kd + hk * dk, dk)
  v0 = 2 * kd + h * dv + j * bv
  v, vx = conv(v0, bv)

  @pl.when((h % r == 0) & (j == 0))
  def _():
    shift_state(hk * dk, dk, qx)
    shift_state(kd + hk * dk, dk, kx)

  shift_state(v0, bv, vx)

  def gate(col):
    """ba's value at column col: its partials added in index order, rounded to x's dtype."""
    return sum_ref_partials(ba_ref, n_ba, b, col).astype(x_dtype).astype(_F32)

  base = hk * 2 * r + h % r
  rows = pl.ds(j * bv, bv)
  o, s = _step(s_in[s_layer, b, h, rows, :], q, k, v, gate(base + r), gate(base),
               acoef_ref[w_layer, h], dtb_ref[w_layer, h], ok, dk ** -0.5)
  o_ref[b, h, rows] = o

  @pl.when(ok)
  def _():
    s_out[s_layer, b, h, rows, :] = s


def _stacked(a, ndim):
  """a with a layer axis: as it is if it has one (ndim + 1 dims), else a[None] (a bitcast)."""
  return a if a.ndim == ndim + 1 else a[None]


def check_conv_inputs(qkv, ba, conv_state, conv_w, a_coef, dt_bias, state, n_k_heads):
  """Validate shapes (each operand already with its leading parts / layer axis); raise
  ValueError naming the offending operand."""
  what = "gdn decode conv"
  bsz, hv, _, _, c = state_dims(what, state, n_k_heads)
  n_taps = conv_w.shape[-1] if conv_w.ndim == 3 else 0
  want = {"qkv": (qkv, (qkv.shape[0], bsz, c)), "ba": (ba, (ba.shape[0], bsz, 2 * hv)),
          "conv_w": (conv_w, (conv_w.shape[0], c, n_taps)),
          "conv_state": (conv_state, (conv_state.shape[0], bsz, n_taps - 1, c)),
          "a_coef": (a_coef, (a_coef.shape[0], hv)), "dt_bias": (dt_bias, (dt_bias.shape[0], hv))}
  check_shapes(what, want, state, n_k_heads, conv_w, n_taps)
  if a_coef.shape[0] != conv_w.shape[0] or dt_bias.shape[0] != conv_w.shape[0]:
    raise ValueError(f"{what}: conv_w {conv_w.shape}, a_coef {a_coef.shape} and "
                     f"dt_bias {dt_bias.shape} must stack the same layers")


@functools.partial(jax.jit, static_argnames=("n_k_heads", "x_dtype", "interpret", "block_v",
                                             "num_warps"))
def gdn_decode_conv(qkv, ba, conv_state, conv_w, a_coef, dt_bias, state, valid, layer,
                    conv_layer=None, weight_layer=None, *, n_k_heads, x_dtype=None,
                    interpret=False, block_v=None, num_warps=None):
  """A GDN layer's decode step from its projections' outputs, a program per Dv tile (module
  docstring).

  Args:
    qkv: [B, C] the qkv projection's output, or its split partial sums [S, B, C] (added in
      index order and rounded to x_dtype in the kernel: the projection's own result).
    ba: [B, 2 Hv] the ba projection's output in its [Hk, 2r] layout (b first, then a, per
      k-head), or its partials [S, B, 2 Hv].
    conv_state: [B, K-1, C], or the stack [Lc, B, K-1, C] (layer `conv_layer` read in place
      and updated: the kernel writes its new rows apart, then a dynamic update).
    conv_w: [C, K] or [Lw, C, K]; a_coef, dt_bias: [Hv] or [Lw, Hv] (`ssm_a` = -exp(A_log),
      `ssm_dt.bias`), read at `weight_layer` when stacked.
    state: [L, B, Hv, Dv, Dk] float32, every layer's state; layer `layer` (int32, may be
      traced) is read and updated in place (aliased).
    valid: [B] int or bool; rows with 0 keep both states bit for bit.
    conv_layer, weight_layer: the stacks' indices (int32, may be traced); None: `layer`.
    n_k_heads: Hk; x_dtype: the model's dtype, the conv's rounding (None: qkv's).
    interpret: the Pallas interpreter (CPU); block_v: Dv tile (power of 2; None: 16 compiled,
      Dv interpreted); num_warps: Triton warps (None: 4).

  Returns:
    (o [B, Hv, Dv] float32, the conv state (stacked as given) in its dtype, the state stack).
  """
  qkv, ba = _stacked(qkv, 2), _stacked(ba, 2)
  conv_stacked, w_stacked = conv_state.ndim == 4, conv_w.ndim == 3
  if a_coef.ndim != conv_w.ndim - 1 or dt_bias.ndim != conv_w.ndim - 1:
    raise ValueError(f"gdn decode conv: conv_w {conv_w.shape}, a_coef {a_coef.shape} and "
                     f"dt_bias {dt_bias.shape} must all be stacked or all one layer's")
  cs, w = _stacked(conv_state, 3), _stacked(conv_w, 2)
  acoef, dtb = _stacked(a_coef, 1), _stacked(dt_bias, 1)
  check_conv_inputs(qkv, ba, cs, w, acoef, dtb, state, n_k_heads)
  require_triton(interpret, "gdn decode conv", "gdn_decode 'pallas_conv_interpret' or 'xla'")
  _, bsz, hv, dv, dk = state.shape
  bv = block_v or (dv if interpret else min(_BLOCK_V, dv))
  if not pow2(bv) or bv > dv:
    raise ValueError(f"gdn decode conv: block_v={bv} must be a power of 2 <= Dv={dv}")
  x_dtype = jnp.dtype(x_dtype or qkv.dtype)
  clip = lambda i, n: jnp.clip(jnp.asarray(layer if i is None else i, jnp.int32), 0, n - 1)
  at = jnp.stack([clip(layer, state.shape[0]),
                  clip(conv_layer, cs.shape[0]) if conv_stacked else jnp.int32(0),
                  clip(weight_layer, w.shape[0]) if w_stacked else jnp.int32(0)])
  valid = jnp.asarray(valid).astype(jnp.int32)
  operands = [at, valid, qkv, ba, cs, w, acoef, dtb, state]
  kernel = functools.partial(_kernel, hk_n=n_k_heads, r=hv // n_k_heads, dk=dk, dv=dv, bv=bv,
                             n_taps=w.shape[-1], x_dtype=x_dtype)
  o, cs_new, state = pl.pallas_call(
      kernel, grid=(bsz, hv, dv // bv),
      in_specs=[_WHOLE] * len(operands), out_specs=[_WHOLE] * 3,
      out_shape=[jax.ShapeDtypeStruct((bsz, hv, dv), _F32),
                 jax.ShapeDtypeStruct(cs.shape[1:], cs.dtype),
                 jax.ShapeDtypeStruct(state.shape, _F32)],
      input_output_aliases={8: 2},
      interpret=interpret,
      # One tile per program: nothing to pipeline (num_stages 1).
      compiler_params=None if interpret else triton_params(num_warps or _NUM_WARPS, 1),
      name="gdn_decode_conv",
  )(*operands)
  if conv_stacked:   # the layer's new rows into the stack (in place where it is carried)
    cs = conv_state.at[at[1]].set(cs_new)
  else:
    cs = cs_new
  return o, cs, state
