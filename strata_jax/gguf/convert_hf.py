"""Convert a transformers Qwen3-Next checkpoint directory to a qwen3next GGUF, laid out as
llama.cpp's converter lays it out (`reference/gguf-qwen3next-layout.md`), and write model GGUFs
from Params.

    python -m strata_jax.gguf.convert_hf HF_DIR OUT.gguf [--outtype f32|f16|bf16]

Tensors are computed and written one at a time, so memory stays near one tensor.
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import gguf
import ml_dtypes
import numpy as np
from gguf.utility import size_label
from tqdm import tqdm

from strata_jax import config as config_lib
from strata_jax.config import ModelConfig
from strata_jax.errors import StrataError
from strata_jax.gguf import names
from strata_jax.gguf.names import hf_to_gguf, hf_to_gguf_name  # noqa: F401  (re-exported)
from strata_jax.gguf.tokenizer import CONTROL, NORMAL, USER_DEFINED

ARCH = "qwen3next"
T = gguf.GGMLQuantizationType
OUTTYPES = {"f32": (T.F32, gguf.LlamaFileType.ALL_F32),
            "f16": (T.F16, gguf.LlamaFileType.MOSTLY_F16),
            "bf16": (T.BF16, gguf.LlamaFileType.MOSTLY_BF16)}


# --- safetensors, read with numpy (no torch needed) ---------------------------------------------

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "F64": np.float64}


class SafeTensorsDir:
  """All tensors of a checkpoint directory's *.safetensors files, memory-mapped."""

  def __init__(self, hf_dir: str):
    self.dir = hf_dir
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
      raise StrataError(f"{hf_dir}: no *.safetensors files")
    self._maps: dict[Path, np.memmap] = {}
    self.entries: dict[str, tuple[Path, str, tuple[int, ...], int, int]] = {}
    for f in files:
      try:
        with open(f, "rb") as fh:
          (n,) = struct.unpack("<Q", fh.read(8))
          header = json.loads(fh.read(n))
      except (OSError, struct.error, ValueError) as e:
        raise StrataError(f"{f}: not a safetensors file: {e}") from e
      for key, info in header.items():
        if key == "__metadata__":
          continue
        begin, end = info["data_offsets"]
        self.entries[key] = (f, info["dtype"], tuple(info["shape"]), 8 + n + begin, 8 + n + end)

  def keys(self) -> list[str]:
    return list(self.entries)

  def shape(self, key: str) -> tuple[int, ...]:
    return self.entries[key][2]

  def get(self, key: str) -> np.ndarray:
    """The tensor as float32 numpy."""
    f, dt, shape, begin, end = self.entries[key]
    if dt not in _ST_DTYPES:
      raise StrataError(f"{f}: tensor {key!r} has unsupported dtype {dt}")
    if f not in self._maps:
      self._maps[f] = np.memmap(f, mode="r")
    raw = self._maps[f][begin:end]
    return raw.view(_ST_DTYPES[dt]).reshape(shape).astype(np.float32)


# --- config ---------------------------------------------------------------------------------------

def read_hf_config(hf_dir: str) -> dict:
  try:
    with open(os.path.join(hf_dir, "config.json")) as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise StrataError(f"{hf_dir}: cannot read config.json: {e}") from e


def _rope(hf: dict, key: str, default):
  # transformers 5 moves rope settings into `rope_parameters`; older configs keep them on top.
  if key in hf:
    return hf[key]
  return (hf.get("rope_parameters") or hf.get("rope_scaling") or {}).get(key, default)


def model_config_from_hf(hf: dict, where: str = "config.json", has_mtp: bool = False
                         ) -> ModelConfig:
  """ModelConfig from a transformers Qwen3NextConfig dict. `has_mtp`: the checkpoint holds
  `mtp.*` tensors; the MTP layer count is then `mtp_num_hidden_layers` (default 1). A config
  that declares MTP layers whose tensors are absent gets none (llama.cpp's converter trusts the
  declaration and writes a block count one too high for such checkpoints)."""
  if hf.get("model_type") != "qwen3_next":
    raise StrataError(f"{where}: model_type is {hf.get('model_type')!r}, expected 'qwen3_next'")
  if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
    raise StrataError(f"{where}: dense MLP layers (mlp_only_layers / decoder_sparse_step) are "
                      "not supported; every layer must be MoE")
  n = hf["num_hidden_layers"]
  if hf.get("layer_types"):
    kinds = {"linear_attention": config_lib.GDN, "full_attention": config_lib.ATTN}
    bad = set(hf["layer_types"]) - set(kinds)
    if bad or len(hf["layer_types"]) != n:
      raise StrataError(f"{where}: layer_types {hf['layer_types']} must be {n} entries of "
                        f"{sorted(kinds)}")
    layer_types = "".join(kinds[t] for t in hf["layer_types"])
  else:
    layer_types = config_lib.layer_pattern_from_interval(n, hf.get("full_attention_interval", 4))
  d = hf["hidden_size"]
  n_head = hf["num_attention_heads"]
  head_dim = hf.get("head_dim") or d // n_head
  cfg = ModelConfig(
      vocab_size=hf["vocab_size"], d_model=d, layer_types=layer_types,
      n_head=n_head, n_kv_head=hf.get("num_key_value_heads", n_head), head_dim=head_dim,
      n_rot=int(head_dim * _rope(hf, "partial_rotary_factor", 0.25)),
      rope_base=float(_rope(hf, "rope_theta", 10000.0)),
      gdn_n_k_heads=hf["linear_num_key_heads"], gdn_n_v_heads=hf["linear_num_value_heads"],
      gdn_d_k=hf["linear_key_head_dim"], gdn_d_v=hf["linear_value_head_dim"],
      conv_kernel=hf.get("linear_conv_kernel_dim", 4),
      n_experts=hf["num_experts"], n_experts_used=hf["num_experts_per_tok"],
      d_ff_expert=hf["moe_intermediate_size"], d_ff_shared=hf["shared_expert_intermediate_size"],
      rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
      context_length=int(hf.get("max_position_embeddings", 4096)),
      n_mtp=int(hf.get("mtp_num_hidden_layers", 1)) if has_mtp else 0)
  bad = cfg.validate()
  if bad:
    raise StrataError(f"{where}: inconsistent config: " + "; ".join(bad))
  return cfg


# --- tokenizer ------------------------------------------------------------------------------------

def _read_json(path: Path) -> dict | None:
  if not path.exists():
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _chat_template(hf_dir: Path, tok_cfg: dict) -> str | None:
  tmpl = tok_cfg.get("chat_template")
  if isinstance(tmpl, list):  # named templates: llama.cpp keeps the default one
    tmpl = next((t["template"] for t in tmpl if t.get("name") == "default"), None)
  if tmpl:
    return tmpl
  if (hf_dir / "chat_template.jinja").exists():
    return (hf_dir / "chat_template.jinja").read_text(encoding="utf-8")
  j = _read_json(hf_dir / "chat_template.json")
  return j.get("chat_template") if j else None


def hf_tokenizer_kv(hf_dir: str, vocab_size: int, hf_cfg: dict | None = None) -> dict | None:
  """`tokenizer.ggml.*` (+ `tokenizer.chat_template`) values from tokenizer.json & co.

  Tokens are padded to `vocab_size` with "[PAD{i}]" user-defined tokens, as llama.cpp does.
  Returns None when the directory has no tokenizer.json (the GGUF then has no tokenizer).
  """
  d = Path(hf_dir)
  tj = _read_json(d / "tokenizer.json")
  if tj is None:
    return None
  model = tj.get("model", {})
  if model.get("type") != "BPE":
    warnings.warn(f"{d / 'tokenizer.json'}: model type {model.get('type')!r} is not BPE; "
                  "the GGUF gets no tokenizer", stacklevel=2)
    return None
  by_id = {int(i): t for t, i in model["vocab"].items()}
  specials = {}
  for a in tj.get("added_tokens", []):
    by_id[int(a["id"])] = a["content"]
    specials[int(a["id"])] = bool(a.get("special"))
  if max(by_id) >= vocab_size:
    raise StrataError(f"{d / 'tokenizer.json'}: token id {max(by_id)} does not fit the model's "
                      f"vocab_size {vocab_size}")
  tokens, types = [], []
  for i in range(vocab_size):
    if i not in by_id:
      tokens.append(f"[PAD{i}]")
      types.append(USER_DEFINED)
    else:
      tokens.append(by_id[i])
      types.append(NORMAL if i not in specials else CONTROL if specials[i] else USER_DEFINED)
  merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
  kv: dict[str, Any] = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
                        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                        "tokenizer.ggml.merges": merges}
  tok_cfg = _read_json(d / "tokenizer_config.json") or {}
  ids = {t: i for i, t in enumerate(tokens)}
  # tokenizer_config.json names the token; config.json's id is the fallback.
  for role, tok_key, cfg_key in (("bos", "bos_token", "bos_token_id"),
                                 ("eos", "eos_token", "eos_token_id"),
                                 ("padding", "pad_token", "pad_token_id")):
    tok = tok_cfg.get(tok_key)
    if isinstance(tok, dict):
      tok = tok.get("content")
    tid = ids.get(tok) if tok else None
    if tid is None and hf_cfg is not None:
      v = hf_cfg.get(cfg_key)
      tid = v[0] if isinstance(v, list) and v else v
    if tid is not None:
      kv[f"tokenizer.ggml.{role}_token_id"] = int(tid)
  if "add_bos_token" in tok_cfg:
    kv["tokenizer.ggml.add_bos_token"] = bool(tok_cfg["add_bos_token"])
  tmpl = _chat_template(d, tok_cfg)
  if tmpl:
    kv["tokenizer.chat_template"] = tmpl
  return kv


def add_tokenizer_metadata(w: gguf.GGUFWriter, kv: Mapping[str, Any]) -> None:
  """Write tokenizer key/values with llama.cpp's value types."""
  for key, v in kv.items():
    if key.endswith("_token_id"):
      w.add_uint32(key, int(v))
    elif isinstance(v, bool):
      w.add_bool(key, v)
    elif key == "tokenizer.ggml.token_type":
      w.add_array(key, [int(x) for x in v])  # INT32 elements
    elif isinstance(v, list):
      w.add_array(key, v)
    else:
      w.add_string(key, str(v))


# --- GGUF writing ---------------------------------------------------------------------------------

def add_model_metadata(w: gguf.GGUFWriter, cfg: ModelConfig, *, file_type: int = 0,
                       name: str | None = None, feed_forward_length: int | None = None,
                       full_attention_interval: int = 4, label: str | None = None) -> None:
  """Write general.* and qwen3next.* keys as llama.cpp's converter does."""
  a = ARCH + "."
  w.add_type(gguf.GGUFType.MODEL)
  if name:
    w.add_name(name)
  if label:
    w.add_size_label(label)
  w.add_file_type(int(file_type))
  w.add_quantization_version(gguf.GGML_QUANT_VERSION)
  u32 = {
      "block_count": cfg.n_layers + cfg.n_mtp, "context_length": cfg.context_length,
      "embedding_length": cfg.d_model,
      "feed_forward_length": feed_forward_length or cfg.d_ff_expert,
      "attention.head_count": cfg.n_head, "attention.head_count_kv": cfg.n_kv_head,
      "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
      "rope.dimension_count": cfg.n_rot,
      "expert_count": cfg.n_experts, "expert_used_count": cfg.n_experts_used,
      "expert_feed_forward_length": cfg.d_ff_expert,
      "expert_shared_feed_forward_length": cfg.d_ff_shared,
      "ssm.conv_kernel": cfg.conv_kernel, "ssm.state_size": cfg.gdn_d_k,
      "ssm.group_count": cfg.gdn_n_k_heads, "ssm.time_step_rank": cfg.gdn_n_v_heads,
      "ssm.inner_size": cfg.gdn_value_dim,
      "full_attention_interval": full_attention_interval,
  }
  if cfg.n_mtp:
    u32["nextn_predict_layers"] = cfg.n_mtp
  for k, v in u32.items():
    w.add_uint32(a + k, int(v))
  w.add_float32(a + "attention.layer_norm_rms_epsilon", float(cfg.rms_eps))
  w.add_float32(a + "rope.freq_base", float(cfg.rope_base))
  # one entry per block, the MTP block (full attention) included, as llama.cpp writes it
  w.add_array(a + "attention.recurrent_layers",
              [t == config_lib.GDN for t in cfg.layer_types] + [False] * cfg.n_mtp)


def default_tensor_type(outtype: str) -> Callable[[str, tuple[int, ...]], T]:
  """llama.cpp's rule: f16/bf16 for matrices, F32 for 1-D and `names.KEEP_F32_SUFFIXES`."""
  want = OUTTYPES[outtype][0]
  return lambda name, shape: T.F32 if names.keeps_f32(name, len(shape)) else want


def encode_tensor(x: np.ndarray, qtype: T) -> np.ndarray:
  """float32 -> the bytes/elements GGUFWriter expects for `qtype`."""
  if qtype == T.F32:
    return np.ascontiguousarray(x, np.float32)
  if qtype == T.F16:
    return np.ascontiguousarray(x, np.float16)
  if qtype == T.BF16:  # round-to-nearest-even, as llama.cpp; written as raw uint16 bits
    return np.ascontiguousarray(x.astype(ml_dtypes.bfloat16)).view(np.uint16)
  return gguf.quants.quantize(np.ascontiguousarray(x, np.float32), qtype)


def _size_label(shapes: Mapping[str, tuple[int, ...]], n_experts: int) -> str:
  expert = sum(int(np.prod(s)) for n, s in shapes.items() if "_exps." in n) // max(n_experts, 1)
  shared = sum(int(np.prod(s)) for n, s in shapes.items() if "_exps." not in n)
  return size_label(shared + expert * n_experts, shared, expert, n_experts)


def write_model_gguf(out_path, cfg: ModelConfig,
                     tensors: Mapping[str, np.ndarray | Callable[[], np.ndarray]], *,
                     outtype: str = "f32", tokenizer_kv: Mapping[str, Any] | None = None,
                     name: str | None = None, feed_forward_length: int | None = None,
                     full_attention_interval: int = 4,
                     tensor_type: Callable[[str, tuple[int, ...]], T] | None = None,
                     encode: Callable[[np.ndarray, T], np.ndarray] = encode_tensor,
                     extra_kv: Callable[[gguf.GGUFWriter], None] | None = None,
                     progress: bool | None = None) -> str:
  """Write a qwen3next model GGUF, one tensor at a time, atomically (temp file + rename).

  Args:
    out_path: the .gguf to write.
    cfg: the geometry (written as metadata; tensor shapes are checked against it).
    tensors: {GGUF name: float32 array or a thunk returning one}, exactly the names of
      `names.gguf_tensor_shapes(cfg)`, `output.weight` optional (tied LM head).
    outtype: "f32", "f16" or "bf16" (sets general.file_type and the default tensor types).
    tokenizer_kv: tokenizer key/values (see `hf_tokenizer_kv`), or None for no tokenizer.
    name: general.name.
    feed_forward_length: qwen3next.feed_forward_length (unused by the model).
    full_attention_interval: written beside the explicit recurrent_layers array.
    tensor_type: per-tensor GGML type, (name, numpy shape) -> type; default from `outtype`.
    encode: (float32 array, type) -> data for GGUFWriter (tests plug K-quant encoders here).
    extra_kv: called with the writer after the standard keys (to add or override keys).
    progress: show a tqdm bar (default: when stderr is a terminal).

  Returns:
    out_path as a string.
  """
  out_path = os.fspath(out_path)
  if outtype not in OUTTYPES:
    raise StrataError(f"{out_path}: outtype {outtype!r} is not one of {sorted(OUTTYPES)}")
  tied = "output.weight" not in tensors
  shapes = names.gguf_tensor_shapes(cfg, tied=tied)
  missing, extra = set(shapes) - set(tensors), set(tensors) - set(shapes)
  if missing or extra:
    raise StrataError(f"{out_path}: tensors do not match the config: missing "
                      f"{sorted(missing)[:8]}, unexpected {sorted(extra)[:8]}")
  tensor_type = tensor_type or default_tensor_type(outtype)
  types = {n: tensor_type(n, s) for n, s in shapes.items()}

  tmp = out_path + ".tmp"
  w = gguf.GGUFWriter(tmp, ARCH)
  add_model_metadata(w, cfg, file_type=OUTTYPES[outtype][1], name=name,
                     feed_forward_length=feed_forward_length,
                     full_attention_interval=full_attention_interval,
                     label=_size_label(shapes, cfg.n_experts))
  if tokenizer_kv:
    add_tokenizer_metadata(w, tokenizer_kv)
  if extra_kv is not None:
    extra_kv(w)
  for n, s in shapes.items():
    block, type_size = gguf.GGML_QUANT_SIZES[types[n]]
    nbytes = int(np.prod(s)) * type_size // block
    w.add_tensor_info(n, s, np.dtype(np.float32), nbytes, raw_dtype=types[n])
  try:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    disable = not sys.stderr.isatty() if progress is None else not progress
    for n in tqdm(shapes, desc="writing", unit="tensor", disable=disable, leave=False):
      x = tensors[n]
      x = np.asarray(x() if callable(x) else x, np.float32)
      if x.shape != shapes[n]:
        raise StrataError(f"{out_path}: tensor {n!r} has shape {x.shape}, expected {shapes[n]}")
      w.write_tensor_data(encode(x, types[n]))
    w.close()
    os.replace(tmp, out_path)
  finally:
    w.close()
    if os.path.exists(tmp):
      os.remove(tmp)
  return out_path


# --- transformers checkpoint -> GGUF tensors ------------------------------------------------------

def _elementwise(kind: str, x: np.ndarray) -> np.ndarray:
  if kind == names.PLUS_ONE:
    return x + 1.0
  if kind == names.NEG_EXP:
    return -np.exp(x)
  if kind == names.SQUEEZE:
    return x[:, 0, :]
  return x


def split_qkvz(w: np.ndarray, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
  """in_proj_qkvz [Hk*(2Dk + 2rDv), D], per k-head group [q k v z], -> (attn_qkv, attn_gate).

  attn_qkv = [q of all k-heads | k of all k-heads | v of all v-heads]; attn_gate = z, with
  v-heads kept in group order (v-head h belongs to k-head h // r).
  """
  hk, dk, dv = cfg.gdn_n_k_heads, cfg.gdn_d_k, cfg.gdn_d_v
  r = cfg.gdn_n_v_heads // hk
  g = w.reshape(hk, 2 * dk + 2 * r * dv, w.shape[-1])
  q, k = g[:, :dk], g[:, dk:2 * dk]
  v, z = g[:, 2 * dk:2 * dk + r * dv], g[:, 2 * dk + r * dv:]
  flat = lambda a: a.reshape(-1, w.shape[-1])  # noqa: E731
  return np.concatenate([flat(q), flat(k), flat(v)]), flat(z)


def _hf_shape(m: names.HFMatch, cfg: ModelConfig, gguf_shape: tuple[int, ...]) -> tuple:
  kind = m.spec.transform
  if kind == names.SQUEEZE:
    return (gguf_shape[0], 1, gguf_shape[1])
  if kind == names.QKVZ:
    return (2 * cfg.gdn_key_dim + 2 * cfg.gdn_value_dim, cfg.d_model)
  if kind == names.EXPERT:
    return gguf_shape[1:]
  if kind == names.GATE_UP:
    return (gguf_shape[0], 2 * gguf_shape[1], gguf_shape[2])
  return gguf_shape


def hf_gguf_tensors(st: SafeTensorsDir, cfg: ModelConfig, tied: bool
                    ) -> dict[str, Callable[[], np.ndarray]]:
  """{GGUF name: thunk} for every tensor of the checkpoint, shapes checked first."""
  where = st.dir
  shapes = names.gguf_tensor_shapes(cfg, tied=tied)
  thunks: dict[str, Callable[[], np.ndarray]] = {}
  experts: dict[str, dict[int, str]] = {}
  for key in st.keys():
    if key.startswith("mtp."):
      # the multi-token-prediction head -> block n_layers, as llama.cpp's converter writes it
      m = names.match_hf_mtp(key, cfg.n_layers) if cfg.n_mtp else None
      if m is None:
        raise StrataError(f"{where}: MTP tensor {key!r} has no qwen3next GGUF counterpart")
    else:
      m = names.match_hf(key)
    if m is None:
      raise StrataError(f"{where}: tensor {key!r} has no qwen3next GGUF counterpart")
    if tied and m.gguf_names == ("output.weight",):
      continue
    for g in m.gguf_names:
      if g not in shapes:
        raise StrataError(f"{where}: tensor {key!r} does not fit the config (no {g!r} in a "
                          f"model with layer pattern {cfg.layer_types!r})")
    want = _hf_shape(m, cfg, shapes[m.gguf_names[0]])
    if st.shape(key) != want:
      raise StrataError(f"{where}: tensor {key!r} has shape {st.shape(key)}, expected {want} "
                        "for this config")
    kind = m.spec.transform
    if kind == names.EXPERT:
      experts.setdefault(m.gguf_names[0], {})[m.expert] = key
    elif kind == names.QKVZ:
      for part, g in enumerate(m.gguf_names):
        thunks[g] = lambda key=key, part=part: split_qkvz(st.get(key), cfg)[part]
    elif kind == names.GATE_UP:
      f = cfg.d_ff_expert
      thunks[m.gguf_names[0]] = lambda key=key: st.get(key)[:, :f]
      thunks[m.gguf_names[1]] = lambda key=key: st.get(key)[:, f:]
    else:
      thunks[m.gguf_names[0]] = lambda key=key, kind=kind: _elementwise(kind, st.get(key))
  for g, parts in experts.items():
    if sorted(parts) != list(range(cfg.n_experts)):
      lost = sorted(set(range(cfg.n_experts)) - set(parts))
      raise StrataError(f"{where}: experts {lost} are missing for {g!r}")
    thunks[g] = lambda parts=parts: np.stack([st.get(parts[j]) for j in range(len(parts))])
  missing = [g for g in shapes if g not in thunks]
  if missing:
    raise StrataError(f"{where}: the checkpoint lacks tensors for {missing[:8]}")
  return {g: thunks[g] for g in shapes}


def convert_hf(hf_dir, out_path, outtype: str = "f32", *, name: str | None = None,
               progress: bool | None = None) -> str:
  """Convert a transformers Qwen3-Next checkpoint directory to a GGUF.

  Args:
    hf_dir: directory with config.json and *.safetensors (per-expert keys as saved by
      `save_pretrained`, or transformers 5's fused `experts.gate_up_proj`/`down_proj`; an
      `mtp.*` head becomes block n_layers with `nextn_predict_layers`, docs/mtp.md), and
      optionally tokenizer.json, tokenizer_config.json (chat_template) or chat_template.jinja.
    out_path: the GGUF to write.
    outtype: "f32", "f16" or "bf16"; 1-D tensors, ssm_a, ssm_dt.bias, ssm_conv1d,
      ffn_gate_inp and ffn_gate_inp_shexp stay F32.
    name: general.name (default: the directory name).
    progress: show a tqdm bar (default: when stderr is a terminal).

  Returns:
    out_path as a string.

  Raises:
    StrataError: the directory is not a supported Qwen3-Next checkpoint.
  """
  hf_dir = os.fspath(hf_dir)
  hf = read_hf_config(hf_dir)
  where = os.path.join(hf_dir, "config.json")
  model_config_from_hf(hf, where=where)   # a config problem is reported before the tensors
  st = SafeTensorsDir(hf_dir)
  has_mtp = any(k.startswith("mtp.") for k in st.keys())
  cfg = model_config_from_hf(hf, where=where, has_mtp=has_mtp)
  tied = bool(hf.get("tie_word_embeddings")) or "lm_head.weight" not in st.entries
  tensors = hf_gguf_tensors(st, cfg, tied)
  return write_model_gguf(
      out_path, cfg, tensors, outtype=outtype,
      tokenizer_kv=hf_tokenizer_kv(hf_dir, cfg.vocab_size, hf),
      name=name or Path(hf_dir).resolve().name,
      feed_forward_length=hf.get("intermediate_size"),
      full_attention_interval=int(hf.get("full_attention_interval", 4)), progress=progress)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("hf_dir")
  p.add_argument("out")
  p.add_argument("--outtype", default="f32", choices=sorted(OUTTYPES))
  p.add_argument("--name", default=None)
  args = p.parse_args(argv)
  try:
    convert_hf(args.hf_dir, args.out, args.outtype, name=args.name)
  except StrataError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
