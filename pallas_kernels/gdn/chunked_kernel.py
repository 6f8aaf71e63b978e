"""Pallas kernel for the chunked gated delta rule, the prefill form (README, "Chunked kernel").

Contract of `reference.delta_rule_chunked`, batched: q, k [B, T, H, Dk] (already
l2-normalised, q already scaled, heads already expanded to the v-heads), v [B, T, H, Dv],
g, beta [B, T, H], state [B, H, Dv, Dk] fp32 -> o [B, T, H, Dv] fp32, state fp32.

One program per (b, h, Dv tile): it keeps its [block_v, Dk] fp32 slice of the state in
registers and walks the chunks of C tokens in order (a `lax.fori_loop` inside the kernel,
lowered to `scf.for`). Per chunk, with G the in-chunk cumulative log decay:

    M = strict_tril(β_t e^{G_t−G_s} k_t·k_s)     T = (I + M)⁻¹ = Π_j (I + N^{2^j}),  N = −M
    ū = T (β v)      w = T (β e^G k)      u = ū − w Sᵀ
    o = (e^G q) Sᵀ + (tril(e^{G_t−G_s}) ⊙ q kᵀ) u      S ← e^{G_last} S + uᵀ (e^{G_last−G} k)

Every product is a `tl.dot` on power-of-2 tiles ≥ 16 (C×C, C×Dk, C×block_v, block_v×Dk);
the UT inverse is log2(C) − 1 squarings and as many products (`chunked.py`'s trick), no
triangular solve. The rows of S are independent in all three state products, so the Dv
split needs no communication; the q/k-only work (decays, M, T, w, q kᵀ) does not depend on
the Dv tile and is recomputed by each of the Dv / block_v programs of a head (accepted: it
keeps one launch and no scratch buffer). All math is fp32 (inputs of any float dtype are
cast on load); `precision` picks the fp32 dot algorithm on the GPU (None: Triton's default
for fp32 operands, TF32); the interpreter (CPU) multiplies in exact fp32. k is loaded again
at each use instead of being kept live across the chunk body (register pressure).

Backend and JAX 0.10/0.11 idioms as in `pallas_kernels/lora/kernel.py` and `decode_kernel.py`.
Not yet run or timed on a GPU: the interpreter has run it, and its Triton IR (JAX 0.10.2's
lowering) was compiled offline for sm_90 with Triton 3.9, no more (README).
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import SQUEEZED, pow2, require_triton, triton_params
from pallas_kernels.gdn.decode_kernel import check_ranks_and_dtypes

_F32 = jnp.float32
_MIN_DIM = 16  # tl.dot needs every dim >= 16; Triton tiles are powers of 2
_NN = (((1,), (0,)), ((), ()))  # a @ b
_NT = (((1,), (1,)), ((), ()))  # a @ bᵀ
_TN = (((0,), (0,)), ((), ()))  # aᵀ @ b
# Compiled defaults: not timed (no GPU run yet). Chosen from an offline compile of the
# kernel's Triton IR for sm_90 (README, "Chunked kernel"): at C = 64, Dk = 128 every tile
# choice spills (~1 KiB a thread), so the grid is sized for occupancy instead: block_v = 32
# gives B * H * Dv / 32 programs (128 at one sequence of 32 heads of 128, about one per SM
# of an H200), one warpgroup (4 warps) matches the M = 64 wgmma tiles, and num_stages = 1
# (pipelining the chunk loop's loads only added shared memory).
_BLOCK_V = 32
_NUM_WARPS = 4
_NUM_STAGES = 1


def _dot(a, b, dims, precision):
  return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=_F32)


def _unit_lower_inverse(m, eye, c, precision):
  """(I + m)⁻¹ for strictly lower m [C, C]: (I + N)(I + N²)(I + N⁴)···(I + N^{C/2}), N = −m.

  N is nilpotent (N^C = 0), so the product is I + N + ... + N^{C−1}; the factors commute
  (all are polynomials in N). Unrolled: C is static."""
  n = -m
  inv = eye + n
  p = 2
  while p < c:
    n = _dot(n, n, _NN, precision)  # N^p
    inv = inv + _dot(inv, n, _NN, precision)  # inv (I + N^p), without a second identity
    p *= 2
  return inv


def _chunked_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, s_out_ref, *,
                    chunk, n_chunks, precision):
  """One program: batch row b, head h, a [block_v, Dk] tile of that head's state; refs hold
  the whole (padded) sequence of this (b, h): q/k [Tp, Dk], v/o [Tp, bv], g/beta [Tp]."""
  c = chunk
  r = jnp.arange(c)
  causal = r[:, None] >= r[None, :]
  strict = r[:, None] > r[None, :]
  eye = (r[:, None] == r[None, :]).astype(_F32)

  def body(i, s):  # s [bv, Dk] fp32: the state at the start of chunk i
    sl = pl.ds(pl.multiple_of(i * c, c), c)
    ld = lambda ref: ref[sl, :].astype(_F32)  # [C, Dk] or [C, bv]
    g = g_ref[sl].astype(_F32)  # [C]
    beta = beta_ref[sl].astype(_F32)  # [C]
    big_g = jnp.cumsum(g)  # [C] in-chunk cumulative log decay
    g_last = jnp.sum(g)  # G_{C-1} as a scalar (no element indexing in Triton)
    diff = big_g[:, None] - big_g[None, :]  # G_t - G_s
    # exp only under the masks: above the diagonal G_t - G_s > 0 could overflow.
    decay_strict = jnp.where(strict, jnp.exp(jnp.where(strict, diff, 0.0)), 0.0)
    decay_causal = jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)
    e_g = jnp.exp(big_g)
    # k is loaded again at each use rather than kept live (a [C, Dk] fp32 tile is 32 KiB of
    # registers at C = 64, Dk = 128); the reloads hit L1/L2.
    k = ld(k_ref)
    m = beta[:, None] * decay_strict * _dot(k, k, _NT, precision)  # [C, C] strictly lower
    t = _unit_lower_inverse(m, eye, c, precision)
    w = _dot(t, (beta * e_g)[:, None] * k, _NN, precision)  # [C, Dk]
    u = _dot(t, beta[:, None] * ld(v_ref), _NN, precision) - _dot(w, s, _NT, precision)
    q = ld(q_ref)
    qk = _dot(q, ld(k_ref), _NT, precision) * decay_causal  # [C, C]
    o = _dot(e_g[:, None] * q, s, _NT, precision) + _dot(qk, u, _NN, precision)
    o_ref[sl, :] = o.astype(o_ref.dtype)
    k_dec = jnp.exp(g_last - big_g)[:, None] * ld(k_ref)  # [C, Dk]
    return jnp.exp(g_last) * s + _dot(u, k_dec, _TN, precision)  # [bv, Dk]

  s_out_ref[...] = lax.fori_loop(0, n_chunks, body, s_ref[...].astype(_F32))


def check_chunked_inputs(q, k, v, g, beta, state, grouped=False):
  """Validate shapes and dtypes; raise ValueError naming the offending operand. grouped: q/k
  may have fewer heads than v (Hk dividing H, v-head h reading k-head h // (H / Hk))."""
  check_ranks_and_dtypes("gdn chunked", (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 3),
                                         ("beta", beta, 3), ("state", state, 4)))
  b, t, hk, dk = q.shape
  h, dv = v.shape[2], v.shape[-1]
  if k.shape != q.shape:
    raise ValueError(f"gdn chunked: k {k.shape} must match q {q.shape} ([B, T, H, Dk])")
  if v.shape[:2] != (b, t) or (h != hk if not grouped else h % hk):
    want = "H a multiple of q's heads" if grouped else f"{(b, t, hk, 'Dv')}"
    raise ValueError(f"gdn chunked: v {v.shape} must be [B, T, H, Dv], {want} (q {q.shape})")
  for name, arr in (("g", g), ("beta", beta)):
    if arr.shape != (b, t, h):
      raise ValueError(f"gdn chunked: {name} {arr.shape} must be [B, T, H] = {(b, t, h)}")
  if state.shape != (b, h, dv, dk):
    raise ValueError(f"gdn chunked: state {state.shape} must be [B, H, Dv, Dk] = "
                     f"{(b, h, dv, dk)}")
  if dk == 0 or dv == 0:
    raise ValueError(f"gdn chunked: Dk={dk} and Dv={dv} must be >= 1")


def head_dim_tile(d):
  """The kernel's tile for a head dim: the power of 2 >= max(d, 16) (tl.dot tiles)."""
  return max(_MIN_DIM, pl.next_power_of_2(d))


def chunk_size(t, chunk):
  """The chunk the kernel runs: `chunk`, or for short inputs the smallest power of 2 >= 16
  that covers all T tokens (fewer padding rows; tl.dot needs >= 16)."""
  if chunk < _MIN_DIM or not pow2(chunk):
    raise ValueError(f"gdn chunked: chunk={chunk} must be a power of 2 >= {_MIN_DIM}")
  return min(chunk, max(_MIN_DIM, pl.next_power_of_2(max(t, 1))))


def chunked_tiles(q, k, v, g, beta, state, chunk, block_v, interpret, grouped=False):
  """Validate the inputs and pick the tiles both chunked kernels run:
  (b, t, h, dk0, dv0, c, dk, dv, bv) with h v's heads, c the chunk, dk / dv the padded head
  dims and bv the Dv tile (`block_v`, or the whole Dv interpreted and _BLOCK_V compiled).
  grouped: as `check_chunked_inputs`."""
  check_chunked_inputs(q, k, v, g, beta, state, grouped)
  require_triton(interpret, "gdn chunked", "'reference'")
  b, t, _, dk0 = q.shape
  h = v.shape[2]
  dv0 = v.shape[-1]
  c = chunk_size(t, chunk)
  dk, dv = head_dim_tile(dk0), head_dim_tile(dv0)
  bv = block_v or (dv if interpret else min(_BLOCK_V, dv))
  if bv < _MIN_DIM or not pow2(bv) or bv > dv:
    raise ValueError(f"gdn chunked: block_v={bv} must be a power of 2 in [{_MIN_DIM}, {dv}] "
                     f"(Dv={dv0} padded to a power of 2 >= {_MIN_DIM})")
  return b, t, h, dk0, dv0, c, dk, dv, bv


@functools.partial(jax.jit, static_argnames=("chunk", "interpret", "block_v", "num_warps",
                                             "num_stages", "precision"))
def gdn_chunked_pallas(q, k, v, g, beta, state, *, chunk=64, interpret=False, block_v=None,
                       num_warps=None, num_stages=None, precision=None):
  """Chunked gated delta rule for a batch of sequences, one launch.

  Args:
    q, k: [B, T, H, Dk] l2-normalised (q also scaled by Dk**-0.5), heads expanded to the
      v-heads; any float dtype (cast to fp32 on load).
    v: [B, T, H, Dv] any float dtype.
    g, beta: [B, T, H] log decay (<= 0) and write strength (cast to float32).
    state: [B, H, Dv, Dk] float32; aliased to the new state (in place when donated).
    chunk: power of 2 >= 16 (tl.dot); short inputs run a smaller chunk (`chunk_size`).
      T is padded to whole chunks with g = beta = 0 rows (they leave the state unchanged)
      and o is cut back to T. Dk and Dv may be any size: each is zero-padded to a power
      of 2 >= 16 (`head_dim_tile`; exact) and the outputs are cut back.
    interpret: run the Pallas interpreter (CPU).
    block_v: power-of-2 Dv tile in [16, padded Dv]; None: 32 compiled, Dv interpreted (each
      interpreted grid step has a fixed cost, so fewer, larger steps).
    num_warps, num_stages: Triton compiler parameters; None: 4 and 1 (ignored when
      interpreting; untimed: the kernel has not run on a GPU yet).
    precision: passed to every `dot_general`. On the GPU: None (Triton's default for fp32
      operands: TF32), `lax.DotAlgorithmPreset.TF32_TF32_F32_X3` (3xTF32, near fp32) or
      "highest" (IEEE fp32 without tensor cores; offline it compiled to a kernel spilling
      ~145 KB a thread: avoid). The interpreter on CPU multiplies in exact fp32 for None
      and "highest" (CPU rejects the TF32 presets).

  Returns:
    (o [B, T, H, Dv] float32, new_state [B, H, Dv, Dk] float32).
  """
  b, t, h, dk0, dv0, c, dk, dv, bv = chunked_tiles(q, k, v, g, beta, state, chunk, block_v,
                                                    interpret)
  if t == 0:
    return jnp.zeros((b, 0, h, dv0), _F32), state
  n = pl.cdiv(t, c)
  tp = n * c
  g, beta = g.astype(_F32), beta.astype(_F32)
  # Zero padding, all exact: rows with g = beta = 0 leave the state unchanged (their o rows
  # are cut); zero Dk columns of q/k/state add nothing to any product and stay zero; zero Dv
  # columns of v/state give u = 0 there, so o and the state stay zero in them.
  if (tp, dk, dv) != (t, dk0, dv0):
    pad = lambda x, d: jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, d - x.shape[-1])))
    q, k, v = pad(q, dk), pad(k, dk), pad(v, dv)
    g, beta = (jnp.pad(x, ((0, 0), (0, tp - t), (0, 0))) for x in (g, beta))
    state = jnp.pad(state, ((0, 0), (0, 0), (0, dv - dv0), (0, dk - dk0)))

  sq = SQUEEZED
  qk_spec = pl.BlockSpec((sq, tp, sq, dk), lambda i, hh, j: (i, 0, hh, 0))
  vo_spec = pl.BlockSpec((sq, tp, sq, bv), lambda i, hh, j: (i, 0, hh, j))
  gb_spec = pl.BlockSpec((sq, tp, sq), lambda i, hh, j: (i, 0, hh))
  s_spec = pl.BlockSpec((sq, sq, bv, dk), lambda i, hh, j: (i, hh, j, 0))
  params = None if interpret else triton_params(num_warps or _NUM_WARPS,
                                                 num_stages or _NUM_STAGES)
  o, state = pl.pallas_call(
      functools.partial(_chunked_kernel, chunk=c, n_chunks=n, precision=precision),
      grid=(b, h, dv // bv),
      in_specs=[qk_spec, qk_spec, vo_spec, gb_spec, gb_spec, s_spec],
      out_specs=[vo_spec, s_spec],
      out_shape=[jax.ShapeDtypeStruct((b, tp, h, dv), _F32),
                 jax.ShapeDtypeStruct(state.shape, _F32)],
      input_output_aliases={5: 1},
      interpret=interpret,
      compiler_params=params,
      name="gdn_chunked",
  )(q, k, v, g, beta, state)
  if (tp, dk, dv) != (t, dk0, dv0):
    o, state = o[:, :t, :, :dv0], state[:, :, :dv0, :dk0]
  return o, state
