"""Slicing params, adapters, control vectors and state into per-stage pieces on their devices.

A stage owns layers [lo, hi). Stage 0 also holds the embedding; the last stage the final norm
and the LM head. Each stage's arrays are committed to its device; the engine hands the
activation [T, D] from one stage's device to the next (one transfer per boundary per step).
"""
from __future__ import annotations

import dataclasses

import jax

from strata_jax.config import ATTN, GDN, ModelConfig
from strata_jax.params import LayerParams, LoraParams, Params


@dataclasses.dataclass
class Stage:
  layers: tuple[int, int]
  cfg: ModelConfig
  params: Params
  lora: LoraParams | None
  device: object | None
  cvec: jax.Array | None = None   # the control vector rows of layers [lo, hi): [hi - lo, D]


def _kind_range(cfg: ModelConfig, lo: int, hi: int, kind: str) -> slice:
  return slice(cfg.layer_types[:lo].count(kind), cfg.layer_types[:hi].count(kind))


def slice_layers(cfg: ModelConfig, layers: LayerParams, lo: int, hi: int) -> LayerParams:
  g, a = _kind_range(cfg, lo, hi, GDN), _kind_range(cfg, lo, hi, ATTN)
  return LayerParams(
      attn_norm=layers.attn_norm[lo:hi], post_norm=layers.post_norm[lo:hi],
      gdn=jax.tree.map(lambda x: x[g], layers.gdn), attn=jax.tree.map(lambda x: x[a], layers.attn),
      moe=jax.tree.map(lambda x: x[lo:hi], layers.moe))


def slice_lora(cfg: ModelConfig, lora: LoraParams | None, lo: int, hi: int) -> LoraParams | None:
  if lora is None:
    return None
  g, a = _kind_range(cfg, lo, hi, GDN), _kind_range(cfg, lo, hi, ATTN)
  return LoraParams(gdn_a=lora.gdn_a[g], gdn_b=lora.gdn_b[g], attn_a=lora.attn_a[a],
                    attn_b=lora.attn_b[a], table=lora.table)


def parse_ranges(n_layers: int, counts: list[int]) -> list[tuple[int, int]]:
  """[24, 24] -> [(0, 24), (24, 48)]; the counts must be positive and sum to n_layers."""
  if any(c <= 0 for c in counts) or sum(counts) != n_layers:
    raise ValueError(f"layer split {','.join(map(str, counts))} must be positive counts that "
                     f"sum to the model's {n_layers} layers")
  out, lo = [], 0
  for c in counts:
    out.append((lo, lo + c))
    lo += c
  return out


def slice_cvec(cvec: jax.Array | None, lo: int, hi: int, device=None) -> jax.Array | None:
  """A control vector's rows [lo, hi) (None stays None), committed to `device` when given."""
  if cvec is None:
    return None
  rows = cvec[lo:hi]
  return jax.device_put(rows, device) if device is not None else rows


def make_stages(cfg: ModelConfig, params: Params | None, lora: LoraParams | None,
                ranges: list[tuple[int, int]], devices: list | None,
                stage_params: list[Params] | None = None,
                cvec: jax.Array | None = None) -> list[Stage]:
  """Cut the model into stages; with `devices`, commit each stage's arrays to its device.

  `stage_params`: each stage's Params, already placed (a model loaded with a split has no
  whole-model params); then only the adapter is cut and placed. `cvec`: the control vector
  [L, D] or None."""
  if stage_params is not None and len(stage_params) != len(ranges):
    raise ValueError(f"{len(stage_params)} loaded stages but {len(ranges)} layer ranges")
  stages = []
  last = len(ranges) - 1
  for i, (lo, hi) in enumerate(ranges):
    if stage_params is not None:
      p = stage_params[i]
    else:
      p = Params(embed=params.embed if i == 0 else None,
                 final_norm=params.final_norm if i == last else None,
                 lm_head=params.lm_head if i == last else None,
                 layers=slice_layers(cfg, params.layers, lo, hi),
                 mtp=params.mtp if i == last else None)
    lr = slice_lora(cfg, lora, lo, hi)
    dev = devices[i] if devices else None
    if dev is not None:
      if stage_params is None:
        p = jax.device_put(p, dev)
      lr = jax.device_put(lr, dev)
    stages.append(Stage(layers=(lo, hi), cfg=cfg.stage(lo, hi), params=p, lora=lr, device=dev,
                        cvec=slice_cvec(cvec, lo, hi, dev)))
  return stages
