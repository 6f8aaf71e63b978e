"""Planning a layer split: explicit counts, or `auto` from each device's free memory."""
from __future__ import annotations

import jax
import numpy as np

from strata_jax.errors import StrataError
from strata_jax.parallel.split import parse_ranges


def plan_layer_split(model, layer_split, split_devices=None):
  """Returns (ranges, devices). `layer_split`: "auto", "N1,N2,...", or a list of counts."""
  devs = jax.devices()
  if split_devices is not None:
    idx = [int(i) for i in (split_devices.split(",") if isinstance(split_devices, str) else split_devices)]
    bad = [i for i in idx if not 0 <= i < len(devs)]
    if bad:
      raise StrataError(f"--split-devices names device {bad[0]}, but only {len(devs)} exist")
    devs = [devs[i] for i in idx]
  L = model.cfg.n_layers
  if layer_split == "auto":
    n = len(devs)
    counts = [L // n + (1 if i < L % n else 0) for i in range(n)]
  else:
    raw = layer_split.split(",") if isinstance(layer_split, str) else layer_split
    try:
      counts = [int(c) for c in raw]
    except ValueError:
      raise StrataError(f"--layer-split {layer_split!r}: expected 'auto' or counts like 24,24") from None
  if len(counts) > len(devs):
    raise StrataError(f"layer split into {len(counts)} stages needs {len(counts)} devices, "
                      f"but {len(devs)} are available")
  try:
    ranges = parse_ranges(L, counts)
  except ValueError as e:
    raise StrataError(str(e)) from None
  return ranges, devs[:len(counts)]
