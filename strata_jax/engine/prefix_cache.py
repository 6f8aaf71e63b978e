"""Prefix block cache: chained xxh3-128 block digests and a host-side LRU block store.

A prompt is cut into blocks of `block_size` tokens. Block 0's digest is
`xxh3_128(tokens_0 as '<i4')`, block i's is `xxh3_128(digest_{i-1} ‖ tokens_i as '<i4')`
(seed 0), each digest stored as 16 bytes little-endian, low 64 bits first. A non-zero adapter
identity is prepended as 8 little-endian bytes to block 0's buffer, so every later digest of an
adapted request differs from the base chain; id 0 hashes byte-identically to the plain chain.
A control vector (non-zero id) puts 16 bytes there instead: the adapter id as 8 little-endian
bytes (written even when 0), then the control vector id as 8 little-endian bytes. The three
seeds (none, 8 bytes, 16 bytes) differ in length, so no chain of one kind equals another's.
Because each digest covers every earlier token (and the adapter), equal digests mean equal
prefixes, and a block can only be matched when its parent is.

The store keeps, per block, an opaque numpy payload from the engine: the block's attention K/V
rows and the GDN conv + recurrent state at the block's end, so a hit restores both and never
resumes from a wrong recurrent state.
"""
from __future__ import annotations

import operator
from typing import Any

import jax
import numpy as np
import xxhash

# Adapter ids (the `adapter_id` of block_hashes) come from the adapters' own module;
# importable from here too.
from strata_jax.adapter_id import adapter_identity  # noqa: F401
from strata_jax.errors import RequestError, StrataError

DIGEST_BYTES = 16
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _check_int(value: Any, name: str) -> int:
  """`value` as a Python int; bools, floats and strings are refused."""
  if isinstance(value, (bool, np.bool_)):
    raise RequestError(f"{name} must be an integer, got a bool ({value!r})")
  try:
    return operator.index(value)
  except TypeError:
    raise RequestError(
        f"{name} must be an integer, got {type(value).__name__} ({value!r})") from None


def _tokens_as_int32(tokens: Any) -> np.ndarray:
  """Token ids as a 1-D '<i4' array; any integer dtype in int32 range is accepted."""
  try:
    arr = np.asarray(tokens)
  except ValueError as e:  # ragged nested lists
    raise RequestError(f"tokens must be a flat sequence of integers: {e}") from None
  if arr.ndim != 1:
    raise RequestError(f"tokens must be 1-D, got shape {arr.shape}")
  if arr.size == 0:
    return np.zeros((0,), "<i4")  # np.asarray([]) is float64; an empty prompt is still valid
  if arr.dtype.kind not in "iu":
    # object arrays come from ints beyond int64; floats, bools and strings are refused too
    raise RequestError(f"tokens must be integers in int32 range [{_INT32_MIN}, {_INT32_MAX}], "
                       f"got dtype {arr.dtype}")
  lo, hi = int(arr.min()), int(arr.max())
  if lo < _INT32_MIN or hi > _INT32_MAX:
    bad = lo if lo < _INT32_MIN else hi
    raise RequestError(f"token id {bad} is outside int32 range [{_INT32_MIN}, {_INT32_MAX}]")
  # Always hash int32 bytes: int64 ids hash differently (env-feasibility §5).
  return arr.astype("<i4", copy=False)


def block_hashes(tokens: Any, block_size: int, adapter_id: int = 0, *,
                 control_vector_id: int = 0) -> list[bytes]:
  """Chained 16-byte digests of the full blocks of `tokens`, as the prefix cache computes them.

  Args:
    tokens: token ids [T], a sequence or array of integers in int32 range.
    block_size: tokens per block (>= 1). A partial trailing block gets no digest.
    adapter_id: 64-bit adapter identity from `adapter_identity` (0 = base model or LoRA off).
    control_vector_id: 64-bit control vector identity (`ControlVector.control_vector_id`), 0
      for none: then the digests are exactly those without the argument. Non-zero: block 0's
      buffer starts with `adapter_id` (8 bytes LE, even when 0) then this id (8 bytes LE).

  Returns:
    `T // block_size` digests, each 16 bytes (the xxh3-128 value little-endian, low 64 bits
    first); digest i covers blocks 0..i, the adapter id and the control vector id.

  Raises:
    RequestError: tokens not 1-D integers in int32 range, block_size < 1, or adapter_id or
      control_vector_id outside [0, 2**64).
  """
  block_size = _check_int(block_size, "block_size")
  if block_size < 1:
    raise RequestError(f"block_size must be >= 1, got {block_size}")
  adapter_id = _check_int(adapter_id, "adapter_id")
  if not 0 <= adapter_id < 2**64:
    raise RequestError(f"adapter_id must be in [0, 2**64), got {adapter_id}")
  control_vector_id = _check_int(control_vector_id, "control_vector_id")
  if not 0 <= control_vector_id < 2**64:
    raise RequestError(f"control_vector_id must be in [0, 2**64), got {control_vector_id}")
  arr = _tokens_as_int32(tokens)
  n_blocks = arr.shape[0] // block_size
  buf = memoryview(arr[: n_blocks * block_size].tobytes())
  stride = 4 * block_size
  prev = adapter_id.to_bytes(8, "little") if adapter_id else b""
  if control_vector_id:
    prev = adapter_id.to_bytes(8, "little") + control_vector_id.to_bytes(8, "little")
  out = []
  for i in range(n_blocks):
    # xxh3_128_digest() is big-endian (canonical); the contract wants low 64 bits first.
    value = xxhash.xxh3_128_intdigest(prev + buf[i * stride:(i + 1) * stride], seed=0)
    prev = value.to_bytes(DIGEST_BYTES, "little")
    out.append(prev)
  return out


def _payload_nbytes(payload: Any) -> int:
  """Total bytes of a pytree of numpy arrays; device arrays are refused (host-side store)."""
  total = 0
  for leaf in jax.tree_util.tree_leaves(payload):
    if not isinstance(leaf, (np.ndarray, np.generic)):
      raise TypeError(
          f"prefix-cache payload leaves must be numpy arrays, got {type(leaf).__name__}")
    total += leaf.nbytes
  return total


def _is_int(value: Any) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


class _Node:
  __slots__ = ("digest", "parent", "payload", "nbytes", "n_tokens", "prev", "next")

  def __init__(self, digest, parent, payload, nbytes, n_tokens):
    self.digest, self.parent = digest, parent
    self.payload, self.nbytes, self.n_tokens = payload, nbytes, n_tokens
    self.prev = self.next = None


class PrefixCache:
  """Host-side LRU store of per-block payloads, keyed by the 16-byte chain digest.

  Recency is one doubly linked list (least recent first). An OrderedDict cannot place an entry
  in the middle, and we need that: a new block goes just *behind* its parent, and `match`
  refreshes a hit chain deepest-first so the root ends up most recent. Together these keep
  every block less recent than its parent, so the least recent entry is always a leaf:
  eviction trims chains from the tail, never orphans a child (a block whose parent is gone
  could never be matched again and would only waste memory), and needs no cascade. All
  operations are O(1) per block.

  Stats: `hits` counts blocks served by `match`, `misses` the blocks asked for but not served
  (every block after the first miss included), so `hits / (hits + misses)` is the block hit
  rate; `evictions` counts entries dropped to respect `max_bytes`.
  """

  def __init__(self, max_bytes: int, block_size: int):
    if not _is_int(max_bytes) or max_bytes < 0:
      raise StrataError(f"prefix cache max_bytes must be an integer >= 0, got {max_bytes!r}")
    if not _is_int(block_size) or block_size < 1:
      raise StrataError(f"prefix cache block_size must be an integer >= 1, got {block_size!r}")
    self.max_bytes = int(max_bytes)
    self.block_size = int(block_size)
    self._nodes: dict[bytes, _Node] = {}
    self._head = _Node(None, None, None, 0, 0)  # sentinel: head.next is the least recent
    self._head.prev = self._head.next = self._head
    self._bytes = 0
    self._hits = self._misses = self._evictions = 0

  # -- recency list ------------------------------------------------------------------------

  def _unlink(self, node: _Node) -> None:
    node.prev.next, node.next.prev = node.next, node.prev

  def _link_before(self, node: _Node, at: _Node) -> None:
    """Place `node` just before `at` (just less recent); `at = head` means most recent."""
    node.prev, node.next = at.prev, at
    at.prev.next = node
    at.prev = node

  def _place(self, node: _Node) -> None:
    """Just behind the parent when there is one (keeps children older), else most recent."""
    parent = self._nodes.get(node.parent) if node.parent is not None else None
    self._link_before(node, parent if parent is not None else self._head)

  # -- public API --------------------------------------------------------------------------

  def __len__(self) -> int:
    return len(self._nodes)

  def __contains__(self, digest: bytes) -> bool:
    return digest in self._nodes

  def peek(self, digest: bytes) -> Any:
    """The stored payload (None if absent), without touching recency or counters."""
    node = self._nodes.get(digest)
    return node.payload if node is not None else None

  def replace(self, digest: bytes, payload: Any) -> bool:
    """Swap a cached block's payload (e.g. add the recurrent state to a K/V-only block).
    Returns whether the block is still cached afterwards."""
    node = self._nodes.get(digest)
    if node is None:
      return False
    nbytes = _payload_nbytes(payload)
    if nbytes > self.max_bytes:
      return False
    self._bytes += nbytes - node.nbytes
    node.payload, node.nbytes = payload, nbytes
    self._unlink(node)
    self._place(node)
    while self._bytes > self.max_bytes:   # least recent is always a leaf (possibly this one)
      self._evict(self._head.next)
    return digest in self._nodes

  def match(self, hashes: list[bytes]) -> list[Any]:
    """Payloads of the longest run of cached blocks from block 0.

    Args:
      hashes: the request's block digests, from `block_hashes`.

    Returns:
      payloads for blocks 0..k-1, stopping at the first block not cached (or stored under a
      different parent, which only a mis-built chain can produce).
    """
    run: list[_Node] = []
    parent = None
    for digest in hashes:
      node = self._nodes.get(digest)
      if node is None or node.parent != parent:
        break
      run.append(node)
      parent = digest
    for node in reversed(run):  # deepest first, so the root ends most recent
      self._unlink(node)
      self._link_before(node, self._head)
    self._hits += len(run)
    self._misses += len(hashes) - len(run)
    return [node.payload for node in run]

  def insert(self, digest: bytes, payload: Any, parent: bytes | None) -> bool:
    """Store one block's payload under its chain digest.

    Args:
      digest: the block's 16-byte digest.
      payload: pytree of numpy arrays (K/V rows, GDN state at the block's end).
      parent: digest of the previous block (`hashes[i - 1]`); None for block 0. Required,
        because `match` checks the link: a block stored without its parent is never matched.
        A block whose parent is not cached is not stored: it could never be matched.

    Returns:
      True when the block is cached after the call. False when its parent is absent, when the
      payload alone exceeds `max_bytes`, or when making room would evict its own parent.
    """
    if not isinstance(digest, bytes) or len(digest) != DIGEST_BYTES:
      raise TypeError(f"digest must be {DIGEST_BYTES} bytes, got {digest!r}")
    node = self._nodes.get(digest)
    if node is not None:  # same digest, same prefix: keep the stored payload, refresh it
      self._unlink(node)
      self._place(node)
      return True
    if parent is not None and parent not in self._nodes:
      return False
    nbytes = _payload_nbytes(payload)
    if nbytes > self.max_bytes:
      return False
    while self._bytes + nbytes > self.max_bytes:
      victim = self._head.next
      if parent is not None and victim.digest == parent:  # only our own chain is left
        return False
      self._evict(victim)
    node = _Node(digest, parent, payload, nbytes, self.block_size)
    self._place(node)
    self._nodes[digest] = node
    self._bytes += nbytes
    return True

  def discard(self, digests) -> int:
    """Drop these blocks now, wherever they are in the recency list (an unloaded adapter's
    chains: every block of a chain carries its seed, so whole chains go). Returns how many
    were cached. Not counted as evictions."""
    n = 0
    for digest in digests:
      node = self._nodes.pop(digest, None)
      if node is not None:
        self._unlink(node)
        self._bytes -= node.nbytes
        n += 1
    return n

  def _evict(self, node: _Node) -> None:
    self._unlink(node)
    del self._nodes[node.digest]
    self._bytes -= node.nbytes
    self._evictions += 1

  @property
  def stats(self) -> dict[str, int]:
    return dict(hits=self._hits, misses=self._misses, evictions=self._evictions,
                bytes=self._bytes, entries=len(self._nodes), capacity_bytes=self.max_bytes)

  def clear(self) -> None:
    """Drop every entry and reset the counters."""
    self._nodes.clear()
    self._head.prev = self._head.next = self._head
    self._bytes = 0
    self._hits = self._misses = self._evictions = 0
