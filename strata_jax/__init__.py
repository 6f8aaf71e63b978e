"""strata-jax: a JAX/Pallas research engine for Qwen3-Next-style hybrid models from GGUF, with
per-request LoRA adapters from llama.cpp's adapter GGUF.

    model = strata_jax.load_model("model.gguf")          # or None for the embedded demo model
    lora = strata_jax.load_lora(model, ["adapter.gguf"])
    engine = strata_jax.Engine(model, lora=lora, slots=4)
    engine.generate(prompt="def fib(n):", max_tokens=32, lora=False)
"""
from strata_jax.api import LoraSet, Model, load_control_vector, load_lora, load_model
from strata_jax.config import ModelConfig
from strata_jax.engine.engine import Engine, Request, Result
from strata_jax.engine.prefix_cache import block_hashes
from strata_jax.errors import (
                               AdapterError,
                               ControlVectorError,
                               GGUFError,
                               RequestError,
                               SessionError,
                               StrataError,
)
from strata_jax.forms import Forms

__all__ = ["Engine", "Request", "Result", "Model", "LoraSet", "ModelConfig", "Forms", "load_model",
           "load_lora", "load_control_vector", "block_hashes", "StrataError", "GGUFError",
           "AdapterError", "ControlVectorError", "SessionError", "RequestError"]
