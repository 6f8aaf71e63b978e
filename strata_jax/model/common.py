"""Small building blocks shared by the layers: projections, RMSNorm, RoPE, the LoRA hook.

A projection weight is a float array [out, in], a `QTensor` (a quantised matrix kept in its
GGUF blocks, `pallas_kernels.quant.layout`), or a `QRef`: one matrix of a layer-stacked
QTensor at a traced index, which the quantised matmul reads in place (no slice is copied).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from pallas_kernels.attention.reference import rms_norm, rope_neox  # noqa: F401 (the model's)
from pallas_kernels.gdn.reference import l2norm as l2_norm  # noqa: F401 (the model's L2 norm)
from pallas_kernels.quant.layout import QTensor


@dataclasses.dataclass(frozen=True)
class QRef:
  """Matrix `index` (int32, traced OK; flat over the leading stack dims; None for a single
  matrix) of QTensor `w`, multiplied by `pallas_kernels.quant.api` with `implementation`
  (`Forms.quant_impl`); `groups` (`Forms.quant_groups`) says how a mixed-type stack picks its
  layer's type. Made inside the traced step; not a pytree (it never crosses a jit boundary)."""
  w: QTensor
  index: object = None
  implementation: str = "auto"
  groups: str = "switch"
  fused: bool = False  # `Forms.quant_launch`: one launch with the layer's other QRefs of an input


@dataclasses.dataclass(frozen=True)
class DRef:
  """Matrix `index` (int32, traced) of a plain float weight stack [L, out, in], multiplied by
  `pallas_kernels.quant.dense_matmul` with `implementation` (`Forms.quant_impl`): one row
  by the in-place GEMV kernel, up to 64 by the in-place tensor-core kernel when `few`
  (`Forms.dense_few`) is "dot", more by XLA on the indexed matrix (`Forms.dense_weights=
  "kernel"`). Made inside the traced step; not a pytree."""
  w: object
  index: object
  implementation: str = "auto"
  few: str = "dot"
  fused: bool = True   # `Forms.dense_launch`: one launch with the layer's other DRefs of an input


def is_quant(w) -> bool:
  from strata_jax.params import QGroups  # noqa: PLC0415
  return isinstance(w, (QTensor, QRef, QGroups))


def _qparts(w):
  """(QTensor or QGroups, index, implementation, groups) of a QRef or a bare QTensor."""
  return ((w.w, w.index, w.implementation, w.groups) if isinstance(w, QRef)
          else (w, None, "auto", "switch"))


def quant_call(w, index, fn, groups="switch"):
  """fn(qtensor, index) for a QTensor stack; for a QGroups, `group_call` with
  fn(that group's stack, the layer's position in it)."""
  from strata_jax.params import QGroups  # noqa: PLC0415
  if not isinstance(w, QGroups):
    return fn(w, index)
  return group_call(w, index, lambda g, pos, **kw: fn(
      w.parts if g is None else w.parts[g], pos, **kw), groups)


def group_and_position(w, index):
  """(the group of layer `index` of the QGroups `w`, its position in that group's stack)."""
  return jnp.asarray(w.group, jnp.int32)[index], jnp.asarray(w.pos, jnp.int32)[index]


def group_call(w, index, fn, groups="switch"):
  """fn(g, position) for layer `index` of the QGroups `w` (one stack per quant type; g the
  layer's group, the position its layer in that group's stack). "switch": a conditional on
  g; "predicated": fn(g, position, active=flag) for every group (an inactive kernel launch
  returns at once) and a select of the layer's group; "fused": fn(None, position,
  group=g), every group's stack to one call (`pallas_kernels.quant.api`'s `group`), which
  for a few rows is one kernel launch."""
  group, pos = group_and_position(w, index)
  if groups == "fused":
    return fn(None, pos, group=group)
  if groups == "predicated":
    ys = [fn(g, pos, active=(group == g).astype(jnp.int32)) for g in range(len(w.parts))]
    out = ys[-1]
    for g in range(len(ys) - 2, -1, -1):
      out = jnp.where(group == g, ys[g], out)
    return out
  return lax.switch(group, [lambda g=g: fn(g, pos) for g in range(len(w.parts))])


def linear(x, w):
  """x [..., in] @ w[out, in]ᵀ with float32 accumulation, result in x's dtype.

  A quantised `w` (QTensor / QRef) goes to `pallas_kernels.quant.api.qmatmul`, which
  dequantises inside the kernel.

  The dot returns x's dtype itself (the GEMM accumulates in fp32 and rounds once, the same
  numbers as an fp32 result cast down): asked for an fp32 result at decode, XLA rewrote some
  bf16 GEMVs to read fp32 copies of their weights (H200: 7.30 -> 6.56 ms a token,
  experiments/bench/README.md).
  """
  if isinstance(w, DRef):
    from pallas_kernels.quant import api as quant_api  # noqa: PLC0415 (kernels load lazily)
    x2 = x.reshape(-1, x.shape[-1])
    y = quant_api.dense_matmul(x2, w.w, w.index, implementation=w.implementation, few=w.few)
    return y.reshape(*x.shape[:-1], y.shape[-1])
  if is_quant(w):
    from pallas_kernels.quant import api as quant_api  # noqa: PLC0415 (kernels load lazily)
    qt, index, impl, groups = _qparts(w)
    x2 = x.reshape(-1, x.shape[-1])
    y = quant_call(qt, index, lambda q, i, **kw: quant_api.qmatmul(
        x2, q, index=i, implementation=impl, **kw), groups)
    return y.reshape(*x.shape[:-1], y.shape[-1])
  return lax.dot_general(x, w.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())),
                         preferred_element_type=x.dtype)


def linear_glu(g, u, w):
  """linear(silu(g) * u, w) in the model's GLU roundings (`gemv.glu_product`) for a gate g
  and up u [..., in]. Under `Forms.shared_glu` "in_down" (the caller asks): with a DRef the
  in-place GEMV makes the hidden row as it loads it, where it takes the rows
  (`quant_api.dense_matmul_glu`); else XLA makes it first."""
  from pallas_kernels.quant import gemv  # noqa: PLC0415 (kernels load lazily)
  if isinstance(w, DRef):
    from pallas_kernels.quant import api as quant_api  # noqa: PLC0415
    g2, u2 = g.reshape(-1, g.shape[-1]), u.reshape(-1, u.shape[-1])
    y = quant_api.dense_matmul_glu(g2, u2, w.w, w.index, implementation=w.implementation,
                                   few=w.few)
    return y.reshape(*g.shape[:-1], y.shape[-1])
  return linear(gemv.glu_product(g, u), w)


def linear_parts(x, w):
  """linear(x, w) of an fp32 x as split partial sums [S, *x.shape[:-1], out] fp32: the
  in-place GEMV's own partials when a DRef's kernel takes the rows (the router's: the routing
  kernel adds them in its launch, `moe_api.route`), else [1, ...] of the whole product.
  Summed in index order they are `linear`'s result bit for bit."""
  if isinstance(w, DRef):
    from pallas_kernels.quant import api as quant_api  # noqa: PLC0415 (kernels load lazily)
    x2 = x.reshape(-1, x.shape[-1])
    y = quant_api.dense_matmul_parts(x2, w.w, w.index, implementation=w.implementation,
                                     few=w.few)
    return y.reshape(y.shape[0], *x.shape[:-1], y.shape[-1])
  return linear(x, w)[None]


@dataclasses.dataclass(frozen=True)
class NormedInput:
  """rms_norm(x, w, eps), not yet made: a decode step's input to a mixer or to the MoE, whose
  norm the launch of the layer's projections of it makes (`Forms.input_norm` "in_proj",
  `linears`; `Forms.moe_norm` "in_launch", `moe._inputs_in_launch`); any other reader makes
  it first (`made`). shape and dtype are the normed input's."""
  x: object
  w: object
  eps: float

  @property
  def shape(self):
    return self.x.shape

  @property
  def dtype(self):
    return self.x.dtype

  @property
  def rows(self):
    """How many rows the norm is of (x's leading axes flattened)."""
    return self.x.size // self.x.shape[-1]

  def made(self):
    return rms_norm(self.x, self.w, self.eps)

  def reshape(self, *shape):
    """The same norm of x reshaped (the last axis, the norm's, kept)."""
    x = self.x.reshape(*shape)
    if x.shape[-1] != self.x.shape[-1]:
      raise ValueError(f"NormedInput: a reshape to {x.shape} changes the normed axis")
    return NormedInput(x, self.w, self.eps)


def one_launch(ws) -> bool:
  """Whether the products of one input by `ws` can share one launch of the in-place kernels
  (`Forms.dense_launch`): several DRefs made `fused`, at one layer index, of one kernel form."""
  return (len(ws) > 1 and all(isinstance(w, DRef) and w.fused for w in ws)
          and len({(id(w.index), w.implementation, w.few) for w in ws}) == 1)


def quant_one_launch(ws) -> bool:
  """Whether the products of one input by `ws` may share one launch of the quantised few-row
  kernel (`Forms.quant_launch`, `quant_api.qmatmul_multi`): several QRefs made `fused`, at
  one layer index, of one implementation, a mixed-type stack's only under "fused" groups."""
  from strata_jax.params import QGroups  # noqa: PLC0415
  return (len(ws) > 1 and all(isinstance(w, QRef) and w.fused for w in ws)
          and len({(id(w.index), w.implementation) for w in ws}) == 1
          and all(w.groups == "fused" for w in ws if isinstance(w.w, QGroups)))


def _quant_multi(x, ws):
  """[linear(x, w) for w in ws] of QRefs through `quant_api.qmatmul_multi`."""
  from pallas_kernels.quant import api as quant_api  # noqa: PLC0415 (kernels load lazily)
  from strata_jax.params import QGroups  # noqa: PLC0415
  mats = []
  for w in ws:
    if isinstance(w.w, QGroups):   # as `group_call`: the layer's part and its place in it
      group, pos = group_and_position(w.w, w.index)
      mats.append((w.w.parts, pos, group))
    else:
      mats.append((w.w, w.index, None))
  x2 = x.reshape(-1, x.shape[-1])
  ys = quant_api.qmatmul_multi(x2, mats, implementation=ws[0].implementation)
  return [y.reshape(*x.shape[:-1], y.shape[-1]) for y in ys]


def linears(x, ws, partials=False):
  """[linear(x, w) for w in ws]. When every w is a DRef at one layer index made `fused` (a
  layer's projections of one input: GDN qkv / gate / ba, attention q / k / v, the shared
  expert's gate / up; `Forms.dense_launch`), the products run in one kernel launch where the
  in-place kernels take the rows (`quant_api.dense_matmul_multi`); each result is `linear`'s
  bit for bit either way. Products XLA makes of plain weight arrays stay separate GEMMs
  (`quant_api.apart`; `dense_matmul_multi` does the same). QRefs made `fused` share one
  launch of the quantised few-row kernel (`quant_one_launch`). partials: each as
  [S, *x.shape[:-1], out], the launch's split partial sums (S = 1: the product itself), for
  a kernel that adds them itself
  (`gemv.sum_partials`, then x's dtype: `linear`'s bits). x may be a `NormedInput`: the
  one-row GEMV's launch then makes the norm (`quant_api.norm_launch_rows`); else it is made
  first."""
  fused = one_launch(ws)
  norm = None
  if isinstance(x, NormedInput):
    from pallas_kernels.quant import api as quant_api  # noqa: PLC0415 (kernels load lazily)
    if fused and quant_api.norm_launch_rows(len(ws), x.rows, x.shape[-1], ws[0].implementation):
      x, norm = x.x, (x.w, x.eps)
    else:
      x = x.made()
  if not fused and quant_one_launch(ws):
    ys = _quant_multi(x, ws)
    return [y[None] for y in ys] if partials else ys
  if not fused:
    from pallas_kernels.quant.api import apart  # noqa: PLC0415 (kernels load lazily)
    xs = apart(x, len(ws)) if all(isinstance(w, jnp.ndarray) for w in ws) else [x] * len(ws)
    return [linear(xi, w)[None] if partials else linear(xi, w) for xi, w in zip(xs, ws)]
  from pallas_kernels.quant import api as quant_api  # noqa: PLC0415 (kernels load lazily)
  x2 = x.reshape(-1, x.shape[-1])
  ys = quant_api.dense_matmul_multi(x2, [w.w for w in ws], ws[0].index,
                                    implementation=ws[0].implementation, few=ws[0].few,
                                    partials=partials, norm=norm)
  if partials:
    return [y.reshape(y.shape[0], *x.shape[:-1], y.shape[-1]) for y in ys]
  return [y.reshape(*x.shape[:-1], y.shape[-1]) for y in ys]


def _one_row(gemv_lora):
  """`dense_matmul_lora`'s one-row kernel under this `Forms.gemv_lora`."""
  return "dot" if gemv_lora == "dot" else "gemv"


def dense_lora_in_kernel(gemv_lora, n_rows, d_in, x_dtype, w_dtype, implementation, few):
  """Whether n_rows of a dense projection kept whole (`Forms.dense_weights="kernel"`) take
  the adapter inside a kernel's launch under `Forms.gemv_lora` (`dense_matmul_lora`), so the
  adapter's stacks are read in place: "rows", "rows_dense" and "dot", where a kernel takes the
  rows (`quant_api.dense_lora_form`)."""
  from pallas_kernels.quant import api as quant_api  # noqa: PLC0415 (kernels load lazily)
  return gemv_lora in ("rows", "rows_dense", "dot") and quant_api.dense_lora_form(
      n_rows, d_in, x_dtype, w_dtype, implementation, few, _one_row(gemv_lora)) is not None


@dataclasses.dataclass(frozen=True)
class Pending:
  """A mixer's output projection not yet finished (`Forms.proj_finish` "kernel" / "gemv"): its
  split partial sums [S, N, D] and what the finishing kernel still adds, the adapter's (hp,
  b_stack, lidx, on, rank_scale) or None; `residual_norm` finishes it with the residual in one
  launch, then takes the next RMSNorm. Made inside the traced step; not a pytree."""
  parts: object
  lora: object
  implementation: str


def residual_norm(x, y, norm_w, eps, defer: bool = False):
  """(x + y, rms_norm(x + y, norm_w)): the residual add after a mixer and the norm before the
  MoE. A `Pending` y is finished by one kernel launch (`quant_api.finish_residual`), and the
  norm is this module's in either case; defer: the norm as a `NormedInput`, for the MoE's
  launch to make (`Forms.moe_norm` "in_launch")."""
  if not isinstance(y, Pending):
    x = x + y
  else:
    from pallas_kernels.quant import api as quant_api  # noqa: PLC0415 (kernels load lazily)
    x = quant_api.finish_residual(y.parts, x.reshape(-1, x.shape[-1]), lora=y.lora,
                                  implementation=y.implementation).reshape(x.shape)
  return x, NormedInput(x, norm_w, eps) if defer else rms_norm(x, norm_w, eps)


def _pending(x2, w, lora_a, lora_b, on, rank_scale, gemv_lora, copy_b=False):
  """A `Pending` of the projection x2 [N, in] @ w (a DRef), with the adapter's DRefs or
  None, where an in-place dense kernel takes the N rows (`dense_lora_form`); else None.
  copy_b: the one-row GEMV's launch copies the layer's B out for the finishing kernel."""
  from pallas_kernels.quant import api as quant_api  # noqa: PLC0415 (kernels load lazily)
  one_row = "gemv" if lora_a is None else _one_row(gemv_lora)
  if quant_api.dense_lora_form(x2.shape[0], x2.shape[1], x2.dtype, w.w.dtype,
                               w.implementation, w.few, one_row) is None:
    return None
  if lora_a is None:
    parts = quant_api.dense_matmul_split(x2, w.w, w.index, implementation=w.implementation,
                                         few=w.few)
    return Pending(parts, None, w.implementation)
  parts, lora = quant_api.dense_matmul_lora_split(
      x2, w.w, w.index, lora_a.w, lora_b.w, on, rank_scale=rank_scale,
      lora_index=lora_a.index, implementation=w.implementation, few=w.few, one_row=one_row,
      copy_b=copy_b)
  return Pending(parts, lora, w.implementation)


def out_projection(x, w, lora_a, lora_b, switch, implementation=None, row_scale=None,
                   gemv_lora="apart", finish="xla"):
  """The mixer output projection with the LoRA hook.

  x [B, T, in]; w [D, in]; lora_a [R, in] / lora_b [D, R] or None, or DRefs of the adapter's
  stacks at the layer (`Forms.gemv_lora` "rows" / "rows_dense"); switch [B] int32;
  row_scale [B, R] float32 or None: each row's scale of every rank column (the adapter table:
  adapters stacked on R chosen per row), None for one stacked set at unit scale.
  Rows with the switch off get the base projection exactly (a select, never `+ 0·delta`).
  `implementation`: the LoRA kernel's (`Forms.lora_impl`). A quantised `w` (QRef) runs the
  LoRA delta inside the quantised matmul (`qmatmul_lora`) instead. With the adapter's stacks
  as DRefs, `gemv_lora` "rows" computes A x in the few-row GEMV's own launch and B h in one
  finishing kernel, the adapter read in place, for the quantised GEMV and the in-place dense
  GEMV ("rows_dense": for the dense one only); otherwise the delta follows the GEMV.

  With one row (B == 1: a prefill chunk, or a one-slot decode) the row's scales are folded
  into B's columns (one [D, R] multiply) and the plain kernel runs, so the large-N prefill
  keeps every kernel form; with several rows the kernel scales h = A x per row.

  finish (`Forms.proj_finish`): "kernel" returns a `Pending` where an in-place dense kernel
  takes the rows of a DRef `w` (with no adapter, or with the adapter's DRefs, which
  `forward.run_layers` passes only where a kernel takes the rows: `dense_lora_in_kernel`),
  for `residual_norm` to finish in one launch ("gemv": for one row only; "gemv_b": as "gemv",
  the GEMV's launch copying the layer's B out for the finishing kernel); else the result.
  """
  B, T, _ = x.shape
  one_row = finish in ("gemv", "gemv_b") and B * T == 1
  if ((finish == "kernel" or one_row) and isinstance(w, DRef)
      and (lora_a is None or isinstance(lora_a, DRef))):
    on = jnp.repeat(switch.astype(jnp.int32), T)
    rank_scale = None if row_scale is None else jnp.repeat(row_scale, T, axis=0)
    pending = _pending(x.reshape(B * T, -1), w, lora_a, lora_b, on, rank_scale, gemv_lora,
                       copy_b=finish == "gemv_b")
    if pending is not None:
      return pending
  if lora_a is None:
    return linear(x, w)
  if isinstance(lora_a, DRef):   # the adapter's stacks at the layer
    from pallas_kernels.quant import api as quant_api  # noqa: PLC0415
    x2 = x.reshape(B * T, -1)
    on = jnp.repeat(switch.astype(jnp.int32), T)
    rank_scale = None if row_scale is None else jnp.repeat(row_scale, T, axis=0)
    if gemv_lora == "rows" and is_quant(w):   # the rows form where it applies, else the pair
      qt, index, impl, groups = _qparts(w)
      y = quant_call(qt, index, lambda q, i, **kw: quant_api.qmatmul_lora(
          x2, q, lora_a.w, lora_b.w, on, rank_scale=rank_scale, index=i, implementation=impl,
          lora_index=lora_a.index, **kw), groups)
      return y.reshape(B, T, -1)
    if isinstance(w, DRef) and dense_lora_in_kernel(gemv_lora, B * T, x2.shape[1], x2.dtype,
                                                    w.w.dtype, w.implementation, w.few):
      y = quant_api.dense_matmul_lora(x2, w.w, w.index, lora_a.w, lora_b.w, on,
                                      rank_scale=rank_scale, lora_index=lora_a.index,
                                      implementation=w.implementation, few=w.few,
                                      one_row=_one_row(gemv_lora))
      return y.reshape(B, T, -1)
    take = lambda r: lax.dynamic_index_in_dim(r.w, r.index, 0, False)
    lora_a, lora_b = take(lora_a), take(lora_b)
  rank_scale = None
  if row_scale is not None:
    if B == 1:
      lora_b = (lora_b.astype(jnp.float32) * row_scale[0]).astype(lora_b.dtype)
    else:
      rank_scale = jnp.repeat(row_scale, T, axis=0)                          # [B*T, R]
  on = jnp.repeat(switch.astype(jnp.int32), T)                               # [B*T]
  x2 = x.reshape(B * T, -1)
  if is_quant(w):
    from pallas_kernels.quant import api as quant_api  # noqa: PLC0415
    qt, index, impl, groups = _qparts(w)
    y = quant_call(qt, index, lambda q, i, **kw: quant_api.qmatmul_lora(
        x2, q, lora_a, lora_b, on, rank_scale=rank_scale, index=i, implementation=impl, **kw),
        groups)
    return y.reshape(B, T, -1)
  y = linear(x, w)
  from pallas_kernels.lora import api as lora_api  # noqa: PLC0415 (kernel package loads lazily)
  out = lora_api.lora_apply(y.reshape(B * T, -1), x2, lora_a, lora_b, on,
                            rank_scale=rank_scale, implementation=implementation)
  return out.reshape(y.shape)
