"""Engine: slots, continuous batching, conversation cache and adapter-isolated prefix cache."""
import hashlib
import time

import numpy as np
import pytest
from model_fixtures import TINY, random_lora, tiny_model
from tolerances import CHUNK_SHAPE_REL_FP32, assert_close

import strata_jax as sj
from strata_jax import steps
from strata_jax.engine.engine import Request, _snap_bytes, chunk_steps

BS = 32


@pytest.fixture(scope="module")
def model():
  return tiny_model()


def _sha(tokens):
  return hashlib.sha256(np.asarray(tokens, "<i4").tobytes()).hexdigest()


def test_isolation_table(model):
  """500-token prompt under base, A, B and A-off, two rounds each, greedy."""
  prompt = list(np.random.default_rng(0).integers(0, TINY.vocab_size, 500))
  lora_a, lora_b = random_lora(seed=1), random_lora(seed=2)
  base = sj.Engine(model, slots=2, max_seq=576, block_size=BS)
  eng_a = sj.Engine(model, lora=lora_a, slots=2, max_seq=576, block_size=BS)
  eng_b = sj.Engine(model, lora=lora_b, slots=2, max_seq=576, block_size=BS)
  table = {}
  for name, eng, sw in [("base", base, None), ("A", eng_a, True), ("B", eng_b, True),
                        ("A-off", eng_a, False)]:
    rounds = [eng.generate(tokens=prompt, max_tokens=12, lora=sw) for _ in range(2)]
    assert rounds[0].tokens == rounds[1].tokens, name
    table[name] = (_sha(rounds[0].tokens), rounds[0].cached_tokens, rounds[1].cached_tokens)
  assert len({table[n][0] for n in ("base", "A", "B")}) == 3
  assert table["A-off"][0] == table["base"][0]
  # first round of each state reads nothing; the repeat reads the cached prefix
  assert table["A"][1] == 0 and table["A"][2] > 0
  assert table["A-off"][1] == 0, "switch-off after A's cached run must read 0 cached tokens"
  assert table["A-off"][2] > 0


def test_other_switch_reads_zero_cached_tokens(model):
  eng = sj.Engine(model, lora=random_lora(seed=3), slots=1, max_seq=256, block_size=BS)
  p = list(range(100))
  assert eng.generate(tokens=p, max_tokens=3, lora=True).cached_tokens == 0
  assert eng.generate(tokens=p, max_tokens=3, lora=False).cached_tokens == 0
  assert eng.generate(tokens=p, max_tokens=3, lora=True).cached_tokens == 96
  assert eng.generate(tokens=p, max_tokens=3, lora=False).cached_tokens == 96


@pytest.mark.parametrize("length", [96, 97, 120])   # hit ends at / inside a block
def test_prefix_hit_equals_uncached(model, length):
  lora = random_lora(seed=4)
  rng = np.random.default_rng(length)
  shared = list(rng.integers(0, TINY.vocab_size, length))
  warm = sj.Engine(model, lora=lora, slots=2, max_seq=256, block_size=BS)
  warm.generate(tokens=shared + [5, 6], max_tokens=2)
  hit = warm.run([Request(tokens=shared + [7], max_tokens=6, return_logits=False)])[0]
  cold = sj.Engine(model, lora=lora, slots=2, max_seq=256, block_size=BS, prefix_cache_bytes=0)
  ref = cold.run([Request(tokens=shared + [7], max_tokens=6)])[0]
  assert hit.cached_tokens == (length + 1 - 1) // BS * BS and hit.cached_tokens > 0
  assert ref.cached_tokens == 0
  assert hit.tokens == ref.tokens


def test_prefix_hit_bit_identical_logits(model):
  """With a prefix-cache hit (the caches on: `return_step_logits`), the logits every token
  was chosen from, the prompt's last logits included, are bit-identical to a cold run's,
  under the powers-of-two schedule (`bucket_step=None`), which runs this cold prompt in the
  very chunks the hit resumes with. (The default one-pass schedule runs it as one chunk, the
  same numbers to rounding: `test_bucket_step_prefix_cache_resume`.)"""
  prompt = list(np.random.default_rng(9).integers(0, TINY.vocab_size, 80))
  warm = sj.Engine(model, slots=1, max_seq=256, block_size=BS, bucket_step=None)
  warm.generate(tokens=prompt, max_tokens=1)
  # a different slot-state so the conversation cache cannot serve it: reset by another prompt
  warm.generate(tokens=[1, 2, 3], max_tokens=1)
  hit = warm.run([Request(tokens=prompt + [3], max_tokens=4, return_step_logits=True)])[0]
  cold = sj.Engine(model, slots=1, max_seq=256, block_size=BS, bucket_step=None)
  ref = cold.run([Request(tokens=prompt + [3], max_tokens=4, return_step_logits=True)])[0]
  assert hit.cached_tokens == 64 and ref.cached_tokens == 0
  assert hit.step_logits.shape == ref.step_logits.shape == (4, TINY.vocab_size)
  assert np.array_equal(hit.step_logits, ref.step_logits)
  assert hit.tokens == ref.tokens


def test_prompts_started_in_one_round_share_blocks_and_store_them_by_its_end(model):
  """Snapshots reach the host after the round's decode dispatch, not inside `_start`: a second
  prompt started in the same round still reads the first one's blocks (they are stored before
  its prefill), and every block is in the cache once `run` returns (the engine is idle)."""
  rng = np.random.default_rng(3)
  shared = list(rng.integers(0, TINY.vocab_size, 3 * BS))
  reqs = [Request(tokens=shared + [9, 10 + i], max_tokens=3) for i in range(2)]
  eng = sj.Engine(model, slots=2, max_seq=256, block_size=BS)
  res = eng.run(reqs)
  assert res[0].cached_tokens == 0 and res[1].cached_tokens == 3 * BS
  assert eng.prefix_cache.stats["entries"] == 3 and not eng._snaps and not eng._copying
  cold = sj.Engine(model, slots=2, max_seq=256, block_size=BS, prefix_cache_bytes=0)
  assert [r.tokens for r in res] == [r.tokens for r in cold.run(reqs)]
  # a round whose prompts share nothing stores its blocks at the round's end as well
  other = [Request(tokens=list(rng.integers(0, TINY.vocab_size, 2 * BS + 1)), max_tokens=2)
           for _ in range(2)]
  eng.run(other)
  assert eng.prefix_cache.stats["entries"] == 3 + 4 and not eng._snaps and not eng._copying


def test_waiting_snapshots_past_the_cache_capacity_are_dropped_oldest_first(model):
  """Snapshots wait on the device for their host copies; those that the cache could not hold
  go at once, oldest first, and the newest prompt's blocks are the ones stored."""
  rng = np.random.default_rng(4)
  # the powers-of-two schedule (bucket_step=None): one snapshot per prompt, its two blocks
  probe = sj.Engine(model, slots=1, max_seq=256, block_size=BS, bucket_step=None)
  probe.run([Request(tokens=list(rng.integers(0, TINY.vocab_size, 2 * BS + 1)), max_tokens=1)])
  per_prompt = probe.prefix_cache.stats["bytes"]          # its 2 blocks, one with the state
  eng = sj.Engine(model, slots=3, max_seq=256, block_size=BS, bucket_step=None,
                  prefix_cache_bytes=per_prompt + per_prompt // 2)
  prompts = [list(rng.integers(0, TINY.vocab_size, 2 * BS + 1)) for _ in range(3)]
  start = eng._start_snapshot_copies   # every snapshot waits until the engine is idle
  eng._start_snapshot_copies = lambda limit=1: start(limit) if limit is None else None
  held, snapshot = [], eng._snapshot

  def watched(*a, **kw):
    snapshot(*a, **kw)
    held.append(sum(_snap_bytes(x) for x in eng._snaps + eng._copying))
  eng._snapshot = watched
  eng.run([Request(tokens=p, max_tokens=4) for p in prompts])
  assert not eng._snaps and not eng._copying
  # one snapshot per prefill chunk: each prompt's two blocks are one slice (state included)
  assert len(held) == 3 and max(held) <= eng.prefix_cache.max_bytes < 3 * per_prompt
  hashes = [sj.block_hashes(p, BS) for p in prompts]
  assert hashes[2][1] in eng.prefix_cache and hashes[0][0] not in eng.prefix_cache
  assert eng.prefix_cache.stats["bytes"] <= per_prompt + per_prompt // 2


def test_snapshot_copies_go_to_pinned_host_memory_and_the_cache_holds_owned_equal_arrays(
    model, monkeypatch):
  """A snapshot's host copy is a DMA into page-locked memory where the device has it (the
  CPU does, as the H200 does), started off the scheduling thread with `snapshot_thread`
  (inline on it by default on CPU); the cache then holds plain numpy copies of the same
  values, the same either way."""
  import threading

  from strata_jax.parallel import distributed
  started, start = [], distributed.start_host_copy

  def watched(a):
    out = start(a)
    started.append((out, threading.current_thread()))
    return out
  monkeypatch.setattr(distributed, "start_host_copy", watched)
  prompt = list(np.random.default_rng(5).integers(0, TINY.vocab_size, 2 * BS + 1))
  eng = sj.Engine(model, slots=1, max_seq=256, block_size=BS, snapshot_thread=True)
  eng.run([Request(tokens=prompt, max_tokens=2)])
  assert started and all(a.sharding.memory_kind == "pinned_host" for a, _ in started)
  assert all(t is not threading.main_thread() for _, t in started)
  started.clear()
  inline = sj.Engine(model, slots=1, max_seq=256, block_size=BS)   # the CPU's default
  inline.run([Request(tokens=prompt, max_tokens=2)])
  assert started and all(t is threading.main_thread() for _, t in started)
  for h in sj.block_hashes(prompt, BS):
    got, want = inline.prefix_cache.peek(h)[0], eng.prefix_cache.peek(h)[0]
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in got)
  hashes = sj.block_hashes(prompt, BS)
  entry = eng.prefix_cache.peek(hashes[1])[0]   # the first (only) stage's arrays
  state = eng.states[0]
  assert isinstance(entry["ssm"], np.ndarray) and entry["ssm"].flags.owndata
  assert np.array_equal(entry["k"], np.asarray(state.k)[:, 0, BS:2 * BS])


def test_a_slow_snapshot_copy_holds_up_no_decode_round_and_is_stored_when_done(
    model, monkeypatch):
  """The scheduling thread never waits for a snapshot's host copy: while the copy is held
  back, rounds go on decoding; the blocks are stored once it lands (here: when the engine
  goes idle and flushes), and the tokens are those of an engine with no cache."""
  import threading

  from strata_jax.parallel import distributed
  gate, start = threading.Event(), distributed.start_host_copy

  def held_back(a):
    assert gate.wait(timeout=60), "the copy was never released"
    return start(a)
  monkeypatch.setattr(distributed, "start_host_copy", held_back)
  prompt = list(np.random.default_rng(9).integers(0, TINY.vocab_size, 2 * BS + 1))
  eng = sj.Engine(model, slots=1, max_seq=256, block_size=BS, decode_steps=(1,),
                  snapshot_thread=True)
  h = eng.submit(Request(tokens=prompt, max_tokens=6))
  rounds = 0
  while eng.busy:
    eng.step()
    rounds += 1
    if rounds == 3:   # decoding went on with the copy held back, and nothing is stored yet
      assert eng.busy and eng._copying and eng.prefix_cache.stats["entries"] == 0
      gate.set()
  assert rounds > 3 and not eng._snaps and not eng._copying
  assert sj.block_hashes(prompt, BS)[1] in eng.prefix_cache
  cold = sj.Engine(model, slots=1, max_seq=256, block_size=BS, prefix_cache_bytes=0)
  assert h.result.tokens == cold.run([Request(tokens=prompt, max_tokens=6)])[0].tokens


def test_a_failed_snapshot_copy_caches_nothing_and_the_engine_serves_on(model, monkeypatch, caplog):
  """If a snapshot's host copy fails (pinned host memory ran out), its blocks are not cached,
  the failure is logged, and the requests' tokens are what they are without the cache."""
  import jax

  from strata_jax.parallel import distributed

  class FailedCopy:
    def __init__(self, a):
      self.nbytes = a.nbytes

    def __array__(self, *a, **kw):
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: pinned host memory")
  monkeypatch.setattr(distributed, "start_host_copy", FailedCopy)
  prompt = list(np.random.default_rng(6).integers(0, TINY.vocab_size, 2 * BS + 1))
  eng = sj.Engine(model, slots=1, max_seq=256, block_size=BS)
  with caplog.at_level("WARNING", logger="strata_jax"):
    got = eng.run([Request(tokens=prompt, max_tokens=3)])[0]
  assert "copy to the host failed" in caplog.text
  assert eng.prefix_cache.stats["entries"] == 0 and not eng._snaps and not eng._copying
  cold = sj.Engine(model, slots=1, max_seq=256, block_size=BS, prefix_cache_bytes=0)
  assert got.tokens == cold.run([Request(tokens=prompt, max_tokens=3)])[0].tokens


def test_a_prefill_chunk_reads_its_blocks_in_one_slice_and_caches_them_block_by_block(
    model, monkeypatch):
  """TTFT: the K/V of every block a prefill chunk completes is read from the device in one
  slice (not one read per block); the cache still holds one entry per block, each holding
  only its own rows (a copy, not a view of the chunk's slice), the state on the last."""
  from strata_jax import steps
  calls, read_kv = [], steps.read_kv

  def counted(*a, **kw):
    calls.append(kw["length"])
    return read_kv(*a, **kw)
  monkeypatch.setattr(steps, "read_kv", counted)
  prompt = list(np.random.default_rng(5).integers(0, TINY.vocab_size, 5 * BS + 3))
  # the tail in chunks of its own (merge_tail=False, powers-of-two buckets): a cache hit
  # computes what a cold run does
  eng = sj.Engine(model, slots=1, max_seq=512, block_size=BS, merge_tail=False,
                  bucket_step=None)
  eng.generate(tokens=prompt, max_tokens=2)
  assert calls == [8 * BS]   # one chunk of 5 blocks in an 8-block bucket: one read
  hashes = sj.block_hashes(prompt, BS)
  payloads = [eng.prefix_cache.peek(h)[0] for h in hashes]
  assert all(p["k"].shape[1] == BS and p["k"].base is None for p in payloads)
  assert ["ssm" in p for p in payloads] == [False] * 4 + [True]
  # a prompt sharing those blocks restores them and computes what a cold engine computes
  follow = prompt + [7]
  eng.generate(tokens=[1, 2, 3], max_tokens=1)   # the slot's conversation no longer matches
  hit = eng.run([Request(tokens=follow, max_tokens=3, return_step_logits=True)])[0]
  cold = sj.Engine(model, slots=1, max_seq=512, block_size=BS, prefix_cache_bytes=0,
                   merge_tail=False, bucket_step=None)
  ref = cold.run([Request(tokens=follow, max_tokens=3, return_step_logits=True)])[0]
  assert hit.cached_tokens == 5 * BS and np.array_equal(hit.step_logits, ref.step_logits)
  # with merge_tail (the default) the cold prompt's 4 new tokens share the chunk holding its
  # 5 blocks (`prefill_cut`) while the hit runs them alone: the same tokens, the logits to
  # rounding
  merged = sj.Engine(model, slots=1, max_seq=512, block_size=BS, prefix_cache_bytes=0)
  got = merged.run([Request(tokens=follow, max_tokens=3, return_step_logits=True)])[0]
  assert got.tokens == ref.tokens
  assert_close(got.step_logits, ref.step_logits, rel=CHUNK_SHAPE_REL_FP32, what="step logits")


def test_time_to_first_token_counts_the_wait_for_a_slot(model):
  """`Result.ttft_s` runs from submit(): with one slot, the second of two requests submitted
  together waits while the first decodes, and that wait is in its time to first token."""
  stamps = []
  eng = sj.Engine(model, slots=1, max_seq=256, block_size=BS, prefix_cache_bytes=0)
  eng.generate(tokens=[4, 5, 6], max_tokens=2)   # compile first
  stamp = lambda t: stamps.append(time.perf_counter())
  first, second = eng.run([Request(tokens=[1, 2, 3], max_tokens=24, on_token=stamp),
                           Request(tokens=[7, 8, 9], max_tokens=2)])
  assert len(stamps) == 24
  # the second was submitted before the first's first token and started after its last
  assert second.ttft_s >= stamps[-1] - stamps[0] > 0
  assert first.ttft_s < second.ttft_s


@pytest.mark.parametrize("limit,buckets,steps", [
    (5, (1, 4, 16), 4),     # 16 would leave 11 spare steps: 4 now, 1 next
    (1, (1, 4, 16), 1),
    (3, (1, 4, 16), 4),     # one spare step beats two more dispatches
    (14, (1, 4, 16), 16),   # two spare of 16: an eighth
    (13, (1, 4, 16), 4),    # three spare of 16: too many
    (40, (1, 4, 16), 16),   # more than the largest: the largest
    (15, (16,), 16),
    (2, (4, 16), 4),        # less than the smallest: the smallest
])
def test_chunk_steps_covers_the_limit_unless_that_wastes_steps(limit, buckets, steps):
  assert chunk_steps(limit, buckets) == steps


def test_a_short_request_decodes_in_the_steps_it_needs(model):
  """A request with 5 tokens left after its first runs 4 + 1 decode steps from the default
  buckets (1, 4, 16), not 16 (a spare step costs a whole step), with the same tokens as one
  step a dispatch."""
  eng = sj.Engine(model, slots=1, max_seq=128, block_size=BS, prefix_cache_bytes=0)
  ran = []
  real = eng._decode_chunk
  eng._decode_chunk = lambda rows, n, *a, **k: ran.append(n) or real(rows, n, *a, **k)
  got = eng.generate(tokens=[3, 4, 5], max_tokens=6).tokens
  assert ran == [4, 1]
  one = sj.Engine(model, slots=1, max_seq=128, block_size=BS, prefix_cache_bytes=0,
                  decode_steps=(1,))
  assert got == one.generate(tokens=[3, 4, 5], max_tokens=6).tokens


def test_conversation_cache_extends(model):
  eng = sj.Engine(model, slots=1, max_seq=256, block_size=BS, prefix_cache_bytes=0)
  p = list(range(10, 50))
  r1 = eng.generate(tokens=p, max_tokens=5)
  follow = p + r1.tokens + [9, 9]
  r2 = eng.generate(tokens=follow, max_tokens=5)
  assert r2.cached_tokens == len(p) + len(r1.tokens) - 1
  fresh = sj.Engine(model, slots=1, max_seq=256, block_size=BS, prefix_cache_bytes=0)
  assert fresh.generate(tokens=follow, max_tokens=5).tokens == r2.tokens


def test_changed_adapter_never_reuses_blocks(model, tmp_path):
  """A new adapter identity (changed file contents) starts a new hash chain."""
  from strata_jax.engine.prefix_cache import adapter_identity
  f = tmp_path / "a.bin"
  f.write_bytes(b"one")
  id1 = adapter_identity([(str(f), 1.0)])
  f.write_bytes(b"two")
  id2 = adapter_identity([(str(f), 1.0)])
  assert id1 != id2
  p = list(range(100))
  assert sj.block_hashes(p, BS, id1)[0] != sj.block_hashes(p, BS, id2)[0]


def test_stress_mixed_switch_shared_prefix(model):
  """60 requests, 4 slots, mixed switch states, a shared 400-token prefix: each request's
  tokens equal what it gets when run alone."""
  lora = random_lora(seed=5)
  rng = np.random.default_rng(11)
  prefix = list(rng.integers(0, TINY.vocab_size, 400))
  reqs = [Request(tokens=prefix + list(rng.integers(0, TINY.vocab_size, 1 + i % 5)),
                  max_tokens=2 + i % 4, lora=bool(i % 3)) for i in range(60)]
  eng = sj.Engine(model, lora=lora, slots=4, max_seq=448, block_size=BS)
  results = eng.run(reqs)
  assert len(results) == 60 and all(r is not None for r in results)
  # alone: no other request in flight and no cache; the same shapes, so the same programs
  alone = sj.Engine(model, lora=lora, slots=4, max_seq=448, block_size=BS, prefix_cache_bytes=0)
  for i in range(0, 60, 11):    # a sample keeps the test short; every switch state is covered
    assert results[i].tokens == alone.run([reqs[i]])[0].tokens, i
  st = eng.prefix_cache.stats
  assert st["hits"] > 0


def test_sampling_is_seeded(model):
  eng = sj.Engine(model, slots=2, max_seq=128, block_size=BS)
  kw = dict(tokens=[1, 2, 3], max_tokens=8, temperature=0.9, top_k=20, top_p=0.9)
  assert eng.generate(seed=1, **kw).tokens == eng.generate(seed=1, **kw).tokens
  assert eng.generate(seed=1, **kw).tokens != eng.generate(seed=2, **kw).tokens


def test_bad_requests(model):
  eng = sj.Engine(model, slots=1, max_seq=64, block_size=BS)
  with pytest.raises(sj.RequestError, match="empty"):
    eng.generate(tokens=[])
  with pytest.raises(sj.RequestError, match="vocabulary"):
    eng.generate(tokens=[TINY.vocab_size])
  with pytest.raises(sj.RequestError, match="at most"):
    eng.generate(tokens=list(range(64)))
  with pytest.raises(sj.RequestError, match="none is loaded"):
    eng.generate(tokens=[1], lora=True)


def test_cancel_and_erase_slot(model):
  eng = sj.Engine(model, slots=1, max_seq=128, block_size=BS)
  h = eng.submit(Request(tokens=[1, 2, 3], max_tokens=50))
  eng.step()
  eng.step()
  h.cancel()
  while eng.busy:
    eng.step()
  assert h.result.finish_reason == "cancelled" and len(h.result.tokens) < 50
  eng.erase_slot(0)
  assert eng.slot_info(0)["n_tokens"] == 0
  assert eng.generate(tokens=[1, 2, 3, 4], max_tokens=2).cached_tokens == 0


def _unmerged(schedule):
  """An engine's `_schedule` with each chunk that hands back a state from inside split back
  into a chunk ending at the cut and one after it (the schedule before `prefill_cut`)."""
  def split(*a):
    out = []
    for pos, n, bucket, cut in schedule(*a):
      if cut is None:
        out.append((pos, n, bucket, None))
      else:
        out += [(pos, cut, bucket, None), (pos + cut, n - cut, BS, None)]
    return out
  return split


def test_one_pass_schedule_takes_a_prompt_in_one_chunk_with_its_state_points_inside(model):
  """`bucket_step`: buckets above it are its multiples, and a chunk runs past the state points
  inside it, each with a power-of-two window reaching the next point; without it (None), the
  chunks end at the points (powers of two). 512 is the default."""
  eng = sj.Engine(model, slots=1, max_seq=4096, block_size=64, bucket_step=512)
  assert eng._schedule(0, 2500, 39, True) == [(0, 2500, 2560, ((2048, 512), (2496, 64)))]
  assert eng._schedule(0, 3000, 46, True) == [(0, 3000, 3072, ((2048, 1024), (2944, 64)))]
  # one point with a block's window: the one-cut program `merge_tail` uses
  assert eng._schedule(0, 5000, 78, True) == [(0, 4096, 4096, ((2048, 2048),)),
                                              (4096, 904, 1024, 896)]
  # a 2,560-token capacity: the largest chunk is 2,560 (powers of two stop at 2,048)
  fit = sj.Engine(model, slots=1, max_seq=2560, block_size=64, bucket_step=512)
  assert fit._schedule(0, 2500, 39, True) == [(0, 2500, 2560, ((2048, 512), (2496, 64)))]
  default = sj.Engine(model, slots=1, max_seq=4096, block_size=64)
  assert default.bucket_step == 512
  plain = sj.Engine(model, slots=1, max_seq=4096, block_size=64, bucket_step=None)
  assert plain._schedule(0, 2500, 39, True) == [(0, 2048, 2048, None), (2048, 452, 512, 448)]
  for bad in (32, 96):
    with pytest.raises(sj.StrataError, match=f"bucket_step={bad}"):
      sj.Engine(model, slots=1, max_seq=256, block_size=64, bucket_step=bad)


@pytest.mark.parametrize("lora_on", [False, True])
def test_one_pass_prefill_caches_every_state_point_as_the_chunked_schedule_does(model, lora_on):
  """A prompt of 5 full blocks and 4 tokens with a state every 2 blocks: under `bucket_step`
  one 192-token chunk that hands back the GDN states at blocks 2, 4 and 5 from inside, where
  the default runs 4 chunks. Each cached GDN state agrees with the chunked schedule's to fp32
  rounding (other shapes), every block's K/V is cached, the tokens are the same, and a prompt
  extending it resumes from the prefix cache at its last full block in both with the same
  tokens. Its prompt
  logits are those of the same chunk with no state points inside (state_every past the
  prompt): bit for bit before the first point, to fp32 rounding after (the GDN op's windows
  from each point). (Against the 4-chunk schedule the logits move by up to 3.6e-5 of their
  max in the first block already, with one chunk and no points as with these: the 64-row
  chunk's own rounding, not the points'.)"""
  lora = random_lora()
  prompt = list(np.random.default_rng(12).integers(0, TINY.vocab_size, 5 * BS + 4))
  got = {}
  for name, step, every in (("one_pass", 64, 2), ("chunked", None, 2), ("one_chunk", 64, 99)):
    eng = sj.Engine(model, lora=lora, slots=1, max_seq=256, block_size=BS, state_every=every,
                    bucket_step=step, warmup=[len(prompt)])
    assert len(eng._schedule(0, len(prompt), 5, True)) == (4 if name == "chunked" else 1)
    programs = (steps.prefill._cache_size(), steps.prefill_cut._cache_size(),
                steps.read_kv._cache_size())
    eng.generate(tokens=prompt, max_tokens=2, lora=lora_on)   # cold: snapshots its blocks
    eng._flush_snapshots()
    # warmup compiled every program the prompt's chunk and its snapshots use
    assert (steps.prefill._cache_size(), steps.prefill_cut._cache_size(),
            steps.read_kv._cache_size()) == programs
    eng.prefix_cache.clear()
    eng.erase_slot(0)
    res = eng.generate(tokens=prompt, max_tokens=6, return_logits=True, lora=lora_on)
    eng._flush_snapshots()
    hashes = sj.block_hashes(prompt, BS, eng.adapters.resolve(lora_on).identity)
    entries = [eng.prefix_cache.peek(hashes[b])[0] for b in range(5)]
    eng.erase_slot(0)   # the follow-up resumes from the prefix cache, not the conversation
    follow = eng.generate(tokens=prompt + res.tokens + [7], max_tokens=3, lora=lora_on)
    got[name] = res, entries, follow
  (a, ea, fa), (b, eb, fb), (c, _, _) = got["one_pass"], got["chunked"], got["one_chunk"]
  for x, y in zip(ea, eb):
    assert ("ssm" in x) == ("ssm" in y)
    for key in ("ssm", "conv") if "ssm" in x else ():
      assert_close(x[key], y[key], rel=CHUNK_SHAPE_REL_FP32, what=key)
    assert x["k"].shape == y["k"].shape and x["v"].shape == y["v"].shape
  assert ["ssm" in x for x in ea] == [False, True, False, True, True]
  assert np.array_equal(a.prompt_logits[:2 * BS], c.prompt_logits[:2 * BS])
  assert_close(a.prompt_logits, c.prompt_logits, rel=CHUNK_SHAPE_REL_FP32, what="prompt logits")
  assert a.tokens == b.tokens == c.tokens and fa.tokens == fb.tokens
  assert fa.cached_tokens == fb.cached_tokens == 5 * BS


@pytest.mark.parametrize("lora_on", [False, True])
def test_a_chunk_holding_the_last_full_block_and_the_tail_computes_what_two_chunks_do(
    model, lora_on):
  """A prompt of 3 full blocks and 4 tokens is one 128-token chunk that hands back the GDN
  state at its last full block (`steps.prefill_cut`), instead of a chunk ending there and a
  4-token chunk: the cached state of that block is bit for bit the two-chunk schedule's, the
  prompt's logits agree to fp32 rounding, the tokens are the same, and a prompt extending it
  resumes from that block."""
  lora = random_lora()
  prompt = list(np.random.default_rng(11).integers(0, TINY.vocab_size, 3 * BS + 4))
  got = {}
  for merged in (True, False):
    eng = sj.Engine(model, lora=lora, slots=1, max_seq=256, block_size=BS, merge_tail=True,
                    bucket_step=None)
    assert eng._schedule(0, len(prompt), 3, True) == [(0, 3 * BS + 4, 128, 3 * BS)]
    if not merged:
      eng._schedule = _unmerged(eng._schedule)
    res = eng.generate(tokens=prompt, max_tokens=6, return_logits=True, lora=lora_on)
    eng._flush_snapshots()
    hashes = sj.block_hashes(prompt, BS, eng.adapters.resolve(lora_on).identity)
    entry = eng.prefix_cache.peek(hashes[2])[0]
    follow = eng.generate(tokens=prompt + res.tokens + [7], max_tokens=3, lora=lora_on)
    got[merged] = res, entry, follow
  (a, ea, fa), (b, eb, fb) = got[True], got[False]
  assert "ssm" in ea and np.array_equal(ea["ssm"], eb["ssm"])
  assert np.array_equal(ea["conv"], eb["conv"]) and np.array_equal(ea["k"], eb["k"])
  # the rows before the cut are the same chunk's; the tail's rows are rounded by other shapes
  assert np.array_equal(a.prompt_logits[:3 * BS], b.prompt_logits[:3 * BS])
  assert_close(a.prompt_logits, b.prompt_logits, rel=CHUNK_SHAPE_REL_FP32, what="prompt logits")
  assert a.tokens == b.tokens and fa.tokens == fb.tokens
  assert fa.cached_tokens == fb.cached_tokens >= 3 * BS
