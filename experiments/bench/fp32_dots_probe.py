"""Which lines of a float32 decode program, lowered for CUDA, ask for less than full fp32
dots? Runs on a CPU machine: `jax.export` lowers for `platforms=("cuda",)` with the GPU forms
(the GPU-only checks are bypassed for the lowering; nothing runs).

    python experiments/bench/fp32_dots_probe.py   # -> experiments/results/fp32_dots_probe.json

Why: on the H200, `tests/test_forms.py::test_float32_programs_ask_for_full_fp32_dots_unless_
tf32_is_named` failed once the decode attention kernel was in the fp32 program (run 31). The
test reads the program's text for "dot_general" lines without "HIGHEST"; a Pallas Triton
kernel is one custom-call line whose serialized IR carries its dots' names."""
import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax import export

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "..", "tests"), os.path.join(HERE, "..", "..")]
from model_fixtures import TINY, tiny_model  # noqa: E402

from strata_jax import steps  # noqa: E402
from strata_jax.forms import Forms  # noqa: E402
from strata_jax.params import empty_lora  # noqa: E402
from strata_jax.state import init_state  # noqa: E402


def lowered_lines(cfg, model):
  dis = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  f = jax.jit(lambda p, lo, s, t, q, a: steps.decode(cfg, p, lo, s, t, q, a))
  state = init_state(cfg, 2, 64)
  z = jnp.zeros(2, jnp.int32)
  with jax.default_matmul_precision("highest"):
    exp = export.export(f, platforms=("cuda",), disabled_checks=dis)(
        model.params, empty_lora(cfg), state, z, z, jnp.ones(2, jnp.int32))
  return [ln for ln in exp.mlir_module().splitlines()
          if "dot_general" in ln and not ln.strip().startswith("#loc")]


def main():
  model = tiny_model()
  # Lower as the GPU would: every GPU-only check passes (nothing is compiled or run here).
  jax.default_backend = lambda: "gpu"
  for mod in list(sys.modules.values()):
    name = getattr(mod, "__name__", "") or ""
    if name.startswith(("pallas_kernels", "strata_jax")):
      if hasattr(mod, "require_gpu"):
        mod.require_gpu = lambda *a, **k: None
      if hasattr(mod, "on_gpu"):
        mod.on_gpu = lambda: True
  out = {}
  for attn in ("pallas", "xla"):
    forms = dataclasses.replace(Forms().resolve("gpu", jnp.float32), attn_decode=attn)
    lines = lowered_lines(dataclasses.replace(TINY, forms=forms), model)
    bad = [ln for ln in lines if "HIGHEST" not in ln]
    out[f"attn_decode={attn}"] = dict(
        dot_lines=len(lines), without_highest=len(bad),
        without_highest_custom_calls=sum("custom_call" in ln for ln in bad),
        without_highest_xla_dots=[ln.strip()[:160] for ln in bad if "custom_call" not in ln])
    print(attn, out[f"attn_decode={attn}"])
  path = os.path.join(HERE, "..", "results", "fp32_dots_probe.json")
  with open(path, "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
