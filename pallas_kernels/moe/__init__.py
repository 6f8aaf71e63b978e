"""Routed experts of an MoE FFN at decode as a Pallas kernel that reads expert weights in place."""
from pallas_kernels.moe.api import (
    CHOICES,
    IMPLEMENTATIONS,
    moe_xla,
    resolve,
    routed_experts,
)
from pallas_kernels.moe.kernel import moe_pallas, tiling
from pallas_kernels.moe.reference import moe_reference

__all__ = [
    "CHOICES",
    "IMPLEMENTATIONS",
    "moe_pallas",
    "moe_reference",
    "moe_xla",
    "resolve",
    "routed_experts",
    "tiling",
]
