"""The server's sampling defaults: `--config FILE` and `create_app(defaults=...)`."""
from __future__ import annotations

import json
import math

from strata_jax.errors import StrataError

SAMPLING_KEYS = ("lora", "temperature", "top_k", "top_p", "max_tokens")


def json_type(v) -> str:
  """How a JSON value's type reads in an error message ("an object", "null", ...)."""
  return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
          type(None): "null"}.get(type(v), "a number")


def check_sampling_defaults(sampling, where: str = "config") -> dict:
  """Validate a {"lora", "temperature", "top_k", "top_p", "max_tokens"} dict of defaults.

  Raises:
    StrataError: naming `where`, the key and what was expected.
  """
  if not isinstance(sampling, dict):
    raise StrataError(f"{where}: \"sampling\" must be a JSON object, got {json_type(sampling)}")
  unknown = sorted(set(sampling) - set(SAMPLING_KEYS))
  if unknown:
    raise StrataError(f"{where}: unknown sampling key(s) {', '.join(map(repr, unknown))}; "
                      f"allowed: {', '.join(SAMPLING_KEYS)}")

  def number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

  def integer(v):
    return isinstance(v, int) and not isinstance(v, bool)

  rules = {
      "lora": (lambda v: isinstance(v, bool), "true or false"),
      "temperature": (lambda v: number(v) and v >= 0, "a number >= 0"),
      "top_k": (lambda v: integer(v) and v >= 0, "an integer >= 0"),
      "top_p": (lambda v: number(v) and 0 <= v <= 1, "a number in [0, 1]"),
      "max_tokens": (lambda v: integer(v) and v >= 1, "an integer >= 1"),
  }
  for key, value in sampling.items():
    ok, expected = rules[key]
    if not ok(value):
      raise StrataError(f"{where}: sampling.{key} must be {expected}, got {json.dumps(value)}")
  return dict(sampling)


def load_config(path: str) -> dict:
  """Read `--config FILE`: {"sampling": {...defaults}}; returns the sampling defaults."""
  try:
    with open(path, encoding="utf-8") as f:
      raw = json.load(f)
  except OSError as e:
    raise StrataError(f"{path}: cannot read the server config: {e.strerror or e}") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise StrataError(f"{path}: the server config is not valid JSON: {e}") from None
  if not isinstance(raw, dict):
    raise StrataError(f"{path}: the server config must be a JSON object, got {json_type(raw)}")
  unknown = sorted(set(raw) - {"sampling"})
  if unknown:
    raise StrataError(f"{path}: unknown config key(s) {', '.join(map(repr, unknown))}; "
                      "allowed: sampling")
  return check_sampling_defaults(raw.get("sampling", {}), where=path)
