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

from strata_jax import sampling as smp
from strata_jax.engine.engine import Request
from strata_jax.engine.sampling import SamplingParamError, check
from strata_jax.serve.errors import ApiError, event_error, unavailable
from strata_jax.serve.streaming import TextStream, cut_stop
from strata_jax.serve.worker import EngineWorker, WorkerUnavailable

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000
# Below this temperature sampling is greedy (the engine's rule, stated in the spec as 0).
MIN_TEMPERATURE = smp.MIN_TEMPERATURE


@dataclasses.dataclass
class GenSpec:
  """One resolved generation: prompt ids, sampling, stops."""
  ids: list[int]
  max_tokens: int
  temperature: float
  top_k: int
  top_p: float
  seed: int
  lora: bool | list | None       # True / False / [{"id", "scale"}] / None (the default)
  stop_ids: frozenset
  stops: list[str]               # text-level stop strings
  stop_id_text: dict             # stop-string tokens -> their string
  min_p: float = 0.0
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  repeat_penalty: float = 1.0
  logprobs: int | None = None    # top logprobs per token (0..20); None: no logprobs
  spec: int | None = None        # speculative drafts per step (None: the server's --spec)

  def request(self) -> Request:
    return Request(tokens=self.ids, max_tokens=self.max_tokens, temperature=self.temperature,
                   top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                   presence_penalty=self.presence_penalty,
                   frequency_penalty=self.frequency_penalty,
                   repeat_penalty=self.repeat_penalty, seed=self.seed,
                   stop=tuple(sorted(self.stop_ids)), lora=self.lora, logprobs=self.logprobs,
                   spec=self.spec)


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
  # (logprobs asked) [(text offset, engine entry)] of the returned text's tokens
  logprobs: list | None = None


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
  def resolve(self, ids: list[int], body, max_tokens: int | None, stops,
              logprobs: int | None = None, logprobs_param: str = "logprobs") -> GenSpec:
    """The request's generation, every sampling value checked (400 naming the parameter);
    `logprobs`: top logprobs per token, as the endpoint reads its body (None: none)."""
    d, eng = self.defaults, self.engine
    if len(ids) >= eng.max_seq:
      raise ApiError(413, f"the prompt has {len(ids)} tokens; this server holds at most "
                     f"{eng.max_seq - 1} prompt tokens per slot (--ctx-size {eng.max_seq})",
                     code="context_length_exceeded", param="prompt")
    lora = first(body.lora, d.get("lora"))
    if isinstance(lora, list):
      lora = [c.model_dump(include={"id", "scale"}) for c in lora]
    elif lora and not eng.has_lora:
      raise ApiError(400, "the request asks for the LoRA adapter (\"lora\": true) but this "
                     "server has none loaded (start it with --lora FILE)", param="lora")
    temperature = first(body.temperature, d.get("temperature"), 1.0)
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
    sp = getattr(body, "speculative", None)
    n_spec = None if sp is None else sp.n
    if n_spec is not None:
      from strata_jax.speculative import MAX_SPEC  # noqa: PLC0415
      if not 0 <= n_spec <= MAX_SPEC:
        raise ApiError(400, f"speculative.n {n_spec}: expected 0 (off) to {MAX_SPEC}",
                       param="speculative")
      if n_spec and len(eng.stages) > 1:
        raise ApiError(400, "speculative decoding runs on a one-stage model (no layer split)",
                       param="speculative")
    get = lambda name, default: first(getattr(body, name, None), default)
    spec = GenSpec(ids=[int(t) for t in ids], max_tokens=mt, temperature=temperature,
                   top_k=first(body.top_k, d.get("top_k"), 0),
                   top_p=first(body.top_p, d.get("top_p"), 1.0), seed=seed, lora=lora,
                   stop_ids=frozenset(stop_ids), stops=stops, stop_id_text=stop_id_text,
                   min_p=get("min_p", 0.0), presence_penalty=get("presence_penalty", 0.0),
                   frequency_penalty=get("frequency_penalty", 0.0),
                   repeat_penalty=get("repeat_penalty", 1.0), logprobs=logprobs,
                   spec=n_spec)
    try:   # never clamped: a bad value is the client's error, named
      check(spec.request(), names={"logprobs": logprobs_param})
    except SamplingParamError as e:
      raise ApiError(400, str(e), param=e.param) from None
    spec.temperature = 0.0 if spec.temperature < MIN_TEMPERATURE else float(spec.temperature)
    return spec

  # ----- running ---------------------------------------------------------------------------
  async def start(self, spec: GenSpec):
    """Submit; returns the event queue once the engine has accepted the request."""
    req = spec.request()
    try:
      events = self.worker.submit(req)
    except WorkerUnavailable as e:
      raise unavailable(e) from None
    kind, payload = await events.get()
    if kind == "error":
      raise event_error(payload)
    return events

  def outcome(self, spec: GenSpec, result, lp: "LogprobTrack | None" = None) -> Outcome:
    toks = list(result.tokens)
    stopped = result.finish_reason == "stop"
    gen = toks[:-1] if stopped and toks else toks
    text = (self.model.decode(gen) or "") if self.model.tokenizer is not None else ""
    text, matched = cut_stop(text, spec.stops)
    if matched is not None:
      # The engine may have run a few tokens past a stop string (several steps per dispatch,
      # stop strings checked here): the completion ends with the token that completes it.
      n = next(i for i in range(1, len(gen) + 1)
               if cut_stop(self.model.decode(gen[:i]) or "", [matched])[1] is not None)
      toks = gen[:n]
    elif stopped and toks:
      matched = spec.stop_id_text.get(toks[-1])
    return Outcome(text=text, finish="stop" if matched is not None or stopped else "length",
                   stop_sequence=matched, prompt_tokens=len(spec.ids),
                   completion_tokens=len(toks), cached_tokens=int(result.cached_tokens),
                   tokens=toks, lora=bool(result.lora), slot=int(result.slot),
                   logprobs=lp.upto(len(text)) if lp is not None else None)

  async def run(self, spec: GenSpec) -> Outcome:
    """Generate to the end; the whole `Outcome`."""
    events = await self.start(spec)
    lp = LogprobTrack(self.model, spec) if spec.logprobs is not None else None
    ts = TextStream(self.model, spec) if spec.stops or lp is not None else None
    try:
      while True:
        kind, payload = await events.get()
        if kind == "logprobs":
          lp.entry = payload
        elif kind == "token" and ts is not None:
          if lp is not None:
            lp.token(payload, len(ts.text))
          ts.push(payload)
          if ts.matched is not None:
            events.cancel.set()     # the text has its stop string: no need to go on
        elif kind == "done":
          return self.outcome(spec, payload, lp)
        elif kind == "error":
          raise event_error(payload)
    finally:
      events.cancel.set()         # a no-op once done; ends the generation if the client left

  async def stream(self, spec: GenSpec, events):
    """Yields ("text", delta) ... then ("done", Outcome) or ("error", ApiError). With logprobs
    asked, ("logprobs", [(offset, entry), ...]) comes before the text delta those tokens
    start in (and before "done" for any left)."""
    ts = TextStream(self.model, spec)
    try:
      async for item in self._stream(spec, events, ts):
        yield item
    finally:
      events.cancel.set()         # a no-op once done; ends the generation if the client left

  async def _stream(self, spec: GenSpec, events, ts: TextStream):
    lp = LogprobTrack(self.model, spec) if spec.logprobs is not None else None
    while True:
      kind, payload = await events.get()
      # The tokens already queued behind this one (a decode chunk's, handed over at once)
      # go out as one delta: one stream event for the lot, not one per token.
      delta = ""
      while kind in ("logprobs", "token"):
        if kind == "logprobs":
          lp.entry = payload
        else:
          if lp is not None:
            lp.token(payload, len(ts.text))
          delta += ts.push(payload)
          if ts.matched is not None:
            events.cancel.set()
        if events.empty():
          kind = None
          break
        kind, payload = events.get_nowait()
      if delta:
        if lp is not None:
          yield "logprobs", lp.take(ts.sent)
        yield "text", delta
      if kind is None:
        continue
      if kind == "done":
        out = self.outcome(spec, payload)
        rest = ts.finish(out.text)
        if lp is not None:
          # what the stream sent, and the rest up to the final text's end (stops applied)
          yield "logprobs", lp.take(len(out.text))
        if rest:
          yield "text", rest
        yield "done", out
        return
      elif kind == "error":
        yield "error", event_error(payload)
        return


class LogprobTrack:
  """The logprobs entries of a generation's text tokens, each at the offset in the text where
  its characters start (`TextStream`'s text before the token). Stop-id tokens have none;
  tokens past a stop string are dropped. Without a tokenizer every token is kept."""

  def __init__(self, model, spec: GenSpec):
    self.has_text = model.tokenizer is not None
    self.stop_ids = spec.stop_ids
    self.entry: dict | None = None      # the entry of the token about to arrive
    self.items: list = []
    self.sent = 0

  def token(self, tok: int, offset: int):
    entry, self.entry = self.entry, None
    if entry is not None and tok not in self.stop_ids:
      self.items.append((offset, entry))

  def upto(self, end: int) -> list:
    """Every entry whose token starts before text offset `end`."""
    return [it for it in self.items if it[0] < end or not self.has_text]

  def take(self, end: int) -> list:
    """The entries not taken before whose tokens start before `end`."""
    out = self.upto(end)[self.sent:]
    self.sent += len(out)
    return out


def reply(body: dict, o: Outcome) -> JSONResponse:
  """A non-streamed answer: `body`, with the `X-Slot-Id` header naming the slot that served it."""
  return JSONResponse(body, headers={"X-Slot-Id": str(o.slot)})


async def _server(request: HttpRequest) -> Server:
  # async: FastAPI runs a plain-def dependency in its thread pool, a hop per request
  return request.app.state.server


# The endpoints' handle on their app's `Server` (a FastAPI dependency; no request parameter).
ServerDep = Annotated[Server, Depends(_server)]
