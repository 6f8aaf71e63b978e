"""Backend choice for the LoRA delta: the one entry point model code calls.

Implementations (all share one contract, tested by one parametrized suite):
  "pallas"            the Pallas kernel compiled for the GPU (Triton lowering; README).
  "pallas_interpret"  the same kernel under the Pallas interpreter (CPU tests).
  "mosaic"            the Mosaic GPU port (kernel_mosaic.py: Hopper, bf16 x/a/b; README).
  "xla"               plain jnp with the kernel's numerics (native 16-bit x @ A^T, fp32
                      accumulation, fp32 h @ B^T) and the same select.

And "auto", which picks one of them per call from the backend and the row count N (static
under jit, so still one program per shape): on GPU "xla" below `AUTO_KERNEL_MIN_ROWS` rows,
where this launch-bound op is cheaper as XLA fusions, and from there on "mosaic" where its
operands suit it (bf16, sizes multiples of 64; it was the fastest from 512 rows on both shapes
timed on the H200), else "pallas" (README, measured numbers).

Default "auto"; the caller's config (`strata_jax.forms.Forms.lora_impl`) names the choice.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.backend import check_choice, on_gpu, require_gpu
from pallas_kernels.lora.kernel import check_lora_inputs, dot_policy, lora_pallas
from pallas_kernels.lora.kernel_mosaic import (  # "mosaic": Hopper, bf16 (README)
  lora_mosaic,
  mosaic_supported,
)

IMPLEMENTATIONS = ("pallas", "pallas_interpret", "xla", "mosaic")
CHOICES = (*IMPLEMENTATIONS, "auto")
# H200, rank 64, 4096 <-> 2048: XLA wins at N <= 32, Mosaic from 512 (lora_backend_probe run 2)
AUTO_KERNEL_MIN_ROWS = 512
_NT = (((1,), (1,)), ((), ()))


def resolve(implementation, n_rows):
  """The concrete implementation `lora_apply` runs for this choice and row count ("auto":
  on the GPU "xla" below `AUTO_KERNEL_MIN_ROWS` rows and "kernel" from there, which
  `lora_apply` makes "mosaic" or "pallas" from the operands; elsewhere "xla", the interpreter
  being for tests)."""
  impl = check_choice("lora", implementation or "auto", CHOICES)
  if impl == "auto":
    return ("kernel" if n_rows >= AUTO_KERNEL_MIN_ROWS else "xla") if on_gpu() else "xla"
  return impl


@functools.partial(jax.jit, static_argnames=("scale",))
def lora_xla(base, x, a, b, on, rank_scale=None, *, scale=1.0):
  """XLA version of `lora_pallas`: same arguments, select and fp32 accumulation.

  x @ A^T follows the kernel's `dot_policy`; h @ B^T runs in fp32 at HIGHEST (the kernel
  splits h into bf16 hi + lo when B is bf16; the two agree to ~1e-5 relative).
  """
  check_lora_inputs(base, x, a, b, on, rank_scale)
  f32 = jnp.float32
  cd, precision = dot_policy(x.dtype, a.dtype)
  h = lax.dot_general(x.astype(cd), a.astype(cd), _NT, precision=precision,
                      preferred_element_type=f32)  # [N, R]
  if rank_scale is not None:
    h = h * rank_scale.astype(f32)  # per row, per rank column: the adapter table's choice
  delta = lax.dot_general(h, b.astype(f32), _NT, precision=lax.Precision.HIGHEST,
                          preferred_element_type=f32)  # [N, Dout]
  if scale != 1.0:
    delta = delta * scale
  y = (base.astype(f32) + delta).astype(base.dtype)
  return jnp.where((on != 0)[:, None], y, base)


def lora_apply(base, x, a, b, on, *, rank_scale=None, scale=1.0, implementation=None):
  """y = where(on != 0, base + scale * (s * (x @ a^T)) @ b^T, base) by the chosen
  implementation.

  Args:
    base: [N, Dout] float32/float16/bfloat16 (the output dtype).
    x: [N, Din] float activations.
    a: [R, Din] stacked LoRA A (ranks of several files concatenated).
    b: [Dout, R] stacked LoRA B with each file's scale folded in.
    on: [N] int32 per-row switch; an off row returns base bit for bit.
    rank_scale: [N, R] float32 per-row scale s of each rank column, or None (all ones). With
      several adapters stacked on R, a row picks its adapters and their scales through it
      (punica/BGMV-style; README "Several adapters per batch"). "mosaic" does not take it
      ("auto" then picks "pallas").
    scale: static extra factor (model code passes 1.0).
    implementation: one of CHOICES (None: "auto").

  Returns:
    [N, Dout] in base.dtype.
  """
  impl = resolve(implementation, x.shape[0])
  rs = rank_scale
  if impl == "kernel":
    impl = "mosaic" if rs is None and mosaic_supported(base, x, a, b) is None else "pallas"
  if impl == "pallas":
    require_gpu("lora", impl, "'pallas_interpret' or 'xla'")
    return lora_pallas(base, x, a, b, on, rs, scale=scale)
  if impl == "mosaic":  # Mosaic GPU kernel; ValueError where `mosaic_supported` says no
    if rs is not None:
      raise ValueError("lora: the 'mosaic' kernel takes no rank_scale; use 'pallas' or 'xla'")
    return lora_mosaic(base, x, a, b, on, scale=scale)
  if impl == "pallas_interpret":
    return lora_pallas(base, x, a, b, on, rs, scale=scale, interpret=True)
  return lora_xla(base, x, a, b, on, rs, scale=scale)
