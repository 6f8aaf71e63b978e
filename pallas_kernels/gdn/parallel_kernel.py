"""Chunk-parallel Pallas kernels for the chunked gated delta rule (README, "Parallel kernel").

Contract of `chunked_kernel.gdn_chunked_pallas` (and of `reference.delta_rule_chunked`,
batched): q, k [B, T, H, Dk] (l2-normalised, q scaled, heads expanded to the v-heads),
v [B, T, H, Dv], g, beta [B, T, H], state [B, H, Dv, Dk] fp32 -> o [B, T, H, Dv] fp32,
state fp32. Here q and k may also come unexpanded, [B, T, Hk, Dk] with Hk dividing H: v-head
h reads q/k head h // (H / Hk) through the block index maps, so the model does not write
the repeated heads (Qwen3-Next: 16 k-heads, 32 v-heads).

`chunked_kernel.py` walks the chunks of a head in order and does all of a chunk's work on the
way, so the UT inverse and the other q/k-only products sit on the serial path. Here the work
that does not depend on the carried state runs first for every chunk at once, and only the
state pass walks the chunks:

1. `_intra_kernel`, grid (B, H, chunks), fully parallel. Per chunk, with G the in-chunk
   cumulative log decay: M = strict_tril(β_t e^{G_t−G_s} k_t·k_s), T = (I + M)⁻¹ as the
   product (I + N)(I + N²)···(I + N^{C/2}) with N = −M (`chunked.py`), then
   ū = T (β v), w = T (β e^G k), A = tril(e^{G_t−G_s}) ⊙ q kᵀ. It writes ū [.., Dv],
   w [.., Dk], A [.., C] (row t of a chunk holds its C entries) and G, all fp32.
   `inverse="blocked"` (`_intra_blocked_kernel`) computes the same ū and w as fla's
   solve_tril + recompute_w_u: the chunk in blocks of 16 rows, the diagonal blocks of T by
   the product form at size 16, the others by block forward substitution, then ū and w
   block-row by block-row (16-row ref slices: Triton cannot slice a value in registers).
2. The state pass, grid (B, H, Dv / block_v): each program keeps a [block_v, Dk] fp32 tile
   of one head's state and walks the chunks; per chunk u = ū − w Sᵀ, then
   S ← e^{G_last} S + uᵀ (e^{G_last−G} k). Two forms:
   - "fused" (`_state_out_kernel`): it also writes o = (e^G q) Sᵀ + A u for the chunk
     (two more products on the serial path, no per-chunk state written). Two launches.
   - "separate" (`_state_kernel` + `_out_kernel`, as fla's chunk_fwd_h / chunk_fwd_o): the
     pass writes u and the state at each chunk's start, h [B, H, chunks, Dv, Dk] fp32, and a
     third, fully parallel launch, grid (B, H, chunks), computes o from q, G, A, u and h.

Every product is a `dot_general` on power-of-2 tiles >= 16 (tl.dot). All math is fp32
(inputs of any float dtype are cast on load); `precision` picks the fp32 dot algorithm on
the GPU (None: Triton's default, TF32); the interpreter (CPU) multiplies in exact fp32. The
intermediates (ū, w, A, G, and for "separate" u and h) are arrays in HBM: fp32, or ū, w, u
and h in `inter_dtype` (bf16 halves their traffic, as fla keeps them in the input dtype).

Backend and JAX 0.10/0.11 idioms as `chunked_kernel.py` (the Triton lowering).
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import SQUEEZED, masked_load, masked_store, triton_params
from pallas_kernels.gdn.chunked_kernel import (
    _NN,
    _NT,
    _TN,
    _dot,
    _unit_lower_inverse,
    chunked_tiles,
)

_F32 = jnp.float32
STATE_PASSES = ("fused", "separate")
INVERSES = ("products", "blocked")
# Rows of a sub-block of the "blocked" inverse: fla's, and tl.dot's minimum tile.
_SUB = 16
# Compiled defaults, from the H200 sweep at T = 2,500, 32 heads of 128, bf16 q/k/v, C = 64
# (experiments/results/device/run70/gdn_probe_chunked_plan.json), its fastest row: "separate"
# at 2 software-pipeline stages, bf16 intermediates, the intra launch at 4 warps, 320.6 us
# (363.1 at 8 warps; 327.8 at 8 warps and 3 stages, a pairing not yet timed with 4 warps;
# 421.2 at 2 stages with fp32 intermediates). The "fused" pass at 1 stage (its state tile and
# A u on the serial path; 2 stages were only timed with bf16 intermediates, 441.9 us). The
# state pass keeps the chunked kernel's block_v and 4 warps (8 warps: 430.2 us; block_v 16 /
# 64: 476.6 / 489.8).
_INTRA_WARPS = 4
_STATE_WARPS = 4
_OUT_WARPS = 4
# "separate" at 3 stages since run 71 (an H100, the lent card that day, 4 intra warps, bf16
# intermediates): 331.9 us against 363.2 at 2 stages and 386.2 at 2 stages with 8 intra warps
# (experiments/results/device/run71/gdn_probe_s15.json).
_STAGES = {"fused": 1, "separate": 3}


def _masks(c):
  r = jnp.arange(c)
  return r, r[:, None] >= r[None, :], r[:, None] > r[None, :]


def _intra_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, ubar_ref, w_ref, a_ref, gc_ref, *,
                  chunk, precision):
  """One program: batch row b, head h, chunk i. Refs hold that chunk: q/k [C, Dk],
  v [C, Dv], g/beta [C]; outputs ū [C, Dv], w [C, Dk], A [C, C], G [C]."""
  c = chunk
  r, causal, strict = _masks(c)
  eye = (r[:, None] == r[None, :]).astype(_F32)
  g = g_ref[...].astype(_F32)
  beta = beta_ref[...].astype(_F32)
  big_g = jnp.cumsum(g)
  diff = big_g[:, None] - big_g[None, :]  # G_t - G_s
  # exp only under the masks: above the diagonal G_t - G_s > 0 could overflow.
  decay_strict = jnp.where(strict, jnp.exp(jnp.where(strict, diff, 0.0)), 0.0)
  k = k_ref[...].astype(_F32)
  m = beta[:, None] * decay_strict * _dot(k, k, _NT, precision)  # [C, C] strictly lower
  t = _unit_lower_inverse(m, eye, c, precision)
  w = _dot(t, (beta * jnp.exp(big_g))[:, None] * k, _NN, precision)
  w_ref[...] = w.astype(w_ref.dtype)
  ubar = _dot(t, beta[:, None] * v_ref[...].astype(_F32), _NN, precision)
  ubar_ref[...] = ubar.astype(ubar_ref.dtype)
  _store_a_and_g(q_ref, k, big_g, diff, causal, a_ref, gc_ref, precision)


def _store_a_and_g(q_ref, k, big_g, diff, causal, a_ref, gc_ref, precision):
  """Both intra kernels' A = tril(e^{G_t−G_s}) ⊙ q kᵀ [C, C] and G [C] (k [C, Dk] fp32,
  diff = G_t − G_s; exp only under the mask)."""
  decay_causal = jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)
  a_ref[...] = _dot(q_ref[...].astype(_F32), k, _NT, precision) * decay_causal
  gc_ref[...] = big_g


def _intra_blocked_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, ubar_ref, w_ref, a_ref,
                          gc_ref, *, chunk, precision):
  """`_intra_kernel`'s outputs with T = (I + M)⁻¹ by blocks of 16 rows (fla's solve_tril and
  recompute_w_u) instead of products of [C, C] matrices. With M_ij, T_ij the [16, 16] blocks
  (block i holds rows 16i..16i+15): T_ii = (I + M_ii)⁻¹ by the product form at size 16,
  T_ij = −T_ii Σ_{j≤p<i} M_ip T_pj for j < i, then w_i = Σ_{j≤i} T_ij (β e^G k)_j and
  ū_i = Σ_{j≤i} T_ij (β v)_j. Blocks are loaded and stored through static 16-row slices of
  the refs (Triton cannot slice a value held in registers)."""
  c, s = chunk, _SUB
  r, causal, _ = _masks(c)
  big_g = jnp.cumsum(g_ref[...].astype(_F32))
  _store_a_and_g(q_ref, k_ref[...].astype(_F32), big_g, big_g[:, None] - big_g[None, :],
                 causal, a_ref, gc_ref, precision)

  rs, _, strict = _masks(s)
  eye = (rs[:, None] == rs[None, :]).astype(_F32)
  rows = lambda i: pl.ds(s * i, s)
  # Block i's G: picked out of the chunk's cumsum by a masked sum (exact: one nonzero term;
  # Triton cannot index elements), so A, w and G use the same values.
  g_of = lambda i: jnp.sum(jnp.where(rs[:, None] + s * i == r[None, :], big_g[None, :], 0.0),
                           axis=1)  # [16]
  n_sub = c // s
  ks = [k_ref[rows(i), :].astype(_F32) for i in range(n_sub)]  # [16, Dk] each
  gs = [g_of(i) for i in range(n_sub)]
  betas = [beta_ref[rows(i)].astype(_F32) for i in range(n_sub)]
  t = {}  # (i, j) -> T_ij [16, 16], j <= i
  for i in range(n_sub):
    kk = lambda j: _dot(ks[i], ks[j], _NT, precision)
    # M_ij = β_i e^{G_i − G_j} k_i k_jᵀ; off the diagonal every entry is below it (no mask).
    m = {j: betas[i][:, None] * jnp.exp(gs[i][:, None] - gs[j][None, :]) * kk(j)
         for j in range(i)}
    d_ii = gs[i][:, None] - gs[i][None, :]
    decay_ii = jnp.where(strict, jnp.exp(jnp.where(strict, d_ii, 0.0)), 0.0)
    m_ii = betas[i][:, None] * decay_ii * kk(i)  # strictly lower
    t[i, i] = _unit_lower_inverse(m_ii, eye, s, precision)
    for j in range(i):
      acc = _dot(m[j], t[j, j], _NN, precision)
      for p in range(j + 1, i):
        acc = acc + _dot(m[p], t[p, j], _NN, precision)
      t[i, j] = -_dot(t[i, i], acc, _NN, precision)
    w = ubar = 0.0
    for j in range(i + 1):  # v's blocks are loaded again per block-row, not held (registers)
      xk = (betas[j] * jnp.exp(gs[j]))[:, None] * ks[j]  # [16, Dk]
      xv = betas[j][:, None] * v_ref[rows(j), :].astype(_F32)  # [16, Dv]
      w = w + _dot(t[i, j], xk, _NN, precision)
      ubar = ubar + _dot(t[i, j], xv, _NN, precision)
    w_ref[rows(i), :] = w.astype(w_ref.dtype)
    ubar_ref[rows(i), :] = ubar.astype(ubar_ref.dtype)


def _last(big_g, r, c):
  """G_{C-1} as a scalar: a masked sum (Triton cannot index one element of a tile)."""
  return jnp.sum(jnp.where(r == c - 1, big_g, 0.0))


def _state_out_kernel(q_ref, k_ref, ubar_ref, w_ref, a_ref, gc_ref, s_ref, o_ref, s_out_ref,
                      *, chunk, n_chunks, precision):
  """Fused state pass. One program: (b, h, Dv tile); refs hold the whole padded sequence of
  this (b, h): q/k/w [Tp, Dk], ū/o [Tp, bv], A [Tp, C], G [Tp]; state [bv, Dk]."""
  c = chunk
  r = jnp.arange(c)

  def body(i, s):  # s [bv, Dk] fp32: the state at the start of chunk i
    sl = pl.ds(pl.multiple_of(i * c, c), c)
    big_g = gc_ref[sl]
    g_last = _last(big_g, r, c)
    u = ubar_ref[sl, :].astype(_F32) - _dot(w_ref[sl, :].astype(_F32), s, _NT,
                                            precision)  # [C, bv]
    q_dec = jnp.exp(big_g)[:, None] * q_ref[sl, :].astype(_F32)
    o = _dot(q_dec, s, _NT, precision) + _dot(a_ref[sl, :], u, _NN, precision)
    o_ref[sl, :] = o.astype(o_ref.dtype)
    k_dec = jnp.exp(g_last - big_g)[:, None] * k_ref[sl, :].astype(_F32)  # [C, Dk]
    return jnp.exp(g_last) * s + _dot(u, k_dec, _TN, precision)

  s_out_ref[...] = lax.fori_loop(0, n_chunks, body, s_ref[...].astype(_F32))


def _state_kernel(k_ref, ubar_ref, w_ref, gc_ref, s_ref, u_ref, h_ref, s_out_ref, *, chunk,
                  n_chunks, precision):
  """Separate state pass: as `_state_out_kernel` without o; writes u [Tp, bv] and the state
  at each chunk's start, h [chunks, bv, Dk]."""
  c = chunk
  r = jnp.arange(c)

  def body(i, s):
    sl = pl.ds(pl.multiple_of(i * c, c), c)
    h_ref[i] = s.astype(h_ref.dtype)
    big_g = gc_ref[sl]
    g_last = _last(big_g, r, c)
    u = ubar_ref[sl, :].astype(_F32) - _dot(w_ref[sl, :].astype(_F32), s, _NT, precision)
    u_ref[sl, :] = u.astype(u_ref.dtype)
    k_dec = jnp.exp(g_last - big_g)[:, None] * k_ref[sl, :].astype(_F32)
    return jnp.exp(g_last) * s + _dot(u, k_dec, _TN, precision)

  s_out_ref[...] = lax.fori_loop(0, n_chunks, body, s_ref[...].astype(_F32))


def _chunk_out(q_ref, a_ref, gc_ref, u_ref, h_ref, precision):
  """o = (e^G q) hᵢᵀ + A u for one chunk and the Dv columns of the u / h blocks, fp32."""
  q_dec = jnp.exp(gc_ref[...])[:, None] * q_ref[...].astype(_F32)
  return (_dot(q_dec, h_ref[...].astype(_F32), _NT, precision)
          + _dot(a_ref[...], u_ref[...].astype(_F32), _NN, precision))


def _out_kernel(q_ref, a_ref, gc_ref, u_ref, h_ref, o_ref, *, precision):
  """One program: (b, h, chunk i, Dv tile): o = (e^G q) hᵢᵀ + A u for block_v columns."""
  o_ref[...] = _chunk_out(q_ref, a_ref, gc_ref, u_ref, h_ref, precision)


def _out_gated_kernel(q_ref, a_ref, gc_ref, u_ref, h_ref, z_ref, nw_ref, y_ref, *, precision,
                      eps, t, dv0):
  """`_out_kernel` on the whole Dv with the layer's gated norm after it: one program per
  (b, h, chunk i) writes y = (o rsqrt(mean(o^2) + eps) norm_w) silu(z) for the chunk's rows
  below t (z and y are unpadded: the last chunk's block overhangs them, loads and stores
  masked). Padded Dv columns of o are zero, so the mean divides by dv0."""
  c = q_ref.shape[0]
  o = _chunk_out(q_ref, a_ref, gc_ref, u_ref, h_ref, precision)                 # [C, Dv]
  rows = pl.program_id(2) * c + jnp.arange(c)
  ok = (rows < t)[:, None]
  zf = masked_load(z_ref, ok).astype(_F32)
  inv = lax.rsqrt(jnp.sum(o * o, axis=-1, keepdims=True) / dv0 + eps)
  y = (o * inv * nw_ref[...].astype(_F32)[None, :]) * jax.nn.silu(zf)
  masked_store(y_ref, y.astype(y_ref.dtype), ok)


def gated_norm_out(q, k, v, g, beta, state, z, norm_w, *, eps, out_dtype, chunk=64,
                   interpret=False, **kw):
  """`gdn_chunked_parallel(state_pass="separate")` with the GDN layer's gated norm in its
  output launch: returns (y [B, T, H, Dv] in out_dtype, state), y =
  `reference.gated_rms_norm(o, z, norm_w, eps, out_dtype)` of the op's o, to the fp32
  rounding of the norm (the kernel's sum and rsqrt against XLA's). z [B, T, H, Dv] any float
  dtype; norm_w [Dv]. The fp32 o is never written: the output launch takes each head's whole
  Dv (the norm needs it) and writes y, unpadded. kw: `gdn_chunked_parallel`'s tiles."""
  return gdn_chunked_parallel(q, k, v, g, beta, state, chunk=chunk, interpret=interpret,
                              state_pass="separate", gate=(z, norm_w), eps=eps,
                              out_dtype=jnp.dtype(out_dtype), **kw)


@functools.partial(jax.jit, static_argnames=(
    "chunk", "interpret", "block_v", "num_warps", "intra_warps", "num_stages", "precision",
    "state_pass", "inter_dtype", "inverse", "eps", "out_dtype"))
def gdn_chunked_parallel(q, k, v, g, beta, state, *, chunk=64, interpret=False, block_v=None,
                         num_warps=None, intra_warps=None, num_stages=None, precision=None,
                         state_pass="fused", inter_dtype=None, inverse="products", gate=None,
                         eps=None, out_dtype=None):
  """Chunked gated delta rule for a batch, intra-chunk work parallel over chunks.

  Args and returns as `chunked_kernel.gdn_chunked_pallas` (q, k [B, T, H, Dk] normalised and
  scaled, or [B, T, Hk, Dk] with Hk dividing H: module docstring; v [B, T, H, Dv]; g, beta
  [B, T, H]; state [B, H, Dv, Dk] float32, aliased to the new state; T, Dk, Dv zero-padded as
  there), plus:
    state_pass: "fused" (two launches: the state pass also writes o) or "separate" (three:
      the state pass writes u and the per-chunk states, a parallel launch computes o).
    num_warps: warps of the state pass (and of the output launch); None: 4.
    intra_warps: warps of the parallel intra-chunk launch; None: 4.
    num_stages: software-pipeline stages of every launch; None: 1 for "fused", 2 for
      "separate" (`_STAGES`).
    block_v: the state pass's Dv tile; None: 32 compiled, Dv interpreted.
    inter_dtype: the dtype ū and w (and for "separate" u and h) are kept in between the
      launches; None: float32. bfloat16 halves their HBM traffic (fla keeps them in the
      input dtype) at bf16 rounding of those values; A, G, the state and all math stay fp32.
    inverse: how the intra launch gets T = (I + M)⁻¹: "products" ((I + N)(I + N²)··· on
      [C, C]) or "blocked" (16-row blocks by forward substitution, as fla's solve_tril).
    gate, eps, out_dtype: (z, norm_w) for `gated_norm_out` ("separate" only): the output
      launch returns the gated norm of o in out_dtype instead of o.
  """
  if state_pass not in STATE_PASSES:
    raise ValueError(f"gdn chunked: state_pass={state_pass!r}: expected one of {STATE_PASSES}")
  if inverse not in INVERSES:
    raise ValueError(f"gdn chunked: inverse={inverse!r}: expected one of {INVERSES}")
  b, t, h, dk0, dv0, c, dk, dv, bv = chunked_tiles(q, k, v, g, beta, state, chunk, block_v,
                                                    interpret, grouped=True)
  grp = h // q.shape[2]   # v-head hh reads q/k head hh // grp (read in place, not repeated)
  if gate is not None and state_pass != "separate":
    raise ValueError("gdn chunked: the gated norm rides in the separate output launch "
                     f"(state_pass='separate', not {state_pass!r})")
  if t == 0:
    return jnp.zeros((b, 0, h, dv0), _F32 if gate is None else out_dtype), state
  n = pl.cdiv(t, c)
  tp = n * c
  g, beta = g.astype(_F32), beta.astype(_F32)
  inter = jnp.dtype(inter_dtype or _F32)
  # Zero padding, exact as in `gdn_chunked_pallas`: g = beta = 0 rows leave the state
  # unchanged; zero Dk / Dv columns stay zero.
  padded = (tp, dk, dv) != (t, dk0, dv0)
  if padded:
    pad = lambda x, d: jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, d - x.shape[-1])))
    q, k, v = pad(q, dk), pad(k, dk), pad(v, dv)
    g, beta = (jnp.pad(x, ((0, 0), (0, tp - t), (0, 0))) for x in (g, beta))
    state = jnp.pad(state, ((0, 0), (0, 0), (0, dv - dv0), (0, dk - dk0)))

  sq = SQUEEZED
  params = lambda warps, stages: None if interpret else triton_params(warps, stages)
  stages = num_stages or _STAGES[state_pass]
  # 1. Intra-chunk work, one program per (b, h, chunk).
  cspec = lambda d, r=1: pl.BlockSpec((sq, c, sq, d), lambda i, hh, j: (i, j, hh // r, 0))
  cvec = pl.BlockSpec((sq, c, sq), lambda i, hh, j: (i, j, hh))
  ubar, w, a, gc = pl.pallas_call(
      functools.partial(_intra_kernel if inverse == "products" else _intra_blocked_kernel,
                        chunk=c, precision=precision),
      grid=(b, h, n),
      in_specs=[cspec(dk, grp), cspec(dk, grp), cspec(dv), cvec, cvec],
      out_specs=[cspec(dv), cspec(dk), cspec(c), cvec],
      out_shape=[jax.ShapeDtypeStruct((b, tp, h, dv), inter),
                 jax.ShapeDtypeStruct((b, tp, h, dk), inter),
                 jax.ShapeDtypeStruct((b, tp, h, c), _F32),
                 jax.ShapeDtypeStruct((b, tp, h), _F32)],
      interpret=interpret,
      compiler_params=params(intra_warps or _INTRA_WARPS, stages),
      name="gdn_chunk_intra",
  )(q, k, v, g, beta)

  # 2. The state pass, one program per (b, h, Dv tile), chunks in order.
  seq = lambda d, r=1: pl.BlockSpec((sq, tp, sq, d), lambda i, hh, j: (i, 0, hh // r, 0))
  seq_v = pl.BlockSpec((sq, tp, sq, bv), lambda i, hh, j: (i, 0, hh, j))
  seq_g = pl.BlockSpec((sq, tp, sq), lambda i, hh, j: (i, 0, hh))
  s_spec = pl.BlockSpec((sq, sq, bv, dk), lambda i, hh, j: (i, hh, j, 0))
  warps = num_warps or _STATE_WARPS
  if state_pass == "fused":
    o, state = pl.pallas_call(
        functools.partial(_state_out_kernel, chunk=c, n_chunks=n, precision=precision),
        grid=(b, h, dv // bv),
        in_specs=[seq(dk, grp), seq(dk, grp), seq_v, seq(dk), seq(c), seq_g, s_spec],
        out_specs=[seq_v, s_spec],
        out_shape=[jax.ShapeDtypeStruct((b, tp, h, dv), _F32),
                   jax.ShapeDtypeStruct(state.shape, _F32)],
        input_output_aliases={6: 1},
        interpret=interpret,
        compiler_params=params(warps, stages),
        name="gdn_chunk_state_out",
    )(q, k, ubar, w, a, gc, state)
  else:
    h_spec = pl.BlockSpec((sq, sq, n, bv, dk), lambda i, hh, j: (i, hh, 0, j, 0))
    u, hs, state = pl.pallas_call(
        functools.partial(_state_kernel, chunk=c, n_chunks=n, precision=precision),
        grid=(b, h, dv // bv),
        in_specs=[seq(dk, grp), seq_v, seq(dk), seq_g, s_spec],
        out_specs=[seq_v, h_spec, s_spec],
        out_shape=[jax.ShapeDtypeStruct((b, tp, h, dv), inter),
                   jax.ShapeDtypeStruct((b, h, n, dv, dk), inter),
                   jax.ShapeDtypeStruct(state.shape, _F32)],
        input_output_aliases={4: 2},
        interpret=interpret,
        compiler_params=params(warps, stages),
        name="gdn_chunk_state",
    )(k, ubar, w, gc, state)
    if gate is not None:
      y = _gated_out_launch(q, a, gc, u, hs, gate, b, t, h, grp, n, c, dk, dv0, dv, eps,
                            out_dtype, precision, interpret, num_warps, stages)
      return y, (state[:, :, :dv0, :dk0] if padded else state)
    # 3. Outputs, one program per (b, h, chunk, Dv tile); the grid's last axis enumerates
    #    (chunk, tile) pairs (the Triton backend has at most three grid axes).
    nv = dv // bv
    tile = lambda d, r=1: pl.BlockSpec((sq, c, sq, d),
                                       lambda i, hh, j: (i, j // nv, hh // r, 0))
    tile_v = pl.BlockSpec((sq, c, sq, bv), lambda i, hh, j: (i, j // nv, hh, j % nv))
    o = pl.pallas_call(
        functools.partial(_out_kernel, precision=precision),
        grid=(b, h, n * nv),
        in_specs=[tile(dk, grp), tile(c),
                  pl.BlockSpec((sq, c, sq), lambda i, hh, j: (i, j // nv, hh)),
                  tile_v,
                  pl.BlockSpec((sq, sq, sq, bv, dk), lambda i, hh, j: (i, hh, j // nv, j % nv, 0))],
        out_specs=tile_v,
        out_shape=jax.ShapeDtypeStruct((b, tp, h, dv), _F32),
        interpret=interpret,
        compiler_params=params(_OUT_WARPS if num_warps is None else num_warps, stages),
        name="gdn_chunk_out",
    )(q, a, gc, u, hs)
  if padded:
    o, state = o[:, :t, :, :dv0], state[:, :, :dv0, :dk0]
  return o, state


def _gated_out_launch(q, a, gc, u, hs, gate, b, t, h, grp, n, c, dk, dv0, dv, eps, out_dtype,
                      precision, interpret, num_warps, stages):
  """The output launch of `gated_norm_out`: grid (b, h, chunk), whole (padded) Dv tiles of
  the intermediates, z and y blocks over their unpadded rows."""
  z, norm_w = gate
  if z.shape != (b, t, h, dv0) or norm_w.shape != (dv0,):
    raise ValueError(f"gdn chunked: the gate z {z.shape} must be [B, T, H, Dv] = "
                     f"{(b, t, h, dv0)} and norm_w {norm_w.shape} [Dv]")
  if dv != dv0:   # zero columns: o's are zero, z's and the weight's are cut from y
    z = jnp.pad(z, ((0, 0), (0, 0), (0, 0), (0, dv - dv0)))
    norm_w = jnp.pad(norm_w, (0, dv - dv0))
  sq = SQUEEZED
  tile = lambda d, r=1: pl.BlockSpec((sq, c, sq, d), lambda i, hh, j: (i, j, hh // r, 0))
  y = pl.pallas_call(
      functools.partial(_out_gated_kernel, precision=precision, eps=eps, t=t, dv0=dv0),
      grid=(b, h, n),
      in_specs=[tile(dk, grp), tile(c), pl.BlockSpec((sq, c, sq), lambda i, hh, j: (i, j, hh)),
                tile(dv), pl.BlockSpec((sq, sq, sq, dv, dk), lambda i, hh, j: (i, hh, j, 0, 0)),
                tile(dv), pl.BlockSpec((dv,), lambda i, hh, j: (0,))],
      out_specs=tile(dv),
      out_shape=jax.ShapeDtypeStruct((b, t, h, dv), out_dtype),
      interpret=interpret,
      compiler_params=None if interpret else triton_params(
          _OUT_WARPS if num_warps is None else num_warps, stages),
      name="gdn_chunk_out_gated",
  )(q, a, gc, u, hs, z, norm_w)
  return y[..., :dv0] if dv != dv0 else y
