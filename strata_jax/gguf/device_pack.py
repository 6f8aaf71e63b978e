"""`pallas_kernels.quant.layout.pack` on the device: the same planes, computed by XLA.

The loader sends a tensor's raw GGUF block bytes to its device as they are (one host-to-device
copy of the file's bytes) and repacks them there: numpy's repacking runs at ~0.1 GiB/s on the
host, far too slow for a 45 GB file, while the device does it at memory speed. The result is
bit-identical to `layout.pack` (tests/test_streaming_load.py checks every type).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.quant.layout import BLOCK, TYPE_SIZE, QTensor, planes


def _f16(b):
  """[..., 2] uint8 -> [...] float16 (little-endian bytes, as GGUF stores them)."""
  return lax.bitcast_convert_type(b, jnp.float16)


def _i8(b):
  return lax.bitcast_convert_type(b, jnp.int8)


@functools.partial(jax.jit, static_argnames=("qtype", "shape"))
def pack(raw, qtype: str, shape: tuple[int, ...]) -> QTensor:
  """raw: uint8 device array of the tensor's block bytes (any shape of the right size)."""
  blocks = raw.reshape(*shape[:-1], shape[-1] // BLOCK[qtype], TYPE_SIZE[qtype])
  return planes(blocks, qtype, shape, xp=jnp, f16=_f16, i8=_i8)
