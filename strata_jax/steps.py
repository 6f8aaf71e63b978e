"""The jitted step functions: the only jit sites of the model.

`prefill` consumes a fixed-size chunk of one slot's prompt; `decode` advances every slot by one
token. The LoRA switch, positions, slot ids and lengths are arrays, so one compiled program
serves every switch state and every prompt length (chunks are padded). State is donated.
"""
from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.gdn.api import FUSED_CHOICES as FUSED_GDN_DECODE
from strata_jax import sampling
from strata_jax.config import ModelConfig
from strata_jax.model import forward
from strata_jax.state import ModelState


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


@functools.partial(jax.jit, static_argnames=("cfg", "all_logits"), donate_argnames=("state",))
def prefill(cfg: ModelConfig, params, lora, state: ModelState, slot, tokens, n_valid, switch,
            *, all_logits: bool = False, cvec=None):
  """Run one chunk of a slot's prompt.

  Args:
    slot: int32 [] the batch row.  tokens: int32 [T] (padded), or the hidden [T, D] coming from
      the previous stage when this stage's params have no embedding (layer split).
    n_valid: int32 [] real tokens.
    switch: int32 [] LoRA switch for this row (ignored when `lora` is None).
    cvec: the control vector rows of this stage's layers [L, D], or None (none: the program
      without control vectors).
  Returns:
    (logits, state): float32 [T, V] (all_logits) or [V] (after the last valid token).
  """
  pos = state.pos[slot][None]
  nv = jnp.reshape(n_valid, (1,)).astype(jnp.int32)
  sw = jnp.reshape(switch, (1,)).astype(jnp.int32)
  kv = (_row(state.k, slot), _row(state.v, slot))
  gdn = (_row(state.conv, slot), _row(state.ssm, slot))
  with _precision(cfg, state):
    x = forward.embed(params, tokens[None]) if params.embed is not None else tokens[None]
    x, kv, gdn = forward.run_layers(cfg, params.layers, lora, kv, gdn, x, pos, nv, sw, cvec)
    if params.lm_head is None:     # not the last stage of a layer split: hand the hidden on
      logits = x[0]
    elif all_logits:
      logits = forward.logits_from_hidden(cfg, params, x[0])
    else:
      logits = forward.logits_from_hidden(cfg, params, x[0, n_valid - 1])
  state = state.replace(
      k=_set_row(state.k, kv[0], slot), v=_set_row(state.v, kv[1], slot),
      conv=_set_row(state.conv, gdn[0], slot), ssm=_set_row(state.ssm, gdn[1], slot),
      pos=state.pos.at[slot].add(n_valid), lora=state.lora.at[slot].set(sw[0]))
  return logits, state


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state",))
def decode(cfg: ModelConfig, params, lora, state: ModelState, tokens, switch, active, *,
           cvec=None):
  """One token for every row. tokens, switch, active: int32 [B] (tokens: the hidden [B, D]
  from the previous stage when this stage has no embedding); cvec: as in `prefill`. Inactive
  rows keep their state (their K/V write lands past their length and is overwritten later).
  Returns (logits float32 [B, V], state)."""
  act = active.astype(bool)
  with _precision(cfg, state):
    x = forward.embed(params, tokens[:, None]) if params.embed is not None else tokens[:, None]
    x, (k, v), (conv, ssm) = forward.run_layers(
        cfg, params.layers, lora, (state.k, state.v), (state.conv, state.ssm), x, state.pos,
        act.astype(jnp.int32), switch, cvec)
    logits = (x[:, 0] if params.lm_head is None
              else forward.logits_from_hidden(cfg, params, x[:, 0]))
  keep = lambda new, old: jnp.where(act.reshape((1, -1) + (1,) * (old.ndim - 2)), new, old)
  if cfg.forms.gdn_decode not in FUSED_GDN_DECODE:
    ssm = keep(ssm, state.ssm)
  # else: the fused decode kernel does not store an inactive row's recurrent state at all
  # (its rows are the input's, bit for bit), so the full-state select is skipped.
  state = state.replace(
      k=k, v=v, conv=keep(conv, state.conv), ssm=ssm,
      pos=state.pos + act.astype(jnp.int32),
      lora=jnp.where(act, switch.astype(jnp.int32), state.lora))
  return logits, state


@functools.partial(jax.jit, donate_argnames=("state",))
def reset_rows(state: ModelState, rows):
  """Clear the recurrent state and length of the rows where rows [B] is true."""
  r = rows.astype(bool)
  z = lambda a: jnp.where(r.reshape((1, -1) + (1,) * (a.ndim - 2)), jnp.zeros_like(a), a)
  return state.replace(conv=z(state.conv), ssm=z(state.ssm), pos=jnp.where(r, 0, state.pos),
                       lora=jnp.where(r, 0, state.lora))


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
                       pos=state.pos.at[slot].set(pos), lora=state.lora.at[slot].set(switch))


@functools.partial(jax.jit, static_argnames=("cfg", "n_steps"), donate_argnames=("state",))
def decode_greedy(cfg: ModelConfig, params, lora, state: ModelState, tokens, switch, active, *,
                  n_steps: int, cvec=None):
  """`n_steps` greedy decode steps in one program (one dispatch for many tokens).

  Each step is `decode` followed by an on-device argmax that feeds the next step; inactive
  rows keep their token and state. tokens, switch, active: int32 [B]; cvec: as in `prefill`.
  Returns (tokens int32 [n_steps, B] the chosen ids, state).
  """
  act = active.astype(bool)

  def body(carry, _):
    toks, st = carry
    logits, st = decode(cfg, params, lora, st, toks, switch, active, cvec=cvec)
    nxt = jnp.where(act, jnp.argmax(logits, axis=-1).astype(jnp.int32), toks)
    return (nxt, st), nxt

  (_, state), out = lax.scan(body, (tokens.astype(jnp.int32), state), None, length=n_steps)
  return out, state


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
  def body(carry, _):
    rows, st = carry
    logits, st = decode(cfg, params, lora, st, rows.last, switch, rows.active, cvec=cvec)
    rows, out = _choose_and_advance(logits, rows, sp, stop_ids, plan)
    return (rows, st), out + ((logits if with_logits else None),)

  (rows, state), out = lax.scan(body, (rows, state), None, length=n_steps)
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
