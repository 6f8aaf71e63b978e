"""Few-token MoE on the H200: gathering the chosen experts' weights (`w[idx]`, a copy) against
reading them in place one expert at a time (dynamic slices feeding the dots), inside a jitted
48-layer scan at bench-a3b shapes (D 2048, 64 experts of 512, top-10), bf16.

  python experiments/bench/moe_probe.py  -> experiments/results/moe_probe.json
"""
from __future__ import annotations

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

L, E, F, D, K = (2, 8, 32, 64, 2) if "--tiny" in sys.argv else (48, 64, 512, 2048, 10)
f32 = jnp.float32


def gather(x, wg, wu, wd, idx, w):
  g, u, d = wg[idx], wu[idx], wd[idx]                          # [N, k, F, D] copies
  hg = jnp.einsum("nd,nkfd->nkf", x, g, preferred_element_type=f32)
  hu = jnp.einsum("nd,nkfd->nkf", x, u, preferred_element_type=f32)
  h = (jax.nn.silu(hg) * hu).astype(x.dtype)
  y = jnp.einsum("nkf,nkdf->nkd", h, d, preferred_element_type=f32)
  return jnp.sum(y * w[..., None], axis=1)


def in_place(x, wg, wu, wd, idx, w):
  def one(n, j):
    e = idx[n, j]
    g = lax.dynamic_index_in_dim(wg, e, keepdims=False)         # [F, D]
    u = lax.dynamic_index_in_dim(wu, e, keepdims=False)
    d = lax.dynamic_index_in_dim(wd, e, keepdims=False)         # [D, F]
    xn = x[n]
    h = (jax.nn.silu(jnp.dot(g, xn, preferred_element_type=f32))
         * jnp.dot(u, xn, preferred_element_type=f32)).astype(x.dtype)
    return jnp.dot(d, h, preferred_element_type=f32) * w[n, j]
  N = x.shape[0]
  def row(n):
    return lax.fori_loop(0, K, lambda j, acc: acc + one(n, j), jnp.zeros((D,), f32))
  return jax.vmap(row)(jnp.arange(N)) if N > 1 else row(0)[None]


def program(fn):
  @jax.jit
  def run(x, wg, wu, wd, router):
    def body(h, ws):
      g, u, d, r = ws
      probs = jax.nn.softmax(jnp.dot(h.astype(f32), r.T), axis=-1)
      w, idx = lax.top_k(probs, K)
      w = w / w.sum(-1, keepdims=True)
      return (h + 0.01 * fn(h, g, u, d, idx, w)).astype(h.dtype), None
    return lax.scan(body, x, (wg, wu, wd, router))[0]
  return run


def main():
  key = jax.random.split(jax.random.key(0), 5)
  mk = lambda k, s: (0.02 * jax.random.normal(k, s, f32)).astype(jnp.bfloat16)
  wg, wu, wd = mk(key[0], (L, E, F, D)), mk(key[1], (L, E, F, D)), mk(key[2], (L, E, D, F))
  router = jax.random.normal(key[3], (L, E, D), f32)
  res = {"shape": dict(L=L, E=E, F=F, D=D, K=K)}
  for N in (1, 8):
    x = mk(key[4], (N, D)) * 50
    outs = {}
    for name, fn in (("gather", gather), ("in_place", in_place)):
      f = program(fn)
      outs[name] = f(x, wg, wu, wd, router).block_until_ready()
      ts = []
      for _ in range(30):
        t = time.perf_counter()
        f(x, wg, wu, wd, router).block_until_ready()
        ts.append(time.perf_counter() - t)
      ts.sort()
      res[f"{name}_N{N}_us_per_layer"] = ts[len(ts) // 2] / L * 1e6
    diff = outs["gather"].astype(f32) - outs["in_place"].astype(f32)
    res[f"max_abs_diff_N{N}"] = float(jnp.abs(diff).max())
  active = K * 3 * F * D * 2
  res["roofline_us_per_layer_N1"] = active / (common.COPY_TBPS * 1e12 / 2) * 1e6
  os.makedirs(common.RESULTS, exist_ok=True)
  with open(os.path.join(common.RESULTS, "moe_probe.json"), "w") as fh:
    json.dump(res, fh, indent=1)
  print(json.dumps(res))


if __name__ == "__main__":
  main()
