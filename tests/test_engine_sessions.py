"""Engine sessions: save a slot, restore into a fresh engine, continue bit-identically."""
import dataclasses

import numpy as np
import pytest
from model_fixtures import TINY, random_lora, tiny_model

import strata_jax as sj
from strata_jax.engine.engine import Request

N, M = 6, 5


@pytest.fixture(scope="module")
def model():
  return tiny_model()


def _engine(model, lora=None, ranges=None):
  m = dataclasses.replace(model, layer_ranges=ranges) if ranges else model
  return sj.Engine(m, lora=lora, slots=2, max_seq=128, block_size=32)


@pytest.mark.parametrize("adapter,switch", [(False, None), (True, True), (True, False)],
                         ids=["no-adapter", "on", "off"])
def test_save_restore_continue_bit_identical(model, tmp_path, adapter, switch):
  lora = random_lora(seed=3) if adapter else None
  prompt = list(np.random.default_rng(1).integers(0, TINY.vocab_size, 40))
  straight_engine = _engine(model, lora)
  straight = straight_engine.run([Request(tokens=prompt, max_tokens=N + M, lora=switch)])[0]
  first = _engine(model, lora)
  r1 = first.run([Request(tokens=prompt, max_tokens=N, lora=switch)])[0]
  info = first.save_session(r1.slot, tmp_path / "s")
  assert info["version"] == 1
  fresh = _engine(model, lora)
  got = fresh.load_session(1, tmp_path / "s")
  assert got["n_tokens"] == len(prompt) + N - 1
  assert got["lora"] == bool(adapter and switch is not False)
  r2 = fresh.run([Request(tokens=prompt + r1.tokens, max_tokens=M, lora=switch,
                          return_logits=False)])[0]
  assert r2.cached_tokens == len(prompt) + N - 1
  assert r1.tokens + r2.tokens == straight.tokens
  # every state array of the continued slot equals the uninterrupted run's, bit for bit
  a, b = _row_state(fresh, r2.slot), _row_state(straight_engine, straight.slot)
  assert all(np.array_equal(x.view(np.uint8), y.view(np.uint8)) for x, y in zip(a, b))


def _row_state(eng, slot):
  import jax.numpy as jnp

  from strata_jax import steps
  n = len(eng.slot_tokens[slot])
  k, v = steps.read_kv(eng.states[0], jnp.int32(slot), jnp.int32(0), length=eng.max_seq)
  conv, ssm = steps.read_recurrent(eng.states[0], jnp.int32(slot))
  return [np.asarray(k)[:, :n], np.asarray(v)[:, :n], np.asarray(conv), np.asarray(ssm)]


def test_split_sessions_are_v2_and_round_trip(model, tmp_path):
  """Three stages: a first, a middle and a last stage's states in one v2 file (a two-stage
  case took 20 s more of the suite and has no state layout that three lack)."""
  ranges = [(0, 2), (2, 5), (5, 8)]
  lora = random_lora(seed=4)
  prompt = list(range(30))
  straight = _engine(model, lora, ranges).generate(tokens=prompt, max_tokens=N + M)
  first = _engine(model, lora, ranges)
  r1 = first.generate(tokens=prompt, max_tokens=N)
  assert first.save_session(r1.slot, tmp_path / "s")["version"] == 2
  fresh = _engine(model, lora, ranges)
  assert fresh.load_session(0, tmp_path / "s")["version"] == 2
  r2 = fresh.generate(tokens=prompt + r1.tokens, max_tokens=M)
  assert r1.tokens + r2.tokens == straight.tokens
  # split == single device, greedy
  assert straight.tokens == _engine(model, lora).generate(tokens=prompt, max_tokens=N + M).tokens
  # another split, a v1-only reader, a different adapter: refused before any array is read
  with pytest.raises(sj.SessionError, match="stage"):
    _engine(model, lora, [(0, 4), (4, 8)]).load_session(0, tmp_path / "s")
  with pytest.raises(sj.SessionError, match="v2|version"):
    fresh.load_session(0, tmp_path / "s", supported_versions={1})
  with pytest.raises(sj.SessionError, match="fingerprint"):
    _engine(model, random_lora(seed=5, adapter_id=99), ranges).load_session(0, tmp_path / "s")


def test_session_refuses_wrong_model_and_capacity(model, tmp_path):
  eng = _engine(model)
  r = eng.generate(tokens=list(range(50)), max_tokens=3)
  eng.save_session(r.slot, tmp_path / "s")
  other = tiny_model(seed=1)
  with pytest.raises(sj.SessionError, match="fingerprint"):
    _engine(other).load_session(0, tmp_path / "s")
  small = sj.Engine(model, slots=1, max_seq=32, block_size=32)
  with pytest.raises(sj.SessionError, match="token"):
    small.load_session(0, tmp_path / "s")
  with pytest.raises(sj.RequestError, match="slot"):
    eng.save_session(7, tmp_path / "t")
