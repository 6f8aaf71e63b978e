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

from pallas_kernels.quant.layout import BLOCK, TYPE_SIZE, QTensor


def _f16(b):
  """[..., 2] uint8 -> [...] float16 (little-endian bytes, as GGUF stores them)."""
  return lax.bitcast_convert_type(b, jnp.float16)


def _i8(b):
  return lax.bitcast_convert_type(b, jnp.int8)


def _pair_nibbles(a, b):
  return jnp.stack([(a & 15) | (b << 4), (a >> 4) | (b & 0xF0)], axis=-2)


def _k_scales(s):
  s = s.reshape(*s.shape[:-1], 3, 4)
  d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
  sc = jnp.concatenate([d & 63, (md & 15) | ((d >> 2) & 0x30)], axis=-1)
  mn = jnp.concatenate([m & 63, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
  return sc, mn


@functools.partial(jax.jit, static_argnames=("qtype", "shape"))
def pack(raw, qtype: str, shape: tuple[int, ...]) -> QTensor:
  """raw: uint8 device array of the tensor's block bytes (any shape of the right size)."""
  rows, n_in = shape[:-1], shape[-1]
  nb = n_in // BLOCK[qtype]
  blocks = raw.reshape(*rows, nb, TYPE_SIZE[qtype])
  if qtype == "q8_0":
    return QTensor(qs=_i8(blocks[..., 2:]).reshape(*rows, n_in), d=_f16(blocks[..., 0:2]),
                   qtype=qtype, shape=shape)
  if qtype in ("q4_k", "q5_k"):
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc, mn = _k_scales(blocks[..., 4:16])
    qh = None
    if qtype == "q5_k":
      qh, ql = blocks[..., 16:48], blocks[..., 48:176]
    else:
      ql = blocks[..., 16:144]
    ql = ql.reshape(*rows, nb, 2, 2, 32)
    qs = _pair_nibbles(ql[..., 0, :, :], ql[..., 1, :, :])
    return QTensor(qs=qs.reshape(*rows, n_in // 2),
                   qh=None if qh is None else qh.reshape(*rows, n_in // 8),
                   sc=sc.reshape(*rows, nb * 8), mn=mn.reshape(*rows, nb * 8), d=d, dmin=dmin,
                   qtype=qtype, shape=shape)
  ql = blocks[..., 0:128].reshape(*rows, nb, 2, 64)
  qs = _pair_nibbles(ql[..., 0, :], ql[..., 1, :])
  return QTensor(qs=qs.reshape(*rows, n_in // 2), qh=blocks[..., 128:192].reshape(*rows, n_in // 4),
                 sc=_i8(blocks[..., 192:208]).reshape(*rows, nb * 16),
                 d=_f16(blocks[..., 208:210]), qtype=qtype, shape=shape)
