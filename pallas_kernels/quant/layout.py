"""Repacked, kernel-friendly layout of GGUF Q8_0 / Q4_K / Q5_K / Q6_K weights on the device.

A `QTensor` holds one weight of logical numpy shape [*lead, out, in] (lead: layer and/or expert
stack dims) as a few planes, each [*lead, out, in / per_byte]: the quant values along the `in`
axis and one scale per block or sub-block. Every plane is row-major along `in`, so a kernel
tile of rows [o0, o0 + bo) and one block's columns is a 2-D strided load of each plane.

Planes per type (per 256-weight super-block unless Q8_0; bytes per weight vs the file's in
the README):

  q8_0  qs int8  [.., in]        the 32 int8 values of each 32-block, in order
        d  f16   [.., in/32]     block scale                       34 B / 32 w = the file's
  q4_k  qs uint8 [.., in/2]      byte j of a block = q[j] | q[j + 128] << 4  (j < 128)
        sc uint8 [.., in/32]     6-bit sub-block scales, unpacked from the 12 scale bytes
        mn uint8 [.., in/32]     6-bit sub-block mins, unpacked
        d, dmin f16 [.., in/256] super-block scale and min scale   148 B vs 144 (1.028x)
  q5_k  qs, sc, mn, d, dmin as q4_k (low 4 bits of the 5-bit values)
        qh uint8 [.., in/8]      the file's high-bit bytes: bit i of byte l is the high bit
                                 of weight 32 i + l                 180 B vs 176 (1.023x)
  q6_k  qs uint8 [.., in/2]      byte j = (q[j] & 15) | (q[j + 128] & 15) << 4
        qh uint8 [.., in/4]      the file's 2-bit bytes: bits 2i..2i+1 of byte 32 h + l are
                                 the top bits of weight 128 h + 32 i + l
        sc int8  [.., in/16]     sub-block scales
        d  f16   [.., in/256]                                       210 B = the file's

The 4-bit planes pair weight j with weight j + 128 of the same block, so a kernel unpacks one
[bo, 128]-byte tile into the block's two contiguous 128-column halves (`& 15` and `>> 4`) and
multiplies each with a contiguous slice of x: no interleaving shuffles on chip. The high-bit
planes are kept as the file stores them, because that layout already gives each half its bits
from one [bo, 32]-byte tile (shifts by 0..3 or 4..7). Scales stay integers (uint8 / int8) with
f16 super-block factors: pre-multiplied f16 sub-block scales would cost 1.11x for Q4_K.
"""
import math
from typing import Any

import numpy as np
from flax import struct

QUANT_TYPES = ("q8_0", "q4_k", "q5_k", "q6_k")
BLOCK = {"q8_0": 32, "q4_k": 256, "q5_k": 256, "q6_k": 256}
TYPE_SIZE = {"q8_0": 34, "q4_k": 144, "q5_k": 176, "q6_k": 210}  # file bytes per block
PLANES = {  # array fields each type uses, in a fixed order
    "q8_0": ("qs", "d"),
    "q4_k": ("qs", "sc", "mn", "d", "dmin"),
    "q5_k": ("qs", "qh", "sc", "mn", "d", "dmin"),
    "q6_k": ("qs", "qh", "sc", "d"),
}
# Plane columns per `in` column (a plane of a row has in * ratio entries).
PLANE_RATIO = {
    "q8_0": {"qs": 1, "d": 1 / 32},
    "q4_k": {"qs": 1 / 2, "sc": 1 / 32, "mn": 1 / 32, "d": 1 / 256, "dmin": 1 / 256},
    "q5_k": {"qs": 1 / 2, "qh": 1 / 8, "sc": 1 / 32, "mn": 1 / 32, "d": 1 / 256,
             "dmin": 1 / 256},
    "q6_k": {"qs": 1 / 2, "qh": 1 / 4, "sc": 1 / 16, "d": 1 / 256},
}


class QuantLayoutError(ValueError):
  """Raw GGUF block bytes that do not describe the requested quantised tensor."""


@struct.dataclass
class QTensor:
  """One (possibly layer- / expert-stacked) quantised weight in the repacked layout.

  Array fields are the planes described in this module's docstring; those a type does not use
  are None. Every plane has the leading stack dims of `shape` and then `out`.
  """
  qs: Any
  d: Any
  qh: Any = None
  sc: Any = None
  mn: Any = None
  dmin: Any = None
  qtype: str = struct.field(pytree_node=False, default="q8_0")
  shape: tuple = struct.field(pytree_node=False, default=())

  @property
  def ndim(self):
    return len(self.shape)

  @property
  def planes(self):
    """{name: array} of the planes this type uses."""
    return {name: getattr(self, name) for name in PLANES[self.qtype]}

  @property
  def nbytes(self):
    """Bytes of all planes (on the device once the planes are device arrays)."""
    return int(sum(int(np.prod(p.shape)) * np.dtype(p.dtype).itemsize
                   for p in self.planes.values()))

  @property
  def lead(self):
    """Leading stack dims of the logical shape (() for a single matrix)."""
    return tuple(self.shape[:-2])

  @property
  def num_matrices(self):
    return math.prod(self.lead)


def file_nbytes(qtype, shape):
  """Bytes the GGUF file stores for a tensor of this type and logical numpy shape."""
  _check_qtype(qtype)
  shape = tuple(int(s) for s in shape)
  if not shape or shape[-1] % BLOCK[qtype]:
    raise QuantLayoutError(f"{qtype}: row length {shape[-1] if shape else None} is not a "
                           f"multiple of the block size {BLOCK[qtype]}")
  return math.prod(shape[:-1]) * (shape[-1] // BLOCK[qtype]) * TYPE_SIZE[qtype]


def _check_qtype(qtype):
  if qtype not in QUANT_TYPES:
    raise QuantLayoutError(f"quant type {qtype!r} has no kernel layout; expected one of "
                           f"{QUANT_TYPES}")


def _f16(b):
  """[..., 2] uint8 -> [...] float16 (little-endian, as GGUF stores it)."""
  return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _i8(b):
  return b.view(np.int8)


def _pair_nibbles(a, b, xp=np):
  """Low/high nibble pairs: a holds weights [0, w) and [w, 2w) of one half as low/high
  nibbles, b the same for the other half. Returns bytes whose low nibble is the first half's
  weight and high nibble the second half's, for weights 0..2w-1: shape [..., 2, w]."""
  return xp.stack([(a & 15) | (b << 4), (a >> 4) | (b & 0xF0)], axis=-2)


def _k_scales(s, xp=np):
  """The 12 packed scale bytes of a Q4_K / Q5_K block -> (sc, mn), each [..., 8] uint8."""
  s = s.reshape(*s.shape[:-1], 3, 4)
  d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
  sc = xp.concatenate([d & 63, (md & 15) | ((d >> 2) & 0x30)], axis=-1)
  mn = xp.concatenate([m & 63, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
  return sc, mn


def pack(raw, qtype, shape):
  """GGUF block bytes -> QTensor with numpy planes.

  Args:
    raw: uint8 block bytes as `gguf` exposes them (`ReaderTensor.data`), any shape whose size
      is the tensor's byte count (normally [*lead, out, bytes_per_row]).
    qtype: one of QUANT_TYPES.
    shape: logical numpy shape [*lead, out, in] of the weight.

  Raises:
    QuantLayoutError (a ValueError): unknown type, a row length that is not a multiple of the
      block size, fewer (or more) bytes than the blocks need, a non-uint8 buffer.
  """
  _check_qtype(qtype)
  shape = tuple(int(s) for s in shape)
  if len(shape) < 2:
    raise QuantLayoutError(f"{qtype}: shape {shape} must be at least 2-D [out, in]")
  want = file_nbytes(qtype, shape)
  raw = np.asarray(raw)
  if raw.dtype != np.uint8:
    raise QuantLayoutError(f"{qtype}: block data must be uint8 bytes, got {raw.dtype}")
  if raw.size < want:
    raise QuantLayoutError(f"{qtype}: data of {raw.size} bytes is shorter than the "
                           f"{want} bytes that shape {shape} needs")
  if raw.size != want:
    raise QuantLayoutError(f"{qtype}: data of {raw.size} bytes does not match the {want} "
                           f"bytes that shape {shape} needs")
  nb = shape[-1] // BLOCK[qtype]
  return planes(np.ascontiguousarray(raw).reshape(*shape[:-1], nb, TYPE_SIZE[qtype]), qtype,
                shape)


def planes(blocks, qtype, shape, *, xp=np, f16=_f16, i8=_i8):
  """[*rows, n_blocks, type_size] uint8 block bytes -> QTensor, in numpy or (with xp=jnp and
  bitcasting f16 / i8, as `strata_jax.gguf.device_pack` passes) traced on a device."""
  rows, n_in = shape[:-1], shape[-1]
  nb = n_in // BLOCK[qtype]
  if qtype == "q8_0":
    return QTensor(qs=i8(blocks[..., 2:]).reshape(*rows, n_in), d=f16(blocks[..., 0:2]),
                   qtype=qtype, shape=shape)
  if qtype in ("q4_k", "q5_k"):
    d, dmin = f16(blocks[..., 0:2]), f16(blocks[..., 2:4])
    sc, mn = _k_scales(blocks[..., 4:16], xp)
    qh = None
    if qtype == "q5_k":
      qh, ql = blocks[..., 16:48], blocks[..., 48:176]
    else:
      ql = blocks[..., 16:144]
    # File: chunk c (4 x 32 bytes): low nibble = weight 64c + l, high = 64c + 32 + l.
    ql = ql.reshape(*rows, nb, 2, 2, 32)
    qs = _pair_nibbles(ql[..., 0, :, :], ql[..., 1, :, :], xp)  # [.., nb, 2 chunks, 2, 32]
    return QTensor(qs=qs.reshape(*rows, n_in // 2),
                   qh=None if qh is None else qh.reshape(*rows, n_in // 8),
                   sc=sc.reshape(*rows, nb * 8), mn=mn.reshape(*rows, nb * 8), d=d, dmin=dmin,
                   qtype=qtype, shape=shape)
  # q6_k. File: half h (2 x 64 bytes): low nibble = weight 128h + l, high = 128h + 64 + l.
  ql = blocks[..., 0:128].reshape(*rows, nb, 2, 64)
  qs = _pair_nibbles(ql[..., 0, :], ql[..., 1, :], xp)  # [.., nb, 2, 64]
  return QTensor(qs=qs.reshape(*rows, n_in // 2),
                 qh=blocks[..., 128:192].reshape(*rows, n_in // 4),
                 sc=i8(blocks[..., 192:208]).reshape(*rows, nb * 16),
                 d=f16(blocks[..., 208:210]), qtype=qtype, shape=shape)


def stack(parts):
  """Stack QTensors of one type and shape along a new leading axis (numpy or jax planes)."""
  if not parts:
    raise QuantLayoutError("stack: no parts")
  first = parts[0]
  for p in parts[1:]:
    if p.qtype != first.qtype or p.shape != first.shape:
      raise QuantLayoutError(f"stack: parts differ: {p.qtype} {p.shape} vs "
                             f"{first.qtype} {first.shape}")
  fields = {}
  for name in PLANES[first.qtype]:
    arrs = [getattr(p, name) for p in parts]
    if all(isinstance(a, np.ndarray) for a in arrs):
      fields[name] = np.stack(arrs)
    else:
      import jax.numpy as jnp  # jax planes: stay on their device
      fields[name] = jnp.stack(arrs)
  return QTensor(**fields, qtype=first.qtype, shape=(len(parts), *first.shape))


def device_put(qt, device=None):
  """The QTensor with its planes on `device` (jax.device_put of the pytree)."""
  import jax
  return jax.device_put(qt, device)


def flat(qt):
  """The planes with the leading stack dims flattened to one: {name: [S, out, cols]}.

  A reshape of leading dims is free for a row-major device array (no copy)."""
  s = qt.num_matrices
  return {name: p.reshape(s, *p.shape[len(qt.lead):]) for name, p in qt.planes.items()}
