"""Planning a layer split: explicit counts, or `auto` from each device's free memory.

`auto` counts, per layer, its weights, its LoRA A/B and its per-slot state (K/V at the
configured context for attention layers, conv + recurrent state for GDN layers), plus the
embedding on the first device and the head on the last, and cuts the layers into contiguous
ranges in proportion to each device's free memory. At load (`load_model`) the weights' bytes
come from the file's tensors (as they will sit on the device) and the state and adapter are a
reserve (`stage_reserve_bytes`), since no weight is placed before the ranges are known.
"""
from __future__ import annotations

import logging

import jax
import numpy as np

from strata_jax.config import ATTN
from strata_jax.errors import StrataError
from strata_jax.parallel.split import parse_ranges

log = logging.getLogger("strata_jax")


def select_devices(split_devices=None) -> list:
  devs = jax.devices()
  if split_devices is None:
    return devs
  raw = split_devices.split(",") if isinstance(split_devices, str) else split_devices
  try:
    idx = [int(i) for i in raw]
  except ValueError:
    raise StrataError(f"--split-devices {split_devices!r}: expected indices like 0,1") from None
  bad = [i for i in idx if not 0 <= i < len(devs)]
  if bad:
    raise StrataError(f"--split-devices names device {bad[0]}; the devices are 0..{len(devs) - 1}")
  return [devs[i] for i in idx]


def parse_split(layer_split, n_layers: int, n_devices: int):
  """'auto' -> 'auto'; 'N1,N2' or a list -> ranges (validated)."""
  if layer_split == "auto":
    return "auto"
  raw = layer_split.split(",") if isinstance(layer_split, str) else layer_split
  try:
    counts = [int(c) for c in raw]
  except (TypeError, ValueError):
    raise StrataError(
        f"--layer-split {layer_split!r}: expected 'auto' or counts like 24,24") from None
  if len(counts) > n_devices:
    raise StrataError(f"layer split into {len(counts)} stages needs {len(counts)} devices, "
                      f"but {n_devices} are available")
  try:
    return parse_ranges(n_layers, counts)
  except ValueError as e:
    raise StrataError(str(e)) from None


def _per_layer(tree) -> int:
  """Bytes of one layer of layer-stacked leaves (arrays or QTensor planes: each leaf's leading
  axis is the layer)."""
  return sum(int(a.nbytes) // max(int(a.shape[0]), 1) for a in jax.tree.leaves(tree))


def state_bytes(cfg, dtype, slots: int = 1, max_seq: int = 4096) -> np.ndarray:
  """Per-layer device bytes of the per-slot state: K/V for attention, conv + recurrent for GDN."""
  item = np.dtype(dtype).itemsize
  kv = 2 * max_seq * cfg.n_kv_head * cfg.head_dim * item * slots
  rec = ((cfg.conv_kernel - 1) * cfg.gdn_conv_dim * item
         + cfg.gdn_n_v_heads * cfg.gdn_d_v * cfg.gdn_d_k * 4) * slots
  return np.array([kv if t == ATTN else rec for t in cfg.layer_types], np.float64)


def lora_bytes(cfg, rank: int, dtype) -> np.ndarray:
  """Per-layer device bytes of stacked LoRA A/B of rank `rank` on the mixer output."""
  item = np.dtype(dtype).itemsize
  g = rank * (cfg.gdn_value_dim + cfg.d_model) * item
  a = rank * (cfg.attn_out_dim + cfg.d_model) * item
  return np.array([a if t == ATTN else g for t in cfg.layer_types], np.float64)


def stage_reserve_bytes(cfg, dtype, slots: int = 1, max_seq: int | None = None) -> np.ndarray:
  """What a split made at load (before the engine exists) reserves per layer beside its
  weights: one slot's state at min(context, 4096) tokens and a rank-64 adapter (the engine
  always runs at least the all-zero rank-64 one)."""
  from strata_jax.params import LORA_RANK_BUCKET  # noqa: PLC0415
  seq = max_seq or min(cfg.context_length, 4096)
  return state_bytes(cfg, dtype, slots, seq) + lora_bytes(cfg, LORA_RANK_BUCKET, dtype)


def layer_bytes(model, lora=None, slots: int = 1, max_seq: int = 4096) -> np.ndarray:
  """Device bytes each layer needs: weights + LoRA + per-slot state (an in-memory model)."""
  cfg = model.cfg
  layers = model.params.layers
  every = _per_layer((layers.attn_norm, layers.post_norm, layers.moe))
  per_kind = {}
  kinds = (("G", layers.gdn, ("gdn_a", "gdn_b")), ("A", layers.attn, ("attn_a", "attn_b")))
  for kind, sub, lora_ab in kinds:
    w = _per_layer(sub)
    if lora is not None:
      w += _per_layer([getattr(lora.params, n) for n in lora_ab])
    per_kind[kind] = w
  return (np.array([every + per_kind[t] for t in cfg.layer_types], np.float64)
          + state_bytes(cfg, model.dtype, slots, max_seq))


def free_bytes(dev) -> float | None:
  try:
    st = dev.memory_stats()
  except Exception:  # noqa: BLE001 (backends without stats)
    return None
  if not st or "bytes_limit" not in st:
    return None
  return float(st["bytes_limit"] - st.get("bytes_in_use", 0))


def allocator_hint(dev) -> str:
  """For a refusal on a GPU: JAX's allocator stops at a share of the card (run 85: an 80 GB
  H100 gave 55.9 GiB), which only an environment variable read when JAX starts raises. The
  limit is the device's own figure; the library reads no environment variable."""
  if getattr(dev, "platform", "") != "gpu":
    return ""
  try:
    limit = (dev.memory_stats() or {}).get("bytes_limit")
  except Exception:  # noqa: BLE001 (backends without stats)
    limit = None
  at = f" at {limit / 2**30:.2f} GiB" if limit else ""
  return (f"; JAX's allocator stops{at}, a share of this GPU (0.75 unless set otherwise): "
          f"XLA_CLIENT_MEM_FRACTION=.95, set before starting, gives it more")


def plan_ranges(cost, embed: float, head: float, devices, what: str = "the model"):
  """Contiguous ranges, one per device, sized by free memory (equal when unknown).

  cost: per-layer device bytes; embed / head: bytes of the embedding (first stage) and of the
  final norm + head (last stage)."""
  cost = np.asarray(cost, np.float64)
  n = min(len(devices), len(cost))
  free = [free_bytes(d) for d in devices[:n]]
  cap = np.array([f if f is not None else 1.0 for f in free], np.float64)
  if any(f is None for f in free):
    cap[:] = 1.0
  total = embed + cost.sum() + head
  if all(f is not None for f in free) and total > cap.sum():
    raise StrataError(f"{what} needs {total / 2**30:.1f} GiB but the {n} devices have "
                      f"{cap.sum() / 2**30:.1f} GiB free")
  # Bytes held once layers [0, i] are placed, the embedding counted on the first device and
  # the head on the last; each cut goes where that total is nearest the device's share.
  held = embed + np.cumsum(cost)
  held[-1] += head
  targets = np.cumsum(cap)[:-1] / cap.sum() * total
  counts, lo = [], 0
  for i, t in enumerate(targets):
    last_ok = len(cost) - (n - 1 - i)              # leave >= 1 layer for every later stage
    hi = lo + 1 + int(np.argmin(np.abs(held[lo:last_ok] - t)))
    counts.append(hi - lo)
    lo = hi
  counts.append(len(cost) - lo)
  return parse_ranges(len(cost), counts)


def plan_auto(model, devices, lora=None, slots: int = 1, max_seq: int = 4096):
  """`plan_ranges` for an in-memory model (its params whole on one device)."""
  cost = layer_bytes(model, lora, slots, max_seq)
  p = model.params
  head = sum(int(a.nbytes) for a in jax.tree.leaves((p.final_norm, p.lm_head)))
  embed = sum(int(a.nbytes) for a in jax.tree.leaves(p.embed))
  return plan_ranges(cost, embed, head, devices)


def describe(ranges, devices) -> str:
  """'layers 0-23 (dev0), 24-47 (dev1)'."""
  parts = [f"{lo}-{hi - 1} (dev{getattr(d, 'id', i)})" for i, ((lo, hi), d) in
           enumerate(zip(ranges, devices or [None] * len(ranges)))]
  return "layers " + ", ".join(parts)


def plan_layer_split(model, layer_split, split_devices=None):
  """For an in-memory model: returns (ranges or 'auto', devices); 'auto' is then resolved by
  the engine, which knows the adapter, the slots and the context it must hold. (`load_model`
  resolves the split itself, from the file, before placing any weight.) `model` may be a
  ModelConfig."""
  devs = select_devices(split_devices)
  cfg = getattr(model, "cfg", model)
  spec = parse_split(layer_split, cfg.n_layers, len(devs))
  if spec == "auto":
    return "auto", devs
  log.info("layer split: %s", describe(spec, devs[:len(spec)]))
  return spec, devs[:len(spec)]
