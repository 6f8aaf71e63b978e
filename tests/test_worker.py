"""The server's engine worker (`strata_jax.serve.worker`) against a stand-in engine that records
what it was asked: how arrivals are grouped into engine rounds."""
import asyncio
import threading
import time

from strata_jax.engine.engine import Request
from strata_jax.serve import worker as worker_mod
from strata_jax.serve.worker import EngineWorker


class _Handle:
  def __init__(self):
    self.done, self.result = False, None

  def cancel(self):
    self.done = True


class RecordingEngine:
  """Each submitted request finishes at the engine's second step after it; `rounds` lists the
  requests each step found submitted and not yet started."""

  def __init__(self):
    self.queued, self.running, self.rounds = [], [], []
    self.lock = threading.Lock()

  @property
  def busy(self):
    return bool(self.queued or self.running)

  def submit(self, req):
    h = _Handle()
    with self.lock:
      self.queued.append((req, h, 0))
    return h

  def step(self):
    with self.lock:
      self.rounds.append([r.tokens[0] for r, _, _ in self.queued])
      self.running += self.queued
      self.queued = []
      still = []
      for req, h, n in self.running:
        if n + 1 >= 2:
          h.done, h.result = True, req.tokens[0]
        else:
          still.append((req, h, n + 1))
      self.running = still
    time.sleep(0.01)   # a decode chunk's worth of device time


async def _submit_spread(w, n, gap_s):
  queues = []
  for i in range(n):
    queues.append(w.submit(Request(tokens=[i], max_tokens=1)))
    await asyncio.sleep(gap_s)
  for q in queues:
    while (await q.get())[0] != "done":
      pass


def _rounds(n, gap_s):
  eng = RecordingEngine()
  w = EngineWorker(eng)
  w.start()
  try:
    asyncio.run(_submit_spread(w, n, gap_s))
  finally:
    w.stop()
  return [r for r in eng.rounds if r]


def test_a_burst_that_wakes_an_idle_engine_starts_in_one_round(monkeypatch):
  """Requests arriving 2 ms apart, within the grace of each other, are all submitted before
  the engine's first step (the grace widened here so a loaded machine's timers fit in it)."""
  monkeypatch.setattr(worker_mod, "ARRIVAL_GRACE_S", 0.05)
  monkeypatch.setattr(worker_mod, "ARRIVAL_WINDOW_S", 2.0)
  assert _rounds(6, 0.002)[0] == list(range(6))


def test_arrivals_further_apart_than_the_grace_do_not_wait_for_each_other(monkeypatch):
  """A request arriving after the grace has passed is not held back: the first starts alone,
  though the burst's window is still open."""
  monkeypatch.setattr(worker_mod, "ARRIVAL_WINDOW_S", 2.0)
  rounds = _rounds(2, worker_mod.ARRIVAL_GRACE_S + 0.2)
  assert rounds[0] == [0] and [1] in rounds
