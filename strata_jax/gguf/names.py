"""Declarative name tables: Params leaf <-> GGUF tensor <-> transformers state-dict key.

The GGUF side follows llama.cpp's `qwen3next` layout (`reference/gguf-qwen3next-layout.md`);
the HF side follows transformers' `Qwen3NextForCausalLM` as saved on disk (per-expert keys) or
held in memory by transformers 5 (fused `experts.gate_up_proj` / `experts.down_proj`).
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

from strata_jax.config import ATTN, GDN, ModelConfig
from strata_jax.params import mtp_param_shapes, param_shapes

# Which layers a Params leaf is stacked over.
TOP = "top"          # not per layer
EVERY = "every"      # all layers: [L, ...]
GDN_ONLY = "gdn"     # GDN layers only: [Lg, ...]
ATTN_ONLY = "attn"   # attention layers only: [La, ...]


@dataclasses.dataclass(frozen=True)
class TensorName:
  """One Params leaf and the GGUF tensor(s) it is read from.

  Attributes:
    path: dotted Params leaf path, as in `params.param_shapes`.
    gguf: GGUF tensor name; per-layer names carry `{i}` (the absolute layer index).
    over: TOP, EVERY, GDN_ONLY or ATTN_ONLY.
    fallback: GGUF name read when `gguf` is absent (llama.cpp ties `output` to `token_embd`).
  """
  path: str
  gguf: str
  over: str
  fallback: str | None = None


MODEL_TENSORS: tuple[TensorName, ...] = (
    TensorName("embed", "token_embd.weight", TOP),
    TensorName("final_norm", "output_norm.weight", TOP),
    TensorName("lm_head", "output.weight", TOP, fallback="token_embd.weight"),
    TensorName("layers.attn_norm", "blk.{i}.attn_norm.weight", EVERY),
    TensorName("layers.post_norm", "blk.{i}.post_attention_norm.weight", EVERY),
    TensorName("layers.gdn.qkv", "blk.{i}.attn_qkv.weight", GDN_ONLY),
    TensorName("layers.gdn.gate", "blk.{i}.attn_gate.weight", GDN_ONLY),
    TensorName("layers.gdn.ba", "blk.{i}.ssm_ba.weight", GDN_ONLY),
    TensorName("layers.gdn.conv", "blk.{i}.ssm_conv1d.weight", GDN_ONLY),
    # ssm_a and ssm_dt.bias carry no ".weight" suffix in llama.cpp's naming.
    TensorName("layers.gdn.a", "blk.{i}.ssm_a", GDN_ONLY),
    TensorName("layers.gdn.dt_bias", "blk.{i}.ssm_dt.bias", GDN_ONLY),
    TensorName("layers.gdn.norm", "blk.{i}.ssm_norm.weight", GDN_ONLY),
    TensorName("layers.gdn.out", "blk.{i}.ssm_out.weight", GDN_ONLY),
    TensorName("layers.attn.q", "blk.{i}.attn_q.weight", ATTN_ONLY),
    TensorName("layers.attn.k", "blk.{i}.attn_k.weight", ATTN_ONLY),
    TensorName("layers.attn.v", "blk.{i}.attn_v.weight", ATTN_ONLY),
    TensorName("layers.attn.q_norm", "blk.{i}.attn_q_norm.weight", ATTN_ONLY),
    TensorName("layers.attn.k_norm", "blk.{i}.attn_k_norm.weight", ATTN_ONLY),
    TensorName("layers.attn.out", "blk.{i}.attn_output.weight", ATTN_ONLY),
    TensorName("layers.moe.router", "blk.{i}.ffn_gate_inp.weight", EVERY),
    TensorName("layers.moe.gate_exps", "blk.{i}.ffn_gate_exps.weight", EVERY),
    TensorName("layers.moe.up_exps", "blk.{i}.ffn_up_exps.weight", EVERY),
    TensorName("layers.moe.down_exps", "blk.{i}.ffn_down_exps.weight", EVERY),
    TensorName("layers.moe.shared_gate", "blk.{i}.ffn_gate_shexp.weight", EVERY),
    TensorName("layers.moe.shared_up", "blk.{i}.ffn_up_shexp.weight", EVERY),
    TensorName("layers.moe.shared_down", "blk.{i}.ffn_down_shexp.weight", EVERY),
    TensorName("layers.moe.shared_gate_inp", "blk.{i}.ffn_gate_inp_shexp.weight", EVERY),
)

# The MTP head: GGUF block `n_layers` (block_count = n_layers + nextn_predict_layers), named as
# llama.cpp names it (`LLM_TENSOR_NEXTN_*` for the head's own tensors, the ordinary block names
# for its attention and MoE). `{i}` is that block index. No `nextn.embed_tokens` /
# `nextn.shared_head_head` for Qwen3-Next: the head shares token_embd and output.
MTP = "mtp"
MTP_TENSORS: tuple[TensorName, ...] = (
    TensorName("mtp.eh_proj", "blk.{i}.nextn.eh_proj.weight", MTP),
    TensorName("mtp.enorm", "blk.{i}.nextn.enorm.weight", MTP),
    TensorName("mtp.hnorm", "blk.{i}.nextn.hnorm.weight", MTP),
    TensorName("mtp.head_norm", "blk.{i}.nextn.shared_head_norm.weight", MTP),
) + tuple(
    TensorName("mtp." + t.path.removeprefix("layers."), t.gguf, MTP)
    for t in MODEL_TENSORS
    if t.over in (EVERY, ATTN_ONLY))
# MTP leaves with no layer axis (the rest carry a leading axis of 1).
MTP_HEAD_LEAVES = frozenset({"mtp.eh_proj", "mtp.enorm", "mtp.hnorm", "mtp.head_norm"})

# Tensors llama.cpp's converter keeps in F32 under f16/bf16 output (besides every 1-D tensor):
# tiny and precision-critical (decay rates, conv taps, router logits).
KEEP_F32_SUFFIXES = ("ssm_a", "ssm_dt.bias", "ssm_conv1d.weight", "ffn_gate_inp.weight",
                     "ffn_gate_inp_shexp.weight")


def keeps_f32(gguf_name: str, ndim: int) -> bool:
  """Whether a GGUF tensor stays F32 when the rest of the file is f16/bf16."""
  return ndim <= 1 or gguf_name.endswith(KEEP_F32_SUFFIXES)


def layer_indices(cfg: ModelConfig, over: str) -> list[int] | None:
  """Absolute layer indices a leaf is stacked over (None for a top-level leaf)."""
  if over == TOP:
    return None
  if over == EVERY:
    return list(range(cfg.n_layers))
  kind = GDN if over == GDN_ONLY else ATTN
  return [i for i, t in enumerate(cfg.layer_types) if t == kind]


def mtp_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """The MTP head's GGUF tensors (block `cfg.n_layers`) with their numpy shapes; empty when the
  config has no MTP layer. Its layer leaves drop their leading axis of 1 (one block's tensor)."""
  shapes = mtp_param_shapes(cfg)
  out = {}
  for spec in MTP_TENSORS if cfg.n_mtp else ():
    s = shapes[spec.path]
    out[spec.gguf.format(i=cfg.n_layers)] = s if spec.path in MTP_HEAD_LEAVES else s[1:]
  return out


def gguf_tensor_shapes(cfg: ModelConfig, tied: bool = False) -> dict[str, tuple[int, ...]]:
  """Every GGUF tensor a model of this geometry has, with its numpy shape.

  Args:
    cfg: the geometry.
    tied: leave out `output.weight` (the LM head is then read from `token_embd.weight`).
  """
  shapes = param_shapes(cfg)
  out = {}
  for spec in MODEL_TENSORS:
    if tied and spec.fallback is not None:
      continue
    idx = layer_indices(cfg, spec.over)
    if idx is None:
      out[spec.gguf] = shapes[spec.path]
    else:
      for i in idx:
        out[spec.gguf.format(i=i)] = shapes[spec.path][1:]
  out.update(mtp_tensor_shapes(cfg))
  return out


def params_to_gguf_tensors(cfg: ModelConfig, flat: dict[str, object],
                           tied: bool = False) -> dict[str, np.ndarray]:
  """Unstack {Params leaf path: array} into {GGUF tensor name: float32 numpy array}.

  The inverse of what the loader does; used to write GGUFs from Params (tests, assets).
  """
  out = {}
  for spec in MODEL_TENSORS:
    if tied and spec.fallback is not None:
      continue
    leaf = np.asarray(flat[spec.path], dtype=np.float32)
    idx = layer_indices(cfg, spec.over)
    if idx is None:
      out[spec.gguf] = leaf
    else:
      for j, i in enumerate(idx):
        out[spec.gguf.format(i=i)] = leaf[j]
  if cfg.n_mtp:
    for spec in MTP_TENSORS:
      leaf = np.asarray(flat[spec.path], dtype=np.float32)
      out[spec.gguf.format(i=cfg.n_layers)] = leaf if spec.path in MTP_HEAD_LEAVES else leaf[0]
  return out


# --- transformers state-dict keys -------------------------------------------------------------

# How the converter turns an HF tensor into its GGUF tensor(s).
COPY = "copy"                  # unchanged
PLUS_ONE = "plus_one"          # Qwen3NextRMSNorm computes x̂·(1+w); GGUF stores 1+w
NEG_EXP = "neg_exp"            # ssm_a = -exp(A_log)
SQUEEZE = "squeeze"            # conv1d (C, 1, K) -> (C, K)
QKVZ = "qkvz"                  # in_proj_qkvz -> attn_qkv [q|k|v], attn_gate [z]
EXPERT = "expert"              # one expert's matrix -> row {j} of a stacked *_exps tensor
GATE_UP = "gate_up"            # fused (E, 2I, H) -> ffn_gate_exps [:, :I], ffn_up_exps [:, I:]


@dataclasses.dataclass(frozen=True)
class HFName:
  """One transformers state-dict key pattern and the GGUF tensor(s) it becomes.

  Attributes:
    hf: key template with `{i}` (layer) and `{j}` (expert) placeholders.
    gguf: GGUF name template(s), one per output tensor.
    transform: one of COPY, PLUS_ONE, NEG_EXP, SQUEEZE, QKVZ, EXPERT, GATE_UP.
  """
  hf: str
  gguf: tuple[str, ...]
  transform: str


_L = "model.layers.{i}."
HF_TENSORS: tuple[HFName, ...] = (
    HFName("model.embed_tokens.weight", ("token_embd.weight",), COPY),
    HFName("model.norm.weight", ("output_norm.weight",), PLUS_ONE),
    HFName("lm_head.weight", ("output.weight",), COPY),
    HFName(_L + "input_layernorm.weight", ("blk.{i}.attn_norm.weight",), PLUS_ONE),
    HFName(_L + "post_attention_layernorm.weight", ("blk.{i}.post_attention_norm.weight",),
           PLUS_ONE),
    HFName(_L + "linear_attn.in_proj_qkvz.weight",
           ("blk.{i}.attn_qkv.weight", "blk.{i}.attn_gate.weight"), QKVZ),
    HFName(_L + "linear_attn.in_proj_ba.weight", ("blk.{i}.ssm_ba.weight",), COPY),
    HFName(_L + "linear_attn.conv1d.weight", ("blk.{i}.ssm_conv1d.weight",), SQUEEZE),
    HFName(_L + "linear_attn.A_log", ("blk.{i}.ssm_a",), NEG_EXP),
    HFName(_L + "linear_attn.dt_bias", ("blk.{i}.ssm_dt.bias",), COPY),
    # The gated GDN norm multiplies by plain w (init 1): no +1.
    HFName(_L + "linear_attn.norm.weight", ("blk.{i}.ssm_norm.weight",), COPY),
    HFName(_L + "linear_attn.out_proj.weight", ("blk.{i}.ssm_out.weight",), COPY),
    HFName(_L + "self_attn.q_proj.weight", ("blk.{i}.attn_q.weight",), COPY),
    HFName(_L + "self_attn.k_proj.weight", ("blk.{i}.attn_k.weight",), COPY),
    HFName(_L + "self_attn.v_proj.weight", ("blk.{i}.attn_v.weight",), COPY),
    HFName(_L + "self_attn.o_proj.weight", ("blk.{i}.attn_output.weight",), COPY),
    HFName(_L + "self_attn.q_norm.weight", ("blk.{i}.attn_q_norm.weight",), PLUS_ONE),
    HFName(_L + "self_attn.k_norm.weight", ("blk.{i}.attn_k_norm.weight",), PLUS_ONE),
    HFName(_L + "mlp.gate.weight", ("blk.{i}.ffn_gate_inp.weight",), COPY),
    HFName(_L + "mlp.experts.{j}.gate_proj.weight", ("blk.{i}.ffn_gate_exps.weight",), EXPERT),
    HFName(_L + "mlp.experts.{j}.up_proj.weight", ("blk.{i}.ffn_up_exps.weight",), EXPERT),
    HFName(_L + "mlp.experts.{j}.down_proj.weight", ("blk.{i}.ffn_down_exps.weight",), EXPERT),
    HFName(_L + "mlp.experts.gate_up_proj",
           ("blk.{i}.ffn_gate_exps.weight", "blk.{i}.ffn_up_exps.weight"), GATE_UP),
    HFName(_L + "mlp.experts.down_proj", ("blk.{i}.ffn_down_exps.weight",), COPY),
    HFName(_L + "mlp.shared_expert.gate_proj.weight", ("blk.{i}.ffn_gate_shexp.weight",), COPY),
    HFName(_L + "mlp.shared_expert.up_proj.weight", ("blk.{i}.ffn_up_shexp.weight",), COPY),
    HFName(_L + "mlp.shared_expert.down_proj.weight", ("blk.{i}.ffn_down_shexp.weight",), COPY),
    HFName(_L + "mlp.shared_expert_gate.weight", ("blk.{i}.ffn_gate_inp_shexp.weight",), COPY),
)


# The MTP head in a transformers checkpoint (`mtp.*`, which transformers itself ignores on load):
# `mtp.layers.0.<key>` is an ordinary block's `model.layers.<N>.<key>` (N = n_layers: llama.cpp's
# converter renames it so), and these four become the `nextn` tensors. Every `*norm.weight`
# gets the +1 of Qwen3NextRMSNorm (llama.cpp's converter: all but linear_attn.norm).
HF_MTP_TENSORS: tuple[HFName, ...] = (
    HFName("mtp.fc.weight", ("blk.{i}.nextn.eh_proj.weight",), COPY),
    HFName("mtp.pre_fc_norm_embedding.weight", ("blk.{i}.nextn.enorm.weight",), PLUS_ONE),
    HFName("mtp.pre_fc_norm_hidden.weight", ("blk.{i}.nextn.hnorm.weight",), PLUS_ONE),
    HFName("mtp.norm.weight", ("blk.{i}.nextn.shared_head_norm.weight",), PLUS_ONE),
)


def match_hf_mtp(hf_name: str, n_layers: int) -> HFMatch | None:
  """Resolve an `mtp.*` key of a checkpoint whose trunk has `n_layers` layers (None if the key
  is not one of the MTP head's)."""
  m = re.fullmatch(r"mtp\.layers\.0\.(.+)", hf_name)
  if m:
    hit = match_hf(f"model.layers.{n_layers}.{m.group(1)}")
    return hit
  for spec in HF_MTP_TENSORS:
    if spec.hf == hf_name:
      return HFMatch(spec, n_layers, None)
  return None


def _template_regex(template: str) -> re.Pattern:
  pat = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{j\}", r"(?P<j>\d+)")
  return re.compile(pat + r"\Z")


_HF_REGEX = tuple((_template_regex(n.hf), n) for n in HF_TENSORS)


@dataclasses.dataclass(frozen=True)
class HFMatch:
  """An HF key resolved against `HF_TENSORS`."""
  spec: HFName
  layer: int | None
  expert: int | None

  @property
  def gguf_names(self) -> tuple[str, ...]:
    return tuple(g.format(i=self.layer) for g in self.spec.gguf)


def match_hf(hf_name: str) -> HFMatch | None:
  """Resolve a transformers state-dict key (exact, with ".weight" where HF has it)."""
  for rx, spec in _HF_REGEX:
    m = rx.match(hf_name)
    if m:
      d = m.groupdict()
      return HFMatch(spec, int(d["i"]) if d.get("i") else None,
                     int(d["j"]) if d.get("j") else None)
  return None


def hf_to_gguf(hf_name: str) -> HFMatch | None:
  """Like `match_hf`, but also accepts PEFT/module paths.

  Strips a PEFT `base_model.model.` prefix and adds the ".weight" suffix when missing, so
  "base_model.model.model.layers.3.self_attn.o_proj" resolves like
  "model.layers.3.self_attn.o_proj.weight".
  """
  name = hf_name.removeprefix("base_model.model.")
  return match_hf(name) or match_hf(name + ".weight")


def hf_to_gguf_name(hf_name: str) -> str | None:
  """The GGUF tensor an HF module/key maps to one-to-one, else None.

  One-to-one means one GGUF tensor with the same matrix layout (COPY) or an elementwise
  transform of it (PLUS_ONE, NEG_EXP, SQUEEZE). A LoRA converter should additionally insist on
  COPY (`hf_to_gguf(name).spec.transform == COPY`): e.g.
  "model.layers.{i}.linear_attn.out_proj" -> "blk.{i}.ssm_out.weight",
  "model.layers.{i}.self_attn.o_proj" -> "blk.{i}.attn_output.weight".
  in_proj_qkvz (split and re-ordered) and expert tensors (stacked) return None.
  """
  m = hf_to_gguf(hf_name)
  if m is None or m.spec.transform in (QKVZ, EXPERT, GATE_UP):
    return None
  return m.gguf_names[0]
