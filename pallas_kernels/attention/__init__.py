"""Attention over a K/V cache stack read in place, only each query's valid keys: one decode
step's (`kernel.py`, with its prologue) and a prefill chunk's (`prefill_kernel.py`)."""
from pallas_kernels.attention.api import (
  CHOICES,
  IMPLEMENTATIONS,
  decode_attention,
  prefill_attention,
  resolve,
  resolve_prefill,
)
from pallas_kernels.attention.kernel import decode_attention_pallas
from pallas_kernels.attention.prefill_kernel import prefill_attention_pallas
from pallas_kernels.attention.reference import attention_reference, decode_attention_reference

__all__ = ["CHOICES", "IMPLEMENTATIONS", "attention_reference", "decode_attention",
           "decode_attention_pallas", "decode_attention_reference", "prefill_attention",
           "prefill_attention_pallas", "resolve", "resolve_prefill"]
