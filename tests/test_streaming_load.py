"""Streaming, per-stage loading: each fake CPU device holds only its stage's weights after a
split load (no whole copy anywhere), the split model equals the unsplit one, and a load that
does not fit its device is refused (before placement, or when the device runs out) with
`DeviceMemoryError` naming the file, the device and the bytes."""
import json
import os
import pathlib
import subprocess
import sys

import gguf_fixtures as F
import jax
import numpy as np
import pytest

import strata_jax as sj
from strata_jax.errors import DeviceMemoryError, GGUFError
from strata_jax.gguf import names
from strata_jax.gguf import reader as reader_lib
from strata_jax.gguf.convert_hf import write_model_gguf
from strata_jax.parallel import plan as plan_lib
from strata_jax.params import init_params, params_to_flat

HERE = pathlib.Path(__file__).parent


def _check(n_dev, split, weights="dequantize", qtype="f32", run=True):
  env = dict(os.environ, PYTHONPATH=str(HERE.parent))
  proc = subprocess.run([sys.executable, str(HERE / "split_load_check.py"), str(n_dev), split,
                         weights, qtype] + ([] if run else ["norun"]),
                        capture_output=True, text=True, env=env, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("n_dev,split", [(2, "auto"), (3, "3,3,2")])
def test_split_load_puts_each_stage_only_on_its_device(n_dev, split):
  out = _check(n_dev, split, run=n_dev == 2)  # the 3-stage run is test_layer_split's
  assert len(out["ranges"]) == n_dev and len(set(out["stage_devices"])) == n_dev
  assert out["params_is_none"] and out["stage_leaves_on_own_device"]
  # What each device holds after the load is its stage's weights, nothing more (the tiny
  # model is a few MiB; a whole copy on any device would more than double it).
  assert out["held"] == out["stage_bytes"], out
  assert sum(out["stage_bytes"]) == out["whole_bytes"]
  assert max(out["held"]) < 0.75 * out["whole_bytes"], out
  if n_dev == 2:
    assert out["same_tokens"] and out["max_logit_err"] <= 1e-6, out
  if split == "auto":
    assert any("layer split (auto, from the file's tensor bytes" in m for m in out["logs"])


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
  cfg = F.tiny_cfg()
  flat = {k: np.asarray(v) for k, v in params_to_flat(init_params(cfg, seed=2)).items()}
  path = write_model_gguf(tmp_path_factory.mktemp("stream") / "m.gguf", cfg,
                          names.params_to_gguf_tensors(cfg, flat))
  return path, flat


def test_refused_before_placement_when_the_device_is_too_small(tiny_file, monkeypatch):
  path, _ = tiny_file
  monkeypatch.setattr(plan_lib, "free_bytes", lambda dev: float(1 << 20))
  placed = []
  monkeypatch.setattr(reader_lib.jax, "device_put", lambda *a, **k: placed.append(1))
  with pytest.raises(DeviceMemoryError) as e:
    sj.load_model(path, progress=False)
  msg = str(e.value)
  assert msg.startswith(f"{path} needs ") and " GiB on cpu:0, 0.00 GiB free" in msg, msg
  assert isinstance(e.value, GGUFError) and not placed


def test_out_of_memory_during_placement_is_reported(tiny_file, monkeypatch):
  path, _ = tiny_file
  real = jax.device_put
  calls = []

  def put(x, *a, **k):
    calls.append(1)
    if len(calls) > 3:
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to "
                                       "allocate 123 bytes")
    return real(x, *a, **k)

  monkeypatch.setattr(reader_lib.jax, "device_put", put)
  with pytest.raises(DeviceMemoryError,
                     match=r"needs \d+\.\d\d GiB on cpu:0, free memory unknown \(out of device"):
    sj.load_model(path, progress=False)


def test_one_stage_load_matches_params(tiny_file):
  path, flat = tiny_file
  m = sj.load_model(path, weights="dequantize", progress=False)
  assert m.stage_params is None and m.layer_ranges == [(0, 3)]
  for k, v in params_to_flat(m.params).items():
    np.testing.assert_array_equal(np.asarray(v), flat[k], err_msg=k)


def test_bad_weights_mode(tiny_file):
  path, _ = tiny_file
  with pytest.raises(GGUFError, match="weights='fast': expected one of keep, dequantize"):
    sj.load_model(path, weights="fast")


def test_cli_weights_flag_reaches_load_model(tmp_path):
  """--weights keep (default) / dequantize on generate and serve, passed to load_model."""
  from pallas_kernels.quant.layout import QTensor
  from strata_jax import loading
  from strata_jax.cli import build_parser

  cfg = F.tiny_cfg()
  flat = {k: np.asarray(v) for k, v in params_to_flat(init_params(cfg, seed=2)).items()}
  path = write_model_gguf(
      tmp_path / "q8.gguf", cfg, names.params_to_gguf_tensors(cfg, flat),
      tensor_type=lambda n, s: (F.T.Q8_0 if len(s) >= 2 and not names.keeps_f32(n, len(s))
                                and s[-1] % 32 == 0 else F.T.F32), encode=F.quantize)
  for cmd in ("generate", "serve"):
    extra = ["--prompt-tokens", "1"] if cmd == "generate" else []
    assert build_parser().parse_args([cmd, "--model", path, *extra]).weights == "keep"
    with pytest.raises(SystemExit):
      build_parser().parse_args([cmd, "--model", path, "--weights", "fast", *extra])
  for mode, kind in (("keep", QTensor), ("dequantize", jax.Array)):
    args = build_parser().parse_args(["generate", "--model", path, "--weights", mode,
                                      "--prompt-tokens", "1"])
    model, _ = loading.load_from_args(args)
    assert model.weights == mode and isinstance(model.params.layers.gdn.qkv, kind)
