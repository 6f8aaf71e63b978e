"""Writes the committed v1 session fixture, `tests/fixtures/session_v1` (run once, from the repo
root: `python tests/make_session_fixture.py`). Its content is a pure function of the constants
below, so `test_session_format.py` can check the committed files against `fixture_payload()`.
"""
import os
import pathlib
import sys

import ml_dtypes
import numpy as np

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "session_v1"
FINGERPRINT = "fixture-model:0123456789abcdef"
LAYERS = (0, 4)                 # one stage, pattern "GGGA": 3 GDN layers, 1 attention layer
N_TOKENS = 6
La, Lg = 1, 3
G, Hd = 2, 8                    # kv-heads, head dim
K, C = 4, 24                    # conv kernel, conv channels (2 * Hk * Dk + Hv * Dv)
Hv, Dv, Dk = 2, 4, 4
KV_DTYPE = ml_dtypes.bfloat16


def _values(shape, seed, dtype):
  """Deterministic, platform-independent values (no RNG stream to drift across numpy versions)."""
  n = int(np.prod(shape))
  x = np.sin(np.arange(n, dtype=np.float64) * 0.7311 + seed) * (1.0 + seed % 3)
  return x.reshape(shape).astype(dtype)


def fixture_payload():
  """(stages, tokens, kwargs of save_session) the fixture was written from."""
  stage = {
      "k": _values((La, N_TOKENS, G, Hd), 1, KV_DTYPE),
      "v": _values((La, N_TOKENS, G, Hd), 2, KV_DTYPE),
      "conv": _values((Lg, K - 1, C), 3, KV_DTYPE),
      "ssm": _values((Lg, Hv, Dv, Dk), 4, np.float32),
  }
  tokens = np.array([151644, 872, 198, 9707, 11, 1879], np.int32)
  return [stage], tokens, {"fingerprint": FINGERPRINT, "flags": 1, "layer_ranges": [LAYERS]}


def fixture_limits(**overrides):
  """SessionReadLimits of an engine running the fixture's model in one stage."""
  from strata_jax.session import SessionReadLimits

  shapes = {
      "k": ((La, None, G, Hd), KV_DTYPE),
      "v": ((La, None, G, Hd), KV_DTYPE),
      "conv": ((Lg, K - 1, C), KV_DTYPE),
      "ssm": ((Lg, Hv, Dv, Dk), np.float32),
  }
  kw = dict(max_tokens=64, max_stages=1, stage_layers=(LAYERS,), stage_shapes=(shapes,),
            fingerprint=FINGERPRINT)
  kw.update(overrides)
  return SessionReadLimits(**kw)


def main():
  sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
  from strata_jax.session import erase_session, save_session

  stages, tokens, kw = fixture_payload()
  erase_session(FIXTURE)
  info = save_session(FIXTURE, stages, tokens, **kw)
  print(f"wrote {FIXTURE} ({info['bytes']} bytes)")
  # orbax records the absolute path it committed to; keep the fixture free of this machine.
  commit = FIXTURE / "commit_success.txt"
  if commit.exists():
    commit.write_text("Checkpoint commit was successful.")
  for dirpath, _, files in os.walk(FIXTURE):
    for f in files:
      print(" ", os.path.relpath(os.path.join(dirpath, f), FIXTURE))


if __name__ == "__main__":
  main()
