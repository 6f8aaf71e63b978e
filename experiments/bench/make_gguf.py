"""Write a synthetic qwen3next GGUF of a real geometry with random, valid blocks, in minutes.

  python experiments/bench/make_gguf.py --geometry qwen3next-80b-a3b --quant q4_k_m \
      --out /tmp/a80b-q4km.gguf

Geometries: `qwen3next-80b-a3b` (Qwen3-Next-80B-A3B: 48 layers, attention every 4th, hidden
2048, 16 q / 2 kv heads of 256, GDN 16 k / 32 v heads of 128, 512 experts top-10 plus a shared
expert, expert and shared FFN 512, vocabulary 151,936, rope dim 64, conv kernel 4),
`bench-a3b` (the same with 64 experts: experiments/bench/common.py) and `tiny` (every in-dim a
multiple of 256, so K-quants apply everywhere; for the CPU smoke test).

Quantisation mixes (`--quant`):
- `q4_k_m`, after llama.cpp's Q4_K_M (`llama_tensor_get_type`): Q4_K for most matrices
  (`token_embd` included), Q6_K for `output`, Q5_K for the fused `attn_qkv` (llama.cpp:
  attn_qkv -> Q5_K under Q4_K_M), and Q6_K for `attn_v` and every `ffn_down*` (experts and
  shared expert) in the layers of llama.cpp's `use_more_bits` (the first and last eighth and
  every third layer in between; for attn_v counted over the attention layers), Q4_K in the
  others; F32 for norms, `ssm_a`, `ssm_dt.bias`, `ssm_conv1d` and the routers (`ffn_gate_inp`,
  `ffn_gate_inp_shexp`), as llama.cpp keeps them. Not modelled: llama.cpp's special cases for
  other model families. Size: ~48 GB for the 80B (the loader keeps such mixed stacks as one
  stack per type, `params.QGroups`).
- `q8_0`: Q8_0 for every matrix, F32 as above. `bf16`: BF16 matrices, F32 as above.

Blocks are random bytes with sane f16 scales (weights of a few hundredths), made with numpy
from one random pool (no quantiser runs): the point is the size, layout and speed of a real
file, not its values. GGUFWriter writes the header and all tensor infos; the tensors' data
then go to their offsets from a few threads (pwrite), each holding one tensor at a time, so
host memory stays at a few tensors plus the pools. Refuses to start when
the disk lacks the space.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.abspath(os.path.join(HERE, "..", "..")))

import gguf  # noqa: E402

T = gguf.GGMLQuantizationType

GEOMETRIES = {
    "qwen3next-80b-a3b": dict(vocab_size=151936, d_model=2048, n_layers=48, attn_interval=4,
                              n_head=16, n_kv_head=2, head_dim=256, n_rot=64, rope_base=1e7,
                              gdn_n_k_heads=16, gdn_n_v_heads=32, gdn_d_k=128, gdn_d_v=128,
                              conv_kernel=4, n_experts=512, n_experts_used=10, d_ff_expert=512,
                              d_ff_shared=512, rms_eps=1e-6),
    "bench-a3b": dict(vocab_size=151936, d_model=2048, n_layers=48, attn_interval=4, n_head=16,
                      n_kv_head=2, head_dim=256, n_rot=64, rope_base=1e7, gdn_n_k_heads=16,
                      gdn_n_v_heads=32, gdn_d_k=128, gdn_d_v=128, conv_kernel=4, n_experts=64,
                      n_experts_used=10, d_ff_expert=512, d_ff_shared=512, rms_eps=1e-6),
    "tiny": dict(vocab_size=512, d_model=256, n_layers=8, attn_interval=4, n_head=2, n_kv_head=1,
                 head_dim=128, n_rot=32, rope_base=1e4, gdn_n_k_heads=2, gdn_n_v_heads=4,
                 gdn_d_k=32, gdn_d_v=64, conv_kernel=4, n_experts=8, n_experts_used=2,
                 d_ff_expert=256, d_ff_shared=256, rms_eps=1e-6),
}
QUANTS = ("q4_k_m", "q8_0", "bf16")
# general.file_type as llama.cpp numbers them (LLAMA_FTYPE_MOSTLY_*).
FILE_TYPE = {"q4_k_m": 15, "q8_0": 7, "bf16": 32}
# The small, precision-critical tensors llama.cpp never quantises (plus every 1-D tensor).
F32_SUFFIXES = ("ssm_a", "ssm_dt.bias", "ssm_conv1d.weight", "ffn_gate_inp.weight",
                "ffn_gate_inp_shexp.weight")
Q4KM_MORE_BITS = (".attn_v.weight", ".ffn_down_exps.weight", ".ffn_down_shexp.weight")
Q4KM_Q5K = ("attn_qkv.weight",)


def use_more_bits(i: int, n: int) -> bool:
  """llama.cpp's layers that get more bits under Q4_K_M (llama-quant.cpp)."""
  return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2

# Per type: the f16 scale fields (byte offset in the block, value) written over the random
# bytes so that weights come out at a few hundredths. Everything else in a block (quants,
# 6-bit sub-block scales, int8 scales) is valid for any byte value.
SCALES = {
    T.Q8_0: [(0, 3e-4)],                  # w = d * q, q int8
    T.Q4_K: [(0, 4e-5), (2, 4e-5)],       # w = d * sc * q - dmin * m, sc/m < 64, q < 16
    T.Q5_K: [(0, 2e-5), (2, 2e-5)],       # the same with q < 32
    T.Q6_K: [(208, 1e-5)],                # w = d * sc * (q - 32), sc int8
}
POOL_BYTES = 64 << 20


def model_config(geometry: str, layers: int | None = None):
  """The geometry's ModelConfig; `layers` (a multiple of its attention interval) keeps the
  per-layer shapes and cuts the depth, for profiling a layer's kernels without the whole file."""
  from strata_jax.config import ModelConfig, layer_pattern_from_interval
  g = dict(GEOMETRIES[geometry])
  if layers:
    if layers % g["attn_interval"]:
      raise SystemExit(f"error: --layers {layers} is not a multiple of {geometry}'s attention "
                       f"interval ({g['attn_interval']})")
    g["n_layers"] = layers
  pattern = layer_pattern_from_interval(g.pop("n_layers"), g.pop("attn_interval"))
  return ModelConfig(layer_types=pattern, context_length=32768 if geometry != "tiny" else 2048,
                     **g)


def tensor_type(name: str, shape: tuple[int, ...], quant: str, cfg=None) -> T:
  """The GGML type of a tensor under a mix (a matrix whose rows are not whole blocks of its
  type falls back to Q8_0, then F32, as llama.cpp falls back). `cfg` places the layer among
  its kind for Q4_K_M's more-bits layers."""
  if len(shape) < 2 or name.endswith(F32_SUFFIXES):
    return T.F32
  if quant == "bf16":
    return T.BF16
  if quant == "q8_0":
    want = T.Q8_0
  elif name == "output.weight":
    want = T.Q6_K
  elif name.endswith(Q4KM_MORE_BITS) and cfg is not None:
    layer = int(name.split(".")[1])
    if name.endswith(".attn_v.weight"):
      attn = [j for j, k in enumerate(cfg.layer_types) if k == "A"]
      i, n = attn.index(layer), len(attn)
    else:
      i, n = layer, cfg.n_layers
    want = T.Q6_K if use_more_bits(i, n) else T.Q4_K
  elif name.endswith(Q4KM_Q5K):
    want = T.Q5_K
  else:
    want = T.Q4_K
  for t in (want, T.Q8_0):
    if shape[-1] % gguf.GGML_QUANT_SIZES[t][0] == 0:
      return t
  return T.F32


def tensor_nbytes(shape, qtype: T) -> int:
  block, size = gguf.GGML_QUANT_SIZES[qtype]
  return int(np.prod(shape)) // block * size


def float_values(name: str, shape, rng) -> np.ndarray:
  """F32 tensors with init_params' recipe (norms ~1, a < 0, dt_bias, conv taps, routers)."""
  if name.endswith("ssm_a"):
    return -np.exp(rng.uniform(-1.0, 1.0, shape)).astype(np.float32)
  if name.endswith("ssm_dt.bias"):
    return rng.uniform(-0.5, 0.5, shape).astype(np.float32)
  if name.endswith("ssm_conv1d.weight"):
    return (0.3 * rng.standard_normal(shape)).astype(np.float32)
  if len(shape) == 1:  # norms (ssm_norm, q/k norms, layer norms)
    return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
  return (0.02 * rng.standard_normal(shape)).astype(np.float32)


class Blocks:
  """Random valid blocks of any type, cut from one random pool with fixed-up scales."""

  def __init__(self, seed: int = 0):
    rng = np.random.default_rng(seed)
    self.pool = np.frombuffer(rng.bytes(POOL_BYTES), np.uint8)
    self.rng = rng
    # BF16 values of ~N(0, 0.02): the pool's bytes as the low byte, a sane high byte.
    hi = np.frombuffer(np.float32(0.02).tobytes(), np.uint8)[3]
    self.bf16_hi = np.array([hi, hi | 0x80], np.uint8)

  def make(self, qtype: T, nbytes: int, out: np.ndarray) -> np.ndarray:
    """Fill out[:nbytes] with random valid data of `qtype` and return that view."""
    buf = out[:nbytes]
    pos = 0
    while pos < nbytes:  # the pool from a random offset, wrapped
      off = int(self.rng.integers(0, POOL_BYTES // 2))
      n = min(nbytes - pos, POOL_BYTES - off)
      buf[pos:pos + n] = self.pool[off:off + n]
      pos += n
    if qtype == T.BF16:
      v = buf.reshape(-1, 2)
      v[:, 1] = self.bf16_hi[v[:, 1] & 1]  # sign from a random bit, exponent fixed
      return buf
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = buf.reshape(-1, size)
    for off, val in SCALES[qtype]:
      blocks[:, off:off + 2] = np.frombuffer(np.float16(val).tobytes(), np.uint8)
    return buf


def plan(cfg, quant: str):
  """[(name, numpy shape, type, bytes)] in file order (names.MODEL_TENSORS order)."""
  from strata_jax.gguf import names
  out = []
  for name, shape in names.gguf_tensor_shapes(cfg).items():
    t = tensor_type(name, shape, quant, cfg)
    out.append((name, tuple(shape), t, tensor_nbytes(shape, t)))
  return out


def write(out_path: str, geometry: str, quant: str, seed: int = 0, progress: bool = True,
          threads: int | None = None, layers: int | None = None):
  """Write the file; returns {"path", "bytes", "tensor_bytes", "seconds", "types"}."""
  from strata_jax.gguf import convert_hf
  cfg = model_config(geometry, layers)
  tensors = plan(cfg, quant)
  data_bytes = sum(nb for *_, nb in tensors)
  out_dir = os.path.dirname(os.path.abspath(out_path)) or "."
  os.makedirs(out_dir, exist_ok=True)
  free = shutil.disk_usage(out_dir).free
  if data_bytes + (64 << 20) > free:
    raise SystemExit(f"error: {out_path}: the {geometry} {quant} file needs "
                     f"{data_bytes / 2**30:.1f} GiB, the disk has {free / 2**30:.1f} GiB free")
  threads = threads or min(8, os.cpu_count() or 1)
  t0 = time.perf_counter()
  tmp = out_path + ".partial"
  w = gguf.GGUFWriter(tmp, "qwen3next")
  convert_hf.add_model_metadata(w, cfg, file_type=FILE_TYPE[quant],
                                name=f"synthetic-{geometry}-{quant}", label=geometry)
  for name, shape, t, nb in tensors:
    dtype = {T.F32: np.float32, T.BF16: np.uint16}.get(t, np.float32)
    w.add_tensor_info(name, shape, np.dtype(dtype), nb, raw_dtype=None if t == T.F32 else t)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_ti_data_to_file()
  # Tensor data: offsets as GGUFWriter lays them out (each padded to the alignment), written
  # by a pool of threads with pwrite (filling and writing release the GIL), so the disk, not
  # one Python thread, sets the pace.
  fout = w.fout[0]
  fout.flush()
  align = w.data_alignment
  start = gguf.GGUFWriter.ggml_pad(fout.tell(), align)
  offsets, pos = [], start
  for *_, nb in tensors:
    offsets.append(pos)
    pos += gguf.GGUFWriter.ggml_pad(nb, align)
  fd = fout.fileno()
  os.ftruncate(fd, pos)
  local = threading.local()
  largest = max(nb for *_, nb in tensors)

  def job(k):
    name, shape, t, nb = tensors[k]
    if not hasattr(local, "blocks"):
      local.blocks = Blocks(seed + 1 + threading.get_ident() % 1000)
      local.scratch = np.empty(largest, np.uint8)
    if t == T.F32:
      data = float_values(name, shape, np.random.default_rng(seed + k)).view(np.uint8)
    else:
      data = local.blocks.make(t, nb, local.scratch)
    view, at = memoryview(data.reshape(-1)), offsets[k]
    while view.nbytes:  # pwrite may write less than asked
      n = os.pwrite(fd, view, at)
      view, at = view[n:], at + n
    return nb

  from tqdm import tqdm
  with tqdm(total=data_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="writing",
            disable=not progress) as bar, \
       concurrent.futures.ThreadPoolExecutor(threads) as pool:
    for nb in pool.map(job, range(len(tensors))):
      bar.update(nb)
  fout.close()
  os.replace(tmp, out_path)
  types = {}
  for _, _, t, nb in tensors:
    types[t.name] = types.get(t.name, 0) + nb
  return {"path": out_path, "bytes": os.path.getsize(out_path), "tensor_bytes": data_bytes,
          "seconds": time.perf_counter() - t0, "types": types}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="qwen3next-80b-a3b")
  ap.add_argument("--quant", choices=QUANTS, default="q4_k_m")
  ap.add_argument("--out", required=True)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--threads", type=int, default=None, help="writer threads (default <= 8)")
  ap.add_argument("--no-progress", action="store_true")
  ap.add_argument("--layers", type=int, default=None,
                  help="fewer layers of the same shapes (a multiple of the attention interval)")
  args = ap.parse_args(argv)
  info = write(args.out, args.geometry, args.quant, args.seed,
               progress=not args.no_progress and sys.stderr.isatty(), threads=args.threads,
               layers=args.layers)
  gib = lambda b: f"{b / 2**30:.2f} GiB"
  print(f"wrote {info['path']}: {gib(info['bytes'])} in {info['seconds']:.1f} s "
        f"({info['tensor_bytes'] / info['seconds'] / 2**30:.2f} GiB/s); by type: "
        + ", ".join(f"{k} {gib(v)}" for k, v in sorted(info["types"].items())))


if __name__ == "__main__":
  main()
