"""The jitted step functions: the only jit sites of the model.

`prefill` consumes a fixed-size chunk of one slot's prompt; `decode` advances every slot by one
token. The LoRA switch, positions, slot ids and lengths are arrays, so one compiled program
serves every switch state and every prompt length (chunks are padded). State is donated.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from strata_jax import sampling
from strata_jax.config import ModelConfig
from strata_jax.model import forward
from strata_jax.state import ModelState, Pending


def _precision(cfg: ModelConfig, state: ModelState):
  """The matmul precision the step traces under, from `cfg.forms` and the compute dtype (the
  K/V cache's): float32 is "highest", full-fp32 dots on every backend, where the GPU's default
  would round fp32 operands to TF32; "tf32" only when the forms name it."""
  p = cfg.forms.jax_precision(state.k.dtype)
  return jax.default_matmul_precision(p) if p else contextlib.nullcontext()


def _row(a, slot):
  """a [L, B, ...] -> [L, 1, ...] the slot's row."""
  return lax.dynamic_slice_in_dim(a, slot, 1, axis=1)


def _set_row(a, row, slot):
  return lax.dynamic_update_slice_in_dim(a, row.astype(a.dtype), slot, axis=1)


def _prefill(cfg, params, lora, state, slot, tokens, n_new, switch, all_logits, cvec,
             cut=None, cut_window=0):
  pos = state.pos[slot][None]
  nv = jnp.reshape(n_new, (1,)).astype(jnp.int32)
  sw = jnp.reshape(switch, (1,)).astype(jnp.int32)
  kv = (_row(state.k, slot), _row(state.v, slot))
  gdn = (_row(state.conv, slot), _row(state.ssm, slot))
  # one row: cut [] -> [1]; several cuts [C] -> [1, C] (with a tuple of C windows)
  cuts = None if cut is None else jnp.asarray(cut, jnp.int32)[None]
  with _precision(cfg, state):
    x = forward.embed(params, tokens[None]) if params.embed is not None else tokens[None]
    x, kv, gdn, *at_cut = forward.run_layers(cfg, params.layers, lora, kv, gdn, x, pos, nv, sw,
                                             cvec, cut=cuts, cut_window=cut_window)
    if params.lm_head is None:     # not the last stage of a layer split: hand the hidden on
      logits = x[0]
    elif all_logits:
      logits = forward.logits_from_hidden(cfg, params, x[0])
    else:
      logits = forward.logits_from_hidden(cfg, params, x[0, n_new - 1])
  state = state.replace(
      k=_set_row(state.k, kv[0], slot), v=_set_row(state.v, kv[1], slot),
      conv=_set_row(state.conv, gdn[0], slot), ssm=_set_row(state.ssm, gdn[1], slot),
      pos=state.pos.at[slot].add(n_new), switch=state.switch.at[slot].set(sw[0]))
  if cut is None:
    return logits, state
  conv_cut, ssm_cut = at_cut[0]
  return logits, state, (conv_cut[:, 0].astype(state.conv.dtype), ssm_cut[:, 0])


@functools.partial(jax.jit, static_argnames=("cfg", "all_logits"), donate_argnames=("state",))
def prefill(cfg: ModelConfig, params, lora, state: ModelState, slot, tokens, n_new, switch,
            *, all_logits: bool = False, cvec=None):
  """Run one chunk of a slot's prompt.

  Args:
    slot: int32 [] the batch row.  tokens: int32 [T] (padded), or the hidden [T, D] coming from
      the previous stage when this stage's params have no embedding (layer split).
    n_new: int32 [] real tokens.
    switch: int32 [] LoRA switch for this row (ignored when `lora` is None).
    cvec: the control vector rows of this stage's layers [L, D], or None (none: the program
      without control vectors).
  Returns:
    (logits, state): float32 [T, V] (all_logits) or [V] (after the last valid token).
  """
  return _prefill(cfg, params, lora, state, slot, tokens, n_new, switch, all_logits, cvec)


@functools.partial(jax.jit, static_argnames=("cfg", "all_logits", "cut_window"),
                   donate_argnames=("state",))
def prefill_cut(cfg: ModelConfig, params, lora, state: ModelState, slot, tokens, n_new, switch,
                cut, *, cut_window: int, all_logits: bool = False, cvec=None):
  """`prefill` of a chunk that also hands back the row's GDN state after its first `cut`
  tokens (int32 [], traced): a prompt's last full block ending inside the chunk, its valid
  tokens ending before cut + cut_window <= T (`model.gdn.gdn_mixer`). One pass over the
  weights for what would otherwise be a chunk ending at the cut and a small one after it.
  Returns (logits, state, (conv [Lg, K-1, C], ssm [Lg, Hv, Dv, Dk])) as `read_recurrent` reads
  them. Several cuts: cut int32 [n] (increasing) and cut_window a tuple of n windows (window i
  reaching cut i + 1, the last the valid end); the states then have an n axis after Lg."""
  return _prefill(cfg, params, lora, state, slot, tokens, n_new, switch, all_logits, cvec,
                  cut, cut_window)


@functools.partial(jax.jit, static_argnames=("cfg", "branch"), donate_argnames=("state",))
def decode(cfg: ModelConfig, params, lora, state: ModelState, tokens, switch, active, *,
           cvec=None, branch: str | None = None):
  """One token for every row. tokens, switch, active: int32 [B] (tokens: the hidden [B, D]
  from the previous stage when this stage has no embedding); cvec: as in `prefill`; branch:
  as in `forward.run_layers`. Inactive rows keep their state bit for bit.
  Returns (logits float32 [B, V], state)."""
  act = active.astype(bool)
  n_new = act.astype(jnp.int32)   # tokens each row adds: its one token if active, else none
  with _precision(cfg, state):
    x = forward.embed(params, tokens[:, None]) if params.embed is not None else tokens[:, None]
    x, (k, v), (conv, ssm) = forward.run_layers(
        cfg, params.layers, lora, (state.k, state.v), (state.conv, state.ssm), x, state.pos,
        n_new, switch, cvec, branch=branch)
    logits = (x[:, 0] if params.lm_head is None
              else forward.logits_from_hidden(cfg, params, x[:, 0]))
  # No full-state select: an inactive row's K/V write is dropped and each GDN layer keeps an
  # idle row's conv and recurrent state bit for bit (`gdn.gdn_mixer`). K/V, and at a fused
  # step the recurrent state, come back as the layer scan's carry (`forward.layers_scan`).
  state = state.replace(
      k=k, v=v, conv=conv, ssm=ssm,
      pos=state.pos + act.astype(jnp.int32),
      switch=jnp.where(act, switch.astype(jnp.int32), state.switch))
  return logits, state


@jax.jit
def penalize_positions(logits, recent, presence, frequency, repeat):
  """The sampler's own penalties (`strata_jax.sampling.penalize`, the same XLA ops, so a
  plain decode step's bits) at every verified position: logits [B, T, V] float32; recent
  [B, T, RECENT] each position's window (oldest first, -1 empty); presence, frequency,
  repeat [B]. Returns [B, T, V]."""
  B, T, V = logits.shape
  per = lambda a: jnp.repeat(a.astype(jnp.float32), T)
  zero = jnp.zeros((B * T,), jnp.float32)
  sp = sampling.SamplingParams(temperature=zero, top_k=jnp.zeros((B * T,), jnp.int32),
                               top_p=zero + 1.0, min_p=zero, presence=per(presence),
                               frequency=per(frequency), repeat=per(repeat),
                               seed_lo=jnp.zeros((B * T,), jnp.uint32),
                               seed_hi=jnp.zeros((B * T,), jnp.uint32))
  z = sampling.penalize(logits.reshape(B * T, V).astype(jnp.float32),
                        recent.reshape(B * T, -1), sp)
  return z.reshape(B, T, V)


@functools.partial(jax.jit, static_argnames=("n_top",))
def token_logprobs(logits, tok, *, n_top: int):
  """`sampling.token_logprobs` of tokens chosen outside the sampler (speculative rows: the
  verification's logits [N, V] and the tokens emitted from them), as a plain step's."""
  return sampling.token_logprobs(logits, tok, n_top)


@functools.partial(jax.jit, donate_argnames=("state",))
def reset_rows(state: ModelState, rows):
  """Clear the recurrent state and length of the rows where rows [B] is true."""
  r = rows.astype(bool)
  z = lambda a: jnp.where(r.reshape((1, -1) + (1,) * (a.ndim - 2)), jnp.zeros_like(a), a)
  return state.replace(conv=z(state.conv), ssm=z(state.ssm), pos=jnp.where(r, 0, state.pos),
                       switch=jnp.where(r, 0, state.switch))


@functools.partial(jax.jit, static_argnames=("length",))
def read_kv(state: ModelState, slot, start, *, length: int):
  """K/V of one row at positions [start, start+length): ([La, length, G, Hd], same)."""
  cut = lambda a: lax.dynamic_slice_in_dim(_row(a, slot)[:, 0], start, length, axis=1)
  return cut(state.k), cut(state.v)


@jax.jit
def read_recurrent(state: ModelState, slot):
  """GDN state of one row: (conv [Lg, K-1, C], ssm [Lg, Hv, Dv, Dk])."""
  return _row(state.conv, slot)[:, 0], _row(state.ssm, slot)[:, 0]


@functools.partial(jax.jit, donate_argnames=("state",))
def write_kv(state: ModelState, slot, start, k, v):
  """Write K/V rows k, v [La, n, G, Hd] of one slot at positions [start, start+n)."""
  put = lambda a, x: lax.dynamic_update_slice(
      a, x[:, None].astype(a.dtype), (0, slot, start, 0, 0))
  return state.replace(k=put(state.k, k), v=put(state.v, v))


@functools.partial(jax.jit, donate_argnames=("state",))
def write_recurrent(state: ModelState, slot, conv, ssm, pos, switch):
  """Set one row's GDN state, length and the switch it was computed under."""
  return state.replace(conv=_set_row(state.conv, conv[:, None], slot),
                       ssm=_set_row(state.ssm, ssm[:, None], slot),
                       pos=state.pos.at[slot].set(pos), switch=state.switch.at[slot].set(switch))


@functools.partial(jax.jit, static_argnames=("cfg", "n_steps"), donate_argnames=("state",))
def decode_greedy(cfg: ModelConfig, params, lora, state: ModelState, tokens, switch, active, *,
                  n_steps: int, cvec=None):
  """`n_steps` greedy decode steps in one program (one dispatch for many tokens).

  Each step is `decode` followed by an on-device argmax that feeds the next step; inactive
  rows keep their token and state. tokens, switch, active: int32 [B]; cvec: as in `prefill`.
  Returns (tokens int32 [n_steps, B] the chosen ids, state).
  """
  act = active.astype(bool)

  def loop(branch):
    def body(carry, _):
      toks, st = carry
      logits, st = decode(cfg, params, lora, st, toks, switch, active, cvec=cvec, branch=branch)
      nxt = jnp.where(act, jnp.argmax(logits, axis=-1).astype(jnp.int32), toks)
      return (nxt, st), nxt

    (_, st), out = lax.scan(body, (tokens.astype(jnp.int32), state), None, length=n_steps)
    return out, st

  return _by_lora_branch(cfg, lora, switch, active, loop)


def _by_lora_branch(cfg, lora, switch, active, loop):
  """loop(branch), the step loop, for the LoRA pass this dispatch's rows need
  (`forward.run_layers`), chosen once, before the loop: a conditional inside it would have the
  GPU copy its index to the host and drain the stream at every step. Rows only leave a decode loop (a stop, the
  length limit), never join it, so the pass its first step needs covers every later step."""
  if lora is None or cfg.forms.lora_branch == "select":
    return loop(None)
  which = forward.lora_branch_index(switch, active)
  return lax.switch(which, [functools.partial(loop, b) for b in forward.LORA_BRANCHES])


# ----- speculative decoding (strata_jax/speculative.py drives these; docs/mtp.md) -------------

@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state",))
def verify(cfg: ModelConfig, params, lora, state: ModelState, tokens, switch, n_new, *,
           cvec=None):
  """The main model over T = N+1 positions of every row: its last token and N drafts.

  Attention reads the cache plus the new positions (their K/V are written at pos..pos+T-1;
  what a row does not accept lies past its length and is overwritten later); the GDN layers
  run T decode steps and keep the state after each (`Pending`). Position, conv and recurrent
  state are left for `commit`. tokens int32 [B, T] (under a layer split, a stage with no
  embedding takes the previous stage's hidden [B, T, D]); switch, n_new int32 [B] (n_new 0:
  the row is idle). Returns (logits float32 [B, T, V] (a stage with no LM head: its hidden,
  for the next stage), hidden [B, T, D] (pre-norm, what the MTP head reads), state,
  pending)."""
  with _precision(cfg, state):
    x = forward.embed(params, tokens) if params.embed is not None else tokens
    x, (k, v), (rows, ssm_steps) = forward.run_layers(
        cfg, params.layers, lora, (state.k, state.v), (state.conv, state.ssm), x, state.pos,
        n_new, switch, cvec, keep_steps=True)
    logits = x if params.lm_head is None else forward.logits_from_hidden(cfg, params, x)
  return logits, x, state.replace(k=k, v=v), Pending(conv=rows, ssm=ssm_steps)


def _commit(state: ModelState, pending: Pending, n_commit, switch) -> ModelState:
  K1 = state.conv.shape[2]
  n = n_commit.astype(jnp.int32)
  conv = jax.vmap(lambda r, i: lax.dynamic_slice_in_dim(r, i, K1, axis=1),
                  in_axes=(1, 0), out_axes=1)(pending.conv, n)             # [Lg, B, K-1, C]
  idx = jnp.maximum(n - 1, 0).reshape(1, -1, 1, 1, 1, 1)
  ssm = jnp.take_along_axis(pending.ssm, idx, axis=2)[:, :, 0]             # [Lg, B, Hv, Dv, Dk]
  on = (n > 0).reshape(1, -1, 1, 1)
  return state.replace(conv=jnp.where(on, conv.astype(state.conv.dtype), state.conv),
                       ssm=jnp.where(on[..., None], ssm, state.ssm), pos=state.pos + n,
                       switch=jnp.where(n > 0, switch.astype(jnp.int32), state.switch))


@functools.partial(jax.jit, donate_argnames=("state",))
def commit(state: ModelState, pending: Pending, n_commit, switch):
  """Keep the first n_commit [B] positions of each row's verification (0: the row is left as
  it was): the state is then exactly the one decoding those tokens one by one leaves."""
  return _commit(state, pending, n_commit, switch)


def _greedy_accept(logits, tokens, n_new):
  """(choice int32 [B, T] the argmax at every position, accepted drafts k [B]): a draft is
  accepted while every earlier one was and it equals the argmax before it."""
  T = tokens.shape[1]
  choice = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  match = (choice[:, :-1] == tokens[:, 1:]) & (jnp.arange(T - 1)[None] < n_new[:, None] - 1)
  k = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)
  return choice, k


def _accept_emit(logits, tokens, n_new, cap, stop, sp=None, step0=None):
  """Greedy acceptance with the round's limits: (choice [B, T], accepted drafts k [B], tokens
  to emit n_emit [B]). A row emits choice[:n_emit]: its accepted drafts and then the model's own
  token, cut after the first stop id (stop int32 [S], -1 padded) and at cap [B] tokens; it has
  then consumed tokens[:n_emit] (0 for an idle row). With sampling parameters `sp` (and
  step0 [B], the output index of each row's position 0), rows whose temperature samples take
  the rejection rule (`sampling.spec_accept`) instead."""
  choice, k = _greedy_accept(logits, tokens, n_new)
  if sp is not None:
    choice, k = sampling.spec_accept(logits, tokens, n_new, sp, step0, choice, k)
  T = tokens.shape[1]
  is_stop = jnp.any(choice[:, :, None] == stop[None, None, :], axis=-1)      # [B, T]
  first_stop = jnp.min(jnp.where(is_stop, jnp.arange(T)[None], T), axis=1)
  n_emit = jnp.minimum(jnp.minimum(k + 1, first_stop + 1), jnp.maximum(cap, 1))
  return choice, k, jnp.where(n_new > 0, n_emit, 0)


@jax.jit
def accept_emit(logits, tokens, n_new, cap, stop, sp=None, step0=None):
  """`_accept_emit` on its own, for a layer split (its stages verify one after another, then
  the last stage's logits decide): (choice [B, T], accepted drafts k [B], n_emit [B]). With
  `sp`, sampled rows take the device's rejection rule (one more program)."""
  return _accept_emit(logits, tokens, n_new, cap, stop, sp, step0)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state",))
def verify_accept(cfg: ModelConfig, params, lora, state: ModelState, tokens, switch, n_new,
                  cap, stop, sp=None, step0=None, *, cvec=None):
  """`verify`, greedy acceptance (`_accept_emit`; with `sp`, the rejection rule for sampled
  rows) and `commit` in one program. Returns (choice int32 [B, T], accepted drafts k [B],
  n_emit [B], hidden [B, T, D], state)."""
  logits, hidden, state, pending = verify(cfg, params, lora, state, tokens, switch, n_new,
                                          cvec=cvec)
  choice, k, n_emit = _accept_emit(logits, tokens, n_new, cap, stop, sp, step0)
  state = _commit(state, pending, n_emit, switch)
  return choice, k, n_emit, hidden, state


def _mtp_draft(cfg, params, mstate, tokens, hidden, pos, n_new, n_draft):
  """Feed the MTP head T entries per row, then draft `n_draft` tokens greedily from entry
  n_new-1 on: the first from that entry's logits, each next one from one more MTP step on
  the previous draft and the head's own hidden state."""
  from strata_jax.model.mtp import mtp_forward  # noqa: PLC0415
  B = tokens.shape[0]
  rows = jnp.arange(B)
  logits, h, k, v = mtp_forward(cfg, params, tokens, hidden, mstate.k, mstate.v, pos, n_new,
                                mstate.start)
  last = jnp.maximum(n_new - 1, 0)
  d = jnp.argmax(logits[rows, last], axis=-1).astype(jnp.int32)              # [B]
  hl = h[rows, last]                                                         # [B, D]
  p = pos + n_new                                                          # next entry
  drafts = [d]
  act = (n_new > 0).astype(jnp.int32)
  for _ in range(n_draft - 1):
    lg, hn, k, v = mtp_forward(cfg, params, d[:, None], hl[:, None], k, v, p, act,
                               mstate.start)
    d = jnp.argmax(lg[:, 0], axis=-1).astype(jnp.int32)
    hl, p = hn[:, 0], p + 1
    drafts.append(d)
  return jnp.stack(drafts, axis=1), mstate.replace(k=k, v=v)


@functools.partial(jax.jit, static_argnames=("cfg", "n_draft"), donate_argnames=("mstate",))
def mtp_draft(cfg: ModelConfig, params, mstate, tokens, hidden, pos, n_new, *, n_draft: int):
  """The MTP head (never adapted) proposes `n_draft` tokens per row. tokens int32 [B, T]: the
  tokens at positions pos+1.., hidden [B, T, D] the trunk's pre-norm hidden state at pos..;
  n_new [B] real entries (0: idle row). Returns (drafts int32 [B, n_draft], mstate)."""
  p = cfg.forms.jax_precision(hidden.dtype)
  with jax.default_matmul_precision(p) if p else contextlib.nullcontext():
    return _mtp_draft(cfg, params, mstate, tokens, hidden, pos, n_new, n_draft)


@functools.partial(jax.jit, static_argnames=("cfg", "n_draft"),
                   donate_argnames=("state", "mstate"))
def spec_step(cfg: ModelConfig, params, lora, state: ModelState, mstate, tokens, switch,
              n_new, cap, stop, sp=None, step0=None, *, n_draft: int, cvec=None):
  """One speculative round in one program: `verify_accept` (greedy rows; with `sp`, sampled
  rows by the rejection rule), then the MTP head takes the emitted positions and drafts the
  next `n_draft` tokens. Returns (choice [B, T], k [B], n_emit [B], drafts [B, n_draft],
  state, mstate)."""
  with _precision(cfg, state):
    return _spec_round(cfg, params, lora, state, mstate, tokens, switch, n_new, cap, stop,
                       n_draft, cvec, sp, step0)


def _spec_round(cfg, params, lora, state, mstate, tokens, switch, n_new, cap, stop, n_draft,
                cvec, sp=None, step0=None):
  """`spec_step`'s round (traced inside a precision context): (choice, k, n_emit,
  drafts, state, mstate)."""
  pos = state.pos
  choice, k, n_emit, hidden, state = verify_accept(cfg, params, lora, state, tokens, switch,
                                                   n_new, cap, stop, sp, step0, cvec=cvec)
  drafts, mstate = _mtp_draft(cfg, params, mstate, choice, hidden, pos, n_emit, n_draft)
  return choice, k, n_emit, drafts, state, mstate


@functools.partial(jax.jit, static_argnames=("cfg", "n_draft", "n_rounds"),
                   donate_argnames=("state", "mstate"))
def spec_rounds_step(cfg: ModelConfig, params, lora, state: ModelState, mstate, last, drafts,
                     n_first, n_row, switch, cap, stop, sp=None, step0=None, *, n_draft: int,
                     n_rounds: int, cvec=None):
  """`n_rounds` speculative rounds in one program, each `spec_step`'s, the next
  one's tokens built on the device from the last one's outputs (no host round trip between
  them). last int32 [B]: each row's last token; drafts int32 [B, n_draft]: its drafts for the
  first round, of which it takes n_first [B] (0 for a row that (re)starts); n_row [B]: the
  drafts it takes in later rounds (<= n_draft); switch [B]; cap [B]: tokens it may still emit
  (0: the row is idle). A row stops after a stop id (stop int32 [S], -1 padded) or at its cap;
  later rounds leave it as it is (n_new 0). With `sp`, sampled rows take the rejection rule,
  step0 [B] the output index of their first round's position 0 (later rounds' follow on).
  Returns (tokens [R, B, T] each round's inputs,
  choice [R, B, T], accepted drafts k [R, B], n_emit [R, B], drafts [B, n_draft] for the next
  round, state, mstate)."""
  B, T = last.shape[0], n_draft + 1
  rows = jnp.arange(B)
  cols = jnp.arange(T)[None]

  def body(carry, _):
    state, mstate, last, drafts, n_d, cap, at = carry
    n_new = jnp.where(cap > 0, 1 + n_d, 0)
    # the positions past a row's drafts hold 0, as the host's round fills them
    tokens = jnp.where(cols < n_new[:, None],
                       jnp.concatenate([last[:, None], drafts], axis=1), 0)
    choice, k, n_emit, drafts, state, mstate = _spec_round(
        cfg, params, lora, state, mstate, tokens, switch, n_new, cap, stop, n_draft, cvec,
        sp, at)
    emitted = cols < n_emit[:, None]
    stopped = jnp.any(emitted & jnp.any(choice[:, :, None] == stop[None, None], axis=-1),
                      axis=1)
    last = jnp.where(n_emit > 0, choice[rows, jnp.maximum(n_emit - 1, 0)], last)
    cap = jnp.where(stopped, 0, cap - n_emit)
    at = None if at is None else at + n_emit
    return (state, mstate, last, drafts, n_row, cap, at), (tokens, choice, k, n_emit)

  with _precision(cfg, state):
    (state, mstate, _, drafts, _, _, _), (tokens, choice, k, n_emit) = lax.scan(
        body, (state, mstate, last, drafts, n_first, cap, step0), None, length=n_rounds)
  return tokens, choice, k, n_emit, drafts, state, mstate


@functools.partial(jax.jit, donate_argnames=("mstate",))
def mtp_restart(mstate, rows, start):
  """Rows where rows [B] is true start feeding the MTP head at position start [B]."""
  r = rows.astype(bool)
  return mstate.replace(start=jnp.where(r, start.astype(jnp.int32), mstate.start))


# ----- sampling on the device ------------------------------------------------------------------
# The sampling math is `strata_jax.sampling` (pure jnp); these are its jit sites.

def _choose_and_advance(logits, rows, sp, stop_ids, plan):
  tok, lp, top_ids, top_lp = sampling.choose(logits, rows.recent, sp, rows.n_gen, plan)
  rows, emitted = sampling.advance(rows, tok, stop_ids)
  return rows, (emitted, lp, top_ids, top_lp)


@functools.partial(jax.jit, static_argnames=("cfg", "n_steps", "plan", "with_logits"),
                   donate_argnames=("state", "rows"))
def decode_sample(cfg: ModelConfig, params, lora, state: ModelState, rows: sampling.Rows,
                  sp: sampling.SamplingParams, switch, stop_ids, *, n_steps: int,
                  plan: sampling.Plan, with_logits: bool = False, cvec=None):
  """`n_steps` decode steps with on-device sampling in one program.

  Each step feeds every active row's last token (`decode`), chooses the next one
  (`sampling.choose`: penalties, temperature, top-k/p, min-p, seeded draw, logprobs) and
  updates the rows (`sampling.advance`): a row that emits a stop id (stop_ids [B, S], -1
  padded) or runs out of `remaining` becomes inactive, so its state never advances past the
  stop. switch: int32 [B] LoRA switch; cvec: as in `prefill`.
  Returns ((emitted int32 [n, B] (-1 where the row was inactive), logprob [n, B],
  top_ids [n, B, n_top], top_lp [n, B, n_top], logits [n, B, V] or None), rows, state).
  """
  return _decode_scan(cfg, params, lora, state, rows, sp, switch, stop_ids, n_steps, plan,
                      with_logits, cvec)


def _decode_scan(cfg, params, lora, state, rows, sp, switch, stop_ids, n_steps, plan,
                 with_logits, cvec):
  def loop(branch):
    def body(carry, _):
      rows, st = carry
      logits, st = decode(cfg, params, lora, st, rows.last, switch, rows.active, cvec=cvec,
                          branch=branch)
      rows, out = _choose_and_advance(logits, rows, sp, stop_ids, plan)
      return (rows, st), out + ((logits if with_logits else None),)

    (rows_out, st), out = lax.scan(body, (rows, state), None, length=n_steps)
    return out, rows_out, st

  return _by_lora_branch(cfg, lora, switch, rows.active, loop)


# The batch axis of each ModelState field (K/V and GDN states are layer-stacked first).
_STATE_ROW_AXIS = {"k": 1, "v": 1, "conv": 1, "ssm": 1, "pos": 0, "switch": 0}
assert set(_STATE_ROW_AXIS) == {f.name for f in dataclasses.fields(ModelState)}


@functools.partial(jax.jit, static_argnames=("cfg", "n_steps", "plan", "with_logits"),
                   donate_argnames=("state", "rows"))
def decode_sample_rows(cfg: ModelConfig, params, lora, state: ModelState, rows: sampling.Rows,
                       sp: sampling.SamplingParams, switch, stop_ids, idx, *, n_steps: int,
                       plan: sampling.Plan, with_logits: bool = False, cvec=None):
  """`decode_sample` over the rows idx [R] (distinct slots) only: their state, sampler rows
  and parameters are gathered, decoded as a batch of R, and written back in place; the other
  slots are not touched. A decode step's cost grows with its batch (H200, 80B-A3B Q4_K_M:
  8.9 ms at 1 row, 23.4 ms at 8), so an engine with idle slots may decode its running rows in the
  smallest power-of-two bucket that holds them. Rows are independent and sampling draws from
  each row's own seed and step, so each row computes what it would in the full batch, up to
  the rounding another batch size may bring (XLA may sum in another order).
  Returns (outputs as decode_sample's, with R columns in idx order, rows, state)."""
  take = lambda a, ax: jnp.take(a, idx, axis=ax)
  sub = state.replace(**{f: take(getattr(state, f), ax) for f, ax in _STATE_ROW_AXIS.items()})
  sub_rows = jax.tree.map(lambda a: take(a, 0), rows)
  out, sub_rows, sub = _decode_scan(cfg, params, lora, sub, sub_rows,
                                    jax.tree.map(lambda a: take(a, 0), sp), take(switch, 0),
                                    take(stop_ids, 0), n_steps, plan, with_logits, cvec)

  def put(full, part, ax):
    at = (slice(None),) * ax + (idx,)
    return full.at[at].set(part.astype(full.dtype), unique_indices=True)
  state = state.replace(**{f: put(getattr(state, f), getattr(sub, f), ax)
                           for f, ax in _STATE_ROW_AXIS.items()})
  rows = jax.tree.map(lambda f, p: put(f, p, 0), rows, sub_rows)
  return out, rows, state


@functools.partial(jax.jit, static_argnames=("plan",), donate_argnames=("rows",))
def sample_step(logits, rows: sampling.Rows, sp: sampling.SamplingParams, stop_ids, *,
                plan: sampling.Plan):
  """One choice from given logits [B, V] (a prompt's last logits; a layer-split step's):
  the same math as one step of `decode_sample`. Returns (outputs as decode_sample's with
  n = 1 and no logits, rows)."""
  rows, out = _choose_and_advance(logits.astype(jnp.float32), rows, sp, stop_ids, plan)
  return jax.tree.map(lambda a: a[None], out), rows


@functools.partial(jax.jit, donate_argnames=("rows",))
def put_rows(rows: sampling.Rows, new: sampling.Rows, slot):
  """Write the one-row `new` into `rows` at `slot`."""
  return jax.tree.map(lambda a, b: lax.dynamic_update_slice_in_dim(a, b.astype(a.dtype), slot, 0),
                      rows, new)


@functools.partial(jax.jit, donate_argnames=("rows",))
def deactivate_rows(rows: sampling.Rows, mask):
  """Stop the rows where mask [B] is true (cancelled requests)."""
  return rows.replace(active=jnp.where(mask.astype(bool), 0, rows.active))
