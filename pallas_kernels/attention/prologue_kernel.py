"""One launch for an attention layer's decode prologue: the q / k RMSNorms, NEOX RoPE and the
new key / value written into the layer's cache (README, "Prologue kernel").

Between its q / k / v projections and the decode attention kernel, an attention layer's decode
step ran the slice of q out of the q|gate projection, the two head norms, RoPE (slices,
products and a concatenation each for q and k) and the two cache scatters as about eight XLA
launches (bench-a3b at batch 1 on the H200, run 33's HLO and profile). This kernel reads the
projections' outputs as they are, returns the roped q and writes the layer's K / V stacks in
place (aliased).

For row b and query head h (kv head g = h // r, r = H / G), position p = pos[b]:

    q  = rope(rmsnorm(qg[b, h, :Hd]) * q_norm_w)      (the model's rms_norm, then rope_neox,
    k  = rope(rmsnorm(k[b, g]) * k_norm_w)             each rounded to x's dtype as there)
    k_cache[layer, b, p, g] = k;  v_cache[layer, b, p, g] = v[b, g]   (if valid[b] and p < S)

rope: pairs (i, i + n_rot / 2) of the first n_rot dims rotated by p * inv_freq[i]; the rest
as is. `reference.decode_prologue_reference` (the model's ops) is the oracle: the caches match
it bit for bit, q to the norm's and Triton's cos / sin rounding.

One program per (b, h). A vector is loaded in power-of-2 pieces (Triton's block sizes): the
rotated halves and the rest of the head (for bench-a3b's 256-wide heads with 64 rotated dims:
32, 32, 128 and 64). The kv head's first query head (h % r == 0) writes its key and value.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import pow2, require_triton, triton_params
from pallas_kernels.attention.reference import inv_freq

_F32 = jnp.float32
_WHOLE = pl.BlockSpec()
_NUM_WARPS = 4   # untimed


def pow2_pieces(start: int, length: int):
  """[(offset, size)] covering start .. start + length in power-of-2 sizes, largest first."""
  out, off = [], start
  while length:
    size = 1 << (length.bit_length() - 1)
    out.append((off, size))
    off, length = off + size, length - size
  return out


def _kernel(layer_ref, pos_ref, valid_ref, inv_ref, qg_ref, k_ref, v_ref, qw_ref, kw_ref,
            kc_in, vc_in, q_out, kc_out, vc_out, *, hd, n_rot, r, eps, x_dtype, seq):
  del kc_in, vc_in   # aliased to kc_out / vc_out: written in place
  b, h = pl.program_id(0), pl.program_id(1)
  g = h // r
  layer, pos = layer_ref[0], pos_ref[b]
  half = n_rot // 2
  ang = pos.astype(_F32) * inv_ref[...]                               # [half]
  cos, sin = jnp.cos(ang), jnp.sin(ang)

  def norm_rope(src, w_ref):
    """(offset, size, values in x's dtype) pieces of rope(rmsnorm(src) * w); src(off, n)
    loads a piece of the head's raw row."""
    full = src(0, hd).astype(_F32)
    inv = jax.lax.rsqrt(jnp.sum(full * full) / hd + eps)

    def normed(off, n):
      return ((src(off, n).astype(_F32) * inv) * w_ref[pl.ds(off, n)].astype(_F32)
              ).astype(x_dtype)
    x1, x2 = normed(0, half).astype(_F32), normed(half, half).astype(_F32)
    pieces = [(0, half, (x1 * cos - x2 * sin).astype(x_dtype)),
              (half, half, (x2 * cos + x1 * sin).astype(x_dtype))]
    return pieces + [(off, n, normed(off, n)) for off, n in pow2_pieces(n_rot, hd - n_rot)]

  for off, n, val in norm_rope(lambda off, n: qg_ref[b, h, pl.ds(off, n)], qw_ref):
    q_out[b, h, pl.ds(off, n)] = val

  @pl.when((h % r == 0) & (valid_ref[b] != 0) & (pos < seq))
  def _():
    for off, n, val in norm_rope(lambda off, n: k_ref[b, g, pl.ds(off, n)], kw_ref):
      kc_out[layer, b, pos, g, pl.ds(off, n)] = val.astype(kc_out.dtype)
    for off, n in pow2_pieces(0, hd):
      vc_out[layer, b, pos, g, pl.ds(off, n)] = v_ref[b, g, pl.ds(off, n)].astype(vc_out.dtype)


def check_prologue_inputs(qg, k, v, q_norm_w, k_norm_w, pos, valid, k_cache, v_cache, n_rot):
  """Validate shapes; raise ValueError naming the offending operand."""
  if k_cache.ndim != 5 or v_cache.shape != k_cache.shape:
    raise ValueError(f"attention prologue: k_cache {k_cache.shape} and v_cache {v_cache.shape}"
                     " must be one [L, B, S, G, Hd] stack shape")
  _, bsz, _, n_kv, hd = k_cache.shape
  n_q = qg.shape[1] if qg.ndim == 3 else 0
  want = {"qg": (qg, (bsz, n_q, 2 * hd)), "k": (k, (bsz, n_kv, hd)), "v": (v, (bsz, n_kv, hd)),
          "q_norm_w": (q_norm_w, (hd,)), "k_norm_w": (k_norm_w, (hd,)), "pos": (pos, (bsz,)),
          "valid": (valid, (bsz,))}
  for name, (arr, shape) in want.items():
    if arr.shape != shape:
      raise ValueError(f"attention prologue: {name} {arr.shape} must be {shape} (cache "
                       f"{k_cache.shape})")
  if n_q == 0 or n_q % n_kv:
    raise ValueError(f"attention prologue: {n_q} query heads must be a multiple of {n_kv}")
  if not pow2(hd) or n_rot % 2 or not 0 < n_rot <= hd or not pow2(n_rot // 2):
    raise ValueError(f"attention prologue: head_dim={hd} and n_rot/2={n_rot // 2} must be "
                     f"powers of 2, n_rot <= head_dim")


@functools.partial(jax.jit, static_argnames=("n_rot", "rope_base", "eps", "interpret",
                                             "num_warps"))
def attention_decode_prologue(qg, k, v, q_norm_w, k_norm_w, pos, valid, k_cache, v_cache,
                              layer, *, n_rot, rope_base, eps, interpret=False,
                              num_warps=None):
  """An attention layer's decode prologue in one launch (module docstring).

  Args:
    qg: [B, H, 2 Hd] the q projection's output per head (q, then the output gate).
    k, v: [B, G, Hd] the k / v projections' outputs.
    q_norm_w, k_norm_w: [Hd] the head norms' weights (GGUF's +1 included).
    pos: [B] int32 each row's position; valid [B]: rows whose key / value is written.
    k_cache, v_cache: [L, B, S, G, Hd] every attention layer's cache; layer `layer` (int32,
      may be traced; clamped) gets the new entries, in place (aliased). Positions >= S are
      dropped, as the model's scatter drops them.
    n_rot, rope_base: RoPE's rotated dims and base; eps: the norms' epsilon (static).
    interpret: the Pallas interpreter (CPU); num_warps: Triton warps (None: 4).

  Returns:
    (q [B, H, Hd] in qg's dtype, normed and roped; k_cache; v_cache).
  """
  check_prologue_inputs(qg, k, v, q_norm_w, k_norm_w, pos, valid, k_cache, v_cache, n_rot)
  require_triton(interpret, "attention prologue", "attn_decode 'pallas' (the XLA prologue)")
  n_layers, bsz, seq, n_kv, hd = k_cache.shape
  n_q = qg.shape[1]
  layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, n_layers - 1).reshape(1)
  operands = [layer, jnp.asarray(pos, jnp.int32), jnp.asarray(valid).astype(jnp.int32),
              inv_freq(n_rot, rope_base), qg, k, v, q_norm_w, k_norm_w, k_cache, v_cache]
  kernel = functools.partial(_kernel, hd=hd, n_rot=n_rot, r=n_q // n_kv, eps=float(eps),
                             x_dtype=jnp.dtype(qg.dtype), seq=seq)
  return pl.pallas_call(
      kernel, grid=(bsz, n_q),
      in_specs=[_WHOLE] * len(operands), out_specs=[_WHOLE] * 3,
      out_shape=[jax.ShapeDtypeStruct((bsz, n_q, hd), qg.dtype),
                 jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                 jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
      input_output_aliases={len(operands) - 2: 1, len(operands) - 1: 2},
      interpret=interpret,
      compiler_params=None if interpret else triton_params(num_warps or _NUM_WARPS, 1),
      name="attn_decode_prologue",
  )(*operands)
