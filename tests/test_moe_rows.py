"""MoE rows whose output is unused (inactive slots, padding) borrow a real row's experts."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_fixtures import TINY, tiny_model

from strata_jax.model.moe import moe


@pytest.mark.parametrize("form", ["few", "dense"])
def test_unused_rows_leave_the_real_rows_outputs_bit_identical(form):
  cfg = TINY if form == "few" else dataclasses.replace(TINY, n_experts=2)  # N*k > E: many
  model = tiny_model(cfg)
  p = jax.tree.map(lambda a: a[0], model.params.layers.moe)
  x = jax.random.normal(jax.random.key(0), (5, cfg.d_model), jnp.float32)
  real = jnp.array([False, True, False, True, True])
  full = moe(cfg, p, x)
  masked = moe(cfg, p, x, real=real)
  np.testing.assert_array_equal(np.asarray(masked)[np.asarray(real)],
                                np.asarray(full)[np.asarray(real)])
  assert np.isfinite(np.asarray(masked)).all()

