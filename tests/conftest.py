"""Test set-up: CPU only; one persistent compilation cache shared by the workers and the
subprocesses of a run; every test module's compiled programs dropped when it ends."""
import gc
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The CLI (in-process and in subprocesses) and the split checks read the same directory.
_CACHE = os.environ.setdefault("STRATA_TEST_JAX_CACHE", "/tmp/strata-jax-test-cache")
os.environ["STRATA_JAX_CACHE"] = _CACHE
if os.environ["JAX_PLATFORMS"] == "cpu":
  # Compiling is most of the suite's time (a tiny model's prefill takes ~3.4 s to compile and
  # milliseconds to run): LLVM without its optimisation passes compiles ~30 % faster and the
  # suite runs faster overall (measured: test_engine + test_model_parity 174 s -> 122 s on
  # 2 cores). Every comparison is within one setting, so no test's meaning changes.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_backend_optimization_level=0").strip()

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# Device runs (experiments/bench/gpu_tests.sh): each failure's report appended to this file as
# it happens, so a run stopped at its time limit still names what failed and why; and every
# test's outcome and call time, so such a run also shows which tests were left and which are
# slow.
_FAILURE_LOG = os.environ.get("STRATA_TEST_FAILURE_LOG")
_PROGRESS_LOG = os.environ.get("STRATA_TEST_PROGRESS_LOG")


def pytest_runtest_logreport(report):
  if "PYTEST_XDIST_WORKER" in os.environ:   # the controller writes, once per report
    return
  if _FAILURE_LOG and report.failed:
    with open(_FAILURE_LOG, "a") as f:
      f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext[-8000:]}\n")
  if _PROGRESS_LOG and (report.when == "call" or report.outcome != "passed"):
    with open(_PROGRESS_LOG, "a") as f:
      f.write(f"{report.duration:.2f}\t{report.outcome}\t{report.when}\t{report.nodeid}\n")


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
  """Each live CPU executable holds about five memory mappings; a worker that kept every
  program of a full run passed Linux's 65,530 (vm.max_map_count) and XLA crashed inside a
  compile or a cache write (a segfault in test_quant_model.py, an abort in test_server.py).
  Later modules reload what they share from the persistent cache."""
  yield
  jax.clear_caches()
  gc.collect()
