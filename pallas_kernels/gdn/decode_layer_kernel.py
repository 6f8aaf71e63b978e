"""One launch for a GDN layer's decode core: the causal conv, the gates, the delta rule and the
gated RMSNorm (README, "Layer kernel"), issue 17 item 1.

Between its input projections (qkv, z, ba) and its output projection, a GDN layer's decode step
ran the conv, the slices of its output and of ba, the fused delta-rule kernel and the gated norm
as about seven launches (bench-a3b at batch 1 on the H200: run 33's profile,
`experiments/results/device/decode_probe_multi_run33.json`). This kernel takes the projections'
outputs as they are and returns what the output projection reads.

For batch row b and v-head h (k-head hk = h // r, r = Hv // Hk; C = 2 Hk Dk + Hv Dv channels,
q at hk Dk, k at Hk Dk + hk Dk, v at 2 Hk Dk + h Dv):

    c[ch]  = silu(0 + sum_j ext[j, ch] w[ch, j]),  ext = [conv_state rows in x's dtype ; x]
             rounded to x's dtype (the model's `causal_conv` at one token)
    q, k, v = c at the head's channels;  a, b = ba[hk 2r + r + h % r], ba[hk 2r + h % r]
    o, S'  = the fused step (`decode_fused_kernel._step`: l2 norms, gates, delta rule)
    y      = (o rsqrt(mean(o^2) + eps) norm_w) silu(z)   in fp32, rounded to out_dtype
    conv_state' = [conv_state[1:], x] (in conv_state's dtype, via x's as the model does)

A row whose valid flag is 0 keeps its conv state and recurrent state bit for bit (the state is
not stored; the conv state's old rows are written back), and gets y from the unchanged state.

One program per (b, h). It runs the head's Dv rows in tiles of block_v, one after another, and
keeps each tile's o, because the norm needs the whole head. The conv state's q / k channels are
written by the k-head's first v-head (h % r == 0), and its v channels by their own head.
`reference.decode_layer_reference` is the oracle: the model's ops in jnp. The state and conv
state match it bit for bit under the interpreter. y matches to the fp32 rounding of the norm's
sum, which runs tile by tile here.
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
# Dv tile, compiled: bench-a3b bf16 batch 1 on the H200, a step 1.1 % over the fused form's at
# 64 (run 45), 1.3 % at 128 with 8 warps, 4.3 % at 32 and 8.3 % at 16 (run 43). The compiled
# tests ran at 16 (run 43); 64 has run compiled in the model only (decode_probe).
_BLOCK_V = 64
_NUM_WARPS = 4
_WHOLE = pl.BlockSpec()   # whole arrays: the program indexes them itself


def _kernel(layer_ref, valid_ref, x_ref, cs_ref, w_ref, z_ref, ba_ref, acoef_ref, dtb_ref,
            nw_ref, s_in, y_ref, cs_out, s_out, *, hk_n, r, dk, dv, bv, n_taps, eps, x_dtype):
  b, h = pl.program_id(0), pl.program_id(1)
  hk = h // r
  layer = layer_ref[0]
  ok = valid_ref[b] != 0
  kd = hk_n * dk

  def conv(c0, n):
    """(silu-conv output [n] rounded to x's dtype, raw x [n]) of channels c0 .. c0 + n."""
    ch = pl.ds(c0, n)
    xv = x_ref[b, ch]
    acc = jnp.zeros((n,), _F32)   # `sum` starts from 0, as the model's
    for j in range(n_taps - 1):   # static indices as int32 (the interpreter's indexers)
      tap = jnp.int32(j)
      acc = acc + cs_ref[b, tap, ch].astype(x_dtype).astype(_F32) * w_ref[ch, tap].astype(_F32)
    acc = acc + xv.astype(x_dtype).astype(_F32) * w_ref[ch, jnp.int32(n_taps - 1)].astype(_F32)
    return jax.nn.silu(acc).astype(x_dtype), xv

  def shift_state(c0, n, xv):
    """conv_state' of channels c0 .. c0 + n: the rows moved up and x last (valid rows), the
    old rows (others)."""
    ch = pl.ds(c0, n)
    dt = cs_out.dtype
    for j in range(n_taps - 1):
      old = cs_ref[b, jnp.int32(j), ch]
      nxt = cs_ref[b, jnp.int32(j + 1), ch] if j + 1 < n_taps - 1 else xv
      cs_out[b, jnp.int32(j), ch] = jnp.where(ok, nxt.astype(x_dtype).astype(dt), old)

  q, qx = conv(hk * dk, dk)
  k, kx = conv(kd + hk * dk, dk)

  @pl.when(h % r == 0)
  def _():
    shift_state(hk * dk, dk, qx)
    shift_state(kd + hk * dk, dk, kx)

  def parts(ref, *ix):
    """The projection's value at ix: its split partials added in index order, rounded to
    x's dtype (the projection's result), in fp32."""
    return sum_ref_partials(ref, ref.shape[0], *ix).astype(x_dtype).astype(_F32)

  base = hk * 2 * r + h % r
  b_gate = parts(ba_ref, b, base)
  a_gate = parts(ba_ref, b, base + r)
  acoef, dtb = acoef_ref[h], dtb_ref[h]
  outs, ss = [], jnp.zeros((), _F32)
  for t in range(dv // bv):
    c0 = 2 * kd + h * dv + t * bv
    v, vx = conv(c0, bv)
    shift_state(c0, bv, vx)
    rows = pl.ds(t * bv, bv)
    o, s = _step(s_in[layer, b, h, rows, :], q, k, v, a_gate, b_gate, acoef, dtb, ok,
                 dk ** -0.5)

    @pl.when(ok)
    def _():
      s_out[layer, b, h, rows, :] = s

    outs.append(o)
    ss = ss + jnp.sum(o * o)
  inv = jax.lax.rsqrt(ss / dv + eps)
  for t, o in enumerate(outs):
    rows = pl.ds(t * bv, bv)
    zt = parts(z_ref, b, h, rows)
    yt = (o * inv) * nw_ref[rows].astype(_F32)
    y_ref[b, h, rows] = (yt * jax.nn.silu(zt)).astype(y_ref.dtype)


def check_layer_inputs(x, conv_state, conv_w, z, ba, a_coef, dt_bias, norm_w, state, n_k_heads):
  """Validate shapes; raise ValueError naming the offending operand."""
  bsz, hv, dv, dk, c = state_dims("gdn decode layer", state, n_k_heads)
  n_taps = conv_w.shape[-1] if conv_w.ndim == 2 else 0
  want = {"x": (x, (bsz, c)), "conv_w": (conv_w, (c, n_taps)),
          "conv_state": (conv_state, (bsz, n_taps - 1, c)), "z": (z, (z.shape[0], bsz, hv, dv)),
          "ba": (ba, (ba.shape[0], bsz, 2 * hv)), "a_coef": (a_coef, (hv,)),
          "dt_bias": (dt_bias, (hv,)), "norm_w": (norm_w, (dv,))}
  check_shapes("gdn decode layer", want, state, n_k_heads, conv_w, n_taps)


@functools.partial(jax.jit, static_argnames=("n_k_heads", "eps", "out_dtype", "interpret",
                                             "block_v", "num_warps"))
def gdn_decode_layer(x, conv_state, conv_w, z, ba, a_coef, dt_bias, norm_w, state, valid, layer,
                     *, n_k_heads, eps, out_dtype=None, interpret=False, block_v=None,
                     num_warps=None):
  """A GDN layer's decode core in one launch (module docstring).

  Args:
    x: [B, C] the qkv projection's output (its dtype is the model's: the conv rounds to it).
    conv_state: [B, K-1, C] the previous raw rows; conv_w: [C, K].
    z: [B, Hv, Dv] the gate projection's output; ba: [B, 2 Hv] the ba projection's output in
      its [Hk, 2r] layout (b first, then a, per k-head). Either may be the projection's split
      partial sums [S, ...] (`quant.api.dense_matmul_multi(partials=True)`): they are added in
      index order and rounded to x's dtype, the projection's own result, in the kernel.
    a_coef, dt_bias: [Hv]; norm_w: [Dv] the gated norm's weight (GGUF's +1 included).
    state: [L, B, Hv, Dv, Dk] float32, every layer's state; layer `layer` (int32, may be
      traced) is read and updated in place (aliased).
    valid: [B] int or bool; rows with 0 keep both states.
    n_k_heads: Hk (static); eps: the norm's epsilon; out_dtype: y's dtype (None: x's).
    interpret: the Pallas interpreter (CPU); block_v: Dv tile (power of 2; None: 64 compiled,
      Dv interpreted); num_warps: Triton warps (None: 4).

  Returns:
    (y [B, Hv, Dv] out_dtype, conv_state' [B, K-1, C] in conv_state's dtype, state stack).
  """
  z = z[None] if z.ndim == 3 else z       # one part: the product itself
  ba = ba[None] if ba.ndim == 2 else ba
  check_layer_inputs(x, conv_state, conv_w, z, ba, a_coef, dt_bias, norm_w, state, n_k_heads)
  require_triton(interpret, "gdn decode layer", "gdn_decode 'pallas_layer_interpret' or 'xla'")
  _, bsz, hv, dv, dk = state.shape
  bv = block_v or (dv if interpret else min(_BLOCK_V, dv))
  if not pow2(bv) or bv > dv:
    raise ValueError(f"gdn decode layer: block_v={bv} must be a power of 2 <= Dv={dv}")
  n_taps = conv_w.shape[1]
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, state.shape[0] - 1).reshape(1)
  valid = jnp.asarray(valid).astype(jnp.int32)
  operands = [layer, valid, x, conv_state, conv_w, z, ba, a_coef, dt_bias, norm_w, state]
  kernel = functools.partial(_kernel, hk_n=n_k_heads, r=hv // n_k_heads, dk=dk, dv=dv, bv=bv,
                             n_taps=n_taps, eps=float(eps), x_dtype=jnp.dtype(x.dtype))
  return pl.pallas_call(
      kernel, grid=(bsz, hv),
      in_specs=[_WHOLE] * len(operands), out_specs=[_WHOLE] * 3,
      out_shape=[jax.ShapeDtypeStruct((bsz, hv, dv), out_dtype),
                 jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
                 jax.ShapeDtypeStruct(state.shape, _F32)],
      input_output_aliases={len(operands) - 1: 2},
      interpret=interpret,
      compiler_params=None if interpret else triton_params(num_warps or _NUM_WARPS, 1),
      name="gdn_decode_layer",
  )(*operands)
