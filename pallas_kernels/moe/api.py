"""Backend choice for the routed experts: the one entry point model code calls.

Implementations (one contract, one parametrized test suite):
  "pallas"            the Pallas kernel compiled for the GPU (Triton lowering; README).
  "pallas_interpret"  the same kernel under the Pallas interpreter (CPU tests).
  "xla"               `moe_reference`: the model's gather form in plain jnp.

And "auto": "pallas" on GPU, "xla" elsewhere (the interpreter is for tests, not serving).

Default: "auto"; the caller's config (`strata_jax.forms.Forms.moe_few`) names the choice.

Many tokens (prefill): `routed_experts_many`, the same contract, runs the grouped-GEMM kernel
(`grouped.py`) for "pallas" / "pallas_interpret" and `moe_reference` for "xla". Default "xla"
(the oracle); the model chooses its many-token form itself (`strata_jax.model.moe`: this
kernel on the GPU).
"xla" gathers [N, k, F, D] per weight matrix: the oracle, not a prefill serving path (at
N = 2500, k = 10, F = 512, D = 2048 that is 52 GB per matrix in bf16).
"""
import jax

from pallas_kernels.backend import check_choice, on_gpu, require_gpu
from pallas_kernels.moe.grouped import routed_experts_grouped
from pallas_kernels.moe.kernel import moe_pallas
from pallas_kernels.moe.reference import moe_reference, route_reference, top_k_reference
from pallas_kernels.moe.topk import route_pallas, top_k_pallas

IMPLEMENTATIONS = ("pallas", "pallas_interpret", "xla")
CHOICES = (*IMPLEMENTATIONS, "auto")
MANY_DEFAULT = "xla"  # the oracle; the model picks its own many-token form (model/moe.py)

moe_xla = jax.jit(moe_reference, static_argnames=("precision", "round_y"))


def resolve(implementation=None):
  """The concrete implementation `routed_experts` runs for this choice (None: "auto")."""
  impl = check_choice("moe", implementation or "auto", CHOICES)
  if impl == "auto":
    return "pallas" if on_gpu() else "xla"
  return impl


def routed_experts(x, wg, wu, wd, idx, w, *, layer=None, implementation=None):
  """routed[n] = sum_j w[n, j] * wd[e] @ (silu(wg[e] @ x[n]) * (wu[e] @ x[n])), e = idx[n, j].

  Args:
    x: [N, D] activations (float32/bfloat16/float16).
    wg, wu: [E, F, D] expert gate / up weights.
    wd: [E, D, F] expert down weights.
    idx: [N, k] int32 chosen expert ids.
    w: [N, k] float32 routing weights.
    layer: optional integer scalar (may be traced): wg / wu / wd are then whole layer stacks
      [L, E, F, D] / [L, E, D, F] and layer `layer` is used. Inside a `lax.scan` over layers
      pass the stacks (closed over) and the index: the kernel then reads them in place,
      while a slice made by the scan is copied for the kernel (~200 µs a layer, README).
    implementation: one of CHOICES (None: "auto").

  Returns:
    [N, D] float32.
  """
  return _run(resolve(implementation), moe_pallas, x, wg, wu, wd, idx, w, layer)


def _run(impl, kernel, x, wg, wu, wd, idx, w, layer, round_y=False):
  """`kernel` compiled ("pallas") or interpreted, or the jnp reference ("xla")."""
  if impl == "pallas":
    require_gpu("moe", impl, "'pallas_interpret' or 'xla'")
    return kernel(x, wg, wu, wd, idx, w, layer=layer)
  if impl == "pallas_interpret":
    return kernel(x, wg, wu, wd, idx, w, layer=layer, interpret=True)
  if layer is not None:  # jnp indexing clamps a traced index, as the kernel does
    wg, wu, wd = wg[layer], wu[layer], wd[layer]
  return moe_xla(x, wg, wu, wd, idx, w, round_y=round_y)


def resolve_many(implementation=None):
  """The concrete implementation `routed_experts_many` runs (None: MANY_DEFAULT)."""
  return check_choice("moe (many tokens)", implementation or MANY_DEFAULT, IMPLEMENTATIONS)


def routed_experts_many(x, wg, wu, wd, idx, w, *, layer=None, implementation=None):
  """The routed experts for many tokens (prefill): `routed_experts`' contract and numerics,
  except that each expert's output y_j is rounded to x's dtype before the weighted fp32 sum
  (as transformers rounds it; `moe_reference(round_y=True)`; nothing changes for fp32 x).

  "pallas" / "pallas_interpret" run the grouped-GEMM kernel (`routed_experts_grouped`):
  the (token, expert) pairs sorted by expert and padded to row tiles of one expert each, so
  only the chosen experts are computed, with weights read in place. "xla" runs
  `moe_reference` (a gather of [N, k, F, D] per matrix: fine for tests, far too large for
  a long prefill). The model runs "pallas" on the GPU (`strata_jax.model.moe`, "auto": 2,500
  tokens of bench-a3b in 160 ms against 258 ms for its dense form) and its dense form
  elsewhere.

  Args:
    x: [N, D] activations (float32/bfloat16/float16).
    wg, wu: [E, F, D] expert gate / up weights.
    wd: [E, D, F] expert down weights.
    idx: [N, k] int32 chosen expert ids.
    w: [N, k] float32 routing weights.
    layer: optional integer scalar (may be traced): wg / wu / wd are then whole layer stacks
      [L, E, F, D] / [L, E, D, F] and layer `layer` is used (read in place by the kernel).
    implementation: one of IMPLEMENTATIONS (None: MANY_DEFAULT).

  Returns:
    [N, D] float32.
  """
  return _run(resolve_many(implementation), routed_experts_grouped, x, wg, wu, wd, idx, w,
              layer, round_y=True)


def top_k(x, k: int, *, implementation=None):
  """The router's top-k: (values [N, k] in x's dtype, ids [N, k] int32) of each row of x
  [N, E], `lax.top_k`'s exactly (ties to the lower id), for every implementation.

  "xla" is `lax.top_k`, which XLA lowers to a sort on the GPU; "pallas" / "pallas_interpret"
  run `topk.py`'s one-launch kernel. "auto" is "pallas" on the GPU (the 80B-A3B Q4_K_M
  batch-1 step: 163 us of top-k against the sort's 259), "xla" elsewhere. The model's choice
  is `strata_jax.forms.Forms.moe_topk`."""
  return _router_op("top_k", implementation, top_k_pallas, top_k_reference, x, k)


def _router_op(op, implementation, kernel, reference, x, k):
  """kernel(x, k) compiled ("pallas") or interpreted, or reference(x, k) ("xla"); "auto" is
  "pallas" on the GPU, "xla" elsewhere."""
  impl = check_choice(op, implementation or "auto", CHOICES)
  if impl == "auto":
    impl = "pallas" if on_gpu() else "xla"
  if impl == "pallas":
    require_gpu(op, impl, "'pallas_interpret' or 'xla'")
    return kernel(x, k)
  if impl == "pallas_interpret":
    return kernel(x, k, interpret=True)
  return reference(x, k)


def route(logits, k: int, *, implementation=None):
  """The router's choice: (w [N, k] fp32, ids [N, k] int32), the top-k of softmax(logits)
  renormalised to sum to 1. logits [N, E], or the router GEMV's split partial sums [S, N, E]
  (added in index order: the GEMV's own sum, in the kernel's launch under "pallas"). "xla": `route_reference` (XLA's softmax, `lax.top_k`, the
  division); "pallas" / "pallas_interpret": `topk.route_pallas`, all three in one launch, the
  same ids and the weights to fp32 rounding. "auto": "pallas" on the GPU, "xla" elsewhere;
  the model's choice is `Forms.moe_topk`, as `top_k`'s."""
  return _router_op("route", implementation, route_pallas, route_reference, logits, k)
