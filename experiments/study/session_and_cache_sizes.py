"""Session file sizes and save/restore times (demo model, measured on this machine), and the
memory of one prefix-cache block and of a session for the 80B-A3B geometry (computed).

  python experiments/study/session_and_cache_sizes.py  -> experiments/results/sizes.json
"""
from __future__ import annotations

import json
import os
import pathlib
import tempfile
import time

import numpy as np

import strata_jax as sj
from strata_jax.config import ModelConfig, layer_pattern_from_interval

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"
A3B = ModelConfig(vocab_size=151936, d_model=2048, layer_types=layer_pattern_from_interval(48, 4),
                  n_head=16, n_kv_head=2, head_dim=256, n_rot=64, rope_base=1e7,
                  gdn_n_k_heads=16, gdn_n_v_heads=32, gdn_d_k=128, gdn_d_v=128, conv_kernel=4,
                  n_experts=512, n_experts_used=10, d_ff_expert=512, d_ff_shared=512)


def state_bytes(cfg: ModelConfig, itemsize: int) -> dict:
  kv_per_token = cfg.n_attn * 2 * cfg.n_kv_head * cfg.head_dim * itemsize
  recurrent = cfg.n_gdn * (cfg.gdn_n_v_heads * cfg.gdn_d_v * cfg.gdn_d_k * 4
                           + (cfg.conv_kernel - 1) * cfg.gdn_conv_dim * itemsize)
  return {"kv_per_token": kv_per_token, "recurrent": recurrent}


def main():
  out = {}
  for name, cfg, item in (("80B-A3B bf16", A3B, 2),):
    sb = state_bytes(cfg, item)
    out[name] = {
        "prefix_block_64_kv_mib": 64 * sb["kv_per_token"] / 2**20,
        "prefix_block_recurrent_state_mib": sb["recurrent"] / 2**20,
        "session_2500_tokens_mib": (2500 * sb["kv_per_token"] + sb["recurrent"]) / 2**20,
        "session_30000_tokens_mib": (30000 * sb["kv_per_token"] + sb["recurrent"]) / 2**20,
    }
  model = sj.load_model()
  sb = state_bytes(model.cfg, 4)
  demo = {"prefix_block_64_kv_kib": 64 * sb["kv_per_token"] / 1024,
          "prefix_block_recurrent_state_kib": sb["recurrent"] / 1024}
  eng = sj.Engine(model, slots=1, max_seq=2560)
  rng = np.random.default_rng(0)
  r = eng.generate(tokens=list(rng.integers(0, model.cfg.vocab_size, 2499)), max_tokens=2)
  with tempfile.TemporaryDirectory() as d:
    t = time.perf_counter()
    info = eng.save_session(r.slot, os.path.join(d, "s"))
    demo["session_2500_save_s"] = time.perf_counter() - t
    demo["session_2500_bytes_on_disk"] = info["bytes"]
    demo["session_2500_raw_mib"] = (2500 * sb["kv_per_token"] + sb["recurrent"]) / 2**20
    fresh = sj.Engine(model, slots=1, max_seq=2560)
    t = time.perf_counter()
    fresh.load_session(0, os.path.join(d, "s"))
    demo["session_2500_restore_s"] = time.perf_counter() - t
  out["demo model f32 (CPU, measured)"] = demo
  RESULTS.mkdir(exist_ok=True)
  (RESULTS / "sizes.json").write_text(json.dumps(out, indent=1))
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
