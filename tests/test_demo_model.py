"""The embedded demo model speaks, and its demo adapter changes the style."""
import json
import os
import pathlib
import re
import subprocess
import sys
import sysconfig

import pytest

from strata_jax.api import asset_path

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMPT = "The function returns"


@pytest.fixture(scope="module")
def english():
  """Words of the Python standard library's own text (an offline English word list)."""
  words = set()
  for f in pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"):
    words.update(w.lower() for w in re.findall(r"[A-Za-z]+", f.read_text(errors="ignore")))
  return words


def _generate(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  p = subprocess.run([sys.executable, "-m", "strata_jax", "generate", "--prompt", PROMPT,
                      "-n", "24", "--json", *args],
                     capture_output=True, text=True, env=env, timeout=600)
  assert p.returncode == 0, p.stderr[-2000:]
  return json.loads(p.stdout.strip().splitlines()[-1])


def _in_vocab(text, english):
  words = re.findall(r"[A-Za-z]+", text)
  assert len(words) >= 8, text
  return sum(w.lower() in english for w in words) / len(words)


@pytest.fixture(scope="module")
def base():
  return _generate()


def test_default_model_and_adapter_style(english, base):
  sizes = [os.path.getsize(asset_path(f)) for f in ("demo-base.gguf", "demo-lora.gguf")]
  assert sum(sizes) < 20e6
  on = _generate("--lora", asset_path("demo-lora.gguf"))
  off = _generate("--lora", asset_path("demo-lora.gguf"), "--lora-off")
  assert base["lora"] is False and on["lora"] is True and off["lora"] is False
  assert off["tokens"] == base["tokens"], "switch off must equal the model without adapter"
  assert on["text"] != off["text"]
  for res in (base, on):
    assert _in_vocab(res["text"], english) >= 0.8, res["text"]


def test_default_model_mtp_head_drafts_losslessly(base):
  """The embedded model carries an MTP head trained on its own data
  (experiments/demo_model/train_mtp.py): `--spec 3` gives plain greedy's tokens, and the head
  drafts usefully (measured: 15 of 30 drafts kept on 32 tokens of this prompt; chance is
  1 in 4096)."""
  spec = _generate("--spec", "3")
  assert spec["tokens"] == base["tokens"]
  d = spec["draft"]
  assert d["proposed"] > 0 and d["accepted"] / d["proposed"] >= 0.25, d
