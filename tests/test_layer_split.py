"""Layer split over 2 and 3 fake CPU devices (each in its own process: the device count must be
set before JAX starts)."""
import json
import os
import pathlib
import socket
import subprocess
import sys

HERE = pathlib.Path(__file__).parent


def test_split_on_three_devices_matches_single_device():
  """Three stages (first, middle, last), speculative decoding and the one-pass prefill on them
  included. Two stages run in `test_split_across_two_processes` (the same checks but those
  two, a process each) and on two devices through the CLI (test_cli.py)."""
  n_dev = 3
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
  # one-pass prefill (`bucket_step`): every stage hands back its states from inside the chunk
  assert out["one_pass_schedule"] == [[0, 100, 128, [[32, 32], [64, 32], [96, 32]]]]
  assert out["one_pass_same"], "a split engine's one-pass prefill must decode as one device's"
  assert any(m.startswith("LoRA: 1 files, 8 layers adapted") for m in out["logs"]), out["logs"]
  assert any("layers 0-2 (dev0), 3-4 (dev1), 5-7 (dev2)" in m for m in out["logs"]), out["logs"]
  # speculative decoding over the three stages: lossless, and every stage's state as decoding
  # the accepted tokens one by one leaves it (split_check.spec_checks)
  assert out["spec_split_same_tokens"] == {"mtp": True, "device_rule": True, "host_rule": True}
  assert out["spec_oracle_same_tokens"]
  acc = out["spec_oracle_acceptance"]
  assert acc[0] == 1.0 and 0.5 < acc[1] < 1.0 and acc[2] == 0.0, acc
  assert out["spec_oracle_states_match"] is True, out["spec_oracle_states_match"]


def _free_port_block(n=3):
  """A base port with `n` consecutive free ports (coordinator, then one transfer port each)."""
  for _ in range(50):
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      base = s.getsockname()[1]
    if base + n >= 65535:
      continue
    try:
      socks = []
      for p in range(base, base + n):
        s = socket.socket()
        socks.append(s)
        s.bind(("127.0.0.1", p))
    except OSError:
      continue
    finally:
      for s in socks:
        s.close()
    return base
  raise RuntimeError("no free port block")


def test_split_across_two_processes():
  """Two processes under jax.distributed (one CPU device each, gloo collectives, JAX's cross-
  host transfers): a stage on each process gives the tokens and logits of the unsplit model
  run in one process, with the switch on, off and mixed, and off still equals no adapter."""
  port = _free_port_block()
  env = dict(os.environ, PYTHONPATH=str(HERE.parent))
  procs = [subprocess.Popen([sys.executable, str(HERE / "split_check.py"), "mp", str(i), str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
           for i in range(2)]
  outs = []
  for p in procs:
    try:
      stdout, stderr = p.communicate(timeout=600)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
    assert p.returncode == 0, stderr[-3000:]
    outs.append(json.loads(stdout.strip().splitlines()[-1]))
  for out in outs:
    assert out["processes"] == 2 and out["stage_processes"] == [0, 1], out
    assert out["ranges"] == [[0, 4], [4, 8]]
    assert out["off_bit_identical"] and out["mixed_rows_match"] and out["programs_stable"]
    assert out["stage_params_on_device"]
    assert "several processes" in out["spec_refused"], out["spec_refused"]
  # process 0 ran the unsplit reference; its comparison holds for both (same split results)
  ref, other = outs
  assert ref["same_tokens"] and "same_tokens" not in other
  assert ref["max_logit_err"] <= 1e-6 and ref["max_prompt_logit_err"] <= 1e-6, ref
