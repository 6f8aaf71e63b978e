"""Pure-jnp oracles for one decode step of gated attention: the model's own ops. The model's
RMSNorm and NEOX RoPE live here (`strata_jax.model.common` imports them), so that the
prologue kernel's oracle is the model's code itself."""
import jax
import jax.numpy as jnp
from jax import lax


def attention_reference(q, k_cache, v_cache, positions, kv_start=None):
  """out [B, T, H, Hd] fp32: query t of row b attends to its cache's keys lo..positions[b, t].

  q [B, T, H, Hd] (any float dtype), k_cache / v_cache [B, S, G, Hd] (H a multiple of G;
  q-head h reads kv-head h // (H / G)), positions [B, T] int32, kv_start [B] or None (keys
  before min(kv_start, position) are not attended; a query before its row's start sees itself
  only: no all-masked row, no NaN). The model's XLA attention (`strata_jax.model.attention`):
  fp32 scores of the whole capacity, scaled by Hd^-0.5, masked to -inf, softmax, fp32
  probabilities times V."""
  B, T, H, Hd = q.shape
  S, G = k_cache.shape[1], k_cache.shape[2]
  qh = q.reshape(B, T, G, H // G, Hd).astype(jnp.float32)
  scores = jnp.einsum("btgrd,bsgd->bgrts", qh, k_cache.astype(jnp.float32)) * (Hd ** -0.5)
  mask = jnp.arange(S)[None, None, :] <= positions[:, :, None]              # [B, T, S]
  if kv_start is not None:
    lo = jnp.minimum(kv_start[:, None], positions)                          # [B, T]
    mask = mask & (jnp.arange(S)[None, None, :] >= lo[:, :, None])
  scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bgrts,bsgd->btgrd", probs, v_cache.astype(jnp.float32))
  return out.reshape(B, T, H, Hd)


def decode_attention_reference(q, k_cache, v_cache, pos, kv_start=None):
  """out [B, H, Hd] fp32: one decode step, `attention_reference` at T = 1 (q [B, H, Hd], pos
  [B] the query's position: keys 0..pos are valid)."""
  return attention_reference(q[:, None], k_cache, v_cache, pos[:, None], kv_start)[:, 0]


def rms_norm(x, w, eps):
  """RMSNorm over the last axis in float32; `w` already carries GGUF's +1."""
  xf = x.astype(jnp.float32)
  y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (y * w.astype(jnp.float32)).astype(x.dtype)


def inv_freq(n_rot: int, base: float):
  """RoPE's frequencies [n_rot / 2] fp32: base^(-2i / n_rot)."""
  return base ** (-jnp.arange(n_rot // 2, dtype=jnp.float32) * 2.0 / n_rot)


def rope_neox(x, positions, n_rot, base):
  """NEOX (rotate-half) RoPE on the first n_rot dims; pairs (i, i + n_rot/2).

  x [B, T, H, Hd]; positions [B, T] int32.
  """
  half = n_rot // 2
  inv = inv_freq(n_rot, base)                                              # [half]
  ang = positions.astype(jnp.float32)[..., None] * inv                     # [B, T, half]
  cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
  xf = x.astype(jnp.float32)
  x1, x2, rest = xf[..., :half], xf[..., half:n_rot], xf[..., n_rot:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
  return out.astype(x.dtype)


def decode_prologue_reference(qg, k, v, q_norm_w, k_norm_w, pos, valid, k_cache, v_cache,
                              layer, *, n_rot, rope_base, eps):
  """The oracle of `prologue_kernel.attention_decode_prologue`: the model's head norms, RoPE
  and cache scatter at one position a row (`strata_jax.model.attention.attn_mixer`). qg
  [B, H, 2 Hd]; k, v [B, G, Hd]; pos, valid [B]; caches [L, B, S, G, Hd], layer `layer`
  (clamped) written where valid and pos < S. Returns (q [B, H, Hd], k_cache, v_cache)."""
  hd = k_cache.shape[-1]
  positions = jnp.asarray(pos, jnp.int32)[:, None]                          # [B, 1]
  q = rope_neox(rms_norm(qg[:, None, :, :hd], q_norm_w, eps), positions, n_rot, rope_base)
  kr = rope_neox(rms_norm(k[:, None], k_norm_w, eps), positions, n_rot, rope_base)
  layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, k_cache.shape[0] - 1)
  rows = jnp.arange(k.shape[0])[:, None]
  write_at = jnp.where((jnp.asarray(valid) != 0)[:, None], positions, k_cache.shape[2])
  at = (layer, rows, write_at)
  k_cache = k_cache.at[at].set(kr.astype(k_cache.dtype), mode="drop")
  v_cache = v_cache.at[at].set(v[:, None].astype(v_cache.dtype), mode="drop")
  return q[:, 0], k_cache, v_cache
