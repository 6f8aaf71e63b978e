"""OpenAI endpoints: POST /v1/chat/completions and POST /v1/completions.

Streams are `data:` lines of chunks ending in `data: [DONE]`; both endpoints stream through
`_stream`, which differs between them only in how a choice is shaped.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from fastapi import APIRouter

from strata_jax.serve import schemas
from strata_jax.serve.errors import ApiError, error_body
from strata_jax.serve.generation import GenSpec, Outcome, Server, ServerDep, first, reply
from strata_jax.serve.streaming import sse, sse_response

router = APIRouter()


def usage(o: Outcome) -> dict:
  return {"prompt_tokens": o.prompt_tokens, "completion_tokens": o.completion_tokens,
          "total_tokens": o.prompt_tokens + o.completion_tokens,
          "prompt_tokens_details": {"cached_tokens": o.cached_tokens}}


def _text(content) -> str:
  if content is None or isinstance(content, str):
    return content or ""
  parts = []
  for p in content:
    if p.type != "text" or p.text is None:
      raise ApiError(400, f"content part type {p.type!r} is not supported: only text parts",
                     param="messages")
    parts.append(p.text)
  return "".join(parts)


def _one(value, name: str):
  if value not in (None, 1):
    raise ApiError(400, f"{name}={value} is not supported: this server returns one choice",
                   param=name)


def _stream(srv: Server, spec: GenSpec, events, body, envelope: dict,
            text_choice: Callable[[str], dict], done_choice: Callable[[Outcome], dict],
            opening: dict | None = None):
  """The SSE response: [opening chunk], a chunk per text delta, the finishing chunk, the usage
  chunk when `stream_options.include_usage`, `[DONE]`; an error ends it with an error object.

  Args:
    envelope: the fields every chunk starts with (id, object, created, model).
    text_choice: a text delta -> the chunk's choice.
    done_choice: the finished generation -> the last chunk's choice.
  """
  include_usage = bool(body.stream_options and body.stream_options.include_usage)

  async def gen():
    if opening is not None:
      yield sse({**envelope, "choices": [opening]})
    async for kind, x in srv.stream(spec, events):
      if kind == "text":
        yield sse({**envelope, "choices": [text_choice(x)]})
      elif kind == "done":
        yield sse({**envelope, "choices": [done_choice(x)]})
        if include_usage:
          yield sse({**envelope, "choices": [], "usage": usage(x)})
      else:
        yield sse(error_body(False, x.status, x.message, code=x.code))
    yield "data: [DONE]\n\n"

  return sse_response(gen())


@router.post("/v1/chat/completions")
async def chat_completions(body: schemas.ChatCompletionRequest, srv: ServerDep):
  _one(body.n, "n")
  messages = []
  for m in body.messages:
    msg = {"role": "system" if m.role == "developer" else m.role, "content": _text(m.content)}
    if m.name is not None:
      msg["name"] = m.name
    messages.append(msg)
  spec = srv.resolve(srv.chat_ids(messages), body,
                     first(body.max_completion_tokens, body.max_tokens), body.stop)
  cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
  if not body.stream:
    o = await srv.run(spec)
    return reply({
        "id": cid, "object": "chat.completion", "created": created, "model": srv.model_name,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": o.text},
                     "logprobs": None, "finish_reason": o.finish}],
        "usage": usage(o), "lora": o.lora}, o)
  events = await srv.start(spec)

  def choice(delta, finish=None):
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

  envelope = {"id": cid, "object": "chat.completion.chunk", "created": created,
              "model": srv.model_name}
  return _stream(srv, spec, events, body, envelope,
                 text_choice=lambda text: choice({"content": text}),
                 done_choice=lambda o: choice({}, o.finish),
                 opening=choice({"role": "assistant", "content": ""}))


@router.post("/v1/completions")
async def completions(body: schemas.CompletionRequest, srv: ServerDep):
  _one(body.n, "n")
  _one(body.best_of, "best_of")
  prompt = body.prompt
  if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
    if len(prompt) != 1:
      raise ApiError(400, f"{len(prompt)} prompts given: this server takes one prompt per "
                     "request", param="prompt")
    prompt = prompt[0]
  ids = srv.text_ids(prompt) if isinstance(prompt, str) else list(prompt)
  if not ids:
    raise ApiError(400, "the prompt is empty: at least one token is needed", param="prompt")
  spec = srv.resolve(ids, body, body.max_tokens, body.stop)
  cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

  def choice(text, finish=None, o: Outcome | None = None):
    c = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
    if o is not None and body.return_tokens:
      c["tokens"] = o.tokens
    return c

  if not body.stream:
    o = await srv.run(spec)
    return reply({
        "id": cid, "object": "text_completion", "created": created, "model": srv.model_name,
        "choices": [choice(o.text, o.finish, o)], "usage": usage(o), "lora": o.lora}, o)
  events = await srv.start(spec)
  envelope = {"id": cid, "object": "text_completion", "created": created,
              "model": srv.model_name}
  return _stream(srv, spec, events, body, envelope, text_choice=choice,
                 done_choice=lambda o: choice("", o.finish, o))
