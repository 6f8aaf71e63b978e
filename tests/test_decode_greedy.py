"""The multi-step decode programs (`steps.decode_greedy`, `steps.decode_sample`: n decode
steps and the choice of each next token in one program) equal `decode` stepped from Python
with a host argmax, tokens and state, with the adapter off, on and mixed, and keep the LoRA
pass's choice out of their step loop."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params
from jaxpr_walk import eqns
from model_fixtures import random_lora, tiny_model

from strata_jax import sampling, steps
from strata_jax.state import init_state

# the switch of rows 0-2; row 2 is inactive, so the active rows are mixed, all on, all off
SWITCHES = {"mixed": [1, 0, 1], "all-on": [1, 1, 0], "all-off": [0, 0, 1]}


@pytest.mark.parametrize("with_lora,switches", [(False, "mixed")] + [
    (True, k) for k in SWITCHES], ids=["no-adapter"] + [f"adapter-{k}" for k in SWITCHES])
def test_decode_greedy_equals_stepped_decode(with_lora, switches):
  model = tiny_model()
  cfg = model.cfg
  lp = random_lora(rank=4).params if with_lora else None
  toks = jnp.asarray([3, 5, 7], jnp.int32)
  switch = jnp.asarray(SWITCHES[switches], jnp.int32)
  active = jnp.asarray([1, 1, 0], jnp.int32)  # an inactive row keeps its token and state
  n = 4
  out, st_loop = steps.decode_greedy(cfg, model.params, lp, init_state(cfg, 3, 64), toks,
                                     switch, active, n_steps=n)
  st, t, ref = init_state(cfg, 3, 64), toks, []
  for _ in range(n):
    lg, st = steps.decode(cfg, model.params, lp, st, t, switch, active)
    t = jnp.where(active.astype(bool), jnp.argmax(lg, axis=-1).astype(jnp.int32), t)
    ref.append(np.asarray(t))
  np.testing.assert_array_equal(np.asarray(out), np.stack(ref))
  for a, b in zip(jax.tree.leaves(st_loop), jax.tree.leaves(st), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_decode_sample_equals_stepped_decode_as_a_row_stops_mid_loop():
  """The loop's first step is mixed (rows off and on); the off row runs out of tokens after
  two, and the on row goes on alone: the LoRA pass chosen once for the loop (mixed) gives
  what choosing it at every step gives."""
  model = tiny_model()
  cfg = model.cfg
  lp = random_lora(rank=4).params
  switch = jnp.asarray([0, 1], jnp.int32)
  n, remaining = 5, np.asarray([2, 99], np.int32)
  rows = sampling.Rows(last=jnp.asarray([3, 5], jnp.int32), active=jnp.ones(2, jnp.int32),
                       remaining=jnp.asarray(remaining), n_gen=jnp.zeros(2, jnp.int32),
                       recent=jnp.full((2, sampling.RECENT), -1, jnp.int32))
  sp = sampling.SamplingParams(
      temperature=jnp.zeros(2), top_k=jnp.zeros(2, jnp.int32), top_p=jnp.ones(2),
      min_p=jnp.zeros(2), presence=jnp.zeros(2), frequency=jnp.zeros(2), repeat=jnp.ones(2),
      seed_lo=jnp.zeros(2, jnp.uint32), seed_hi=jnp.zeros(2, jnp.uint32))
  stop = jnp.full((2, 1), -1, jnp.int32)
  (emitted, *_), _, st_loop = steps.decode_sample(
      cfg, model.params, lp, init_state(cfg, 2, 64), rows, sp, switch, stop, n_steps=n,
      plan=sampling.Plan())
  st, last, active, ref = init_state(cfg, 2, 64), np.asarray([3, 5], np.int32), [1, 1], []
  for i in range(n):
    lg, st = steps.decode(cfg, model.params, lp, st, jnp.asarray(last), switch,
                          jnp.asarray(active, jnp.int32))
    tok = np.argmax(np.asarray(lg), axis=-1).astype(np.int32)
    ref.append([int(tok[r]) if active[r] else -1 for r in range(2)])
    last = np.where(active, tok, last).astype(np.int32)
    active = [int(a and i + 1 < remaining[r]) for r, a in enumerate(active)]
  np.testing.assert_array_equal(np.asarray(emitted), np.asarray(ref))
  assert (np.asarray(emitted)[2:, 0] == -1).all() and (np.asarray(emitted)[:, 1] >= 0).all()
  for a, b in zip(jax.tree.leaves(st_loop), jax.tree.leaves(st), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _conditionals_in_step_loop(jaxpr, n_steps):
  """The conditionals inside any scan of length n_steps (Pallas kernels' bodies excluded)."""
  return [e for loop in eqns(jaxpr, into_kernels=False)
          if loop.primitive.name == "scan" and loop.params["length"] == n_steps
          for body in jaxprs_in_params(loop.params)
          for e in eqns(body, into_kernels=False) if e.primitive.name == "cond"]


def test_step_loops_choose_the_lora_pass_outside_the_loop():
  """On the GPU a conditional's index goes to the host, which drains the stream first; one
  inside the step loop would cost a stall per token. The choice is made once per dispatch."""
  model = tiny_model()
  cfg, lp, n = model.cfg, random_lora(rank=4).params, 7
  st = init_state(cfg, 2, 64)
  sw = act = jnp.ones(2, jnp.int32)
  greedy = jax.make_jaxpr(lambda s: steps.decode_greedy(
      cfg, model.params, lp, s, sw, sw, act, n_steps=n))(st).jaxpr
  rows = sampling.Rows(last=sw, active=act, remaining=act, n_gen=act,
                       recent=jnp.full((2, sampling.RECENT), -1, jnp.int32))
  sp = sampling.SamplingParams(*([jnp.ones(2)] * 7 + [jnp.zeros(2, jnp.uint32)] * 2))
  sample = jax.make_jaxpr(lambda s: steps.decode_sample(
      cfg, model.params, lp, s, rows, sp, sw, jnp.full((2, 1), -1, jnp.int32), n_steps=n,
      plan=sampling.Plan()))(st).jaxpr
  for jaxpr in (greedy, sample):
    assert _conditionals_in_step_loop(jaxpr, n) == []
    assert any(e.primitive.name == "cond" for e in eqns(jaxpr))  # the choice is there
