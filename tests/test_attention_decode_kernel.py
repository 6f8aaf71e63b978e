"""Decode attention kernel (pallas_kernels/attention): parity with the model's XLA form
(`decode_attention_reference`) against float64, in-place reads of a layer stack, valid keys
only, kv_start windows, and the implementation choice.

The interpreter runs the kernel body on CPU; the compiled kernel runs under the `gpu` marker.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import KERNEL_REL, assert_close

from pallas_kernels.attention import (
  decode_attention,
  decode_attention_pallas,
  decode_attention_reference,
  resolve,
)
from pallas_kernels.attention.kernel import tiling

ON_GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU backend")
F32, BF16 = jnp.float32, jnp.bfloat16


def make(B=3, H=4, G=2, Hd=32, S=70, L=2, dtype=F32, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, H, Hd)).astype(np.float32)
  k = rng.standard_normal((L, B, S, G, Hd)).astype(np.float32)
  v = rng.standard_normal((L, B, S, G, Hd)).astype(np.float32)
  return tuple(jnp.asarray(a, dtype) for a in (q, k, v))


def oracle(q, k, v, layer, pos, kv_start=None):
  """The reference in float64 (numpy) on the layer's cache."""
  f = lambda a: np.asarray(jnp.asarray(a, F32), np.float64)
  q, k, v = f(q), f(k)[layer], f(v)[layer]
  B, H, Hd = q.shape
  G = k.shape[2]
  out = np.zeros((B, H, Hd))
  for b in range(B):
    lo = 0 if kv_start is None else min(int(kv_start[b]), int(pos[b]))
    for h in range(H):
      g = h // (H // G)
      s = k[b, lo:pos[b] + 1, g] @ q[b, h] * Hd ** -0.5
      p = np.exp(s - s.max())
      out[b, h] = p @ v[b, lo:pos[b] + 1, g] / p.sum()
  return out


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layer", [0, 1])
def test_parity_with_float64_and_the_xla_form(dtype, layer):
  """Ragged capacity (70 keys, blocks of 32), positions at 0, inside and at the last key,
  two kv-heads of two query heads each; the layer read from the stack."""
  q, k, v = make(dtype=dtype, seed=layer)
  pos = jnp.asarray([0, 37, 69], jnp.int32)
  got = decode_attention(q, k, v, jnp.int32(layer), pos, implementation="pallas_interpret")
  want = oracle(q, k, v, layer, np.asarray(pos))
  rel = KERNEL_REL["float32"]  # the sums are fp32 whatever the cache's dtype
  assert_close(got, want, rel=rel, what=f"kernel {jnp.dtype(dtype).name}")
  with jax.default_matmul_precision("highest"):  # as the model traces fp32 (GPU: not TF32)
    xla = decode_attention(q, k, v, jnp.int32(layer), pos, implementation="xla")
  assert_close(xla, want, rel=rel, what="xla form")


def test_splits_and_blocks_give_one_answer():
  """Every split count and block size: the same numbers to fp32 rounding (the splits'
  softmax parts combine exactly, an empty split adds nothing)."""
  q, k, v = make(S=130, seed=3)
  pos = jnp.asarray([5, 64, 129], jnp.int32)
  want = oracle(q, k, v, 1, np.asarray(pos))
  for n_split, block_s in [(1, 16), (3, 16), (8, 32), (5, 64)]:
    got = decode_attention_pallas(q, k, v, jnp.int32(1), pos, n_split=n_split,
                                  block_s=block_s, interpret=True)
    assert_close(got, want, rel=KERNEL_REL["float32"], what=f"{n_split}x{block_s}")


def test_only_valid_keys_count():
  """Keys past a row's position (and before its kv_start) change nothing, even NaN ones."""
  q, k, v = make(seed=4)
  pos = jnp.asarray([10, 40, 3], jnp.int32)
  start = jnp.asarray([4, 0, 9], jnp.int32)  # the third row's start is past its position
  got = decode_attention(q, k, v, jnp.int32(0), pos, start, implementation="pallas_interpret")
  keys = jnp.arange(k.shape[2])[None, None, :, None, None]
  lo = jnp.minimum(start, pos)[None, :, None, None, None]
  hide = (keys > pos[None, :, None, None, None]) | (keys < lo)
  k_nan, v_nan = jnp.where(hide, jnp.nan, k), jnp.where(hide, jnp.nan, v)
  got_nan = decode_attention(q, k_nan, v_nan, jnp.int32(0), pos, start,
                             implementation="pallas_interpret")
  np.testing.assert_array_equal(np.asarray(got), np.asarray(got_nan))
  assert_close(got, oracle(q, k, v, 0, np.asarray(pos), np.asarray(start)),
               rel=KERNEL_REL["float32"], what="window")
  with jax.default_matmul_precision("highest"):
    want_xla = decode_attention(q, k, v, jnp.int32(0), pos, start, implementation="xla")
  assert_close(got, want_xla, rel=KERNEL_REL["float32"], what="window vs xla")


def test_tiling_and_errors():
  t = tiling(16, 2, 256, 2560, BF16)
  assert (t.r, t.rows_pad, t.n_split, t.chunk, t.cd) == (8, 16, 8, 320, jnp.dtype(BF16))
  assert tiling(16, 2, 256, 100, F32).precision == jax.lax.Precision.HIGHEST
  with pytest.raises(ValueError, match="block_s=8"):
    tiling(4, 2, 32, 64, F32, block_s=8)
  q, k, v = make()
  with pytest.raises(ValueError, match="decode attention"):
    decode_attention_pallas(q[:, :3], k, v, 0, jnp.zeros((3,), jnp.int32), interpret=True)
  with pytest.raises(ValueError, match="unknown implementation"):
    decode_attention(q, k, v, 0, jnp.zeros((3,), jnp.int32), implementation="cuda")
  assert resolve("auto") == ("pallas" if ON_GPU else "xla")


def test_reference_is_the_models_xla_form():
  """The oracle is the model's T = 1 attention core, bit for bit (same ops in the same order)."""
  q, k, v = make(seed=6)
  pos = jnp.asarray([3, 50, 69], jnp.int32)
  ref = decode_attention_reference(q, k[1], v[1], pos)
  qh = q.reshape(3, 1, 2, 2, 32).astype(F32)
  scores = jnp.einsum("btgrd,bsgd->bgrts", qh, k[1].astype(F32)) * (32 ** -0.5)
  mask = jnp.arange(70)[None, None, :] <= pos[:, None, None]
  probs = jax.nn.softmax(jnp.where(mask[:, None, None], scores, -jnp.inf), axis=-1)
  out = jnp.einsum("bgrts,bsgd->btgrd", probs, v[1].astype(F32)).reshape(3, 4, 32)
  np.testing.assert_array_equal(np.asarray(ref), np.asarray(out))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_gpu_bench_shapes(dtype):
  """bench-a3b's attention (16 q-heads, 2 kv-heads of 256) over a 2,560-key capacity, 32 rows
  at scattered positions, compiled."""
  q, k, v = make(B=32, H=16, G=2, Hd=256, S=2560, L=2, dtype=dtype, seed=7)
  pos = jnp.asarray(np.random.default_rng(7).integers(0, 2560, 32), jnp.int32)
  got = decode_attention(q, k, v, jnp.int32(1), pos, implementation="pallas")
  want = oracle(q, k, v, 1, np.asarray(pos))
  assert_close(got, want, rel=KERNEL_REL["float32"], what="gpu")
