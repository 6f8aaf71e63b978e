"""Token choice as pure jnp functions: penalties, temperature, top-k, top-p, min-p, seeded draws
and logprobs, every parameter an array over the batch rows. The jit sites are in `steps.py`.

Semantics (documented choices; llama.cpp and vLLM are the references):
- Penalties follow llama.cpp's `penalties` sampler over a window of the last `RECENT` (= 64,
  llama.cpp's `repeat_last_n` default) tokens of the row: the prompt's last tokens, then each
  generated token as it is chosen (llama.cpp feeds the prompt into the sampler too). For every
  distinct token of the window, with `c` its count there: `x *= repeat` if `x <= 0` else
  `x /= repeat`, then `x -= c * frequency + presence` (that association). Neutral values
  (1, 0, 0) leave the logits bit-identical.
- Order, as transformers and vLLM (and the engine before this module): penalties, then
  `/ temperature`, then top-k, then top-p (the smallest most-probable set whose probability
  reaches top_p, on the tempered distribution), then min-p (keep `p >= min_p * p_max`), then a
  draw from what is kept, renormalised. (llama.cpp applies temperature last.)
- Temperature below `MIN_TEMPERATURE` (0 included) is greedy: the argmax of the (penalised)
  logits, exactly `jnp.argmax` as before, so greedy tokens are the same as without sampling.
- The draw is an inverse-CDF draw with one uniform per row and step:
  `u = uniform(fold_in(fold_in(fold_in(key(0), seed_lo), seed_hi), step))`, `step` the index of
  the token in the request's output. A request's tokens therefore depend on its prompt,
  parameters and seed only: never on its neighbours, slot or the batch size.
- Which candidates a row is drawn from (a static `Plan` says which paths a program computes;
  every row's own path is always among them, so a row's token never depends on its neighbours):
    * `cap`: 0 < top_k <= TOP_K_CAP (64): `lax.top_k(z, 64)`, no sort of the vocabulary;
    * `full`: top_k = 0 and top_p >= 1: the whole vocabulary in id order (a draw needs no sort);
    * `nucleus`: top-p, or top_k > 64: no sort of the vocabulary. The top-k set and the top-p
      nucleus are each found by bisection on a per-row threshold (32 passes over [B, V]: the
      k-th largest logit, then the smallest probability the nucleus keeps), ties broken by lower
      id as a stable descending sort would (`lax.top_k`'s order), the top token always kept;
      then the inverse-CDF draw runs over the kept ids in id order. Top-p needs the exact
      nucleus, which on a flat distribution (random models, high temperature) can hold most of
      the 151,936 ids, so no cap is applied. This replaced a stable sort of [B, V]: with it,
      H200, bench-a3b, batch 32, the sampled decode program (T 0.8, top-p 0.95) took 2.6 ms a
      step (17 %) more than the greedy one (experiments/results/device/bench_engine_run6.json,
      `sample_program_*`).
  A capped row is drawn from `lax.top_k`'s 64 entries whatever else the batch computes.
- Logprobs are `log_softmax` of the raw model logits the token was chosen from (before
  penalties, temperature and filters), as OpenAI and llama.cpp's server report them; the top
  `MAX_LOGPROBS` (20) per step come with them when a plan asks.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

RECENT = 64            # penalty window (llama.cpp repeat_last_n default)
TOP_K_CAP = 64         # top_k up to this: drawn from lax.top_k's 64 entries (`cap`)
MAX_LOGPROBS = 20      # OpenAI's top_logprobs bound
MIN_TEMPERATURE = 1e-5

GREEDY, CAP, FULL, NUCLEUS = 0, 1, 2, 3


@struct.dataclass
class SamplingParams:
  """Per-row sampling parameters, each [B]."""
  temperature: jax.Array   # float32
  top_k: jax.Array         # int32, 0 = off
  top_p: jax.Array         # float32, >= 1 = off
  min_p: jax.Array         # float32, 0 = off
  presence: jax.Array      # float32
  frequency: jax.Array     # float32
  repeat: jax.Array        # float32, 1 = off
  seed_lo: jax.Array       # uint32
  seed_hi: jax.Array       # uint32


@struct.dataclass
class Rows:
  """Per-row decode bookkeeping carried from step to step on the device, each [B] or [B, W]."""
  last: jax.Array        # int32 the last chosen token (fed at the next step)
  active: jax.Array      # int32 1 while the row generates
  remaining: jax.Array   # int32 tokens the row may still emit
  n_gen: jax.Array       # int32 tokens emitted so far (the draw's step index)
  recent: jax.Array      # int32 [B, RECENT] penalty window, oldest first, -1 = empty


@dataclasses.dataclass(frozen=True)
class Plan:
  """Which sampling paths a program computes (static: each combination is one program)."""
  penalties: bool = False
  cap: bool = False
  full: bool = False
  nucleus: bool = False
  nucleus_top_k: bool = False   # a nucleus row has top_k > TOP_K_CAP: its bisection runs
  n_top: int = 0          # 0 or MAX_LOGPROBS: top logprobs per step
  logprobs: bool = False  # the chosen token's logprob

  @property
  def sampled(self) -> bool:
    return self.cap or self.full or self.nucleus


def row_path(temperature, top_k, top_p):
  """GREEDY / CAP / FULL / NUCLEUS for one row (host floats) or for arrays (jnp)."""
  if isinstance(temperature, (int, float)):
    if not temperature >= MIN_TEMPERATURE:
      return GREEDY
    if 0 < top_k <= TOP_K_CAP:
      return CAP
    return FULL if top_k == 0 and top_p >= 1.0 else NUCLEUS
  return jnp.where(
      temperature >= MIN_TEMPERATURE,
      jnp.where((top_k > 0) & (top_k <= TOP_K_CAP), CAP,
                jnp.where((top_k == 0) & (top_p >= 1.0), FULL, NUCLEUS)), GREEDY)


def penalize(logits, recent, sp: SamplingParams):
  """llama.cpp's repetition / frequency / presence penalties over the window. logits [B, V]."""
  V = logits.shape[-1]
  valid = recent >= 0
  cnt = jnp.sum((recent[:, :, None] == recent[:, None, :]) & valid[:, None, :], axis=-1)
  g = jnp.take_along_axis(logits, jnp.where(valid, recent, 0), axis=1)
  rp = sp.repeat[:, None]
  g = jnp.where(g <= 0, g * rp, g / rp)
  g = g - (cnt.astype(g.dtype) * sp.frequency[:, None] + sp.presence[:, None])  # as llama.cpp
  rows = jnp.arange(logits.shape[0])[:, None]
  # duplicates of a token write the same value; empty window entries write nothing
  return logits.at[rows, jnp.where(valid, recent, V)].set(g, mode="drop")


def uniforms(sp: SamplingParams, step):
  """One uniform in [0, 1) per row from (seed, step) alone."""
  def one(lo, hi, s):
    k = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(0), lo), hi)
    return jax.random.uniform(jax.random.fold_in(k, s), (), jnp.float32)
  return jax.vmap(one)(sp.seed_lo, sp.seed_hi, step.astype(jnp.uint32))


def pick(vals, top_k, top_p, min_p, u, *, ordered: bool):
  """Index into the last axis of vals [B, N] (tempered logits; sorted descending if `ordered`)
  drawn with uniforms u [B] after top-k / top-p (ordered only) and min-p."""
  N = vals.shape[-1]
  rank = jnp.arange(N, dtype=jnp.int32)[None, :]
  keep = jnp.ones(vals.shape, bool)
  if ordered:
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
  z = jnp.where(keep, vals, -jnp.inf)
  p = jnp.exp(z - jnp.max(z, axis=-1, keepdims=True))
  p = p / jnp.sum(p, axis=-1, keepdims=True)
  if ordered:
    excl = jnp.cumsum(p, axis=-1) - p
    keep &= (excl < top_p[:, None]) | (rank == 0) | (top_p[:, None] >= 1.0)
  keep &= p >= min_p[:, None] * jnp.max(p, axis=-1, keepdims=True)
  p = jnp.where(keep, p, 0.0)
  cdf = jnp.cumsum(p, axis=-1)
  idx = jnp.sum(cdf <= (u * cdf[:, -1])[:, None], axis=-1).astype(jnp.int32)
  last_kept = jnp.max(jnp.where(keep & (p > 0), rank, 0), axis=-1)
  return jnp.minimum(idx, last_kept)


def sample(z, sp: SamplingParams, step, plan: Plan):
  """Token ids [B] for the sampled rows of penalised logits z [B, V] (greedy rows get -1)."""
  V = z.shape[-1]
  path = row_path(sp.temperature, sp.top_k, sp.top_p)
  t = jnp.where(path == GREEDY, 1.0, sp.temperature)[:, None]
  zt = z / t
  u = uniforms(sp, step)
  tok = jnp.full(z.shape[:1], -1, jnp.int32)
  if plan.full:
    i = pick(zt, sp.top_k, sp.top_p, sp.min_p, u, ordered=False)
    tok = jnp.where(path == FULL, i, tok)
  if plan.cap:
    cv, ci = lax.top_k(zt, min(TOP_K_CAP, V))
    i = pick(cv, sp.top_k, sp.top_p, sp.min_p, u, ordered=True)
    tok = jnp.where(path == CAP, jnp.take_along_axis(ci, i[:, None], 1)[:, 0], tok)
  if plan.nucleus:
    mine = path == NUCLEUS    # other rows' filters off here (their draws here are unused)
    i = pick_nucleus(zt, jnp.where(mine, sp.top_k, 0), jnp.where(mine, sp.top_p, 1.0),
                     sp.min_p, u, with_top_k=plan.nucleus_top_k)
    tok = jnp.where(mine, i, tok)
  return tok


def _ordered_u32(x):
  """float32 -> uint32 keys in the same order (radix-sort keys: negatives' bits flipped)."""
  b = lax.bitcast_convert_type(x, jnp.uint32)
  return jnp.where(b >= jnp.uint32(0x80000000), ~b, b | jnp.uint32(0x80000000))


def _last_true(lo, hi, ok):
  """Per row, the largest uint32 t in [lo, hi) with ok(t) [B] true, for ok true at lo and
  monotone (true, then false); 32 halvings cover any uint32 range. Unrolled: 32 small fused
  reductions, with no device loop whose predicate the host would read every iteration."""
  def halve(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    go, good = hi - lo > 1, ok(mid)
    return jnp.where(go & good, mid, lo), jnp.where(go & ~good, mid, hi)
  return lax.fori_loop(0, 32, halve, (lo, hi), unroll=True)[0]


def _first(mask, n):
  """The first n [B] true entries of each row of mask, in id order."""
  return mask & (jnp.cumsum(mask.astype(jnp.int32), axis=-1) <= n[:, None])


def _top_k_mask(z, k):
  """The k [B] (1..V) largest entries of each row of z, ties by lower id (`lax.top_k`'s)."""
  key = _ordered_u32(z)
  kth = _last_true(jnp.min(key, axis=-1), jnp.max(key, axis=-1) + 1,
                   lambda t: jnp.sum(key >= t[:, None], axis=-1) >= k)
  above = key > kth[:, None]
  return above | _first(key == kth[:, None], k - jnp.sum(above, axis=-1))


def _nucleus_mask(p, top_p):
  """The smallest most-probable set of p [B, V] (probabilities) whose mass reaches top_p [B]:
  every entry a stable descending sort puts before the mass reaches top_p (ties by lower id),
  the top entry always."""
  key = lax.bitcast_convert_type(p, jnp.uint32)   # p >= 0: the bits are in p's order
  mass_from = lambda t: jnp.sum(jnp.where(key >= t[:, None], p, 0.0), axis=-1)
  # the smallest kept probability: the largest t whose entries >= t hold top_p (a total
  # rounded below top_p keeps everything: t = 0)
  t = _last_true(jnp.zeros(p.shape[:1], jnp.uint32), jnp.max(key, axis=-1) + 1,
                 lambda t: mass_from(t) >= top_p)
  above = key > t[:, None]
  ties = key == t[:, None]
  before = jnp.sum(jnp.where(above, p, 0.0), axis=-1)   # < top_p, so the first tie stays
  j = jnp.cumsum(ties.astype(jnp.int32), axis=-1) - 1     # a tie's place among the ties
  t_val = lax.bitcast_convert_type(t, jnp.float32)
  return above | (ties & (before[:, None] + j * t_val[:, None] < top_p[:, None]))


def pick_nucleus(zt, top_k, top_p, min_p, u, *, with_top_k: bool = True):
  """Id drawn from tempered logits zt [B, V] with uniforms u [B] after top-k (top_k [B], 0 or
  >= V: off), top-p (top_p [B], >= 1: off) and min-p, with no sort: see the module's
  `nucleus` path. `with_top_k` (static) False skips the top-k passes (no row uses top-k):
  static rather than a `lax.cond`, whose predicate the GPU would read on the host every step."""
  keep, _ = _top_k_and_nucleus(zt, top_k, top_p, with_top_k)
  # min-p and the draw in id order over what is kept: `pick`'s (min-p is relative to the top
  # probability, so renormalising over the kept ids leaves it as it was)
  return pick(jnp.where(keep, zt, -jnp.inf), top_k, top_p, min_p, u, ordered=False)


def _top_k_and_nucleus(zt, top_k, top_p, with_top_k: bool = True):
  """(keep [B, V]: the top-k set, then its top-p nucleus; p [B, V]: the softmax over the top-k
  set) for tempered logits zt, top_k [B] (0 or >= V: off), top_p [B] (>= 1: off)."""
  V = zt.shape[-1]
  keep = jnp.ones(zt.shape, bool)
  if with_top_k:
    use_k = (top_k > 0) & (top_k < V)
    keep = _top_k_mask(zt, jnp.where(use_k, top_k, V))
  z = jnp.where(keep, zt, -jnp.inf)
  p = jnp.exp(z - jnp.max(z, axis=-1, keepdims=True))
  p = p / jnp.sum(p, axis=-1, keepdims=True)
  use_p = top_p < 1.0
  keep &= _nucleus_mask(p, jnp.where(use_p, top_p, 1.0)) | ~use_p[:, None]
  return keep, p


def kept_probs(zt, top_k, top_p, min_p):
  """The distribution a plain step draws from, as probabilities [N, V] over tempered logits
  zt [N, V]: top-k (top_k [N], 0 or >= V: off), then the top-p nucleus (top_p [N], >= 1: off),
  then min-p (min_p [N]), renormalised; the kept sets `pick_nucleus` draws from (a `cap` row's
  64 entries hold the same set). `speculative.target_probs` is its float64 host twin."""
  keep, p = _top_k_and_nucleus(zt, top_k, top_p)
  # min-p is relative to the top probability, which the nucleus always keeps
  keep &= p >= min_p[:, None] * jnp.max(p, axis=-1, keepdims=True)
  p = jnp.where(keep, p, 0.0)
  return p / jnp.sum(p, axis=-1, keepdims=True)


SPEC_STREAM = 1   # folded into a speculative draw's key: its uniforms are not a plain step's


def spec_uniforms(sp: SamplingParams, step):
  """Two uniforms in [0, 1) per row and position from (seed, step) alone, step int [B, T] the
  output index the position would emit: [..., 0] decides a draft, [..., 1] draws a token."""
  def one(lo, hi, s):
    k = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(0), lo), hi)
    at = lambda i: jax.random.uniform(jax.random.fold_in(jax.random.fold_in(k, i), SPEC_STREAM),
                                      (2,), jnp.float32)
    return jax.vmap(at)(s)
  return jax.vmap(one)(sp.seed_lo, sp.seed_hi, step.astype(jnp.uint32))


def spec_accept(logits, tokens, n_new, sp: SamplingParams, step0, choice, k):
  """The rejection rule on the device for the sampled rows of a speculative round (the others
  keep the greedy `choice`, `k` given). logits [B, T, V] the verification's (penalties are the
  host's); tokens [B, T] the row's pending token, then its n_new - 1 drafts; step0 [B] the
  output index of position 0's token. Draft d at position i, whose target (`kept_probs` of
  logits / temperature) is p, is kept with probability p(d); the first rejected one is
  replaced by a draw from p with d removed, renormalised, and after every draft was kept a
  bonus token is drawn from the next position's p, so each emitted token follows plain
  sampling's distribution. Returns (choice [B, T]: the kept drafts, then the drawn token;
  accepted drafts k [B])."""
  B, T, V = logits.shape
  sampled = row_path(sp.temperature, sp.top_k, sp.top_p) != GREEDY
  t = jnp.where(sampled, sp.temperature, 1.0)
  per_pos = lambda x: jnp.repeat(x, T)
  p = kept_probs((logits / t[:, None, None]).reshape(B * T, V), per_pos(sp.top_k),
                 per_pos(sp.top_p), per_pos(sp.min_p)).reshape(B, T, V)
  at = jnp.arange(T, dtype=jnp.int32)
  u = spec_uniforms(sp, step0[:, None] + at[None])                      # [B, T, 2]
  drafts = tokens[:, 1:]                                               # [B, T - 1]
  p_draft = jnp.take_along_axis(p[:, :-1], drafts[..., None], axis=-1)[..., 0]
  ok = (u[:, :-1, 0] < p_draft) & (at[None, :-1] < n_new[:, None] - 1)
  ks = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)      # [B]
  rows = jnp.arange(B)
  q = p[rows, ks]                                                      # [B, V]
  rejected = ks < n_new - 1
  d = drafts[rows, jnp.minimum(ks, T - 2)] if T > 1 else jnp.zeros(B, jnp.int32)
  q_res = jnp.where(rejected[:, None] & (jnp.arange(V)[None] == d[:, None]), 0.0, q)
  cdf = jnp.cumsum(q_res, axis=-1)
  drawn = jnp.sum(cdf <= (u[rows, ks, 1] * cdf[:, -1])[:, None], axis=-1).astype(jnp.int32)
  last_kept = jnp.max(jnp.where(q_res > 0, jnp.arange(V)[None], 0), axis=-1)
  # float32 can hold a rejected draft at p(d) = 1 - ulp with nothing else left: keep it
  tok = jnp.where(cdf[:, -1] > 0, jnp.minimum(drawn, last_kept), d)
  shifted = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1)
  mine = jnp.where(at[None] < ks[:, None], shifted, jnp.where(at[None] == ks[:, None],
                                                                 tok[:, None], 0))
  return (jnp.where(sampled[:, None], mine, choice).astype(jnp.int32),
          jnp.where(sampled, ks, k).astype(jnp.int32))


def choose(logits, recent, sp: SamplingParams, step, plan: Plan):
  """The token of every row and its logprobs.

  logits [B, V] float32 raw model logits; recent [B, RECENT]; step [B] draw index.
  Returns (tok int32 [B], logprob float32 [B], top_ids int32 [B, n_top], top_lp [B, n_top]).
  """
  z = penalize(logits, recent, sp) if plan.penalties else logits
  tok = jnp.argmax(z, axis=-1).astype(jnp.int32)
  if plan.sampled:
    s = sample(z, sp, step, plan)
    tok = jnp.where(s >= 0, s, tok)
  B = logits.shape[0]
  if plan.logprobs or plan.n_top:
    lp, top_ids, top_lp = token_logprobs(logits, tok, plan.n_top)
  else:
    lp = jnp.zeros((B,), jnp.float32)
    top_lp, top_ids = (jnp.zeros((B, plan.n_top), jnp.float32),
                       jnp.zeros((B, plan.n_top), jnp.int32))
  return tok, lp, top_ids, top_lp


def token_logprobs(logits, tok, n_top: int):
  """(logprob of tok [B], the n_top most likely ids [B, n_top], their logprobs): log_softmax
  of the raw logits [B, V] in fp32, the top ids in `lax.top_k`'s order (ties: lower id)."""
  lsm = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  lp = jnp.take_along_axis(lsm, tok[:, None], 1)[:, 0]
  if not n_top:
    B = logits.shape[0]
    return lp, jnp.zeros((B, 0), jnp.int32), jnp.zeros((B, 0), jnp.float32)
  top_lp, top_ids = lax.top_k(lsm, n_top)
  return lp, top_ids, top_lp


def advance(rows: Rows, tok, stop_ids):
  """Rows after the active ones emitted `tok`; returns (rows, emitted [B]: tok or -1).
  A row stops at a stop id (stop_ids [B, S], -1 padded) or when `remaining` runs out."""
  act = rows.active.astype(bool)
  remaining = rows.remaining - act.astype(jnp.int32)
  hit = jnp.any((tok[:, None] == stop_ids) & (stop_ids >= 0), axis=-1)
  shifted = jnp.concatenate([rows.recent[:, 1:], tok[:, None]], axis=1)
  new = Rows(last=jnp.where(act, tok, rows.last),
             active=(act & ~hit & (remaining > 0)).astype(jnp.int32),
             remaining=remaining, n_gen=rows.n_gen + act.astype(jnp.int32),
             recent=jnp.where(act[:, None], shifted, rows.recent))
  return new, jnp.where(act, tok, -1)
