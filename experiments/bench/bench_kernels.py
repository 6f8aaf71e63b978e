"""The device's ceilings and our GDN kernels, timed in JAX.

  - phys: device-to-device copy bandwidth ((read + write) bytes / time, 2 GiB bf16) and the
    rate of an 8192^3 bf16 matmul: the ceilings every roofline of this run is drawn from.
  - gdn: `pallas_kernels.gdn.api.chunked` (prefill, T tokens, one sequence) and `api.step`
    (decode, batch B) on the bench-a3b GDN shapes (32 v-heads of 128, q/k expanded to 32
    heads, fp32 state). Each timed call runs the op `--gdn_iters` times inside one jitted
    fori_loop with the state carried, so dispatch is not measured; time per op = call / iters.
    When peer_fla_gdn.py saved its T=2500 inputs and outputs, our chunked output on the same
    inputs is compared with fla's.

  python experiments/bench/bench_kernels.py [--tiny]   # experiments/results/bench_kernels.json
"""
from __future__ import annotations

import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

flags.DEFINE_bool("tiny", False, "toy sizes (CPU smoke test)")
flags.DEFINE_string("out", os.path.join(common.RESULTS, "bench_kernels.json"), "output JSON")
flags.DEFINE_integer("reps", 7, "timed calls per measurement (median)")
flags.DEFINE_integer("prefill_tokens", 2500, "T of the chunked GDN measurement")
flags.DEFINE_string("decode_batches", "1,8,32", "batches of the GDN decode measurement")
flags.DEFINE_integer("gdn_iters", 0, "ops per timed call (0: 5 chunked, 200 decode)")
F = flags.FLAGS


def _time(fn, args, reps):
  import jax
  jax.block_until_ready(fn(*args))  # compile + warm
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(reps):
    t0 = common.now()
    jax.block_until_ready(fn(*args))
    ts.append(common.now() - t0)
  return common.summarize(ts)


def _time_many(fn, args, reps, n=10):
  """Median time per call of n back-to-back calls (dispatch overlaps the device work)."""
  import jax  # noqa: PLC0415
  jax.block_until_ready(fn(*args))
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(reps):
    t0 = common.now()
    for _ in range(n):
      y = fn(*args)
    jax.block_until_ready(y)
    ts.append((common.now() - t0) / n)
  return common.summarize(ts)


def phys(res, tiny, reps):
  """The ceilings. copy: `jnp.copy` of 2 GiB bf16 ((read + write) bytes / time), the figure
  issue #7's rooflines are stated in; stream: the same bytes through an elementwise kernel
  (a + 0), what a fused kernel reaches; matmul: 8192^3 bf16."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  n = (1 << 16) if tiny else (1 << 30)  # bf16 elements: 2 GiB on the device
  x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
  nbytes = 2 * x.size * x.dtype.itemsize
  t = _time_many(jax.jit(jnp.copy), (x,), reps)
  ts = _time_many(jax.jit(lambda a: a + jnp.bfloat16(0)), (x,), reps)
  del x
  M = 256 if tiny else 8192
  a = jax.random.normal(jax.random.key(1), (M, M), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(2), (M, M), jnp.bfloat16)
  tm = _time_many(jax.jit(jnp.dot), (a, b), reps)
  res["phys"] = dict(copy_bytes=nbytes, copy_s=t, copy_TBps=nbytes / t["median"] / 1e12,
                     stream_s=ts, stream_TBps=nbytes / ts["median"] / 1e12, matmul_M=M,
                     matmul_s=tm, matmul_TFLOPs=2 * M ** 3 / tm["median"] / 1e12)
  print("phys", {k: v for k, v in res["phys"].items() if not isinstance(v, dict)}, flush=True)


def gdn_inputs(key, B, T, H, Dk, Dv):
  """Random inputs as the model hands them to the op: q, k unit-norm per head (q scaled by
  Dk^-1/2), bf16 q/k/v, fp32 log-decay g < 0, beta in (0, 1)."""
  import jax
  import jax.numpy as jnp
  ks = jax.random.split(key, 6)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = (unit(jax.random.normal(ks[0], (B, T, H, Dk))) * Dk ** -0.5).astype(jnp.bfloat16)
  k = unit(jax.random.normal(ks[1], (B, T, H, Dk))).astype(jnp.bfloat16)
  v = jax.random.normal(ks[2], (B, T, H, Dv)).astype(jnp.bfloat16)
  g = jax.nn.log_sigmoid(jax.random.normal(ks[3], (B, T, H)))
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H))).astype(jnp.bfloat16)
  s0 = 0.05 * jax.random.normal(ks[5], (B, H, Dv, Dk), jnp.float32)
  return q, k, v, g, beta, s0


def gdn(res, tiny, reps):
  import jax
  import jax.numpy as jnp
  from jax import lax

  from pallas_kernels.gdn import api as gdn_api
  from strata_jax.forms import Forms
  H, Dk, Dv = (4, 16, 16) if tiny else (32, 128, 128)
  ceil = common.ceilings(res)
  # the decode step the model runs on this backend at batch 1, as one step runs alone (the
  # GPU: the fused kernel, which the conv kernel's choice runs outside a layer scan)
  fused_impl = gdn_api.fused_form(gdn_api.decode_form(
      Forms().resolve(jax.default_backend(), jnp.bfloat16).gdn_decode, 1))
  out = res["gdn"] = {"H": H, "Dk": Dk, "Dv": Dv, "implementation": "pallas_kernels.gdn.api, "
                      f"chunked: {gdn_api.chunked_implementation()}, decode: "
                      f"step_fused({fused_impl}) as the model calls it (us), and the jnp "
                      "step vmap(api.step) beside it (xla_step_us)",
                      "chunked": [],
                      "decode": []}

  T = 100 if tiny else F.prefill_tokens
  n = F.gdn_iters or 5
  q, k, v, g, beta, s0 = gdn_inputs(jax.random.key(10), 1, T, H, Dk, Dv)

  @jax.jit
  def chunked_loop(q, k, v, g, beta, s):
    def body(_, c):
      o, s = jax.vmap(gdn_api.chunked)(q, k, v, g, beta, c[1])
      return o, s
    o0 = jnp.zeros(v.shape, jnp.float32)
    return lax.fori_loop(0, n, body, (o0, s))

  t = _time(chunked_loop, (q, k, v, g, beta, s0), reps)
  per = t["median"] / n
  flops = common.gdn_chunk_flops(T, H, Dk, Dv)
  io = 2 * T * H * (2 * Dk + 2 * Dv) + T * H * (4 + 2) + 2 * H * Dk * Dv * 4
  roof = max(flops / ceil["flops"], io / ceil["bw"])
  out["chunked"].append(dict(B=1, T=T, iters=n, call_s=t, us=per * 1e6, flops=flops,
                             io_bytes=io, roofline_us=roof * 1e6, tflops=flops / per / 1e12))
  print("gdn chunked", out["chunked"][-1], flush=True)
  common.write_json(F.out, res)

  n = F.gdn_iters or 200
  for B in [int(b) for b in F.decode_batches.split(",")]:
    q, k, v, g, beta, s0 = gdn_inputs(jax.random.key(20 + B), B, 1, H, Dk, Dv)
    q, k, v, g, beta = (a[:, 0] for a in (q, k, v, g, beta))

    @jax.jit
    def step_loop(q, k, v, g, beta, s):
      def body(_, c):
        return jax.vmap(gdn_api.step)(q, k, v, g, beta, c[1])
      o0 = jnp.zeros(v.shape, jnp.float32)
      return lax.fori_loop(0, n, body, (o0, s))

    t_xla = _time(step_loop, (q, k, v, g, beta, s0), reps)
    # The model's call: raw bf16 q / k on half the heads (Qwen3-Next: 16 k heads, 32 v
    # heads), raw bf16 gate inputs; l2norm, gates and the step in `step_fused`.
    ks = jax.random.split(jax.random.key(40 + B), 6)
    qr, kr = (jax.random.normal(kk, (B, H // 2, Dk)).astype(jnp.bfloat16) for kk in ks[:2])
    a_in, b_in = (jax.random.normal(kk, (B, H)).astype(jnp.bfloat16) for kk in ks[2:4])
    a_coef = -jnp.exp(jax.random.uniform(ks[4], (H,), jnp.float32, -1.0, 1.0))
    dt_bias = 0.1 * jax.random.normal(ks[5], (H,), jnp.float32)

    @jax.jit
    def fused_loop(q, k, v, a, b, s):
      def body(_, c):
        return gdn_api.step_fused(q, k, v, a, b, a_coef, dt_bias, c[1],
                                  implementation=fused_impl)
      o0 = jnp.zeros(v.shape, jnp.float32)
      return lax.fori_loop(0, n, body, (o0, s))

    t = _time(fused_loop, (qr, kr, v.astype(jnp.bfloat16), a_in, b_in, s0), reps)
    per = t["median"] / n
    state_bytes = 2 * B * H * Dk * Dv * 4
    out["decode"].append(dict(B=B, iters=n, call_s=t, us=per * 1e6, state_rw_bytes=state_bytes,
                              roofline_us=state_bytes / ceil["bw"] * 1e6,
                              state_GBps=state_bytes / per / 1e9, implementation=fused_impl,
                              xla_step_call_s=t_xla, xla_step_us=t_xla["median"] / n * 1e6))
    print("gdn decode", out["decode"][-1], flush=True)
    common.write_json(F.out, res)

  cross_check(res, gdn_api)


def cross_check(res, gdn_api):
  """Our chunked op on the inputs fla ran (peer_fla_gdn.py saves them): relative error."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  d = os.path.join(common.TMP, "fla_gdn_inputs")
  if not os.path.exists(os.path.join(d, "o_fla.npy")):
    res["gdn"]["vs_fla"] = "skipped: no saved fla inputs"
    return
  ld = lambda n: jnp.asarray(np.load(os.path.join(d, n + ".npy")))
  q, k, v, g, beta, o_fla, ht_fla = (ld(n) for n in ("q", "k", "v", "g", "beta", "o_fla", "ht_fla"))
  l2 = lambda x: x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)
  Dk = q.shape[-1]
  s0 = jnp.zeros((q.shape[0], v.shape[2], v.shape[3], Dk), jnp.float32)
  o, s = jax.jit(jax.vmap(gdn_api.chunked))(l2(q) * Dk ** -0.5, l2(k), v, g, beta, s0)
  rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
  res["gdn"]["vs_fla"] = dict(T=int(q.shape[1]), o_rel_err=rel(o, o_fla),
                              state_rel_err=rel(s, jnp.swapaxes(ht_fla, -1, -2)),
                              note="fla: bf16 in/out, l2norm in kernel; ours fp32 reference")
  print("gdn vs fla", res["gdn"]["vs_fla"], flush=True)
  common.write_json(F.out, res)


def main(_):
  import jax
  res = {"jax": jax.__version__, "backend": jax.default_backend(),
         "device": jax.devices()[0].device_kind, "tiny": F.tiny}
  for name, fn in (("phys", phys), ("gdn", gdn)):
    try:
      fn(res, F.tiny, F.reps)
    except Exception as e:
      res.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:1500]}"
      print("ERROR", name, res["errors"][name], flush=True)
    common.write_json(F.out, res)


if __name__ == "__main__":
  app.run(main)
