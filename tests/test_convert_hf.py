"""transformers Qwen3-Next checkpoint -> GGUF: every transform checked against the HF weights
(and HF's own q/k/v/z de-interleaving), metadata, f16/bf16 output, fused experts, tied head."""
import json
import pathlib

import gguf
import gguf_fixtures as F
import ml_dtypes
import numpy as np
import pytest
import torch

from strata_jax.errors import StrataError
from strata_jax.gguf import names, read_model_gguf
from strata_jax.gguf.convert_hf import convert_hf
from strata_jax.gguf.tokenizer import CONTROL, NORMAL, USER_DEFINED
from strata_jax.params import params_to_flat

T = gguf.GGMLQuantizationType
D = F.HF_DIMS


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
  d = tmp_path_factory.mktemp("hf")
  sd, model = F.save_tiny_hf(d / "ckpt")
  out = {ot: convert_hf(d / "ckpt", d / f"m-{ot}.gguf", ot) for ot in ("f32", "f16", "bf16")}
  return dict(dir=d / "ckpt", sd=sd, model=model, out=out, root=d)


def gguf_tensors(path):
  r = gguf.GGUFReader(path)
  return r, {t.name: t for t in r.tensors}


def values(t):
  if t.tensor_type == T.BF16:
    return gguf.quants.dequantize(t.data, T.BF16)
  return np.asarray(t.data, np.float32)


def test_every_tensor_matches_hf(hf):
  _, ts = gguf_tensors(hf["out"]["f32"])
  sd, model = hf["sd"], hf["model"]
  want = {"token_embd.weight": sd["model.embed_tokens.weight"],
          "output.weight": sd["lm_head.weight"],
          "output_norm.weight": 1 + sd["model.norm.weight"]}
  kv, vd, hk = D["linear_num_key_heads"] * D["linear_key_head_dim"], D["linear_value_head_dim"], \
      D["linear_num_key_heads"]
  for i, kind in enumerate(D["layer_types"]):
    p, b = f"model.layers.{i}.", f"blk.{i}."
    want[b + "attn_norm.weight"] = 1 + sd[p + "input_layernorm.weight"]
    want[b + "post_attention_norm.weight"] = 1 + sd[p + "post_attention_layernorm.weight"]
    if kind == "linear_attention":
      la = model.model.layers[i].linear_attn
      # HF's own de-interleaving as the oracle: feed the weight columns as "tokens".
      wqkvz = torch.from_numpy(sd[p + "linear_attn.in_proj_qkvz.weight"])
      wba = torch.from_numpy(sd[p + "linear_attn.in_proj_ba.weight"])
      q, k, v, z, _, _ = la.fix_query_key_value_ordering(wqkvz.T[None], wba.T[None])
      rows = lambda x: x.reshape(1, D["hidden_size"], -1)[0].T.numpy()  # noqa: E731
      want[b + "attn_qkv.weight"] = np.concatenate([rows(q), rows(k), rows(v)])
      want[b + "attn_gate.weight"] = rows(z)
      assert rows(q).shape == (kv, D["hidden_size"])
      want[b + "ssm_ba.weight"] = sd[p + "linear_attn.in_proj_ba.weight"]
      want[b + "ssm_a"] = -np.exp(sd[p + "linear_attn.A_log"])
      want[b + "ssm_dt.bias"] = sd[p + "linear_attn.dt_bias"]
      want[b + "ssm_conv1d.weight"] = sd[p + "linear_attn.conv1d.weight"][:, 0, :]
      want[b + "ssm_norm.weight"] = sd[p + "linear_attn.norm.weight"]  # no +1
      want[b + "ssm_out.weight"] = sd[p + "linear_attn.out_proj.weight"]
    else:
      for hn, gn in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                     ("o_proj", "attn_output")):
        want[b + gn + ".weight"] = sd[p + f"self_attn.{hn}.weight"]
      want[b + "attn_q_norm.weight"] = 1 + sd[p + "self_attn.q_norm.weight"]
      want[b + "attn_k_norm.weight"] = 1 + sd[p + "self_attn.k_norm.weight"]
    # transformers 5 holds experts fused in memory: gate_up_proj (E, 2I, H), gate rows first.
    gu = sd[p + "mlp.experts.gate_up_proj"]
    inter = D["moe_intermediate_size"]
    assert gu.shape == (D["num_experts"], 2 * inter, D["hidden_size"])
    want[b + "ffn_gate_exps.weight"] = gu[:, :inter]
    want[b + "ffn_up_exps.weight"] = gu[:, inter:]
    want[b + "ffn_down_exps.weight"] = sd[p + "mlp.experts.down_proj"]
    want[b + "ffn_gate_inp.weight"] = sd[p + "mlp.gate.weight"]
    for x in ("gate", "up", "down"):
      want[b + f"ffn_{x}_shexp.weight"] = sd[p + f"mlp.shared_expert.{x}_proj.weight"]
    want[b + "ffn_gate_inp_shexp.weight"] = sd[p + "mlp.shared_expert_gate.weight"]
  assert hk == 2 and D["linear_num_value_heads"] == 4 and vd == 8  # n_k != n_v, d_k != d_v
  assert set(ts) == set(want)
  for name, w in want.items():
    assert ts[name].tensor_type == T.F32, name
    np.testing.assert_array_equal(values(ts[name]), w.astype(np.float32), err_msg=name)


def test_ggml_ne_order(hf):
  _, ts = gguf_tensors(hf["out"]["f32"])
  h, e, i = D["hidden_size"], D["num_experts"], D["moe_intermediate_size"]
  conv = 2 * D["linear_num_key_heads"] * D["linear_key_head_dim"] + \
      D["linear_num_value_heads"] * D["linear_value_head_dim"]
  ne = lambda n: [int(x) for x in ts[n].shape]  # noqa: E731
  assert ne("blk.0.ffn_gate_inp_shexp.weight") == [h, 1]
  assert ne("blk.0.ssm_conv1d.weight") == [4, conv]
  assert ne("blk.0.ffn_gate_exps.weight") == [h, i, e]
  assert ne("blk.0.ffn_down_exps.weight") == [i, h, e]
  assert ne("blk.0.ssm_a") == [D["linear_num_value_heads"]]
  assert ne("blk.1.attn_q.weight") == [h, 2 * D["num_attention_heads"] * D["head_dim"]]


def test_metadata(hf):
  r, _ = gguf_tensors(hf["out"]["f32"])
  f = r.fields
  val = lambda k: f[k].contents()  # noqa: E731
  a = "qwen3next."
  assert val("general.architecture") == "qwen3next"
  assert val("general.type") == "model"
  assert val("general.file_type") == 0
  expect = {
      "block_count": 4, "context_length": 2048, "embedding_length": D["hidden_size"],
      "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 16,
      "attention.value_length": 16, "rope.dimension_count": 4, "expert_count": 4,
      "expert_used_count": 2, "expert_feed_forward_length": 32,
      "expert_shared_feed_forward_length": 48, "ssm.conv_kernel": 4, "ssm.state_size": 16,
      "ssm.group_count": 2, "ssm.time_step_rank": 4, "ssm.inner_size": 32,
      "full_attention_interval": 4,
  }
  for k, v in expect.items():
    assert val(a + k) == v, k
    assert f[a + k].types == [gguf.GGUFValueType.UINT32], k
  assert val(a + "rope.freq_base") == pytest.approx(1e6)
  assert val(a + "attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
  assert f[a + "attention.layer_norm_rms_epsilon"].types == [gguf.GGUFValueType.FLOAT32]
  assert val(a + "attention.recurrent_layers") == [True, False, True, True]
  assert f[a + "attention.recurrent_layers"].types == [gguf.GGUFValueType.ARRAY,
                                                       gguf.GGUFValueType.BOOL]


def test_tokenizer_metadata(hf):
  r, _ = gguf_tensors(hf["out"]["f32"])
  val = lambda k: r.fields[k].contents()  # noqa: E731
  tj = json.loads((hf["dir"] / "tokenizer.json").read_text())
  tokens, types = val("tokenizer.ggml.tokens"), val("tokenizer.ggml.token_type")
  assert val("tokenizer.ggml.model") == "gpt2" and val("tokenizer.ggml.pre") == "qwen2"
  assert len(tokens) == len(types) == D["vocab_size"]
  for t, i in tj["model"]["vocab"].items():
    assert tokens[i] == t
  assert types[tokens.index("<|im_end|>")] == CONTROL
  assert types[tokens.index("<think>")] == USER_DEFINED
  assert types[tokens.index("Ġ")] == NORMAL
  assert tokens[-1] == f"[PAD{D['vocab_size'] - 1}]" and types[-1] == USER_DEFINED
  assert len(val("tokenizer.ggml.merges")) == len(tj["model"]["merges"])
  assert val("tokenizer.ggml.eos_token_id") == tokens.index("<|im_end|>")
  assert val("tokenizer.ggml.padding_token_id") == tokens.index("<|endoftext|>")
  assert "tokenizer.ggml.bos_token_id" not in r.fields
  assert val("tokenizer.ggml.add_bos_token") is False
  assert val("tokenizer.chat_template") == F.CHATML


@pytest.mark.parametrize("outtype,qt,ft", [("f16", T.F16, 1), ("bf16", T.BF16, 32)])
def test_half_outtypes(hf, outtype, qt, ft):
  r, ts = gguf_tensors(hf["out"][outtype])
  _, ref = gguf_tensors(hf["out"]["f32"])
  assert r.fields["general.file_type"].contents() == ft
  for name, t in ts.items():
    keep = t.data.ndim == 1 or name.endswith(("ssm_a", "ssm_dt.bias", "ssm_conv1d.weight",
                                              "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"))
    assert t.tensor_type == (T.F32 if keep else qt), name
    x = values(ref[name])
    if not keep:  # exactly the round-to-nearest-even cast of the f32 conversion
      x = x.astype(np.float16 if qt == T.F16 else ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(values(t), x, err_msg=name)
  mf = read_model_gguf(hf["out"][outtype])
  full = read_model_gguf(hf["out"]["f32"])
  for (p, a), b in zip(params_to_flat(mf.params).items(), params_to_flat(full.params).values()):
    # one rounding step relative; absolute slack for f16 subnormals
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2 ** -8, atol=2 ** -24,
                               err_msg=p)


def test_loader_stacks_converted_layers(hf):
  mf = read_model_gguf(hf["out"]["f32"])
  _, ts = gguf_tensors(hf["out"]["f32"])
  p = mf.params.layers
  # Layer pattern GAGG: GDN layers 0, 2, 3 -> slots 0, 1, 2; attention layer 1 -> slot 0.
  assert mf.cfg.layer_types == "GAGG"
  np.testing.assert_array_equal(p.gdn.qkv[1], values(ts["blk.2.attn_qkv.weight"]))
  np.testing.assert_array_equal(p.gdn.a[2], values(ts["blk.3.ssm_a"]))
  np.testing.assert_array_equal(p.attn.q[0], values(ts["blk.1.attn_q.weight"]))
  np.testing.assert_array_equal(p.moe.up_exps[3], values(ts["blk.3.ffn_up_exps.weight"]))
  np.testing.assert_array_equal(mf.params.lm_head, hf["sd"]["lm_head.weight"])
  assert mf.cfg.gdn_d_v == 8 and mf.cfg.n_rot == 4 and mf.cfg.rope_base == 1e6


def test_fused_experts_checkpoint(hf, tmp_path):
  """transformers 5's in-memory layout (gate_up_proj / down_proj) converts identically."""
  from safetensors.numpy import save_file
  sd = {k: np.ascontiguousarray(v) for k, v in hf["sd"].items()}
  assert any(k.endswith("experts.gate_up_proj") for k in sd)  # state_dict() is fused
  d = tmp_path / "fused"
  d.mkdir()
  save_file(sd, str(d / "model.safetensors"))
  for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
    (d / f).write_bytes((hf["dir"] / f).read_bytes())
  out = convert_hf(d, tmp_path / "fused.gguf", "f32", name="hf")
  _, a = gguf_tensors(out)
  _, b = gguf_tensors(hf["out"]["f32"])
  assert set(a) == set(b)
  for n in a:
    np.testing.assert_array_equal(a[n].data, b[n].data, err_msg=n)


def test_bf16_checkpoint(hf, tmp_path):
  """A bf16 safetensors checkpoint converts like the f32 one holding the same values."""
  from safetensors.torch import save_file
  sd = {k: torch.from_numpy(v).to(torch.bfloat16).contiguous() for k, v in hf["sd"].items()}
  for name, tensors in (("bf16", sd), ("f32", {k: v.float() for k, v in sd.items()})):
    d = tmp_path / name
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    (d / "config.json").write_bytes((hf["dir"] / "config.json").read_bytes())
  _, a = gguf_tensors(convert_hf(tmp_path / "bf16", tmp_path / "a.gguf", name="x"))
  _, b = gguf_tensors(convert_hf(tmp_path / "f32", tmp_path / "b.gguf", name="x"))
  for n in a:
    np.testing.assert_array_equal(a[n].data, b[n].data, err_msg=n)


def test_tied_embeddings(tmp_path):
  sd, _ = F.save_tiny_hf(tmp_path / "tied", seed=1, tokenizer=False, tie_word_embeddings=True)
  out = convert_hf(tmp_path / "tied", tmp_path / "tied.gguf")
  _, ts = gguf_tensors(out)
  assert "output.weight" not in ts
  mf = read_model_gguf(out)
  np.testing.assert_array_equal(mf.params.lm_head, sd["model.embed_tokens.weight"])
  assert mf.tokenizer is None and mf.bos_id is None and mf.eos_id is None


def test_hf_to_gguf_name():
  assert names.hf_to_gguf_name("model.layers.3.linear_attn.out_proj") == "blk.3.ssm_out.weight"
  assert names.hf_to_gguf_name(
      "base_model.model.model.layers.7.self_attn.o_proj") == "blk.7.attn_output.weight"
  assert names.hf_to_gguf_name("model.layers.0.input_layernorm.weight") == \
      "blk.0.attn_norm.weight"
  assert names.hf_to_gguf_name("model.layers.0.linear_attn.A_log") == "blk.0.ssm_a"
  assert names.hf_to_gguf_name("model.layers.0.linear_attn.in_proj_qkvz") is None  # split
  assert names.hf_to_gguf_name("model.layers.0.mlp.experts.5.up_proj") is None  # stacked
  assert names.hf_to_gguf_name("model.layers.0.foo") is None
  m = names.hf_to_gguf("model.layers.2.linear_attn.in_proj_qkvz.weight")
  assert m.gguf_names == ("blk.2.attn_qkv.weight", "blk.2.attn_gate.weight")
  assert names.hf_to_gguf("model.layers.1.self_attn.o_proj").spec.transform == names.COPY


def test_rejects_non_qwen3next(tmp_path, hf):
  d = tmp_path / "other"
  d.mkdir()
  cfg = json.loads((hf["dir"] / "config.json").read_text())
  cfg["model_type"] = "qwen2_moe"
  (d / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(StrataError, match=r"other/config.json: model_type is 'qwen2_moe'"):
    convert_hf(d, tmp_path / "x.gguf")
  assert not pathlib.Path(tmp_path / "x.gguf").exists()
