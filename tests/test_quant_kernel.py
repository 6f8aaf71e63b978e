"""Quant matmul kernel: parity against float64 math on the gguf-dequantised weights, the stack
read at a traced index, the LoRA epilogue's off-row bit identity, and the MoE experts.

Every contract test runs against each implementation (tokamax style): "pallas_interpret" and
"xla" on CPU, the compiled "pallas" under the `gpu` marker on the device.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params
from jaxpr_walk import kernel_names
from quant_fixtures import gguf_dequantize, random_raw
from tolerances import KERNEL_REL, assert_close

from pallas_kernels.quant import (
    BLOCK,
    QUANT_TYPES,
    experts,
    pack,
    qmatmul,
    qmatmul_lora,
    qmatmul_pallas,
)
from pallas_kernels.quant.kernel import ROWS_MAX
from pallas_kernels.quant.layout import flat

CPU_IMPLS = ("pallas_interpret", "xla")
ON_GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU backend")
F32, BF16 = jnp.float32, jnp.bfloat16
OUT = 40  # not a multiple of the 16-row tiles the odd-shape cases force
SMALL_TILES = {"block_rows": 16, "block_out": 16, "block_in": 512}  # ragged, 2 blocks a step


def _in(qtype, blocks=2):
  return blocks * BLOCK[qtype] if qtype != "q8_0" else 96  # Q8_0: 3 blocks, no 2^k step


@functools.lru_cache(maxsize=None)
def _weight(qtype, lead=(2,), out=OUT, blocks=2, seed=0):
  """(QTensor of numpy planes, float64 dense weights) for a [*lead, out, in] stack."""
  shape = (*lead, out, _in(qtype, blocks))
  raw = random_raw(qtype, shape, seed=seed)
  return pack(raw, qtype, shape), gguf_dequantize(raw, qtype).astype(np.float64)


def _x(n, d_in, dtype, seed=1):
  return np.asarray(jnp.asarray(np.random.default_rng(seed).standard_normal((n, d_in)), dtype))


def _want(x, w64):
  return np.asarray(x, np.float64) @ w64.T


def _tol(dtype):
  return KERNEL_REL[np.dtype(dtype).name]


def bits(arr):
  arr = np.asarray(arr)
  return arr.view({2: np.uint16, 4: np.uint32}[arr.dtype.itemsize])


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("qtype", QUANT_TYPES)
@pytest.mark.parametrize("n,dtype,form", [(17, F32, None), (1, BF16, "rows"),
                                          (1, BF16, "blocks"), (3, F32, "blocks")],
                         ids=["N17-f32-dot", "N1-bf16-rows", "N1-bf16-blocks", "N3-f32-blocks"])
def test_qmatmul_matches_float64_on_stacked_weight(impl, qtype, n, dtype, form):
  """out = 40 over 16-row tiles (ragged); N = 17 over 16-row tiles (ragged; the "dot" form)
  or N = 1 / 3 (the GEMV forms: "rows", one sub-block a load, and "blocks", whole blocks)."""
  if impl == "xla" and form == "blocks" and n == 1:
    pytest.skip("xla has no forms: N1-bf16-rows covers it")
  qt, w64 = _weight(qtype)
  x = _x(n, qt.shape[-1], dtype)
  tiles = dict(SMALL_TILES, form=form) if impl != "xla" else None
  w = jax.device_put(qt)
  got = qmatmul(jnp.asarray(x), w, index=jnp.int32(1), implementation=impl, tiles=tiles)
  assert got.shape == (n, OUT) and got.dtype == x.dtype
  assert_close(got, _want(x, w64[1]), rel=_tol(dtype), what=f"{impl} {qtype} N{n} {form}")
  if impl != "xla" and dtype == BF16:
    # "rows" has "xla"'s numerics (weights rounded to bf16, fp32 sums), "blocks" keeps the
    # weights exact: within the bf16 tolerance of each other either way.
    want = qmatmul(jnp.asarray(x), w, index=jnp.int32(1), implementation="xla")
    assert_close(got, want, rel=_tol(dtype), what=f"{qtype} kernel vs xla")


@pytest.mark.parametrize("qtype", ["q6_k"])
def test_traced_index_reads_each_matrix_of_a_layer_expert_stack(qtype):
  """[L, E, out, in] stack, flat index layer * E + e traced under one jit."""
  qt, w64 = _weight(qtype, lead=(2, 3), out=24, blocks=1, seed=5)
  x = _x(2, qt.shape[-1], F32)
  f = jax.jit(lambda x, w, i: qmatmul(x, w, index=i, implementation="pallas_interpret"))
  w = jax.device_put(qt)
  for layer, e in ((0, 0), (1, 2), (0, 1)):
    got = f(jnp.asarray(x), w, jnp.int32(layer * 3 + e))
    assert_close(got, _want(x, w64[layer, e]), rel=_tol(F32), what=f"{qtype} L{layer} E{e}")
  assert f._cache_size() == 1


def test_unstacked_weight_and_index_errors():
  qt, w64 = _weight("q8_0", lead=(), out=OUT)
  x = _x(3, qt.shape[-1], F32)
  got = qmatmul(jnp.asarray(x), jax.device_put(qt), implementation="pallas_interpret")
  assert_close(got, _want(x, w64), rel=_tol(F32), what="unstacked")
  stacked, _ = _weight("q8_0")
  with pytest.raises(ValueError, match="stacked"):
    qmatmul(jnp.asarray(x), stacked, implementation="xla")
  with pytest.raises(ValueError, match="in = 96"):
    qmatmul(jnp.asarray(x[:, :64]), qt, implementation="xla")
  with pytest.raises(ValueError, match="unknown implementation"):
    qmatmul(jnp.asarray(x), qt, implementation="mosaic")


def _lora(n, d_in, d_out, rank, dtype, on_kind, seed=2):
  rng = np.random.default_rng(seed)
  a = (rng.standard_normal((rank, d_in)) / np.sqrt(d_in)).astype(np.float32)
  b = (rng.standard_normal((d_out, rank)) / np.sqrt(rank)).astype(np.float32)
  a, b = (np.asarray(jnp.asarray(v, dtype)) for v in (a, b))
  if on_kind == "mixed":
    on = (rng.random(n) < 0.5).astype(np.int32)
    on[0], on[-1] = 1, 0
  else:
    on = np.full((n,), int(on_kind == "all"), np.int32)
  return a, b, on


# (impl, qtype, lora_down, dtype, on rows, N): N = 18 runs the "dot" form, N = 3 "rows".
LORA_CASES = [("pallas_interpret", "q5_k", "h", F32, "mixed", 18),
              ("pallas_interpret", "q8_0", "a", F32, "mixed", 18),
              ("pallas_interpret", "q8_0", "h", BF16, "mixed", 18),
              ("pallas_interpret", "q8_0", "a", BF16, "none", 18),
              ("pallas_interpret", "q8_0", "h", F32, "all", 18),
              ("pallas_interpret", "q4_k", "h", BF16, "mixed", 3),
              ("pallas_interpret", "q8_0", "a", F32, "mixed", 3),
              # the default for a few rows, "blocks": the delta from h added in the kernel
              # (to the first share's partial when `in` is split); from A ("a"), the plain
              # call's fp32 sum and the delta and the select in XLA
              ("pallas_interpret", "q5_k", "h", BF16, "mixed", 3, 1, "blocks"),
              ("pallas_interpret", "q6_k", "h", F32, "all", 1, 1, "blocks"),
              ("pallas_interpret", "q4_k", "h", F32, "mixed", 4, 2, "blocks"),
              ("pallas_interpret", "q8_0", "h", BF16, "none", 2, 1, "blocks"),
              ("pallas_interpret", "q4_k", "a", BF16, "mixed", 3, 1, "blocks"),
              ("xla", "q5_k", "h", BF16, "mixed", 18), ("xla", "q5_k", "h", F32, "mixed", 18),
              # a base split along `in` (the GPU's default for a few rows and few output tiles):
              # the plain call's fp32 sum, then the delta and the select
              ("pallas_interpret", "q4_k", "a", F32, "mixed", 3, 2),
              ("pallas_interpret", "q6_k", "h", BF16, "mixed", 2, 2)]


LORA_CASES = [(*c, *(1, None)[len(c) - 6:]) for c in LORA_CASES]  # (.., k_split, form)


@pytest.mark.parametrize("impl,qtype,down,dtype,on_kind,n,k_split,form", LORA_CASES,
                         ids=["-".join(map(str, (*c[:3], np.dtype(c[3]).name, *c[4:])))
                              for c in LORA_CASES])
def test_lora_off_rows_bit_identical_on_rows_match(impl, qtype, down, dtype, on_kind, n,
                                                   k_split, form):
  rank, scale = 12, 0.5
  qt, w64 = _weight(qtype)
  w = jax.device_put(qt)
  x = _x(n, qt.shape[-1], dtype)
  a, b, on = _lora(n, qt.shape[-1], OUT, rank, dtype, on_kind)
  tiles = None
  if impl != "xla":  # "rows" form: one row per program; "dot": 16-row tiles, ragged
    tiles = dict(SMALL_TILES, block_rows=1, form="rows") if n <= ROWS_MAX else SMALL_TILES
  if form == "blocks":
    tiles = dict(SMALL_TILES, form="blocks", k_split=k_split)
    if k_split > 1:
      tiles["block_in"] = 256
  elif k_split > 1:
    tiles = dict(tiles, block_in=256, k_split=k_split)
  kw = dict(index=jnp.int32(1), implementation=impl, tiles=tiles)
  got = np.asarray(qmatmul_lora(jnp.asarray(x), w, jnp.asarray(a), jnp.asarray(b),
                                jnp.asarray(on), scale=scale, lora_down=down, **kw))
  plain = np.asarray(qmatmul(jnp.asarray(x), w, **kw))
  off = on == 0
  assert np.array_equal(bits(got[off]), bits(plain[off])), "off rows differ from qmatmul"
  if (~off).any():
    f = np.float64
    want = _want(x, w64[1]) + scale * (x.astype(f) @ a.astype(f).T) @ b.astype(f).T
    assert_close(got[~off], want[~off], rel=_tol(dtype), what=f"{impl} lora on rows")
    assert not np.array_equal(got[~off], plain[~off])


@pytest.mark.parametrize("impl", ["pallas_interpret", "xla"])
def test_lora_rank_scale_table(impl):
  """The per-row adapter table (rank_scale [N, R]) on the quantised path: h = x @ A^T scaled
  per row and rank column before B; off rows stay qmatmul's bits."""
  rank, n = 12, 18
  qt, w64 = _weight("q8_0")
  w = jax.device_put(qt)
  x = _x(n, qt.shape[-1], F32)
  a, b, on = _lora(n, qt.shape[-1], OUT, rank, F32, "mixed")
  rs = np.random.default_rng(4).uniform(0, 2, (n, rank)).astype(np.float32)
  rs[:, :5] *= np.arange(n)[:, None] % 2        # odd rows use "adapter 0" (columns 0..4)
  tiles = None if impl == "xla" else (
      dict(SMALL_TILES, block_rows=1) if n <= ROWS_MAX else SMALL_TILES)
  kw = dict(index=jnp.int32(1), implementation=impl, tiles=tiles)
  got = np.asarray(qmatmul_lora(jnp.asarray(x), w, jnp.asarray(a), jnp.asarray(b),
                                jnp.asarray(on), rank_scale=jnp.asarray(rs), **kw))
  plain = np.asarray(qmatmul(jnp.asarray(x), w, **kw))
  off = on == 0
  assert np.array_equal(bits(got[off]), bits(plain[off]))
  f = np.float64
  want = _want(x, w64[1]) + ((x.astype(f) @ a.astype(f).T) * rs) @ b.astype(f).T
  assert_close(got[~off], want[~off], rel=_tol(F32), what=f"{impl} rank-scaled rows")
  with pytest.raises(ValueError, match="lora_down='h'"):
    qmatmul_lora(jnp.asarray(x), w, jnp.asarray(a), jnp.asarray(b), jnp.asarray(on),
                 rank_scale=jnp.asarray(rs), lora_down="a", **kw)


@pytest.mark.parametrize("form,n", [("rows", 1), ("rows", 3), ("dot", 17), ("blocks", 1),
                                    ("blocks", 3)])
@pytest.mark.parametrize("qtype,dtype", [("q4_k", F32), ("q6_k", BF16), ("q8_0", BF16)])
def test_k_split_partial_sums_match_float64_and_the_unsplit_kernel(qtype, dtype, form, n):
  """k_split programs per output tile each sum a share of `in`: the same result as float64
  math, and within rounding of one program per tile; groups (the experts' pairs) each read
  their own matrix."""
  qt, w64 = _weight(qtype, lead=(3,), blocks=4, seed=7)
  planes = flat(jax.device_put(qt))
  d_in = qt.shape[-1]
  x = np.stack([_x(n, d_in, dtype, seed=s) for s in (1, 2)])           # G = 2
  idx = jnp.asarray([2, 0], jnp.int32)
  tiles = dict(form=form, block_out=16, block_in=BLOCK[qtype] if qtype != "q8_0" else 32,
               interpret=True)
  if form == "dot":
    tiles["block_rows"] = 16
  one = qmatmul_pallas(jnp.asarray(x), planes, idx, qtype=qtype, d_out=OUT, **tiles)
  if qtype == "q8_0":   # 3 blocks, one a step: a split must divide the 3 steps
    for bad in (2, 3):
      with pytest.raises(ValueError, match="k_split"):
        qmatmul_pallas(jnp.asarray(x), planes, idx, qtype=qtype, d_out=OUT, k_split=bad,
                       **tiles)
    return
  for k_split in (2, 4):
    got = qmatmul_pallas(jnp.asarray(x), planes, idx, qtype=qtype, d_out=OUT, k_split=k_split,
                         **tiles)
    assert got.shape == (2, n, OUT) and got.dtype == x.dtype
    for g, m in enumerate((2, 0)):
      assert_close(got[g], _want(x[g], w64[m]), rel=_tol(dtype), what=f"k_split {k_split} g{g}")
    assert_close(got, one, rel=_tol(dtype), what=f"k_split {k_split} vs unsplit")


@pytest.mark.parametrize("lora", ["none", "h"])
def test_gated_call_runs_only_when_active_and_then_equals_the_plain_call(lora):
  """`active` 1: the same bits as the call without the flag; 0: no program writes y (the
  caller selects another group's result), here left at what the interpreter allocated."""
  qt, _ = _weight("q4_k", blocks=4)
  planes = flat(jax.device_put(qt))
  d_in = qt.shape[-1]
  x = jnp.asarray(_x(2, d_in, F32))[None]
  kw = dict(qtype="q4_k", d_out=OUT, block_in=256, interpret=True)
  if lora == "h":
    kw.update(lora="h", on=jnp.asarray([1, 0], jnp.int32), h=jnp.ones((2, 8), F32),
              b=jnp.full((OUT, 8), 0.01, F32))
  idx = jnp.asarray([1], jnp.int32)
  plain = qmatmul_pallas(x, planes, idx, **kw)
  on = qmatmul_pallas(x, planes, idx, active=jnp.int32(1), **kw)
  off = qmatmul_pallas(x, planes, idx, active=jnp.int32(0), **kw)
  assert np.array_equal(bits(on), bits(plain))
  assert not np.array_equal(np.asarray(off), np.asarray(plain))


def test_gated_experts_equal_the_ungated_ones():
  d = f = 256
  raw = {k: random_raw("q4_k", (2, 3, f, d), seed=s) for s, k in enumerate("gud")}
  qts = [jax.device_put(pack(raw[k], "q4_k", raw[k].shape[:-1] + (d,))) for k in "gud"]
  args = (jnp.asarray(_x(2, d, F32)), *qts, jnp.asarray([[0, 2], [1, 1]], jnp.int32),
          jnp.full((2, 2), 0.5, F32))
  kw = dict(layer=jnp.int32(1), implementation="pallas_interpret")
  assert np.array_equal(bits(experts(*args, **kw)),
                        bits(experts(*args, active=jnp.int32(1), **kw)))


def test_experts_sorted_by_expert_equal_the_pairs_in_token_order():
  """More pairs than experts (a prefill): the kernel runs them sorted by expert, and every
  token's output is the unsorted run's, bit for bit (each pair is computed on its own)."""
  d = f = 256
  n_exp, n, k = 3, 5, 2
  raw = {c: random_raw("q4_k", (2, n_exp, f, d), seed=s) for s, c in enumerate("gud")}
  qts = [jax.device_put(pack(raw[c], "q4_k", raw[c].shape[:-1] + (d,))) for c in "gud"]
  idx = np.random.default_rng(3).integers(0, n_exp, (n, k)).astype(np.int32)
  args = (jnp.asarray(_x(n, d, F32)), *qts, jnp.asarray(idx),
          jnp.asarray(np.random.default_rng(4).random((n, k)), F32))
  kw = dict(layer=jnp.int32(1), implementation="pallas_interpret")
  sorted_ = experts(*args, sort_pairs=True, **kw)
  assert np.array_equal(bits(sorted_), bits(experts(*args, sort_pairs=False, **kw)))
  assert np.array_equal(bits(sorted_), bits(experts(*args, **kw)))   # n * k > E: sorted


def test_blocks_form_refuses_the_lora_epilogue_from_a():
  qt, _ = _weight("q4_k")
  with pytest.raises(ValueError, match="epilogue takes h"):
    qmatmul_pallas(jnp.ones((1, 2, qt.shape[-1]), F32), flat(jax.device_put(qt)),
                   jnp.zeros((1,), jnp.int32), qtype="q4_k", d_out=OUT, lora="a",
                   on=jnp.ones((2,), jnp.int32), a=jnp.ones((8, qt.shape[-1]), F32),
                   b=jnp.ones((OUT, 8), F32), form="blocks", interpret=True)


def test_k_split_is_refused_with_the_lora_epilogue_of_rows_and_dot():
  """Their epilogue needs the whole sum ("blocks" adds it to the first share's partial)."""
  qt, _ = _weight("q4_k")
  planes = flat(jax.device_put(qt))
  d_in = qt.shape[-1]
  with pytest.raises(ValueError, match="k_split needs lora='none'"):
    qmatmul_pallas(jnp.ones((1, 2, d_in), F32), planes, jnp.zeros((1,), jnp.int32),
                   qtype="q4_k", d_out=OUT, lora="h", on=jnp.ones((2,), jnp.int32),
                   h=jnp.ones((2, 8), F32), b=jnp.ones((OUT, 8), F32), k_split=2,
                   block_in=256, form="rows", interpret=True)


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("qtype,dtype", [("q4_k", F32), ("q8_0", BF16)])
def test_experts_match_float64(impl, qtype, dtype):
  n_layers, n_exp, k, n = 2, 3, 2, 2
  d = f = _in(qtype, 1) if qtype != "q8_0" else 64
  raw = {name: random_raw(qtype, (n_layers, n_exp, f, d), seed=s)
         for s, name in enumerate(("g", "u", "d"))}
  qts = {name: jax.device_put(pack(r, qtype, r.shape[:-1] + (d,))) for name, r in raw.items()}
  w64 = {name: gguf_dequantize(r, qtype).astype(np.float64) for name, r in raw.items()}
  x = _x(n, d, dtype)
  idx = np.array([[2, 0], [1, -1]], np.int32)  # -1 wraps to the last expert
  wts = np.array([[0.7, 0.3], [0.4, 0.6]], np.float32)
  layer = 1
  got = jax.jit(functools.partial(experts, implementation=impl))(
      jnp.asarray(x), qts["g"], qts["u"], qts["d"], jnp.asarray(idx), jnp.asarray(wts),
      layer=jnp.int32(layer))
  assert got.shape == (n, d) and got.dtype == np.float32
  xf = np.asarray(x, np.float64)
  want = np.zeros((n, d))
  for t in range(n):
    for j in range(k):
      e = idx[t, j] % n_exp
      gv = w64["g"][layer, e] @ xf[t]
      uv = w64["u"][layer, e] @ xf[t]
      want[t] += wts[t, j] * (w64["d"][layer, e] @ (gv / (1 + np.exp(-gv)) * uv))
  assert_close(got, want, rel=2 * _tol(dtype) if dtype == BF16 else _tol(dtype),
               what=f"{impl} experts {qtype}")


def test_kernel_rejects_bad_planes_and_tiles():
  qt, _ = _weight("q4_k")
  planes = flat(jax.device_put(qt))
  x = jnp.zeros((1, 2, qt.shape[-1]), F32)
  with pytest.raises(ValueError, match="plane qs"):
    qmatmul_pallas(x, planes, jnp.zeros((1,), jnp.int32), qtype="q4_k", d_out=OUT + 1,
                   interpret=True)
  with pytest.raises(ValueError, match="power of 2"):
    qmatmul_pallas(x, planes, jnp.zeros((1,), jnp.int32), qtype="q4_k", d_out=OUT,
                   block_out=24, interpret=True)


LOWER_CASES = [(q, BF16, "a", f) for q in QUANT_TYPES for f in ("rows", "dot")] + [
    ("q4_k", F32, "h", "rows"), ("q4_k", F32, "h", "dot"), ("q6_k", BF16, "none", "rows"),
    ("q6_k", BF16, "none", "dot")] + [(q, dt, "none", "blocks") for q in QUANT_TYPES
                                      for dt in (BF16, F32)] + [("q5_k", BF16, "h", "blocks"),
                                                                ("q8_0", F32, "h", "blocks")]


@pytest.mark.parametrize("qtype,dtype,lora,form", LOWER_CASES)
def test_kernel_lowers_to_triton_for_the_gpu(qtype, dtype, lora, form):
  """Cross-lowering on CPU: every construct of the kernel has a Pallas Triton lowering rule
  (what the interpreter cannot tell); compiling the Triton IR needs the device."""
  qt, _ = _weight(qtype)
  planes = flat(jax.device_put(qt))
  d_in = qt.shape[-1]
  kw = {}
  if lora != "none":
    kw = dict(on=jnp.ones((3,), jnp.int32), b=jnp.ones((OUT, 8), dtype), lora=lora)
    kw["a" if lora == "a" else "h"] = (jnp.ones((8, d_in), dtype) if lora == "a"
                                       else jnp.ones((3, 8), F32))

  def f(x, p, i):
    return qmatmul_pallas(x, p, i, qtype=qtype, d_out=OUT, form=form, **kw)

  if lora == "none":   # the split-K programs and the "active" flag lower too
    f = functools.partial(lambda x, p, i, f0: f0(x, p, i), f0=lambda x, p, i: qmatmul_pallas(
        x, p, i, qtype=qtype, d_out=OUT, form=form, block_in=256,
        k_split=1 if qtype == "q8_0" else 2, active=i[0] + 1))  # Q8_0: 3 steps

  low = jax.jit(f).trace(jnp.ones((1, 3, d_in), dtype), planes,
                         jnp.zeros((1,), jnp.int32)).lower(lowering_platforms=("cuda",))
  assert "xla.gpu.triton" in low.as_text()


# Compiled on the device: the same contract, larger shapes and both tilings.
GPU_CASES = [(qt, n, dt, form) for qt in QUANT_TYPES
             for n, dt, form in ((1, BF16, "rows"), (1, BF16, "dot"), (3, BF16, "rows"),
                                 (1, BF16, "blocks"), (3, BF16, "blocks"), (2, F32, "blocks"),
                                 (8, BF16, "rows"), (8, BF16, "dot"), (32, BF16, "dot"),
                                 (300, BF16, "dot"), (2, F32, "rows"), (5, F32, "dot"))]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("qtype,n,dtype,form", GPU_CASES,
                         ids=[f"{c[0]}-N{c[1]}-{np.dtype(c[2]).name}-{c[3]}" for c in GPU_CASES])
def test_gpu_parity(qtype, n, dtype, form):
  qt, w64 = _weight(qtype, lead=(3,), out=328, blocks=4, seed=11)
  x = _x(n, qt.shape[-1], dtype)
  got = qmatmul(jnp.asarray(x), jax.device_put(qt), index=jnp.int32(2), implementation="pallas",
                tiles={"form": form})
  assert_close(got, _want(x, w64[2]), rel=_tol(dtype), what=f"gpu {qtype} N{n} {form}")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("qtype", [q for q in QUANT_TYPES if q != "q8_0"])  # 8 steps each
@pytest.mark.parametrize("n,dtype,form", [(1, BF16, "rows"), (2, F32, "rows"), (5, F32, "dot"),
                                          (1, BF16, "blocks"), (2, F32, "blocks")])
def test_gpu_k_split_parity(qtype, n, dtype, form):
  qt, w64 = _weight(qtype, lead=(3,), out=328, blocks=8, seed=13)
  x = _x(n, qt.shape[-1], dtype)
  for k_split in (2, 8):
    got = qmatmul(jnp.asarray(x), jax.device_put(qt), index=jnp.int32(1),
                  implementation="pallas",
                  tiles={"form": form, "block_in": 256, "k_split": k_split})
    assert_close(got, _want(x, w64[1]), rel=_tol(dtype), what=f"gpu k_split {k_split} {qtype}")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("down", ["h", "a"])
@pytest.mark.parametrize("n,dtype,on_kind", [(1, BF16, "none"), (1, BF16, "all"),
                                             (3, BF16, "mixed"), (8, BF16, "mixed"),
                                             (32, BF16, "mixed"), (200, BF16, "mixed"),
                                             (2, F32, "mixed"), (7, F32, "mixed")])
def test_gpu_lora_off_rows_bit_identical(down, n, dtype, on_kind):
  """Every form (N <= 4: "blocks" with the delta in XLA, "dot" above), both LoRA down
  forms, on the device."""
  qt, w64 = _weight("q4_k", lead=(2,), out=264, blocks=4, seed=12)
  w = jax.device_put(qt)
  x = _x(n, qt.shape[-1], dtype)
  a, b, on = _lora(n, qt.shape[-1], 264, 16, dtype, on_kind)
  kw = dict(index=jnp.int32(1), implementation="pallas")
  got = np.asarray(qmatmul_lora(jnp.asarray(x), w, jnp.asarray(a), jnp.asarray(b),
                                jnp.asarray(on), lora_down=down, **kw))
  plain = np.asarray(qmatmul(jnp.asarray(x), w, **kw))
  off = on == 0
  assert np.array_equal(bits(got[off]), bits(plain[off])), "off rows differ from qmatmul"
  if (~off).any():
    f = np.float64
    want = _want(x, w64[1]) + (x.astype(f) @ a.astype(f).T) @ b.astype(f).T
    assert_close(got[~off], want[~off], rel=_tol(dtype), what="gpu lora on rows")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("qtype", ["q4_k", "q6_k", "q8_0"])
def test_gpu_experts(qtype):
  d = f = 512
  raw = {name: random_raw(qtype, (2, 8, f, d), seed=s) for s, name in enumerate("gud")}
  qts = {k: jax.device_put(pack(r, qtype, r.shape[:-1] + (d,))) for k, r in raw.items()}
  x = jnp.asarray(_x(3, d, BF16))
  idx = jnp.asarray(np.array([[1, 7], [3, 3], [0, 5]], np.int32))
  wts = jnp.asarray(np.full((3, 2), 0.5, np.float32))
  args = (x, qts["g"], qts["u"], qts["d"], idx, wts)
  got = experts(*args, layer=jnp.int32(1), implementation="pallas")
  want = experts(*args, layer=jnp.int32(1), implementation="xla")
  assert_close(got, want, rel=2 * _tol(BF16), what=f"gpu experts {qtype}")


def test_split_defaults_follow_the_measured_shapes():
  """Compiled "rows" GEMVs: few output tiles split `in` 4 ways at 512 columns a step, the
  experts 2 ways, the output head 2 ways at 256; a split always divides the loop steps."""
  from pallas_kernels.quant.kernel import split_defaults
  assert split_defaults(2048, 4096, "q4_k") == (512, 4)      # ssm_out: 8 steps
  assert split_defaults(512, 2048, "q4_k") == (512, 4)       # shared expert gate / up
  assert split_defaults(2048, 512, "q4_k") == (512, 1)       # one step: nothing to split
  assert split_defaults(8192, 2048, "q5_k") == (1024, 1)     # many tiles
  assert split_defaults(512, 2048, "q4_k", groups=10) == (1024, 2)
  assert split_defaults(2048, 512, "q6_k", groups=10) == (1024, 1)
  assert split_defaults(151936, 2048, "q6_k") == (256, 2)
  assert split_defaults(64, 96, "q8_0") == (512, 1)           # 3 blocks: no power-of-2 split
  assert split_defaults(512, 2560, "q4_k", groups=10) == (1024, 1)  # 10 blocks: 5 steps of 2
  assert split_defaults(512, 3072, "q4_k", groups=10) == (1024, 1)  # 12 blocks: 3 steps of 4


def test_rows_form_expert_tiles_shrink_until_the_grid_has_enough_programs():
  """The experts' GEMVs (one matrix per pair) get 4-16-row tiles and >= ROWS_MIN_PROGRAMS
  programs; a single matrix keeps 32-row tiles (faster for ssm_out on the H200)."""
  from pallas_kernels.quant.kernel import ROWS_MIN_PROGRAMS, tiling_defaults
  assert tiling_defaults(1, 151936, form="rows")[1] == 32
  assert tiling_defaults(1, 2048, form="rows")[1] == 32
  _, bo, _ = tiling_defaults(1, 2048, form="rows", groups=10)
  assert bo == 16 and 2048 // bo * 10 >= ROWS_MIN_PROGRAMS
  _, bo, _ = tiling_defaults(1, 512, form="rows", groups=10)
  assert bo == 4 and 512 // bo * 10 >= ROWS_MIN_PROGRAMS
  assert tiling_defaults(1, 512, form="rows", interpret=True)[1] == 128  # CPU: big tiles


def test_blocks_form_is_the_few_row_default_and_splits_until_the_grid_is_full():
  """Few rows run "blocks" (the LoRA epilogue from A keeps "rows"); more rows "dot".
  Compiled "blocks" splits `in` (a power of 2 dividing the steps, at most 8) until the grid
  has BLOCKS_MIN_PROGRAMS programs."""
  from pallas_kernels.quant.kernel import (
      BLOCKS_MIN_PROGRAMS,
      blocks_defaults,
      default_form,
      epilogue_outside,
  )
  assert default_form(1) == default_form(ROWS_MAX, lora="h") == "blocks"
  assert default_form(2, lora="a") == "rows" and default_form(ROWS_MAX + 1) == "dot"
  assert not epilogue_outside(1, 2048, 4096, "q4_k")        # split, fused in the ks = 0 share
  assert epilogue_outside(1, 2048, 4096, "q4_k", lora_down="a")
  assert epilogue_outside(1, 2048, 4096, "q4_k", form="rows")        # a split "rows" call
  assert not epilogue_outside(3, 64, 256, "q4_k", form="rows", interpret=True)
  assert blocks_defaults(2048, 4096, "q4_k") == (16, 512, 4)        # ssm_out: 8 steps
  assert blocks_defaults(151936, 2048, "q6_k") == (16, 512, 1)      # many tiles
  assert blocks_defaults(512, 2048, "q4_k", groups=10) == (16, 512, 2)
  bo, _, ks = blocks_defaults(512, 2048, "q4_k")
  assert 512 // bo * ks <= BLOCKS_MIN_PROGRAMS and ks == 4         # 4 steps: at most 4
  assert blocks_defaults(64, 96, "q8_0")[2] == 1                     # 3 blocks: no split
  assert blocks_defaults(512, 2048, "q4_k", interpret=True) == (128, 2048, 1)


# The "blocks" GEMV over a plain float weight stack (Forms.dense_weights="kernel").
@pytest.mark.parametrize("n,dtype,k_split", [(1, F32, 1), (3, BF16, 1), (2, F32, 3),
                                             (4, BF16, 3)])
def test_dense_gemv_reads_the_indexed_matrix_and_matches_float64(n, dtype, k_split):
  """Stack [2, 3, 40, 96]: matrix 1 * 3 + 2 at a traced index, out ragged over 16-row
  tiles, one 32-column unit a step (k_split shares of 3 steps)."""
  from pallas_kernels.quant import dense_matmul
  rng = np.random.default_rng(3)
  w = np.asarray(jnp.asarray(rng.standard_normal((2, 3, OUT, 96)), dtype))
  x = _x(n, 96, dtype)
  f = jax.jit(lambda x, w, i: dense_matmul(x, w, i, implementation="pallas_interpret", tiles=dict(
      block_out=16, block_in=32, k_split=k_split), rows_max=ROWS_MAX))
  got = f(jnp.asarray(x), jnp.asarray(w), jnp.int32(5))
  assert got.shape == (n, OUT) and got.dtype == x.dtype
  assert_close(got, _want(x, np.asarray(w[1, 2], np.float64)), rel=_tol(dtype),
               what=f"dense gemv N{n} {np.dtype(dtype).name}")
  assert "qgemv_dense" in str(jax.make_jaxpr(f)(jnp.asarray(x), jnp.asarray(w), jnp.int32(5)))
  if k_split == 1:
    with pytest.raises(ValueError, match="k_split=2 does not divide"):
      dense_matmul(jnp.asarray(x), jnp.asarray(w), jnp.int32(5), implementation="pallas_interpret",
                   tiles=dict(block_in=32, k_split=2), rows_max=ROWS_MAX)


def test_dense_gemv_leaves_many_rows_and_odd_widths_to_xla():
  """More rows than the kernel takes (DENSE_ROWS_MAX by default, never above ROWS_MAX), or
  `in` not a multiple of 32: the XLA reference, bit for bit, and no kernel in the program."""
  from pallas_kernels.quant import dense_matmul, dense_reference
  from pallas_kernels.quant.api import DENSE_ROWS_MAX
  rng = np.random.default_rng(4)
  for n, d_in, rows_max in ((DENSE_ROWS_MAX + 1, 64, None), (ROWS_MAX + 1, 64, ROWS_MAX + 1),
                            (1, 48, None)):
    w = jnp.asarray(rng.standard_normal((3, 24, d_in)), F32)
    x = jnp.asarray(rng.standard_normal((n, d_in)), F32)
    f = lambda x, w: dense_matmul(x, w, jnp.int32(2), implementation="pallas_interpret",
                                  rows_max=rows_max)
    assert np.array_equal(bits(f(x, w)), bits(dense_reference(x, w, jnp.int32(2))))
    assert "qgemv_dense" not in str(jax.make_jaxpr(f)(x, w))


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_dense_gemv_lowers_to_triton_for_the_gpu(dtype):
  from pallas_kernels.quant.gemv import dense_call
  f = lambda x, w, i: dense_call(x, w, i, k_split=2)
  low = jax.jit(f).trace(jnp.ones((1, 2, 1024), dtype), jnp.ones((3, OUT, 1024), dtype),
                         jnp.zeros((1,), jnp.int32)).lower(lowering_platforms=("cuda",))
  assert "xla.gpu.triton" in low.as_text()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n,dtype", [(1, BF16), (4, BF16), (2, F32)])
def test_gpu_dense_gemv(n, dtype):
  from pallas_kernels.quant import dense_matmul
  rng = np.random.default_rng(5)
  w = np.asarray(jnp.asarray(rng.standard_normal((4, 328, 2048)), dtype))
  x = _x(n, 2048, dtype)
  got = dense_matmul(jnp.asarray(x), jnp.asarray(w), jnp.int32(3), implementation="pallas",
                     rows_max=ROWS_MAX)
  assert_close(got, _want(x, np.asarray(w[3], np.float64)), rel=_tol(dtype),
               what=f"gpu dense gemv N{n}")


@pytest.mark.parametrize("n,dtype,k_split,on_kind", [
    (1, F32, 1, "all"), (1, BF16, 3, "all"), (1, F32, 3, "off"), (3, BF16, 1, "mixed"),
    (2, F32, 3, "mixed")])
def test_dense_gemv_lora_rows_add_the_delta_and_keep_off_rows_bits(n, dtype, k_split, on_kind):
  """dense_matmul_lora's kernels (A x as extra rows of the GEMV's launch, then the finish:
  split sums in order, + B h, one rounding): on rows equal W x + B (A x) in float64 and
  `dense_lora_reference`; off rows are `dense_matmul`'s bit for bit, split sums or not."""
  from pallas_kernels.quant import dense_matmul
  from pallas_kernels.quant.api import dense_lora_reference, dense_matmul_lora
  rng = np.random.default_rng(6)
  w = np.asarray(jnp.asarray(rng.standard_normal((2, 3, OUT, 96)), dtype))
  x = _x(n, 96, dtype)
  a, b, on = _lora(n, 96, OUT, 12, dtype, on_kind)
  kw = dict(implementation="pallas_interpret", rows_max=ROWS_MAX,
            tiles=dict(block_out=16, block_in=32, k_split=k_split))
  args = (jnp.asarray(x), jnp.asarray(w), jnp.int32(5))
  lora = (jnp.asarray(a), jnp.asarray(b), jnp.asarray(on))
  f = jax.jit(lambda x, w, i, a, b, on: dense_matmul_lora(x, w, i, a, b, on, **kw))
  got = np.asarray(f(*args, *lora))
  jaxpr = str(jax.make_jaxpr(f)(*args, *lora))
  assert "qgemv_dense_lora_rows" in jaxpr and "lora_finish" in jaxpr
  plain = np.asarray(dense_matmul(*args, **kw))
  off = on == 0
  assert np.array_equal(bits(got[off]), bits(plain[off])), "off rows differ from dense_matmul"
  if (~off).any():
    f64 = np.float64
    want = _want(x, np.asarray(w[1, 2], f64)) + (x.astype(f64) @ a.astype(f64).T) @ b.astype(
        f64).T
    assert_close(got[~off], want[~off], rel=_tol(dtype), what=f"dense lora N{n} on rows")
    ref = np.asarray(dense_lora_reference(*args, *lora))
    assert_close(got[~off], ref[~off], rel=_tol(dtype), what="dense lora vs reference")
    assert not np.array_equal(got[~off], plain[~off])


@pytest.mark.parametrize("n,dtype,k_split", [(1, F32, 3), (2, BF16, 1), (3, F32, 3)])
def test_dense_lora_reads_the_adapter_stacks_in_place_at_the_layer(n, dtype, k_split):
  """With `lora_index`, A and B are stacks read in place at that (traced) index: the same
  bits as the call on the pair taken out first, no slice of the stacks in the program, and
  with per-row rank scales (the adapter table) h is scaled before B: on rows within the
  float64 product's tolerance, off rows `dense_matmul`'s bits."""
  from pallas_kernels.quant import dense_matmul
  from pallas_kernels.quant.api import dense_matmul_lora
  rng = np.random.default_rng(9)
  rank, lay = 12, 3
  w = jnp.asarray(np.asarray(jnp.asarray(rng.standard_normal((4, OUT, 96)), dtype)))
  x = jnp.asarray(_x(n, 96, dtype))
  pairs = [_lora(n, 96, OUT, rank, dtype, "mixed", seed=30 + i) for i in range(5)]
  a_st = jnp.asarray(np.stack([p[0] for p in pairs]))
  b_st = jnp.asarray(np.stack([p[1] for p in pairs]))
  on = jnp.asarray(pairs[0][2])
  rs = jnp.asarray(rng.uniform(0, 2, (n, rank)).astype(np.float32))
  kw = dict(implementation="pallas_interpret", rows_max=ROWS_MAX,
            tiles=dict(block_out=16, block_in=32, k_split=k_split))
  f = jax.jit(lambda x, i, li, rs: dense_matmul_lora(x, w, i, a_st, b_st, on, rank_scale=rs,
                                                     lora_index=li, **kw))
  got = np.asarray(f(x, jnp.int32(1), jnp.int32(lay), rs))
  jaxpr = str(jax.make_jaxpr(f)(x, jnp.int32(1), jnp.int32(lay), rs))
  assert "dynamic_slice" not in jaxpr and "qgemv_dense_lora_rows" in jaxpr
  pair = np.asarray(dense_matmul_lora(x, w, jnp.int32(1), a_st[lay], b_st[lay], on,
                                      rank_scale=rs, **kw))
  assert np.array_equal(bits(got), bits(pair)), "stack at lora_index != the pair itself"
  off = np.asarray(on) == 0
  plain = np.asarray(dense_matmul(x, w, jnp.int32(1), **kw))
  assert np.array_equal(bits(got[off]), bits(plain[off])), "off rows differ from dense_matmul"
  f64 = np.float64
  a, b = np.asarray(a_st[lay], f64), np.asarray(b_st[lay], f64)
  xf = np.asarray(x, f64)
  want = _want(np.asarray(x), np.asarray(w[1], f64)) + ((xf @ a.T) * np.asarray(rs)) @ b.T
  assert_close(got[~off], want[~off], rel=_tol(dtype), what=f"stacked dense lora N{n}")


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_dense_lora_rows_lower_to_triton_for_the_gpu(dtype):
  """Both launches of the LoRA rows path (the GEMV with A's rows, the finish) lower to
  Triton for the GPU, at ssm_out's shape with split sums, the rank-scale table and the
  bench's rank 50 (masked rank tiles)."""
  from pallas_kernels.quant.gemv import dense_lora_call
  f = lambda x, w, i, a, b, li, on, rs: dense_lora_call(x, w, i, a, b, li, on, rs, k_split=4)
  args = (jnp.ones((1, 4096), dtype), jnp.ones((3, 2048, 4096), dtype),
          jnp.zeros((1,), jnp.int32), jnp.ones((2, 50, 4096), dtype),
          jnp.ones((2, 2048, 50), dtype), jnp.zeros((1,), jnp.int32), jnp.ones((1,), jnp.int32),
          jnp.ones((1, 50), F32))
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("xla.gpu.triton") == 2


@pytest.mark.parametrize("dtype,rank", [(F32, 12), (BF16, 50)])
def test_the_projection_launch_copies_the_layers_b_for_a_finish_with_no_index_wait(dtype, rank):
  """`dense_lora_rows(copy_b=True)` (`Forms.proj_finish="gemv_b"`): the one-row GEMV's launch
  also copies B = b_stack[lidx] out as [1, out, R] (out 40: a ragged last tile; rank 50: a
  padded one), bit for bit, and its partial sums are the launch's without the copy; the
  finishing kernel reading that copy at a static index gives the indexed finish's bits,
  switch on and off. Both lower to Triton for the GPU."""
  from pallas_kernels.quant.finish import finish_call
  from pallas_kernels.quant.gemv import dense_lora_rows
  rng = np.random.default_rng(11)
  lay = 3
  w = jnp.asarray(rng.standard_normal((4, OUT, 128)), dtype)
  x = jnp.asarray(_x(1, 128, dtype))
  a_st = jnp.asarray(0.3 * rng.standard_normal((5, rank, 128)), dtype)
  b_st = jnp.asarray(0.3 * rng.standard_normal((5, OUT, rank)), dtype)
  res = jnp.asarray(rng.standard_normal((1, OUT)), dtype)
  i, li = jnp.int32(1), jnp.int32(lay)
  kw = dict(block_out=16, block_in=32, k_split=2, interpret=True)
  for on in (jnp.ones((1,), jnp.int32), jnp.zeros((1,), jnp.int32)):
    yp, hp = dense_lora_rows(x, w, i, a_st, b_st, li, on, **kw)
    yp2, hp2, b_cur = dense_lora_rows(x, w, i, a_st, b_st, li, on, copy_b=True, **kw)
    assert np.array_equal(bits(yp2), bits(yp)) and np.array_equal(bits(hp2), bits(hp))
    assert b_cur.shape == (1, OUT, rank) and b_cur.dtype == dtype
    assert np.array_equal(bits(b_cur[0]), bits(b_st[lay]))
    want = finish_call(yp, res, lora=(hp, b_st, li, on, None), interpret=True)
    got = finish_call(yp2, res, lora=(hp2, b_cur, jnp.int32(0), on, None), interpret=True)
    assert np.array_equal(bits(got), bits(want))
  args = (jnp.ones((1, 4096), BF16), jnp.ones((3, 2048, 4096), BF16), jnp.zeros((1,), jnp.int32),
          jnp.ones((2, 50, 4096), BF16), jnp.ones((2, 2048, 50), BF16),
          jnp.zeros((1,), jnp.int32), jnp.ones((1,), jnp.int32))

  def both(x, w, i, a, b, li, on):
    yp, hp, b_cur = dense_lora_rows(x, w, i, a, b, li, on, k_split=4, copy_b=True)
    return finish_call(yp, x[:, :2048], lora=(hp, b_cur, jnp.int32(0), on, None))
  text = jax.jit(both).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("xla.gpu.triton") == 2


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU backend")
def test_gpu_projection_launch_copies_b_and_the_static_finish_gives_the_indexed_bits():
  """Compiled at ssm_out's shape (bench-a3b, rank 50, split sums): the copy is B bit for bit,
  and the finish at a static index gives the indexed finish's bits, switch on and off."""
  from pallas_kernels.quant.finish import finish_call
  from pallas_kernels.quant.gemv import dense_lora_rows
  rng = np.random.default_rng(12)
  w = jnp.asarray(rng.standard_normal((3, 2048, 4096)), BF16)
  a_st = jnp.asarray(0.05 * rng.standard_normal((4, 50, 4096)), BF16)
  b_st = jnp.asarray(0.05 * rng.standard_normal((4, 2048, 50)), BF16)
  x = jnp.asarray(rng.standard_normal((1, 4096)), BF16)
  res = jnp.asarray(rng.standard_normal((1, 2048)), BF16)
  i, li = jnp.int32(2), jnp.int32(3)

  @jax.jit
  def both(on):
    yp, hp = dense_lora_rows(x, w, i, a_st, b_st, li, on, k_split=4)
    yp2, hp2, b_cur = dense_lora_rows(x, w, i, a_st, b_st, li, on, k_split=4, copy_b=True)
    return (finish_call(yp, res, lora=(hp, b_st, li, on, None)),
            finish_call(yp2, res, lora=(hp2, b_cur, jnp.int32(0), on, None)), b_cur)
  for on in (jnp.ones((1,), jnp.int32), jnp.zeros((1,), jnp.int32)):
    want, got, b_cur = both(on)
    assert np.array_equal(bits(b_cur[0]), bits(b_st[3]))
    assert np.array_equal(bits(got), bits(want))


def test_dense_lora_rank_scale_and_many_rows_take_the_reference():
  """The per-row adapter table scales h before B; more rows than the kernel takes run
  `dense_lora_reference` (no kernel), whose off rows are `dense_reference`'s bits."""
  from pallas_kernels.quant import dense_reference
  from pallas_kernels.quant.api import DENSE_ROWS_MAX, dense_matmul_lora
  rng = np.random.default_rng(7)
  n, rank = DENSE_ROWS_MAX + 2, 12
  w = jnp.asarray(rng.standard_normal((3, OUT, 64)), F32)
  x = _x(n, 64, F32)
  a, b, on = _lora(n, 64, OUT, rank, F32, "mixed")
  rs = rng.uniform(0, 2, (n, rank)).astype(np.float32)
  f = lambda x: dense_matmul_lora(x, w, jnp.int32(2), jnp.asarray(a), jnp.asarray(b),
                                  jnp.asarray(on), rank_scale=jnp.asarray(rs),
                                  implementation="pallas_interpret")
  got = np.asarray(f(jnp.asarray(x)))
  assert "qgemv_dense" not in str(jax.make_jaxpr(f)(jnp.asarray(x)))
  off = on == 0
  assert np.array_equal(bits(got[off]), bits(np.asarray(
      dense_reference(jnp.asarray(x), w, jnp.int32(2)))[off]))
  f64 = np.float64
  want = x.astype(f64) @ np.asarray(w[2], f64).T + (
      (x.astype(f64) @ a.astype(f64).T) * rs) @ b.astype(f64).T
  assert_close(got[~off], want[~off], rel=_tol(F32), what="rank-scaled dense lora")
  with pytest.raises(ValueError, match="dense lora"):
    dense_matmul_lora(jnp.asarray(x), w, jnp.int32(2), jnp.asarray(a), jnp.asarray(b),
                      jnp.asarray(on[:1]))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_gpu_dense_gemv_lora_rows(dtype):
  """ssm_out's shape at batch 1 (2048 x 4096, split sums) compiled, the adapter a stack read
  at its index: the on row within the float64 product's tolerance, the off row
  `dense_matmul`'s bits."""
  from pallas_kernels.quant import dense_matmul
  from pallas_kernels.quant.api import dense_matmul_lora
  rng = np.random.default_rng(8)
  w = np.asarray(jnp.asarray(0.02 * rng.standard_normal((3, 2048, 4096)), dtype))
  x = _x(1, 4096, dtype)
  a, b, _ = _lora(1, 4096, 2048, 50, dtype, "all")
  a_st, b_st = (jnp.asarray(np.stack([np.zeros_like(v), v])) for v in (a, b))
  args = (jnp.asarray(x), jnp.asarray(w), jnp.int32(2))
  plain = np.asarray(dense_matmul(*args, implementation="pallas"))
  for on in (np.ones(1, np.int32), np.zeros(1, np.int32)):
    got = np.asarray(dense_matmul_lora(*args, a_st, b_st, jnp.asarray(on), lora_index=1,
                                       implementation="pallas"))
    if on[0]:
      f64 = np.float64
      want = _want(x, np.asarray(w[2], f64)) + (x.astype(f64) @ a.astype(f64).T) @ b.astype(
          f64).T
      assert_close(got, want, rel=_tol(dtype), what="gpu dense lora on")
    else:
      assert np.array_equal(bits(got), bits(plain))


# A mixed-type stack (a QGroups' parts) in one launch (Forms.quant_groups="fused").
def _parts(out=OUT, blocks=2, lead=((2,), (3,))):
  return tuple(jax.device_put(_weight(q, lead=ld, out=out, blocks=blocks, seed=20 + i)[0])
               for i, (q, ld) in enumerate(zip(("q4_k", "q6_k"), lead)))


@pytest.mark.parametrize("n,dtype", [(1, F32), (3, BF16), (ROWS_MAX + 1, F32)])
def test_mixed_stack_in_one_launch_gives_each_parts_own_numbers(n, dtype):
  """qmatmul / qmatmul_lora over (Q4_K, Q6_K) parts with the part a traced index: for a few
  rows one launch (its jaxpr holds the groups kernel), more rows each part's call gated and a
  select; either way the chosen part's own call, bit for bit, LoRA off rows included."""
  parts = _parts()
  d_in = parts[0].shape[-1]
  x = jnp.asarray(_x(n, d_in, dtype))
  a, b, on = _lora(n, d_in, OUT, 8, dtype, "mixed")
  kw = dict(implementation="pallas_interpret")
  f = jax.jit(lambda x, g, i: qmatmul(x, parts, index=i, group=g, **kw))
  fl = jax.jit(lambda x, g, i: qmatmul_lora(x, parts, jnp.asarray(a), jnp.asarray(b),
                                            jnp.asarray(on), index=i, group=g, **kw))
  for g, i in ((0, 1), (1, 2), (1, 0)):
    want = qmatmul(x, parts[g], index=jnp.int32(i), **kw)
    assert np.array_equal(bits(f(x, jnp.int32(g), jnp.int32(i))), bits(want))
    want_l = qmatmul_lora(x, parts[g], jnp.asarray(a), jnp.asarray(b), jnp.asarray(on),
                          index=jnp.int32(i), **kw)
    assert np.array_equal(bits(fl(x, jnp.int32(g), jnp.int32(i))), bits(want_l))
  closed = jax.make_jaxpr(f)(x, jnp.int32(0), jnp.int32(0))
  assert ("qgemv_groups" in str(closed)) == (n <= ROWS_MAX)
  # more rows: gated calls and a select, no XLA conditional (a host round trip on the GPU)
  assert "cond" not in _xla_primitives(closed.jaxpr)


@pytest.mark.parametrize("qtype,n,dtype", [("q4_k", 1, F32), ("q6_k", 2, BF16),
                                            ("q8_0", 3, F32), ("mixed", 1, F32)])
def test_qmatmul_lora_rows_read_the_adapter_stacks_in_place(qtype, n, dtype):
  """`qmatmul_lora` with stacks and `lora_index` for a few rows: A's rows in the quantised
  GEMV's launch and the finish (the groups kernel for a mixed-type stack), no slice of the
  adapter's stacks in the program; off rows are `qmatmul`'s bits, on rows within the float64
  product's tolerance (rank scales applied to h), the same numbers as the pair taken out."""
  rank, lay = 12, 2
  if qtype == "mixed":
    w, group, index = _parts(), jnp.int32(1), jnp.int32(2)
    w64 = None
  else:
    qt, w64 = _weight(qtype)
    w, group, index = jax.device_put(qt), None, jnp.int32(1)
  d_in = (w[0] if isinstance(w, tuple) else w).shape[-1]
  x = jnp.asarray(_x(n, d_in, dtype))
  pairs = [_lora(n, d_in, OUT, rank, dtype, "mixed", seed=40 + i) for i in range(3)]
  a_st = jnp.asarray(np.stack([p[0] for p in pairs]))
  b_st = jnp.asarray(np.stack([p[1] for p in pairs]))
  on = jnp.asarray(pairs[0][2] if n > 1 else np.ones(1, np.int32))
  rs = jnp.asarray(np.random.default_rng(3).uniform(0, 2, (n, rank)).astype(np.float32))
  kw = dict(implementation="pallas_interpret", index=index, group=group)
  f = jax.jit(lambda x, li, on: qmatmul_lora(x, w, a_st, b_st, on, rank_scale=rs,
                                             lora_index=li, **kw))
  got = np.asarray(f(x, jnp.int32(lay), on))
  jaxpr = str(jax.make_jaxpr(f)(x, jnp.int32(lay), on))
  assert "lora_rows" in jaxpr and "lora_finish" in jaxpr
  dt = "f32" if dtype == F32 else "bf16"   # no pair of the stacks is taken out
  assert f"{dt}[{rank},{d_in}]" not in jaxpr and f"{dt}[{OUT},{rank}]" not in jaxpr
  plain = np.asarray(qmatmul(x, w, **kw))
  off = np.asarray(on) == 0
  assert np.array_equal(bits(got[off]), bits(plain[off])), "off rows differ from qmatmul"
  all_off = np.asarray(f(x, jnp.int32(lay), jnp.zeros_like(on)))
  assert np.array_equal(bits(all_off), bits(plain)), "switched off differs from qmatmul"
  pair = np.asarray(qmatmul_lora(x, w, a_st[lay], b_st[lay], on, rank_scale=rs, **kw))
  assert_close(got[~off], pair[~off], rel=_tol(dtype), what=f"{qtype} rows vs pair")
  if w64 is not None:
    f64 = np.float64
    a, b = np.asarray(a_st[lay], f64), np.asarray(b_st[lay], f64)
    xf = np.asarray(x, f64)
    want = _want(np.asarray(x), w64[1]) + ((xf @ a.T) * np.asarray(rs)) @ b.T
    assert_close(got[~off], want[~off], rel=_tol(dtype), what=f"{qtype} lora rows N{n}")


def test_qmatmul_lora_rows_leave_many_rows_and_xla_to_the_pair():
  """More rows than the "blocks" form takes, or "xla": the pair at lora_index is taken out
  and the call is `qmatmul_lora` on it, bit for bit."""
  qt, _ = _weight("q4_k")
  w = jax.device_put(qt)
  rank, n = 8, ROWS_MAX + 1
  x = jnp.asarray(_x(n, qt.shape[-1], F32))
  pairs = [_lora(n, qt.shape[-1], OUT, rank, F32, "mixed", seed=50 + i) for i in range(2)]
  a_st = jnp.asarray(np.stack([p[0] for p in pairs]))
  b_st = jnp.asarray(np.stack([p[1] for p in pairs]))
  on = jnp.asarray(pairs[0][2])
  for impl, rows in (("pallas_interpret", x), ("xla", x[:1])):
    kw = dict(implementation=impl, index=jnp.int32(1))
    got = qmatmul_lora(rows, w, a_st, b_st, on[:rows.shape[0]], lora_index=jnp.int32(1), **kw)
    want = qmatmul_lora(rows, w, a_st[1], b_st[1], on[:rows.shape[0]], **kw)
    assert np.array_equal(bits(got), bits(want))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("qtype", ["q4_k", "q5_k"])
def test_gpu_qmatmul_lora_rows(qtype):
  """ssm_out's shape (2048 x 4096) compiled at one row, bf16, rank 64: the on row within the
  float64 product's tolerance, the off row `qmatmul`'s bits."""
  raw = random_raw(qtype, (2, 2048, 4096), seed=11)
  qt = jax.device_put(pack(raw, qtype, (2, 2048, 4096)))
  w64 = gguf_dequantize(raw, qtype).astype(np.float64)
  x = _x(1, 4096, BF16)
  a, b, _ = _lora(1, 4096, 2048, 64, BF16, "all")
  a_st, b_st = (jnp.asarray(np.stack([np.zeros_like(v), v])) for v in (a, b))
  kw = dict(implementation="pallas", index=jnp.int32(1))
  plain = np.asarray(qmatmul(jnp.asarray(x), qt, **kw))
  for on in (np.ones(1, np.int32), np.zeros(1, np.int32)):
    got = np.asarray(qmatmul_lora(jnp.asarray(x), qt, a_st, b_st, jnp.asarray(on),
                                  lora_index=jnp.int32(1), **kw))
    if on[0]:
      f64 = np.float64
      want = _want(x, w64[1]) + (np.asarray(x, f64) @ a.astype(f64).T) @ b.astype(f64).T
      assert_close(got, want, rel=_tol(BF16), what=f"gpu {qtype} lora rows on")
    else:
      assert np.array_equal(bits(got), bits(plain))


def _xla_primitives(jaxpr):
  """Primitive names of a jaxpr and its nested jaxprs, not looking inside Pallas kernels."""
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    if eqn.primitive.name == "pallas_call":
      continue
    for sub in jaxprs_in_params(eqn.params):
      names |= _xla_primitives(sub)
  return names


def _mixed_expert_parts(d, f, n_experts, seed):
  """{"g", "u", "d": (Q4_K stack of 2 layers, Q6_K stack of 1)} of [layers, E, out, in]
  expert matrices (gate / up [f, d], down [d, f])."""
  parts = {}
  for name, (o, i) in (("g", (f, d)), ("u", (f, d)), ("d", (d, f))):
    parts[name] = tuple(jax.device_put(pack(r, q, r.shape[:-1] + (i,))) for q, r in (
        ("q4_k", random_raw("q4_k", (2, n_experts, o, i), seed=seed)),
        ("q6_k", random_raw("q6_k", (1, n_experts, o, i), seed=seed + 1))))
  return parts


def test_mixed_expert_stacks_in_one_launch_give_each_parts_own_numbers():
  d = 256
  parts = _mixed_expert_parts(d, 256, 3, seed=31)
  x = jnp.asarray(_x(2, d, F32))
  idx = jnp.asarray([[0, 2], [1, 1]], jnp.int32)
  wts = jnp.full((2, 2), 0.5, F32)
  kw = dict(implementation="pallas_interpret")
  for pair in (False, True):   # the gate and the up in launches of their own, or in one
    fused = jax.jit(lambda g, lay: experts(x, parts["g"], parts["u"], parts["d"], idx, wts,
                                           layer=lay, group=g, fused=pair, **kw))
    for g, lay in ((0, 1), (1, 0)):
      want = experts(x, parts["g"][g], parts["u"][g], parts["d"][g], idx, wts,
                     layer=jnp.int32(lay), **kw)
      assert np.array_equal(bits(fused(jnp.int32(g), jnp.int32(lay))), bits(want)), pair
  assert "qgemv_groups" in str(jax.make_jaxpr(fused)(jnp.int32(0), jnp.int32(0)))


def test_a_second_stack_in_the_groups_launch_gives_each_stack_its_own_call_bits():
  """qmatmul_groups_pallas with `more` (an expert's gate and up in one launch): one
  pallas_call, and each output is that stack's own call, bit for bit, for either part, at an
  out size that is not a multiple of the tiles."""
  from pallas_kernels.quant.kernel import qmatmul_groups_pallas
  gate, up = _parts(blocks=4), tuple(jax.device_put(_weight(q, lead=ld, out=OUT, blocks=4,
                                                            seed=40 + i)[0])
                                     for i, (q, ld) in enumerate(zip(("q4_k", "q6_k"),
                                                                     ((2,), (3,)))))
  d_in = gate[0].shape[-1]
  x = jnp.asarray(_x(3, d_in, BF16)).reshape(3, 1, d_in)
  kw = dict(qtypes=("q4_k", "q6_k"), d_out=OUT, interpret=True, out_dtype=F32)
  fg, fu = tuple(flat(p) for p in gate), tuple(flat(p) for p in up)
  both = jax.jit(lambda g, i: qmatmul_groups_pallas(x, fg, g, i, more=(fu,), **kw))
  for g, i in ((0, [1, 0, 1]), (1, [2, 0, 1])):
    idx = jnp.asarray(i, jnp.int32)
    got_g, got_u = both(jnp.int32(g), idx)
    assert np.array_equal(bits(got_g), bits(qmatmul_groups_pallas(x, fg, g, idx, **kw)))
    assert np.array_equal(bits(got_u), bits(qmatmul_groups_pallas(x, fu, g, idx, **kw)))
  jaxpr = jax.make_jaxpr(both)(jnp.int32(0), jnp.zeros((3,), jnp.int32)).jaxpr
  assert len(kernel_names(jaxpr)) == 1
  compiled = jax.jit(lambda g, i: qmatmul_groups_pallas(x, fg, g, i, more=(fu,),
                                                        **{**kw, "interpret": False}))
  low = compiled.trace(jnp.int32(0), jnp.zeros((3,), jnp.int32)).lower(
      lowering_platforms=("cuda",))
  assert "xla.gpu.triton" in low.as_text()


def test_mixed_expert_stacks_run_gate_and_up_in_one_launch():
  """The routed experts over mixed-type stacks: fused, two launches (gate with up, then
  down); else three."""
  d = 256
  parts = _mixed_expert_parts(d, 256, 3, seed=51)
  x = jnp.asarray(_x(1, d, BF16))
  for fused, launches in ((True, 2), (False, 3)):
    run = lambda g, lay: experts(x, parts["g"], parts["u"], parts["d"],
                                 jnp.asarray([[0, 2]], jnp.int32), jnp.full((1, 2), 0.5, F32),
                                 layer=lay, group=g, implementation="pallas_interpret",
                                 fused=fused)
    jaxpr = jax.make_jaxpr(run)(jnp.int32(0), jnp.int32(0)).jaxpr
    assert len(kernel_names(jaxpr)) == launches, fused


def test_one_launch_over_a_layers_quantised_products_gives_each_its_own_call_bits():
  """qmatmul_multi over a Q8_0 stack, a Q5_K stack of an odd out size and a mixed-type stack
  (Q4_K, Q6_K) at its part: one pallas_call, each product `qmatmul`'s own bits, for 1 and 3
  rows; it lowers to Triton for the GPU."""
  from pallas_kernels.quant import qmatmul_multi
  blocks = 8
  q5 = jax.device_put(_weight("q5_k", lead=(3,), out=OUT, blocks=blocks, seed=62)[0])
  d_in = q5.shape[-1]
  q8 = jax.device_put(pack(random_raw("q8_0", (3, 64, d_in), seed=61), "q8_0", (3, 64, d_in)))
  mixed = _parts(blocks=blocks)
  for n, dtype in ((1, BF16), (3, F32)):
    x = jnp.asarray(_x(n, q5.shape[-1], dtype))
    run = jax.jit(lambda x, i, g: qmatmul_multi(
        x, [(q8, i, None), (q5, i, None), (mixed, i, g)], implementation="pallas_interpret"))
    for i, g in ((1, 0), (2, 1)):
      got = run(x, jnp.int32(i), jnp.int32(g))
      want = [qmatmul(x, q8, index=jnp.int32(i), implementation="pallas_interpret"),
              qmatmul(x, q5, index=jnp.int32(i), implementation="pallas_interpret"),
              qmatmul(x, mixed, index=jnp.int32(i), group=jnp.int32(g),
                      implementation="pallas_interpret")]
      for k, (a, b) in enumerate(zip(got, want)):
        assert np.array_equal(bits(a), bits(b)), f"product {k}, {n} rows, part {g}"
    assert len(kernel_names(jax.make_jaxpr(run)(x, jnp.int32(0), jnp.int32(0)).jaxpr)) == 1
  from pallas_kernels.quant.kernel import MultiMat, qmatmul_multi_pallas
  compiled = jax.jit(lambda x, i, g: qmatmul_multi_pallas(x, [
      MultiMat("q8_0", flat(q8), i, 64), MultiMat("q5_k", flat(q5), i, OUT),
      MultiMat(("q4_k", "q6_k"), tuple(flat(p) for p in mixed), i, OUT, g)]))
  low = compiled.trace(jnp.ones((1, q5.shape[-1]), BF16), jnp.int32(0), jnp.int32(0)).lower(
      lowering_platforms=("cuda",))
  assert "xla.gpu.triton" in low.as_text()


def test_mixed_stack_kernel_lowers_to_triton_for_the_gpu():
  from pallas_kernels.quant.kernel import qmatmul_groups_pallas
  parts = _parts(blocks=4)
  d_in = parts[0].shape[-1]
  f = lambda x, p, g, i: qmatmul_groups_pallas(x, p, g, i, qtypes=("q4_k", "q6_k"), d_out=OUT,
                                               on=jnp.ones((2,), jnp.int32),
                                               h=jnp.ones((2, 8), F32), b=jnp.ones((OUT, 8), BF16))
  low = jax.jit(f).trace(jnp.ones((1, 2, d_in), BF16), tuple(flat(p) for p in parts),
                         jnp.int32(1), jnp.zeros((1,), jnp.int32)).lower(
      lowering_platforms=("cuda",))
  assert "xla.gpu.triton" in low.as_text()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n,dtype", [(1, BF16), (2, F32)])
def test_gpu_mixed_stack_in_one_launch(n, dtype):
  parts = _parts(out=328, blocks=8)
  x = jnp.asarray(_x(n, parts[0].shape[-1], dtype))
  for g, i in ((0, 1), (1, 2)):
    got = qmatmul(x, parts, index=jnp.int32(i), group=jnp.int32(g), implementation="pallas")
    want = qmatmul(x, parts[g], index=jnp.int32(i), implementation="pallas")
    assert np.array_equal(bits(got), bits(want)), f"part {g}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n,dtype", [(1, BF16), (3, F32)])
def test_gpu_one_launch_over_a_layers_products_and_the_experts_gate_with_up(n, dtype):
  """Compiled: qmatmul_multi over Q8_0, Q5_K (odd out) and a mixed stack gives each
  product's own call's bits; the experts over mixed stacks (gate and up in one launch) give
  each part's own experts' bits."""
  from pallas_kernels.quant import qmatmul_multi
  q5 = jax.device_put(_weight("q5_k", lead=(3,), out=328, blocks=8, seed=62)[0])
  d_in = q5.shape[-1]
  q8 = jax.device_put(pack(random_raw("q8_0", (3, 64, d_in), seed=61), "q8_0", (3, 64, d_in)))
  mixed = _parts(out=328, blocks=8)
  x = jnp.asarray(_x(n, d_in, dtype))
  for i, g in ((1, 0), (2, 1)):
    i, g = jnp.int32(i), jnp.int32(g)
    got = qmatmul_multi(x, [(q8, i, None), (q5, i, None), (mixed, i, g)],
                        implementation="pallas")
    want = [qmatmul(x, q8, index=i, implementation="pallas"),
            qmatmul(x, q5, index=i, implementation="pallas"),
            qmatmul(x, mixed, index=i, group=g, implementation="pallas")]
    for k, (a, b) in enumerate(zip(got, want)):
      assert np.array_equal(bits(a), bits(b)), f"product {k}, part {int(g)}"
  d = 512
  parts = _mixed_expert_parts(d, 512, 4, seed=71)
  xe = jnp.asarray(_x(n, d, dtype))
  idx = jnp.asarray(np.arange(2 * n).reshape(n, 2) % 4, jnp.int32)
  wts = jnp.full((n, 2), 0.5, F32)
  for g, lay in ((0, 1), (1, 0)):
    got = experts(xe, parts["g"], parts["u"], parts["d"], idx, wts, layer=jnp.int32(lay),
                  group=jnp.int32(g), implementation="pallas", fused=True)
    want = experts(xe, parts["g"][g], parts["u"][g], parts["d"][g], idx, wts,
                   layer=jnp.int32(lay), implementation="pallas")
    assert np.array_equal(bits(got), bits(want)), f"experts, part {g}"


def test_mixed_stack_without_group_is_refused():
  parts = _parts()
  x = jnp.ones((1, parts[0].shape[-1]), F32)
  with pytest.raises(ValueError, match="needs at least one part and group="):
    qmatmul(x, parts, index=jnp.int32(0), implementation="pallas_interpret")


def test_dense_defaults_narrow_the_steps_of_a_small_matrix_to_fill_the_grid():
  """512 programs where the matrix allows: bench-a3b's ssm_out splits `in` 4 ways at 512
  columns a step; the shared expert's down projection (512 columns: one step) takes 128-column
  steps and a 4-way split instead of 128 one-step programs; never below MIN_STEP_COLS."""
  from pallas_kernels.quant import gemv
  assert gemv.dense_defaults(2048, 4096) == (16, 16, 4)
  assert gemv.dense_defaults(8192, 2048) == (16, 16, 1)
  assert gemv.dense_defaults(2048, 512) == (16, 4, 4)
  bo, unroll, ks = gemv.dense_defaults(64, 2048)   # the router: 4 tiles
  assert unroll * gemv.DENSE_UNIT == gemv.MIN_STEP_COLS and ks == 8
  assert gemv.dense_defaults(2048, 512, interpret=True)[2] == 1
