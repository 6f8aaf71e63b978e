"""Why a switched-off row can differ from the no-adapter program on the GPU (run 55: three GPU
tests failed so). The tests' tiny fp32 model, one decode row, `lora_branch="select"` (an off row
runs the adapter program), three steps. For each `proj_finish` form it compares, bit for bit:

  bare-bare   the no-adapter program against itself compiled afresh (caches cleared): does
              compiling twice give the same bits?
  bare-off    the no-adapter program against the adapter program with the switch off
  xla-kernel  the adapter-off logits under that form against proj_finish="xla"'s

and names the XLA GEMM fusions each program holds (`gemm_fusion` / `cublas` calls), since XLA
autotunes each program's GEMMs on its own. Run it with XLA_FLAGS=--xla_gpu_autotune_level=0
beside a plain run to see whether autotuning is what moves the bits.

  python experiments/bench/off_bits_probe.py --out off_bits.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "tests"))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="off_bits.json")
  ap.add_argument("--finish", default="gemv,kernel,xla")
  ap.add_argument("--gemv_lora", default="rows")
  args = ap.parse_args()
  import jax
  import jax.numpy as jnp
  import numpy as np
  from model_fixtures import TINY, random_lora, tiny_model

  from strata_jax import steps
  from strata_jax.forms import Forms
  from strata_jax.state import init_state

  model = tiny_model()
  lora = random_lora(rank=6).params
  kernels = "pallas" if jax.default_backend() == "gpu" else "pallas_interpret"

  def run(finish, adapter):
    jax.clear_caches()
    forms = Forms(dense_weights="kernel", quant_impl=kernels, lora_impl="xla",
                  lora_branch="select", gemv_lora=args.gemv_lora, proj_finish=finish)
    cfg = dataclasses.replace(TINY, forms=forms.resolve(jax.default_backend(), jnp.float32))
    state = init_state(cfg, 1, 64)
    step = jax.jit(steps.decode, static_argnums=0)
    tok0 = (cfg, model.params, adapter, state, jnp.asarray([5], jnp.int32),
            jnp.asarray([0], jnp.int32), jnp.ones(1, jnp.int32))
    hlo = step.lower(*tok0).compile().as_text()
    gemms = sorted(set(re.findall(r"(gemm_fusion[\w.]*|__cublas\w*|cublas\w*)", hlo)))
    logits = []
    for tok in (5, 9, 13):
      out, state = step(cfg, model.params, adapter, state, jnp.asarray([tok], jnp.int32),
                        jnp.asarray([0], jnp.int32), jnp.ones(1, jnp.int32))
      logits.append(np.asarray(out))
    return np.stack(logits), gemms

  res = dict(device=str(jax.devices()[0]), jax=jax.__version__,
             xla_flags=os.environ.get("XLA_FLAGS", ""), gemv_lora=args.gemv_lora, forms={})
  diff = lambda a, b: dict(equal=bool(np.array_equal(a, b)),
                           max_abs=float(np.abs(a - b).max()))
  offs = {}
  for finish in args.finish.split(","):
    bare, g_bare = run(finish, None)
    bare2, _ = run(finish, None)
    offs[finish], g_off = run(finish, lora)
    row = res["forms"][finish] = {"bare-bare": diff(bare, bare2),
                                  "bare-off": diff(bare, offs[finish]),
                                  "gemms_bare": g_bare, "gemms_off": g_off}
    print(finish, row, flush=True)
  if "xla" in offs:
    for finish, row in res["forms"].items():
      row["xla-kernel"] = diff(offs[finish], offs["xla"])
  print(json.dumps(res, indent=1))
  with open(args.out, "w") as f:
    json.dump(res, f, indent=1)


if __name__ == "__main__":
  main()
