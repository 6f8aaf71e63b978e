"""Per-slot model state: one pytree with a batch (slot) axis, keyed by the layer pattern."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from strata_jax.config import ModelConfig


@struct.dataclass
class ModelState:
  k: jax.Array      # [La, B, S, G, Hd]  attention keys (after norm + RoPE)
  v: jax.Array      # [La, B, S, G, Hd]
  conv: jax.Array   # [Lg, B, K-1, C]    last K-1 raw (pre-conv) q|k|v rows
  ssm: jax.Array    # [Lg, B, Hv, Dv, Dk] float32 recurrent state
  pos: jax.Array    # [B] int32 tokens consumed so far
  switch: jax.Array  # [B] int32 the adapter switch each row was computed under (0: no adapter)


def init_state(cfg: ModelConfig, batch: int, max_seq: int, dtype=jnp.float32) -> ModelState:
  """Empty state for `batch` rows and `max_seq` tokens of K/V."""
  La, Lg = cfg.n_attn, cfg.n_gdn
  return ModelState(
      k=jnp.zeros((La, batch, max_seq, cfg.n_kv_head, cfg.head_dim), dtype),
      v=jnp.zeros((La, batch, max_seq, cfg.n_kv_head, cfg.head_dim), dtype),
      conv=jnp.zeros((Lg, batch, cfg.conv_kernel - 1, cfg.gdn_conv_dim), dtype),
      ssm=jnp.zeros((Lg, batch, cfg.gdn_n_v_heads, cfg.gdn_d_v, cfg.gdn_d_k), jnp.float32),
      pos=jnp.zeros((batch,), jnp.int32),
      switch=jnp.zeros((batch,), jnp.int32),
  )


@struct.dataclass
class MTPState:
  """The MTP head's cache (speculative decoding with `--draft mtp`, docs/mtp.md)."""
  k: jax.Array      # [B, S, G, Hd]  the MTP layer's keys, at trunk positions
  v: jax.Array      # [B, S, G, Hd]
  start: jax.Array  # [B] int32 the row's first cached position (its attention starts there)


def init_mtp_state(cfg: ModelConfig, batch: int, max_seq: int, dtype=jnp.float32) -> MTPState:
  z = lambda: jnp.zeros((batch, max_seq, cfg.n_kv_head, cfg.head_dim), dtype)
  return MTPState(k=z(), v=z(), start=jnp.zeros((batch,), jnp.int32))


@struct.dataclass
class Pending:
  """The GDN state after every position of a verification step, until `steps.commit` keeps
  the one after each row's accepted tokens."""
  conv: jax.Array   # [Lg, B, K-1+T, C]  the previous K-1 raw rows, then the T new ones
  ssm: jax.Array    # [Lg, B, T, Hv, Dv, Dk] float32, after position t
