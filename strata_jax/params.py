"""Parameter pytrees. Every leaf is described once in `param_shapes`; the GGUF loader, random
init for tests, layer-split slicing and shardings all derive from it.

Weights keep GGUF's numpy order: a projection is W [out, in] and is applied as x @ W.T.
Layer-stacked leaves have a leading layer axis: per layer kind ([Lg] GDN, [La] attention)
or over all layers ([L]) for norms and the MoE.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from strata_jax.config import ModelConfig

# Leaves kept in float32 whatever the compute dtype: small, and precision-critical.
FP32_LEAVES = frozenset({"gdn.a", "gdn.dt_bias", "gdn.conv", "moe.router", "moe.shared_gate_inp"})


@struct.dataclass
class QGroups:
  """A layer-stacked quantised leaf whose layers have several GGUF types (llama.cpp's K-quant
  mixes give some layers' attn_v / ffn_down more bits): one QTensor stack per type.

  Attributes:
    parts: the stacks (`pallas_kernels.quant.layout.QTensor`), one per type.
    group: per layer of the stage (static), which part holds it.
    pos: per layer, its index in that part.
  """
  parts: tuple
  group: tuple = struct.field(pytree_node=False, default=())
  pos: tuple = struct.field(pytree_node=False, default=())

  @property
  def nbytes(self) -> int:
    return sum(p.nbytes for p in self.parts)

  @property
  def shape(self) -> tuple:
    return (len(self.group), *self.parts[0].shape[1:])


@struct.dataclass
class GDNParams:
  qkv: jax.Array       # [Lg, 2*Hk*Dk + Hv*Dv, D]  attn_qkv: q | k | v
  gate: jax.Array      # [Lg, Hv*Dv, D]            attn_gate (z)
  ba: jax.Array        # [Lg, 2*Hv, D]             ssm_ba, per k-group [b(r) | a(r)]
  conv: jax.Array      # [Lg, C, K]                ssm_conv1d
  a: jax.Array         # [Lg, Hv]                  ssm_a = -exp(A_log)
  dt_bias: jax.Array   # [Lg, Hv]                  ssm_dt.bias
  norm: jax.Array      # [Lg, Dv]                  ssm_norm (no +1)
  out: jax.Array       # [Lg, D, Hv*Dv]            ssm_out


@struct.dataclass
class AttnParams:
  q: jax.Array         # [La, 2*H*Hd, D]  attn_q, per head [q | gate]
  k: jax.Array         # [La, G*Hd, D]
  v: jax.Array         # [La, G*Hd, D]
  q_norm: jax.Array    # [La, Hd]
  k_norm: jax.Array    # [La, Hd]
  out: jax.Array       # [La, D, H*Hd]   attn_output


@struct.dataclass
class MoEParams:
  router: jax.Array           # [L, E, D]      ffn_gate_inp
  gate_exps: jax.Array        # [L, E, F, D]
  up_exps: jax.Array          # [L, E, F, D]
  down_exps: jax.Array        # [L, E, D, F]
  shared_gate: jax.Array      # [L, Fs, D]     ffn_gate_shexp
  shared_up: jax.Array        # [L, Fs, D]
  shared_down: jax.Array      # [L, D, Fs]
  shared_gate_inp: jax.Array  # [L, 1, D]      ffn_gate_inp_shexp


@struct.dataclass
class LayerParams:
  attn_norm: jax.Array   # [L, D]  (+1 already folded in, as in GGUF)
  post_norm: jax.Array   # [L, D]
  gdn: GDNParams
  attn: AttnParams
  moe: MoEParams


@struct.dataclass
class MTPParams:
  """The multi-token-prediction (MTP) head: one gated-attention + MoE block fed
  `eh_proj · [enorm(embed(t)) ; hnorm(h)]` (docs/mtp.md). GGUF block `n_layers` (`blk.N.*`,
  with `blk.N.nextn.*`); its layer leaves keep a leading axis of 1 so the layer code reads
  them as a stack of one."""
  eh_proj: jax.Array     # [D, 2D]  nextn.eh_proj (columns: embedding half, then hidden half)
  enorm: jax.Array       # [D]      nextn.enorm (+1 folded in)
  hnorm: jax.Array       # [D]      nextn.hnorm
  head_norm: jax.Array   # [D]      nextn.shared_head_norm (before the shared LM head)
  attn_norm: jax.Array   # [1, D]
  post_norm: jax.Array   # [1, D]
  attn: AttnParams       # [1, ...]
  moe: MoEParams         # [1, ...]


@struct.dataclass
class Params:
  embed: jax.Array       # [V, D]
  final_norm: jax.Array  # [D]
  lm_head: jax.Array     # [V, D]
  layers: LayerParams
  mtp: MTPParams | None = None   # the MTP head (last stage only), None when the file has none


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Every leaf's shape, keyed by its dotted path (e.g. "layers.gdn.qkv")."""
  D, V, L, Lg, La = cfg.d_model, cfg.vocab_size, cfg.n_layers, cfg.n_gdn, cfg.n_attn
  Hv, Dv, C, K = cfg.gdn_n_v_heads, cfg.gdn_d_v, cfg.gdn_conv_dim, cfg.conv_kernel
  H, G, Hd = cfg.n_head, cfg.n_kv_head, cfg.head_dim
  E, F, Fs = cfg.n_experts, cfg.d_ff_expert, cfg.d_ff_shared
  return {
      "embed": (V, D), "final_norm": (D,), "lm_head": (V, D),
      "layers.attn_norm": (L, D), "layers.post_norm": (L, D),
      "layers.gdn.qkv": (Lg, C, D), "layers.gdn.gate": (Lg, Hv * Dv, D),
      "layers.gdn.ba": (Lg, 2 * Hv, D), "layers.gdn.conv": (Lg, C, K),
      "layers.gdn.a": (Lg, Hv), "layers.gdn.dt_bias": (Lg, Hv),
      "layers.gdn.norm": (Lg, Dv), "layers.gdn.out": (Lg, D, Hv * Dv),
      "layers.attn.q": (La, 2 * H * Hd, D), "layers.attn.k": (La, G * Hd, D),
      "layers.attn.v": (La, G * Hd, D), "layers.attn.q_norm": (La, Hd),
      "layers.attn.k_norm": (La, Hd), "layers.attn.out": (La, D, H * Hd),
      "layers.moe.router": (L, E, D), "layers.moe.gate_exps": (L, E, F, D),
      "layers.moe.up_exps": (L, E, F, D), "layers.moe.down_exps": (L, E, D, F),
      "layers.moe.shared_gate": (L, Fs, D), "layers.moe.shared_up": (L, Fs, D),
      "layers.moe.shared_down": (L, D, Fs), "layers.moe.shared_gate_inp": (L, 1, D),
  }


def mtp_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """The MTP head's leaves, keyed "mtp.<leaf>" (empty when `cfg.n_mtp` is 0)."""
  if not cfg.n_mtp:
    return {}
  D = cfg.d_model
  H, G, Hd = cfg.n_head, cfg.n_kv_head, cfg.head_dim
  E, F, Fs = cfg.n_experts, cfg.d_ff_expert, cfg.d_ff_shared
  return {
      "mtp.eh_proj": (D, 2 * D), "mtp.enorm": (D,), "mtp.hnorm": (D,), "mtp.head_norm": (D,),
      "mtp.attn_norm": (1, D), "mtp.post_norm": (1, D),
      "mtp.attn.q": (1, 2 * H * Hd, D), "mtp.attn.k": (1, G * Hd, D),
      "mtp.attn.v": (1, G * Hd, D), "mtp.attn.q_norm": (1, Hd), "mtp.attn.k_norm": (1, Hd),
      "mtp.attn.out": (1, D, H * Hd),
      "mtp.moe.router": (1, E, D), "mtp.moe.gate_exps": (1, E, F, D),
      "mtp.moe.up_exps": (1, E, F, D), "mtp.moe.down_exps": (1, E, D, F),
      "mtp.moe.shared_gate": (1, Fs, D), "mtp.moe.shared_up": (1, Fs, D),
      "mtp.moe.shared_down": (1, D, Fs), "mtp.moe.shared_gate_inp": (1, 1, D),
  }


def leaf_dtype(path: str, dtype) -> jnp.dtype:
  """The storage dtype of a leaf for a given compute dtype."""
  short = path.removeprefix("layers.").removeprefix("mtp.")
  return jnp.float32 if short in FP32_LEAVES else jnp.dtype(dtype)


def params_from_flat(flat: dict[str, object]) -> Params:
  """Build the Params pytree from {dotted path: array}."""
  def sub(prefix, cls):
    names = [f.name for f in cls.__dataclass_fields__.values()]
    return cls(**{n: flat[f"{prefix}{n}"] for n in names})
  layers = LayerParams(
      attn_norm=flat["layers.attn_norm"], post_norm=flat["layers.post_norm"],
      gdn=sub("layers.gdn.", GDNParams), attn=sub("layers.attn.", AttnParams),
      moe=sub("layers.moe.", MoEParams))
  mtp = None
  if flat.get("mtp.eh_proj") is not None:
    mtp = MTPParams(eh_proj=flat["mtp.eh_proj"], enorm=flat["mtp.enorm"],
                    hnorm=flat["mtp.hnorm"], head_norm=flat["mtp.head_norm"],
                    attn_norm=flat["mtp.attn_norm"], post_norm=flat["mtp.post_norm"],
                    attn=sub("mtp.attn.", AttnParams), moe=sub("mtp.moe.", MoEParams))
  return Params(embed=flat["embed"], final_norm=flat["final_norm"], lm_head=flat["lm_head"],
                layers=layers, mtp=mtp)


def params_to_flat(params: Params) -> dict[str, jax.Array]:
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    out[".".join(k.name for k in path)] = leaf
  return out


def init_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32, scale: float = 0.05) -> Params:
  """Random parameters with sane magnitudes (for tests and benchmarks; numpy, on host)."""
  rng = np.random.default_rng(seed)
  flat = {}
  for path, shape in {**param_shapes(cfg), **mtp_param_shapes(cfg)}.items():
    name = path.split(".")[-1]
    if name in ("attn_norm", "post_norm", "final_norm", "q_norm", "k_norm", "norm", "enorm",
                "hnorm", "head_norm"):
      x = 1.0 + 0.1 * rng.standard_normal(shape)
    elif name == "a":
      x = -np.exp(rng.uniform(-1.0, 1.0, shape))
    elif name == "dt_bias":
      x = rng.uniform(-0.5, 0.5, shape)
    elif name == "conv":
      x = 0.3 * rng.standard_normal(shape)
    else:
      x = scale * rng.standard_normal(shape)
    flat[path] = jnp.asarray(x.astype(np.float32), dtype=leaf_dtype(path, dtype))
  return params_from_flat(flat)


@struct.dataclass
class LoraParams:
  """Stacked LoRA for the mixer output projections, each file's scale folded into B.

  Several adapter files stack along the rank axis R; a file without a given layer contributes
  zero rows there. `y = W x + B (A x)` for rows whose switch is on.

  `table` (optional, the per-row adapter table): [C, R] float32, row c the scale of every rank
  column for rows whose switch is c (row 0 unused: switch 0 is off). Without it a row that is
  on uses every column at scale 1 (one stacked set); with it, adapters that share the rank
  axis are chosen per row: `y = W x + B (table[switch] * (A x))` (the engine's AdapterTable).
  """
  gdn_a: jax.Array    # [Lg, R, Hv*Dv]   for ssm_out
  gdn_b: jax.Array    # [Lg, D, R]
  attn_a: jax.Array   # [La, R, H*Hd]    for attn_output
  attn_b: jax.Array   # [La, D, R]
  table: jax.Array | None = None   # [C, R] float32 per-row-switch rank scales, or None


LORA_RANK_BUCKET = 64


def lora_rank_bucket(rank: int) -> int:
  """Stacked ranks are zero-padded to a multiple of 64 (at least 64), so every adapter set up
  to that rank, and the no-adapter model, run one compiled program (zero rows are exact)."""
  return max(LORA_RANK_BUCKET, -(-int(rank) // LORA_RANK_BUCKET) * LORA_RANK_BUCKET)


def pad_lora_rank(lora: LoraParams, rank: int) -> LoraParams:
  """Zero-pad the stacked rank axis to `rank`."""
  def pad(x, axis):
    extra = rank - x.shape[axis]
    if extra < 0:
      raise ValueError(f"LoRA rank {x.shape[axis]} exceeds the padded rank {rank}")
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)
  return LoraParams(gdn_a=pad(lora.gdn_a, 1), gdn_b=pad(lora.gdn_b, 2),
                    attn_a=pad(lora.attn_a, 1), attn_b=pad(lora.attn_b, 2),
                    table=None if lora.table is None else pad(lora.table, 1))


def empty_lora(cfg: ModelConfig, rank: int = LORA_RANK_BUCKET, dtype=jnp.float32) -> LoraParams:
  """An all-zero adapter: what a model with no adapter runs, with every switch off."""
  D = cfg.d_model
  z = lambda *s: jnp.zeros(s, dtype)
  return LoraParams(gdn_a=z(cfg.n_gdn, rank, cfg.gdn_value_dim), gdn_b=z(cfg.n_gdn, D, rank),
                    attn_a=z(cfg.n_attn, rank, cfg.attn_out_dim), attn_b=z(cfg.n_attn, D, rank))


@dataclasses.dataclass(frozen=True)
class LoraSet:
  """Every loaded adapter, stacked along the rank axis R, scales folded into B.

  Attributes:
    params: `LoraParams` (gdn_a [Lg, R, Hv*Dv], gdn_b [Lg, D, R], attn_a [La, R, H*Hd],
      attn_b [La, D, R]).
    files: one `AdapterFileInfo` per file, in the order given.
    ignored: base tensors present in some file but not applied (each once, first seen first).
    rank_total: R, the sum of the files' slot widths.
    adapter_id: non-zero 64-bit identity of the files' contents and scales (keys the caches;
      set by `strata_jax.load_lora`), 0 when unset.
  """
  params: LoraParams
  files: tuple  # of strata_jax.gguf.adapter.AdapterFileInfo
  ignored: tuple[str, ...]
  rank_total: int
  adapter_id: int = 0

  @property
  def nbytes(self) -> int:
    return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(self.params))
