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


def _token(model, tok: int) -> tuple[str, list[int] | None]:
  """A token's text (its bytes as UTF-8, undecodable bytes replaced) and bytes; without a
  tokenizer "token_id:<id>" and no bytes."""
  b = model.token_bytes(tok)
  if b is None:
    return f"token_id:{tok}", None
  return b.decode("utf-8", errors="replace"), list(b)


def chat_logprobs(model, items) -> dict | None:
  """OpenAI chat `logprobs` of [(offset, entry)]: {"content": [{token, logprob, bytes,
  top_logprobs: [{token, logprob, bytes}]}], "refusal": null}; None for None."""
  if items is None:
    return None
  content = []
  for _, e in items:
    text, b = _token(model, e["token"])
    top = []
    for tid, lp in e["top"].items():
      t, tb = _token(model, tid)
      top.append({"token": t, "logprob": lp, "bytes": tb})
    content.append({"token": text, "logprob": e["logprob"], "bytes": b, "top_logprobs": top})
  return {"content": content, "refusal": None}


def completion_logprobs(model, items) -> dict | None:
  """OpenAI completions `logprobs` of [(offset, entry)]: {"tokens", "token_logprobs",
  "top_logprobs" (per token the k most likely and the chosen one: up to k + 1, as OpenAI),
  "text_offset" (from the completion's start)}; None for None."""
  if items is None:
    return None
  out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
  for offset, e in items:
    text = _token(model, e["token"])[0]
    top = {_token(model, tid)[0]: lp for tid, lp in e["top"].items()}
    top.setdefault(text, e["logprob"])
    out["tokens"].append(text)
    out["token_logprobs"].append(e["logprob"])
    out["top_logprobs"].append(top)
    out["text_offset"].append(offset)
  return out


def _one(value, name: str):
  if value not in (None, 1):
    raise ApiError(400, f"{name}={value} is not supported: this server returns one choice",
                   param=name)


def _stream(srv: Server, spec: GenSpec, events, body, envelope: dict,
            text_choice: Callable[[str, list | None], dict],
            done_choice: Callable[[Outcome, list | None], dict], opening: dict | None = None):
  """The SSE response: [opening chunk], a chunk per text delta, the finishing chunk, the usage
  chunk when `stream_options.include_usage`, `[DONE]`; an error ends it with an error object.

  Args:
    envelope: the fields every chunk starts with (id, object, created, model).
    text_choice: (a text delta, its tokens' logprobs items or None) -> the chunk's choice.
    done_choice: (the finished generation, logprobs items left or None) -> the last chunk's
      choice.
  """
  include_usage = bool(body.stream_options and body.stream_options.include_usage)

  async def gen():
    if opening is not None:
      yield sse({**envelope, "choices": [opening]})
    items = None          # logprobs of the tokens the next text delta starts with
    async for kind, x in srv.stream(spec, events):
      if kind == "logprobs":
        items = (items or []) + x
      elif kind == "text":
        yield sse({**envelope, "choices": [text_choice(x, items)]})
        items = None
      elif kind == "done":
        yield sse({**envelope, "choices": [done_choice(x, items or None)]})
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
  if body.top_logprobs is not None and not body.logprobs:
    raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
  k = (body.top_logprobs or 0) if body.logprobs else None
  spec = srv.resolve(srv.chat_ids(messages), body,
                     first(body.max_completion_tokens, body.max_tokens), body.stop,
                     logprobs=k, logprobs_param="top_logprobs")
  cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
  if not body.stream:
    o = await srv.run(spec)
    return reply({
        "id": cid, "object": "chat.completion", "created": created, "model": srv.model_name,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": o.text},
                     "logprobs": chat_logprobs(srv.model, o.logprobs),
                     "finish_reason": o.finish}],
        "usage": usage(o), "lora": o.lora}, o)
  events = await srv.start(spec)

  def choice(delta, finish=None, items=None):
    return {"index": 0, "delta": delta, "logprobs": chat_logprobs(srv.model, items),
            "finish_reason": finish}

  envelope = {"id": cid, "object": "chat.completion.chunk", "created": created,
              "model": srv.model_name}
  return _stream(srv, spec, events, body, envelope,
                 text_choice=lambda text, items: choice({"content": text}, None, items),
                 done_choice=lambda o, items: choice({}, o.finish, items),
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
  spec = srv.resolve(ids, body, body.max_tokens, body.stop, logprobs=body.logprobs)
  cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

  def choice(text, finish=None, o: Outcome | None = None, items=None):
    c = {"text": text, "index": 0, "logprobs": completion_logprobs(srv.model, items),
         "finish_reason": finish}
    if o is not None and body.return_tokens:
      c["tokens"] = o.tokens
    return c

  if not body.stream:
    o = await srv.run(spec)
    return reply({
        "id": cid, "object": "text_completion", "created": created, "model": srv.model_name,
        "choices": [choice(o.text, o.finish, o, o.logprobs)], "usage": usage(o),
        "lora": o.lora}, o)
  events = await srv.start(spec)
  envelope = {"id": cid, "object": "text_completion", "created": created,
              "model": srv.model_name}
  return _stream(srv, spec, events, body, envelope,
                 text_choice=lambda text, items: choice(text, items=items),
                 done_choice=lambda o, items: choice("", o.finish, o, items))
