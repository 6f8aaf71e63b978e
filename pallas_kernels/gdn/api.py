"""Entry points the model calls for the gated delta rule; picks the implementation.

`step_raw` (one decode step for a batch, from raw q/k) has three implementations:
  "pallas"            the fused decode kernel compiled for the GPU (Triton lowering; README).
  "pallas_interpret"  the same kernel under the Pallas interpreter (CPU tests).
  "xla"               `reference.delta_rule_step_raw`, plain jnp.
and "auto": on GPU "xla" below `AUTO_PALLAS_MIN_BATCH` batch rows, where the step is
launch-bound and XLA's fusions are cheaper than a Pallas launch, and "pallas" from there on,
where the single pass over the state wins by ~25% (README, "Decode kernel"); "xla" on CPU,
where the interpreter is 10-15x slower than XLA. B is static under jit, so this is still
one program per shape. Default "auto"; the environment variable STRATA_GDN_IMPL (any of the
four names) overrides it; an explicit `implementation=` wins over both.
"""
from __future__ import annotations

import os

import jax

from pallas_kernels.gdn import chunked as chunked_form
from pallas_kernels.gdn import reference
from pallas_kernels.gdn.decode_kernel import gdn_decode_pallas

IMPLEMENTATIONS = ("pallas", "pallas_interpret", "xla")
CHOICES = (*IMPLEMENTATIONS, "auto")
ENV_VAR = "STRATA_GDN_IMPL"
AUTO_PALLAS_MIN_BATCH = 24  # H200, 32 heads of 128: tie at B = 16, Pallas 24% less time at 24


CHUNKED_CHOICES = ("reference", "products")
CHUNKED_ENV_VAR = "STRATA_GDN_CHUNKED"


def chunked(q, k, v, g, beta, state, *, chunk: int = 64, implementation=None):
  """Prefill form. Shapes as in `reference` (one sequence).

  "reference": the oracle (triangular solve, HIGHEST precision everywhere); "products":
  `chunked.py` (UT inverse by matrix products, JAX's default matmul precision). Default
  "reference"; STRATA_GDN_CHUNKED overrides it, `implementation=` wins over both."""
  impl = implementation or os.environ.get(CHUNKED_ENV_VAR, "").strip() or "reference"
  if impl == "products":
    return chunked_form.delta_rule_chunked(q, k, v, g, beta, state, chunk=chunk)
  if impl != "reference":
    raise ValueError(f"gdn: unknown chunked implementation {impl!r}; expected one of "
                     f"{CHUNKED_CHOICES}")
  return reference.delta_rule_chunked(q, k, v, g, beta, state, chunk=chunk)


def step(q, k, v, g, beta, state):
  """Decode form: one token for every head of one sequence."""
  return reference.delta_rule_step(q, k, v, g, beta, state)


def default_implementation():
  """STRATA_GDN_IMPL if set, else "auto"."""
  env = os.environ.get(ENV_VAR, "").strip()
  if env and env not in CHOICES:
    raise ValueError(f"{ENV_VAR}={env!r}: expected one of {CHOICES}")
  return env or "auto"


def resolve(implementation, batch):
  """The concrete implementation `step_raw` runs for this choice and batch size."""
  impl = implementation or default_implementation()
  if impl == "auto":
    on_gpu = jax.default_backend() == "gpu"
    return "pallas" if on_gpu and batch >= AUTO_PALLAS_MIN_BATCH else "xla"
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"gdn: unknown implementation {impl!r}; expected one of {CHOICES}")
  return impl


def step_raw(q, k, v, g, beta, state, *, implementation=None):
  """Decode form for a batch from raw (not yet normalised) q/k: l2norm, head expansion and
  the delta rule step in one. Contract as `reference.delta_rule_step_raw`:
  q, k [B, Hk, Dk]; v [B, Hv, Dv]; g, beta [B, Hv]; state [B, Hv, Dv, Dk] float32
  -> (o [B, Hv, Dv] float32, new state [B, Hv, Dv, Dk] float32). The Pallas forms update
  the state in place when the caller donates it."""
  impl = resolve(implementation, q.shape[0])
  if impl == "pallas":
    if jax.default_backend() != "gpu":
      raise ValueError(f"gdn: implementation 'pallas' needs a GPU backend, not "
                       f"{jax.default_backend()!r}; use 'pallas_interpret' or 'xla'")
    return gdn_decode_pallas(q, k, v, g, beta, state)
  if impl == "pallas_interpret":
    return gdn_decode_pallas(q, k, v, g, beta, state, interpret=True)
  return reference.delta_rule_step_raw(q, k, v, g, beta, state)
