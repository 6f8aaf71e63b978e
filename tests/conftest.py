"""Test set-up: CPU only; no persistent compilation cache in the pytest processes."""
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, str(pathlib.Path(__file__).parent))

# No persistent compilation cache in the pytest processes: with the server's worker thread
# compiling beside other threads, writing an entry (executable.serialize()) aborted two
# xdist workers of a full run (tests/test_server.py, 2026-12-01). In-process jit caches still
# share programs within a worker; subprocesses (notebooks, split checks) keep
# theirs ($STRATA_TEST_JAX_CACHE).
os.environ["STRATA_JAX_CACHE"] = "0"   # the CLI, called in-process, leaves the cache off too
