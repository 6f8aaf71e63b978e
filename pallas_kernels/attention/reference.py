"""Pure-jnp oracle for one decode step of gated attention's softmax part: the model's own ops."""
import jax
import jax.numpy as jnp


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
