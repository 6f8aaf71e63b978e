"""The router's top-k kernel (pallas_kernels/moe/topk.py): `lax.top_k`'s values and ids.

The interpreter runs the kernel's body on CPU; the compiled kernel runs under the `gpu`
marker on the device (`experiments/bench/gpu_tests.sh`).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_fixtures import TINY, tiny_model
from tolerances import KERNEL_REL, assert_close

from pallas_kernels.moe import api
from pallas_kernels.moe.topk import top_k_pallas
from strata_jax import steps
from strata_jax.forms import Forms
from strata_jax.state import init_state

ON_GPU = jax.default_backend() == "gpu"
# (rows, experts, k): one decode row of the 80B's router, bench-a3b's, TINY's; row counts that
# are not a power of two or exceed a program's 16 rows; expert counts that need padding.
SHAPES = [(1, 512, 10), (8, 64, 10), (3, 4, 2), (17, 64, 10), (5, 10, 3), (2, 7, 7)]


def router_like(n, e, *, ties: bool, dtype=np.float32, seed=0):
  """Rows with many equal entries (ties) or softmax-like distinct ones; the first row starts
  with two -inf and the last holds a +inf (both orders of infinities reach the ids)."""
  rng = np.random.default_rng(seed)
  x = (rng.integers(0, 4, (n, e)) if ties else rng.random((n, e))).astype(np.float32)
  x[0, :2] = -np.inf
  x[-1, e // 2] = np.inf
  return jnp.asarray(x, dtype)


@pytest.mark.parametrize("ties", [True, False], ids=["ties", "distinct"])
@pytest.mark.parametrize("n,e,k", SHAPES)
def test_top_k_kernel_gives_lax_top_k_values_and_ids(n, e, k, ties):
  x = router_like(n, e, ties=ties)
  vals, ids = api.top_k(x, k, implementation="pallas_interpret")
  ref_vals, ref_ids = api.top_k(x, k, implementation="xla")
  assert vals.shape == (n, k) and ids.dtype == jnp.int32
  assert np.array_equal(vals, ref_vals) and np.array_equal(ids, ref_ids)


def test_top_k_kernel_keeps_the_input_dtype():
  x = router_like(4, 64, ties=False, dtype=jnp.bfloat16)
  vals, ids = api.top_k(x, 10, implementation="pallas_interpret")
  ref_vals, ref_ids = jax.lax.top_k(x, 10)
  assert vals.dtype == jnp.bfloat16
  assert np.array_equal(np.asarray(vals, np.float32), np.asarray(ref_vals, np.float32))
  assert np.array_equal(ids, ref_ids)


def test_top_k_refuses_a_k_outside_the_row_and_an_unknown_implementation():
  x = router_like(2, 8, ties=False)
  with pytest.raises(ValueError, match="k=9 must be in 1..8"):
    api.top_k(x, 9, implementation="pallas_interpret")
  with pytest.raises(ValueError, match="unknown implementation 'fast'"):
    api.top_k(x, 2, implementation="fast")
  if not ON_GPU:
    with pytest.raises(ValueError, match="needs a GPU backend"):
      api.top_k(x, 2, implementation="pallas")


def test_top_k_auto_runs_lax_top_k_off_the_gpu():
  """"auto" is the kernel on the GPU and `lax.top_k` elsewhere; the same numbers either way."""
  x = router_like(3, 64, ties=True)
  got, want = api.top_k(x, 10), jax.lax.top_k(x, 10)
  assert all(np.array_equal(np.asarray(g), np.asarray(w)) for g, w in zip(got, want))
  if not ON_GPU:
    assert "triton" not in jax.jit(lambda x: api.top_k(x, 10)).lower(x).as_text()


def test_top_k_kernel_lowers_to_triton_for_the_gpu():
  """Cross-lowering on CPU: every construct has a Pallas Triton lowering rule (compiling the
  Triton IR needs the device)."""
  low = jax.jit(lambda x: top_k_pallas(x, 10)).trace(
      jnp.zeros((1, 512), jnp.float32)).lower(lowering_platforms=("cuda",))
  assert "xla.gpu.triton" in low.as_text()


def test_model_with_the_routing_kernel_gives_the_xla_forms_logits():
  """`Forms.moe_topk`: the prompt's logits at every position and a decode step's with the
  routing kernel (softmax, top-k, renormalisation in one launch) are the XLA form's: bit for
  bit under the interpreter (XLA's own exp), to fp32 rounding compiled on the GPU (Triton's
  exp and sums round otherwise: run 32)."""
  model = tiny_model()

  def run(form):
    cfg = dataclasses.replace(TINY, forms=dataclasses.replace(
        Forms().resolve(jax.default_backend(), jnp.float32), moe_topk=form))
    st = init_state(cfg, 1, 32, jnp.float32)
    toks = jnp.asarray(np.random.default_rng(1).integers(0, TINY.vocab_size, 6), jnp.int32)
    lg, st = steps.prefill(cfg, model.params, None, st, jnp.int32(0), toks, jnp.int32(6),
                           jnp.int32(0), all_logits=True)
    lg2, _ = steps.decode(cfg, model.params, None, st, jnp.asarray([3], jnp.int32),
                          jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32))
    return np.concatenate([np.asarray(lg), np.asarray(lg2)])

  if ON_GPU:
    assert_close(run("pallas"), run("xla"), rel=KERNEL_REL["float32"], what="routing kernel")
  else:
    assert np.array_equal(run("pallas_interpret"), run("xla"))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU backend")
@pytest.mark.parametrize("n,e,k", [(1, 512, 10), (8, 512, 10), (32, 64, 10), (2500, 512, 10)])
def test_gpu_top_k_kernel(n, e, k):
  x = jax.nn.softmax(jnp.asarray(np.random.default_rng(2).standard_normal((n, e)),
                                 jnp.float32), axis=-1)
  vals, ids = api.top_k(x, k, implementation="pallas")
  ref_vals, ref_ids = jax.lax.top_k(x, k)
  assert np.array_equal(vals, ref_vals) and np.array_equal(ids, ref_ids)


def logits_like(n, e, seed=0):
  """Router logits: distinct values on a softmax-like scale."""
  return jnp.asarray(np.random.default_rng(seed).standard_normal((n, e)) * 2.0, jnp.float32)


@pytest.mark.parametrize("n,e,k", SHAPES)
def test_route_kernel_gives_the_references_ids_and_weights(n, e, k):
  """softmax, top-k and renormalisation in one launch: the reference's ids exactly, its
  weights to fp32 rounding, each row summing to 1."""
  x = logits_like(n, e, seed=n * e)
  w, ids = api.route(x, k, implementation="pallas_interpret")
  ref_w, ref_ids = api.route(x, k, implementation="xla")
  assert w.shape == (n, k) and w.dtype == jnp.float32 and ids.dtype == jnp.int32
  assert np.array_equal(ids, ref_ids)
  np.testing.assert_allclose(w, ref_w, rtol=2e-6, atol=1e-7)
  np.testing.assert_allclose(np.asarray(w, np.float64).sum(-1), 1.0, rtol=1e-6)
  # the float64 oracle of the weights
  p = np.exp(np.asarray(x, np.float64) - np.asarray(x, np.float64).max(-1, keepdims=True))
  top = np.take_along_axis(p, np.asarray(ids), axis=-1)
  np.testing.assert_allclose(w, top / top.sum(-1, keepdims=True), rtol=2e-6)


def test_route_reference_is_the_models_routing():
  """`route_reference`: softmax, lax.top_k, w / sum(w), bit for bit."""
  from pallas_kernels.moe.reference import route_reference
  x = logits_like(5, 64, seed=9)
  probs = jax.nn.softmax(x, axis=-1)
  w, ids = jax.lax.top_k(probs, 10)
  got_w, got_ids = route_reference(x, 10)
  assert np.array_equal(got_ids, ids)
  assert np.array_equal(got_w, w / jnp.sum(w, axis=-1, keepdims=True))


def test_route_refuses_a_k_outside_the_row():
  with pytest.raises(ValueError, match="k=9 must be in 1..8"):
    api.route(logits_like(2, 8), 9, implementation="pallas_interpret")


def test_route_kernel_lowers_to_triton_for_the_gpu():
  from pallas_kernels.moe.topk import route_pallas
  low = jax.jit(lambda x: route_pallas(x, 10)).trace(logits_like(8, 64)).lower(
      lowering_platforms=("cuda",))
  assert "xla.gpu.triton" in low.as_text()


@pytest.mark.parametrize("n_parts", [1, 2, 3, 8])
@pytest.mark.parametrize("n,e,k", [(1, 64, 10), (17, 64, 10), (5, 10, 3)])
def test_route_kernel_adds_split_partials_as_the_gemv_sum_does(n, e, k, n_parts):
  """Given the router GEMV's split partials [S, N, E], the kernel adds them in index order
  (`gemv.sum_partials`' order): the ids and weights of the summed logits bit for bit, and the
  reference's ids for the partials."""
  from pallas_kernels.quant.gemv import sum_partials
  parts = jnp.stack([logits_like(n, e, seed=10 * s + n) for s in range(n_parts)])
  w, ids = api.route(parts, k, implementation="pallas_interpret")
  w_sum, ids_sum = api.route(sum_partials(parts), k, implementation="pallas_interpret")
  assert w.shape == (n, k) and ids.shape == (n, k)
  assert np.array_equal(ids, ids_sum)
  if jax.default_backend() == "cpu":
    assert np.array_equal(w, w_sum)
  else:   # the interpreter's body compiled by XLA:GPU rounds the two programs' softmax
    # differently (run 36); the compiled kernel's bits are `test_gpu_route_kernel_of_split_*`'s
    np.testing.assert_allclose(w, w_sum, rtol=2e-6, atol=1e-7)
  ref_w, ref_ids = api.route(parts, k, implementation="xla")
  assert np.array_equal(ids, ref_ids)
  np.testing.assert_allclose(w, ref_w, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("op", ["route", "top_k"])
@pytest.mark.parametrize("n", [1, 8, 32])
def test_router_kernels_store_decode_batches_at_their_shape_with_no_slice_after(op, n):
  """A decode batch's results leave the launch at [N, k] (k columns under a mask): no slice
  op follows it (on the H200 the slice of a padded block was one more launch a layer)."""
  from pallas_kernels.moe.topk import route_pallas
  kernel = route_pallas if op == "route" else top_k_pallas
  jaxpr = str(jax.make_jaxpr(lambda x: kernel(x, 10, interpret=True))(logits_like(n, 64)))
  after = jaxpr.split("pallas_call")[-1]
  assert "slice" not in after, after


def test_route_refuses_logits_that_are_neither_rows_nor_partials():
  from pallas_kernels.moe.topk import route_pallas
  with pytest.raises(ValueError, match="must be \\[N, E\\] or split partials"):
    route_pallas(jnp.zeros((2, 1, 3, 8)), 2, interpret=True)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("n,e,k", [(1, 64, 10), (32, 64, 10), (1, 512, 10), (40, 512, 10)])
def test_gpu_route_kernel_of_split_partials_is_that_of_their_sum(n, e, k):
  from pallas_kernels.quant.gemv import sum_partials
  parts = jnp.stack([logits_like(n, e, seed=10 * s + n) for s in range(8)])
  w, ids = api.route(parts, k, implementation="pallas")
  w_sum, ids_sum = jax.jit(lambda p: api.route(sum_partials(p), k, implementation="pallas"))(
      parts)
  assert np.array_equal(ids, ids_sum) and np.array_equal(w, w_sum)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("n,e,k", [(1, 64, 10), (32, 64, 10), (1, 512, 10), (40, 512, 10)])
def test_gpu_route_kernel(n, e, k):
  x = logits_like(n, e, seed=n)
  w, ids = api.route(x, k, implementation="pallas")
  ref_w, ref_ids = api.route(x, k, implementation="xla")
  assert np.array_equal(ids, ref_ids)
  np.testing.assert_allclose(w, ref_w, rtol=1e-5, atol=1e-7)
