"""Decode cost of rows over several adapters (issue 19): `multi_adapter_b32_cost_ratio`.

bench-a3b (common.BENCH_A3B, random bf16 weights on the device), 32 rows decoding through
`steps.decode_greedy` (n_steps tokens per call), four random rank-50 adapters on ssm_out and
attn_output of every layer held in one adapter table (`strata_jax.engine.adapters`: R = 200
padded to 256, per-row scale table). Variants, timed in interleaved rounds (median):
  one        every row on adapter 0 (same table, same program)
  four       row b on adapter b % 4
  mixed      row b on adapters b % 4 and (b + 1) % 4 at scale 0.5 each
  alone      every row on adapter 0, in a table holding adapter 0 only (R = 64)
  off        every row with no adapter (same table)
measured = four / one (target <= 1.2); four / alone is reported beside it.

Then the path users run (`--engine`, default on): `Engine(model, lora=[4 adapters], slots=32)`
serving 32 requests at once (random 128-token prompts, 64 new tokens, greedy), every request
on adapter 0 ("one") or request b on adapter b % 4 ("four"), as a request names them
(`"lora": [{"id": b % 4, "scale": 1.0}]`); decode tokens/s as `bench_engine.py` counts them
(tokens after each request's first, over the window after the last first token). Reported
beside the program's figure: `multi_adapter_b32_engine_cost_ratio` = one / four tokens/s.

  python experiments/bench/multi_adapter_bench.py [--tiny]
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

F = flags.FLAGS
flags.DEFINE_bool("tiny", False, "toy geometry (CPU smoke test)")
flags.DEFINE_string("out", os.path.join(common.RESULTS, "multi_adapter.json"), "output JSON")
flags.DEFINE_integer("batch", 32, "decode rows")
flags.DEFINE_integer("n_adapters", 4, "adapters in the table")
flags.DEFINE_integer("rank", common.LORA_RANK, "rank of each adapter")
flags.DEFINE_integer("n_steps", 32, "decode steps per program call")
flags.DEFINE_integer("max_seq", 512, "K/V capacity of the decode state")
flags.DEFINE_integer("reps", 7, "timed rounds")
flags.DEFINE_bool("engine", True, "also time the Engine serving the batch (the users' path)")
flags.DEFINE_integer("prompt", 128, "prompt tokens per request (engine part)")
flags.DEFINE_integer("new", 64, "new tokens per request (engine part)")
flags.DEFINE_integer("engine_reps", 3, "timed engine runs per variant (after one untimed)")

TARGET = 1.2


def main(_):
  import jax
  import jax.numpy as jnp
  import numpy as np

  from strata_jax import steps
  from strata_jax.engine.adapters import AdapterTable
  from strata_jax.params import LoraSet
  from strata_jax.state import init_state

  geom = common.TINY if F.tiny else common.BENCH_A3B
  dtype = jnp.bfloat16
  cfg = common.model_config(geom)   # with the forms load_model resolves for this backend
  cfg = dataclasses.replace(cfg, forms=cfg.forms.resolve(jax.default_backend(), dtype))
  B, K = F.batch, F.n_adapters
  params = common.device_params(cfg, dtype)
  sets = [LoraSet(params=common.device_lora(cfg, F.rank, dtype, seed=1 + k), files=(),
                  ignored=(), rank_total=F.rank, adapter_id=0x100 + k) for k in range(K)]
  full = AdapterTable(cfg, dtype, B + 1, adapters=sets)
  alone = AdapterTable(cfg, dtype, B + 1, adapters=sets[:1])

  def lora_for(table, rows):
    """The table's LoraParams with row b + 1 set to rows[b] ({adapter id: scale})."""
    for b, choice in enumerate(rows):
      table.set_row(b + 1, table.resolve([{"id": i, "scale": s} for i, s in choice.items()]))
    return jax.device_put(table.params())

  variants = {
      "one": (full, [{0: 1.0}] * B),
      "four": (full, [{b % K: 1.0} for b in range(B)]),
      "mixed": (full, [{b % K: 0.5, (b + 1) % K: 0.5} for b in range(B)]),
      "alone": (alone, [{0: 1.0}] * B),
      "off": (full, [{}] * B),
  }
  loras = {name: lora_for(t, rows) for name, (t, rows) in variants.items()}
  switch = {name: jnp.asarray([b + 1 if rows[b] else 0 for b in range(B)], jnp.int32)
            for name, (_, rows) in variants.items()}
  active = jnp.ones(B, jnp.int32)
  tokens = jnp.asarray(np.arange(B) % cfg.vocab_size, jnp.int32)
  state = {"s": init_state(cfg, B, F.max_seq, dtype)}

  def call(name):
    t0 = common.now()
    out, st = steps.decode_greedy(cfg, params, loras[name], state["s"], tokens, switch[name],
                                  active, n_steps=F.n_steps)
    common.block(out)
    state["s"] = st.replace(pos=jnp.zeros_like(st.pos))   # decode from the start each call
    return common.now() - t0

  names = list(variants)
  for v in names:   # compile (one program per table rank: full R and alone R)
    call(v)
  samples = {v: [] for v in names}
  for _ in range(F.reps):
    for v in names:
      samples[v].append(call(v))
  med = {v: statistics.median(s) for v, s in samples.items()}
  ratio = med["four"] / med["one"]
  res = dict(geometry=dict(geom, layer_types=cfg.layer_types), batch=B, n_adapters=K,
             rank=F.rank, table_rank=full.rank, alone_rank=alone.rank, n_steps=F.n_steps,
             backend=jax.default_backend(), devices=str(jax.devices()),
             seconds={v: common.summarize(s) for v, s in samples.items()},
             ms_per_step={v: 1e3 * m / F.n_steps for v, m in med.items()},
             four_over_one=ratio, four_over_alone=med["four"] / med["alone"],
             mixed_over_one=med["mixed"] / med["one"], one_over_off=med["one"] / med["off"])
  if F.engine:
    res["engine"] = engine_rates(cfg, params, sets, dtype)
  print(res, flush=True)
  common.write_json(F.out, res)
  if not F.tiny:
    if F.engine:
      common.merge_summary([{
          "name": "multi_adapter_b32_engine_cost_ratio",
          "measured": round(res["engine"]["one_over_four"], 4), "target": TARGET,
          "unit": "x (Engine decode tok/s, 32 requests on one adapter / over 4 adapters)",
          "met": res["engine"]["one_over_four"] <= TARGET,
          "command": "python experiments/bench/multi_adapter_bench.py"}])
    common.merge_summary([{
        "name": "multi_adapter_b32_cost_ratio", "measured": round(ratio, 4), "target": TARGET,
        "unit": "x (decode time, 32 rows over 4 rank-50 adapters / 32 rows on one)",
        "met": ratio <= TARGET,
        "command": "python experiments/bench/multi_adapter_bench.py"}])


def engine_rates(cfg, params, sets, dtype) -> dict:
  """The batch served by `Engine` with the adapters numbered 0..K-1: decode tokens/s with
  every request on adapter 0 and with request b on adapter b % K (interleaved runs, median)."""
  import numpy as np

  import bench_engine
  import strata_jax as sj
  B, K = F.batch, len(sets)
  model = bench_engine.bench_model(cfg, params, dtype, F.tiny)
  eng = sj.Engine(model, lora=list(sets), slots=B, decode_steps=(16,),
                  max_seq=max(256, 1 << (F.prompt + F.new).bit_length()))
  rng = np.random.default_rng(0)
  choices = {"one": [[{"id": 0, "scale": 1.0}]] * B,
             "four": [[{"id": b % K, "scale": 1.0}] for b in range(B)]}
  rates = {v: [] for v in choices}
  for rep in range(F.engine_reps + 1):   # the first run compiles and is not counted
    for v, loras in choices.items():
      prompts = bench_engine._prompts(rng, B, F.prompt, cfg.vocab_size)
      rate, _, _ = bench_engine.engine_run(eng, prompts, F.new, {}, loras)
      if rep:
        rates[v].append(rate)
  med = {v: statistics.median(r) for v, r in rates.items()}
  return dict(tok_s=med, runs_tok_s=rates, one_over_four=med["one"] / med["four"],
              batch=B, prompt=F.prompt, new=F.new)


if __name__ == "__main__":
  app.run(main)
