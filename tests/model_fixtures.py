"""Tiny models and adapters built in-process (no files) for engine and switch tests."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from strata_jax.api import LoraSet, Model
from strata_jax.config import ModelConfig
from strata_jax.params import LoraParams, init_params

TINY = ModelConfig(vocab_size=256, d_model=64, layer_types="GGGAGGGA", n_head=4, n_kv_head=2,
                   head_dim=16, n_rot=8, rope_base=1e4, gdn_n_k_heads=2, gdn_n_v_heads=4,
                   gdn_d_k=16, gdn_d_v=8, conv_kernel=4, n_experts=4, n_experts_used=2,
                   d_ff_expert=32, d_ff_shared=48, rms_eps=1e-6, context_length=1024)


def tiny_model(cfg: ModelConfig = TINY, seed: int = 0, dtype=jnp.float32) -> Model:
  return Model(cfg=cfg, params=init_params(cfg, seed, dtype=dtype, scale=0.1), dtype=dtype,
               path=f"<tiny seed={seed}>", fingerprint=f"tiny-{seed}",
               layer_ranges=[(0, cfg.n_layers)], eos_id=None)


def random_lora(cfg: ModelConfig = TINY, rank: int = 8, seed: int = 1, scale: float = 0.5,
                dtype=jnp.float32, adapter_id: int | None = None) -> LoraSet:
  rng = np.random.default_rng(seed)
  mk = lambda *s: jnp.asarray((scale * rng.standard_normal(s)).astype(np.float32), dtype)
  D = cfg.d_model
  p = LoraParams(gdn_a=mk(cfg.n_gdn, rank, cfg.gdn_value_dim), gdn_b=mk(cfg.n_gdn, D, rank),
                 attn_a=mk(cfg.n_attn, rank, cfg.attn_out_dim), attn_b=mk(cfg.n_attn, D, rank))
  return LoraSet(params=p, files=(f"<random seed={seed}>",), ignored=(), rank_total=rank,
                 adapter_id=adapter_id if adapter_id is not None else 0x1000 + seed)
