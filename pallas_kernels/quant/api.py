"""Matmuls over quantised weights: the entry points model code calls.

Implementations (one contract, one parametrized test suite):
  "pallas"            the Pallas kernel (kernel.py) compiled for the GPU (Triton lowering).
  "pallas_interpret"  the same kernel under the Pallas interpreter (CPU tests).
  "xla"               dequantise the selected matrix to the compute dtype, then one XLA dot
                      with fp32 accumulation (the kernel's numerics; a dense weight per call).
And "auto": "pallas" on GPU, "xla" elsewhere. Every choice is an argument; nothing is read
from the environment.

Compute dtype: x's for 16-bit x (weights rounded to it after an exact fp32 dequantisation,
fp32 accumulation); fp32 x: fp32 weights and precision HIGHEST unless `precision` is given.
"""
import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import argsort_ids, sum_partials
from pallas_kernels.attention.reference import rms_norm
from pallas_kernels.lora.kernel import dot_policy
from pallas_kernels.quant import dense_dot, finish, gemv
from pallas_kernels.quant.gemv import DENSE_UNIT, dense_call, triton_params
from pallas_kernels.quant.kernel import (
    ROWS_MAX,
    MultiMat,
    epilogue_outside,
    groups_tiling,
    qmatmul_groups_lora_rows,
    qmatmul_groups_pallas,
    qmatmul_lora_rows,
    qmatmul_multi_pallas,
    qmatmul_pallas,
)
from pallas_kernels.quant.layout import BLOCK, QTensor, flat
from pallas_kernels.quant.reference import dequantize, select_matrix

IMPLEMENTATIONS = ("pallas", "pallas_interpret", "xla")
CHOICES = (*IMPLEMENTATIONS, "auto")
LORA_DOWN = ("h", "a")  # x @ A^T once outside the kernel, or inside every program
_F32 = jnp.float32
_HI = lax.Precision.HIGHEST
_NT = (((1,), (1,)), ((), ()))
_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def resolve(implementation="auto"):
  """The concrete implementation for this choice on this backend."""
  if implementation == "auto":
    return "pallas" if jax.default_backend() == "gpu" else "xla"
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"quant: unknown implementation {implementation!r}; expected one of "
                     f"{CHOICES}")
  if implementation == "pallas" and jax.default_backend() != "gpu":
    raise ValueError(f"quant: implementation 'pallas' needs a GPU backend, not "
                     f"{jax.default_backend()!r}; use 'pallas_interpret' or 'xla'")
  return implementation


def _compute(x_dtype, precision):
  """(operand dtype, precision) of the weight product for activations of `x_dtype`."""
  if jnp.dtype(x_dtype) in _HALF:
    return jnp.dtype(x_dtype), lax.Precision.DEFAULT
  return jnp.dtype(_F32), precision or _HI


def _check(x, w, index, group=None):
  if isinstance(w, tuple):  # a mixed-type stack: one QTensor per type
    if not w or group is None:
      raise ValueError("quant: a mixed-type stack (a tuple of QTensors) needs at least one "
                       "part and group= (the part holding the matrix)")
    for part in w:
      _check(x, part, index)
    return
  if not isinstance(w, QTensor):
    raise ValueError(f"quant: w must be a QTensor, got {type(w).__name__}")
  if x.ndim != 2 or x.shape[1] != w.shape[-1]:
    raise ValueError(f"quant: x {x.shape} must be [N, in] with in = {w.shape[-1]} "
                     f"(w {w.qtype} {w.shape})")
  if w.lead and index is None:
    raise ValueError(f"quant: w {w.shape} is stacked; pass index (flat over the leading dims)")


def _each_part(group, parts, fn, impl):
  """fn(part) for the part `group` picks, where one launch cannot serve a mixed-type stack
  (XLA, many rows, a tiling or form asked for): with the kernels, every part's call gated by
  its "active" flag and a select (an XLA conditional is a host round trip on the GPU); with
  XLA, a conditional (it would compute every part's product)."""
  group = jnp.asarray(group, jnp.int32)
  if impl == "xla":
    return lax.switch(group, [lambda p=p: fn(p) for p in parts])
  ys = [fn(p, active=(group == i).astype(jnp.int32)) for i, p in enumerate(parts)]
  out = ys[-1]
  for i in range(len(ys) - 2, -1, -1):
    out = jnp.where(group == i, ys[i], out)
  return out


def _one_launch(parts, n, d_out, d_in, impl, tiles, groups=1):
  """Whether a mixed-type stack's call is one "blocks" launch (`qmatmul_groups_pallas`)."""
  return (impl != "xla" and n <= ROWS_MAX and not tiles and groups_tiling(
      tuple(p.qtype for p in parts), d_out, d_in, groups=groups,
      interpret=impl != "pallas") is not None)


def _index(w, index):
  return jnp.reshape(jnp.asarray(0 if index is None else index, jnp.int32), (1,))


def _xla_acc(x, w, index, precision):
  """fp32 [N, out] = x @ W^T as the kernel computes it (dense weight of the compute dtype)."""
  cd, prec = _compute(x.dtype, precision)
  wd = dequantize(select_matrix(w, 0 if index is None else index), _F32).astype(cd)
  return lax.dot_general(x.astype(cd), wd, _NT, precision=prec, preferred_element_type=_F32)


def _kernel_kw(impl, tiles):
  return dict(interpret=impl == "pallas_interpret", **(tiles or {}))


def qmatmul(x, w, *, index=None, implementation="auto", precision=None, tiles=None,
            active=None, group=None):
  """y = x @ W^T, fp32 accumulation, y in x.dtype.

  Args:
    x: [N, in] activations (float32 / bfloat16 / float16).
    w: QTensor of logical shape [..., out, in].
    index: int32 scalar (traced OK) choosing the matrix of the flattened leading dims (e.g.
      layer, or layer * E + expert); the kernel reads the stack in place. Required iff w is
      stacked.
    implementation: one of CHOICES.
    precision: of the product for fp32 x (None: HIGHEST).
    tiles: optional kernel options {form, block_rows, block_out, block_in, num_warps,
      num_stages, k_split} (kernel.qmatmul_pallas).
    active: None, or an int32 scalar (traced): 0 leaves the result unspecified and, in the
      kernels, costs one launch whose programs return at once (one call per type of a
      mixed-type stack, the caller selecting; "xla" computes regardless).
    group: with `w` a tuple of QTensors (a mixed-type stack, one stack per type), the int32
      part holding the matrix (traced OK); `index` is then its index in that part. A few
      rows run every part's "blocks" program in one launch, a flag picking the part;
      otherwise each part's call gated by its flag and a select (XLA: a conditional).
      Either way, that part's own numbers.

  Returns:
    [N, out] in x.dtype.
  """
  _check(x, w, index, group)
  impl = resolve(implementation)
  if isinstance(w, tuple):
    n, d_in = x.shape
    if _one_launch(w, n, w[0].shape[-2], d_in, impl, tiles):
      return qmatmul_groups_pallas(
          x[None], tuple(flat(p) for p in w), group, _index(w[0], index),
          qtypes=tuple(p.qtype for p in w), d_out=w[0].shape[-2],
          interpret=impl == "pallas_interpret")[0]
    return _each_part(group, w, lambda p, **kw: qmatmul(
        x, p, index=index, implementation=implementation, precision=precision, tiles=tiles,
        **kw), impl)
  if impl == "xla":
    return _xla_acc(x, w, index, precision).astype(x.dtype)
  y = qmatmul_pallas(x[None], flat(w), _index(w, index), qtype=w.qtype, d_out=w.shape[-2],
                     precision=precision, active=active, **_kernel_kw(impl, tiles))
  return y[0]


def qmatmul_multi(x, mats, *, implementation="auto"):
  """[qmatmul(x, w, index=i, group=g, implementation=...) for w, i, g in mats]: a layer's
  products of one input (GDN qkv / gate / ba, attention q / k / v, the shared expert's gate
  and up) over quantised stacks. Where the few-row kernel takes every one (the "blocks" form,
  a mixed-type stack in its one launch), all run in one launch (`qmatmul_multi_pallas`), each
  result its own call's bit for bit; otherwise one call each. On the H200 the 80B's batch-1
  projections are launch-bound: 2.5-12 us a launch for 0.5-17 MB (run 49's profile)."""
  impl = resolve(implementation)
  n, d_in = x.shape
  for w, i, g in mats:
    _check(x, w, i, g)

  def in_launch(w):
    if isinstance(w, tuple):
      return _one_launch(w, n, w[0].shape[-2], d_in, impl, None)
    return impl != "xla" and n <= ROWS_MAX

  if len(mats) < 2 or not all(in_launch(w) for w, _, _ in mats):
    return [qmatmul(x, w, index=i, implementation=implementation, group=g)
            for w, i, g in mats]
  specs = []
  for w, i, g in mats:
    if isinstance(w, tuple):
      specs.append(MultiMat(tuple(p.qtype for p in w), tuple(flat(p) for p in w),
                            _index(w[0], i), w[0].shape[-2], g))
    else:
      specs.append(MultiMat(w.qtype, flat(w), _index(w, i), w.shape[-2]))
  return qmatmul_multi_pallas(x, specs, interpret=impl == "pallas_interpret")


def _stack3(a):
  """[..., rows, cols] -> [S, rows, cols], the leading dims flattened (a free reshape)."""
  return a.reshape(-1, *a.shape[-2:])


# XLA's dot merger joins products of one input into a GEMM over the weights concatenated,
# which copies every weight on every call: in bench-a3b's 2,500-token prefill, [12288, 2048]
# per GDN layer and [9216, 2048] per attention layer (`wrapped_concatenate`, about 2 ms on the
# H100, experiments/results/device/run74). `apart` hands each product its own name for the
# input, so nothing merges. False: merged as before (decode_probe's "merged").
SEPARATE_DOTS = True


def apart(x, n: int):
  """n names for x that XLA's dot merger cannot see as one operand (an optimization barrier:
  no copy, no change to any value), or [x] * n with SEPARATE_DOTS off."""
  if n < 2 or not SEPARATE_DOTS:
    return [x] * n
  return list(lax.optimization_barrier(tuple(x for _ in range(n))))


def dense_reference(x, stack, index):
  """x [N, in] @ stack[index]^T, the XLA path of `dense_matmul`: the matrix taken at the
  (traced) index, one dot returning x's dtype (fp32 accumulation), as the model's `linear`."""
  w = lax.dynamic_index_in_dim(_stack3(stack), index, 0, False)
  return lax.dot_general(x, w.astype(x.dtype), _NT, preferred_element_type=x.dtype)


# The kernel's rows for a plain float stack: on the H200 it beat XLA's slice and dot at batch 1
# (bench-a3b bf16 decode 5.17 against 5.75 ms a step) and lost at batch 4 (8.53 against 8.08;
# experiments/results/device/decode_probe_dgemv_run1.json).
DENSE_ROWS_MAX = 1


def dense_kernel_rows(n, d_in, implementation="auto", rows_max=None):
  """Whether `dense_matmul` runs the in-place kernel for n rows of width d_in."""
  rows_max = min(ROWS_MAX, DENSE_ROWS_MAX if rows_max is None else rows_max)
  return resolve(implementation) != "xla" and 0 < n <= rows_max and d_in % DENSE_UNIT == 0


# How 2 to `dense_dot.ROWS_MAX` rows of a 16-bit weight stack are multiplied (`few`,
# `Forms.dense_few`): "dot" = the tensor-core tiles of dense_dot.py reading the matrix in
# place; "xla" = `dense_reference` (XLA copies the matrix out of the stack, then dots).
FEW = ("dot", "xla")


def dense_dot_rows(n, x_dtype, stack_dtype, implementation="auto", few="dot", min_rows=2):
  """Whether `dense_matmul` runs the in-place tensor-core kernel for n rows (min_rows, past
  what the GEMV takes, to dense_dot.ROWS_MAX; x and the stack of one 16-bit dtype)."""
  if few not in FEW:
    raise ValueError(f"dense matmul: few={few!r}; expected one of {FEW}")
  return (few == "dot" and resolve(implementation) != "xla"
          and min_rows <= n <= dense_dot.ROWS_MAX
          and jnp.dtype(x_dtype) == jnp.dtype(stack_dtype)
          and jnp.dtype(x_dtype) in dense_dot.HALF)


def _kernel_params(impl, tiles):
  """(tile kwargs, Triton compiler params or None) from `tiles`'s {..., num_warps,
  num_stages} for the resolved implementation."""
  tk = dict(tiles or {})
  warps, stages = tk.pop("num_warps", None), tk.pop("num_stages", None)
  return tk, triton_params(warps, stages) if impl == "pallas" else None


def dense_matmul_glu(g, u, stack, index, *, implementation="auto", few="dot"):
  """`dense_matmul(gemv.glu_product(g, u), stack, index)`, a SiLU-GLU's down projection of
  its gate g and up u [N, in] (`Forms.shared_glu` "in_down"): where the in-place GEMV takes
  the rows, its programs make silu(g) * u as they load x (no XLA kernel makes the hidden row
  first); otherwise the hidden row is made in XLA and multiplied as `dense_matmul` does. The
  same numbers either way, bit for bit where the kernel's silu rounds as XLA's."""
  if g.shape != u.shape:
    raise ValueError(f"dense matmul glu: gate {g.shape} and up {u.shape} must match")
  if dense_kernel_rows(*g.shape, implementation):
    return _dense_kernel(g, stack, index, resolve(implementation), None, up=u)
  return dense_matmul(gemv.glu_product(g, u), stack, index, implementation=implementation,
                      few=few)


def dense_matmul(x, stack, index, *, implementation="auto", tiles=None, rows_max=None,
                 few="dot"):
  """y = x @ stack[index]^T for a plain float weight stack [..., out, in] (leading dims
  flattened; `index` int32, traced OK) and a few rows x [N, in], in x's dtype.

  With the kernels (N <= rows_max, default DENSE_ROWS_MAX, at most ROWS_MAX; `in` a multiple
  of 32) the "blocks" GEMV of gemv.py reads matrix `index` in place (no slice copy); from
  there to dense_dot.ROWS_MAX rows of a 16-bit x and stack (`few` "dot"), dense_dot.py's
  tensor-core tiles read it in place; otherwise, and with "xla", `dense_reference`.
  The kernels' sums are fp32 over products of the weights and x rounded to the compute dtype
  (x's if 16-bit, else fp32): the reference's numbers to summation order.
  tiles: optional {block_out, block_in, k_split, num_warps, num_stages}.
  """
  if dense_kernel_rows(*x.shape, implementation, rows_max):
    return _dense_kernel(x, stack, index, resolve(implementation), tiles)
  if dense_dot_rows(x.shape[0], x.dtype, stack.dtype, implementation, few):
    impl = resolve(implementation)
    tk, params = _kernel_params(impl, tiles)
    return dense_dot.dense_dot_call(x, _stack3(stack), index, compiler_params=params,
                                    interpret=impl == "pallas_interpret", **tk)
  return dense_reference(x, stack, index)


def dense_matmul_parts(x, stack, index, *, implementation="auto", few="dot", tiles=None):
  """`dense_matmul`'s product of an fp32 x as split partial sums [S, N, out] fp32, for a
  consumer kernel that adds them (the router's: `moe.topk.route_pallas`): the GEMV's own
  partials where it takes the rows (S its k_split), else the whole product (S = 1).
  `gemv.sum_partials` of them is `dense_matmul`'s result bit for bit. tiles: as
  `dense_matmul`'s."""
  if x.dtype != jnp.float32:
    raise ValueError(f"dense matmul parts: x must be float32 (got {x.dtype}): the partials "
                     "of a 16-bit x would round where its sum rounds once")
  if dense_kernel_rows(*x.shape, implementation):
    return _dense_kernel(x, stack, index, resolve(implementation), tiles, partials=True)
  return dense_matmul(x, stack, index, implementation=implementation, few=few,
                      tiles=tiles)[None]


def dense_matmul_multi(x, stacks, index, *, implementation="auto", few="dot", partials=False,
                       norm=None, x_dtypes=None, normed_out=False):
  """[dense_matmul(x, s, index, ...) for s in stacks], the stacks sharing `in` (a layer's
  projections of one input): where one kernel form takes the rows for every stack (the GEMV's
  one row; dense_dot's 2 to 64 rows of one 16-bit dtype), all the products run in one launch
  (`multi.py`), each result `dense_matmul`'s bit for bit; otherwise one call each.
  partials: each product as its split partial sums [S, N, out] (fp32 when the launch split
  it; else S = 1 in x's dtype): `gemv.sum_partials` of them, cast to x's dtype, is the
  product above bit for bit.
  norm: (w [in], eps): the products are of rms_norm(x, w, eps), x the raw residual. The
  GEMV's launch makes the norm in its programs (`gemv.dense_multi_call`); every other form
  takes the reference's norm first (`norm_launch_rows` says which). With norm: x_dtypes, per
  stack the dtype its product's x has (the normed rows converted, as the router's fp32), and
  normed_out, the normed rows [N, in] returned after the products."""
  n, d_in = x.shape
  impl = resolve(implementation)
  stacks = [_stack3(s) for s in stacks]
  interpret = impl == "pallas_interpret"
  params = triton_params() if impl == "pallas" else None
  if norm_launch_rows(len(stacks), n, d_in, implementation):
    idx = jnp.reshape(jnp.asarray(index, jnp.int32), (1,))
    return gemv.dense_multi_call(x, stacks, idx, interpret=interpret, compiler_params=params,
                                 partials=partials, norm=norm, x_dtypes=x_dtypes,
                                 normed_out=normed_out)
  if norm is None and (x_dtypes is not None or normed_out):
    raise ValueError("dense matmul multi: x_dtypes and normed_out need a norm")
  if norm is not None:
    x = rms_norm(x, *norm)
    extra = [x] if normed_out else []
    if x_dtypes is not None and any(jnp.dtype(d) != x.dtype for d in x_dtypes):
      ys = [dense_matmul(x.astype(d), s, index, implementation=implementation, few=few)
            for d, s in zip(x_dtypes, stacks)]
      return [y[None] for y in ys] + extra if partials else ys + extra
    return dense_matmul_multi(x, stacks, index, implementation=implementation, few=few,
                              partials=partials) + extra
  if len(stacks) > 1 and all(dense_dot_rows(n, x.dtype, s.dtype, implementation, few)
                             for s in stacks):
    return dense_dot.dense_dot_multi_call(x, stacks, index, interpret=interpret,
                                          compiler_params=params, partials=partials)
  ys = [dense_matmul(xi, s, index, implementation=implementation, few=few)
        for xi, s in zip(apart(x, len(stacks)), stacks)]
  return [y[None] for y in ys] if partials else ys


def norm_launch_rows(n_stacks, n, d_in, implementation="auto"):
  """Whether `dense_matmul_multi` runs the GEMV's one launch over the stacks (one row, several
  stacks), and so makes a `norm=` inside it, not in XLA before it."""
  return n_stacks > 1 and dense_kernel_rows(n, d_in, implementation)


def _dense_kernel(x, stack, index, impl, tiles, partials=False, up=None):
  """The in-place GEMV of one group: y [N, out], or its split partial sums [S, N, out]; with
  `up`, of the GLU row `gemv.glu_product(x, up)`, made in the kernel."""
  tk, params = _kernel_params(impl, tiles)
  idx = jnp.reshape(jnp.asarray(index, jnp.int32), (1,))
  y = dense_call(x[None], _stack3(stack), idx, interpret=impl == "pallas_interpret",
                 compiler_params=params, partials=partials,
                 up=None if up is None else up[None], **tk)
  return y[:, 0] if partials else y[0]


def _lora_pair(a, b, lora_index):
  """(A [R, in], B [out, R]) of one adapter pair, or of the stacks [..., R, in] / [..., out, R]
  at `lora_index` (taken by XLA)."""
  if lora_index is None:
    return a, b
  take = lambda s: lax.dynamic_index_in_dim(_stack3(s), lora_index, 0, False)
  return take(a), take(b)


def dense_lora_reference(x, stack, index, a, b, on, *, rank_scale=None, lora_index=None):
  """`dense_matmul_lora` in XLA: the base product's fp32 sum plus B (A x) on the on rows,
  rounded once; off rows are `dense_reference`'s."""
  a, b = _lora_pair(a, b, lora_index)
  w = lax.dynamic_index_in_dim(_stack3(stack), index, 0, False)
  acc = lax.dot_general(x, w.astype(x.dtype), _NT, preferred_element_type=_F32)
  h = _lora_h(x, a, rank_scale)
  delta = lax.dot_general(h, b.astype(_F32), _NT, precision=_HI, preferred_element_type=_F32)
  return jnp.where((on != 0)[:, None], (acc + delta).astype(x.dtype),
                   dense_reference(x, stack, index))


def dense_lora_form(n, d_in, x_dtype, stack_dtype, implementation="auto", few="dot",
                    one_row="gemv", rows_max=None):
  """Which kernel `dense_matmul_lora` runs for n rows: "gemv" (one row, `one_row` "gemv";
  `rows_max` as `dense_matmul`), "dot" (the tensor-core tiles: 2 to dense_dot.ROWS_MAX rows,
  from one row under `one_row` "dot"; `few` "dot", 16-bit x and stack), or None (XLA)."""
  if one_row == "gemv" and dense_kernel_rows(n, d_in, implementation, rows_max):
    return "gemv"
  if dense_dot_rows(n, x_dtype, stack_dtype, implementation, few,
                    min_rows=1 if one_row == "dot" else 2):
    return "dot"
  return None


def dense_matmul_lora(x, stack, index, a, b, on, *, rank_scale=None, lora_index=None,
                      implementation="auto", tiles=None, rows_max=None, few="dot",
                      one_row="gemv"):
  """y = x @ stack[index]^T + where(on, B (A x)) per row, for the rows `dense_matmul`'s
  kernels take (`dense_lora_form`; more rows: `dense_lora_reference`).

  From 2 rows (1 under `one_row` "dot") to dense_dot.ROWS_MAX of a 16-bit x and stack (`few`
  "dot"), the tensor-core kernel (`dense_dot.dense_dot_call(lora=...)`) does it in one
  launch: each program adds B times its own share's h = A x to its output tile.

  a: [R, in] and b: [out, R]; or, with `lora_index` (int32, traced OK), stacks [..., R, in]
  and [..., out, R] whose pair `lora_index` is read in place, as the weight. The GEMV
  computes h = A x as R more rows of its launch (`gemv.dense_lora_rows`), then one finishing
  kernel (`gemv.lora_finish`) sums the split partials, adds B h (h times rank_scale [N, R]
  when given) on the rows whose switch is on and rounds once: a decode step's adapted
  projection is two launches, with no slice of A or B copied. Rows with on == 0 are
  `dense_matmul`'s bit for bit. on: [N] int32 / bool; tiles ({block_out, block_in, k_split,
  finish_block, num_warps, num_stages}), rows_max: as `dense_matmul`."""
  parts, lora = dense_matmul_lora_split(x, stack, index, a, b, on, rank_scale=rank_scale,
                                        lora_index=lora_index, implementation=implementation,
                                        tiles=tiles, rows_max=rows_max, few=few,
                                        one_row=one_row)
  if lora is not None:   # the GEMV's rows: B h, the select and the sums in one more launch
    impl = resolve(implementation)
    hp, b_stack, lidx, on, rank_scale = lora
    return gemv.lora_finish(parts, hp, b_stack, lidx, on, rank_scale, out_dtype=x.dtype,
                            block=(tiles or {}).get("finish_block"),
                            interpret=impl == "pallas_interpret",
                            compiler_params=_kernel_params(impl, tiles)[1])
  return sum_partials(parts).astype(x.dtype) if parts.shape[0] > 1 else parts[0]


# A decode step's output projection, ended by one kernel (`Forms.proj_finish`): the
# product comes back as its split partial sums, and `finish_residual` adds them, the
# adapter's B h on rows that are on and the residual in one launch.


def dense_matmul_split(x, stack, index, *, implementation="auto", few="dot"):
  """`dense_matmul`'s product as split partial sums [S, N, out] (fp32 when the kernel split
  `in`; S = 1: the product itself in x's dtype): `gemv.sum_partials` of them, rounded to x's
  dtype, is `dense_matmul`'s result bit for bit. Unlike `dense_matmul_parts`, x may be
  16-bit: the sum is rounded once, where `dense_matmul` rounds it."""
  if dense_kernel_rows(*x.shape, implementation):
    return _dense_kernel(x, stack, index, resolve(implementation), None, partials=True)
  if dense_dot_rows(x.shape[0], x.dtype, stack.dtype, implementation, few):
    impl = resolve(implementation)
    return dense_dot.dense_dot_call(x, _stack3(stack), index, partials=True,
                                    interpret=impl == "pallas_interpret",
                                    compiler_params=_kernel_params(impl, None)[1])
  return dense_matmul(x, stack, index, implementation=implementation, few=few)[None]


def dense_matmul_lora_split(x, stack, index, a, b, on, *, rank_scale=None, lora_index=None,
                            implementation="auto", tiles=None, rows_max=None, few="dot",
                            one_row="gemv", copy_b=False):
  """`dense_matmul_lora` as (partials [S, N, out], lora), where `lora` is what a finishing
  kernel still adds, (hp, b_stack, lidx, on, rank_scale), or None (the partials sum to the
  result, rounded to x's dtype). The one-row GEMV leaves B h to it (its launch computes A x
  as R more rows, `gemv.dense_lora_rows`): `gemv.lora_finish`, or `finish_residual`,
  which gives the step the no-adapter step's launches. dense_dot adds the delta in its own
  launch, share by share, so its partials carry it already. Arguments: `dense_matmul_lora`'s
  (tiles' finish_block is the finishing kernel's, not read here); copy_b: the GEMV's launch
  also copies B = b[lora_index] out, and `lora` holds that copy as a stack of one (the
  finishing kernel then reads B at a static index, not after loading the layer index)."""
  n, d_in = x.shape
  d_out = stack.shape[-2]
  a_stack = a if lora_index is not None else a[None]
  b_stack = b if lora_index is not None else b[None]
  if (a_stack.ndim < 3 or a_stack.shape[-1] != d_in
      or b_stack.shape[-2:] != (d_out, a_stack.shape[-2])
      or b_stack.shape[:-2] != a_stack.shape[:-2] or on.shape != (n,)):
    raise ValueError(f"dense lora: a {a.shape}, b {b.shape}, on {on.shape} must be "
                     f"[R, {d_in}], [{d_out}, R], [{n}] (stacks of them with lora_index)")
  form = dense_lora_form(n, d_in, x.dtype, stack.dtype, implementation, few, one_row, rows_max)
  if form is None:
    return dense_lora_reference(x, stack, index, a, b, on, rank_scale=rank_scale,
                                lora_index=lora_index)[None], None
  a_stack, b_stack = _stack3(a_stack), _stack3(b_stack)
  lidx = jnp.asarray(0 if lora_index is None else lora_index, jnp.int32)
  on = on.astype(jnp.int32)
  impl = resolve(implementation)
  tk, params = _kernel_params(impl, tiles)
  tk.pop("finish_block", None)
  kw = dict(interpret=impl == "pallas_interpret", compiler_params=params, **tk)
  if form == "gemv":
    out = gemv.dense_lora_rows(x, _stack3(stack), jnp.asarray(index, jnp.int32), a_stack,
                               b_stack, lidx, on, copy_b=copy_b, **kw)
    if copy_b:
      yp, hp, b_cur = out
      return yp, (hp, b_cur, jnp.zeros((), jnp.int32), on, rank_scale)
    yp, hp = out
    return yp, (hp, b_stack, lidx, on, rank_scale)
  return dense_dot.dense_dot_call(x, _stack3(stack), index, partials=True,
                                  lora=(a_stack, b_stack, lidx, on, rank_scale), **kw), None


def finish_residual(parts, res, *, lora=None, implementation="auto"):
  """x' [N, D] in res's dtype: res + round(sum of the partials [S, N, D], plus B h on rows
  that are on when `lora` is given), in one kernel launch (`finish.finish_call`; "xla":
  `finish.finish_reference`, the same roundings). The caller takes the next RMSNorm of x'.
  lora: (hp [S', N, R] fp32, b_stack [L, D, R], lidx, on [N], rank_scale [N, R] or None)."""
  impl = resolve(implementation)
  if impl == "xla":
    return finish.finish_reference(parts, res, lora=lora)
  return finish.finish_call(parts, res, lora=lora, interpret=impl == "pallas_interpret",
                            compiler_params=_kernel_params(impl, None)[1])


def _lora_h(x, a, rank_scale=None):
  """h = x @ A^T [N, R] fp32, as the LoRA kernel computes it (`dot_policy`), times the
  per-row rank scales [N, R] when given."""
  cd, prec = dot_policy(x.dtype, a.dtype)
  h = lax.dot_general(x.astype(cd), a.astype(cd), _NT, precision=prec,
                      preferred_element_type=_F32)
  return h if rank_scale is None else h * rank_scale.astype(_F32)


def qmatmul_lora(x, w, a, b, on, *, rank_scale=None, scale=1.0, index=None,
                 implementation="auto", precision=None, lora_down="h", tiles=None,
                 active=None, group=None, lora_index=None):
  """y = W x + where(on, scale * B (A x)) per row: a select, so off rows are `qmatmul`'s.

  Args:
    x: [N, in]; w: QTensor [..., out, in]; index: as `qmatmul`.
    a: [R, in] LoRA A; b: [out, R] LoRA B (adapter scales folded in). With `lora_index`
      (int32, traced OK): stacks [..., R, in] and [..., out, R] and the pair at that index.
      A few rows with the kernels and the default tiling then take the LoRA rows form (A's
      rows in the GEMV's launch, B h and the select in one finishing kernel, the stacks read
      in place: `kernel.qmatmul_lora_rows`); any other call takes the pair out first.
    on: [N] bool / int32 switch per row.
    rank_scale: [N, R] float per-row scale of each rank column (h = x @ A^T times it before
      B, as `pallas_kernels.lora`), or None (all ones); needs lora_down="h".
    scale: static factor on the delta.
    lora_down: "h" computes h = x @ A^T once in XLA and the kernel adds B h in its epilogue;
      "a" computes h inside the kernel's K loop (no extra op, but every output tile's
      program reads all of A). Both are the same numbers.
    implementation, precision, tiles, active, group: as `qmatmul` (a mixed-type stack in
      one launch needs lora_down="h").

  Returns:
    [N, out] in x.dtype; rows with on == 0 are bit-identical to `qmatmul(x, w, ...)`.
  """
  _check(x, w, index, group)
  n, d_in = x.shape
  d_out = (w[0] if isinstance(w, tuple) else w).shape[-2]
  if lora_index is not None:
    y = _lora_rows(x, w, a, b, on, rank_scale, scale, index, group, lora_index,
                   implementation, tiles, active)
    if y is not None:
      return y
    a, b = _lora_pair(a, b, lora_index)
  if a.ndim != 2 or a.shape[1] != d_in or b.shape != (d_out, a.shape[0]):
    raise ValueError(f"quant: LoRA a {a.shape} must be [R, {d_in}] and b {b.shape} "
                     f"[{d_out}, R]")
  if on.shape != (n,):
    raise ValueError(f"quant: on {on.shape} must be [N] = [{n}]")
  if lora_down not in LORA_DOWN:
    raise ValueError(f"quant: lora_down={lora_down!r} is not one of {LORA_DOWN}")
  if rank_scale is not None and rank_scale.shape != (n, a.shape[0]):
    raise ValueError(f"quant: rank_scale {rank_scale.shape} must be [N, R] = "
                     f"[{n}, {a.shape[0]}]")
  if rank_scale is not None and lora_down != "h":
    raise ValueError("quant: rank_scale needs lora_down='h' (h is scaled before the kernel)")
  impl = resolve(implementation)
  on = on.astype(jnp.int32)
  lora_h = lambda: _lora_h(x, a, rank_scale)

  def with_delta(acc):
    """The fp32 base `acc` plus the delta on the on rows (XLA), a select keeping the rest."""
    delta = lax.dot_general(lora_h(), b.astype(_F32), _NT, precision=_HI,
                            preferred_element_type=_F32)
    if scale != 1.0:
      delta = delta * scale
    return jnp.where((on != 0)[:, None], (acc + delta).astype(x.dtype), acc.astype(x.dtype))

  if isinstance(w, tuple):
    if lora_down == "h" and _one_launch(w, n, d_out, d_in, impl, tiles):
      return qmatmul_groups_pallas(
          x[None], tuple(flat(p) for p in w), group, _index(w[0], index),
          qtypes=tuple(p.qtype for p in w), d_out=d_out, on=on, h=lora_h(), b=b,
          scale=scale, interpret=impl == "pallas_interpret")[0]
    return _each_part(group, w, lambda p, **kw: qmatmul_lora(
        x, p, a, b, on, rank_scale=rank_scale, scale=scale, index=index,
        implementation=implementation, precision=precision, lora_down=lora_down,
        tiles=tiles, **kw), impl)
  if impl == "xla":
    return with_delta(_xla_acc(x, w, index, precision))
  tk = dict(tiles or {})
  if epilogue_outside(n, d_out, d_in, w.qtype, form=tk.get("form"), interpret=impl != "pallas",
                      block_in=tk.get("block_in"), k_split=tk.get("k_split"),
                      lora_down=lora_down):
    # The plain call's form cannot fuse this epilogue: the base is that same call's fp32
    # sum, and the delta and the select follow in XLA, so an off row is `qmatmul`'s.
    return with_delta(qmatmul_pallas(x[None], flat(w), _index(w, index), qtype=w.qtype,
                                     d_out=d_out, precision=precision, out_dtype=_F32,
                                     active=active, **_kernel_kw(impl, tiles))[0])
  kw = dict(on=on, b=b, scale=scale, lora=lora_down)
  if lora_down == "h":
    kw["h"] = lora_h()
  else:
    kw["a"] = a
  y = qmatmul_pallas(x[None], flat(w), _index(w, index), qtype=w.qtype, d_out=d_out,
                     precision=precision, active=active, **kw, **_kernel_kw(impl, tiles))
  return y[0]


def _lora_rows(x, w, a, b, on, rank_scale, scale, index, group, lora_index, implementation,
               tiles, active):
  """`qmatmul_lora`'s LoRA rows form (stacks a, b read at lora_index in place), or None when
  the call is not a few rows of the kernels' "blocks" form with its default tiling."""
  impl = resolve(implementation)
  n, d_in = x.shape
  parts = w if isinstance(w, tuple) else (w,)
  d_out = parts[0].shape[-2]
  if impl == "xla" or n > ROWS_MAX or tiles or active is not None or d_in % DENSE_UNIT:
    return None
  a_st, b_st = _stack3(a), _stack3(b)
  if (a_st.shape[2] != d_in or b_st.shape != (a_st.shape[0], d_out, a_st.shape[1])
      or on.shape != (n,)):
    raise ValueError(f"quant: LoRA stacks a {a.shape}, b {b.shape} must be [..., R, {d_in}] "
                     f"and [..., {d_out}, R], on {on.shape} [{n}]")
  if rank_scale is not None and rank_scale.shape != (n, a_st.shape[1]):
    raise ValueError(f"quant: rank_scale {rank_scale.shape} must be [N, R] = "
                     f"[{n}, {a_st.shape[1]}]")
  kw = dict(scale=scale, interpret=impl == "pallas_interpret")
  lidx = jnp.asarray(lora_index, jnp.int32)
  on = on.astype(jnp.int32)
  if isinstance(w, tuple):
    if not _one_launch(w, n, d_out, d_in, impl, tiles):
      return None
    return qmatmul_groups_lora_rows(x, tuple(flat(p) for p in w), group, _index(w[0], index),
                                    a_st, b_st, lidx, on, rank_scale,
                                    qtypes=tuple(p.qtype for p in w), d_out=d_out, **kw)
  if d_in % BLOCK[w.qtype]:
    return None
  return qmatmul_lora_rows(x, flat(w), _index(w, index), a_st, b_st, lidx, on, rank_scale,
                           qtype=w.qtype, d_out=d_out, **kw)


def _expert_rows(idx, layer, n_layers, n_experts):
  """Flat matrix index layer * E + e per (token, slot); ids wrap / clamp as jnp indexing."""
  e = jnp.where(idx < 0, idx + n_experts, idx)
  e = jnp.clip(e, 0, n_experts - 1)
  lay = jnp.clip(jnp.asarray(layer, jnp.int32), 0, n_layers - 1)
  return (lay * n_experts + e).astype(jnp.int32)


def experts(x, wg, wu, wd, idx, weights, *, layer, implementation="auto", precision=None,
            tiles=None, active=None, sort_pairs=None, group=None, fused=False):
  """Few-token routed experts over quantised stacks, reading only the chosen experts.

  out[n] = sum_j weights[n, j] * Wd_e (silu(Wg_e x[n]) * (Wu_e x[n])), e = idx[n, j] of layer
  `layer`. h = silu(g) * u is rounded to x.dtype between the two products (as the dense
  model does); the result is float32.

  Args:
    x: [N, D] activations.
    wg, wu: QTensor [L, E, F, D]; wd: QTensor [L, E, D, F].
    idx: [N, k] int32 expert ids; weights: [N, k] routing weights.
    layer: int32 scalar (traced OK).
    implementation, precision, tiles, active: as `qmatmul`. The kernel runs three launches
      (gate, up, down) over all N * k (token, expert) pairs, one pair per row group.
    sort_pairs (static): run the kernel's pairs sorted by expert (None: when there are more
      pairs than experts, as in a prefill). The grid walks a pair's output tiles, then the
      next pair's, so sorted pairs of one expert follow each other and read its blocks from L2
      instead of HBM; each pair's numbers do not depend on its neighbours, so the result is
      the same, bit for bit. A decode batch has too few pairs for the sort to pay.
    group: with wg, wu, wd tuples of QTensors (mixed-type stacks grouped alike, one stack
      per type), the int32 part holding the layer; `layer` is its index in that part. Each
      product is then one launch over every part (`qmatmul` with `group`), or, where that
      cannot serve it, each part's experts gated and a select (XLA: a conditional).
    fused: with `group` and one launch a product, the gate's and the up's programs share one
      launch (`Forms.quant_launch` "fused"; each its own launch's bits).

  Returns:
    [N, D] float32.
  """
  parts = None
  if isinstance(wg, tuple):
    if group is None or not (len(wg) == len(wu) == len(wd) > 0):
      raise ValueError("quant experts: mixed-type stacks need as many parts each and group=")
    impl = resolve(implementation)
    parts = (wg, wu, wd)
    f, d = wg[0].shape[-2:]
    pairs = idx.shape[0] * idx.shape[1] if idx.ndim == 2 else 1
    if not (_one_launch(wg, 1, f, d, impl, tiles, groups=pairs)
            and _one_launch(wd, 1, d, f, impl, tiles, groups=pairs)):
      return _each_part(group, list(zip(wg, wu, wd)), lambda p, **kw: experts(
          x, *p, idx, weights, layer=layer, implementation=implementation,
          precision=precision, tiles=tiles, sort_pairs=sort_pairs, **kw), impl)
    wg, wu, wd = wg[0], wu[0], wd[0]  # shapes below; the products use every part
  for name, w in (("wg", wg), ("wu", wu), ("wd", wd)):
    if not isinstance(w, QTensor) or w.ndim != 4:
      raise ValueError(f"quant experts: {name} must be a 4-D QTensor [L, E, ., .]")
  n_layers, n_experts, f, d = wg.shape
  if wu.shape != wg.shape or wd.shape != (n_layers, n_experts, d, f):
    raise ValueError(f"quant experts: wg {wg.shape}, wu {wu.shape}, wd {wd.shape} must be "
                     f"[L, E, F, D], [L, E, F, D], [L, E, D, F]")
  if x.ndim != 2 or x.shape[1] != d:
    raise ValueError(f"quant experts: x {x.shape} must be [N, {d}]")
  if idx.ndim != 2 or idx.shape[0] != x.shape[0] or weights.shape != idx.shape:
    raise ValueError(f"quant experts: idx {idx.shape} and weights {weights.shape} must be "
                     f"[N, k] with N = {x.shape[0]}")
  impl = resolve(implementation)
  n, k = idx.shape
  cd, prec = _compute(x.dtype, precision)
  if parts is not None:  # the layer's part sets the clamp of its layer index
    n_layers = jnp.asarray([p.shape[0] for p in parts[0]], jnp.int32)[group]
  rows = _expert_rows(idx, layer, n_layers, n_experts).reshape(n * k)  # [P]
  xp = jnp.repeat(x, k, axis=0)  # [P, D]: pair p = n * k + j
  if sort_pairs is None:
    sort_pairs = n * k > n_experts
  order = None
  if sort_pairs and impl != "xla":
    # Every pair has the call's layer, so the rows sort as their expert ids do.
    order = argsort_ids(rows % n_experts, n_experts)
    rows, xp = rows[order], xp[order]
  if impl == "xla":
    def proj(w, v):  # gather the chosen experts' planes, dequantise, multiply
      sel = QTensor(**{name: p.reshape(-1, *p.shape[2:])[rows] for name, p in w.planes.items()},
                    qtype=w.qtype, shape=(n * k, *w.shape[2:]))
      wm = dequantize(sel, _F32).astype(cd)  # [P, out, in]
      return jnp.einsum("pi,poi->po", v.astype(cd), wm, precision=prec,
                        preferred_element_type=_F32)
  elif parts is not None:
    def proj(w, v, *more):  # one launch over the parts of a mixed-type stack (and `more`'s)
      ys = qmatmul_groups_pallas(v[:, None, :], tuple(flat(p) for p in w), group, rows,
                                 qtypes=tuple(p.qtype for p in w), d_out=w[0].shape[-2],
                                 out_dtype=_F32, interpret=impl == "pallas_interpret",
                                 more=tuple(tuple(flat(p) for p in m) for m in more))
      return [y[:, 0, :] for y in ys] if more else ys[:, 0, :]
  else:
    def proj(w, v):
      y = qmatmul_pallas(v[:, None, :], flat(w), rows, qtype=w.qtype, d_out=w.shape[-2],
                         precision=precision, out_dtype=_F32, active=active,
                         **_kernel_kw(impl, tiles))
      return y[:, 0, :]
  wg, wu, wd = parts or (wg, wu, wd)
  if fused and parts is not None and impl != "xla":
    # The gate and the up products in one launch (each its own call's bits): on the H200 the
    # 80B's expert GEMVs are launch-bound, about 6.8 us a call for 6 MB (run 49).
    g, u = proj(wg, xp, wu)
  else:
    g, u = proj(wg, xp), proj(wu, xp)  # [P, F] fp32
  h = jax.nn.silu(g).astype(x.dtype) * u.astype(x.dtype)
  y = proj(wd, h)  # [P, D] fp32
  if order is not None:   # back to pair order
    y = jnp.zeros_like(y).at[order].set(y, unique_indices=True)
  return jnp.sum(y.reshape(n, k, d) * weights.astype(_F32)[..., None], axis=1)
