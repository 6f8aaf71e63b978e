"""bench-a3b through the jitted steps: decode tokens/s, prefill tokens/s and the LoRA cost.

Model: bench-a3b (common.BENCH_A3B: 48 layers, attention every 4th, 64 experts top-10),
random bf16 weights drawn on the device. Adapter: rank 50 on ssm_out and attn_output of all
48 layers, in the layout an Engine places (`--lora_layout engine`: the rank zero-padded to 64
and a per-row scale table, as `AdapterTable`; runs before 56 measured `raw`, rank 50 and no
table, a layout no user path runs). Three adapter states, two compiled programs per shape:
  none  lora=None                        (the program without the hook)
  off   LoraParams loaded, switch zeros  (same program as `on`: the switch is data)
  on    LoraParams loaded, switch ones
Decode runs `steps.decode_greedy` (n_steps decode steps + on-device argmax in one program),
so tokens/s = B * n_steps / call time and host dispatch is not measured; `decode` stepped from
Python is timed beside it at batch 1 to show what one dispatch per token costs. Prefill runs
`steps.prefill` on one T-token chunk (state reset between calls, untimed). Variants are timed
in interleaved rounds (median), so clock drift hits them alike. The LoRA cost per layer is
(time with the switch on - time without adapter) / 48 inside the same 48-layer program:
decode batch 1 (1 token), batch 8 (8 tokens), prefill of 300 tokens.

  python experiments/bench/bench_model.py [--tiny]   # experiments/results/bench_model.json
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import gzip
import os
import statistics
import sys
import traceback

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

flags.DEFINE_bool("tiny", False, "toy geometry (CPU smoke test)")
flags.DEFINE_string("out", os.path.join(common.RESULTS, "bench_model.json"), "output JSON")
flags.DEFINE_string("kernels_json", os.path.join(common.RESULTS, "bench_kernels.json"),
                    "ceilings measured by bench_kernels.py (else the peers' figures)")
flags.DEFINE_string("batches", "1,8,32", "decode batch sizes")
flags.DEFINE_integer("n_steps", 32, "decode steps per program call")
flags.DEFINE_integer("max_seq", 512, "K/V capacity of the decode state")
flags.DEFINE_integer("decode_reps", 7, "timed rounds per decode variant")
flags.DEFINE_integer("prefill_tokens", 2500, "prompt length of the prefill measurement")
flags.DEFINE_integer("lora_tokens", 300, "prefill length of the LoRA-cost measurement")
flags.DEFINE_integer("prefill_reps", 5, "timed rounds per prefill variant")
flags.DEFINE_integer("compile_threads", 6, "programs compiled at once")
flags.DEFINE_bool("single_step", True, "also time decode stepped from Python (batch 1)")
flags.DEFINE_enum("lora_layout", "engine", ["engine", "raw"],
                  "the adapter's device layout: an Engine's (rank padded to 64, per-row table) "
                  "or the bare rank-50 LoraParams (runs before 56)")
flags.DEFINE_string("lora_impl", "", "Forms.lora_impl for the adapter programs ('' = default)")
flags.DEFINE_string("lora_alt_impl", "xla", "a second LoRA implementation (or a forms spec "
                    "NAME=VALUE,..., e.g. gemv_lora=rows) timed beside "
                    "the default at decode and at --lora_tokens (variants off@IMPL, on@IMPL; "
                    "'' = none; xla: at batch 1 on the GPU the LoRA ops after the dense GEMV "
                    "instead of its fused epilogue)")
flags.DEFINE_string("alt_batches", "1,8", "decode batches timed with --lora_alt_impl too")
flags.DEFINE_string("sections", "decode,prefill,lora,single", "what to build and time")
flags.DEFINE_string("dump_hlo", "decode_b1_none,decode_b1_lora,prefill_none",
                    "programs whose optimized HLO is "
                    "saved (gzip) under experiments/results/tmp/")
F = flags.FLAGS



def interleaved_rounds(names, call, reps, warmup=2):
  """`call(name)` -> seconds: `warmup` untimed rounds, then `reps` timed rounds in which
  every variant runs once in turn (clock drift hits them alike); {name: [seconds]}."""
  for _ in range(warmup):
    for v in names:
      call(v)
  samples = {v: [] for v in names}
  for _ in range(reps):
    for v in names:
      samples[v].append(call(v))
  return samples


class Bench:
  def __init__(self, res):
    import jax
    import jax.numpy as jnp

    from strata_jax import steps
    from strata_jax.state import init_state
    self.jax, self.jnp, self.steps, self.init_state = jax, jnp, steps, init_state
    self.res = res
    geom = common.TINY if F.tiny else common.BENCH_A3B
    self.dtype = jnp.bfloat16
    # the forms an Engine on this backend runs (Forms.resolve), so the programs are the users'
    from strata_jax.forms import Forms
    cfg = common.model_config(geom)
    self.cfg = cfg = dataclasses.replace(
        cfg, forms=Forms().resolve(jax.default_backend(), self.dtype))
    res["forms"] = dataclasses.asdict(cfg.forms)
    self.L = cfg.n_layers
    self.ceil = common.ceilings(common.read_json(F.kernels_json))
    res["ceilings"] = dict(copy_TBps=self.ceil["bw"] / 1e12,
                           matmul_TFLOPs=self.ceil["flops"] / 1e12,
                           source=self.ceil["source"])
    res["geometry"] = dict(geom, layer_types=cfg.layer_types, lora_rank=common.LORA_RANK,
                           lora_layout=F.lora_layout, dtype="bfloat16")
    t0 = common.now()
    self.params = common.device_params(cfg, self.dtype)
    make = common.engine_lora if F.lora_layout == "engine" else common.device_lora
    self.lora = make(cfg, common.LORA_RANK, self.dtype)
    wb = common.weight_bytes(cfg)
    res["model"] = dict(params=common.param_count(cfg), init_s=common.now() - t0,
                        active_bytes_per_token=common.decode_step_bytes(cfg, 1, 0)["weights"],
                        weight_bytes=wb)
    print("model", res["model"], flush=True)
    self.programs, self.prog_info = {}, {}

  # -- programs --------------------------------------------------------------------------
  def state_abs(self, B, S):
    return self.jax.eval_shape(lambda: self.init_state(self.cfg, B, S, self.dtype))

  def with_lora_impl(self, impl):
    """The model config with `impl` as its LoRA implementation (forms are static config), or,
    for a forms spec `NAME=VALUE,...` (e.g. `gemv_lora=rows`), with those forms changed."""
    from strata_jax.forms import parse_forms
    forms = (parse_forms(impl, base=self.cfg.forms) if "=" in impl
             else dataclasses.replace(self.cfg.forms, lora_impl=impl))
    return dataclasses.replace(self.cfg, forms=forms)

  def specs(self, alt=False):
    """name -> zero-argument function returning the lowered program. alt: only the adapter
    programs that --lora_alt_impl is timed with (lowered with that implementation)."""
    jax, jnp, steps = self.jax, self.jnp, self.steps
    cfg = self.with_lora_impl(F.lora_alt_impl) if alt else self.cfg
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    kinds = ("lora",) if alt else ("none", "lora")
    sfx = f"@{F.lora_alt_impl}" if alt else ""
    out = {}
    alt_b = [int(b) for b in F.alt_batches.split(",") if b]
    for B in self.batches:
      if alt and B not in alt_b:
        continue
      for kind in kinds:
        lp = self.lora if kind == "lora" else None
        out[f"decode_b{B}_{kind}{sfx}"] = (lambda B=B, lp=lp: steps.decode_greedy.lower(
            cfg, self.params, lp, self.state_abs(B, F.max_seq), i32(B), i32(B), i32(B),
            n_steps=F.n_steps))
    if not self.want("decode"):
      out = {}
    if F.single_step and self.want("single") and 1 in self.batches and not alt:
      out["decode_b1_single"] = lambda: steps.decode.lower(
          cfg, self.params, None, self.state_abs(1, F.max_seq), i32(1), i32(1), i32(1))
    for tag, T in (("prefill", self.T), ("lora", self.T_lora)):
      if (alt and tag == "prefill") or not self.want(tag):
        continue
      for kind in kinds:
        lp = self.lora if kind == "lora" else None
        out[f"{tag}_{kind}{sfx}"] = (lambda T=T, lp=lp: steps.prefill.lower(
            cfg, self.params, lp, self.state_abs(1, self.seq_for(T)), i32(), i32(T), i32(),
            i32()))
    return out

  def _lower(self, specs, lowered):
    for name, fn in specs.items():
      t0 = common.now()
      try:
        lowered[name] = fn()
        self.prog_info[name] = dict(lower_s=common.now() - t0)
      except Exception as e:
        self.prog_info[name] = dict(error=f"lower: {type(e).__name__}: {str(e)[:1500]}")
        print("LOWER ERROR", name, traceback.format_exc()[-3000:], flush=True)

  def want(self, section):
    return section in F.sections.split(",")

  def seq_for(self, T):
    return -(-T // 256) * 256

  def compile_all(self):
    lowered = {}
    self._lower(self.specs(), lowered)
    if F.lora_alt_impl:
      # The implementation is a field of the config's forms: the alternates are other programs.
      self._lower(self.specs(alt=True), lowered)

    def comp(name):
      t0 = common.now()
      try:
        return name, lowered[name].compile(), common.now() - t0, None
      except Exception as e:
        return name, None, common.now() - t0, f"compile: {type(e).__name__}: {str(e)[:1500]}"

    t0 = common.now()
    with cf.ThreadPoolExecutor(max(1, F.compile_threads)) as ex:
      for name, prog, dt, err in ex.map(comp, list(lowered)):
        info = self.prog_info[name]
        info["compile_s"] = dt
        if err:
          info["error"] = err
          print("COMPILE ERROR", name, err, flush=True)
          continue
        self.programs[name] = prog
        try:
          text = prog.as_text()
          info["hlo"] = common.hlo_counts(text)
          if name in F.dump_hlo.split(","):
            os.makedirs(common.TMP, exist_ok=True)
            with gzip.open(os.path.join(common.TMP, f"hlo_{name}.txt.gz"), "wt") as f:
              f.write(text)
          mem = prog.memory_analysis()
          if mem is not None:
            info["temp_bytes"] = int(getattr(mem, "temp_size_in_bytes", -1))
        except Exception as e:
          info["introspect_error"] = repr(e)[:300]
        print("compiled", name, {k: v for k, v in info.items() if k != "hlo"}, flush=True)
    self.res["compile_wall_s"] = common.now() - t0
    self.res["programs"] = self.prog_info

  def fallback_lora_impl(self):
    """If an adapter program failed with the default LoRA implementation, retry with 'xla'."""
    failed = [n for n, i in self.prog_info.items() if "error" in i and n.endswith("_lora")]
    if not failed or F.lora_impl == "xla":
      return
    self.cfg = self.with_lora_impl("xla")
    self.res["lora_impl_fallback"] = dict(failed=failed, retried_with="xla",
                                          errors={n: self.prog_info[n]["error"] for n in failed})
    specs = self.specs()
    for name in failed:
      t0 = common.now()
      try:
        self.programs[name] = specs[name]().compile()
        self.prog_info[name] = dict(compile_s=common.now() - t0, lora_impl="xla (fallback)")
      except Exception as e:
        self.prog_info[name]["error_xla"] = f"{type(e).__name__}: {str(e)[:800]}"

  # -- measurements ----------------------------------------------------------------------
  def _variants(self, prefix):
    """variant -> (program, lora, switch value): none / off / on, and off@IMPL / on@IMPL."""
    get = self.programs.get
    out = {"none": (get(f"{prefix}_none"), None, 0), "off": (get(f"{prefix}_lora"), self.lora, 0),
           "on": (get(f"{prefix}_lora"), self.lora, 1)}
    if F.lora_alt_impl:
      alt = get(f"{prefix}_lora@{F.lora_alt_impl}")
      out[f"off@{F.lora_alt_impl}"] = (alt, self.lora, 0)
      out[f"on@{F.lora_alt_impl}"] = (alt, self.lora, 1)
    return {k: v for k, v in out.items() if v[0] is not None}

  def _summ(self, samples, base_key="none"):
    """Per-variant stats, and the on/off deltas both as a difference of medians and as the
    median of per-round paired differences (robust to drift between rounds)."""
    out = {v: common.summarize(s) for v, s in samples.items()}
    if base_key in samples:
      for v in samples:
        if v != base_key:
          pairs = [a - b for a, b in zip(samples[v], samples[base_key], strict=True)]
          out[v]["delta_median_s"] = out[v]["median"] - out[base_key]["median"]
          out[v]["delta_paired_s"] = statistics.median(pairs)
    return out

  def decode(self, B):
    jax, jnp, cfg = self.jax, self.jnp, self.cfg
    progs = self._variants(f"decode_b{B}")
    if not progs:
      return
    states = {v: self.init_state(cfg, B, F.max_seq, self.dtype) for v in progs}
    toks = {v: jax.random.randint(jax.random.key(B), (B,), 0, cfg.vocab_size, jnp.int32)
            for v in progs}
    act = jnp.ones((B,), jnp.int32)

    sws = {0: jnp.zeros((B,), jnp.int32), 1: jnp.ones((B,), jnp.int32)}

    def call(v):
      prog, lp, s = progs[v]
      sw = sws[s]
      t0 = common.now()
      out, states[v] = prog(self.params, lp, states[v], toks[v], sw, act)
      out = jax.block_until_ready(out)
      dt = common.now() - t0
      toks[v] = out[-1]
      return dt

    samples = interleaved_rounds(progs, call, F.decode_reps)
    N = F.n_steps
    res = self._summ(samples)
    for r in res.values():
      r["step_us"] = r["median"] / N * 1e6
      r["tokens_per_s"] = B * N / r["median"]
    ctx = (2 + F.decode_reps) * N // 2
    byt = common.decode_step_bytes(cfg, B, ctx)
    rf_w = B / (byt["weights"] / self.ceil["bw"])
    rf_all = B / (byt["total"] / self.ceil["bw"])
    entry = dict(batch=B, n_steps=N, max_seq=F.max_seq, variants=res, step_bytes=byt,
                 roofline_tokens_per_s_weights=rf_w, roofline_tokens_per_s_with_state=rf_all)
    if "none" in res:
      entry["roofline_fraction"] = res["none"]["tokens_per_s"] / rf_w
      entry["roofline_fraction_with_state"] = res["none"]["tokens_per_s"] / rf_all
      for v in res:
        if v != "none":
          d = res[v]["delta_paired_s"] / N
          entry[f"lora_{v}_slowdown_pct"] = 100 * d / (res["none"]["median"] / N)
          entry[f"lora_{v}_us_per_layer"] = d / self.L * 1e6
    # the tokens the three variants produced agree for none/off (a quick bitwise check)
    if "none" in toks and "off" in toks:
      entry["off_tokens_equal_none"] = bool(jnp.array_equal(toks["none"], toks["off"]))
    self.res.setdefault("decode", {})[str(B)] = entry
    print("decode", B, {k: v for k, v in entry.items() if k not in ("variants", "step_bytes")},
          {v: round(r["tokens_per_s"], 1) for v, r in res.items()}, flush=True)

  def decode_single(self):
    jax, jnp, cfg = self.jax, self.jnp, self.cfg
    prog = self.programs.get("decode_b1_single")
    if prog is None:
      return
    argmax = jax.jit(lambda lg: jnp.argmax(lg, axis=-1).astype(jnp.int32))
    st = self.init_state(cfg, 1, F.max_seq, self.dtype)
    tok = jnp.zeros((1,), jnp.int32)
    sw, act = jnp.zeros((1,), jnp.int32), jnp.ones((1,), jnp.int32)
    N = F.n_steps

    def run():
      nonlocal st, tok
      t0 = common.now()
      for _ in range(N):
        lg, st = prog(self.params, None, st, tok, sw, act)
        tok = argmax(lg)
      jax.block_until_ready(tok)
      return common.now() - t0

    run()
    r = common.summarize([run() for _ in range(max(3, F.decode_reps // 2))])
    r["step_us"] = r["median"] / N * 1e6
    r["tokens_per_s"] = N / r["median"]
    self.res["decode_single_step_b1"] = r
    print("decode single-step b1", r, flush=True)

  def prefill(self, tag, T):
    jax, jnp, cfg = self.jax, self.jnp, self.cfg
    progs = self._variants(tag)
    if not progs:
      return
    S = self.seq_for(T)
    states = {v: self.init_state(cfg, 1, S, self.dtype) for v in progs}
    tokens = jax.random.randint(jax.random.key(T), (T,), 0, cfg.vocab_size, jnp.int32)
    slot, nv, one = jnp.int32(0), jnp.int32(T), jnp.ones((1,), jnp.int32)
    sws = {0: jnp.int32(0), 1: jnp.int32(1)}

    def call(v):
      prog, lp, s = progs[v]
      states[v] = jax.block_until_ready(self.steps.reset_rows(states[v], one))
      t0 = common.now()
      logits, states[v] = prog(self.params, lp, states[v], slot, tokens, nv, sws[s])
      logits = jax.block_until_ready(logits)
      dt = common.now() - t0
      if not bool(jnp.isfinite(logits).all()):
        self.res.setdefault("warnings", []).append(f"{tag} {v}: non-finite logits")
      return dt

    samples = interleaved_rounds(progs, call, F.prefill_reps)
    res = self._summ(samples)
    for r in res.values():
      r["tokens_per_s"] = T / r["median"]
    fl = common.prefill_flops(cfg, T)
    wbytes = 2 * common.param_count(cfg)
    roof_s = max(fl["total"] / self.ceil["flops"], wbytes / self.ceil["bw"])
    entry = dict(tokens=T, max_seq=S, variants=res, flops=fl, weight_bytes=wbytes,
                 roofline_s=roof_s, roofline_tokens_per_s=T / roof_s)
    if "none" in res:
      entry["roofline_fraction"] = res["none"]["tokens_per_s"] / entry["roofline_tokens_per_s"]
      entry["achieved_TFLOPs_useful"] = fl["total"] / res["none"]["median"] / 1e12
      for v in res:
        if v != "none":
          d = res[v]["delta_paired_s"]
          entry[f"lora_{v}_slowdown_pct"] = 100 * d / res["none"]["median"]
          entry[f"lora_{v}_us_per_layer"] = d / self.L * 1e6
    self.res.setdefault("prefill" if tag == "prefill" else "lora_prefill", {})[str(T)] = entry
    print(tag, T, {k: v for k, v in entry.items() if k not in ("variants", "flops")},
          {v: round(r["tokens_per_s"], 1) for v, r in res.items()}, flush=True)

  def lora_roofline(self):
    self.res["lora_roofline_us_per_layer"] = {
        str(n): common.lora_roofline_us(self.cfg, n, self.ceil) for n in (1, 8, self.T_lora)}

  def run(self):
    if F.tiny:  # the smoke test checks the plumbing, not the numbers
      F.n_steps, F.decode_reps, F.prefill_reps = 4, 2, 2
      if F.lora_alt_impl == "pallas":  # compiled Pallas needs a GPU
        F.lora_alt_impl = "xla"
    self.batches = [int(b) for b in F.batches.split(",")]
    self.T = 100 if F.tiny else F.prefill_tokens
    self.T_lora = 30 if F.tiny else F.lora_tokens
    if F.lora_impl:
      self.cfg = self.with_lora_impl(F.lora_impl)
    from pallas_kernels.lora import api as lora_api
    self.res["lora_impl"] = {str(n): lora_api.resolve(self.cfg.forms.lora_impl, n)
                             for n in (*self.batches, self.T_lora, self.T)}
    if F.lora_alt_impl and "=" in F.lora_alt_impl:   # a forms spec
      self.res["lora_alt_forms"] = dataclasses.asdict(self.with_lora_impl(F.lora_alt_impl).forms)
    elif F.lora_alt_impl:
      self.res["lora_alt_impl"] = {str(n): lora_api.resolve(F.lora_alt_impl, n)
                                   for n in (*self.batches, self.T_lora)}
    self.compile_all()
    self.fallback_lora_impl()
    common.write_json(F.out, self.res)
    self.lora_roofline()
    order = [("decode", 1), ("decode", 8), ("prefill", None), ("lora", None), ("decode", 32),
             ("single", None)]
    order += [("decode", b) for b in self.batches if b not in (1, 8, 32)]
    for what, arg in order:
      try:
        if what == "decode" and arg in self.batches:
          self.decode(arg)
        elif what == "prefill":
          self.prefill("prefill", self.T)
        elif what == "lora":
          self.prefill("lora", self.T_lora)
        elif what == "single" and F.single_step:
          self.decode_single()
      except Exception as e:
        self.res.setdefault("errors", {})[f"{what}{arg or ''}"] = \
            f"{type(e).__name__}: {str(e)[:1500]}"
        print("ERROR", what, arg, traceback.format_exc()[-3000:], flush=True)
      common.write_json(F.out, self.res)


def main(_):
  import jax
  res = {"jax": jax.__version__, "backend": jax.default_backend(),
         "device": jax.devices()[0].device_kind, "tiny": F.tiny,
         "flags": {k: F[k].value for k in ("batches", "n_steps", "max_seq", "decode_reps",
                                           "prefill_tokens", "lora_tokens", "prefill_reps",
                                           "compile_threads", "lora_impl",
                                           "lora_alt_impl")},
         "xla_flags": os.environ.get("XLA_FLAGS", "")}
  t0 = common.now()
  try:
    Bench(res).run()
  except Exception as e:
    res.setdefault("errors", {})["setup"] = f"{type(e).__name__}: {str(e)[:1500]}"
    print("ERROR", traceback.format_exc()[-3000:], flush=True)
  res["wall_s"] = common.now() - t0
  common.write_json(F.out, res)


if __name__ == "__main__":
  app.run(main)
