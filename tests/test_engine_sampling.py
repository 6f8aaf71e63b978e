"""The engine's device sampling and multi-step decode on the tiny model: greedy tokens equal
the one-step-per-dispatch path with a host argmax; a seeded request gives the same tokens
alone, among 7 others and in another slot; logprobs equal log_softmax of the step logits;
stop ids end a row on the device; warmup compiles what the first request uses (the prefix-cache
hit's bit-identical logits: tests/test_engine.py)."""
import jax.numpy as jnp
import numpy as np
import pytest
from model_fixtures import TINY, tiny_model
from tolerances import KERNEL_REL, ROW_COUNT_REL_FP32, assert_close

import strata_jax as sj
from strata_jax import steps
from strata_jax.engine.engine import Request
from strata_jax.params import LORA_RANK_BUCKET, empty_lora
from strata_jax.state import init_state

BS = 32
KW = dict(max_seq=128, block_size=BS, decode_steps=(1, 4))


@pytest.fixture(scope="module")
def model():
  return tiny_model()


def _prompt(seed, n):
  return [int(t) for t in np.random.default_rng(seed).integers(0, TINY.vocab_size, n)]


def test_greedy_equals_one_step_dispatch_with_host_argmax(model):
  """Reference: the pre-sampling engine's algorithm (block-size prefill chunks, one `decode`
  per token, argmax of the logits on the host)."""
  prompt, n = _prompt(0, 70), 13
  cfg = model.cfg
  lora = empty_lora(cfg, LORA_RANK_BUCKET, model.dtype)
  st = init_state(cfg, 1, KW["max_seq"])
  for pos in range(0, len(prompt), BS):
    chunk = np.zeros(BS, np.int32)
    part = prompt[pos:pos + BS]
    chunk[:len(part)] = part
    logits, st = steps.prefill(cfg, model.params, lora, st, jnp.int32(0), jnp.asarray(chunk),
                               jnp.int32(len(part)), jnp.int32(0))
  want = [int(np.argmax(np.asarray(logits)))]
  one = jnp.ones(1, jnp.int32)
  while len(want) < n:
    logits, st = steps.decode(cfg, model.params, lora, st, jnp.asarray([want[-1]], jnp.int32),
                              0 * one, one)
    want.append(int(np.argmax(np.asarray(logits)[0])))
  eng = sj.Engine(model, slots=1, **KW)
  assert eng.generate(tokens=prompt, max_tokens=n).tokens == want


def test_seeded_request_ignores_neighbours_and_slot(model):
  mine = Request(tokens=_prompt(1, 20), max_tokens=13, temperature=0.9, top_p=0.9, seed=77)
  others = [Request(tokens=_prompt(10 + i, 5 + i), max_tokens=13, seed=i,
                    **[dict(), dict(temperature=1.2), dict(temperature=0.7, top_k=5),
                       dict(temperature=1.0, min_p=0.1, repeat_penalty=1.3),
                       dict(temperature=0.8, top_p=0.5, presence_penalty=0.5),
                       dict(frequency_penalty=0.4), dict(temperature=0.5, top_k=100)][i])
            for i in range(7)]
  alone = sj.Engine(model, slots=1, **KW).run([mine])[0]
  batch = sj.Engine(model, slots=8, **KW)
  first = batch.run([mine] + others)[0]
  last = batch.run(others + [mine])[-1]
  assert first.slot != last.slot
  assert alone.tokens == first.tokens == last.tokens
  assert len(alone.tokens) == 13
  # a neighbour asking for logits and logprobs (one step per dispatch) changes nothing either
  watched = Request(tokens=_prompt(30, 9), max_tokens=13, temperature=1.1, seed=5, logprobs=3,
                    return_step_logits=True)
  both = batch.run([watched, mine])
  assert both[1].tokens == alone.tokens
  r = both[0]
  z = r.step_logits.astype(np.float64)
  lsm = z - z.max(-1, keepdims=True)
  lsm -= np.log(np.exp(lsm).sum(-1, keepdims=True))
  assert [e["token"] for e in r.logprobs] == r.tokens and r.step_logits.shape == (13, 256)
  got = np.array([e["logprob"] for e in r.logprobs])
  assert_close(got, lsm[np.arange(13), r.tokens], rel=KERNEL_REL["float32"], what="logprob")
  for i, e in enumerate(r.logprobs):
    ids = list(e["top"])
    assert ids == list(np.argsort(-lsm[i], kind="stable")[:3])
    assert_close(list(e["top"].values()), lsm[i, ids], rel=KERNEL_REL["float32"], what="top")


def test_stop_id_ends_the_row_on_the_device(model):
  """A stop id met inside a multi-step chunk: nothing after it is returned, and the slot's
  state holds exactly prompt + tokens[:-1] (a follow-up reuses it and equals a fresh run)."""
  eng = sj.Engine(model, slots=1, prefix_cache_bytes=0, **KW)
  p = _prompt(2, 20)
  free = eng.generate(tokens=p, max_tokens=13, temperature=1.0, seed=3).tokens
  stop = free[6]
  cut = free.index(stop)
  r = eng.generate(tokens=p, max_tokens=13, temperature=1.0, seed=3, stop=[stop])
  assert r.tokens == free[:cut + 1] and r.finish_reason == "stop"
  follow = p + r.tokens + [4]
  again = eng.generate(tokens=follow, max_tokens=5)
  assert again.cached_tokens == len(p) + len(r.tokens) - 1
  fresh = sj.Engine(model, slots=1, prefix_cache_bytes=0, **KW)
  assert fresh.generate(tokens=follow, max_tokens=5).tokens == again.tokens


def test_warmup_compiles_the_buckets_used(model):
  eng = sj.Engine(model, slots=1, warmup=[100, 64], merge_tail=True, **KW)
  programs = lambda: (steps.prefill._cache_size(), steps.prefill_cut._cache_size(),
                      steps.decode_sample._cache_size(), steps.read_kv._cache_size())
  sizes = programs()
  eng.generate(tokens=_prompt(4, 100), max_tokens=5)
  eng.generate(tokens=_prompt(5, 64), max_tokens=5)
  assert programs() == sizes   # the prefix cache's K/V slices too
  # 100 tokens: the 96 to the last full block and the 4 after it in one 128-token chunk that
  # hands back the state at 96; 64 (two full blocks): one chunk ending at the last block
  assert eng._schedule(0, 100, 3, True) == [(0, 100, 128, 96)]
  assert eng._schedule(0, 64, 2, True) == [(0, 64, 64, None)]


def test_decode_buckets_match_the_full_batch(model, monkeypatch):
  """decode_buckets=True: with idle slots the engine decodes only its running rows, gathered
  into the smallest power-of-two bucket (`steps.decode_sample_rows`), and writes them back:
  each request's tokens equal those of the default engine, which decodes all 8 slots every
  step, and its logprobs agree (to rounding: another batch size may round sums differently)."""
  used = []
  gathered = steps.decode_sample_rows

  def spy(*args, **kw):
    used.append(int(args[8].shape[0]))
    return gathered(*args, **kw)
  monkeypatch.setattr(steps, "decode_sample_rows", spy)
  modes = [dict(), dict(temperature=0.9, top_p=0.9), dict(temperature=0.7, top_k=5)]
  reqs = [Request(tokens=_prompt(40 + i, 6 + 5 * i), max_tokens=7 + 3 * i, seed=i, logprobs=2,
                  **modes[i]) for i in range(3)]
  results = {}
  for buckets in (True, False):
    eng = sj.Engine(model, slots=8, decode_buckets=buckets, **KW)
    results[buckets] = eng.run(reqs[:1]) + eng.run(reqs)
  assert set(used) == {1, 2, 4}   # one row alone; three rows, then two, then one
  for got, want in zip(results[True], results[False]):
    assert got.tokens == want.tokens
    assert_close([e["logprob"] for e in got.logprobs], [e["logprob"] for e in want.logprobs],
                 rel=ROW_COUNT_REL_FP32, what="logprobs, bucket vs full batch")
