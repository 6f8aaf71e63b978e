"""Where the quantised model's switch-off logits leave the adapter-free step program's
(`lora=None`) on the GPU (`tests/test_quant_model.py`'s
`test_keep_adapter_off_is_bit_identical_to_the_adapter_free_program`, a CPU promise since run
1 of this probe): the largest difference
per prefill position and decode step, for weights kept quantised and dequantised, under the
XLA_FLAGS this process was started with. One JSON line per weights mode."""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))

import jax  # noqa: E402
import test_quant_model as Q  # noqa: E402
from model_fixtures import random_lora  # noqa: E402

from strata_jax.gguf.reader import read_model_gguf  # noqa: E402
from strata_jax.params import pad_lora_rank  # noqa: E402


def main():
  path = Q._write(os.path.join(sys.argv[1] if len(sys.argv) > 1 else "/tmp", "q4k.gguf"),
                  Q.T.Q4_K)
  lora = pad_lora_rank(random_lora(Q.CFG, rank=4, scale=0.05).params, 64)
  for weights in ("keep", "dequantize"):
    mf = read_model_gguf(path, weights=weights)
    off, _ = Q._run(mf, lora, 0)
    none, _ = Q._run(mf, None, 0)
    diff = np.abs(off - none).max(axis=-1)
    print(json.dumps({"weights": weights, "backend": jax.default_backend(),
                      "xla_flags": os.environ.get("XLA_FLAGS", ""),
                      "bit_identical": bool(np.array_equal(off, none)),
                      "max_abs_per_row": [float(d) for d in diff]}), flush=True)


if __name__ == "__main__":
  main()
