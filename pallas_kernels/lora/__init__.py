"""LoRA delta as a Pallas kernel: y = select(on, base + B @ (A @ x), base) per row."""
from pallas_kernels.lora.api import (
    AUTO_KERNEL_MIN_ROWS,
    CHOICES,
    IMPLEMENTATIONS,
    lora_apply,
    lora_xla,
    resolve,
)
from pallas_kernels.lora.kernel import lora_pallas, tiling
from pallas_kernels.lora.reference import lora_reference

__all__ = [
    "AUTO_KERNEL_MIN_ROWS",
    "CHOICES",
    "IMPLEMENTATIONS",
    "lora_apply",
    "lora_pallas",
    "lora_reference",
    "lora_xla",
    "resolve",
    "tiling",
]
