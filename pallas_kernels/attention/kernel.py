"""Pallas kernel: one decode step's attention over a K/V cache stack read in place, only each
row's valid keys.

Why: the model's XLA form (`reference.decode_attention_reference`) copies the layer's cache
out of the [L, B, S, G, Hd] stack, converts all S keys and values to fp32 and scores the whole
capacity, however few keys a row holds. On the H200 those copies were 16 us an attention layer
at batch 32 (experiments/results/device/decode_probe_dense_dot_run25.json,
`loop_dynamic_slice_fusion`), and an Engine slot sized for a 2,500-token prompt pays for 2,560
keys at every step.

Grid (B, G, n_split). Program (b, g, s) takes kv-head g's r = H / G query heads of row b (rows
padded to 16, a dot's least, by masked loads) and the keys of its split, [s * chunk, (s + 1) *
chunk) cut to lo..pos, in blocks of `block_s` read in place at (layer, b, keys, g): no block
past a row's position is loaded. It keeps the flash-decoding running max m, sum l and fp32
output acc. Scores are q . k in the cache's dtype with fp32 sums (exact products: the
reference's fp32 products of the same 16-bit values), times Hd^-0.5; probabilities stay fp32
and multiply V in fp32 (IEEE, never TF32), as the reference does. The splits' (m, l, acc) are
combined in jnp: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s."""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import require_triton, triton_params
from pallas_kernels.quant.gemv import masked_load, masked_store, tile_mask

_F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))  # a @ b^T
_NN = (((1,), (0,)), ((), ()))  # a @ b
_MIN_TILE = 16
_WHOLE = pl.BlockSpec()
BLOCK_S = 32  # keys a loop step: [32, Hd] K and V tiles
MAX_SPLITS = 8  # splits of the capacity a (row, kv-head) gets


class Tiling(NamedTuple):
  """Static description of one call."""
  r: int  # H // G query heads a kv-head
  rows_pad: int
  head_dim: int
  block_s: int
  chunk: int  # keys a split
  n_split: int
  cd: object  # the score dot's operand dtype
  precision: object
  windowed: bool  # kv_start given


def tiling(heads, groups, head_dim, capacity, dtype, *, windowed=False, block_s=None,
           n_split=None):
  """The call's tiles: `block_s` keys a step (a power of 2 >= 16), `n_split` splits of the
  capacity (at most MAX_SPLITS, each a whole number of blocks)."""
  bs = block_s or BLOCK_S
  if bs < _MIN_TILE or bs & (bs - 1):
    raise ValueError(f"decode attention: block_s={bs} must be a power of 2 >= {_MIN_TILE}")
  blocks = -(-capacity // bs)
  ns = max(1, min(n_split or MAX_SPLITS, blocks))
  chunk = -(-blocks // ns) * bs
  ns = -(-capacity // chunk)
  r = heads // groups
  half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
  return Tiling(r=r, rows_pad=max(_MIN_TILE, pl.next_power_of_2(r)),
                head_dim=head_dim, block_s=bs, chunk=chunk, n_split=ns,
                cd=jnp.dtype(dtype) if half else jnp.dtype(_F32),
                precision=None if half else lax.Precision.HIGHEST, windowed=windowed)


def _kernel(layer_ref, pos_ref, *refs, t: Tiling):
  if t.windowed:
    start_ref, q_ref, k_ref, v_ref, m_ref, l_ref, o_ref = refs
  else:
    q_ref, k_ref, v_ref, m_ref, l_ref, o_ref = refs
  b, g, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rp, hd, bs = t.rows_pad, t.head_dim, t.block_s
  lay = layer_ref[0]
  pos = pos_ref[b]
  lo = jnp.minimum(start_ref[b], pos) if t.windowed else jnp.int32(0)
  first = jnp.maximum(s * t.chunk, lo)
  end = jnp.minimum((s + 1) * t.chunk, pos + 1)  # one past the split's last valid key
  b0 = first // bs
  n_blocks = jnp.where(end > first, (end - b0 * bs + bs - 1) // bs, 0)
  r_ok = jnp.arange(rp) < t.r if t.r != rp else None
  q = masked_load(q_ref.at[b, pl.ds(g * t.r, rp), pl.ds(0, hd)], tile_mask(r_ok, None, rp, hd))
  q = q.astype(t.cd)
  scale = hd ** -0.5

  def body(i, carry):
    m, l, acc = carry
    k0 = (b0 + i) * bs
    keys = k0 + jnp.arange(bs)
    ok = (keys >= first) & (keys < end)
    kv_mask = tile_mask(ok, None, bs, hd)
    kt = masked_load(k_ref.at[lay, b, pl.ds(k0, bs), g, pl.ds(0, hd)], kv_mask).astype(t.cd)
    vt = masked_load(v_ref.at[lay, b, pl.ds(k0, bs), g, pl.ds(0, hd)], kv_mask).astype(_F32)
    sc = lax.dot_general(q, kt, _NT, precision=t.precision,
                         preferred_element_type=_F32) * scale  # [rp, bs]
    sc = jnp.where(ok[None, :], sc, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(sc, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(sc - m_new[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + lax.dot_general(p, vt, _NN, precision=lax.Precision.HIGHEST,
                                                 preferred_element_type=_F32)
    return m_new, l, acc

  init = (jnp.full((rp,), -jnp.inf, _F32), jnp.zeros((rp,), _F32), jnp.zeros((rp, hd), _F32))
  m, l, acc = lax.fori_loop(0, n_blocks, body, init)
  masked_store(m_ref.at[b, g, s, pl.ds(0, rp)], m, r_ok)
  masked_store(l_ref.at[b, g, s, pl.ds(0, rp)], l, r_ok)
  masked_store(o_ref.at[b, g, s, pl.ds(0, rp), pl.ds(0, hd)], acc,
               tile_mask(r_ok, None, rp, hd))


def combine(m, l, acc):
  """[B, G, n_split, r] running maxima and sums, acc [..., Hd] -> [B, G, r, Hd]: the splits'
  softmax parts put together. A split with no keys has m = -inf, l = acc = 0."""
  top = jnp.max(m, axis=2, keepdims=True)
  w = jnp.where(jnp.isfinite(m), jnp.exp(m - top), 0.0)  # [B, G, ns, r]
  num = jnp.sum(w[..., None] * acc, axis=2)
  den = jnp.sum(w * l, axis=2)
  return num / den[..., None]


def stack_operands(op, q_form, q, k_stack, v_stack, layer, pos, kv_start):
  """The attention kernels' operands, [layer (1,), pos, (kv_start), q, k_stack, v_stack], after
  checking q [B, ..., H, Hd] (`q_form` names it) against the stacks [L, B, S, G, Hd]; the layer
  clipped to the stack."""
  B, H, Hd = q.shape[0], q.shape[-2], q.shape[-1]
  L, Bk, _, G, Hk = k_stack.shape
  if (Bk, Hk) != (B, Hd) or v_stack.shape != k_stack.shape or H % G:
    raise ValueError(f"{op}: q {q.shape}, K {k_stack.shape}, V {v_stack.shape} must be "
                     f"{q_form}, [L, B, S, G, Hd] twice, H a multiple of G")
  layer = jnp.clip(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), 0, L - 1)
  starts = [] if kv_start is None else [kv_start.astype(jnp.int32)]
  return [layer, jnp.asarray(pos, jnp.int32), *starts, q, k_stack, v_stack]


@functools.partial(jax.jit, static_argnames=("block_s", "n_split", "interpret"))
def decode_attention_pallas(q, k_stack, v_stack, layer, pos, kv_start=None, *, block_s=None,
                            n_split=None, interpret=False):
  """out [B, H, Hd] fp32 of `reference.decode_attention_reference` for q [B, H, Hd], caches
  layer `layer` (an int32 scalar, traced OK, clipped) of k_stack / v_stack [L, B, S, G, Hd],
  read in place; pos [B] int32 the query positions (keys 0..pos, positions past the capacity
  clipped to it), kv_start [B] or None."""
  B, H, Hd = q.shape
  S, G = k_stack.shape[2:4]
  require_triton(interpret, "decode attention", "the 'xla' form")
  args = stack_operands("decode attention", "[B, H, Hd]", q, k_stack, v_stack, layer,
                        jnp.clip(pos.astype(jnp.int32), 0, S - 1), kv_start)
  dt = jnp.promote_types(q.dtype, k_stack.dtype)
  t = tiling(H, G, Hd, S, dt, windowed=kv_start is not None, block_s=block_s, n_split=n_split)
  part = (B, G, t.n_split, t.r)
  m, l, acc = pl.pallas_call(
      functools.partial(_kernel, t=t), grid=(B, G, t.n_split),
      out_shape=(jax.ShapeDtypeStruct(part, _F32), jax.ShapeDtypeStruct(part, _F32),
                 jax.ShapeDtypeStruct((*part, Hd), _F32)),
      in_specs=[_WHOLE] * len(args), out_specs=(_WHOLE, _WHOLE, _WHOLE),
      interpret=interpret, compiler_params=None if interpret else triton_params(4, 2),
      name="attn_decode",
  )(*args)
  return combine(m, l, acc).reshape(B, H, Hd)
