"""Entry points the model calls for the gated delta rule; picks the implementation.

`chunked` (prefill, one sequence; the model vmaps it) and `chunked_batched` (the same for a
batch) run "reference", "products", "pallas", "pallas_interpret", or the chunk-parallel
kernels "pallas_parallel" (two launches), "pallas_split" (three, fla's split) and their
"_interpret" forms ("auto", the default: "pallas_split" on the GPU, "reference" elsewhere):
see `chunked`. q and k may come with fewer heads than v (grouped, as the model has them):
the chunk-parallel kernels read them in place, the other forms get them repeated. The rest of
this docstring is about the decode step.

`step_raw` (one decode step for a batch, from raw q/k) has three implementations:
  "pallas"            the fused decode kernel compiled for the GPU (Triton lowering; README).
  "pallas_interpret"  the same kernel under the Pallas interpreter (CPU tests).
  "xla"               `reference.delta_rule_step_raw`, plain jnp.
and "auto": on GPU "xla" below `AUTO_PALLAS_MIN_BATCH` batch rows, where the step is
launch-bound and XLA's fusions are cheaper than a Pallas launch, and "pallas" from there on,
where the single pass over the state wins by ~25% (README, "Decode kernel"); "xla" on CPU,
where the interpreter is 10-15x slower than XLA. B is static under jit, so this is still
one program per shape. Default "auto"; the caller's config (`strata_jax.forms.Forms`) names
the choice.

`step_fused` (one decode step from raw q/k/v and the raw gate inputs a, b) adds
"pallas_fused" / "pallas_fused_interpret": `decode_fused_kernel.py`, gates, l2norms and the
delta rule in one launch, the state updated in place and not stored for invalid rows. Any
`step_raw` choice computes the gates in jnp and calls `step_raw`.

`decode_layer` (a GDN layer's decode core from its projections' outputs: the conv, the gates,
the delta rule and the gated norm) adds "pallas_layer" / "pallas_layer_interpret":
`decode_layer_kernel.py`, all of it in one launch. Everywhere else those two choices are
"pallas_fused" / "pallas_fused_interpret" (`fused_form`): a verification's steps, `step_fused`.
Any other choice runs `reference.decode_layer_reference` (jnp; the model itself keeps its own
ops under those choices).

`decode_conv` (the same core without the gated norm: the split sums, the conv, the gates and
the delta rule, the conv state, weights and state read at a layer index in place) adds
"pallas_conv" / "pallas_conv_interpret": `decode_conv_kernel.py`, one launch with the fused
kernel's program per Dv tile; "pallas_fused" / "pallas_fused_interpret" everywhere else, and
`reference.decode_conv_reference` for any other choice.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.backend import check_choice, on_gpu, require_gpu
from pallas_kernels.gdn import chunked as chunked_form
from pallas_kernels.gdn import reference
from pallas_kernels.gdn.chunked_kernel import gdn_chunked_pallas
from pallas_kernels.gdn.decode_conv_kernel import gdn_decode_conv
from pallas_kernels.gdn.decode_fused_kernel import gdn_decode_fused, gdn_decode_fused_steps
from pallas_kernels.gdn.decode_kernel import gdn_decode_pallas
from pallas_kernels.gdn.decode_layer_kernel import gdn_decode_layer
from pallas_kernels.gdn.parallel_kernel import gated_norm_out, gdn_chunked_parallel

IMPLEMENTATIONS = ("pallas", "pallas_interpret", "xla")
CHOICES = (*IMPLEMENTATIONS, "auto")
AUTO_PALLAS_MIN_BATCH = 24  # H200, 32 heads of 128: tie at B = 16, Pallas 24% less time at 24


# The chunk-parallel kernels (`parallel_kernel.py`): name -> state_pass; "_interpret" forms.
PARALLEL = {"pallas_parallel": "fused", "pallas_split": "separate"}
PARALLEL_INTERPRET = {f"{n}_interpret": sp for n, sp in PARALLEL.items()}
CHUNKED_CHOICES = ("reference", "products", "pallas", "pallas_interpret", *PARALLEL,
                   *PARALLEL_INTERPRET, "auto")
FUSED_CHOICES = ("pallas_fused", "pallas_fused_interpret")
# The layer kernel's choices, each with the fused step kernel's form it runs where one step is
# all there is (a verification's steps, `step_fused`).
LAYER_CHOICES = {"pallas_layer": "pallas_fused", "pallas_layer_interpret": "pallas_fused_interpret"}
# The conv kernel's choices (`decode_conv`), likewise.
CONV_CHOICES = {"pallas_conv": "pallas_fused", "pallas_conv_interpret": "pallas_fused_interpret"}


# `Forms.gdn_decode` "auto" on the GPU (`decode_form`): the conv kernel up to this many rows,
# the fused kernel above. Runs 82-83 (H100, bench-a3b bf16, 128-token prompts): the conv
# kernel 1.5 % faster a step at batch 1 and 0.5 % at batch 8 with the adapter on, 1.1 % at
# batch 1 with none (the Engine 1.0 % at batch 1, greedy and sampled). Its extra work (each
# program sums its channels' partials and redoes its k-head's conv) grows with the batch where
# the glue it removes (81 us of weight slices, 86 launches a step) does not; yet at batch 32
# it is 3.3 % faster a step still (run 88, H100, adapter on: 13.68 ms against 14.13 / 14.17).
# Above 32 rows it is untimed, and the fused kernel stays.
CONV_MAX_BATCH = 32


def decode_form(implementation, batch):
  """The `Forms.gdn_decode` choice a decode step of `batch` rows runs: "auto" (None too) is
  "pallas_conv" up to `CONV_MAX_BATCH` rows and "pallas_fused" above on the GPU, "xla"
  elsewhere; any other choice as it is."""
  if implementation not in (None, "auto"):
    return implementation
  if not on_gpu():
    return "xla"
  return "pallas_conv" if batch <= CONV_MAX_BATCH else "pallas_fused"


def fused_form(implementation):
  """The step choice a layer- or conv-kernel choice runs elsewhere ("pallas_layer" ->
  "pallas_fused");
  any other choice as it is."""
  return LAYER_CHOICES.get(implementation, CONV_CHOICES.get(implementation, implementation))


def is_fused(implementation) -> bool:
  """Whether the decode step under this choice is the fused kernel's (alone or in the layer
  kernel): the model hands it the raw gate inputs."""
  return fused_form(implementation) in FUSED_CHOICES
# The Pallas chunked kernels' chunks unless the caller says otherwise. The serial kernel: its
# author's offline sm_90 compile spilled registers at 64 (the per-chunk [C, C] and [C, Dk]
# tiles), and on the H200 it took 1,059 us at 64 against 880 at 32. The chunk-parallel ones:
# 500 us at 64 against 637 at 32 (T = 2,500, 32 heads of 128, bf16 q/k/v;
# experiments/results/device/gdn_probe_run1.json).
PALLAS_CHUNK = 32
PARALLEL_CHUNK = 64


def chunked_implementation(implementation=None):
  """The chunked implementation to run for `implementation` (None: "auto"): "auto" is
  "pallas_split" on the GPU (H200, T = 2,500, 32 heads of 128, bf16 q/k/v: 320.6 us at its
  tuned defaults then, bf16 intermediates and 2 stages (3 since run 71: 331.9 against 363.2
  us on an H100), against 505 us for "pallas_parallel"
  (experiments/results/device/run70), 870 us for the serial "pallas", 2,544 us for "reference"
  and 1,632 us for "products"), "reference" elsewhere. A ValueError for any other name."""
  impl = check_choice("gdn chunked", implementation or "auto", CHUNKED_CHOICES)
  if impl == "auto":
    return "pallas_split" if on_gpu() else "reference"
  if impl == "pallas" or impl in PARALLEL:
    require_gpu("gdn chunked", impl, f"'{impl}_interpret' or 'reference'")
  return impl


def _parallel(impl, q, k, v, g, beta, state, chunk):
  """The chunk-parallel kernel for a batch (impl one of PARALLEL / PARALLEL_INTERPRET)."""
  interpret = impl in PARALLEL_INTERPRET
  sp = (PARALLEL_INTERPRET if interpret else PARALLEL)[impl]
  return gdn_chunked_parallel(q, k, v, g, beta, state, chunk=chunk, interpret=interpret,
                              state_pass=sp, inter_dtype=_inter_dtype(v))


def _inter_dtype(v):
  """16-bit q/k/v: ū, w, u and h kept in that dtype between the launches, as fla keeps them
  (on the H200, 363 against 421 us at T = 2,500; experiments/results/device/run70). fp32
  inputs keep fp32 intermediates (None)."""
  return v.dtype if jnp.dtype(v.dtype).itemsize == 2 else None


def _expand_heads(q, k, v):
  """q, k with v's heads: each of Hk heads repeated H / Hk times on the head axis (-2), v-head
  h <- k-head h // (H / Hk), for the forms that take expanded heads."""
  h, hk = v.shape[-2], q.shape[-2]
  if h == hk:
    return q, k
  if h % hk:
    raise ValueError(f"gdn chunked: v has {h} heads, not a multiple of q's {hk} "
                     f"(q {q.shape}, v {v.shape})")
  return jnp.repeat(q, h // hk, axis=-2), jnp.repeat(k, h // hk, axis=-2)


def pallas_chunk_for(impl, pallas_chunk=None) -> int:
  """The chunk a Pallas form runs: `pallas_chunk`, or (None / "auto", `Forms.gdn_pallas_chunk`'s
  default) the kernel's own."""
  if pallas_chunk not in (None, "auto"):
    return pallas_chunk
  return PARALLEL_CHUNK if impl in PARALLEL or impl in PARALLEL_INTERPRET else PALLAS_CHUNK


def chunked(q, k, v, g, beta, state, *, chunk: int = 64, implementation=None,
            pallas_chunk: int | str | None = None):
  """Prefill form for one sequence. Shapes as in `reference` (no batch dim):
  q, k [T, H, Dk]; v [T, H, Dv]; g, beta [T, H]; state [H, Dv, Dk] -> (o [T, H, Dv], state).
  q and k may also be [T, Hk, Dk] with Hk dividing H (v-head h <- k-head h // (H / Hk)).

  "reference": the oracle (triangular solve, HIGHEST precision everywhere); "products":
  `chunked.py` (UT inverse by matrix products, JAX's default matmul precision); "pallas" /
  "pallas_interpret": `chunked_kernel.py` compiled for the GPU / under the interpreter (CPU);
  "pallas_parallel" / "pallas_split" (+ "_interpret"): `parallel_kernel.py`, the intra-chunk
  work parallel over chunks, then the state pass (fused with the outputs, or separate).
  Default "auto" (`chunked_implementation`); every Pallas form runs chunks of
  min(chunk, pallas_chunk), pallas_chunk None or "auto" meaning the kernel's default
  (`pallas_chunk_for`).

  The Pallas forms add a batch dim of 1 and launch the batched kernel. Under `jax.vmap` (how
  the model calls this) Pallas's batching rule folds the vmapped axis into the kernel's grid,
  so `jax.vmap(chunked)` is still one launch over the whole batch; `chunked_batched` is the
  same launch without the vmap."""
  impl = chunked_implementation(implementation)
  pallas_chunk = pallas_chunk_for(impl, pallas_chunk)
  if impl in PARALLEL or impl in PARALLEL_INTERPRET:
    o, s = _parallel(impl, q[None], k[None], v[None], g[None], beta[None], state[None],
                     min(chunk, pallas_chunk))
    return o[0], s[0]
  q, k = _expand_heads(q, k, v)
  if impl in ("pallas", "pallas_interpret"):
    o, s = gdn_chunked_pallas(q[None], k[None], v[None], g[None], beta[None], state[None],
                              chunk=min(chunk, pallas_chunk), interpret=impl == "pallas_interpret")
    return o[0], s[0]
  if impl == "products":
    return chunked_form.delta_rule_chunked(q, k, v, g, beta, state, chunk=chunk)
  return reference.delta_rule_chunked(q, k, v, g, beta, state, chunk=chunk)


def chunked_batched(q, k, v, g, beta, state, *, chunk: int = 64, implementation=None,
                    pallas_chunk: int | str | None = None):
  """Prefill form for a batch: q, k [B, T, H, Dk]; v [B, T, H, Dv]; g, beta [B, T, H];
  state [B, H, Dv, Dk] -> (o [B, T, H, Dv] float32, state [B, H, Dv, Dk] float32).

  Implementations as `chunked` (q, k may have fewer heads there too): the Pallas forms call
  the batched kernel directly (grid B x H x Dv tiles), the jnp forms are vmapped over B."""
  impl = chunked_implementation(implementation)
  pallas_chunk = pallas_chunk_for(impl, pallas_chunk)
  if impl in PARALLEL or impl in PARALLEL_INTERPRET:
    return _parallel(impl, q, k, v, g, beta, state, min(chunk, pallas_chunk))
  q, k = _expand_heads(q, k, v)
  if impl in ("pallas", "pallas_interpret"):
    return gdn_chunked_pallas(q, k, v, g, beta, state, chunk=min(chunk, pallas_chunk),
                              interpret=impl == "pallas_interpret")
  one = lambda *a: chunked(*a, chunk=chunk, implementation=impl, pallas_chunk=pallas_chunk)
  return jax.vmap(one)(q, k, v, g, beta, state)


def chunked_gated(q, k, v, g, beta, state, z, norm_w, *, eps: float, out_dtype,
                  chunk: int = 64, implementation=None, pallas_chunk: int | str | None = None):
  """`chunked` followed by the layer's gated norm (`reference.gated_rms_norm(o, z, norm_w,
  eps, out_dtype)`): one sequence, z [T, H, Dv], norm_w [Dv] -> (y [T, H, Dv] in out_dtype,
  state). Under "pallas_split" (+ "_interpret") the norm runs in the op's output launch
  (`parallel_kernel.gated_norm_out`: the fp32 o is never written; equal to the norm after
  the op to its fp32 rounding); every other form runs `chunked`, then the norm in jnp."""
  impl = chunked_implementation(implementation)
  pallas_chunk = pallas_chunk_for(impl, pallas_chunk)
  if PARALLEL.get(impl, PARALLEL_INTERPRET.get(impl)) == "separate":
    y, s = gated_norm_out(q[None], k[None], v[None], g[None], beta[None], state[None], z[None],
                          norm_w, eps=eps, out_dtype=out_dtype,
                          chunk=min(chunk, pallas_chunk), interpret=impl in PARALLEL_INTERPRET,
                          inter_dtype=_inter_dtype(v))
    return y[0], s[0]
  o, s = chunked(q, k, v, g, beta, state, chunk=chunk, implementation=impl,
                 pallas_chunk=pallas_chunk)
  return reference.gated_rms_norm(o, z, norm_w, eps, out_dtype), s


def step(q, k, v, g, beta, state):
  """Decode form: one token for every head of one sequence."""
  return reference.delta_rule_step(q, k, v, g, beta, state)


def resolve(implementation, batch):
  """The concrete implementation `step_raw` runs for this choice (None: "auto") and batch.
  The fused choices (`FUSED_CHOICES`) need the raw gates, which `step_raw` does not get:
  there they resolve as "auto" (a caller holding only g and beta, e.g. a token-by-token
  verification scan, still runs under forms that name the fused kernel)."""
  if is_fused(implementation):
    implementation = "auto"
  impl = check_choice("gdn", implementation or "auto", CHOICES)
  if impl == "auto":
    return "pallas" if on_gpu() and batch >= AUTO_PALLAS_MIN_BATCH else "xla"
  return impl


def step_raw(q, k, v, g, beta, state, *, implementation=None, layer=None, valid=None):
  """Decode form for a batch from raw (not yet normalised) q/k: l2norm, head expansion and
  the delta rule step in one. Contract as `reference.delta_rule_step_raw`:
  q, k [B, Hk, Dk]; v [B, Hv, Dv]; g, beta [B, Hv]; state [B, Hv, Dv, Dk] float32
  -> (o [B, Hv, Dv] float32, new state [B, Hv, Dv, Dk] float32). The Pallas forms update
  the state in place when the caller donates it.

  With `layer` (an int32 scalar, may be traced), `state` is the stack [L, B, Hv, Dv, Dk] of
  every layer's state; layer `layer` is updated and the whole stack returned, rows whose
  `valid` [B] is 0 left as they were, bit for bit. The Pallas forms read and write that layer
  in place (`in_place`); the jnp form slices, selects and updates it."""
  impl = resolve(implementation, q.shape[0])
  if impl in ("pallas", "pallas_interpret"):
    if impl == "pallas":
      require_gpu("gdn", impl, "'pallas_interpret' or 'xla'")
    return gdn_decode_pallas(q, k, v, g, beta, state, layer, valid,
                             interpret=impl == "pallas_interpret")
  if layer is None:
    return reference.delta_rule_step_raw(q, k, v, g, beta, state)
  old = state[layer]
  o, s = reference.delta_rule_step_raw(q, k, v, g, beta, old)
  if valid is not None:
    s = jnp.where((valid != 0).reshape((-1,) + (1,) * (s.ndim - 1)), s, old)
  return o, state.at[layer].set(s)


def in_place(implementation, batch) -> bool:
  """Whether the decode step under this choice (None: "auto") and batch updates a layer of a
  stacked state in place (a Pallas kernel with the state aliased): a layer scan can then carry
  the stack. The jnp forms cannot: XLA keeps the old stack alive with a copy per layer."""
  if is_fused(implementation):
    return True
  return resolve(implementation, batch) in ("pallas", "pallas_interpret")


def step_fused(q, k, v, a, b, a_coef, dt_bias, state, valid=None, layer=None, *,
               implementation=None):
  """Decode step for a batch from raw q/k/v and raw gate inputs. Contract as
  `reference.delta_rule_step_fused`: q, k [B, Hk, Dk]; v [B, Hv, Dv]; a, b [B, Hv];
  a_coef, dt_bias [Hv]; state [B, Hv, Dv, Dk] float32; valid [B] or None -> (o [B, Hv, Dv],
  new state), float32. Rows with valid == 0 keep their state.

  With `layer` (an int32 scalar, may be traced), `state` is the stack [L, B, Hv, Dv, Dk] of
  every layer's state and the step updates layer `layer` of it, returning the whole stack:
  the fused kernel reads and writes that layer in place (carry the stack through a layer
  scan and donate it: no per-layer slice or restack); the jnp forms slice and update it.

  "pallas_fused" / "pallas_fused_interpret": `decode_fused_kernel.py`, one launch (state
  aliased: in place when donated; invalid rows are not stored). Any `step_raw` choice
  (None: "auto"): the gates and mask in jnp, then `step_raw` with that choice."""
  implementation = fused_form(implementation)
  if implementation in FUSED_CHOICES:
    if implementation == "pallas_fused":
      require_gpu("gdn", implementation, "'pallas_fused_interpret' or 'xla'")
    return gdn_decode_fused(q, k, v, a, b, a_coef, dt_bias, state, valid, layer,
                            interpret=implementation == "pallas_fused_interpret")
  g, beta = reference.gates(a, b, a_coef, dt_bias)
  if valid is not None:
    ok = (valid != 0)[:, None]
    g, beta = jnp.where(ok, g, 0.0), jnp.where(ok, beta, 0.0)
  if layer is None:
    return step_raw(q, k, v, g, beta, state, implementation=implementation)
  o, s = step_raw(q, k, v, g, beta, state[layer], implementation=implementation)
  return o, state.at[layer].set(s)


def steps_fused(q, k, v, a, b, a_coef, dt_bias, state, valid=None, *, implementation=None):
  """T decode steps from raw inputs with every step's state kept (a speculative
  verification's GDN layer). Contract as `reference.delta_rule_steps_fused`: q, k
  [B, T, Hk, Dk]; v [B, T, Hv, Dv]; a, b [B, T, Hv]; state [B, Hv, Dv, Dk]; valid [B, T] or
  None -> (o [B, T, Hv, Dv], steps [B, T, Hv, Dv, Dk]), float32.

  "pallas_fused" / "pallas_fused_interpret": one launch (`gdn_decode_fused_steps`), each step
  rounding as `step_fused`'s kernel does. Any other choice: a scan of `step_fused` steps."""
  implementation = fused_form(implementation)
  if implementation in FUSED_CHOICES:
    if implementation == "pallas_fused":
      require_gpu("gdn", implementation, "'pallas_fused_interpret' or 'xla'")
    return gdn_decode_fused_steps(q, k, v, a, b, a_coef, dt_bias, state, valid,
                                  interpret=implementation == "pallas_fused_interpret")
  one = lambda *args: step_fused(*args, implementation=implementation)
  return reference.delta_rule_steps_fused(q, k, v, a, b, a_coef, dt_bias, state, valid,
                                          step=one)


def decode_layer(x, conv_state, conv_w, z, ba, a_coef, dt_bias, norm_w, state, valid, layer, *,
                 n_k_heads, eps, out_dtype=None, implementation=None):
  """A GDN layer's decode core from its projections' outputs. Contract as
  `reference.decode_layer_reference`: x [B, C] (qkv), conv_state [B, K-1, C], conv_w [C, K],
  z [B, Hv, Dv], ba [B, 2 Hv], a_coef / dt_bias [Hv], norm_w [Dv], state the [L, B, Hv, Dv,
  Dk] stack with layer `layer` updated, valid [B] -> (y [B, Hv, Dv] in out_dtype (None: x's),
  the new conv state, the state stack). Rows with valid == 0 keep both states.

  "pallas_layer" / "pallas_layer_interpret": `decode_layer_kernel.gdn_decode_layer`, one
  launch, the state stack aliased (in place when donated). Any other choice: the reference."""
  kw = dict(n_k_heads=n_k_heads, eps=eps, out_dtype=out_dtype)
  if implementation in LAYER_CHOICES:
    if implementation == "pallas_layer":
      require_gpu("gdn", implementation, "'pallas_layer_interpret' or 'xla'")
    return gdn_decode_layer(x, conv_state, conv_w, z, ba, a_coef, dt_bias, norm_w, state, valid,
                            layer, interpret=implementation == "pallas_layer_interpret", **kw)
  return reference.decode_layer_reference(x, conv_state, conv_w, z, ba, a_coef, dt_bias, norm_w,
                                          state, valid, layer, **kw)


def decode_conv(qkv, ba, conv_state, conv_w, a_coef, dt_bias, state, valid, layer,
                conv_layer=None, weight_layer=None, *, n_k_heads, x_dtype=None,
                implementation=None):
  """A GDN layer's decode step from its projections' outputs, the gated norm excepted.
  Contract as `reference.decode_conv_reference`: qkv [B, C] or its partials [S, B, C], ba
  [B, 2 Hv] or [S, B, 2 Hv], conv_state [B, K-1, C] or a stack read at `conv_layer`, conv_w
  [C, K] / a_coef, dt_bias [Hv] or stacks read at `weight_layer` (None: `layer`), state the
  [L, B, Hv, Dv, Dk] stack -> (o [B, Hv, Dv] fp32, conv state, state stack). Rows with
  valid == 0 keep both states.

  "pallas_conv" / "pallas_conv_interpret": `decode_conv_kernel.gdn_decode_conv`, one launch,
  the state (and a stacked conv state) aliased, in place when donated. Any other choice: the
  reference."""
  kw = dict(n_k_heads=n_k_heads, x_dtype=x_dtype)
  args = (qkv, ba, conv_state, conv_w, a_coef, dt_bias, state, valid, layer, conv_layer,
          weight_layer)
  if implementation in CONV_CHOICES:
    if implementation == "pallas_conv":
      require_gpu("gdn", implementation, "'pallas_conv_interpret' or 'xla'")
    return gdn_decode_conv(*args, interpret=implementation == "pallas_conv_interpret", **kw)
  return reference.decode_conv_reference(*args, **kw)
