"""Run in its own process (fake CPU devices must be set before JAX starts):
python tests/split_check.py N_DEVICES  -> prints one JSON line of results.
python tests/split_check.py mp PROCESS_ID PORT  -> one of two processes under jax.distributed
  (one CPU device each, coordinator on 127.0.0.1:PORT; with STRATA_SPLIT_REAL=1 and
  CUDA_VISIBLE_DEVICES=i, one GPU each); the split puts a stage on each process's device;
  the unsplit reference runs locally in each process."""
import json
import os
import sys
import time

T0 = time.perf_counter()

MP = sys.argv[1] == "mp"
n_dev = 2 if MP else int(sys.argv[1])
REAL = os.environ.get("STRATA_SPLIT_REAL") == "1"   # real accelerators (device machine)
if MP and not REAL:
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = " ".join(   # one CPU device a process; other flags stay
      f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)
elif not REAL:
  # appended: the test run's own flags (conftest) stay
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={n_dev}")
  os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(__file__))

import dataclasses  # noqa: E402
import logging  # noqa: E402

import jax  # noqa: E402

if MP:  # before anything else touches JAX
  from strata_jax.parallel import distributed  # noqa: E402
  distributed.initialize(f"127.0.0.1:{sys.argv[3]}", 2, int(sys.argv[2]))

import numpy as np  # noqa: E402
from model_fixtures import TINY, random_lora, tiny_model  # noqa: E402

import strata_jax as sj  # noqa: E402
from strata_jax import steps  # noqa: E402
from strata_jax.engine.engine import Request  # noqa: E402
from strata_jax.parallel.plan import plan_layer_split  # noqa: E402

if REAL:
  jax.config.update("jax_default_matmul_precision", "highest")
  # One autotuning result per fusion for every program (the unsplit model and each stage):
  # JAX's persistent cache carries XLA's per-fusion autotune cache, so a stage's GEMMs get
  # the configuration the unsplit program's identical fusions got instead of re-timing them
  # (timed picks differ from program to program, and so do the last bits of the logits).
  if os.environ.get("STRATA_SPLIT_SHARED_AUTOTUNE", "1") == "1":
    import tempfile
    cache = os.environ.get("STRATA_SPLIT_JAX_CACHE") or tempfile.mkdtemp(prefix="split-jax-")
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
else:
  # the test run's cache, under two processes too, as the CLI's `_compilation_cache` does
  # (JAX writes it from process 0 only): warm, the two-process check took 90 s here, 126 s
  # without it; cold (as in CI) the same
  cache = os.environ.get("STRATA_TEST_JAX_CACHE", "/tmp/strata-jax-test-cache")
  jax.config.update("jax_compilation_cache_dir", cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

logs = []
logging.getLogger("strata_jax").addHandler(type("H", (logging.Handler,), {
    "emit": lambda self, rec: logs.append(rec.getMessage())})())
logging.getLogger("strata_jax").setLevel(logging.INFO)

# STRATA_SPLIT_PERIODS repeats of the tiny model's 4-layer pattern (default 2: 8 layers). More
# periods keep every stage's layer scan longer than one step (XLA folds a one-step loop into
# its surroundings, which can re-fuse, and re-round, the first and last layer on the GPU).
PERIODS = int(os.environ.get("STRATA_SPLIT_PERIODS", "2"))
# with an MTP head (on the last stage; plain decoding never reads it) for the speculative checks
CFG = dataclasses.replace(TINY, layer_types=TINY.layer_types[:4] * PERIODS, n_mtp=1)
model = tiny_model(CFG)
lora = random_lora(CFG, seed=2)
prompts = [list(np.random.default_rng(i).integers(0, TINY.vocab_size, 20 + 7 * i))
           for i in range(3)]
switches = [True, False, True]


def run(m, lora_set, sw):
  eng = sj.Engine(m, lora=lora_set, slots=3, max_seq=96, block_size=32)
  res = eng.run([Request(tokens=p, max_tokens=5, lora=s, return_logits=True)
                 for p, s in zip(prompts, sw)])
  return eng, res


L = CFG.n_layers
split_spec = f"{L // 2},{L // 2}" if MP else "auto" if n_dev == 2 else \
    f"{3 * L // 8},{L // 4},{L - 3 * L // 8 - L // 4}"
ranges, devs = plan_layer_split(model, split_spec)
split_model = dataclasses.replace(model, layer_ranges=ranges, devices=devs)
out = {"devices": n_dev, "platform": jax.default_backend(), "processes": jax.process_count(),
       "layers": L, "xla_flags": os.environ.get("XLA_FLAGS", ""),
       "jax_cache": bool(jax.config.jax_compilation_cache_dir),
       "stage_processes": [d.process_index for d in devs]}
# The unsplit reference runs on process 0 (its own device, no collectives): every process
# holds the same split results (`to_host` broadcasts them), so one process compares for all.
REFERENCE = jax.process_index() == 0
seconds = {"start": time.perf_counter() - T0}


def lap(name):
  seconds[name] = round(time.perf_counter() - T0 - sum(seconds.values()), 1)


def one_pass(m):
  """`Engine(bucket_step=)`: a 100-token prompt with a state every block is one chunk that
  hands back three states from inside, per stage; then a prompt extending it (slot erased)
  resumes from the prefix cache."""
  eng = sj.Engine(m, lora=lora, slots=1, max_seq=160, block_size=32, state_every=1,
                  bucket_step=32)
  p = list(np.random.default_rng(7).integers(0, TINY.vocab_size, 100))
  sched = eng._schedule(0, len(p), 3, True)
  res = eng.generate(tokens=p, max_tokens=4, lora=True)
  eng._flush_snapshots()
  eng.erase_slot(0)
  follow = eng.generate(tokens=p + res.tokens + [7], max_tokens=3, lora=True)
  return sched, res.tokens, follow.tokens, follow.cached_tokens


# The reference first, before the split's collectives.
if REFERENCE:
  single_eng, single = run(model, lora, switches)
lap("reference")
eng, split = run(split_model, lora, switches)
lap("split")
out["ranges"] = [list(st.layers) for st in eng.stages]
out["stage_devices"] = [str(st.device) for st in eng.stages]
if REFERENCE:
  out["same_tokens"] = all(a.tokens == b.tokens for a, b in zip(single, split))
  out["max_logit_err"] = max(float(np.abs(a.step_logits - b.step_logits).max())
                             for a, b in zip(single, split))
  out["max_prompt_logit_err"] = max(float(np.abs(a.prompt_logits - b.prompt_logits).max())
                                    for a, b in zip(single, split))
n_prog = (steps.prefill._cache_size(), steps.decode._cache_size())
_, split_off = run(split_model, lora, [False] * 3)
_, split_on = run(split_model, lora, [True] * 3)
lap("off_on")
out["programs_stable"] = (steps.prefill._cache_size(), steps.decode._cache_size()) == n_prog
_, split_none = run(split_model, None, [None] * 3)
lap("none")
out["off_bit_identical"] = all(
    np.array_equal(a.step_logits, b.step_logits)
    and np.array_equal(a.prompt_logits, b.prompt_logits)
    for a, b in zip(split_off, split_none))
out["mixed_rows_match"] = all(
    np.array_equal(split[i].step_logits, (split_on if s else split_off)[i].step_logits)
    for i, s in enumerate(switches))
out["stage_params_on_device"] = all(
    {d for a in jax.tree.leaves(st.params) for d in a.sharding.device_set} == {st.device}
    for st in eng.stages)


def spec_checks():
  """Speculative decoding on the split engine (one process): greedy rounds with the MTP head,
  sampled rows on the device's rule (temperature 1, top-k 1: a point mass) and rows on the
  host's rule (greedy rows that want their logits) give the plain split engine's tokens; a
  prompt-lookup drafter that knows the answer (row 0 fully, row 1 with its last draft
  wrong, row 2 never) makes the rows accept different lengths in the same rounds, and every
  stage's state then equals the plain split engine's, which decoded the same tokens one at a
  time."""
  from tolerances import SPEC_STATE_REL_FP32, assert_state_close  # noqa: PLC0415

  from strata_jax import speculative  # noqa: PLC0415

  def go(spec, draft=None, **kw):
    eng = sj.Engine(split_model, lora=lora, slots=3, max_seq=96, block_size=32, draft=draft)
    res = eng.run([Request(tokens=p, max_tokens=12, lora=s, spec=spec, **kw)
                   for p, s in zip(prompts, switches)])
    return eng, [r.tokens for r in res], [r.draft for r in res]

  plain_eng, plain, _ = go(0)
  # prompt lookup: the oracle drafter below (random prompts rarely repeat an n-gram)
  got = {"mtp": go(3, "mtp")[1], "device_rule": go(3, "mtp", temperature=1.0, top_k=1)[1],
         "host_rule": go(3, "mtp", return_step_logits=True)[1]}
  out["spec_split_same_tokens"] = {k: v == plain for k, v in got.items()}

  def oracle(ctx, n):
    row = next(i for i, t in enumerate(prompts) if list(ctx[:len(t)]) == list(t))
    done = len(ctx) - len(prompts[row])
    d = list(plain[row][done:done + n])
    if row == 1 and d:
      d[-1] = (d[-1] + 1) % CFG.vocab_size
    return [(x + 1) % CFG.vocab_size for x in d] if row == 2 else d
  speculative.ngram_draft, keep = oracle, speculative.ngram_draft
  try:
    eng, toks, drafts = go(3, "ngram")
  finally:
    speculative.ngram_draft = keep
  out["spec_oracle_same_tokens"] = toks == plain
  out["spec_oracle_acceptance"] = [d["accepted"] / max(d["proposed"], 1) for d in drafts]
  try:
    for i, (st, ref) in enumerate(zip(eng.states, plain_eng.states)):
      assert_state_close(st, ref, rel=SPEC_STATE_REL_FP32, what=f"stage {i}")
    out["spec_oracle_states_match"] = True
  except AssertionError as e:
    out["spec_oracle_states_match"] = str(e)


if not MP:
  spec_checks()
else:   # stages on several processes: speculative requests are refused, naming why
  from strata_jax.errors import RequestError  # noqa: E402
  try:
    eng.submit(Request(tokens=prompts[0], max_tokens=2, spec=2))
    out["spec_refused"] = False
  except RequestError as e:
    out["spec_refused"] = str(e)
lap("spec")

# One-pass prefill with state points inside the chunk, then a resume from the prefix cache:
# on one process's devices only. Under two processes the CLI's split test runs the one-pass
# prefill (its default), and this leg cost the suite's longest test ~40 s of its ~100 s.
if not MP:
  single_pass = one_pass(model)
  split_pass = one_pass(split_model)
  lap("one_pass")
  out["one_pass_schedule"] = split_pass[0]
  out["one_pass_same"] = single_pass[1:] == split_pass[1:] and split_pass[3] == 96
out["logs"] = logs
out["seconds"] = seconds   # where the check's time goes (the suite's longest tests)
print(json.dumps(out))
