"""Entry points the model calls for the gated delta rule; picks the implementation."""
from __future__ import annotations

from pallas_kernels.gdn import reference


def chunked(q, k, v, g, beta, state, *, chunk: int = 64):
  """Prefill form. Shapes as in `reference` (one sequence)."""
  return reference.delta_rule_chunked(q, k, v, g, beta, state, chunk=chunk)


def step(q, k, v, g, beta, state):
  """Decode form: one token for every head of one sequence."""
  return reference.delta_rule_step(q, k, v, g, beta, state)
