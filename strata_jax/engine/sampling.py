"""Host-side sampling: greedy, temperature, top-k, top-p, with a per-request generator."""
from __future__ import annotations

import numpy as np


def sample(logits: np.ndarray, rng: np.random.Generator, temperature: float = 0.0,
           top_k: int = 0, top_p: float = 1.0) -> int:
  """Pick one token id from float logits [V]."""
  if not temperature > 1e-5:          # 0, tiny (logits / T would overflow) or NaN: greedy
    return int(np.argmax(logits))
  z = logits.astype(np.float64) / temperature
  if 0 < top_k < z.size:
    kth = np.partition(z, -top_k)[-top_k]
    z = np.where(z >= kth, z, -np.inf)
  z = z - z.max()
  p = np.exp(z)
  p /= p.sum()
  if top_p < 1.0:
    order = np.argsort(-p, kind="stable")
    cum = np.cumsum(p[order])
    keep = order[: int(np.searchsorted(cum, top_p) + 1)]
    mask = np.zeros_like(p)
    mask[keep] = p[keep]
    p = mask / mask.sum()
  return int(rng.choice(p.size, p=p))
