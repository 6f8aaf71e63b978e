"""The layer stack: embedding -> layers (a lax.scan over repeats of the layer pattern) -> logits."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.gdn.api import CONV_CHOICES as GDN_CONV_CHOICES
from pallas_kernels.gdn.api import decode_form as gdn_decode_form
from pallas_kernels.gdn.api import in_place as gdn_in_place
from pallas_kernels.quant.layout import QTensor
from strata_jax.config import ATTN, GDN, ModelConfig
from strata_jax.model.attention import attn_mixer
from strata_jax.model.common import (DRef, NormedInput, QRef, dense_lora_in_kernel, linear,
                                     residual_norm, rms_norm)
from strata_jax.model.gdn import gdn_mixer
from strata_jax.model.moe import moe
from strata_jax.params import QGroups


def pattern_period(layer_types: str) -> int:
  """Smallest p such that the pattern is its first p letters repeated."""
  n = len(layer_types)
  for p in range(1, n + 1):
    if n % p == 0 and layer_types[:p] * (n // p) == layer_types:
      return p
  return n


def _blocks(tree, n_blocks):
  """[L*, ...] -> [n_blocks, L*/n_blocks, ...] for every leaf (None passes through)."""
  return jax.tree.map(lambda a: a.reshape(n_blocks, a.shape[0] // n_blocks, *a.shape[1:]), tree)


def _is_q(a):
  return isinstance(a, (QTensor, QGroups))


def _split_quant(tree):
  """(tree with QTensor leaves set to None, tree with only the QTensor leaves)."""
  dense = jax.tree.map(lambda a: None if _is_q(a) else a, tree, is_leaf=_is_q)
  quant = jax.tree.map(lambda a: a if _is_q(a) else None, tree, is_leaf=_is_q)
  return dense, quant


# The dense matrices `Forms.dense_weights="in_place"` keeps whole (not scanned), by params class.
IN_PLACE_FIELDS = {"GDNParams": ("qkv", "gate", "ba", "out"),
                   "AttnParams": ("q", "k", "v", "out"),
                   "MoEParams": ("router", "shared_gate", "shared_up", "shared_down")}


def _split_whole(cfg, tree):
  """(tree with the whole-kept matrices set to None, tree with only those), under
  `Forms.dense_weights` "in_place" or "kernel"; else (tree, None). (An unresolved "auto",
  a config built by hand, is "scan".)"""
  if cfg.forms.dense_weights in ("scan", "auto"):
    return tree, None
  names = IN_PLACE_FIELDS[type(tree).__name__]
  whole = tree.replace(**{f.name: None for f in dataclasses.fields(tree) if f.name not in names})
  return tree.replace(**{n: None for n in names}), whole


def _dense_few(cfg):
  """`Forms.dense_few` of a config, "auto" (a config built by hand) read as its "dot"."""
  return "dot" if cfg.forms.dense_few == "auto" else cfg.forms.dense_few


def _layer(cfg, dense, quant, i, index, whole=None):
  """One layer's params: slot `i` of the scanned (dense) block, `QRef(stack, index)` for each
  quantised stack, which the quantised matmul reads in place at the traced `index`, and
  matrix `index` of each stack in `whole` (dense matrices kept out of the scan): taken by
  XLA, or under `Forms.dense_weights="kernel"` a `DRef` the GEMV kernel reads in place."""
  p = jax.tree.map(lambda a: a[i], dense)
  impl, groups = cfg.forms.quant_impl, cfg.forms.quant_groups
  fields = {f.name: QRef(getattr(quant, f.name), index, impl, groups,
                         cfg.forms.quant_launch == "fused")
            for f in dataclasses.fields(quant) if _is_q(getattr(quant, f.name))}
  if whole is not None:
    fused = cfg.forms.dense_launch != "apart"
    take = ((lambda a: DRef(a, index, impl, _dense_few(cfg), fused))
            if cfg.forms.dense_weights == "kernel"
            else (lambda a: lax.dynamic_index_in_dim(a, index, 0, False)))
    fields.update({f.name: take(getattr(whole, f.name)) for f in dataclasses.fields(whole)
                   if getattr(whole, f.name) is not None and f.name not in fields})
  return p.replace(**fields) if fields else p


def _unblocks(tree):
  return jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), tree)


# run_layers' passes under `Forms.lora_branch` "cond", in `lax.switch` order.
LORA_BRANCHES = ("off", "on", "mixed")


def _on_off_rows(switch, n_new):
  """(on, off) [B] bool: the rows adding tokens with the switch on / off."""
  switch = jnp.broadcast_to(switch, n_new.shape)
  return (switch != 0) & (n_new > 0), (switch == 0) & (n_new > 0)


def lora_branch_index(switch, n_new):
  """Which pass of `LORA_BRANCHES` the rows adding tokens need: int32 scalar."""
  on, off = _on_off_rows(switch, n_new)
  return jnp.where(jnp.any(on), jnp.where(jnp.any(off), 2, 1), 0).astype(jnp.int32)


def run_layers(cfg: ModelConfig, layers, lora, kv, gdn_state, x, pos, n_new, switch,
               cvec=None, keep_steps: bool = False, cut=None, cut_window: int = 0,
               branch: str | None = None):
  """`layers_scan` with the adapter; under `cfg.forms.lora_branch` "cond", one of three
  branches ("select": one scan, the delta computed for every row and a select keeping the base
  rows).

  Rows whose switch is off must come out bit-identical to the model with no adapter, in any
  batch. On the GPU, XLA tunes each GEMM it compiles by timing, so two different layer
  programs (with and without the adapter hook) may round the base projections differently.
  Hence off rows always run the one no-adapter scan, and on rows the one adapter scan:
    no active row on  -> the no-adapter scan;
    no active row off -> the adapter scan;
    mixed             -> the no-adapter scan with only the off rows active, then the adapter
                         scan with only the on rows active (about twice the work of one).
  An inactive row (n_new 0) leaves its K/V, conv and recurrent state untouched, so the two
  passes compose; rows are independent, so an off row's numbers do not depend on the others.

  keep_steps: the GDN state of every step comes back instead of the last (`layers_scan`); the
  mixed case then runs both passes from the same GDN state and keeps each row's own pass.
  cut, cut_window: the GDN state after each row's first `cut` tokens comes back too, as a
  fourth result (`layers_scan`).
  branch: one of `LORA_BRANCHES`, chosen by the caller, runs that pass alone; None chooses
  here with a `lax.switch`. On the GPU a conditional's index is copied to the host, which
  waits for the stream to drain, so a decode loop chooses once per dispatch, outside its step
  loop (`steps._by_lora_branch`), instead of once per step.
  """
  if lora is None or cfg.forms.lora_branch == "select":
    return layers_scan(cfg, layers, lora, kv, gdn_state, x, pos, n_new, switch, cvec,
                       keep_steps, cut, cut_window)
  switch = jnp.broadcast_to(switch, n_new.shape)
  on, off = _on_off_rows(switch, n_new)
  scan = lambda lp, kv, gs, nv: layers_scan(cfg, layers, lp, kv, gs, x, pos, nv, switch, cvec,
                                            keep_steps, cut, cut_window)

  def mixed():
    x_off, kv1, gs1, *cut1 = scan(None, kv, gdn_state, jnp.where(off, n_new, 0))
    x_on, kv2, gs2, *cut2 = scan(lora, kv1, gdn_state if keep_steps else gs1,
                                 jnp.where(on, n_new, 0))
    rows = on.reshape((-1,) + (1,) * (x.ndim - 1))
    # [Lg, B, ...]: each row from its own pass
    pick = lambda a, b: jnp.where(on.reshape((1, -1) + (1,) * (a.ndim - 2)), a, b)
    if keep_steps:
      gs2 = jax.tree.map(pick, gs2, gs1)
    # a cut state: an on row's from the on pass (which it entered with its state untouched)
    return (jnp.where(rows, x_on, x_off), kv2, gs2) + tuple(
        jax.tree.map(pick, c2, c1) for c2, c1 in zip(cut2, cut1))

  passes = {"off": lambda: scan(None, kv, gdn_state, n_new),
            "on": lambda: scan(lora, kv, gdn_state, n_new), "mixed": mixed}
  if branch is not None:
    return passes[branch]()
  return lax.switch(lora_branch_index(switch, n_new), [passes[b] for b in LORA_BRANCHES])


def layers_scan(cfg: ModelConfig, layers, lora, kv, gdn_state, x, pos, n_new, switch,
                cvec=None, keep_steps: bool = False, cut=None, cut_window: int = 0):
  """Apply every layer of `cfg.layer_types`.

  layers: LayerParams; lora: LoraParams or None; kv: (k, v) [La, B, S, G, Hd];
  gdn_state: (conv [Lg, B, K-1, C], ssm [Lg, B, Hv, Dv, Dk]); x [B, T, D]; pos, n_new,
  switch [B] (with `lora.table`, each row's index into it); cvec: the control vector [L, D]
  (row il added to layer il's output, after its MoE residual add, as llama.cpp's
  `build_cvec`), or None: then nothing is added and the program is the one without control
  vectors. Returns (x, kv, gdn_state).
  keep_steps (static): gdn_state comes back as (conv_rows [Lg, B, K-1+T, C], ssm_steps
  [Lg, B, T, Hv, Dv, Dk]), every step's state (`gdn.gdn_mixer`), for speculative verification.

  The scan runs over repeats of the pattern's period (e.g. 12 x "GGGA"); the period's
  layers are unrolled in the body, so compile time does not grow with depth.

  The K/V cache stacks ride in the scan's carry, whole: each attention layer scatters its new
  keys/values into its own index (`attn_mixer(layer=)`) and XLA updates a while loop's carry in
  place, where a scan's xs would be sliced (a copy) and its ys stacked (another). At a decode
  step with a Pallas GDN kernel (fused, or the step kernel: `gdn_api.in_place`) the recurrent
  state stack rides in the carry too: the kernel reads and writes its layer of it in place
  (`gdn_mixer(layer=)`). The jnp GDN forms, and the small conv state, take their layer's
  state from xs: a jnp read of a carried stack is fused into several consumers, some of them
  after the layer's in-place update, and XLA then copies the whole stack at every layer.
  keep_steps returns every step's state, not a stack.
  cut [B] (prefill; static cut_window): a fourth result, (conv [Lg, B, K-1, C], ssm [Lg, B, Hv,
  Dv, Dk]) the GDN state after each row's first `cut` tokens (`gdn_mixer`).
  """
  period = pattern_period(cfg.layer_types)
  n_blocks = cfg.n_layers // period
  block_types = cfg.layer_types[:period]
  # Quantised stacks are not scanned (a scan slices its xs, copying each layer's matrix):
  # the body reads them in place at the traced layer index.
  moe_d, moe_q = _split_quant(layers.moe)
  gdn_d, gdn_q = _split_quant(layers.gdn)
  attn_d, attn_q = _split_quant(layers.attn)
  moe_d, moe_w = _split_whole(cfg, moe_d)
  gdn_d, gdn_w = _split_whole(cfg, gdn_d)
  attn_d, attn_w = _split_whole(cfg, attn_d)
  norms_and_moe = _blocks((layers.attn_norm, layers.post_norm, moe_d), n_blocks)
  gdn_p = _blocks(gdn_d, n_blocks)
  attn_p = _blocks(attn_d, n_blocks)
  n_g, n_a = block_types.count(GDN), block_types.count(ATTN)
  # Under `Forms.gemv_lora` "rows" / "rows_dense" / "dot", a program whose output projections
  # run a few-row kernel with the adapter inside (the in-place dense GEMV's one row, the
  # tensor-core dense_dot's 2 to 64 rows of a 16-bit model, or its one row under "dot";
  # "rows": also the quantised GEMV's few rows) keeps the adapter's stacks whole, and each
  # projection gets DRefs of its layer's pair, which those kernels read in place; every other
  # program (more rows, prefill) takes each block's pairs as the scan's xs, as before.
  from pallas_kernels.quant import api as quant_api  # noqa: PLC0415 (kernels load lazily)
  n_rows = x.shape[0] * x.shape[1]
  quant_rows = (cfg.forms.quant_impl != "xla" and n_rows <= quant_api.ROWS_MAX
                and any(_is_q(getattr(q, "out", None)) for q in (gdn_q, attn_q)))
  rows = cfg.forms.gemv_lora
  # (the whole-kept matrices' widths are multiples of 32, so DENSE_UNIT stands for any)
  dense_rows = cfg.forms.dense_weights == "kernel" and dense_lora_in_kernel(
      rows, n_rows, quant_api.DENSE_UNIT, x.dtype, x.dtype, cfg.forms.quant_impl,
      _dense_few(cfg))
  lora_whole = lora is not None and (dense_rows or (rows == "rows" and quant_rows))
  scanned = lora is not None and not lora_whole
  lora_g = _blocks((lora.gdn_a, lora.gdn_b), n_blocks) if scanned else None
  lora_a = _blocks((lora.attn_a, lora.attn_b), n_blocks) if scanned else None
  # The adapter table: each row's scale per rank column [B, R] (None: one stacked set, unit
  # scales), looked up once per step from the row's switch.
  row_scale = None
  if lora is not None and lora.table is not None:
    sw = jnp.broadcast_to(switch, pos.shape).astype(jnp.int32)
    row_scale = jnp.take(lora.table, sw, axis=0, mode="clip").astype(jnp.float32)
  B, T, D = x.shape
  gdn_decode = gdn_decode_form(cfg.forms.gdn_decode, B)     # "auto": by the batch on the GPU
  ssm_in_carry = not keep_steps and T == 1 and gdn_in_place(gdn_decode, B)
  # `Forms.gdn_decode` "pallas_conv": the conv state stack rides in the carry as well (the
  # kernel reads its layer in place; a dynamic update writes it back), and the conv weights,
  # A and dt_bias stay whole, read at the layer index in the kernel (a block's slices were
  # copies for the launch).
  conv_in_carry = ssm_in_carry and gdn_decode in GDN_CONV_CHOICES
  gdn_stacks = None
  if conv_in_carry and not any(_is_q(getattr(layers.gdn, n)) for n in ("conv", "a", "dt_bias")):
    gdn_stacks = (layers.gdn.conv, layers.gdn.a, layers.gdn.dt_bias)
  conv_b = None if conv_in_carry else _blocks(gdn_state[0], n_blocks)
  ssm_b = None if ssm_in_carry else _blocks(gdn_state[1], n_blocks)
  cvec_b = _blocks(cvec, n_blocks)   # [n_blocks, period, D], or None
  # The expert stacks whole, for the few-token MoE kernel (reads layer `blk * period + li`).
  stacks = (layers.moe.gate_exps, layers.moe.up_exps, layers.moe.down_exps)
  real = (jnp.arange(T, dtype=jnp.int32)[None, :] < n_new[:, None]).reshape(B * T)
  in_proj_norm = T == 1 and cfg.forms.input_norm == "in_proj"
  in_launch_moe_norm = T == 1 and cfg.forms.moe_norm == "in_launch"

  def body(carry, xs):
    # ssm_all / conv_all: the whole ssm / conv stack, or None (then ssm_in / conv_in)
    x, (kc, vc), ssm_all, conv_all = carry
    blk, (attn_norm, post_norm, moe_p), gp, ap, lg, la, conv_in, ssm_in, cv = xs
    conv_out, ssm_out, cut_out = [], [], []
    gi = ai = 0
    for li, kind in enumerate(block_types):
      # `Forms.input_norm` "in_proj": a decode step's norm made by the projections' launch
      h = (NormedInput(x, attn_norm[li], cfg.rms_eps) if in_proj_norm
           else rms_norm(x, attn_norm[li], cfg.rms_eps))
      if kind == ATTN:
        p = _layer(cfg, ap, attn_q, ai, blk * n_a + ai, attn_w)
        la_i = (la[0][ai], la[1][ai]) if la is not None else (None, None)
        if lora_whole:
          la_i = (DRef(lora.attn_a, blk * n_a + ai), DRef(lora.attn_b, blk * n_a + ai))
        y, kc, vc = attn_mixer(cfg, p, h, kc, vc, pos, n_new, *la_i, switch,
                               row_scale=row_scale, layer=blk * n_a + ai)
        ai += 1
      else:
        p = _layer(cfg, gp, gdn_q, gi, blk * n_g + gi, gdn_w)
        lg_i = (lg[0][gi], lg[1][gi]) if lg is not None else (None, None)
        if lora_whole:
          lg_i = (DRef(lora.gdn_a, blk * n_g + gi), DRef(lora.gdn_b, blk * n_g + gi))
        if ssm_in_carry:
          y, conv, ssm_all = gdn_mixer(
              cfg, p, h, conv_all if conv_in_carry else conv_in[gi], ssm_all, n_new, *lg_i,
              switch, row_scale=row_scale, layer=blk * n_g + gi, stacks=gdn_stacks)
          if conv_in_carry:
            conv_all, conv = conv, None
        else:
          y, conv, ssm, *at_cut = gdn_mixer(cfg, p, h, conv_in[gi], ssm_in[gi], n_new, *lg_i,
                                            switch, keep_steps, row_scale=row_scale, cut=cut,
                                            cut_window=cut_window)
          ssm_out.append(ssm)
          cut_out += at_cut
        if conv is not None:
          conv_out.append(conv)
        gi += 1
      x, h = residual_norm(x, y, post_norm[li], cfg.rms_eps,   # y may be `Pending`
                           defer=in_launch_moe_norm)
      h = h.reshape(B * T, D)
      x = x + moe(cfg, _layer(cfg, moe_p, moe_q, li, blk * period + li, moe_w), h, stacks,
                  blk * period + li, real=real,
                  form_tokens=B if keep_steps else None).reshape(B, T, D)
      if cv is not None:
        x = x + cv[li].astype(x.dtype)
    restack = lambda new, old: jnp.stack(new) if new else old   # a kind may be absent
    at_cut = None
    if cut is not None:   # (conv, ssm) per GDN layer of the block, stacked like the states
      at_cut = (restack([c for c, _ in cut_out], conv_in), restack([s for _, s in cut_out], ssm_in))
    return (x, (kc, vc), ssm_all, conv_all), (restack(conv_out, conv_in),
                                               restack(ssm_out, ssm_in), at_cut)

  carry = (x, tuple(kv), gdn_state[1] if ssm_in_carry else None,
           gdn_state[0] if conv_in_carry else None)
  (x, kv, ssm_all, conv_all), (conv_b, ssm_b, cut_b) = lax.scan(
      body, carry, (jnp.arange(n_blocks, dtype=jnp.int32), norms_and_moe, gdn_p, attn_p,
                    lora_g, lora_a, conv_b, ssm_b, cvec_b))
  out = (x, kv, (conv_all if conv_in_carry else _unblocks(conv_b),
                 ssm_all if ssm_in_carry else _unblocks(ssm_b)))
  return out if cut is None else out + (_unblocks(cut_b),)


def embed(params, tokens):
  """tokens [B, T] -> [B, T, D]. A quantised table: the rows are gathered in their blocks,
  then dequantised (exactly) to the compute dtype."""
  if _is_q(params.embed):
    from pallas_kernels.quant.reference import dequantize  # noqa: PLC0415
    qt = params.embed
    flat_ids = tokens.reshape(-1)
    rows = QTensor(**{n: jnp.take(p, flat_ids, axis=0) for n, p in qt.planes.items()},
                   qtype=qt.qtype, shape=(flat_ids.shape[0], qt.shape[-1]))
    x = dequantize(rows, jnp.float32).astype(params.layers.attn_norm.dtype)
    return x.reshape(*tokens.shape, qt.shape[-1])
  return jnp.take(params.embed, tokens, axis=0)


def logits_from_hidden(cfg: ModelConfig, params, x):
  """x [..., D] -> float32 logits [..., V]. Under `Forms.head="kernel"` a plain float head's
  rows go to the in-place dense kernels (the matrix as a stack of one) where one takes them
  (the GEMV's one row, dense_dot's few 16-bit rows), not to XLA's autotuned GEMM."""
  h = rms_norm(x, params.final_norm, cfg.rms_eps)
  w = params.lm_head
  if _is_q(w):
    w = QRef(w, None, cfg.forms.quant_impl)
  elif cfg.forms.head == "kernel" and _head_kernel_rows(cfg, h, w):
    w = DRef(w[None], jnp.int32(0), cfg.forms.quant_impl, _dense_few(cfg))
  return linear(h, w).astype(jnp.float32)


def _head_kernel_rows(cfg, h, w) -> bool:
  """Whether an in-place dense kernel takes the head's rows of h (else XLA's GEMM): the
  kernels' own routing (`dense_lora_form` with no adapter is `dense_matmul`'s, as the
  mixers' `common._pending` asks it)."""
  from pallas_kernels.quant import api as quant_api  # noqa: PLC0415 (kernels load lazily)
  n, d = h.size // h.shape[-1], h.shape[-1]
  return quant_api.dense_lora_form(n, d, h.dtype, w.dtype, cfg.forms.quant_impl,
                                   _dense_few(cfg)) is not None
