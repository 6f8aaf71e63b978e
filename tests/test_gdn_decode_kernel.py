"""Fused GDN decode kernel: parity with `delta_rule_step_raw`, which equals the model's path.

CPU runs the kernel under the Pallas interpreter; the `gpu` tests run it compiled (set
JAX_PLATFORMS=cuda on the device, as tests/conftest.py defaults to cpu).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import KERNEL_REL, assert_close

from pallas_kernels.gdn import api, reference
from pallas_kernels.gdn.decode_kernel import gdn_decode_pallas
from strata_jax.model.common import l2_norm

ON_GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU backend")
F32, BF16 = jnp.float32, jnp.bfloat16
ABS = 1e-6  # fp32 kernel vs fp32 reference: only the summation order differs
REL = KERNEL_REL["float32"]

# (B, Hk, Hv, Dk, Dv): r = 2 and r = 1, square and Dk != Dv heads, B = 1 and 3.
SHAPES = [(1, 2, 4, 16, 16), (3, 2, 4, 32, 64), (3, 4, 4, 16, 16), (1, 2, 2, 32, 64)]


def _id(s):
  return "B{}-Hk{}-Hv{}-Dk{}-Dv{}".format(*s)


def make_inputs(b, hk, hv, dk, dv, *, act=F32, seed=0):
  """Model-like inputs: raw q/k of any norm, g <= 0, beta in (0, 1), an O(1) state."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(2.0 * rng.standard_normal((b, hk, dk)), act)
  k = jnp.asarray(rng.standard_normal((b, hk, dk)), act)
  v = jnp.asarray(rng.standard_normal((b, hv, dv)), act)
  g = jnp.asarray(-np.log1p(np.exp(rng.standard_normal((b, hv)))), F32)  # -softplus
  beta = jnp.asarray(1.0 / (1.0 + np.exp(-rng.standard_normal((b, hv)))), F32)
  state = jnp.asarray(rng.standard_normal((b, hv, dv, dk)), F32)
  return q, k, v, g, beta, state


def check(got, want, what):
  (o, s), (wo, ws) = got, want
  assert o.dtype == s.dtype == jnp.float32
  assert_close(o, wo, rel=REL, abs_=ABS, what=f"{what} o")
  assert_close(s, ws, rel=REL, abs_=ABS, what=f"{what} state")


@pytest.mark.parametrize("act", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_interpret_parity(shape, act):
  args = make_inputs(*shape, act=act, seed=sum(shape))
  want = reference.delta_rule_step_raw(*args)
  check(gdn_decode_pallas(*args, interpret=True), want, f"{_id(shape)} {jnp.dtype(act).name}")


@pytest.mark.parametrize("block_v", [16, 32])
def test_interpret_dv_tiles(block_v):
  """Several programs per head (the compiled default) write disjoint state rows."""
  args = make_inputs(3, 2, 4, 32, 64, seed=7)
  got = gdn_decode_pallas(*args, interpret=True, block_v=block_v)
  check(got, reference.delta_rule_step_raw(*args), f"block_v={block_v}")


def test_raw_reference_is_model_path():
  """`delta_rule_step_raw` is the model's decode path: l2_norm, head repeat, vmap(step)."""
  b, hk, hv, dk, dv = 3, 2, 4, 32, 64
  for act in (F32, BF16):
    q, k, v, g, beta, state = make_inputs(b, hk, hv, dk, dv, act=act, seed=11)
    r = hv // hk
    qm = jnp.repeat(l2_norm(q) * (dk ** -0.5), r, axis=1)
    km = jnp.repeat(l2_norm(k), r, axis=1)
    wo, ws = jax.vmap(reference.delta_rule_step)(qm, km, v.astype(F32), g, beta, state)
    o, s = reference.delta_rule_step_raw(q, k, v, g, beta, state)
    assert_close(o, wo, abs_=1e-7, what="o")
    assert_close(s, ws, abs_=1e-7, what="state")


def test_decode_chains_steps():
  """The new state feeds the next step (the decode loop), in a jit that donates it."""
  args = make_inputs(1, 2, 4, 16, 16, seed=3)
  step = jax.jit(lambda *a: gdn_decode_pallas(*a, interpret=True), donate_argnums=5)
  s_got, s_want = jnp.array(args[5]), args[5]  # a copy: the step donates (deletes) s_got
  for _ in range(3):
    wo, s_want = reference.delta_rule_step_raw(*args[:5], s_want)
    o, s_got = step(*args[:5], s_got)
    assert_close(o, wo, rel=REL, abs_=ABS, what="chained o")
  assert_close(s_got, s_want, rel=REL, abs_=ABS, what="chained state")


@pytest.mark.parametrize("impl", ["pallas_interpret", "xla",
                                  pytest.param("pallas", marks=[pytest.mark.gpu, needs_gpu])])
def test_stacked_step_updates_its_layer_in_place_and_skips_idle_rows(impl):
  """`step_raw(layer=, valid=)`: layer 2 of a 4-layer stack is the one-layer step's, bit for bit,
  for the valid rows; idle rows (negative zeros included) and the other layers are left as they
  were. One exception: XLA's form compiled for the GPU fuses the stacked and the one-layer
  programs differently, so there its valid rows agree to fp32 rounding only (GPU run 12,
  gpu_tests_run12_failures.txt); the Pallas kernels are bit for bit on every backend."""
  step_raw = api.step_raw
  q, k, v, g, beta, s0 = make_inputs(3, 2, 4, 16, 32, act=F32, seed=5)
  stack = jnp.asarray(np.random.default_rng(6).standard_normal((4, *s0.shape)), F32)
  stack = stack.at[2, 1, :, 0].set(-0.0)
  valid = jnp.asarray([1, 0, 1], jnp.int32)
  o1, s1 = jax.jit(lambda st: step_raw(q, k, v, g, beta, st, implementation=impl))(stack[2])
  o2, s2 = jax.jit(lambda st, i: step_raw(q, k, v, g, beta, st, implementation=impl, layer=i,
                                          valid=valid))(stack, jnp.int32(2))
  bits = lambda a: np.asarray(a).tobytes()
  if impl == "xla" and ON_GPU:
    assert_close(o2, o1, rel=REL, abs_=ABS, what="o")
    assert_close(s2[2, ::2], s1[::2], rel=REL, abs_=ABS, what="valid rows' state")
  else:
    assert bits(o2) == bits(o1)
    assert bits(s2[2, 0]) == bits(s1[0]) and bits(s2[2, 2]) == bits(s1[2])
  assert bits(s2[2, 1]) == bits(stack[2, 1])            # idle row: not stored
  assert bits(s2[np.array([0, 1, 3])]) == bits(stack[np.array([0, 1, 3])])


@pytest.mark.parametrize("stacked", [False, True], ids=["one-layer", "stack36"])
def test_step_kernel_lowers_to_triton_for_the_gpu(stacked):
  """Cross-lowering on CPU at the bench's sizes (batch 32, bf16 q/k/v; the stack of 36 layers
  with a traced layer index and a mask)."""
  q, k, v, g, beta, s0 = make_inputs(32, 16, 32, 128, 128, act=BF16)
  extra = (jnp.zeros((36, *s0.shape), F32), jnp.int32(5), jnp.ones((32,), jnp.int32)) if (
      stacked) else (s0,)
  f = lambda *a: gdn_decode_pallas(*a)
  text = jax.jit(f).trace(q, k, v, g, beta, *extra).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "triton" in text


def test_input_checks():
  q, k, v, g, beta, state = make_inputs(1, 2, 4, 16, 16)
  with pytest.raises(ValueError, match="Dk=24 must be a power of 2 >= 16"):
    gdn_decode_pallas(*make_inputs(1, 2, 4, 24, 16), interpret=True)
  with pytest.raises(ValueError, match="Dv=8 must be a power of 2 >= 16"):
    gdn_decode_pallas(*make_inputs(1, 2, 4, 16, 8), interpret=True)
  with pytest.raises(ValueError, match="block_v=48"):
    gdn_decode_pallas(q, k, v, g, beta, state, interpret=True, block_v=48)
  with pytest.raises(ValueError, match="block_v=32"):
    gdn_decode_pallas(q, k, v, g, beta, state, interpret=True, block_v=32)
  with pytest.raises(ValueError, match="multiple of Hk"):
    gdn_decode_pallas(*make_inputs(1, 3, 4, 16, 16), interpret=True)
  with pytest.raises(ValueError, match="state must be float32"):
    gdn_decode_pallas(q, k, v, g, beta, state.astype(BF16), interpret=True)
  with pytest.raises(ValueError, match="g .* must be"):
    gdn_decode_pallas(q, k, v, g[:, :2], beta, state, interpret=True)


def test_step_raw_dispatch(monkeypatch):
  args = make_inputs(3, 2, 4, 16, 16, seed=5)
  want = reference.delta_rule_step_raw(*args)
  for impl in ("xla", "pallas_interpret"):
    check(api.step_raw(*args, implementation=impl), want, impl)
  small, large = api.resolve(None, 1), api.resolve(None, api.AUTO_PALLAS_MIN_BATCH)
  assert (small, large) == (("xla", "pallas") if ON_GPU else ("xla", "xla"))
  assert api.resolve("pallas_interpret", 1) == "pallas_interpret"
  assert api.resolve("xla", 64) == "xla"
  with pytest.raises(ValueError, match="unknown implementation 'triton'"):
    api.resolve("triton", 1)
  with pytest.raises(ValueError, match="unknown implementation"):
    api.step_raw(*args, implementation="cuda")
  if not ON_GPU:
    with pytest.raises(ValueError, match="needs a GPU"):
      api.step_raw(*args, implementation="pallas")


# ---------------------------------------------------------------- compiled, on the device

GPU_SHAPES = [*SHAPES, (1, 16, 32, 128, 128), (8, 16, 32, 128, 128), (5, 16, 16, 128, 128),
              (2, 4, 8, 64, 256)]


@pytest.fixture
def highest_precision():
  """fp32 parity on GPU: the reference's einsums are HIGHEST already; this covers the rest."""
  with jax.default_matmul_precision("highest"):
    yield


@pytest.mark.gpu
@needs_gpu
@pytest.mark.usefixtures("highest_precision")
@pytest.mark.parametrize("block_v", [None, 16, 64])
@pytest.mark.parametrize("act", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=_id)
def test_gpu_parity(shape, act, block_v):
  args = make_inputs(*shape, act=act, seed=sum(shape))
  want = reference.delta_rule_step_raw(*args)
  bv = None if block_v is None else min(block_v, shape[4])
  check(gdn_decode_pallas(*args, block_v=bv), want, f"gpu {_id(shape)} block_v={bv}")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.usefixtures("highest_precision")
@pytest.mark.parametrize("impl", ["pallas", "auto"])
def test_gpu_step_raw_donated(impl):
  b = api.AUTO_PALLAS_MIN_BATCH
  assert api.resolve("auto", b) == "pallas"
  args = make_inputs(b, 16, 32, 128, 128, act=BF16, seed=1)
  want = reference.delta_rule_step_raw(*args)
  state = jnp.array(args[5])  # a buffer of our own to donate
  f = jax.jit(lambda *a: api.step_raw(*a, implementation=impl), donate_argnums=5)
  check(f(*args[:5], state), want, f"gpu step_raw {impl} donated")
  assert state.is_deleted()
