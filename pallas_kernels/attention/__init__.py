"""One decode step's attention over a K/V cache stack read in place, only each row's valid keys."""
from pallas_kernels.attention.api import CHOICES, IMPLEMENTATIONS, decode_attention, resolve
from pallas_kernels.attention.kernel import decode_attention_pallas
from pallas_kernels.attention.reference import attention_reference, decode_attention_reference

__all__ = ["CHOICES", "IMPLEMENTATIONS", "attention_reference", "decode_attention",
           "decode_attention_pallas", "decode_attention_reference", "resolve"]
