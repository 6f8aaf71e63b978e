"""Where does batch-1 decode time go? bench-a3b through `steps.decode_greedy`, one variant of
the model code at a time (each traced and compiled afresh), timed side by side in one process:

  base      the model as committed
  bf16dot   projections return their 16-bit dtype from the dot (no fp32 result + convert)
  unroll    the layer scan fully unrolled at decode (one straight program per step)
  moe/nomoe the Pallas in-place expert kernel, or the gather form (STRATA_MOE_IMPL=pallas/xla)
  gdn/nogdn the Pallas GDN decode kernel (`step_raw`), or jnp (Forms.gdn_decode)
  gdnfused  the fused GDN decode kernel (gates inside), whose recurrent state stack rides in
            the layer scan's carry and is updated in place (Forms.gdn_decode="pallas_fused", the
            GPU default since run 1 of decode_probe_state_in_place)
  gdnconv   the GDN decode from the qkv / ba projections' split partials in one launch: the
            sums, the conv, the gates and the delta rule, on the fused kernel's grid, the conv
            state stack in the scan's carry and the conv weights, A and dt_bias read in place
            (Forms.gdn_decode="pallas_conv")
  gdnstep   the GDN decode before that: jnp below batch 24, the step kernel from 24
            (`step_raw`'s "auto")
  qpred     a mixed-type quantised stack (--gguf Q4_K_M) by one gated launch per type and a
            select, instead of an XLA conditional (Forms.quant_groups="predicated")
  qfused    the same stack in one launch for a few rows, every type's program compiled in and
            a flag picking the layer's (Forms.quant_groups="fused")
  inplace   the projection matrices kept whole, each layer's taken at its index in the scan
            body, not sliced per block as the scan's xs (Forms.dense_weights="in_place")
  dgemv     the same, a decode step's few rows multiplied by the "blocks" GEMV kernel
            reading each layer's matrix in place (Forms.dense_weights="kernel")
  qrows     the quantised GEMVs (a few rows) by the "rows" form, one sub-block a load, as
            before the "blocks" form (pallas_kernels/quant/gemv.py) became their default
  fewxla/fewdot  2 to 64 rows of the whole-kept dense matrices by XLA (slice copy, dot) or by
            the in-place tensor-core kernel (Forms.dense_few)
  qxla/qpallas  quantised weights (--gguf) multiplied by XLA (gather, dequantise, dot) or by
            the Pallas kernels that dequantise in place (Forms.quant_impl)
  headgemv/headxla  the output head by the in-place dense kernels (Forms.head="kernel", the
            GPU's default since run 59) or XLA's autotuned GEMM (run 58: 141.5 us tuned, 342
            untuned)
  sample    the Engine's own program, `steps.decode_sample` with a greedy plan (the sampler's
            rows in the scan's carry), in place of `decode_greedy`
  fin64/fin32  proj_finish's kernel on 64 / 32 columns a program (128 by default)
  lorabo128 dense_dot's adapted programs on 128 output rows, not 64 (fewer programs each
            computing its share's A x again)
  grouped   many-token MoE as sorted (token, expert) pairs and grouped products
  cond      adapter programs branch (lax.cond) to the no-adapter layers when every switch is off
  fastgdn   prefill's chunked delta rule from `chunked.py` (products, default precision)
  gdnkernel prefill's chunked delta rule by the Pallas kernel (STRATA_GDN_CHUNKED=pallas)
  moekernel many-token MoE by the grouped Pallas kernel (STRATA_MOE_MANY=pallas)
  attnxla/attnflash  a prefill's (or verify step's) attention by XLA's einsums or by the
            flash-style prefill kernel (Forms.attn_prefill)
  pq64/pk32/pw8/ps2  the prefill attention kernel's query / key block, warps, stages
  grows128/gf128/gcd64/gd128/gcf64/gw8/gs3  the grouped MoE kernel's row tile (and group
            padding), up's F block and D step, down's D block and F step, warps, stages
  gdnf32in  the chunked GDN op fed fp32 q/k/v with q/k repeated to the v-heads (before run 71;
            q/k arrive already rounded, so it reproduces the old dtype, layout and fp32
            intermediates, not the old values)
  ggk / ggx the grouped MoE kernel's up launch loads its rows of x by token (the default since
            run 71) / takes them from XLA's gather (before)
  gdnsN     the GDN "separate" state pass at N pipeline stages (3 since run 71, 2 before)
  convcat   the GDN conv state sliced out of the written concatenation (before run 71)
  convtaps  the GDN conv's taps as pad + select (Forms.gdn_conv="taps", the default since
            run 78), not sliced out of the concatenation
  convjoin  the taps sliced out of the concatenation (Forms.gdn_conv="concat"), which XLA
            writes for the conv's three readers in a prefill (the default before run 78)
  gnormop   a prefill's GDN gated norm in the chunked op's output launch
            (Forms.gdn_gated_norm="in_op"), not after the op in XLA
  normproj  a decode step's RMSNorm before each mixer made by its projections' one-row launch
            (Forms.input_norm="in_proj"), not by two XLA fusions before it
  normmoe   the RMSNorm before the MoE made by one launch with the router's product and the
            shared expert's gate / up, which writes the normed row (Forms.moe_norm)
  With --prefill T the variants time `steps.prefill` of a T-token chunk instead (--profile:
  one traced call each).
  Variants combine with '+': "bf16dot+unroll". Each is timed with no adapter, or, when the
  name ends in '@on' / '@off', with the adapter loaded and switched on / off: rank 50 in the
  layout an Engine places (rank padded to 64, a per-row scale table). '@rawon' / '@rawoff'
  load it bare (rank 50, no table), the layout runs before 56 measured.

  python experiments/bench/decode_probe.py --variants base,bf16dot --out probe.json

XLA flags (e.g. command buffers around the while loop) are per process: run the script again
with XLA_FLAGS set and a --tag.
"""
from __future__ import annotations

import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

# Variant parts that only choose model forms (`strata_jax.forms.Forms` fields).
FORM_VARIANTS = {
    "grouped": {"moe_many": "grouped"},
    "moekernel": {"moe_many": "pallas"},
    "fastgdn": {"gdn_chunked": "products"},
    "gdnkernel": {"gdn_chunked": "pallas"},
    "gdnkernel64": {"gdn_chunked": "pallas", "gdn_pallas_chunk": 64},
    "cond": {"lora_branch": "cond"},
    "select": {"lora_branch": "select"},
    "moe": {"moe_few": "pallas"},
    "gdn": {"gdn_decode": "pallas"},
    "gdnfused": {"gdn_decode": "pallas_fused"},
    "gdnlayer": {"gdn_decode": "pallas_layer"},   # a GDN layer's decode core in one launch
    "gdnconv": {"gdn_decode": "pallas_conv"},   # its split sums, conv and delta rule in one launch
    "attnpro": {"attn_decode": "pallas_prologue"},   # attention's norms, RoPE, cache write
    "convtaps": {"gdn_conv": "taps"},   # the GDN conv's taps as pad + select (2026-12-06)
    "convjoin": {"gdn_conv": "concat"},   # the taps sliced from the concatenation (before run 78)
    "gnormop": {"gdn_gated_norm": "in_op"},   # the gated norm in the chunked op's launch
    "normproj": {"input_norm": "in_proj"},   # the input norm in the projections' launch
    "normmoe": {"moe_norm": "in_launch"},    # the MoE's norm in the router's launch
    "gludown": {"shared_glu": "in_down"},    # the shared expert's silu(g) * u in its down GEMV
    "pfin": {"proj_finish": "kernel"},   # one kernel after each mixer's output projection
    "finishb": {"proj_finish": "gemv_b"},   # B copied by the projection's launch (one row)
    "xfin": {"proj_finish": "xla"},      # XLA's fusions after it (the default before run 54)
    "headgemv": {"head": "kernel"},   # the head by the in-place kernels (the GPU's default)
    "headxla": {"head": "xla"},       # XLA's autotuned GEMM (the default before run 59)
    "attnkernel": {"attn_decode": "pallas"},   # the decode kernel alone (base's GPU form)
    "attnxla": {"attn_prefill": "xla"},       # a prefill's attention by XLA's einsums
    "attnflash": {"attn_prefill": "pallas"},  # ... by the flash-style prefill kernel
    "gdnstep": {"gdn_decode": "auto"},      # the default's GDN step (by the batch: decode_form)
    "nomoe": {"moe_few": "xla"},
    "nogdn": {"gdn_decode": "xla"},
    "qxla": {"quant_impl": "xla"},
    "qpallas": {"quant_impl": "pallas"},
    "qpred": {"quant_groups": "predicated"},
    "qfused": {"quant_groups": "fused"},
    "inplace": {"dense_weights": "in_place"},
    "dgemv": {"dense_weights": "kernel"},
    "dscan": {"dense_weights": "scan"},
    "topk": {"moe_topk": "pallas"},
    "xlatopk": {"moe_topk": "xla"},
    "gdnparallel": {"gdn_chunked": "pallas_parallel"},
    "gdnsplit": {"gdn_chunked": "pallas_split"},
    "lorarows": {"gemv_lora": "rows"},
    "loraapart": {"gemv_lora": "apart"},
    "loradot": {"gemv_lora": "dot"},   # one adapted row by dense_dot too (run 27: slower)
    "fewxla": {"dense_few": "xla"},
    "fewdot": {"dense_few": "dot"},
    "fused": {"dense_launch": "fused"},
    "apart": {"dense_launch": "apart"},
    "qlaunch": {"quant_launch": "fused"},   # quantised products of one input in one launch
    "qapart": {"quant_launch": "apart"},
}


def variant_cfg(cfg, variant: str):
  """`cfg` with the variant's forms (a static field: each variant compiles its own program)."""
  import dataclasses
  changes = {k: v for part in variant.split("+") for k, v in FORM_VARIANTS.get(part, {}).items()}
  return dataclasses.replace(cfg, forms=dataclasses.replace(cfg.forms, **changes))


def patch(variant: str):
  """Apply a variant's switches to the model modules; returns an undo function."""
  import functools

  from jax import lax

  from strata_jax.model import attention, forward, gdn, moe
  from strata_jax.model import common as mc
  undo = []

  def setattr_undo(mod, name, value):
    old = getattr(mod, name)
    setattr(mod, name, value)
    undo.append(lambda: setattr(mod, name, old))

  for part in variant.split("+"):
    if part in ("base", ""):
      continue
    if part == "bf16dot":
      def linear(x, w):
        return lax.dot_general(x, w.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())),
                               preferred_element_type=x.dtype)
      for mod in (mc, gdn, attention, moe, forward):
        if hasattr(mod, "linear"):
          setattr_undo(mod, "linear", linear)
    elif part == "unroll":
      class _Lax:
        def __getattr__(self, name):
          return getattr(lax, name)
        scan = staticmethod(functools.partial(lax.scan, unroll=True))
      setattr_undo(forward, "lax", _Lax())
    elif part == "qrows":
      from pallas_kernels.quant import kernel as qk
      setattr_undo(qk, "default_form",
                   lambda m, lora="none": "rows" if m <= qk.ROWS_MAX else "dot")
    elif part in ("fin64", "fin32"):   # proj_finish's column tile (128 columns a program)
      from pallas_kernels.quant import finish
      cols, block = int(part[3:]), finish._block
      setattr_undo(finish, "_block", lambda d: min(cols, block(d)))
    elif part == "lorabo128":   # dense_dot's adapted programs on 128 output rows (64)
      from pallas_kernels.quant import dense_dot
      setattr_undo(dense_dot, "LORA_BLOCK_OUT", 128)
    elif part == "widesteps":   # the dense GEMV's tiling before MIN_STEP_COLS (512 columns a step)
      from pallas_kernels.quant import gemv
      setattr_undo(gemv, "MIN_STEP_COLS", 512)
    elif part == "routesum":   # XLA adds the router GEMV's split partials (its own launch)
      setattr_undo(moe, "linear_parts", lambda x, w: mc.linear(x, w)[None])
    elif part == "route1w":   # the routing kernel at one warp for every program
      from pallas_kernels.moe import topk
      setattr_undo(topk, "ROUTE_WARPS", 1)
    elif re.fullmatch(r"g(rows|f|cd|d|cf|w|s)\d+", part):   # the grouped MoE kernel's tiles
      from pallas_kernels.moe import grouped
      key, n = re.fullmatch(r"g(rows|f|cd|d|cf|w|s)(\d+)", part).groups()
      name = {"rows": "_BLOCK_ROWS", "f": "_BLOCK_F", "cd": "_CHUNK_D", "d": "_BLOCK_D",
              "cf": "_CHUNK_F", "w": "_NUM_WARPS", "s": "_NUM_STAGES"}[key]
      setattr_undo(grouped, name, int(n))
      if key == "w":   # every tile's warps, the wide tiles' too
        setattr_undo(grouped, "_NUM_WARPS_WIDE", int(n))
    elif re.fullmatch(r"p[qkws]\d+", part):   # the prefill attention kernel's tiles
      from pallas_kernels.attention import prefill_kernel as pk
      name = {"q": "BLOCK_Q", "k": "BLOCK_K", "w": "NUM_WARPS", "s": "NUM_STAGES"}[part[1]]
      setattr_undo(pk, name, int(part[2:]))
    elif re.fullmatch(r"lw\d+|lbv\d+", part):   # the GDN layer kernel's warps / Dv tile
      from pallas_kernels.gdn import decode_layer_kernel as dlk
      n = int(re.sub(r"\D", "", part))
      setattr_undo(dlk, "_NUM_WARPS" if part.startswith("lw") else "_BLOCK_V", n)
    elif part == "gdnf32in":   # the chunked GDN op fed fp32 q/k/v, heads repeated (before run 71)
      import jax.numpy as jnp

      from pallas_kernels.gdn import api as gdn_api

      class _Api:
        def __getattr__(self, name):
          return getattr(gdn_api, name)

        @staticmethod
        def chunked(q, k, v, *rest, **kw):
          r = v.shape[-2] // q.shape[-2]
          f32 = lambda a: a.astype(jnp.float32)
          return gdn_api.chunked(f32(jnp.repeat(q, r, axis=-2)), f32(jnp.repeat(k, r, axis=-2)),
                                 f32(v), *rest, **kw)
      setattr_undo(gdn, "gdn_api", _Api())
    elif part == "convcat":   # the conv state sliced out of the concatenation (before run 71)
      import jax
      import jax.numpy as jnp

      def conv_window(conv_state, x, start):
        ext = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)
        return jax.vmap(lambda e, n: lax.dynamic_slice_in_dim(e, n, conv_state.shape[1], 0))(
            ext, start)
      setattr_undo(gdn, "conv_window", conv_window)
    elif part in ("ggk", "ggx"):   # the grouped MoE kernel's rows of x: in place / XLA's gather
      from pallas_kernels.moe import grouped
      setattr_undo(grouped, "_GATHER", "kernel" if part == "ggk" else "xla")
    elif re.fullmatch(r"gdns\d", part):   # the GDN "separate" state pass's pipeline stages
      from pallas_kernels.gdn import parallel_kernel
      setattr_undo(parallel_kernel, "_STAGES", {**parallel_kernel._STAGES, "separate": int(part[4:])})
    elif part == "route4w":   # the routing kernel at four warps for every program (run 38's base)
      from pallas_kernels.moe import topk
      setattr_undo(topk, "ROUTE_WARPS_ONE_ROW", 4)
    elif part == "sort32":   # the grouped MoE's pairs sorted by an int32 key (before session 19)
      import pallas_kernels._common as kc
      setattr_undo(kc, "NARROW_SORT_KEYS", False)
    elif part == "merged":   # XLA may merge a layer's projections (weights concatenated per call)
      from pallas_kernels.quant import api as quant_api
      setattr_undo(quant_api, "SEPARATE_DOTS", False)
    elif part in ("gy16", "gy32"):   # the grouped MoE's per-pair rows in x's dtype / fp32
      from pallas_kernels.moe import grouped
      setattr_undo(grouped, "_ROUND_Y", part == "gy16")
    elif part in FORM_VARIANTS or part == "sample":
      continue   # variant_cfg; "sample": the program (main)
    else:
      raise SystemExit(f"unknown variant part {part!r}")
  return lambda: [u() for u in reversed(undo)]


def prompted_state(cfg, params, lora, state, B, n, switch):
  """`state` with row b prefilled from a random prompt of n tokens (seed b), and each row's
  first token (the argmax after its prompt): rows at distinct contexts route to different
  experts from step to step, as the Engine's do (`bench_engine.prefilled_state`)."""
  import jax.numpy as jnp
  import numpy as np

  from strata_jax import steps
  first = []
  for b in range(B):
    p = np.random.default_rng(b).integers(0, cfg.vocab_size, n).astype(np.int32)
    logits, state = steps.prefill(cfg, params, lora, state, jnp.int32(b), jnp.asarray(p),
                                  jnp.int32(n), jnp.int32(switch))
    first.append(int(jnp.argmax(logits)))
  return state, jnp.asarray(np.asarray(first, np.int32))


def main():
  import argparse
  ap = argparse.ArgumentParser()
  ap.add_argument("--variants", default="base,bf16dot,unroll")
  ap.add_argument("--batches", default="1")
  ap.add_argument("--n_steps", type=int, default=32)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--tag", default="")
  ap.add_argument("--tiny", action="store_true")
  ap.add_argument("--max_seq", type=int, default=512, help="K/V capacity of the decode state")
  ap.add_argument("--prefill", type=int, default=0)
  ap.add_argument("--prompt", type=int, default=0,
                  help="decode from B distinct random prompts of this many tokens, prefilled "
                       "first, each call's last tokens feeding the next, as the Engine decodes "
                       "(bench_engine.py's program_rate); 0: from token 0 in an empty state, "
                       "every call restarting from it")
  ap.add_argument("--profile", default="",
                  help="comma list of variants whose decode (or --prefill) calls are traced")
  ap.add_argument("--gdn_op", type=int, default=0, help="also time the chunked ops at this T")
  ap.add_argument("--gguf", default="", help="a model file (make_gguf.py) instead of bench-a3b's "
                  "random bf16 weights; its quantised weights stay quantised (--weights keep)")
  ap.add_argument("--dump-hlo", dest="dump_hlo", default="",
                  help="a folder: each variant's optimised HLO goes there (gzipped text), to "
                       "find what a profile's fusion names compute")
  ap.add_argument("--out", default=os.path.join(common.TMP, "decode_probe.json"))
  args = ap.parse_args()

  import jax
  import jax.numpy as jnp

  from strata_jax import steps
  from strata_jax.state import init_state
  dtype = jnp.bfloat16
  t0 = time.perf_counter()
  if args.gguf:
    from strata_jax.api import load_model
    model = load_model(args.gguf, dtype="bfloat16")
    cfg, params = model.cfg, model.params
  else:
    cfg = common.model_config(common.TINY if args.tiny else common.BENCH_A3B)
    # the forms an Engine on this backend runs (as load_model's): unresolved, "auto" would mean
    # "scan" to the layer scan (run 23's bench-a3b variants compared two identical programs)
    import dataclasses
    cfg = dataclasses.replace(cfg, forms=cfg.forms.resolve(jax.default_backend(), dtype))
    params = common.device_params(cfg, dtype)
  loras = {"": None, "on": common.engine_lora(cfg, common.LORA_RANK, dtype)}
  loras["off"] = loras["on"]
  loras["rawon"] = loras["rawoff"] = common.device_lora(cfg, common.LORA_RANK, dtype)
  lora = loras["on"]
  print(f"params {time.perf_counter() - t0:.1f}s", flush=True)
  res = dict(tag=args.tag, xla_flags=os.environ.get("XLA_FLAGS", ""), device=str(jax.devices()[0]),
             jax=jax.__version__, max_seq=args.max_seq, results=[])
  if args.gdn_op:
    res["gdn_op"] = time_gdn_ops(cfg, args.gdn_op)
    print(json.dumps(res["gdn_op"]), flush=True)
  if args.prefill:
    time_prefill(args, cfg, params, lora, dtype, res)
    return
  for B in (int(b) for b in args.batches.split(",")):
    for variant in args.variants.split(","):
      name, _, lstate = variant.partition("@")   # "@on" / "@off": adapter loaded
      on = lstate in ("on", "rawon")
      undo = patch(name)
      jax.clear_caches()   # the monkeypatched variants change code jit cannot see
      vcfg = variant_cfg(cfg, name)
      try:
        state = init_state(cfg, B, args.max_seq, dtype)
        toks = jnp.zeros((B,), jnp.int32)
        sw = jnp.full((B,), 1 if on else 0, jnp.int32)
        act = jnp.ones((B,), jnp.int32)
        lp = loras[lstate]
        if args.prompt:
          state, toks = prompted_state(vcfg, params, lp, state, B, args.prompt, 1 if on else 0)
        t = time.perf_counter()
        if "sample" in name.split("+"):   # the Engine's program: sampler rows in the carry
          rows, sp, _, stop, plan = common.sample_inputs(B, {}, [0] * B)
          program = steps.decode_sample.lower(vcfg, params, lp, state, rows, sp, sw, stop,
                                              n_steps=args.n_steps, plan=plan).compile()
          holder = [rows]

          def compiled(params, lp, state, toks, sw, act):
            out, holder[0], state = program(params, lp, state, holder[0], sp, sw, stop)
            return out[0], state
        else:
          program = compiled = steps.decode_greedy.lower(
              vcfg, params, lp, state, toks, sw, act, n_steps=args.n_steps).compile()
        t_compile = time.perf_counter() - t
        text = program.as_text()
        counts = common.hlo_counts(text)
        if args.dump_hlo:
          import gzip
          os.makedirs(args.dump_hlo, exist_ok=True)
          safe = variant.replace("@", "_at_").replace("+", "_and_")   # $OUT takes plain names
          with gzip.open(os.path.join(args.dump_hlo, f"decode_{safe}_b{B}.hlo.txt.gz"),
                         "wt") as f:
            f.write(text)
        feed = args.prompt and "sample" not in name.split("+")   # tokens carried on
        out, state = compiled(params, lp, state, toks, sw, act)
        out.block_until_ready()
        times = []
        for _ in range(args.reps):
          toks = out[-1] if feed else toks
          t = time.perf_counter()
          out, state = compiled(params, lp, state, toks, sw, act)
          out.block_until_ready()
          times.append(time.perf_counter() - t)
        toks = out[-1] if feed else toks
        med = statistics.median(times)
        if variant in args.profile.split(","):
          res[f"profile_{variant}_b{B}"] = common.profile_call(
              lambda: compiled(params, lp, state, toks, sw, act), args.n_steps, top=200)
        row = dict(variant=variant, batch=B, ms_per_step=med / args.n_steps * 1e3,
                   tok_s=B * args.n_steps / med, spread=(max(times) - min(times)) / med,
                   compile_s=t_compile, hlo=counts, tokens=out[:4, 0].tolist())
      except Exception as e:  # keep going: one broken variant must not cost the run
        row = dict(variant=variant, batch=B, error=f"{type(e).__name__}: {e}"[:2000])
      finally:
        undo()
      print(json.dumps(row), flush=True)
      res["results"].append(row)
      os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
      with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


def time_gdn_ops(cfg, T):
  """The chunked delta rule alone, 32 heads, one sequence: reference vs chunked.py."""
  import jax
  import jax.numpy as jnp
  from jax import lax

  from pallas_kernels.gdn import chunked, reference
  from pallas_kernels.gdn.chunked_kernel import gdn_chunked_pallas
  pallas = lambda c: lambda *a: (lambda o, s: (o[0], s[0]))(*gdn_chunked_pallas(
      *(x[None] for x in a), chunk=c))
  H, Dk, Dv = cfg.gdn_n_v_heads, cfg.gdn_d_k, cfg.gdn_d_v
  ks = jax.random.split(jax.random.key(0), 6)
  l2 = lambda a: a / jnp.linalg.norm(a, axis=-1, keepdims=True)
  q = l2(jax.random.normal(ks[0], (T, H, Dk))) * Dk ** -0.5
  k = l2(jax.random.normal(ks[1], (T, H, Dk)))
  v = jax.random.normal(ks[2], (T, H, Dv))
  g = -jnp.exp(jax.random.uniform(ks[3], (T, H), minval=-4, maxval=0))
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (T, H)))
  s0 = jnp.zeros((H, Dv, Dk))
  out = {}
  ref = None
  for name, fn in (("reference", reference.delta_rule_chunked),
                   ("products_default", chunked.delta_rule_chunked),
                   ("products_highest", lambda *a: chunked.delta_rule_chunked(
                       *a, precision=lax.Precision.HIGHEST)),
                   ("pallas_c32", pallas(32)), ("pallas_c64", pallas(64))):
    if name.startswith("pallas") and jax.default_backend() != "gpu":
      continue
    # inputs are arguments, not closed-over constants (XLA would constant-fold the products)
    loop = jax.jit(lambda s, *a, fn=fn: lax.fori_loop(
        0, 5, lambda i, c: (c[0] + fn(*a, c[1])[0][0, 0, 0], c[1]), (0.0, s))[0])
    try:  # a kernel that fails to compile must not cost the other timings
      o = jax.jit(fn)(q, k, v, g, beta, s0)[0]
      ref = o if ref is None else ref
      loop(s0, q, k, v, g, beta).block_until_ready()
      ts = []
      for _ in range(5):
        t = time.perf_counter()
        loop(s0, q, k, v, g, beta).block_until_ready()
        ts.append((time.perf_counter() - t) / 5)
      out[name] = dict(us=statistics.median(ts) * 1e6,
                       max_abs_vs_reference=float(jnp.abs(o - ref).max()))
    except Exception as e:
      out[name] = dict(error=f"{type(e).__name__}: {e}"[:1500])
  return out


def time_prefill(args, cfg, params, lora, dtype, res):
  import jax
  import jax.numpy as jnp
  import numpy as np

  from strata_jax import steps
  from strata_jax.state import init_state
  T = args.prefill
  first = None   # the first variant's last-position logits
  for variant in args.variants.split(","):
    name, _, lstate = variant.partition("@")
    undo = patch(name)
    jax.clear_caches()   # the monkeypatched variants change code jit cannot see
    vcfg = variant_cfg(cfg, name)
    try:
      state = init_state(cfg, 1, T + 64, dtype)
      toks = jax.random.randint(jax.random.key(3), (T,), 0, cfg.vocab_size, jnp.int32)
      lp = lora if lstate else None
      args_ = (params, lp, state, jnp.int32(0), toks, jnp.int32(T),
               jnp.int32(1 if lstate == "on" else 0))
      t = time.perf_counter()
      compiled = steps.prefill.lower(vcfg, *args_).compile()
      t_compile = time.perf_counter() - t
      reset = jax.jit(lambda s: s.replace(pos=jnp.zeros_like(s.pos)), donate_argnums=0)
      logits, state = compiled(*args_)
      times = []
      for _ in range(args.reps):
        state = reset(state)
        state.pos.block_until_ready()
        t = time.perf_counter()
        logits, state = compiled(params, lp, state, *args_[3:])
        logits.block_until_ready()
        times.append(time.perf_counter() - t)
      med = statistics.median(times)
      text = compiled.as_text()
      if variant in args.profile.split(","):   # one call traced: where a prefill's time goes
        state = reset(state)

        def call():
          return compiled(params, lp, state, *args_[3:])[0]
        res[f"profile_{variant}_prefill{T}"] = common.profile_call(call, 1, top=200)
      if args.dump_hlo:
        import gzip
        os.makedirs(args.dump_hlo, exist_ok=True)
        safe = variant.replace("@", "_at_").replace("+", "_and_")
        with gzip.open(os.path.join(args.dump_hlo, f"prefill{T}_{safe}.hlo.txt.gz"), "wt") as f:
          f.write(text)
      # How far this variant's last-position logits are from the first variant's, and how
      # near the top two are: on random weights the argmax alone flips on rounding noise.
      last = np.asarray(logits, np.float32).reshape(-1)
      first = first if first is not None else last
      top2 = np.sort(last)[-2:]
      row = dict(variant=variant, prefill=T, ms=med * 1e3, tok_s=T / med, compile_s=t_compile,
                 argmax=int(last.argmax()), top2_margin=float(top2[1] - top2[0]),
                 logit_std=float(last.std()),
                 max_abs_vs_first=float(np.abs(last - first).max()),
                 hlo=common.hlo_counts(text))
    except Exception as e:
      row = dict(variant=variant, prefill=T, error=f"{type(e).__name__}: {e}"[:2000])
    finally:
      undo()
    print(json.dumps(row), flush=True)
    res["results"].append(row)
    with open(args.out, "w") as f:
      json.dump(res, f, indent=1)


if __name__ == "__main__":
  main()
