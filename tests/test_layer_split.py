"""Layer split over 2 and 3 fake CPU devices (each in its own process: the device count must be
set before JAX starts)."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent


@pytest.mark.parametrize("n_dev", [2, 3])
def test_split_matches_single_device(n_dev):
  env = dict(os.environ, PYTHONPATH=str(HERE.parent))
  proc = subprocess.run([sys.executable, str(HERE / "split_check.py"), str(n_dev)],
                        capture_output=True, text=True, env=env, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert len(out["ranges"]) == n_dev and len(set(out["stage_devices"])) == n_dev
  assert out["same_tokens"]
  assert out["max_logit_err"] <= 1e-6 and out["max_prompt_logit_err"] <= 1e-6, out
  assert out["off_bit_identical"], "switch off must equal the no-adapter model under the split"
  assert out["mixed_rows_match"]
  assert out["programs_stable"], "compiled-program count grew with the switch"
  assert out["stage_params_on_device"]
  assert any(m.startswith("LoRA: 1 files, 8 layers adapted") for m in out["logs"]), out["logs"]
  if n_dev == 2:
    assert any("layers 0-3 (dev0), 4-7 (dev1)" in m for m in out["logs"]), out["logs"]
