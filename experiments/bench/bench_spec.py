"""Speculative decoding on bench-a3b plus a random MTP layer (issue 18): the cost of one
verification step and of one MTP draft token against one decode step, the LoRA switch's cost
with MTP on, and the projected speed-up at acceptance 0.7 (formula in README.md).

Every measurement is a jitted loop of R repetitions (state carried, one dispatch), timed in
interleaved rounds (median), batch 1, bf16, adapter loaded (rank 50):
  decode        `steps.decode_greedy`, R steps in one program (the plain decode loop the Engine
                runs: argmax fed back, the LoRA pass chosen once), switch on
  verify_nN     `steps.verify_accept` on N+1 positions (the last token and N drafts), R times,
                switch on; the drafts are random, so the state advances one token a step
  mtp_step      one MTP entry (`model.mtp.mtp_forward`, T = 1) R times: one draft token
  round_nN      `steps.spec_step` (verify N+1, feed the MTP head, N drafts), R times,
                switch on and off (same program: the switch is data)

Then the path users run (`--engine_rounds`, one setting per value): `Engine(slots=1, spec=N,
spec_rounds=value)` serving one request of `context` prompt tokens and 64 new ones, adapter
on, greedy or sampled (`--engine_temperatures`; median of `rounds` timed requests): decode tokens/s, and beside it what the device
program alone would give for the same rounds (`round_nN_on`'s time per round, the engine's own
drafts proposed / accepted): engine / program is the host's share of a round.

  python experiments/bench/bench_spec.py            # GPU: bench-a3b, results/bench_spec.json
  python experiments/bench/bench_spec.py --smoke    # CPU, toy sizes, a few seconds
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
import statistics
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

flags.DEFINE_bool("smoke", False, "toy geometry on CPU (a smoke test of the script)")
flags.DEFINE_string("out", "", "output JSON (default results/bench_spec.json)")
flags.DEFINE_string("ns", "2,3,4,6", "draft counts N measured")
flags.DEFINE_integer("compile_threads", 8, "programs compiled at once")
flags.DEFINE_integer("reps", 16, "repetitions inside one program call")
flags.DEFINE_integer("rounds", 5, "timed rounds (median)")
flags.DEFINE_integer("context", 256, "tokens in the cache before the timed steps")
flags.DEFINE_integer("max_seq", 1024, "K/V capacity")
flags.DEFINE_string("forms", "", "Forms over the backend's defaults, as the CLI's --forms")
flags.DEFINE_bool("summary", True, "merge the targets into results/summary.json")
flags.DEFINE_string("engine_rounds", "1,4", "Engine(spec_rounds=) values served through the "
                    "Engine at N = 3 (empty: no Engine leg)")
flags.DEFINE_string("engine_temperatures", "0", "temperatures of the Engine leg's request "
                    "(each with every --engine_rounds value; > 0: top-p 0.95, seed 1, the "
                    "rejection rule on the device)")
F = flags.FLAGS

ACCEPT = 0.7


def expected_tokens(a: float, n: int) -> float:
  """Tokens a round emits when each draft is accepted with probability a (independently):
  1 + a + ... + a^N = (1 - a^(N+1)) / (1 - a)."""
  return float(n + 1) if a >= 1 else (1 - a ** (n + 1)) / (1 - a)


def mtp_device_params(cfg, dtype, seed: int = 7, std: float = 0.02):
  """A random MTP head (MTPParams) drawn on the device, norms ~1."""
  import jax
  import jax.numpy as jnp

  from strata_jax.params import AttnParams, MoEParams, MTPParams, leaf_dtype, mtp_param_shapes
  shapes = mtp_param_shapes(cfg)
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  flat = {}
  for key, (path, shape) in zip(keys, shapes.items()):
    name = path.split(".")[-1]
    f32 = jnp.float32
    if "norm" in name:
      x = 1.0 + 0.1 * jax.random.normal(key, shape, f32)
    else:
      x = std * jax.random.normal(key, shape, f32)
    flat[path] = x.astype(leaf_dtype(path, dtype))
  sub = lambda p, cls: cls(**{f.name: flat[p + f.name] for f in dataclasses.fields(cls)})
  return MTPParams(eh_proj=flat["mtp.eh_proj"], enorm=flat["mtp.enorm"],
                   hnorm=flat["mtp.hnorm"], head_norm=flat["mtp.head_norm"],
                   attn_norm=flat["mtp.attn_norm"], post_norm=flat["mtp.post_norm"],
                   attn=sub("mtp.attn.", AttnParams), moe=sub("mtp.moe.", MoEParams))


def main(_):
  import jax
  import jax.numpy as jnp
  from jax import lax

  from strata_jax import steps
  from strata_jax.forms import Forms, parse_forms
  from strata_jax.model.mtp import mtp_forward
  from strata_jax.params import pad_lora_rank
  from strata_jax.state import init_mtp_state, init_state

  geom = common.TINY if F.smoke else common.BENCH_A3B
  dtype = jnp.float32 if F.smoke else jnp.bfloat16
  cfg = dataclasses.replace(common.model_config(geom), n_mtp=1)
  forms = parse_forms(F.forms) if F.forms else Forms()
  cfg = dataclasses.replace(cfg, forms=forms.resolve(jax.default_backend(), dtype))
  if F.smoke:   # the Pallas interpreter is for tests: XLA's LoRA delta on CPU
    cfg = dataclasses.replace(cfg, forms=dataclasses.replace(cfg.forms, lora_impl="xla"))
  params = common.device_params(cfg, dtype)
  params = params.replace(mtp=mtp_device_params(cfg, dtype))
  lora = pad_lora_rank(common.device_lora(cfg, common.LORA_RANK, dtype), 64)
  ns = [int(n) for n in F.ns.split(",") if n]
  R, S = F.reps, F.max_seq
  res = dict(geometry=dict(geom, layer_types=cfg.layer_types, n_mtp=1, lora_rank=50,
                           dtype=jnp.dtype(dtype).name), batch=1, reps=R, context=F.context,
             backend=jax.default_backend())

  one = jnp.ones((1,), jnp.int32)
  cap = jnp.full((1,), 1 << 20, jnp.int32)
  stop = jnp.full((1,), -1, jnp.int32)

  # the cache holds `context` tokens (prefill, untimed)
  state0 = init_state(cfg, 1, S, dtype)
  ctx = jnp.arange(F.context, dtype=jnp.int32) % cfg.vocab_size
  _, state0 = steps.prefill(cfg, params, lora, state0, jnp.int32(0), ctx, jnp.int32(F.context),
                            jnp.int32(1))
  mstate0 = init_mtp_state(cfg, 1, S, dtype)
  mstate0 = mstate0.replace(start=jnp.full((1,), F.context, jnp.int32))
  hidden0 = (0.5 * jax.random.normal(jax.random.key(3), (1, 1, cfg.d_model))).astype(dtype)

  # params and the adapter are arguments, never closed over: a closure would embed the
  # model's 24 GB as program constants (the first H200 run died lowering them).
  @jax.jit
  def decode_loop(params, lora, state, tok, switch):
    out, st = steps.decode_greedy(cfg, params, lora, state, tok, switch, one, n_steps=R)
    return out[-1], st.pos

  def verify_loop_fn(n):
    @jax.jit
    def loop(params, lora, state, toks, switch):
      def body(c, i):
        st, tk = c
        ch, k, ne, _, st = steps.verify_accept(cfg, params, lora, st, tk, switch,
                                               jnp.full((1,), n + 1, jnp.int32), cap, stop)
        nxt = jnp.concatenate([ch[:, :1], (tk[:, 1:] + 7 * (i + 1)) % cfg.vocab_size], axis=1)
        return (st, nxt), None
      (st, tk), _ = lax.scan(body, (state, toks), jnp.arange(R))
      return tk, st.pos
    return loop

  @jax.jit
  def mtp_loop(params, mstate, tok, h):
    def body(c, i):
      ms, t, hh = c
      lg, hn, k, v = mtp_forward(cfg, params, t[:, None], hh, ms.k, ms.v,
                                 jnp.full((1,), F.context, jnp.int32) + i, one, ms.start)
      return (ms.replace(k=k, v=v), jnp.argmax(lg[:, 0], -1).astype(jnp.int32), hn), None
    (ms, t, _), _ = lax.scan(body, (mstate, tok, h), jnp.arange(R))
    return t, ms.k[0, 0, 0, 0]

  def round_loop_fn(n):
    @jax.jit
    def loop(params, lora, state, mstate, toks, switch):
      def body(c, _):
        st, ms, tk = c
        ch, k, ne, dr, st, ms = steps.spec_step(
            cfg, params, lora, st, ms, tk, switch, jnp.full((1,), n + 1, jnp.int32), cap, stop,
            n_draft=n)
        last = jnp.take_along_axis(ch, (ne - 1)[:, None], axis=1)
        return (st, ms, jnp.concatenate([last, dr], axis=1)), None
      (st, ms, tk), _ = lax.scan(body, (state, mstate, toks), None, length=R)
      return tk, st.pos
    return loop

  # (function, arguments) per variant; the loops donate nothing, so the inputs are reused.
  on, off = jnp.ones((1,), jnp.int32), jnp.zeros((1,), jnp.int32)
  tok = jnp.full((1,), 5, jnp.int32)
  specs = {"decode": (decode_loop, (params, lora, state0, tok, on)),
           "mtp_step": (mtp_loop, (params, mstate0, tok, hidden0))}
  for n in ns:
    toks = (jnp.arange(n + 1, dtype=jnp.int32)[None] * 11 + 3) % cfg.vocab_size
    specs[f"verify_n{n}"] = (verify_loop_fn(n), (params, lora, state0, toks, on))
    rl = round_loop_fn(n)
    for sw_name, sw in (("on", on), ("off", off)):
      specs[f"round_n{n}_{sw_name}"] = (rl, (params, lora, state0, mstate0, toks, sw))

  t0 = common.now()
  compiled = {}

  def comp(item):
    name, (fn, args) = item
    if name.endswith("_off"):     # the same program as "_on" (the switch is data)
      return name, None
    return name, fn.lower(*args).compile()
  with cf.ThreadPoolExecutor(max(1, F.compile_threads)) as ex:
    for name, prog in ex.map(comp, list(specs.items())):
      if prog is not None:
        compiled[name] = prog
  for name in specs:
    if name.endswith("_off"):
      compiled[name] = compiled[name[:-4] + "_on"]
  res["compile_s"] = common.now() - t0
  print("compiled", len(compiled), "programs in", round(res["compile_s"], 1), "s", flush=True)

  def timed(name):
    t0 = common.now()
    common.block(compiled[name](*specs[name][1]))
    return common.now() - t0

  for name in specs:   # warm up
    timed(name)
  samples = {v: [] for v in specs}
  for _ in range(F.rounds):
    for v in specs:
      samples[v].append(timed(v))
  per = {v: statistics.median(s) / R for v, s in samples.items()}
  res["seconds_per_step"] = per
  res["spread"] = {v: (max(s) - min(s)) / statistics.median(s) for v, s in samples.items()}
  t_dec = per["decode"]
  verify_ratio = {n: per[f"verify_n{n}"] / t_dec for n in ns}
  round_on = {n: per[f"round_n{n}_on"] for n in ns}
  switch_cost = {n: per[f"round_n{n}_on"] / per[f"round_n{n}_off"] - 1 for n in ns}
  speedup = {n: expected_tokens(ACCEPT, n) * t_dec / round_on[n] for n in ns}
  best = max(ns, key=lambda n: speedup[n])
  res.update(verify_cost_ratio=verify_ratio, mtp_draft_cost_ratio=per["mtp_step"] / t_dec,
             round_cost_ratio={n: round_on[n] / t_dec for n in ns},
             projected_speedup_a07=speedup, best_n=best, lora_switch_cost_mtp=switch_cost)
  for k in ("verify_cost_ratio", "mtp_draft_cost_ratio", "projected_speedup_a07", "best_n",
            "lora_switch_cost_mtp"):
    print(k, res[k], flush=True)

  if F.engine_rounds:
    res["engine"] = engine_leg(cfg, params, dtype, per, 3 if 3 in ns else best)
    for row in res["engine"]:
      print("engine", row, flush=True)

  results = os.path.join(common.RESULTS, "tmp", "smoke") if F.smoke else common.RESULTS
  out = F.out or os.path.join(results, "bench_spec.json")
  common.write_json(out, res)
  cmd = "python experiments/bench/bench_spec.py" + (" --smoke" if F.smoke else "")
  n4 = 4 if 4 in ns else best
  entries = [
      dict(name="verify_n4_cost_ratio", measured=verify_ratio[n4], target=1.15, unit="x",
           met=verify_ratio[n4] <= 1.15, command=cmd),
      dict(name="mtp_draft_cost_ratio", measured=res["mtp_draft_cost_ratio"], target=0.1,
           unit="x", met=res["mtp_draft_cost_ratio"] <= 0.1, command=cmd),
      dict(name="spec_projected_speedup_a07", measured=speedup[best], target=1.8, unit="x",
           met=speedup[best] >= 1.8, command=cmd),
      dict(name="spec_lora_switch_cost", measured=switch_cost[best], target=0.01,
           unit="fraction", met=switch_cost[best] <= 0.01, command=cmd),
  ]
  res["summary"] = entries
  common.write_json(out, res)
  if F.summary:
    common.merge_summary(entries, results)
  plot(res, ns, os.path.splitext(out)[0] + ".png")
  print("wrote", out, flush=True)


def engine_leg(cfg, params, dtype, per, n):
  """`Engine(slots=1, spec=n, spec_rounds=r)` for each r of --engine_rounds and each
  temperature of --engine_temperatures: one request of `context` prompt tokens and 64 new
  ones, adapter on, median of --rounds timed
  requests after one untimed (compiling) request. Beside each: the device program's rate for
  the same rounds, tokens / (rounds x t(round_n{n}_on)). Returns one dict per r."""
  import time

  import numpy as np
  from bench_engine import bench_model

  import strata_jax as sj
  from strata_jax.engine.engine import Request
  model = bench_model(cfg, params, dtype, F.smoke)
  lora = common.device_lora_set(cfg, common.LORA_RANK, dtype)
  prompt = [int(t) for t in np.random.default_rng(5).integers(0, cfg.vocab_size, F.context)]
  new = 64
  out = []
  settings = [(r, float(t)) for t in F.engine_temperatures.split(",") if t
              for r in [int(x) for x in F.engine_rounds.split(",") if x]]
  for r, temp in settings:
    eng = sj.Engine(model, lora=lora, slots=1, max_seq=F.max_seq, spec=n, spec_rounds=r,
                    prefix_cache_bytes=0)
    rates, props, accs, walls = [], [], [], []
    for i in range(F.rounds + 1):
      t0 = time.perf_counter()
      res = eng.run([Request(tokens=prompt, max_tokens=new, lora=True, temperature=temp,
                             top_p=0.95, seed=1)])[0]
      if i:   # the first request compiles
        rates.append(res.decode_tokens_per_s)
        walls.append(time.perf_counter() - t0)
        props.append(res.draft["proposed"])
        accs.append(res.draft["accepted"])
    # rounds: the first one after the prompt has no drafts, each later one proposes n
    n_rounds = 1 + statistics.median(props) / n
    program = (new - 1) / (n_rounds * per[f"round_n{n}_on"])
    rate = statistics.median(rates)
    out.append(dict(spec=n, spec_rounds=r, temperature=temp, decode_tok_s=rate,
                    wall_s=statistics.median(walls),
                    proposed=statistics.median(props), accepted=statistics.median(accs),
                    program_tok_s=program, engine_over_program=rate / program))
  return out


def plot(res, ns, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(1, 2, figsize=(10, 4))
  ax[0].plot(ns, [res["verify_cost_ratio"][n] for n in ns], "o-", label="verify N+1 / decode")
  ax[0].plot(ns, [res["round_cost_ratio"][n] for n in ns], "s-",
             label="round (verify + MTP) / decode")
  ax[0].axhline(1.15, color="grey", ls=":", label="target verify N=4: 1.15")
  ax[0].set_xlabel("drafts N")
  ax[0].set_ylabel("time / one decode step")
  ax[0].legend(fontsize=8)
  ax[0].set_title(f"batch 1, MTP draft token = {res['mtp_draft_cost_ratio']:.3f} decode")
  for a in (0.5, 0.6, 0.7, 0.8, 0.9):
    sp = [expected_tokens(a, n) / res["round_cost_ratio"][n] for n in ns]
    ax[1].plot(ns, sp, "o-", label=f"acceptance {a}")
  ax[1].axhline(1.8, color="grey", ls=":", label="target at 0.7: 1.8")
  ax[1].set_xlabel("drafts N")
  ax[1].set_ylabel("projected tokens/s over plain decode")
  ax[1].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


if __name__ == "__main__":
  app.run(main)
