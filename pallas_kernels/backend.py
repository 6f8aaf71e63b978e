"""Implementation choice shared by the ops' `api.py`: names checked once, the GPU test once.

The choice itself is always an argument (`implementation=`), set by the caller's config; no
op reads the environment.
"""
import jax


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def check_choice(op: str, implementation: str, choices) -> str:
  """`implementation` if it is one of `choices`, else a ValueError naming the op."""
  if implementation not in choices:
    raise ValueError(f"{op}: unknown implementation {implementation!r}; expected one of "
                     f"{tuple(choices)}")
  return implementation


def require_gpu(op: str, implementation: str, fallbacks: str) -> None:
  """A compiled Pallas implementation needs the GPU backend: a clear error elsewhere."""
  if not on_gpu():
    raise ValueError(f"{op}: implementation {implementation!r} needs a GPU backend, not "
                     f"{jax.default_backend()!r}; use {fallbacks}")
