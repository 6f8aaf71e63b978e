"""Speculative decoding with the model's MTP head (issue 18): the head in GGUF as llama.cpp
writes it, its forward against a float64 reference of docs/mtp.md, lossless greedy output
(adapter on, off and mixed in one batch; MTP and n-gram drafts), the state after a commit
against one-by-one decoding, the rejection rule's output distribution, and bad input."""
import dataclasses
import json

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_fixtures import random_lora
from scipy import stats
from tolerances import SPEC_STATE_REL_FP32, assert_close, assert_state_close

import strata_jax as sj
from strata_jax import speculative
from strata_jax.config import ModelConfig
from strata_jax.engine.engine import Engine, Request
from strata_jax.errors import GGUFError, SpecError, StrataError
from strata_jax.gguf import names
from strata_jax.gguf.convert_hf import convert_hf, write_model_gguf
from strata_jax.model.mtp import mtp_forward
from strata_jax.params import init_params, params_to_flat
from strata_jax.state import init_mtp_state

# Small enough to compile fast: one GDN and one attention layer, plus the MTP head.
CFG = ModelConfig(vocab_size=96, d_model=32, layer_types="GA", n_head=2, n_kv_head=1,
                  head_dim=16, n_rot=8, rope_base=1e4, gdn_n_k_heads=1, gdn_n_v_heads=2,
                  gdn_d_k=16, gdn_d_v=8, conv_kernel=4, n_experts=4, n_experts_used=2,
                  d_ff_expert=16, d_ff_shared=24, rms_eps=1e-6, context_length=512, n_mtp=1)


def _model(cfg=CFG, seed=0):
  forms = sj.Forms().resolve("cpu", jnp.float32)
  cfg = dataclasses.replace(cfg, forms=dataclasses.replace(forms, lora_impl="xla"))
  return sj.Model(cfg=cfg, params=init_params(cfg, seed, scale=0.15), dtype=jnp.float32,
                  path=f"<spec seed={seed}>", fingerprint=f"spec-{seed}",
                  layer_ranges=[(0, cfg.n_layers)])


@pytest.fixture(scope="module")
def model():
  return _model()


@pytest.fixture(scope="module")
def lora():
  return random_lora(CFG, rank=4, seed=3, scale=0.6)


# ----- GGUF ---------------------------------------------------------------------------------

def _flat(cfg, seed=0):
  return {k: np.asarray(v, np.float32)
          for k, v in params_to_flat(init_params(cfg, seed, scale=0.15)).items()}


def test_gguf_mtp_block_round_trip(tmp_path):
  path = write_model_gguf(tmp_path / "m.gguf", CFG, names.params_to_gguf_tensors(CFG, _flat(CFG)))
  r = gguf.GGUFReader(path)
  kv = {k: f.contents() for k, f in r.fields.items() if k.startswith("qwen3next.")}
  assert kv["qwen3next.block_count"] == 3 and kv["qwen3next.nextn_predict_layers"] == 1
  assert kv["qwen3next.attention.recurrent_layers"] == [True, False, False]
  shapes = {t.name: tuple(int(x) for x in reversed(t.shape)) for t in r.tensors}
  D = CFG.d_model
  assert shapes["blk.2.nextn.eh_proj.weight"] == (D, 2 * D)          # ggml ne {2D, D}
  for n in ("enorm", "hnorm", "shared_head_norm"):
    assert shapes[f"blk.2.nextn.{n}.weight"] == (D,)
  assert shapes["blk.2.attn_q.weight"] == (2 * CFG.n_head * CFG.head_dim, D)
  assert shapes["blk.2.ffn_gate_exps.weight"] == (CFG.n_experts, CFG.d_ff_expert, D)
  assert not any(n.startswith("blk.2.nextn.embed") or "shared_head_head" in n for n in shapes)
  m = sj.load_model(path)
  assert m.cfg.n_mtp == 1 and m.cfg.layer_types == "GA"
  got = params_to_flat(m.params)
  for k, v in _flat(CFG).items():
    np.testing.assert_array_equal(np.asarray(got[k]), v, err_msg=k)
  # a model without the head still loads, with no MTP params
  plain = dataclasses.replace(CFG, n_mtp=0)
  p2 = write_model_gguf(tmp_path / "p.gguf", plain,
                        names.params_to_gguf_tensors(plain, _flat(plain)))
  assert sj.load_model(p2).params.mtp is None


def test_gguf_nextn_disagreeing_with_tensors(tmp_path):
  flat = _flat(CFG)
  tensors = names.params_to_gguf_tensors(CFG, flat)
  missing = dict(tensors)
  del missing["blk.2.nextn.hnorm.weight"]
  p = tmp_path / "missing.gguf"
  w = gguf.GGUFWriter(str(p), "qwen3next")
  from strata_jax.gguf.convert_hf import add_model_metadata  # noqa: PLC0415
  add_model_metadata(w, CFG)
  for n, x in missing.items():
    w.add_tensor(n, np.ascontiguousarray(x, np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(GGUFError, match=r"missing.gguf: .*nextn_predict_layers is 1 but tensor "
                     r"'blk.2.nextn.hnorm.weight'"):
    sj.load_model(str(p))
  # the head's tensors present but not declared
  plain = dataclasses.replace(CFG, n_mtp=0)
  extra = names.params_to_gguf_tensors(plain, _flat(plain))
  extra["blk.2.nextn.eh_proj.weight"] = tensors["blk.2.nextn.eh_proj.weight"]
  q = tmp_path / "undeclared.gguf"
  w = gguf.GGUFWriter(str(q), "qwen3next")
  add_model_metadata(w, plain)
  for n, x in extra.items():
    w.add_tensor(n, np.ascontiguousarray(x, np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(GGUFError, match=r"undeclared.gguf: .*nextn_predict_layers is 0 .* MTP "
                     r"tensors \('blk.2.nextn.eh_proj.weight'"):
    sj.load_model(str(q))


def test_convert_hf_writes_mtp_head(tmp_path):
  import gguf_fixtures as F  # noqa: PLC0415 (transformers + torch)
  from safetensors.numpy import save_file  # noqa: PLC0415
  d = tmp_path / "ckpt"
  F.save_tiny_hf(d, tokenizer=False)
  H = F.HF_DIMS
  D, E, Fe, Fs = (H["hidden_size"], H["num_experts"], H["moe_intermediate_size"],
                  H["shared_expert_intermediate_size"])
  nh, nkv, hd = H["num_attention_heads"], H["num_key_value_heads"], H["head_dim"]
  rng = np.random.default_rng(7)
  r = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.1  # noqa: E731
  L = "mtp.layers.0."
  mtp = {"mtp.fc.weight": r(D, 2 * D), "mtp.norm.weight": r(D),
         "mtp.pre_fc_norm_embedding.weight": r(D), "mtp.pre_fc_norm_hidden.weight": r(D),
         L + "input_layernorm.weight": r(D), L + "post_attention_layernorm.weight": r(D),
         L + "self_attn.q_proj.weight": r(2 * nh * hd, D),
         L + "self_attn.k_proj.weight": r(nkv * hd, D),
         L + "self_attn.v_proj.weight": r(nkv * hd, D),
         L + "self_attn.o_proj.weight": r(D, nh * hd),
         L + "self_attn.q_norm.weight": r(hd), L + "self_attn.k_norm.weight": r(hd),
         L + "mlp.gate.weight": r(E, D), L + "mlp.shared_expert_gate.weight": r(1, D),
         L + "mlp.shared_expert.gate_proj.weight": r(Fs, D),
         L + "mlp.shared_expert.up_proj.weight": r(Fs, D),
         L + "mlp.shared_expert.down_proj.weight": r(D, Fs)}
  for j in range(E):
    for w, s in (("gate_proj", (Fe, D)), ("up_proj", (Fe, D)), ("down_proj", (D, Fe))):
      mtp[f"{L}mlp.experts.{j}.{w}.weight"] = r(*s)
  save_file(mtp, str(d / "mtp.safetensors"))
  cfg = json.loads((d / "config.json").read_text())
  cfg["mtp_num_hidden_layers"] = 1
  (d / "config.json").write_text(json.dumps(cfg))
  out = convert_hf(d, tmp_path / "m.gguf")
  rd = gguf.GGUFReader(out)
  n = H["num_hidden_layers"]
  assert rd.fields["qwen3next.block_count"].contents() == n + 1
  assert rd.fields["qwen3next.nextn_predict_layers"].contents() == 1
  ts = {t.name: np.asarray(t.data, np.float32) for t in rd.tensors}
  b = f"blk.{n}."
  want = {b + "nextn.eh_proj.weight": mtp["mtp.fc.weight"],
          b + "nextn.enorm.weight": 1 + mtp["mtp.pre_fc_norm_embedding.weight"],
          b + "nextn.hnorm.weight": 1 + mtp["mtp.pre_fc_norm_hidden.weight"],
          b + "nextn.shared_head_norm.weight": 1 + mtp["mtp.norm.weight"],
          b + "attn_norm.weight": 1 + mtp[L + "input_layernorm.weight"],
          b + "attn_q.weight": mtp[L + "self_attn.q_proj.weight"],
          b + "attn_q_norm.weight": 1 + mtp[L + "self_attn.q_norm.weight"],
          b + "ffn_gate_inp_shexp.weight": mtp[L + "mlp.shared_expert_gate.weight"],
          b + "ffn_down_exps.weight": np.stack([mtp[f"{L}mlp.experts.{j}.down_proj.weight"]
                                                for j in range(E)])}
  for k, v in want.items():
    np.testing.assert_array_equal(ts[k].reshape(v.shape), v, err_msg=k)
  m = sj.load_model(out)
  assert m.cfg.n_mtp == 1 and m.params.mtp is not None


# ----- the MTP forward --------------------------------------------------------------------------

def _rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def test_mtp_forward_matches_float64_definition(model):
  """One entry on an empty cache (the attention then reads only itself: out = sigmoid(gate)·v)
  against docs/mtp.md in float64: [enorm(e) ; hnorm(h)] in that order, eh_proj, residual
  attention and MoE, shared_head_norm, the shared LM head."""
  cfg, p = model.cfg, model.params
  f = {k: np.asarray(v, np.float64) for k, v in params_to_flat(p).items()}
  eps, D = cfg.rms_eps, cfg.d_model
  rng = np.random.default_rng(0)
  h = rng.standard_normal((1, 1, D)).astype(np.float32)
  tok = np.array([[17]], np.int32)
  ms = init_mtp_state(cfg, 1, 16)
  with jax.default_matmul_precision("highest"):
    logits, hout, _, _ = jax.jit(lambda t, h, k, v: mtp_forward(
        cfg, p, t, h, k, v, jnp.array([5]), jnp.array([1]), jnp.array([5])))(tok, h, ms.k, ms.v)
  e = f["embed"][17]
  x = f["mtp.eh_proj"] @ np.concatenate([_rms(e, f["mtp.enorm"], eps),
                                         _rms(h[0, 0].astype(np.float64), f["mtp.hnorm"], eps)])
  a = _rms(x, f["mtp.attn_norm"][0], eps)
  Hd, H = cfg.head_dim, cfg.n_head
  qg = (f["mtp.attn.q"][0] @ a).reshape(H, 2 * Hd)
  v = (f["mtp.attn.v"][0] @ a).reshape(cfg.n_kv_head, Hd)
  o = np.concatenate([v[hh // (H // cfg.n_kv_head)] / (1 + np.exp(-qg[hh, Hd:]))
                      for hh in range(H)])
  x = x + f["mtp.attn.out"][0] @ o
  m = _rms(x, f["mtp.post_norm"][0], eps)
  pr = np.exp(f["mtp.moe.router"][0] @ m)
  pr /= pr.sum()
  top = np.argsort(-pr)[:cfg.n_experts_used]
  silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
  glu = lambda g, u, dn: dn @ (silu(g @ m) * (u @ m))  # noqa: E731
  y = sum(pr[j] / pr[top].sum() * glu(f["mtp.moe.gate_exps"][0, j], f["mtp.moe.up_exps"][0, j],
                                      f["mtp.moe.down_exps"][0, j]) for j in top)
  gate = 1 / (1 + np.exp(-(f["mtp.moe.shared_gate_inp"][0] @ m)))
  x = x + y + gate * glu(f["mtp.moe.shared_gate"][0], f["mtp.moe.shared_up"][0],
                         f["mtp.moe.shared_down"][0])
  want = f["lm_head"] @ _rms(x, f["mtp.head_norm"], eps)
  assert_close(np.asarray(hout)[0, 0], x, rel=1e-5, what="mtp hidden")
  assert_close(np.asarray(logits)[0, 0], want, rel=1e-5, what="mtp logits")


def test_mtp_entries_at_once_equal_one_by_one(model):
  cfg, p = model.cfg, model.params
  rng = np.random.default_rng(1)
  T = 4
  toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, T)), jnp.int32)
  hid = jnp.asarray(rng.standard_normal((2, T, cfg.d_model)), jnp.float32)
  pos, start = jnp.array([3, 9]), jnp.array([3, 9])
  f = jax.jit(lambda t, h, k, v, pos, nv: mtp_forward(cfg, p, t, h, k, v, pos, nv, start))
  ms = init_mtp_state(cfg, 2, 32)
  all_lg, _, k_all, _ = f(toks, hid, ms.k, ms.v, pos, jnp.array([T, T]))
  k, v = ms.k, ms.v
  for t in range(T):
    lg, _, k, v = f(toks[:, t:t + 1], hid[:, t:t + 1], k, v, pos + t, jnp.array([1, 1]))
    assert_close(np.asarray(lg[:, 0]), np.asarray(all_lg[:, t]), rel=1e-5, what=f"entry {t}")
  assert_close(np.asarray(k), np.asarray(k_all), rel=1e-6, what="mtp keys")


# ----- lossless ---------------------------------------------------------------------------------

PROMPTS = [[5, 17, 33, 2, 9, 40, 7], [1, 2, 3, 1, 2, 3, 1, 2], [9, 9, 8, 8, 7]]


def _run(model, lora, switches, spec, draft="mtp", n=14, temperature=0.0, top_k=0,
         engine=False):
  eng = Engine(model, lora=lora, slots=3, max_seq=64, spec=spec, draft=draft)
  reqs = [Request(tokens=t, max_tokens=n, lora=s, temperature=temperature, top_k=top_k,
                  seed=11) for t, s in zip(PROMPTS, switches)]
  res = eng.run(reqs)
  return (res, eng) if engine else res


@pytest.mark.parametrize("draft", ["mtp", "ngram"])
def test_greedy_speculative_equals_plain_greedy(model, lora, draft):
  """Adapter loaded with the switch on, off and mixed in one batch, and no adapter at all:
  the speculative tokens equal plain greedy decoding's, bit for bit."""
  for lr, sw in ((lora, [True, False, True]), (lora, [False, False, False]),
                 (lora, [True, True, True]), (None, [None, None, None])):
    plain = [r.tokens for r in _run(model, lr, sw, 0)]
    res = _run(model, lr, sw, 3, draft)
    assert [r.tokens for r in res] == plain, (draft, sw)
    assert all(r.draft is not None and 0 <= r.draft["accepted"] <= r.draft["proposed"]
               for r in res)


def test_greedy_speculative_equals_plain_greedy_under_the_fused_gdn_kernel(lora):
  """The GPU's default GDN decode form (the fused kernel, here interpreted): the verification
  runs its T steps in one launch (`gdn_decode_fused_steps`) and still gives plain greedy
  decoding's tokens and leaves the states plain decoding leaves, with the switch mixed in one
  batch."""
  m = _model()
  m = dataclasses.replace(m, cfg=dataclasses.replace(
      m.cfg, forms=dataclasses.replace(m.cfg.forms, gdn_decode="pallas_fused_interpret")))
  sw = [True, False, True]
  res0, eng0 = _run(m, lora, sw, 0, n=8, engine=True)
  res, eng = _run(m, lora, sw, 3, n=8, engine=True)
  assert [r.tokens for r in res] == [r.tokens for r in res0]
  assert sum(r.draft["accepted"] for r in res) > 0
  # every state as the one-token decode left it
  assert_state_close(eng.states[0], eng0.states[0], rel=SPEC_STATE_REL_FP32)


@pytest.mark.parametrize("sampled", [False, True])
def test_rows_accept_different_lengths(model, lora, monkeypatch, sampled):
  """A drafter that knows the answer (row 0 fully, row 1 with its last draft wrong, row 2 never):
  the rows accept different lengths in the same rounds and still give the plain tokens; and
  every row's state (K/V up to its length, conv, recurrent) then equals the plain engine's,
  which decoded the same tokens one at a time. Sampled: temperature 0.8 with top-k 1 through
  the device's rejection rule (a point-mass target keeps right drafts and rejects wrong ones
  with certainty)."""
  sw = [True, False, True]
  res0, eng0 = _run(model, lora, sw, 0, engine=True)
  plain = [r.tokens for r in res0]

  def oracle(ctx, n):
    row = next(i for i, t in enumerate(PROMPTS) if list(ctx[:len(t)]) == t)
    done = len(ctx) - len(PROMPTS[row])
    d = list(plain[row][done:done + n])
    if row == 1 and d:
      d[-1] = (d[-1] + 1) % CFG.vocab_size
    return [(x + 1) % CFG.vocab_size for x in d] if row == 2 else d
  monkeypatch.setattr(speculative, "ngram_draft", oracle)
  res, eng = _run(model, lora, sw, 3, "ngram", engine=True, temperature=0.8 if sampled else 0.0,
                  top_k=1 if sampled else 0)
  assert [r.tokens for r in res] == plain
  acc = [r.draft["accepted"] / max(r.draft["proposed"], 1) for r in res]
  assert acc[0] == 1.0 and 0.5 < acc[1] < 1.0 and acc[2] == 0.0, [r.draft for r in res]
  assert eng.slot_tokens == eng0.slot_tokens     # the caches see the same (accepted) tokens
  assert_state_close(eng.states[0], eng0.states[0], rel=SPEC_STATE_REL_FP32)


def test_sampled_path_with_top_k_1_equals_greedy(model, lora):
  """temperature > 0 runs the sampled path (verify, the device's rejection rule, commit, MTP
  drafts); with top_k = 1 the target is a point mass, so it must equal greedy decoding."""
  sw = [True, False, True]
  plain = [r.tokens for r in _run(model, lora, sw, 0)]
  res = _run(model, lora, sw, 3, "mtp", temperature=0.8, top_k=1)
  assert [r.tokens for r in res] == plain


def test_sampled_path_with_min_p_1_equals_greedy(model, lora):
  """min_p = 1 keeps only the most likely token, so the sampled path's target (top-k, top-p,
  then min-p, as the device sampler) is a point mass and must equal greedy decoding."""
  sw = [True, False, True]
  plain = [r.tokens for r in _run(model, lora, sw, 0)]
  eng = Engine(model, lora=lora, slots=3, max_seq=64, spec=3)
  res = eng.run([Request(tokens=t, max_tokens=14, lora=s, temperature=0.8, min_p=1.0, seed=11)
                 for t, s in zip(PROMPTS, sw)])
  assert [r.tokens for r in res] == plain


PENALTIES = dict(presence_penalty=0.4, frequency_penalty=0.3, repeat_penalty=1.5)


@pytest.mark.parametrize("temperature,top_k", [(0.0, 0), (0.8, 1)])
def test_penalised_speculative_rows_equal_plain_decoding(model, lora, temperature, top_k):
  """Repeat / frequency / presence penalties under speculative decoding: each position's
  window is the row's tokens and the drafts before it, so greedy rows (and sampled rows whose
  top-k of 1 makes the target a point mass) give plain penalised decoding's tokens, the switch
  mixed in one batch; and the penalties change those tokens here, so they are applied."""
  sw = [True, False, True]

  def run(spec, **kw):
    eng = Engine(model, lora=lora, slots=3, max_seq=64, spec=spec)
    return [r.tokens for r in eng.run([Request(tokens=t, max_tokens=14, lora=s, seed=11, **kw)
                                       for t, s in zip(PROMPTS, sw)])]
  plain = run(0, **PENALTIES)
  assert plain != run(0)
  assert run(3, temperature=temperature, top_k=top_k, **PENALTIES) == plain


def test_speculative_step_logits_and_logprobs_are_plain_decodings(model, lora):
  """Speculative rows that ask for their step logits and logprobs (what `--dump-logits` and
  `--logprobs` read): the same tokens as plain greedy, each step's logits those plain decoding
  chose the token from (the verification's rounding: SPEC_STATE_REL_FP32), and each logprobs
  entry the log_softmax of those logits with the same top ids, switch mixed in one batch."""
  sw = [True, False, True]

  def run(spec):
    eng = Engine(model, lora=lora, slots=3, max_seq=64, spec=spec)
    return eng.run([Request(tokens=t, max_tokens=12, lora=s, return_step_logits=True,
                            logprobs=3) for t, s in zip(PROMPTS, sw)])
  plain, res = run(0), run(3)
  assert sum(r.draft["accepted"] for r in res) > 0
  for r0, r in zip(plain, res):
    assert r.tokens == r0.tokens
    assert r.step_logits.shape == r0.step_logits.shape and r.step_logits.dtype == np.float32
    assert_close(r.step_logits, r0.step_logits, rel=SPEC_STATE_REL_FP32, what="step logits")
    assert [int(np.argmax(z)) for z in r.step_logits] == r.tokens
    z = r.step_logits.astype(np.float64)
    lsm = z - z.max(-1, keepdims=True)
    lsm -= np.log(np.exp(lsm).sum(-1, keepdims=True))
    for i, (e, e0) in enumerate(zip(r.logprobs, r0.logprobs)):
      assert e["token"] == e0["token"] == r.tokens[i]
      assert list(e["top"]) == list(e0["top"])
      assert_close(e["logprob"], lsm[i, e["token"]], rel=1e-6, what="logprob")
      assert_close(list(e["top"].values()), lsm[i, list(e["top"])], rel=1e-6, what="top")


# ----- the rejection rule ---------------------------------------------------------------------

def test_rejection_sampling_gives_the_target_distribution():
  """Drafts are point masses; the emitted first token must follow the target p0 whatever the
  draft, and, after an accepted first draft, the second token p1 (chi-square, 40,000 draws)."""
  rng = np.random.default_rng(0)
  V = 6
  logits = rng.standard_normal((3, V)) * 1.5
  temperature, trials = 0.9, 40_000
  p = [speculative.target_probs(lg, temperature) for lg in logits]
  drafts = [int(np.argmax(p[0])), int(np.argmin(p[1]))]   # a likely and an unlikely draft
  first = np.zeros(V)
  second = np.zeros(V)
  for _ in range(trials):
    out, _ = speculative.accept(logits, drafts, rng, temperature)
    first[out[0]] += 1
    if out[0] == drafts[0] and len(out) > 1:
      second[out[1]] += 1
  for counts, probs in ((first, p[0]), (second, p[1])):
    _, pval = stats.chisquare(counts, probs * counts.sum())
    assert pval > 1e-3, (counts / counts.sum(), probs)


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (0.7, 0, 1.0, 0.0), (1.3, 40, 0.9, 0.0), (1.0, 5, 1.0, 0.1), (0.9, 0, 0.6, 0.05),
    (1.0, 100, 0.97, 0.0)])
def test_device_target_is_the_hosts_target(temperature, top_k, top_p, min_p):
  """`sampling.kept_probs` (the device rule's target) equals the host's float64
  `target_probs` on random logits, the kept set included, for each filter alone and
  together (and a top-k beyond the vocabulary: off)."""
  from strata_jax import sampling
  rng = np.random.default_rng(1)
  V = 97
  logits = rng.standard_normal((6, V)) * 2.0
  logits[0, :4] = logits[0, 4]     # ties at the top
  n = logits.shape[0]
  got = np.asarray(jax.jit(sampling.kept_probs)(
      jnp.asarray(logits / temperature, jnp.float32), jnp.full(n, top_k, jnp.int32),
      jnp.full(n, top_p, jnp.float32), jnp.full(n, min_p, jnp.float32)))
  for row, g in zip(logits, got):
    want = speculative.target_probs(row, temperature, top_k, top_p, min_p)
    np.testing.assert_array_equal(g > 0, want > 0)
    np.testing.assert_allclose(g, want, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.9, 0, 1.0), (1.2, 4, 0.9)])
def test_device_rejection_rule_gives_the_target_distribution(temperature, top_k, top_p):
  """`sampling.spec_accept` over 40,000 rows, each its own seed, on the same logits and
  drafts (a likely first draft, an unlikely second): the first emitted token follows the
  target p0 and, after a kept first draft, the second follows p1 (chi-square); each row's
  accepted count agrees with its emitted drafts; a greedy row beside them keeps the greedy
  choice it was given."""
  from strata_jax import sampling
  rng = np.random.default_rng(0)
  V, T, B = 6, 3, 40_000
  logits = rng.standard_normal((T, V)) * 1.5
  p = [speculative.target_probs(lg, temperature, top_k, top_p) for lg in logits]
  drafts = [int(np.argmax(p[0])), int(np.argmin(np.where(p[1] > 0, p[1], 2)))]
  seeds = np.arange(B, dtype=np.uint64) * 7919 + 3
  temp = np.full(B, temperature, np.float32)
  temp[0] = 0.0                                   # one greedy row
  z = np.zeros(B, np.float32)
  sp = sampling.SamplingParams(
      temperature=temp, top_k=np.full(B, top_k, np.int32), top_p=np.full(B, top_p, np.float32),
      min_p=z, presence=z, frequency=z, repeat=z + 1,
      seed_lo=(seeds & 0xFFFFFFFF).astype(np.uint32), seed_hi=(seeds >> 32).astype(np.uint32))
  tokens = np.tile(np.asarray([[1] + drafts], np.int32), (B, 1))
  n_new = np.full(B, T, np.int32)
  greedy_choice = np.full((B, T), 77, np.int32)
  choice, k = jax.device_get(jax.jit(sampling.spec_accept)(
      jnp.asarray(np.broadcast_to(logits, (B, T, V)), jnp.float32), tokens, n_new, sp,
      np.full(B, 5, np.int32), greedy_choice, np.full(B, 1, np.int32)))
  assert list(choice[0]) == [77] * T and k[0] == 1
  choice, k = choice[1:], k[1:]
  assert all((choice[i, :k[i]] == drafts[:k[i]]).all() for i in range(0, B - 1, 97))
  assert (k <= 2).all() and ((k < 2) | (choice[:, 2] < V)).all()
  first = np.bincount(choice[:, 0], minlength=V)[:V]
  kept = k >= 1
  second = np.bincount(choice[kept, 1], minlength=V)[:V]
  for counts, probs in ((first, p[0]), (second, p[1])):
    on = probs > 0
    assert counts[~on].sum() == 0, (counts, probs)
    _, pval = stats.chisquare(counts[on], probs[on] * counts.sum())
    assert pval > 1e-3, (counts / counts.sum(), probs)


def test_sampled_speculative_rows_depend_on_their_seed_alone(model, lora):
  """The device's rule draws from (seed, output index) alone: a seeded sampled request gives
  the same tokens alone, beside other rows (switch mixed), and with four MTP rounds a
  dispatch or one; another seed gives other tokens. (This random MTP head's drafts are never
  kept; `test_rows_accept_different_lengths[True]` keeps drafts on the device's rule.)"""
  def go(reqs, rounds=4, slots=3):
    eng = Engine(model, lora=lora, slots=slots, max_seq=64, spec=3, draft="mtp",
                 spec_rounds=rounds)
    return eng.run(reqs)
  me = dict(tokens=PROMPTS[0], max_tokens=20, lora=True, temperature=0.8, top_p=0.95, seed=5)
  alone = go([Request(**me)], slots=1)[0]
  crowd = go([Request(tokens=PROMPTS[1], max_tokens=9, lora=False, temperature=1.1, seed=1),
              Request(**me), Request(tokens=PROMPTS[2], max_tokens=20, lora=True)])
  one_round = go([Request(**me)], rounds=1, slots=1)[0]
  assert crowd[1].tokens == alone.tokens == one_round.tokens
  assert go([Request(**dict(me, seed=6))], slots=1)[0].tokens != alone.tokens


def test_ngram_draft_prompt_lookup():
  assert speculative.ngram_draft([1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]
  assert speculative.ngram_draft([1, 2, 3, 9, 2], 2) == [3, 9]
  assert speculative.ngram_draft([1, 2, 3], 2) == []


# ----- bad input --------------------------------------------------------------------------------

def test_spec_bad_input(model):
  for bad in (-1, 17):
    with pytest.raises(SpecError, match=rf"--spec {bad}: expected an integer from 0"):
      speculative.check_spec(bad, None, True)
  with pytest.raises(SpecError, match="--draft 'eagle'"):
    speculative.check_spec(2, "eagle", True)
  plain = _model(dataclasses.replace(CFG, n_mtp=0))
  with pytest.raises(SpecError, match="--draft mtp: the model has no MTP layer"):
    Engine(plain, spec=2, draft="mtp")
  assert Engine(plain, spec=2).draft == "ngram"
  assert Engine(model, spec=2).draft == "mtp"
  with pytest.raises(StrataError, match="speculative n 20"):
    Engine(model, spec=2).generate(tokens=[1, 2], spec=20)


def test_cli_spec_json_and_errors(tmp_path):
  """`generate --spec N --json` gives plain greedy's tokens plus the draft counts; a bad
  --spec, and --draft mtp on a model with no MTP layer, exit 2 with `error: ...`."""
  from test_cli import cli  # noqa: PLC0415
  m = write_model_gguf(tmp_path / "m.gguf", CFG, names.params_to_gguf_tensors(CFG, _flat(CFG)))
  plain_cfg = dataclasses.replace(CFG, n_mtp=0)
  p = write_model_gguf(tmp_path / "p.gguf", plain_cfg,
                       names.params_to_gguf_tensors(plain_cfg, _flat(plain_cfg)))
  base = ["generate", "--model", m, "--prompt-tokens", "5,17,33,2", "-n", "8", "--json"]
  # with --dump-logits and --logprobs too: the plain run's arrays and entries
  dumps = [tmp_path / "plain.logits", tmp_path / "spec.logits"]   # the paths as given
  ref, got = (json.loads(cli(*base, "--logprobs", "2", "--dump-logits", str(d), *extra).stdout)
              for d, extra in zip(dumps, ([], ["--spec", "3"])))
  assert got["tokens"] == ref["tokens"] and "draft" not in ref
  assert set(got["draft"]) == {"proposed", "accepted"} and got["draft"]["proposed"] > 0
  lp = [ref, got]
  assert [e["token"] for e in lp[1]["logprobs"]] == ref["tokens"]
  for e, e0 in zip(lp[1]["logprobs"], lp[0]["logprobs"]):
    assert list(e["top"]) == list(e0["top"])
    assert_close(e["logprob"], e0["logprob"], rel=SPEC_STATE_REL_FP32, what="logprob")
  z0, z1 = (np.load(d) for d in dumps)
  assert z1["steps"].shape == (8, CFG.vocab_size)
  for k in ("prompt", "prompt_last", "steps"):
    assert_close(z1[k], z0[k], rel=SPEC_STATE_REL_FP32, what=k)
  for args, msg in ((["--spec", "17"], "error: --spec 17: expected an integer from 0 (off) to 16"),
                    (["--spec", "-1"], "error: --spec -1: expected an integer"),
                    (["--model", p, "--spec", "2", "--draft", "mtp"],
                     "error: --draft mtp: the model has no MTP layer")):
    r = cli(*base, *args, check=False)
    assert r.returncode == 2 and msg in r.stderr, r.stderr[-500:]


@pytest.mark.parametrize("impl", ["xla", "pallas_fused_interpret"])
def test_gdn_keep_steps_equals_decode_steps(model, impl):
  """The verification's GDN form (T tokens as T decode steps, every state kept) against T
  one-token decode calls, under the decode kernel the forms name (the fused one included)."""
  from strata_jax.model.gdn import gdn_mixer  # noqa: PLC0415
  cfg = dataclasses.replace(model.cfg, forms=dataclasses.replace(model.cfg.forms,
                                                                 gdn_decode=impl))
  p = jax.tree.map(lambda a: a[0], model.params.layers.gdn)
  rng = np.random.default_rng(2)
  B, T = 2, 3
  x = jnp.asarray(rng.standard_normal((B, T, cfg.d_model)), jnp.float32)
  conv = jnp.asarray(rng.standard_normal((B, cfg.conv_kernel - 1, cfg.gdn_conv_dim)),
                     jnp.float32)
  ssm = jnp.asarray(0.1 * rng.standard_normal((B, cfg.gdn_n_v_heads, cfg.gdn_d_v,
                                               cfg.gdn_d_k)), jnp.float32)
  nv, sw = jnp.array([T, 2]), jnp.zeros((B,), jnp.int32)
  with jax.default_matmul_precision("highest"):
    y, rows, steps_ = jax.jit(lambda x, c, s: gdn_mixer(cfg, p, x, c, s, nv, None, None, sw,
                                                        keep_steps=True))(x, conv, ssm)
    one = jax.jit(lambda x, c, s, n: gdn_mixer(cfg, p, x, c, s, n, None, None, sw))
    c, s = conv, ssm
    for t in range(T):
      yt, c, s = one(x[:, t:t + 1], c, s, (nv > t).astype(jnp.int32))
      ok = np.asarray(nv) > t
      np.testing.assert_array_equal(np.asarray(y[:, t]), np.asarray(yt[:, 0]), f"y {t}")
      np.testing.assert_array_equal(np.asarray(steps_[:, t])[ok], np.asarray(s)[ok], f"ssm {t}")
      n = np.minimum(np.asarray(nv), t + 1)
      for b in range(B):
        np.testing.assert_array_equal(np.asarray(rows)[b, n[b]:n[b] + cfg.conv_kernel - 1],
                                      np.asarray(c)[b])


def test_spec_and_plain_rows_side_by_side(model, lora):
  """Requests with and without speculation in one engine at once: the speculative rows run
  beside the plain decode chunks and every row gives its plain greedy tokens."""
  sw = [True, False, True]
  plain = [r.tokens for r in _run(model, lora, sw, 0)]
  eng = Engine(model, lora=lora, slots=3, max_seq=64, spec=0, draft="mtp")
  reqs = [Request(tokens=t, max_tokens=14, lora=s, spec=n)
          for t, s, n in zip(PROMPTS, sw, (3, 0, 2))]
  res = eng.run(reqs)
  assert [r.tokens for r in res] == plain
  assert res[0].draft is not None and res[1].draft is None and res[2].draft is not None


def test_rounds_for_never_runs_a_round_past_every_rows_length():
  """Rounds a dispatch: the engine's most when the row with the least room can use them all
  (a round emits at most n + 1 tokens), else one."""
  assert speculative.rounds_for([13, 40], [3, 3], 4) == 4   # 3 rounds emit <= 12 < 13
  assert speculative.rounds_for([12, 40], [3, 3], 4) == 1
  assert speculative.rounds_for([16, 40], [3, 3], 2) == 2
  assert speculative.rounds_for([40], [1], 8) == 8
  assert speculative.rounds_for([6], [2], 3) == 1
  assert speculative.rounds_for([7], [2], 3) == 3


def test_several_mtp_rounds_in_one_dispatch_equal_one_round_at_a_time(model, lora, monkeypatch):
  """`Engine(spec_rounds=4)` runs greedy MTP rounds back to back in one program
  (`steps.spec_rounds_step`), building each round's tokens on the device: the tokens, the
  drafts proposed and accepted, and the states equal one round a dispatch, with the switch
  mixed and one row ending at a stop id mid-dispatch (its later rounds empty)."""
  from strata_jax import steps
  calls = []
  real = steps.spec_rounds_step
  monkeypatch.setattr(steps, "spec_rounds_step",
                      lambda *a, **k: calls.append(k["n_rounds"]) or real(*a, **k))
  sw = [True, False, True]
  plain = [r.tokens for r in _run(model, lora, sw, 0, n=20)]
  stops = [(), (plain[1][6],), ()]

  def go(rounds):
    eng = Engine(model, lora=lora, slots=3, max_seq=64, spec=3, draft="mtp",
                 spec_rounds=rounds)
    res = eng.run([Request(tokens=t, max_tokens=20, lora=s, stop=st)
                   for t, s, st in zip(PROMPTS, sw, stops)])
    return res, eng

  one, eng1 = go(1)
  assert not calls
  many, eng4 = go(4)
  assert calls and set(calls) == {4}, calls
  assert [r.tokens for r in many] == [r.tokens for r in one]
  assert many[1].tokens == plain[1][:plain[1].index(plain[1][6]) + 1]
  assert [r.draft for r in many] == [r.draft for r in one]
  assert eng4.slot_tokens == eng1.slot_tokens
  assert_state_close(eng4.states[0], eng1.states[0], rel=SPEC_STATE_REL_FP32)
  with pytest.raises(StrataError, match="spec_rounds"):
    Engine(model, slots=1, max_seq=64, spec_rounds=0)


def _full_sort_nucleus(p, top_p):
  """The nucleus by one stable sort of the whole vocabulary (the definition)."""
  order = np.argsort(-p, kind="stable")
  return order[: int(np.searchsorted(np.cumsum(p[order]), top_p) + 1)]


@pytest.mark.parametrize("vocab,scale,levels", [
    (151936, 3.0, 0), (151936, 0.3, 0), (151936, 3.0, 8), (5000, 1.0, 0), (700, 2.0, 4)])
def test_the_nucleus_from_the_head_is_the_full_sorts(vocab, scale, levels):
  """`nucleus` sorts only the largest probabilities when they already hold top_p: the same
  indices as sorting the whole vocabulary, for peaked and flat distributions (a flat one at
  top_p 0.99 needs the fallback), ties at the cut (logits on a few levels), a top-k's zeros
  and a vocabulary under the head size; and `target_probs` with it as before."""
  rng = np.random.default_rng(vocab + levels)
  z = rng.standard_normal(vocab) * scale
  if levels:
    z = np.round(z * levels / scale) / levels * scale   # many exact ties
  for top_k in (0, 50):
    zz = z if not top_k else np.where(z >= np.partition(z, -top_k)[-top_k], z, -np.inf)
    p = np.exp(zz - zz.max())
    p /= p.sum()
    for top_p in (0.1, 0.5, 0.9, 0.95, 0.99):
      np.testing.assert_array_equal(speculative.nucleus(p, top_p), _full_sort_nucleus(p, top_p))
  got = speculative.target_probs(z.astype(np.float32), 0.8, top_k=40, top_p=0.9, min_p=0.01)
  x = np.asarray(z.astype(np.float32), np.float64) / 0.8
  x = np.where(x >= np.partition(x, -40)[-40], x, -np.inf)
  want = np.exp(x - x.max())
  want /= want.sum()
  keep = _full_sort_nucleus(want, 0.9)
  mask = np.zeros_like(want)
  mask[keep] = want[keep]
  want = mask / mask.sum()
  want = np.where(want >= 0.01 * want.max(), want, 0.0)
  np.testing.assert_array_equal(got, want / want.sum())


def _scan_ngram_draft(toks, n, max_ngram, min_ngram):
  """Prompt lookup by a plain scan from the end (the definition)."""
  L = len(toks)
  for g in range(min(max_ngram, L - 1), min_ngram - 1, -1):
    for start in range(L - g - 1, -1, -1):
      if toks[start:start + g] == toks[L - g:]:
        return toks[start + g:start + g + n]
  return []


def test_ngram_draft_matches_the_scan_on_random_contexts():
  """The numpy match gives the plain scan's drafts: small vocabularies (many matches, the
  longest n-gram first), large ones (mostly none), short contexts, every n."""
  rng = np.random.default_rng(3)
  for vocab, length in ((3, 12), (5, 60), (20, 300), (151936, 2000), (4, 2), (4, 1)):
    for _ in range(20):
      toks = [int(t) for t in rng.integers(0, vocab, length)]
      for n in (1, 3, 6):
        want = _scan_ngram_draft(toks, n, speculative.NGRAM_MAX, speculative.NGRAM_MIN)
        got = speculative.ngram_draft(toks, n)
        assert got == want and all(type(t) is int for t in got), (toks, n, got, want)
