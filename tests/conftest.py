"""Test set-up: CPU only, a persistent compilation cache shared by all tests of a run."""
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_CACHE = pathlib.Path(os.environ.get("STRATA_TEST_JAX_CACHE", "/tmp/strata-jax-test-cache"))

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import jax  # noqa: E402

jax.config.update("jax_compilation_cache_dir", str(_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
