"""Chunked GDN kernel (prefill): parity with `reference.delta_rule_chunked`, vmapped over B.

CPU runs the kernel under the Pallas interpreter (tiny shapes: every case compiles anew);
the `gpu` tests run it compiled (set JAX_PLATFORMS=cuda on the device, as tests/conftest.py
defaults to cpu). The GPU tests have not run yet (README, "Chunked kernel").
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import DELTA_RULE_FP32, assert_close

from pallas_kernels.gdn import api, reference
from pallas_kernels.gdn.chunked_kernel import chunk_size, gdn_chunked_pallas

ON_GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU backend")


@pytest.fixture(autouse=True)
def full_fp32_dots():
  """The kernel's fp32 dots follow the caller's matmul precision (the model's Forms set it:
  "highest" for float32); these parity checks against the fp32 oracle ask for full fp32, as
  the float32 model does. On the GPU the default would be TF32 (errors ~1e-4)."""
  with jax.default_matmul_precision("highest"):
    yield
F32, BF16 = jnp.float32, jnp.bfloat16
H = 2
# Compiled at Triton's default fp32 dot precision (TF32) against the HIGHEST oracle. A CPU
# emulation of the kernel's products with TF32 operands (T = 2,560, 8 heads of 128, inputs
# as `make_inputs`) was off by 0.9e-3 (o) and 1.5e-3 (state) relative to max |want| with
# truncated operands, 0.3e-3 / 0.7e-3 rounded; a first bound, not yet checked on a GPU.
TF32_REL = 5e-3

# (B, T, Dk, Dv, chunk): B = 1 and 2; T = 1, 37 and 130 pad, 64 does not; Dk != Dv both ways;
# Dk = 24, Dv = 8 are zero-padded to 32 and 16 (the tiny test model has Dv = 8).
CASES = [(1, 1, 16, 16, 64), (2, 37, 16, 32, 16), (1, 64, 32, 32, 64), (2, 64, 24, 8, 16),
         (2, 130, 32, 16, 64)]


def _id(c):
  return "B{}-T{}-Dk{}-Dv{}-C{}".format(*c)


def make_inputs(b, t, h, dk, dv, *, act=F32, seed=0):
  """Model-like inputs: unit q/k (q scaled), g = -softplus <= 0, beta in (0, 1), O(1) state."""
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q = jnp.asarray(unit(rng.standard_normal((b, t, h, dk))) / np.sqrt(dk), act)
  k = jnp.asarray(unit(rng.standard_normal((b, t, h, dk))), act)
  v = jnp.asarray(rng.standard_normal((b, t, h, dv)), act)
  g = jnp.asarray(-np.log1p(np.exp(rng.standard_normal((b, t, h)))), F32)
  beta = jnp.asarray(1.0 / (1.0 + np.exp(-rng.standard_normal((b, t, h)))), F32)
  state = jnp.asarray(rng.standard_normal((b, h, dv, dk)), F32)
  return q, k, v, g, beta, state


def oracle(q, k, v, g, beta, state, chunk=64):
  one = lambda *a: reference.delta_rule_chunked(*a, chunk=chunk)
  return jax.vmap(one)(*(x.astype(F32) for x in (q, k, v, g, beta)), state)


def check(got, want, what, **tol):
  (o, s), (wo, ws) = got, want
  assert o.dtype == s.dtype == jnp.float32
  tol = tol or {"abs_": DELTA_RULE_FP32}
  assert_close(o, wo, what=f"{what} o", **tol)
  assert_close(s, ws, what=f"{what} state", **tol)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_interpret_parity(case):
  b, t, dk, dv, c = case
  args = make_inputs(b, t, H, dk, dv, seed=sum(case))
  got = gdn_chunked_pallas(*args, chunk=c, interpret=True)
  assert got[0].shape == (b, t, H, dv) and got[1].shape == (b, H, dv, dk)
  check(got, oracle(*args, chunk=c), _id(case))


def test_interpret_dv_tiles_bf16():
  """Several programs per head (block_v < Dv) write disjoint state rows; bf16 q/k/v are
  read and upcast in the kernel (the oracle gets the same values in fp32)."""
  args = make_inputs(2, 40, H, 16, 32, act=BF16, seed=5)
  got = gdn_chunked_pallas(*args, chunk=16, interpret=True, block_v=16)
  check(got, oracle(*args, chunk=16), "block_v=16 bf16")


def test_zero_gates_leave_state_unchanged():
  """g = beta = 0 (the padding rows) leave the state bit for bit: u = 0, e^0 = 1."""
  q, k, v, g, beta, s0 = make_inputs(2, 20, H, 16, 16, seed=1)
  _, s = gdn_chunked_pallas(q, k, v, jnp.zeros_like(g), jnp.zeros_like(beta), s0, chunk=16,
                            interpret=True)
  np.testing.assert_array_equal(np.asarray(s), np.asarray(s0))


def test_api_chunked_under_vmap():
  """The model's call, `jax.vmap(api.chunked)`, runs the kernel (Pallas's batching rule folds
  the vmapped axis into the grid) and equals `chunked_batched` and the oracle."""
  args = make_inputs(2, 37, H, 16, 16, seed=2)
  want = oracle(*args, chunk=16)
  one = lambda *a: api.chunked(*a, chunk=16, implementation="pallas_interpret")
  vm = jax.jit(jax.vmap(one))(*args)
  check(vm, want, "vmap(api.chunked)")
  bat = api.chunked_batched(*args, chunk=16, implementation="pallas_interpret")
  check(bat, want, "api.chunked_batched")
  np.testing.assert_array_equal(np.asarray(vm[0]), np.asarray(bat[0]))


def test_api_choice():
  assert api.chunked_implementation() == ("pallas_split" if ON_GPU else "reference")
  assert api.chunked_implementation("pallas_interpret") == "pallas_interpret"
  assert api.chunked_implementation("products") == "products"
  with pytest.raises(ValueError, match="unknown implementation 'fast'"):
    api.chunked_implementation("fast")
  if not ON_GPU:
    with pytest.raises(ValueError, match="needs a GPU"):
      api.chunked_implementation("pallas")


def test_input_checks():
  args = make_inputs(1, 8, H, 16, 16)
  with pytest.raises(ValueError, match="power of 2"):
    gdn_chunked_pallas(*args, chunk=48, interpret=True)
  with pytest.raises(ValueError, match="block_v"):
    gdn_chunked_pallas(*args, interpret=True, block_v=32)
  q, k, v, g, beta, s = args
  with pytest.raises(ValueError, match="state must be float32"):
    gdn_chunked_pallas(q, k, v, g, beta, s.astype(BF16), interpret=True)
  with pytest.raises(ValueError, match="g "):
    gdn_chunked_pallas(q, k, v, g[:, :4], beta, s, interpret=True)
  assert [chunk_size(t, 64) for t in (1, 16, 17, 37, 64, 2500)] == [16, 16, 32, 64, 64, 64]


# Bench shape: one sequence of 2,500 tokens, 32 heads of 128 (experiments/bench).
GPU_SHAPE = (1, 2500, 32, 128, 128)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("chunk", [64, 32])
def test_gpu_parity_bench_shape(chunk):
  b, t, h, dk, dv = GPU_SHAPE
  args = make_inputs(b, t, h, dk, dv, seed=11)
  want = oracle(*args, chunk=64)
  x3 = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3  # near-fp32 products on tensor cores
  check(gdn_chunked_pallas(*args, chunk=chunk, precision=x3), want, f"gpu 3xtf32 C={chunk}")
  check(gdn_chunked_pallas(*args, chunk=chunk), want, f"gpu tf32 C={chunk}", rel=TF32_REL)


@pytest.mark.gpu
@needs_gpu
def test_gpu_api_vmap_and_tiles():
  """The model's vmapped call on the GPU, a bf16 input, and several Dv tiles."""
  args = make_inputs(2, 300, 4, 128, 128, seed=12)
  want = oracle(*args)
  vm = jax.jit(jax.vmap(lambda *a: api.chunked(*a, implementation="pallas")))(*args)
  check(vm, want, "gpu vmap(api.chunked)", rel=TF32_REL)
  for bv in (16, 64, 128):
    check(gdn_chunked_pallas(*args, block_v=bv), want, f"gpu block_v={bv}", rel=TF32_REL)
  bf = make_inputs(2, 300, 4, 128, 128, act=BF16, seed=13)
  check(gdn_chunked_pallas(*bf), oracle(*bf), "gpu bf16", rel=TF32_REL)
