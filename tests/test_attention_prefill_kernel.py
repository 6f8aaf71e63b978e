"""Prefill attention kernel (pallas_kernels/attention/prefill_kernel.py): parity with the
model's XLA form (`attention_reference`) and float64 for causal chunks at any start position,
in-place reads of a layer stack, kv_start windows, positions past the capacity, keys outside
the chunk's range never read, and the implementation choice.

The interpreter runs the kernel body on CPU; the compiled kernel runs under the `gpu` marker.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import KERNEL_REL, assert_close

from pallas_kernels.attention import (
  attention_reference,
  prefill_attention,
  prefill_attention_pallas,
  resolve_prefill,
)
from pallas_kernels.attention.prefill_kernel import tiling

ON_GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU backend")
F32, BF16 = jnp.float32, jnp.bfloat16


def make(B=2, T=37, H=4, G=2, Hd=16, S=70, L=2, dtype=F32, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, T, H, Hd)).astype(np.float32)
  k = rng.standard_normal((L, B, S, G, Hd)).astype(np.float32)
  v = rng.standard_normal((L, B, S, G, Hd)).astype(np.float32)
  return tuple(jnp.asarray(a, dtype) for a in (q, k, v))


def oracle(q, k, v, layer, pos, kv_start=None):
  """Causal attention in float64 (numpy): query t of row b at position pos[b] + t sees keys
  min(kv_start, position)..position, cut to the capacity."""
  f = lambda a: np.asarray(jnp.asarray(a, F32), np.float64)
  q, k, v = f(q), f(k)[layer], f(v)[layer]
  B, T, H, Hd = q.shape
  S, G = k.shape[1], k.shape[2]
  out = np.zeros((B, T, H, Hd))
  for b in range(B):
    for t in range(T):
      p_t = int(pos[b]) + t
      lo = 0 if kv_start is None else min(int(kv_start[b]), p_t)
      hi = min(p_t, S - 1) + 1
      for h in range(H):
        g = h // (H // G)
        s = k[b, lo:hi, g] @ q[b, t, h] * Hd ** -0.5
        p = np.exp(s - s.max())
        out[b, t, h] = p @ v[b, lo:hi, g] / p.sum()
  return out


def xla_form(q, k, v, layer, pos, kv_start=None):
  with jax.default_matmul_precision("highest"):   # as the model traces fp32
    return prefill_attention(q, k, v, jnp.int32(layer), pos, kv_start, implementation="xla")


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layer", [0, 1])
def test_parity_with_float64_and_the_xla_form(dtype, layer):
  """37 queries in blocks of 16 (a ragged last block), two rows: one from position 0, one
  from 20 (a chunk after a cached prefix), two kv-heads of two query heads each."""
  q, k, v = make(dtype=dtype, seed=layer)
  pos = jnp.asarray([0, 20], jnp.int32)
  got = prefill_attention(q, k, v, jnp.int32(layer), pos, implementation="pallas_interpret")
  want = oracle(q, k, v, layer, np.asarray(pos))
  # a 16-bit cache: the probabilities meet V in its dtype (fp32 sums), so its bound
  rel = KERNEL_REL[jnp.dtype(dtype).name]
  assert_close(got, want, rel=rel, what=f"kernel {jnp.dtype(dtype).name}")
  assert_close(xla_form(q, k, v, layer, pos), want, rel=KERNEL_REL["float32"], what="xla form")


def test_blocks_give_one_answer():
  """Every query and key block size: the same numbers to fp32 rounding."""
  q, k, v = make(T=50, S=130, seed=3)
  pos = jnp.asarray([7, 64], jnp.int32)
  want = oracle(q, k, v, 1, np.asarray(pos))
  for bq, bk in [(16, 16), (32, 16), (64, 64), (16, 128)]:
    got = prefill_attention_pallas(q, k, v, jnp.int32(1), pos, block_q=bq, block_k=bk,
                                   interpret=True)
    assert_close(got, want, rel=KERNEL_REL["float32"], what=f"{bq}x{bk}")


def test_one_position_a_row():
  """T = 1 (a decode step where the decode kernel's form is not chosen): rows at the first, a
  middle and the last key of the cache."""
  q, k, v = make(B=3, T=1, S=40, seed=8)
  pos = jnp.asarray([0, 17, 39], jnp.int32)
  got = prefill_attention(q, k, v, jnp.int32(1), pos, implementation="pallas_interpret")
  assert_close(got, oracle(q, k, v, 1, np.asarray(pos)), rel=KERNEL_REL["float32"],
               what="one position")


def test_windows_and_positions_past_the_capacity():
  """kv_start windows (the MTP layer's cache: queries before the start see themselves only)
  and a row whose last queries lie past the capacity (they see every key, as the XLA form's
  mask does)."""
  q, k, v = make(T=30, S=70, seed=5)
  pos = jnp.asarray([10, 55], jnp.int32)          # row 1's positions run to 84 > 69
  start = jnp.asarray([25, 3], jnp.int32)         # row 0: queries 10..24 before its start
  got = prefill_attention(q, k, v, jnp.int32(0), pos, start, implementation="pallas_interpret")
  want = oracle(q, k, v, 0, np.asarray(pos), np.asarray(start))
  assert_close(got, want, rel=KERNEL_REL["float32"], what="window")
  assert_close(xla_form(q, k, v, 0, pos, start), want, rel=KERNEL_REL["float32"],
               what="window, xla form")


def test_keys_outside_the_chunks_range_are_never_read():
  """NaN keys and values before a row's first visible key and after its last query's position
  change nothing (the XLA form multiplies them by zero probabilities: NaN)."""
  q, k, v = make(T=20, S=90, seed=4)
  pos = jnp.asarray([30, 5], jnp.int32)
  start = jnp.asarray([12, 0], jnp.int32)
  got = prefill_attention(q, k, v, jnp.int32(1), pos, start, implementation="pallas_interpret")
  keys = jnp.arange(k.shape[2])[None, None, :, None, None]
  first = jnp.minimum(start, pos)[None, :, None, None, None]
  last = (pos + q.shape[1] - 1)[None, :, None, None, None]
  hide = (keys < first) | (keys > last)
  k_nan, v_nan = jnp.where(hide, jnp.nan, k), jnp.where(hide, jnp.nan, v)
  got_nan = prefill_attention(q, k_nan, v_nan, jnp.int32(1), pos, start,
                              implementation="pallas_interpret")
  np.testing.assert_array_equal(np.asarray(got), np.asarray(got_nan))
  assert np.isnan(np.asarray(xla_form(q, k_nan, v_nan, 1, pos, start))).any()


def test_tiling_choice_and_errors():
  t = tiling(16, 2, 256, 2500, BF16)
  assert (t.r, t.block_q, t.block_k, t.cd, t.precision) == (8, 128, 64, jnp.dtype(BF16), None)
  assert tiling(16, 2, 256, 5, BF16).block_q == 16            # a verify step's 5 positions
  f32 = tiling(16, 2, 256, 2500, F32)   # half the blocks: the H200's shared memory (run 68)
  assert (f32.block_q, f32.block_k, f32.precision) == (64, 32, jax.lax.Precision.HIGHEST)
  with pytest.raises(ValueError, match="block_k=8"):
    tiling(4, 2, 32, 64, F32, block_k=8)
  with pytest.raises(ValueError, match="head_dim=24"):
    tiling(4, 2, 24, 64, F32)
  q, k, v = make()
  with pytest.raises(ValueError, match="prefill attention"):
    prefill_attention_pallas(q[:, :, :3], k, v, 0, jnp.zeros((2,), jnp.int32), interpret=True)
  with pytest.raises(ValueError, match="unknown implementation"):
    prefill_attention(q, k, v, 0, jnp.zeros((2,), jnp.int32), implementation="cuda")
  assert resolve_prefill("auto", BF16, 256) == ("pallas" if ON_GPU else "xla")
  assert resolve_prefill("auto", BF16, 24) == "xla"      # a head size the kernel does not tile
  assert resolve_prefill("auto", F32, 256) == "xla"


def test_xla_form_is_the_models_attention_reference_bit_for_bit():
  """The "xla" choice is `attention_reference` on the layer's cache at the chunk's positions."""
  q, k, v = make(seed=6)
  pos = jnp.asarray([3, 17], jnp.int32)
  positions = pos[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
  np.testing.assert_array_equal(
      np.asarray(prefill_attention(q, k, v, jnp.int32(1), pos, implementation="xla")),
      np.asarray(attention_reference(q, k[1], v[1], positions)))


@pytest.mark.parametrize("windowed", [False, True], ids=["causal", "kv_start"])
def test_lowers_to_triton_for_the_gpu(windowed):
  """Cross-lowering on CPU at bench-a3b's attention (16 q-heads, 2 kv-heads of 256, bf16),
  with and without kv_start (the MTP layer's window): every construct has a Pallas Triton
  lowering rule (what the interpreter cannot tell)."""
  q, k, v = make(B=1, T=100, H=16, G=2, Hd=256, S=160, dtype=BF16)
  start = jnp.asarray([3], jnp.int32) if windowed else None
  f = lambda *a: prefill_attention_pallas(*a, jnp.int32(1), jnp.asarray([7], jnp.int32), start)
  text = jax.jit(f).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
  assert "triton" in text


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_gpu_bench_shapes(dtype):
  """bench-a3b's attention (16 q-heads, 2 kv-heads of 256): a 300-token chunk after a
  1,000-token prefix and one from position 0, compiled, with and without kv_start. bf16: the
  probabilities meet V in bf16."""
  q, k, v = make(B=2, T=300, H=16, G=2, Hd=256, S=1536, L=2, dtype=dtype, seed=7)
  pos = jnp.asarray([1000, 0], jnp.int32)
  rel = KERNEL_REL[jnp.dtype(dtype).name]
  for start in (None, jnp.asarray([900, 120], jnp.int32)):   # and the MTP layer's windows
    got = prefill_attention(q, k, v, jnp.int32(1), pos, start, implementation="pallas")
    want = oracle(q, k, v, 1, np.asarray(pos), None if start is None else np.asarray(start))
    assert_close(got, want, rel=rel, what=f"gpu {jnp.dtype(dtype).name} start {start}")
