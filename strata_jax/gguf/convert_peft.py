"""A PEFT LoRA directory for a transformers Qwen3-Next base -> a llama.cpp adapter GGUF.

The output is what llama.cpp's `convert_lora_to_gguf.py` writes (`reference/anchors-mission.md`
§A1): `general.architecture = qwen3next`, `general.type = adapter`, `adapter.type = lora`,
`adapter.lora.alpha` (f32, from `lora_alpha`), `general.name`, `general.quantization_version`;
tensors `<gguf base>.lora_a` = PEFT `lora_A.weight` [r, n_in] and `<gguf base>.lora_b` = PEFT
`lora_B.weight` [n_out, r], with the base converter's transforms replayed on the pair:
`in_proj_qkvz` becomes `attn_qkv` + `attn_gate` by re-ordering B's rows with the base
converter's own `convert_hf.split_qkvz` (A is shared); every other supported projection is
copied. The base `config.json` is read with `convert_hf.model_config_from_hf`, so a base the
model converter refuses (e.g. dense MLP layers) is refused here too.

Where llama.cpp's converter is silent or wrong, we decide:

* rsLoRA (`use_rslora`): PEFT scales by alpha/sqrt(r), but llama.cpp's converter copies
  `lora_alpha` and its loader scales by alpha/r. We write alpha*sqrt(r) instead, so that every
  llama.cpp-format loader (ours included) computes PEFT's scale; A and B stay PEFT's. This needs
  one rank for every tensor; with `rank_pattern` giving other ranks, it is refused.
* `rank_pattern` alone is fine: the GGUF rank is per tensor (B's shape), as PEFT's is.
* `alpha_pattern` with a value other than `lora_alpha`: refused (a GGUF adapter has one alpha).
* DoRA (`use_dora`), LoRA biases (`lora_bias`), non-LORA PEFT types: refused.
* Norm vectors (mergekit-extract-lora writes them): skipped with a warning (llama.cpp keeps them,
  and its loader then skips them). Any other non-LoRA tensor is refused, as llama.cpp does.
* LoRA on a module with no one-to-one GGUF weight (experts, embeddings, conv, unknown names):
  skipped, named in one warning.
* `--outtype q8_0`: a tensor whose rows are not a multiple of 32 is written F16, as llama.cpp's
  converter falls back.
"""
from __future__ import annotations

import json
import math
import os
import re
import warnings

import gguf
import numpy as np

from strata_jax.config import ModelConfig
from strata_jax.errors import AdapterError, StrataError
from strata_jax.gguf.adapter import ARCH, KEY_ALORA_TOKENS, KEY_ALPHA, AdapterWarning
from strata_jax.gguf.convert_hf import model_config_from_hf, split_qkvz
from strata_jax.gguf.names import COPY, QKVZ, hf_to_gguf

_QT = gguf.GGMLQuantizationType
OUTTYPES = {"f32": _QT.F32, "f16": _QT.F16, "bf16": _QT.BF16, "q8_0": _QT.Q8_0}

# "base_model.model.model.layers.3.self_attn.o_proj.lora_A.weight"; older PEFT versions keep
# the adapter name ("lora_A.default.weight").
_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])"
                       r"(?:\.[^.]+)?\.weight$")
_EMBED_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_embedding_[AB]"
                        r"(?:\.[^.]+)?$")


def convert_peft(peft_dir: str | os.PathLike, base_hf_dir: str | os.PathLike | None,
                 out_path: str | os.PathLike, outtype: str = "f32") -> str:
  """Converts a PEFT LoRA adapter for Qwen3-Next into a llama.cpp adapter GGUF.

  Args:
    peft_dir: holds `adapter_config.json` and `adapter_model.safetensors` (or `.bin`).
    base_hf_dir: the transformers base model directory (its `config.json` is read); None uses
      the adapter config's `base_model_name_or_path` when that is a local directory.
    out_path: the GGUF to write.
    outtype: "f32" (llama.cpp's default), "f16", "bf16" or "q8_0".

  Returns:
    out_path, as a string.

  Raises:
    AdapterError: the adapter or base config cannot be converted (message names the file,
      tensor and shapes).
  """
  peft_dir, out_path = os.fspath(peft_dir), os.fspath(out_path)
  if outtype not in OUTTYPES:
    raise AdapterError(f"outtype {outtype!r} is not one of {', '.join(OUTTYPES)}")
  where = f"PEFT adapter '{peft_dir}'"
  pcfg = _read_json(os.path.join(peft_dir, "adapter_config.json"), where)
  if base_hf_dir is None:
    base_hf_dir = pcfg.get("base_model_name_or_path")
    if not base_hf_dir or not os.path.isdir(base_hf_dir):
      raise AdapterError(f"{where}: no base model directory given, and base_model_name_or_path "
                         f"{base_hf_dir!r} is not a local directory")
  base = _read_json(os.path.join(os.fspath(base_hf_dir), "config.json"), "base model")
  try:
    cfg = model_config_from_hf(base, where=f"base model '{base_hf_dir}'")
  except StrataError as e:
    raise AdapterError(str(e)) from None

  pairs, skipped = _read_pairs(peft_dir, where)
  alpha = _alpha(pcfg, pairs, where)
  out, unsupported = [], []
  for module, (a, b) in pairs.items():
    m = hf_to_gguf(module + ".weight")
    if m is None or m.spec.transform not in (COPY, QKVZ):
      unsupported.append(module)
      continue
    if m.spec.hf == "lm_head.weight" and base.get("tie_word_embeddings", False):
      raise AdapterError(f"{where}: lm_head is present in adapter, but the base model ties it to "
                         "the embeddings (llama.cpp has no separate output.weight to adapt)")
    if m.spec.transform == COPY:
      out.append((m.gguf_names[0], a, b))
    else:
      qkv, gate = _split_qkvz_b(b, cfg, f"{where}: '{module}'")
      out += [(m.gguf_names[0], a, qkv), (m.gguf_names[1], a, gate)]
  if skipped or unsupported:
    warnings.warn(f"{where}: not converted: {', '.join(skipped + unsupported)} (only projections "
                  "with a one-to-one GGUF weight, and in_proj_qkvz, are supported)",
                  AdapterWarning, stacklevel=2)

  w = gguf.GGUFWriter(out_path, arch=ARCH)
  w.add_type(gguf.GGUFType.ADAPTER)
  w.add_string(gguf.Keys.Adapter.TYPE, "lora")
  w.add_float32(KEY_ALPHA, alpha)
  # llama.cpp's metadata heuristic gives a plain directory name title-cased ("Lora_A1").
  w.add_name(os.path.basename(os.path.normpath(peft_dir)).title())
  w.add_quantization_version(gguf.GGML_QUANT_VERSION)
  tokens = pcfg.get("alora_invocation_tokens")
  if tokens:
    w.add_key_value(KEY_ALORA_TOKENS, [int(t) for t in tokens], gguf.GGUFValueType.ARRAY,
                    sub_type=gguf.GGUFValueType.UINT32)
  for name, a, b in out:
    for suffix, x in ((".lora_a", a), (".lora_b", b)):
      data, raw = _encode(x, outtype)
      w.add_tensor(name + suffix, data, raw_dtype=raw)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return out_path


def _read_json(path: str, what: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise AdapterError(f"{what}: cannot read '{path}' ({e})") from None


def _alpha(pcfg: dict, pairs: dict, where: str) -> float:
  """The `adapter.lora.alpha` to write (see the module docstring for the rules)."""
  if pcfg.get("peft_type", "LORA") != "LORA":
    raise AdapterError(f"{where}: peft_type {pcfg.get('peft_type')!r} is not LORA")
  for key in ("use_dora", "lora_bias"):
    if pcfg.get(key):
      raise AdapterError(f"{where}: {key} adapters cannot be written as a llama.cpp LoRA GGUF")
  alpha = float(pcfg.get("lora_alpha", 0.0))
  other = {k: v for k, v in (pcfg.get("alpha_pattern") or {}).items() if float(v) != alpha}
  if other:
    raise AdapterError(f"{where}: alpha_pattern {other} gives some modules an alpha other than "
                       f"lora_alpha {alpha:g}; a GGUF adapter has one alpha")
  if pcfg.get("use_rslora"):
    r = int(pcfg["r"])
    ranks = {m: b.shape[1] for m, (_, b) in pairs.items() if b.shape[1] != r}
    if ranks:
      raise AdapterError(f"{where}: rsLoRA with per-module ranks {ranks} (r = {r}) cannot be "
                         "expressed with one alpha")
    # llama.cpp scales by alpha/r; PEFT's rsLoRA by lora_alpha/sqrt(r).
    alpha *= math.sqrt(r)
  return alpha


def _load_state(peft_dir: str, where: str) -> dict[str, np.ndarray]:
  """{key: float32 numpy} from adapter_model.safetensors (or .bin)."""
  import torch  # the PEFT files are torch tensors (bf16 included); only the converter needs it

  st = os.path.join(peft_dir, "adapter_model.safetensors")
  pt = os.path.join(peft_dir, "adapter_model.bin")
  try:
    if os.path.isfile(st):
      from safetensors.torch import load_file
      state = load_file(st)
    elif os.path.isfile(pt):
      state = torch.load(pt, map_location="cpu", weights_only=True)
    else:
      raise AdapterError(f"{where}: neither adapter_model.safetensors nor adapter_model.bin found")
  except AdapterError:
    raise
  except Exception as e:  # corrupt files surface as many exception types
    raise AdapterError(f"{where}: cannot read the adapter weights ({type(e).__name__}: {e})") \
        from None
  return {k: v.detach().to(torch.float32).numpy() for k, v in state.items()}


def _read_pairs(peft_dir: str, where: str):
  """({module: (A [r, n_in], B [n_out, r])} in file order, [skipped names])."""
  halves: dict[str, dict[str, np.ndarray]] = {}
  skipped = []
  for key, x in _load_state(peft_dir, where).items():
    m = _LORA_KEY.match(key)
    if m:
      halves.setdefault(m["module"], {})[m["ab"]] = x
    elif ".base_layer." in key:
      continue
    elif _EMBED_KEY.match(key):
      skipped.append(_EMBED_KEY.match(key)["module"])
    elif "norm" in key:
      skipped.append(key)
    else:
      hint = (" (embeddings in an adapter usually mean tokens were added during fine-tuning)"
              if "embed_tokens" in key or "lm_head" in key else "")
      raise AdapterError(f"{where}: unexpected tensor '{key}' {list(x.shape)}: not a lora_A or "
                         f"lora_B tensor{hint}")
  pairs = {}
  for module, ab in halves.items():
    if set(ab) != {"A", "B"}:
      have = next(iter(ab))
      raise AdapterError(f"{where}: '{module}' has lora_{have} {list(ab[have].shape)} but no "
                         f"lora_{'B' if have == 'A' else 'A'}")
    a, b = ab["A"], ab["B"]
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
      raise AdapterError(f"{where}: '{module}' has lora_A {list(a.shape)} and lora_B "
                         f"{list(b.shape)}; expected [r, n_in] and [n_out, r]")
    pairs[module] = (a, b)
  return pairs, list(dict.fromkeys(skipped))


def _split_qkvz_b(b: np.ndarray, cfg: ModelConfig, where: str) -> tuple[np.ndarray, np.ndarray]:
  """in_proj_qkvz's lora_B [Hk*(2Dk + 2rDv), R] -> (B_qkv [2*Hk*Dk + Hv*Dv, R], B_gate [Hv*Dv, R]).

  The base converter's row re-ordering (`convert_hf.split_qkvz`) applied to B; it acts on rows
  only, so A is shared by both halves, as llama.cpp's LoraTorchTensor replays it.
  """
  rows = cfg.gdn_n_k_heads * (2 * cfg.gdn_d_k) + 2 * cfg.gdn_value_dim
  if b.shape[0] != rows:
    raise AdapterError(f"{where}: lora_B {list(b.shape)} does not have the {rows} rows of "
                       "in_proj_qkvz for the base config")
  return split_qkvz(b, cfg)


def _encode(x: np.ndarray, outtype: str):
  """(array to write, raw_dtype or None), rounding as llama.cpp's converter does."""
  qtype = OUTTYPES[outtype]
  if qtype == _QT.Q8_0 and x.shape[-1] % 32:
    qtype = _QT.F16
  x = np.ascontiguousarray(x, np.float32)
  if qtype == _QT.F32:
    return x, None
  if qtype == _QT.F16:
    return x.astype(np.float16), None
  return gguf.quants.quantize(x, qtype), qtype
