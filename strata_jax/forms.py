"""How each op is computed: one frozen, hashable value, a static field of `ModelConfig`.

Every implementation choice the model makes (LoRA branch and kernel, GDN chunked and decode
kernels, MoE forms, matmul precision) is a field here. It travels inside `ModelConfig`, the
static argument of the jitted steps, so two `Forms` give two compiled programs: a notebook can
hold two engines with different forms in one process, and nothing read while tracing escapes
jit's cache key (no environment variables).

"auto" fields are resolved once per backend and compute dtype by `resolve` (what `load_model`
and `Engine` do); the two decode kernels whose best choice depends on the batch size keep
"auto" and choose per shape (static under jit), as their `api.py` says.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from strata_jax.errors import FormsError

# field -> the accepted values ("auto" first). The defaults are what measured fastest on the
# H200 (experiments/bench/README.md).
CHOICES: dict[str, tuple] = {
    # an adapter program: "cond" runs the adapter-free layers for an all-off batch, the adapter
    # layers for an all-on batch and both passes for a mixed batch; "select" one pass that
    # always computes the adapter. Off rows are bit-identical to no adapter either way.
    "lora_branch": ("cond", "select"),
    # the LoRA delta: "auto" = XLA below 512 rows on the GPU, a kernel above (Mosaic or Triton).
    # Where the in-place dense GEMV takes the row, `gemv_lora` decides how the delta is added.
    "lora_impl": ("auto", "xla", "pallas", "mosaic", "pallas_interpret"),
    # prefill's chunked delta rule: "auto" = the chunk-parallel Pallas kernel on the GPU
    # ("pallas_split": intra-chunk work for all chunks at once, then fla's split of a state
    # pass and a parallel output launch), the oracle elsewhere. On the H200 at T = 2,500,
    # 32 heads of 128, bf16 q/k/v: 320.6 us at its tuned defaults against 505 for
    # "pallas_parallel" (the state pass fused with the outputs) and 870 for the serial
    # "pallas" kernel (C = 32); experiments/results/device/run70/gdn_probe_chunked_plan.json.
    "gdn_chunked": ("auto", "reference", "products", "pallas", "pallas_interpret",
                    "pallas_parallel", "pallas_split", "pallas_parallel_interpret",
                    "pallas_split_interpret"),
    # every Pallas chunked kernel's chunk (a power of 2 >= 16): "auto" = 64 for the
    # chunk-parallel kernels (500 against 637 us at 32, gdn_probe_run1.json) and 32 for the
    # serial one (64 spilled registers on sm_90 there: 1,059 against 880 us).
    "gdn_pallas_chunk": ("auto", 16, 32, 64, 128),
    # a prefill's GDN causal conv: "concat" slices each tap out of [conv state ; x]; "taps"
    # builds each tap as a select between the two operands shifted (two pads, the same
    # elements bit for bit), which XLA fuses into each of the conv's three readers (q, k, v),
    # where it wrote the concatenation for them (36 x 97 us of run 77's 2,500-token prefill on
    # the H100). "auto" = "taps" on the GPU: on the H100, one process, the prefill took
    # 67.06 ms against 69.26 / 69.18 with "concat", the last logits equal bit for bit
    # (experiments/results/device/run78/decode_probe_prefill_s22.json); "concat" elsewhere,
    # where XLA:CPU compiles the pads and selects slower (tests/test_engine.py: 66.7 against
    # 61.6 s) and nothing was timed.
    "gdn_conv": ("auto", "concat", "taps"),
    # a prefill's GDN gated norm: "after" the chunked op (XLA reads its fp32 o); "in_op" in the
    # op's output launch under "pallas_split" (`pallas_kernels/gdn/README.md`: the fp32 o is
    # never written; 36 x ~36 us of run 77's prefill read it back), after the op in jnp under
    # every other chunked form. "auto" = "after" everywhere: on the H100 "in_op" made the
    # prefill slower, 69.81 against 69.26 / 69.18 ms (67.35 against 67.06 with "taps"): the
    # output launch took 3.22 ms with the norm against 2.7 without (run78).
    "gdn_gated_norm": ("auto", "after", "in_op"),
    # the decode delta rule step: "auto" = on the GPU "pallas_conv" (below) up to 32 rows and
    # "pallas_fused" above (`pallas_kernels.gdn.api.decode_form`), XLA elsewhere.
    # "pallas_fused": one launch from the raw inputs, gates included, the state stack updated
    # in place, inactive rows not stored (measured on the H200 at or below XLA at every batch:
    # 5.63 / 8.75 / 10.56 ms a bench-a3b step at batch 1 / 8 / 32 against 5.76 / 9.58 / 10.58,
    # experiments/results/device/decode_probe_state_in_place_run1.json).
    # "pallas": the step kernel from precomputed gates (`step_raw`'s "auto" picks it from
    # batch 24 on the GPU, where a caller holds only g and beta). "pallas_layer": a decode
    # step's whole GDN core in one launch, from its projections' outputs to what the output
    # projection reads: the conv, the gates, the delta rule, the gated norm
    # (`pallas_kernels/gdn/decode_layer_kernel.py`; "pallas_fused" wherever a step runs
    # alone). The state bits are the fused kernel's; the norm's sum runs in Dv tiles (fp32
    # rounding). Not "auto": bench-a3b bf16 on the H200, a step takes 3.885 ms against the
    # fused form's 3.842 at batch 1 (Dv tiles of 64, run 45) and 7.836 against 7.680 at batch
    # 32 (tiles of 32, run 43): its (row, v-head) programs, 32 at batch 1, each run the head's
    # Dv tiles one after another, where the fused kernel runs a program per tile.
    # "pallas_conv": the layer kernel's launch without the gated norm, on the fused kernel's
    # program per Dv tile: the qkv / ba split sums, the conv, the gates and the delta rule,
    # the conv state stack (in the layer scan's carry, its layer written back by a dynamic
    # update) and the conv weights, A and dt_bias read at the layer index in place
    # (`pallas_kernels/gdn/decode_conv_kernel.py`; "pallas_fused" wherever a step runs alone).
    # Bits: the fused form's from bf16 q / k / v.
    # "auto" up to 32 rows since runs 82-83 and 88: the figures and why not above are at
    # `pallas_kernels.gdn.api.CONV_MAX_BATCH`.
    "gdn_decode": ("auto", "xla", "pallas", "pallas_interpret", "pallas_fused",
                   "pallas_fused_interpret", "pallas_layer", "pallas_layer_interpret",
                   "pallas_conv", "pallas_conv_interpret"),
    # MoE with more (token, expert) pairs than experts: "auto" = the grouped Pallas kernel on the
    # GPU, every expert on every token ("dense") elsewhere; "grouped" = XLA's ragged dot.
    "moe_many": ("auto", "dense", "grouped", "pallas", "pallas_interpret"),
    # MoE with few tokens: "auto" = the in-place Pallas expert kernel on the GPU, XLA elsewhere.
    "moe_few": ("auto", "xla", "pallas", "pallas_interpret"),
    # matmuls over weights kept quantised (weights="keep"): "auto" = the Pallas kernel that
    # dequantises in-kernel on the GPU, dequantise + XLA dot elsewhere.
    "quant_impl": ("auto", "xla", "pallas", "pallas_interpret"),
    # a stack whose layers come in several quant types (llama.cpp's Q4_K_M: Q6_K in its
    # "more bits" layers): "switch" = an XLA conditional on the layer's type (a host round
    # trip each on the GPU); "predicated" = one kernel launch per type with an "active" flag
    # in memory, the inactive ones returning at once, and a select; "fused" = one launch for a
    # few rows with every type's program compiled in and a flag in memory picking the layer's
    # (`pallas_kernels.quant.gemv.groups_call`), "predicated" for more rows, its numbers bit
    # for bit. "auto" = "fused" on the GPU (80B-A3B Q4_K_M decode at batch 1 on the H200:
    # 4.54 ms a step against 4.91 predicated, experiments/results/device/
    # decode_probe_a80b_run6_qfused.json; predicated 7.37 against 8.55 switched in
    # decode_probe_a80b_run3_qpred.json), "switch" elsewhere (XLA would compute every type's
    # product there).
    "quant_groups": ("auto", "switch", "predicated", "fused"),
    # fp32 matmuls: "auto" = "highest" (full fp32) for a float32 compute dtype, the dtype's own
    # for bfloat16; "tf32" is the GPU's faster reduced fp32, only ever chosen by name.
    "matmul_precision": ("auto", "highest", "tf32", "default"),
    # the layers' dense projection matrices (GDN qkv / gate / ba / out, attention q / k / v /
    # out, the router and the shared expert): "scan" = sliced per block as the layer scan's
    # xs; "in_place" = passed whole, each layer's matrix taken at its traced layer index in the
    # scan body (the H200's decode program copied the scanned qkv slices, 12 copies and ~600 us
    # a bench-a3b step: experiments/results/device/hlo/; in place XLA still copies them, and
    # decode moved -0.3 / +0.8 / +0.8 % at batch 1 / 8 / 32). Same numbers either way.
    # "kernel" = passed whole, and a decode step's single row multiplied by the "blocks" GEMV
    # kernel reading the layer's matrix in place (`pallas_kernels.quant.dense_matmul`, by
    # `quant_impl`: the kernel on the GPU, XLA elsewhere; more rows: XLA on the indexed
    # matrix, as "in_place"); the numbers to summation order. "auto" = "kernel" on the GPU,
    # "scan" elsewhere: on the H200, one process, one machine, bench-a3b bf16 adapter on, the
    # Engine decoded 187.4 tok/s at batch 1 with it against 147.1 with "scan", its
    # `decode_greedy` reference 192.6 against 164.7 (experiments/results/device/
    # bench_engine_b1_dgemv.json, _b1_profile.json). With three engines in one process its
    # batch-1 program ran slower (152-167 tok/s, bench_engine_run13/14.json; cause unknown).
    "dense_weights": ("auto", "scan", "in_place", "kernel"),
    # the LoRA delta on a projection a few-row GEMV kernel takes (the in-place dense GEMV of
    # `dense_weights="kernel"` at a decode step's single row, or the quantised "blocks" GEMV
    # up to 4 rows): "apart" = beside the GEMV (dense: `lora_impl`'s LoRA ops after it, on the
    # layer's A and B sliced from the scan; quantised: h = A x in XLA, B h in the GEMV's
    # epilogue); "rows" = A's rows computed in the GEMV's own launch, and B h, the switch's
    # select and the split sums in one finishing kernel, the adapter's stacks read in place at
    # the layer (`pallas_kernels.quant.dense_matmul_lora`, `qmatmul_lora(lora_index=)`);
    # "rows_dense" = "rows" for the dense GEMV, "apart" for the quantised one. Off rows are
    # the plain GEMV's bits in every form. "auto" = "rows_dense" on the GPU: on the H200,
    # bench-a3b bf16 at batch 1, adapter on, the LoRA cost 3.01 us a layer with "rows" against
    # 3.90 "apart" (experiments/results/device/bench_model_decode_run23_lorarows.json), while
    # the 80B-A3B Q4_K_M step took 4.70 ms with "rows" against 4.64 "apart"
    # (decode_probe_a80b_run9_lorarows.json); "rows" elsewhere (the interpreter keeps both
    # kernels under test wherever a test names the GEMV kernels). Under "rows", "rows_dense"
    # and "dot", 2 to 64 rows of a 16-bit dense projection that `dense_few="dot"` takes get
    # the delta inside that kernel's one launch (`pallas_kernels/quant/dense_dot.py`: each
    # program adds B times its own share's A x: on the H200, bench-a3b rank 50, 5.76 / 4.95
    # us a layer at batch 8 / 32 against 9.88 / 9.66 with the LoRA ops after the product,
    # experiments/results/device/bench_model_decode_run27_dotlora.json and _run26_densedot);
    # "dot" sends one row there too, instead of the GEMV (5.54 against the rows form's 3.20
    # us a layer at batch 1, run 27: not the default).
    "gemv_lora": ("auto", "apart", "rows", "rows_dense", "dot"),
    # 2 to 64 rows (a decode batch, a verify step) of a 16-bit matrix kept whole under
    # `dense_weights="kernel"`: "dot" = the tensor-core tiles that read the layer's matrix in
    # place (`pallas_kernels/quant/dense_dot.py`), "xla" = XLA's dot on the indexed matrix,
    # which XLA copies out of the stack first (at batch 8 on the H200 those copies took 1.74
    # of bench-a3b's 8.54 ms a step: experiments/results/device/
    # decode_probe_lora_profile_run24.json). "auto" = "dot" (the interpreter on CPU, where
    # it only runs when a test names the kernel forms). Same numbers to summation order.
    "dense_few": ("auto", "dot", "xla"),
    # the router's softmax, top-k and renormalisation: "auto" = "pallas" on the GPU (one
    # launch, `pallas_kernels/moe/topk.py`'s `route_pallas`; its top-k alone took 163 us of the
    # 80B-A3B Q4_K_M batch-1 step where `lax.top_k`'s sort took 259, and the step 4.48 against
    # 4.55 ms, decode_probe_a80b_run8_topk.json), "xla" elsewhere; the same ids either way,
    # the weights to fp32 rounding (Triton's exp).
    "moe_topk": ("auto", "xla", "pallas", "pallas_interpret"),
    # one decode step's attention (a single new position a row): "pallas" = the kernel that
    # reads the layer's K/V cache in place and only each row's keys up to its position
    # (`pallas_kernels/attention`), "xla" = the model's einsums, which copy the layer's cache
    # out of the stack, convert it to fp32 and score the whole capacity. "auto" =
    # "pallas" on the GPU for a 16-bit compute dtype (bench-a3b bf16 on the
    # H200, the kernel alone against "xla": decode roofline 0.402 / 0.519 / 0.489 at batch
    # 1 / 8 / 32 against 0.398 / 0.513 / 0.476,
    # experiments/results/device/bench_model_decode_run31_attn.json and _run28_moe.json),
    # "xla" for float32 and elsewhere. Why float32 keeps XLA: run 31's GPU test that every
    # fp32 dot of the program asks for full precision failed with the kernel in it. The
    # cause is the test's text match (the kernel's custom-call line carries its dots' names
    # in its serialized IR: experiments/results/fp32_dots_probe.json; the test now reads
    # XLA's dots only), and the compiled kernel met float64 to 1e-6 in fp32, but the fp32
    # model with the kernel has not run on the device. A verify or prefill step
    # (several positions) is always "xla". The numbers to fp32 summation order (the kernel's
    # softmax runs online, over splits).
    # "pallas_prologue" / "pallas_prologue_interpret": the kernel, with the q / k head norms,
    # RoPE and the new key / value's cache write before it in one launch too
    # (`pallas_kernels/attention/prologue_kernel.py`; the same caches in bf16, q to the
    # norm's and the cos / sin's fp32 rounding). Not "auto" (it was from run 63 to run 67):
    # bench-a3b bf16 on the H200, the Engine's own program (`decode_sample`) took 3.936 /
    # 3.945 ms a step with it against 3.973 / 3.980 without at batch 1 with a 512-key cache
    # (experiments/results/device/run63/decode_probe_s12b_attnpro.json), but through the
    # Engine, whose batch-1 slot holds 2,560 keys, that program ran 236.6 and 239.2 tok/s
    # with it (runs 65, 67) against 249.7 without (run 61), while `decode_greedy` stayed at
    # 249-251 in all three, and the Engine went from 238.6 to 228.4 / 231.4 tok/s. Cause not
    # found (a hypothesis: a copy of the cache stacks in that program's loop, which grows
    # with the capacity); the A/B in one process is owed (pending_run.sh owed14).
    "attn_decode": ("auto", "xla", "pallas", "pallas_interpret", "pallas_prologue",
                    "pallas_prologue_interpret"),
    # attention at several positions a row (a prefill chunk, a verify step): "pallas" = the
    # flash-style kernel that reads the layer's K/V cache in place, key blocks up to each query
    # block's last position, the softmax online, the probabilities meeting V in the cache's
    # dtype (`pallas_kernels/attention/prefill_kernel.py`); "xla" = the model's einsums, fp32
    # scores and probabilities of every query against the whole capacity in memory (410 MB a
    # layer for bench-a3b's 2,500-token chunk). "auto" = "pallas" on the GPU for a 16-bit
    # compute dtype and a power-of-2 head size (bench-a3b bf16 on the H200: a 2,500-token
    # prefill in 82.2 against 93.0 ms, 4,096 tokens in 123.0 against 145.7, the same argmax;
    # experiments/results/device/run68/decode_probe_prefill_attn.json and
    # _prefill4096_attn.json), "xla" for float32 (the kernel's fp32 form is IEEE and untimed)
    # and elsewhere. The logits to the 16-bit rounding of the probabilities (tests/
    # test_attention_prefill_kernel.py) in bf16, to fp32 summation order in fp32.
    "attn_prefill": ("auto", "xla", "pallas", "pallas_interpret"),
    # a layer's projections of one input (GDN qkv / gate / ba, attention q / k / v, the shared
    # expert's gate / up) where the in-place kernels take the rows (`dense_weights="kernel"`:
    # the GEMV's one row, dense_dot's 2 to 64): "fused" = one launch for all of them
    # (`pallas_kernels/quant/multi.py`), "apart" = one launch each. Every product keeps its
    # own call's tiling, so the numbers are the same bit for bit. "auto" = "fused" (bench-a3b
    # bf16 decode on the H200: 4.138 against 4.390 ms a step at batch 1, 7.624 against 7.987
    # at batch 32; experiments/results/device/decode_probe_multi_run33.json).
    "dense_launch": ("auto", "fused", "apart"),
    # the same for weights kept quantised (the 80B), where the quantised few-row kernel takes
    # every product: "fused" = a layer's products of one input in one launch
    # (`pallas_kernels.quant.api.qmatmul_multi`; a mixed-type stack's only under "fused"
    # groups), and the routed experts' gate with their up (`quant_api.experts(fused=True)`);
    # "apart" = one launch each. The same numbers bit for bit. "auto" = "fused" on the GPU:
    # the 80B's layers at batch 1, 0.900 against 1.028 / 1.005 ms a step (run 87, H100, an
    # 8-layer 80B-A3B Q4_K_M, decode_probe's "qlaunch" against "base").
    "quant_launch": ("auto", "fused", "apart"),
    # what follows a decode step's mixer output projection (ssm_out, attn_output) where the
    # in-place dense kernels take its rows (`dense_weights="kernel"`): "xla" = XLA adds the
    # projection's split sums, the residual and the next RMSNorm in its fusions, and the
    # adapter's B h takes a finishing launch of its own (`gemv.lora_finish`; on the H200 3.2 us
    # a call, a launch's floor: experiments/results/device/run50); "kernel" = one Pallas
    # kernel adds the sums, B h and the residual in every path, no adapter, off and on
    # (`pallas_kernels/quant/finish.py`), so the adapted step has the plain step's launches
    # and an off row runs the plain step's instructions; the norm stays XLA's. "gemv" =
    # "kernel" where the one-row GEMV takes the projection (a decode step of one row), "xla"
    # for more rows. "auto" = "gemv" on the GPU: bench-a3b
    # bf16 on the H200, "kernel" took 3.794 against 3.847 ms a step at batch 1 with no
    # adapter and 3.925 against 3.971 with it on, but 5.943 against 5.800 at batch 8 and 8.385
    # against 7.641 at batch 32, where its 16 programs each run every row
    # (experiments/results/device/run53); "xla" elsewhere. "gemv_b" = "gemv" with the
    # adapter's B for the layer copied out by the projection's own launch, so the finishing
    # kernel reads B at a static index instead of loading the layer index first: by runs
    # 82-83's profiles (H100) that wait is three quarters of the adapter's cost at batch 1
    # (the finish 1.3 -> 2.9 us a call). Timed, it saves nothing (run 86, H100, batch 1,
    # adapter on: 4.468 / 4.467 against 4.454 / 4.449 ms a step), so it stays opt-in.
    "proj_finish": ("auto", "xla", "kernel", "gemv", "gemv_b"),
    # the output head (a plain float `lm_head`) at a decode step's few rows: "xla" = XLA's
    # GEMM, whose tiling XLA's autotuner picks per program: on the H200 at bench-a3b batch 1
    # it took 141.5 us a step tuned and 342 untuned (run 58), and the Engine's own program
    # lost ~5 % to a decode_greedy of the same step in most runs (run 55: 236.3 against 249.3
    # tok/s), in some none (run 46); "kernel" = the in-place dense kernels (`Forms.dense_few`:
    # the GEMV at one row, dense_dot to 64 rows of a 16-bit model), no autotuning: 149.4 us
    # at batch 1 and 143.3 at 8, steps level with XLA's tuned head (run 59). "auto" = "kernel"
    # on the GPU, "xla" elsewhere.
    "head": ("auto", "xla", "kernel"),
    # a decode step's RMSNorm before each mixer: "xla" = XLA makes it (two fusions a layer: the
    # sum of squares, the scaling; 48 x 2.8 us of bench-a3b's batch-1 step on the H100,
    # experiments/bench/README.md, twenty-second session); "in_proj" = the launch of the
    # layer's projections of it makes it, where the one-row in-place GEMV takes them
    # (`dense_weights="kernel"`, `dense_launch="fused"`): each program reads the whole raw row
    # and normalises its share of it (`pallas_kernels/quant/gemv.py`, `_row_inv_rms`), with
    # the reference's roundings but its sum of squares in another order. "auto" = "xla": on
    # the H100 (run 79, batch 1, 2,560 keys) "in_proj" took 4.547 ms a step against 4.439 /
    # 4.444: 174 launches fewer, but the projections' launch grew 738 -> 902 us (each program
    # reduces the whole row before its first product), more than the norms it replaced.
    "input_norm": ("auto", "xla", "in_proj"),
    # a decode step's RMSNorm before the MoE: "xla" = XLA makes it after the residual add (two
    # fusions a layer, the shared expert's sigmoid-gate dot riding in the second: 48 x
    # (1.2 + 2.55) us on the H100, run 77), and the router's GEMV is a launch of its own;
    # "in_launch" = one launch of the one-row GEMV makes the norm and runs the router's fp32
    # product, the shared expert's gate and up, and writes the normed row for the experts'
    # kernel and the sigmoid gate (`moe._inputs_in_launch`), where the in-place GEMV takes
    # them (`dense_weights="kernel"`, `dense_launch="fused"`). "auto" = "xla": run 79 gave
    # 4.497 ms a step (both norms in launches 4.569, adapter on 4.669 against 4.540), the
    # launch 166 -> 378 us a step for what the router's launch and the norm took before.
    "moe_norm": ("auto", "xla", "in_launch"),
    # the shared expert's hidden row silu(g) * u at a decode step: "xla" = one XLA fusion a
    # layer makes it before its down projection (likely run 79's `loop_multiply_fusion_3`,
    # 48 x ~1.25 us of bench-a3b's batch-1 step on the H100; the HLO was not dumped);
    # "in_down" = the down projection's one-row in-place GEMV makes it as each program loads
    # its share of x (`gemv.glu_product`: the same roundings, no reduction over the row),
    # where that kernel takes the rows (`dense_weights="kernel"`). "auto" = "xla" until timed.
    "shared_glu": ("auto", "xla", "in_down"),
}


# Choices that run compiled Pallas kernels, which need the GPU backend. Their "_interpret"
# forms and "xla" run anywhere; naming one of these elsewhere is refused at load
# (`Forms.check_backend`), not left to fail inside the first trace.
GPU_ONLY = {
    "lora_impl": ("pallas", "mosaic"),
    "gdn_chunked": ("pallas", *(c for c in CHOICES["gdn_chunked"] if c.startswith("pallas_")
                                and not c.endswith("_interpret"))),
    "gdn_decode": ("pallas", "pallas_fused", "pallas_layer", "pallas_conv"),
    "moe_many": ("pallas",),
    "moe_few": ("pallas",),
    "quant_impl": ("pallas",),
    "moe_topk": ("pallas",),
    "attn_decode": ("pallas", "pallas_prologue"),
    "attn_prefill": ("pallas",),
}


@dataclasses.dataclass(frozen=True)
class Forms:
  """Implementation choices of every op; see `CHOICES` for each field's values."""
  lora_branch: str = "cond"
  lora_impl: str = "auto"
  gdn_chunked: str = "auto"
  gdn_pallas_chunk: int | str = "auto"
  gdn_conv: str = "auto"
  gdn_gated_norm: str = "auto"
  gdn_decode: str = "auto"
  moe_many: str = "auto"
  moe_few: str = "auto"
  quant_impl: str = "auto"
  quant_groups: str = "auto"
  matmul_precision: str = "auto"
  dense_weights: str = "auto"
  gemv_lora: str = "auto"
  moe_topk: str = "auto"
  dense_few: str = "auto"
  attn_decode: str = "auto"
  attn_prefill: str = "auto"
  dense_launch: str = "auto"
  quant_launch: str = "auto"
  proj_finish: str = "auto"
  head: str = "auto"
  input_norm: str = "auto"
  moe_norm: str = "auto"
  shared_glu: str = "auto"

  def __post_init__(self):
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if value not in CHOICES[f.name]:
        raise FormsError(f"forms: {f.name}={value!r}: expected one of {CHOICES[f.name]}")

  def resolve(self, backend: str, compute_dtype) -> Forms:
    """These forms with "auto" replaced by the concrete choice for `backend` ("cpu", "gpu",
    ...) and the compute dtype. On the GPU the LoRA kernel keeps "auto" (its choice depends on
    the batch size, static under jit), and so do the GDN decode step (the conv kernel up to 32
    rows, the fused one above: `pallas_kernels.gdn.api.decode_form`) and the prefill attention
    of a 16-bit model (the kernel tiles power-of-2 head sizes only). Idempotent."""
    gpu = backend == "gpu"
    auto = lambda value, on_gpu, elsewhere: value if value != "auto" else (
        on_gpu if gpu else elsewhere)
    precision = self.matmul_precision
    if precision == "auto":
      precision = "highest" if _dtype_name(compute_dtype) == "float32" else "default"
    gdn_chunked = auto(self.gdn_chunked, "pallas_split", "reference")
    from pallas_kernels.gdn.api import pallas_chunk_for  # noqa: PLC0415 (kernels load lazily)
    return dataclasses.replace(
        self,
        # the Pallas interpreter on CPU keeps the kernel's code path under test
        lora_impl=auto(self.lora_impl, "auto", "pallas_interpret" if backend == "cpu"
                       else "xla"),
        gdn_chunked=gdn_chunked,
        gdn_pallas_chunk=pallas_chunk_for(gdn_chunked, self.gdn_pallas_chunk),
        gdn_conv=auto(self.gdn_conv, "taps", "concat"),
        gdn_gated_norm=auto(self.gdn_gated_norm, "after", "after"),
        # the GPU keeps "auto": the conv or the fused kernel by the batch (`decode_form`)
        gdn_decode=auto(self.gdn_decode, "auto", "xla"),
        moe_many=auto(self.moe_many, "pallas", "dense"),
        moe_few=auto(self.moe_few, "pallas", "xla"),
        quant_impl=auto(self.quant_impl, "pallas", "xla"),
        quant_groups=auto(self.quant_groups, "fused", "switch"),
        dense_weights=auto(self.dense_weights, "kernel", "scan"),
        gemv_lora=auto(self.gemv_lora, "rows_dense", "rows"),
        moe_topk=auto(self.moe_topk, "pallas", "xla"),
        dense_few=auto(self.dense_few, "dot", "dot"),
        attn_decode=auto(self.attn_decode, "xla" if _dtype_name(compute_dtype) == "float32"
                         else "pallas", "xla"),
        # the kernel's head-size rule is the op's own (`resolve_prefill`), so the GPU keeps "auto"
        attn_prefill=auto(self.attn_prefill, "xla" if _dtype_name(compute_dtype) == "float32"
                          else "auto", "xla"),
        dense_launch=auto(self.dense_launch, "fused", "fused"),
        quant_launch=auto(self.quant_launch, "fused", "apart"),
        proj_finish=auto(self.proj_finish, "gemv", "xla"),
        head=auto(self.head, "kernel", "xla"),
        input_norm=auto(self.input_norm, "xla", "xla"),
        moe_norm=auto(self.moe_norm, "xla", "xla"),
        shared_glu=auto(self.shared_glu, "xla", "xla"),
        matmul_precision=precision)

  def check_backend(self, backend: str) -> Forms:
    """These forms, or FormsError naming the first field whose choice runs a compiled Pallas
    kernel when `backend` is not "gpu" (`GPU_ONLY`): a clear error where the model is loaded,
    not a traceback from inside the first trace."""
    if backend == "gpu":
      return self
    for name, compiled in GPU_ONLY.items():
      value = getattr(self, name)
      if value in compiled:
        instead = [c for c in dict.fromkeys((f"{value}_interpret", "pallas_interpret", "xla"))
                   if c in CHOICES[name]][:2]
        raise FormsError(f"forms: {name}={value!r} runs a compiled Pallas kernel, which needs "
                         f"the GPU backend (this one is {backend!r}); use "
                         + " or ".join(repr(c) for c in instead))
    return self

  def jax_precision(self, compute_dtype) -> str | None:
    """The `jax.default_matmul_precision` the steps trace under for this compute dtype (None:
    JAX's default). Unresolved "auto" decides here, so a config built by hand is full fp32
    in float32 too."""
    precision = self.matmul_precision
    if precision == "auto":
      precision = "highest" if _dtype_name(compute_dtype) == "float32" else "default"
    return {"highest": "highest", "tf32": "tensorfloat32"}.get(precision)


def _dtype_name(dtype) -> str:
  return np.dtype(dtype).name


def parse_forms(spec: str, base: Forms | None = None) -> Forms:
  """`"lora_branch=select,gdn_chunked=products"` -> Forms (the CLI's `--forms`).

  Raises FormsError (a ValueError) naming an unknown field or value."""
  base = base or Forms()
  changes = {}
  for item in filter(None, (s.strip() for s in spec.split(","))):
    name, sep, value = item.partition("=")
    name, value = name.strip(), value.strip()
    if not sep or name not in CHOICES:
      raise FormsError(f"forms: {item!r}: expected NAME=VALUE with NAME one of "
                       f"{tuple(CHOICES)}")
    ints = any(isinstance(c, int) for c in CHOICES[name])
    changes[name] = int(value) if ints and value.isdigit() else value
  return dataclasses.replace(base, **changes)
