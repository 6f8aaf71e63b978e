"""Trains the embedded demo model: a ~4.7M-parameter Qwen3-Next on CPU, stopped by wall time.

  python experiments/demo_model/train_base.py --minutes 30

Steps: build the corpora (data.py), train a byte-level BPE tokenizer (Qwen2 pre-tokenizer,
4096 ids with <|endoftext|>, <|im_start|>, <|im_end|> last), train a tiny
`Qwen3NextForCausalLM` with AdamW on 95% stdlib-docstring prose / 5% KJV (the KJV share only
gives the frozen embeddings of the LoRA stage some exposure to that vocabulary; greedy text
stays docstring-style), save `save_pretrained` + tokenizer files to --out, log losses to
experiments/results/demo_training.json (key "base") and print greedy samples.

The learning rate follows the fraction of the time budget spent (warmup, then cosine), so the
run ends annealed however fast the machine is. A checkpoint (model + optimizer) is written every
--ckpt-minutes; --resume continues from it with the remaining budget.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "..", "results", "demo_training.json")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2's pre-tokenizer split (llama.cpp `tokenizer.ggml.pre = qwen2`), so a GGUF runtime that
# knows Qwen2 reproduces our token ids.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_TEMPLATE = (
  "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
  "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SAMPLE_PROMPTS = ("The", "This function", "In the beginning", "And he said")


def model_config(vocab_size: int):
  from transformers import Qwen3NextConfig
  return Qwen3NextConfig(
    vocab_size=vocab_size, hidden_size=256, num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_conv_kernel_dim=4,
    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, moe_intermediate_size=64,
    shared_expert_intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[],
    output_router_logits=True, router_aux_loss_coef=0.001,
    tie_word_embeddings=False, rms_norm_eps=1e-6, max_position_embeddings=2048,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                     "partial_rotary_factor": 0.25},
    pad_token_id=vocab_size - 3, eos_token_id=vocab_size - 1, bos_token_id=None)


def train_tokenizer(texts: list[str], vocab_size: int = 4096):
  """Byte-level BPE with the Qwen2 split; the three specials take the last three ids."""
  from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence([
    pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIALS), min_frequency=2,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(texts, trainer)
  tok.add_special_tokens(list(SPECIALS))
  assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
  assert [tok.token_to_id(s) for s in SPECIALS] == list(range(vocab_size - 3, vocab_size))
  return tok


def save_tokenizer(tok, out: str):
  tok.save(os.path.join(out, "tokenizer.json"))
  cfg = {
    "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 2048,
    "bos_token": None, "add_bos_token": False, "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>", "unk_token": None, "chat_template": CHAT_TEMPLATE,
    "added_tokens_decoder": {str(tok.token_to_id(s)): {
      "content": s, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
      "single_word": False} for s in SPECIALS}}
  with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
    json.dump(cfg, f, indent=2)


def encode_docs(tok, docs: list[str], rng: random.Random, chat_frac: float = 0.25) -> list[int]:
  """One token stream of `data.training_texts`."""
  stream = []
  for enc in tok.encode_batch(data.training_texts(docs, rng, chat_frac)):
    stream.extend(enc.ids)
  return stream


def random_batch(stream: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
  starts = torch.randint(0, len(stream) - seq - 1, (batch,), generator=gen)
  return torch.stack([stream[s:s + seq + 1] for s in starts.tolist()])


def val_windows(stream: torch.Tensor, seq: int, n: int) -> torch.Tensor:
  """The first `n` non-overlapping windows (fewer if the stream is short): a fixed eval set."""
  n = min(n, (len(stream) - 1) // (seq + 1))
  return stream[:n * (seq + 1)].view(n, seq + 1)


def lm_loss(model, x: torch.Tensor) -> torch.Tensor:
  """Mean next-token cross-entropy (nats) of x[:, 1:] given x[:, :-1]."""
  logits = model(input_ids=x[:, :-1], output_router_logits=False).logits
  return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch: int = 8) -> float:
  model.eval()
  losses = [lm_loss(model, windows[i:i + batch]).item() * len(windows[i:i + batch])
            for i in range(0, len(windows), batch)]
  model.train()
  return sum(losses) / len(windows)


def lr_at(frac: float, step: int, peak: float, warmup: int, floor: float = 0.1) -> float:
  """Linear warmup over `warmup` steps, then cosine from `peak` to `floor*peak` by time."""
  warm = min(1.0, (step + 1) / warmup)
  cos = floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
  return peak * warm * cos


@torch.no_grad()
def greedy(model, tok, prompt: str, n: int = 48) -> str:
  model.eval()
  ids = torch.tensor([tok.encode(prompt).ids])
  out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                       do_sample=False, output_router_logits=False,
                       pad_token_id=tok.token_to_id("<|endoftext|>"),
                       eos_token_id=[tok.token_to_id("<|endoftext|>"),
                                     tok.token_to_id("<|im_end|>")])
  model.train()
  return tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=False)


def update_results(key: str, value, path: str | None = None):
  """Read-modify-write of one top-level key of the shared results JSON."""
  path = path or RESULTS
  os.makedirs(os.path.dirname(path), exist_ok=True)
  res = {}
  if os.path.exists(path):
    with open(path) as f:
      res = json.load(f)
  res[key] = value
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(res, f, indent=1)
  os.replace(tmp, path)


def param_groups(model, wd: float):
  decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
  no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
  return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--minutes", type=float, default=30.0, help="training wall-time budget")
  ap.add_argument("--out", default="/work/demo_build/base_hf")
  ap.add_argument("--ckpt", default="/work/demo_build/ckpt_base.pt")
  ap.add_argument("--cache", default=data.DEFAULT_CACHE)
  ap.add_argument("--resume", action="store_true")
  ap.add_argument("--seq", type=int, default=256)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--lr", type=float, default=2e-3)
  ap.add_argument("--warmup", type=int, default=100)
  ap.add_argument("--wd", type=float, default=0.1)
  ap.add_argument("--kjv-frac", type=float, default=0.05, help="share of KJV batches")
  ap.add_argument("--eval-every", type=int, default=150)
  ap.add_argument("--ckpt-minutes", type=float, default=5.0)
  ap.add_argument("--threads", type=int, default=1)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args()
  torch.set_num_threads(args.threads)
  torch.manual_seed(args.seed)
  from tokenizers import Tokenizer
  from transformers import Qwen3NextForCausalLM

  t_prep = time.time()
  docs_train, docs_val = data.split(data.build_docs(args.cache).splitlines())
  kjv_train, kjv_val = data.split(data.kjv_passages(data.build_kjv(args.cache)))
  os.makedirs(args.out, exist_ok=True)
  tok_path = os.path.join(args.out, "tokenizer.json")
  if args.resume and os.path.exists(tok_path):
    tok = Tokenizer.from_file(tok_path)
  else:
    # Balance the merges: all the docs prose and about as many characters of KJV.
    tok = train_tokenizer(docs_train + kjv_train[::3])
  save_tokenizer(tok, args.out)
  rng = random.Random(args.seed)
  streams = {name: torch.tensor(encode_docs(tok, docs, rng), dtype=torch.long)
             for name, docs in (("docs", docs_train), ("kjv", kjv_train),
                                ("docs_val", docs_val), ("kjv_val", kjv_val))}
  evals = {"docs": val_windows(streams["docs_val"], args.seq, 48),
           "kjv": val_windows(streams["kjv_val"], args.seq, 48)}
  chars = sum(map(len, docs_train))
  print(f"docs: {len(docs_train)} train paragraphs, {len(streams['docs']):,} tokens "
        f"({chars / len(streams['docs']):.2f} chars/token); kjv: {len(streams['kjv']):,} "
        f"tokens; prep {time.time() - t_prep:.0f}s", flush=True)

  cfg = model_config(tok.get_vocab_size())
  model = Qwen3NextForCausalLM(cfg)
  n_params = sum(p.numel() for p in model.parameters())
  print(f"params: {n_params:,}", flush=True)
  opt = torch.optim.AdamW(param_groups(model, args.wd), lr=args.lr, betas=(0.9, 0.95))
  step, spent, log = 0, 0.0, {"train": [], "val": []}
  if args.resume and os.path.exists(args.ckpt):
    ck = torch.load(args.ckpt, weights_only=False)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    step, spent, log = ck["step"], ck["spent"], ck["log"]
    print(f"resumed at step {step} after {spent / 60:.1f} min", flush=True)
  budget = args.minutes * 60
  gen = torch.Generator().manual_seed(args.seed + step)
  tokens_per_step = args.batch * args.seq

  def record_eval():
    v = {k: evaluate(model, w) for k, w in evals.items()}
    log["val"].append({"step": step, "minutes": spent / 60, **v})
    print(f"  step {step} {spent / 60:5.1f} min  val docs {v['docs']:.3f}  kjv {v['kjv']:.3f}",
          flush=True)

  def save(final=False):
    # The shipped config is for inference: no router logits (the balance loss is training-only).
    model.config.output_router_logits = False
    model.save_pretrained(args.out)
    model.config.output_router_logits = True
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                "spent": spent, "log": log}, args.ckpt)
    summary = {"config": {k: getattr(args, k) for k in ("seq", "batch", "lr", "warmup", "wd",
                                                      "kjv_frac", "minutes", "threads")},
               "params": n_params, "steps": step, "minutes": spent / 60,
               "tokens": step * tokens_per_step, "final": final, **log}
    update_results("base", summary)

  if step == 0:
    record_eval()
  model.train()
  t_ckpt, acc, acc_n = time.time(), 0.0, 0
  while spent < budget:
    t0 = time.time()
    for g in opt.param_groups:
      g["lr"] = lr_at(spent / budget, step, args.lr, args.warmup)
    src = "kjv" if torch.rand((), generator=gen).item() < args.kjv_frac else "docs"
    x = random_batch(streams[src], args.batch, args.seq, gen)
    # No labels: HF would compute a second cross-entropy; the router's load-balancing loss
    # (output_router_logits=True in the config) is added by hand.
    out = model(input_ids=x[:, :-1])
    lm = lm_loss_from_logits(out.logits, x)
    loss = lm + cfg.router_aux_loss_coef * out.aux_loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    step += 1
    spent += time.time() - t0
    if src == "docs":
      acc, acc_n = acc + lm.item(), acc_n + 1
    if step % 10 == 0 and acc_n:
      log["train"].append({"step": step, "minutes": spent / 60, "loss": acc / acc_n,
                           "lr": opt.param_groups[0]["lr"]})
      if step % 50 == 0:
        print(f"step {step} {spent / 60:5.1f} min  train {acc / acc_n:.3f}  "
              f"lr {opt.param_groups[0]['lr']:.2e}  {(time.time() - t0) * 1e3:.0f} ms/step",
              flush=True)
      acc, acc_n = 0.0, 0
    if step % args.eval_every == 0:
      record_eval()
    if time.time() - t_ckpt > args.ckpt_minutes * 60:
      save()
      t_ckpt = time.time()
  if log["val"][-1]["step"] != step:
    record_eval()
  save(final=True)
  print(f"done: {step} steps, {spent / 60:.1f} min, {step * tokens_per_step:,} tokens", flush=True)
  for p in SAMPLE_PROMPTS:
    print(f"[{p}] {greedy(model, tok, p)!r}", flush=True)


def lm_loss_from_logits(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
  """Cross-entropy of logits computed on x[:, :-1] against the next tokens x[:, 1:]."""
  return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())


if __name__ == "__main__":
  main()
