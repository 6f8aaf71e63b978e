"""The chunked (WY/UT) delta rule equals the token-by-token recurrence (fp32 oracles), and the
model's chunked form (`chunked.py`, UT inverse by products) equals them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import DELTA_RULE_FP32, KERNEL_REL, assert_close

from pallas_kernels.gdn import chunked, reference


def _inputs(T, H, Dk, Dv, seed=0):
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(rng.standard_normal((T, H, Dk))) / np.sqrt(Dk)
  k = unit(rng.standard_normal((T, H, Dk)))
  v = rng.standard_normal((T, H, Dv))
  g = -np.exp(rng.uniform(-4, 1, (T, H)))
  beta = 1 / (1 + np.exp(-rng.standard_normal((T, H))))
  s0 = 0.5 * rng.standard_normal((H, Dv, Dk))
  return [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, s0)]


@pytest.mark.parametrize("T,H,Dk,Dv", [(1, 2, 16, 8), (63, 3, 16, 16), (64, 2, 32, 8),
                                       (257, 4, 16, 32)], ids=lambda x: str(x))
def test_chunked_equals_recurrent(T, H, Dk, Dv):
  args = _inputs(T, H, Dk, Dv)
  o_r, s_r = reference.delta_rule_recurrent(*args)
  o_c, s_c = reference.delta_rule_chunked(*args, chunk=64)
  assert_close(o_c, o_r, abs_=DELTA_RULE_FP32, what="o")
  assert_close(s_c, s_r, abs_=DELTA_RULE_FP32, what="state")
  o_f, s_f = jax.jit(chunked.delta_rule_chunked)(*args)
  assert_close(o_f, o_r, abs_=DELTA_RULE_FP32, what="o (model's chunked form)")
  assert_close(s_f, s_r, abs_=DELTA_RULE_FP32, what="state (model's chunked form)")


@pytest.mark.parametrize("C", [2, 8, 64])
def test_unit_lower_inverse(C):
  """(I + M)⁻¹ by the product of (I + N^(2^j)) factors equals the solve, M strictly lower."""
  rng = np.random.default_rng(C)
  m = np.tril(rng.uniform(-1, 1, (3, C, C)), -1).astype(np.float32)
  inv = np.asarray(chunked.unit_lower_inverse(jnp.asarray(m)))
  want = np.linalg.inv(np.eye(C) + m.astype(np.float64))
  np.testing.assert_allclose(inv, want, atol=1e-5 * np.abs(want).max(), rtol=0)


def test_zero_gates_leave_state_unchanged():
  """Padding rows (g = 0, beta = 0) must not move the state: prefill chunks rely on it."""
  q, k, v, g, beta, s0 = _inputs(16, 2, 16, 8)
  for fn in (reference.delta_rule_chunked, chunked.delta_rule_chunked):
    _, s = fn(q, k, v, jnp.zeros_like(g), jnp.zeros_like(beta), s0)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s0))


def test_matches_float64_loop():
  """Both forms against a plain float64 numpy loop of the defining recurrence."""
  q, k, v, g, beta, s0 = (np.asarray(a, np.float64) for a in _inputs(40, 2, 16, 8, seed=3))
  s = s0.copy()
  outs = []
  for t in range(40):
    s = s * np.exp(g[t])[:, None, None]
    u = beta[t][:, None] * (v[t] - np.einsum("hvk,hk->hv", s, k[t]))
    s = s + u[:, :, None] * k[t][:, None, :]
    outs.append(np.einsum("hvk,hk->hv", s, q[t]))
  args = [jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta, s0)]
  for fn in (reference.delta_rule_recurrent, reference.delta_rule_chunked,
             chunked.delta_rule_chunked):
    o, st = fn(*args)
    assert_close(o, np.stack(outs), abs_=DELTA_RULE_FP32, what=fn.__name__)
    assert_close(st, s, abs_=DELTA_RULE_FP32, what=fn.__name__ + " state")


def test_reference_solves_one_matrix_at_a_time_with_the_batched_solves_numbers():
  """The reference's unit-lower solve runs one matrix a call (jaxlib 0.10's batched CPU trsm
  deadlocked two solves in flight on a 2-core machine), also under vmap: the batched
  `lax.linalg.triangular_solve`'s numbers bit for bit, and float64's to fp32 tolerance."""
  from jax import lax
  rng = np.random.default_rng(7)
  C = 16
  m = np.tril(rng.standard_normal((2, 3, 2, C, C)) * 0.3, -1)
  r = rng.standard_normal((2, 3, 2, C, 5))
  m32, r32 = jnp.asarray(m, jnp.float32), jnp.asarray(r, jnp.float32)
  got = np.asarray(jax.jit(jax.vmap(reference._unit_lower_solve))(m32, r32))
  batched = np.asarray(jax.jit(lambda m, r: lax.linalg.triangular_solve(
      jnp.eye(C, dtype=m.dtype) + m, r, left_side=True, lower=True, unit_diagonal=True))(m32, r32))
  assert np.array_equal(got, batched)
  assert_close(got, np.linalg.solve(np.eye(C) + m, r), rel=KERNEL_REL["float32"],
               what="unit lower solve")


def test_conv_window_gathers_the_rows_a_slice_of_the_concatenation_gives():
  """`gdn.conv_window` (the conv state after n_new tokens, gathered from the old state and the
  new rows without the concatenation) equals slicing concat([state, x]) at each row's start,
  bit for bit, for starts 0 .. T and one past T (clamped as `lax.dynamic_slice` clamps)."""
  from jax import lax  # noqa: PLC0415

  from strata_jax.model.gdn import conv_window  # noqa: PLC0415
  rng = np.random.default_rng(3)
  B, K1, T, C = 6, 3, 4, 5
  state = jnp.asarray(rng.standard_normal((B, K1, C)), jnp.float32)
  x = jnp.asarray(rng.standard_normal((B, T, C)), jnp.bfloat16)
  start = jnp.asarray([0, 1, 2, 3, 4, 5], jnp.int32)
  ext = jnp.concatenate([state.astype(x.dtype), x], axis=1)
  want = jax.vmap(lambda e, n: lax.dynamic_slice_in_dim(e, n, K1, axis=0))(ext, start)
  got = conv_window(state, x, start)
  assert got.dtype == x.dtype
  np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                np.asarray(want.astype(jnp.float32)))


@pytest.mark.parametrize("T", [1, 2, 3, 7])
def test_conv_taps_are_the_concatenations_slices_bit_for_bit(T):
  """`gdn.conv_taps` (each conv tap as a select of two shifted operands, so that XLA does not
  write the concatenation) gives every tap's rows of concat([state, x]) with their bits,
  negative zeros included, for T shorter and longer than the K-1 state rows; and `causal_conv`
  gives the same output and state either way."""
  from strata_jax.model import gdn  # noqa: PLC0415
  rng = np.random.default_rng(5)
  B, K, C = 2, 4, 6
  state = rng.standard_normal((B, K - 1, C)).astype(np.float32)
  state[0, 0, :2] = -0.0
  state = jnp.asarray(state, jnp.bfloat16)
  x = rng.standard_normal((B, T, C)).astype(np.float32)
  x[1, 0, :3] = -0.0
  x = jnp.asarray(x, jnp.bfloat16)
  ext = jnp.concatenate([state, x], axis=1)
  bits = lambda a: np.asarray(a).view(np.uint16)
  for j in range(K):
    np.testing.assert_array_equal(bits(gdn.conv_taps(state, x, j)), bits(ext[:, j:j + T]))
  w = jnp.asarray(rng.standard_normal((C, K)), jnp.float32)
  n_new = jnp.asarray([T, max(T - 1, 0)], jnp.int32)
  with_taps = gdn.causal_conv(x, state, w, n_new, taps=True)
  concatenated = gdn.causal_conv(x, state, w, n_new)
  for a, b in zip(with_taps, concatenated):
    np.testing.assert_array_equal(bits(a), bits(b))
