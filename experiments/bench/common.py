"""Shared pieces of the benchmark scripts: the bench-a3b geometry, random weights made on the
device, timing, and the byte / FLOP counts the rooflines are computed from.

Kept free of torch so the JAX scripts import it; the torch peers import only the geometry
constants (plain Python).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# STRATA_BENCH_RESULTS redirects every script's output (run_all.sh --tiny uses a scratch folder,
# so the smoke test never overwrites the committed results).
RESULTS = os.path.abspath(os.environ.get("STRATA_BENCH_RESULTS")
                          or os.path.join(HERE, "..", "results"))
TMP = os.path.join(RESULTS, "tmp")   # inputs saved for cross-checks, HLO dumps (gitignored)

# bench-a3b (issue #7): 11.98 B params, ~7.0 GB of bf16 weights read per decoded token.
BENCH_A3B = dict(vocab_size=151936, d_model=2048, n_layers=48, attn_interval=4, n_head=16,
                 n_kv_head=2, head_dim=256, n_rot=64, rope_base=1e7, gdn_n_k_heads=16,
                 gdn_n_v_heads=32, gdn_d_k=128, gdn_d_v=128, conv_kernel=4, n_experts=64,
                 n_experts_used=10, d_ff_expert=512, d_ff_shared=512, rms_eps=1e-6)
# The same layer kinds at toy sizes, for the CPU smoke test of every script (--tiny).
TINY = dict(vocab_size=512, d_model=64, n_layers=8, attn_interval=4, n_head=4, n_kv_head=2,
            head_dim=16, n_rot=8, rope_base=1e4, gdn_n_k_heads=2, gdn_n_v_heads=4, gdn_d_k=16,
            gdn_d_v=16, conv_kernel=4, n_experts=8, n_experts_used=2, d_ff_expert=32,
            d_ff_shared=32, rms_eps=1e-6)
LORA_RANK = 50

# Fallback ceilings (shared/peers, 2026-11-29, one H200) when this run has not measured them.
COPY_TBPS = 4.13
MATMUL_TFLOPS = 690.0


def model_config(geom: dict):
  from strata_jax.config import ModelConfig, layer_pattern_from_interval
  g = dict(geom)
  pattern = layer_pattern_from_interval(g.pop("n_layers"), g.pop("attn_interval"))
  return ModelConfig(layer_types=pattern, context_length=32768, **g)


# ---------------------------------------------------------------------------------------------
# Random weights, made on the device (the host numpy init is far too slow for 12 B params).

def device_params(cfg, dtype, seed: int = 0, std: float = 0.02):
  """Params with init_params' recipe (norms ~1, a < 0, dt_bias, conv) drawn by jax.random on
  the default device in one jitted program; layer-stacked leaves are drawn one layer at a time
  (lax.map over keys), so no single draw exceeds 2^31 elements and the fp32 temporaries stay
  one layer big."""
  import jax
  import jax.numpy as jnp

  from strata_jax.params import leaf_dtype, param_shapes, params_from_flat

  def draw(kind, key, shape, dt):
    f32 = jnp.float32
    if kind == "norm":
      x = 1.0 + 0.1 * jax.random.normal(key, shape, f32)
    elif kind == "a":
      x = -jnp.exp(jax.random.uniform(key, shape, f32, -1.0, 1.0))
    elif kind == "dt_bias":
      x = jax.random.uniform(key, shape, f32, -0.5, 0.5)
    elif kind == "conv":
      x = 0.3 * jax.random.normal(key, shape, f32)
    else:
      x = std * jax.random.normal(key, shape, f32)
    return x.astype(dt)

  shapes = param_shapes(cfg)

  @jax.jit
  def make(root):
    flat = {}
    for i, (path, shape) in enumerate(shapes.items()):
      name = path.split(".")[-1]
      kind = ("norm" if name in ("attn_norm", "post_norm", "final_norm", "q_norm", "k_norm",
                                 "norm")
              else name if name in ("a", "dt_bias", "conv") else "w")
      dt = leaf_dtype(path, dtype)
      key = jax.random.fold_in(root, i)
      if path.startswith("layers.") and len(shape) >= 2:
        draw_layer = lambda k, kind=kind, s=shape[1:], dt=dt: draw(kind, k, s, dt)
        flat[path] = jax.lax.map(draw_layer, jax.random.split(key, shape[0]))
      else:
        flat[path] = draw(kind, key, shape, dt)
    return flat

  flat = make(jax.random.key(seed))
  params = params_from_flat(flat)
  jax.block_until_ready(params)
  return params


def device_lora(cfg, rank: int, dtype, seed: int = 1, std: float = 0.02):
  """A random rank-`rank` adapter on ssm_out and attn_output of every layer."""
  import jax

  from strata_jax.params import LoraParams
  k = jax.random.split(jax.random.key(seed), 4)
  D = cfg.d_model
  mk = lambda key, s: (std * jax.random.normal(key, s)).astype(dtype)
  lora = LoraParams(gdn_a=mk(k[0], (cfg.n_gdn, rank, cfg.gdn_value_dim)),
                    gdn_b=mk(k[1], (cfg.n_gdn, D, rank)),
                    attn_a=mk(k[2], (cfg.n_attn, rank, cfg.attn_out_dim)),
                    attn_b=mk(k[3], (cfg.n_attn, D, rank)))
  jax.block_until_ready(lora)
  return lora


def device_lora_set(cfg, rank: int, dtype, seed: int = 1):
  """`device_lora` as the LoraSet an Engine takes."""
  from strata_jax.params import LoraSet
  return LoraSet(params=device_lora(cfg, rank, dtype, seed=seed),
                 files=(f"<random rank {rank}>",), ignored=(), rank_total=rank,
                 adapter_id=0xBE7C)


def engine_lora(cfg, rank: int, dtype, rows: int = 2, seed: int = 1):
  """`device_lora` in the layout an Engine places (its `AdapterTable`): the rank zero-padded to
  a multiple of 64 and a per-row scale table [rows, R] (row 0 off, the others the adapter at
  scale 1), so a switch of 1 runs what an Engine's request with the adapter runs."""
  import jax

  from strata_jax.engine.adapters import AdapterTable
  table = AdapterTable(cfg, dtype, rows, adapters=[device_lora_set(cfg, rank, dtype, seed)])
  for row in range(1, rows):
    table.set_row(row, table.default_choice())
  lora = table.params()
  jax.block_until_ready(lora)
  return lora


def sample_inputs(B, kw, first):
  """decode_sample's inputs for B rows of one request's parameters `kw` (no length limit),
  starting from tokens `first` [B], as an Engine builds them: (rows, sampling params,
  switch, stop ids, plan), on the default device."""
  import jax
  import numpy as np

  from strata_jax.engine import sampling as hs
  from strata_jax.engine.engine import Request
  from strata_jax.sampling import Rows
  req = Request(tokens=[0], max_tokens=1 << 30, **kw)
  rp = hs.RowParams(B)
  for i in range(B):
    rp.set(i, req, 1)
  rows = Rows(last=np.asarray(first, np.int32), active=np.ones(B, np.int32),
              remaining=np.full(B, 1 << 30, np.int32), n_gen=np.zeros(B, np.int32),
              recent=np.full((B, hs.dev.RECENT), -1, np.int32))
  return (*jax.device_put((rows, rp.params(), rp.switch, rp.stops())), hs.plan_for([req]))


# ---------------------------------------------------------------------------------------------
# Byte and FLOP counts (bf16 weights unless itemsize says otherwise).

def weight_bytes(cfg, itemsize: int = 2) -> dict:
  """Bytes of each weight group: per layer kind, and the experts split out."""
  D, C, K = cfg.d_model, cfg.gdn_conv_dim, cfg.conv_kernel
  Hv, Dv, H, G, Hd = cfg.gdn_n_v_heads, cfg.gdn_d_v, cfg.n_head, cfg.n_kv_head, cfg.head_dim
  E, F, Fs = cfg.n_experts, cfg.d_ff_expert, cfg.d_ff_shared
  gdn = (C * D + Hv * Dv * D + 2 * Hv * D + D * Hv * Dv + Dv) * itemsize + (C * K + 2 * Hv) * 4
  attn = (2 * H * Hd * D + 2 * G * Hd * D + D * H * Hd + 2 * Hd) * itemsize
  dense_moe = (3 * Fs * D + 2 * D) * itemsize + (E * D + D) * 4   # shared expert, norms, router
  expert = 3 * F * D * itemsize                                    # one routed expert
  return dict(gdn_layer=gdn, attn_layer=attn, dense_moe_layer=dense_moe, expert=expert,
              lm_head=cfg.vocab_size * D * itemsize, embed_row=D * itemsize,
              final_norm=D * itemsize)


def expected_distinct_experts(cfg, n_tokens: int) -> float:
  """Expected experts touched by n tokens with uniform random top-k routing."""
  E, k = cfg.n_experts, cfg.n_experts_used
  return E * (1.0 - (1.0 - k / E) ** n_tokens)


def decode_step_bytes(cfg, batch: int, context: int, itemsize: int = 2) -> dict:
  """Fewest bytes one decode step must move: the weights it reads (experts: the expected
  union over the batch), and per row the recurrent state read + written and the K/V read."""
  w = weight_bytes(cfg, itemsize)
  L = cfg.n_layers
  weights = (cfg.n_gdn * w["gdn_layer"] + cfg.n_attn * w["attn_layer"] + L * w["dense_moe_layer"]
             + L * expected_distinct_experts(cfg, batch) * w["expert"] + w["lm_head"]
             + w["final_norm"] + batch * w["embed_row"])
  ssm = cfg.n_gdn * cfg.gdn_n_v_heads * cfg.gdn_d_v * cfg.gdn_d_k * 4
  conv = cfg.n_gdn * (cfg.conv_kernel - 1) * cfg.gdn_conv_dim * itemsize
  kv = cfg.n_attn * 2 * cfg.n_kv_head * cfg.head_dim * itemsize * (context + 1)
  state = batch * (2 * ssm + 2 * conv + kv)
  return dict(weights=weights, state=state, total=weights + state)


def gdn_chunk_flops(T: int, H: int, Dk: int, Dv: int, C: int = 64) -> float:
  """Matrix FLOPs of the chunked delta rule (WY/UT form) for one sequence of T tokens."""
  n = math.ceil(T / C)
  per_chunk = (2 * C * C * Dk            # k kᵀ
               + C * C * (Dk + Dv)       # unit lower-triangular solve, Dk + Dv right-hand sides
               + 2 * C * Dk * Dv         # w s0ᵀ
               + 2 * C * C * Dk          # q kᵀ
               + 2 * C * Dk * Dv         # q s0ᵀ
               + 2 * C * C * Dv          # (q kᵀ) u
               + 2 * C * Dk * Dv)        # state update uᵀ k
  return per_chunk * n * H


def prefill_flops(cfg, T: int) -> dict:
  """Matrix FLOPs of one T-token prefill with logits for the last token only."""
  D, C = cfg.d_model, cfg.gdn_conv_dim
  Hv, Dv, H, G, Hd = cfg.gdn_n_v_heads, cfg.gdn_d_v, cfg.n_head, cfg.n_kv_head, cfg.head_dim
  gdn_proj = 2 * T * D * (C + 2 * Hv * Dv + 2 * Hv)
  attn_proj = 2 * T * D * (2 * H * Hd + 2 * G * Hd + H * Hd)
  attn_core = 2 * 2 * H * Hd * T * (T + 1) / 2                    # causal QKᵀ and PV
  moe_routed = 2 * T * cfg.n_experts_used * 3 * cfg.d_ff_expert * D
  moe_dense = 2 * T * (3 * cfg.d_ff_shared * D + cfg.n_experts * D)
  gdn_core = gdn_chunk_flops(T, Hv, cfg.gdn_d_k, Dv)
  total = (cfg.n_gdn * (gdn_proj + gdn_core) + cfg.n_attn * (attn_proj + attn_core)
           + cfg.n_layers * (moe_routed + moe_dense) + 2 * D * cfg.vocab_size)
  return dict(total=total, moe_routed=cfg.n_layers * moe_routed,
              moe_all_experts=cfg.n_layers * moe_routed * cfg.n_experts / cfg.n_experts_used)


def lora_roofline_us(cfg, n_tokens: int, ceil: dict, rank: int = LORA_RANK) -> float:
  """Fewest-cost bound of a rank-`rank` adapter on one layer's mixer output projection:
  read A and B once, or do its FLOPs (whichever is slower); average over the layer kinds."""
  din = (cfg.n_gdn * cfg.gdn_value_dim + cfg.n_attn * cfg.attn_out_dim) / cfg.n_layers
  byt = rank * (din + cfg.d_model) * 2
  fl = 2 * n_tokens * rank * (din + cfg.d_model)
  return max(byt / ceil["bw"], fl / ceil["flops"]) * 1e6


def param_count(cfg) -> int:
  from strata_jax.params import param_shapes
  return sum(math.prod(s) for s in param_shapes(cfg).values())


def random_qtensor(key, qtype, lead, out, d_in):
  """A QTensor of random planes on the device (random bits; f16 scales in [1e-3, 1e-2])."""
  import jax
  import jax.numpy as jnp

  from pallas_kernels.quant.layout import PLANE_RATIO, PLANES, QTensor
  fields = {}
  for k, name in zip(jax.random.split(key, 8), PLANES[qtype]):
    shape = (*lead, out, int(d_in * PLANE_RATIO[qtype][name]))
    if name in ("d", "dmin"):
      fields[name] = jax.random.uniform(k, shape, jnp.float32, 1e-3, 1e-2).astype(jnp.float16)
    else:
      bits = jax.random.bits(k, shape, jnp.uint8)
      fields[name] = bits.view(jnp.int8) if (qtype, name) in (("q8_0", "qs"), ("q6_k", "sc")) \
          else bits
  return QTensor(**fields, qtype=qtype, shape=(*lead, out, d_in))


# ---------------------------------------------------------------------------------------------
# Timing and output.

def block(x):
  import jax
  return jax.block_until_ready(x)


def summarize(samples: list[float]) -> dict:
  s = sorted(samples)
  return dict(median=statistics.median(s), min=s[0], max=s[-1], n=len(s))


def now() -> float:
  return time.perf_counter()


def add_result(res: dict, rec: dict, path: str) -> None:
  """Append `rec` to res["results"], print it as a JSON line and rewrite `path`, so a run cut
  short keeps every measurement made so far."""
  res["results"].append(rec)
  print(json.dumps(rec), flush=True)
  write_json(os.path.abspath(path), res)


def median_call_s(call, reps: int) -> float:
  """Median wall seconds of `reps` calls of `call()`, each waited for."""
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    block(call())
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def read_json(path: str) -> dict | None:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def write_json(path: str, obj) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = path + ".part"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1, default=str)
  os.replace(tmp, path)


def merge_summary(entries: list[dict], results: str | None = None) -> str:
  """Put `entries` into summary.json (replacing entries of the same name, keeping the rest):
  each benchmark owns its names, and report.py's rows and later benches live side by side.
  summary.json is the contract's, one entry per target with `met` a bool; an entry with no
  target (a tok/s measured beside a ratio, one change's speed-up) goes to measured.json
  beside it, in the same fields. Returns summary.json's path."""
  d = results or RESULTS
  names = {e["name"] for e in entries}
  for name, keep in (("summary.json", lambda e: e.get("target") is not None),
                     ("measured.json", lambda e: e.get("target") is None)):
    path = os.path.join(d, name)
    rows = [r for r in (read_json(path) or []) if r.get("name") not in names]
    new = [e for e in entries if keep(e)]
    if new or rows or os.path.exists(path):
      write_json(path, rows + new)
  return os.path.join(d, "summary.json")


def ceilings(kernels_json: dict | None) -> dict:
  """Copy bandwidth (bytes/s) and bf16 matmul rate (FLOP/s) measured in this run, else the
  peers' figures."""
  bw, fl, src = COPY_TBPS * 1e12, MATMUL_TFLOPS * 1e12, "fallback (shared/peers 2026-11-29)"
  if kernels_json and "phys" in kernels_json and "copy_TBps" in kernels_json["phys"]:
    bw = kernels_json["phys"]["copy_TBps"] * 1e12
    fl = kernels_json["phys"]["matmul_TFLOPs"] * 1e12
    src = "measured in this run (bench_kernels.py)"
  return dict(bw=bw, flops=fl, source=src)


def profile_call(call, n_steps: int = 1, top: int = 60, window_us=None) -> dict:
  """Trace `call()` (jax.profiler, perfetto) and summarise the GPU side per step: kernels by
  name (time, count), busy time (the union of kernel intervals, all streams), the span from
  the first kernel's start to the last one's end, and the longest idle gaps inside that span
  (host waits, syncs, copies not on a traced stream). A slower program shows in `top`; a host
  that keeps the device waiting shows in `idle_us` and `gaps`. `window_us` (a callable, asked
  after the call): only the kernels that start in the span's last that-many µs count (an
  engine run's decode, after its prefills)."""
  import collections
  import glob
  import gzip
  import tempfile

  import jax
  d = tempfile.mkdtemp()
  with jax.profiler.trace(d, create_perfetto_trace=True):
    jax.block_until_ready(call())
  path = glob.glob(os.path.join(d, "**", "*perfetto_trace.json.gz"), recursive=True)
  if not path:
    return dict(error="no perfetto trace written")
  ev = json.load(gzip.open(path[0]))
  ev = ev.get("traceEvents", ev) if isinstance(ev, dict) else ev
  pname = {e["pid"]: e["args"]["name"] for e in ev
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  by = collections.defaultdict(lambda: [0.0, 0])
  spans = []
  for e in ev:
    if e.get("ph") != "X" or "gpu" not in pname.get(e.get("pid"), "?").lower():
      continue
    spans.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)),
                   e.get("name", "?")[:120]))
  if not spans:
    return dict(error="no GPU events in the trace")
  spans.sort()
  if window_us is not None and window_us() is not None:
    end = max(s1 for _, s1, _ in spans)
    spans = [sp for sp in spans if sp[0] >= end - window_us()]
  for s0, s1, name in spans:
    b = by[name]
    b[0] += s1 - s0
    b[1] += 1
  spans = [sp[:2] for sp in spans]
  busy, gaps, (cur_s, cur_e) = 0.0, [], spans[0]
  for s0, e0 in spans[1:]:
    if s0 > cur_e:
      busy += cur_e - cur_s
      gaps.append((s0 - cur_e, cur_e - spans[0][0]))
      cur_s, cur_e = s0, e0
    else:
      cur_e = max(cur_e, e0)
  busy += cur_e - cur_s
  span = cur_e - spans[0][0]
  gaps.sort(reverse=True)
  return dict(steps=n_steps, span_us=span, busy_us=busy, idle_us=span - busy,
              kernels_per_step=sum(c for _, c in by.values()) / n_steps,
              busy_us_per_step=busy / n_steps,
              gaps=[dict(us=g, at_us=a) for g, a in gaps[:12]],
              top=[dict(name=n, us_per_step=t / n_steps, count_per_step=c / n_steps)
                   for n, (t, c) in sorted(by.items(), key=lambda kv: -kv[1][0])[:top]])


def hlo_counts(text: str) -> dict:
  """Launch-relevant op counts in an optimized HLO text (custom calls are the Pallas kernels
  and cuBLAS; conditionals the LoRA branch)."""
  return {k: text.count(k) for k in ("fusion(", "custom-call(", "copy(", "while(", "gather(",
                                     "dynamic-slice(", "conditional(", "command_buffer", "concatenate(",
                                     "__triton")}
