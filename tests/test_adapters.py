"""Several adapters chosen per row (issue 19 §2): numbered adapters on one padded rank axis, a
per-row scale table, identity per request, hot load and unload.

Every engine here has the same shapes (8 slots, 128 tokens, blocks of 32, rank table 64), so
the jitted steps compile once for the module.
"""
import math

import jax
import numpy as np
import pytest
from adapter_fixtures import write_adapter
from model_fixtures import TINY, random_lora, tiny_model

import strata_jax as sj
from strata_jax import steps
from strata_jax.adapter_id import choice_identity
from strata_jax.engine.engine import Request

SLOTS, SEQ, BS = 8, 128, 32


@pytest.fixture(scope="module")
def model():
  return tiny_model()


@pytest.fixture(scope="module")
def four():
  """Four rank-8 adapters (their total rank 32 pads to the 64-column table)."""
  return [random_lora(rank=8, seed=10 + i, scale=0.5) for i in range(4)]


def _engine(model, adapters=(), **kw):
  kw = dict(slots=SLOTS, max_seq=SEQ, block_size=BS) | kw
  return sj.Engine(model, lora=list(adapters), **kw)


def _prompt(seed, n=40):
  return [int(t) for t in np.random.default_rng(seed).integers(0, TINY.vocab_size, n)]


# 8 rows over 4 adapters and none: alone, several at once, other scales
CHOICES = [False, [{"id": 0, "scale": 1.0}], [{"id": 1, "scale": 1.0}], [{"id": 2}],
           [{"id": 3, "scale": 0.25}], [{"id": 0, "scale": 0.5}, {"id": 2, "scale": 1.5}],
           False, [{"id": 1, "scale": 2.0}, {"id": 3, "scale": 1.0}]]


def _reqs():
  return [Request(tokens=_prompt(i, 20 + 7 * i), max_tokens=5, lora=c, return_logits=True)
          for i, c in enumerate(CHOICES)]


def _bits(a):
  return np.asarray(a, np.float32).view(np.uint32)


def test_mixed_batch_equals_each_row_alone_bit_for_bit(model, four):
  """8 rows over 4 adapters (and none) decode together; each row's logits equal, bit for bit,
  the same request run alone, and the no-adapter rows equal an engine with no adapter."""
  eng = _engine(model, four)
  batched = eng.run(_reqs())
  assert len({r.slot for r in batched}) == SLOTS, "all 8 rows ran in one batch"
  for i, req in enumerate(_reqs()):
    alone = eng.run([req])[0]
    assert np.array_equal(_bits(alone.prompt_logits), _bits(batched[i].prompt_logits)), i
    assert np.array_equal(_bits(alone.step_logits), _bits(batched[i].step_logits)), i
    assert alone.tokens == batched[i].tokens
  bare = _engine(model)
  for i in (0, 6):
    ref = bare.run([_reqs()[i]])[0]
    assert np.array_equal(_bits(ref.step_logits), _bits(batched[i].step_logits))
    assert np.array_equal(_bits(ref.prompt_logits), _bits(batched[i].prompt_logits))
  # every adapter choice changes the numbers, and differently from the others
  last = [tuple(_bits(r.step_logits[-1])[:8]) for r in batched]
  assert len(set(last[1:6] + last[7:])) == 6 and all(x != last[0] for x in last[1:6])
  assert batched[5].adapters == [{"id": 0, "scale": 0.5}, {"id": 2, "scale": 1.5}]


def test_one_adapter_row_matches_that_adapter_loaded_alone(model, four):
  """A row choosing adapter 2 of 4 computes what an engine with adapter 2 alone computes (the
  other adapters' columns scaled to 0; the sums run over other zero columns, so to rounding)."""
  from tolerances import assert_close
  req = Request(tokens=_prompt(3, 50), max_tokens=4, return_logits=True)
  mixed = _engine(model, four).run([Request(**{**req.__dict__, "lora": [{"id": 2}]})])[0]
  only = _engine(model, [four[2]]).run([Request(**{**req.__dict__, "lora": True})])[0]
  assert_close(mixed.prompt_logits, only.prompt_logits, abs_=1e-5, what="prompt")
  assert_close(mixed.step_logits, only.step_logits, abs_=1e-5, what="steps")


def test_hot_load_compiles_nothing_new_and_unload_refuses(model, four, tmp_path):
  eng = _engine(model, four[:2])
  p = _prompt(5)
  eng.generate(tokens=p, max_tokens=3, lora=[{"id": 1}])
  sizes = lambda: (steps.prefill._cache_size(), steps.decode._cache_size())
  before = sizes()
  path, _ = write_adapter(tmp_path / "c.gguf", TINY, rank=8, seed=3)
  new = eng.load_adapter(path, scale=0.5)
  assert new == 2 and [a["id"] for a in eng.lora_adapters()] == [0, 1, 2]
  assert eng.lora_adapters()[2]["path"] == path and eng.lora_adapters()[2]["scale"] == 0.5
  on_new = eng.generate(tokens=p, max_tokens=3, lora=[{"id": 2}])
  assert sizes() == before, "a hot load within the padded table compiles nothing"
  assert on_new.adapters == [{"id": 2, "scale": 0.5}]   # a missing scale: the default
  # unload: refused afterwards, by id, with a clear error; ids are never reused
  assert eng.unload_adapter(2) is True
  with pytest.raises(sj.RequestError, match="adapter id 2 was unloaded"):
    eng.generate(tokens=p, max_tokens=2, lora=[{"id": 2, "scale": 1.0}])
  assert eng.load_adapter(four[3]) == 3
  with pytest.raises(sj.RequestError, match="adapter id 9 does not exist"):
    eng.generate(tokens=p, max_tokens=2, lora=[{"id": 9}])
  # a load past the table grows it (a new program), and says so in the docs
  big = random_lora(rank=48, seed=7)
  eng.load_adapter(big)
  assert eng.stages[0].lora.gdn_a.shape[1] == 128


def test_unload_in_flight_is_deferred_and_the_request_keeps_its_adapter(model, four):
  p = _prompt(6, 30)
  ref = _engine(model, four[:2]).generate(tokens=p, max_tokens=60, lora=[{"id": 1}]).tokens
  eng = _engine(model, four[:2])
  h = eng.submit(Request(tokens=p, max_tokens=60, lora=[{"id": 1}]))
  eng.step()                      # prefill, first token, a decode chunk in flight
  assert not h.done
  assert eng.unload_adapter(1) is False, "a request holds it: deferred"
  assert [a["id"] for a in eng.lora_adapters()] == [0]
  with pytest.raises(sj.RequestError, match="unloaded"):
    eng.submit(Request(tokens=p, max_tokens=2, lora=[{"id": 1}]))
  while eng.busy:
    eng.step()
  assert h.result.tokens == ref, "the in-flight request finished under its adapter"
  assert eng.adapters.entries.get(1) is None, "freed once the last request finished"


def test_identity_separates_the_prefix_cache_and_is_order_normalised(model, four):
  eng = _engine(model, four[:2])
  p = _prompt(7, 100)
  a01 = [{"id": 0, "scale": 0.5}, {"id": 1, "scale": 1.0}]
  a10 = [{"id": 1, "scale": 1.0}, {"id": 0, "scale": 0.5}]
  assert eng.generate(tokens=p, max_tokens=2, lora=a01).cached_tokens == 0
  for other in (False, [{"id": 0}], [{"id": 1}], [{"id": 0, "scale": 0.75}, {"id": 1}]):
    assert eng.generate(tokens=p, max_tokens=2, lora=other).cached_tokens == 0, other
  assert eng.generate(tokens=p, max_tokens=2, lora=a10).cached_tokens == 96
  # the cache's digests are block_hashes under the choice's identity
  ids = [(four[0].adapter_id, 0.5), (four[1].adapter_id, 1.0)]
  want = sj.block_hashes(p, BS, choice_identity(ids))
  assert all(d in eng.prefix_cache for d in want)
  assert choice_identity(ids) == choice_identity(ids[::-1]) != choice_identity(ids[:1])
  # one adapter at scale 1 keeps its own id (what a single LoraSet always hashed as)
  assert choice_identity([(four[0].adapter_id, 1.0)]) == four[0].adapter_id


def test_unloaded_adapter_blocks_are_never_served(model, four):
  """Identity from content, never from an id or columns (vLLM issue 42125): after unload, an
  adapter loaded into the same columns starts cold, and the old blocks are gone."""
  eng = _engine(model, four[:2])
  p = _prompt(8, 100)
  eng.generate(tokens=p, max_tokens=2, lora=[{"id": 1}])
  old = sj.block_hashes(p, BS, four[1].adapter_id)
  assert all(d in eng.prefix_cache for d in old)
  cols = eng.adapters.entries[1].columns.copy()
  eng.unload_adapter(1)
  assert not any(d in eng.prefix_cache for d in old), "purged at unload"
  new = eng.load_adapter(four[2])
  assert np.array_equal(eng.adapters.entries[new].columns, cols), "the same columns, reused"
  assert eng.generate(tokens=p, max_tokens=2, lora=[{"id": new}]).cached_tokens == 0
  # the same content loaded again is the same adapter: same identity, recomputed
  again = eng.load_adapter(four[1])
  r = eng.generate(tokens=p, max_tokens=2, lora=[{"id": again}])
  assert r.cached_tokens == 0 and all(d in eng.prefix_cache for d in old)


@pytest.mark.parametrize("spec, match", [
    ([{"id": 5}], "does not exist"),
    ([{"id": 0, "scale": -1.0}], ">= 0"),
    ([{"id": 0, "scale": math.nan}], "finite"),
    ([{"id": 0}, {"id": 0}], "twice"),
    ([{"scale": 1.0}], "id"),
    ("yes", "expected true, false or a list"),
])
def test_bad_adapter_choices_are_refused(model, four, spec, match):
  eng = _engine(model, four[:1])
  with pytest.raises(sj.RequestError, match=match):
    eng.submit(Request(tokens=[1, 2], max_tokens=1, lora=spec))
  assert not eng.busy and eng.adapters.entries[0].refs == 0


def test_loading_a_file_that_is_not_an_adapter_is_refused(model, tmp_path):
  from gguf_fixtures import write_raw_gguf
  eng = _engine(model)
  path = write_raw_gguf(tmp_path / "model.gguf", TINY, {})
  with pytest.raises(sj.AdapterError, match="model.gguf"):
    eng.load_adapter(str(path))
  assert eng.lora_adapters() == []


def test_default_scales_as_llama_cpp(model, four):
  eng = _engine(model, four[:2])
  p = _prompt(9, 30)
  eng.set_lora_scales([{"id": 1, "scale": 0.5}])   # adapter 0 not listed: scale 0
  assert [a["scale"] for a in eng.lora_adapters()] == [0.0, 0.5]
  default = eng.generate(tokens=p, max_tokens=4, return_logits=True)
  explicit = eng.generate(tokens=p, max_tokens=4, lora=[{"id": 1, "scale": 0.5}],
                          return_logits=True)
  assert default.adapters == [{"id": 1, "scale": 0.5}]
  assert np.array_equal(default.step_logits, explicit.step_logits)


def test_session_keyed_by_the_slots_adapters(model, four, tmp_path):
  p = _prompt(10, 30)
  choice = [{"id": 0, "scale": 0.5}, {"id": 1, "scale": 1.0}]
  first = _engine(model, four[:2])
  r1 = first.generate(tokens=p, max_tokens=3, lora=choice)
  first.save_session(r1.slot, tmp_path / "s")
  fresh = _engine(model, four[:2])     # knows the choice from the session's `+mix:` tail
  fresh.load_session(1, tmp_path / "s")
  r2 = fresh.generate(tokens=p + r1.tokens, max_tokens=3, lora=choice)
  assert r2.cached_tokens == len(p) + len(r1.tokens) - 1, "the conversation continues"
  straight = _engine(model, four[:2]).generate(tokens=p + r1.tokens, max_tokens=3, lora=choice)
  assert r2.tokens == straight.tokens
  with pytest.raises(sj.SessionError, match="fingerprint"):
    _engine(model, four[2:]).load_session(0, tmp_path / "s")


def test_state_of_every_row_keeps_its_own_table_index(model, four):
  """Each running row's switch is its table row (slot + 1) under adapters, 0 without."""
  eng = _engine(model, four)
  hs = [eng.submit(Request(tokens=_prompt(i, 10), max_tokens=3, lora=c))
        for i, c in enumerate(CHOICES[:4])]
  eng.step()
  rows = np.asarray(jax.device_get(eng.states[0].switch))
  for slot, (h, _) in eng._running.items():
    assert rows[slot] == (slot + 1 if h.req.lora.on else 0), slot
  while eng.busy:
    eng.step()
  assert all(h.done for h in hs)
