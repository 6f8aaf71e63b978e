"""Hermetic fixtures for parity checks, importable from tests, notebooks and experiments alike:
a tiny random transformers Qwen3-Next checkpoint with a trained byte-level BPE tokenizer, and the
bound that fp32 logits are held to against transformers.

`save_tiny_hf` needs the test extra (`pip install 'strata-jax[test]'`: transformers, torch).
"""
from __future__ import annotations

import json
import pathlib

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from strata_jax.gguf.tokenizer import PRE_PATTERNS

# Max abs error of fp32 logits against transformers (and transformers + PEFT): the parity bound
# the tests hold the model to (tests/tolerances.py reads it from here).
PARITY_LOGITS_ABS_FP32 = 1e-4

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Gated delta networks keep a fixed-size recurrent state per head.",
    "Hybrid models mix linear attention with a few softmax attention layers.",
    "Numbers like 12345 and 3.14159 are split digit by digit.",
    "Ünïcödé text, emojis 🙂 and 日本語 also round-trip through bytes.",
    "Don't, can't, won't: contractions are split as in GPT-2.",
    "tabs\tand\nnewlines\n\n  and   spaces",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{%- for m in messages %}"
          "{%- if m['role'] == 'bad' %}{{ raise_exception('bad role') }}{%- endif %}"
          "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{%- endfor %}"
          "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


# --- tokenizer ------------------------------------------------------------------------------------

def train_tokenizer(vocab_size: int = 300) -> tokenizers.Tokenizer:
  """A tiny byte-level BPE with Qwen2's pre-tokenizer, ChatML specials and one user token."""
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(PRE_PATTERNS["qwen2"]), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(SENTENCES * 4, trainer)
  tok.add_tokens([tokenizers.AddedToken("<think>", special=False, normalized=False)])
  return tok


def save_tokenizer(d: pathlib.Path, vocab_size: int = 300, chat_template: str | None = CHATML):
  """tokenizer.json + tokenizer_config.json (eos <|im_end|>, pad <|endoftext|>) into `d`."""
  tok = train_tokenizer(vocab_size)
  tok.save(str(d / "tokenizer.json"))
  cfg = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
         "add_bos_token": False}
  if chat_template:
    cfg["chat_template"] = chat_template
  (d / "tokenizer_config.json").write_text(json.dumps(cfg))
  return tok


# --- transformers checkpoint ----------------------------------------------------------------------

HF_DIMS = dict(
    vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
    partial_rotary_factor=0.25, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=2048,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
)


def tiny_hf_config(**overrides):
  """A transformers `Qwen3NextConfig` of `HF_DIMS` (layers linear, full, linear, linear)."""
  from transformers import Qwen3NextConfig  # noqa: PLC0415 (the test extra)
  return Qwen3NextConfig(**{**HF_DIMS, **overrides})


def save_tiny_hf(d: pathlib.Path, *, seed: int = 0, tokenizer: bool = True, **overrides):
  """Save a random fp32 Qwen3NextForCausalLM to `d`; returns its state dict as numpy.

  Every parameter is randomised (HF initialises norms, A_log and dt_bias to constants, which
  would hide a missing +1 or a wrong sign).
  """
  import torch  # noqa: PLC0415 (the test extra)
  from transformers import Qwen3NextForCausalLM  # noqa: PLC0415
  torch.manual_seed(seed)
  model = Qwen3NextForCausalLM(tiny_hf_config(**overrides)).float()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("linear_attn.norm.weight"):
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif "norm" in name:
        p.copy_(0.2 * torch.randn_like(p))
      elif name.endswith("A_log"):
        p.uniform_(-1.0, 1.0)
      elif name.endswith("dt_bias"):
        p.uniform_(-0.5, 0.5)
      else:
        p.normal_(0.0, 0.05)
  d.mkdir(parents=True, exist_ok=True)
  model.save_pretrained(str(d))
  if tokenizer:
    save_tokenizer(d)
  return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}, model
