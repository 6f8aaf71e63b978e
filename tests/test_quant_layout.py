"""Repacked quant layout: exact round trip against gguf, device bytes, bad input, stacking."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from quant_fixtures import gguf_dequantize, random_raw

from pallas_kernels.quant import (
    BLOCK,
    QUANT_TYPES,
    QuantLayoutError,
    dequantize,
    file_nbytes,
    pack,
    qmatmul_reference,
    select_matrix,
    stack,
)

# (out, blocks per row): odd row counts, 1-3 blocks.
SHAPES = [(3, 1), (5, 2), (130, 3)]


def _shape(qtype, out, blocks):
  return (out, blocks * BLOCK[qtype])


@pytest.mark.parametrize("qtype", QUANT_TYPES)
@pytest.mark.parametrize("out,blocks", SHAPES, ids=[f"out{o}-b{b}" for o, b in SHAPES])
def test_dequantize_of_pack_equals_gguf_exactly(qtype, out, blocks):
  shape = _shape(qtype, out, blocks)
  raw = random_raw(qtype, shape, seed=out + blocks)
  qt = pack(raw, qtype, shape)
  want = gguf_dequantize(raw, qtype)
  got = np.asarray(jax.jit(dequantize)(qt))
  assert got.shape == want.shape == shape
  assert got.dtype == np.float32
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_device_bytes_within_1p1_of_file(qtype):
  shape = (2, 7, 2 * BLOCK[qtype])
  raw = random_raw(qtype, shape)
  qt = jax.device_put(pack(raw, qtype, shape))
  assert file_nbytes(qtype, shape) == raw.nbytes
  assert qt.nbytes <= 1.1 * raw.nbytes, (qt.nbytes, raw.nbytes)
  assert sum(x.nbytes for x in jax.tree.leaves(qt)) == qt.nbytes


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_stacked_pack_and_stack_agree_and_select_matrix(qtype):
  shape = (3, 4, 5, BLOCK[qtype])  # [L, E, out, in]
  raw = random_raw(qtype, shape, seed=7)
  whole = pack(raw, qtype, shape)
  parts = [pack(raw[i], qtype, shape[1:]) for i in range(shape[0])]
  for stacked in (stack(parts), stack([jax.device_put(p) for p in parts])):
    assert stacked.shape == whole.shape and stacked.qtype == qtype
    for name, plane in whole.planes.items():
      np.testing.assert_array_equal(np.asarray(stacked.planes[name]), plane)
  want = gguf_dequantize(raw, qtype)
  got = np.asarray(dequantize(whole))
  np.testing.assert_array_equal(got, want)
  sel = jax.jit(select_matrix)(whole, jnp.int32(2 * 4 + 3))  # layer 2, expert 3
  np.testing.assert_array_equal(np.asarray(dequantize(sel)), want[2, 3])


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_qmatmul_reference_is_dequantise_then_multiply(qtype):
  shape = (2, 6, 2 * BLOCK[qtype])
  raw = random_raw(qtype, shape, seed=3)
  qt = pack(raw, qtype, shape)
  x = np.random.default_rng(0).standard_normal((3, shape[-1])).astype(np.float32)
  w = gguf_dequantize(raw, qtype)[1].astype(np.float64)
  got = np.asarray(qmatmul_reference(jnp.asarray(x), qt, index=jnp.int32(1)))
  np.testing.assert_allclose(got, x.astype(np.float64) @ w.T, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="stacked"):
    qmatmul_reference(jnp.asarray(x), qt)


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_row_not_multiple_of_block_is_refused(qtype):
  shape = (4, BLOCK[qtype] + 16)
  with pytest.raises(QuantLayoutError, match="multiple of the block size"):
    pack(np.zeros(10_000, np.uint8), qtype, shape)
  assert issubclass(QuantLayoutError, ValueError)


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_short_or_long_data_is_refused(qtype):
  shape = (3, BLOCK[qtype])
  raw = random_raw(qtype, shape)
  with pytest.raises(ValueError, match="shorter"):
    pack(raw.reshape(-1)[:-1], qtype, shape)
  with pytest.raises(ValueError, match="does not match"):
    pack(np.concatenate([raw.reshape(-1), raw.reshape(-1)[:5]]), qtype, shape)
  with pytest.raises(ValueError, match="uint8"):
    pack(raw.view(np.int8), qtype, shape)


def test_unknown_type_is_refused():
  with pytest.raises(ValueError, match="no kernel layout"):
    pack(np.zeros(18, np.uint8), "q4_0", (1, 32))
