"""Draws experiments/results/demo_training.png from demo_training.json (both training runs).

  python experiments/demo_model/plot.py
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "..", "results")


def _panel(ax, run: dict, train_label: str, title: str):
  tr = run.get("train", [])
  ax.plot([r["step"] for r in tr], [r["loss"] for r in tr], lw=1, alpha=0.7, label=train_label)
  val = run.get("val", [])
  for key, style in (("docs", "o-"), ("kjv", "s-")):
    if val and key in val[0]:
      name = "stdlib docs" if key == "docs" else "KJV"
      ax.plot([r["step"] for r in val], [r[key] for r in val], style, ms=3,
              label=f"val: {name}")
  ax.set_title(title)
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats/token)")
  ax.grid(alpha=0.3)
  ax.legend()


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--results", default=os.path.join(RESULTS, "demo_training.json"))
  args = ap.parse_args(argv)
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  with open(args.results) as f:
    res = json.load(f)
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  if "base" in res:
    b = res["base"]
    _panel(axes[0], b, "train (docs batches)",
           f"base: {b['params'] / 1e6:.2f}M params, {b['steps']} steps, "
           f"{b['minutes']:.0f} min on 1 CPU thread")
  if "lora" in res:
    lo = res["lora"]
    _panel(axes[1], lo, "train (KJV)",
           f"LoRA r={lo['config']['rank']} on o_proj+out_proj: {lo['params']:,} params, "
           f"{lo['steps']} steps, {lo['minutes']:.0f} min")
  fig.tight_layout()
  out = os.path.splitext(args.results)[0] + ".png"
  fig.savefig(out, dpi=120)
  print(f"wrote {out}")


if __name__ == "__main__":
  main(sys.argv[1:])
