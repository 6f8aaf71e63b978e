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


def decode_under_forms(lora=None, *, prompt_seed: int = 1, n_steps: int = 3, **forms):
  """The tiny fp32 model under `Forms` with `forms` changed (CPU's resolved forms otherwise): a
  6-token prompt (switch on), then n_steps decode steps of two rows, the switch on in row 0
  and off in row 1, row 1 sitting out every other step (n_new = t % 2). Returns (each step's
  logits [n_steps, 2, V] as numpy, the state after each step as numpy trees)."""
  import dataclasses

  import jax

  from strata_jax import steps
  from strata_jax.forms import Forms
  from strata_jax.state import init_state
  model = tiny_model()
  cfg = dataclasses.replace(TINY, forms=dataclasses.replace(
      Forms().resolve("cpu", jnp.float32), **forms))
  st = init_state(cfg, 2, 32, jnp.float32)
  toks = jnp.asarray(np.random.default_rng(prompt_seed).integers(0, TINY.vocab_size, 6),
                     jnp.int32)
  _, st = steps.prefill(cfg, model.params, lora, st, jnp.int32(0), toks, jnp.int32(6),
                        jnp.int32(1))
  logits, states = [], []
  for t in range(n_steps):
    lg, st = steps.decode(cfg, model.params, lora, st, jnp.asarray([3 + t, 5], jnp.int32),
                          jnp.asarray([1, 0], jnp.int32), jnp.asarray([1, t % 2], jnp.int32))
    logits.append(np.asarray(lg))
    states.append(jax.tree.map(np.asarray, st))
  return np.stack(logits), states
