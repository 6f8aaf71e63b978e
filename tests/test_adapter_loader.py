"""LoRA adapter GGUFs: stacking and scales, dtypes, llama.cpp's loader checks, PEFT conversion."""
import json
import math
import shutil
import warnings

import adapter_fixtures as af
import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import KERNEL_REL, assert_close

from strata_jax.config import ModelConfig
from strata_jax.errors import AdapterError
from strata_jax.gguf.adapter import AdapterWarning, read_adapters
from strata_jax.gguf.convert_peft import convert_peft

CFG = af.tiny_config()  # "GGGA"
SSM0, SSM1 = "blk.0.ssm_out.weight", "blk.1.ssm_out.weight"
ATT3 = "blk.3.attn_output.weight"


def _read(paths, scales=None, **kw):
  """read_adapters that fails on any warning (tests expecting one use pytest.warns)."""
  with warnings.catch_warnings():
    warnings.simplefilter("error", AdapterWarning)
    return read_adapters(CFG, paths, scales, **kw)


# --- stacking and scales ----------------------------------------------------------------------

def test_two_files_stack_along_rank(tmp_path):
  # As the layout doc's lora_a1 / lora_a2: ranks 8 and 4, alpha 16 and 6, the second without
  # layer 1.
  p1, s1 = af.write_adapter(tmp_path / "lora_a1.gguf", CFG, rank=8, alpha=16.0, seed=1)
  p2, s2 = af.write_adapter(tmp_path / "lora_a2.gguf", CFG, rank=4, alpha=6.0,
                            layers=[0, 2, 3], seed=2)
  ls = _read([p1, p2])
  p = ls.params
  assert ls.rank_total == 12
  assert p.gdn_a.shape == (3, 12, 64) and p.gdn_b.shape == (3, 64, 12)
  assert p.attn_a.shape == (1, 12, 64) and p.attn_b.shape == (1, 64, 12)
  assert p.gdn_a.dtype == jnp.float32
  # File 1 owns rank rows 0..7 with scale 16/8, file 2 rows 8..11 with scale 6/4.
  np.testing.assert_array_equal(p.gdn_a[0, :8], s1[SSM0][0])
  np.testing.assert_array_equal(p.gdn_b[0, :, :8], s1[SSM0][1] * np.float32(2.0))
  np.testing.assert_array_equal(p.gdn_a[0, 8:], s2[SSM0][0])
  np.testing.assert_array_equal(p.gdn_b[0, :, 8:], s2[SSM0][1] * np.float32(1.5))
  np.testing.assert_array_equal(p.attn_b[0, :, 8:], s2[ATT3][1] * np.float32(1.5))
  # File 2 lacks layer 1: zeros in its slot there.
  assert not np.any(p.gdn_a[1, 8:]) and not np.any(p.gdn_b[1, :, 8:])
  got = af.stacked_delta(ls, CFG)
  want = af.longhand_delta(CFG, [(s1, 16.0, 1.0), (s2, 6.0, 1.0)])
  for base in want:
    assert_close(got[base], want[base], rel=KERNEL_REL["float32"], what=base)
  f1, f2 = ls.files
  assert (f1.path, f1.alpha, f1.rank, f1.rank_offset, f1.n_applied) == (p1, 16.0, 8, 0, 4)
  assert (f2.path, f2.alpha, f2.rank, f2.rank_offset, f2.n_applied) == (p2, 6.0, 4, 8, 3)
  assert dict(f2.scales) == {SSM0: 1.5, "blk.2.ssm_out.weight": 1.5, ATT3: 1.5}
  assert ls.ignored == ()
  assert ls.nbytes == 4 * (3 * 12 * 64 * 2 + 1 * 12 * 64 * 2)


def test_ranks_differ_within_one_file(tmp_path):
  # Rank is per tensor (llama.cpp reads it from B): the file's slot is its largest rank.
  _, big = af.write_adapter(tmp_path / "x.gguf", CFG, rank=8, alpha=8.0, layers=[0], seed=3)
  _, small = af.write_adapter(tmp_path / "y.gguf", CFG, rank=2, alpha=8.0, layers=[3], seed=4)
  tensors = {}
  for base, (a, b) in {**big, **small}.items():
    tensors[base + ".lora_a"], tensors[base + ".lora_b"] = a, b
  path = af.write_raw(tmp_path / "mixed.gguf", tensors, alpha=8.0)
  ls = _read([path])
  assert ls.rank_total == 8 and dict(ls.files[0].ranks) == {SSM0: 8, ATT3: 2}
  assert dict(ls.files[0].scales) == {SSM0: 1.0, ATT3: 4.0}
  got = af.stacked_delta(ls, CFG)
  want = af.longhand_delta(CFG, [({**big, **small}, 8.0, 1.0)])
  for base in want:
    assert_close(got[base], want[base], rel=KERNEL_REL["float32"], what=base)


@pytest.mark.parametrize("alpha", [0.0, None], ids=["alpha0", "no-alpha"])
def test_alpha_zero_or_absent_means_user_scale_alone(tmp_path, alpha):
  p, s = af.write_adapter(tmp_path / "a.gguf", CFG, rank=4, alpha=alpha, seed=5)
  ls = _read([p], [0.25])
  assert ls.files[0].alpha == 0.0
  assert {v for _, v in ls.files[0].scales} == {0.25}
  got, want = af.stacked_delta(ls, CFG), af.longhand_delta(CFG, [(s, 0.0, 0.25)])
  for base in want:
    assert_close(got[base], want[base], rel=KERNEL_REL["float32"], what=base)


def test_user_scales(tmp_path):
  p1, s1 = af.write_adapter(tmp_path / "a.gguf", CFG, rank=8, alpha=16.0, seed=6)
  p2, s2 = af.write_adapter(tmp_path / "b.gguf", CFG, rank=4, alpha=6.0, layers=[1, 3], seed=7)
  ls = _read([p1, p2], [0.5, -1.25])
  assert [f.user_scale for f in ls.files] == [0.5, -1.25]
  assert dict(ls.files[1].scales)[ATT3] == pytest.approx(-1.25 * 6.0 / 4)
  got = af.stacked_delta(ls, CFG)
  want = af.longhand_delta(CFG, [(s1, 16.0, 0.5), (s2, 6.0, -1.25)])
  for base in want:
    assert_close(got[base], want[base], rel=KERNEL_REL["float32"], what=base)


def test_same_file_twice_stacks_twice(tmp_path):
  p, s = af.write_adapter(tmp_path / "a.gguf", CFG, rank=4, alpha=4.0, seed=8)
  ls = _read([p, p], [1.0, 2.0])
  assert ls.rank_total == 8
  got, want = af.stacked_delta(ls, CFG), af.longhand_delta(CFG, [(s, 4.0, 3.0)])
  for base in want:
    assert_close(got[base], want[base], rel=KERNEL_REL["float32"], what=base)


def test_no_files():
  ls = _read([])
  assert ls.rank_total == 0 and ls.files == () and ls.params.gdn_a.shape == (3, 0, 64)


# The storage dtypes: what the loader returns equals the stored values exactly (up to the f32
# scale fold), and the stored values are within the dtype's rounding of the original f32.
# Q8_0 rounds each 32-block to max/254 at worst, inside bf16's bound.
@pytest.mark.parametrize("dtype,rank,rel", [("f16", 8, KERNEL_REL["float16"]),
                                            ("bf16", 8, KERNEL_REL["bfloat16"]),
                                            ("q8_0", 32, KERNEL_REL["bfloat16"]),
                                            ("q8_0", 8, KERNEL_REL["bfloat16"])],
                         ids=["f16", "bf16", "q8_0", "q8_0-b-as-f16"])
def test_storage_dtypes(tmp_path, dtype, rank, rel):
  p, stored = af.write_adapter(tmp_path / f"{dtype}.gguf", CFG, rank=rank, alpha=16.0,
                               dtype=dtype, seed=9)
  types = {t.name: t.tensor_type for t in gguf.GGUFReader(p).tensors}
  want_a = af.DTYPES[dtype]
  want_b = af.QT.F16 if (dtype == "q8_0" and rank % 32) else af.DTYPES[dtype]
  assert types[SSM0 + ".lora_a"] == want_a and types[SSM0 + ".lora_b"] == want_b
  ls = _read([p])
  got = af.stacked_delta(ls, CFG)
  exact = af.longhand_delta(CFG, [(stored, 16.0, 1.0)])
  orig = af.longhand_delta(CFG, [(af.random_pairs(CFG, af.output_projections(CFG), rank, 9),
                                  16.0, 1.0)])
  for base in exact:
    assert_close(got[base], exact[base], rel=KERNEL_REL["float32"], what=base)
    assert_close(got[base], orig[base], rel=rel, what=f"{dtype} {base}")


def test_compute_dtype_bfloat16(tmp_path):
  p, stored = af.write_adapter(tmp_path / "a.gguf", CFG, rank=8, alpha=16.0, seed=10)
  ls = _read([p], dtype=jnp.bfloat16)
  assert ls.params.gdn_b.dtype == jnp.bfloat16 and ls.params.attn_a.dtype == jnp.bfloat16
  assert ls.nbytes == 2 * (3 * 8 * 64 * 2 + 8 * 64 * 2)
  # The scale is folded in f32, then rounded once.
  want = (stored[SSM0][1] * np.float32(2.0)).astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(ls.params.gdn_b[0]), want)


def test_other_weights_warn_once_and_are_not_applied(tmp_path):
  others = ["blk.0.attn_qkv.weight", "blk.1.ssm_ba.weight", "blk.3.attn_q.weight",
            "blk.2.ffn_up_shexp.weight"]
  p, stored = af.write_adapter(tmp_path / "a.gguf", CFG, rank=4, alpha=8.0, extra=others,
                               seed=11)
  with pytest.warns(AdapterWarning) as rec:
    ls = read_adapters(CFG, [p])
  msgs = [str(r.message) for r in rec if issubclass(r.category, AdapterWarning)]
  assert len(msgs) == 1
  assert p in msgs[0] and all(name in msgs[0] for name in others)
  assert ls.ignored == tuple(others) and ls.files[0].ignored == tuple(others)
  applied = {k: v for k, v in stored.items() if k not in others}
  got, want = af.stacked_delta(ls, CFG), af.longhand_delta(CFG, [(applied, 8.0, 1.0)])
  for base in want:
    assert_close(got[base], want[base], rel=KERNEL_REL["float32"], what=base)


def test_norm_vectors_skipped_silently(tmp_path):
  # mergekit-extract-lora writes norm vectors; llama.cpp skips them without a word.
  tensors = _good_tensors()
  tensors["blk.0.attn_norm.weight"] = np.ones(64, np.float32)
  tensors["output_norm.weight"] = np.ones(64, np.float32)
  ls = _read([af.write_raw(tmp_path / "a.gguf", tensors, alpha=8.0)])
  assert ls.files[0].n_applied == 4 and ls.ignored == ()


# --- llama.cpp's loader checks, one test each --------------------------------------------------

def _good_tensors(rank=4, seed=12):
  out = {}
  for base, (a, b) in af.random_pairs(CFG, af.output_projections(CFG), rank, seed).items():
    out[base + ".lora_a"], out[base + ".lora_b"] = a, b
  return out


def _raises_naming(path, *needles, paths=None, scales=None):
  with pytest.raises(AdapterError) as ei:
    read_adapters(CFG, paths if paths is not None else [path], scales)
  msg = str(ei.value)
  for needle in (str(path),) + needles:
    assert needle in msg, f"{needle!r} not in: {msg}"
  return msg


def test_not_a_gguf(tmp_path):
  path = tmp_path / "notes.gguf"
  path.write_text("this is not a GGUF file\n")
  _raises_naming(path, "not a readable GGUF")


def test_missing_file(tmp_path):
  _raises_naming(tmp_path / "absent.gguf", "no such file")


def test_general_type_not_adapter(tmp_path):
  path = af.write_raw(tmp_path / "model.gguf", _good_tensors(), general_type="model", alpha=8.0)
  _raises_naming(path, "general.type", "'adapter'", "'model'")


def test_adapter_type_not_lora(tmp_path):
  path = af.write_raw(tmp_path / "ia3.gguf", _good_tensors(), adapter_type="ia3", alpha=8.0)
  _raises_naming(path, "adapter.type", "'lora'", "'ia3'")


def test_arch_mismatch(tmp_path):
  path = af.write_raw(tmp_path / "llama.gguf", _good_tensors(), arch="llama", alpha=8.0)
  _raises_naming(path, "general.architecture", "'llama'", "'qwen3next'", "mismatch")


def test_missing_lora_b(tmp_path):
  tensors = _good_tensors()
  del tensors[SSM1 + ".lora_b"]
  path = af.write_raw(tmp_path / "a.gguf", tensors, alpha=8.0)
  _raises_naming(path, SSM1, "missing one component", "lora_a [4, 64]", "no lora_b")


def test_missing_lora_a(tmp_path):
  tensors = _good_tensors()
  del tensors[ATT3 + ".lora_a"]
  path = af.write_raw(tmp_path / "a.gguf", tensors, alpha=8.0)
  _raises_naming(path, ATT3, "missing one component", "lora_b [64, 4]", "no lora_a")


def test_unexpected_suffix(tmp_path):
  tensors = _good_tensors()
  tensors["blk.0.ssm_out.weight.lora_c"] = np.zeros((4, 64), np.float32)
  path = af.write_raw(tmp_path / "a.gguf", tensors, alpha=8.0)
  _raises_naming(path, "blk.0.ssm_out.weight.lora_c", "unexpected suffix", "[4, 64]")


def test_layer_not_in_model(tmp_path):
  tensors = _good_tensors()
  tensors["blk.99.ssm_out.weight.lora_a"] = np.zeros((4, 64), np.float32)
  tensors["blk.99.ssm_out.weight.lora_b"] = np.zeros((64, 4), np.float32)
  path = af.write_raw(tmp_path / "a.gguf", tensors, alpha=8.0)
  _raises_naming(path, "blk.99.ssm_out.weight", "does not exist in base model", "[4, 64]")


def test_attn_output_on_gdn_layer(tmp_path):
  tensors = _good_tensors()
  tensors["blk.0.attn_output.weight.lora_a"] = np.zeros((4, 64), np.float32)
  tensors["blk.0.attn_output.weight.lora_b"] = np.zeros((64, 4), np.float32)
  path = af.write_raw(tmp_path / "a.gguf", tensors, alpha=8.0)
  _raises_naming(path, "blk.0.attn_output.weight", "does not exist in base model")


def test_lora_a_transposed(tmp_path):
  tensors = _good_tensors()
  tensors[SSM1 + ".lora_a"] = np.ascontiguousarray(tensors[SSM1 + ".lora_a"].T)  # [n_in, r]
  path = af.write_raw(tmp_path / "a.gguf", tensors, alpha=8.0)
  _raises_naming(path, SSM1, "lora_a tensor is not transposed", "lora_a [64, 4]",
                 "lora_b [64, 4]", "[64, 64]")


def test_lora_a_wrong_input_width(tmp_path):
  tensors = _good_tensors()
  tensors[ATT3 + ".lora_a"] = np.zeros((4, 48), np.float32)
  path = af.write_raw(tmp_path / "a.gguf", tensors, alpha=8.0)
  _raises_naming(path, ATT3, "incorrect shape", "lora_a [4, 48]", "expected lora_a [r, 64]")


def test_lora_b_wrong_output_width(tmp_path):
  tensors = _good_tensors()
  tensors[SSM0 + ".lora_b"] = np.zeros((32, 4), np.float32)
  path = af.write_raw(tmp_path / "a.gguf", tensors, alpha=8.0)
  _raises_naming(path, SSM0, "incorrect shape", "lora_b [32, 4]", "[64, r]")


def test_rank_mismatch(tmp_path):
  tensors = _good_tensors()
  tensors[SSM0 + ".lora_b"] = np.zeros((64, 3), np.float32)
  path = af.write_raw(tmp_path / "a.gguf", tensors, alpha=8.0)
  _raises_naming(path, SSM0, "rank mismatch", "lora_a [4, 64]", "lora_b [64, 3]")


def test_unsupported_tensor_type(tmp_path):
  tensors = _good_tensors()
  tensors[ATT3 + ".lora_a"] = np.zeros((4, 64), np.int32)
  path = af.write_raw(tmp_path / "a.gguf", tensors, alpha=8.0)
  _raises_naming(path, ATT3 + ".lora_a", "unsupported type I32", "[4, 64]")


def test_scales_length_mismatch(tmp_path):
  path = af.write_raw(tmp_path / "a.gguf", _good_tensors(), alpha=8.0)
  _raises_naming(path, "2 LoRA scale(s) for 1 adapter file(s)", scales=[1.0, 0.5])


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_scale(tmp_path, scale):
  path = af.write_raw(tmp_path / "a.gguf", _good_tensors(), alpha=8.0)
  _raises_naming(path, "not finite", scales=[scale])


def test_non_finite_alpha(tmp_path):
  path = af.write_raw(tmp_path / "a.gguf", _good_tensors(), alpha=float("nan"))
  _raises_naming(path, "adapter.lora.alpha", "not finite")


def test_activated_lora_refused(tmp_path):
  vt = gguf.GGUFValueType
  path = af.write_raw(tmp_path / "a.gguf", _good_tensors(), alpha=8.0,
                      extra_kv={"adapter.alora.invocation_tokens": ([5, 6], vt.ARRAY, vt.UINT32)})
  _raises_naming(path, "adapter.alora.invocation_tokens", "not supported")


# --- PEFT -> GGUF -----------------------------------------------------------------------------

# The transformers twin of HF_CFG below, built by hand from the same numbers.
PEFT_CFG = ModelConfig(
    vocab_size=128, d_model=64, layer_types="GGGA", n_head=4, n_kv_head=2, head_dim=16, n_rot=4,
    rope_base=1e4, gdn_n_k_heads=2, gdn_n_v_heads=4, gdn_d_k=8, gdn_d_v=8, conv_kernel=4,
    n_experts=4, n_experts_used=2, d_ff_expert=32, d_ff_shared=48)


@pytest.fixture(scope="module")
def peft_adapter(tmp_path_factory):
  """A tiny transformers Qwen3-Next with a PEFT LoRA (r=4, alpha=8, non-zero B), saved."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  peft = pytest.importorskip("peft")
  root = tmp_path_factory.mktemp("peft")
  hf_cfg = transformers.Qwen3NextConfig(
      vocab_size=128, hidden_size=64, num_hidden_layers=4,
      layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4,
      num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
      linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
      num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
      intermediate_size=96)
  torch.manual_seed(0)
  model = transformers.Qwen3NextForCausalLM(hf_cfg).eval()
  hf_cfg.save_pretrained(root / "base")
  lcfg = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                         target_modules=["o_proj", "out_proj", "in_proj_qkvz"])
  pm = peft.get_peft_model(model, lcfg).eval()
  pm.save_pretrained(root / "lora_a1")
  state = {k: v.detach().numpy() for k, v in pm.state_dict().items() if "lora_" in k}
  return {"root": root, "dir": root / "lora_a1", "base": root / "base", "model": pm,
          "state": state, "torch": torch, "peft": peft, "transformers": transformers,
          "hf_cfg": hf_cfg}


def _peft_ab(state, module):
  key = f"base_model.model.model.layers.{module}"
  return state[f"{key}.lora_A.default.weight"], state[f"{key}.lora_B.default.weight"]


def _variant(peft_adapter, name, **config):
  """A copy of the saved adapter with adapter_config.json fields replaced."""
  d = peft_adapter["root"] / name
  shutil.copytree(peft_adapter["dir"], d)
  cfg = json.loads((d / "adapter_config.json").read_text())
  cfg.update(config)
  (d / "adapter_config.json").write_text(json.dumps(cfg))
  return d


def test_convert_peft_writes_llama_cpp_layout(peft_adapter, tmp_path):
  out = convert_peft(peft_adapter["dir"], peft_adapter["base"], tmp_path / "a.gguf")
  r = gguf.GGUFReader(out)
  kv = {k: r.get_field(k).contents() for k in r.fields if not k.startswith("GGUF.")}
  assert kv == {"general.architecture": "qwen3next", "general.type": "adapter",
                "adapter.type": "lora", "adapter.lora.alpha": 8.0, "general.name": "Lora_A1",
                "general.quantization_version": 2}
  tensors = {t.name: t for t in r.tensors}
  assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in tensors.values())
  state = peft_adapter["state"]
  for _i, module, base in [(0, "0.linear_attn.out_proj", "blk.0.ssm_out.weight"),
                          (2, "2.linear_attn.out_proj", "blk.2.ssm_out.weight"),
                          (3, "3.self_attn.o_proj", ATT3)]:
    a, b = _peft_ab(state, module)
    np.testing.assert_array_equal(tensors[base + ".lora_a"].data, a)  # [r, n_in], unchanged
    np.testing.assert_array_equal(tensors[base + ".lora_b"].data, b)  # [n_out, r], unchanged
    assert list(tensors[base + ".lora_a"].shape) == [a.shape[1], 4]   # ggml ne {n_in, r}
  assert {f"blk.{i}.{w}.weight.lora_{x}" for i in range(3) for w in ("attn_qkv", "attn_gate")
          for x in "ab"} <= set(tensors)


def test_convert_peft_qkvz_follows_transformers_ordering(peft_adapter, tmp_path):
  # The LoRA delta of in_proj_qkvz, pushed through transformers' own
  # fix_query_key_value_ordering, must come out as GGUF attn_qkv [q | k | v] and attn_gate [z].
  torch = peft_adapter["torch"]
  out = convert_peft(peft_adapter["dir"], peft_adapter["base"], tmp_path / "a.gguf")
  tensors = {t.name: np.asarray(t.data, np.float64) for t in gguf.GGUFReader(out).tensors}
  a, b = _peft_ab(peft_adapter["state"], "1.linear_attn.in_proj_qkvz")
  delta = b.astype(np.float64) @ a  # [Hk*(2dk+2r*dv), D]
  gdn = peft_adapter["model"].base_model.model.model.layers[1].linear_attn
  mixed = torch.from_numpy(delta.T[None])  # each input unit as one "token": [1, D, rows]
  ba = torch.zeros(1, 64, 8, dtype=mixed.dtype)
  q, k, v, z, _, _ = gdn.fix_query_key_value_ordering(mixed, ba)
  flat = lambda x: x.reshape(64, -1).numpy().T  # noqa: E731
  want_qkv = np.concatenate([flat(q), flat(k), flat(v)])
  got_qkv = tensors["blk.1.attn_qkv.weight.lora_b"] @ tensors["blk.1.attn_qkv.weight.lora_a"]
  got_z = tensors["blk.1.attn_gate.weight.lora_b"] @ tensors["blk.1.attn_gate.weight.lora_a"]
  assert_close(got_qkv, want_qkv, rel=KERNEL_REL["float32"], what="attn_qkv")
  assert_close(got_z, flat(z), rel=KERNEL_REL["float32"], what="attn_gate")
  np.testing.assert_array_equal(tensors["blk.1.attn_gate.weight.lora_a"], a)


def test_convert_peft_read_back_matches_peft(peft_adapter, tmp_path):
  torch = peft_adapter["torch"]
  out = convert_peft(peft_adapter["dir"], peft_adapter["base"], tmp_path / "a.gguf")
  with pytest.warns(AdapterWarning, match="attn_qkv.*attn_gate"):
    ls = read_adapters(PEFT_CFG, [out])
  assert ls.rank_total == 4 and ls.files[0].n_applied == 4
  assert {s for _, s in ls.files[0].scales} == {2.0}  # alpha 8 / r 4
  layers = peft_adapter["model"].base_model.model.model.layers
  for j, mod in enumerate([layers[i].linear_attn.out_proj for i in range(3)]
                          + [layers[3].self_attn.o_proj]):
    a, b = (ls.params.gdn_a[j], ls.params.gdn_b[j]) if j < 3 else (ls.params.attn_a[0],
                                                                   ls.params.attn_b[0])
    assert mod.scaling["default"] == 2.0
    xin = torch.randn(5, mod.in_features, generator=torch.Generator().manual_seed(j))
    with torch.no_grad():
      want = (mod(xin) - mod.base_layer(xin)).numpy()
    got = xin.numpy() @ np.asarray(a).T @ np.asarray(b).T
    assert_close(got, want, rel=KERNEL_REL["float32"] * 10, what=f"peft delta {j}")


@pytest.mark.parametrize("outtype,rel", [("f16", KERNEL_REL["float16"]),
                                         ("bf16", KERNEL_REL["bfloat16"]),
                                         ("q8_0", KERNEL_REL["bfloat16"])])
def test_convert_peft_outtypes(peft_adapter, tmp_path, outtype, rel):
  out = convert_peft(peft_adapter["dir"], peft_adapter["base"], tmp_path / "a.gguf", outtype)
  types = {t.name: t.tensor_type for t in gguf.GGUFReader(out).tensors}
  qt = gguf.GGMLQuantizationType
  want = {"f16": (qt.F16, qt.F16), "bf16": (qt.BF16, qt.BF16), "q8_0": (qt.Q8_0, qt.F16)}
  assert (types[ATT3 + ".lora_a"], types[ATT3 + ".lora_b"]) == want[outtype]  # q8_0: r=4 -> F16
  with pytest.warns(AdapterWarning):
    ls = read_adapters(PEFT_CFG, [out])
  a, b = _peft_ab(peft_adapter["state"], "3.self_attn.o_proj")
  got = np.asarray(ls.params.attn_b[0], np.float64) @ np.asarray(ls.params.attn_a[0], np.float64)
  assert_close(got, 2.0 * (b.astype(np.float64) @ a), rel=rel, what=outtype)


def test_convert_peft_rslora_folds_sqrt_rank_into_alpha(peft_adapter, tmp_path):
  d = _variant(peft_adapter, "rslora", use_rslora=True)
  out = convert_peft(d, peft_adapter["base"], tmp_path / "a.gguf")
  alpha = gguf.GGUFReader(out).get_field("adapter.lora.alpha").contents()
  assert alpha == pytest.approx(8.0 * math.sqrt(4))
  # PEFT's own runtime scale for the same directory.
  transformers, peft = peft_adapter["transformers"], peft_adapter["peft"]
  fresh = transformers.Qwen3NextForCausalLM(peft_adapter["hf_cfg"])
  pm = peft.PeftModel.from_pretrained(fresh, str(d))
  peft_scale = pm.base_model.model.model.layers[3].self_attn.o_proj.scaling["default"]
  with pytest.warns(AdapterWarning):
    ls = read_adapters(PEFT_CFG, [out])
  assert dict(ls.files[0].scales)[ATT3] == pytest.approx(peft_scale, rel=1e-6)
  assert peft_scale == pytest.approx(8.0 / math.sqrt(4))


@pytest.mark.parametrize("config,needle", [
    ({"alpha_pattern": {"o_proj": 16}}, "alpha_pattern"),
    ({"use_dora": True}, "use_dora"),
    ({"use_rslora": True, "r": 8}, "rsLoRA"),
], ids=["alpha_pattern", "dora", "rslora-rank-mismatch"])
def test_convert_peft_refuses(peft_adapter, tmp_path, config, needle):
  d = _variant(peft_adapter, "v-" + needle, **config)
  with pytest.raises(AdapterError) as ei:
    convert_peft(d, peft_adapter["base"], tmp_path / "a.gguf")
  assert needle in str(ei.value) and str(d) in str(ei.value)


def test_convert_peft_warns_on_unsupported_modules(peft_adapter, tmp_path):
  from safetensors.numpy import load_file, save_file
  d = _variant(peft_adapter, "experts")
  state = load_file(d / "adapter_model.safetensors")
  key = "base_model.model.model.layers.0.mlp.experts.0.gate_proj"
  state[key + ".lora_A.weight"] = np.zeros((4, 64), np.float32)
  state[key + ".lora_B.weight"] = np.zeros((32, 4), np.float32)
  save_file(state, d / "adapter_model.safetensors")
  with pytest.warns(AdapterWarning, match=r"model\.layers\.0\.mlp\.experts\.0\.gate_proj"):
    out = convert_peft(d, peft_adapter["base"], tmp_path / "a.gguf")
  names = {t.name for t in gguf.GGUFReader(out).tensors}
  assert not any("ffn" in n for n in names) and ATT3 + ".lora_a" in names
