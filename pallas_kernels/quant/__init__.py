"""GGUF-quantised weights kept in a repacked layout on the device, and matmuls over them."""
from pallas_kernels.quant.api import (
    CHOICES,
    IMPLEMENTATIONS,
    LORA_DOWN,
    dense_matmul,
    dense_reference,
    experts,
    qmatmul,
    qmatmul_lora,
    qmatmul_multi,
    resolve,
)
from pallas_kernels.quant.kernel import qmatmul_pallas
from pallas_kernels.quant.layout import (
    BLOCK,
    QUANT_TYPES,
    QTensor,
    QuantLayoutError,
    device_put,
    file_nbytes,
    pack,
    stack,
)
from pallas_kernels.quant.reference import dequantize, qmatmul_reference, select_matrix

__all__ = [
    "BLOCK",
    "CHOICES",
    "IMPLEMENTATIONS",
    "LORA_DOWN",
    "QUANT_TYPES",
    "dense_matmul",
    "dense_reference",
    "dequantize",
    "device_put",
    "experts",
    "file_nbytes",
    "pack",
    "qmatmul",
    "qmatmul_lora",
    "qmatmul_multi",
    "qmatmul_pallas",
    "qmatmul_reference",
    "QTensor",
    "QuantLayoutError",
    "resolve",
    "select_matrix",
    "stack",
]
