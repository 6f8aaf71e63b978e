"""Routed-experts kernel (pallas_kernels/moe): parity with the model's gather form.

The interpreter runs the kernel's body on CPU; the compiled kernel runs under the `gpu`
marker on the device (`JAX_PLATFORMS=cuda python -m pytest tests/test_moe_kernel.py -m gpu`).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import KERNEL_REL, assert_close

from pallas_kernels.moe import (
    moe_pallas,
    moe_reference,
    resolve,
    routed_experts,
)

ON_GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU backend")
BF16, F32 = jnp.bfloat16, jnp.float32
# Small shapes: E experts, top-k, F expert width, D model width.
E, K, F, D = 8, 2, 32, 64
# bf16 h: kernel and reference round the same fp32 values to bf16 (silu(h_g), h_u, then
# their product), but those fp32 values differ in the last bits (summation order, and
# Triton's sigmoid vs XLA's), so each of the three roundings can land one bf16 step the
# other way. bf16 keeps 8 significant bits: one step is at most 2^-7 of the value, so an h
# element differs by at most ~3 * 2^-7 of itself, and each output by at most that times
# sum_j,f |w wd h| (every element off at once: a worst case; real errors are far smaller).
# Everything else (the products, the fp32 sums) agrees to fp32 rounding.
H_ROUNDING = 3 * 2.0 ** -7
# The many-token kernels also round each expert's output y_j to x's dtype (`round_y`). Kernel
# and reference round fp32 values that differ as above, so a y_j may land one step apart:
# 2^-7 of |y_j| more.
Y_ROUNDING = 2.0 ** -7


def make_inputs(n, *, e=E, k=K, f=F, d=D, act=F32, wdt=F32, seed=0, idx=None):
  """Numpy inputs, scaled so h and the output are O(1); idx distinct per row unless given."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, d)).astype(act)
  wg = (rng.standard_normal((e, f, d)) / np.sqrt(d)).astype(wdt)
  wu = (rng.standard_normal((e, f, d)) / np.sqrt(d)).astype(wdt)
  wd = (rng.standard_normal((e, d, f)) / np.sqrt(f)).astype(wdt)
  if idx is None:
    idx = np.stack([rng.choice(e, size=k, replace=False) for _ in range(n)])
  idx = np.asarray(idx, np.int32)
  w = rng.random(idx.shape).astype(np.float32)
  w /= w.sum(-1, keepdims=True)
  return x, wg, wu, wd, idx, w


def j(args):
  return tuple(jnp.asarray(v) for v in args)


def rounding_bound(x, wg, wu, wd, idx, w, round_y=False):
  """Per-element bound on |kernel - reference| from bf16 rounding of h (H_ROUNDING), and of
  y with round_y (Y_ROUNDING)."""
  f = np.float64
  e = wg.shape[0]
  idx = np.clip(np.where(idx < 0, idx + e, idx), 0, e - 1)  # as jnp indexing reads idx
  xd = np.asarray(x).dtype
  cast = lambda a: np.asarray(a).astype(xd).astype(f)  # weights as the model casts them
  xs = np.asarray(x, f)
  g = np.einsum("nd,nkfd->nkf", xs, cast(wg[idx]))
  u = np.einsum("nd,nkfd->nkf", xs, cast(wu[idx]))
  h = np.abs(g / (1 + np.exp(-g)) * u)
  y = np.einsum("nkf,nkdf->nkd", h, np.abs(cast(wd[idx])))
  return (H_ROUNDING + (Y_ROUNDING if round_y else 0.0)) * np.einsum("nkd,nk->nd", y,
                                                                      np.abs(w.astype(f)))


def check(got, args, *, what="", round_y=False):
  """fp32 h (x fp32): kernel = reference to 1e-6. 16-bit h: within `rounding_bound`.
  round_y: the many-token contract (each y_j rounded to x's dtype, `moe_reference`'s)."""
  got = np.asarray(got)
  assert got.dtype == np.float32 and got.shape == (args[0].shape[0], args[3].shape[1]), what
  with jax.default_matmul_precision("highest"):
    want = np.asarray(moe_reference(*j(args), precision=jax.lax.Precision.HIGHEST,
                                    round_y=round_y))
  if np.dtype(args[0].dtype) == np.float32:
    assert_close(got, want, rel=KERNEL_REL["float32"], what=what)
  else:
    scale = np.abs(want).max()
    err = np.abs(got.astype(np.float64) - want)
    bound = rounding_bound(*args, round_y=round_y) + 1e-6 * scale
    assert (err <= bound).all(), (f"{what}: max err {err.max():.3e}, worst err/bound "
                                  f"{(err / bound).max():.3f}")


def test_reference_matches_float64():
  args = make_inputs(3, seed=1)
  x, wg, wu, wd, idx, w = (np.asarray(v, np.float64) for v in args)
  idx = idx.astype(np.int64)
  g = np.einsum("nd,nkfd->nkf", x, wg[idx])
  u = np.einsum("nd,nkfd->nkf", x, wu[idx])
  y = np.einsum("nkf,nkdf->nkd", g / (1 + np.exp(-g)) * u, wd[idx])
  want = np.einsum("nkd,nk->nd", y, w)
  assert_close(moe_reference(*j(args)), want, rel=KERNEL_REL["float32"], what="reference")


@pytest.mark.parametrize("n", [1, 3])
def test_parity_fp32(n):
  args = make_inputs(n, seed=n)
  check(routed_experts(*j(args), implementation="pallas_interpret"), args, what=f"fp32 N{n}")


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("act,wdt", [(BF16, BF16), (F32, BF16), (BF16, F32)],
                         ids=["bf16", "x32-wbf16", "xbf16-w32"])
def test_parity_mixed(n, act, wdt):
  """bf16 weights with fp32 x are exact in fp32 (1e-6); bf16 x rounds h (see H_ROUNDING)."""
  args = make_inputs(n, act=act, wdt=wdt, seed=10 + n)
  got = routed_experts(*j(args), implementation="pallas_interpret")
  check(got, args, what=f"{np.dtype(act).name}/{np.dtype(wdt).name} N{n}")


@pytest.mark.parametrize("act", [F32, BF16], ids=["f32", "bf16"])
def test_repeated_expert_ids(act):
  """One expert in several rows, twice in a row, and ids that wrap (-1) or clamp (E + 3)."""
  idx = [[3, 3], [3, 1], [5, 3], [-1, E + 3]]
  args = make_inputs(4, act=act, wdt=act, idx=idx, seed=4)
  check(moe_pallas(*j(args), interpret=True), args, what="repeated ids")
  # The duplicated pair in row 0 counts twice: it equals expert 3 alone at w0 + w1.
  x, wg, wu, wd, _, w = args
  one = (x[:1], wg, wu, wd, np.array([[3]], np.int32), w[:1].sum(1, keepdims=True))
  assert_close(moe_pallas(*j(args), interpret=True)[0], moe_reference(*j(one))[0],
               rel=KERNEL_REL["float32"] if act == F32 else 1e-2, what="duplicate pair")


@pytest.mark.parametrize("kw", [dict(block_f=16, chunk_d=16, block_d=16, chunk_f=16),
                                dict(block_f=8, chunk_d=64, block_d=32, chunk_f=8)],
                         ids=["tiles16", "tiles-mixed"])
def test_kernel_tilings(kw):
  """Several programs per row and several loop steps, as the compiled defaults use."""
  args = make_inputs(3, seed=21)
  check(moe_pallas(*j(args), interpret=True, **kw), args, what=f"tiling {kw}")


def test_layer_stack():
  """layer=: the kernel reads layer l's experts from [L, E, ...] stacks (a traced index)."""
  stacks = [make_inputs(2, seed=30 + i) for i in range(3)]
  x, idx, w = stacks[0][0], stacks[0][4], stacks[0][5]
  wg, wu, wd = (np.stack([s[i] for s in stacks]) for i in (1, 2, 3))
  for impl in ("pallas_interpret", "xla"):
    f = jax.jit(lambda li: routed_experts(*j((x, wg, wu, wd, idx, w)), layer=li,
                                          implementation=impl))
    for li in range(3):
      check(f(jnp.int32(li)), (x, wg[li], wu[li], wd[li], idx, w), what=f"{impl} layer {li}")


def test_reads_weights_in_place():
  """No gather of weights outside the kernels: the jaxpr is two pallas_calls (+ casts)."""
  jaxpr = jax.make_jaxpr(lambda *a: moe_pallas(*a, interpret=True))(*j(make_inputs(3)))
  prims = set()
  for eqn in jaxpr.jaxpr.eqns:  # the jit wrapper, then its body
    inner = eqn.params.get("jaxpr")
    prims |= {e.primitive.name for e in (inner.eqns if inner is not None else [eqn])}
  assert "gather" not in prims and "dynamic_slice" not in prims, prims
  body = jaxpr.jaxpr.eqns[0].params["jaxpr"].eqns
  assert [e.primitive.name for e in body].count("pallas_call") == 2


def test_input_errors():
  x, wg, wu, wd, idx, w = j(make_inputs(1))
  with pytest.raises(ValueError, match="D=48 must be a power of 2"):
    moe_pallas(x[:, :48], wg[..., :48], wu[..., :48], wd[:, :48], idx, w, interpret=True)
  with pytest.raises(ValueError, match="wd"):
    moe_pallas(x, wg, wu, wd[:, :, :16], idx, w, interpret=True)
  with pytest.raises(ValueError, match="idx must be int32"):
    moe_pallas(x, wg, wu, wd, idx.astype(F32), w, interpret=True)
  with pytest.raises(ValueError, match="block_f=24 must be a power of 2"):
    moe_pallas(x, wg, wu, wd, idx, w, interpret=True, block_f=24)
  with pytest.raises(ValueError, match="unknown implementation"):
    routed_experts(x, wg, wu, wd, idx, w, implementation="cuda")


def test_implementation_choice():
  assert resolve() == resolve("auto") == ("pallas" if ON_GPU else "xla")
  assert resolve("pallas_interpret") == "pallas_interpret"
  assert resolve("xla") == "xla"
  with pytest.raises(ValueError, match="unknown implementation 'triton'"):
    resolve("triton")


@pytest.mark.parametrize("act", [F32, BF16], ids=["f32", "bf16"])
def test_xla(act):
  """"xla" is the jitted reference. Under jit XLA may skip h's bf16 rounding (excess
  precision), so even it sits one rounding away from the eager reference: same bound."""
  args = make_inputs(3, act=act, wdt=act, seed=5)
  check(routed_experts(*j(args), implementation="xla"), args, what="xla")


# ---------------------------------------------------------------- compiled, on the device

# (N, E, k, F, D): small, and bench-a3b (64 experts of 512, top-10, D 2048) at decode.
GPU_CASES = [(1, 8, 2, 32, 64), (3, 8, 2, 32, 64), (1, 64, 10, 512, 2048),
             (4, 64, 10, 512, 2048), (6, 64, 10, 512, 2048)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "N{}-E{}-k{}-F{}-D{}".format(*c))
@pytest.mark.parametrize("act,wdt", [(F32, F32), (BF16, BF16), (F32, BF16)],
                         ids=["f32", "bf16", "x32-wbf16"])
def test_gpu_parity(case, act, wdt):
  n, e, k, f, d = case
  args = make_inputs(n, e=e, k=k, f=f, d=d, act=act, wdt=wdt, seed=n)
  args[4][0, -1] = args[4][0, 0]  # a repeated id
  if n > 1:
    args[4][1, 0] = args[4][0, 0]  # the same expert in two rows
  check(routed_experts(*j(args), implementation="pallas"), args, what=f"gpu {case}")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kw", [dict(block_f=32, block_d=32), dict(block_f=8, chunk_d=256),
                                dict(block_d=64, chunk_f=128, num_warps=8),
                                dict(block_f=64, chunk_d=2048, block_d=8)],
                         ids=["bf32-bd32", "bf8-cd256", "bd64-cf128-w8", "bf64-cd2048-bd8"])
def test_gpu_tilings(kw):
  args = make_inputs(2, e=64, k=10, f=512, d=2048, act=BF16, wdt=BF16, seed=7)
  check(moe_pallas(*j(args), **kw), args, what=f"gpu tiling {kw}")


@pytest.mark.gpu
@needs_gpu
def test_gpu_layer_stack_in_scan():
  """layer= inside a jitted lax.scan over layers (how the model would call it)."""
  stacks = [make_inputs(2, e=64, k=10, f=512, d=2048, act=BF16, wdt=BF16, seed=40 + i)
            for i in range(3)]
  x = stacks[0][0]
  wg, wu, wd, idx, w = (np.stack([s[i] for s in stacks]) for i in (1, 2, 3, 4, 5))

  @jax.jit
  def run(x, wg, wu, wd, idx, w):
    step = lambda c, xs: (c, moe_pallas(x, wg, wu, wd, xs[0], xs[1], xs[2]))
    return jax.lax.scan(step, 0, (idx, w, jnp.arange(3)))[1]

  got = run(*j((x, wg, wu, wd, idx, w)))
  for li in range(3):
    check(got[li], (x, wg[li], wu[li], wd[li], idx[li], w[li]), what=f"scan layer {li}")
