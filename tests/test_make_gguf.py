"""experiments/bench/make_gguf.py writes valid GGUFs (every mix, the tiny geometry) that the
loader reads with the geometry and types asked for; load_80b.py --smoke runs end to end."""
import json
import os
import pathlib
import subprocess
import sys

import gguf
import numpy as np
import pytest

from strata_jax.gguf.reader import read_model_gguf

ROOT = pathlib.Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "experiments" / "bench"))
import make_gguf  # noqa: E402

T = gguf.GGMLQuantizationType


@pytest.mark.parametrize("quant", make_gguf.QUANTS)
def test_make_gguf_tiny_is_valid(tmp_path, quant):
  path = str(tmp_path / f"{quant}.gguf")
  info = make_gguf.write(path, "tiny", quant, progress=False, threads=3)
  types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
  if quant == "q4_k_m":
    assert types["blk.0.attn_qkv.weight"] == T.Q5_K and types["output.weight"] == T.Q6_K
    assert types["blk.3.attn_output.weight"] == T.Q4_K
    # llama.cpp's use_more_bits over 8 layers: 0, 3, 6, 7 get Q6_K for ffn_down*
    assert [types[f"blk.{i}.ffn_down_exps.weight"] == T.Q6_K for i in range(8)] == [
        True, False, False, True, False, False, True, True]
    # attention layers 3, 7 are attn_v's 0 and 1 of 2: only the last eighth gets more bits
    assert (types["blk.3.attn_v.weight"], types["blk.7.attn_v.weight"]) == (T.Q4_K, T.Q6_K)
  assert types["blk.0.ssm_a"] == T.F32 and types["blk.0.ffn_gate_inp.weight"] == T.F32
  mf = read_model_gguf(path, weights="dequantize")
  want = make_gguf.model_config("tiny")
  assert (mf.cfg.layer_types, mf.cfg.d_model, mf.cfg.n_experts, mf.cfg.head_dim) == (
      want.layer_types, want.d_model, want.n_experts, want.head_dim)
  assert mf.file_bytes == info["tensor_bytes"]
  for leaf in mf.params.layers.moe.gate_exps, mf.params.lm_head, mf.params.layers.gdn.a:
    x = np.asarray(leaf)
    assert np.isfinite(x).all() and 0 < np.abs(x).max() < 4


def test_load_80b_smoke(tmp_path):
  out = tmp_path / "a80b.json"
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, str(ROOT / "experiments/bench/load_80b.py"), "--smoke",
                         "--out", str(out)], capture_output=True, text=True, env=env,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  res = json.loads(out.read_text())
  got = {e["name"]: e for e in res["entries"]}
  assert got["a80b_q4km_fits_one_h200"]["measured"] is True
  ratio = got["a80b_q4km_device_bytes_ratio"]["measured"]
  assert ratio >= 1.0 and ratio <= 1.1, ratio
  assert got["a80b_q4km_decode_tok_s_b1"]["measured"] > 0
  assert set(got) >= {"a80b_host_peak_gib", "a80b_load_s",
                      "a80b_q4km_decode_b1_roofline_fraction"}
  assert all(set(e) == {"name", "measured", "target", "unit", "met", "command"}
             for e in res["entries"])


def test_summary_holds_only_targets_and_measured_json_the_rest(tmp_path):
  """The contract's summary.json is one entry per target with `met` a bool: benches' entries
  with no target go to measured.json beside it, and an entry that loses its target moves."""
  import common  # noqa: PLC0415 (experiments/bench, on the path above)
  row = lambda name, target, met: dict(name=name, measured=1.0, target=target, unit="x",
                                       met=met, command="c")
  common.merge_summary([row("a", 2.0, False), row("b", None, None)], str(tmp_path))
  common.merge_summary([row("c", 1.0, True)], str(tmp_path))
  read = lambda f: {e["name"]: e for e in json.loads((tmp_path / f).read_text())}
  assert set(read("summary.json")) == {"a", "c"} and set(read("measured.json")) == {"b"}
  common.merge_summary([row("a", None, None)], str(tmp_path))
  assert set(read("summary.json")) == {"c"} and set(read("measured.json")) == {"a", "b"}
  assert all(isinstance(e["met"], bool) for e in read("summary.json").values())
  real = json.loads((ROOT / "experiments/results/summary.json").read_text())
  assert real and all(e["target"] is not None and isinstance(e["met"], bool) for e in real)
