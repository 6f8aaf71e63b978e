"""GGUF model loading: every supported tensor type against its f32 twin, the tokenizer and chat
template, the fingerprint, and one test per kind of bad file (GGUFError naming file + problem)."""
import dataclasses
import os
import shutil

import gguf
import gguf_fixtures as F
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers

from strata_jax.config import layer_pattern_from_interval
from strata_jax.errors import GGUFError, RequestError
from strata_jax.gguf import names, reader
from strata_jax.gguf.convert_hf import hf_tokenizer_kv, write_model_gguf
from strata_jax.gguf.reader import load_tokenizer, read_model_gguf
from strata_jax.gguf.tokenizer import Tokenizer
from strata_jax.params import FP32_LEAVES, init_params, params_to_flat

T = gguf.GGMLQuantizationType
VOCAB = 320
# Max |error| / max |x| per tensor: one quantisation step of each format (16-bit floats: one
# rounding of the mantissa).
QUANT_REL = {T.F16: 2 ** -11, T.BF16: 2 ** -8, T.Q8_0: 1 / 127, T.Q4_0: 1 / 7,
             T.Q4_K: 2 / 15, T.Q5_K: 2 / 31, T.Q6_K: 1 / 31}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  d = tmp_path_factory.mktemp("loader")
  F.save_tokenizer(d)
  cfg = F.tiny_cfg(vocab_size=VOCAB)
  flat = {k: np.asarray(v) for k, v in params_to_flat(init_params(cfg, seed=3)).items()}
  tensors = names.params_to_gguf_tensors(cfg, flat)
  tok_kv = hf_tokenizer_kv(str(d), VOCAB)
  path = write_model_gguf(d / "f32.gguf", cfg, tensors, tokenizer_kv=tok_kv, name="tiny")
  return dict(dir=d, cfg=cfg, flat=flat, tensors=tensors, tok_kv=tok_kv, path=path)


def f32_cfg(cfg):
  """The config as read back: float metadata is stored as float32."""
  return dataclasses.replace(cfg, rms_eps=float(np.float32(cfg.rms_eps)),
                             rope_base=float(np.float32(cfg.rope_base)))


def test_f32_round_trip(model):
  mf = read_model_gguf(model["path"])
  assert mf.cfg == f32_cfg(model["cfg"])
  assert mf.path == str(model["path"])
  for path, leaf in params_to_flat(mf.params).items():
    assert leaf.dtype == jnp.float32, path
    np.testing.assert_array_equal(np.asarray(leaf), model["flat"][path], err_msg=path)
  assert mf.metadata["general.architecture"] == "qwen3next"
  assert mf.metadata["qwen3next.attention.recurrent_layers"] == [True, False, True]
  assert "tokenizer.ggml.tokens" not in mf.metadata and "tokenizer.ggml.merges" not in mf.metadata
  assert mf.metadata["tokenizer.chat_template"] == F.CHATML
  assert mf.add_bos is False and mf.bos_id is None
  assert mf.eos_id == mf.tokenizer.token_to_id("<|im_end|>")


def test_bfloat16_compute_dtype(model):
  mf = read_model_gguf(model["path"], dtype=jnp.bfloat16)
  for path, leaf in params_to_flat(mf.params).items():
    fp32 = path.removeprefix("layers.") in FP32_LEAVES
    assert leaf.dtype == (jnp.float32 if fp32 else jnp.bfloat16), path
    want = model["flat"][path].astype(np.float32 if fp32 else jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(leaf), want, err_msg=path)


@pytest.mark.parametrize("qtype", list(QUANT_REL), ids=lambda q: q.name)
def test_tensor_type_matches_f32_twin(model, tmp_path, qtype):
  cfg = model["cfg"]

  def tensor_type(name, shape):
    ok = (len(shape) >= 2 and not names.keeps_f32(name, len(shape))
          and shape[-1] % F.block_size(qtype) == 0)
    return qtype if ok else T.F32

  path = write_model_gguf(tmp_path / f"{qtype.name}.gguf", cfg, model["tensors"],
                          tensor_type=tensor_type, encode=F.quantize, tokenizer_kv=model["tok_kv"])
  types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
  assert sum(t == qtype for t in types.values()) >= 10  # most matrices really are quantised
  mf = read_model_gguf(path, weights="dequantize")
  loaded = params_to_flat(mf.params)
  for spec in names.MODEL_TENSORS:
    idx = names.layer_indices(cfg, spec.over)
    for slot, i in enumerate([None] if idx is None else idx):
      name = spec.gguf if i is None else spec.gguf.format(i=i)
      got = np.asarray(loaded[spec.path] if i is None else loaded[spec.path][slot])
      x = model["tensors"][name]
      if types[name] == T.F32:
        np.testing.assert_array_equal(got, x, err_msg=name)
        continue
      data = F.quantize(x, qtype)
      ref = gguf.quants.dequantize(data.view(np.uint8) if qtype == T.BF16 else data, qtype)
      np.testing.assert_array_equal(got, ref, err_msg=name)  # the reference decoder, exactly
      err = np.abs(got - x).max() / np.abs(x).max()
      assert err <= QUANT_REL[qtype], f"{name}: rel error {err:.3g} > {QUANT_REL[qtype]:.3g}"


def test_lm_head_falls_back_to_token_embd(model, tmp_path):
  tensors = {k: v for k, v in model["tensors"].items() if k != "output.weight"}
  path = write_model_gguf(tmp_path / "tied.gguf", model["cfg"], tensors)
  mf = read_model_gguf(path)
  np.testing.assert_array_equal(np.asarray(mf.params.lm_head), model["flat"]["embed"])
  assert mf.tokenizer is None


def test_layer_pattern_from_interval(model, tmp_path):
  cfg = model["cfg"]
  assert cfg.layer_types == layer_pattern_from_interval(3, 2)
  path = F.write_raw_gguf(tmp_path / "interval.gguf", cfg, model["tensors"],
                          set_kv=lambda w: w.add_uint32("qwen3next.full_attention_interval", 2),
                          drop_keys=["qwen3next.attention.recurrent_layers"])
  assert read_model_gguf(path).cfg.layer_types == "GAG"


# --- tokenizer ------------------------------------------------------------------------------------

TEXTS = F.SENTENCES + [
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "<think>reasoning</think> 2024-06-01: 99 bottles",
    "  leading spaces, trailing  ", "", "ÀÉÎ õü ß 🙂🙃 中文 한국어", "a\r\nb\n\n\nc",
]


@pytest.fixture(scope="module")
def tok(model):
  return read_model_gguf(model["path"]).tokenizer


def test_tokenizer_matches_source_tokenizer_json(model, tok):
  ref = tokenizers.Tokenizer.from_file(str(model["dir"] / "tokenizer.json"))
  for text in TEXTS:
    ids = tok.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False).ids, text
    assert tok.decode(ids) == text
  im_start = tok.token_to_id("<|im_start|>")
  assert tok.encode("<|im_start|>") == [im_start]  # control tokens are atomic
  assert tok.encode("x<think>y")[1] == tok.token_to_id("<think>")  # so are user-defined ones
  assert tok.decode([im_start], skip_special=True) == ""
  assert tok.vocab_size == VOCAB and tok.id_to_token(VOCAB - 1) == f"[PAD{VOCAB - 1}]"
  assert {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")} <= tok.eog_ids


def test_tokenizer_bos(model):
  kv = dict(model["tok_kv"], **{"tokenizer.ggml.bos_token_id": 1,
                                "tokenizer.ggml.add_bos_token": True})
  t = Tokenizer.from_gguf_kv(kv)
  assert t.encode("hi")[0] == 1 and t.encode("hi", add_bos=False)[0] != 1


def test_unsupported_tokenizer_model_warns(model, tmp_path):
  kv = dict(model["tok_kv"], **{"tokenizer.ggml.model": "llama"})
  p = F.write_raw_gguf(tmp_path / "spm.gguf", model["cfg"], model["tensors"], tokenizer_kv=kv)
  with pytest.warns(UserWarning, match="tokenizer model 'llama' is not supported"):
    mf = read_model_gguf(p)
  assert mf.tokenizer is None and mf.eos_id == model["tok_kv"]["tokenizer.ggml.eos_token_id"]
  assert load_tokenizer(model["path"]).encode("hi") == read_model_gguf(
      model["path"]).tokenizer.encode("hi")


def test_chat_template(tok, model):
  msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
  want = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
          "<|im_start|>assistant\n")
  assert tok.apply_chat_template(msgs) == want
  assert tok.apply_chat_template(msgs, add_generation_prompt=False) == want[:-len(
      "<|im_start|>assistant\n")]
  with pytest.raises(RequestError, match="chat template: bad role"):
    tok.apply_chat_template([{"role": "bad", "content": "x"}])
  plain = Tokenizer.from_gguf_kv({k: v for k, v in model["tok_kv"].items()
                                  if k != "tokenizer.chat_template"})
  assert plain.apply_chat_template(msgs) == "system: Be brief.\nuser: Hi\nassistant:"


# --- fingerprint ----------------------------------------------------------------------------------

def test_fingerprint(model, tmp_path, monkeypatch):
  fp = read_model_gguf(model["path"]).fingerprint
  assert len(fp) == 32 and fp == read_model_gguf(model["path"]).fingerprint
  other = tmp_path / "flipped.gguf"
  shutil.copy(model["path"], other)
  with open(other, "r+b") as f:  # flip one byte of the last tensor's data
    f.seek(-5, os.SEEK_END)
    b = f.read(1)
    f.seek(-5, os.SEEK_END)
    f.write(bytes([b[0] ^ 1]))
  assert read_model_gguf(other).fingerprint != fp
  # The sampled form (files >= 256 MiB) still sees the header, the samples and the size.
  monkeypatch.setattr(reader, "_FULL_HASH_BYTES", 0)
  monkeypatch.setattr(reader, "_SAMPLE_BYTES", 4096)
  sampled = reader.fingerprint(reader.open_gguf(model["path"]))
  assert sampled != fp and sampled == reader.fingerprint(reader.open_gguf(model["path"]))
  assert reader.fingerprint(reader.open_gguf(str(other))) != sampled


# --- bad files: one test each ---------------------------------------------------------------------

def raises(path, pattern):
  """GGUFError whose message starts with the file path and matches `pattern`."""
  with pytest.raises(GGUFError, match=pattern) as e:
    read_model_gguf(path)
  assert str(e.value).startswith(f"{path}: "), str(e.value)
  assert "\n" not in str(e.value)
  return str(e.value)


def test_not_a_gguf(tmp_path):
  p = tmp_path / "model.safetensors"
  p.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
  raises(str(p), r"not a GGUF file \(magic b'\\x08\\x00\\x00\\x00', expected b'GGUF'\)")
  empty = tmp_path / "empty.gguf"
  empty.write_bytes(b"")
  raises(str(empty), "not a GGUF file")


@pytest.mark.parametrize("where", ["data", "header"])
def test_truncated_file(model, tmp_path, where):
  data = open(model["path"], "rb").read()
  cut = len(data) - 1000 if where == "data" else 200
  p = tmp_path / "cut.gguf"
  p.write_bytes(data[:cut])
  raises(str(p), "truncated")


def test_wrong_architecture(model, tmp_path):
  p = F.write_raw_gguf(tmp_path / "llama.gguf", model["cfg"], model["tensors"], arch="llama")
  raises(p, "architecture is 'llama', expected 'qwen3next'")


def test_missing_metadata_key(model, tmp_path):
  p = F.write_raw_gguf(tmp_path / "nokey.gguf", model["cfg"], model["tensors"],
                       drop_keys=["qwen3next.ssm.state_size"])
  raises(p, "missing metadata key 'qwen3next.ssm.state_size'")


def test_missing_tensor(model, tmp_path):
  tensors = {k: v for k, v in model["tensors"].items() if k != "blk.2.ssm_out.weight"}
  p = F.write_raw_gguf(tmp_path / "notensor.gguf", model["cfg"], tensors)
  raises(p, "missing tensor 'blk.2.ssm_out.weight'")


def test_wrong_shape(model, tmp_path):
  tensors = dict(model["tensors"])
  tensors["blk.0.attn_qkv.weight"] = np.ascontiguousarray(tensors["blk.0.attn_qkv.weight"].T)
  p = F.write_raw_gguf(tmp_path / "shape.gguf", model["cfg"], tensors)
  raises(p, r"tensor 'blk.0.attn_qkv.weight' has shape \(256, 128\), expected \(128, 256\)")


def test_undecodable_tensor_type(model, tmp_path):
  p = F.write_raw_gguf(tmp_path / "q8k.gguf", model["cfg"], model["tensors"],
                       types={"blk.0.attn_gate.weight": T.Q8_K})
  raises(p, "tensor 'blk.0.attn_gate.weight' has unsupported type Q8_K: no decoder for it")


def test_row_not_a_multiple_of_the_block(model, tmp_path):
  """A tensor declared Q8_0 whose rows (4 conv taps) are not whole 32-value blocks (an f32
  file with the tensor's type id patched in the header: no writer makes such a file)."""
  p = F.write_raw_gguf(tmp_path / "rows.gguf", model["cfg"], model["tensors"])
  data = bytearray(open(p, "rb").read())
  name = b"blk.0.ssm_conv1d.weight"
  at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
  n_dims = int.from_bytes(data[at:at + 4], "little")
  type_at = at + 4 + 8 * n_dims
  assert int.from_bytes(data[type_at:type_at + 4], "little") == int(T.F32)
  data[type_at:type_at + 4] = int(T.Q8_0).to_bytes(4, "little")
  (tmp_path / "rows.gguf").write_bytes(bytes(data))
  raises(p, r"tensor 'blk.0.ssm_conv1d.weight' \(Q8_0\) has rows of 4 values, not a multiple "
         "of the Q8_0 block of 32")


def test_data_shorter_than_blocks(model, tmp_path):
  p = F.write_raw_gguf(tmp_path / "q.gguf", model["cfg"], model["tensors"],
                       types={"output.weight": T.Q6_K})
  data = open(p, "rb").read()
  last = max(gguf.GGUFReader(p).tensors, key=lambda t: t.data_offset)
  short = tmp_path / "short.gguf"
  short.write_bytes(data[:int(last.data_offset) + int(last.n_bytes) - 100])
  raises(str(short), f"tensor '{last.name}' .*data is shorter than its blocks need")


def test_other_types_dequantised_at_load_with_one_log_line(model, tmp_path, caplog):
  """Q3_K is not kept on the device: dequantised per tensor, named once in the log."""
  types = {"blk.0.attn_gate.weight": T.Q3_K, "blk.2.attn_gate.weight": T.Q3_K}
  p = F.write_raw_gguf(tmp_path / "q3k.gguf", model["cfg"], model["tensors"], types=types)
  with caplog.at_level("INFO", logger="strata_jax"):
    mf = read_model_gguf(p, weights="keep")
  lines = [r.getMessage() for r in caplog.records if "dequantised at load" in r.getMessage()]
  assert len(lines) == 1 and all(n in lines[0] for n in types), lines
  got = np.asarray(mf.params.layers.gdn.gate)
  raw = gguf.GGUFReader(p).tensors
  want = gguf.quants.dequantize(next(t for t in raw if t.name == "blk.2.attn_gate.weight").data,
                                T.Q3_K)
  np.testing.assert_array_equal(got[1], want)


@pytest.mark.parametrize("key,value,pattern", [
    ("qwen3next.ssm.inner_size", 63, "ssm.inner_size 63 is not a multiple of ssm.time_step_rank 4"),
    ("qwen3next.attention.head_count_kv", 3, "head_count 2 is not a multiple of head_count_kv 3"),
    ("qwen3next.attention.recurrent_layers", [True, False],
     "recurrent_layers has 2 entries, block_count is 3"),
    ("tokenizer.ggml.tokens", ["a", "b"], "tokenizer.ggml.tokens has 2 entries"),
], ids=["inner_size", "head_count_kv", "recurrent_layers", "vocab"])
def test_inconsistent_metadata(model, tmp_path, key, value, pattern):
  def set_kv(w):
    if isinstance(value, list):
      w.add_array(key, value)
    else:
      w.add_uint32(key, value)
  p = F.write_raw_gguf(tmp_path / "bad.gguf", model["cfg"], model["tensors"],
                       tokenizer_kv=model["tok_kv"], set_kv=set_kv)
  msg = raises(p, "inconsistent metadata")
  assert pattern in msg, msg
