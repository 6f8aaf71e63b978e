"""Prefix block cache: the `block_hashes` contract, adapter identity, and the LRU block store."""
import random
import struct

import numpy as np
import pytest
import xxhash

from strata_jax.engine import prefix_cache as pc
from strata_jax.engine.prefix_cache import PrefixCache, adapter_identity, block_hashes
from strata_jax.errors import AdapterError, RequestError

TOKEN_LISTS = {
    "range40": list(range(40)),
    "edges": [151643, 0, 2**31 - 1, 7] * 8,
    "negative": [-(2**31), -1, 5, 2**31 - 1] * 4,
}


def longhand_chain(tokens, block_size, adapter_id=0):
  """The DESIGN.md chain written out independently: struct packing, canonical digest reversed."""
  out = []
  prev = struct.pack("<Q", adapter_id) if adapter_id else b""
  for start in range(0, len(tokens) - block_size + 1, block_size):
    block = tokens[start:start + block_size]
    buf = prev + struct.pack(f"<{block_size}i", *block)
    canonical = xxhash.xxh3_128(buf, seed=0).digest()  # big-endian: high 64 bits first
    prev = canonical[::-1]                               # little-endian: low 64 bits first
    out.append(prev)
  return out


# -- block_hashes ----------------------------------------------------------------------------

@pytest.mark.parametrize("adapter_id", [0, 1, 0x0123456789ABCDEF, 2**64 - 1],
                         ids=lambda a: f"id{a:x}")
@pytest.mark.parametrize("block_size", [1, 4, 16], ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("name", list(TOKEN_LISTS))
def test_block_hashes_match_longhand_chain(name, block_size, adapter_id):
  tokens = TOKEN_LISTS[name]
  got = block_hashes(tokens, block_size, adapter_id=adapter_id)
  want = longhand_chain(tokens, block_size, adapter_id)
  assert len(got) == len(tokens) // block_size
  assert all(isinstance(d, bytes) and len(d) == 16 for d in got)
  assert got == want


def test_block_hashes_golden_vectors():
  # Pinned so that a change of library, encoding or endianness cannot go unnoticed.
  assert [d.hex() for d in block_hashes(list(range(8)), 4)] == [
      "6ce5111a70ce980827165282dba81152", "2524b2553dae3345a396287f8100493b"]
  assert [d.hex() for d in block_hashes(list(range(8)), 4, adapter_id=0x0123456789ABCDEF)] == [
      "08e59205908173cfe237e1e663394088", "3909cf4dce6adc2cb508eaadcba2d294"]
  # low 64 bits first
  value = xxhash.xxh3_128_intdigest(struct.pack("<4i", 0, 1, 2, 3))
  assert block_hashes([0, 1, 2, 3], 4)[0] == struct.pack("<QQ", value & (2**64 - 1), value >> 64)


def test_adapter_id_changes_every_block():
  tokens = TOKEN_LISTS["range40"]
  base = block_hashes(tokens, 4)
  for adapter_id in (1, 2, 2**63, 2**64 - 1):
    adapted = block_hashes(tokens, 4, adapter_id=adapter_id)
    assert all(a != b for a, b in zip(adapted, base))
  assert block_hashes(tokens, 4, 1) != block_hashes(tokens, 4, 2)


def test_adapter_id_zero_is_plain_chain():
  tokens = TOKEN_LISTS["edges"]
  plain = longhand_chain(tokens, 4)
  assert block_hashes(tokens, 4, adapter_id=0) == block_hashes(tokens, 4) == plain
  assert block_hashes(tokens, 4, adapter_id=np.uint64(0)) == block_hashes(tokens, 4)


def test_partial_trailing_block_excluded_and_prefix_stable():
  tokens = list(range(40))
  assert len(block_hashes(tokens[:39], 4)) == 9
  assert block_hashes(tokens[:39], 4) == block_hashes(tokens[:36], 4)
  assert block_hashes(tokens[:3], 4) == []
  assert block_hashes([], 4) == []
  assert block_hashes(np.zeros((0,), np.int64), 4) == []
  assert block_hashes(tokens, 4)[:5] == block_hashes(tokens[:20], 4)


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint16, np.int8, np.uint64])
def test_integer_arrays_hash_as_int32(dtype):
  tokens = list(range(40))
  want = longhand_chain(tokens, 4)
  assert block_hashes(np.asarray(tokens, dtype=dtype), 4) == want
  assert block_hashes(tuple(np.int64(t) for t in tokens), 4) == want


def test_int64_edge_values_hash_as_int32():
  tokens = TOKEN_LISTS["negative"]
  assert block_hashes(np.asarray(tokens, np.int64), 4) == longhand_chain(tokens, 4)


@pytest.mark.parametrize("tokens", [
    [1, 2, 3.0, 4], np.arange(8, dtype=np.float32), [2**31, 0, 0, 0], [-(2**31) - 1, 0, 0, 0],
    np.array([2**31], np.int64), np.array([2**32], np.uint64), [2**70, 1, 2, 3], [[1, 2], [3]],
    np.zeros((2, 4), np.int32), ["a", "b", "c", "d"], [True, False, True, False], "1234", 7,
], ids=["float-in-list", "float-array", "int32max+1", "int32min-1", "int64-big", "uint64-big",
        "bigint", "ragged", "2d", "strings", "bools", "str", "scalar"])
def test_bad_tokens_raise_request_error(tokens):
  with pytest.raises(RequestError, match="token"):
    block_hashes(tokens, 4)


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_size=0), "block_size"), (dict(block_size=-4), "block_size"),
    (dict(block_size=2.0), "block_size"), (dict(block_size=True), "block_size"),
    (dict(block_size=4, adapter_id=-1), "adapter_id"),
    (dict(block_size=4, adapter_id=2**64), "adapter_id"),
    (dict(block_size=4, adapter_id=1.0), "adapter_id"),
    (dict(block_size=4, adapter_id="7"), "adapter_id"),
])
def test_bad_arguments_raise_request_error(kwargs, match):
  with pytest.raises(RequestError, match=match) as info:
    block_hashes(list(range(8)), **kwargs)
  assert isinstance(info.value, ValueError)


# -- adapter_identity ------------------------------------------------------------------------

A, B = b"adapter-a " * 100, b"adapter-b " * 100


def test_adapter_identity_empty_is_base():
  assert adapter_identity([]) == 0


def test_adapter_identity_depends_on_contents_scales_order():
  ids = {
      adapter_identity([(A, 1.0)]),
      adapter_identity([(B, 1.0)]),
      adapter_identity([(A, 0.5)]),
      adapter_identity([(A, 1.0), (B, 1.0)]),
      adapter_identity([(B, 1.0), (A, 1.0)]),
      adapter_identity([(A, 1.0), (B, 0.5)]),
      adapter_identity([(A + B, 1.0)]),
      adapter_identity([(A, 1.0), (A, 1.0)]),
  }
  assert len(ids) == 8
  assert all(0 < i < 2**64 for i in ids)
  assert adapter_identity([(A, 1.0)]) == adapter_identity([(bytearray(A), 1)])
  assert adapter_identity([(A, 0.0)]) == adapter_identity([(A, -0.0)])


def test_adapter_identity_path_equals_bytes_and_follows_rewrites(tmp_path):
  path = tmp_path / "lora.gguf"
  big = np.random.default_rng(0).integers(0, 256, size=3 * (1 << 20) + 17, dtype=np.uint8).tobytes()
  path.write_bytes(big)  # > 1 MiB: read in chunks
  first = adapter_identity([(path, 1.0)])
  assert first == adapter_identity([(str(path), 1.0)]) == adapter_identity([(big, 1.0)])
  moved = tmp_path / "elsewhere.gguf"
  moved.write_bytes(big)
  assert adapter_identity([(moved, 1.0)]) == first  # contents, not the path
  path.write_bytes(big[:-1] + bytes([big[-1] ^ 1]))  # same name, new contents (vLLM #42125)
  assert adapter_identity([(path, 1.0)]) != first


def test_adapter_identity_never_zero(monkeypatch):
  class ZeroHash:
    def __init__(self, *args, **kwargs):
      pass

    def update(self, data):
      pass

    def intdigest(self):
      return 0

  monkeypatch.setattr(pc.xxhash, "xxh3_64", ZeroHash)
  assert adapter_identity([(A, 1.0)]) == 1


@pytest.mark.parametrize("files,match", [
    ([(A, float("nan"))], "finite"), ([(A, float("inf"))], "finite"), ([(A, "x")], "scale"),
    ([(A,)], "pair"), ([(123, 1.0)], "bytes or a path"),
])
def test_adapter_identity_bad_input(files, match):
  with pytest.raises(AdapterError, match=match):
    adapter_identity(files)


def test_adapter_identity_missing_file_names_it(tmp_path):
  missing = tmp_path / "nope.gguf"
  with pytest.raises(AdapterError, match="nope.gguf"):
    adapter_identity([(missing, 1.0)])


# -- PrefixCache -----------------------------------------------------------------------------

def payload(nbytes, tag=0):
  return {"k": np.full((nbytes,), tag, np.uint8)}


def digest(name):
  return xxhash.xxh3_128(str(name).encode()).digest()


def insert_chain(cache, hashes, nbytes=100, start=0):
  stored = []
  for i in range(start, len(hashes)):
    stored.append(cache.insert(hashes[i], payload(nbytes, i), hashes[i - 1] if i else None))
  return stored


def assert_no_orphans(cache):
  """Every cached block is reachable: its parent is cached, and bytes add up."""
  for node in cache._nodes.values():
    assert node.parent is None or node.parent in cache
  assert cache.stats["bytes"] == sum(n.nbytes for n in cache._nodes.values()) <= cache.max_bytes


def test_payload_bytes_from_arrays():
  cache = PrefixCache(max_bytes=1 << 20, block_size=16)
  block = {
      "k": np.zeros((2, 16, 2, 64), np.float32), "v": np.zeros((2, 16, 2, 64), np.float32),
      "conv": np.zeros((6, 3, 256), np.float32), "ssm": np.zeros((6, 4, 32, 32), np.float32),
  }
  assert cache.insert(digest(0), block, None)
  stats = cache.stats
  assert stats["bytes"] == sum(a.nbytes for a in block.values())
  assert stats["entries"] == 1 and stats["capacity_bytes"] == 1 << 20
  assert cache._nodes[digest(0)].n_tokens == 16
  assert cache.match([digest(0)])[0] is block
  with pytest.raises(TypeError, match="numpy"):
    cache.insert(digest(1), {"k": [1, 2, 3]}, None)


def test_match_longest_run_and_counters():
  cache = PrefixCache(max_bytes=10_000, block_size=4)
  hashes = block_hashes(list(range(40)), 4)
  insert_chain(cache, hashes[:6])
  got = cache.match(hashes)
  assert [p["k"][0] for p in got] == [0, 1, 2, 3, 4, 5]
  assert cache.stats["hits"] == 6 and cache.stats["misses"] == 4
  assert cache.match([]) == []
  other = block_hashes(list(range(1, 41)), 4)
  assert cache.match(other) == []
  assert cache.stats["hits"] == 6 and cache.stats["misses"] == 14


def test_match_stops_at_first_miss():
  cache = PrefixCache(max_bytes=10_000, block_size=4)
  h = block_hashes(list(range(16)), 4)
  cache.insert(h[0], payload(10, 0), None)
  cache.insert(h[1], payload(10, 1), h[0])
  # h[2] absent; h[3] cannot be stored without its parent, and a later block is never reached
  assert not cache.insert(h[3], payload(10, 3), h[2])
  assert len(cache.match(h)) == 2
  assert cache.stats["misses"] == 2


def test_match_checks_the_parent_link():
  cache = PrefixCache(max_bytes=10_000, block_size=4)
  h = block_hashes(list(range(8)), 4)
  cache.insert(h[0], payload(10), None)
  cache.insert(h[1], payload(10), None)  # stored as a root: a mis-built chain
  assert len(cache.match(h)) == 1


def test_adapter_chains_are_isolated():
  cache = PrefixCache(max_bytes=10_000, block_size=4)
  tokens = list(range(16))
  base = block_hashes(tokens, 4)
  insert_chain(cache, base)
  assert len(cache.match(base)) == 4
  assert cache.match(block_hashes(tokens, 4, adapter_id=adapter_identity([(A, 1.0)]))) == []
  assert len(cache.match(block_hashes(tokens, 4, adapter_id=0))) == 4


def test_lru_eviction_order():
  cache = PrefixCache(max_bytes=300, block_size=4)
  a, b, c, d, e = (digest(x) for x in "abcde")
  for x in (a, b, c):
    assert cache.insert(x, payload(100), None)
  assert cache.match([a])  # a is now the most recent; b the least
  assert cache.insert(d, payload(100), None)
  assert b not in cache and {a, c, d} <= set(cache._nodes)
  assert cache.insert(c, payload(100), None)  # re-insert refreshes c; a becomes least recent
  assert cache.insert(e, payload(100), None)
  assert a not in cache and {c, d, e} <= set(cache._nodes)
  assert cache.stats["evictions"] == 2 and cache.stats["bytes"] == 300


def test_reinsert_keeps_payload():
  cache = PrefixCache(max_bytes=300, block_size=4)
  first = payload(100, 1)
  assert cache.insert(digest("a"), first, None)
  assert cache.insert(digest("a"), payload(100, 2), None)
  assert cache.match([digest("a")])[0] is first
  assert cache.stats["entries"] == 1 and cache.stats["bytes"] == 100


def test_oversized_payload_not_stored():
  cache = PrefixCache(max_bytes=300, block_size=4)
  cache.insert(digest("a"), payload(100), None)
  assert not cache.insert(digest("big"), payload(301), None)
  assert digest("big") not in cache and digest("a") in cache
  assert cache.stats["evictions"] == 0
  assert cache.insert(digest("fit"), payload(300), None)
  assert cache.stats == dict(hits=0, misses=0, evictions=1, bytes=300, entries=1,
                             capacity_bytes=300)
  assert not PrefixCache(0, 4).insert(digest("a"), payload(1), None)


def test_eviction_trims_chain_tails_first():
  cache = PrefixCache(max_bytes=600, block_size=4)
  h = block_hashes(list(range(16)), 4)
  insert_chain(cache, h)
  other = digest("other")
  cache.insert(other, payload(100), None)
  cache.insert(digest("x"), payload(100), None)
  assert cache.insert(digest("y"), payload(100), None)  # evicts the chain's tail, not its root
  assert h[3] not in cache
  assert len(cache.match(h)) == 3
  assert_no_orphans(cache)


def test_long_prompt_keeps_its_head():
  cache = PrefixCache(max_bytes=1000, block_size=4)
  h = block_hashes(list(range(80)), 4)
  stored = insert_chain(cache, h)
  assert stored == [True] * 10 + [False] * 10  # making room would evict its own parent
  assert len(cache.match(h)) == 10
  assert_no_orphans(cache)


def test_insert_without_cached_parent_is_refused():
  cache = PrefixCache(max_bytes=1000, block_size=4)
  h = block_hashes(list(range(8)), 4)
  assert not cache.insert(h[1], payload(10), h[0])
  assert len(cache) == 0


def test_random_workload_keeps_bound_and_no_orphans():
  rng = random.Random(0)
  cache = PrefixCache(max_bytes=2_000, block_size=4)
  prompts = [[rng.randrange(4) for _ in range(rng.randrange(4, 60))] for _ in range(30)]
  for step in range(400):
    tokens = rng.choice(prompts)
    h = block_hashes(tokens, 4, adapter_id=rng.choice([0, 0, 5]))
    k = len(cache.match(h))
    insert_chain(cache, h, nbytes=rng.choice([50, 100, 150]), start=k)
    assert_no_orphans(cache)
    if step % 100 == 99:
      assert cache.stats["evictions"] > 0
  stats = cache.stats
  assert stats["hits"] > 0 and stats["misses"] > 0
  assert stats["entries"] == len(cache)


def test_clear():
  cache = PrefixCache(max_bytes=1000, block_size=4)
  h = block_hashes(list(range(16)), 4)
  insert_chain(cache, h)
  cache.match(h)
  cache.clear()
  assert cache.stats == dict(hits=0, misses=0, evictions=0, bytes=0, entries=0, capacity_bytes=1000)
  assert cache.match(h) == []
  assert insert_chain(cache, h) == [True] * 4


@pytest.mark.parametrize("max_bytes,block_size", [(-1, 4), (10, 0), (10, 1.5), (True, 4)])
def test_cache_config_validated(max_bytes, block_size):
  with pytest.raises(ValueError):
    PrefixCache(max_bytes, block_size)


def test_replace_swaps_payload_and_respects_bound():
  from strata_jax.engine.prefix_cache import PrefixCache
  c = PrefixCache(max_bytes=3000, block_size=4)
  a, b = bytes(16), bytes([1]) * 16
  assert c.insert(a, {"k": np.zeros(100, np.float32)}, None)
  assert c.insert(b, {"k": np.zeros(100, np.float32)}, a)
  assert c.peek(b)["k"].nbytes == 400 and c.stats["hits"] == 0
  assert c.replace(b, {"k": np.zeros(100, np.float32), "ssm": np.ones(300, np.float32)})
  assert "ssm" in c.peek(b) and c.stats["bytes"] == 400 + 1600
  assert not c.replace(b, {"x": np.zeros(1000, np.float32)})     # alone over the bound
  assert c.replace(b, {"x": np.zeros(700, np.float32)}) is False   # evicts itself, parent stays
  assert a in c and b not in c and c.stats["bytes"] <= 3000
