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


@pytest.mark.parametrize("n_dev,split,weights,qtype", [
    (2, "auto", "keep", "q4_k"), (3, "3,3,2", "dequantize", "f32")])
def test_split_load_puts_each_stage_only_on_its_device(n_dev, split, weights, qtype):
  """2 devices: Q4_K projections kept quantised, split auto, run against the unsplit model;
  3 devices: an f32 file, explicit counts, placement only (test_layer_split runs 3 stages)."""
  out = _check(n_dev, split, weights, qtype, run=n_dev == 2)
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


@pytest.mark.parametrize("qtype", ["q8_0", "q4_k", "q5_k", "q6_k"])
def test_device_pack_equals_layout_pack(qtype):
  """The loader repacks raw blocks on the device; the planes equal layout.pack's, bit for bit
  (a stacked, odd-sized tensor: 3 x 5 rows of 2 blocks)."""
  from pallas_kernels.quant import layout
  from strata_jax.gguf import device_pack
  shape = (3, 5, 2 * layout.BLOCK[qtype])
  raw = np.random.default_rng(7).integers(0, 256, layout.file_nbytes(qtype, shape), np.uint8)
  want = layout.pack(raw.reshape(3, 5, -1), qtype, shape)
  got = device_pack.pack(jax.device_put(raw), qtype, shape)
  assert got.shape == want.shape and got.qtype == want.qtype
  for name, plane in want.planes.items():
    g = np.asarray(getattr(got, name))
    assert g.dtype == plane.dtype and g.shape == plane.shape, name
    np.testing.assert_array_equal(g.view(np.uint8), plane.view(np.uint8), err_msg=name)


def test_memmap_pages_released_after_each_tensor(tiny_file):
  """The loader drops each tensor's pages from the process's mapping once read."""
  r = reader_lib.open_gguf(tiny_file[0])
  mm = getattr(r.data, "_mmap", None)
  assert mm is not None and hasattr(mm, "madvise")
  reader_lib._release(r, r.tensors[-1])  # no error on a real mapping


def test_stack_in_place_is_the_stack_of_its_parts_bit_for_bit():
  """Plain parts give `jnp.stack`'s array; quantised parts of one type `qlayout.stack`'s
  QTensor; of two types (Q4_K and Q6_K interleaved, as a Q4_K_M mix has them) a QGroups with
  each type's stack, group and position as the layer order says."""
  import jax.numpy as jnp
  from quant_fixtures import random_raw

  from pallas_kernels.quant import layout as qlayout
  from strata_jax.params import QGroups
  rng = np.random.default_rng(0)
  plain = [jnp.asarray(rng.standard_normal((3, 5)), jnp.bfloat16) for _ in range(4)]
  stack = reader_lib.StackInPlace(4)
  for x in plain:
    stack.add(x)
  got = stack.result()
  assert got.dtype == jnp.bfloat16 and np.array_equal(np.asarray(got), np.asarray(jnp.stack(plain)))
  shape = (8, 256)
  keys = ["q4_k", "q6_k", "q4_k", "q4_k", "q6_k"]
  parts = [jax.device_put(qlayout.pack(random_raw(k, shape, seed=i), k, shape))
           for i, k in enumerate(keys)]
  stack = reader_lib.StackInPlace(len(parts), keys)
  for p in parts:
    stack.add(p)
  got = stack.result()
  assert isinstance(got, QGroups) and got.group == (0, 1, 0, 0, 1) and got.pos == (0, 0, 1, 2, 1)
  for g, k in enumerate(("q4_k", "q6_k")):
    want = qlayout.stack([p for p, key in zip(parts, keys) if key == k])
    assert got.parts[g].shape == want.shape and got.parts[g].qtype == k
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)),
                                     got.parts[g], want))
  one = reader_lib.StackInPlace(2, ["q4_k", "q4_k"])
  one.add(parts[0])
  with pytest.raises(ValueError, match="1 of 2 parts"):
    one.result()
  one.add(parts[2])
  assert one.result().shape == (2, *shape)


def test_stack_in_place_holds_the_stack_and_one_part_not_every_part():
  """While a leaf is stacked, the device holds its [n, ...] buffer and the part being written:
  each part is donated into the buffer and dropped (run 85: stacking the 80B's 6 GiB leaf from
  all its parts ran an 80 GB H100 out of memory)."""
  import jax.numpy as jnp
  n, shape = 6, (256, 1024)
  part_bytes = 256 * 1024 * 4
  base = sum(a.nbytes for a in jax.live_arrays())
  stack = reader_lib.StackInPlace(n)
  peak = 0
  for i in range(n):
    stack.add(jnp.full(shape, float(i), jnp.float32))   # the caller keeps no reference
    peak = max(peak, sum(a.nbytes for a in jax.live_arrays()) - base)
  assert peak <= (n + 1) * part_bytes, peak / part_bytes
  got = stack.result()
  assert [float(got[i, 0, 0]) for i in range(n)] == [float(i) for i in range(n)]


def test_a_gpu_refusal_names_the_allocators_share_and_how_to_raise_it(tiny_file, monkeypatch):
  """On a GPU the refusal says JAX's allocator stops at a share of the card (its limit, where
  the device reports one) and how to give it more; elsewhere nothing."""
  import types
  path, _ = tiny_file
  gpu = types.SimpleNamespace(platform="gpu", id=0,
                              memory_stats=lambda: {"bytes_limit": 60 * 2**30})
  monkeypatch.setattr(plan_lib, "free_bytes", lambda dev: float(1 << 20))
  monkeypatch.setattr(reader_lib, "_device", lambda dev: gpu)
  with pytest.raises(DeviceMemoryError) as e:
    sj.load_model(path, progress=False)
  msg = str(e.value)
  assert " GiB on gpu:0, 0.00 GiB free; JAX's allocator stops at 60.00 GiB, a share of this GPU" \
      in msg, msg
  assert "XLA_CLIENT_MEM_FRACTION=.95" in msg, msg
  no_stats = types.SimpleNamespace(platform="gpu", id=0, memory_stats=lambda: None)
  assert plan_lib.allocator_hint(no_stats).startswith("; JAX's allocator stops, a share")
  assert plan_lib.allocator_hint(jax.devices("cpu")[0]) == ""
