"""Streaming, written once for every endpoint: the incremental detokenizer with stop strings,
and server-sent-event framing."""
from __future__ import annotations

import json

from fastapi.responses import StreamingResponse

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def cut_stop(text: str, stops: list[str], start: int = 0) -> tuple[str, str | None]:
  """Cut `text` at the earliest stop string found at or after `start`."""
  best, which = None, None
  for s in stops:
    i = text.find(s, start)
    if i >= 0 and (best is None or i < best):
      best, which = i, s
  return (text, None) if best is None else (text[:best], which)


class TextStream:
  """Incremental detokenizer for streaming: emits text only when it is final (no partial UTF-8
  sequence, no possible start of a stop string), and cuts at the first stop string.

  Args:
    model: the loaded model (its tokenizer decodes).
    spec: the request's `GenSpec` (stop strings and stop token ids).
  """

  def __init__(self, model, spec):
    self.model, self.spec = model, spec
    self.ids: list[int] = []
    self.text = ""
    self.sent = 0
    self.matched: str | None = None
    self._prefix = self._read = 0
    self._maxstop = max((len(s) for s in spec.stops), default=0)

  def push(self, tok: int) -> str:
    if self.matched is not None or tok in self.spec.stop_ids or self.model.tokenizer is None:
      return ""
    self.ids.append(tok)
    # Decode a window starting a few tokens back, so merges at the seam come out right.
    before = self.model.decode(self.ids[self._prefix:self._read]) or ""
    after = self.model.decode(self.ids[self._prefix:]) or ""
    if len(after) > len(before) and after.startswith(before) and not after.endswith("\ufffd"):
      self.text += after[len(before):]
      self._prefix, self._read = self._read, len(self.ids)
    return self._emit(final=False)

  def _holdback(self) -> int:
    for k in range(min(self._maxstop - 1, len(self.text) - self.sent), 0, -1):
      tail = self.text[-k:]
      if any(s.startswith(tail) for s in self.spec.stops):
        return k
    return 0

  def _emit(self, final: bool) -> str:
    if self.spec.stops and self.matched is None:
      self.text, self.matched = cut_stop(self.text, self.spec.stops,
                                         max(0, self.sent - self._maxstop))
    end = len(self.text)
    if not final and self.matched is None:
      end -= self._holdback()
    out = self.text[self.sent:end] if end > self.sent else ""
    self.sent = max(self.sent, end)
    return out

  def finish(self, full_text: str) -> str:
    """The rest of the text, given the exact (whole-sequence) decode, stops applied."""
    sent = self.text[:self.sent]
    if full_text.startswith(sent):
      self.text = full_text
    self.matched = None
    return self._emit(final=True)


def sse(obj) -> str:
  """One `data:` event (OpenAI streams)."""
  return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_event(event: str, obj) -> str:
  """One named event (Anthropic streams)."""
  return f"event: {event}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_response(events) -> StreamingResponse:
  """The HTTP response streaming the strings of the async iterator `events`."""
  return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
