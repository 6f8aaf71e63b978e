"""Backend choice for one decode step's attention: the entry point model code calls.

Implementations: "pallas" (the kernel compiled for the GPU), "pallas_interpret" (the same
kernel under the Pallas interpreter, CPU tests), "xla" (`decode_attention_reference`, the
model's own ops on the layer's cache). "auto": "pallas" on the GPU, "xla" elsewhere.

`decode_prologue` (the head norms, RoPE and the cache write of one position a row): "pallas" /
"pallas_interpret" run `prologue_kernel.attention_decode_prologue`, one launch; "xla" its
reference, the model's ops.

`prefill_attention` (several positions a row: a prefill chunk, a verify step): "pallas" /
"pallas_interpret" run `prefill_kernel.prefill_attention_pallas` (flash-style, no score
matrix); "xla" the model's einsums (`attention_reference`). "auto": "pallas" on the GPU for a
16-bit cache and a head size the kernel tiles, "xla" elsewhere.
"""
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import pow2
from pallas_kernels.attention.kernel import decode_attention_pallas
from pallas_kernels.attention.prefill_kernel import prefill_attention_pallas
from pallas_kernels.attention.prologue_kernel import attention_decode_prologue
from pallas_kernels.attention.reference import (  # noqa: F401 (the model's XLA form)
    attention_reference,
    decode_attention_reference,
    decode_prologue_reference,
)
from pallas_kernels.backend import check_choice, on_gpu, require_gpu

IMPLEMENTATIONS = ("pallas", "pallas_interpret", "xla")
CHOICES = (*IMPLEMENTATIONS, "auto")


def resolve(implementation=None):
  """The concrete implementation for this choice (None: "auto")."""
  impl = check_choice("decode attention", implementation or "auto", CHOICES)
  if impl == "auto":
    return "pallas" if on_gpu() else "xla"
  return impl


def decode_attention(q, k_stack, v_stack, layer, pos, kv_start=None, *, implementation=None):
  """out [B, H, Hd] fp32: q [B, H, Hd] against layer `layer` of the cache stacks
  [L, B, S, G, Hd], keys min(kv_start, pos)..pos of each row (`kernel.decode_attention_pallas`
  says the rest)."""
  impl = resolve(implementation)
  if impl == "xla":
    li = jnp.clip(jnp.asarray(layer, jnp.int32), 0, k_stack.shape[0] - 1)
    k = lax.dynamic_index_in_dim(k_stack, li, 0, keepdims=False)
    v = lax.dynamic_index_in_dim(v_stack, li, 0, keepdims=False)
    return decode_attention_reference(q, k, v, pos, kv_start)
  if impl == "pallas":
    require_gpu("decode attention", impl, "'pallas_interpret' or 'xla'")
  return decode_attention_pallas(q, k_stack, v_stack, layer, pos, kv_start,
                                 interpret=impl == "pallas_interpret")


def decode_prologue(qg, k, v, q_norm_w, k_norm_w, pos, valid, k_stack, v_stack, layer, *,
                    n_rot, rope_base, eps, implementation=None):
  """(q [B, H, Hd] normed and roped, k_stack, v_stack with layer `layer` written at each valid
  row's position): qg [B, H, 2 Hd] (q, then the gate, per head), k, v [B, G, Hd], the head
  norms' weights [Hd], pos / valid [B], the stacks [L, B, S, G, Hd]. Contract as
  `reference.decode_prologue_reference`."""
  impl = resolve(implementation)
  kw = dict(n_rot=n_rot, rope_base=rope_base, eps=eps)
  if impl == "xla":
    return decode_prologue_reference(qg, k, v, q_norm_w, k_norm_w, pos, valid, k_stack,
                                     v_stack, layer, **kw)
  if impl == "pallas":
    require_gpu("attention prologue", impl, "'pallas_interpret' or 'xla'")
  return attention_decode_prologue(qg, k, v, q_norm_w, k_norm_w, pos, valid, k_stack, v_stack,
                                   layer, interpret=impl == "pallas_interpret", **kw)


def resolve_prefill(implementation, dtype, head_dim):
  """The concrete prefill implementation for this choice, cache dtype and head size."""
  impl = check_choice("prefill attention", implementation or "auto", CHOICES)
  if impl == "auto":
    tiles = head_dim >= 16 and pow2(head_dim)
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "pallas" if on_gpu() and half and tiles else "xla"
  return impl


def prefill_attention(q, k_stack, v_stack, layer, pos, kv_start=None, *, implementation=None):
  """out [B, T, H, Hd] fp32: q [B, T, H, Hd] at positions pos[b] + t against layer `layer` of
  the cache stacks [L, B, S, G, Hd] (already holding the chunk's keys), keys
  min(kv_start, position)..position of each query; `reference.attention_reference`'s
  contract."""
  impl = resolve_prefill(implementation, k_stack.dtype, q.shape[-1])
  if impl == "xla":
    li = jnp.clip(jnp.asarray(layer, jnp.int32), 0, k_stack.shape[0] - 1)
    k = lax.dynamic_index_in_dim(k_stack, li, 0, keepdims=False)
    v = lax.dynamic_index_in_dim(v_stack, li, 0, keepdims=False)
    positions = pos[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
    return attention_reference(q, k, v, positions, kv_start)
  if impl == "pallas":
    require_gpu("prefill attention", impl, "'pallas_interpret' or 'xla'")
  return prefill_attention_pallas(q, k_stack, v_stack, layer, pos, kv_start,
                                  interpret=impl == "pallas_interpret")
