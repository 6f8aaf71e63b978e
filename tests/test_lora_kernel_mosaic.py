"""The Mosaic GPU LoRA kernel (`kernel_mosaic.lora_mosaic`): the same contract as the Triton one.

On CPU it runs under the Mosaic GPU interpreter (jnp dots stand in for the WGMMAs, which the
interpreter cannot run on a transposed SMEM ref; everything else, the TMA pipelines, the
padding of N and R, the Dout splits, the two-slot stores and the select, is the kernel's
own code), and its lowering to Mosaic GPU is checked for CUDA without a GPU. Compiled
parity runs under the `gpu` marker on the device.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_lora_kernel import BF16, F16, F32, bits, check, make_inputs
from tolerances import KERNEL_REL, assert_close

from pallas_kernels.lora import lora_apply, lora_pallas
from pallas_kernels.lora.kernel_mosaic import (
    BLOCK_ROWS,
    interpret_params,
    lora_mosaic,
    mosaic_supported,
    mosaic_tiling,
)

ON_GPU = jax.default_backend() == "gpu"
IP = interpret_params()
needs_interpreter = pytest.mark.skipif(
    ON_GPU or IP is None, reason="the Mosaic GPU interpreter runs on the CPU backend")


def run_interp(base, x, a, b, on, **kw):
  return lora_mosaic(*(jnp.asarray(v) for v in (base, x, a, b, on)), interpret=IP, **kw)


def bf16_inputs(n, d_in, d_out, rank, *, base=BF16, seed=0, on="mixed"):
  """bf16 x, a, b (what the kernel takes) and a base of the given dtype."""
  out = make_inputs(n, d_in, d_out, rank, act=BF16, w=BF16, seed=seed, on=on)
  return (out[0].astype(base), *out[1:])


# N = 8 and 70 pad rows to 64 / 128 (two row blocks); R = 50 pads to 64; 192 x 320 takes
# 64-wide tiles (not multiples of 128); dout_splits=1 puts five Dout tiles in one program
# (two-slot stores, a two-deep up pipeline); base f32 / f16 use their own SMEM tiling.
@needs_interpreter
@pytest.mark.parametrize("n,d_in,d_out,rank,base,kw", [
    (8, 256, 256, 64, BF16, {}),
    (70, 192, 320, 50, BF16, {}),
    (64, 128, 320, 64, F16, dict(dout_splits=1)),
    (3, 384, 128, 16, F16, dict(in_stages=2)),
], ids=["N8-256x256", "N70-192x320-R50", "N64-f16base-g1", "N3-f16base-s2"])
def test_interpret_parity(n, d_in, d_out, rank, base, kw):
  args = bf16_inputs(n, d_in, d_out, rank, base=base, seed=n)
  check(run_interp(*args, **kw), *args, what=f"mosaic interpret N{n} {d_in}x{d_out} R{rank}")


@needs_interpreter
@pytest.mark.parametrize("kw", [{}, dict(dout_splits=1)], ids=["default", "g1"])
def test_interpret_fp32_base_matches_triton_kernel(kw):
  """An fp32 base keeps the kernel's own rounding visible. With bf16 b both kernels split
  h = hi + lo (2^-17 relative: above the fp32 bound against float64 math), so the check is
  against the Triton kernel's interpreter run: the same products, summed in another order."""
  args = [jnp.asarray(v) for v in bf16_inputs(64, 128, 320, 64, base=F32, seed=3)]
  got = np.asarray(run_interp(*args, **kw))
  want = np.asarray(lora_pallas(*args, interpret=True))
  off = np.asarray(args[4]) == 0
  assert np.array_equal(bits(got[off]), bits(np.asarray(args[0])[off]))
  assert_close(got, want, rel=KERNEL_REL["float32"], what="mosaic vs triton, fp32 base")


@needs_interpreter
def test_interpret_scale():
  args = bf16_inputs(8, 128, 128, 64, base=F16, seed=5)
  check(run_interp(*args, scale=0.37), *args, scale=0.37, what="mosaic scale")


@needs_interpreter
def test_interpret_off_rows_bit_identical_adversarial():
  """Off rows: -0.0 and NaN in base, +-inf and NaN in x, sharing a row block with on rows."""
  base, x, a, b, _ = bf16_inputs(8, 128, 192, 50, seed=17)
  on = np.array([1, 0, 0, 1, 0, 1, 0, 0], np.int32)
  base[:, ::3] = -0.0
  base[1, :] = -0.0
  x[1, 5] = np.inf
  x[2, :] = np.nan
  x[4, 7] = -np.inf
  base[6, 3] = np.nan
  got = np.asarray(run_interp(base, x, a, b, on))
  check(got, base, x, a, b, on, what="mosaic adversarial")
  assert np.isfinite(got[on == 1].astype(np.float32)).all()


@needs_interpreter
def test_interpret_all_off_ignores_nan_adapter():
  base, x, a, b, on = bf16_inputs(3, 128, 128, 64, seed=19, on="none")
  base[0, :4] = -0.0
  a[0, 0], b[1, 1] = np.nan, np.inf
  assert np.array_equal(bits(run_interp(base, x, a, b, on)), bits(base))


def _lower_for_cuda(n, d_in, d_out, rank, base=BF16, **kw):
  s = jax.ShapeDtypeStruct
  f = jax.jit(functools.partial(lora_mosaic, **kw))
  return f.trace(s((n, d_out), base), s((n, d_in), BF16), s((rank, d_in), BF16),
                 s((d_out, rank), BF16), s((n,), jnp.int32)).lower(
                     lowering_platforms=("cuda",))


@pytest.mark.parametrize("n,d_in,d_out", [(1, 4096, 2048), (2048, 2048, 4096),
                                          (300, 6144, 2560)])
def test_lowers_to_mosaic_gpu_without_a_gpu(n, d_in, d_out):
  """Pallas -> Mosaic GPU lowering (layouts, WGMMA shapes, transforms) for the bench shapes."""
  text = _lower_for_cuda(n, d_in, d_out, 64).as_text()
  assert "mosaic_gpu" in text


def test_tiling_choices():
  t = mosaic_tiling(1, 4096, 2048, 50)
  assert (t.n_pad, t.rank_pad, t.block_in, t.block_out) == (BLOCK_ROWS, 64, 128, 128)
  assert t.dout_splits == 16 and t.out_tiles == 1  # decode: one Dout tile per program
  t = mosaic_tiling(2048, 4096, 2048, 64)
  assert t.row_blocks == 32 and t.dout_splits == 4  # 128 programs, <= 132 SMs
  t = mosaic_tiling(300, 192, 320, 64)
  assert (t.n_pad, t.block_in, t.block_out) == (320, 64, 64)
  assert (320 // t.block_out) % t.dout_splits == 0
  with pytest.raises(ValueError, match="dout_splits 3 must divide"):
    mosaic_tiling(64, 256, 256, 64, dout_splits=3)


def test_unsupported_operands_are_refused():
  base, x, a, b, on = (jnp.asarray(v) for v in bf16_inputs(8, 128, 128, 64))
  assert mosaic_supported(base, x, a, b) is None
  assert "bfloat16" in mosaic_supported(base, x.astype(F32), a, b)
  assert "Din = 96" in mosaic_supported(base, x[:, :96], a[:, :96], b)
  assert "Dout = 80" in mosaic_supported(base[:, :80], x, a, b[:80])
  assert "pads past 256" in mosaic_supported(base, x, jnp.zeros((300, 128), BF16),
                                             jnp.zeros((128, 300), BF16))
  with pytest.raises(ValueError, match="lora mosaic: unsupported operands: x, a, b must be"):
    lora_mosaic(base, x.astype(F32), a, b, on, interpret=IP)
  with pytest.raises(ValueError, match="b .* must be \\[Dout, R\\]"):  # the shared checks
    lora_mosaic(base, x, a, b.T[:, :64], on, interpret=IP)


# ---------------------------------------------------------------- compiled, on the device

GPU_CASES = [(1, 4096, 2048, 64), (8, 2048, 4096, 64), (300, 4096, 2048, 50),
             (2048, 2048, 4096, 64), (4096, 6144, 2560, 50)]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU backend")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "N{}-{}x{}-R{}".format(*c))
@pytest.mark.parametrize("base", [BF16, F16], ids=["bf16", "f16base"])
def test_gpu_parity(case, base):
  """Compiled Mosaic GPU kernel (through `lora_apply(implementation="mosaic")`)."""
  args = bf16_inputs(*case, base=base, seed=case[0])
  got = lora_apply(*(jnp.asarray(v) for v in args), implementation="mosaic")  # no flags
  check(got, *args, what=f"gpu mosaic {case}")
