"""What every kernel file shares: the Triton lowering's import, its compiler parameters across
JAX versions, the power-of-two tile check, the masked load, the split GEMVs' partial sums in
their one order (outside a kernel and inside one), the compensated fp32 sum of tile
products, and the stable sort of small ids by a narrow key.

Every kernel here lowers through Pallas's Triton backend (`jax.experimental.pallas.triton`),
deprecated in JAX 0.11; each kernel's README says why it still uses it. Without it (a future
JAX) the kernels run only in interpret mode, and the compiled path says so.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # Deprecated in JAX 0.11; the kernels' READMEs say why they use it.
  from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - a future JAX without the Triton backend
  pltriton = None

# A squeezed block dimension: `pl.squeezed` since JAX 0.10, `None` before.
SQUEEZED = getattr(pl, "squeezed", None)


def pow2(v: int) -> bool:
  """Whether `v` is a power of two (Triton tiles are)."""
  return v >= 1 and not v & (v - 1)


def triton_params(num_warps: int, num_stages: int):
  """Compiler parameters of the Triton lowering."""
  # `CompilerParams` since JAX 0.6; the older name is kept for the odd older install.
  cls = getattr(pltriton, "CompilerParams", None) or pltriton.TritonCompilerParams
  return cls(num_warps=num_warps, num_stages=num_stages)


def require_triton(interpret: bool, op: str, instead: str):
  """The compiled path needs the Triton backend; without it, name the implementation to use."""
  if not interpret and pltriton is None:
    raise RuntimeError(f"{op}: this JAX has no Pallas Triton backend; use {instead}")


def sum_partials(parts):
  """parts [ks, ...] fp32 -> their sum, added in index order (p0 + p1 + ...): the split GEMVs'
  order (the LoRA finishing kernel, the routing kernel and the GDN layer kernel add them in it
  too, so their results are this sum's bits)."""
  total = parts[0]
  for k in range(1, parts.shape[0]):
    total = total + parts[k]
  return total


# Sort small ids by the narrowest unsigned key that holds them (`argsort_ids`). A GPU radix
# sort makes one pass per key byte: an expert id below 256 sorts in one pass instead of an
# int32's four (bench-a3b's 2,500-token prefill ran 192 sort passes, 1.47 ms, on the H100:
# experiments/results/device/run74). False: the int32 key (decode_probe's "sort32").
NARROW_SORT_KEYS = True


def argsort_ids(ids, bound: int):
  """Stable argsort of int ids in [0, bound) as int32: `jnp.argsort(ids, stable=True)`'s
  order exactly (a stable sort of equal keys keeps index order; the narrower key holds every
  id unchanged)."""
  key = ids
  if NARROW_SORT_KEYS and bound <= 1 << 8:
    key = ids.astype(jnp.uint8)
  elif NARROW_SORT_KEYS and bound <= 1 << 16:
    key = ids.astype(jnp.uint16)
  return jnp.argsort(key, stable=True).astype(jnp.int32)


def masked_load(view, mask):
  """Load a ref view; where `mask` (None: everywhere) is false, 0."""
  if mask is None:
    return view[...]
  zero = jnp.zeros((), view.dtype)
  if pltriton is None:  # pragma: no cover - interpret-only fallback: the interpreter pads
    return jnp.where(mask, view[...], zero)
  return pltriton.load(view, mask=mask, other=zero)


def masked_store(view, val, mask):
  """Store val into a ref view where `mask` (None: everywhere) holds; elsewhere unchanged."""
  if mask is None:
    view[...] = val
  elif pltriton is None:  # pragma: no cover - interpret-only fallback
    view[...] = jnp.where(mask, val, view[...])
  else:
    pltriton.store(view, val, mask=mask)


def sum_ref_partials(ref, n_parts, *ix, mask=None):
  """In a kernel: ref[s, *ix] for s < n_parts, in fp32, added in index order (`sum_partials`'
  order, so a consumer kernel's sum of a GEMV's split partials is XLA's bit for bit); with
  `mask`, each a `masked_load` (0 where it is false)."""
  def load(s):   # static indices as int32 (the interpreter's indexers)
    if mask is None:
      return ref[(jnp.int32(s), *ix)].astype(jnp.float32)
    return masked_load(ref.at[(jnp.int32(s), *ix)], mask).astype(jnp.float32)

  total = load(0)
  for s in range(1, n_parts):
    total = total + load(s)
  return total


def compensated_add(total, comp, part):
  """One step of Kahan summation: (total + part, its new compensation). fp32 kernels sum their
  tiles' partial products with it, so a long reduction (64 Q6_K tiles, 128 LoRA Din tiles)
  keeps about the per-tile dot's error; plain running sums erred by 1.0-1.3e-6 of the output's
  scale on the H200 (gpu_tests_run7/8_failures.txt)."""
  y = part - comp
  new = total + y
  return new, (new - total) - y
