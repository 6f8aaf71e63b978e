"""Walking a jaxpr for structural checks (what a program holds, not what it computes)."""
from jax.extend.core import jaxprs_in_params


def eqns(jaxpr, *, into_kernels: bool = True):
  """Every equation of `jaxpr` and of the jaxprs nested in its equations' params (scan and
  cond bodies, inner jits), Pallas kernel bodies too unless into_kernels is False."""
  for e in jaxpr.eqns:
    yield e
    if into_kernels or e.primitive.name != "pallas_call":
      for sub in jaxprs_in_params(e.params):
        yield from eqns(sub, into_kernels=into_kernels)


def kernel_names(jaxpr):
  """The name of every Pallas kernel launch `jaxpr` makes, one per call site (a jit called
  twice counts twice, though the printed jaxpr shows its body once)."""
  names = []
  for e in eqns(jaxpr, into_kernels=False):
    if e.primitive.name == "pallas_call":
      name = e.params.get("name") or e.params.get("name_and_src_info")  # by JAX version
      names.append(str(name).split()[0])
  return names
