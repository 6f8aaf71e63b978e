"""Valid random GGUF blocks of the quant types with kernel layouts (tests only)."""
import gguf
import numpy as np

from pallas_kernels.quant import BLOCK
from pallas_kernels.quant.layout import TYPE_SIZE

GGML = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_k": gguf.GGMLQuantizationType.Q4_K,
        "q5_k": gguf.GGMLQuantizationType.Q5_K, "q6_k": gguf.GGMLQuantizationType.Q6_K}
# Offsets of the f16 fields in each block (the rest is any bytes).
_F16_AT = {"q8_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


def _f16_scales(rng, n, scale):
  """Sane f16 scales: mostly ~scale, some negative, one exact zero and a subnormal."""
  v = (rng.uniform(0.25, 1.0, n) * scale).astype(np.float16)
  v[rng.random(n) < 0.1] *= -1
  if n > 2:
    v[0], v[1] = 0.0, np.float16(3e-6)
  return v


def random_raw(qtype, shape, seed=0):
  """uint8 [*lead, out, bytes_per_row] GGUF bytes of valid random blocks of `qtype`.

  Q8_0 goes through `gguf.quants.quantize` of Gaussian data (the real quantiser); the
  K-quants (no quantiser in gguf 0.19) are random bytes with sane f16 scales, which exercises
  every bit of the packed values and scales.
  """
  rng = np.random.default_rng(seed)
  shape = tuple(shape)
  nblocks = int(np.prod(shape[:-1])) * (shape[-1] // BLOCK[qtype])
  if qtype == "q8_0":
    x = rng.standard_normal(shape).astype(np.float32)
    raw = gguf.quants.quantize(x, GGML[qtype])
    return np.ascontiguousarray(raw)
  blocks = rng.integers(0, 256, (nblocks, TYPE_SIZE[qtype]), dtype=np.uint8)
  for k, at in enumerate(_F16_AT[qtype]):
    s = _f16_scales(rng, nblocks, 0.02 if k == 0 else 0.01)
    blocks[:, at:at + 2] = s.view(np.uint8).reshape(nblocks, 2)
  return blocks.reshape(*shape[:-1], (shape[-1] // BLOCK[qtype]) * TYPE_SIZE[qtype])


def gguf_dequantize(raw, qtype):
  """gguf's own dequantisation (the oracle of the layout)."""
  return gguf.quants.dequantize(raw, GGML[qtype])
