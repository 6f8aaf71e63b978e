"""Gated DeltaNet mixer (Qwen3-Next linear attention)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.gdn import api as gdn_api
from pallas_kernels.gdn import reference as gdn_reference
from pallas_kernels.quant.gemv import sum_partials
from strata_jax.config import ModelConfig
from strata_jax.model.common import l2_norm, linears, out_projection


def causal_conv(x, conv_state, w, n_new, taps: bool = False):
  """Depthwise causal conv (tap K-1 on the current token), then SiLU.

  x [B, T, C] raw rows; conv_state [B, K-1, C] previous raw rows; w [C, K]; n_new [B].
  Returns (y [B, T, C], new conv_state = the last K-1 raw rows up to the last valid token).
  taps (`Forms.gdn_conv` "taps"): each tap from `conv_taps`, not sliced out of the
  concatenation of conv_state and x; the same elements, so the same y bit for bit.
  """
  K = w.shape[1]
  T = x.shape[1]
  wf = w.astype(jnp.float32)
  state = conv_state.astype(x.dtype)
  if taps:
    rows = [conv_taps(state, x, j) for j in range(K)]
  else:
    ext = jnp.concatenate([state, x], axis=1)                                  # [B, K-1+T, C]
    rows = [ext[:, j:j + T] for j in range(K)]
  acc = sum(r.astype(jnp.float32) * wf[:, j] for j, r in enumerate(rows))
  y = jax.nn.silu(acc).astype(x.dtype)
  if K == 1:
    return y, conv_state
  return y, conv_window(conv_state, x, n_new).astype(conv_state.dtype)


def conv_taps(conv_state, x, j):
  """Rows j .. j+T-1 of concat([conv_state, x], axis=1), built without the concatenation:
  conv_state [B, K-1, C] and x [B, T, C] of one dtype; 0 <= j <= K-1. Each row is one of the
  two operands' elements (a select, so the bits of the slice). Pads and selects fuse into
  each reader of the conv, where XLA wrote the concatenation for the prefill's three readers
  (q, k, v): 36 x 97 us of a 2,500-token prefill on the H100 (results/device/run77)."""
  km1, T = conv_state.shape[1], x.shape[1]
  zero = jnp.zeros((), x.dtype)
  shift = km1 - j                     # the first `shift` rows come from conv_state
  if shift == 0:
    return x
  new = lax.pad(x, zero, ((0, 0, 0), (shift, -shift, 0), (0, 0, 0)))        # x moved down
  old = lax.pad(conv_state[:, j:], zero, ((0, 0, 0), (0, T - shift, 0), (0, 0, 0)))
  row = lax.broadcasted_iota(jnp.int32, (1, T, 1), 1)
  return jnp.where(row < shift, old, new)


def conv_window(conv_state, x, start):
  """Rows start .. start+K-2 of concat([conv_state, x], axis=1) per batch row (the start
  clamped as `lax.dynamic_slice` clamps it), in x's dtype, gathered from the two operands:
  the concatenation's only reader is then the conv's sum, into which XLA fuses it (with a
  second reader it wrote the [B, K-1+T, C] array: 36 x 97 us of a 2,500-token prefill on the
  H200, experiments/results/device/run70). conv_state [B, K-1, C]; x [B, T, C]; start [B]."""
  km1, T = conv_state.shape[1], x.shape[1]
  pos = jnp.clip(start, 0, T)[:, None] + jnp.arange(km1)[None, :]           # [B, K-1]
  take = lambda a, i: jnp.take_along_axis(a, i[..., None], axis=1)
  old = take(conv_state, jnp.clip(pos, 0, km1 - 1)).astype(x.dtype)
  new = take(x, jnp.clip(pos - km1, 0, T - 1))
  return jnp.where((pos < km1)[..., None], old, new)


def gdn_mixer(cfg: ModelConfig, p, x, conv_state, ssm, n_new, lora_a, lora_b, switch,
              keep_steps: bool = False, *, row_scale=None, layer=None, cut=None,
              cut_window: int = 0, stacks=None):
  """x [B, T, D]; p one layer's GDNParams; conv_state [B, K-1, C]; ssm [B, Hv, Dv, Dk] f32;
  n_new [B] tokens of the T each row adds (the rest is padding and leaves state unchanged;
  0: the row sits this call out).
  Returns (y [B, T, D], conv_state, ssm).

  keep_steps (speculative verification, static): the T tokens run as T decode steps (the very
  step `decode` runs, one token at a time) and the state after every step is kept: returns
  (y, conv_rows [B, K-1+T, C] the previous K-1 raw rows then the T new ones, ssm_steps
  [B, T, Hv, Dv, Dk] the recurrent state after token t). The state after the first n tokens is
  then (conv_rows[:, n:n+K-1], ssm_steps[:, n-1]) (`strata_jax.speculative`).

  layer: None, or an int32 scalar (may be traced; not with keep_steps): ssm is then every
  layer's stack [L, B, Hv, Dv, Dk] and layer `layer` of it is updated; the whole stack comes
  back. The decode kernels (T == 1, fused or the Pallas step: `gdn_api.in_place`) read and
  write that layer in place, so a layer scan can carry the stack; the other forms read and
  write it in jnp,
  where XLA fuses the read into several consumers and then copies the whole stack to keep it
  alive past the update (`forward.layers_scan` passes them one layer's state instead).
  Under `Forms.gdn_decode` "pallas_conv" conv_state may be the stack [L, B, K-1, C] too (its
  layer read in place, then updated by a dynamic update), and `stacks` every layer's (conv
  weights, A, dt_bias), read at `layer` in the kernel instead of `p`'s (sliced out of a
  block: a copy each for a kernel's operand).

  At T == 1 a row with n_new == 0 keeps its conv and recurrent state bit for bit (the fused
  kernel does not store it; the other forms select it).

  cut [B] int32 (prefill, T > 1; with the static `cut_window` W): each row's state is also
  wanted after its first `cut` tokens, and its valid tokens end before cut + W <= T. The
  chunked op then runs twice: over the chunk with the gates masked from the cut on (its
  outputs before the cut are final, its state is the state at the cut), and over the W tokens
  from the cut, from that state. These are the very calls of a chunk ending at the cut and a
  W-token chunk after it, so the states and outputs are theirs, while every other layer makes
  one pass over the weights for both. Returns (y, conv_state, ssm, (conv_cut, ssm_cut)).

  cut [B, C] with a tuple of C windows (W_1, ..., W_C): the states after each of C increasing
  cuts. The op runs over the chunk masked from cut 1, then over W_i tokens from cut i (from
  the state at cut i), masked from cut i + 1 for all but the last: the calls of chunks ending
  at each cut. Each cut + W_i <= T, and W_i reaches cut i + 1 (the last: the row's valid end).
  conv_cut and ssm_cut then carry a C axis after B."""
  if keep_steps and layer is not None:
    raise ValueError("gdn_mixer: keep_steps returns per-step states, not a stack: no `layer`")
  B, T, _ = x.shape
  step_form = gdn_api.decode_form(cfg.forms.gdn_decode, B)  # "auto": by the batch on the GPU
  many = cut is not None and jnp.ndim(cut) == 2
  windows = tuple(cut_window) if many else (cut_window,)
  if cut is not None and (T == 1 or keep_steps or layer is not None or min(windows) < 1
                          or (many and len(windows) != cut.shape[1])):
    raise ValueError("gdn_mixer: a cut is for a prefill chunk (T > 1, one layer's state, "
                     "cut_window >= 1, one window per cut)")
  Hk, Hv, Dk, Dv = cfg.gdn_n_k_heads, cfg.gdn_n_v_heads, cfg.gdn_d_k, cfg.gdn_d_v
  r = Hv // Hk
  if (T == 1 and layer is not None and not keep_steps
      and step_form in gdn_api.CONV_CHOICES):
    # One launch from the qkv / ba projections' split partials to the delta rule's output:
    # the conv, the gates, the delta rule. The conv state (when `conv_state` is the stack)
    # and the weights in `stacks` are read at `layer` in place; the gated norm stays XLA's,
    # which adds z's partials in its fusion.
    qkv, z, ba = linears(x, [p.qkv, p.gate, p.ba], partials=True)
    conv_w, a_coef, dt_bias = stacks if stacks is not None else (p.conv, p.a, p.dt_bias)
    stacked = conv_state.ndim == 4
    o, conv_state, ssm = gdn_api.decode_conv(
        qkv[:, :, 0], ba[:, :, 0], conv_state, conv_w, a_coef, dt_bias, ssm, n_new, layer,
        layer if stacked else None, layer if stacks is not None else None, n_k_heads=Hk,
        x_dtype=x.dtype, implementation=step_form)
    z = sum_partials(z.astype(jnp.float32)).astype(x.dtype).reshape(B, T, Hv, Dv)
    return _gdn_out(cfg, p, o[:, None], z, x, lora_a, lora_b, switch, row_scale), \
        conv_state, ssm
  if (T == 1 and layer is not None and not keep_steps
      and step_form in gdn_api.LAYER_CHOICES):
    # One launch from the projections' outputs to what the output projection reads: the
    # conv, the gates, the delta rule (this layer of the stack, in place) and the gated norm.
    # z and ba go in as the projection launch's split partials, which the kernel adds.
    qkv, z, ba = linears(x, [p.qkv, p.gate, p.ba], partials=True)
    qkv = sum_partials(qkv).astype(x.dtype)[:, 0]                          # [B, C]
    o, conv_state, ssm = gdn_api.decode_layer(
        qkv, conv_state, p.conv, z.reshape(-1, B, Hv, Dv), ba[:, :, 0], p.a, p.dt_bias,
        p.norm, ssm, n_new, layer, n_k_heads=Hk, eps=cfg.rms_eps, out_dtype=x.dtype,
        implementation=step_form)
    y = out_projection(o.reshape(B, 1, Hv * Dv), p.out, lora_a, lora_b, switch,
                       cfg.forms.lora_impl, row_scale, cfg.forms.gemv_lora,
                       cfg.forms.proj_finish)
    return y, conv_state, ssm
  qkv, z, ba = linears(x, [p.qkv, p.gate, p.ba])
  z = z.reshape(B, T, Hv, Dv)                                                # qkv [B, T, C]
  ba = ba.astype(jnp.float32).reshape(B, T, Hk, 2 * r)
  b, a = ba[..., :r].reshape(B, T, Hv), ba[..., r:].reshape(B, T, Hv)
  kd = cfg.gdn_key_dim
  beta = jax.nn.sigmoid(b)
  g = p.a.astype(jnp.float32) * jax.nn.softplus(a + p.dt_bias.astype(jnp.float32))
  valid = (jnp.arange(T)[None, :] < n_new[:, None])[..., None]             # [B, T, 1]
  beta, g = jnp.where(valid, beta, 0.0), jnp.where(valid, g, 0.0)
  if keep_steps:
    # Token by token, as `decode` computes it: the conv over the window of the last K raw
    # rows, then one delta-rule step (same shapes, so the same rounding as a decode step).
    K = p.conv.shape[1]
    rows = jnp.concatenate([conv_state.astype(qkv.dtype), qkv], axis=1)    # [B, K-1+T, C]
    one_each = jnp.ones((B,), jnp.int32)

    if gdn_api.is_fused(step_form):
      # Under the fused decode kernel: the conv of all T rows at once (each output is the same
      # K products summed in the same order as a one-token conv), then the T steps in one
      # launch whose per-step math is the decode kernel's, every step's state written.
      c, _ = causal_conv(qkv, conv_state, p.conv, n_new)
      q_s, k_s = c[..., :kd].reshape(B, T, Hk, Dk), c[..., kd:2 * kd].reshape(B, T, Hk, Dk)
      v_s = c[..., 2 * kd:].reshape(B, T, Hv, Dv).astype(jnp.float32)
      o, ssm = gdn_api.steps_fused(q_s, k_s, v_s, a, b, p.a, p.dt_bias, ssm, valid[..., 0],
                                   implementation=step_form)
      return _gdn_out(cfg, p, o, z, x, lora_a, lora_b, switch, row_scale), rows, ssm

    def one(s, xs):
      t, g_t, beta_t = xs
      win = lax.dynamic_slice_in_dim(rows, t, K, axis=1)                     # [B, K, C]
      c, _ = causal_conv(win[:, K - 1:], win[:, :K - 1], p.conv, one_each)
      q_t, k_t = c[:, 0, :kd].reshape(B, Hk, Dk), c[:, 0, kd:2 * kd].reshape(B, Hk, Dk)
      v_t = c[:, 0, 2 * kd:].reshape(B, Hv, Dv).astype(jnp.float32)
      o_t, s = gdn_api.step_raw(q_t, k_t, v_t, g_t, beta_t, s,
                                implementation=step_form)
      return s, (o_t, s)
    tm = lambda a: jnp.moveaxis(a, 1, 0)                                     # [T, B, ...]
    _, (o, steps) = lax.scan(one, ssm, (jnp.arange(T), tm(g), tm(beta)))
    o, conv_state, ssm = jnp.moveaxis(o, 0, 1), rows, jnp.moveaxis(steps, 0, 1)
    return _gdn_out(cfg, p, o, z, x, lora_a, lora_b, switch, row_scale), conv_state, ssm
  # At T == 1 an idle row keeps its state bit for bit (the delta rule with g = beta = 0 gives
  # S + 0, which can flip a zero's sign): `steps.decode` relies on it (no full-state select).
  def idle(new, old):
    if T > 1:
      return new
    return jnp.where((n_new > 0).reshape((B,) + (1,) * (old.ndim - 1)), new, old)
  conv_cut = None
  if cut is not None:   # the last K-1 raw rows before the cut, as causal_conv keeps them
    cuts = cut if many else cut[:, None]                                   # [B, C]
    conv_cut = (jnp.stack([conv_window(conv_state, qkv, cuts[:, i])
                           for i in range(len(windows))], axis=1) if many
                else conv_window(conv_state, qkv, cut)).astype(conv_state.dtype)
  qkv, conv_new = causal_conv(qkv, conv_state, p.conv, n_new, cfg.forms.gdn_conv == "taps")
  conv_state = idle(conv_new, conv_state)
  q_raw = qkv[..., :kd].reshape(B, T, Hk, Dk)
  k_raw = qkv[..., kd:2 * kd].reshape(B, T, Hk, Dk)
  v = qkv[..., 2 * kd:].reshape(B, T, Hv, Dv).astype(jnp.float32)
  # The decode kernels take n_new itself as their `valid` (n_new >= 0, a row is valid where it
  # is not 0): `n_new > 0` was one more XLA kernel a layer-scan iteration, 12 x 1.4 us of a
  # bench-a3b batch-1 step (H100: 1,156 -> 1,144 kernels, results/device/run78).
  if T == 1 and gdn_api.is_fused(step_form):
    # One launch from the raw inputs: gates, L2 norms, head expansion, the delta rule; the
    # state of a row with no valid token is not stored (it is unchanged). Given the stack and
    # `layer`, the kernel updates that layer of it in place.
    o, ssm = gdn_api.step_fused(q_raw[:, 0], k_raw[:, 0], v[:, 0], a[:, 0], b[:, 0], p.a,
                                p.dt_bias, ssm, n_new, layer,
                                implementation=step_form)
    y = _gdn_out(cfg, p, o[:, None], z, x, lora_a, lora_b, switch, row_scale)
    return y, conv_state, ssm
  if T == 1 and layer is not None and gdn_api.in_place(step_form, B):
    # The Pallas step kernel updates this layer of the stack in place; idle rows not stored.
    o, ssm = gdn_api.step_raw(q_raw[:, 0], k_raw[:, 0], v[:, 0], g[:, 0], beta[:, 0], ssm,
                              implementation=step_form, layer=layer,
                              valid=n_new)
    y = _gdn_out(cfg, p, o[:, None], z, x, lora_a, lora_b, switch, row_scale)
    return y, conv_state, ssm
  s_in = ssm if layer is None else lax.dynamic_index_in_dim(ssm, layer, 0, keepdims=False)
  # a prefill's chunked op returns o already gated and normed (`Forms.gdn_gated_norm`)
  in_op_norm = T > 1 and cfg.forms.gdn_gated_norm == "in_op"
  if T == 1:
    # One fused step (L2 norms, head expansion, the delta rule) on the GPU.
    o, s = gdn_api.step_raw(q_raw[:, 0], k_raw[:, 0], v[:, 0], g[:, 0], beta[:, 0], s_in,
                            implementation=step_form)
    o = o[:, None]
  else:
    # The chunked op's q/k/v in a 16-bit model's own dtype, q/k normalised in fp32 and then
    # rounded, as transformers hands them to fla's kernel (fp32 models: fp32). q/k keep
    # their Hk heads: the op maps v-head h to k-head h // r (the chunk-parallel kernels read
    # them in place; the other forms repeat them). At T = 2,500 this halves the bytes the
    # kernel reads and the prefill writes for them, twice over.
    act = x.dtype if jnp.dtype(x.dtype).itemsize == 2 else jnp.float32
    q = (l2_norm(q_raw) * (Dk ** -0.5)).astype(act)
    k = l2_norm(k_raw).astype(act)
    v = v.astype(act)   # exact: v holds qkv's values (x's dtype)
    choice = dict(implementation=cfg.forms.gdn_chunked, pallas_chunk=cfg.forms.gdn_pallas_chunk)
    if in_op_norm:   # o comes back gated and normed (x's dtype): z goes in with each call
      chunked = functools.partial(gdn_api.chunked_gated, norm_w=p.norm, eps=cfg.rms_eps,
                                  out_dtype=x.dtype, **choice)
    else:
      op = functools.partial(gdn_api.chunked, **choice)
      chunked = lambda q, k, v, g, beta, s, z: op(q, k, v, g, beta, s)
    if cut is None:
      o, s = jax.vmap(chunked)(q, k, v, g, beta, s_in, z)
    else:
      def masked(a, upto, length):   # gates and betas zero from `upto` [B] on: state kept
        keep = (jnp.arange(length)[None, :] < upto[:, None])[..., None]
        return jnp.where(keep, a, 0.0)
      o, s = jax.vmap(chunked)(q, k, v, masked(g, cuts[:, 0], T), masked(beta, cuts[:, 0], T),
                               s_in, z)
      s_cuts = [s]
      for i, w in enumerate(windows):   # from cut i, to the next cut (or on)
        c = cuts[:, i]
        win = lambda a: jax.vmap(lambda r, c0: lax.dynamic_slice_in_dim(r, c0, w, 0))(a, c)
        g_w, b_w = win(g), win(beta)
        if i + 1 < len(windows):
          g_w, b_w = masked(g_w, cuts[:, i + 1] - c, w), masked(b_w, cuts[:, i + 1] - c, w)
        o_w, s = jax.vmap(chunked)(win(q), win(k), win(v), g_w, b_w, s, win(z))
        o = jax.vmap(lambda r, u, c0: lax.dynamic_update_slice_in_dim(r, u, c0, 0))(o, o_w, c)
        if i + 1 < len(windows):
          s_cuts.append(s)
      s_cut = jnp.stack(s_cuts, axis=1) if many else s_cuts[0]
  s = idle(s, s_in)
  ssm = s if layer is None else lax.dynamic_update_index_in_dim(ssm, s, layer, 0)
  y = _gdn_out(cfg, p, o, z, x, lora_a, lora_b, switch, row_scale, in_op_norm)
  if cut is not None:
    return y, conv_state, ssm, (conv_cut, s_cut)
  return y, conv_state, ssm


def _gdn_out(cfg, p, o, z, x, lora_a, lora_b, switch, row_scale=None, normed=False):
  """The gated norm and the output projection (with the LoRA hook): o [B, T, Hv, Dv] f32,
  or (normed) the gated norm already applied, in x's dtype."""
  B, T, Hv, Dv = o.shape
  if not normed:
    o = gdn_reference.gated_rms_norm(o, z, p.norm, cfg.rms_eps, x.dtype)
  o = o.reshape(B, T, Hv * Dv)
  return out_projection(o, p.out, lora_a, lora_b, switch, cfg.forms.lora_impl, row_scale,
                        cfg.forms.gemv_lora, cfg.forms.proj_finish)
