"""Cost of the LoRA delta inside a jitted L-layer lax.scan, Pallas tilings vs plain XLA.

Each layer computes base = x @ W^T (the projection the adapter rides on), then
y = lora(base, x, A, B, on), then feeds y back into x so layers depend on each other. The
per-layer cost of a variant is (t(program with it) - t(program without LoRA)) / L, with the
switch on for every row and, in the same compiled program, off for every row. Variants are
timed in interleaved rounds (median of all samples) so clock drift hits them alike.

  PYTHONPATH=. python experiments/bench/lora_kernel_probe.py --out results.json   # device
  PYTHONPATH=. python experiments/bench/lora_kernel_probe.py --smoke              # CPU check

Prints one JSON object, a result per line (and writes it, indented, to --out).
"""
import argparse
import functools
import json
import statistics
import sys
import time

import common
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.lora import lora_pallas, lora_xla, tiling

BF16 = jnp.bfloat16

# Pallas variants: name -> lora_pallas keyword arguments. The defaults (`tiling`) were
# chosen from the sweep of the others on an H200 (README, "Tiling").
PALLAS_VARIANTS = {
    "pallas_default": {},
    "pallas_s24_g20": dict(din_splits=24, dout_splits=20),
    "pallas_s8_g20": dict(din_splits=8, dout_splits=20),
    "pallas_s4_g20": dict(din_splits=4, dout_splits=20),
    "pallas_s8_g5": dict(din_splits=8, dout_splits=5),
    "pallas_fused_g20": dict(din_splits=1, dout_splits=20),
    "pallas_fused_g1": dict(din_splits=1, dout_splits=1),
}


def make_program(lora_fn, d_in, d_out):
  """Jitted L-layer scan; lora_fn(base, x, a, b, on) or None for the no-LoRA baseline."""

  def layer(x, p):
    w, a, b, on = p[0], p[1], p[2], p[3]
    base = lax.dot_general(x, w, (((1,), (1,)), ((), ())),
                           preferred_element_type=jnp.float32).astype(x.dtype)  # [N, Dout]
    y = base if lora_fn is None else lora_fn(base, x, a, b, on)
    fb = jnp.pad(y, ((0, 0), (0, max(0, d_in - d_out))))[:, :d_in]  # [N, Din]
    return x + (fb * 0.01).astype(x.dtype), None

  @jax.jit
  def program(x, w, a, b, on):
    on_l = jnp.broadcast_to(on, (w.shape[0], *on.shape))
    return lax.scan(layer, x, (w, a, b, on_l))[0]

  return program


def time_rounds(fns, args_by_name, rounds, iters):
  """Median wall time (s) of each fn over rounds x iters synchronous calls, interleaved."""
  samples = {k: [] for k in fns}
  for _ in range(rounds):
    for k, f in fns.items():
      a = args_by_name[k]
      for _ in range(iters):
        t0 = time.perf_counter()
        f(*a).block_until_ready()
        samples[k].append(time.perf_counter() - t0)
  return {k: statistics.median(v) for k, v in samples.items()}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--layers", type=int, default=48)
  ap.add_argument("--din", type=int, default=6144)
  ap.add_argument("--dout", type=int, default=2560)
  ap.add_argument("--rank", type=int, default=50)
  ap.add_argument("--tokens", default="1,8,300")  # 4096: a long prefill chunk
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--variants", default=",".join(PALLAS_VARIANTS))
  ap.add_argument("--smoke", action="store_true", help="tiny CPU run, interpret mode")
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  interpret = args.smoke
  if args.smoke:
    args.layers, args.din, args.dout, args.rank, args.tokens = 3, 96, 80, 50, "1,8"
    args.rounds, args.iters = 1, 2

  L, d_in, d_out, r = args.layers, args.din, args.dout, args.rank
  key = jax.random.key(0)
  kw, ka, kb, kx = jax.random.split(key, 4)
  w = (jax.random.normal(kw, (L, d_out, d_in), jnp.float32) / np.sqrt(d_in)).astype(BF16)
  a = (jax.random.normal(ka, (L, r, d_in), jnp.float32) / np.sqrt(d_in)).astype(BF16)
  b = (jax.random.normal(kb, (L, d_out, r), jnp.float32) / np.sqrt(r)).astype(BF16)

  impls = {"none": None, "xla": lora_xla}
  for name in args.variants.split(","):
    if name:
      impls[name] = functools.partial(lora_pallas, interpret=interpret, **PALLAS_VARIANTS[name])

  report = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind),
            "backend": jax.default_backend(), "layers": L, "din": d_in, "dout": d_out,
            "rank": r, "dtype": "bfloat16", "rounds": args.rounds, "iters": args.iters,
            "results": []}
  for n in [int(t) for t in args.tokens.split(",")]:
    x = jax.random.normal(jax.random.fold_in(kx, n), (n, d_in), jnp.float32).astype(BF16)
    on_all, on_none = jnp.ones((n,), jnp.int32), jnp.zeros((n,), jnp.int32)
    progs, compile_s, errors = {}, {}, {}
    for name, fn in impls.items():
      try:
        t0 = time.perf_counter()
        prog = make_program(fn, d_in, d_out).lower(x, w, a, b, on_all).compile()
        compile_s[name] = time.perf_counter() - t0
        prog(x, w, a, b, on_all).block_until_ready()
        progs[name] = prog
      except Exception as e:  # noqa: BLE001 - a failing variant is reported, not fatal
        errors[name] = f"{type(e).__name__}: {str(e)[:600]}"
    ref = progs["xla"](x, w, a, b, on_all).astype(jnp.float32) if "xla" in progs else None
    fns, fargs = {}, {}
    for name, prog in progs.items():
      fns[name + ":on"], fargs[name + ":on"] = prog, (x, w, a, b, on_all)
      if name != "none":
        fns[name + ":off"], fargs[name + ":off"] = prog, (x, w, a, b, on_none)
    med = time_rounds(fns, fargs, args.rounds, args.iters)
    t_none = med.get("none:on")
    for name in impls:
      row = {"n": n, "variant": name}
      if name in errors:
        row["error"] = errors[name]
      elif name in progs:
        row["program_ms_on"] = round(med[name + ":on"] * 1e3, 4)
        row["compile_s"] = round(compile_s[name], 2)
        row["hlo"] = common.hlo_counts(progs[name].as_text())
        if name != "none":
          row["program_ms_off"] = round(med[name + ":off"] * 1e3, 4)
          row["us_per_layer_on"] = round((med[name + ":on"] - t_none) / L * 1e6, 2)
          row["us_per_layer_off"] = round((med[name + ":off"] - t_none) / L * 1e6, 2)
          # Whole 48-layer program, switch off vs no adapter at all: bit for bit.
          off = progs[name](x, w, a, b, on_none)
          row["off_equals_no_lora"] = bool(jnp.array_equal(off, progs["none"](x, w, a, b, on_all)))
          if ref is not None and name != "xla":
            got = progs[name](x, w, a, b, on_all).astype(jnp.float32)
            row["rel_diff_vs_xla"] = float(jnp.abs(got - ref).max() / jnp.abs(ref).max())
        else:
          row["us_per_layer_base_matmul"] = round(med["none:on"] / L * 1e6, 2)
        if name.startswith("pallas"):
          splits = {k: v for k, v in PALLAS_VARIANTS[name].items()
                    if k in ("din_splits", "dout_splits")}
          t = tiling(n, d_in, d_out, r, interpret=interpret, **splits)
          row["tiling"] = dict(block_rows=t.block_rows, block_in=t.block_in,
                               block_out=t.block_out, din_splits=t.din_splits,
                               dout_splits=t.dout_splits)
      report["results"].append(row)
      print(json.dumps(row), file=sys.stderr, flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(report, f, indent=1)
  # Stdout: the same JSON, one result per line, so a short log tail still holds all rows.
  head = {k: v for k, v in report.items() if k != "results"}
  print(json.dumps(head)[:-1] + ', "results": [')
  print(",\n".join(json.dumps(row) for row in report["results"]) + "]}")


if __name__ == "__main__":
  main()
