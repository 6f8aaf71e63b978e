"""Converts the trained demo model and adapter to the GGUFs shipped as the package defaults.

  python experiments/demo_model/export.py [--outtype f16]

Writes `demo-base-<outtype>.gguf` and `demo-lora-<outtype>.gguf` into --out-dir with the
project's converters (`strata_jax.gguf.convert_hf` / `convert_peft`) and prints their sizes.
Copy them to `strata_jax/assets/demo-base.gguf` and `demo-lora.gguf` (the names `api.py`
loads by default) to ship them.
"""
from __future__ import annotations

import argparse
import os


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--base", default="/work/demo_build/base_hf")
  ap.add_argument("--lora", default="/work/demo_build/lora_peft")
  ap.add_argument("--out-dir", default="/work/demo_build")
  ap.add_argument("--outtype", default="f16", choices=["f32", "f16", "bf16"])
  args = ap.parse_args()
  from strata_jax.gguf.convert_hf import convert_hf
  from strata_jax.gguf.convert_peft import convert_peft

  base = convert_hf(args.base, os.path.join(args.out_dir, f"demo-base-{args.outtype}.gguf"),
                    args.outtype, name="strata-jax-demo-base")
  lora = convert_peft(args.lora, args.base,
                      os.path.join(args.out_dir, f"demo-lora-{args.outtype}.gguf"), args.outtype)
  total = 0
  for path in (base, lora):
    size = os.path.getsize(path)
    total += size
    print(f"{path}: {size / 2**20:.2f} MiB ({size:,} bytes)")
  print(f"together: {total / 2**20:.2f} MiB")


if __name__ == "__main__":
  main()
