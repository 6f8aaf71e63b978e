"""Train the embedded demo model's MTP head on the base's own data (trunk frozen).

  python experiments/demo_model/train_mtp.py --minutes 25   # -> /work/demo_build/demo-base-mtp.gguf

The head is Qwen3-Next's MTP block as docs/mtp.md defines it (`strata_jax/model/mtp.py`): entry
t reads the trunk's pre-norm hidden state at t and the token at t + 1, and drafts the token at
t + 2. It is trained by self-distillation: the target at entry t is the frozen trunk's own
next-token distribution at position t + 1, so the head learns to draft what the trunk will
emit (acceptance is agreement with the trunk, not with the text). The data are the base's
training documents (data.py: stdlib docstrings, a quarter as one-turn chats).

Start: the attention and MoE of the trunk's attention layer (layer 3), its norms, and
`eh_proj` = [small noise | identity], so the block first sees the normed hidden state.
AdamW, linear warmup then cosine to 10 % over the wall-time budget (as train_base.py).

Writes the base GGUF with the head (block 4, `nextn_predict_layers = 1`, f16; a head the
shipped file already carries is replaced, not trained on), after checking that every trunk
tensor's bytes are unchanged, and `demo_mtp.json` (loss curve,
steps) under --out-dir.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.abspath(os.path.join(HERE, "..", "..")))

def token_stream(model, docs, rng):
  """One id stream of the base's training format (`data.training_texts`)."""
  import data
  return [t for text in data.training_texts(docs, rng) for t in model.encode(text)]


def warm_start(base_params, mtp):
  """The head from the trunk's attention layer (its index in the attention stack: 0)."""
  import jax
  import jax.numpy as jnp
  L = base_params.layers
  ai = 3   # layer 3 is the trunk's attention layer ("GGGA")
  D = mtp.eh_proj.shape[0]
  noise = 0.02 * jax.random.normal(jax.random.PRNGKey(0), (D, D), jnp.float32)
  return mtp.replace(
      eh_proj=jnp.concatenate([noise, jnp.eye(D, dtype=jnp.float32)], axis=1),
      enorm=jnp.ones_like(mtp.enorm), hnorm=jnp.ones_like(mtp.hnorm),
      head_norm=base_params.final_norm.astype(jnp.float32),
      attn_norm=L.attn_norm[ai:ai + 1], post_norm=L.post_norm[ai:ai + 1],
      attn=jax.tree.map(lambda a: a[0:1], L.attn),
      moe=jax.tree.map(lambda a: a[ai:ai + 1], L.moe))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--minutes", type=float, default=25.0, help="wall-time budget")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--seq", type=int, default=256)
  ap.add_argument("--lr", type=float, default=1e-3)
  ap.add_argument("--cache", default="/work/demo_build/data")
  ap.add_argument("--out-dir", default="/work/demo_build")
  ap.add_argument("--max-steps", type=int, default=0, help="stop after this many (0: time only)")
  args = ap.parse_args(argv)

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  import data
  import strata_jax as sj
  from strata_jax.gguf import names
  from strata_jax.gguf.convert_hf import write_model_gguf
  from strata_jax.model import forward
  from strata_jax.model.mtp import mtp_forward
  from strata_jax.params import init_params, params_to_flat
  from strata_jax.state import init_state

  src = sj.api.asset_path("demo-base.gguf")
  model = sj.load_model(src)
  cfg = dataclasses.replace(model.cfg, n_mtp=1)
  params = model.params
  mtp0 = warm_start(params, init_params(cfg, 0).mtp)

  docs_train, docs_val = data.split(data.build_docs(args.cache).splitlines())
  rng = random.Random(0)
  stream = np.asarray(token_stream(model, docs_train, rng), np.int32)
  val = np.asarray(token_stream(model, docs_val[:200], random.Random(1)), np.int32)
  print(f"tokens: train {len(stream):,}, val {len(val):,}", flush=True)
  B, T = args.batch, args.seq

  @jax.jit
  def trunk(toks):
    """Pre-norm hidden [B, T, D] and next-token log-probs [B, T, V] of the frozen trunk."""
    st = init_state(model.cfg, toks.shape[0], toks.shape[1], jnp.float32)
    x = forward.embed(params, toks)
    n = jnp.full((toks.shape[0],), toks.shape[1], jnp.int32)
    x, _, _ = forward.run_layers(model.cfg, params.layers, None, (st.k, st.v),
                                 (st.conv, st.ssm), x, st.pos, n, jnp.zeros_like(n))
    return x, jax.nn.log_softmax(forward.logits_from_hidden(model.cfg, params, x), axis=-1)

  def head_logits(mtp, toks, hidden):
    Bn, Tn = toks.shape
    kv = jnp.zeros((Bn, Tn, cfg.n_kv_head, cfg.head_dim), jnp.float32)
    zeros = jnp.zeros((Bn,), jnp.int32)
    logits, _, _, _ = mtp_forward(cfg, params.replace(mtp=mtp), toks[:, 1:Tn - 1],
                                  hidden[:, :Tn - 2], kv, kv, zeros,
                                  jnp.full((Bn,), Tn - 2, jnp.int32), zeros)
    return logits

  def loss_fn(mtp, toks, hidden, teacher_lp):
    lp = jax.nn.log_softmax(head_logits(mtp, toks, hidden), axis=-1)
    tgt = teacher_lp[:, 1:-1]                    # the trunk's distribution of token t + 2
    return -jnp.mean(jnp.sum(jnp.exp(tgt) * lp, axis=-1))

  @jax.jit
  def agreement(mtp, toks, hidden, teacher_lp):
    """Fraction of entries whose argmax draft equals the trunk's argmax (greedy acceptance
    of a first draft)."""
    d = jnp.argmax(head_logits(mtp, toks, hidden), axis=-1)
    return jnp.mean((d == jnp.argmax(teacher_lp[:, 1:-1], axis=-1)).astype(jnp.float32))

  budget = args.minutes * 60
  sched = lambda frac: args.lr * (min(1.0, frac / 0.03) * (0.1 + 0.9 * 0.5 * (1 + np.cos(
      np.pi * min(frac, 1.0)))))
  opt = optax.chain(optax.clip_by_global_norm(1.0),
                    optax.inject_hyperparams(optax.adamw)(learning_rate=args.lr,
                                                          weight_decay=0.01))
  state = opt.init(mtp0)

  @jax.jit
  def step(mtp, state, toks, lr):
    hidden, teacher = trunk(toks)
    loss, g = jax.value_and_grad(loss_fn)(mtp, toks, hidden, teacher)
    state[1].hyperparams["learning_rate"] = lr
    upd, state = opt.update(g, state, mtp)
    return optax.apply_updates(mtp, upd), state, loss

  vwin = np.stack([val[i * T:(i + 1) * T] for i in range(min(8, len(val) // T))])

  def evaluate(mtp):
    h, t = trunk(jnp.asarray(vwin))
    return float(loss_fn(mtp, jnp.asarray(vwin), h, t)), float(agreement(mtp, jnp.asarray(vwin),
                                                                         h, t))

  gen = np.random.default_rng(0)
  mtp, curve, t0, n = mtp0, [], time.perf_counter(), 0
  v0 = evaluate(mtp)
  curve.append({"step": 0, "s": 0.0, "val_loss": v0[0], "val_agree": v0[1]})
  print(f"start: val loss {v0[0]:.3f}, first-draft agreement {v0[1]:.3f}", flush=True)
  while True:
    frac = (time.perf_counter() - t0) / budget
    if frac >= 1 or (args.max_steps and n >= args.max_steps):
      break
    starts = gen.integers(0, len(stream) - T, B)
    toks = jnp.asarray(np.stack([stream[s:s + T] for s in starts]))
    mtp, state, loss = step(mtp, state, toks, jnp.float32(sched(frac)))
    n += 1
    if n % 100 == 0:
      v = evaluate(mtp)
      curve.append({"step": n, "s": round(time.perf_counter() - t0, 1), "train_loss":
                    float(loss), "val_loss": v[0], "val_agree": v[1]})
      print(f"step {n} ({curve[-1]['s']} s): loss {float(loss):.3f}, val {v[0]:.3f}, "
            f"agreement {v[1]:.3f}", flush=True)
  v = evaluate(mtp)
  curve.append({"step": n, "s": round(time.perf_counter() - t0, 1), "val_loss": v[0],
                "val_agree": v[1]})
  print(f"end: {n} steps, val loss {v[0]:.3f}, first-draft agreement {v[1]:.3f}", flush=True)

  # ---- the base GGUF with the head: trunk tensors byte-identical to the shipped file
  import gguf
  os.makedirs(args.out_dir, exist_ok=True)
  out = os.path.join(args.out_dir, "demo-base-mtp.gguf")
  r = gguf.GGUFReader(src)
  tok_kv = {k: f.contents() for k, f in r.fields.items() if k.startswith("tokenizer.")}
  flat = {k: np.asarray(v, np.float32)
          for k, v in params_to_flat(params.replace(mtp=mtp)).items()}
  write_model_gguf(out, cfg, names.params_to_gguf_tensors(cfg, flat), outtype="f16",
                   tokenizer_kv=tok_kv, name=r.fields["general.name"].contents(),
                   feed_forward_length=int(r.fields["qwen3next.feed_forward_length"].contents()),
                   progress=False)
  new = {t.name: t for t in gguf.GGUFReader(out).tensors}
  head = f"blk.{model.cfg.n_layers}."   # a head the shipped file already has is replaced
  for t in (t for t in r.tensors if not t.name.startswith(head)):
    if t.tensor_type != new[t.name].tensor_type or bytes(t.data) != bytes(new[t.name].data):
      raise SystemExit(f"{out}: trunk tensor {t.name} changed in the rewrite")
  print(f"{out}: {os.path.getsize(out) / 2**20:.2f} MiB "
        f"({sum(n.startswith(head) for n in new)} head tensors)", flush=True)
  with open(os.path.join(args.out_dir, "demo_mtp.json"), "w") as f:
    json.dump({"steps": n, "batch": B, "seq": T, "minutes": args.minutes, "lr": args.lr,
               "curve": curve}, f, indent=1)


if __name__ == "__main__":
  main()
