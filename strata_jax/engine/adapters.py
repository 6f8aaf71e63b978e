"""The adapter table: numbered LoRA adapters sharing one padded rank axis, chosen per row.

Every loaded adapter (one `LoraSet`: a file, or several files stacked with `--lora A,B`) owns a
set of columns of the rank axis R of one `LoraParams` (its A rows and B columns there, zeros
elsewhere). A table `[C, R]` float32 of per-row scales (`LoraParams.table`, C = slots + 1)
says, for the rows whose switch is c, the scale of every column: row `slot + 1` holds the
request running in that slot, row 0 is all zeros (switch 0: off). So rows of one batch use
different adapters, and several adapters each, in the one compiled program: the kernel
computes `h = A x` for all R columns, scales h per row by the table, then `B h`
(punica/BGMV-style, `pallas_kernels/lora`).

Rules (docs/adapters.md):
* Ids are numbers 0, 1, ... in load order and are never reused: an unloaded id stays refused.
* The padded rank R is fixed when the engine is built: `lora_rank` or the loaded ranks' sum,
  rounded up to a multiple of 64 (`lora_rank_bucket`). Loading an adapter whose rank fits the
  free columns writes its A/B there, with no new program; one that does not fit grows R to
  the next bucket that holds everything, which compiles the steps once more.
* A request's adapters are fixed when it is submitted (a snapshot of the ids and scales it
  resolves to); it holds them until it finishes. Unloading an adapter that requests still
  hold refuses it to new requests at once and frees its columns when the last one finishes.
* Identity: each adapter's is its `LoraSet.adapter_id` (file contents and load scales); a
  request's is `choice_identity` of its (identity, scale) pairs: never a number or a column.
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from strata_jax.adapter_id import choice_identity, params_identity
from strata_jax.errors import AdapterError, RequestError
from strata_jax.params import LoraParams, LoraSet, lora_rank_bucket


@dataclasses.dataclass
class AdapterEntry:
  """One loaded adapter.

  Attributes:
    id: its number (llama.cpp's `id`), never reused.
    path: the file(s) it came from, comma-joined (or a description for in-memory sets).
    lora: the `LoraSet` (its load scales folded into B).
    scale: the default scale (`"lora": true` and absent `lora` use it; POST /lora-adapters
      sets it).
    content_id: its identity (`LoraSet.adapter_id`, or from the arrays' bytes).
    columns: the rank columns it owns [r].
    refs: requests (queued or running) that hold it.
    unloaded: refused to new requests; its columns are freed when `refs` reaches 0.
  """
  id: int
  path: str
  lora: LoraSet
  scale: float
  content_id: int
  columns: np.ndarray
  refs: int = 0
  unloaded: bool = False

  @property
  def rank(self) -> int:
    return int(self.columns.size)


@dataclasses.dataclass(frozen=True)
class AdapterChoice:
  """The adapters one request runs under, fixed at submit.

  Attributes:
    pairs: ((adapter id, scale), ...) sorted by id, scales > 0 only.
    identity: `choice_identity` of the adapters' content ids and scales (0: none).
  """
  pairs: tuple[tuple[int, float], ...] = ()
  identity: int = 0

  @property
  def on(self) -> bool:
    return bool(self.pairs)

  def as_json(self) -> list[dict]:
    return [{"id": i, "scale": s} for i, s in self.pairs]


OFF = AdapterChoice()


def check_scale(scale, where: str) -> float:
  """A request or default scale: a finite number >= 0 (RequestError otherwise)."""
  if isinstance(scale, bool):
    raise RequestError(f"{where}: scale must be a number, got {scale!r}")
  try:
    s = float(scale)
  except (TypeError, ValueError):
    raise RequestError(f"{where}: scale must be a number, got {scale!r}") from None
  if not math.isfinite(s) or s < 0:
    raise RequestError(f"{where}: scale must be a finite number >= 0, got {scale!r}")
  return s + 0.0


class AdapterTable:
  """Numbered adapters on one padded rank axis, and the per-row scale table.

  Args:
    cfg: the model's config (layer pattern and geometry).
    dtype: storage dtype of A and B (the model's compute dtype).
    rows: table rows C (the engine's slots + 1).
    rank: the padded rank R to reserve (rounded up to a multiple of 64); None: the loaded
      adapters' total rank, rounded up.
    adapters: `LoraSet`s, or `(LoraSet, default scale)` / `(LoraSet, scale, path)` tuples,
      numbered 0, 1, ... in order.
  """

  def __init__(self, cfg, dtype, rows: int, rank: int | None = None, adapters: Sequence = ()):
    self.cfg, self.dtype, self.rows = cfg, jnp.dtype(dtype), int(rows)
    items = [self._item(a) for a in adapters]
    need = sum(_width(ls) for ls, _, _ in items)
    self.rank = lora_rank_bucket(max(need, int(rank or 0)))
    D = cfg.d_model
    z = lambda *s: np.zeros(s, self.dtype)
    self._gdn_a = z(cfg.n_gdn, self.rank, cfg.gdn_value_dim)
    self._gdn_b = z(cfg.n_gdn, D, self.rank)
    self._attn_a = z(cfg.n_attn, self.rank, cfg.attn_out_dim)
    self._attn_b = z(cfg.n_attn, D, self.rank)
    self._table = np.zeros((self.rows, self.rank), np.float32)
    self._free = list(range(self.rank))
    self.entries: dict[int, AdapterEntry] = {}
    self._next_id = 0
    self.blocks: dict[int, set] = {}   # adapter id -> prefix-cache digests computed under it
    self.params_version = 0            # bumped when A/B or R change (the engine re-places)
    self.table_version = 0             # bumped when the table changes
    for ls, scale, path in items:
      self.add(ls, scale, path)

  # ----- loading ---------------------------------------------------------------------------
  @staticmethod
  def _item(a):
    if isinstance(a, LoraSet):
      return a, 1.0, None
    if isinstance(a, tuple) and len(a) in (2, 3) and isinstance(a[0], LoraSet):
      return a[0], check_scale(a[1], "adapter"), (a[2] if len(a) == 3 else None)
    raise AdapterError(f"an adapter must be a LoraSet (from load_lora) or a (LoraSet, scale) "
                       f"pair, got {type(a).__name__}")

  def add(self, lora: LoraSet, scale: float = 1.0, path: str | None = None) -> int:
    """Load `lora` as the next numbered adapter with default `scale`; returns its id.

    Uses free rank columns when it fits (no new program); otherwise grows R (bumps
    `params_version` with a new shape: the engine's steps compile once more)."""
    scale = check_scale(scale, f"adapter {path or ''}".strip())
    p = lora.params
    for name, want in (("gdn_a", (self.cfg.n_gdn, self.cfg.gdn_value_dim)),
                       ("attn_a", (self.cfg.n_attn, self.cfg.attn_out_dim))):
      a = getattr(p, name)
      if a.ndim != 3 or (a.shape[0], a.shape[2]) != want:
        raise AdapterError(f"adapter {path or ''}: {name} {tuple(a.shape)} does not fit this "
                           f"model ([{want[0]}, R, {want[1]}])")
    r = _width(lora)
    if r > len(self._free):
      self._grow(self.rank - len(self._free) + r)
    cols = np.asarray(sorted(self._free)[:r], np.int64)
    self._free = sorted(set(self._free) - set(cols.tolist()))
    host = lambda x: np.asarray(x).astype(self.dtype)
    self._gdn_a[:, cols] = host(p.gdn_a)
    self._gdn_b[:, :, cols] = host(p.gdn_b)
    self._attn_a[:, cols] = host(p.attn_a)
    self._attn_b[:, :, cols] = host(p.attn_b)
    cid = lora.adapter_id or params_identity(
        [p.gdn_a, p.gdn_b, p.attn_a, p.attn_b])
    if path is None:
      files = [getattr(f, "path", f) for f in lora.files]
      path = ",".join(map(str, files)) or f"<adapter {self._next_id}>"
    e = AdapterEntry(id=self._next_id, path=os.fspath(path), lora=lora, scale=scale,
                     content_id=int(cid), columns=cols)
    self.entries[e.id] = e
    self._next_id += 1
    self.params_version += 1
    return e.id

  def _grow(self, need: int):
    new = lora_rank_bucket(need)
    extra = new - self.rank
    pad = lambda x, axis: np.concatenate(
        [x, np.zeros(x.shape[:axis] + (extra,) + x.shape[axis + 1:], x.dtype)], axis=axis)
    self._gdn_a, self._attn_a = pad(self._gdn_a, 1), pad(self._attn_a, 1)
    self._gdn_b, self._attn_b = pad(self._gdn_b, 2), pad(self._attn_b, 2)
    self._table = pad(self._table, 1)
    self._free += list(range(self.rank, new))
    self.rank = new

  def unload(self, adapter_id) -> list[AdapterEntry]:
    """Refuse `adapter_id` to new requests from now on; free it now if no request holds it.
    Returns the entries freed by this call (for the engine to purge their cached blocks)."""
    e = self.get(adapter_id, what="unload")
    e.unloaded = True
    return self._collect()

  def _collect(self) -> list[AdapterEntry]:
    freed = [e for e in self.entries.values() if e.unloaded and e.refs == 0]
    for e in freed:
      c = e.columns
      self._gdn_a[:, c] = 0
      self._gdn_b[:, :, c] = 0
      self._attn_a[:, c] = 0
      self._attn_b[:, :, c] = 0
      self._table[:, c] = 0
      self._free = sorted(set(self._free) | set(c.tolist()))
      del self.entries[e.id]
      self.params_version += 1
      self.table_version += 1
    return freed

  # ----- queries ---------------------------------------------------------------------------
  def loaded(self) -> list[AdapterEntry]:
    """Adapters new requests may use, by id."""
    return [e for _, e in sorted(self.entries.items()) if not e.unloaded]

  def get(self, adapter_id, what: str = "lora") -> AdapterEntry:
    if isinstance(adapter_id, bool) or not isinstance(adapter_id, (int, np.integer)):
      raise RequestError(f"{what}: adapter id must be an integer, got {adapter_id!r}")
    e = self.entries.get(int(adapter_id))
    if e is None or e.unloaded:
      ids = ", ".join(str(x.id) for x in self.loaded()) or "none"
      state = "was unloaded" if (e is not None or 0 <= adapter_id < self._next_id) else \
          "does not exist"
      raise RequestError(f"{what}: adapter id {adapter_id} {state} (loaded ids: {ids})")
    return e

  def info(self) -> list[dict]:
    """llama.cpp's GET /lora-adapters list: id, path, scale (plus rank and identity)."""
    return [{"id": e.id, "path": e.path, "scale": e.scale, "rank": e.rank,
             "identity": f"{e.content_id:016x}"} for e in self.loaded()]

  def used_rank(self) -> int:
    return self.rank - len(self._free)

  # ----- defaults --------------------------------------------------------------------------
  def set_scales(self, items) -> None:
    """llama.cpp's POST /lora-adapters: `[{"id", "scale"}, ...]`; every adapter not listed
    gets scale 0 (as llama.cpp's `parse_lora_request`). Requests already submitted keep the
    scales they were submitted with."""
    new = self._parse(items, "POST /lora-adapters")
    for e in self.loaded():
      e.scale = new.get(e.id, 0.0)

  # ----- requests --------------------------------------------------------------------------
  def default_choice(self) -> AdapterChoice:
    return self._choice({e.id: e.scale for e in self.loaded()})

  def resolve(self, spec) -> AdapterChoice:
    """A request's `lora` -> its AdapterChoice (validated; RequestError on bad input).

    None: every loaded adapter at its default scale (none loaded: off). True: the same, and an
    error when none is loaded. False: off. A list of `{"id", "scale"}` (llama.cpp's form; a
    missing scale means the adapter's default), of `(id, scale)` pairs, or a mapping
    {id: scale}: exactly those, the others at 0.
    """
    if isinstance(spec, AdapterChoice):
      return spec
    if spec is None or spec is True:
      if spec is True and not self.loaded():
        raise RequestError("the request asks for the LoRA adapter but none is loaded")
      return self.default_choice()
    if spec is False:
      return OFF
    return self._choice(self._parse(spec, "lora"))

  def _parse(self, items, where: str) -> dict[int, float]:
    if isinstance(items, Mapping):
      items = list(items.items())
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
      raise RequestError(f"{where}: expected true, false or a list of {{\"id\", \"scale\"}}, "
                         f"got {items!r}")
    out: dict[int, float] = {}
    for item in items:
      if isinstance(item, Mapping):
        if "id" not in item:
          raise RequestError(f"{where}: each entry needs an \"id\", got {dict(item)!r}")
        aid, scale = item["id"], item.get("scale")
      elif isinstance(item, (tuple, list)) and len(item) == 2:
        aid, scale = item
      else:
        raise RequestError(f"{where}: each entry must be {{\"id\": N, \"scale\": S}}, got "
                           f"{item!r}")
      e = self.get(aid, what=where)
      if e.id in out:
        raise RequestError(f"{where}: adapter id {e.id} is listed twice")
      out[e.id] = e.scale if scale is None else check_scale(scale, f"{where}: adapter {e.id}")
    return out

  def _choice(self, scales: dict[int, float]) -> AdapterChoice:
    pairs = tuple(sorted((i, s) for i, s in scales.items() if s != 0.0))
    ident = choice_identity([(self.entries[i].content_id, s) for i, s in pairs])
    return AdapterChoice(pairs=pairs, identity=ident) if pairs else OFF

  def hold(self, choice: AdapterChoice):
    for i, _ in choice.pairs:
      self.entries[i].refs += 1

  def release(self, choice: AdapterChoice) -> list[AdapterEntry]:
    """A request holding `choice` is done; returns the entries this frees (deferred unloads)."""
    for i, _ in choice.pairs:
      e = self.entries.get(i)
      if e is not None:
        e.refs -= 1
    return self._collect()

  def set_row(self, row: int, choice: AdapterChoice):
    """Table row `row` := the scale of each column under `choice` (zeros elsewhere)."""
    new = np.zeros(self.rank, np.float32)
    for i, s in choice.pairs:
      new[self.entries[i].columns] = s
    if not np.array_equal(new, self._table[row]):
      self._table[row] = new
      self.table_version += 1

  def note_blocks(self, choice: AdapterChoice, digests, cache=None):
    """Remember prefix-cache digests computed under `choice`, to purge them at unload. With
    `cache`, a set grown well past the cache's size keeps only digests still cached (the
    others were evicted), so a long-running server's sets stay bounded."""
    for i, _ in choice.pairs:
      held = self.blocks.setdefault(i, set())
      held.update(digests)
      if cache is not None and len(held) > 2 * len(cache) + 4096:
        self.blocks[i] = {d for d in held if d in cache}

  # ----- device arrays ---------------------------------------------------------------------
  def table(self) -> jnp.ndarray:
    return jnp.asarray(self._table)

  def params(self) -> LoraParams:
    """The whole padded LoraParams with the table (jnp arrays on the default device)."""
    return LoraParams(gdn_a=jnp.asarray(self._gdn_a), gdn_b=jnp.asarray(self._gdn_b),
                      attn_a=jnp.asarray(self._attn_a), attn_b=jnp.asarray(self._attn_b),
                      table=self.table())


def _width(lora: LoraSet) -> int:
  return int(lora.params.gdn_a.shape[1])
