"""One launch for several products of the same rows: y_m = x @ W_m[idx]^T, m = 0, 1, ...

Why: a decode step multiplies one input by several matrices of a layer (GDN qkv, gate and
ba; attention q, k and v; the shared expert's gate and up). Each was its own kernel launch,
and the small ones (ba: 64 rows, k / v: 512, the shared expert's 512) are launch-bound: on
the H200 about 2.3-2.6 us each for 0.26-2 MB, about 460 us of bench-a3b's 4.37 ms batch-1
step (experiments/results/device/decode_probe_moe_run29.json, `qgemv_dense*` rows).

How: the launch's grid is the parts' grids end to end. Program `pid` runs the program of the
part whose range holds it, at `pid - offset` (a `pl.when` per part; every part's program is
compiled in). Each part's program, tiling and inputs are exactly those of its own call
(`gemv.dense_call` for one row, `dense_dot.dense_dot_call` for 2 to 64), so each result is
that call's, bit for bit; their split partial sums are added afterwards as there.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
from jax.experimental import pallas as pl

_WHOLE = pl.BlockSpec()  # a whole array (a pointer): the programs index it themselves


class Part(NamedTuple):
  """One product of a fused launch: `program(refs, pid)` with refs = its inputs then its
  output, run for pid in 0 .. n_programs - 1."""
  program: Callable
  n_programs: int
  args: tuple
  out_shape: jax.ShapeDtypeStruct


def _kernel(*refs, specs):
  """specs: (program, n_programs, n_args) per part (static; the arrays stay out of it)."""
  pid = pl.program_id(0)  # outside any branch
  n_in = sum(n_args for _, _, n_args in specs)
  ins, outs = refs[:n_in], refs[n_in:]
  start = offset = 0
  for i, (program, n_programs, n_args) in enumerate(specs):
    part_refs = [*ins[start:start + n_args], outs[i]]
    lo, hi = offset, offset + n_programs
    pl.when((pid >= lo) & (pid < hi))(functools.partial(program, part_refs, pid - lo))
    start += n_args
    offset = hi


def launch(parts, *, name, interpret=False, compiler_params=None):
  """Every part's output (a list, in order) from one `pallas_call` over all their programs."""
  parts = tuple(parts)
  args = [a for p in parts for a in p.args]
  return pl.pallas_call(
      functools.partial(_kernel, specs=tuple((p.program, p.n_programs, len(p.args))
                                             for p in parts)),
      grid=(sum(p.n_programs for p in parts),),
      out_shape=[p.out_shape for p in parts],
      in_specs=[_WHOLE] * len(args), out_specs=[_WHOLE] * len(parts),
      interpret=interpret, compiler_params=compiler_params, name=name,
  )(*args)
