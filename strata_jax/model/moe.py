"""Mixture of experts with a shared expert (softmax router, top-k renormalised, SiLU-GLU)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import argsort_ids, sum_partials
from pallas_kernels.moe import api as moe_api
from strata_jax.config import ModelConfig
from pallas_kernels.quant.gemv import glu_product
from strata_jax.model.common import (NormedInput, group_call, is_quant, linear, linear_glu,
                                     linear_parts, linears, one_launch)
from strata_jax.params import QGroups


def _glu(x, wg, wu, wd, gu=None, in_down=False):
  """The shared expert; gu: its gate and up products of x, made already (`_inputs_in_launch`).
  in_down (`Forms.shared_glu` "in_down"): the down projection's kernel makes silu(g) * u as
  it loads it, where the in-place GEMV takes the rows (`linear_glu`)."""
  g, u = linears(x, [wg, wu]) if gu is None else gu
  if in_down:
    return linear_glu(g, u, wd)
  return linear(glu_product(g, u), wd)


def _inputs_in_launch(p, x: NormedInput):
  """(router partials [S, N, E] fp32, (shared gate, shared up) [N, F], h [N, D]) from one
  launch that makes the norm before the MoE, `Forms.moe_norm` "in_launch": the router's
  fp32 product, the shared expert's gate and up and the normed rows themselves (for the
  experts and the shared expert's sigmoid gate), where the one-row GEMV takes them (each
  product `linear_parts` / `linears` of rms_norm(x) to its sum of squares' order); else
  None."""
  from pallas_kernels.quant import api as quant_api  # noqa: PLC0415 (kernels load lazily)
  ws = (p.router, p.shared_gate, p.shared_up)
  n, d = x.rows, x.shape[-1]
  if not (one_launch(ws) and quant_api.norm_launch_rows(len(ws), n, d, ws[0].implementation)):
    return None
  router, g, u, h = quant_api.dense_matmul_multi(
      x.x.reshape(n, d), [w.w for w in ws], ws[0].index, implementation=ws[0].implementation,
      few=ws[0].few, partials=True, norm=(x.w, x.eps),
      x_dtypes=(jnp.float32, x.dtype, x.dtype), normed_out=True)
  whole = lambda y: sum_partials(y).astype(x.dtype)
  return router, (whole(g), whole(u)), h


def _grouped_dot(xs, w, group_sizes):
  """Rows xs [M, in] sorted by expert, w [E, out, in] -> [M, out] fp32, each row times its
  group's matrix (group_sizes [E] rows per expert, in order)."""
  dn = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0],
      rhs_group_dimensions=[0])
  return jax.lax.ragged_dot_general(xs, w.astype(xs.dtype), group_sizes, dn,
                                    preferred_element_type=jnp.float32)


def routed_grouped(x, wg, wu, wd, idx, w):
  """The routed experts for many tokens: the N·k (token, expert) pairs sorted by expert, one
  grouped matrix product per weight (each expert's rows times its matrix only). Same
  numerics as the gather form: fp32 accumulation, h in x's dtype."""
  N, k = idx.shape
  E = wg.shape[0]
  flat = idx.reshape(-1)
  order = argsort_ids(flat, E)
  xs = x[order // k]                                                          # [N*k, D]
  sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
  h = (jax.nn.silu(_grouped_dot(xs, wg, sizes)).astype(x.dtype)
       * _grouped_dot(xs, wu, sizes).astype(x.dtype))
  y = _grouped_dot(h, wd, sizes) * w.reshape(-1)[order][:, None]               # [N*k, D]
  return jnp.zeros((N, wd.shape[1]), jnp.float32).at[order // k].add(y)


def many_tokens_form(form: str) -> str:
  """`Forms.moe_many` made concrete. "dense" (every expert on every token), "grouped" (sorted
  pairs and `ragged_dot`: 3.3x slower than dense on the H200), "pallas" / "pallas_interpret"
  (sorted pairs and the grouped Pallas kernel, experts read in place). "auto": "pallas" on the
  GPU (bench-a3b prefill of 2,500 tokens on the H200: 160 ms against 258 ms dense), "dense"
  elsewhere (the Pallas interpreter is for tests)."""
  if form == "auto":
    return "pallas" if jax.default_backend() == "gpu" else "dense"
  return form


def moe(cfg: ModelConfig, p, x, stacks=None, layer=None, real=None,
        form_tokens: int | None = None):
  """x [N, D] -> [N, D]; p one layer's MoEParams. x may be a `NormedInput` (the norm before
  the MoE not yet made: `_inputs_in_launch` makes it with the router's product). `stacks`
  (the whole [L, ...] expert weight stacks) and `layer` (this layer's index in them, may be
  traced) let the few-token kernel read the experts where they lie: a layer slice made by the
  scan would be copied for it first.
  `real` [N] bool marks the rows whose output is used (not padding, not an inactive slot).
  `form_tokens` (static): the token count the few/many form is chosen for (default N); a
  speculative verification passes its row count, so each position takes the form (and the
  rounding) the decode step of that batch takes."""
  N, D = x.shape
  k = cfg.n_experts_used
  made = _inputs_in_launch(p, x) if isinstance(x, NormedInput) else None
  shared_gu = None
  if made is not None:
    logits, shared_gu, x = made
  else:
    x = x.made() if isinstance(x, NormedInput) else x
    # [S, N, E] f32: the router GEMV's split partials (S = 1 where it does not split)
    logits = linear_parts(x.astype(jnp.float32), p.router)
  # their sum, softmax, top-k, renormalised: w [N, k] f32 (one launch under the Pallas form)
  w, idx = moe_api.route(logits, k, implementation=cfg.forms.moe_topk)
  if real is not None:
    # Rows whose output is never used (inactive slots of a decode batch, padding) take the
    # experts of the first real row: the kernels read experts per (row, expert) pair, and
    # these pairs then read matrices the real rows read anyway (from L2, not HBM). Each
    # real row's own experts, and so its output, are unchanged.
    idx = jnp.where(real[:, None], idx, idx[jnp.argmax(real)][None, :])
  # The expert weights as the kernels read them: whole stacks plus the layer index, or this
  # layer's arrays.
  ew, at = (stacks, layer) if stacks is not None else (
      (p.gate_exps, p.up_exps, p.down_exps), None)
  n_form = N if form_tokens is None else form_tokens
  form = "few" if n_form * k <= cfg.n_experts else many_tokens_form(cfg.forms.moe_many)
  if is_quant(p.gate_exps):
    # Quantised expert stacks: every token count goes through the quantised experts kernel,
    # which reads only the chosen experts' blocks of layer `layer`, in place.
    from pallas_kernels.quant import api as quant_api  # noqa: PLC0415
    wg, wu, wd = stacks if stacks is not None else (p.gate_exps.w, p.up_exps.w, p.down_exps.w)
    layer = layer if stacks is not None else p.gate_exps.index
    impl = cfg.forms.quant_impl
    if isinstance(wg, QGroups):  # the three stacks are grouped alike (by the layer's types)
      part = lambda s, k: s.parts if k is None else s.parts[k]  # None: every part (fused)
      fused = cfg.forms.quant_launch == "fused"   # the gate with the up, in one launch
      routed = group_call(wg, layer, lambda k, pos, **kw: quant_api.experts(
          x, part(wg, k), part(wu, k), part(wd, k), idx, w, layer=pos, implementation=impl,
          fused=fused, **kw), cfg.forms.quant_groups)
    else:
      routed = quant_api.experts(x, wg, wu, wd, idx, w, layer=layer, implementation=impl)
  elif form == "few":
    # Few tokens: read only the chosen experts' weights, in place on the GPU (Pallas kernel).
    routed = moe_api.routed_experts(x, *ew, idx, w, layer=at, implementation=cfg.forms.moe_few)
  elif form == "grouped":
    routed = routed_grouped(x, p.gate_exps, p.up_exps, p.down_exps, idx, w)
  elif form in ("pallas", "pallas_interpret"):
    routed = moe_api.routed_experts_many(x, *ew, idx, w, layer=at, implementation=form)
  else:
    # Many tokens: every expert over every token, weighted by the (sparse) routing weights.
    dense_w = jnp.zeros((N, cfg.n_experts), jnp.float32).at[jnp.arange(N)[:, None], idx].set(w)
    f32 = jnp.float32
    h_g = jnp.einsum("nd,efd->nef", x, p.gate_exps.astype(x.dtype), preferred_element_type=f32)
    h_u = jnp.einsum("nd,efd->nef", x, p.up_exps.astype(x.dtype), preferred_element_type=f32)
    h = jax.nn.silu(h_g).astype(x.dtype) * h_u.astype(x.dtype)
    y = jnp.einsum("nef,edf->ned", h, p.down_exps.astype(x.dtype), preferred_element_type=f32)
    routed = jnp.einsum("ned,ne->nd", y, dense_w)
  shared = _glu(x, p.shared_gate, p.shared_up, p.shared_down, shared_gu,
                cfg.forms.shared_glu == "in_down").astype(jnp.float32)
  gate = jax.nn.sigmoid(linear(x.astype(jnp.float32), p.shared_gate_inp))  # [N, 1]
  return (routed + gate * shared).astype(x.dtype)
