"""Module layering: what importing a module drags in, and what it does to the process.

Each check runs in a fresh interpreter, so modules imported by other tests cannot hide an edge.
"""
import json
import subprocess
import sys

import pytest


def _fresh(code: str) -> dict:
  """Run `code` in a new interpreter; it prints one JSON object as its last line."""
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module,forbidden", [
    ("strata_jax.serve.app", "strata_jax.cli"),
    ("strata_jax.loading", "strata_jax.cli"),
    ("strata_jax.loading", "strata_jax.serve"),
])
def test_import_does_not_pull_in(module, forbidden):
  got = _fresh(f"import importlib, json, sys; importlib.import_module({module!r}); "
               f"print(json.dumps({{'loaded': {forbidden!r} in sys.modules}}))")
  assert not got["loaded"], f"importing {module} imports {forbidden}"


def test_adapter_identity_has_one_home():
  # load_lora and the prefix cache both take it from the adapters' module, not from each other.
  from strata_jax import adapter_id, api
  from strata_jax.engine import prefix_cache
  assert api.adapter_identity is adapter_id.adapter_identity
  assert prefix_cache.adapter_identity is adapter_id.adapter_identity


def test_importing_session_changes_nothing_process_wide():
  # numpy and jax add warnings filters of their own at import: import them first.
  got = _fresh(
      "import json, logging, sys, warnings\n"
      "import jax, numpy\n"
      "hook, filters = sys.unraisablehook, list(warnings.filters)\n"
      "import strata_jax.session\n"
      "print(json.dumps({'hook': sys.unraisablehook is hook,\n"
      "                  'warnings': [str(f) for f in warnings.filters if f not in filters],\n"
      "                  'loggers': [logging.getLogger(n).filters == []\n"
      "                              for n in ('asyncio', 'absl')]}))")
  assert got == {"hook": True, "warnings": [], "loggers": [True, True]}
