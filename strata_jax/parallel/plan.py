"""Planning a layer split: explicit counts, or `auto` from each device's free memory.

`auto` counts, per layer, its weights, its LoRA A/B and its per-slot state (K/V at the
configured context for attention layers, conv + recurrent state for GDN layers), plus the
embedding on the first device and the head on the last, and cuts the layers into contiguous
ranges in proportion to each device's free memory.
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
    raise StrataError(f"--split-devices names device {bad[0]}, but only {len(devs)} exist")
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


def layer_bytes(model, lora=None, slots: int = 1, max_seq: int = 4096) -> np.ndarray:
  """Device bytes each layer needs: weights + LoRA + per-slot state."""
  cfg = model.cfg
  item = np.dtype(model.dtype).itemsize
  layers = model.params.layers
  every = sum(int(np.prod(a.shape[1:])) * a.dtype.itemsize
              for a in jax.tree.leaves((layers.attn_norm, layers.post_norm, layers.moe)))
  per_kind = {}
  kinds = (("G", layers.gdn, ("gdn_a", "gdn_b")), ("A", layers.attn, ("attn_a", "attn_b")))
  for kind, sub, lora_ab in kinds:
    w = sum(int(np.prod(a.shape[1:])) * a.dtype.itemsize for a in jax.tree.leaves(sub))
    if lora is not None:
      w += sum(int(np.prod(a.shape[1:])) * a.dtype.itemsize
               for a in (getattr(lora.params, n) for n in lora_ab))
    per_kind[kind] = w
  kv = 2 * max_seq * cfg.n_kv_head * cfg.head_dim * item * slots
  rec = ((cfg.conv_kernel - 1) * cfg.gdn_conv_dim * item
         + cfg.gdn_n_v_heads * cfg.gdn_d_v * cfg.gdn_d_k * 4) * slots
  return np.array([every + per_kind[t] + (kv if t == ATTN else rec) for t in cfg.layer_types],
                  np.float64)


def free_bytes(dev) -> float | None:
  try:
    st = dev.memory_stats()
  except Exception:  # noqa: BLE001 (backends without stats)
    return None
  if not st or "bytes_limit" not in st:
    return None
  return float(st["bytes_limit"] - st.get("bytes_in_use", 0))


def plan_auto(model, devices, lora=None, slots: int = 1, max_seq: int = 4096):
  """Contiguous ranges, one per device, sized by free memory (equal when unknown)."""
  cost = layer_bytes(model, lora, slots, max_seq)
  n = min(len(devices), len(cost))
  free = [free_bytes(d) for d in devices[:n]]
  cap = np.array([f if f is not None else 1.0 for f in free], np.float64)
  if any(f is None for f in free):
    cap[:] = 1.0
  embed = model.params.embed.size * model.params.embed.dtype.itemsize
  head = model.params.lm_head.size * model.params.lm_head.dtype.itemsize
  total = embed + cost.sum() + head
  if all(f is not None for f in free) and total > cap.sum():
    raise StrataError(f"the model needs {total / 2**30:.1f} GiB but the {n} devices have "
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


def describe(ranges, devices) -> str:
  """'layers 0-23 (dev0), 24-47 (dev1)'."""
  parts = [f"{lo}-{hi - 1} (dev{getattr(d, 'id', i)})" for i, ((lo, hi), d) in
           enumerate(zip(ranges, devices or [None] * len(ranges)))]
  return "layers " + ", ".join(parts)


def plan_layer_split(model, layer_split, split_devices=None):
  """At load: returns (ranges or 'auto', devices). 'auto' is resolved by the engine, which
  knows the adapter, the slots and the context it must hold."""
  devs = select_devices(split_devices)
  spec = parse_split(layer_split, model.cfg.n_layers, len(devs))
  if spec == "auto":
    return "auto", devs
  log.info("layer split: %s", describe(spec, devs[:len(spec)]))
  return spec, devs[:len(spec)]
