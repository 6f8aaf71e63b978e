"""summary.json and the figures, from the JSON files the benchmark scripts wrote.

Reads {bench_kernels,bench_model,peer_fla_gdn,peer_transformers}.json from the results folder
(experiments/results, or $STRATA_BENCH_RESULTS) and writes summary.json (one entry per target
of issue #7) plus decode.png, prefill.png, lora.png and gdn.png, each with the roofline its
figures are measured against (ceilings: the copy bandwidth and matmul rate measured in the
same run, bench_kernels.json; bench_model.json's rooflines are redrawn from them).
Runs on any machine with matplotlib (CPU is fine).

  python experiments/bench/report.py
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import common

COMMAND = "bash experiments/bench/run_all.sh"
WORST = "% (worst of batch 1/8/32)"


def _get(d, *path):
  for p in path:
    if d is None:
      return None
    d = d.get(p) if isinstance(d, dict) else None
  return d


def fla_row(fla, section, layout, **match):
  for r in (fla or {}).get(section, []):
    if r.get("layout") == layout and all(r.get(k) == v for k, v in match.items()) and "us" in r:
      return r
  return None


def summary(km, mm, fla, hf):
  dec = _get(mm, "decode") or {}
  batches = sorted(dec, key=int)

  def worst(key):
    vals = [dec[b].get(key) for b in batches if dec[b].get(key) is not None]
    return max(vals) if vals else None

  gdn = _get(km, "gdn") or {}
  ours_chunk = next((r for r in gdn.get("chunked", [])), None)
  fla_chunk = fla_row(fla, "chunked", "rep32", T=ours_chunk["T"]) if ours_chunk else None
  gdn_prefill = fla_chunk["us"] / ours_chunk["us"] if ours_chunk and fla_chunk else None
  ratios = []
  for r in gdn.get("decode", []):
    f = fla_row(fla, "decode", "rep32", B=r["B"])
    if f:
      ratios.append(f["us"] / r["us"])
  gdn_decode = min(ratios) if ratios else None
  ours_b1 = _get(dec, "1", "variants", "none", "tokens_per_s")
  hf_dec = _get(hf, "decode", "tokens_per_s")
  pf = _get(mm, "prefill") or {}
  T = max(pf, key=int) if pf else None
  ours_pf = _get(pf, T, "variants", "none", "tokens_per_s") if T else None
  hf_pf = _get(hf, "prefill", "tokens_per_s")
  div = lambda a, b: a / b if a is not None and b else None

  rows = [
      ("lora_on_decode_slowdown", worst("lora_on_slowdown_pct"), 1.0, WORST, "le"),
      ("lora_off_decode_slowdown", worst("lora_off_slowdown_pct"), 0.3, WORST, "le"),
      ("lora_us_per_layer_1tok", _get(dec, "1", "lora_on_us_per_layer"), 1.5, "us/layer", "le"),
      ("lora_us_per_layer_8tok", _get(dec, "8", "lora_on_us_per_layer"), 3.0, "us/layer", "le"),
      ("decode_b1_roofline_fraction", _get(dec, "1", "roofline_fraction"), 0.6,
       "fraction of the weight-read roofline", "ge"),
      # issue 17: batch 8 and 32 at half the roofline, prefill too
      ("decode_b8_roofline_fraction", _get(dec, "8", "roofline_fraction"), 0.5,
       "fraction of the weight-read roofline", "ge"),
      ("decode_b32_roofline_fraction", _get(dec, "32", "roofline_fraction"), 0.5,
       "fraction of the weight-read roofline", "ge"),
      ("prefill_roofline_fraction", _get(pf, T, "roofline_fraction") if T else None, 0.5,
       f"fraction of the prefill roofline ({T} tokens)", "ge"),
      ("gdn_prefill_vs_fla", gdn_prefill, 1.0, "x fla speed (fla time / ours), T=2500", "ge"),
      ("gdn_decode_vs_fla", gdn_decode, 1.0, "x fla speed (worst of batch 1/8/32)", "ge"),
      # issue #7: batch-1 decode >= 350 tok/s is "29x transformers"
      ("decode_vs_transformers", div(ours_b1, hf_dec), 29.0,
       "x transformers+fla tokens/s, batch 1", "ge"),
      ("prefill_vs_transformers", div(ours_pf, hf_pf), 2.0,
       "x transformers+fla tokens/s, 2500 tokens", "ge"),
  ]
  out = []
  for name, m, target, unit, sense in rows:
    met = m is not None and (m <= target if sense == "le" else m >= target)
    out.append({"name": name, "measured": None if m is None else round(float(m), 4),
                "target": target, "unit": unit, "met": bool(met), "command": COMMAND})
  return out


def _save(fig, outdir, name):
  """Lay out, write and close `fig`; returns its path."""
  import matplotlib.pyplot as plt
  fig.tight_layout()
  path = os.path.join(outdir, name)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def plots(km, mm, fla, hf, outdir):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  ceil = common.ceilings(km)
  ceil_txt = (f"ceilings: copy {ceil['bw'] / 1e12:.2f} TB/s, "
              f"bf16 matmul {ceil['flops'] / 1e12:.0f} TFLOP/s")
  colors = {"none": "#4c72b0", "off": "#55a868", "on": "#c44e52", "peer": "#8172b2",
            "fla_rep32": "#dd8452", "fla_gva16": "#937860"}
  written = []

  # --- decode ---
  dec = _get(mm, "decode") or {}
  if dec:
    fig, ax = plt.subplots(figsize=(8, 4.8))
    bs = sorted(dec, key=int)
    w = 0.25
    for i, b in enumerate(bs):
      for j, v in enumerate(("none", "off", "on")):
        t = _get(dec, b, "variants", v, "tokens_per_s")
        if t:
          ax.bar(i + (j - 1) * w, t, w, color=colors[v],
                 label=f"strata-jax, adapter {v}" if i == 0 else None)
          ax.text(i + (j - 1) * w, t, f"{t:.0f}", ha="center", va="bottom", fontsize=7)
      rw = dec[b].get("roofline_tokens_per_s_weights")
      rs = dec[b].get("roofline_tokens_per_s_with_state")
      ax.hlines(rw, i - 1.5 * w, i + 1.5 * w, colors="k",
                label="roofline: weights read once" if i == 0 else None)
      ax.hlines(rs, i - 1.5 * w, i + 1.5 * w, colors="k", linestyles="dashed",
                label="roofline: weights + recurrent state / K/V" if i == 0 else None)
    hf_t = _get(hf, "decode", "tokens_per_s")
    labels = [f"batch {b}" for b in bs]
    if hf_t:
      ax.bar(len(bs), hf_t, w, color=colors["peer"], label="transformers + fla (batch 1)")
      ax.text(len(bs), hf_t, f"{hf_t:.1f}", ha="center", va="bottom", fontsize=7)
      labels.append("transformers\nbatch 1")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_yscale("log")
    ax.set_ylabel("decode tokens/s (greedy, on-device loop)")
    ax.set_title(f"bench-a3b decode, H200  ({ceil_txt})", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(axis="y", alpha=0.3, which="both")
    written.append(_save(fig, outdir, "decode.png"))

  # --- prefill ---
  pf = _get(mm, "prefill") or {}
  if pf:
    T = max(pf, key=int)
    e = pf[T]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names, vals, cols = [], [], []
    for v in ("none", "off", "on"):
      t = _get(e, "variants", v, "tokens_per_s")
      if t:
        names.append(f"strata-jax\nadapter {v}")
        vals.append(t)
        cols.append(colors[v])
    hf_t = _get(hf, "prefill", "tokens_per_s")
    if hf_t:
      names.append("transformers\n+ fla")
      vals.append(hf_t)
      cols.append(colors["peer"])
    ax.bar(range(len(vals)), vals, color=cols)
    for i, t in enumerate(vals):
      ax.text(i, t, f"{t / 1e3:.1f}k", ha="center", va="bottom", fontsize=8)
    ax.axhline(e["roofline_tokens_per_s"], color="k",
               label=f"roofline {e['roofline_tokens_per_s'] / 1e3:.0f}k tok/s "
                     "(matmul FLOPs, top-10 experts)")
    if hf_t:
      ax.axhline(2 * hf_t, color="k", ls=":", label="target: 2x transformers + fla")
    ax.set_xticks(range(len(names)), names)
    ax.set_yscale("log")
    ax.set_ylabel(f"prefill tokens/s ({T}-token prompt)")
    ax.set_title(f"bench-a3b prefill, {T} tokens, H200  ({ceil_txt})", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3, which="both")
    written.append(_save(fig, outdir, "prefill.png"))

  # --- LoRA per layer ---
  alt = _get(mm, "flags", "lora_alt_impl") or ""
  keys = ["on", "off"] + ([f"on@{alt}", f"off@{alt}"] if alt else [])
  pts = []
  for n, src in (("1", _get(dec, "1")), ("8", _get(dec, "8"))):
    if src:
      pts.append((n, "decode", src))
  for n, e in (_get(mm, "lora_prefill") or {}).items():
    pts.append((n, "prefill", e))
  if pts:
    roof = _get(mm, "lora_roofline_us_per_layer") or {}
    impl = _get(mm, "lora_impl") or {}
    targets = {"1": 1.5, "8": 3.0}
    shades = {"on": colors["on"], "off": colors["off"], f"on@{alt}": "#e8a0a2",
              f"off@{alt}": "#a8d5b0"}
    fig, ax = plt.subplots(figsize=(8, 4.8))
    w = 0.8 / len(keys)
    for i, (n, _, src) in enumerate(pts):
      for j, k in enumerate(keys):
        val = src.get(f"lora_{k}_us_per_layer")
        if val is None:
          continue
        x = i + (j - (len(keys) - 1) / 2) * w
        lab = f"switch {k.split('@')[0]}, " + (f"impl {alt}" if "@" in k else "default impl")
        ax.bar(x, val, w, color=shades[k], label=lab if i == 0 else None)
        ax.text(x, val, f"{val:.2f}", ha="center", va="bottom" if val >= 0 else "top", fontsize=7)
      if n in roof:
        ax.hlines(roof[n], i - 0.4, i + 0.4, colors="k",
                  label="roofline: read A, B once" if i == 0 else None)
      if n in targets:
        ax.hlines(targets[n], i - 0.4, i + 0.4, colors="r", linestyles=":",
                  label="target" if i == 0 else None)
    ax.axhline(0, color="gray", lw=0.5)
    ax.set_xticks(range(len(pts)), [f"{n} token{'s' if n != '1' else ''} ({kind})\ndefault impl: "
                                    f"{impl.get(n, '?')}" for n, kind, _ in pts], fontsize=8)
    ax.set_ylabel("LoRA cost per layer (us), rank 50\n(program with adapter - without) / 48")
    ax.set_title(f"LoRA inside the jitted 48-layer program  ({ceil_txt})", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    written.append(_save(fig, outdir, "lora.png"))

  # --- GDN kernels ---
  gdn = _get(km, "gdn") or {}
  if gdn.get("chunked") or gdn.get("decode"):
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4.5), gridspec_kw={"width_ratios": [1, 2]})
    c = gdn.get("chunked", [None])[0]
    if c:
      names, vals, cols = ["strata-jax\n(api.chunked)"], [c["us"]], [colors["none"]]
      for lay in ("rep32", "gva16"):
        f = fla_row(fla, "chunked", lay, T=c["T"])
        if f:
          names.append(f"fla {lay}")
          vals.append(f["us"])
          cols.append(colors[f"fla_{lay}"])
      a1.bar(range(len(vals)), vals, color=cols)
      for i, t in enumerate(vals):
        a1.text(i, t, f"{t:.0f}", ha="center", va="bottom", fontsize=8)
      roof = max(c["flops"] / ceil["flops"], c["io_bytes"] / ceil["bw"]) * 1e6
      a1.axhline(roof, color="k", label=f"roofline {roof:.0f} us")
      a1.set_xticks(range(len(names)), names, fontsize=8)
      a1.set_yscale("log")
      a1.set_ylabel("us per call")
      a1.set_title(f"chunked prefill, T={c['T']}, 32 heads", fontsize=9)
      a1.legend(fontsize=7)
    ds = gdn.get("decode", [])
    if ds:
      w = 0.27
      for i, r in enumerate(ds):
        entries = [("strata-jax (api.step)", r["us"], colors["none"])]
        for lay in ("rep32", "gva16"):
          f = fla_row(fla, "decode", lay, B=r["B"])
          if f:
            entries.append((f"fla {lay}", f["us"], colors[f"fla_{lay}"]))
        for j, (lab, val, col) in enumerate(entries):
          x = i + (j - 1) * w
          a2.bar(x, val, w, color=col, label=lab if i == 0 else None)
          a2.text(x, val, f"{val:.1f}", ha="center", va="bottom", fontsize=7)
        roof = r["state_rw_bytes"] / ceil["bw"] * 1e6
        a2.hlines(roof, i - 1.5 * w, i + 1.5 * w, colors="k",
                  label="roofline: state read + write" if i == 0 else None)
      a2.set_xticks(range(len(ds)), [f"batch {r['B']}" for r in ds])
      a2.set_yscale("log")
      a2.set_ylabel("us per decode step (one layer)")
      a2.set_title("recurrent decode, one token, 32 heads", fontsize=9)
      a2.legend(fontsize=7)
    fig.suptitle(f"Gated DeltaNet kernels vs fla, same run  ({ceil_txt})", fontsize=9)
    written.append(_save(fig, outdir, "gdn.png"))
  return written


def recompute_rooflines(mm, km):
  """Redraw bench_model's rooflines from bench_kernels' ceilings (a no-op when both come from
  one run_all; needed when the two files come from different runs)."""
  if not mm or not km or "copy_TBps" not in (km.get("phys") or {}):
    return False
  ceil = common.ceilings(km)
  for b, e in (mm.get("decode") or {}).items():
    byt, none = e.get("step_bytes"), _get(e, "variants", "none")
    if not byt:
      continue
    e["roofline_tokens_per_s_weights"] = int(b) / (byt["weights"] / ceil["bw"])
    e["roofline_tokens_per_s_with_state"] = int(b) / (byt["total"] / ceil["bw"])
    if none:
      e["roofline_fraction"] = none["tokens_per_s"] / e["roofline_tokens_per_s_weights"]
      e["roofline_fraction_with_state"] = (none["tokens_per_s"]
                                           / e["roofline_tokens_per_s_with_state"])
  for sec in ("prefill", "lora_prefill"):
    for T, e in (mm.get(sec) or {}).items():
      if "flops" not in e:
        continue
      e["roofline_s"] = max(e["flops"]["total"] / ceil["flops"], e["weight_bytes"] / ceil["bw"])
      e["roofline_tokens_per_s"] = int(T) / e["roofline_s"]
      none = _get(e, "variants", "none")
      if none:
        e["roofline_fraction"] = none["tokens_per_s"] / e["roofline_tokens_per_s"]
  try:
    cfg = common.model_config(common.TINY if mm.get("tiny") else common.BENCH_A3B)
    ns = mm.get("lora_roofline_us_per_layer") or {}
    mm["lora_roofline_us_per_layer"] = {n: common.lora_roofline_us(cfg, int(n), ceil) for n in ns}
  except ImportError:  # strata_jax not on the path: keep the recorded figures
    pass
  mm["ceilings"] = dict(copy_TBps=ceil["bw"] / 1e12, matmul_TFLOPs=ceil["flops"] / 1e12,
                        source="bench_kernels.json (rooflines redrawn by report.py)")
  return True


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--results", default=common.RESULTS)
  args = ap.parse_args()
  rd = lambda n: common.read_json(os.path.join(args.results, n))
  km, mm = rd("bench_kernels.json"), rd("bench_model.json")
  fla, hf = rd("peer_fla_gdn.json"), rd("peer_transformers.json")
  if recompute_rooflines(mm, km):
    common.write_json(os.path.join(args.results, "bench_model.json"), mm)
  rows = summary(km, mm, fla, hf)
  common.merge_summary(rows, args.results)  # other benches' entries stay
  for r in rows:
    m = "-" if r["measured"] is None else f"{r['measured']:.4g}"
    met = "MET" if r["met"] else "missed"
    print(f"{r['name']:30s} {m:>10s}  target {r['target']:<5g} {met}  ({r['unit']})")
  try:
    for p in plots(km, mm, fla, hf, args.results):
      print("wrote", p)
  except ImportError as e:
    print("no plots:", e)


if __name__ == "__main__":
  main()
