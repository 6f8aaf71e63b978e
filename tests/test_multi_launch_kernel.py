"""Several products of one input in one launch (pallas_kernels/quant/multi.py): each part is
its own call's result bit for bit (the one-row GEMV and the few-row tensor-core product,
split sums and ragged tiles included), how `dense_matmul_multi` routes rows, the Triton
lowering, and the compiled kernels under the `gpu` marker."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import INTERP_BITS, KERNEL_REL, assert_close

from pallas_kernels.quant import gemv
from pallas_kernels.quant.api import dense_matmul, dense_matmul_multi
from pallas_kernels.quant.dense_dot import dense_dot_call, dense_dot_multi_call
from pallas_kernels.quant.gemv import dense_call, dense_multi_call

BF16, F32 = jnp.bfloat16, jnp.float32
ON_GPU = jax.default_backend() == "gpu"
# (out, in) of the parts: a GDN layer's qkv / gate / ba in miniature (ba ragged, 24 rows)
OUTS, IN = (96, 64, 24), 128


def _case(m, dtype, n_mats=3, seed=0, outs=OUTS, d_in=IN):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((m, d_in)), dtype)
  stacks = [jnp.asarray(rng.standard_normal((n_mats, o, d_in)), dtype) for o in outs]
  return x, stacks


def _bits(a):
  a = np.asarray(a)
  return a.view(np.uint16) if a.dtype.itemsize == 2 else a.view(np.uint32)


def _want(x, stack, i):
  return np.asarray(x, np.float64) @ np.asarray(stack[i], np.float64).T


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("tiles", [None, [dict(block_out=16, block_in=32, k_split=2),
                                          dict(block_out=32, block_in=64, k_split=1),
                                          dict(block_out=16, block_in=32, k_split=4)]])
def test_gemv_multi_gives_each_dense_call_bit_for_bit(dtype, tiles):
  x, stacks = _case(1, dtype, seed=1)
  idx = jnp.full((1,), 2, jnp.int32)
  got = jax.jit(lambda x, s, i: dense_multi_call(x, s, i, tiles=tiles, interpret=True))(
      x, stacks, idx)
  for j, (y, s) in enumerate(zip(got, stacks)):
    one = dense_call(x[None], s, idx, interpret=True, **(tiles[j] if tiles else {}))[0]
    assert y.shape == (1, s.shape[1]) and y.dtype == dtype
    assert np.array_equal(_bits(y), _bits(one)), f"part {j}"
    assert_close(y, _want(x, s, 2), rel=KERNEL_REL[jnp.dtype(dtype).name], what=f"part {j}")


@pytest.mark.parametrize("m,tiles", [
    (3, None),
    (8, [dict(block_out=16, block_in=32, k_split=4), dict(block_out=32, block_in=64),
         dict(block_out=16, block_in=16, k_split=2)]),
    (17, None)])
def test_dense_dot_multi_gives_each_dense_dot_call_bit_for_bit(m, tiles):
  x, stacks = _case(m, BF16, seed=m)
  got = jax.jit(lambda x, s, i: dense_dot_multi_call(x, s, i, tiles=tiles, interpret=True))(
      x, stacks, jnp.int32(1))
  for j, (y, s) in enumerate(zip(got, stacks)):
    one = dense_dot_call(x, s, jnp.int32(1), interpret=True, **(tiles[j] if tiles else {}))
    assert y.shape == (m, s.shape[1]) and y.dtype == BF16
    assert np.array_equal(_bits(y), _bits(one)), f"part {j}"
    assert_close(y, _want(x, s, 1), rel=KERNEL_REL["bfloat16"], what=f"part {j}")


@pytest.mark.parametrize("m,dtype,launches", [(1, BF16, 1), (1, F32, 1), (4, BF16, 1),
                                              (4, F32, 0), (65, BF16, 0)])
def test_dense_matmul_multi_routes_rows_to_one_launch_or_each_call(m, dtype, launches):
  """One row (the GEMV) or 2 to 64 rows of a 16-bit dtype (dense_dot): one launch for every
  part, each result `dense_matmul`'s bit for bit; fp32 rows past one, or more than 64 rows:
  `dense_matmul` each (XLA's dots, whose bits a GPU's GEMM tuning may move between programs:
  run 32), to the dtype's rounding."""
  x, stacks = _case(m, dtype, seed=3)
  f = lambda x, s: dense_matmul_multi(x, s, jnp.int32(2), implementation="pallas_interpret")
  got = jax.jit(f)(x, stacks)
  for j, (y, s) in enumerate(zip(got, stacks)):
    one = dense_matmul(x, s, jnp.int32(2), implementation="pallas_interpret")
    if launches:
      assert np.array_equal(_bits(y), _bits(one)), f"part {j}"
    else:
      assert_close(y, np.asarray(one, np.float64), rel=KERNEL_REL[jnp.dtype(dtype).name],
                   what=f"part {j}")
  jaxpr = str(jax.make_jaxpr(f)(x, stacks))
  assert jaxpr.count("pallas_call") == launches


def test_multi_reads_every_stack_in_place_at_a_traced_index():
  x, stacks = _case(1, BF16, n_mats=4, seed=5)
  f = lambda x, s, i: dense_matmul_multi(x, s, i, implementation="pallas_interpret")
  for i, want_i in ((0, 0), (3, 3), (7, 3)):   # past the stack: the last matrix, as XLA's
    for y, s in zip(jax.jit(f)(x, stacks, jnp.int32(i)), stacks):
      assert_close(y, _want(x, s, want_i), rel=KERNEL_REL["bfloat16"], what=f"index {i}")
  jaxpr = str(jax.make_jaxpr(f)(x, stacks, jnp.int32(1)))
  assert "dynamic_slice" not in jaxpr.split("pallas_call")[0]


def test_multi_refuses_stacks_of_another_width():
  x, stacks = _case(1, BF16)
  odd = jnp.zeros((3, 16, IN + 32), BF16)
  with pytest.raises(ValueError, match="shared `in`"):
    dense_multi_call(x, [stacks[0], odd], jnp.zeros((1,), jnp.int32), interpret=True)
  with pytest.raises(ValueError, match="shared `in`"):
    dense_dot_multi_call(jnp.zeros((4, IN), BF16), [stacks[0], odd], 0, interpret=True)


@pytest.mark.parametrize("m", [1, 8])
def test_multi_lowers_to_triton_for_the_gpu(m):
  x, stacks = _case(m, BF16, outs=(512, 64), d_in=1024)
  low = jax.jit(lambda x, s: dense_matmul_multi(x, s, jnp.int32(1), implementation="pallas")
                ).trace(x, stacks).lower(lowering_platforms=("cuda",)) if ON_GPU else None
  if low is None:   # lower the kernel calls themselves for CUDA from this CPU machine
    from pallas_kernels.quant.gemv import triton_params
    call = (lambda x, s: dense_multi_call(x, s, jnp.zeros((1,), jnp.int32),
                                          compiler_params=triton_params())) if m == 1 else (
        lambda x, s: dense_dot_multi_call(x, s, 1, compiler_params=triton_params()))
    low = jax.jit(call).trace(x, stacks).lower(lowering_platforms=("cuda",))
  assert "xla.gpu.triton" in low.as_text()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("m", [1, 8, 32])
def test_gpu_multi_gives_each_call_bit_for_bit(m):
  """bench-a3b's GDN input projections (qkv 8,192, gate 4,096, ba 64 rows of 2,048)."""
  x, stacks = _case(m, BF16, n_mats=2, seed=m, outs=(8192, 4096, 64), d_in=2048)
  got = dense_matmul_multi(x, stacks, jnp.int32(1), implementation="pallas")
  for j, (y, s) in enumerate(zip(got, stacks)):
    one = dense_matmul(x, s, jnp.int32(1), implementation="pallas")
    assert np.array_equal(_bits(y), _bits(one)), f"part {j}"
    assert_close(y, _want(x, s, 1), rel=KERNEL_REL["bfloat16"], what=f"gpu part {j}")


@pytest.mark.parametrize("k_split", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 3])
def test_dense_matmul_parts_sum_in_order_to_dense_matmul_bit_for_bit(m, k_split):
  """The router's GEMV handing its split partials to the routing kernel: [S, M, out] fp32
  whose index-order sum is `dense_matmul`'s result bit for bit, at a traced index, S the
  GEMV's k_split (one row) or 1 (rows the GEMV does not take)."""
  from pallas_kernels.quant.api import dense_matmul_parts
  from pallas_kernels.quant.gemv import sum_partials
  x, (stack, *_) = _case(m, F32, seed=11)
  tiles = dict(block_out=16, block_in=32, k_split=k_split)
  kw = dict(implementation="pallas_interpret", tiles=tiles)
  parts = jax.jit(lambda x, i: dense_matmul_parts(x, stack, i, **kw))(x, jnp.int32(2))
  whole = dense_matmul(x, stack, jnp.int32(2), **kw)
  gemv_rows = m == 1
  assert parts.shape == (k_split if gemv_rows else 1, m, stack.shape[1])
  assert parts.dtype == F32
  assert np.array_equal(_bits(sum_partials(parts)), _bits(whole))
  if gemv_rows:   # the kernel's exact fp32 products (XLA's dot runs TF32 on a GPU: run 36)
    assert_close(whole, _want(x, stack, 2), rel=KERNEL_REL["float32"], what="product")


def test_dense_matmul_parts_refuses_a_16_bit_x():
  from pallas_kernels.quant.api import dense_matmul_parts
  x, (stack, *_) = _case(1, BF16, seed=12)
  with pytest.raises(ValueError, match="x must be float32"):
    dense_matmul_parts(x, stack, jnp.int32(0), implementation="pallas_interpret")


@pytest.mark.parametrize("m,dtype", [(1, BF16), (1, F32), (4, BF16), (4, F32)])
def test_dense_matmul_multi_partials_sum_to_its_products_bit_for_bit(m, dtype):
  """partials=True (the GDN layer kernel adds z's and ba's itself): each product as its split
  partial sums [S, M, out], whose index-order sum in x's dtype is the summed call's result
  bit for bit, through the GEMV's launch, dense_dot's, and one call each (fp32 rows past one)."""
  from pallas_kernels.quant.gemv import sum_partials
  x, stacks = _case(m, dtype, seed=13)
  kw = dict(implementation="pallas_interpret")
  tiles = [dict(block_out=16, block_in=32, k_split=4)] * 3
  if m == 1:   # the GEMV's launch with split partials (the compiled defaults split `in`)
    got = gemv.dense_multi_call(x, stacks, jnp.int32(1).reshape(1), tiles=tiles,
                                interpret=True, partials=True)
    want = gemv.dense_multi_call(x, stacks, jnp.int32(1).reshape(1), tiles=tiles,
                                 interpret=True)
    assert all(p.shape[0] == 4 and p.dtype == F32 for p in got)
  else:
    got = dense_matmul_multi(x, stacks, jnp.int32(1), partials=True, **kw)
    want = dense_matmul_multi(x, stacks, jnp.int32(1), **kw)
  for p, y in zip(got, want):
    assert p.ndim == 3 and p.shape[1:] == y.shape
    assert np.array_equal(_bits(sum_partials(p).astype(dtype)), _bits(y))


def _norm_case(m, dtype, seed):
  """x with a row scale far from 1 (so a missing norm shows) and a norm weight about 1."""
  x, stacks = _case(m, dtype, seed=seed)
  rng = np.random.default_rng(seed + 100)
  x = (x.astype(F32) * 3.5).astype(dtype)
  w = jnp.asarray(1.0 + 0.2 * rng.standard_normal(IN), dtype)
  return x, stacks, w


def _normed64(x, w, eps):
  xf = np.asarray(x, np.float64)
  return xf / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + eps) * np.asarray(w, np.float64)


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("tiles", [None, [dict(block_out=16, block_in=32, k_split=4)] * 3])
def test_gemv_multi_with_norm_multiplies_the_whole_rows_rms_norm(dtype, tiles):
  """norm=(w, eps): the launch's products are of rms_norm(x, w, eps), each program
  normalising its share of `in` by the whole row's mean square (k_split 4 here: a share's
  own mean would be off by its fraction). fp32: the reference norm's product to fp32's
  rounding (the sums of squares run in another order); bf16: a normed element may round the
  other way, so against the float64 product to bf16's rounding."""
  from pallas_kernels.attention.reference import rms_norm
  x, stacks, w = _norm_case(1, dtype, seed=21)
  eps = 1e-6
  idx = jnp.full((1,), 1, jnp.int32)
  got = jax.jit(lambda x, s, w: dense_multi_call(x, s, idx, tiles=tiles, interpret=True,
                                                 norm=(w, eps)))(x, stacks, w)
  ref = dense_multi_call(rms_norm(x, w, eps), stacks, idx, tiles=tiles, interpret=True)
  h64 = _normed64(x, w, eps)
  for j, (y, r, s) in enumerate(zip(got, ref, stacks)):
    assert y.shape == r.shape and y.dtype == dtype
    if dtype == F32:
      assert_close(y, np.asarray(r, np.float64), rel=KERNEL_REL["float32"], what=f"part {j}")
    want = h64 @ np.asarray(s[1], np.float64).T
    assert_close(y, want, rel=KERNEL_REL[jnp.dtype(dtype).name], what=f"part {j} vs f64")


@pytest.mark.parametrize("m,dtype", [(1, F32), (4, BF16), (4, F32)])
def test_dense_matmul_multi_norm_is_made_in_the_gemv_launch_or_by_the_reference(m, dtype):
  """One row: the GEMV's launch makes the norm (one pallas_call, no XLA rsqrt outside it);
  more rows: the reference norm first, then the same products as given the normed rows,
  bit for bit."""
  from jaxpr_walk import eqns

  from pallas_kernels.attention.reference import rms_norm
  from pallas_kernels.quant.api import norm_launch_rows
  x, stacks, w = _norm_case(m, dtype, seed=22 + m)
  eps = 1e-6
  kw = dict(implementation="pallas_interpret")
  f = lambda x, s, w: dense_matmul_multi(x, s, jnp.int32(2), norm=(w, eps), **kw)
  got = jax.jit(f)(x, stacks, w)
  ref = jax.jit(lambda x, s, w: dense_matmul_multi(rms_norm(x, w, eps), s, jnp.int32(2),
                                                   **kw))(x, stacks, w)
  in_launch = norm_launch_rows(len(stacks), m, IN, "pallas_interpret")
  assert in_launch == (m == 1)
  outside = [e.primitive.name for e in eqns(jax.make_jaxpr(f)(x, stacks, w).jaxpr,
                                            into_kernels=False)]
  assert ("rsqrt" in outside) != in_launch
  for j, (y, r) in enumerate(zip(got, ref)):
    if in_launch:
      assert_close(y, np.asarray(r, np.float64), rel=KERNEL_REL["float32"], what=f"part {j}")
    else:
      assert np.array_equal(_bits(y), _bits(r)), f"part {j}"


def test_gemv_multi_refuses_a_norm_weight_of_another_width():
  x, stacks, w = _norm_case(1, BF16, seed=23)
  with pytest.raises(ValueError, match="norm weight"):
    dense_multi_call(x, stacks, jnp.zeros((1,), jnp.int32), interpret=True,
                     norm=(w[:-32], 1e-6))


@pytest.mark.parametrize("moe", [False, True])
def test_gemv_multi_with_norm_lowers_to_triton_for_the_gpu(moe):
  """The norm in the launch (and, for the MoE's launch, an fp32 part and the normed rows'
  program) lowers for CUDA from this CPU machine."""
  from pallas_kernels.quant.gemv import triton_params
  x, stacks = _case(1, BF16, outs=(512, 64), d_in=1024)
  w = jnp.ones((1024,), BF16)
  kw = dict(x_dtypes=(F32, BF16), normed_out=True) if moe else {}
  low = jax.jit(lambda x, s, w: dense_multi_call(
      x, s, jnp.zeros((1,), jnp.int32), compiler_params=triton_params(), norm=(w, 1e-6), **kw)
  ).trace(x, stacks, w).lower(lowering_platforms=("cuda",))
  assert "xla.gpu.triton" in low.as_text()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("moe", [False, True])
def test_gpu_multi_with_norm_multiplies_the_rms_norm(moe):
  """Compiled, one row: bench-a3b's GDN input projections, or the MoE's launch (an fp32
  router of 64 experts, the shared expert's gate / up of 512, the normed row): against the
  float64 product of the float64 norm, to bf16's rounding."""
  outs = (64, 512, 512) if moe else (8192, 4096, 64)
  x, stacks = _case(1, BF16, n_mats=2, seed=31, outs=outs, d_in=2048)
  w = jnp.asarray(1.0 + 0.2 * np.random.default_rng(32).standard_normal(2048), BF16)
  kw = {}
  if moe:
    stacks = [stacks[0].astype(F32), *stacks[1:]]
    kw = dict(x_dtypes=(F32, BF16, BF16), normed_out=True)
  got = dense_matmul_multi(x, stacks, jnp.int32(1), implementation="pallas", norm=(w, 1e-6),
                           **kw)
  h64 = _normed64(x, w, 1e-6)
  if moe:
    *got, h = got
    assert_close(h, h64, rel=KERNEL_REL["bfloat16"], what="gpu normed rows")
  for j, (y, s) in enumerate(zip(got, stacks)):
    want = h64 @ np.asarray(s[1], np.float64).T
    assert_close(y, want, rel=KERNEL_REL["bfloat16"], what=f"gpu part {j}")


@pytest.mark.parametrize("m", [1, 3])
def test_multi_with_norm_gives_fp32_parts_and_the_normed_rows(m):
  """The MoE's launch (`Forms.moe_norm`): a router part whose x is the normed row converted
  to fp32 (its fp32 product of rms_norm's bf16 values), bf16 parts, and the normed rows
  themselves as one more output. One row, the GEMV's launch: each to its sum-of-squares
  order against the reference (the rows themselves to one bf16 rounding); more rows: the
  reference norm and each call, bit for bit."""
  from pallas_kernels.attention.reference import rms_norm
  from pallas_kernels.quant.api import dense_matmul
  x, stacks, w = _norm_case(m, BF16, seed=41)
  eps = 1e-6
  stacks = [stacks[0].astype(F32), *stacks[1:]]   # the router: an fp32 stack
  kw = dict(implementation="pallas_interpret")
  f = lambda x, s, w: dense_matmul_multi(x, s, jnp.int32(1), partials=True, norm=(w, eps),
                                         x_dtypes=(F32, BF16, BF16), normed_out=True, **kw)
  *parts, h = jax.jit(f)(x, stacks, w)
  h_ref = jax.jit(lambda x, w: rms_norm(x, w, eps))(x, w)
  assert h.shape == x.shape and h.dtype == BF16
  assert [p.dtype for p in parts][0] == F32
  for j, (p, s, dt) in enumerate(zip(parts, stacks, (F32, BF16, BF16))):
    y = gemv.sum_partials(p.astype(F32)).astype(dt)
    ref = jax.jit(lambda h, s: dense_matmul(h.astype(dt), s, jnp.int32(1), **kw))(h_ref, s)
    # On a GPU the interpreter's bodies round their own way (`INTERP_BITS`): there every part
    # is held to x's dtype (bf16) rounding, the router's fp32 one included (run 79: 1.5e-3).
    rel = KERNEL_REL[jnp.dtype(dt if INTERP_BITS else BF16).name]
    if m == 1 or not INTERP_BITS:
      assert_close(y, np.asarray(ref, np.float64), rel=rel, what=f"part {j}")
    else:
      assert np.array_equal(_bits(y), _bits(ref)), f"part {j}"
  if m == 1 or not INTERP_BITS:
    assert_close(h, np.asarray(h_ref, np.float64), rel=KERNEL_REL["bfloat16"], what="rows")
  else:
    assert np.array_equal(_bits(h), _bits(h_ref))


def test_multi_refuses_x_dtypes_or_normed_rows_without_a_norm():
  x, stacks, _ = _norm_case(1, BF16, seed=42)
  with pytest.raises(ValueError, match="need a norm|make the norm|makes the norm"):
    dense_multi_call(x, stacks, jnp.zeros((1,), jnp.int32), interpret=True, normed_out=True)
  with pytest.raises(ValueError, match="need a norm"):
    dense_matmul_multi(jnp.zeros((4, IN), BF16), stacks, jnp.int32(0),
                       implementation="pallas_interpret", x_dtypes=(F32, BF16, BF16))


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("tiles", [{}, dict(block_out=16, block_in=32, k_split=2)])
def test_gemv_makes_the_glu_row_as_it_loads_x(dtype, tiles):
  """`dense_call(g, up=u)` (`Forms.shared_glu` "in_down"): the product of the GLU's hidden
  row silu(g) * u, made in each program as it loads its share of x, is the product of that
  row made first (`gemv.glu_product`) bit for bit (on CPU; on a GPU the interpreter's silu
  rounds its own way: x's dtype), and meets float64 math on that row."""
  rng = np.random.default_rng(7)
  g, u = (jnp.asarray(rng.standard_normal((1, 1, IN)) * 2, dtype) for _ in range(2))
  stack = jnp.asarray(rng.standard_normal((3, 96, IN)), dtype)
  idx = jnp.full((1,), 1, jnp.int32)
  got = jax.jit(lambda g, u, s: dense_call(g, s, idx, up=u, interpret=True, **tiles))(
      g, u, stack)
  h = gemv.glu_product(g, u)
  ref = dense_call(h, stack, idx, interpret=True, **tiles)
  assert got.shape == ref.shape and got.dtype == dtype
  if INTERP_BITS:
    assert np.array_equal(_bits(got), _bits(ref))
  else:
    assert_close(got, ref, rel=KERNEL_REL[jnp.dtype(dtype).name], what="glu vs made first")
  assert_close(got[0], _want(h[0], stack, 1), rel=KERNEL_REL[jnp.dtype(dtype).name],
               what="glu vs float64")
  with pytest.raises(ValueError, match="GLU's up"):
    dense_call(g, stack, idx, up=u.astype(F32 if dtype == BF16 else BF16), interpret=True)


@pytest.mark.parametrize("n", [1, 3])
def test_dense_matmul_glu_routes_rows_and_keeps_the_bits(n):
  """`dense_matmul_glu`: one row through the GEMV that makes the row, more rows through the
  row made in XLA and `dense_matmul`; either way `dense_matmul(glu_product(g, u))`'s bits."""
  from pallas_kernels.quant.api import dense_matmul_glu
  rng = np.random.default_rng(n)
  g, u = (jnp.asarray(rng.standard_normal((n, IN)), BF16) for _ in range(2))
  stack = jnp.asarray(rng.standard_normal((2, 40, IN)), BF16)
  kw = dict(implementation="pallas_interpret")
  got = jax.jit(lambda g, u: dense_matmul_glu(g, u, stack, jnp.int32(1), **kw))(g, u)
  want = jax.jit(lambda g, u: dense_matmul(gemv.glu_product(g, u), stack, jnp.int32(1),
                                           **kw))(g, u)
  if INTERP_BITS or n > 1:
    assert np.array_equal(_bits(got), _bits(want))
  else:
    assert_close(got, want, rel=KERNEL_REL["bfloat16"], what="glu gemv")
  with pytest.raises(ValueError, match="must match"):
    dense_matmul_glu(g, u[:, :32], stack, jnp.int32(0), **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_gpu_glu_gemv_compiled():
  """The compiled GLU prologue (Triton's silu) against float64 math on the XLA-made row."""
  rng = np.random.default_rng(3)
  g, u = (jnp.asarray(rng.standard_normal((1, 512)), BF16) for _ in range(2))
  stack = jnp.asarray(rng.standard_normal((2, 2048, 512)), BF16)
  from pallas_kernels.quant.api import dense_matmul_glu
  y = dense_matmul_glu(g, u, stack, jnp.int32(1), implementation="pallas")
  h = np.asarray(gemv.glu_product(g, u), np.float64)
  assert_close(y, h @ np.asarray(stack[1], np.float64).T, rel=KERNEL_REL["bfloat16"],
               what="compiled glu gemv")
