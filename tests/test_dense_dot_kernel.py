"""The few-row tensor-core product over a 16-bit weight stack read in place
(pallas_kernels/quant/dense_dot.py): interpret-mode parity against float64 and the jnp
reference (odd row counts, ragged output tiles, split sums, a traced index), how
`dense_matmul` routes rows to it, its refusals, its Triton lowering, and the compiled kernel
under the `gpu` marker."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import KERNEL_REL, assert_close

from pallas_kernels.quant import dense_dot
from pallas_kernels.quant.api import dense_lora_reference, dense_reference
from pallas_kernels.quant.dense_dot import dense_dot_call

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
ON_GPU = jax.default_backend() == "gpu"


def _case(m, d_out, d_in, dtype, n_mats=3, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((m, d_in)), dtype)
  stack = jnp.asarray(rng.standard_normal((n_mats, d_out, d_in)), dtype)
  return x, stack


def _want(x, stack, i):
  return np.asarray(x, np.float64) @ np.asarray(stack[i], np.float64).T


@pytest.mark.parametrize("m,d_out,d_in,tiles", [
    (2, 64, 64, {}),                                           # the least rows, one tile
    (3, 100, 96, {}),                                          # odd rows, ragged out tile
    (8, 72, 256, dict(block_out=16, block_in=32, k_split=4)),  # split sums, ragged out
    (17, 48, 128, dict(block_out=32, block_in=64, k_split=2)),  # rows past one 16-row dot
    (64, 40, 64, dict(block_out=16, block_in=16)),             # ROWS_MAX rows
])
def test_dense_dot_matches_float64_and_the_reference(m, d_out, d_in, tiles):
  x, stack = _case(m, d_out, d_in, BF16, seed=m)
  f = jax.jit(lambda x, s, i: dense_dot_call(x, s, i, interpret=True, **tiles))
  got = f(x, stack, jnp.int32(2))
  assert got.shape == (m, d_out) and got.dtype == BF16
  assert_close(got, _want(x, stack, 2), rel=KERNEL_REL["bfloat16"], what=f"dense dot M{m}")
  ref = dense_reference(x, stack, jnp.int32(2))
  assert_close(got, np.asarray(ref, np.float64), rel=KERNEL_REL["bfloat16"],
               what=f"dense dot vs reference M{m}")


def test_dense_dot_reads_the_traced_index_in_place_and_clips_it():
  """The matrix at a traced index, with no slice of the stack in the program; an index past
  the stack reads its last matrix (as XLA's dynamic index)."""
  x, stack = _case(5, 32, 64, F16, n_mats=4, seed=7)
  f = jax.jit(lambda x, s, i: dense_dot_call(x, s, i, interpret=True))
  for i, want_i in ((1, 1), (3, 3), (9, 3)):
    got = f(x, stack, jnp.int32(i))
    assert_close(got, _want(x, stack, want_i), rel=KERNEL_REL["float16"], what=f"index {i}")
  jaxpr = str(jax.make_jaxpr(lambda x, s, i: dense_dot_call(x, s, i, interpret=True))(
      x, stack, jnp.int32(1)))
  assert "dynamic_slice" not in jaxpr.split("pallas_call")[0]


def test_dense_dot_refuses_fp32_mixed_dtypes_and_too_many_rows():
  x, stack = _case(4, 32, 64, BF16)
  with pytest.raises(ValueError, match="16-bit dtype"):
    dense_dot_call(x.astype(F32), stack.astype(F32), 0, interpret=True)
  with pytest.raises(ValueError, match="16-bit dtype"):
    dense_dot_call(x, stack.astype(F16), 0, interpret=True)
  big = jnp.zeros((dense_dot.ROWS_MAX + 1, 64), BF16)
  with pytest.raises(ValueError, match="rows"):
    dense_dot_call(big, stack, 0, interpret=True)
  with pytest.raises(ValueError, match="k_split=3 does not divide"):
    dense_dot_call(x, stack, 0, interpret=True, block_in=16, k_split=3)


def test_defaults_fill_the_grid_by_splitting_in_and_keep_two_steps_a_share():
  bo, bk, ks = dense_dot.defaults(8, 2048, 4096)   # bench-a3b's ssm_out: 32 tiles
  assert (bo, bk) == (64, 256) and ks == 8 and 4096 // bk // ks >= 2
  assert dense_dot.defaults(8, 8192, 2048) == (64, 256, 2)   # 128 tiles: 256 programs
  assert dense_dot.defaults(8, 16384, 2048) == (64, 256, 1)   # 256 tiles: no split
  assert dense_dot.defaults(8, 512, 2048)[2] == 4   # 8 tiles, 8 steps: 2 a share
  # an adapted call: LORA_BLOCK_OUT rows a program, `in` tiles halved to stay in an SM's
  # shared memory, and always the plain call's split of `in` (its off rows' summation order)
  bo = dense_dot.LORA_BLOCK_OUT
  assert dense_dot.defaults(8, 2048, 4096, rank_pad=64) == (bo, 128, 8)
  assert dense_dot.defaults(32, 2048, 4096, rank_pad=64) == (bo, 128, 8)
  assert dense_dot.defaults(64, 2048, 4096)[1] == 256
  assert dense_dot.defaults(64, 2048, 4096, rank_pad=512)[1] == 64
  for m, d_out, d_in in ((8, 2048, 4096), (64, 4096, 4096), (5, 72, 512), (32, 16384, 2048)):
    for rank_pad in (16, 64, 512):
      assert (dense_dot.defaults(m, d_out, d_in, rank_pad=rank_pad)[2]
              == dense_dot.defaults(m, d_out, d_in)[2]), (m, d_out, d_in, rank_pad)


def test_dense_matmul_routes_a_few_16_bit_rows_to_the_dot_and_the_rest_to_xla():
  """One row: the GEMV; 2 to ROWS_MAX rows of a 16-bit stack: the tensor-core kernel (few
  "dot"), XLA's reference with few "xla", for fp32 and past ROWS_MAX; XLA is bit for bit
  `dense_reference` there."""
  from pallas_kernels.quant import dense_matmul
  rng = np.random.default_rng(3)
  kernels = lambda f, *a: [k for k in ("qgemv_dense", "dense_dot") if k in str(
      jax.make_jaxpr(f)(*a))]
  for n, dtype, few, want in ((1, BF16, "dot", ["qgemv_dense"]), (4, BF16, "dot", ["dense_dot"]),
                              (4, BF16, "xla", []), (4, F32, "dot", []),
                              (dense_dot.ROWS_MAX + 1, BF16, "dot", [])):
    stack = jnp.asarray(rng.standard_normal((3, 24, 64)), dtype)
    x = jnp.asarray(rng.standard_normal((n, 64)), dtype)
    f = lambda x, s, few=few: dense_matmul(x, s, jnp.int32(2), implementation="pallas_interpret",
                                           few=few)
    assert kernels(f, x, stack) == want, (n, dtype, few)
    if not want:
      assert np.array_equal(np.asarray(f(x, stack)), np.asarray(dense_reference(x, stack, 2)))
    else:
      assert_close(f(x, stack), _want(x, stack, 2), rel=KERNEL_REL[np.dtype(dtype).name],
                   what=f"dense_matmul N{n}")
  with pytest.raises(ValueError, match="few='tiles'"):
    dense_matmul(x, stack, 0, implementation="pallas_interpret", few="tiles")


def test_dense_dot_lowers_to_triton_for_the_gpu():
  f = lambda x, w, i: dense_dot_call(x, w, i, k_split=2)
  low = jax.jit(f).trace(jnp.ones((8, 1024), BF16), jnp.ones((3, 40, 1024), BF16),
                         jnp.zeros((1,), jnp.int32)).lower(lowering_platforms=("cuda",))
  assert "xla.gpu.triton" in low.as_text()


def test_dense_dot_lora_lowers_to_triton_for_the_gpu():
  """The adapted kernel at bench-a3b's attn_output shape, rank 50 (masked rank tiles), with
  its default tiling (LORA_BLOCK_OUT rows a program)."""
  a, b, on = _lora_case(8, 2048, 4096, 50, "mixed", n_ad=2)
  f = lambda x, w, a, b, on: dense_dot_call(x, w, jnp.int32(1), lora=(a, b, jnp.int32(1), on,
                                                                      None))
  low = jax.jit(f).trace(jnp.ones((8, 4096), BF16), jnp.ones((2, 2048, 4096), BF16), a, b,
                         on).lower(lowering_platforms=("cuda",))
  assert "xla.gpu.triton" in low.as_text()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU backend")
@pytest.mark.parametrize("m,d_out,d_in", [(2, 8192, 2048), (8, 2048, 4096), (32, 64, 2048),
                                          (5, 12288, 2048), (64, 512, 2048)])
def test_gpu_dense_dot(m, d_out, d_in):
  """Compiled, at bench-a3b's shapes: float64's numbers to the bf16 kernel bound, and the
  jnp reference's (XLA's dot on the sliced matrix)."""
  x, stack = _case(m, d_out, d_in, BF16, n_mats=4, seed=m)
  got = jax.jit(dense_dot_call)(x, stack, jnp.int32(3))
  assert_close(got, _want(x, stack, 3), rel=KERNEL_REL["bfloat16"], what=f"gpu dense dot M{m}")
  ref = jax.jit(dense_reference)(x, stack, jnp.int32(3))
  assert_close(got, np.asarray(ref, np.float64), rel=KERNEL_REL["bfloat16"],
               what=f"gpu dense dot vs XLA M{m}")


def _lora_case(m, d_out, d_in, rank, on_kind, n_ad=3, seed=11):
  rng = np.random.default_rng(seed)
  a = jnp.asarray(0.1 * rng.standard_normal((n_ad, rank, d_in)), BF16)
  b = jnp.asarray(0.1 * rng.standard_normal((n_ad, d_out, rank)), BF16)
  on = {"all": np.ones(m), "off": np.zeros(m), "mixed": np.arange(m) % 2 == 0}[on_kind]
  return a, b, jnp.asarray(on, jnp.int32)


def _lora_want(x, stack, i, a, b, li, on, rank_scale=None):
  x64 = np.asarray(x, np.float64)
  h = x64 @ np.asarray(a[li], np.float64).T
  if rank_scale is not None:
    h = h * np.asarray(rank_scale, np.float64)
  return _want(x, stack, i) + h @ np.asarray(b[li], np.float64).T, np.asarray(on) != 0


@pytest.mark.parametrize("m,k_split,on_kind,scaled", [
    (5, 1, "mixed", False), (5, 4, "mixed", True), (8, 2, "all", False), (3, 2, "off", False),
    (1, 1, "all", True), (17, 2, "mixed", False)])
def test_dense_dot_lora_adds_the_delta_in_one_launch_and_keeps_off_rows_bits(m, k_split,
                                                                             on_kind, scaled):
  """On rows: W x + B (A x) (times the rank scales) against float64 and the jnp reference;
  off rows: the plain kernel's bits, split sums or not; A and B read at a traced index."""
  d_out, d_in, rank = 72, 128, 12
  x, stack = _case(m, d_out, d_in, BF16, seed=m + 20)
  a, b, on = _lora_case(m, d_out, d_in, rank, on_kind)
  rs = (jnp.asarray(np.random.default_rng(2).uniform(0.5, 2, (m, rank)), F32) if scaled
        else None)
  tiles = dict(block_out=16, block_in=32, k_split=k_split)
  f = jax.jit(lambda x, s, a, b, li, on, rs: dense_dot_call(
      x, s, jnp.int32(1), lora=(a, b, li, on, rs), interpret=True, **tiles))
  got = np.asarray(f(x, stack, a, b, jnp.int32(2), on, rs))
  plain = np.asarray(dense_dot_call(x, stack, jnp.int32(1), interpret=True, **tiles))
  want, on_rows = _lora_want(x, stack, 1, a, b, 2, on, rs)
  assert np.array_equal(got[~on_rows].view(np.uint16), plain[~on_rows].view(np.uint16))
  if on_rows.any():
    assert_close(got[on_rows], want[on_rows], rel=KERNEL_REL["bfloat16"], what="on rows")
    ref = np.asarray(dense_lora_reference(x, stack, jnp.int32(1), a, b, on, rank_scale=rs,
                                          lora_index=jnp.int32(2)), np.float64)
    assert_close(got[on_rows], ref[on_rows], rel=KERNEL_REL["bfloat16"], what="vs reference")
    assert not np.array_equal(got[on_rows], plain[on_rows])


def test_dense_matmul_lora_takes_2_to_64_rows_into_the_one_launch_kernel():
  """`dense_matmul_lora` with the adapter's stacks: 5 rows run `dense_dot_lora` alone (no
  finishing kernel, no slice of A or B outside it); one row runs the GEMV's rows form, or
  the dot under one_row="dot"; few="xla" and fp32 go to the XLA reference."""
  from pallas_kernels.quant.api import dense_matmul_lora
  d_out, d_in, rank = 40, 64, 6
  a, b, _ = _lora_case(5, d_out, d_in, rank, "all")
  stack = _case(1, d_out, d_in, BF16, n_mats=2)[1]
  for n, kw, want in ((5, {}, "dense_dot_lora"), (1, {}, "qgemv_dense_lora_rows"),
                      (1, dict(one_row="dot"), "dense_dot_lora"), (5, dict(few="xla"), None)):
    x = _case(n, d_out, d_in, BF16, seed=n)[0]
    on = jnp.ones((n,), jnp.int32)
    f = lambda x, s, a, b, kw=kw: dense_matmul_lora(
        x, s, jnp.int32(1), a, b, on, lora_index=jnp.int32(2),
        implementation="pallas_interpret", **kw)
    jaxpr = str(jax.make_jaxpr(f)(x, stack, a, b))
    outside = jaxpr.split("pallas_call")[0]
    if want is None:
      assert "pallas_call" not in jaxpr
      ref = dense_lora_reference(x, stack, jnp.int32(1), a, b, on, lora_index=jnp.int32(2))
      assert np.array_equal(np.asarray(f(x, stack, a, b)), np.asarray(ref))
      continue
    assert want in jaxpr and (want != "dense_dot_lora" or "lora_finish" not in jaxpr), (n, kw)
    assert "dynamic_slice" not in outside
    got = f(x, stack, a, b)
    assert_close(got, _lora_want(x, stack, 1, a, b, 2, on)[0], rel=KERNEL_REL["bfloat16"],
                 what=f"dense_matmul_lora N{n} {kw}")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU backend")
@pytest.mark.parametrize("m,on_kind", [(8, "mixed"), (1, "all"), (32, "off"), (5, "all"),
                                        (64, "mixed")])
def test_gpu_dense_dot_lora(m, on_kind):
  """Compiled, at bench-a3b's adapted shape (ssm_out / attn_output, rank 50): on rows against
  float64, off rows the plain kernel's bits (the adapted call's own tiling, LORA_BLOCK_OUT
  rows a program, against the plain call's: the same split of `in`)."""
  d_out, d_in, rank = 2048, 4096, 50
  x, stack = _case(m, d_out, d_in, BF16, n_mats=3, seed=m)
  a, b, on = _lora_case(m, d_out, d_in, rank, on_kind, n_ad=4)
  got = np.asarray(jax.jit(lambda *v: dense_dot_call(
      v[0], v[1], jnp.int32(2), lora=(v[2], v[3], jnp.int32(3), v[4], None)))(
          x, stack, a, b, on))
  plain = np.asarray(jax.jit(dense_dot_call)(x, stack, jnp.int32(2)))
  want, on_rows = _lora_want(x, stack, 2, a, b, 3, on)
  assert np.array_equal(got[~on_rows].view(np.uint16), plain[~on_rows].view(np.uint16))
  if on_rows.any():
    assert_close(got[on_rows], want[on_rows], rel=KERNEL_REL["bfloat16"], what="gpu on rows")
