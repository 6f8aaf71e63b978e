"""Tolerances, once, keyed by dtype. Never loosened in the change that makes a test pass."""
import jax
import numpy as np

from strata_jax.testing import PARITY_LOGITS_ABS_FP32

# Relative error bound (max |got - want| / max |want|) for kernels against float64 math.
KERNEL_REL = {"float32": 1e-6, "float16": 2e-3, "bfloat16": 1.6e-2}
# Model logits against transformers in fp32 (max abs error). The library states this bound
# (strata_jax.testing), so that the parity notebook checks the same number.
MODEL_LOGITS_ABS_FP32 = PARITY_LOGITS_ABS_FP32
# Chunked vs recurrent delta rule (fp32 references).
DELTA_RULE_FP32 = 1e-5


def assert_close(got, want, *, rel=None, abs_=None, what=""):
  """Assert closeness; the message reports max-abs and relative RMS error."""
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
  err = np.abs(got - want)
  max_abs = float(err.max()) if err.size else 0.0
  scale = float(np.abs(want).max()) if want.size else 0.0
  rms = lambda a: float(np.sqrt((a ** 2).mean())) if a.size else 0.0
  rel_rms = rms(err) / (rms(want) + 1e-30)
  max_rel = max_abs / (scale + 1e-30)
  msg = f"{what}: max_abs={max_abs:.3e} rel_rms={rel_rms:.3e} max_rel={max_rel:.3e}"
  if abs_ is not None:
    assert max_abs <= abs_, msg + f" > abs {abs_:g}"
  if rel is not None:
    assert max_abs <= rel * scale, msg + f" > rel {rel:g}"
  return max_abs


def assert_state_close(got, want, *, rel, what="state"):
  """A model state against another: positions equal; conv, recurrent state and each row's
  K/V up to its length within `rel` (assert_close's max abs over max |want|)."""
  np.testing.assert_array_equal(np.asarray(got.pos), np.asarray(want.pos), err_msg=what)
  for name in ("conv", "ssm"):
    assert_close(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), rel=rel,
                 what=f"{what} {name}")
  for b, n in enumerate(np.asarray(want.pos)):
    for name in ("k", "v"):
      assert_close(np.asarray(getattr(got, name))[:, b, :n],
                   np.asarray(getattr(want, name))[:, b, :n], rel=rel,
                   what=f"{what} {name} row {b}")


# Quantised weights kept on the device (dequantised in the matmul) against the same file
# dequantised at load, fp32 logits (max abs error; issue 15).
QUANT_KEEP_LOGITS_ABS_FP32 = 1e-5
# Speculative verification against one-by-one decoding, fp32 state and the logits each token
# was chosen from (max abs over max |want|):
# the verification runs T positions per row, and XLA's CPU kernels for another row count round
# some sums differently (the tokens stay bit-identical; tests/test_speculative.py).
SPEC_STATE_REL_FP32 = 1e-5
# Prompt logits when a prefill chunk's shape changes (the same tokens in another bucket, or
# joined to the chunk before), fp32, max abs over max |want|: as above, XLA's CPU kernels for
# another row count round some sums differently (tests/test_engine.py: padding only the last
# chunk to 128 rows instead of 32 moves the tiny model's logits by up to 6.3e-6). It was 1e-5
# until an Intel Xeon host gave 1.013e-5 on the unchanged code (ab70104, the GDN conv state in
# tests/test_engine.py::test_one_pass_prefill_caches_every_state_point_as_the_chunked_schedule_does,
# 2026-12-06) and 1.205e-5 in its prompt logits once the GDN gated norm moved into the chunked
# op (each prefill call's rows normed, then the windows joined: other fusions, other roundings).
CHUNK_SHAPE_REL_FP32 = 2e-5
# One request's decode logprobs when the engine decodes it in batches of another row count
# (its decode buckets against all slots), fp32, max abs over max |want|: the same rounding as
# above. It had the kernel bound (1e-6) until an AMD EPYC host gave 1.9e-6 on the unchanged
# code (tests/test_engine_sampling.py::test_decode_buckets_match_the_full_batch, 2026-12-03).
ROW_COUNT_REL_FP32 = CHUNK_SHAPE_REL_FP32
# Dense projections by the in-place GEMV kernel (fp32 sums in another order) against XLA's dot,
# fp32 logits, max abs over max |want| (Forms.dense_weights="kernel"; tests/test_forms.py).
DENSE_GEMV_REL_FP32 = 1e-5
# One decode step's attention by the kernel (an online softmax over splits of the cache)
# against the model's XLA einsums, fp32 logits, max abs over max |want|
# (Forms.attn_decode; tests/test_forms.py).
ATTN_DECODE_REL_FP32 = 1e-5
# A prefill chunk's attention by the flash-style kernel (an online softmax over key blocks)
# against the model's XLA einsums, fp32 logits, max abs over max |want|
# (Forms.attn_prefill; tests/test_forms.py).
ATTN_PREFILL_REL_FP32 = 1e-5
# A prefill's GDN gated norm in the chunked op's output launch against the norm after the op,
# fp32 logits, max abs over max |want|: the kernel's sum of squares and rsqrt round their own
# way (tests/test_forms.py).
GATED_NORM_REL_FP32 = 1e-5
# A GDN layer's decode core in one kernel (Forms.gdn_decode="pallas_layer"): the gated norm's
# sum of squares runs in Dv tiles, where XLA reduces the row its own way; fp32 logits after
# three decode steps, max abs over max |want| (tests/test_gdn_decode_layer_kernel.py measured
# 3.6e-6 on the tiny model).
GDN_LAYER_REL_FP32 = 1e-5

# Bit-for-bit claims between two interpreted Pallas programs hold on CPU, the interpreter's home.
# XLA:GPU compiles the interpreter's body and rounds its ops its own way (runs 36, 41, 42), so
# there such cases are held to the inputs' dtype rounding; compiled `gpu` cases keep their bits.
INTERP_BITS = jax.default_backend() == "cpu"
