"""The engine against the device programs (issue 16): bench-a3b through `Engine`, the server.

  python experiments/bench/bench_engine.py --out experiments/results/device/bench_engine.json \
      --merge-summary                      # H200, bench-a3b, < 5 min with compiles
  python experiments/bench/bench_engine.py --smoke --out /tmp/be.json    # CPU, toy sizes

Model: bench-a3b (common.BENCH_A3B), random bf16 weights made on the device, a random rank-50
adapter on every layer, switch on; a synthetic byte-level vocabulary (token i is " w<i>"), so
the server streams text and no token ends a generation early. Every request: a random
128-token prompt, 64 new tokens.

Keys (the issue's targets), written to `--out` as {"entries": [summary.json entries],
"details": {raw numbers}} with a plot beside it (same name, .png):
- engine_vs_program_b{1,8,32}_greedy (>= 0.95) / _sampled (>= 0.9, temperature 0.8, top_p
  0.95): `Engine(slots=B)` serving B requests at once, decode tokens/s = tokens after each
  row's first / (last token - the moment every row has its first token), over
  `steps.decode_greedy` (16 steps a call, 4 calls, the engine's padded adapter, switch on)
  tokens/s from the very prompt sets the engine served, each prefilled afresh by the engine's
  prefill program, decoding from the token the engine's greedy request starts from; same
  process, same batch, same K/V capacity. With random weights a token stream's expert
  routing moves a step's time by several % (before run 11 the program decoded other prompts
  from a state carried over between runs); `program_token_match` is the share of the
  engine's greedy tokens the program decoded too (1.0: the same work).
  `sample_program_*`: the engine's own decode program (`decode_sample`) timed the same way,
  the device-side price of on-device sampling.
- server_vs_engine_b32 (>= 0.85): `create_app` (what `strata-jax serve` runs) on the batch-32
  engine in this process, 32 concurrent streaming `/v1/completions` clients in another process;
  aggregate tokens/s (all completion tokens / first request sent to last answer read) over the
  engine's, measured the same way (`Engine.run` of 32 requests).
- engine_ttft_vs_prefill_2500 (<= 1.2): `Result.ttft_s` of a 2,500-token prompt (default
  engine: prefix cache on, chunks 2,048 + 452, the last full block's state handed back from
  inside the second chunk, `Engine(merge_tail=True)`; runs 11 and 12 also timed 2,048 + 448 +
  4) over one `steps.prefill` of the 2,500 tokens as one chunk.
Each figure is the median of --reps timed runs after one untimed run. Compiles: every program
is built before timing, the engines' `warmup` and the reference programs in threads; the
persistent compilation cache (STRATA_JAX_CACHE, as the CLI) makes a repeat run start fast.
`--merge-summary [PATH]` replaces these keys in PATH (default
experiments/results/summary.json, a list of entries) and keeps the others.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

DEFAULT_SUMMARY = os.path.join(ROOT, "experiments", "results", "summary.json")
TARGETS = {"greedy": 0.95, "sampled": 0.9, "server": 0.85, "ttft": 1.2}
SAMPLED = dict(temperature=0.8, top_p=0.95)


def _cache():
  """The CLI's persistent compilation cache (STRATA_JAX_CACHE; "0" disables)."""
  d = os.environ.get("STRATA_JAX_CACHE", os.path.expanduser("~/.cache/strata-jax/xla"))
  if d and d != "0":
    import jax
    jax.config.update("jax_compilation_cache_dir", d)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  return d


def synthetic_tokenizer(vocab: int):
  """Byte-level BPE over `vocab` pieces "Ġw<i>" (text " w<i>"), no merges, no end tokens."""
  from strata_jax.gguf.tokenizer import NORMAL, Tokenizer, _build_hf_tokenizer
  tokens = [f"\u0120w{i}" for i in range(vocab)]
  types = [NORMAL] * vocab
  return Tokenizer(_build_hf_tokenizer(tokens, types, [], "default"), tokens, types)


def bench_model(cfg, params, dtype, tiny: bool):
  """bench-a3b (or the tiny geometry) as an `sj.Model`: random device weights, a synthetic
  tokenizer, one stage."""
  import strata_jax as sj
  return sj.Model(cfg=cfg, params=params, dtype=dtype, path="<bench-a3b>",
                  fingerprint="bench-a3b" + ("-tiny" if tiny else ""),
                  tokenizer=synthetic_tokenizer(cfg.vocab_size),
                  layer_ranges=[(0, cfg.n_layers)])


def build(args):
  import dataclasses

  import common
  import jax
  import jax.numpy as jnp
  geom = common.TINY if args.smoke else common.BENCH_A3B
  dtype = jnp.float32 if args.smoke else jnp.bfloat16
  # The forms `load_model` gives users on this backend (Forms.resolve). Unresolved, "auto"
  # reads as "scan" to the layer scan: every Engine figure before run 34 ran the scanned
  # weights (their slices copied each step), not the in-place kernels users run.
  cfg = common.model_config(geom)
  cfg = dataclasses.replace(cfg, forms=cfg.forms.resolve(jax.default_backend(), dtype))
  t0 = time.perf_counter()
  model = bench_model(cfg, common.device_params(cfg, dtype), dtype, args.smoke)
  lora = common.device_lora_set(cfg, common.LORA_RANK, dtype)
  return model, lora, time.perf_counter() - t0


def _prompts(rng, n, length, vocab):
  return [[int(t) for t in rng.integers(0, vocab, length)] for _ in range(n)]


def engine_run(eng, prompts, new, kw, loras=None):
  """Serve `prompts` at once (request i under loras[i], default every adapter on);
  (decode tok/s, end-to-end tok/s, results)."""
  from strata_jax.engine.engine import Request
  first, last = {}, [0.0]

  def on_token(i):
    def f(_):
      now = time.perf_counter()
      first.setdefault(i, now)
      last[0] = now
    return f
  reqs = [Request(tokens=p, max_tokens=new, lora=True if loras is None else loras[i],
                  on_token=on_token(i), **kw) for i, p in enumerate(prompts)]
  t0 = time.perf_counter()
  res = eng.run(reqs)
  t1 = time.perf_counter()
  n_all = sum(len(r.tokens) for r in res)
  n_dec = n_all - len(res)
  start = max(first.values())
  return n_dec / (last[0] - start), n_all / (t1 - t0), res


def _host_phases(eng, run):
  """`run()`'s result, with the scheduling thread's time in each phase of the engine's rounds
  recorded in `eng.host_phases` ({phase: [calls, total ms, longest ms]}): where the host is
  when the profile shows the GPU idle between chunks."""
  names = ("step", "_start", "_dispatch", "_collect", "_store_copied", "_start_snapshot_copies",
           "_flush_snapshots", "_take_first_tokens")
  phases = {n: [0, 0.0, 0.0] for n in names}
  saved = {n: getattr(eng, n) for n in names}

  def timed(n, fn):
    def call(*a, **kw):
      t = time.perf_counter()
      try:
        return fn(*a, **kw)
      finally:
        ms = 1e3 * (time.perf_counter() - t)
        p = phases[n]
        p[0], p[1], p[2] = p[0] + 1, p[1] + ms, max(p[2], ms)
    return call
  for n in names:
    setattr(eng, n, timed(n, saved[n]))
  try:
    return run()
  finally:
    for n in names:
      delattr(eng, n)   # the instance attributes go; the class's methods are back
    eng.host_phases = {n: [c, round(t, 2), round(m, 2)] for n, (c, t, m) in phases.items()}


def _windowed(run, B, new, window):
  """engine_run's result; stores its decode window (µs: the time its decode rate divides by)."""
  rate = run[0]
  window[0] = B * (new - 1) / rate * 1e6
  return run[2][0].tokens


def prefilled_state(eng, prompts):
  """A [B]-row state (the engine's capacity) holding the B `prompts`, prefilled row by row with
  the engine's own prefill program, switch on; and each row's first token (the argmax after
  its prompt, the token the engine's greedy request decodes from). The decode references
  start from it: rows at real, distinct contexts route their tokens to different experts, as
  the engine's rows do (identical rows would all read the same 10 experts, which made the
  reference too fast at batch 8 and 32 in run 2)."""
  import jax.numpy as jnp
  import numpy as np

  from strata_jax import steps
  from strata_jax.state import init_state
  st = eng.stages[0]
  state = init_state(st.cfg, len(prompts), eng.max_seq, eng.model.dtype)
  first = []
  for slot, toks in enumerate(prompts):
    logits, state = steps.prefill(st.cfg, st.params, st.lora, state, jnp.int32(slot),
                                  jnp.asarray(np.asarray(toks, np.int32)),
                                  jnp.int32(len(toks)), jnp.int32(1), cvec=st.cvec)
    first.append(int(jnp.argmax(logits)))
  return state, jnp.asarray(np.asarray(first, np.int32))


def program_rate(eng, B, steps_per_call, calls, prompt_sets):
  """decode_greedy on the engine's stage (params, padded adapter, forms), switch on, from each
  set of B prompts in `prompt_sets` prefilled afresh (`prefilled_state`; the sets the engine
  served, so at greedy the program decodes the engine's very tokens and reads the same
  experts): B * steps_per_call * calls / seconds, the median over the sets after the first
  (untimed); also the tokens each set decoded ([B, steps] per set)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from strata_jax import steps
  st = eng.stages[0]
  one = jnp.ones((B,), jnp.int32)
  times, tokens = [], []
  for r, prompts in enumerate(prompt_sets):
    state, toks = prefilled_state(eng, prompts)
    jax.block_until_ready(state)
    outs = []
    t0 = time.perf_counter()
    for _ in range(calls):
      out, state = steps.decode_greedy(st.cfg, st.params, st.lora, state, toks, one, one,
                                       n_steps=steps_per_call, cvec=st.cvec)
      toks = out[-1]
      outs.append(out)
    jax.block_until_ready(toks)
    if r:
      times.append(time.perf_counter() - t0)
    tokens.append(np.concatenate([np.asarray(o) for o in outs]).T)
  rate = B * steps_per_call * calls / statistics.median(times) if times else None
  return rate, times, tokens


def sample_program_rate(eng, B, steps_per_call, calls, prompt_sets, kw):
  """`steps.decode_sample`, the engine's own decode program, called back to back as
  `program_rate` calls decode_greedy, from the same prompt sets (B rows active, request
  parameters `kw`, switch on): the device-side price of on-device sampling and row
  bookkeeping, apart from the engine's host loop."""
  import common
  import jax

  from strata_jax import steps
  st = eng.stages[0]
  times = []
  for r, prompts in enumerate(prompt_sets):
    state, first = prefilled_state(eng, prompts)
    rows, sp, switch, stop, plan = common.sample_inputs(B, kw, first)
    jax.block_until_ready((rows, state))
    t0 = time.perf_counter()
    for _ in range(calls):
      out, rows, state = steps.decode_sample(st.cfg, st.params, st.lora, state, rows, sp,
                                             switch, stop, n_steps=steps_per_call, plan=plan,
                                             with_logits=False, cvec=st.cvec)
    jax.block_until_ready(out[0])
    if r:
      times.append(time.perf_counter() - t0)
  return (B * steps_per_call * calls / statistics.median(times) if times else None), times


def dump_hlo(eng, B, steps_per_call, folder):
  """The optimised HLO of `decode_greedy` and of `decode_sample` (greedy plan) as the engine's
  B-row stage compiles them (the programs `program_rate` and `sample_program_rate` time), to
  `folder`/decode_{greedy,sample}_b{B}.hlo.txt.gz: where the profile's fusions differ."""
  import gzip

  import common

  import jax.numpy as jnp

  from strata_jax import steps
  st, state = eng.stages[0], eng.states[0]
  one = jnp.ones((B,), jnp.int32)
  rows, sp, switch, stop, plan = common.sample_inputs(B, {}, one)
  programs = {
      "greedy": steps.decode_greedy.lower(st.cfg, st.params, st.lora, state, one, one, one,
                                          n_steps=steps_per_call, cvec=st.cvec),
      "sample": steps.decode_sample.lower(st.cfg, st.params, st.lora, state, rows, sp, switch,
                                          stop, n_steps=steps_per_call, plan=plan,
                                          with_logits=False, cvec=st.cvec)}
  os.makedirs(folder, exist_ok=True)
  for name, lowered in programs.items():
    with gzip.open(os.path.join(folder, f"decode_{name}_b{B}.hlo.txt.gz"), "wt") as f:
      f.write(lowered.compile().as_text())


def prefill_time(eng, T, reps):
  """One `steps.prefill` of T tokens as one chunk on the engine's stage, switch on."""
  import jax
  import jax.numpy as jnp

  from strata_jax import steps
  st = eng.stages[0]
  tokens = jax.random.randint(jax.random.key(T), (T,), 0, eng.model.cfg.vocab_size, jnp.int32)
  times = []
  for r in range(reps + 1):
    eng.states[0] = steps.reset_rows(eng.states[0], jnp.ones((eng.n_slots,), jnp.int32))
    jax.block_until_ready(eng.states[0])
    t0 = time.perf_counter()
    logits, eng.states[0] = steps.prefill(st.cfg, st.params, st.lora, eng.states[0],
                                          jnp.int32(0), tokens, jnp.int32(T), jnp.int32(1),
                                          cvec=st.cvec)
    jax.block_until_ready(logits)
    if r:
      times.append(time.perf_counter() - t0)
  eng.states[0] = steps.reset_rows(eng.states[0], jnp.ones((eng.n_slots,), jnp.int32))
  eng.slot_tokens[0] = []
  return (statistics.median(times) if times else None), times


# ----- the server's clients (a separate process) ----------------------------------------------
def client_main(url, n, prompt_len, new, vocab, seed):
  """n concurrent streaming /v1/completions; prints one JSON line."""
  import httpx
  import numpy as np
  prompts = _prompts(np.random.default_rng(seed), n, prompt_len, vocab)
  out = [None] * n
  go = threading.Barrier(n)

  def one(i):
    # each client's connection pool is made before the start line: making an httpx client
    # (SSL context and all) took tens of ms, and 32 of them spread the "concurrent" requests
    # over ~0.4 s of client time that runs <= 7 counted against the server
    client = httpx.Client(timeout=600)
    go.wait()
    t0 = time.perf_counter()
    first, chunks, usage = None, 0, None
    body = {"prompt": prompts[i], "max_tokens": new, "temperature": 0, "stream": True,
            "lora": True, "stream_options": {"include_usage": True}}
    with client, client.stream("POST", f"{url}/v1/completions", json=body) as r:
      for line in r.iter_lines():
        if not line.startswith("data: {"):
          continue
        ev = json.loads(line[6:])
        if ev.get("usage"):
          usage = ev["usage"]
        elif ev["choices"] and ev["choices"][0]["text"]:
          chunks += 1
          first = first or time.perf_counter()
    out[i] = dict(t0=t0, first=first, done=time.perf_counter(), chunks=chunks,
                  tokens=usage["completion_tokens"] if usage else 0, status=r.status_code)

  threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  print(json.dumps(out))


def _trace_engine(eng):
  """Record the worker thread's engine rounds and admissions: [(kind, start, end, running)]
  with perf_counter times (CLOCK_MONOTONIC on Linux: comparable with the client process's)."""
  trace = []
  step, start = eng.step, eng._start

  def traced_step():
    t = time.perf_counter()
    step()
    trace.append(("step", t, time.perf_counter(), len(eng._running)))

  def traced_start(slot, req):
    t = time.perf_counter()
    run = start(slot, req)
    trace.append(("start", t, time.perf_counter(), None))
    return run
  eng.step, eng._start = traced_step, traced_start
  return trace


def _timeline(trace, t0, t1):
  """One server run's engine rounds, times from its first client's request (s): how many
  prompts each round admitted, when the first and last were admitted, how long rounds took."""
  steps = [x for x in trace if x[0] == "step" and t0 <= x[1] <= t1]
  starts = [x for x in trace if x[0] == "start" and t0 <= x[1] <= t1]
  per_round = [sum(1 for s in starts if st[1] <= s[1] <= st[2]) for st in steps]
  return dict(rounds=len(steps), admitted_per_round=[n for n in per_round if n],
              first_admit_s=starts[0][1] - t0 if starts else None,
              last_admit_s=starts[-1][2] - t0 if starts else None,
              start_ms_mean=1e3 * statistics.mean(s[2] - s[1] for s in starts) if starts else None,
              round_ms=[round(1e3 * (st[2] - st[1]), 2) for st in steps][:40])


def server_rate(eng, args, seed):
  """Aggregate tokens/s of n streaming clients against create_app(eng) (median of reps)."""
  import socket

  import uvicorn

  from strata_jax.serve import create_app
  trace = _trace_engine(eng)
  app = create_app(eng, model_name="bench-a3b")
  sock = socket.socket()
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  sock.bind(("127.0.0.1", 0))
  url = f"http://127.0.0.1:{sock.getsockname()[1]}"
  server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
  th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
  th.start()
  while not server.started:
    time.sleep(0.02)
  runs = []
  try:
    for r in range(args.reps + 1):
      p = subprocess.run([sys.executable, os.path.abspath(__file__), "--client", url,
                          "--clients", str(args.server_clients), "--prompt", str(args.prompt),
                          "--new", str(args.new), "--vocab", str(eng.model.cfg.vocab_size),
                          "--seed", str(seed + r)], capture_output=True, text=True, timeout=600)
      if p.returncode:
        raise RuntimeError(f"clients failed: {p.stderr[-2000:]}")
      cl = json.loads(p.stdout.strip().splitlines()[-1])
      if r:
        tokens = sum(c["tokens"] for c in cl)
        t0 = min(c["t0"] for c in cl)
        wall = max(c["done"] for c in cl) - t0
        runs.append(dict(tok_s=tokens / wall, tokens=tokens, wall_s=wall,
                         chunks=sum(c["chunks"] for c in cl),
                         ttft_median_s=statistics.median(c["first"] - c["t0"] for c in cl),
                         timeline=_timeline(trace, t0, t0 + wall)))
  finally:
    server.should_exit = True
    th.join(60)
    sock.close()
    del eng.step, eng._start   # the engine's own methods again
  return statistics.median(r["tok_s"] for r in runs), runs


# ----- output ------------------------------------------------------------------------------------
def entries(details, command):
  def entry(name, measured, target, unit, met):
    return {"name": name, "measured": None if measured is None else round(measured, 4),
            "target": target, "unit": unit, "met": bool(met) if measured is not None else False,
            "command": command}
  out = []
  for B in details["batches"]:
    d = details["decode"].get(str(B), {})
    for mode in ("greedy", "sampled"):
      m = d.get(f"{mode}_ratio")
      t = TARGETS[mode]
      out.append(entry(f"engine_vs_program_b{B}_{mode}", m, t,
                       f"engine decode tok/s / decode_greedy tok/s (batch {B}, adapter on"
                       + (", T 0.8, top_p 0.95)" if mode == "sampled" else ")"),
                       m is not None and m >= t))
  s = details.get("server", {}).get("ratio")
  out.append(entry(f"server_vs_engine_b{details['server_batch']}", s, TARGETS["server"],
                   f"serve tok/s ({details['server_clients']} streaming clients) / "
                   "Engine.run tok/s (end to end)",
                   s is not None and s >= TARGETS["server"]))
  r = details.get("ttft", {}).get("ratio")
  out.append(entry(f"engine_ttft_vs_prefill_{details['ttft_tokens']}", r, TARGETS["ttft"],
                   "engine TTFT / one prefill program call (lower is better)",
                   r is not None and r <= TARGETS["ttft"]))
  return out


def merge_summary(path, new):
  """`new` into the summary.json at `path` (entries without a target: measured.json beside it)."""
  import common
  common.merge_summary(new, os.path.dirname(path))


def plot(details, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
  bs = [str(B) for B in details["batches"]]
  series = [("decode_greedy program", "program_tok_s"), ("engine greedy", "greedy_tok_s"),
            ("engine T 0.8 top_p 0.95", "sampled_tok_s")]
  w = 0.8 / len(series)
  for i, (label, key) in enumerate(series):
    ys = [details["decode"].get(B, {}).get(key) or 0 for B in bs]
    a.bar([j + i * w for j in range(len(bs))], ys, w, label=label)
  srv = details.get("server", {})
  if srv.get("tok_s"):   # end to end (prompts included), beside the engine's end to end
    x = len(bs) - 1 + len(series) * w
    a.bar([x, x + w], [srv["engine_end_to_end_tok_s"], srv["tok_s"]], w,
          color=["silver", "grey"])
    a.text(x + w / 2, max(srv["tok_s"], srv["engine_end_to_end_tok_s"]),
           f"end to end:\nengine | serve\n({details['server_clients']} streaming clients)",
           ha="center", va="bottom", fontsize=7)
  a.set_xticks([j + w for j in range(len(bs))], [f"batch {B}" for B in bs])
  a.set_ylabel("tokens/s")
  a.set_title(f"decode, {details['geometry']}, adapter on")
  a.legend(fontsize=8)
  t = details.get("ttft", {})
  if t.get("engine_s"):
    b.bar(["prefill\nprogram", "engine\nTTFT"], [t["program_s"] * 1e3, t["engine_s"] * 1e3],
          color=["C0", "C1"])
  b.set_ylabel("ms")
  b.set_title(f"{details['ttft_tokens']}-token prompt")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ----- main ------------------------------------------------------------------------------------
def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--smoke", action="store_true", help="CPU, toy geometry, short runs")
  ap.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "device",
                                                 "bench_engine.json"))
  ap.add_argument("--merge-summary", nargs="?", const=DEFAULT_SUMMARY, default=None,
                  metavar="PATH", help="merge the keys into this summary.json")
  ap.add_argument("--batches", default="1,8,32")
  ap.add_argument("--prompt", type=int, default=128)
  ap.add_argument("--new", type=int, default=64)
  ap.add_argument("--ttft-tokens", type=int, default=2500)
  ap.add_argument("--server-clients", type=int, default=32)
  ap.add_argument("--reps", type=int, default=2, help="timed runs per figure (after 1 untimed)")
  ap.add_argument("--decode-steps", type=int, default=16, help="engine steps per dispatch")
  ap.add_argument("--forms", default="", help="Forms for every engine, as the CLI's --forms "
                  "(e.g. dense_weights=kernel); the entries' command records it")
  ap.add_argument("--bucket-step", type=int, default=512,
                  help="Engine(bucket_step=): one-pass prefill with buckets in multiples of "
                       "it (the Engine's default, 512; 0: off)")
  ap.add_argument("--warm-threads", type=int, default=1,
                  help="engines compiled at once before timing (1: one after another)")
  ap.add_argument("--profile", action="store_true",
                  help="also trace one greedy engine run and one program round per batch "
                       "(details.profile: GPU kernels per step, busy and idle time)")
  ap.add_argument("--dump-hlo", dest="dump_hlo", default="",
                  help="a folder: decode_greedy's and decode_sample's optimised HLO per batch "
                       "(gzipped text), to compare the two programs fusion by fusion")
  ap.add_argument("--client", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--clients", type=int, default=32, help=argparse.SUPPRESS)
  ap.add_argument("--vocab", type=int, default=0, help=argparse.SUPPRESS)
  ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.client:
    client_main(args.client, args.clients, args.prompt, args.new, args.vocab, args.seed)
    return 0
  if args.smoke:
    args.batches, args.prompt, args.new, args.ttft_tokens = "1", 16, 8, 100
    args.server_clients, args.reps, args.decode_steps = 2, 1, 4
  command = "python experiments/bench/bench_engine.py " + " ".join(argv or sys.argv[1:])
  t_start = time.perf_counter()
  cache_dir = _cache()
  import jax
  import numpy as np

  import strata_jax as sj
  from strata_jax.forms import parse_forms
  batches = [int(b) for b in args.batches.split(",")]
  details = {"jax": jax.__version__, "backend": jax.default_backend(),
             "device": jax.devices()[0].device_kind, "smoke": args.smoke,
             "geometry": "tiny" if args.smoke else "bench-a3b", "batches": batches,
             "prompt": args.prompt, "new": args.new, "ttft_tokens": args.ttft_tokens,
             "server_clients": args.server_clients, "server_batch": max(batches),
             "reps": args.reps, "decode_steps": args.decode_steps, "compilation_cache": cache_dir,
             "sampled": SAMPLED, "forms": args.forms, "bucket_step": args.bucket_step,
             "decode": {}}
  out_path = os.path.abspath(args.out)
  err = None
  try:
    model, lora, init_s = build(args)
    details["init_s"] = init_s
    V = model.cfg.vocab_size
    rng = np.random.default_rng(0)
    ttft_seq = -(-(args.ttft_tokens + 2) // 64) * 64
    short_seq = max(256, 1 << (args.prompt + args.new).bit_length())
    # --forms: every engine (and so the reference programs, which run the engine's config)
    forms = parse_forms(args.forms) if args.forms else None
    engines = {}
    for B in batches:   # batch 1 also serves the TTFT prompt (its K/V capacity fits it)
      engines[B] = sj.Engine(model, lora=lora, slots=B, decode_steps=(args.decode_steps,),
                             forms=forms, bucket_step=args.bucket_step or None,
                             max_seq=ttft_seq if B == 1 else short_seq)
    if 1 not in engines:
      engines[1] = sj.Engine(model, lora=lora, slots=1, decode_steps=(args.decode_steps,),
                             forms=forms, bucket_step=args.bucket_step or None,
                             max_seq=ttft_seq)
    from strata_jax.engine import sampling as hs
    from strata_jax.engine.engine import Request
    plans = (hs.plan_for([Request(tokens=[0])]), hs.plan_for([Request(tokens=[0], **SAMPLED)]))

    # ---- every program before timing: engines' warmup and the references, one engine after
    # another (--warm-threads N: N at once), as a user's process compiles. The same batch-1
    # decode_greedy reference (dense GEMV form, H200) ran 152 tok/s with three engines compiled
    # at once (bench_engine_run13.json), 167 with them compiled in turn (_run14.json) and 193
    # in a process with the batch-1 engine alone (bench_engine_b1_dgemv.json); why the other
    # engines slow it is not known (XLA tunes each GEMM by timing it on the GPU, and the
    # processes hold different memory).
    t0 = time.perf_counter()

    def warm(B):
      e = engines[B]
      lengths = [args.prompt] + ([args.ttft_tokens] if B == 1 else [])
      e.warmup(lengths, plans=plans)
      warm_set = [_prompts(np.random.default_rng(B), B, args.prompt, V)]
      program_rate(e, B, args.decode_steps, 1, warm_set)
      for kw in ({}, dict(SAMPLED, seed=7)):
        sample_program_rate(e, B, args.decode_steps, 1, warm_set, kw)
      if B == 1:
        prefill_time(e, args.ttft_tokens, 0)
      return B
    with cf.ThreadPoolExecutor(max(1, args.warm_threads)) as ex:
      list(ex.map(warm, list(engines)))
    details["compile_wall_s"] = time.perf_counter() - t0
    print(f"compiled in {details['compile_wall_s']:.1f} s", flush=True)

    # ---- decode: engine greedy / sampled against the program, per batch
    calls = -(-args.new // args.decode_steps)
    for B in batches:
      e, d = engines[B], {}
      # one prompt set per run, served by the engine in each mode and by the programs, so a
      # ratio compares the same tokens' work (random weights: a token stream's expert routing
      # moves a step's time by several %)
      # (the sampled runs then find their prompts in the prefix cache: a shorter time to first
      # token, which the decode rate, timed from every row's first token on, leaves out)
      sets = [_prompts(rng, B, args.prompt, V) for _ in range(args.reps + 1)]
      engine_tokens = []
      for mode, kw in (("greedy", {}), ("sampled", dict(SAMPLED, seed=7))):
        dec, e2e = [], []
        for r, prompts in enumerate(sets):
          rate, agg, res = engine_run(e, prompts, args.new, kw)
          assert all(len(x.tokens) == args.new for x in res), "a row stopped early"
          if mode == "greedy":
            engine_tokens.append(np.asarray([x.tokens for x in res]))
          if r:
            dec.append(rate)
            e2e.append(agg)
        d[f"{mode}_tok_s"], d[f"{mode}_runs_tok_s"] = statistics.median(dec), dec
        d[f"{mode}_end_to_end_tok_s"], d[f"{mode}_end_to_end_runs"] = statistics.median(e2e), e2e
      d["program_tok_s"], d["program_runs_s"], prog_tokens = program_rate(
          e, B, args.decode_steps, calls, sets)
      # the engine's greedy tokens after its first against the program's (which decodes from
      # that first token): the share equal, 1.0 when both did the same work
      d["program_token_match"] = float(np.mean([
          (et[:, 1:] == pt[:, :args.new - 1]).mean()
          for et, pt in zip(engine_tokens, prog_tokens)]))
      for mode, kw in (("greedy", {}), ("sampled", dict(SAMPLED, seed=7))):
        d[f"sample_program_{mode}_tok_s"], d[f"sample_program_{mode}_runs_s"] = \
            sample_program_rate(e, B, args.decode_steps, calls, sets, kw)
      for mode in ("greedy", "sampled"):
        d[f"{mode}_ratio"] = d[f"{mode}_tok_s"] / d["program_tok_s"]
      details["decode"][str(B)] = d
      if args.dump_hlo:
        dump_hlo(e, B, args.decode_steps, args.dump_hlo)
      if args.profile:   # where the engine's extra time goes: a slower program, or idle gaps
        import common
        window = [None]   # the engine run's decode window (µs), the profile's last stretch
        steps_run = calls * args.decode_steps
        details.setdefault("profile", {})[str(B)] = dict(
            engine=common.profile_call(lambda: _host_phases(e, lambda: _windowed(engine_run(
                e, _prompts(rng, B, args.prompt, V), args.new, {}), B, args.new, window)),
                steps_run, top=25, window_us=lambda: window[0]),
            # the program's decode stretch only (its rows are prefilled inside the call)
            program=common.profile_call(lambda: program_rate(
                e, B, args.decode_steps, calls, sets[:1])[2], steps_run, top=25,
                window_us=lambda: B * steps_run / d["program_tok_s"] * 1e6))
        details["profile"][str(B)]["engine_host_phases_ms"] = e.host_phases
      print("decode", B, {k: v for k, v in d.items() if not k.endswith("runs")}, flush=True)
      common_write(out_path, details, command)

    # ---- time to first token of a long prompt against one prefill call
    e = engines[1]
    ttft = []
    for r in range(args.reps + 1):
      res = e.generate(tokens=_prompts(rng, 1, args.ttft_tokens, V)[0], max_tokens=1,
                       lora=True)
      if r:
        ttft.append(res.ttft_s)
    prog_s, prog_runs = prefill_time(e, args.ttft_tokens, args.reps)
    details["ttft"] = dict(engine_s=statistics.median(ttft), engine_runs_s=ttft,
                           program_s=prog_s, program_runs_s=prog_runs,
                           chunks=[(b, cut) for _, _, b, cut in e._schedule(
                               0, args.ttft_tokens, args.ttft_tokens // e.block_size, True)])
    details["ttft"]["ratio"] = details["ttft"]["engine_s"] / prog_s
    if args.profile:   # the GPU's busy time and gaps from submit to first token, by kernel
      import common
      long_prompt = _prompts(rng, 1, args.ttft_tokens, V)[0]
      details["ttft"]["profile"] = common.profile_call(lambda: _host_phases(
          e, lambda: e.generate(tokens=long_prompt, max_tokens=1, lora=True).tokens), 1, top=20)
      details["ttft"]["profile"]["engine_host_phases_ms"] = e.host_phases
      details["ttft"]["profile"]["program"] = common.profile_call(
          lambda: prefill_time(e, args.ttft_tokens, 0)[1], 1, top=20)
    print("ttft", details["ttft"], flush=True)
    common_write(out_path, details, command)

    # ---- the server on the largest batch's engine (the worker owns it from here on)
    B = max(batches)
    srv_rate, runs = server_rate(engines[B], args, seed=100)
    eng_e2e = details["decode"][str(B)]["greedy_end_to_end_tok_s"]
    details["server"] = dict(tok_s=srv_rate, runs=runs, engine_end_to_end_tok_s=eng_e2e,
                             ratio=srv_rate / eng_e2e)
    print("server", details["server"], flush=True)
  except Exception as e:  # noqa: BLE001 (recorded, then the exit status says so)
    err = f"{type(e).__name__}: {e}"
    details["error"] = err
    details["traceback"] = traceback.format_exc()[-4000:]
    print(details["traceback"], file=sys.stderr, flush=True)
  details["wall_s"] = time.perf_counter() - t_start
  ents = common_write(out_path, details, command)
  try:
    plot(details, os.path.splitext(out_path)[0] + ".png")
  except Exception as e:  # noqa: BLE001
    details["plot_error"] = repr(e)
    common_write(out_path, details, command)
  if args.merge_summary:
    merge_summary(os.path.abspath(args.merge_summary), ents)
  print(json.dumps(ents, indent=1))
  return 1 if err else 0


def common_write(path, details, command):
  from common import write_json
  ents = entries(details, command)
  write_json(path, {"entries": ents, "details": details})
  return ents


if __name__ == "__main__":
  sys.exit(main())
