"""Chunk-parallel GDN kernels (prefill): parity with `reference.delta_rule_chunked`, vmapped
over B, for both state passes ("fused": two launches; "separate": three, fla's split).

CPU runs the kernels under the Pallas interpreter and cross-lowers them to Triton for cuda
(every construct has a Triton lowering rule; compiling needs the device). The `gpu` tests run
them compiled (JAX_PLATFORMS=cuda on the device)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_gdn_chunked_kernel import TF32_REL, check, make_inputs, oracle
from tolerances import DELTA_RULE_FP32, KERNEL_REL, assert_close

from pallas_kernels.gdn import api, reference
from pallas_kernels.gdn.parallel_kernel import (
    INVERSES,
    STATE_PASSES,
    gated_norm_out,
    gdn_chunked_parallel,
)

ON_GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU backend")
F32, BF16 = jnp.float32, jnp.bfloat16
H = 2


@pytest.fixture(autouse=True)
def full_fp32_dots():
  """Full fp32 products against the fp32 oracle (as test_gdn_chunked_kernel.py)."""
  with jax.default_matmul_precision("highest"):
    yield


# (B, T, H, Dk, Dv, chunk): T = 1 (one padded chunk), 37 and 130 (padded), 64 (whole chunks);
# B = 1, 2, 3; 3 heads; Dk != Dv both ways; Dk = 24, Dv = 8 zero-padded to 32 and 16.
CASES = [(1, 1, 2, 16, 16, 64), (2, 37, 3, 16, 32, 16), (1, 64, 2, 32, 32, 32),
         (3, 64, 2, 24, 8, 16), (2, 130, 2, 32, 16, 64)]


def _id(c):
  return "B{}-T{}-H{}-Dk{}-Dv{}-C{}".format(*c)


# every case with the fused pass, three with the separate one
PARITY = [(c, "fused") for c in CASES] + [(CASES[i], "separate") for i in (1, 3, 4)]


@pytest.mark.parametrize("case,state_pass", PARITY, ids=[f"{_id(c)}-{p}" for c, p in PARITY])
def test_interpret_parity(case, state_pass):
  b, t, h, dk, dv, c = case
  args = make_inputs(b, t, h, dk, dv, seed=sum(case))
  got = gdn_chunked_parallel(*args, chunk=c, interpret=True, state_pass=state_pass)
  assert got[0].shape == (b, t, h, dv) and got[1].shape == (b, h, dv, dk)
  check(got, oracle(*args, chunk=c), f"{_id(case)} {state_pass}")


@pytest.mark.parametrize("state_pass", STATE_PASSES)
def test_interpret_dv_tiles_bf16(state_pass):
  """bf16 q/k/v (upcast in the kernels; the oracle gets the same values in fp32), several
  state-pass programs per head (block_v < Dv) writing disjoint state rows."""
  args = make_inputs(2, 45, H, 16, 32, act=BF16, seed=5)
  got = gdn_chunked_parallel(*args, chunk=16, interpret=True, block_v=16, state_pass=state_pass)
  check(got, oracle(*args, chunk=16), f"block_v=16 bf16 {state_pass}")


@pytest.mark.parametrize("state_pass", STATE_PASSES)
def test_interpret_bf16_intermediates(state_pass):
  """ū, w (and u, h) kept in bf16 between the launches: within bf16 rounding of the oracle."""
  args = make_inputs(2, 45, H, 16, 32, act=BF16, seed=6)
  got = gdn_chunked_parallel(*args, chunk=16, interpret=True, state_pass=state_pass,
                             inter_dtype=BF16)
  check(got, oracle(*args, chunk=16), f"bf16 intermediates {state_pass}",
        rel=KERNEL_REL["bfloat16"])


# inverse="blocked" (T by 16-row blocks): C = 16 (one block), 32, 64; T not a multiple of C;
# both state passes; bf16 q/k/v.
BLOCKED = [((1, 37, 2, 16, 32, 16), "fused", F32), ((1, 70, 2, 32, 16, 32), "separate", F32),
           ((1, 100, 2, 16, 16, 64), "fused", BF16), ((2, 45, 2, 24, 8, 64), "separate", BF16)]


@pytest.mark.parametrize("case,state_pass,act", BLOCKED,
                         ids=[f"{_id(c)}-{p}-{jnp.dtype(a).name}" for c, p, a in BLOCKED])
def test_interpret_parity_blocked_inverse(case, state_pass, act):
  b, t, h, dk, dv, c = case
  args = make_inputs(b, t, h, dk, dv, act=act, seed=sum(case))
  got = gdn_chunked_parallel(*args, chunk=c, interpret=True, state_pass=state_pass,
                             inverse="blocked")
  check(got, oracle(*args, chunk=c), f"{_id(case)} {state_pass} blocked")


def test_blocked_inverse_matches_products():
  """The two ways to T give the same outputs to fp32 rounding (four 16-row blocks)."""
  args = make_inputs(1, 100, H, 16, 16, seed=7)
  run = lambda inverse: gdn_chunked_parallel(*args, chunk=64, interpret=True, inverse=inverse)
  check(run("blocked"), run("products"), "blocked vs products")


def test_matches_serial_kernel_and_zero_gates_keep_state():
  """The two state passes agree with each other; g = beta = 0 leaves the state bit for bit."""
  q, k, v, g, beta, s0 = make_inputs(2, 40, H, 16, 16, seed=1)
  fused = gdn_chunked_parallel(q, k, v, g, beta, s0, chunk=16, interpret=True)
  split = gdn_chunked_parallel(q, k, v, g, beta, s0, chunk=16, interpret=True,
                               state_pass="separate")
  check(fused, split, "fused vs separate")
  z = jnp.zeros_like(g)
  _, s = gdn_chunked_parallel(q, k, v, z, z, s0, chunk=16, interpret=True)
  np.testing.assert_array_equal(np.asarray(s), np.asarray(s0))


def test_api_forms_under_vmap():
  """The model's call, `jax.vmap(api.chunked)`, with each interpreted parallel form equals
  `chunked_batched` and the oracle (the pallas chunk caps the chunk, as for "pallas")."""
  args = make_inputs(2, 37, H, 16, 16, seed=2)
  want = oracle(*args, chunk=16)
  for impl in api.PARALLEL_INTERPRET:
    one = lambda *a, impl=impl: api.chunked(*a, chunk=64, implementation=impl, pallas_chunk=16)
    vm = jax.jit(jax.vmap(one))(*args)
    check(vm, want, f"vmap(api.chunked) {impl}")
    bat = api.chunked_batched(*args, chunk=16, implementation=impl)
    check(bat, want, f"api.chunked_batched {impl}")


@pytest.mark.parametrize("state_pass", STATE_PASSES)
def test_grouped_q_k_heads_read_in_place_equal_the_repeated_heads(state_pass):
  """q/k with Hk = 2 heads for H = 6 v-heads (v-head h reads k-head h // 3 through the index
  maps) give the bits of q/k repeated to 6 heads; the api's other forms repeat them, and a
  head count that does not divide H is refused."""
  q, k, v, g, beta, s0 = make_inputs(2, 37, 6, 16, 32, act=BF16, seed=11)
  qg, kg = q[:, :, ::3], k[:, :, ::3]                       # [B, T, 2, Dk]
  rep = lambda a: jnp.repeat(a, 3, axis=2)
  run = lambda qq, kk: gdn_chunked_parallel(qq, kk, v, g, beta, s0, chunk=16, interpret=True,
                                            state_pass=state_pass, inter_dtype=BF16)
  for got, want in zip(run(qg, kg), run(rep(qg), rep(kg))):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  ref = api.chunked_batched(qg, kg, v, g, beta, s0, chunk=16, implementation="reference")
  check(ref, oracle(rep(qg), rep(kg), v, g, beta, s0, chunk=16), "reference, grouped")
  with pytest.raises(ValueError, match="multiple of q's"):
    run(q[:, :, :4], k[:, :, :4])


@pytest.mark.parametrize("act", [BF16, F32], ids=["bf16", "fp32"])
def test_api_keeps_intermediates_in_16_bit_inputs_dtype_and_fp32_otherwise(act):
  """The model's path keeps ū, w, u and h in q/k/v's dtype when it is 16-bit (as fla does),
  in fp32 for fp32 inputs: bit for bit the kernel called with that `inter_dtype`, and for
  bf16 not the fp32-intermediate result."""
  args = make_inputs(2, 45, H, 16, 32, act=act, seed=7)
  for impl, sp in api.PARALLEL_INTERPRET.items():
    got = api.chunked_batched(*args, chunk=16, implementation=impl)
    kernel = lambda inter, sp=sp: gdn_chunked_parallel(*args, chunk=16, interpret=True,
                                                       state_pass=sp, inter_dtype=inter)
    want = kernel(BF16 if act == BF16 else None)
    for g_, w_ in zip(got, want):
      np.testing.assert_array_equal(np.asarray(g_), np.asarray(w_))
    if act == BF16:
      assert not np.array_equal(np.asarray(got[0]), np.asarray(kernel(None)[0]))


def _gate(b, t, h, dv, act, seed):
  rng = np.random.default_rng(seed)
  z = jnp.asarray(rng.standard_normal((b, t, h, dv)), act)
  norm_w = jnp.asarray(1.0 + 0.1 * rng.standard_normal(dv), act)
  return z, norm_w


# (B, T, H, Hk, Dv, chunk, dtype): T padded to whole chunks (37, 130) or not (64); Dv = 8
# zero-padded to 16 (the tiny model's); grouped q/k heads; bf16 and fp32.
GATED = [(2, 37, 3, 3, 32, 16, F32), (1, 64, 4, 2, 16, 32, BF16), (3, 64, 2, 1, 8, 16, F32),
         (2, 130, 2, 2, 16, 64, BF16)]


@pytest.mark.parametrize("case", GATED, ids=lambda c: "B{}-T{}-H{}-Hk{}-Dv{}-C{}-{}".format(
    *c[:-1], jnp.dtype(c[-1]).name))
def test_gated_norm_in_the_output_launch_equals_the_norm_after_the_op(case):
  """`gated_norm_out` (the norm in the separate pass's output launch, y unpadded, stored
  masked) against `reference.gated_rms_norm` of the separate pass's o: the same state bit
  for bit, y to the rounding of the norm in its dtype."""
  b, t, h, hk, dv, c, act = case
  q, k, v, g, beta, s0 = make_inputs(b, t, h, 16, dv, act=act, seed=t + dv)
  q, k = q[:, :, ::h // hk], k[:, :, ::h // hk]
  z, norm_w = _gate(b, t, h, dv, act, seed=c)
  inter = act if act == BF16 else None
  o, s = gdn_chunked_parallel(q, k, v, g, beta, s0, chunk=c, interpret=True,
                              state_pass="separate", inter_dtype=inter)
  y, s_y = gated_norm_out(q, k, v, g, beta, s0, z, norm_w, eps=1e-6, out_dtype=act, chunk=c,
                          interpret=True, inter_dtype=inter)
  assert y.shape == (b, t, h, dv) and y.dtype == act
  np.testing.assert_array_equal(np.asarray(s_y), np.asarray(s))
  want = reference.gated_rms_norm(o, z, norm_w, 1e-6, act)
  assert_close(y, want, rel=KERNEL_REL[jnp.dtype(act).name], what=f"gated y {case}")
  assert np.all(np.isfinite(np.asarray(y, np.float32)))


def test_api_chunked_gated_is_the_op_then_the_norm_under_vmap():
  """The model's call, `jax.vmap(api.chunked_gated)`: the reference form is `chunked`, then
  `reference.gated_rms_norm`, bit for bit; "pallas_split_interpret" (the norm in the kernel)
  equals it to the norm's rounding; "pallas_parallel_interpret" (no separate output launch)
  runs the op, then the norm."""
  q, k, v, g, beta, s0 = make_inputs(2, 37, H, 16, 16, act=BF16, seed=3)
  z, norm_w = _gate(2, 37, H, 16, BF16, seed=4)
  for impl in ("reference", "pallas_parallel_interpret", "pallas_split_interpret"):
    gated = lambda q, k, v, g, b, s, z, impl=impl: api.chunked_gated(
        q, k, v, g, b, s, z, norm_w, eps=1e-6, out_dtype=BF16, pallas_chunk=16,
        implementation=impl)
    plain = lambda *a, impl=impl: api.chunked(*a, pallas_chunk=16, implementation=impl)
    y, s = jax.jit(jax.vmap(gated))(q, k, v, g, beta, s0, z)
    o, s_op = jax.jit(jax.vmap(plain))(q, k, v, g, beta, s0)
    want = reference.gated_rms_norm(o, z, norm_w, 1e-6, BF16)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_op))
    if impl == "pallas_split_interpret":
      assert_close(y, want, rel=KERNEL_REL["bfloat16"], what=impl)
    else:
      np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))


def test_gated_norm_needs_the_separate_pass_and_matching_shapes():
  q, k, v, g, beta, s0 = make_inputs(1, 8, H, 16, 16)
  z, norm_w = _gate(1, 8, H, 16, F32, seed=0)
  with pytest.raises(ValueError, match="separate"):
    gdn_chunked_parallel(q, k, v, g, beta, s0, interpret=True, state_pass="fused",
                         gate=(z, norm_w), eps=1e-6, out_dtype=jnp.dtype(F32))
  with pytest.raises(ValueError, match="gate z"):
    gated_norm_out(q, k, v, g, beta, s0, z[:, :4], norm_w, eps=1e-6, out_dtype=F32,
                   interpret=True)


def test_gated_norm_out_lowers_to_triton_for_the_gpu():
  """Cross-lowering at the bench's head size, T not a multiple of the chunk (the masked
  loads and stores of z and y)."""
  q, k, v, g, beta, s0 = make_inputs(1, 100, 2, 128, 128, act=BF16)
  z, norm_w = _gate(1, 100, 2, 128, BF16, seed=1)
  f = lambda *a: gated_norm_out(*a, eps=1e-6, out_dtype=BF16, chunk=64, inter_dtype=BF16)
  text = jax.jit(f).trace(q, k, v, g, beta, s0, z, norm_w).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("triton") >= 3 and "gdn_chunk_out_gated" in text


def test_choices_and_input_checks():
  for impl in api.PARALLEL_INTERPRET:
    assert api.chunked_implementation(impl) == impl
  assert api.chunked_implementation() == ("pallas_split" if ON_GPU else "reference")
  # each kernel's measured chunk unless the caller names one (pallas_kernels/gdn/api.py)
  assert [api.pallas_chunk_for(i) for i in ("pallas_parallel", "pallas_split_interpret",
                                            "pallas")] == [64, 64, 32]
  assert api.pallas_chunk_for("pallas_parallel", 16) == 16
  assert api.pallas_chunk_for("pallas", "auto") == 32
  if not ON_GPU:
    for impl in api.PARALLEL:
      with pytest.raises(ValueError, match="needs a GPU"):
        api.chunked_implementation(impl)
  args = make_inputs(1, 8, H, 16, 16)
  with pytest.raises(ValueError, match="state_pass='both'"):
    gdn_chunked_parallel(*args, interpret=True, state_pass="both")
  with pytest.raises(ValueError, match="inverse='solve'"):
    gdn_chunked_parallel(*args, interpret=True, inverse="solve")
  with pytest.raises(ValueError, match="power of 2"):
    gdn_chunked_parallel(*args, chunk=48, interpret=True)
  with pytest.raises(ValueError, match="block_v"):
    gdn_chunked_parallel(*args, interpret=True, block_v=32)
  q, k, v, g, beta, s = args
  with pytest.raises(ValueError, match="state must be float32"):
    gdn_chunked_parallel(q, k, v, g, beta, s.astype(BF16), interpret=True)


@pytest.mark.parametrize("inverse", INVERSES)
@pytest.mark.parametrize("inter", [None, BF16], ids=["f32-inter", "bf16-inter"])
@pytest.mark.parametrize("state_pass", STATE_PASSES)
def test_lowers_to_triton_for_the_gpu(state_pass, inter, inverse):
  """Cross-lowering on CPU at the bench's head size (bf16, padded T): every construct of the
  kernels has a Pallas Triton lowering rule (what the interpreter cannot tell)."""
  args = make_inputs(1, 100, 2, 128, 128, act=BF16)
  f = lambda *a: gdn_chunked_parallel(*a, chunk=64, state_pass=state_pass, inter_dtype=inter,
                                      inverse=inverse)
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("triton") >= (2 if state_pass == "fused" else 3)


# ---------------------------------------------------------------- compiled, on the device

@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("inverse", INVERSES)
@pytest.mark.parametrize("state_pass", STATE_PASSES)
@pytest.mark.parametrize("chunk", [64, 32])
def test_gpu_parity_bench_shape(chunk, state_pass, inverse):
  """T = 2,500, 32 heads of 128, bf16 q/k/v (the bench's shape and dtypes), T by products
  or by 16-row blocks."""
  args = make_inputs(1, 2500, 32, 128, 128, act=BF16, seed=11)
  want = oracle(*args, chunk=64)
  x3 = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
  run = lambda **kw: gdn_chunked_parallel(*args, chunk=chunk, state_pass=state_pass,
                                          inverse=inverse, **kw)
  what = f"C={chunk} {state_pass} {inverse}"
  check(run(precision=x3), want, f"gpu 3xtf32 {what}", abs_=DELTA_RULE_FP32)
  check(run(), want, f"gpu tf32 {what}", rel=TF32_REL)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("state_pass", STATE_PASSES)
def test_gpu_bf16_intermediates(state_pass):
  args = make_inputs(1, 2500, 32, 128, 128, act=BF16, seed=14)
  got = gdn_chunked_parallel(*args, state_pass=state_pass, inter_dtype=BF16)
  check(got, oracle(*args), f"gpu bf16 intermediates {state_pass}", rel=KERNEL_REL["bfloat16"])


@pytest.mark.gpu
@needs_gpu
def test_gpu_gated_norm_in_the_output_launch():
  """Compiled at the bench's shape (T = 2,500, 32 heads of 128, 16 q/k heads, bf16): the
  norm in the output launch against the norm after the op (the same kernels' o)."""
  q, k, v, g, beta, s0 = make_inputs(1, 2500, 32, 128, 128, act=BF16, seed=15)
  q, k = q[:, :, ::2], k[:, :, ::2]
  z, norm_w = _gate(1, 2500, 32, 128, BF16, seed=16)
  o, s = gdn_chunked_parallel(q, k, v, g, beta, s0, state_pass="separate", inter_dtype=BF16)
  y, s_y = gated_norm_out(q, k, v, g, beta, s0, z, norm_w, eps=1e-6, out_dtype=BF16,
                          inter_dtype=BF16)
  np.testing.assert_array_equal(np.asarray(s_y), np.asarray(s))
  assert_close(y, reference.gated_rms_norm(o, z, norm_w, 1e-6, BF16),
               rel=KERNEL_REL["bfloat16"], what="gpu gated y")


@pytest.mark.gpu
@needs_gpu
def test_gpu_api_vmap_and_tiles():
  args = make_inputs(2, 300, 4, 128, 128, seed=12)
  want = oracle(*args)
  for impl in api.PARALLEL:
    vm = jax.jit(jax.vmap(lambda *a, impl=impl: api.chunked(*a, implementation=impl)))(*args)
    check(vm, want, f"gpu vmap(api.chunked) {impl}", rel=TF32_REL)
  for bv in (16, 64, 128):
    check(gdn_chunked_parallel(*args, block_v=bv), want, f"gpu block_v={bv}", rel=TF32_REL)
