"""GGUF model files: loading (dequantise at load), tokenizer, and conversion from transformers.

The converter lives in `strata_jax.gguf.convert_hf` (not re-exported: its function of the same
name would shadow the module).
"""
from strata_jax.gguf.names import hf_to_gguf, hf_to_gguf_name, params_to_gguf_tensors
from strata_jax.gguf.reader import ModelFile, load_tokenizer, open_gguf, read_model_gguf
from strata_jax.gguf.tokenizer import Tokenizer

__all__ = [
    "ModelFile", "Tokenizer", "hf_to_gguf", "hf_to_gguf_name", "load_tokenizer", "open_gguf",
    "params_to_gguf_tensors", "read_model_gguf",
]
