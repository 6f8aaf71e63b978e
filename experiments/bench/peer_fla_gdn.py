"""Peer: fla's (flash-linear-attention, Triton) Gated DeltaNet kernels on the bench-a3b shapes.

  chunked prefill  chunk_gated_delta_rule, B=1, T tokens, 32 v-heads of 128, fp32 state out
  recurrent decode fused_recurrent_gated_delta_rule, one token, batch 1/8/32, fp32 state in/out
Two q/k layouts: "rep32" (q/k repeated to the 32 v-heads: the shapes our op takes) and
"gva16" (16 q/k heads shared by pairs of v-heads, fla's grouped form). bf16 q/k/v/beta, fp32
log-decay g, q/k L2-normalised inside the kernel. Timed as CUDA-graph replays (median;
triton.testing.do_bench_cudagraph), and eagerly (do_bench) beside it. The T-token rep32
inputs and outputs are saved as .npy for bench_kernels.py's cross-check. FLOPs and bytes are
recorded; report.py draws the rooflines from this run's measured ceilings. The first call of
each shape runs fla's Triton autotuning (~40 s for the chunked op on an H200).

Needs torch with CUDA and the fla-core wheel on the path; without a GPU it writes a JSON that
says so (the CPU smoke test).

  python experiments/bench/peer_fla_gdn.py [--tiny]   # experiments/results/peer_fla_gdn.json
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--tiny", action="store_true")
  ap.add_argument("--out", default=os.path.join(common.RESULTS, "peer_fla_gdn.json"))
  ap.add_argument("--tokens", type=int, default=2500)
  ap.add_argument("--batches", default="1,8,32")
  args = ap.parse_args()
  res = {"peer": "fla", "tiny": args.tiny, "chunked": [], "decode": []}
  try:
    import torch
    res["torch"] = torch.__version__
    if not torch.cuda.is_available():
      res["skipped"] = "no CUDA device (fla's kernels are Triton GPU kernels)"
      common.write_json(args.out, res)
      print(res, flush=True)
      return
    import fla
    import triton
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from triton.testing import do_bench, do_bench_cudagraph
  except Exception as e:
    res["skipped"] = f"import failed: {type(e).__name__}: {e}"[:800]
    common.write_json(args.out, res)
    print(res, flush=True)
    return
  import numpy as np
  import torch.nn.functional as tnf

  res.update(triton=triton.__version__, fla=fla.__version__, gpu=torch.cuda.get_device_name())
  common.write_json(args.out, res)
  print("fla imported", flush=True)
  torch.set_grad_enabled(False)
  g = common.BENCH_A3B
  HK, HV, DK, DV = g["gdn_n_k_heads"], g["gdn_n_v_heads"], g["gdn_d_k"], g["gdn_d_v"]

  def inputs(B, T, layout, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda", dtype=torch.float32)
    hq = HV if layout == "rep32" else HK
    q, k = rnd(B, T, HK, DK), rnd(B, T, HK, DK)
    if layout == "rep32":
      q, k = q.repeat_interleave(HV // HK, dim=2), k.repeat_interleave(HV // HK, dim=2)
    assert q.shape[2] == hq
    v = rnd(B, T, HV, DV)
    gate = tnf.logsigmoid(rnd(B, T, HV))
    beta = torch.sigmoid(rnd(B, T, HV))
    bf = torch.bfloat16
    return q.to(bf), k.to(bf), v.to(bf), gate, beta.to(bf)

  def timed(fn):
    out = {"eager_us": do_bench(fn, warmup=25, rep=150, return_mode="median") * 1e3}
    try:
      out["graph_us"] = do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
    except Exception as e:
      out["graph_error"] = repr(e)[:300]
    out["us"] = out.get("graph_us", out["eager_us"])
    return out

  T = args.tokens
  t_start = time.perf_counter()

  def chunked(layout):
    r = {"layout": layout, "B": 1, "T": T}
    try:
      q, k, v, gate, beta = inputs(1, T, layout, seed=T)
      fn = functools.partial(chunk_gated_delta_rule, q, k, v, gate, beta,
                             use_qk_l2norm_in_kernel=True, output_final_state=True)
      t0 = time.perf_counter()
      o, ht = fn()
      torch.cuda.synchronize()
      r["first_call_s"] = time.perf_counter() - t0
      r.update(timed(fn))
      flops = common.gdn_chunk_flops(T, HV, DK, DV)
      io = (2 * T * q.shape[2] * DK + 2 * T * HV * DV) * 2 + T * HV * 6 + HV * DK * DV * 4
      r.update(flops=flops, io_bytes=io, tflops=flops / (r["us"] * 1e-6) / 1e12,
               o_finite=bool(torch.isfinite(o).all()))
      if layout == "rep32":
        d = os.path.join(common.TMP, "fla_gdn_inputs")
        os.makedirs(d, exist_ok=True)
        for name, x in (("q", q), ("k", k), ("v", v), ("g", gate), ("beta", beta),
                        ("o_fla", o), ("ht_fla", ht)):
          np.save(os.path.join(d, name + ".npy"), x.float().cpu().numpy())
    except Exception as e:
      r["error"] = f"{type(e).__name__}: {e}"[:1500]
    res["chunked"].append(r)
    common.write_json(args.out, res)
    print("chunked", r, flush=True)

  def decode(layout, B):
    r = {"layout": layout, "B": B}
    try:
      q, k, v, gate, beta = inputs(B, 1, layout, seed=100 + B)
      h0 = 0.05 * torch.randn(B, HV, DK, DV, device="cuda", dtype=torch.float32)
      fn = functools.partial(fused_recurrent_gated_delta_rule, q, k, v, g=gate, beta=beta,
                             initial_state=h0, output_final_state=True,
                             use_qk_l2norm_in_kernel=True)
      fn()
      torch.cuda.synchronize()
      r.update(timed(fn))
      sb = 2 * B * HV * DK * DV * 4
      r.update(state_rw_bytes=sb, state_GBps=sb / (r["us"] * 1e-6) / 1e9)
    except Exception as e:
      r["error"] = f"{type(e).__name__}: {e}"[:1500]
    res["decode"].append(r)
    common.write_json(args.out, res)
    print("decode", r, flush=True)

  # Priority order (the run caps this step's time; autotuning compiles many configs):
  # the layout our op shares first.
  for layout in ("rep32", "gva16"):
    chunked(layout)
    for B in [int(b) for b in args.batches.split(",")]:
      decode(layout, B)
    print(f"{layout} done at {time.perf_counter() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
  main()
