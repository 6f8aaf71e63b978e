"""Tokenizer built from a GGUF's own vocabulary (`tokenizer.ggml.*`) with the `tokenizers` library,
plus chat-template rendering with jinja2."""
from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from strata_jax.errors import RequestError

# llama.cpp token types (`tokenizer.ggml.token_type`).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer split patterns by `tokenizer.ggml.pre` (the same regexes llama.cpp and the HF
# tokenizer.json files use). Anything else falls back to GPT-2's ByteLevel regex.
_QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_PATTERNS = {"qwen2": _QWEN2_PATTERN, "qwen35": _QWEN2_PATTERN, "llama-bpe": _LLAMA3_PATTERN,
                "llama3": _LLAMA3_PATTERN}

# Control tokens llama.cpp also treats as end-of-generation, by text.
_EOG_TEXTS = frozenset({"<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>",
                        "<|end_of_text|>", "<EOT>", "<|return|>"})

_P = "tokenizer.ggml."


class UnsupportedTokenizer(ValueError):
  """The GGUF's tokenizer model is not one this class implements (only "gpt2")."""


def _build_hf_tokenizer(tokens: Sequence[str], types: Sequence[int], merges: Sequence[str],
                        pre: str) -> tokenizers.Tokenizer:
  vocab = {t: i for i, t in enumerate(tokens)}
  pairs = []
  for m in merges:
    a, sep, b = m.partition(" ")
    if not sep:
      raise ValueError(f"merge {m!r} is not of the form 'a b'")
    pairs.append((a, b))
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False,
                                        byte_fallback=False))
  pattern = PRE_PATTERNS.get(pre)
  if pattern is None:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  else:
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  # Control and user-defined tokens are matched atomically in text (as llama.cpp does with
  # parse_special); their ids are those already in the vocab.
  special = [tokenizers.AddedToken(t, special=True, normalized=False)
             for t, ty in zip(tokens, types) if ty == CONTROL]
  user = [tokenizers.AddedToken(t, special=False, normalized=False)
          for t, ty in zip(tokens, types) if ty == USER_DEFINED]
  if special:
    tok.add_special_tokens(special)
  if user:
    tok.add_tokens(user)
  return tok


@functools.cache
def _byte_decoder() -> dict[str, int]:
  """GPT-2's byte-level BPE table inverted: the character standing for each byte -> the byte."""
  keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
  chars, extra = {}, 0
  for b in range(256):
    if b in keep:
      chars[chr(b)] = b
    else:
      chars[chr(256 + extra)] = b
      extra += 1
  return chars


def _raise_exception(message):
  raise RequestError(f"chat template: {message}")


def _tojson(x, indent=None, ensure_ascii=False, sort_keys=False):
  # HF's override: keep non-ASCII text readable in prompts.
  return json.dumps(x, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


class Tokenizer:
  """Byte-level BPE tokenizer from a GGUF vocabulary.

  Attributes:
    bos_id: `tokenizer.ggml.bos_token_id` (None when absent).
    eos_id: `tokenizer.ggml.eos_token_id` (None when absent).
    add_bos: whether `encode` prepends BOS (`tokenizer.ggml.add_bos_token`, default False).
    chat_template: the jinja2 source from `tokenizer.chat_template`, or None.
    eog_ids: ids that end generation: eos, eot and end-of-turn control tokens.
  """

  def __init__(self, hf: tokenizers.Tokenizer, tokens: Sequence[str], types: Sequence[int], *,
               bos_id: int | None = None, eos_id: int | None = None, eot_id: int | None = None,
               add_bos: bool = False, chat_template: str | None = None):
    self._hf = hf
    self._tokens = list(tokens)
    self._types = list(types)
    self.bos_id = bos_id
    self.eos_id = eos_id
    self.add_bos = add_bos
    self.chat_template = chat_template
    eog = {i for i in (eos_id, eot_id) if i is not None}
    eog |= {i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == CONTROL and t in _EOG_TEXTS}
    self.eog_ids = frozenset(eog)
    self._template = None

  @classmethod
  def from_gguf_kv(cls, kv: Mapping[str, Any]) -> "Tokenizer":
    """Build from GGUF key/values (`tokenizer.ggml.*`, `tokenizer.chat_template`).

    Raises:
      UnsupportedTokenizer: the tokenizer model is not byte-level BPE ("gpt2").
      ValueError: the arrays are inconsistent. Messages do not name the file; the caller does.
    """
    model = kv.get(_P + "model")
    if model != "gpt2":
      raise UnsupportedTokenizer(f"tokenizer model {model!r} is not supported "
                                 "(only 'gpt2' byte-level BPE)")
    tokens = kv.get(_P + "tokens")
    merges = kv.get(_P + "merges")
    if not tokens:
      raise ValueError(f"{_P}tokens is missing")
    if merges is None:
      raise ValueError(f"{_P}merges is missing")
    types = kv.get(_P + "token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
      raise ValueError(f"{_P}token_type has {len(types)} entries, {_P}tokens {len(tokens)}")

    def tid(key):
      v = kv.get(_P + key)
      if v is None:
        return None
      if not 0 <= int(v) < len(tokens):
        raise ValueError(f"{_P}{key} {v} is outside the vocabulary of {len(tokens)}")
      return int(v)

    hf = _build_hf_tokenizer(tokens, types, merges, str(kv.get(_P + "pre", "default")))
    return cls(hf, tokens, types, bos_id=tid("bos_token_id"), eos_id=tid("eos_token_id"),
               eot_id=tid("eot_token_id"), add_bos=bool(kv.get(_P + "add_bos_token", False)),
               chat_template=kv.get("tokenizer.chat_template"))

  @property
  def vocab_size(self) -> int:
    return len(self._tokens)

  def id_to_token(self, i: int) -> str:
    return self._tokens[i]

  def token_bytes(self, i: int) -> bytes:
    """The bytes token `i` stands for: a byte-level BPE piece mapped back through GPT-2's
    byte-to-character table; a control or user-defined token's text as UTF-8."""
    t = self._tokens[i]
    if self._types[i] in (CONTROL, USER_DEFINED):
      return t.encode("utf-8")
    table = _byte_decoder()
    return b"".join(bytes([table[c]]) if c in table else c.encode("utf-8") for c in t)

  def token_to_id(self, token: str) -> int | None:
    return self._hf.token_to_id(token)

  def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
    """Token ids of `text`; special tokens in the text are matched atomically.

    Args:
      text: the text.
      add_bos: prepend BOS; None follows the GGUF (`add_bos`).
    """
    ids = self._hf.encode(text, add_special_tokens=False).ids
    if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
      ids = [self.bos_id] + ids
    return ids

  def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
    """Text of `ids` (invalid UTF-8 from partial byte sequences becomes U+FFFD)."""
    return self._hf.decode([int(i) for i in ids], skip_special_tokens=skip_special)

  def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                          **kwargs) -> str:
    """Render a conversation to prompt text.

    Uses the GGUF's `tokenizer.chat_template` (jinja2, sandboxed, with `raise_exception`,
    `strftime_now`, `bos_token`, `eos_token`); without one, a plain-text fallback of
    "role: content" lines ending in "assistant:".

    Args:
      messages: [{"role": ..., "content": ...}, ...].
      add_generation_prompt: end with the opening of an assistant turn.
      **kwargs: extra template variables (e.g. `tools`, `enable_thinking`).

    Raises:
      RequestError: the template rejected the conversation or failed to render.
    """
    if not self.chat_template:
      return plain_chat_prompt(messages, add_generation_prompt)
    try:
      if self._template is None:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        self._template = env.from_string(self.chat_template)
      tok = lambda i: self._tokens[i] if i is not None else ""  # noqa: E731
      return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=tok(self.bos_id), eos_token=tok(self.eos_id),
                                   **kwargs)
    except jinja2.TemplateError as e:
      raise RequestError(f"chat template: {e}") from e


def plain_chat_prompt(messages: list[dict], add_generation_prompt: bool = True) -> str:
  """The fallback prompt: one "role: content" line per message, then "assistant:"."""
  text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
  return text + ("assistant:" if add_generation_prompt else "")
