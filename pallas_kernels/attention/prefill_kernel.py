"""Pallas kernel: a prefill chunk's causal attention over the K/V cache stack, read in place,
flash-style (no score matrix in memory).

Why: the model's XLA form (`reference.attention_reference`) materialises fp32 scores and
probabilities for every query against the whole capacity: at a 2,500-token chunk with 16
q-heads and a 2,560-key cache that is 410 MB a layer, written and read several times, plus
both einsums over all keys, the masked half included. The memory grows with T x S: a
32k-token chunk would need 68 GB of scores a layer.

Grid (B, H, T / block_q). Program (b, h, i) takes queries i * block_q .. + block_q of q-head h
(kv-head h // (H / G)) of row b and walks the key blocks from the first key any of them sees
(0, or min(kv_start, its first position)) to the last one's position, cut to the capacity;
no key outside that range is loaded (the loads are masked to it). It keeps the running max
m, sum l and fp32 output acc per query. The scores are q . k in the cache's dtype with fp32
sums (bf16: exact products, as the reference's fp32 products of the same 16-bit values), times
Hd^-0.5. The probabilities meet V in the cache's dtype with fp32 sums: a 16-bit cache rounds
them to it (as FlashAttention and llama.cpp's flash-attention kernels do; the reference
multiplies fp32 probabilities, TF32 on the GPU, so the two differ by about the 16-bit rounding,
the bound the tests hold); an fp32 cache keeps IEEE fp32 for both products. out = acc / l.

Masks as the reference's: key <= the query's position, key >= min(kv_start, position) when
kv_start is given, key < the capacity. Every query sees at least one key (its own position,
or the capacity's last key when its position is past it), so no row divides by zero. The
running max starts at a finite floor, so a key block that is fully masked for one query
(another query of the block sees it) adds exactly nothing to that query."""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import masked_load, pow2, require_triton, triton_params
from pallas_kernels.attention.kernel import stack_operands
from pallas_kernels.quant.gemv import masked_store, tile_mask

_F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))  # a @ b^T
_NN = (((1,), (0,)), ((), ()))  # a @ b
_MIN_TILE = 16
_WHOLE = pl.BlockSpec()
_FLOOR = -1e30  # the running max's start: exp(-inf - floor) = 0 and exp(floor - s) = 0
BLOCK_Q = 128
BLOCK_K = 64
NUM_WARPS = 8
NUM_STAGES = 2


class Tiling(NamedTuple):
  """Static description of one call."""
  r: int  # H // G query heads a kv-head
  head_dim: int
  block_q: int
  block_k: int
  cd: object  # both dots' operand dtype (the probabilities are rounded to it)
  precision: object
  windowed: bool  # kv_start given


def tiling(heads, groups, head_dim, tokens, dtype, *, windowed=False, block_q=None,
           block_k=None):
  """The call's tiles: `block_q` queries a program, `block_k` keys a loop step (powers of 2
  >= 16; `block_q` at most T rounded up to one). Defaults 128 x 64 for 16-bit caches (run 68:
  82.2 ms a bench-a3b 2,500-token prefill, 83.0 at 128 x 32, 84.0 at 64 x 64), 64 x 32 for
  fp32 ones."""
  if not pow2(head_dim) or head_dim < _MIN_TILE:
    raise ValueError(f"prefill attention: head_dim={head_dim} must be a power of 2 >= "
                     f"{_MIN_TILE} (Triton tiles); use the 'xla' form")
  half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
  # fp32 tiles take twice the shared memory: half the blocks (128 x 64 at Hd = 256 asked the
  # H200 for 295 KB of its 227, run 68)
  shrink = 1 if half else 2
  bq = block_q or min(BLOCK_Q // shrink, max(_MIN_TILE, pl.next_power_of_2(tokens)))
  bk = block_k or BLOCK_K // shrink
  for name, v in (("block_q", bq), ("block_k", bk)):
    if v < _MIN_TILE or not pow2(v):
      raise ValueError(f"prefill attention: {name}={v} must be a power of 2 >= {_MIN_TILE}")
  return Tiling(r=heads // groups, head_dim=head_dim, block_q=bq, block_k=bk,
                cd=jnp.dtype(dtype) if half else jnp.dtype(_F32),
                precision=None if half else lax.Precision.HIGHEST, windowed=windowed)


def _kernel(layer_ref, pos_ref, *refs, t: Tiling, tokens: int, capacity: int):
  if t.windowed:
    start_ref, q_ref, k_ref, v_ref, o_ref = refs
  else:
    q_ref, k_ref, v_ref, o_ref = refs
  b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  bq, bk, hd = t.block_q, t.block_k, t.head_dim
  g = h // t.r
  lay = layer_ref[0]
  q0 = i * bq
  rows = q0 + jnp.arange(bq)
  row_ok = rows < tokens
  qpos = pos_ref[b] + rows                                   # [bq] the queries' positions
  first_pos = pos_ref[b] + q0
  last_pos = pos_ref[b] + jnp.minimum(q0 + bq, tokens) - 1
  if t.windowed:
    lo = jnp.minimum(start_ref[b], qpos)                       # [bq] each query's first key
    first = jnp.minimum(start_ref[b], first_pos)
  else:
    lo = jnp.zeros((bq,), jnp.int32)
    first = jnp.int32(0)
  first = jnp.minimum(first, capacity - 1)
  last = jnp.minimum(last_pos, capacity - 1)
  b0 = first // bk
  n_blocks = last // bk - b0 + 1
  q = masked_load(q_ref.at[b, pl.ds(q0, bq), h, pl.ds(0, hd)],
                  tile_mask(row_ok, None, bq, hd)).astype(t.cd)
  scale = hd ** -0.5

  def body(j, carry):
    m, l, acc = carry
    k0 = (b0 + j) * bk
    keys = k0 + jnp.arange(bk)
    in_range = (keys >= first) & (keys <= last)   # no key another query of the block sees
    kv_mask = tile_mask(in_range, None, bk, hd)
    kt = masked_load(k_ref.at[lay, b, pl.ds(k0, bk), g, pl.ds(0, hd)], kv_mask).astype(t.cd)
    vt = masked_load(v_ref.at[lay, b, pl.ds(k0, bk), g, pl.ds(0, hd)], kv_mask).astype(t.cd)
    sc = lax.dot_general(q, kt, _NT, precision=t.precision,
                         preferred_element_type=_F32) * scale        # [bq, bk]
    ok = ((keys[None, :] <= qpos[:, None]) & (keys[None, :] >= lo[:, None])
          & in_range[None, :])
    sc = jnp.where(ok, sc, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(sc, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(sc - m_new[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + lax.dot_general(p.astype(t.cd), vt, _NN,
                                                 precision=t.precision,
                                                 preferred_element_type=_F32)
    return m_new, l, acc

  init = (jnp.full((bq,), _FLOOR, _F32), jnp.zeros((bq,), _F32), jnp.zeros((bq, hd), _F32))
  _, l, acc = lax.fori_loop(0, n_blocks, body, init)
  l = jnp.where(row_ok, l, 1.0)   # padding queries: nothing stored, no 0 / 0 either
  masked_store(o_ref.at[b, pl.ds(q0, bq), h, pl.ds(0, hd)], acc / l[:, None],
               tile_mask(row_ok, None, bq, hd))


@functools.partial(jax.jit, static_argnames=("block_q", "block_k", "num_warps", "num_stages",
                                             "interpret"))
def prefill_attention_pallas(q, k_stack, v_stack, layer, pos, kv_start=None, *, block_q=None,
                             block_k=None, num_warps=None, num_stages=None, interpret=False):
  """out [B, T, H, Hd] fp32 of `reference.attention_reference` for q [B, T, H, Hd] at
  positions pos[b] + t, against layer `layer` (an int32 scalar, traced OK, clipped) of k_stack
  / v_stack [L, B, S, G, Hd], read in place; pos [B] int32 each row's first position,
  kv_start [B] or None."""
  B, T, H, Hd = q.shape
  S, G = k_stack.shape[2:4]
  require_triton(interpret, "prefill attention", "the 'xla' form")
  args = stack_operands("prefill attention", "[B, T, H, Hd]", q, k_stack, v_stack, layer, pos,
                        kv_start)
  dt = jnp.promote_types(q.dtype, k_stack.dtype)
  t = tiling(H, G, Hd, T, dt, windowed=kv_start is not None, block_q=block_q, block_k=block_k)
  params = None if interpret else triton_params(num_warps or NUM_WARPS,
                                                num_stages or NUM_STAGES)
  return pl.pallas_call(
      functools.partial(_kernel, t=t, tokens=T, capacity=S),
      grid=(B, H, pl.cdiv(T, t.block_q)),
      out_shape=jax.ShapeDtypeStruct((B, T, H, Hd), _F32),
      in_specs=[_WHOLE] * len(args), out_specs=_WHOLE,
      interpret=interpret, compiler_params=params, name="attn_prefill",
  )(*args)
