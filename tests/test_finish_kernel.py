"""The kernel that ends a decode step's mixer after its output projection
(pallas_kernels/quant/finish.py): the split sums, the adapter's B h on rows that are on and
the residual add in one launch. Interpret-mode parity against float64 and the jnp reference
(ragged chunks, split sums, rank padding, per-row scales), off rows bit for bit the
no-adapter call's, its refusals, its Triton lowering, and the compiled kernel under the `gpu`
marker."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import KERNEL_REL, assert_close

from pallas_kernels.quant.finish import finish_call, finish_reference

BF16, F32 = jnp.bfloat16, jnp.float32
ON_GPU = jax.default_backend() == "gpu"


def _case(ks, m, d, dtype, rank=0, n_ad=3, seed=0):
  rng = np.random.default_rng(seed)
  yp = jnp.asarray(rng.standard_normal((ks, m, d)), F32)
  res = jnp.asarray(rng.standard_normal((m, d)), dtype)
  if not rank:
    return yp, res, None
  hp = jnp.asarray(rng.standard_normal((2, m, rank)), F32)
  b = jnp.asarray(0.1 * rng.standard_normal((n_ad, d, rank)), dtype)
  on = jnp.asarray(np.arange(m) % 2 == 0, jnp.int32)
  return yp, res, (hp, b, jnp.int32(1), on, None)


def _want(yp, res, lora, scale=1.0):
  """float64 numbers of x' (no intermediate rounding)."""
  y = np.asarray(yp, np.float64).sum(0)
  if lora is not None:
    hp, b, li, on, rs = lora
    h = np.asarray(hp, np.float64).sum(0)
    if rs is not None:
      h = h * np.asarray(rs, np.float64)
    delta = scale * h @ np.asarray(b[int(li)], np.float64).T
    y = np.where(np.asarray(on)[:, None] != 0, y + delta, y)
  return np.asarray(res, np.float64) + y


def _finish(yp, res, lora, scale=1.0, block=None, interpret=True):
  return finish_call(yp, res, lora=lora, scale=scale, block=block, interpret=interpret)


@pytest.mark.parametrize("ks,m,d,rank,block,dtype", [
    (1, 1, 64, 0, None, F32),      # one row, no split, no adapter
    (4, 3, 96, 0, 32, F32),        # split sums, three tiles
    (2, 5, 100, 16, 32, F32),      # a ragged last tile, the adapter, mixed rows
    (3, 4, 128, 50, 64, BF16),     # bf16, a rank padded to 64
    (1, 2, 2048, 8, None, BF16),   # bench-a3b's width, 16 tiles of 128
])
def test_finish_matches_float64_and_the_reference(ks, m, d, rank, block, dtype):
  yp, res, lora = _case(ks, m, d, dtype, rank, seed=d + rank)
  xn = jax.jit(lambda yp, res, lora: _finish(yp, res, lora, block=block))(yp, res, lora)
  assert xn.shape == (m, d) and xn.dtype == dtype
  rel = KERNEL_REL[jnp.dtype(dtype).name]
  assert_close(xn, _want(yp, res, lora), rel=rel, what="x'")
  ref_x = jax.jit(lambda yp, res, lora: finish_reference(yp, res, lora=lora))(yp, res, lora)
  if lora is None:  # the same roundings; with the adapter, B h sums in another order
    assert np.array_equal(np.asarray(xn, np.float32), np.asarray(ref_x, np.float32))
  assert_close(xn, ref_x, rel=rel, what="x' vs reference")


def test_finish_off_rows_are_the_no_adapter_calls_bits_and_scales_apply_per_row():
  """Compiled on a GPU (the interpreter's jnp ops would be XLA's there, fused differently in
  the two programs), interpreted elsewhere."""
  yp, res, (hp, b, li, on, _) = _case(2, 6, 160, BF16, rank=12, seed=5)
  rs = jnp.asarray(np.random.default_rng(1).uniform(0.5, 2, (6, 12)), F32)
  got = np.asarray(_finish(yp, res, (hp, b, li, on, rs), scale=0.5, block=64,
                           interpret=not ON_GPU), np.float32)
  plain = np.asarray(_finish(yp, res, None, block=64, interpret=not ON_GPU), np.float32)
  off = np.asarray(on) == 0
  assert np.array_equal(got[off], plain[off])
  assert not np.array_equal(got[~off], plain[~off])
  want = _want(yp, res, (hp, b, li, on, rs), scale=0.5)
  assert_close(got[~off], want[~off], rel=KERNEL_REL["bfloat16"], what="x' on rows")


def test_finish_refuses_mismatched_shapes():
  yp, res, (hp, b, li, on, _) = _case(2, 3, 64, F32, rank=4)
  with pytest.raises(ValueError, match="residual"):
    finish_call(yp, res[:, :32], interpret=True)
  with pytest.raises(ValueError, match="must be"):
    finish_call(yp, res, lora=(hp, b[:, :32], li, on, None), interpret=True)


def test_finish_lowers_to_triton_for_the_gpu():
  yp, res, lora = _case(4, 1, 2048, BF16, rank=16)
  low = jax.jit(lambda yp, res, lora: finish_call(yp, res, lora=lora)).trace(
      yp, res, lora).lower(lowering_platforms=("cuda",))
  assert "xla.gpu.triton" in low.as_text()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU backend")
@pytest.mark.parametrize("ks,m,rank", [(4, 1, 16), (1, 8, 16), (2, 32, 50), (4, 1, 0),
                                       (2, 4, 6)])
def test_gpu_finish(ks, m, rank):
  """Compiled, at bench-a3b's width: float64's numbers to the bf16 bound, and off rows the
  no-adapter launch's bits (rank 6 as the model tests' adapter: run 55's failures)."""
  yp, res, lora = _case(ks, m, 2048, BF16, rank, seed=m)
  f = jax.jit(lambda yp, res, lora: _finish(yp, res, lora, interpret=False))
  got = f(yp, res, lora)
  assert_close(got, _want(yp, res, lora), rel=KERNEL_REL["bfloat16"], what="gpu x'")
  if lora is not None:
    plain = f(yp, res, None)
    off = np.asarray(lora[3]) == 0
    assert np.array_equal(np.asarray(got, np.float32)[off], np.asarray(plain, np.float32)[off])


@pytest.mark.parametrize("n,dtype", [(1, F32), (3, BF16)])
def test_split_products_sum_to_the_plain_products_bits(n, dtype):
  """`dense_matmul_split` (the GEMV's one row, dense_dot's few bf16 rows): its partials,
  summed in index order and rounded, are `dense_matmul`'s bits; `dense_matmul_lora_split`'s
  off rows are too, and its on rows finished are `dense_matmul_lora`'s numbers."""
  from pallas_kernels._common import sum_partials
  from pallas_kernels.quant import api
  rng = np.random.default_rng(n)
  x = jnp.asarray(rng.standard_normal((n, 256)), dtype)
  stack = jnp.asarray(rng.standard_normal((2, 96, 256)), dtype)
  a = jnp.asarray(0.1 * rng.standard_normal((3, 4, 256)), dtype)
  b = jnp.asarray(0.1 * rng.standard_normal((3, 96, 4)), dtype)
  on = jnp.asarray(np.arange(n) % 2 == 0, jnp.int32)
  kw = dict(implementation="pallas_interpret")
  plain = np.asarray(api.dense_matmul(x, stack, jnp.int32(1), **kw), np.float32)
  parts = api.dense_matmul_split(x, stack, jnp.int32(1), **kw)
  summed = np.asarray(sum_partials(parts.astype(F32)).astype(dtype), np.float32)
  assert np.array_equal(summed, plain)
  lparts, lora = api.dense_matmul_lora_split(x, stack, jnp.int32(1), a, b, on,
                                             lora_index=jnp.int32(2), **kw)
  res = jnp.zeros((n, 96), dtype)
  got = api.finish_residual(lparts, res, lora=lora, **kw)
  want = np.asarray(api.dense_matmul_lora(x, stack, jnp.int32(1), a, b, on,
                                          lora_index=jnp.int32(2), **kw), np.float32)
  off = np.asarray(on) == 0
  assert np.array_equal(np.asarray(got, np.float32)[off], plain[off])
  assert_close(got, want, rel=KERNEL_REL[jnp.dtype(dtype).name], what="lora split finished")
