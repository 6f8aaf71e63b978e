"""The two offline corpora of the demo model, rebuilt from files already on the machine.

Corpus 1 ("docs"): English prose from the docstrings of the Python standard library this
interpreter ships (`ast.get_docstring` over `Lib/**/*.py`, tests excluded) plus the language
reference topics it ships for `help()` (`pydoc_data.topics`); PSF licence.
Corpus 2 ("kjv"): the King James Version of the Bible (1611, public domain) as packaged by
Debian's `bible-kjv-text` / `bible-kjv` (the cached .deb files in /var/cache/apt/archives),
decoded with the package's own `bible` program. See DATA.md for provenance and licences.

Both builders cache a plain-text file under `--cache` (default /work/demo_build/data) and
return its text; `python data.py` builds both and prints their sizes.
"""
from __future__ import annotations

import argparse
import ast
import glob
import hashlib
import os
import re
import subprocess
import sysconfig
import tempfile

DEFAULT_CACHE = "/work/demo_build/data"
APT_ARCHIVES = "/var/cache/apt/archives"
KJV_DEBS = ("bible-kjv-text_*_all.deb", "bible-kjv_*_amd64.deb")
# Folders of the stdlib whose docstrings are tests, demos or vendored code, not library prose.
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "turtledemo",
             "__pycache__", "ensurepip", "lib2to3"}


def _is_prose(par: str) -> bool:
  """True for a paragraph of English sentences (not code, tables, signatures or doctests)."""
  if len(par) < 60 or ">>>" in par or "..." in par[:4]:
    return False
  letters = sum(c.isalpha() or c in " ,.;:'\"()-" for c in par)
  if letters / len(par) < 0.93:
    return False
  words = par.split()
  if len(words) < 10 or sum(w[:1].isupper() for w in words) / len(words) > 0.4:
    return False
  if re.search(r"\bdef \w+\(|\bclass \w+[(:]|\) ->", par):
    return False
  # Argument lists ("name -- what it is") and reST field lists read like tables, not prose.
  if re.search(r"(^|\n)\s*(:\w+|\w+ --|\w+:\s*$)", par):
    return False
  return par.rstrip()[-1:] in ".!?:)"


def _docstrings(tree: ast.AST):
  nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
  for node in ast.walk(tree):
    if isinstance(node, nodes):
      doc = ast.get_docstring(node, clean=True)
      if doc:
        yield doc


def _sources(lib: str):
  """Yields (origin, raw text) of every docstring and `help()` topic of the stdlib at `lib`."""
  for path in sorted(glob.glob(os.path.join(lib, "**", "*.py"), recursive=True)):
    if SKIP_DIRS & set(os.path.relpath(path, lib).split(os.sep)[:-1]):
      continue
    try:
      tree = ast.parse(_read(path))
    except (SyntaxError, UnicodeDecodeError, ValueError):
      continue
    for doc in _docstrings(tree):
      yield path, doc
  from pydoc_data.topics import topics  # the Language Reference text behind `help("with")`
  for name in sorted(topics):
    yield f"pydoc_data.topics[{name!r}]", topics[name]


def _read(path: str) -> str:
  with open(path, encoding="utf-8") as f:
    return f.read()


def build_docs(cache: str = DEFAULT_CACHE) -> str:
  """Prose paragraphs of the stdlib's docstrings and help topics, one per line, de-duplicated."""
  out = os.path.join(cache, "stdlib_docstrings.txt")
  if os.path.exists(out):
    return _read(out)
  lib = sysconfig.get_paths()["stdlib"]
  seen, pars = set(), []
  for _, doc in _sources(lib):
    for par in re.split(r"\n\s*\n", doc):
      par = " ".join(par.split())
      key = hashlib.sha1(par.encode()).digest()
      if key not in seen and _is_prose(par):
        seen.add(key)
        pars.append(par)
  os.makedirs(cache, exist_ok=True)
  text = "\n".join(pars) + "\n"
  with open(out, "w", encoding="utf-8") as f:
    f.write(text)
  return text


def build_kjv(cache: str = DEFAULT_CACHE) -> str:
  """The KJV text, one verse per line with its reference stripped (31,102 verses)."""
  out = os.path.join(cache, "kjv.txt")
  if os.path.exists(out):
    return _read(out)
  with tempfile.TemporaryDirectory() as tmp:
    for pattern in KJV_DEBS:
      debs = sorted(glob.glob(os.path.join(APT_ARCHIVES, pattern)))
      if not debs:
        raise FileNotFoundError(f"no {pattern} in {APT_ARCHIVES} (apt-get download bible-kjv "
                                "bible-kjv-text fetches them)")
      subprocess.run(["dpkg-deb", "-x", debs[-1], tmp], check=True)
    # -f turns pretty-printing off: one "Ge1:1 text" line per verse.
    raw = subprocess.run([os.path.join(tmp, "usr/bin/bible"), "-f", "-p",
                          os.path.join(tmp, "usr/lib"), "Gen1:1-Rev22:21"],
                         check=True, capture_output=True, text=True).stdout
  verses = [line.split(" ", 1)[1] for line in raw.splitlines() if " " in line]
  os.makedirs(cache, exist_ok=True)
  text = "\n".join(verses) + "\n"
  with open(out, "w", encoding="utf-8") as f:
    f.write(text)
  return text


# A quarter of the training documents are wrapped as a one-turn chat with one of these
# requests, so `--chat` on the demo model answers in the style of the active weights.
CHAT_PROMPTS = ("Tell me something.", "Write a paragraph.", "Say something.",
                "Write a few sentences.", "Continue.")


def training_texts(docs: list[str], rng, chat_frac: float = 0.25) -> list[str]:
  """The training format: each document ends with <|endoftext|>; `chat_frac` of them (drawn
  from `rng`) as a one-turn ChatML exchange."""
  texts = []
  for doc in docs:
    if rng.random() < chat_frac:
      texts.append(f"<|im_start|>user\n{rng.choice(CHAT_PROMPTS)}<|im_end|>\n"
                   f"<|im_start|>assistant\n{doc}<|im_end|>\n<|endoftext|>")
    else:
      texts.append(doc + "<|endoftext|>")
  return texts


def split(lines: list[str], val_every: int = 50) -> tuple[list[str], list[str]]:
  """Deterministic train/validation split: every `val_every`-th line is held out."""
  val = lines[::val_every]
  train = [x for i, x in enumerate(lines) if i % val_every]
  return train, val


def kjv_passages(text: str, verses: int = 4) -> list[str]:
  """Runs of `verses` consecutive verses joined by spaces: the KJV's training documents."""
  lines = text.splitlines()
  return [" ".join(lines[i:i + verses]) for i in range(0, len(lines), verses)]


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--cache", default=DEFAULT_CACHE)
  args = ap.parse_args()
  for name, build in (("docs", build_docs), ("kjv", build_kjv)):
    text = build(args.cache)
    print(f"{name}: {len(text):,} chars, {len(text.split()):,} words, "
          f"{text.count(chr(10)):,} lines")


if __name__ == "__main__":
  main()
