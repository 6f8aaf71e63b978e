"""Executes every notebook in notebooks/ with nbclient (CPU, the embedded demo model) and fails
on any cell error. Notebooks are kept output-free; that is checked too.

`python tests/test_notebooks.py --save-images` runs the parity and adapter notebooks once
more and writes their figures to docs/images/ (the notebooks themselves stay output-free).
"""
from __future__ import annotations

import os
import pathlib
import re
import sys
import tempfile

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parent.parent
NB_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NB_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 300
# A path to tests/ put on sys.path, or a module imported from it.
_TESTS_IMPORT = re.compile(r"sys\.path\.\w+\(.*tests|^\s*(from|import)\s+tests\b", re.M)
# notebook -> (variable holding the figure, image file under docs/images/)
IMAGES = {"02_parity": ("fig", "parity_error.png"),
          "05_adapter_inspection": ("fig", "adapter_norms.png")}


def kernel_env() -> dict[str, str]:
  """The kernel's environment: CPU only, and the tests' persistent compilation cache so that
  notebooks compiling the same shapes (and later runs) reuse each other's programs."""
  cache = os.environ.get("STRATA_TEST_JAX_CACHE", "/tmp/strata-jax-test-cache")
  return {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": cache,
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def execute(nb) -> None:
  """Runs `nb` with its kernel in a fresh empty directory: a notebook must not depend on the
  directory it is opened from (nor reach into tests/ through it)."""
  with tempfile.TemporaryDirectory(prefix="strata-nb-") as cwd:
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": cwd}})
    client.execute(env=kernel_env())


def test_notebooks_found():
  assert [p.stem for p in NOTEBOOKS] == ["01_quickstart", "02_parity", "03_caches_sessions",
                                         "04_layer_split", "05_adapter_inspection"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path):
  nb = nbformat.read(path, as_version=4)
  dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
           and (c.get("outputs") or c.get("execution_count") is not None)]
  assert not dirty, f"{path.name}: cells {dirty} were saved with outputs; strip them"
  imports_tests = [i for i, c in enumerate(nb.cells)
                   if c.cell_type == "code" and _TESTS_IMPORT.search(c.source)]
  assert not imports_tests, f"{path.name}: cells {imports_tests} import from tests/"
  execute(nb)   # raises CellExecutionError, naming the cell and the traceback, on any error


def save_images() -> None:
  out = ROOT / "docs" / "images"
  out.mkdir(parents=True, exist_ok=True)
  for stem, (var, name) in IMAGES.items():
    nb = nbformat.read(NB_DIR / f"{stem}.ipynb", as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(f"{var}.savefig({str(out / name)!r}, dpi=150)"))
    execute(nb)
    print("wrote", out / name)


if __name__ == "__main__":
  if sys.argv[1:] != ["--save-images"]:
    sys.exit(__doc__)
  save_images()
