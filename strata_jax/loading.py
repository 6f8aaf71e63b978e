"""A model and its adapters from parsed command-line arguments (`generate`, `serve`).

Below both the CLI and the server: `cli` parses, `serve.app` serves, and both load through here.
"""
from __future__ import annotations

from strata_jax.errors import AdapterError, ControlVectorError


def _file_scales(value: str, scaled: bool, flag: str, error) -> tuple[list[str], list[float]]:
  """One flag value "F[,F...]" (scale 1 each) or, scaled, "F:S[,F:S...]" -> (paths, scales);
  a malformed item raises `error` naming the flag."""
  paths, scales = [], []
  for item in value.split(","):
    if not item:
      continue
    f, sep, s = item.rpartition(":") if scaled else (item, ":", "1")
    try:
      if not sep or not f:
        raise ValueError
      scales.append(float(s))
    except ValueError:
      raise error(f"{flag} {item!r}: expected FILE:SCALE") from None
    paths.append(f)
  return paths, scales


def parse_lora(args) -> list[tuple[list[str], list[float]]]:
  """--lora F[,F...] and --lora-scaled F:S[,F:S...], each repeatable -> one (paths, scales)
  group per flag occurrence, in command-line order."""
  groups = []
  for kind, value in getattr(args, "lora_groups", None) or []:
    paths, scales = _file_scales(value, kind != "plain", "--lora-scaled", AdapterError)
    if paths:
      groups.append((paths, scales))
  return groups


def load_from_args(args):
  """(Model, adapters) from --model, --dtype, --layer-split, --split-devices, --forms,
  --weights, --lora*: adapters is a list of `(LoraSet, default scale, path)`, one numbered
  adapter per flag occurrence (empty without --lora). A group of one file is loaded at scale 1
  with its scale as the default (llama.cpp's `--lora-scaled`, changeable per request; a
  negative scale, which requests cannot name, is folded in instead); a comma-separated group
  stacks its files with their scales folded in, default scale 1."""
  from strata_jax.api import load_lora, load_model  # noqa: PLC0415 (keeps import light)
  from strata_jax.forms import parse_forms  # noqa: PLC0415
  model = load_model(args.model, dtype=args.dtype, layer_split=args.layer_split,
                     split_devices=args.split_devices, forms=parse_forms(args.forms),
                     weights=getattr(args, "weights", "keep"))
  adapters = []
  for paths, scales in parse_lora(args):
    if len(paths) == 1 and scales[0] >= 0:   # (a request's scale is >= 0: a negative folds)
      adapters.append((load_lora(model, paths), scales[0], paths[0]))
    else:
      adapters.append((load_lora(model, paths, scales), 1.0, ",".join(paths)))
  return model, adapters


def parse_control_vectors(args) -> tuple[list[str], list[float]]:
  """--control-vector F[,F...] and --control-vector-scaled F:S[,F:S...] (each may repeat; the
  files keep their command-line order) -> (paths, scales)."""
  paths, scales = [], []
  for kind, value in getattr(args, "control_vectors", None) or []:
    p, s = _file_scales(value, kind != "plain", "--control-vector-scaled", ControlVectorError)
    paths += p
    scales += s
  return paths, scales


def control_vector_from_args(args, model):
  """The `ControlVector` of --control-vector*, or None when no file is given (then, as in
  llama.cpp, --control-vector-layer-range alone does nothing)."""
  from strata_jax.api import load_control_vector  # noqa: PLC0415 (keeps import light)
  paths, scales = parse_control_vectors(args)
  if not paths:
    return None
  rng = getattr(args, "control_vector_layer_range", None)
  return load_control_vector(model, paths, scales, tuple(rng) if rng else None)
