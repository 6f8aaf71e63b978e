"""Model configuration: frozen, hashable, the only static argument of the jitted steps."""
from __future__ import annotations

import dataclasses

from strata_jax.forms import Forms

GDN = "G"   # Gated DeltaNet (linear attention) layer
ATTN = "A"  # gated softmax attention layer


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Qwen3-Next geometry, as read from the `qwen3next.*` GGUF metadata, plus the `Forms`.

  `layer_types` is the layer pattern, one letter per layer: "G" for a GDN layer, "A" for a
  gated-attention layer (e.g. "GGGA" for the default interval of 4).
  """
  vocab_size: int
  d_model: int
  layer_types: str
  # gated softmax attention
  n_head: int
  n_kv_head: int
  head_dim: int
  n_rot: int
  rope_base: float
  # gated delta net
  gdn_n_k_heads: int      # ssm.group_count
  gdn_n_v_heads: int      # ssm.time_step_rank
  gdn_d_k: int            # ssm.state_size
  gdn_d_v: int            # ssm.inner_size / time_step_rank
  conv_kernel: int
  # MoE
  n_experts: int
  n_experts_used: int
  d_ff_expert: int
  d_ff_shared: int
  rms_eps: float = 1e-6
  context_length: int = 4096
  # multi-token-prediction (MTP) layers after the trunk (GGUF `nextn_predict_layers`; 0 or 1):
  # a draft head, not part of `layer_types` (docs/mtp.md)
  n_mtp: int = 0
  # how each op is computed (implementation choices, matmul precision); see strata_jax/forms.py
  forms: Forms = Forms()

  @property
  def n_layers(self) -> int:
    return len(self.layer_types)

  @property
  def n_gdn(self) -> int:
    return self.layer_types.count(GDN)

  @property
  def n_attn(self) -> int:
    return self.layer_types.count(ATTN)

  @property
  def gdn_key_dim(self) -> int:
    return self.gdn_n_k_heads * self.gdn_d_k

  @property
  def gdn_value_dim(self) -> int:
    return self.gdn_n_v_heads * self.gdn_d_v

  @property
  def gdn_conv_dim(self) -> int:
    """Channels that go through the causal conv: q, k (all k-heads) and v (all v-heads)."""
    return 2 * self.gdn_key_dim + self.gdn_value_dim

  @property
  def attn_out_dim(self) -> int:
    return self.n_head * self.head_dim

  def stage(self, lo: int, hi: int) -> "ModelConfig":
    """The config of layers [lo, hi) (for a layer split)."""
    return dataclasses.replace(self, layer_types=self.layer_types[lo:hi])

  def validate(self) -> list[str]:
    """Inconsistencies in the geometry, as readable strings (empty when consistent)."""
    bad = []
    if not self.layer_types or set(self.layer_types) - {GDN, ATTN}:
      bad.append(f"layer pattern {self.layer_types!r} must be a non-empty string of 'G'/'A'")
    if self.n_kv_head <= 0 or self.n_head % self.n_kv_head:
      bad.append(f"head_count {self.n_head} is not a multiple of head_count_kv {self.n_kv_head}")
    if self.n_rot > self.head_dim or self.n_rot % 2:
      bad.append(f"rope.dimension_count {self.n_rot} must be even and <= key_length "
                 f"{self.head_dim}")
    if self.gdn_n_k_heads <= 0 or self.gdn_n_v_heads % self.gdn_n_k_heads:
      bad.append(f"ssm.time_step_rank {self.gdn_n_v_heads} is not a multiple of "
                 f"ssm.group_count {self.gdn_n_k_heads}")
    if not 0 < self.n_experts_used <= self.n_experts:
      bad.append(f"expert_used_count {self.n_experts_used} must be in "
                 f"1..expert_count {self.n_experts}")
    if self.n_mtp not in (0, 1):
      bad.append(f"nextn_predict_layers {self.n_mtp}: only 0 or 1 MTP layer is supported")
    if self.conv_kernel < 1:
      bad.append(f"ssm.conv_kernel {self.conv_kernel} must be >= 1")
    return bad


def layer_pattern_from_interval(n_layers: int, interval: int) -> str:
  """Layer i is attention iff (i + 1) % interval == 0 (llama.cpp's rule)."""
  return "".join(ATTN if (i + 1) % interval == 0 else GDN for i in range(n_layers))
