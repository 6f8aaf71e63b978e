"""Fused GDN decode kernel (gates in the kernel, invalid rows not stored): parity with
`reference.delta_rule_step_fused`, which is the model's decode path.

CPU runs the kernel under the Pallas interpreter and cross-lowers it to Triton for cuda; the
`gpu` tests run it compiled (JAX_PLATFORMS=cuda on the device)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import KERNEL_REL, assert_close

from pallas_kernels.gdn import api, reference
from pallas_kernels.gdn.decode_fused_kernel import (
  gdn_decode_fused,
  gdn_decode_fused_steps,
  sigmoid,
  softplus,
)

ON_GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU backend")
F32, BF16 = jnp.float32, jnp.bfloat16
ABS = 1e-6  # fp32 kernel vs fp32 reference: summation order and the gates' formulas differ
REL = KERNEL_REL["float32"]

# (B, Hk, Hv, Dk, Dv): B = 1, 3, 5; r = 1, 2, 3; odd head counts; Dk != Dv; Dv = 8 (the
# tiny test model's).
SHAPES = [(1, 2, 4, 16, 8), (3, 3, 6, 32, 16), (5, 1, 3, 16, 16), (3, 2, 2, 8, 32)]


def _id(s):
  return "B{}-Hk{}-Hv{}-Dk{}-Dv{}".format(*s)


def make_inputs(b, hk, hv, dk, dv, *, act=F32, seed=0):
  """Raw q/k of any norm, raw gate inputs, the layer's A = -exp(A_log) and dt_bias, an O(1)
  state."""
  rng = np.random.default_rng(seed)
  n = lambda *s: rng.standard_normal(s)
  return (jnp.asarray(2.0 * n(b, hk, dk), act), jnp.asarray(n(b, hk, dk), act),
          jnp.asarray(n(b, hv, dv), act), jnp.asarray(2.0 * n(b, hv), F32),
          jnp.asarray(2.0 * n(b, hv), F32), jnp.asarray(-np.exp(n(hv)), F32),
          jnp.asarray(n(hv), F32), jnp.asarray(n(b, hv, dv, dk), F32))


def valid_rows(b):
  """Every other row invalid (row 0 valid)."""
  return jnp.asarray(np.arange(b) % 2 == 0)


def check(got, want, what):
  (o, s), (wo, ws) = got, want
  assert o.dtype == s.dtype == jnp.float32
  assert_close(o, wo, rel=REL, abs_=ABS, what=f"{what} o")
  assert_close(s, ws, rel=REL, abs_=ABS, what=f"{what} state")


# (shape, masked): every shape masked (valid and invalid rows), one all-valid (valid=None).
PARITY = [(s, True) for s in SHAPES] + [(SHAPES[1], False)]


@pytest.mark.parametrize("act", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape,masked", PARITY,
                         ids=[f"{_id(s)}-{'masked' if m else 'all-valid'}" for s, m in PARITY])
def test_interpret_parity(shape, masked, act):
  args = make_inputs(*shape, act=act, seed=sum(shape))
  valid = valid_rows(shape[0]) if masked else None
  got = gdn_decode_fused(*args, valid, interpret=True)
  check(got, reference.delta_rule_step_fused(*args, valid), f"{_id(shape)} {act.__name__}")
  if masked:  # invalid rows: not stored, so the aliased state keeps them bit for bit
    keep = ~np.asarray(valid)
    np.testing.assert_array_equal(np.asarray(got[1])[keep], np.asarray(args[-1])[keep])


@pytest.mark.parametrize("block_v", [1, 4, 16])
def test_interpret_dv_tiles(block_v):
  """Several programs per head (block_v < Dv, down to one state row) write disjoint rows."""
  args = make_inputs(3, 2, 4, 16, 32, seed=7)
  valid = valid_rows(3)
  got = gdn_decode_fused(*args, valid, interpret=True, block_v=block_v)
  check(got, reference.delta_rule_step_fused(*args, valid), f"block_v={block_v}")


def test_gates_and_reference_are_the_model_path():
  """The kernel's softplus / sigmoid match jax.nn's; the fused oracle is the model's gates
  (g = A softplus(a + dt_bias), beta = sigmoid(b), zeroed for invalid rows) then
  `delta_rule_step_raw`."""
  x = jnp.linspace(-30.0, 30.0, 601)
  assert_close(softplus(x), jax.nn.softplus(x), rel=REL, what="softplus")
  assert_close(sigmoid(x), jax.nn.sigmoid(x), rel=REL, what="sigmoid")
  q, k, v, a, b, ac, dtb, s = make_inputs(3, 2, 4, 16, 16, seed=3)
  valid = valid_rows(3)
  ok = valid[:, None]
  g = jnp.where(ok, ac * jax.nn.softplus(a + dtb), 0.0)
  beta = jnp.where(ok, jax.nn.sigmoid(b), 0.0)
  want = reference.delta_rule_step_raw(q, k, v, g, beta, s)
  got = reference.delta_rule_step_fused(q, k, v, a, b, ac, dtb, s, valid)
  for x, y in zip(got, want):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_chained_donated_steps_update_in_place():
  """The new state feeds the next step inside a jit that donates it (the decode loop)."""
  *inp, s0 = make_inputs(2, 2, 4, 16, 16, seed=4)
  valid = jnp.asarray([True, False])
  step = jax.jit(lambda s, *a: gdn_decode_fused(*a, s, valid, interpret=True),
                 donate_argnums=0)
  s_got, s_want = jnp.array(s0), s0
  for _ in range(3):
    wo, s_want = reference.delta_rule_step_fused(*inp, s_want, valid)
    o, s_got = step(s_got, *inp)
    assert_close(o, wo, rel=REL, abs_=ABS, what="chained o")
  assert_close(s_got, s_want, rel=REL, abs_=ABS, what="chained state")
  np.testing.assert_array_equal(np.asarray(s_got[1]), np.asarray(s0[1]))


def test_stacked_state_scan_updates_one_layer_in_place():
  """With `layer`, the kernel takes every layer's state [L, B, Hv, Dv, Dk] and updates layer
  `layer` (a traced scan index) in place: a scan over the layers that carries the donated
  stack equals the per-layer oracle, and no other layer's state (nor an invalid row's) is
  touched."""
  n_layers, shape = 3, (3, 2, 4, 16, 8)
  per_layer = [make_inputs(*shape, seed=20 + i)[:7] for i in range(n_layers)]
  xs = tuple(jnp.stack(t) for t in zip(*per_layer, strict=True))
  stack0 = jnp.asarray(np.random.default_rng(4).standard_normal((n_layers, *shape[:1],
                                                                  shape[2], 8, 16)), F32)
  valid = valid_rows(3)

  def run(impl, stack):
    def body(st, x):
      layer, inp = x
      o, st = api.step_fused(*inp, st, valid, layer, implementation=impl)
      return st, o
    return jax.lax.scan(body, stack, (jnp.arange(n_layers, dtype=jnp.int32), xs))

  got = jax.jit(lambda st: run("pallas_fused_interpret", st), donate_argnums=0)(
      jnp.array(stack0))
  want_o, want_s = [], []
  for i in range(n_layers):
    o, s = reference.delta_rule_step_fused(*per_layer[i], stack0[i], valid)
    want_o.append(o)
    want_s.append(s)
  check(got[::-1], (jnp.stack(want_o), jnp.stack(want_s)), "scan over the stack")
  keep = ~np.asarray(valid)
  np.testing.assert_array_equal(np.asarray(got[0])[:, keep], np.asarray(stack0)[:, keep])
  # the jnp form of the same call: slice, step, update
  xla = jax.jit(lambda st: run("xla", st))(stack0)
  assert_close(xla[0], got[0], rel=REL, abs_=ABS, what="xla stacked form")
  # one call on layer 1 leaves layers 0 and 2 bit for bit
  _, st = gdn_decode_fused(*per_layer[1], stack0, valid, jnp.int32(1), interpret=True)
  for i in (0, 2):
    np.testing.assert_array_equal(np.asarray(st[i]), np.asarray(stack0[i]))
  with pytest.raises(ValueError, match="stack"):
    gdn_decode_fused(*per_layer[1], stack0[0], valid, jnp.int32(1), interpret=True)


def test_step_fused_dispatch():
  args = make_inputs(3, 2, 4, 16, 16, seed=5)
  valid = valid_rows(3)
  want = reference.delta_rule_step_fused(*args, valid)
  for impl in ("pallas_fused_interpret", "xla", "pallas_interpret", None):
    check(api.step_fused(*args, valid, implementation=impl), want, str(impl))
  if not ON_GPU:
    with pytest.raises(ValueError, match="needs a GPU"):
      api.step_fused(*args, implementation="pallas_fused")
  # step_raw (precomputed gates) under forms naming the fused kernel runs "auto"
  assert api.resolve("pallas_fused", 1) == api.resolve("auto", 1)
  assert api.resolve("pallas_fused_interpret", 64) == api.resolve("auto", 64)


def test_input_checks():
  args = make_inputs(1, 2, 4, 16, 16)
  q, k, v, a, b, ac, dtb, s = args
  with pytest.raises(ValueError, match="Dk=24 must be a power of 2"):
    gdn_decode_fused(*make_inputs(1, 2, 4, 24, 16), interpret=True)
  with pytest.raises(ValueError, match="block_v=32"):
    gdn_decode_fused(*args, interpret=True, block_v=32)
  with pytest.raises(ValueError, match="block_v=3"):
    gdn_decode_fused(*args, interpret=True, block_v=3)
  with pytest.raises(ValueError, match="multiple of Hk"):
    gdn_decode_fused(*make_inputs(1, 3, 4, 16, 16), interpret=True)
  with pytest.raises(ValueError, match="state must be float32"):
    gdn_decode_fused(q, k, v, a, b, ac, dtb, s.astype(BF16), interpret=True)
  with pytest.raises(ValueError, match="a .* must be"):
    gdn_decode_fused(q, k, v, a[:, :2], b, ac, dtb, s, interpret=True)
  with pytest.raises(ValueError, match="dt_bias .* must be"):
    gdn_decode_fused(q, k, v, a, b, ac, dtb[:2], s, interpret=True)
  with pytest.raises(ValueError, match="valid .* must be"):
    gdn_decode_fused(*args, jnp.ones((2,), bool), interpret=True)


@pytest.mark.parametrize("stacked", [False, True], ids=["one-layer", "stack36"])
@pytest.mark.parametrize("block_v", [8, 32])
def test_lowers_to_triton_for_the_gpu(block_v, stacked):
  """Cross-lowering on CPU at the bench's sizes (bf16 q/k/v, a mask; the stack of 36 layers
  with a traced layer index)."""
  *inp, s0 = make_inputs(2, 16, 32, 128, 128, act=BF16)
  extra = (jnp.zeros((36, *s0.shape), F32), valid_rows(2), jnp.int32(5)) if stacked else (
      s0, valid_rows(2))
  f = lambda *a: gdn_decode_fused(*a, block_v=block_v)
  text = jax.jit(f).trace(*inp, *extra).lower(lowering_platforms=("cuda",)).as_text()
  assert "triton" in text


# ------------------------------------------- T steps in one launch (speculative verification)

def make_steps_inputs(b, t, hk, hv, dk, dv, *, act=F32, seed=0):
  """make_inputs with a time axis: q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], a, b [B, T, Hv]; a
  negative zero in the state (an invalid step must keep it)."""
  rng = np.random.default_rng(seed)
  n = lambda *s: rng.standard_normal(s)
  state = n(b, hv, dv, dk)
  state[:, 0, 0, 0] = -0.0
  return (jnp.asarray(2.0 * n(b, t, hk, dk), act), jnp.asarray(n(b, t, hk, dk), act),
          jnp.asarray(n(b, t, hv, dv), act), jnp.asarray(2.0 * n(b, t, hv), F32),
          jnp.asarray(2.0 * n(b, t, hv), F32), jnp.asarray(-np.exp(n(hv)), F32),
          jnp.asarray(n(hv), F32), jnp.asarray(state, F32))


def step_by_step(q, k, v, a, b, a_coef, dt_bias, state, valid, implementation):
  """T calls of the one-step kernel (`api.step_fused`), each on the state the last left."""
  os_, ss = [], []
  for t in range(q.shape[1]):
    o, state = api.step_fused(q[:, t], k[:, t], v[:, t], a[:, t], b[:, t], a_coef, dt_bias,
                              state, valid[:, t], implementation=implementation)
    os_.append(o)
    ss.append(state)
  return jnp.stack(os_, 1), jnp.stack(ss, 1)


# (B, T, Hk, Hv, Dk, Dv): T = 3 and 5 (padded to 4 and 8 for Triton's blocks), 1, 4.
STEPS_SHAPES = [(3, 3, 2, 4, 16, 8), (2, 5, 1, 3, 16, 16), (1, 1, 2, 2, 8, 32),
                (2, 4, 2, 4, 16, 16)]


def steps_valid(b, t):
  """Row i has its first t - i steps valid (the last row possibly none)."""
  return jnp.asarray(np.arange(t)[None, :] < (t - np.arange(b))[:, None], jnp.int32)


@pytest.mark.parametrize("shape", STEPS_SHAPES, ids=lambda s: "B{}-T{}-Hk{}-Hv{}-Dk{}-Dv{}"
                         .format(*s))
def test_steps_kernel_equals_one_step_kernel_calls_bit_for_bit(shape):
  """What makes a speculative verification's GDN layer round as decode does: each step's o
  and state are the one-step kernel's, bit for bit (interpreter), invalid steps keep the
  state (negative zeros included); and both are the oracle's within fp32 rounding."""
  args = make_steps_inputs(*shape, seed=sum(shape))
  valid = steps_valid(shape[0], shape[1])
  o, steps = gdn_decode_fused_steps(*args, valid, interpret=True)
  wo, ws = step_by_step(*args, valid, "pallas_fused_interpret")
  np.testing.assert_array_equal(np.asarray(o), np.asarray(wo))
  np.testing.assert_array_equal(np.asarray(steps).view(np.uint32), np.asarray(ws).view(np.uint32))
  with jax.default_matmul_precision("highest"):
    ro, rs = reference.delta_rule_steps_fused(*args, valid)
  assert_close(o, ro, rel=REL, abs_=ABS, what="o vs oracle")
  assert_close(steps, rs, rel=REL, abs_=ABS, what="steps vs oracle")


def test_steps_fused_dispatch():
  """`api.steps_fused`: the kernel under the fused choices, a scan of `step_fused` steps
  under the others (XLA's: the oracle's numbers to fp32 rounding); bad shapes named."""
  args = make_steps_inputs(2, 3, 2, 4, 16, 8, seed=9)
  valid = steps_valid(2, 3)
  got = api.steps_fused(*args, valid, implementation="pallas_fused_interpret")
  want = gdn_decode_fused_steps(*args, valid, interpret=True)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  xo, xs = api.steps_fused(*args, valid, implementation="xla")
  with jax.default_matmul_precision("highest"):
    ro, rs = reference.delta_rule_steps_fused(*args, valid)
  assert_close(xo, ro, rel=REL, abs_=ABS, what="xla o")
  assert_close(xs, rs, rel=REL, abs_=ABS, what="xla steps")
  with pytest.raises(ValueError, match=r"valid \(2, 4\) must be \[B, T\]"):
    gdn_decode_fused_steps(*args, jnp.ones((2, 4), jnp.int32), interpret=True)
  with pytest.raises(ValueError, match="must be \\[B, T, H, D\\]"):
    gdn_decode_fused_steps(args[0][:, 0], *args[1:], valid, interpret=True)


@pytest.mark.parametrize("n_t", [5, 8])
def test_steps_kernel_lowers_to_triton_for_the_gpu(n_t):
  """Cross-lowering on CPU at the bench's verification sizes (batch 1, N + 1 = 5 positions,
  padded to 8; bf16 q/k/v)."""
  *inp, s0 = make_steps_inputs(1, n_t, 16, 32, 128, 128, act=BF16)
  f = lambda *a: gdn_decode_fused_steps(*a)
  text = jax.jit(f).trace(*inp, s0, steps_valid(1, n_t)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "triton" in text


# ---------------------------------------------------------------- compiled, on the device

# The CPU shapes in both dtypes at the default tile; the bench's (32 heads of 128, batch
# 1/8/32) in bf16 at four tiles.
BIG = [(1, 16, 32, 128, 128), (8, 16, 32, 128, 128), (32, 16, 32, 128, 128)]
GPU_CASES = ([(s, a, None) for s in SHAPES for a in (F32, BF16)]
             + [(s, BF16, bv) for s in BIG for bv in (None, 1, 8, 64)])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape,act,block_v", GPU_CASES,
                         ids=[f"{_id(s)}-{jnp.dtype(a).name}-bv{bv}" for s, a, bv in GPU_CASES])
def test_gpu_parity(shape, act, block_v):
  args = make_inputs(*shape, act=act, seed=sum(shape))
  valid = valid_rows(shape[0])
  bv = None if block_v is None else min(block_v, shape[4])
  with jax.default_matmul_precision("highest"):
    want = reference.delta_rule_step_fused(*args, valid)
  got = gdn_decode_fused(*args, valid, block_v=bv)
  check(got, want, f"gpu {_id(shape)} block_v={bv}")
  keep = ~np.asarray(valid)
  np.testing.assert_array_equal(np.asarray(got[1])[keep], np.asarray(args[-1])[keep])


@pytest.mark.gpu
@needs_gpu
def test_gpu_stacked_scan_donated():
  """36 layers' states carried through a scan and donated: each layer updated in place."""
  n_layers, b = 36, 4
  *inp, s0 = make_inputs(b, 16, 32, 128, 128, act=BF16, seed=3)
  stack0 = jnp.stack([s0 * (1 + 0.01 * i) for i in range(n_layers)])
  valid = valid_rows(b)

  def run(st):
    def body(st, layer):
      o, st = api.step_fused(*inp, st, valid, layer, implementation="pallas_fused")
      return st, o
    return jax.lax.scan(body, st, jnp.arange(n_layers, dtype=jnp.int32))
  buf = jnp.array(stack0)
  st, o = jax.jit(run, donate_argnums=0)(buf)
  assert buf.is_deleted()
  with jax.default_matmul_precision("highest"):
    for i in (0, 17, 35):
      wo, ws = reference.delta_rule_step_fused(*inp, stack0[i], valid)
      check((o[i], st[i]), (wo, ws), f"gpu stacked layer {i}")


def test_model_decode_under_fused_form_keeps_idle_rows():
  """`steps.decode` with gdn_decode="pallas_fused_interpret" (no full-state select: the
  kernel does not store an inactive row) leaves the inactive row's recurrent and conv state
  bit for bit and gives the active row the state and logits of the jnp ("xla") form."""
  import dataclasses

  from model_fixtures import tiny_model

  from strata_jax import steps
  from strata_jax.forms import Forms
  from strata_jax.state import init_state
  model = tiny_model()
  state = init_state(model.cfg, 2, 16)
  rng = np.random.default_rng(0)  # a nonzero recurrent state, as after a prefill
  state = state.replace(ssm=jnp.asarray(rng.standard_normal(state.ssm.shape), F32),
                        conv=jnp.asarray(rng.standard_normal(state.conv.shape), F32),
                        pos=jnp.asarray([7, 11], jnp.int32))
  before = jax.tree.map(np.asarray, state)
  run = {}
  for form in ("xla", "pallas_fused_interpret"):
    cfg = dataclasses.replace(model.cfg, forms=Forms(gdn_decode=form))
    st = jax.tree.map(jnp.array, before)  # decode donates its state
    run[form] = steps.decode(cfg, model.params, None, st, jnp.asarray([5, 6], jnp.int32),
                             jnp.zeros(2, jnp.int32), jnp.asarray([1, 0], jnp.int32))
  (lg, st), (wlg, wst) = run["pallas_fused_interpret"], run["xla"]
  for name in ("conv", "ssm"):
    np.testing.assert_array_equal(np.asarray(getattr(st, name))[:, 1],
                                  getattr(before, name)[:, 1])
  assert not np.array_equal(np.asarray(st.ssm)[:, 0], before.ssm[:, 0])
  assert_close(st.ssm, wst.ssm, rel=REL, abs_=ABS, what="ssm vs xla form")
  assert_close(lg[0], wlg[0], abs_=1e-5, what="active row logits vs xla form")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", STEPS_SHAPES + [(1, 5, 16, 32, 128, 128)],
                         ids=lambda s: "B{}-T{}-Hk{}-Hv{}-Dk{}-Dv{}".format(*s))
def test_gpu_steps_kernel(shape):
  """Compiled: the T-step kernel against the oracle (fp32 rounding) and, for invalid steps,
  the state kept bit for bit."""
  args = make_steps_inputs(*shape, act=BF16 if shape[-1] == 128 else F32, seed=sum(shape))
  valid = steps_valid(shape[0], shape[1])
  o, steps = gdn_decode_fused_steps(*args, valid)
  with jax.default_matmul_precision("highest"):
    ro, rs = reference.delta_rule_steps_fused(*args, valid)
  assert_close(o, ro, rel=REL, abs_=ABS, what="o")
  assert_close(steps, rs, rel=REL, abs_=ABS, what="steps")
  first_invalid = np.asarray(valid).sum(1)
  for i, n in enumerate(first_invalid):
    if n < shape[1]:   # from its first invalid step on, the row keeps the state it had
      kept = np.asarray(steps)[i, n - 1] if n else np.asarray(args[-1])[i]
      np.testing.assert_array_equal(np.asarray(steps)[i, n:].view(np.uint32),
                                    np.broadcast_to(kept, np.asarray(steps)[i, n:].shape)
                                    .view(np.uint32))
