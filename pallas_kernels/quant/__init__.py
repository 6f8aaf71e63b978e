"""GGUF-quantised weights kept in a repacked layout on the device, and matmuls over them."""
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
    "QUANT_TYPES",
    "QTensor",
    "QuantLayoutError",
    "dequantize",
    "device_put",
    "file_nbytes",
    "pack",
    "qmatmul_reference",
    "select_matrix",
    "stack",
]
