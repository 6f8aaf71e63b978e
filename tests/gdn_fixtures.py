"""Shapes shared by the GDN decode kernels' tests (tests only)."""

# (B, Hk, Hv, Dk, Dv, K): the tiny model's (Hk 2, Hv 4, Dk 16, Dv 8, 4 taps); r = 1 and 3;
# 2 and 3 taps; Dk != Dv both ways.
DECODE_SHAPES = [(3, 2, 4, 16, 8, 4), (2, 1, 3, 8, 16, 2), (4, 2, 2, 8, 8, 3)]


def shape_id(s):
  """A test id naming every dimension of a DECODE_SHAPES entry."""
  return "B{}-Hk{}-Hv{}-Dk{}-Dv{}-K{}".format(*s)
