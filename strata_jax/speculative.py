"""Speculative decoding: a drafter proposes up to N tokens per row, the (adapted) main model
verifies them in one step, and each row keeps the longest prefix the target model itself would
have produced (docs/mtp.md).

Drafters: "mtp", the model's own MTP head (never adapted, whatever the row's LoRA switch), and
"ngram", prompt lookup over the row's own tokens (any model). Acceptance: greedy rows keep
drafts while they equal the argmax; sampled rows use the standard rejection rule with the
draft as a point mass (draft d at a position with target distribution p is kept with
probability p(d); on rejection the token is drawn from p with d removed, renormalised), so the
output distribution is exactly the target model's: on the device (`sampling.spec_accept`),
or here on the host (`accept`) for rows that want their logits or have penalties. Host
orchestration (numpy) here; the jitted programs are in `strata_jax.steps`.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax import steps
from strata_jax import sampling
from strata_jax.errors import SpecError
from strata_jax.state import init_mtp_state

DRAFTS = ("mtp", "ngram")
MAX_SPEC = 16          # --spec above this is refused
NGRAM_MAX, NGRAM_MIN = 3, 1
GREEDY_BELOW = 1e-5    # temperatures below this are greedy (as `engine.sampling.sample`)


def check_spec(n: int, draft: str | None, has_mtp: bool, where: str = "--spec") -> str:
  """Validate a speculation request; returns the drafter ("mtp" when the model has an MTP head
  and none is named, else "ngram"). Raises SpecError naming the flag or the model."""
  if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= MAX_SPEC:
    raise SpecError(f"{where} {n!r}: expected an integer from 0 (off) to {MAX_SPEC}")
  if draft is None:
    return "mtp" if has_mtp else "ngram"
  if draft not in DRAFTS:
    raise SpecError(f"--draft {draft!r}: expected one of {', '.join(DRAFTS)}")
  if draft == "mtp" and not has_mtp:
    raise SpecError("--draft mtp: the model has no MTP layer (qwen3next.nextn_predict_layers "
                    "is 0); use --draft ngram")
  return draft


def ngram_draft(tokens: Sequence[int], n: int, max_ngram: int = NGRAM_MAX,
                min_ngram: int = NGRAM_MIN) -> list[int]:
  """Prompt lookup: the tokens that followed the latest earlier occurrence of the row's last
  `g`-gram (g from max_ngram down to min_ngram), at most n of them; [] when none recurs.
  Matched with numpy over the whole context at once: a Python scan took 1.5 ms a round at
  4,000 tokens with no match, and prompt lookup serves long contexts."""
  toks = np.asarray(tokens, np.int64)
  L = toks.size
  for g in range(min(max_ngram, L - 1), min_ngram - 1, -1):
    tail = toks[L - g:]
    starts = np.flatnonzero(toks[:L - g] == tail[0])   # an earlier g-gram ends before L
    for j in range(1, g):
      starts = starts[toks[starts + j] == tail[j]]
    if starts.size:   # the latest; what follows it is never empty (it starts before L - g)
      return toks[starts[-1] + g:starts[-1] + g + n].tolist()
  return []


def target_probs(logits: np.ndarray, temperature: float, top_k: int = 0,
                 top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
  """The distribution a plain decode step samples from (`strata_jax.sampling.pick`'s): softmax
  of logits / temperature over the top-k, then the top-p nucleus, then min-p (keep
  p >= min_p * p_max); float64 [V]."""
  z = np.asarray(logits, np.float64) / temperature
  if 0 < top_k < z.size:
    kth = np.partition(z, -top_k)[-top_k]
    z = np.where(z >= kth, z, -np.inf)
  z = z - z.max()
  p = np.exp(z)
  p /= p.sum()
  if top_p < 1.0:
    keep = nucleus(p, top_p)
    mask = np.zeros_like(p)
    mask[keep] = p[keep]
    p = mask / mask.sum()
  if min_p > 0.0:
    p = np.where(p >= min_p * p.max(), p, 0.0)
    p /= p.sum()
  return p


def nucleus(p: np.ndarray, top_p: float, heads: tuple[int, ...] = (1024, 16384)) -> np.ndarray:
  """The top-p nucleus of p [V]: the shortest prefix of p sorted descending (ties by index, a
  stable sort) whose running sum reaches top_p. Sorting all of a 151,936-token vocabulary took
  ~15 ms a position on the host (experiments/results/nucleus_cpu.log), so only the largest
  are sorted: the nonzero entries (a top-k leaves k), or the `heads[i]` largest with every
  entry tied at the cut, the first of these whose running sum reaches top_p. Each is a prefix
  of the whole order, so the nucleus is the whole sort's."""
  support = np.flatnonzero(p)
  vals = p[support]
  for head in heads:
    idx, v = support, vals
    if vals.size > head:
      keep = vals >= np.partition(vals, -head)[-head]
      idx, v = support[keep], vals[keep]
    o = np.argsort(-v, kind="stable")
    cum = np.cumsum(v[o])
    if cum.size and cum[-1] >= top_p:
      return idx[o[: int(np.searchsorted(cum, top_p) + 1)]]
    if idx.size == support.size:
      break
  order = np.argsort(-p, kind="stable")
  cum = np.cumsum(p[order])
  return order[: int(np.searchsorted(cum, top_p) + 1)]


def accept(logits: np.ndarray, drafts: Sequence[int], rng: np.random.Generator,
           temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           min_p: float = 0.0) -> tuple[list[int], int]:
  """Verify one row's drafts. logits [T, V]: the target's logits after the row's last token
  (position 0) and after each draft. Returns (emitted tokens, accepted drafts k): the k kept
  drafts, then one token of the target's own (a correction on rejection, a bonus when all
  were kept)."""
  out = []
  for i, d in enumerate(drafts):
    if temperature < GREEDY_BELOW or not temperature == temperature:
      tok = int(np.argmax(logits[i]))
      if tok == d:
        out.append(d)
        continue
      return out + [tok], i
    p = target_probs(logits[i], temperature, top_k, top_p, min_p)
    if rng.random() < p[d]:
      out.append(int(d))
      continue
    p[d] = 0.0
    return out + [int(rng.choice(p.size, p=p / p.sum()))], i
  last = logits[len(drafts)]
  if temperature < GREEDY_BELOW or not temperature == temperature:
    return out + [int(np.argmax(last))], len(drafts)
  p = target_probs(last, temperature, top_k, top_p, min_p)
  return out + [int(rng.choice(p.size, p=p))], len(drafts)


def _greedy(r) -> bool:
  return r.temperature < GREEDY_BELOW or not r.temperature == r.temperature


def rounds_for(caps: Sequence[int], ns: Sequence[int], most: int) -> int:
  """Greedy MTP rounds to run in one dispatch: `most` when no row can reach its cap before the
  last of them (a round emits at most n + 1 tokens), so no round is spent on rows that are all
  done, stop ids aside; else 1. Two programs at most (one round, `most` rounds): each count
  compiles its own."""
  fit = min(-(-int(c) // (int(n) + 1)) for c, n in zip(caps, ns))
  return most if fit >= most else 1


@dataclasses.dataclass
class Row:
  """One row of a speculative round.

  Attributes:
    last: the row's last token (sampled, not yet fed to the model).
    switch: its LoRA switch.
    context: every token of the row so far, `last` included (the n-gram drafter reads it).
    cap: tokens the row may still emit (>= 1).
    stop: token ids that end the row (emitted, then nothing more).
    temperature, top_k, top_p, min_p: its sampling (temperature below 1e-5: greedy).
    step: the output index of the row's next token (the device rule's draws,
      `sampling.spec_accept`, are keyed by it and the row's seed in `round`'s `sp`).
    rng: the host rule's draws (rows that want their logits or have penalties).
    presence, frequency, repeat: its penalties (0, 0, 1: off), over the last RECENT tokens of
      `context` and the drafts before each position, as a plain decode step's window.
    n: drafts the row takes per round (at most the decoder's n; None: the decoder's n).
    want_logits: return the logits each emitted token was chosen from (`Out.logits`).
  """
  last: int
  switch: int
  context: Sequence[int]
  cap: int
  stop: Sequence[int] = ()
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  rng: np.random.Generator | None = None
  step: int = 0
  n: int | None = None
  min_p: float = 0.0
  want_logits: bool = False
  presence: float = 0.0
  frequency: float = 0.0
  repeat: float = 1.0

  @property
  def penalised(self) -> bool:
    return self.presence != 0.0 or self.frequency != 0.0 or self.repeat != 1.0


@dataclasses.dataclass
class Out:
  """What a row got from a round: `emitted` tokens (in order), `consumed` tokens (now in the
  model state: the old `last` and the kept drafts), drafts proposed and accepted; with
  `Row.want_logits`, `logits` [len(emitted), V] float32: the verification's logits each
  emitted token was chosen from (position i of the round chose token i)."""
  emitted: list[int]
  consumed: list[int]
  proposed: int
  accepted: int
  logits: np.ndarray | None = None


class SpecDecoder:
  """Speculative rounds over the batch rows of one model state, whole or split by layers.

  Each row carries the drafts proposed for it in the previous round; a round verifies them and
  proposes the next. A row (re)starts with `restart(slot, pos)` once its prompt is in the
  state: its first round has no drafts (and, with "mtp", begins the MTP head's cache there).

  `stages`: the engine's `parallel.split.Stage`s, in order (one for a whole model). Their
  adapters and control vectors are read at every round, as the engine re-places them. Under a
  layer split each stage verifies the round's positions on its device and hands its hidden to
  the next; the last stage's logits decide, every stage then keeps its own accepted states,
  and the MTP head runs on the last stage beside the LM head, with a copy of the embedding
  placed there on first use (the head embeds each draft).
  """

  def __init__(self, stages, n: int, draft: str, n_slots: int, max_seq: int,
               dtype=jnp.float32, rounds: int = 1):
    self.stages = stages
    self.n, self.draft = int(n), draft
    self.rounds = int(rounds)
    self.n_slots = n_slots
    last = stages[-1]
    self.mstate = None
    if draft == "mtp":
      self.mstate = init_mtp_state(last.cfg, n_slots, max_seq, dtype)
      if last.device is not None:
        self.mstate = jax.device_put(self.mstate, last.device)
    self._head_params = None
    self.drafts: dict[int, list[int]] = {}

  def restart(self, slot: int, pos: int):
    self.drafts[slot] = []
    if self.mstate is not None:
      rows = (np.arange(self.n_slots) == slot).astype(np.int32)
      self.mstate = steps.mtp_restart(self.mstate, rows, np.full(self.n_slots, pos, np.int32))

  def round(self, states: list, rows: dict[int, Row], sp: sampling.SamplingParams):
    """Verify and draft for `rows` {slot: Row}; the other slots are left as they are.
    `states`: each stage's model state (donated); `sp`: every slot's sampling parameters [B]
    (the engine's `RowParams.params()`), of which the device's rule reads the sampled rows'.
    Returns (states, {slot: Out})."""
    B, T = self.n_slots, self.n + 1
    toks = np.zeros((B, T), np.int32)
    nv, sw = np.zeros(B, np.int32), np.zeros(B, np.int32)
    cap, n_row = np.zeros(B, np.int32), np.zeros(B, np.int32)   # n_row: drafts a row takes
    step0 = np.zeros(B, np.int32)
    for slot, r in rows.items():
      step0[slot] = r.step
      n_row[slot] = self.n if r.n is None else min(r.n, self.n)
      d = self.drafts.get(slot, [])[:n_row[slot]]
      toks[slot, 0], toks[slot, 1:1 + len(d)] = r.last, d
      nv[slot], sw[slot], cap[slot] = 1 + len(d), r.switch, r.cap
    # numpy inputs go to the programs as they are: jit moves them with its own call (a
    # `jnp.asarray` each was a dispatch of its own, five a round)
    stop = np.asarray(sorted({int(s) for r in rows.values() for s in r.stop}) or [-1], np.int32)
    # rows that want their logits take the host's rule (greedy: the same argmax), which reads
    # the verification's logits anyway, as do penalised rows (each position's own window);
    # sampled rows otherwise take the device's rule, with their seeds and output indices
    host_rule = any(r.want_logits or r.penalised for r in rows.values())
    if host_rule or all(_greedy(r) for r in rows.values()):
      sp = step0 = None   # the greedy programs (the host's rule reads logits)
    states = list(states)
    arrs = (toks, sw, nv)
    logits = None
    whole = len(self.stages) == 1
    if whole:
      st = self.stages[0]
      args = (st.cfg, st.params, st.lora, states[0])
    if whole and not host_rule and self.draft == "mtp":
      R = rounds_for(cap[list(rows)], n_row[list(rows)], self.rounds)
      if R > 1:
        states[0], out = self._rounds(states[0], rows, toks, nv, n_row, sw, cap, stop, R,
                                      sp, step0)
        return states, out
      choice, k, n_emit, drafts, states[0], self.mstate = steps.spec_step(
          *args, self.mstate, *arrs, cap, stop, sp, step0, n_draft=self.n, cvec=st.cvec)
    else:
      pos = states[-1].pos + 0      # a copy: the steps donate the state
      if whole and not host_rule:
        choice, k, n_emit, hidden, states[0] = steps.verify_accept(
            *args, *arrs, cap, stop, sp, step0, cvec=st.cvec)
      else:
        out, hidden, pending = self._verify(states, *arrs)
        if host_rule:
          choice, k, n_emit, logits = self._accept_on_host(out, rows, toks, nv, cap)
        else:
          choice, k, n_emit = steps.accept_emit(out, toks, nv, cap, stop, sp, step0)
        states = self._commit(states, pending, n_emit, arrs[1])
      drafts = None
      if self.draft == "mtp":
        drafts, self.mstate = steps.mtp_draft(
            self.stages[-1].cfg, self._head(), self.mstate, jnp.asarray(choice), hidden, pos,
            jnp.asarray(n_emit), n_draft=self.n)
    choice, k, n_emit, drafts = jax.device_get((choice, k, n_emit, drafts))   # one read
    out = {}
    for slot, r in rows.items():
      e = int(n_emit[slot])
      emitted = [int(t) for t in choice[slot, :e]]
      consumed = [int(t) for t in toks[slot, :e]]
      proposed = int(nv[slot]) - 1
      out[slot] = Out(emitted=emitted, consumed=consumed, proposed=proposed,
                      accepted=min(int(k[slot]), e),
                      logits=(np.asarray(logits[slot][:e], np.float32) if r.want_logits
                              else None))
      if drafts is not None:
        self.drafts[slot] = [int(t) for t in drafts[slot]]
      else:
        self.drafts[slot] = ngram_draft(list(r.context) + emitted, self.n)
    return states, out

  def _rounds(self, state, rows, toks, nv, n_row, sw, cap, stop, R: int, sp, step0):
    """R MTP rounds in one program (`steps.spec_rounds_step`): each row's Out sums its
    rounds (a row stops at a stop id or its cap; its later rounds are empty)."""
    st = self.stages[0]
    tokens, choice, k, n_emit, drafts, state, self.mstate = steps.spec_rounds_step(
        st.cfg, st.params, st.lora, state, self.mstate, toks[:, 0], toks[:, 1:],
        (nv - (nv > 0)).astype(np.int32), n_row, sw, cap, stop, sp, step0, n_draft=self.n,
        n_rounds=R, cvec=st.cvec)
    tokens, choice, k, n_emit, drafts = jax.device_get((tokens, choice, k, n_emit, drafts))
    out = {}
    for slot in rows:
      o = Out(emitted=[], consumed=[], proposed=0, accepted=0)
      for i in range(R):
        e = int(n_emit[i, slot])
        if e == 0:
          break
        o.emitted += [int(t) for t in choice[i, slot, :e]]
        o.consumed += [int(t) for t in tokens[i, slot, :e]]
        o.proposed += (int(nv[slot]) - 1) if i == 0 else int(n_row[slot])
        o.accepted += min(int(k[i, slot]), e)
      out[slot] = o
      self.drafts[slot] = [int(t) for t in drafts[slot]]
    return state, out

  def _head(self):
    """The params the MTP head reads: the last stage's (the head, the LM head), and under a
    split a copy of stage 0's embedding on the last stage's device (made once)."""
    first, last = self.stages[0], self.stages[-1]
    if first is last:
      return last.params
    if self._head_params is None:
      embed = first.params.embed
      if last.device is not None:
        embed = jax.device_put(embed, last.device)
      self._head_params = last.params.replace(embed=embed)
    return self._head_params

  def _verify(self, states, tokens, switch, n_new):
    """`steps.verify` stage by stage (each stage's hidden goes to the next one's device).
    Returns (the last stage's logits [B, T, V], its hidden [B, T, D], each stage's pending
    GDN states); `states` is updated in place."""
    x, pending = tokens, []
    for i, st in enumerate(self.stages):
      if st.device is not None:
        x, switch, n_new = jax.device_put((x, switch, n_new), st.device)
      x, hidden, states[i], p = steps.verify(st.cfg, st.params, st.lora, states[i], x, switch,
                                             n_new, cvec=st.cvec)
      pending.append(p)
    return x, hidden, pending

  def _commit(self, states, pending, n_emit, switch):
    """Every stage keeps the states after its rows' first n_emit [B] positions."""
    for i, st in enumerate(self.stages):
      n, s = ((n_emit, switch) if st.device is None
              else jax.device_put((n_emit, switch), st.device))
      states[i] = steps.commit(states[i], pending[i], n, s)
    return states

  def _accept_on_host(self, logits, rows, toks, nv, cap):
    """The rejection rule per row on the host (with each position's penalties applied first
    where a row has them). Returns (choice [B, T], accepted drafts k [B], n_emit [B],
    {slot: its logits [T, V] as numpy}). Only the rows' own logits come to the host: with
    32 slots and one speculating row, 1/32 of the [B, T, V] copy."""
    B, T = toks.shape
    pen = [s for s, r in rows.items() if r.penalised]
    decide = None
    if pen:   # each position's window: the row's tokens, then the drafts before it
      recent = np.full((B, T, sampling.RECENT), -1, np.int32)
      knobs = np.zeros((3, B), np.float32)
      knobs[2] = 1.0
      for slot in pen:
        r = rows[slot]
        seq = list(r.context) + [int(t) for t in toks[slot, 1:]]
        for i in range(T):
          w = seq[:len(r.context) + i][-sampling.RECENT:]
          recent[slot, i, sampling.RECENT - len(w):] = w
        knobs[:, slot] = r.presence, r.frequency, r.repeat
      decide = steps.penalize_positions(logits, jnp.asarray(recent), *map(jnp.asarray, knobs))
    slots = sorted(rows)
    at = {slot: i for i, slot in enumerate(slots)}
    sel = np.asarray(slots, np.int32)
    logits, decide = jax.device_get((logits[sel], None if decide is None else decide[sel]))
    choice = np.zeros((B, T), np.int32)
    k, n_emit = np.zeros(B, np.int32), np.zeros(B, np.int32)
    for slot, r in rows.items():
      n_d = int(nv[slot]) - 1
      drafts = [int(t) for t in toks[slot, 1:1 + n_d]]
      z = (decide if r.penalised else logits)[at[slot], :n_d + 1]
      emitted, acc = accept(z, drafts, r.rng, r.temperature, r.top_k, r.top_p, r.min_p)
      stop_at = next((i for i, t in enumerate(emitted) if t in set(r.stop)), len(emitted) - 1)
      e = min(len(emitted), stop_at + 1, max(int(cap[slot]), 1))
      choice[slot, :len(emitted)] = emitted
      k[slot], n_emit[slot] = acc, e
    return choice, k, n_emit, {slot: logits[at[slot]] for slot in slots}
