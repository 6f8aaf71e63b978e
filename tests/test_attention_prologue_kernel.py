"""Attention decode prologue kernel (the q / k head norms, RoPE and the cache write in one
launch): parity with `reference.decode_prologue_reference`, which is the model's own ops.

CPU runs the kernel under the Pallas interpreter and cross-lowers it to Triton for cuda; the
`gpu` tests run it compiled (JAX_PLATFORMS=cuda on the device)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_fixtures import decode_under_forms, random_lora
from tolerances import ATTN_DECODE_REL_FP32, INTERP_BITS, KERNEL_REL, assert_close

from pallas_kernels.attention import api
from pallas_kernels.attention.prologue_kernel import attention_decode_prologue, pow2_pieces
from pallas_kernels.attention.reference import decode_prologue_reference

ON_GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU backend")
F32, BF16 = jnp.float32, jnp.bfloat16

# (B, H, G, Hd, n_rot, S): the tiny model's (4 / 2 heads of 16, 8 rotated); every dim rotated;
# a quarter rotated (bench-a3b's 64 of 256: the rest in two pieces); one kv head for 4.
SHAPES = [(3, 4, 2, 16, 8, 8), (2, 2, 2, 32, 32, 16), (3, 4, 1, 32, 8, 8)]


def _id(s):
  return "B{}-H{}-G{}-Hd{}-rot{}-S{}".format(*s)


def make_inputs(b, h, g, hd, n_rot, seq, *, dtype, layers=2, seed=0):
  """(qg, k, v, q_norm_w, k_norm_w, pos, valid, k_cache, v_cache): row 1 invalid, the last
  row's position past the cache (dropped)."""
  rng = np.random.default_rng(seed)
  n = lambda *s: rng.standard_normal(s).astype(np.float32)
  pos = np.minimum(np.arange(b) * 3 + 2, seq - 1)
  pos[-1] = seq
  valid = np.arange(b) != 1
  return (jnp.asarray(n(b, h, 2 * hd), dtype), jnp.asarray(n(b, g, hd), dtype),
          jnp.asarray(n(b, g, hd), dtype), jnp.asarray(1 + 0.1 * n(hd), dtype),
          jnp.asarray(1 + 0.1 * n(hd), dtype), jnp.asarray(pos, jnp.int32), jnp.asarray(valid),
          jnp.asarray(n(layers, b, seq, g, hd), dtype),
          jnp.asarray(n(layers, b, seq, g, hd), dtype))


def test_pow2_pieces_cover_a_range_in_powers_of_two():
  assert pow2_pieces(64, 192) == [(64, 128), (192, 64)]
  assert pow2_pieces(0, 7) == [(0, 4), (4, 2), (6, 1)]
  assert pow2_pieces(8, 0) == []


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[_id(s) for s in SHAPES])
def test_prologue_kernel_gives_the_models_q_and_cache_writes(shape, dtype):
  """q to the dtype's rounding (the norm's sum and cos / sin round in their own order), the
  caches: bit for bit in bf16 (on CPU), to fp32 rounding in fp32; an invalid row, a position
  past the cache and the other layers are not written."""
  args = make_inputs(*shape, dtype=dtype, seed=sum(shape))
  kw = dict(n_rot=shape[4], rope_base=1e4, eps=1e-6)
  q, kc, vc = attention_decode_prologue(*args, jnp.int32(1), interpret=True, **kw)
  want_q, want_kc, want_vc = decode_prologue_reference(*args, jnp.int32(1), **kw)
  assert q.dtype == dtype and q.shape == want_q.shape
  assert_close(q, want_q, rel=KERNEL_REL[jnp.dtype(dtype).name], what="q")
  assert np.array_equal(np.asarray(vc), np.asarray(want_vc))
  if dtype == BF16 and INTERP_BITS:
    assert np.array_equal(np.asarray(kc), np.asarray(want_kc))
  assert_close(kc, want_kc, rel=KERNEL_REL[jnp.dtype(dtype).name], what="k cache")
  kc0 = np.asarray(args[7])
  kc, valid = np.asarray(kc), np.asarray(args[6])
  assert np.array_equal(kc[0], kc0[0])                          # other layer untouched
  assert np.array_equal(kc[1, ~valid], kc0[1, ~valid])          # invalid row
  assert np.array_equal(kc[1, -1], kc0[1, -1])                  # position past the cache


def test_decode_prologue_dispatch():
  args = make_inputs(*SHAPES[0], dtype=F32, seed=4)
  kw = dict(n_rot=8, rope_base=1e4, eps=1e-6)
  ref = api.decode_prologue(*args, jnp.int32(0), implementation="xla", **kw)
  want = decode_prologue_reference(*args, jnp.int32(0), **kw)
  for a, b in zip(ref, want):
    assert np.array_equal(np.asarray(a), np.asarray(b))
  got = api.decode_prologue(*args, jnp.int32(0), implementation="pallas_interpret", **kw)
  assert_close(got[0], want[0], rel=KERNEL_REL["float32"], what="q")
  if not ON_GPU:
    with pytest.raises(ValueError, match="needs a GPU backend"):
      api.decode_prologue(*args, jnp.int32(0), implementation="pallas", **kw)


def test_prologue_kernel_refuses_mismatched_shapes():
  args = list(make_inputs(*SHAPES[0], dtype=F32))
  kw = dict(n_rot=8, rope_base=1e4, eps=1e-6, interpret=True)
  with pytest.raises(ValueError, match="k .* must be"):
    attention_decode_prologue(args[0], args[1][:, :1, :8], *args[2:], jnp.int32(0), **kw)
  with pytest.raises(ValueError, match="one \\[L, B, S, G, Hd\\] stack shape"):
    attention_decode_prologue(*args[:7], args[7], args[8][:1], jnp.int32(0), **kw)
  with pytest.raises(ValueError, match="powers of 2"):
    attention_decode_prologue(*args, jnp.int32(0), **{**kw, "n_rot": 12})


@pytest.mark.parametrize("batch", [1, 32])
def test_prologue_kernel_lowers_to_triton_for_the_gpu(batch):
  """bench-a3b's attention layer (16 query heads, 2 kv heads of 256, 64 rotated dims, 12
  layers of 512 positions) cross-lowers to Triton for cuda on this machine."""
  h, g, hd, seq, layers = 16, 2, 256, 512, 12
  sds = jax.ShapeDtypeStruct
  shapes = (sds((batch, h, 2 * hd), BF16), sds((batch, g, hd), BF16), sds((batch, g, hd), BF16),
            sds((hd,), BF16), sds((hd,), BF16), sds((batch,), jnp.int32),
            sds((batch,), jnp.int32), sds((layers, batch, seq, g, hd), BF16),
            sds((layers, batch, seq, g, hd), BF16), sds((), jnp.int32))
  f = jax.jit(lambda *a: attention_decode_prologue(*a, n_rot=64, rope_base=1e7, eps=1e-6))
  text = f.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
  assert "xla.gpu.triton" in text and "attn_decode_prologue" in text


def test_model_decode_under_the_prologue_kernel_gives_the_kernel_forms_logits():
  """`Forms.attn_decode="pallas_prologue_interpret"`: the decode kernel's form's logits
  (`attn_decode="pallas_interpret"`, the model's XLA prologue) to fp32 rounding, its greedy
  tokens and its K / V caches, with the adapter on in one row and off in the other."""
  lora = random_lora().params
  got, states = decode_under_forms(lora, prompt_seed=2, attn_decode="pallas_prologue_interpret")
  want, want_states = decode_under_forms(lora, prompt_seed=2, attn_decode="pallas_interpret")
  assert_close(got, want, rel=ATTN_DECODE_REL_FP32, what="logits")
  assert np.array_equal(got.argmax(-1), want.argmax(-1))
  assert_close(states[-1].k, want_states[-1].k, rel=KERNEL_REL["float32"], what="k cache")
  assert np.array_equal(states[-1].v, want_states[-1].v)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_gpu_prologue_kernel_at_bench_shapes(batch):
  """Compiled at bench-a3b's attention layer, bf16: q and the caches against the reference."""
  shape = (batch, 16, 2, 256, 64, 512)
  args = make_inputs(*shape, dtype=BF16, seed=batch)
  kw = dict(n_rot=64, rope_base=1e7, eps=1e-6)
  q, kc, vc = jax.jit(lambda *a: attention_decode_prologue(*a, **kw))(*args, jnp.int32(1))
  want_q, want_kc, want_vc = decode_prologue_reference(*args, jnp.int32(1), **kw)
  assert_close(q, want_q, rel=KERNEL_REL["bfloat16"], what="q")
  assert_close(kc, want_kc, rel=KERNEL_REL["bfloat16"], what="k cache")
  assert np.array_equal(np.asarray(vc), np.asarray(want_vc))
