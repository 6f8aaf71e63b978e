"""Parity with transformers' Qwen3NextForCausalLM (fp32, CPU), through `strata-jax convert hf`,
and with transformers + PEFT for adapters through `strata-jax convert peft`."""
import jax
import numpy as np
import pytest
import torch
from gguf_fixtures import save_tiny_hf
from tolerances import MODEL_LOGITS_ABS_FP32, assert_close

import strata_jax as sj
from strata_jax.cli import main as cli_main

pytestmark = pytest.mark.parity
LENGTHS = [1, 63, 257]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
  d = tmp_path_factory.mktemp("hf")
  _, model = save_tiny_hf(d / "model", seed=0)
  out = d / "model.gguf"
  assert cli_main(["convert", "hf", str(d / "model"), str(out)]) == 0
  return d, model.eval(), sj.load_model(str(out))


def _prompt(n, vocab, seed=0):
  return list(np.random.default_rng(seed + n).integers(0, vocab, n))


def _hf_logits(model, ids):
  with torch.no_grad():
    return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("T", LENGTHS)
def test_all_position_logits(hf, T):
  _, hf_model, model = hf
  ids = _prompt(T, model.cfg.vocab_size)
  eng = sj.Engine(model, slots=1, max_seq=320, block_size=64)
  res = eng.generate(tokens=ids, max_tokens=1, return_logits=True)
  want = _hf_logits(hf_model, ids)
  err = assert_close(res.prompt_logits, want, abs_=MODEL_LOGITS_ABS_FP32, what=f"T={T}")
  assert_close(res.prompt_logits[-1], want[-1], abs_=MODEL_LOGITS_ABS_FP32, what="last")
  print(f"parity T={T}: max abs error {err:.2e}")


_PALLAS = "pallas" if jax.default_backend() == "gpu" else "pallas_interpret"


@pytest.mark.parametrize("forms", [sj.Forms(gdn_chunked=_PALLAS), sj.Forms(gdn_chunked="products"),
                                   sj.Forms(moe_many=_PALLAS)], ids=str)
def test_prefill_kernel_forms_match_transformers(hf, forms):
  """The prefill forms (the chunked GDN kernel or the products form, the grouped MoE kernel;
  interpreted on CPU) through an engine built with them give transformers' logits too."""
  _, hf_model, model = hf
  ids = _prompt(63, model.cfg.vocab_size)
  eng = sj.Engine(model, slots=1, max_seq=128, block_size=64, forms=forms)
  res = eng.generate(tokens=ids, max_tokens=1, return_logits=True)
  assert_close(res.prompt_logits, _hf_logits(hf_model, ids), abs_=MODEL_LOGITS_ABS_FP32,
               what=str(forms))


_ON_GPU = jax.default_backend() == "gpu"
_FUSED = "pallas_fused" if _ON_GPU else "pallas_fused_interpret"


@pytest.mark.parametrize("parallel", ["pallas_parallel", "pallas_split"])
def test_parallel_chunked_and_fused_decode_forms_match_transformers(hf, parallel):
  """Each chunk-parallel prefill kernel (the state pass fused with the outputs, or fla's
  split) and the fused decode kernel (interpreted on CPU) give transformers' logits for the
  prompt and for each decoded token, in an engine of two slots with one idle (its row is not
  valid in every decode step: the kernel skips its state)."""
  _, hf_model, model = hf
  ids = _prompt(63, model.cfg.vocab_size)
  forms = sj.Forms(gdn_chunked=parallel if _ON_GPU else f"{parallel}_interpret",
                   gdn_decode=_FUSED)
  eng = sj.Engine(model, slots=2, max_seq=128, block_size=64, forms=forms)
  res = eng.generate(tokens=ids, max_tokens=4, return_logits=True)
  want = _hf_logits(hf_model, ids + res.tokens[:3])
  assert_close(res.prompt_logits, want[:len(ids)], abs_=MODEL_LOGITS_ABS_FP32, what="prompt")
  assert_close(res.step_logits[1:4], want[len(ids):], abs_=MODEL_LOGITS_ABS_FP32,
               what="decode steps")


def test_greedy_32_tokens(hf):
  _, hf_model, model = hf
  ids = _prompt(63, model.cfg.vocab_size)
  with torch.no_grad():
    out = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                            min_new_tokens=32, eos_token_id=None, pad_token_id=0)
  want = out[0, len(ids):].tolist()
  eng = sj.Engine(model, slots=1, max_seq=128, block_size=64)
  assert eng.generate(tokens=ids, max_tokens=32).tokens == want


def test_prefill_then_decode_equals_longer_prefill(hf):
  _, _, model = hf
  ids = _prompt(70, model.cfg.vocab_size)
  eng = sj.Engine(model, slots=1, max_seq=128, block_size=64, prefix_cache_bytes=0)
  res = eng.generate(tokens=ids, max_tokens=6, return_logits=True)
  longer = ids + res.tokens[:5]
  eng2 = sj.Engine(model, slots=1, max_seq=128, block_size=64, prefix_cache_bytes=0)
  full = eng2.generate(tokens=longer, max_tokens=1, return_logits=True).prompt_logits
  # step i's logits come after consuming ids + tokens[:i]
  assert_close(res.step_logits[1:6], full[len(ids):len(ids) + 5], abs_=MODEL_LOGITS_ABS_FP32,
               what="decode vs prefill")


# ----- adapters against PEFT ------------------------------------------------------------------

def _peft(hf_model, name, seed, alpha=8):
  from peft import LoraConfig
  torch.manual_seed(seed)
  cfg = LoraConfig(r=4, lora_alpha=alpha, target_modules=["o_proj", "out_proj"],
                   init_lora_weights=False)
  return cfg


@pytest.fixture(scope="module")
def peft_setup(hf):
  import copy

  from peft import get_peft_model
  d, hf_model, model = hf
  files = {}
  for name, seed in (("a1", 1), ("a2", 2)):
    torch.manual_seed(seed)
    pm = get_peft_model(copy.deepcopy(hf_model), _peft(hf_model, name, seed))
    with torch.no_grad():   # B non-zero and large enough to matter
      for n, p in pm.named_parameters():
        if "lora_" in n:
          p.normal_(0.0, 0.3)
    pm.save_pretrained(str(d / name))
    out = d / f"{name}.gguf"
    assert cli_main(["convert", "peft", str(d / name), str(out), "--base", str(d / "model")]) == 0
    files[name] = out
  return d, hf_model, model, files


def _peft_logits(d, hf_model, names, weights, ids):
  """transformers + PEFT with `names` active; each adapter's scaling multiplied by weight."""
  import copy

  from peft import PeftModel
  pm = PeftModel.from_pretrained(copy.deepcopy(hf_model), str(d / names[0]), adapter_name=names[0])
  for n in names[1:]:
    pm.load_adapter(str(d / n), adapter_name=n)
  pm.base_model.set_adapter(list(names))
  for mod in pm.modules():
    if hasattr(mod, "scaling") and isinstance(mod.scaling, dict):
      for n, w in zip(names, weights):
        if n in mod.scaling:
          mod.scaling[n] *= w
  with torch.no_grad():
    return pm(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("case", ["a1", "a1+a2", "a1@0.5"])
def test_lora_matches_peft(peft_setup, case):
  d, hf_model, model, files = peft_setup
  names = case.split("@")[0].split("+")
  weights = [float(case.split("@")[1])] * len(names) if "@" in case else [1.0] * len(names)
  lora = sj.load_lora(model, [str(files[n]) for n in names], weights)
  ids = _prompt(40, model.cfg.vocab_size, seed=5)
  eng = sj.Engine(model, lora=lora, slots=1, max_seq=128, block_size=64)
  on = eng.generate(tokens=ids, max_tokens=1, lora=True, return_logits=True).prompt_logits
  want = _peft_logits(d, hf_model, names, weights, ids)
  err = assert_close(on, want, abs_=MODEL_LOGITS_ABS_FP32, what=case)
  base = _hf_logits(hf_model, ids)
  assert np.abs(want - base).max() > 100 * MODEL_LOGITS_ABS_FP32, "the adapter must matter"
  print(f"peft parity {case}: max abs error {err:.2e}")
