"""OpenAI- and Anthropic-compatible HTTP server over one Engine (`strata-jax serve`)."""
from strata_jax.serve.app import create_app, serve_main
from strata_jax.serve.config import load_config

__all__ = ["create_app", "load_config", "serve_main"]
