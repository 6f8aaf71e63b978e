"""Run in its own process (fake CPU devices must be set before JAX starts):
python tests/split_load_check.py N_DEVICES SPLIT WEIGHTS QTYPE [norun] -> one JSON line.

Writes a tiny GGUF (projections in QTYPE where rows allow, else f32), loads it with
`layer_split=SPLIT` over N fake CPU devices, and reports, per device, the bytes of the live
arrays after the load (before anything else is loaded) against each stage's planned bytes,
then the tokens and logits of the split model against the same file loaded unsplit."""
import json
import os
import sys

n_dev = int(sys.argv[1])
SPLIT, WEIGHTS, QTYPE = sys.argv[2], sys.argv[3], sys.argv[4]
RUN = len(sys.argv) < 6 or sys.argv[5] != "norun"   # norun: placement checks only
# appended: the test run's own flags (conftest) stay
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={n_dev}")
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(__file__))

import gc  # noqa: E402
import logging  # noqa: E402
import tempfile  # noqa: E402

import gguf  # noqa: E402
import gguf_fixtures as F  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

import strata_jax as sj  # noqa: E402
from strata_jax.engine.engine import Request  # noqa: E402
from strata_jax.gguf import names  # noqa: E402
from strata_jax.gguf.convert_hf import write_model_gguf  # noqa: E402
from strata_jax.params import init_params, params_to_flat  # noqa: E402

cache = os.environ.get("STRATA_TEST_JAX_CACHE", "/tmp/strata-jax-test-cache")
jax.config.update("jax_compilation_cache_dir", cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
logs = []
logging.getLogger("strata_jax").addHandler(type("H", (logging.Handler,), {
    "emit": lambda self, rec: logs.append(rec.getMessage())})())
logging.getLogger("strata_jax").setLevel(logging.INFO)

T = gguf.GGMLQuantizationType
cfg = F.tiny_cfg(layer_types="GGGAGGGA")
flat = {k: np.array(v, copy=True) for k, v in params_to_flat(init_params(cfg, seed=5)).items()}
gc.collect()  # no init array stays live (the per-device count below sees every live array)
tensors = names.params_to_gguf_tensors(cfg, flat)
qt = None if QTYPE == "f32" else T[QTYPE.upper()]


def tensor_type(name, shape):
  ok = (qt is not None and len(shape) >= 2 and not names.keeps_f32(name, len(shape))
        and shape[-1] % F.block_size(qt) == 0)
  return qt if ok else T.F32


path = write_model_gguf(os.path.join(tempfile.mkdtemp(), "m.gguf"), cfg, tensors,
                        tensor_type=tensor_type, encode=F.quantize)
split = SPLIT if SPLIT == "auto" else [int(c) for c in SPLIT.split(",")]
model = sj.load_model(path, layer_split=split, weights=WEIGHTS, progress=False)


def device_bytes():
  out = {}
  for a in jax.live_arrays():
    for shard in a.addressable_shards:
      out[str(shard.device)] = out.get(str(shard.device), 0) + int(shard.data.nbytes)
  return out


held = device_bytes()
stage_bytes = [sum(int(a.nbytes) for a in jax.tree.leaves(p)) for p in model.stage_params]
out = {"ranges": [list(r) for r in model.layer_ranges],
       "stage_devices": [str(d) for d in model.devices], "params_is_none": model.params is None,
       "held": [held.get(str(d), 0) for d in model.devices], "stage_bytes": stage_bytes,
       "stage_leaves_on_own_device": all(
           {d for a in jax.tree.leaves(p) for d in a.devices()} == {dev}
           for p, dev in zip(model.stage_params, model.devices))}
whole = sj.load_model(path, weights=WEIGHTS, progress=False)
out["whole_bytes"] = sum(int(a.nbytes) for a in jax.tree.leaves(whole.params))
if not RUN:
  print(json.dumps(out))
  sys.exit(0)
prompts = [list(np.random.default_rng(i).integers(0, cfg.vocab_size, 12 + 5 * i))
           for i in range(2)]


def run(m):
  eng = sj.Engine(m, slots=2, max_seq=64, block_size=16)
  return eng.run([Request(tokens=p, max_tokens=4, return_logits=True) for p in prompts])


a, b = run(whole), run(model)
out["same_tokens"] = all(x.tokens == y.tokens for x, y in zip(a, b))
out["max_logit_err"] = max(float(np.abs(x.step_logits - y.step_logits).max())
                           for x, y in zip(a, b))
out["logs"] = logs
print(json.dumps(out))
