"""Pure-jnp oracle for one decode step of gated attention's softmax part: the model's own ops."""
import jax
import jax.numpy as jnp


def decode_attention_reference(q, k_cache, v_cache, pos, kv_start=None):
  """out [B, H, Hd] fp32: each row's query attends to its cache's keys lo..pos.

  q [B, H, Hd] (any float dtype), k_cache / v_cache [B, S, G, Hd] (H a multiple of G; q-head
  h reads kv-head h // (H / G)), pos [B] int32 (the query's position: keys 0..pos are valid),
  kv_start [B] or None (keys before min(kv_start, pos) are not attended). The ops, dtypes and
  order of `strata_jax.model.attention.attn_mixer` at T = 1: fp32 scores of the whole
  capacity, scaled by Hd^-0.5, masked to -inf, softmax, fp32 probabilities times V."""
  B, H, Hd = q.shape
  S, G = k_cache.shape[1], k_cache.shape[2]
  qh = q.reshape(B, 1, G, H // G, Hd).astype(jnp.float32)
  scores = jnp.einsum("btgrd,bsgd->bgrts", qh, k_cache.astype(jnp.float32)) * (Hd ** -0.5)
  positions = pos[:, None]
  mask = jnp.arange(S)[None, None, :] <= positions[:, :, None]
  if kv_start is not None:
    lo = jnp.minimum(kv_start[:, None], positions)
    mask = mask & (jnp.arange(S)[None, None, :] >= lo[:, :, None])
  scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bgrts,bsgd->btgrd", probs, v_cache.astype(jnp.float32))
  return out.reshape(B, H, Hd)
