"""Trains the demo LoRA: KJV style on top of the demo model, on CPU, stopped by wall time.

  python experiments/demo_model/train_lora.py --minutes 8

Loads the base written by train_base.py (--base), wraps it with PEFT LoRA r=8, alpha=16 on
`o_proj` (gated attention output, GGUF `attn_output`) and `out_proj` (GDN output, GGUF
`ssm_out`) and trains only those adapters on King James Version passages (chat-wrapped for a
quarter, like the base). Saves `save_pretrained` to --out, logs losses under the "lora" key of
experiments/results/demo_training.json, redraws the plot and prints greedy continuations of the
same prompts with the adapter on and off.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data
import plot
import train_base as tb

TARGETS = ["o_proj", "out_proj"]


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--minutes", type=float, default=8.0, help="training wall-time budget")
  ap.add_argument("--base", default="/work/demo_build/base_hf")
  ap.add_argument("--out", default="/work/demo_build/lora_peft")
  ap.add_argument("--cache", default=data.DEFAULT_CACHE)
  ap.add_argument("--rank", type=int, default=8)
  ap.add_argument("--alpha", type=float, default=16.0)
  ap.add_argument("--seq", type=int, default=256)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--lr", type=float, default=5e-3)
  ap.add_argument("--warmup", type=int, default=20)
  ap.add_argument("--eval-every", type=int, default=50)
  ap.add_argument("--ckpt-minutes", type=float, default=3.0)
  ap.add_argument("--threads", type=int, default=1)
  ap.add_argument("--seed", type=int, default=1)
  ap.add_argument("--results", default=tb.RESULTS, help="losses JSON (the plot goes beside it)")
  args = ap.parse_args()
  tb.RESULTS = args.results
  torch.set_num_threads(args.threads)
  torch.manual_seed(args.seed)
  from peft import LoraConfig, get_peft_model
  from tokenizers import Tokenizer
  from transformers import Qwen3NextForCausalLM

  tok = Tokenizer.from_file(os.path.join(args.base, "tokenizer.json"))
  docs_train, docs_val = data.split(data.build_docs(args.cache).splitlines())
  kjv_train, kjv_val = data.split(data.kjv_passages(data.build_kjv(args.cache)))
  rng = random.Random(args.seed)
  stream = torch.tensor(tb.encode_docs(tok, kjv_train, rng), dtype=torch.long)
  # The validation windows of train_base.py: replay its rng (seed 0) through the same encodes.
  vrng = random.Random(0)
  for docs in (docs_train, kjv_train):
    tb.encode_docs(tok, docs, vrng)
  evals = {}
  for name, docs in (("docs", docs_val), ("kjv", kjv_val)):
    evals[name] = tb.val_windows(torch.tensor(tb.encode_docs(tok, docs, vrng)), args.seq, 48)

  base = Qwen3NextForCausalLM.from_pretrained(args.base, dtype=torch.float32)
  base.config.output_router_logits = False  # the router is frozen: no balance loss
  before = {p: tb.greedy(base, tok, p) for p in tb.SAMPLE_PROMPTS}
  lcfg = LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=TARGETS,
                    lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
  model = get_peft_model(base, lcfg)
  n_lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
  print(f"LoRA params: {n_lora:,}", flush=True)
  opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                          betas=(0.9, 0.95), weight_decay=0.0)
  budget = args.minutes * 60
  gen = torch.Generator().manual_seed(args.seed)
  step, spent, log = 0, 0.0, {"train": [], "val": []}

  def record_eval():
    v = {k: tb.evaluate(model, w) for k, w in evals.items()}
    log["val"].append({"step": step, "minutes": spent / 60, **v})
    print(f"  step {step} {spent / 60:5.1f} min  val kjv {v['kjv']:.3f}  docs {v['docs']:.3f}",
          flush=True)

  def save(final=False):
    model.save_pretrained(args.out)
    tb.update_results("lora", {
      "config": {"rank": args.rank, "alpha": args.alpha, "targets": TARGETS, "seq": args.seq,
                 "batch": args.batch, "lr": args.lr, "minutes": args.minutes,
                 "threads": args.threads},
      "params": n_lora, "steps": step, "minutes": spent / 60,
      "tokens": step * args.batch * args.seq, "final": final, **log})

  record_eval()
  model.train()
  t_ckpt, acc, acc_n = time.time(), 0.0, 0
  while spent < budget:
    t0 = time.time()
    for g in opt.param_groups:
      g["lr"] = tb.lr_at(spent / budget, step, args.lr, args.warmup)
    x = tb.random_batch(stream, args.batch, args.seq, gen)
    loss = tb.lm_loss(model, x)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    opt.step()
    step += 1
    spent += time.time() - t0
    acc, acc_n = acc + loss.item(), acc_n + 1
    if step % 10 == 0:
      log["train"].append({"step": step, "minutes": spent / 60, "loss": acc / acc_n,
                           "lr": opt.param_groups[0]["lr"]})
      print(f"step {step} {spent / 60:5.1f} min  train {acc / acc_n:.3f}  "
            f"{(time.time() - t0) * 1e3:.0f} ms/step", flush=True)
      acc, acc_n = 0.0, 0
    if step % args.eval_every == 0:
      record_eval()
    if time.time() - t_ckpt > args.ckpt_minutes * 60:
      save()
      t_ckpt = time.time()
  if log["val"][-1]["step"] != step:
    record_eval()
  save(final=True)
  print(f"done: {step} steps, {spent / 60:.1f} min", flush=True)
  plot.main(["--results", args.results])
  samples = []
  for p in tb.SAMPLE_PROMPTS:
    after = tb.greedy(model, tok, p)
    samples.append({"prompt": p, "base": before[p], "lora": after})
    print(f"[{p}]\n  base: {before[p]!r}\n  lora: {after!r}", flush=True)
  chat = ("<|im_start|>user\nTell me something.<|im_end|>\n<|im_start|>assistant\n")
  with model.disable_adapter():
    chat_base = tb.greedy(model, tok, chat)
  chat_lora = tb.greedy(model, tok, chat)
  samples.append({"prompt": chat, "base": chat_base, "lora": chat_lora})
  print(f"[chat: Tell me something.]\n  base: {chat_base!r}\n  lora: {chat_lora!r}", flush=True)
  tb.update_results("samples", samples)


if __name__ == "__main__":
  main()
