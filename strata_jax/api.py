"""The Python entry points: `load_model`, `load_lora`, `load_control_vector`."""
from __future__ import annotations

import dataclasses
import importlib.resources
import os
import warnings

import jax
import jax.numpy as jnp

from strata_jax.adapter_id import adapter_identity
from strata_jax.config import ModelConfig
from strata_jax.errors import AdapterError, GGUFError
from strata_jax.forms import Forms
from strata_jax.params import LoraSet, Params

DEFAULT_MODEL = "demo-base.gguf"
DEFAULT_ADAPTER = "demo-lora.gguf"
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass
class Model:
  """A loaded model: config, params, tokenizer, identity, and where its layers live.

  A model loaded with a layer split has no whole-model `params` (None): `stage_params` holds
  one Params per stage, already on its device (`layer_ranges`, `devices`). A one-stage model
  has `params` (and `stage_params` None).
  """
  cfg: ModelConfig
  params: Params | None
  dtype: object
  path: str
  fingerprint: str
  tokenizer: object | None = None
  add_bos: bool = False
  bos_id: int | None = None
  eos_id: int | None = None
  layer_ranges: list[tuple[int, int]] = dataclasses.field(default_factory=list)
  devices: list | None = None
  stage_params: list[Params] | None = None
  weights: str = "dequantize"
  file_bytes: int = 0

  def encode(self, text: str) -> list[int]:
    if self.tokenizer is None:
      raise GGUFError(f"{self.path}: the model file has no tokenizer; pass token ids instead")
    ids = self.tokenizer.encode(text)
    return ([self.bos_id] + ids) if self.add_bos and self.bos_id is not None else ids

  def stop_ids(self) -> list[int]:
    """Token ids that end a generation (end-of-generation tokens of the vocabulary)."""
    if self.tokenizer is not None and getattr(self.tokenizer, "eog_ids", None):
      return sorted(self.tokenizer.eog_ids)
    return [self.eos_id] if self.eos_id is not None else []

  def decode(self, ids) -> str | None:
    return self.tokenizer.decode(list(ids)) if self.tokenizer is not None else None

  def token_bytes(self, i: int) -> bytes | None:
    """The bytes one token stands for (None without a tokenizer)."""
    return self.tokenizer.token_bytes(int(i)) if self.tokenizer is not None else None


def asset_path(name: str) -> str:
  return str(importlib.resources.files("strata_jax") / "assets" / name)


def default_model_path() -> str:
  return asset_path(DEFAULT_MODEL)


def _dtype(dtype) -> object:
  if isinstance(dtype, str):
    if dtype not in _DTYPES:
      raise GGUFError(f"unknown dtype {dtype!r}: use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]
  return jnp.dtype(dtype).type if dtype is not None else jnp.float32


def load_model(path: str | None = None, dtype="float32", layer_split=None,
               split_devices=None, forms: Forms | None = None, weights: str = "keep",
               progress: bool | None = None) -> Model:
  """Load a qwen3next GGUF (default: the embedded demo model).

  Tensors stream from the file onto the device that owns their layer, one at a time through
  host memory; with a split, no device and no host buffer ever holds the whole model.

  Args:
    path: the GGUF file; None for the embedded default model.
    dtype: compute dtype, "float32" or "bfloat16".
    layer_split: None (one device), "auto" (ranges from the file's tensor sizes and the
      devices' free memory), or per-stage layer counts ("24,24" or [24, 24]).
    split_devices: device indices for the stages (default: the first N devices); given
      without `layer_split`, the split is "auto" over these devices.
    forms: how each op is computed (`strata_jax.forms.Forms`; default `Forms()`), resolved
      for this backend and dtype: float32 runs full-fp32 matmuls unless it names "tf32".
    weights: "keep" (Q8_0 / Q4_K / Q5_K / Q6_K projections stay quantised on the device) or
      "dequantize" (everything in the compute dtype).
    progress: a progress bar over the bytes read (default: when stderr is a terminal).
  """
  from strata_jax.gguf.reader import WEIGHTS_MODES, read_model_gguf  # noqa: PLC0415
  from strata_jax.parallel.plan import select_devices  # noqa: PLC0415

  path = path or default_model_path()
  if not os.path.isfile(path):
    raise GGUFError(f"{path}: no such model file")
  if weights not in WEIGHTS_MODES:
    raise GGUFError(f"{path}: weights={weights!r}: expected one of {', '.join(WEIGHTS_MODES)}")
  dt = _dtype(dtype)
  if split_devices is not None and layer_split is None:
    layer_split = "auto"   # devices named alone: a layer split over them, as llama.cpp's --device
  devs = select_devices(split_devices) if layer_split is not None else None
  mf = read_model_gguf(path, dtype=dt, progress=progress, weights=weights,
                       layer_split=layer_split, devices=devs)
  backend = jax.default_backend()
  forms = (forms or Forms()).resolve(backend, dt).check_backend(backend)
  cfg = dataclasses.replace(mf.cfg, forms=forms)
  one = mf.devices is None
  return Model(cfg=cfg, params=mf.stages[0] if one else None, dtype=dt, path=path,
               fingerprint=mf.fingerprint, tokenizer=mf.tokenizer, add_bos=mf.add_bos,
               bos_id=mf.bos_id, eos_id=mf.eos_id, layer_ranges=list(mf.ranges),
               devices=mf.devices, stage_params=None if one else list(mf.stages),
               weights=weights, file_bytes=mf.file_bytes)


def load_lora(model: Model, paths, scales=None) -> LoraSet:
  """Load llama.cpp LoRA adapter GGUF(s) for `model`; several files stack their ranks."""
  from strata_jax.gguf.adapter import read_adapters  # noqa: PLC0415 (keeps import light)

  paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
  if not paths:
    raise AdapterError("load_lora needs at least one adapter file")
  scales = [1.0] * len(paths) if scales is None else list(scales)
  if len(scales) != len(paths):
    raise AdapterError(f"{len(paths)} adapter files but {len(scales)} scales")
  with warnings.catch_warnings():
    warnings.simplefilter("always")
    ls = read_adapters(model.cfg, [str(p) for p in paths], scales, dtype=model.dtype)
  aid = adapter_identity([(str(p), float(s)) for p, s in zip(paths, scales)])
  return dataclasses.replace(ls, adapter_id=aid)


def load_control_vector(model: Model, paths, scales=None, layer_range=None):
  """Load llama.cpp control-vector GGUF(s) for `model`, summed with their scales.

  Args:
    model: the loaded model.
    paths: one file or a list of files.
    scales: one finite scale per file (default 1.0 each; negative steers the other way).
    layer_range: `(start, end)`, inclusive graph layer indices (llama.cpp's
      `--control-vector-layer-range`); None for every layer.

  Returns:
    A `ControlVector` to pass as `Engine(model, control_vector=...)`.

  Raises:
    ControlVectorError: a file is not a control vector for this model (see
      `strata_jax.gguf.control_vector`), a bad scale or an empty range.
  """
  from strata_jax.gguf.control_vector import read_control_vectors  # noqa: PLC0415

  return read_control_vectors(model.cfg, paths, scales=scales, layer_range=layer_range,
                              dtype=model.dtype)


def model_fingerprint(model: Model, lora: LoraSet | None, control_vector=None) -> str:
  """Identity for session files: the model's alone without an adapter or control vector,
  else with `+lora:<id>` and then `+cvec:<id>` (16 hex digits each) appended."""
  fp = model.fingerprint if lora is None else f"{model.fingerprint}+lora:{lora.adapter_id:016x}"
  if control_vector is not None:
    fp += f"+cvec:{control_vector.control_vector_id:016x}"
  return fp
