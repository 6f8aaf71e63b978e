"""Child process for the session kill test: saves sessions at one path in a loop until killed.

`python tests/session_kill_helper.py PATH PROGRESS_FILE FIRST_INDEX` saves `payload(i)` for
i = FIRST_INDEX, FIRST_INDEX + 1, ... and appends `i` to PROGRESS_FILE after each save returns
(one unbuffered write, so a SIGKILL cannot lose a line that was written). It writes "ready"
first, once imports are done, so the parent's random delays fall inside the save loop. With
STRATA_SESSION_NO_EXCHANGE=1 it replaces sessions through a backup rename, not renameat2.
"""
import os
import pathlib
import sys

import ml_dtypes
import numpy as np

N_TOKENS, La, Lg, G, Hd = 1024, 2, 6, 2, 64
K, C, Hv, Dv, Dk = 4, 384, 4, 64, 64
LAYERS = (0, 8)
FINGERPRINT = "kill-test-model"


def payload(i: int):
  """Session number i: every array differs between numbers (about 1.5 MB in all;
  a save takes ~0.2 s here)."""
  rng = np.random.default_rng(i)

  def arr(shape, dtype):
    return rng.standard_normal(shape, np.float32).astype(dtype)

  stage = {
      "k": arr((La, N_TOKENS, G, Hd), ml_dtypes.bfloat16),
      "v": arr((La, N_TOKENS, G, Hd), ml_dtypes.bfloat16),
      "conv": arr((Lg, K - 1, C), ml_dtypes.bfloat16),
      "ssm": arr((Lg, Hv, Dv, Dk), np.float32),
  }
  tokens = (np.arange(N_TOKENS, dtype=np.int32) + 1000 * i).astype(np.int32)
  return [stage], tokens, {"fingerprint": FINGERPRINT, "flags": i & 1, "layer_ranges": [LAYERS]}


def limits():
  from strata_jax.session import SessionReadLimits

  shapes = {
      "k": ((La, None, G, Hd), ml_dtypes.bfloat16),
      "v": ((La, None, G, Hd), ml_dtypes.bfloat16),
      "conv": ((Lg, K - 1, C), ml_dtypes.bfloat16),
      "ssm": ((Lg, Hv, Dv, Dk), np.float32),
  }
  return SessionReadLimits(max_tokens=N_TOKENS, max_stages=1, stage_layers=(LAYERS,),
                           stage_shapes=(shapes,), fingerprint=FINGERPRINT)


def main():
  path, progress, first = sys.argv[1], sys.argv[2], int(sys.argv[3])
  sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
  from strata_jax.session import atomic, orbax_io, save_session

  orbax_io.checkpointer()   # import orbax before "ready"
  if os.environ.get("STRATA_SESSION_NO_EXCHANGE") == "1":
    atomic.use_exchange = False   # cover the rename-to-backup path
  fd = os.open(progress, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
  os.write(fd, b"ready\n")
  i = first
  while True:
    stages, tokens, kw = payload(i)
    save_session(path, stages, tokens, **kw)
    os.write(fd, f"{i}\n".encode())
    i += 1


if __name__ == "__main__":
  main()
