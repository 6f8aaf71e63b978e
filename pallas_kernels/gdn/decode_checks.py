"""Shape checks shared by the GDN decode kernels that take the conv (`decode_layer_kernel`,
`decode_conv_kernel`): plain Python on static shapes, run before any tracing."""
from pallas_kernels._common import pow2


def state_dims(what, state, n_k_heads):
  """(B, Hv, Dv, Dk, C) of the [L, B, Hv, Dv, Dk] state stack, C the conv's channels; raise
  ValueError (prefixed `what`) unless Hv is a multiple of Hk."""
  if state.ndim != 5:
    raise ValueError(f"{what}: state {state.shape} must be the [L, B, Hv, Dv, Dk] stack")
  _, bsz, hv, dv, dk = state.shape
  if n_k_heads < 1 or hv % n_k_heads:
    raise ValueError(f"{what}: Hv = {hv} must be a multiple of Hk = {n_k_heads}")
  return bsz, hv, dv, dk, 2 * n_k_heads * dk + hv * dv


def check_shapes(what, want, state, n_k_heads, conv_w, n_taps):
  """Raise ValueError (prefixed `what`) naming the first operand of `want` ({name: (array,
  shape)}) whose shape differs, a conv of fewer than 2 taps, or Dk / Dv not powers of 2."""
  for name, (arr, shape) in want.items():
    if arr.shape != shape:
      raise ValueError(f"{what}: {name} {arr.shape} must be {shape} (state {state.shape}, "
                       f"Hk = {n_k_heads}, {n_taps} conv taps)")
  if n_taps < 2:
    raise ValueError(f"{what}: conv_w {conv_w.shape} needs 2 or more taps")
  for name, d in (("Dk", state.shape[4]), ("Dv", state.shape[3])):
    if not pow2(d):
      raise ValueError(f"{what}: {name}={d} must be a power of 2 (Triton tiles are)")
