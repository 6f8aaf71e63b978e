"""Peer: the same model in transformers (Qwen3NextForCausalLM, bf16, on the same GPU).

bench-a3b geometry, random weights made on the GPU. transformers runs fla's GDN kernels
when `fla` is importable (the run puts the fla-core wheel on the path) and its torch
fallbacks otherwise; which one it bound is recorded. Measures
  decode  greedy `generate` at batch 1 from a --prompt-token prompt: decode-only tokens/s =
          (n - 1) / (time(n new tokens) - time(1 new token)), best of --reps
  prefill one forward of --tokens tokens with the cache on and logits for the last token.

  python experiments/bench/peer_transformers.py [--tiny]
  (writes experiments/results/peer_transformers.json)
  python experiments/bench/peer_transformers.py --cache static --compile
  (the fairest transformers peer: its static cache and `torch.compile` of the forward, mode
  "reduce-overhead" (CUDA graphs) on the GPU; transformers marks Qwen3-Next
  `_can_compile_fullgraph`, and on the CPU (transformers 5.24, a toy model) static-cache
  generate, compiled, gives the eager dynamic-cache tokens; writes
  peer_transformers_static_compile.json)
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common


def bound_impl(fn, depth=0):
  """The module of the kernel transformers bound behind a hub-kernel wrapper, if visible."""
  try:
    cells = inspect.getclosurevars(fn).nonlocals
  except (TypeError, ValueError):
    return None
  if "implementation" in cells:
    return getattr(cells["implementation"], "__module__", None)
  if depth < 4:
    for v in cells.values():
      if callable(v) and v is not fn:
        m = bound_impl(v, depth + 1)
        if m:
          return m
  return None


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--tiny", action="store_true", help="toy geometry on the CPU")
  ap.add_argument("--out", default=os.path.join(common.RESULTS, "peer_transformers.json"))
  ap.add_argument("--prompt", type=int, default=128)
  ap.add_argument("--new", type=int, default=32)
  ap.add_argument("--tokens", type=int, default=2500)
  ap.add_argument("--reps", type=int, default=2)
  ap.add_argument("--cache", default="dynamic", choices=("dynamic", "static"),
                  help="generate's cache_implementation (static: preallocated, compilable)")
  ap.add_argument("--compile", action="store_true",
                  help="torch.compile the forward (reduce-overhead on the GPU)")
  args = ap.parse_args()
  if args.cache == "static" or args.compile:
    default = os.path.join(common.RESULTS, "peer_transformers.json")
    if args.out == default:
      args.out = os.path.join(common.RESULTS, f"peer_transformers_{args.cache}"
                              f"{'_compile' if args.compile else ''}.json")
  import torch
  import transformers
  from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
  from transformers.models.qwen3_next import modeling_qwen3_next as mq

  dev = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
  res = {"peer": "transformers", "cache": args.cache, "compiled": args.compile,
         "transformers": transformers.__version__,
         "torch": torch.__version__, "device": dev, "tiny": args.tiny,
         "fla_importable": importlib.util.find_spec("fla") is not None,
         "bound": {n: bound_impl(getattr(mq, n, None)) for n in
                   ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
                    "causal_conv1d_fn", "causal_conv1d_update")}}
  g = common.TINY if args.tiny else common.BENCH_A3B
  if args.tiny:
    args.prompt, args.new, args.tokens = 16, 4, 100
  cfg = Qwen3NextConfig(
      vocab_size=g["vocab_size"], hidden_size=g["d_model"], num_hidden_layers=g["n_layers"],
      full_attention_interval=g["attn_interval"], num_attention_heads=g["n_head"],
      num_key_value_heads=g["n_kv_head"], head_dim=g["head_dim"],
      partial_rotary_factor=g["n_rot"] / g["head_dim"], linear_num_key_heads=g["gdn_n_k_heads"],
      linear_num_value_heads=g["gdn_n_v_heads"], linear_key_head_dim=g["gdn_d_k"],
      linear_value_head_dim=g["gdn_d_v"], linear_conv_kernel_dim=g["conv_kernel"],
      num_experts=g["n_experts"], num_experts_per_tok=g["n_experts_used"],
      moe_intermediate_size=g["d_ff_expert"], shared_expert_intermediate_size=g["d_ff_shared"],
      decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=False,
      rms_norm_eps=g["rms_eps"], max_position_embeddings=32768, pad_token_id=0,
      bos_token_id=None, eos_token_id=None)

  sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
  t0 = time.perf_counter()
  torch.manual_seed(0)
  with torch.device(dev):
    model = Qwen3NextForCausalLM._from_config(cfg, dtype=torch.bfloat16)
  model.eval()
  if args.compile:
    model.forward = torch.compile(model.forward, fullgraph=False,
                                  mode="reduce-overhead" if dev == "cuda" else "default")
  sync()
  res["init_s"] = time.perf_counter() - t0
  res["params"] = sum(p.numel() for p in model.parameters())
  res["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
  res["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
  common.write_json(args.out, res)
  print("init", res, flush=True)

  gen = torch.Generator(device=dev).manual_seed(1)
  prompt = torch.randint(0, g["vocab_size"], (1, args.prompt), device=dev, generator=gen)
  kw = dict(do_sample=False, use_cache=True, attention_mask=torch.ones_like(prompt),
            pad_token_id=0, eos_token_id=None)
  if args.cache == "static":
    kw["cache_implementation"] = "static"

  def generate(n):
    sync()
    t = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kw)
    sync()
    return time.perf_counter() - t, int(out.shape[1] - prompt.shape[1])

  with torch.inference_mode():
    res["warmup_s"], _ = generate(args.new)
    full = [generate(args.new) for _ in range(args.reps)]
    one = [generate(1)[0] for _ in range(args.reps)]
    t_full, t_one = min(t for t, _ in full), min(one)
    res["decode"] = dict(batch=1, prompt=args.prompt, new=args.new, generated=full[0][1],
                         generate_s=[t for t, _ in full], generate_1_s=one,
                         tokens_per_s=(args.new - 1) / (t_full - t_one),
                         ms_per_token=(t_full - t_one) / (args.new - 1) * 1e3)
    common.write_json(args.out, res)
    print("decode", res["decode"], flush=True)

    ids = torch.randint(0, g["vocab_size"], (1, args.tokens), device=dev, generator=gen)
    fkw = {"use_cache": True}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
      fkw["logits_to_keep"] = 1
    ts = []
    for _ in range(args.reps + 2):
      sync()
      t = time.perf_counter()
      o = model(input_ids=ids, **fkw)
      sync()
      ts.append(time.perf_counter() - t)
    best = min(ts[1:])
    res["prefill"] = dict(tokens=args.tokens, times_s=ts, s=best, tokens_per_s=args.tokens / best,
                          logits_finite=bool(torch.isfinite(o.logits).all()))
    if dev == "cuda":
      res["max_mem_GB"] = torch.cuda.max_memory_allocated() / 1e9
  common.write_json(args.out, res)
  print("prefill", res["prefill"], flush=True)


if __name__ == "__main__":
  main()
