"""Host side of sampling: request checks and the per-row arrays handed to the device sampler
(`strata_jax.sampling` holds the math; `strata_jax.steps` its jit sites)."""
from __future__ import annotations

import math

import numpy as np

from strata_jax import sampling as dev
from strata_jax.errors import RequestError

_F32_MAX = float(np.finfo(np.float32).max)


class SamplingParamError(RequestError):
  """A bad sampling parameter; `param` names it (the field of `Request`, or `names`' entry)."""

  def __init__(self, param: str, message: str):
    super().__init__(message)
    self.param = param


def _number(name: str, v, lo=None, hi=None, lo_open=False):
  if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
    raise SamplingParamError(name, f"{name} must be a number, got {v!r}")
  if not (math.isfinite(float(v)) and abs(float(v)) <= _F32_MAX):   # held as float32
    raise SamplingParamError(name, f"{name} must be a finite number, got {v!r}")
  v = float(v)
  if lo is not None and (v <= lo if lo_open else v < lo):
    raise SamplingParamError(name, f"{name} must be {'>' if lo_open else '>='} {lo:g}, "
                             f"got {v:g}")
  if hi is not None and v > hi:
    raise SamplingParamError(name, f"{name} must be <= {hi:g}, got {v:g}")
  return v


def _integer(name: str, v, lo=None, hi=None):
  if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
    raise SamplingParamError(name, f"{name} must be an integer, got {v!r}")
  if (lo is not None and v < lo) or (hi is not None and v > hi):
    rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    raise SamplingParamError(name, f"{name} must be an integer {rng}, got {v}")
  return int(v)


def check(req, names: dict | None = None) -> None:
  """Raise SamplingParamError (a RequestError naming the parameter) for a bad sampling
  parameter of `req` (a `Request`); never clamps. `names` maps Request fields to the names
  the caller's users know (an HTTP body's, a CLI flag's)."""
  n = lambda f: (names or {}).get(f, f)
  _number(n("temperature"), req.temperature, lo=0.0)
  _integer(n("top_k"), req.top_k, lo=0, hi=2**31 - 1)   # beyond the vocabulary: all kept
  _number(n("top_p"), req.top_p, lo=0.0, hi=1.0)
  _number(n("min_p"), req.min_p, lo=0.0, hi=1.0)
  _number(n("presence_penalty"), req.presence_penalty)
  _number(n("frequency_penalty"), req.frequency_penalty)
  _number(n("repeat_penalty"), req.repeat_penalty, lo=0.0, lo_open=True)
  _integer(n("seed"), req.seed)
  if req.logprobs is not None:
    _integer(n("logprobs"), req.logprobs, lo=0, hi=dev.MAX_LOGPROBS)


def path(req) -> int:
  return dev.row_path(float(req.temperature), int(req.top_k), float(req.top_p))


def penalised(req) -> bool:
  return (req.repeat_penalty != 1.0 or req.presence_penalty != 0.0
          or req.frequency_penalty != 0.0)


def plan_for(reqs, with_top: bool | None = None) -> dev.Plan:
  """The smallest static plan that covers every request in `reqs`."""
  paths = {path(r) for r in reqs}
  top = any((r.logprobs or 0) > 0 for r in reqs) if with_top is None else with_top
  return dev.Plan(penalties=any(penalised(r) for r in reqs), cap=dev.CAP in paths,
                  full=dev.FULL in paths, nucleus=dev.NUCLEUS in paths,
                  nucleus_top_k=any(path(r) == dev.NUCLEUS and r.top_k > 0 for r in reqs),
                  n_top=dev.MAX_LOGPROBS if top else 0,
                  logprobs=any(r.logprobs is not None for r in reqs))


class RowParams:
  """Host numpy arrays [B] of every row's sampling parameters, LoRA switch and stop ids."""

  FIELDS = ("temperature", "top_k", "top_p", "min_p", "presence", "frequency", "repeat",
            "seed_lo", "seed_hi")

  def __init__(self, n: int, n_stop: int = 8):
    self.n = n
    self.a = dict(temperature=np.zeros(n, np.float32), top_k=np.zeros(n, np.int32),
                  top_p=np.ones(n, np.float32), min_p=np.zeros(n, np.float32),
                  presence=np.zeros(n, np.float32), frequency=np.zeros(n, np.float32),
                  repeat=np.ones(n, np.float32), seed_lo=np.zeros(n, np.uint32),
                  seed_hi=np.zeros(n, np.uint32))
    self.switch = np.zeros(n, np.int32)
    self.stop = np.full((n, n_stop), -1, np.int32)

  def set(self, i: int, req, switch: int):
    a = self.a
    a["temperature"][i], a["top_k"][i], a["top_p"][i] = req.temperature, req.top_k, req.top_p
    a["min_p"][i], a["presence"][i] = req.min_p, req.presence_penalty
    a["frequency"][i], a["repeat"][i] = req.frequency_penalty, req.repeat_penalty
    seed = int(req.seed) % (1 << 64)
    a["seed_lo"][i], a["seed_hi"][i] = seed & 0xFFFFFFFF, seed >> 32
    self.switch[i] = switch
    stop = sorted({int(t) for t in req.stop})
    if len(stop) > self.stop.shape[1]:   # a wider power-of-two table (one more program)
      w = 1 << (len(stop) - 1).bit_length()
      self.stop = np.concatenate(
          [self.stop, np.full((self.n, w - self.stop.shape[1]), -1, np.int32)], axis=1)
    self.stop[i] = -1
    self.stop[i, :len(stop)] = stop

  def params(self, rows=None) -> dev.SamplingParams:
    pick = (lambda x: x) if rows is None else (lambda x: x[rows])
    return dev.SamplingParams(**{k: pick(v) for k, v in self.a.items()})

  def stops(self, rows=None):
    return self.stop if rows is None else self.stop[rows]


def first_rows(prompt: list[int], remaining: int) -> dev.Rows:
  """One row (numpy) about to choose its first token after `prompt`."""
  recent = np.full((1, dev.RECENT), -1, np.int32)
  tail = prompt[-dev.RECENT:]
  recent[0, dev.RECENT - len(tail):] = tail
  one = lambda v: np.asarray([v], np.int32)
  return dev.Rows(last=one(0), active=one(1), remaining=one(remaining), n_gen=one(0),
                  recent=recent)


def empty_rows(n: int) -> dev.Rows:
  z = np.zeros(n, np.int32)
  return dev.Rows(last=z, active=z.copy(), remaining=z.copy(), n_gen=z.copy(),
                  recent=np.full((n, dev.RECENT), -1, np.int32))
