"""`steps.decode_greedy` (n decode steps + on-device argmax in one program) equals `decode`
stepped from Python with a host argmax, tokens and state, with the adapter off and on."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_fixtures import random_lora, tiny_model

from strata_jax import steps
from strata_jax.state import init_state


@pytest.mark.parametrize("with_lora", [False, True], ids=["no-adapter", "adapter"])
def test_decode_greedy_equals_stepped_decode(with_lora):
  model = tiny_model()
  cfg = model.cfg
  lp = random_lora(rank=4).params if with_lora else None
  toks = jnp.asarray([3, 5, 7], jnp.int32)
  switch = jnp.asarray([1, 0, 1], jnp.int32)
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
