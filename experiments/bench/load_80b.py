"""Load a (synthetic) Qwen3-Next-80B-A3B GGUF through the engine path and measure it.

  python experiments/bench/load_80b.py --gguf /tmp/a80b-q4km.gguf
  python experiments/bench/load_80b.py --smoke         # CPU, tiny geometry (made here)

Measures: load seconds (`load_model`, from a warm page cache: the file is read once first),
peak host memory during the load (resident anonymous + shmem pages, sampled every 20 ms: the
file's page cache and its mapped pages are not counted; `ru_maxrss`, which counts them, is
reported beside it), device bytes of the weights after the load against the file's tensor
bytes, and decode tokens/s of `Engine` at batch 1/8/32 with a random rank-16 adapter, switch on
and off. The batch-1 roofline fraction is (bytes the weights read per decoded token: every
non-expert weight, the top-k experts of each layer, one embedding row) / (seconds per token) /
the H200's copy bandwidth (experiments/bench/common.py COPY_TBPS).

Writes `--out` (default experiments/results/a80b.json): {"entries": [summary.json entries],
"details": {...}}. Entries: a80b_q4km_fits_one_h200, a80b_q4km_device_bytes_ratio,
a80b_host_peak_gib, a80b_load_s, a80b_q4km_decode_b1_roofline_fraction,
a80b_q4km_decode_tok_s_b{1,8,32} (beside the 164 tok/s anchor: the seed engine, IQ1_M, RTX 5090).
With --layer-split (2 GPUs, each capped below the file's size by
XLA_PYTHON_CLIENT_MEM_FRACTION): a80b_split_fits only (loads, decodes, and each device's bytes
in use after the load are within its stage's weight bytes + 10 %).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

ANCHOR_TOK_S = 164.0


class HostMemory:
  """Peak of RssAnon + RssShmem (/proc/self/status), sampled in a thread."""

  def __init__(self, every: float = 0.02):
    self.every, self.peak, self._stop = every, 0, threading.Event()

  @staticmethod
  def now() -> int:
    try:
      with open("/proc/self/status") as f:
        kv = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
      return 0
    kb = lambda k: int(kv.get(k, "0 kB").split()[0])
    return (kb("RssAnon") + kb("RssShmem")) * 1024

  def __enter__(self):
    self.peak = self.now()
    self._t = threading.Thread(target=self._run, daemon=True)
    self._t.start()
    return self

  def _run(self):
    while not self._stop.wait(self.every):
      self.peak = max(self.peak, self.now())

  def __exit__(self, *exc):
    self._stop.set()
    self._t.join()
    self.peak = max(self.peak, self.now())


def warm_page_cache(path: str, chunk: int = 64 << 20) -> float:
  """Read the file once (the load is then timed from a warm page cache)."""
  t0 = time.perf_counter()
  with open(path, "rb", buffering=0) as f:
    buf = bytearray(chunk)
    while f.readinto(buf):
      pass
  return time.perf_counter() - t0


def weight_bytes_per_token(model) -> float:
  """Bytes of weights one batch-1 decode step reads: every leaf except the expert stacks and
  the embedding, k/E of each expert stack, one embedding row."""
  import jax
  cfg = model.cfg
  stages = model.stage_params or [model.params]
  total = 0.0
  for p in stages:
    for path, leaf in jax.tree_util.tree_flatten_with_path(
        p, is_leaf=lambda x: hasattr(x, "qtype"))[0]:
      if leaf is None:
        continue
      name = jax.tree_util.keystr(path)
      nb = leaf.nbytes
      if "_exps" in name:
        nb *= cfg.n_experts_used / cfg.n_experts
      elif name.endswith("embed"):
        nb /= cfg.vocab_size
      total += nb
  return total


def params_device_bytes(model) -> dict:
  import jax
  out = {}
  for p in model.stage_params or [model.params]:
    for a in jax.tree.leaves(p):
      for d in a.devices():
        out[str(d)] = out.get(str(d), 0) + int(a.nbytes)
  return out


def random_lora(cfg, rank: int, dtype):
  import numpy as np

  from strata_jax.params import LoraParams, LoraSet
  rng = np.random.default_rng(1)
  mk = lambda *s: (0.02 * rng.standard_normal(s)).astype(np.float32)
  import jax.numpy as jnp
  D = cfg.d_model
  p = LoraParams(gdn_a=jnp.asarray(mk(cfg.n_gdn, rank, cfg.gdn_value_dim), dtype),
                 gdn_b=jnp.asarray(mk(cfg.n_gdn, D, rank), dtype),
                 attn_a=jnp.asarray(mk(cfg.n_attn, rank, cfg.attn_out_dim), dtype),
                 attn_b=jnp.asarray(mk(cfg.n_attn, D, rank), dtype))
  return LoraSet(params=p, files=(f"<random rank {rank}>",), ignored=(), rank_total=rank,
                 adapter_id=0x80B)


def decode_rates(engine, batch: int, n_tokens: int, prompt_len: int, lora: bool | None):
  """Aggregate decode tokens/s of `batch` concurrent requests (after one warm-up run)."""
  import numpy as np

  from strata_jax.engine.engine import Request
  V = engine.model.cfg.vocab_size
  rng = np.random.default_rng(batch)

  def reqs(n):
    return [Request(tokens=[int(t) for t in rng.integers(0, V, prompt_len)], max_tokens=n,
                    lora=lora, return_logits=False) for _ in range(batch)]

  # compile prefill and decode at this batch: the same token count, since the decode loop's
  # steps per dispatch follow it (run 2's warm-up of 3 tokens left the adapter-on run, the
  # first timed, compiling: 2.1 tok/s)
  engine.run(reqs(n_tokens))
  res = engine.run(reqs(n_tokens))
  per = [r.decode_tokens_per_s for r in res]
  return float(sum(per)), float(np.median(per))


def write_report(out_path, command, details, fits, layer_split):
  """summary.json entries from `details`, written with them to `out_path` (also after each
  batch: a run cut off by its time limit keeps what it measured). Returns the entries."""
  from common import COPY_TBPS
  def entry(name, measured, target, unit, met):
    return {"name": name, "measured": measured, "target": target, "unit": unit, "met": met,
            "command": command}

  if layer_split:
    held = details.get("device_bytes_in_use", {})
    stage = details.get("param_device_bytes", {})
    within = bool(stage) and all(held.get(d) is None or held[d] <= 1.1 * stage[d]
                                 for d in stage)
    details["split_within_stage_plus_10pct"] = within
    entries = [entry("a80b_split_fits", fits and within, True,
                     "loads + decodes split; each device <= its stage + 10%", fits and within)]
  else:
    entries = [entry("a80b_q4km_fits_one_h200", fits, True, "loads and generates", fits)]
  if "device_bytes_ratio" in details:
    r = details["device_bytes_ratio"]
    entries.append(entry("a80b_q4km_device_bytes_ratio", round(r, 4), 1.1,
                         "device weight bytes / file tensor bytes", r <= 1.1))
  if "host_peak_bytes" in details:
    g = details["host_peak_bytes"] / 2**30
    entries.append(entry("a80b_host_peak_gib", round(g, 3), 8, "GiB (RssAnon+RssShmem peak)",
                         g <= 8))
  if "load_s" in details:
    entries.append(entry("a80b_load_s", round(details["load_s"], 2), 90, "s (warm page cache)",
                         details["load_s"] <= 90))
  dec = details.get("decode", {})
  for key, v in dec.items():
    b, sw = key.split("_")
    if sw != "off":
      target = ANCHOR_TOK_S if b == "b1" else None
      entries.append(entry(f"a80b_q4km_decode_tok_s_{b}", round(v["tok_s"], 2), target,
                           f"tok/s (batch {b[1:]}, adapter {sw}; anchor 164 at b1)",
                           (v["tok_s"] >= target) if target else None))
  b1 = dec.get("b1_on") or dec.get("b1_none")
  if b1:
    achieved = details["weight_bytes_per_token_b1"] * b1["tok_s"] / (COPY_TBPS * 1e12)
    details["b1_achieved_tbps"] = details["weight_bytes_per_token_b1"] * b1["tok_s"] / 1e12
    entries.append(entry("a80b_q4km_decode_b1_roofline_fraction", round(achieved, 4), 0.5,
                         f"fraction of {COPY_TBPS} TB/s (weight bytes per token / s)",
                         achieved >= 0.5))
  if layer_split:  # a split run answers only a80b_split_fits (the rest is in details)
    entries = entries[:1]
  os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
  with open(out_path, "w") as f:
    json.dump({"entries": entries, "details": details}, f, indent=1, default=str)
  return entries


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--gguf", help="the model GGUF (make_gguf.py)")
  ap.add_argument("--smoke", action="store_true",
                  help="CPU smoke test: make a tiny q4_k_m GGUF and run a short version")
  ap.add_argument("--weights", default="keep", choices=("keep", "dequantize"))
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--batches", default="1,8,32")
  ap.add_argument("--tokens", type=int, default=32, help="decoded tokens per request")
  ap.add_argument("--prompt", type=int, default=16, help="prompt tokens per request")
  ap.add_argument("--lora-rank", type=int, default=16, help="0: no adapter")
  ap.add_argument("--max-seq", type=int, default=256)
  ap.add_argument("--no-warm", action="store_true", help="skip reading the file first")
  ap.add_argument("--forms", default="", help="NAME=VALUE[,...] (strata_jax.forms), e.g. "
                  "quant_impl=xla")
  ap.add_argument("--layer-split", default=None,
                  help="auto | N1,N2: load split over the devices (writes a80b_split_fits)")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)

  if args.smoke:
    import make_gguf
    tmp = tempfile.mkdtemp(prefix="load80b-smoke-")
    args.gguf = os.path.join(tmp, "tiny-q4_k_m.gguf")
    make_gguf.write(args.gguf, "tiny", "q4_k_m", progress=False)
    args.batches, args.tokens, args.prompt, args.max_seq = "1", 3, 5, 32
    args.dtype = "float32"
    args.out = args.out or os.path.join(tmp, "a80b.json")
  if not args.gguf:
    ap.error("--gguf PATH (or --smoke)")
  out_path = args.out or os.path.join(HERE, "..", "results", "a80b.json")
  command = "python experiments/bench/load_80b.py " + " ".join(argv or sys.argv[1:])

  import jax

  import strata_jax as sj
  from strata_jax.forms import parse_forms
  details = {"gguf": args.gguf, "file_bytes": os.path.getsize(args.gguf),
             "weights": args.weights, "dtype": args.dtype, "device": str(jax.devices()[0]),
             "platform": jax.default_backend(), "forms": args.forms}
  details["warm_s"] = None if args.no_warm else warm_page_cache(args.gguf)
  fits, err = False, None
  try:
    with HostMemory() as mem:
      t0 = time.perf_counter()
      model = sj.load_model(args.gguf, dtype=args.dtype, weights=args.weights,
                            layer_split=args.layer_split, forms=parse_forms(args.forms))
      jax.block_until_ready(jax.tree.leaves(model.stage_params or model.params))
      details["load_s"] = time.perf_counter() - t0
    details["host_peak_bytes"] = mem.peak
    details["ru_maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    per_dev = params_device_bytes(model)
    details["param_device_bytes"] = per_dev
    details["file_tensor_bytes"] = model.file_bytes
    details["device_bytes_ratio"] = sum(per_dev.values()) / model.file_bytes
    details["layer_ranges"] = model.layer_ranges
    devices = model.devices or [jax.devices()[0]]
    details["device_bytes_in_use"] = {k: v.get("bytes_in_use") for k, v in
                                      device_memory(devices).items()}
    # the loader's high-water mark against the allocator's limit (run 85: an 80 GB H100 ran
    # out stacking a 6 GiB leaf; since then each leaf is written in place, a layer at a time)
    details["device_memory_after_load"] = device_memory(devices)
    bpt = weight_bytes_per_token(model)
    details["weight_bytes_per_token_b1"] = bpt
    lora = random_lora(model.cfg, args.lora_rank, model.dtype) if args.lora_rank else None
    details["decode"] = {}
    for b in (int(x) for x in args.batches.split(",")):
      # one engine per batch, with as many slots as requests (what a user serving b requests
      # configures): run 1 used one 32-slot engine, whose every step decodes all 32 slots
      engine = sj.Engine(model, lora=lora, slots=b, max_seq=args.max_seq, block_size=16,
                         prefix_cache_bytes=0)
      for sw in ([True, False] if lora is not None else [None]):
        agg, med = decode_rates(engine, b, args.tokens, args.prompt, sw)
        details["decode"][f"b{b}_{'on' if sw else 'off' if sw is False else 'none'}"] = {
            "tok_s": agg, "per_request_tok_s": med}
      del engine
      details["device_memory_after_decode"] = device_memory(devices)
      write_report(out_path, command, details, True, args.layer_split)
    fits = True
  except Exception as e:  # noqa: BLE001 (reported in the JSON, then re-raised)
    err = f"{type(e).__name__}: {e}"
    details["error"] = err
    details["traceback"] = traceback.format_exc()[-4000:]

  entries = write_report(out_path, command, details, fits, args.layer_split)
  print(json.dumps({"entries": entries, "details": {k: v for k, v in details.items()
                                                     if k != "traceback"}}, default=str))
  if err:
    print(details["traceback"], file=sys.stderr)
    return 1
  return 0


def device_memory(devices) -> dict:
  """{device: bytes_in_use, peak_bytes_in_use, bytes_limit} (None where a backend keeps no
  statistics, as the CPU)."""
  out = {}
  for d in devices:
    try:
      st = d.memory_stats() or {}
    except Exception:  # noqa: BLE001 (CPU: no stats)
      st = {}
    out[str(d)] = {k: st.get(k) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")}
  return out


if __name__ == "__main__":
  sys.exit(main())
