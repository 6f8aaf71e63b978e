"""LoRA delta kernel: parity against float64 numpy, the off-row select, one compile per shape.

Every contract test runs against each implementation (tokamax style): "pallas_interpret"
and "xla" on CPU, and the compiled "pallas" under the `gpu` marker on the device.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import KERNEL_REL, assert_close

from pallas_kernels.lora import (
    AUTO_KERNEL_MIN_ROWS,
    lora_apply,
    lora_pallas,
    lora_reference,
    resolve,
)

CPU_IMPLS = ("pallas_interpret", "xla")
ON_GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU backend")

# (Din, Dout, R): non-powers of 2, odd and large ranks.
SMALL_DIMS = [(96, 80, 50), (200, 72, 128)]
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def _id(n, dims):
  return f"N{n}-{dims[0]}x{dims[1]}-R{dims[2]}"


def make_inputs(n, d_in, d_out, rank, *, act=F32, w=F32, seed=0, on="mixed"):
  """Numpy inputs with delta ~ base ~ O(1); on = 'mixed' | 'all' | 'none'."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, d_in)).astype(act)
  base = rng.standard_normal((n, d_out)).astype(act)
  a = (rng.standard_normal((rank, d_in)) / np.sqrt(d_in)).astype(w)
  b = (rng.standard_normal((d_out, rank)) / np.sqrt(rank)).astype(w)
  if on == "mixed":
    flags = (rng.random(n) < 0.6).astype(np.int32)
    flags[0] = 1  # at least one row on, and one off when there are two rows
    flags[-1] = 0 if n > 1 else 1
  else:
    flags = np.full((n,), int(on == "all"), np.int32)
  return base, x, a, b, flags


def want64(base, x, a, b, on, scale=1.0):
  """float64 numpy: the math the kernel approximates, from the same (rounded) inputs."""
  f = np.float64
  with np.errstate(invalid="ignore", over="ignore"):  # inf/NaN in off rows, on purpose
    y = base.astype(f) + scale * (x.astype(f) @ a.astype(f).T) @ b.astype(f).T
  return np.where(on[:, None] != 0, y, base.astype(f))


def bits(arr):
  arr = np.asarray(arr)
  return arr.view({2: np.uint16, 4: np.uint32}[arr.dtype.itemsize])


def check(got, base, x, a, b, on, *, scale=1.0, what=""):
  """Output dtype, parity on on-rows, bit identity on off-rows."""
  got = np.asarray(got)
  assert got.dtype == base.dtype, f"{what}: dtype {got.dtype} != base {base.dtype}"
  off = on == 0
  assert np.array_equal(bits(got[off]), bits(base[off])), f"{what}: off rows differ from base"
  onr = ~off
  if onr.any():
    want = want64(base, x, a, b, on, scale)[onr]
    assert_close(got[onr], want, rel=KERNEL_REL[np.dtype(base.dtype).name], what=what)


def run(impl, *args, **kw):
  return lora_apply(*(jnp.asarray(v) for v in args), implementation=impl, **kw)


# ---------------------------------------------------------------- parity (CPU impls)


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("n", [1, 3, 8, 300])
@pytest.mark.parametrize("dims", SMALL_DIMS, ids=lambda d: f"{d[0]}x{d[1]}-R{d[2]}")
def test_parity_fp32(impl, n, dims):
  args = make_inputs(n, *dims, seed=n)
  check(run(impl, *args), *args, what=f"{impl} {_id(n, dims)}")


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("act,w", [(BF16, BF16), (F16, F16), (BF16, F32), (F16, BF16)],
                         ids=["bf16", "f16", "bf16-w32", "f16-wbf16"])
def test_parity_half(impl, act, w):
  args = make_inputs(8, 96, 80, 50, act=act, w=w, seed=3)
  check(run(impl, *args), *args, what=f"{impl} {np.dtype(act).name}/{np.dtype(w).name}")


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_scale(impl):
  args = make_inputs(3, 96, 80, 12, seed=5)
  check(run(impl, *args, scale=0.37), *args, scale=0.37, what=f"{impl} scale")


@pytest.mark.parametrize("n,d_in,d_out,rank,kw", [
    (300, 200, 72, 50, dict(din_splits=1, dout_splits=1)),  # fused, one program per row block
    (300, 200, 72, 50, dict(block_rows=64, block_in=64, block_out=32, din_splits=2,
                            dout_splits=2)),  # split: ragged Din split, ragged Dout tile
    (3, 96, 80, 12, dict(block_in=32, block_out=16, din_splits=3, dout_splits=5)),
    (8, 200, 72, 128, dict(block_in=16, block_out=16, din_splits=1, dout_splits=2)),
], ids=["fused", "split", "split-many", "fused-dout-splits"])
def test_kernel_tilings(n, d_in, d_out, rank, kw):
  """The fused and split kernel forms under the interpreter (GPU picks among them)."""
  args = make_inputs(n, d_in, d_out, rank, seed=7)
  got = lora_pallas(*(jnp.asarray(v) for v in args), interpret=True, **kw)
  check(got, *args, what=f"tiling {kw}")


def test_reference_matches_float64():
  args = make_inputs(8, 200, 72, 50, seed=11)
  check(lora_reference(*(jnp.asarray(v) for v in args)), *args, what="reference")


@pytest.mark.slow
@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_parity_long_prefill(impl):
  args = make_inputs(4096, 96, 80, 50, seed=13)
  check(run(impl, *args), *args, what=f"{impl} N4096")


# ---------------------------------------------------------------- the switch


def adversarial_inputs(act=F32):
  """Off rows hold -0.0 in base, inf and NaN in x; they share row blocks with on rows."""
  base, x, a, b, _ = make_inputs(8, 96, 80, 50, act=act, seed=17)
  on = np.array([1, 0, 0, 1, 0, 1, 0, 0], np.int32)
  base[:, ::3] = -0.0  # on rows too: -0.0 + delta is fine there
  base[1, :] = -0.0
  x[1, 5] = np.inf
  x[2, :] = np.nan
  x[4, 7] = -np.inf
  base[6, 3] = np.nan  # a NaN that is base's own must come back with the same bits
  return base, x, a, b, on


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("act", [F32, BF16], ids=["f32", "bf16"])
def test_off_rows_bit_identical_adversarial(impl, act):
  args = adversarial_inputs(act)
  got = np.asarray(run(impl, *args))
  check(got, *args, what=f"{impl} adversarial")
  assert np.isfinite(got[args[4] == 1].astype(np.float32)).all()


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_all_off_ignores_nan_adapter(impl):
  base, x, a, b, on = make_inputs(3, 96, 80, 50, on="none", seed=19)
  base[0, :4] = -0.0
  a[0, 0], b[1, 1] = np.nan, np.inf
  got = run(impl, base, x, a, b, on)
  assert np.array_equal(bits(got), bits(base))


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_one_compile_serves_every_switch_state(impl):
  f = jax.jit(functools.partial(lora_apply, implementation=impl))
  base, x, a, b, _ = (jnp.asarray(v) for v in make_inputs(8, 96, 80, 50, seed=23))
  outs = {}
  for state in ("all", "none", "mixed"):
    on = jnp.asarray(make_inputs(8, 96, 80, 50, seed=23, on=state)[4])
    outs[state] = f(base, x, a, b, on)
  assert f._cache_size() == 1
  assert np.array_equal(bits(outs["none"]), bits(base))
  assert not np.array_equal(bits(outs["all"]), bits(base))


# ---------------------------------------------------------------- several adapters per batch


def table_inputs(n, d_in, d_out, ranks, *, seed=0, act=F32):
  """Adapters of `ranks` stacked on R, and a per-row rank scale: row i picks adapter
  i % (len(ranks) + 1) (the last choice: none, and such rows are off) at scale 0.5 + i / 4,
  and every fourth on row also adds adapter 0 at 0.75."""
  base, x, a, b, _ = make_inputs(n, d_in, d_out, sum(ranks), act=act, seed=seed)
  offs = np.cumsum([0, *ranks])
  rs = np.zeros((n, sum(ranks)), np.float32)
  on = np.zeros(n, np.int32)
  for i in range(n):
    k = i % (len(ranks) + 1)
    if k < len(ranks):
      rs[i, offs[k]:offs[k + 1]] = 0.5 + i / 4
      on[i] = 1
      if i % 4 == 0:
        rs[i, offs[0]:offs[1]] += 0.75
  return base, x, a, b, on, rs


def want64_table(base, x, a, b, on, rs):
  f = np.float64
  h = (x.astype(f) @ a.astype(f).T) * rs.astype(f)
  y = base.astype(f) + h @ b.astype(f).T
  return np.where(on[:, None] != 0, y, base.astype(f))


def check_table(got, base, x, a, b, on, rs, what):
  got = np.asarray(got)
  off = on == 0
  assert np.array_equal(bits(got[off]), bits(base[off])), f"{what}: off rows differ from base"
  want = want64_table(base, x, a, b, on, rs)[~off]
  assert_close(got[~off], want, rel=KERNEL_REL[np.dtype(base.dtype).name], what=what)


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("n,ranks", [(1, (12,)), (9, (8, 50, 16, 30)), (33, (64, 64))],
                         ids=["N1", "N9-4ad", "N33-2ad"])
def test_rank_scale_table_parity(impl, n, ranks):
  """Rows choose among adapters stacked on R (and mix them) through the rank-scale table."""
  args = table_inputs(n, 96, 80, ranks, seed=n)
  got = run(impl, *args[:5], rank_scale=jnp.asarray(args[5]))
  check_table(got, *args, what=f"{impl} N{n} ranks {ranks}")
  ref = lora_reference(*(jnp.asarray(v) for v in args[:5]), rank_scale=jnp.asarray(args[5]))
  check_table(ref, *args, what=f"reference N{n}")


@pytest.mark.parametrize("kw", [dict(din_splits=1, dout_splits=2, block_in=32),
                                dict(block_rows=16, block_in=32, block_out=16, din_splits=3,
                                     dout_splits=2)], ids=["fused", "split"])
def test_rank_scale_table_kernel_forms(kw):
  """Both kernel forms apply the table (the split form scales the summed partials)."""
  args = table_inputs(21, 200, 72, (8, 50, 16), seed=5)
  got = lora_pallas(*(jnp.asarray(v) for v in args), interpret=True, **kw)
  check_table(got, *args, what=f"tiling {kw}")


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_rank_scale_row_equals_its_adapter_alone(impl):
  """A row whose table picks one adapter at scale 1 gives what that adapter alone gives (the
  other adapters' columns are exact zeros in h), to fp32 rounding (the sums differ in length)."""
  base, x, a, b, on, _ = table_inputs(6, 96, 80, (8, 24), seed=9)
  on[:] = 1
  rs = np.zeros((6, 32), np.float32)
  rs[:, 8:] = 1.0
  got = run(impl, base, x, a, b, on, rank_scale=jnp.asarray(rs))
  alone = run(impl, base, x, a[8:], b[:, 8:], on)
  assert_close(got, alone, rel=KERNEL_REL["float32"], what=f"{impl} one adapter of two")


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_rank_scale_is_data_one_compile(impl):
  if impl == "pallas_interpret" and jax.default_backend() == "gpu":
    pytest.skip("the interpreter is the CPU path; under the GPU backend its second call "
                "compiled again even with like-made tables (gpu_tests_run{7,8}_failures.txt)")
  f = jax.jit(functools.partial(lora_apply, implementation=impl))
  *args, rs = table_inputs(8, 96, 80, (8, 50), seed=2)
  base, x, a, b, on = (jnp.asarray(v) for v in args)
  first = f(base, x, a, b, on, rank_scale=jnp.asarray(rs))
  second = f(base, x, a, b, on, rank_scale=jnp.asarray(rs[::-1].copy()))
  assert f._cache_size() == 1
  assert not np.array_equal(bits(first), bits(second))


def test_rank_scale_checks():
  base, x, a, b, on, rs = (jnp.asarray(v) for v in table_inputs(3, 96, 80, (12,)))
  with pytest.raises(ValueError, match="rank_scale .* must be \\[N, R\\]"):
    lora_pallas(base, x, a, b, on, rs[:, :-1], interpret=True)
  with pytest.raises(ValueError, match="takes no rank_scale"):
    lora_apply(base, x, a, b, on, rank_scale=rs, implementation="mosaic")


# ---------------------------------------------------------------- API


def test_input_checks():
  base, x, a, b, on = (jnp.asarray(v) for v in make_inputs(3, 96, 80, 12))
  with pytest.raises(ValueError, match="b .* must be \\[Dout, R\\]"):
    lora_pallas(base, x, a, b.T, on, interpret=True)
  with pytest.raises(ValueError, match="a .* must be \\[R, Din\\]"):
    lora_pallas(base, x, a[:, :-1], b, on, interpret=True)
  with pytest.raises(ValueError, match="row counts differ"):
    lora_pallas(base, x, a, b, on[:2], interpret=True)
  with pytest.raises(ValueError, match="on must be int32"):
    lora_pallas(base, x, a, b, on.astype(jnp.float32), interpret=True)
  with pytest.raises(ValueError, match="x dtype int32"):
    lora_pallas(base, x.astype(jnp.int32), a, b, on, interpret=True)
  with pytest.raises(ValueError, match="block_in=48 must be a power of 2"):
    lora_pallas(base, x, a, b, on, interpret=True, block_in=48)
  with pytest.raises(ValueError, match="unknown implementation"):
    lora_apply(base, x, a, b, on, implementation="cuda")


def test_implementation_choice():
  small, large = resolve(None, 8), resolve("auto", AUTO_KERNEL_MIN_ROWS)
  if ON_GPU:
    assert (small, large) == ("xla", "kernel")
  else:
    assert small == large == "xla"
  assert resolve("pallas_interpret", 8) == "pallas_interpret"
  with pytest.raises(ValueError, match="unknown implementation 'triton'"):
    resolve("triton", 8)
  assert resolve("xla", 1) == "xla"


# ---------------------------------------------------------------- compiled, on the device

# (N, Din, Dout, R): the model's 6144 -> 2560 and a rank-12 4096-wide case, plus small odd ones.
GPU_CASES = [(1, 96, 80, 50), (3, 200, 72, 128), (8, 96, 80, 50), (300, 200, 72, 128),
             (4096, 96, 80, 50), (1, 6144, 2560, 50), (8, 6144, 2560, 50),
             (300, 6144, 2560, 50), (4096, 6144, 2560, 50), (3, 6144, 2560, 128),
             (300, 6144, 2560, 128), (8, 2048, 4096, 12)]


@pytest.fixture
def highest_precision():
  """fp32 parity on GPU: make any default-precision dot full fp32 (the kernel's are)."""
  with jax.default_matmul_precision("highest"):
    yield


@pytest.mark.gpu
@needs_gpu
@pytest.mark.usefixtures("highest_precision")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: _id(c[0], c[1:]))
@pytest.mark.parametrize("act", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_gpu_parity(impl, act, case):
  n, dims = case[0], case[1:]
  args = make_inputs(n, *dims, act=act, w=act, seed=n)
  check(run(impl, *args), *args, what=f"gpu {impl} {np.dtype(act).name} {_id(n, dims)}")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kw", [dict(din_splits=1), dict(din_splits=1, dout_splits=4),
                                dict(din_splits=8, dout_splits=10), dict(din_splits=24),
                                dict(block_rows=32, din_splits=4, num_warps=4)],
                         ids=["fused", "fused-g4", "split8x10", "split24", "bn32-w4"])
@pytest.mark.parametrize("n", [1, 8, 300])
def test_gpu_tilings(kw, n):
  args = make_inputs(n, 6144, 2560, 50, act=BF16, w=BF16, seed=29)
  check(lora_pallas(*(jnp.asarray(v) for v in args), **kw), *args, what=f"gpu tiling {kw}")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("act", [F32, BF16], ids=["f32", "bf16"])
def test_gpu_switch(impl, act):
  args = adversarial_inputs(act)
  check(run(impl, *args), *args, what=f"gpu {impl} adversarial")
  base, x, a, b, on = make_inputs(3, 96, 80, 50, on="none", seed=19)
  a[0, 0] = np.nan
  assert np.array_equal(bits(run(impl, base, x, a, b, on)), bits(base))
  f = jax.jit(functools.partial(lora_apply, implementation=impl))
  base, x, a, b, _ = (jnp.asarray(v) for v in make_inputs(8, 6144, 2560, 50, act=act, w=act))
  for state in ("all", "none", "mixed"):
    f(base, x, a, b, jnp.asarray(make_inputs(8, 6144, 2560, 50, on=state)[4]))
  assert f._cache_size() == 1


@pytest.mark.gpu
@needs_gpu
@pytest.mark.usefixtures("highest_precision")
@pytest.mark.parametrize("kw", [dict(din_splits=1), dict(din_splits=8, dout_splits=10)],
                         ids=["fused", "split8x10"])
@pytest.mark.parametrize("n", [1, 32, 300])
@pytest.mark.parametrize("act", [F32, BF16], ids=["f32", "bf16"])
def test_gpu_rank_scale_table(act, n, kw):
  """The compiled kernel with the per-row adapter table: 4 rank-50 adapters on one R (200)."""
  args = table_inputs(n, 4096, 2048, (50, 50, 50, 50), seed=31, act=act)
  got = lora_pallas(*(jnp.asarray(v) for v in args[:5]), jnp.asarray(args[5]), **kw)
  check_table(got, *args, what=f"gpu table {np.dtype(act).name} N{n} {kw}")


@pytest.mark.parametrize("rank,b_itemsize,bo", [(50, 2, 128), (64, 4, 128), (200, 2, 64),
                                                (200, 4, 32)])
def test_compiled_tiling_fits_the_b_tiles_in_shared_memory(rank, b_itemsize, bo):
  """The compiled defaults keep num_stages + 1 copies of the up pass's [bo, Rp] B tile within
  the shared-memory budget: an adapter table of 4 rank-50 adapters (Rp 256) asked the H200 for
  280-336 KiB at bo = 128 (gpu_tests_run7_failures.txt); small ranks keep bo = 128."""
  from pallas_kernels.lora import kernel
  t = kernel.tiling(32, 4096, 2048, rank, b_itemsize=b_itemsize)
  assert t.block_out == bo
  assert t.block_out * t.rank_pad * b_itemsize * 4 <= kernel._SMEM_BUDGET
