"""The device sampler (`strata_jax.sampling`) as pure functions: drawn frequencies match the
filtered softmax (chi-square, strong enough to fail a 5 % temperature error), greedy is argmax,
a row's draw ignores its neighbours, llama.cpp's penalties, logprobs = log_softmax."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats
from tolerances import KERNEL_REL, assert_close

from strata_jax import sampling as smp
from strata_jax.engine import sampling as host_sampling
from strata_jax.engine.engine import Request

V = 16
LOGITS = np.linspace(-3.0, 3.0, V).astype(np.float32)[np.random.default_rng(0).permutation(V)]
N = 40_000          # draws per configuration
# draws per configuration of the frequency test: enough that a 5 % temperature error is
# rejected with near certainty (chi-square noncentrality >= 80 for every case; at 40,000 the
# nucleus cases sat near 24, against a critical value of 23.5)
N_FREQ = 160_000
ALPHA = 1e-4        # chi-square false-alarm rate


def _params(n, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, presence=0.0, frequency=0.0,
            repeat=1.0, seeds=None):
  f = lambda v: jnp.full((n,), v, jnp.float32)
  seeds = np.arange(n, dtype=np.uint64) if seeds is None else np.asarray(seeds, np.uint64)
  return smp.SamplingParams(
      temperature=f(temperature), top_k=jnp.full((n,), top_k, jnp.int32), top_p=f(top_p),
      min_p=f(min_p), presence=f(presence), frequency=f(frequency), repeat=f(repeat),
      seed_lo=jnp.asarray(seeds & 0xFFFFFFFF, jnp.uint32),
      seed_hi=jnp.asarray(seeds >> 32, jnp.uint32))


@functools.partial(jax.jit, static_argnames=("plan",))
def _choose(logits, recent, sp, step, plan):
  return smp.choose(logits, recent, sp, step, plan)


def _draw(sp, plan, logits=LOGITS, step=0):
  n = sp.temperature.shape[0]
  lg = jnp.broadcast_to(jnp.asarray(logits), (n, logits.shape[-1]))
  recent = jnp.full((n, smp.RECENT), -1, jnp.int32)
  return np.asarray(_choose(lg, recent, sp, jnp.full((n,), step, jnp.int32), plan)[0])


def _want(T, top_k=0, top_p=1.0, min_p=0.0, logits=LOGITS):
  """float64 reference of the filtered, tempered distribution."""
  z = logits.astype(np.float64) / T
  order = np.argsort(-z, kind="stable")
  p = np.exp(z - z.max())
  p /= p.sum()
  keep = np.zeros(z.size, bool)
  if top_k:
    keep[order[:top_k]] = True
  else:
    keep[:] = True
  q = np.where(keep, p, 0.0)
  q /= q.sum()
  if top_p < 1.0:
    cum = np.cumsum(q[order]) - q[order]
    drop = order[cum >= top_p]
    drop = drop[drop != order[0]]
    q[drop] = 0.0
  q = np.where(q >= min_p * q.max(), q, 0.0)
  return q / q.sum()


def _chi2(counts, want):
  """Chi-square statistic and its critical value at ALPHA over the bins want > 0; a count in a
  bin of probability 0 is an infinite statistic."""
  if np.any(counts[want == 0]):
    return np.inf, 0.0
  m = want > 0
  e = want[m] * counts.sum()
  stat = float(((counts[m] - e) ** 2 / e).sum())
  return stat, float(stats.chi2.ppf(1 - ALPHA, m.sum() - 1))


CASES = [  # (plan path, parameters)
    ("full", dict(temperature=0.8)),
    ("full", dict(temperature=1.3, min_p=0.05)),
    ("cap", dict(temperature=0.8, top_k=6)),
    ("nucleus", dict(temperature=0.8, top_p=0.9)),
    ("nucleus", dict(temperature=1.0, top_k=0, top_p=0.85, min_p=0.05)),
]


@pytest.mark.parametrize("path,kw", CASES, ids=[f"{p}-{i}" for i, (p, _) in enumerate(CASES)])
def test_frequencies_follow_filtered_softmax(path, kw):
  plan = smp.Plan(**{path: True})
  counts = np.bincount(_draw(_params(N_FREQ, **kw), plan), minlength=V)
  want = _want(kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0), kw.get("min_p", 0.0))
  stat, crit = _chi2(counts, want)
  assert stat < crit, (stat, crit)
  # the test's strength: the same draws reject the distribution of a 5 % temperature error
  wrong = _want(kw["temperature"] * 1.05, kw.get("top_k", 0), kw.get("top_p", 1.0),
                kw.get("min_p", 0.0))
  assert _chi2(counts, wrong)[0] > crit


# Ties at the boundaries: 10 levels of 10 equal logits, ids shuffled. Top-k 65 keeps the 6 top
# levels and the 5 lowest ids of the 7th; top-p 0.5 ends inside a level, keeping its lowest ids
# (a stable descending sort's order); each dropped tie drawn even once fails the test.
TIES = np.repeat(np.linspace(2.0, -2.5, 10), 10).astype(np.float32)[
    np.random.default_rng(1).permutation(100)]


@pytest.mark.parametrize("kw", [dict(temperature=1.0, top_k=65),
                                dict(temperature=1.0, top_p=0.5),
                                dict(temperature=0.9, top_k=80, top_p=0.9, min_p=0.02)],
                         ids=["top_k_65", "top_p_0.5", "top_k_80_p_0.9_min_p"])
def test_nucleus_ties_break_by_lower_id_and_frequencies_follow(kw):
  plan = host_sampling.plan_for([Request(tokens=[0], **kw)])   # the engine's own plan
  assert plan.nucleus and plan.nucleus_top_k == ("top_k" in kw)
  counts = np.bincount(_draw(_params(N, **kw), plan, logits=TIES), minlength=TIES.size)
  want = _want(kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0),
               kw.get("min_p", 0.0), logits=TIES)
  assert 0 < np.count_nonzero(want) < TIES.size
  stat, crit = _chi2(counts, want)
  assert stat < crit, (stat, crit)


def test_nucleus_mask_equals_a_stable_sorts_prefix():
  """The bisected nucleus is exactly the prefix of a stable descending sort whose mass
  before each kept entry is below top_p, on random rows and on rows with many ties."""
  rng = np.random.default_rng(7)
  rows = np.concatenate([rng.standard_normal((6, 500)) * 2,
                         np.round(rng.standard_normal((6, 500))),          # heavy ties
                         np.zeros((1, 500))]).astype(np.float32)          # all tied
  top_p = np.array([0.1, 0.5, 0.9, 0.95, 0.99, 0.3] * 2 + [0.371], np.float32)
  z = jnp.asarray(rows)
  p = jax.nn.softmax(z, axis=-1)
  got = np.asarray(jax.jit(smp._nucleus_mask)(p, jnp.asarray(top_p)))
  p = np.asarray(p)
  for r in range(len(rows)):
    order = np.argsort(-p[r], kind="stable")
    before = np.cumsum(p[r][order].astype(np.float64)) - p[r][order]
    want = np.zeros(p.shape[1], bool)
    want[order[(before < top_p[r]) | (np.arange(p.shape[1]) == 0)]] = True
    # float32 sums against float64 ones may differ for an entry whose mass-before is within
    # rounding of top_p; none of these rows has one (checked by the margin)
    assert np.min(np.abs(before - top_p[r])) > 1e-5
    np.testing.assert_array_equal(got[r], want, err_msg=f"row {r}")


def test_top_k_mask_equals_lax_top_k():
  rng = np.random.default_rng(8)
  z = np.concatenate([rng.standard_normal((4, 300)),
                      np.round(rng.standard_normal((4, 300)) * 2),
                      -np.abs(rng.standard_normal((1, 300)))]).astype(np.float32)
  z[0, :10] = -np.inf
  k = np.array([1, 65, 150, 299, 70, 100, 3, 200, 120], np.int32)
  got = np.asarray(jax.jit(smp._top_k_mask)(jnp.asarray(z), jnp.asarray(k)))
  for r in range(len(z)):
    _, ids = jax.lax.top_k(jnp.asarray(z[r]), int(k[r]))
    want = np.zeros(z.shape[1], bool)
    want[np.asarray(ids)] = True
    np.testing.assert_array_equal(got[r], want, err_msg=f"row {r}")


def test_five_percent_temperature_error_fails():
  """A sampler that uses T * 1.05 is caught by the chi-square test above."""
  counts = np.bincount(_draw(_params(N, temperature=0.84), smp.Plan(full=True)), minlength=V)
  stat, crit = _chi2(counts, _want(0.8))
  assert stat > crit, (stat, crit)


def test_greedy_rows_are_argmax():
  rng = np.random.default_rng(1)
  logits = rng.standard_normal((64, 1000)).astype(np.float32)
  logits[:, 7] = logits.max(axis=1)   # ties: the lower id wins, as jnp.argmax
  sp = _params(64, temperature=0.0)
  # below MIN_TEMPERATURE (1e-5) is greedy too: logits / T would overflow
  sp = sp.replace(temperature=jnp.where(jnp.arange(64) % 2 == 0, 0.0, 1e-9))
  everything = smp.Plan(penalties=True, cap=True, full=True, nucleus=True, nucleus_top_k=True,
                        n_top=20, logprobs=True)
  for plan in (smp.Plan(), everything):
    tok = np.asarray(_choose(jnp.asarray(logits), jnp.full((64, smp.RECENT), -1, jnp.int32), sp,
                             jnp.zeros(64, jnp.int32), plan)[0])
    np.testing.assert_array_equal(tok, np.asarray(jnp.argmax(jnp.asarray(logits), axis=-1)))


def test_a_rows_draw_ignores_its_neighbours_and_batch_size():
  """Each configuration drawn alone (its own path only, batch 1) equals the same row drawn in a
  batch that computes every path, at another row index."""
  rng = np.random.default_rng(2)
  logits = rng.standard_normal((1, 300)).astype(np.float32) * 3
  everything = smp.Plan(penalties=True, cap=True, full=True, nucleus=True, nucleus_top_k=True,
                        n_top=20, logprobs=True)
  configs = [dict(temperature=0.7), dict(temperature=0.9, top_k=20),
             dict(temperature=1.1, top_p=0.8), dict(temperature=0.9, top_k=100, top_p=0.95),
             dict(temperature=0.0)]
  seeds = [3, 2**40 + 5, 11]
  batch = [(c, s) for s in seeds for c in configs]
  order = rng.permutation(len(batch))
  cols = {k: [] for k in ("temperature", "top_k", "top_p")}
  for i in order:
    for k in cols:
      cols[k].append(batch[i][0].get(k, 1.0 if k == "top_p" else 0))
  sp = _params(len(batch), seeds=[batch[i][1] for i in order])
  sp = sp.replace(temperature=jnp.asarray(cols["temperature"], jnp.float32),
                  top_k=jnp.asarray(cols["top_k"], jnp.int32),
                  top_p=jnp.asarray(cols["top_p"], jnp.float32))
  for step in (0, 5):
    together = _draw(sp, everything, logits[0], step=step)
    for j, i in enumerate(order):
      c, s = batch[i]
      req = Request(tokens=[0], **c)
      alone = _draw(_params(1, seeds=[s], **c), host_sampling.plan_for([req]), logits[0], step)
      assert together[j] == alone[0], (c, s, step)


def test_seed_and_step_change_the_draw():
  a = _draw(_params(2000, temperature=1.0), smp.Plan(full=True))
  b = _draw(_params(2000, temperature=1.0, seeds=np.arange(2000) + 10**6), smp.Plan(full=True))
  c = _draw(_params(2000, temperature=1.0), smp.Plan(full=True), step=1)
  assert (a != b).mean() > 0.5 and (a != c).mean() > 0.5


def _penalize_reference(logits, recent, repeat, frequency, presence):
  """llama.cpp llama_sampler_penalties_apply, float32 as there."""
  out = logits.copy()
  for b in range(out.shape[0]):
    toks = [t for t in recent[b] if t >= 0]
    for t in set(toks):
      c = toks.count(t)
      x = out[b, t]
      x = x * np.float32(repeat[b]) if x <= 0 else x / np.float32(repeat[b])
      out[b, t] = x - (np.float32(c) * np.float32(frequency[b])
                       + np.float32(c > 0) * np.float32(presence[b]))
  return out


def test_penalties_match_llama_cpp():
  rng = np.random.default_rng(3)
  B, Vp = 4, 50
  logits = rng.standard_normal((B, Vp)).astype(np.float32)
  recent = rng.integers(0, 12, (B, smp.RECENT)).astype(np.int32)   # many repeats
  recent[1, :40] = -1                                               # a short window
  recent[3] = -1                                                    # an empty one
  rep = np.array([1.3, 1.0, 0.8, 1.5], np.float32)
  freq = np.array([0.2, 0.0, 0.5, 1.0], np.float32)
  pres = np.array([0.5, 0.7, 0.0, 1.0], np.float32)
  sp = _params(B).replace(repeat=jnp.asarray(rep), frequency=jnp.asarray(freq),
                          presence=jnp.asarray(pres))
  got = np.asarray(jax.jit(smp.penalize)(jnp.asarray(logits), jnp.asarray(recent), sp))
  want = _penalize_reference(logits, recent, rep, freq, pres)
  # to fp32 rounding (XLA, like a C++ compiler, may contract c * f + p into one FMA)
  assert_close(got, want, rel=KERNEL_REL["float32"], what="penalised logits")
  assert not np.array_equal(got, logits)
  # neutral values leave the logits bit-identical
  neutral = np.asarray(jax.jit(smp.penalize)(jnp.asarray(logits), jnp.asarray(recent), _params(B)))
  np.testing.assert_array_equal(neutral, logits)


def test_logprobs_equal_log_softmax():
  rng = np.random.default_rng(4)
  logits = (rng.standard_normal((8, 500)) * 4).astype(np.float32)
  sp = _params(8, temperature=0.9, top_p=0.9, repeat=1.2)
  recent = jnp.asarray(rng.integers(0, 500, (8, smp.RECENT)), jnp.int32)
  plan = smp.Plan(penalties=True, nucleus=True, n_top=20, logprobs=True)
  tok, lp, ti, tl = map(np.asarray, _choose(jnp.asarray(logits), recent, sp,
                                            jnp.zeros(8, jnp.int32), plan))
  z = logits.astype(np.float64)
  lsm = z - z.max(-1, keepdims=True)
  lsm -= np.log(np.exp(lsm).sum(-1, keepdims=True))     # of the raw logits, not the penalised
  assert_close(lp, lsm[np.arange(8), tok], rel=KERNEL_REL["float32"], what="chosen")
  assert_close(tl, np.take_along_axis(lsm, ti, 1), rel=KERNEL_REL["float32"], what="top")
  np.testing.assert_array_equal(ti, np.argsort(-lsm, axis=1, kind="stable")[:, :20])


def test_advance_stops_at_stop_ids_and_length():
  rows = host_sampling.empty_rows(3).replace(
      active=np.array([1, 1, 1], np.int32), remaining=np.array([5, 1, 5], np.int32))
  stop = np.array([[9, -1], [-1, -1], [-1, -1]], np.int32)
  new, emitted = smp.advance(jax.tree.map(jnp.asarray, rows), jnp.asarray([9, 4, 4]),
                             jnp.asarray(stop))
  np.testing.assert_array_equal(np.asarray(emitted), [9, 4, 4])
  np.testing.assert_array_equal(np.asarray(new.active), [0, 0, 1])   # stop id; length; goes on
  np.testing.assert_array_equal(np.asarray(new.recent)[:, -1], [9, 4, 4])


@pytest.mark.parametrize("field,value,match", [
    ("temperature", float("nan"), "temperature"), ("temperature", -0.5, "temperature"),
    ("top_p", 1.5, "top_p"), ("top_p", -0.1, "top_p"), ("top_k", -1, "top_k"),
    ("min_p", 2.0, "min_p"), ("repeat_penalty", 0.0, "repeat_penalty"),
    ("presence_penalty", float("inf"), "presence_penalty"), ("logprobs", 21, "logprobs"),
    ("logprobs", -1, "logprobs"), ("seed", 1.5, "seed")])
def test_bad_parameters_raise(field, value, match):
  from strata_jax.errors import RequestError
  with pytest.raises(RequestError, match=match):
    host_sampling.check(Request(tokens=[1], **{field: value}))
