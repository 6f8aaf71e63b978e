"""Anthropic endpoint: POST /v1/messages (stream: Anthropic's named events)."""
from __future__ import annotations

import uuid

from fastapi import APIRouter

from strata_jax.serve import schemas
from strata_jax.serve.errors import ApiError, error_body
from strata_jax.serve.generation import Outcome, ServerDep, reply
from strata_jax.serve.streaming import sse_event, sse_response

router = APIRouter()


def usage(o: Outcome) -> dict:
  return {"input_tokens": o.prompt_tokens - o.cached_tokens, "output_tokens": o.completion_tokens,
          "cache_read_input_tokens": o.cached_tokens, "cache_creation_input_tokens": 0}


def _stop_reason(o: Outcome) -> str:
  if o.stop_sequence is not None:
    return "stop_sequence"
  return "end_turn" if o.finish == "stop" else "max_tokens"


def _text(content, param: str) -> str:
  if isinstance(content, str):
    return content
  parts = []
  for b in content:
    if b.type != "text" or b.text is None:
      raise ApiError(400, f"content block type {b.type!r} is not supported: only text blocks",
                     param=param)
    parts.append(b.text)
  return "".join(parts)


@router.post("/v1/messages")
async def messages(body: schemas.MessagesRequest, srv: ServerDep):
  msgs = []
  if body.system is not None:
    system = _text(body.system, "system")
    if system:
      msgs.append({"role": "system", "content": system})
  for i, m in enumerate(body.messages):
    msgs.append({"role": m.role, "content": _text(m.content, f"messages.{i}")})
  # A final assistant turn is a prefill: the reply continues it.
  prefill = None
  if msgs[-1]["role"] == "assistant":
    prefill = msgs.pop()["content"]
  spec = srv.resolve(srv.chat_ids(msgs, prefill), body, body.max_tokens, body.stop_sequences)
  mid = f"msg_{uuid.uuid4().hex}"

  if not body.stream:
    o = await srv.run(spec)
    return reply({
        "id": mid, "type": "message", "role": "assistant", "model": srv.model_name,
        "content": [{"type": "text", "text": o.text}], "stop_reason": _stop_reason(o),
        "stop_sequence": o.stop_sequence, "usage": usage(o), "lora": o.lora}, o)
  events = await srv.start(spec)

  async def gen():
    yield sse_event("message_start", {"type": "message_start", "message": {
        "id": mid, "type": "message", "role": "assistant", "model": srv.model_name,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": len(spec.ids), "output_tokens": 0,
                  "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}}})
    yield sse_event("content_block_start", {"type": "content_block_start", "index": 0,
                                            "content_block": {"type": "text", "text": ""}})
    async for kind, x in srv.stream(spec, events):
      if kind == "text":
        yield sse_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                "delta": {"type": "text_delta", "text": x}})
      elif kind == "done":
        yield sse_event("content_block_stop", {"type": "content_block_stop", "index": 0})
        yield sse_event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": _stop_reason(x), "stop_sequence": x.stop_sequence},
            "usage": usage(x)})
        yield sse_event("message_stop", {"type": "message_stop"})
      elif kind == "error":
        yield sse_event("error", error_body(True, x.status, x.message, kind=x.kind if
                                            x.kind == "overloaded_error" else None))

  return sse_response(gen())
