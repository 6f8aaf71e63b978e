"""GDN decode conv kernel (the split sums, the conv, the gates and the delta rule in one launch, a
program per Dv tile; `Forms.gdn_decode="pallas_conv"`): its conv state is the reference's bit for
bit, its state and output the fused step path's (bit for bit from bf16 inputs under the
interpreter), whether the conv state and weights come one layer's or as stacks read at a layer
index, and the qkv / ba projections whole or as split partials.

CPU runs the kernel under the Pallas interpreter and cross-lowers it to Triton for cuda; the
`gpu` tests run it compiled (JAX_PLATFORMS=cuda on the device)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gdn_fixtures import DECODE_SHAPES as SHAPES
from gdn_fixtures import shape_id
from model_fixtures import decode_under_forms, random_lora
from tolerances import INTERP_BITS, KERNEL_REL, assert_close

from pallas_kernels.gdn import api, reference
from pallas_kernels.gdn.decode_conv_kernel import gdn_decode_conv
from pallas_kernels.gdn.decode_fused_kernel import gdn_decode_fused
from pallas_kernels.quant.gemv import sum_partials

ON_GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU backend")
F32, BF16 = jnp.float32, jnp.bfloat16

LAYERS = 3


def make_inputs(b, hk, hv, dk, dv, n_taps, *, dtype, parts=2, seed=0):
  """(qkv partials [parts, B, C] fp32, ba partials, conv state stack [L, B, K-1, C], conv_w
  [L, C, K], a_coef [L, Hv], dt_bias [L, Hv], state [L, B, Hv, Dv, Dk], valid) at O(1)
  scales; every other row invalid (row 0 valid)."""
  rng = np.random.default_rng(seed)
  n = lambda *s: rng.standard_normal(s).astype(np.float32)
  c = 2 * hk * dk + hv * dv
  return (jnp.asarray(n(parts, b, c)), jnp.asarray(2.0 * n(parts, b, 2 * hv)),
          jnp.asarray(n(LAYERS, b, n_taps - 1, c), dtype),
          jnp.asarray(0.5 * n(LAYERS, c, n_taps)), jnp.asarray(-np.exp(n(LAYERS, hv))),
          jnp.asarray(n(LAYERS, hv)), jnp.asarray(0.3 * n(LAYERS, b, hv, dv, dk)),
          jnp.asarray(np.arange(b) % 2 == 0))


def fused_path(args, hk, dtype, layer, conv_layer, weight_layer):
  """The model's fused form: the partials summed (x's dtype), the reference conv, then the
  fused step kernel on its q / k / v and the ba halves."""
  qkv, ba, cs, w, a_coef, dt_bias, state, valid = args
  _, b, hv, dv, dk = state.shape
  r, kd = hv // hk, hk * dk
  x, ba = sum_partials(qkv).astype(dtype), sum_partials(ba).astype(dtype)
  c, conv_new = reference.causal_conv_step(x, cs[conv_layer], w[weight_layer], valid)
  q, k = c[:, :kd].reshape(b, hk, dk), c[:, kd:2 * kd].reshape(b, hk, dk)
  v = c[:, 2 * kd:].reshape(b, hv, dv).astype(F32)
  ba = ba.astype(F32).reshape(b, hk, 2 * r)
  o, s = gdn_decode_fused(q, k, v, ba[..., r:].reshape(b, hv), ba[..., :r].reshape(b, hv),
                          a_coef[weight_layer], dt_bias[weight_layer], state, valid,
                          jnp.int32(layer), interpret=True)
  return o, cs.at[conv_layer].set(conv_new), s


@pytest.mark.parametrize("block_v", [None, 4], ids=["one-tile", "Dv-tiles"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[shape_id(s) for s in SHAPES])
def test_conv_kernel_is_the_fused_path_at_each_stacks_layer(shape, dtype, block_v):
  """State layer 1, conv state layer 2, weights layer 0: the conv state is the reference's bit
  for bit; o and the state the fused path's (bit for bit from bf16 q / k / v) and the
  reference's to fp32 rounding."""
  hk = shape[1]
  args = make_inputs(*shape, dtype=dtype, seed=sum(shape))
  at = (jnp.int32(1), jnp.int32(2), jnp.int32(0))
  kw = dict(n_k_heads=hk, x_dtype=dtype)
  o, conv_new, state = gdn_decode_conv(*args, *at, interpret=True, block_v=block_v, **kw)
  want = reference.decode_conv_reference(*args, *at, **kw)
  fused = fused_path(args, hk, dtype, 1, 2, 0)
  assert o.dtype == state.dtype == F32 and conv_new.dtype == dtype
  assert np.array_equal(np.asarray(conv_new), np.asarray(want[1]))
  assert np.array_equal(np.asarray(conv_new), np.asarray(fused[1]))
  if dtype == BF16 and INTERP_BITS:   # q / k / v rounded to bf16: the fused kernel's inputs
    assert np.array_equal(np.asarray(o), np.asarray(fused[0]))
    assert np.array_equal(np.asarray(state), np.asarray(fused[2]))
  # (fp32 q / k / v: the conv's silu inside the interpreted kernel and in XLA's own fusion
  # round the last bit differently; on the GPU the interpreted bf16 conv outputs can round a
  # bf16 step apart, run 42)
  rel = KERNEL_REL["float32" if dtype == F32 or INTERP_BITS else "bfloat16"]
  for got, ref, what in ((o, fused[0], "o vs fused"), (state, fused[2], "state vs fused"),
                         (o, want[0], "o"), (state, want[2], "state")):
    assert_close(got, ref, rel=rel, what=what)


def test_conv_kernel_keeps_invalid_rows_and_other_layers_bit_for_bit():
  args = make_inputs(*SHAPES[0], dtype=BF16, seed=3)
  state0, cs0, valid = np.asarray(args[6]), np.asarray(args[2]), np.asarray(args[7])
  _, conv_new, state = gdn_decode_conv(*args, jnp.int32(2), jnp.int32(1), n_k_heads=2,
                                       interpret=True, x_dtype=BF16)
  state, conv_new = np.asarray(state), np.asarray(conv_new)
  assert np.array_equal(state[:2], state0[:2])             # other layers untouched
  assert np.array_equal(conv_new[[0, 2]], cs0[[0, 2]])
  assert np.array_equal(state[2, ~valid], state0[2, ~valid])
  assert np.array_equal(conv_new[1, ~valid], cs0[1, ~valid])
  assert not np.array_equal(state[2, valid], state0[2, valid])
  # a valid row's conv state: the old rows moved up, the projection's result last
  x = np.asarray(sum_partials(args[0]).astype(BF16))
  assert np.array_equal(conv_new[1, 0, :-1], cs0[1, 0, 1:])
  assert np.array_equal(conv_new[1, 0, -1], x[0])


def test_conv_kernel_aliases_the_recurrent_state_and_never_the_conv_state():
  """The state stack (operand 8) is updated in place; the conv state never is: a k-head's q / k
  channels are read by all its programs and written by one, in no fixed order on the GPU (the
  interpreter, running programs one by one on copies, could not show the race)."""
  args = make_inputs(*SHAPES[0], dtype=BF16)
  text = str(jax.make_jaxpr(lambda *a: gdn_decode_conv(*a, jnp.int32(0), n_k_heads=2,
                                                       interpret=True))(*args))
  assert "input_output_aliases=((8, 2),)" in text


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_conv_kernel_takes_one_layers_arrays_as_the_stacks_layer(dtype):
  """The conv state, conv weights, A and dt_bias given as one layer's arrays (no layer axis),
  and qkv / ba as whole products: the very outputs of the stacked call at that layer (the
  projections' results are their partials' sums in x's dtype)."""
  args = make_inputs(*SHAPES[0], dtype=dtype, seed=11)
  qkv, ba, cs, w, a_coef, dt_bias, state, valid = args
  kw = dict(n_k_heads=2, x_dtype=dtype, interpret=True)
  stacked = gdn_decode_conv(*args, jnp.int32(1), jnp.int32(2), jnp.int32(0), **kw)
  one = gdn_decode_conv(sum_partials(qkv).astype(dtype), sum_partials(ba).astype(dtype), cs[2],
                        w[0], a_coef[0], dt_bias[0], state, valid, jnp.int32(1), **kw)
  assert one[1].shape == cs.shape[1:]
  for a, b in ((stacked[0], one[0]), (stacked[1][2], one[1]), (stacked[2], one[2])):
    if INTERP_BITS:
      assert np.array_equal(np.asarray(a), np.asarray(b))
    else:
      assert_close(a, b, rel=KERNEL_REL[jnp.dtype(dtype).name], what="one layer vs stack")


def test_decode_conv_dispatch():
  """"pallas_conv_interpret" runs the kernel, any other choice the reference; elsewhere the
  conv choices are the fused step kernel's."""
  args = make_inputs(*SHAPES[0], dtype=F32, seed=5)
  kw = dict(n_k_heads=2, x_dtype=F32)
  got = api.decode_conv(*args, jnp.int32(0), implementation="pallas_conv_interpret", **kw)
  ref = api.decode_conv(*args, jnp.int32(0), implementation="xla", **kw)
  want = reference.decode_conv_reference(*args, jnp.int32(0), **kw)
  for a, b in zip(ref, want):
    assert np.array_equal(np.asarray(a), np.asarray(b))
  assert_close(got[0], want[0], rel=KERNEL_REL["float32"], what="o")
  assert api.fused_form("pallas_conv") == "pallas_fused"
  assert api.is_fused("pallas_conv_interpret") and api.in_place("pallas_conv", 1)
  if not ON_GPU:
    with pytest.raises(ValueError, match="needs a GPU backend"):
      api.decode_conv(*args, jnp.int32(0), implementation="pallas_conv", **kw)


def test_conv_kernel_refuses_mismatched_shapes():
  args = list(make_inputs(*SHAPES[0], dtype=F32))
  kw = dict(n_k_heads=2, interpret=True)
  with pytest.raises(ValueError, match="ba .* must be"):
    gdn_decode_conv(args[0], args[1][..., :3], *args[2:], jnp.int32(0), **kw)
  with pytest.raises(ValueError, match="multiple of Hk"):
    gdn_decode_conv(*args, jnp.int32(0), n_k_heads=3, interpret=True)
  with pytest.raises(ValueError, match="all be stacked or all one layer's"):
    gdn_decode_conv(*args[:4], args[4][0], *args[5:], jnp.int32(0), **kw)
  with pytest.raises(ValueError, match="must be the \\[L, B, Hv, Dv, Dk\\] stack"):
    gdn_decode_conv(*args[:6], args[6][0], args[7], jnp.int32(0), **kw)


@pytest.mark.parametrize("batch", [1, 32])
def test_conv_kernel_lowers_to_triton_for_the_gpu(batch):
  """bench-a3b's layer (Hk 16, Hv 32, Dk = Dv = 128, 4 taps, 36 layers), stacks and split
  partials as the model hands them, cross-lowers to Triton for cuda on this machine."""
  hk, hv, dk, dv, n_taps, layers = 16, 32, 128, 128, 4, 36
  c = 2 * hk * dk + hv * dv
  sds = jax.ShapeDtypeStruct
  shapes = (sds((2, batch, c), F32), sds((4, batch, 2 * hv), F32),
            sds((layers, batch, n_taps - 1, c), BF16), sds((layers, c, n_taps), BF16),
            sds((layers, hv), F32), sds((layers, hv), F32),
            sds((layers, batch, hv, dv, dk), F32), sds((batch,), jnp.int32), sds((), jnp.int32))
  f = jax.jit(lambda *a: gdn_decode_conv(*a, n_k_heads=hk, x_dtype=BF16))
  text = f.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
  assert "xla.gpu.triton" in text and "gdn_decode_conv" in text


def test_model_decode_under_the_conv_kernel_gives_the_fused_forms_logits():
  """`Forms.gdn_decode="pallas_conv_interpret"` (fp32 tiny model), adapter on in row 0 and off
  in row 1: the fused form's logits and states to fp32 rounding, its greedy tokens; a row that
  sits a step out keeps its GDN states bit for bit."""
  lora = random_lora().params
  # the conv state stack rides in the layer scan's carry: no [blocks, 3, B, K-1, C] slices
  blocked = lambda form: "f32[2,3,1,3,96]" in _decode_jaxpr(form)
  assert blocked("pallas_fused_interpret") and not blocked("pallas_conv_interpret")
  got, states = decode_under_forms(lora, gdn_decode="pallas_conv_interpret")
  want, want_states = decode_under_forms(lora, gdn_decode="pallas_fused_interpret")
  assert_close(got, want, rel=KERNEL_REL["float32"], what="logits")
  assert np.array_equal(got.argmax(-1), want.argmax(-1))
  assert_close(states[-1].ssm, want_states[-1].ssm, rel=KERNEL_REL["float32"], what="ssm")
  # (the conv state holds raw qkv rows, which after a step carry the fp32 rounding above)
  assert_close(states[-1].conv, want_states[-1].conv, rel=KERNEL_REL["float32"], what="conv")
  # row 1 sat out the last step: its states are those after the step before
  assert np.array_equal(states[2].ssm[:, 1], states[1].ssm[:, 1])
  assert np.array_equal(states[2].conv[:, 1], states[1].conv[:, 1])


def test_auto_decode_form_is_the_conv_kernel_to_32_rows_on_the_gpu_and_the_fused_above(
    monkeypatch):
  """`Forms.gdn_decode` "auto" (kept by `Forms.resolve` on the GPU) runs the conv kernel up to
  `CONV_MAX_BATCH` rows and the fused kernel above (above 32 rows the conv kernel is untimed),
  XLA off the GPU; a named choice runs at every batch."""
  assert api.CONV_MAX_BATCH == 32
  monkeypatch.setattr(api, "on_gpu", lambda: False)
  assert api.decode_form("auto", 1) == "xla"
  monkeypatch.setattr(api, "on_gpu", lambda: True)
  assert [api.decode_form("auto", b) for b in (1, 8, 32, 33, 64)] == [
      "pallas_conv", "pallas_conv", "pallas_conv", "pallas_fused", "pallas_fused"]
  assert api.decode_form(None, 1) == "pallas_conv"
  for named in ("pallas_conv", "pallas_fused", "xla", "pallas_layer_interpret"):
    assert api.decode_form(named, 32) == named


def test_model_decode_picks_the_auto_gdn_form_by_its_batch(monkeypatch):
  """The model's decode step asks `decode_form` with its own batch: with the backend taken
  for a GPU, tracing "auto" at 1 row reaches the compiled conv kernel and at 33 rows the
  compiled fused kernel (each refused on CPU by name); on CPU "auto" traces as XLA. (The
  backend is not in jit's cache key, so the taken-for-GPU traces run first: they fail and
  leave nothing cached. No other test traces "auto" on CPU, where `Forms.resolve` makes it
  "xla".)"""
  monkeypatch.setattr(api, "on_gpu", lambda: True)
  with pytest.raises(ValueError, match="'pallas_conv' needs a GPU"):
    _decode_jaxpr("auto", batch=1)
  with pytest.raises(ValueError, match="'pallas_fused' needs a GPU"):
    _decode_jaxpr("auto", batch=api.CONV_MAX_BATCH + 1)
  monkeypatch.undo()
  assert "gdn_decode_conv" not in _decode_jaxpr("auto", batch=1)


def _decode_jaxpr(gdn_decode, batch=1):
  """The tiny model's decode step of `batch` rows under `gdn_decode`, as jaxpr text."""
  import dataclasses

  from model_fixtures import TINY, tiny_model

  from strata_jax import steps
  from strata_jax.forms import Forms
  from strata_jax.params import empty_lora
  from strata_jax.state import init_state
  cfg = dataclasses.replace(TINY, forms=dataclasses.replace(
      Forms().resolve("cpu", F32), gdn_decode=gdn_decode))
  rows = lambda v: jnp.full(batch, v, jnp.int32)
  return str(jax.make_jaxpr(lambda p, s: steps.decode(
      cfg, p, empty_lora(cfg), s, rows(0), rows(0), rows(1)))(
          tiny_model().params, init_state(cfg, batch, 64)))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_gpu_conv_kernel_at_bench_shapes(batch):
  """Compiled at bench-a3b's layer, bf16: the conv state the reference's bit for bit, o and
  the state against the reference (and so the compiled fused path) to fp32 rounding."""
  shape = (batch, 16, 32, 128, 128, 4)
  args = make_inputs(*shape, dtype=BF16, seed=batch)
  at = (jnp.int32(1), jnp.int32(2), jnp.int32(0))
  kw = dict(n_k_heads=16, x_dtype=BF16)
  o, conv_new, state = jax.jit(lambda *a: gdn_decode_conv(*a, **kw))(*args, *at)
  want = reference.decode_conv_reference(*args, *at, **kw)
  assert np.array_equal(np.asarray(conv_new), np.asarray(want[1]))
  assert_close(o, want[0], rel=KERNEL_REL["float32"], what="o")
  assert_close(state, want[2], rel=KERNEL_REL["float32"], what="state")
