"""Per-app state and the generation plumbing every endpoint shares: a request body resolved
against the server's defaults (`GenSpec`), submitted to the worker, and read back whole
(`Server.run`) or as text deltas (`Server.stream`), ending in an `Outcome`."""
from __future__ import annotations

import dataclasses
import os
import secrets
import time
from typing import Annotated

from fastapi import Depends
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse

from strata_jax.engine.engine import Request
from strata_jax.serve.errors import ApiError, event_error, unavailable
from strata_jax.serve.streaming import TextStream, cut_stop
from strata_jax.serve.worker import EngineWorker, WorkerUnavailable

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000
# Below this temperature sampling is greedy: logits / T would overflow float64 for T -> 0.
MIN_TEMPERATURE = 1e-5


@dataclasses.dataclass
class GenSpec:
  """One resolved generation: prompt ids, sampling, stops."""
  ids: list[int]
  max_tokens: int
  temperature: float
  top_k: int
  top_p: float
  seed: int
  lora: bool | None
  stop_ids: frozenset
  stops: list[str]               # text-level stop strings
  stop_id_text: dict             # stop-string tokens -> their string
  spec: int | None = None        # speculative drafts per step (None: the server's --spec)


@dataclasses.dataclass
class Outcome:
  """A finished generation, as every API reports it."""
  text: str
  finish: str            # "stop" | "length"
  stop_sequence: str | None
  prompt_tokens: int
  completion_tokens: int
  cached_tokens: int
  tokens: list[int]
  lora: bool
  slot: int


def first(*values):
  """The first of `values` that is not None (a request field, then a default, ...)."""
  return next((v for v in values if v is not None), None)


class Server:
  """Per-app state (`app.state.server`) and the generation plumbing shared by the endpoints."""

  def __init__(self, engine, worker: EngineWorker, model_name: str, slot_save_path: str | None,
               defaults: dict, max_tokens_cap: int | None):
    self.engine, self.worker, self.model = engine, worker, engine.model
    self.model_name, self.defaults = model_name, defaults
    self.slot_save_path = os.path.abspath(slot_save_path) if slot_save_path else None
    self.max_tokens_cap = max_tokens_cap
    self.created = int(time.time())

  # ----- prompts ---------------------------------------------------------------------------
  def chat_ids(self, messages: list[dict], prefill: str | None = None) -> list[int]:
    tok = self.model.tokenizer
    if tok is None or not hasattr(tok, "apply_chat_template"):
      raise ApiError(400, "this model has no tokenizer or chat template: use /v1/completions "
                     "with a prompt of token ids")
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    return self.model.encode(text + (prefill or ""))

  def text_ids(self, text: str) -> list[int]:
    if self.model.tokenizer is None:
      raise ApiError(400, "this model has no tokenizer: give the prompt as a list of token ids",
                     param="prompt")
    return self.model.encode(text)

  # ----- sampling --------------------------------------------------------------------------
  def resolve(self, ids: list[int], body, max_tokens: int | None, stops) -> GenSpec:
    d, eng = self.defaults, self.engine
    if len(ids) >= eng.max_seq:
      raise ApiError(413, f"the prompt has {len(ids)} tokens; this server holds at most "
                     f"{eng.max_seq - 1} prompt tokens per slot (--ctx-size {eng.max_seq})",
                     code="context_length_exceeded", param="prompt")
    lora = first(body.lora, d.get("lora"))
    if lora and not eng.has_lora:
      raise ApiError(400, "the request asks for the LoRA adapter (\"lora\": true) but this "
                     "server has none loaded (start it with --lora FILE)", param="lora")
    temperature = float(first(body.temperature, d.get("temperature"), 1.0))
    if temperature < MIN_TEMPERATURE:
      temperature = 0.0
    mt = int(first(max_tokens, d.get("max_tokens"), eng.max_seq))
    if self.max_tokens_cap is not None:
      mt = min(mt, self.max_tokens_cap)
    stops = [stops] if isinstance(stops, str) else list(stops or [])
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
      raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings of at most "
                     f"{MAX_STOP_CHARS} characters each", param="stop")
    stops = [s for s in stops if s]
    stop_ids, stop_id_text = set(self.model.stop_ids()), {}
    for s in stops:
      if self.model.tokenizer is None:
        raise ApiError(400, "stop strings need a tokenizer; this model has none", param="stop")
      one = self.model.encode(s)
      if len(one) == 1 and one[0] not in stop_ids:   # the engine stops on it directly
        stop_ids.add(one[0])
        stop_id_text[one[0]] = s
    seed = body.seed % (1 << 63) if body.seed is not None else secrets.randbits(63)
    spec = getattr(body, "speculative", None)
    n_spec = None if spec is None else spec.n
    if n_spec is not None:
      from strata_jax.speculative import MAX_SPEC  # noqa: PLC0415
      if not 0 <= n_spec <= MAX_SPEC:
        raise ApiError(400, f"speculative.n {n_spec}: expected 0 (off) to {MAX_SPEC}",
                       param="speculative")
      if n_spec and len(eng.stages) > 1:
        raise ApiError(400, "speculative decoding runs on a one-stage model (no layer split)",
                       param="speculative")
    return GenSpec(spec=n_spec, ids=[int(t) for t in ids], max_tokens=mt, temperature=temperature,
                   top_k=int(first(body.top_k, d.get("top_k"), 0)),
                   top_p=float(first(body.top_p, d.get("top_p"), 1.0)), seed=seed, lora=lora,
                   stop_ids=frozenset(stop_ids), stops=stops, stop_id_text=stop_id_text)

  # ----- running ---------------------------------------------------------------------------
  async def start(self, spec: GenSpec):
    """Submit; returns the event queue once the engine has accepted the request."""
    req = Request(tokens=spec.ids, max_tokens=spec.max_tokens, temperature=spec.temperature,
                  top_k=spec.top_k, top_p=spec.top_p, seed=spec.seed,
                  stop=tuple(sorted(spec.stop_ids)), lora=spec.lora, spec=spec.spec)
    try:
      events = self.worker.submit(req)
    except WorkerUnavailable as e:
      raise unavailable(e) from None
    kind, payload = await events.get()
    if kind == "error":
      raise event_error(payload)
    return events

  def outcome(self, spec: GenSpec, result) -> Outcome:
    toks = list(result.tokens)
    stopped = result.finish_reason == "stop"
    gen = toks[:-1] if stopped and toks else toks
    text = (self.model.decode(gen) or "") if self.model.tokenizer is not None else ""
    text, matched = cut_stop(text, spec.stops)
    if matched is None and stopped and toks:
      matched = spec.stop_id_text.get(toks[-1])
    return Outcome(text=text, finish="stop" if matched is not None or stopped else "length",
                   stop_sequence=matched, prompt_tokens=len(spec.ids),
                   completion_tokens=len(toks), cached_tokens=int(result.cached_tokens),
                   tokens=toks, lora=bool(result.lora), slot=int(result.slot))

  async def run(self, spec: GenSpec) -> Outcome:
    """Generate to the end; the whole `Outcome`."""
    events = await self.start(spec)
    ts = TextStream(self.model, spec) if spec.stops else None
    try:
      while True:
        kind, payload = await events.get()
        if kind == "token" and ts is not None:
          ts.push(payload)
          if ts.matched is not None:
            events.cancel.set()     # the text has its stop string: no need to go on
        elif kind == "done":
          return self.outcome(spec, payload)
        elif kind == "error":
          raise event_error(payload)
    finally:
      events.cancel.set()         # a no-op once done; ends the generation if the client left

  async def stream(self, spec: GenSpec, events):
    """Yields ("text", delta) ... then ("done", Outcome) or ("error", ApiError)."""
    ts = TextStream(self.model, spec)
    try:
      async for item in self._stream(spec, events, ts):
        yield item
    finally:
      events.cancel.set()         # a no-op once done; ends the generation if the client left

  async def _stream(self, spec: GenSpec, events, ts: TextStream):
    while True:
      kind, payload = await events.get()
      if kind == "token":
        delta = ts.push(payload)
        if ts.matched is not None:
          events.cancel.set()
        if delta:
          yield "text", delta
      elif kind == "done":
        out = self.outcome(spec, payload)
        rest = ts.finish(out.text)
        if rest:
          yield "text", rest
        yield "done", out
        return
      elif kind == "error":
        yield "error", event_error(payload)
        return


def reply(body: dict, o: Outcome) -> JSONResponse:
  """A non-streamed answer: `body`, with the `X-Slot-Id` header naming the slot that served it."""
  return JSONResponse(body, headers={"X-Slot-Id": str(o.slot)})


def _server(request: HttpRequest) -> Server:
  return request.app.state.server


# The endpoints' handle on their app's `Server` (a FastAPI dependency; no request parameter).
ServerDep = Annotated[Server, Depends(_server)]
