"""Request bodies of the HTTP API (pydantic), as the OpenAPI schema describes them.

Field types are checked here (a wrong type is a 422); values that depend on the loaded model or
engine (token ids, prompt length, the LoRA switch) are checked by the handlers (400 / 413).
Unknown fields are accepted and ignored, as the OpenAI and Anthropic clients send optional
parameters this server does not implement (tools, metadata, ...).
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

# Sampling values are typed here (a wrong type is a 422); their ranges (NaN, a negative
# temperature, top_p outside [0, 1], ...) are checked with the engine's own rules when the
# request is resolved: a 400 naming the parameter (`strata_jax.engine.sampling.check`).
MaxTokens = Annotated[int, Field(ge=1)]


class _Body(BaseModel):
  model_config = ConfigDict(extra="allow")


class Speculative(_Body):
  n: int


class LoraChoice(_Body):
  """One adapter of a request, as llama.cpp's server takes it: `{"id": 0, "scale": 0.5}`.
  A missing scale is the adapter's default; the value checks (id loaded, scale finite and
  >= 0) are the engine's (400)."""
  id: int
  scale: float | None = None


class _Sampling(_Body):
  """Fields every generation endpoint shares. `lora`: None = the server's default."""
  temperature: float | None = None
  top_p: float | None = None
  top_k: int | None = None
  min_p: float | None = Field(default=None, description="llama.cpp's min-p; 0 = off")
  presence_penalty: float | None = None
  frequency_penalty: float | None = None
  repeat_penalty: float | None = Field(default=None, description="llama.cpp's; 1 = off")
  seed: int | None = None
  stream: StrictBool | None = False
  lora: StrictBool | list[LoraChoice] | None = Field(
      default=None, description="LoRA for this request: true (every loaded adapter at its "
      "default scale), false (none), or llama.cpp's [{\"id\": 0, \"scale\": 0.5}, ...] "
      "(the adapters not listed are off); absent: the server default (on when one is loaded)")
  speculative: Speculative | None = Field(
      default=None, description='speculative decoding for this request, {"n": N} drafts per '
      "step (0: off); absent: the server's --spec")


# ----- OpenAI ------------------------------------------------------------------------------
class TextPart(_Body):
  type: str
  text: str | None = None


class ChatMessage(_Body):
  role: Literal["system", "developer", "user", "assistant", "tool", "function"]
  content: str | list[TextPart] | None = None
  name: str | None = None


class StreamOptions(_Body):
  include_usage: StrictBool | None = None


class _OpenAISampling(_Sampling):
  model: str | None = None
  max_tokens: MaxTokens | None = None
  stop: str | list[str] | None = None
  n: int | None = None
  stream_options: StreamOptions | None = None


class ChatCompletionRequest(_OpenAISampling):
  messages: list[ChatMessage] = Field(min_length=1)
  max_completion_tokens: MaxTokens | None = None
  logprobs: StrictBool | None = Field(
      default=None, description="each output token's logprob (choices[].logprobs.content)")
  top_logprobs: StrictInt | None = Field(
      default=None, description="0..20 most likely tokens per position (needs logprobs)")


class CompletionRequest(_OpenAISampling):
  prompt: str | list[int] | list[str] | list[list[int]] = Field(
      description="text, a list of token ids, or a one-element list of either")
  best_of: int | None = None
  logprobs: StrictInt | None = Field(
      default=None, description="0..20: the chosen token's logprob and this many most likely")
  return_tokens: StrictBool = Field(
      default=False, description="add the generated token ids to each choice (llama.cpp)")


# ----- Anthropic ---------------------------------------------------------------------------
class ContentBlock(_Body):
  type: str
  text: str | None = None


class AnthropicMessage(_Body):
  role: Literal["user", "assistant"]
  content: str | list[ContentBlock]


class MessagesRequest(_Sampling):
  model: str | None = None
  max_tokens: MaxTokens
  messages: list[AnthropicMessage] = Field(min_length=1)
  system: str | list[ContentBlock] | None = None
  stop_sequences: list[str] | None = None


# ----- LoRA adapters (llama.cpp's /lora-adapters, plus hot load / unload) -------------------
class LoraLoadRequest(_Body):
  path: str = Field(description="adapter GGUF file, as the server process sees it")
  scale: float = Field(default=1.0, description="its default scale")


class LoraUnloadRequest(_Body):
  id: int


# ----- slots (llama.cpp) -------------------------------------------------------------------
class SlotRequest(_Body):
  filename: str | None = Field(
      default=None, description="session name inside --slot-save-path (one path component)")
