"""The engine worker: one thread owns the Engine (which is not thread-safe).

HTTP handlers (on the asyncio loop) hand work to the thread through a queue; the thread hands
events back through each job's asyncio queue with `loop.call_soon_threadsafe`. The loop:

  drain the queue -> engine.submit each request; engine.step() while busy; else block on the
  queue. When a request wakes an idle engine, the thread waits a moment for the rest of a
  burst (ARRIVAL_GRACE_S after each arrival, ARRIVAL_WINDOW_S in all) so that requests sent
  together are prefilled in one round: otherwise the first one alone starts a multi-step
  decode chunk, and the others' prefills queue behind it on the device.

Calls that touch a slot (session save / restore / erase) act as barriers: the thread stops
admitting requests, finishes the running ones, runs the call on the idle engine, then goes on.
Calls made with `barrier=False` (adapter load / unload / default scales) run between two steps,
while requests stay in flight.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from strata_jax.engine.engine import Request

log = logging.getLogger("strata_jax.serve")


class WorkerUnavailable(RuntimeError):
  """The worker died, is stopping, or has too many requests queued (HTTP 503)."""

  def __init__(self, message: str, overloaded: bool = False):
    super().__init__(message)
    self.overloaded = overloaded


@dataclasses.dataclass
class _Gen:
  req: Request
  loop: asyncio.AbstractEventLoop
  events: asyncio.Queue
  cancel: threading.Event
  # events made on the worker thread during one engine step, handed to the loop at once
  # after it (a decode chunk emits up to 16 tokens a row: one wake-up of the loop, not 16)
  buf: list = dataclasses.field(default_factory=list)
  first_sent: bool = False


@dataclasses.dataclass
class _Call:
  fn: Callable[[Any], Any]
  loop: asyncio.AbstractEventLoop
  future: asyncio.Future
  barrier: bool = True


_STOP = object()
ARRIVAL_GRACE_S = 0.005    # after an arrival that woke an idle engine: wait this for the next
ARRIVAL_WINDOW_S = 0.05    # ... and no longer than this for the whole burst


def _put_all(events: asyncio.Queue, items: list):
  for item in items:
    events.put_nowait(item)


def _post(loop: asyncio.AbstractEventLoop, fn, *args):
  """Run `fn(*args)` on `loop`; a closed loop (its server is gone) drops the event."""
  try:
    loop.call_soon_threadsafe(fn, *args)
  except RuntimeError:
    pass


def _settle(future: asyncio.Future, value=None, error: BaseException | None = None):
  if future.done():   # the waiting handler was cancelled
    return
  if error is not None:
    future.set_exception(error)
  else:
    future.set_result(value)


class EngineWorker:
  """Owns `engine` on a daemon thread.

  Args:
    engine: the Engine; nothing else may touch it once the worker has started.
    max_pending: generation requests admitted at once (queued + running); more are refused
      with `WorkerUnavailable(overloaded=True)`.
  """

  def __init__(self, engine, max_pending: int = 256):
    self.engine = engine
    self.max_pending = int(max_pending)
    self.error: str | None = None
    self._q: queue.Queue = queue.Queue()
    self._lock = threading.Lock()
    self._pending = 0
    self._stopping = False
    self._thread = threading.Thread(target=self._main, name="strata-engine", daemon=True)

  # ----- the asyncio side --------------------------------------------------------------------
  def start(self):
    if not self._thread.is_alive() and self._thread.ident is None:
      self._thread.start()

  def stop(self, timeout: float = 30.0):
    """Stop admitting work, let the thread finish what it holds, and join it."""
    self._stopping = True
    self._q.put(_STOP)
    if self._thread.ident is not None:
      self._thread.join(timeout)

  @property
  def alive(self) -> bool:
    return self._thread.is_alive() and self.error is None and not self._stopping

  @property
  def pending(self) -> int:
    return self._pending

  def _check_alive(self):
    if self.error is not None:
      raise WorkerUnavailable(f"the engine worker died: {self.error}")
    if self._stopping or not self._thread.is_alive():
      raise WorkerUnavailable("the engine worker is not running (the server is shutting down)")

  def submit(self, req: Request) -> asyncio.Queue:
    """Queue `req`; returns the asyncio queue its events arrive on, in order:
    ("accepted", None) or ("error", exc), then ("token", id)... (each preceded by
    ("logprobs", entry) when `req.logprobs` is set), then ("done", Result) or ("error", exc).
    Must be called on the event loop; `req.on_token` / `req.on_logprobs` are replaced."""
    self._check_alive()
    with self._lock:
      if self._pending >= self.max_pending:
        raise WorkerUnavailable(f"the server is overloaded: {self._pending} requests are "
                                "queued or running; retry later", overloaded=True)
      self._pending += 1
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    job = _Gen(req=req, loop=loop, events=events, cancel=threading.Event())
    # called on the worker thread inside engine.step(); `_flush` hands them over after it,
    # except the first token, handed over at once: a step that admits a burst of requests
    # prefills them one after another, and each first token need not wait for the others
    def on_token(tok):
      job.buf.append(("token", int(tok)))
      if not job.first_sent:
        job.first_sent = True
        self._flush(job)
    req.on_token = on_token
    if req.logprobs is not None:   # each token's entry comes just before the token
      req.on_logprobs = lambda entry: job.buf.append(("logprobs", entry))
    # Setting this (a stop string matched, the client went away) ends the generation early.
    events.cancel = job.cancel
    self._q.put(job)
    return events

  async def call(self, fn: Callable[[Any], Any], barrier: bool = True):
    """Run `fn(engine)` on the worker thread, once the engine is idle (`barrier`) or between
    two steps (not `barrier`: running requests go on after it); returns its result."""
    self._check_alive()
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    self._q.put(_Call(fn=fn, loop=loop, future=fut, barrier=barrier))
    return await fut

  # ----- the worker thread ------------------------------------------------------------------
  def _flush(self, job: _Gen):
    if job.buf:
      items, job.buf = job.buf, []
      _post(job.loop, _put_all, job.events, items)

  def _done(self, job: _Gen, kind: str, payload):
    self._flush(job)
    with self._lock:
      self._pending -= 1
    _post(job.loop, job.events.put_nowait, (kind, payload))

  def _admit(self, job: _Gen, running: list):
    try:
      handle = self.engine.submit(job.req)
    except Exception as e:  # noqa: BLE001 - submit only validates; the engine is unchanged
      self._done(job, "error", e)
      return
    _post(job.loop, job.events.put_nowait, ("accepted", None))
    running.append((handle, job))

  def _run_call(self, job: _Call):
    try:
      out = job.fn(self.engine)
    except Exception as e:  # noqa: BLE001 - handed to the waiting handler, which maps it
      _post(job.loop, _settle, job.future, None, e)
      return
    _post(job.loop, _settle, job.future, out)

  def _main(self):
    running: list = []        # (Handle, _Gen) submitted to the engine, not finished
    barrier: _Call | None = None
    stop = False
    try:
      while True:
        # Take work: block only when the engine has nothing to do.
        burst_end = None   # set when an arrival woke an idle engine: its burst's deadline
        while barrier is None and not stop:
          idle = not self.engine.busy
          wait = burst_end - time.monotonic() if burst_end is not None else 0.0
          try:
            if idle:
              item = self._q.get()
              burst_end = time.monotonic() + ARRIVAL_WINDOW_S
            elif wait > 0:
              item = self._q.get(timeout=min(ARRIVAL_GRACE_S, wait))
            else:
              item = self._q.get_nowait()
          except queue.Empty:
            break
          if item is _STOP:
            stop = True
          elif isinstance(item, _Call) and not item.barrier:
            self._run_call(item)
          elif isinstance(item, _Call):
            barrier = item
          else:
            self._admit(item, running)
          if self.engine.busy and self._q.empty() and burst_end is None:
            break
        if self.engine.busy:
          self.engine.step()
          still = []
          for handle, job in running:
            self._flush(job)
            if handle.done:
              self._done(job, "done", handle.result)
            else:
              if job.cancel.is_set():
                handle.cancel()
              still.append((handle, job))
          running = still
        elif barrier is not None:
          self._run_call(barrier)
          barrier = None
        elif stop:
          break
    except BaseException as e:
      self.error = f"{type(e).__name__}: {e}"
      log.exception("the engine worker died")
      err = WorkerUnavailable(f"the engine worker died: {self.error}")
      for _, job in running:
        self._done(job, "error", err)
      if barrier is not None:
        _post(barrier.loop, _settle, barrier.future, None, err)
    finally:
      # Anything still queued gets an answer rather than a hang.
      err = WorkerUnavailable(
          f"the engine worker died: {self.error}" if self.error else "the server is shutting down")
      while True:
        try:
          item = self._q.get_nowait()
        except queue.Empty:
          break
        if isinstance(item, _Gen):
          self._done(item, "error", err)
        elif isinstance(item, _Call):
          _post(item.loop, _settle, item.future, None, err)
