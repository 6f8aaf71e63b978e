"""`Forms`: implementation choices are configuration that jit keys its programs on."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_walk import eqns
from model_fixtures import TINY, random_lora, tiny_model
from tolerances import (
    ATTN_DECODE_REL_FP32,
    ATTN_PREFILL_REL_FP32,
    DENSE_GEMV_REL_FP32,
    GATED_NORM_REL_FP32,
    assert_close,
)

import strata_jax as sj
from strata_jax import steps
from strata_jax.forms import CHOICES, Forms, parse_forms
from strata_jax.params import empty_lora
from strata_jax.state import init_state


def test_unknown_form_value_is_refused_naming_the_field():
  with pytest.raises(ValueError, match="lora_branch='maybe'"):
    Forms(lora_branch="maybe")


def test_parse_forms_reads_name_value_pairs_and_refuses_unknown_names():
  f = parse_forms("lora_branch=select, gdn_chunked=products,gdn_pallas_chunk=64")
  assert (f.lora_branch, f.gdn_chunked, f.gdn_pallas_chunk) == ("select", "products", 64)
  with pytest.raises(ValueError, match="expected NAME=VALUE"):
    parse_forms("speed=fast")
  with pytest.raises(ValueError, match="gdn_chunked='fast'"):
    parse_forms("gdn_chunked=fast")


def test_resolve_replaces_auto_per_backend_and_dtype():
  cpu = Forms().resolve("cpu", jnp.float32)
  assert (cpu.gdn_chunked, cpu.gdn_decode, cpu.moe_many, cpu.moe_few, cpu.lora_impl) == (
      "reference", "xla", "dense", "xla", "pallas_interpret")
  assert (cpu.quant_impl, cpu.quant_groups, cpu.dense_weights) == ("xla", "switch", "scan")
  assert cpu.moe_topk == "xla"
  assert cpu.matmul_precision == "highest" and cpu.jax_precision(jnp.float32) == "highest"
  assert Forms().jax_precision(jnp.float32) == "highest", "unresolved auto: fp32 is full fp32"
  gpu = Forms().resolve("gpu", jnp.bfloat16)
  assert (gpu.gdn_chunked, gpu.moe_many, gpu.moe_few) == ("pallas_split", "pallas", "pallas")
  assert (gpu.gdn_pallas_chunk, cpu.gdn_pallas_chunk) == (64, 32)  # each kernel's measured chunk
  assert Forms(gdn_chunked="pallas").resolve("gpu", jnp.bfloat16).gdn_pallas_chunk == 32
  assert Forms(gdn_pallas_chunk=16).resolve("gpu", jnp.bfloat16).gdn_pallas_chunk == 16
  assert (gpu.quant_impl, gpu.quant_groups, gpu.dense_weights) == ("pallas", "fused", "kernel")
  assert (gpu.gemv_lora, cpu.gemv_lora) == ("rows_dense", "rows")   # measured: forms.py
  assert gpu.gdn_decode == "auto"       # by the batch: pallas_kernels.gdn.api.decode_form
  assert gpu.moe_topk == "pallas"                    # measured: forms.py's comment
  assert (gpu.attn_decode, cpu.attn_decode) == ("pallas", "xla")   # measured: forms.py
  assert (gpu.proj_finish, cpu.proj_finish) == ("gemv", "xla")     # measured: forms.py
  assert (gpu.dense_launch, cpu.dense_launch) == ("fused", "fused")   # the same numbers
  assert (gpu.quant_launch, cpu.quant_launch) == ("fused", "apart")   # run 87
  # taps measured faster and the same bits, in_op slower (forms.py); named, they stay
  assert (gpu.gdn_conv, gpu.gdn_gated_norm, cpu.gdn_conv) == ("taps", "after", "concat")
  named = parse_forms("gdn_conv=concat,gdn_gated_norm=in_op").resolve("gpu", jnp.bfloat16)
  assert (named.gdn_conv, named.gdn_gated_norm) == ("concat", "in_op")
  assert Forms().resolve("gpu", jnp.float32).attn_decode == "xla"   # forms.py says why
  # the prefill kernel: the op picks it per cache dtype and head size (pallas_kernels/attention)
  assert (gpu.attn_prefill, cpu.attn_prefill) == ("auto", "xla")
  assert Forms().resolve("gpu", jnp.float32).attn_prefill == "xla"
  assert gpu.lora_impl == "auto"                     # chosen per batch size, as the api says
  assert gpu.matmul_precision == "default" and gpu.jax_precision(jnp.bfloat16) is None
  tf32 = Forms(matmul_precision="tf32").resolve("gpu", jnp.float32)
  assert tf32.jax_precision(jnp.float32) == "tensorfloat32"
  assert cpu.resolve("cpu", jnp.float32) == cpu
  assert all(getattr(Forms(), f) == CHOICES[f][0] for f in CHOICES)


def test_two_engines_with_different_forms_run_their_own_programs():
  """No cache clearing: an engine built with other forms compiles its own programs, and each
  engine keeps getting its own numbers afterwards."""
  model = tiny_model()
  prompt = list(range(3, 70))
  ref = sj.Engine(model, slots=1, max_seq=128, block_size=32)
  prod = sj.Engine(model, slots=1, max_seq=128, block_size=32,
                   forms=Forms(gdn_chunked="products"))
  assert prod.cfg != ref.cfg and ref.cfg == model.cfg
  a = ref.generate(tokens=prompt, max_tokens=2, return_logits=True)
  # the prompt's chunk program: `prefill`, or `prefill_cut` where a chunk holds a state point
  programs = lambda: steps.prefill._cache_size() + steps.prefill_cut._cache_size()
  n = programs()
  b = prod.generate(tokens=prompt, max_tokens=2, return_logits=True)
  assert programs() > n, "other forms compile another program"
  # the products form rounds differently from the reference triangular solve
  assert not np.array_equal(a.prompt_logits, b.prompt_logits)
  np.testing.assert_allclose(a.prompt_logits, b.prompt_logits, atol=1e-4)
  again = ref.generate(tokens=prompt, max_tokens=2, return_logits=True)
  assert np.array_equal(again.prompt_logits, a.prompt_logits)


def _dot_precisions(forms):
  cfg = dataclasses.replace(TINY, forms=forms.resolve(jax.default_backend(), jnp.float32))
  model = tiny_model()
  state = init_state(cfg, 2, 64)
  text = steps.decode.lower(cfg, model.params, empty_lora(cfg), state, jnp.zeros(2, jnp.int32),
                            jnp.zeros(2, jnp.int32), jnp.ones(2, jnp.int32)).as_text()
  # A compiled Pallas kernel is one custom-call line whose serialized IR carries its dots'
  # names (experiments/bench/fp32_dots_probe.py); its own fp32 dots are checked against
  # float64 by its kernel tests. These are XLA's dots.
  return [line for line in text.splitlines()
          if "dot_general" in line and "custom_call" not in line]


def test_float32_programs_ask_for_full_fp32_dots_unless_tf32_is_named():
  full = _dot_precisions(Forms())
  assert full and all("HIGHEST" in line for line in full), "every fp32 dot at HIGHEST"
  tf32 = _dot_precisions(Forms(matmul_precision="tf32"))
  assert any("HIGHEST" not in line for line in tf32), "tf32 leaves the model's dots reduced"


def _decode_jaxpr(model, forms):
  cfg = dataclasses.replace(TINY, forms=forms.resolve(jax.default_backend(), jnp.float32))
  return str(jax.make_jaxpr(lambda p, s: steps.decode(
      cfg, p, empty_lora(cfg), s, jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32),
      jnp.ones(1, jnp.int32)))(model.params, init_state(cfg, 1, 64)))


def test_dense_weights_kernel_decodes_the_scanned_forms_tokens_and_keeps_off_bit_identical():
  """`dense_weights="kernel"` (the GEMV kernel, under the interpreter here, reads each layer's
  matrix in place at decode): the prompt (too many rows for the kernel: XLA on the indexed
  matrix) is the scanned form's bit for bit, decode steps within fp32 summation order with
  the same tokens, and the adapter switched off is the no-adapter engine of the same forms
  bit for bit."""
  model = tiny_model()
  lora = random_lora()
  prompt = list(range(3, 70))
  kernel = Forms(dense_weights="kernel", quant_impl="pallas_interpret")
  program = _decode_jaxpr(model, kernel)
  assert "qgemv_dense" in program
  assert "qgemv_dense_multi" in program   # dense_launch "auto": a layer's inputs in one launch
  # (the layers' projections: the head has its own form, "kernel" on the GPU)
  assert "qgemv_dense" not in _decode_jaxpr(model, Forms(dense_weights="in_place", head="xla"))
  run = lambda forms, lo, on: sj.Engine(model, lora=lo, slots=1, max_seq=128, block_size=32,
                                        forms=forms).generate(
      tokens=prompt, max_tokens=4, return_logits=True, return_step_logits=True, lora=on)
  got = {}
  for on in (False, True):
    ref, got[on] = run(Forms(), lora, on), run(kernel, lora, on)
    assert np.array_equal(got[on].prompt_logits, ref.prompt_logits)
    assert got[on].tokens == ref.tokens
    assert_close(got[on].step_logits, ref.step_logits, rel=DENSE_GEMV_REL_FP32,
                 what=f"kernel decode, adapter {'on' if on else 'off'}")
  off, bare = got[False], run(kernel, None, None)
  assert np.array_equal(off.step_logits, bare.step_logits) and off.tokens == bare.tokens


@pytest.mark.parametrize("impl", [
    "pallas_interpret",
    pytest.param("pallas", marks=pytest.mark.skipif(jax.default_backend() != "gpu",
                                                     reason="the compiled kernel needs a GPU"))])
def test_attn_decode_kernel_decodes_the_xla_forms_tokens_and_leaves_the_prompt_to_xla(impl):
  """`attn_decode` naming the kernel (interpreted; compiled on a GPU, in this fp32 model): a
  decode step's attention is the kernel (reading the cache stack in place, keys up to each
  row's position), the prompt's several positions stay XLA's bit for bit, and decoding gives
  the XLA form's tokens with logits to fp32 summation order (adapter on; attention is not
  adapted)."""
  model = tiny_model()
  lora = random_lora()
  prompt = list(range(3, 40))
  kernel = Forms(attn_decode=impl)
  assert "attn_decode" in _decode_jaxpr(model, kernel)
  run = lambda forms: sj.Engine(model, lora=lora, slots=1, max_seq=128, block_size=32,
                                forms=forms).generate(
      tokens=prompt, max_tokens=3, return_logits=True, return_step_logits=True, lora=True)
  ref, got = run(Forms()), run(kernel)
  assert np.array_equal(got.prompt_logits, ref.prompt_logits)
  assert got.tokens == ref.tokens
  assert_close(got.step_logits, ref.step_logits, rel=ATTN_DECODE_REL_FP32,
               what="attention kernel decode")


@pytest.mark.parametrize("impl", [
    "pallas_interpret",
    pytest.param("pallas", marks=pytest.mark.skipif(jax.default_backend() != "gpu",
                                                     reason="the compiled kernel needs a GPU"))])
def test_attn_prefill_kernel_prefills_to_the_xla_forms_logits_and_tokens(impl):
  """`attn_prefill` naming the kernel (interpreted; compiled on a GPU, in this fp32 model):
  the prompt's attention is the kernel's, in two chunks (the second after a cached prefix),
  with the XLA form's prompt logits to fp32 summation order and its tokens (adapter on)."""
  model = tiny_model()
  lora = random_lora()
  prompt = list(range(3, 60))
  kernel = Forms(attn_prefill=impl)
  run = lambda forms: sj.Engine(model, lora=lora, slots=1, max_seq=128, block_size=32,
                                max_prefill_chunk=32, forms=forms).generate(
      tokens=prompt, max_tokens=3, return_logits=True, return_step_logits=True, lora=True)
  ref, got = run(Forms()), run(kernel)
  assert_close(got.prompt_logits, ref.prompt_logits, rel=ATTN_PREFILL_REL_FP32,
               what="attention kernel prefill")
  assert got.tokens == ref.tokens
  assert_close(got.step_logits, ref.step_logits, rel=ATTN_PREFILL_REL_FP32,
               what="decode after the kernel's prefill")


def test_gemv_lora_rows_take_the_adapter_into_the_gemv_launch_and_apart_keeps_its_ops():
  """At one row with the in-place GEMV, `gemv_lora="rows"` computes the adapter in the
  GEMV's launch and the LoRA finishing kernel (`proj_finish="xla"`): no LoRA dot and no slice
  of the adapter's stacks in the program; "apart" keeps the LoRA ops (h = A x, then B h) after
  the plain GEMV."""
  model = tiny_model()
  lora = random_lora(rank=5).params   # a rank no other dimension of TINY has

  def decode_jaxpr(gemv_lora):
    forms = Forms(dense_weights="kernel", quant_impl="pallas_interpret", lora_impl="xla",
                  gemv_lora=gemv_lora, proj_finish="xla").resolve(jax.default_backend(),
                                                                   jnp.float32)
    cfg = dataclasses.replace(TINY, forms=forms)
    return jax.make_jaxpr(lambda p, s: steps.decode(
        cfg, p, lora, s, jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32), jnp.ones(1, jnp.int32),
        branch="on"))(model.params, init_state(cfg, 1, 64))

  def lora_ops(jaxpr, name):
    return sum(e.primitive.name == name
               and any(5 in v.aval.shape for v in (*e.invars, *e.outvars))
               for e in eqns(jaxpr.jaxpr, into_kernels=False))

  gemv, after = decode_jaxpr("rows"), decode_jaxpr("apart")
  assert lora_ops(gemv, "dot_general") == 0 and lora_ops(after, "dot_general") > 0
  assert lora_ops(gemv, "dynamic_slice") == 0, "an adapter slice in the gemv form"
  assert "qgemv_dense_lora_rows" in str(gemv) and "lora_finish" in str(gemv)
  assert "qgemv_dense_lora_rows" not in str(after)


@pytest.mark.parametrize("table", [False, True])
def test_gemv_lora_rows_off_is_the_bare_model_and_on_is_the_apart_forms_numbers(table):
  """One decode row through the rows form with `lora_branch="select"` (so a switched-off row
  runs the adapter kernels too, its switch 0): off gives the no-adapter program's logits bit
  for bit, on gives the "apart" form's logits within fp32 summation order; with an adapter
  table (rank columns scaled per row) as well. On a GPU the kernels are compiled."""
  model = tiny_model()
  lora = random_lora(rank=6).params
  if table:   # two adapters of 3 columns each; switch 1 takes the second at scale 0.7
    lora = dataclasses.replace(lora, table=jnp.asarray(
        [[0, 0, 0, 0, 0, 0], [0, 0, 0, 0.7, 0.7, 0.7]], jnp.float32))

  def run(gemv_lora, adapter, switch):
    kernels = "pallas" if jax.default_backend() == "gpu" else "pallas_interpret"
    forms = Forms(dense_weights="kernel", quant_impl=kernels, lora_impl="xla",
                  lora_branch="select", gemv_lora=gemv_lora)
    cfg = dataclasses.replace(TINY, forms=forms.resolve(jax.default_backend(), jnp.float32))
    state = init_state(cfg, 1, 64)
    logits = []
    for tok in (5, 9, 13):
      out, state = jax.jit(steps.decode, static_argnums=0)(
          cfg, model.params, adapter, state, jnp.asarray([tok], jnp.int32),
          jnp.asarray([switch], jnp.int32), jnp.ones(1, jnp.int32))
      logits.append(np.asarray(out))
    return np.stack(logits)

  bare = run("rows", None, 0)
  assert np.array_equal(run("rows", lora, 0), bare), "switched off differs from no adapter"
  on, after = run("rows", lora, 1), run("apart", lora, 1)
  assert not np.allclose(on, bare)
  assert_close(on, after, rel=DENSE_GEMV_REL_FP32, what="rows vs apart, adapter on")


@pytest.mark.parametrize("gemv_lora,switch", [("rows_dense", (1, 0, 1)), ("dot", (1,)),
                                               ("dot", (0,))])
def test_dense_dot_lora_off_rows_are_the_bare_model_and_on_rows_as_close_to_fp32_as_apart(
    gemv_lora, switch):
  """A bf16 decode batch through the tensor-core dense kernel (`dense_few="dot"`) with the
  adapter inside its launch (2 or more rows; one row under gemv_lora="dot"), under
  `lora_branch="select"`: switched-off rows give the no-adapter program's logits bit for bit,
  and the program has no finishing kernel. Switched-on rows are no further from the same
  model in fp32 (the bf16 weights and adapter widened exactly) than the "apart" form's bf16
  logits are, within a factor 2: bf16 logits move with every summation order and rounding,
  so the fp32 model is the yardstick for both. On a GPU the kernels are compiled."""
  model = tiny_model(dtype=jnp.bfloat16)
  lora = random_lora(rank=6, dtype=jnp.bfloat16).params
  B = len(switch)
  wide = lambda tree: jax.tree.map(lambda v: v.astype(jnp.float32), tree)

  def run(form, adapter, params=model.params, dtype=jnp.bfloat16, dense_weights="kernel"):
    kernels = "pallas" if jax.default_backend() == "gpu" else "pallas_interpret"
    forms = Forms(dense_weights=dense_weights, quant_impl=kernels, lora_impl="xla",
                  lora_branch="select", gemv_lora=form, dense_few="dot")
    cfg = dataclasses.replace(TINY, forms=forms.resolve(jax.default_backend(), dtype))
    state = init_state(cfg, B, 64, dtype)
    args = (jnp.asarray(switch, jnp.int32), jnp.ones(B, jnp.int32))
    step = jax.jit(steps.decode, static_argnums=0)
    text = str(jax.make_jaxpr(steps.decode, static_argnums=0)(
        cfg, params, adapter, state, jnp.full((B,), 5, jnp.int32), *args))
    logits = []
    for tok in (5, 9, 13):
      out, state = step(cfg, params, adapter, state, jnp.full((B,), tok, jnp.int32), *args)
      logits.append(np.asarray(out, np.float32))
    return np.stack(logits, axis=1), text   # [B, steps, V]

  bare, _ = run(gemv_lora, None)
  got, text = run(gemv_lora, lora)
  assert "dense_dot_lora" in text and "lora_finish" not in text
  on = np.asarray(switch) != 0
  assert np.array_equal(got[~on], bare[~on]), "a switched-off row differs from no adapter"
  if on.any():
    after, _ = run("apart", lora)
    fp32, _ = run("apart", wide(lora), wide(model.params), jnp.float32, "scan")
    gap = lambda a, b: float(np.abs(a[on] - b[on]).max())
    assert gap(after, fp32) > 0
    assert gap(got, fp32) <= 2 * gap(after, fp32), (gap(got, fp32), gap(after, fp32))
    assert gap(got, bare) > 4 * gap(after, fp32), "the adapter's effect is lost in rounding"


@pytest.mark.parametrize("dtype,switch", [(jnp.float32, (1,)), (jnp.bfloat16, (1, 0, 1))])
def test_proj_finish_kernel_gives_the_adapted_step_the_bare_steps_launches_and_off_its_bits(
    dtype, switch):
  """`proj_finish="kernel"`: after each mixer's output projection one kernel adds the split
  sums, the adapter's B h, the residual and the next norm, in every path. One fp32 row (the
  in-place GEMV, A x in its launch) and three bf16 rows (dense_dot, the delta in its launch),
  under `lora_branch="select"`: the adapted program launches as many kernels as the bare one
  and no `lora_finish`; switched-off rows are the bare program's logits bit for bit; on rows
  match the "xla" form (fp32: to summation order; bf16: no further from the fp32 model than
  the "xla" form is, within a factor 2, as the dense_dot test above). On a GPU the kernels
  are compiled."""
  model = tiny_model(dtype=dtype)
  lora = random_lora(rank=6, dtype=dtype).params
  B, on = len(switch), np.asarray(switch) != 0
  kernels = "pallas" if jax.default_backend() == "gpu" else "pallas_interpret"
  wide = lambda tree: jax.tree.map(lambda v: v.astype(jnp.float32), tree)

  def run(finish, adapter, params=model.params, dtype=dtype, dense_weights="kernel"):
    forms = Forms(dense_weights=dense_weights, quant_impl=kernels, lora_impl="xla",
                  lora_branch="select", dense_few="dot", proj_finish=finish)
    cfg = dataclasses.replace(TINY, forms=forms.resolve(jax.default_backend(), dtype))
    state = init_state(cfg, B, 64, dtype)
    args = (jnp.asarray(switch, jnp.int32), jnp.ones(B, jnp.int32))
    text = str(jax.make_jaxpr(steps.decode, static_argnums=0)(
        cfg, params, adapter, state, jnp.full((B,), 5, jnp.int32), *args))
    logits = []
    for tok in (5, 9, 13):
      out, state = jax.jit(steps.decode, static_argnums=0)(
          cfg, params, adapter, state, jnp.full((B,), tok, jnp.int32), *args)
      logits.append(np.asarray(out, np.float32))
    return np.stack(logits, axis=1), text   # [B, steps, V]

  bare, bare_text = run("kernel", None)
  got, text = run("kernel", lora)
  assert "proj_finish" in text and "lora_finish" not in text
  assert text.count("pallas_call") == bare_text.count("pallas_call")
  assert np.array_equal(got[~on], bare[~on]), "a switched-off row differs from no adapter"
  xla, _ = run("xla", lora)
  if dtype == jnp.float32:
    assert_close(got[on], xla[on], rel=DENSE_GEMV_REL_FP32, what="kernel vs xla finish")
  else:
    fp32, _ = run("xla", wide(lora), wide(model.params), jnp.float32, "scan")
    gap = lambda a, b: float(np.abs(a[on] - b[on]).max())
    assert gap(got, fp32) <= 2 * gap(xla, fp32), (gap(got, fp32), gap(xla, fp32))
  assert float(np.abs(got[on] - bare[on]).max()) > 0.1, "the adapter's effect is lost"


def test_proj_finish_gemv_takes_the_kernel_for_one_row_and_xla_for_more():
  """`proj_finish="gemv"` (the GPU's default): a one-row decode step ends each mixer in the
  finishing kernel, a three-row step in XLA's fusions."""
  model = tiny_model(dtype=jnp.bfloat16)
  lora = random_lora(dtype=jnp.bfloat16).params
  kernels = "pallas" if jax.default_backend() == "gpu" else "pallas_interpret"
  forms = Forms(dense_weights="kernel", quant_impl=kernels, proj_finish="gemv")
  cfg = dataclasses.replace(TINY, forms=forms.resolve(jax.default_backend(), jnp.bfloat16))

  def text(rows):
    return str(jax.make_jaxpr(steps.decode, static_argnums=0)(
        cfg, model.params, lora, init_state(cfg, rows, 64, jnp.bfloat16),
        jnp.full((rows,), 5, jnp.int32), jnp.ones(rows, jnp.int32), jnp.ones(rows, jnp.int32)))

  assert "proj_finish" in text(1)
  assert "proj_finish" not in text(3)


def test_proj_finish_gemv_b_copies_b_in_the_projections_launch():
  """`proj_finish="gemv_b"`: a one-row adapted decode step launches the kernels "gemv" does;
  each projection launch (`qgemv_dense_lora_rows`) has a third output, the layer's B
  [1, D, R], and each finishing launch reads a B stack of one (no layer index first). That
  copy is B bit for bit and the finish then gives the indexed finish's bits
  (`test_quant_kernel.py`, `..._copies_the_layers_b_...`), so the logits are "gemv"'s."""
  from jaxpr_walk import eqns, kernel_names
  model = tiny_model(dtype=jnp.bfloat16)
  lora = random_lora(rank=6, dtype=jnp.bfloat16).params
  kernels = "pallas" if jax.default_backend() == "gpu" else "pallas_interpret"

  def jaxpr(finish):
    forms = Forms(dense_weights="kernel", quant_impl=kernels, lora_impl="xla",
                  gemv_lora="rows", proj_finish=finish)
    cfg = dataclasses.replace(TINY, forms=forms.resolve(jax.default_backend(), jnp.bfloat16))
    return jax.make_jaxpr(steps.decode, static_argnums=0)(
        cfg, model.params, lora, init_state(cfg, 1, 64, jnp.bfloat16),
        jnp.full((1,), 5, jnp.int32), jnp.ones(1, jnp.int32), jnp.ones(1, jnp.int32)).jaxpr

  plain, copied = jaxpr("gemv"), jaxpr("gemv_b")
  assert kernel_names(copied) == kernel_names(plain)
  launches = [e for e in eqns(copied, into_kernels=False) if e.primitive.name == "pallas_call"]
  name = lambda e: str(e.params.get("name") or e.params.get("name_and_src_info")).split()[0]
  rows = [e for e in launches if name(e) == "qgemv_dense_lora_rows"]
  finishes = [e for e in launches if name(e) == "proj_finish"]
  D, R = TINY.d_model, 6
  reads_b = lambda e, lead: any(v.aval.shape[1:] == (D, R) and lead(v.aval.shape[0])
                               for v in e.invars if len(v.aval.shape) == 3)
  assert rows and all(len(e.outvars) == 3 and e.outvars[2].aval.shape == (1, D, R)
                      for e in rows)
  # the adapted finishes (the "cond" branch's adapter-free layers finish with no B)
  assert sum(reads_b(e, lambda n: n == 1) for e in finishes) == len(rows)
  assert not any(reads_b(e, lambda n: n > 1) for e in finishes)
  assert not any(len(e.outvars) == 3 for e in eqns(plain, into_kernels=False)
                 if e.primitive.name == "pallas_call" and name(e) == "qgemv_dense_lora_rows")


@pytest.mark.parametrize("dtype,rows,kernel", [(jnp.float32, 1, "qgemv_dense"),
                                               (jnp.bfloat16, 3, "dense_dot")])
def test_head_kernel_takes_the_decode_rows_and_gives_xlas_logits(dtype, rows, kernel):
  """`head="kernel"` (the GPU's default): a decode step's output head runs the in-place dense
  kernel (the GEMV at one row, dense_dot at three bf16 rows) instead of XLA's GEMM, one more
  launch, with "xla"'s logits (fp32: to summation order; bf16: to a bf16 rounding of the
  logits) and its greedy tokens; the adapter switched off still gives the no-adapter logits
  bit for bit. Interpreted here; compiled on a GPU."""
  model = tiny_model(dtype=dtype)
  lora = random_lora(rank=6, dtype=dtype).params
  kernels = "pallas" if jax.default_backend() == "gpu" else "pallas_interpret"

  def run(head, adapter):
    forms = Forms(dense_weights="kernel", quant_impl=kernels, lora_branch="select", head=head)
    cfg = dataclasses.replace(TINY, forms=forms.resolve(jax.default_backend(), dtype))
    state = init_state(cfg, rows, 64, dtype)
    args = (jnp.zeros(rows, jnp.int32), jnp.ones(rows, jnp.int32))
    text = str(jax.make_jaxpr(steps.decode, static_argnums=0)(
        cfg, model.params, adapter, state, jnp.full((rows,), 5, jnp.int32), *args))
    logits = []
    for tok in (5, 9, 13):
      out, state = jax.jit(steps.decode, static_argnums=0)(
          cfg, model.params, adapter, state, jnp.full((rows,), tok, jnp.int32), *args)
      logits.append(np.asarray(out, np.float32))
    return np.stack(logits, axis=1), text

  got, text = run("kernel", None)
  want, xla_text = run("xla", None)
  assert text.count("pallas_call") == xla_text.count("pallas_call") + 1
  assert text.count(kernel) > xla_text.count(kernel)
  rel = DENSE_GEMV_REL_FP32 if dtype == jnp.float32 else 2.0 ** -7
  assert_close(got, want, rel=rel, what="kernel head vs XLA's")
  assert np.array_equal(got.argmax(-1), want.argmax(-1))
  off, _ = run("kernel", lora)
  assert np.array_equal(off, got), "switched off differs from no adapter"


def test_dense_launch_fused_is_the_apart_forms_decode_bit_for_bit():
  """`dense_launch="fused"`: a layer's projections of one input (GDN qkv / gate / ba,
  attention q / k / v, the shared expert's gate / up) run in one launch of the in-place
  kernels (interpreted here; compiled on a GPU), and a decode step's logits are the
  one-launch-each form's bit for bit, adapter on, with fewer launches. Three bf16 rows take
  dense_dot's multi launch; one row takes the GEMV's (`test_dense_weights_kernel_decodes_...`
  checks its program; the kernel tests check each part's bits)."""
  rows, dtype, kernel = 3, jnp.bfloat16, "dense_dot_multi"
  model = tiny_model(dtype=dtype)
  lora = random_lora(dtype=dtype).params
  kernels = "pallas" if jax.default_backend() == "gpu" else "pallas_interpret"

  def run(launch):   # one step (traced once: its jaxpr, then its program)
    forms = Forms(dense_weights="kernel", quant_impl=kernels, dense_launch=launch)
    cfg = dataclasses.replace(TINY, forms=forms.resolve(jax.default_backend(), dtype))
    args = (model.params, lora, init_state(cfg, rows, 64, dtype),
            jnp.full((rows,), 5, jnp.int32), jnp.ones(rows, jnp.int32),
            jnp.ones(rows, jnp.int32))
    traced = jax.jit(steps.decode, static_argnums=0).trace(cfg, *args)
    out, _ = traced.lower().compile()(*args)
    return np.asarray(out, np.float32), str(traced.jaxpr)

  fused, text_f = run("fused")
  apart, text_a = run("apart")
  assert kernel in text_f and kernel not in text_a
  assert text_f.count("pallas_call") < text_a.count("pallas_call")
  assert np.array_equal(fused, apart)


def test_dense_weights_in_place_give_the_scanned_forms_numbers_and_no_scanned_matrix():
  """`dense_weights="in_place"`: the projection matrices are not the layer scan's xs (no
  per-block slice of them to copy) but taken at each layer's index in the body; the prompt
  and decode logits, with the adapter on and off, are bit for bit the scanned form's."""
  model = tiny_model()
  lora = random_lora()
  prompt = list(range(3, 70))
  outs = {}
  for form in ("scan", "in_place"):
    eng = sj.Engine(model, lora=lora, slots=1, max_seq=128, block_size=32,
                    forms=Forms(dense_weights=form))
    outs[form] = [eng.generate(tokens=prompt, max_tokens=4, return_logits=True,
                               return_step_logits=True, lora=on) for on in (False, True)]
  for a, b in zip(outs["scan"], outs["in_place"]):
    assert np.array_equal(a.prompt_logits, b.prompt_logits)
    assert a.step_logits.shape[0] == 4 and a.tokens == b.tokens
    assert np.array_equal(a.step_logits, b.step_logits)
  assert not np.array_equal(outs["scan"][0].prompt_logits, outs["scan"][1].prompt_logits)

  decode_jaxpr = lambda form: _decode_jaxpr(model, Forms(dense_weights=form))
  qkv = model.params.layers.gdn.qkv                 # [6, C, D]: 2 blocks of 3 GDN layers
  blocked = "f32[2,3,{},{}]".format(*qkv.shape[1:])
  assert blocked in decode_jaxpr("scan") and blocked not in decode_jaxpr("in_place")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the refusal is for other backends")
@pytest.mark.parametrize("field,value,instead", [
    ("attn_decode", "pallas", "pallas_interpret"), ("lora_impl", "mosaic", "pallas_interpret"),
    ("gdn_decode", "pallas_layer", "pallas_layer_interpret"),
    ("gdn_chunked", "pallas_split", "pallas_split_interpret")])
def test_compiled_kernel_forms_are_refused_off_the_gpu_when_an_engine_is_built(field, value,
                                                                                instead):
  """A choice that runs a compiled Pallas kernel, named where there is no GPU: a FormsError
  naming the field and what runs instead (the CLI's `error: ...`, exit 2), not a traceback
  from inside the first trace; what it names is accepted."""
  from strata_jax.errors import FormsError
  with pytest.raises(FormsError, match=f"{field}={value!r} runs a compiled Pallas kernel.*use "
                                       f"{instead!r}"):
    sj.Engine(tiny_model(), slots=1, max_seq=32, forms=Forms(**{field: value}))
  sj.Engine(tiny_model(), slots=1, max_seq=32, forms=Forms(**{field: instead}))


def test_gdn_prefill_forms_give_the_default_forms_logits(monkeypatch):
  """The GDN prefill forms against the CPU defaults, the prompt's logits with the adapter off
  and on: `gdn_conv="taps"` (the conv's taps by pad + select, the GPU's default) bit for bit,
  and `gdn_gated_norm="in_op"` under the chunk-parallel kernel (the norm in its output launch,
  which is traced only then) to the fp32 rounding of the norm. (Under the jnp chunked forms
  "in_op" runs the norm after the op, bit for bit: tests/test_gdn_parallel_kernel.py.)"""
  from pallas_kernels.gdn import api as gdn_api
  model = tiny_model()
  prompt = list(range(3, 40))
  traced = []   # the kernel launch with the norm, as traced
  launch = gdn_api.gated_norm_out
  monkeypatch.setattr(gdn_api, "gated_norm_out",
                      lambda *a, **k: traced.append(1) or launch(*a, **k))
  base = dict(gdn_chunked="pallas_split_interpret")
  logits, launches = {}, {}
  for name, extra in (("default", {}), ("taps", {"gdn_conv": "taps"}),
                      ("in_op", {"gdn_gated_norm": "in_op"})):
    traced.clear()
    eng = sj.Engine(model, slots=1, max_seq=64, forms=Forms(**base, **extra), lora=random_lora())
    logits[name] = [eng.generate(tokens=prompt, max_tokens=1, return_logits=True,
                                 lora=on).prompt_logits for on in (False, True)]
    launches[name] = len(traced)
  assert launches == {"default": 0, "taps": 0, "in_op": launches["in_op"]}
  assert launches["in_op"] > 0
  for a, b, c in zip(logits["default"], logits["taps"], logits["in_op"]):
    assert np.array_equal(a, b)
    assert_close(c, a, rel=GATED_NORM_REL_FP32, what="in_op prompt logits")
  assert not np.array_equal(logits["default"][0], logits["default"][1])


def _outside_kernels(cfg, forms, params, primitive):
  """(how many `primitive` eqns the one-row decode step holds outside kernels, its layer
  scans: one a LoRA branch) under `forms`."""
  cfg = dataclasses.replace(cfg, forms=forms.resolve(jax.default_backend(), jnp.float32))
  jaxpr = jax.make_jaxpr(lambda p, s: steps.decode(
      cfg, p, empty_lora(cfg), s, jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32),
      jnp.ones(1, jnp.int32)))(params, init_state(cfg, 1, 64)).jaxpr
  names = [e.primitive.name for e in eqns(jaxpr, into_kernels=False)]
  return names.count(primitive), names.count("scan")


def _decodes_as_xla(model, lora, forms, what, cpu_bits):
  """Engines under forms["xla"] and forms["in"]: the prompt logits bit for bit, the same
  tokens, decode logits bit for bit on CPU where `cpu_bits` (else to fp32 summation order),
  adapter on and off; and off is the no-adapter engine of the same forms bit for bit."""
  run = lambda f, lo, on: sj.Engine(model, lora=lo, slots=1, max_seq=128, block_size=32,
                                    forms=forms[f]).generate(
      tokens=list(range(3, 70)), max_tokens=4, return_logits=True, return_step_logits=True,
      lora=on)
  got = {}
  for on in (False, True):
    ref, got[on] = run("xla", lora, on), run("in", lora, on)
    assert np.array_equal(got[on].prompt_logits, ref.prompt_logits)
    assert got[on].tokens == ref.tokens
    if cpu_bits and jax.default_backend() == "cpu":
      assert np.array_equal(got[on].step_logits, ref.step_logits), (what, on)
    else:
      assert_close(got[on].step_logits, ref.step_logits, rel=DENSE_GEMV_REL_FP32,
                   what=f"{what}, adapter {'on' if on else 'off'}")
  off, bare = got[False], run("in", None, None)
  assert np.array_equal(off.step_logits, bare.step_logits) and off.tokens == bare.tokens


def _in_launch_forms(**changes):
  """{"xla": the in-place GEMV's forms, "in": the same with `changes`}."""
  kernels = "pallas" if jax.default_backend() == "gpu" else "pallas_interpret"
  base = Forms(dense_weights="kernel", quant_impl=kernels)
  return {"xla": base, "in": dataclasses.replace(base, **changes)}


def test_shared_glu_in_the_down_gemv_decodes_the_xla_forms_bits():
  """`shared_glu="in_down"` (the shared expert's silu(g) * u made by its down projection's
  one-row GEMV as it loads x; interpreted here, compiled on a GPU): the layer scan's body
  holds one XLA logistic a layer fewer; prompt logits are the "xla" forms' bit for bit
  (several rows: XLA makes the row), and so are decode steps on CPU (the same roundings,
  `gemv.glu_product`; on a GPU Triton's silu rounds its own way: fp32 summation order), with
  the same tokens; the adapter switched off is the no-adapter engine of the same forms.
  (The shared expert 64 wide: the GEMV takes widths in multiples of 32, TINY's is 48.)"""
  from strata_jax.model.forward import pattern_period
  wide = dataclasses.replace(TINY, d_ff_shared=64)
  model = tiny_model(wide)
  forms = _in_launch_forms(shared_glu="in_down")
  (xla, scans), (inside, scans_in) = (_outside_kernels(wide, forms[f], model.params, "logistic")
                                      for f in ("xla", "in"))
  assert scans == scans_in >= 1
  assert xla - inside == pattern_period(wide.layer_types) * scans
  _decodes_as_xla(model, random_lora(wide), forms, "shared_glu in_down", cpu_bits=True)


@pytest.mark.parametrize("changes,norms", [
    ({"input_norm": "in_proj", "moe_norm": "in_launch"}, 2)])   # both forms (both opt-in)
def test_norms_in_the_launches_decode_the_xla_norms_tokens(changes, norms):
  """`input_norm="in_proj"` (the norm before each mixer, made by its projections' launch) and
  `moe_norm="in_launch"` (the norm before the MoE, made by one launch with the router's and
  the shared expert's products; one-row decode under the in-place GEMV, interpreted here,
  compiled on a GPU):
  the layer scan's body holds `norms` XLA rsqrts a layer fewer; the prompt is the "xla"
  forms' bit for bit (several rows: the norms are XLA's), decode steps to fp32 summation
  order with the same tokens, and the adapter switched off is the no-adapter engine of the
  same forms bit for bit."""
  from strata_jax.model.forward import pattern_period
  model = tiny_model()
  forms = _in_launch_forms(**changes)
  (xla, scans), (inside, scans_in) = (_outside_kernels(TINY, forms[f], model.params, "rsqrt")
                                      for f in ("xla", "in"))
  assert scans == scans_in >= 1
  assert xla - inside == norms * pattern_period(TINY.layer_types) * scans
  _decodes_as_xla(model, random_lora(), forms, str(changes), cpu_bits=False)
