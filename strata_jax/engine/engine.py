"""The engine: batch slots decoding together, sampling, a conversation cache per slot and a
prefix block cache shared by the slots. Host-side orchestration in numpy; every device call
goes through `strata_jax.steps`."""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax import sampling as smp
from strata_jax import session as sess
from strata_jax import speculative, steps
from strata_jax.adapter_id import choice_identity
from strata_jax.engine import sampling as host_sampling
from strata_jax.engine.adapters import OFF, AdapterChoice, AdapterTable
from strata_jax.engine.prefix_cache import PrefixCache, block_hashes
from strata_jax.errors import ControlVectorError, RequestError, SessionError, StrataError
from strata_jax.forms import Forms
from strata_jax.parallel import distributed
from strata_jax.parallel.plan import describe, plan_auto
from strata_jax.parallel.split import make_stages, slice_cvec
from strata_jax.params import LoraSet
from strata_jax.state import init_state

log = logging.getLogger("strata_jax")


def chunk_steps(limit: int, buckets: Sequence[int]) -> int:
  """Decode steps for the next dispatch, one of the sorted `buckets`, for rows that need at
  most `limit` more: the fewest that cover `limit` if at most one step or an eighth of them
  would be spare, else the most that fit in it (the rest goes in later dispatches), else the
  fewest.
  A spare step costs a whole step (the weights are read for inactive rows all the same),
  while one more dispatch, queued behind the running one, costs the host a little: five
  tokens from (1, 4, 16) take 4 + 1 steps, not 16."""
  cover = [b for b in buckets if b >= limit]
  if cover and cover[0] - limit <= max(1, cover[0] // 8):
    return cover[0]
  fit = [b for b in buckets if b <= limit]
  return fit[-1] if fit else buckets[0]


@dataclasses.dataclass
class Request:
  """One generation request.

  `lora`: None (every loaded adapter at its default scale; none loaded: off), True (the same,
  an error when none is loaded), False (off), or llama.cpp's per-request form: a list of
  `{"id": N, "scale": S}` (or `(id, scale)` pairs, or {id: scale}); adapters not listed are
  off. Resolved and fixed when the request is submitted (docs/adapters.md).

  Sampling (on the device, `strata_jax.sampling`): temperature 0 is greedy; top_k 0, top_p 1,
  min_p 0, presence/frequency penalty 0 and repeat_penalty 1 are off. Penalties are llama.cpp's
  over the last 64 tokens (prompt included). `seed` fixes the draws: the tokens depend only on
  the prompt, the parameters and the seed. `logprobs=k` (0..20) returns each chosen token's
  logprob and the k most likely ids per step (`Result.logprobs`).
  """
  tokens: list[int]
  max_tokens: int = 32
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  repeat_penalty: float = 1.0
  seed: int = 0
  stop: Sequence[int] = ()
  lora: bool | None | list | dict | AdapterChoice = None
  logprobs: int | None = None
  return_logits: bool = False       # prompt [T, V] and step logits (turns the caches off)
  return_step_logits: bool = False  # only the logits each token was chosen from (caches on)
  on_token: Callable[[int], None] | None = None   # called with each token as it is read
  # (logprobs set) called with each token's logprobs entry (as in Result.logprobs) just
  # before on_token
  on_logprobs: Callable[[dict], None] | None = None
  spec: int | None = None   # speculative drafts per step (0 off; None: the engine's `spec`)


@dataclasses.dataclass
class Result:
  prompt_tokens: list[int]
  tokens: list[int]
  lora: bool
  finish_reason: str            # "stop" | "length" | "cancelled"
  cached_tokens: int            # prompt tokens read from a cache
  prompt_tokens_computed: int
  ttft_s: float                 # from submit() to the first token, queueing included
  decode_tokens_per_s: float
  slot: int
  text: str | None = None
  prompt_logits: np.ndarray | None = None   # [T, V] (return_logits)
  step_logits: np.ndarray | None = None     # [n, V] the raw logits each token was chosen from
  # (logprobs=k) per token: {"token": id, "logprob": x, "top": {id: x, ...} (k entries)}
  logprobs: list[dict] | None = None
  adapters: list | None = None              # [{"id", "scale"}] the adapters that served it
  draft: dict | None = None   # speculative decoding: {"proposed": p, "accepted": a}


class Handle:
  """A submitted request; `result` is None until it finishes."""

  def __init__(self, req: Request):
    self.req, self.result, self.cancelled = req, None, False
    self.t_submit = time.perf_counter()

  def cancel(self):
    """Stop generating soon (finish_reason "cancelled"); tokens read after the cancel are
    not delivered."""
    self.cancelled = True

  @property
  def done(self) -> bool:
    return self.result is not None


@dataclasses.dataclass
class _Running:
  req: Request
  switch: int
  tokens: list[int]
  t0: float
  t_first: float = 0.0
  cached: int = 0
  computed: int = 0
  remaining: int = 0        # tokens it may still emit, as of the tokens read
  inflight: int = 0         # decode steps dispatched and not yet read
  cancel_at: int | None = None
  step_logits: list = dataclasses.field(default_factory=list)
  prompt_logits: np.ndarray | None = None
  logprobs: list | None = None
  spec: int = 0            # speculative drafts per round (0: the plain decode path)
  proposed: int = 0
  accepted: int = 0
  rng: np.random.Generator | None = None   # the host rejection rule's draws (its spec rows)
  first: tuple | None = None   # (sampler outputs, plan, logits or None): not yet read


@dataclasses.dataclass
class _Snap:
  """A prefill chunk's prefix-cache snapshot, waiting on the device for its host copy: the
  K/V rows [start, start + L) of one slot (one read per chunk and stage), holding blocks
  `blocks` of the chain `hashes`; the GDN state after block `state_blk` (or None)."""
  hashes: list
  blocks: list
  start: int
  state_blk: int | None
  payload: list            # per stage: {"k", "v"[, "conv", "ssm"]} device arrays
  host: concurrent.futures.Future | None = None   # the copier's (blk, payload) pairs


@dataclasses.dataclass
class _Chunk:
  out: tuple               # device outputs of decode_sample (or of one sample_step)
  n: int
  runs: list               # (slot, _Running) of the rows that may be active in it
  plan: smp.Plan
  cols: dict | None = None  # slot -> its column in the outputs (None: the slot itself)


# Prefix-cache snapshot bytes whose host copies start in one scheduling round (at least one
# snapshot): well under what the host link moves in one decode chunk.
SNAPSHOT_COPY_BYTES = 64 << 20


def _record_step(run: _Running, tok: int, logits, entry):
  """What a delivered token brings besides itself: its step logits (the raw logits it was
  chosen from, when the request asks) and its logprobs entry (`entry` = (logprob, top ids,
  their logprobs), when it asks for logprobs; the top ids cut to its k)."""
  r = run.req
  if logits is not None:
    run.step_logits.append(np.asarray(logits, np.float32))
  if entry is not None:
    lp, ids, lps = entry
    top = {int(a): float(b) for a, b in zip(ids[:r.logprobs], lps[:r.logprobs])}
    run.logprobs.append({"token": int(tok), "logprob": float(lp), "top": top})
    if r.on_logprobs is not None:
      r.on_logprobs(run.logprobs[-1])


def _snap_bytes(item: _Snap) -> int:
  return sum(a.nbytes for entry in item.payload for a in entry.values())


def _cut_blocks(item: _Snap, host: list, block_size: int) -> list:
  """(blk, per-stage payload) for each block of a snapshot read to the host: the block's K/V
  rows cut from its chunk's slice (copied, so a cached block does not keep the whole chunk
  alive), and the GDN state with the block that carries it."""
  out = []
  for blk in item.blocks:
    lo = blk * block_size - item.start
    payload = []
    for e in host:
      entry = {"k": np.array(e["k"][:, lo:lo + block_size]),
               "v": np.array(e["v"][:, lo:lo + block_size])}
      if blk == item.state_blk:   # owned copies: the cache must not hold pinned buffers
        entry.update(conv=np.array(e["conv"]), ssm=np.array(e["ssm"]))
      payload.append(entry)
    out.append((blk, tuple(payload)))
  return out


def _copy_snapshot(item: _Snap, block_size: int) -> list:
  """The copier thread's job: every array's device-to-host copy started (so they overlap),
  then read and cut into blocks. Off the scheduling thread, which would otherwise leave the
  device idle while it waits and copies (H200, bench-a3b, run 7: 22-33 ms per 75 MB GDN state,
  once per state, at every batch size)."""
  started = [{k: distributed.start_host_copy(a) for k, a in e.items()} for e in item.payload]
  return _cut_blocks(item, [{k: np.asarray(a) for k, a in e.items()} for e in started],
                     block_size)


class Engine:
  """Batch slots over one model (optionally split into stages), an optional LoRA set and an
  optional control vector.

  Decoding runs `steps.decode_sample`: several steps per dispatch with sampling, stop ids and
  length limits on the device; only token ids (and requested logprobs) come back. The next
  chunk is dispatched before the previous one's tokens are read, so host work overlaps the
  device.

  Args:
    model: a `strata_jax.Model` (from `load_model`).
    lora: a `LoraSet` from `load_lora`, or None.
    control_vector: a `ControlVector` from `load_control_vector`, or None. It applies to every
      row (as llama.cpp's); `set_control_vector` swaps it without recompiling.
    slots: number of rows decoding together.
    max_seq: K/V capacity per slot (tokens).
    block_size: prefix-cache block size (tokens) and the smallest prefill chunk.
    prefix_cache_bytes: host memory bound of the prefix block cache (0 disables it).
    state_every: keep the GDN state with every this-many blocks (and with each prompt's last
      full block); K/V are kept for every block. The recurrent state is fixed-size and, for
      large models, far bigger than a block's K/V (80B-A3B: 74 MiB vs 1.5 MiB per 64 tokens).
      Prefill chunks end where a state is kept, so this also bounds the chunk length (the
      default, 32 blocks of 64, lets a 2,500-token prompt run as chunks of 2,048, 448 and 4).
    max_prefill_chunk: the largest prefill chunk (tokens; a power-of-two multiple of
      block_size). Chunks are padded to power-of-two buckets (one program per bucket).
    decode_steps: the decode steps per dispatch the engine may use (one program each): a
      dispatch takes the fewest that cover the running rows' remaining length (with requests
      queued, the first row's to finish) when at most one step or an eighth of them would be
      spare, else the most that fit in it (`chunk_steps`).
    warmup: compile the programs before the first request: True for every prefill bucket, or
      a list of prompt lengths for the buckets those use; plus the greedy decode programs
      (for every row bucket).
    decode_buckets: opt-in speed for engines with idle slots: with fewer running rows than
      slots, decode only those rows, gathered into the smallest power-of-two bucket that
      holds them (`steps.decode_sample_rows`; one program per bucket), as a step's cost grows
      with its batch. The price: a row's numbers then depend on how many neighbours it has
      (XLA rounds some sums differently for another batch size), so tokens match the full
      batch's but logits may differ in the last bits, and a resumed session is bit-identical
      to the uninterrupted run only under the same buckets. Off (default): every step runs
      all slots, and a row's numbers never depend on its neighbours. Single device only.
    snapshot_thread: copy prefix-cache snapshots to the host on a thread of their own, so the
      scheduling thread never waits on them (H200, bench-a3b: the GPU idled 22-33 ms per 75 MB
      GDN state otherwise, bench_engine runs 7 and 8). None (default): where the device is
      not the host's CPU. On the CPU backend the copies run inline: the device's work runs on
      the host's own threads there, and a second thread issuing transfers stalled a CPU
      process serving two engines (tests/test_server.py, 2026-12-01).
    merge_tail: a prompt's tokens after its last full block join the chunk before them when
      its bucket has room, and that chunk hands back the GDN state at the block from inside
      (`steps.prefill_cut`): one pass over the weights fewer (`_schedule`). A cache hit then
      matches a cold run to rounding, not bit for bit. On by default: the time to first token
      of a 2,500-token prompt on the H200 was 1.12 / 1.17 x one prefill call with it and 1.19
      / 1.29 without (experiments/results/device/bench_engine_run12.json, _run11.json). (It
      was opt-in after two CPU test runs hung with it on; most likely jaxlib 0.10's LAPACK
      triangular solve deadlocking XLA's CPU thread pool, seen under gdb in the same setting
      and gone now that the GDN reference solves one matrix a call.)
    bucket_step: the one-pass prefill, 512 by default (None or 0: off). A power of two >= the
      block size: chunk buckets above it are its multiples (not powers of two), the largest
      chunk is the largest such bucket that fits, and a chunk runs on past the
      recurrent-state points inside it (every `state_every` blocks, the prompt's last full
      block), handing their states back from inside (`steps.prefill_cut` with several cuts;
      the GDN op runs once more from each point). A prompt up to that length then makes one
      pass over the weights: with 512, a 2,500-token prompt is one 2,560-token chunk, where
      the default runs 2,048 and 512 (on an H100 the second chunk's re-read of every expert
      took most of the time to first token beyond one prefill call:
      experiments/results/device/run74). The default since run 75 (H100, bench-a3b bf16): the
      2,500-token time to first token 83.5 ms with it against 99.5 ms without, 1.07 / 1.27 x
      one prefill call (experiments/results/device/run75/bench_engine_b1_s19_step*.json).
      The states match the powers-of-two schedule's to rounding (other shapes), not bit for
      bit.
      `warmup=True` compiles its buckets but not its several-cut programs: pass prompt
      lengths.
    spec: speculative decoding, drafts per step for requests that do not say (0: off).
    draft: the drafter, "mtp" (the model's MTP head; the default when it has one) or "ngram"
      (prompt lookup). `strata_jax.speculative`.
    spec_rounds: MTP rounds per dispatch (one program runs them back to back,
      `steps.spec_rounds_step`; one round runs where a row's length could end sooner:
      `speculative.rounds_for`). 1: one round a dispatch.
  """

  def __init__(self, model, lora=None, slots: int = 1, max_seq: int | None = None,
               block_size: int = 64, prefix_cache_bytes: int = 256 << 20, state_every: int = 32,
               max_prefill_chunk: int = 4096, decode_steps: Sequence[int] = (1, 4, 16),
               warmup: bool | Sequence[int] = False, forms: Forms | None = None,
               control_vector=None, lora_rank: int | None = None, spec: int = 0,
               draft: str | None = None, decode_buckets: bool = False,
               snapshot_thread: bool | None = None, merge_tail: bool = True,
               bucket_step: int | None = 512, spec_rounds: int = 4):
    self.model, self.n_slots = model, int(slots)
    # Numbered adapters (engine/adapters.py): one LoraSet is adapter 0; a list numbers them.
    pair = isinstance(lora, tuple) and len(lora) in (2, 3) and isinstance(lora[0], LoraSet) \
        and not isinstance(lora[1], LoraSet)
    items = [] if lora is None else [lora] if isinstance(lora, LoraSet) or pair else list(lora)
    self.lora_set = items[0] if len(items) == 1 and isinstance(items[0], LoraSet) else None
    # Forms live in the config, the steps' static argument: an engine with other forms
    # compiles and runs its own programs beside this model's other engines.
    backend = jax.default_backend()
    cfg = model.cfg if forms is None else dataclasses.replace(
        model.cfg, forms=forms.resolve(backend, model.dtype).check_backend(backend))
    self.cfg = cfg
    self.block_size = int(block_size)
    self.state_every = max(1, int(state_every))
    cap = max_seq or min(cfg.context_length, 4096)
    self.max_seq = -(-int(cap) // self.block_size) * self.block_size
    bucket_step = bucket_step or None   # 0: off, as None
    if bucket_step is not None and (int(bucket_step) < self.block_size
                                    or int(bucket_step) & (int(bucket_step) - 1)):
      raise StrataError(f"bucket_step={bucket_step}: a power of two >= the block size "
                        f"({self.block_size}), or None / 0 (off)")
    self.bucket_step = None if bucket_step is None else int(bucket_step)
    chunk, cap = self.block_size, min(int(max_prefill_chunk), self.max_seq)
    while chunk * 2 <= cap:
      chunk *= 2
    # the largest bucket that fits: with `bucket_step`, a multiple of it (2,560 for a 2,500-token
    # prompt's 2,560-token capacity, where powers of two stop at 2,048)
    self.max_chunk = max(chunk, cap // self.bucket_step * self.bucket_step
                         if self.bucket_step else 0)
    self.decode_steps = tuple(sorted({int(b) for b in decode_steps if int(b) >= 1})) or (1,)
    # Without an adapter the engine runs the very same program with an all-zero adapter and
    # every switch off: "off" is then bit-identical to "no adapter" by construction, on any
    # backend (GPU autotuning may otherwise pick different GEMM code for two programs).
    self.adapters = AdapterTable(cfg, model.dtype, self.n_slots + 1, lora_rank, items)
    lora_params = self.adapters.params()
    self._placed_versions = (self.adapters.params_version, self.adapters.table_version)
    ranges = model.layer_ranges
    placed = getattr(model, "stage_params", None)   # loaded with a split: stages on devices
    if ranges == "auto":
      if placed is not None:
        raise StrataError("a model loaded with a layer split keeps the ranges it was loaded "
                          "with; reload it to change them")
      ranges = plan_auto(model, model.devices, LoraSet(lora_params, (), (), 0), self.n_slots,
                         self.max_seq)
      log.info("layer split (auto): %s", describe(ranges, model.devices[:len(ranges)]))
    if placed is not None and (len(placed) != len(ranges) or any(
        p.layers.attn_norm.shape[0] != hi - lo for p, (lo, hi) in zip(placed, ranges))):
      raise StrataError(f"layer ranges {ranges} differ from the {len(placed)} stages the model "
                        "was loaded with; reload it to change them")
    devices = model.devices[:len(ranges)] if model.devices else None
    self._check_control_vector(control_vector)
    self.control_vector = control_vector
    self.stages = make_stages(cfg, model.params, lora_params, ranges, devices, placed,
                              cvec=control_vector.vectors if control_vector is not None else None)
    # Stages on devices of several processes (jax.distributed): host reads are broadcasts.
    self._shared = devices is not None and distributed.multi_process()
    self._host = lambda x: distributed.to_host(x, self._shared)
    if self.adapters.loaded():
      n_adapted = int(sum(np.count_nonzero(np.abs(np.asarray(a, np.float32)).sum(axis=(1, 2)))
                          for a in (lora_params.gdn_b, lora_params.attn_b)))
      per_dev = ", ".join(
          f"{sum(a.nbytes for a in jax.tree.leaves(st.lora)) / 2**20:.2f} MiB"
          for st in self.stages)
      log.info("LoRA: %d files, %d layers adapted, %s per device; adapters %s, rank table %d",
               sum(len(e.lora.files) for e in self.adapters.loaded()), n_adapted, per_dev,
               ", ".join(f"{e.id}: {e.path} (rank {e.rank})" for e in self.adapters.loaded()),
               self.adapters.rank)
    self.states = []
    for st in self.stages:
      s = init_state(st.cfg, self.n_slots, self.max_seq, model.dtype)
      self.states.append(jax.device_put(s, st.device) if st.device is not None else s)
    # the identity `lora: true` runs under (the one LoraSet's adapter_id for a single adapter)
    self.adapter_id = self.adapters.default_choice().identity
    self.control_vector_id = control_vector.control_vector_id if control_vector else 0
    self.prefix_cache = PrefixCache(prefix_cache_bytes, self.block_size)
    # per slot: the tokens whose state the row holds, and the (switch, adapter id, control
    # vector id) it was under
    self.slot_tokens: list[list[int]] = [[] for _ in range(self.n_slots)]
    self.slot_key: list[tuple[int, int, int]] = [(0, 0, 0)] * self.n_slots
    self.slot_choice: list[AdapterChoice] = [OFF] * self.n_slots
    self._lru = collections.OrderedDict((s, None) for s in range(self.n_slots))
    self._pending: collections.deque = collections.deque()
    self._running: dict = {}
    # The sampler's per-row arrays live on the last stage's device. Stages on several
    # processes: every process keeps its own copy on a local device and samples from the
    # broadcast logits (the same inputs and program, so the same tokens everywhere).
    self._sdev = jax.local_devices()[0] if self._shared else self.stages[-1].device
    self._shost = np.asarray if self._shared else self._host   # the sampler's outputs
    self.rows = self._put(host_sampling.empty_rows(self.n_slots))
    self.row_params = host_sampling.RowParams(self.n_slots)
    self._row_dev = None          # device copy of row_params (None: rebuild at next dispatch)
    self._inflight: _Chunk | None = None
    # decode row buckets: powers of two below the slot count (the full batch needs no gather)
    self.row_buckets = tuple(1 << i for i in range(max(0, self.n_slots - 1).bit_length())
                             ) if decode_buckets and len(self.stages) == 1 and not self._shared \
        else ()
    self._idx_dev: dict = {}      # device copies of the bucket row lists, by rows
    self._snaps: list = []        # prefix-cache snapshots waiting for their host copy
    self._copying: list = []      # ... and those whose copies have started
    self._copier = None           # the thread that copies them (started on first use)
    self._snapshot_thread = (jax.default_backend() != "cpu" if snapshot_thread is None
                             else bool(snapshot_thread))
    self.merge_tail = bool(merge_tail)
    has_mtp = self.stages[-1].params.mtp is not None   # the head sits on the last stage
    self.spec = int(spec) if isinstance(spec, (int, np.integer)) else spec
    self.draft = speculative.check_spec(self.spec, draft, has_mtp)
    if isinstance(spec_rounds, bool) or not isinstance(spec_rounds, (int, np.integer)) or \
        spec_rounds < 1:
      raise StrataError(f"spec_rounds must be an integer >= 1, got {spec_rounds!r}")
    self.spec_rounds = int(spec_rounds)
    self._spec_decoder = None
    if warmup:
      self.warmup(None if warmup is True else warmup)

  # ----- public API -----------------------------------------------------------------------
  @property
  def has_lora(self) -> bool:
    return bool(self.adapters.loaded())

  # ----- adapters (engine/adapters.py; docs/adapters.md) -------------------------------------
  def lora_adapters(self) -> list[dict]:
    """The loaded adapters as llama.cpp's GET /lora-adapters lists them: id, path, scale."""
    return self.adapters.info()

  def set_lora_scales(self, items):
    """Default scales, as llama.cpp's POST /lora-adapters: `[{"id", "scale"}, ...]`, every
    adapter not listed at 0. Submitted requests keep theirs."""
    self.adapters.set_scales(items)
    self.adapter_id = self.adapters.default_choice().identity

  def load_adapter(self, lora, scale: float = 1.0) -> int:
    """Load one more numbered adapter (a LoraSet, or an adapter GGUF path); returns its id.
    May run between steps while requests are in flight. Without a new program while its rank
    fits the table's free columns (docs/adapters.md)."""
    path = None
    if not isinstance(lora, LoraSet):
      from strata_jax.api import load_lora  # noqa: PLC0415
      path = str(lora)
      lora = load_lora(self.model, [path])
    aid = self.adapters.add(lora, scale, path)
    self._sync_adapters()
    self.adapter_id = self.adapters.default_choice().identity
    return aid

  def unload_adapter(self, adapter_id: int) -> bool:
    """Refuse `adapter_id` to new requests from now on. Requests holding it finish with it;
    its rank columns, and every cached block and conversation computed under it, are dropped
    when the last one ends. Returns whether it was freed at once."""
    freed = self._purge(self.adapters.unload(adapter_id))
    self.adapter_id = self.adapters.default_choice().identity
    return adapter_id in freed

  def _purge(self, entries) -> list[int]:
    """Drop the cached blocks and slot conversations of freed adapters; re-place the table."""
    ids = {e.id for e in entries}
    self._flush_snapshots()   # store what waits now, so the discard below sees a freed chain
    for e in entries:
      self.prefix_cache.discard(self.adapters.blocks.pop(e.id, ()))
    for slot in range(self.n_slots):
      if ids & {i for i, _ in self.slot_choice[slot].pairs}:
        self.slot_tokens[slot], self.slot_key[slot] = [], (0, 0, 0)
        self.slot_choice[slot] = OFF
    if entries:
      self._sync_adapters()
    return sorted(ids)

  def _sync_adapters(self):
    """Place the adapter arrays on the stages' devices when they changed (A/B: after a load or
    a free; the table: after a slot took a request under other adapters)."""
    from strata_jax.parallel.split import slice_lora  # noqa: PLC0415
    pv, tv = self.adapters.params_version, self.adapters.table_version
    if (pv, tv) == self._placed_versions:
      return
    put = lambda x, st: jax.device_put(x, st.device) if st.device is not None else x
    if pv != self._placed_versions[0]:
      full = self.adapters.params()
      for st in self.stages:
        st.lora = put(slice_lora(self.cfg, full, *st.layers), st)
    else:
      table = self.adapters.table()
      for st in self.stages:
        st.lora = st.lora.replace(table=put(table, st))
    self._placed_versions = (pv, tv)

  def set_control_vector(self, control_vector):
    """Apply another control vector (or None) from now on. The vector is data: a vector of
    the same model runs the same compiled program. Slots and cached blocks computed under
    the previous one stay keyed by its id, so they are never served under this one."""
    if self.busy:
      raise RequestError("set_control_vector: requests are in flight; wait until they finish")
    self._check_control_vector(control_vector)
    vec = control_vector.vectors if control_vector is not None else None
    for st in self.stages:
      st.cvec = slice_cvec(vec, *st.layers, st.device)
    self.control_vector = control_vector
    self.control_vector_id = control_vector.control_vector_id if control_vector else 0

  def _check_control_vector(self, cv):
    if cv is None:
      return
    want = (self.model.cfg.n_layers, self.model.cfg.d_model)
    shape = tuple(getattr(getattr(cv, "vectors", None), "shape", ()))
    if shape != want:
      files = ", ".join(f.path for f in getattr(cv, "files", ())) or "?"
      raise ControlVectorError(
          f"control vector ({files}) is for {shape[0] if shape else '?'} layers of n_embd "
          f"{shape[1] if len(shape) > 1 else '?'}; this model has {want[0]} layers of n_embd "
          f"{want[1]}")

  def generate(self, prompt: str | None = None, tokens: Sequence[int] | None = None, **kw):
    """Generate for one prompt (text or token ids). Keyword arguments as in `Request`."""
    if (prompt is None) == (tokens is None):
      raise RequestError("generate() needs exactly one of prompt= or tokens=")
    ids = self.model.encode(prompt) if prompt is not None else list(tokens)
    return self.run([Request(tokens=ids, **kw)])[0]

  def run(self, requests: Sequence[Request]) -> list[Result]:
    """Serve requests through the slots with continuous batching; results in request order."""
    handles = [self.submit(r) for r in requests]
    while self.busy:
      self.step()
    return [h.result for h in handles]

  def submit(self, req: Request) -> "Handle":
    """Queue a request (validated now); `step()` drives it. Returns a handle whose `result`
    is set when it finishes."""
    self._check(req)
    choice = self.adapters.resolve(req.lora)
    self.adapters.hold(choice)
    h = Handle(dataclasses.replace(req, lora=choice))
    self._pending.append(h)
    return h

  @property
  def busy(self) -> bool:
    return bool(self._pending or self._running or self._inflight is not None)

  def step(self):
    """One scheduling round: free slots take queued requests (prefill and first token), the
    next decode chunk is dispatched, then the previous chunk's tokens are read (the device
    runs the new chunk meanwhile). A finished slot takes the next request next round."""
    admitted = []   # (slot, handle, run) prefilled, first token not read yet
    try:
      while self._pending and len(self._running) + len(admitted) < self.n_slots:
        h = self._pending.popleft()
        if h.cancelled:
          self._release(h.req)
          continue
        slot = self._pick_slot(h.req, exclude=set(self._running) | {a[0] for a in admitted})
        run = self._start(slot, h.req)
        run.t0 = h.t_submit   # time to first token counts the wait for a slot too
        admitted.append((slot, h, run))
        # first tokens already computed go out now, the rest after the loop: the host queues
        # the next prompt's prefill while the device runs this one (no read in between)
        admitted = self._take_first_tokens(admitted, wait=False)
    finally:
      self._take_first_tokens(admitted, wait=True)
    cancel = [s for s, (h, run) in self._running.items() if h.cancelled and run.cancel_at is None]
    if cancel:
      for s in cancel:
        run = self._running[s][1]
        run.cancel_at = len(run.tokens)
      mask = self._put(np.isin(np.arange(self.n_slots), cancel).astype(np.int32))
      self.rows = self._on_last(steps.deactivate_rows, self.rows, mask)
    chunk = self._dispatch()
    if self._inflight is not None:
      self._collect(self._inflight)
    self._inflight = chunk
    # prefix-cache snapshots go to the copier thread a slice a round, behind the decode chunk
    # just queued, and are stored once on the host: they never hold up a token or a dispatch
    self._store_copied()
    self._start_snapshot_copies()
    spec_rows = {s: hr for s, hr in self._running.items()
                 if hr[1].spec and hr[1].cancel_at is None}
    if spec_rows:
      self._spec_step(spec_rows)
    for slot in list(self._running):
      h, run = self._running[slot]
      if run.cancel_at is not None and run.inflight == 0:
        h.result = self._finish(slot, run, reason="cancelled")
        del self._running[slot]
        self._row_dev = None
    if not self.busy:
      self._flush_snapshots()

  def _take_first_tokens(self, admitted: list, wait: bool) -> list:
    """Read the first token of each admitted request whose sampler has run (all of them with
    `wait`), hand it on, and start the request's decoding (or finish it); returns the rest."""
    rest = []
    for slot, h, run in admitted:
      out1, plan, last = run.first
      if not (wait or self._shared or out1[0].is_ready()):
        rest.append((slot, h, run))
        continue
      run.first = None
      self._emit_chunk(slot, run, self._read(out1, plan), 1,
                       self._host(last) if last is not None else None)
      if self._finished(slot, run):
        h.result = self._finish(slot, run)
      else:
        self._running[slot] = (h, run)
        self._row_dev = None
    return rest

  def warmup(self, prompt_lengths: Sequence[int] | None = None,
             plans: Sequence[smp.Plan] = (smp.Plan(),)):
    """Compile (and run once, on no rows) the prefill buckets that prompts of these lengths
    use (None: every bucket), the first-token choice and the decode programs of `plans`."""
    if self.busy:
      raise RequestError("warmup() needs an idle engine")
    # (bucket, whether a chunk of it hands back a state from inside, or its windows)
    buckets, lengths = set(), set()   # lengths: the K/V slices the snapshots read
    if prompt_lengths is None:
      for b in sorted({self._bucket(n) for n in range(1, self.max_chunk + 1)}):
        buckets.update({(b, False), (b, True)} if b > self.block_size and self.merge_tail
                       else {(b, False)})
        lengths.add(b)
    else:
      for n in prompt_lengths:
        for pos, m, bk, cut in self._schedule(0, int(n), int(n) // self.block_size, True):
          # a chunk with several points (`bucket_step`): its windows make its program, and it
          # reads one K/V slice per stretch between them
          buckets.add((bk, tuple(w for _, w in cut) if isinstance(cut, tuple)
                       else cut is not None))
          lengths.update(length for *_, length in self._stretches(pos, m, bk, cut, None))
    for b, with_cut in sorted(buckets, key=lambda bc: (bc[0], str(bc[1]))):
      # n_new 0: every layer leaves the row as it is (and the offsets are traced)
      cut = (tuple((0, w) for w in with_cut) if isinstance(with_cut, tuple)
             else b - self.block_size if with_cut else None)
      self._prefill_chunk(0, np.zeros(b, np.int32), 0, 0, all_logits=False, cut=cut)
    if self.prefix_cache.max_bytes > 0:   # the K/V slices for the prefix cache
      for length in sorted(lengths):
        for st, state in zip(self.stages, self.states):
          distributed.call_on_stage(steps.read_kv, st.device, state, np.int32(0),
                                    np.int32(0), length=min(length, self.max_seq))
    for plan in plans:
      one = self._put(host_sampling.empty_rows(1))
      self._on_last(steps.sample_step, self._put(jnp.zeros((1, self.model.cfg.vocab_size))),
                    one, self._put(self.row_params.params([0])),
                    self._put(self.row_params.stops([0])), plan=plan)
      if len(self.stages) == 1:
        for n in self.decode_steps:   # no row is active: nothing changes
          for rows in [None] + [tuple(range(r)) for r in self.row_buckets]:
            self._decode_chunk(rows, n, plan, with_logits=False)
    jax.block_until_ready(self.states)

  # ----- requests -------------------------------------------------------------------------
  def _check(self, r: Request):
    if not r.tokens:
      raise RequestError("the prompt is empty: at least one token is needed")
    v = self.model.cfg.vocab_size
    bad = [t for t in r.tokens if not 0 <= int(t) < v]
    if bad:
      raise RequestError(f"prompt token {bad[0]} is outside the vocabulary [0, {v})")
    if len(r.tokens) >= self.max_seq:
      raise RequestError(f"the prompt has {len(r.tokens)} tokens; this engine holds at most "
                         f"{self.max_seq - 1} prompt tokens per slot (max_seq={self.max_seq})")
    if isinstance(r.max_tokens, bool) or not isinstance(r.max_tokens, (int, np.integer)):
      raise RequestError(f"max_tokens must be an integer, got {r.max_tokens!r}")
    if r.max_tokens < 1:
      raise RequestError(f"max_tokens must be >= 1, got {r.max_tokens}")
    host_sampling.check(r)
    if r.spec is not None:
      speculative.check_spec(r.spec, None, True, where="speculative n")
    if self._spec_n(r) and self._shared:
      raise RequestError("speculative decoding runs in one process: this engine's stages are "
                         "on the devices of several processes (jax.distributed)")
    bad = [t for t in r.stop if not 0 <= int(t) < v]
    if bad:
      raise RequestError(f"stop token {bad[0]} is outside the vocabulary [0, {v})")

  def _spec_n(self, r: Request) -> int:
    return self.spec if r.spec is None else int(r.spec)

  def _release(self, req: Request):
    self._purge(self.adapters.release(req.lora))

  def _cache_key(self, choice: AdapterChoice) -> tuple[int, int, int]:
    return (int(choice.on), choice.identity, self.control_vector_id)

  def _switch(self, slot: int, choice: AdapterChoice) -> int:
    """The slot's switch for the steps: its table row (slot + 1) set to the request's adapter
    scales, or 0 (off) for none."""
    if not choice.on:
      return 0
    self.adapters.set_row(slot + 1, choice)
    self._sync_adapters()
    return slot + 1

  def _conv_match(self, slot: int, req: Request) -> int:
    """Tokens of the slot's conversation the request can reuse (0 if none)."""
    have = self.slot_tokens[slot]
    if (req.return_logits or self.slot_key[slot] != self._cache_key(req.lora)
        or not have or len(have) >= len(req.tokens) or req.tokens[:len(have)] != have):
      return 0
    return len(have)

  def _pick_slot(self, req: Request, exclude) -> int:
    free = [s for s in self._lru if s not in exclude]
    best = max(free, key=lambda s: self._conv_match(s, req))
    return best if self._conv_match(best, req) > 0 else free[0]

  # ----- device placement -----------------------------------------------------------------
  def _put(self, tree):
    """Host arrays to the sampler's device."""
    if self._sdev is not None:
      return jax.device_put(tree, self._sdev)
    return jax.tree.map(jnp.asarray, tree)

  def _on_last(self, fn, *args, **kw):
    return distributed.call_on_stage(fn, self._sdev, *args, **kw)

  def _device_rows(self):
    """(SamplingParams, switch, stop ids) of every row on the device (cached)."""
    if self._row_dev is None:
      rp = self.row_params
      self._row_dev = self._put((rp.params(), rp.switch, rp.stops()))
    return self._row_dev

  # ----- prefill --------------------------------------------------------------------------
  def _schedule(self, start: int, total: int, n_hashes: int, aligned: bool):
    """Prefill chunks [(pos, n, bucket, cut)] for tokens [start, total): as long as max_chunk
    allows, ending where a block's recurrent state is kept (every `state_every` blocks and
    the prompt's last full block) so it can be snapshotted; padded to power-of-two buckets
    (multiples of the block size). With `merge_tail`, a last chunk shorter than a block joins
    the chunk before it when that chunk's bucket has room: the state at the last full block then comes from
    inside the chunk (`cut`, its offset there; else None; `steps.prefill_cut`), and the
    prompt makes one pass over the weights fewer (H200, bench-a3b: a chunk costs ~14 ms
    beyond its tokens, results/bench_model.json). The schedule depends on the prompt alone
    (not on the cache's size), so a prompt computes the same numbers with the cache on or
    off; a cache hit resumes at a block and runs the rest in chunks of its own, the same
    tokens to the rounding of other shapes."""
    bs = self.block_size
    cuts = set()
    if aligned:
      cuts = {(b + 1) * bs for b in range(n_hashes)
              if (b + 1) % self.state_every == 0 or b == n_hashes - 1}
    if self.bucket_step is not None:
      return self._schedule_one_pass(start, total, cuts)
    out, pos = [], start
    while pos < total:
      end = min(total, pos + self.max_chunk)
      end = min([c for c in cuts if pos < c <= end], default=end)
      n = end - pos
      bucket = self._bucket(n)
      out.append((pos, n, bucket, None))
      pos = end
    if self.merge_tail and len(out) > 1 and out[-1][1] < bs and out[-1][0] in cuts:
      (p, n, bucket, _), (_, tail, _, _) = out[-2:]
      if n + tail <= bucket:
        out[-2:] = [(p, n + tail, bucket, n)]
    return out

  def _pow2(self, n: int) -> int:
    """The least power of two >= n from the block size."""
    size = self.block_size
    while size < n:
      size *= 2
    return size

  def _bucket(self, n: int) -> int:
    """A chunk of n tokens' bucket: `_pow2(n)`; with `bucket_step`, the least multiple of it
    >= n above it."""
    bucket, step = self._pow2(n), self.bucket_step
    return bucket if step is None or bucket <= step else -(-n // step) * step

  def _schedule_one_pass(self, start: int, total: int, cuts: set) -> list:
    """`_schedule` under `bucket_step`: chunks as long as `max_chunk` allows, each handing
    back the states at the state points inside it (`cut`: ((offset, window), ...), or None,
    or an int offset when it is one point with a block's window: `prefill_cut`'s one-cut
    program, as `merge_tail` makes). Window i is the least power of two (>= a block) that
    reaches the next point (the last: the chunk's end); a point whose window would run past
    the chunk's bucket ends the chunk there instead."""
    bs, out, pos = self.block_size, [], start
    while pos < total:
      end = min(total, pos + self.max_chunk)
      inner = sorted(c for c in cuts if pos < c < end)
      while True:
        bucket, pairs = self._bucket(end - pos), []
        for i, c in enumerate(inner):
          w = self._pow2((inner[i + 1] if i + 1 < len(inner) else end) - c)
          if c - pos + w > bucket:
            break
          pairs.append((c - pos, w))
        if len(pairs) == len(inner):
          break
        end, inner = inner[len(pairs)], inner[:len(pairs)]   # end the chunk at that point
      cut = (None if not pairs else pairs[0][0] if len(pairs) == 1 and pairs[0][1] == bs
             else tuple(pairs))
      out.append((pos, end - pos, bucket, cut))
      pos = end
    return out

  def _start(self, slot: int, req: Request) -> _Running:
    self._lru.move_to_end(slot)
    choice = req.lora
    switch = self._switch(slot, choice)
    run = _Running(req=req, switch=switch, tokens=[], t0=time.perf_counter(),
                   logprobs=[] if req.logprobs is not None else None)
    toks = list(map(int, req.tokens))
    start = self._conv_match(slot, req)
    aligned = start == 0
    # the chain of the prompt's full blocks, under the adapter id its switch state uses
    hashes = (block_hashes(toks, self.block_size, choice.identity,
                           control_vector_id=self.control_vector_id) if aligned else [])
    self.adapters.note_blocks(choice, hashes, self.prefix_cache)
    if aligned:
      waiting = self._copying + self._snaps
      if waiting and not {w.hashes[b] for w in waiting for b in w.blocks}.isdisjoint(hashes):
        self._flush_snapshots()   # an earlier prompt shares blocks: store them first
      self._reset(slot)
      start = self._restore_prefix(slot, toks, hashes, switch) if not req.return_logits else 0
    run.cached = start
    logits_parts = []
    if not aligned and len(toks) - start == 1 and not req.return_logits:
      # One new token on a kept conversation (e.g. a resumed session): the decode step, so the
      # continuation computes exactly what an uninterrupted run would have.
      last = self._decode_rows({slot: (toks[-1], switch)})
      last = (self._host(last) if self._shared else last)[slot]
    else:
      for pos, n, bucket, cut in self._schedule(start, len(toks), len(hashes), aligned):
        chunk = np.zeros(bucket, np.int32)
        chunk[:n] = toks[pos:pos + n]
        out, at_cut = self._prefill_chunk(slot, chunk, n, switch,
                                          all_logits=req.return_logits, cut=cut)
        if req.return_logits:
          logits_parts.append(self._host(out)[:n])
        if aligned:
          self._snapshot_chunk(slot, hashes, pos, n, bucket, cut, at_cut)
      last = logits_parts[-1][n - 1] if req.return_logits else out
      if self._shared and not req.return_logits:
        last = self._host(last)      # every process samples from the same logits
    run.computed = len(toks) - start
    if req.return_logits:
      run.prompt_logits = np.concatenate(logits_parts, axis=0)
    self.slot_tokens[slot] = toks
    self.slot_key[slot] = self._cache_key(choice)
    self.slot_choice[slot] = choice
    # the first token: the device sampler on the prompt's last logits
    self.row_params.set(slot, req, switch)
    self._row_dev = None
    plan = host_sampling.plan_for([req])
    rows1 = self._put(host_sampling.first_rows(toks, min(req.max_tokens, self.max_seq - len(toks))))
    last = last[None] if last.ndim == 1 else last
    out1, rows1 = self._on_last(
        steps.sample_step, self._put(last), rows1, self._put(self.row_params.params([slot])),
        self._put(self.row_params.stops([slot])), plan=plan)
    self.rows = self._on_last(steps.put_rows, self.rows, rows1, np.int32(slot))
    run.remaining = min(req.max_tokens, self.max_seq - len(toks))
    want_logits = req.return_logits or req.return_step_logits
    if not self._shared:
      out1[0].copy_to_host_async()
    # read by `_take_first_tokens`, once the host has queued what else this round admits
    run.first = (out1, plan, last if want_logits else None)
    run.spec = self._spec_n(req)
    if run.spec:    # speculative rounds from now on, off the device sampler's rows
      run.rng = np.random.default_rng(req.seed)
      self._speculator(run.spec).restart(slot, len(toks))
      mask = self._put((np.arange(self.n_slots) == slot).astype(np.int32))
      self.rows = self._on_last(steps.deactivate_rows, self.rows, mask)
    return run

  def _snapshot_chunk(self, slot, hashes, pos, n, bucket, cut, at_cut):
    """Snapshot what a prefill chunk [pos, pos + n) completed: K/V for every block (one read);
    the (much larger) GDN state every `state_every` blocks and at the prompt's last full block
    (chunks end there, or hand it back from inside: `cut`). Several points inside a chunk
    (`bucket_step`): one snapshot per stretch between them, each with its point's state."""
    bs = self.block_size
    for lo, hi, end, state, length in self._stretches(pos, n, bucket, cut, at_cut):
      blks = [b for b in range(lo // bs, hi // bs) if b < len(hashes) and (b + 1) * bs > lo]
      if blks:
        last_blk = blks[-1]
        with_state = (last_blk + 1) * bs == end and (
            (last_blk + 1) % self.state_every == 0 or last_blk == len(hashes) - 1)
        self._snapshot(slot, hashes, blks, last_blk if with_state else None, length, state)

  def _stretches(self, pos, n, bucket, cut, at_cut):
    """A chunk's snapshot stretches [(lo, hi, where its state is, that state per stage or None
    for the row's after the chunk, K/V slice length)]: the whole chunk, or (several points
    inside) one per stretch up to each point, with its state, and the rest."""
    if cut is None or isinstance(cut, int):
      return [(pos, pos + n, pos + n if cut is None else pos + cut, at_cut, bucket)]
    bounds = [pos] + [pos + off for off, _ in cut]
    pick = lambda i: None if at_cut is None else [(c[:, i], m[:, i]) for c, m in at_cut]
    return [(lo, hi, hi, pick(i), self._bucket(hi - lo))
            for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))] + [
        (bounds[-1], pos + n, pos + n, None, self._bucket(pos + n - bounds[-1]))]

  def _prefill_chunk(self, slot, chunk, n, switch, all_logits, cut=None):
    """One prefill chunk through every stage: (logits, None), or with `cut` (logits, the GDN
    state after the chunk's first `cut` tokens per stage, as `read_recurrent` reads it)."""
    x, at_cut = chunk, []   # numpy: jit takes it in the call (no separate eager transfer op)
    for i, st in enumerate(self.stages):
      if st.device is not None:
        x = jax.device_put(x, st.device)
      args = (st.cfg, st.params, st.lora, self.states[i], np.int32(slot), x, np.int32(n),
              np.int32(switch))
      if cut is None:
        x, self.states[i] = distributed.call_on_stage(
            steps.prefill, st.device, *args, all_logits=all_logits, cvec=st.cvec)
      else:   # one point with a block's window, or several: ((offset, window), ...)
        offsets, windows = ((np.int32(cut), self.block_size) if isinstance(cut, int) else
                            (np.array([o for o, _ in cut], np.int32), tuple(w for _, w in cut)))
        x, self.states[i], gdn = distributed.call_on_stage(
            steps.prefill_cut, st.device, *args, offsets, cut_window=windows,
            all_logits=all_logits, cvec=st.cvec)
        at_cut.append(gdn)
    return x, (at_cut if cut is not None else None)

  def _reset(self, slot: int):
    rows = (np.arange(self.n_slots) == slot).astype(np.int32)
    for i, st in enumerate(self.stages):
      r = jax.device_put(rows, st.device) if st.device is not None else rows
      self.states[i] = distributed.call_on_stage(steps.reset_rows, st.device, self.states[i], r)
    self.slot_tokens[slot] = []

  def _snapshot(self, slot: int, hashes: list[bytes], blks: list[int], state_blk, bucket: int,
                at_cut=None):
    """Read the K/V of blocks `blks` (consecutive) in one slice per stage, and the GDN state
    after block `state_blk` (None: none), on the device now; they reach the host cache later:
    up to SNAPSHOT_COPY_BYTES a round go to the copier thread behind that round's decode
    dispatch (`_start_snapshot_copies`), stored once there (`_store_copied`), and all at once
    when the engine goes idle or a new prompt shares its blocks (`_flush_snapshots`).
    H200, bench-a3b: a GDN state is 75 MB and reached the host at ~1-2 GB/s. Copied at the
    prompt's first token it queued ahead of that token's own copy (TTFT); copied all at once
    behind the decode it stalled the dispatch loop (batch 32: 2.4 GB, engine/program 0.37).
    The K/V slice is the chunk's bucket long (a length the prefill already compiles for), so
    a 2,500-token prompt reads 3 slices instead of 39 one-block reads. `at_cut`: the GDN state
    per stage the chunk handed back from inside (`steps.prefill_cut`), read instead of the
    row's state after the chunk."""
    if self.prefix_cache.max_bytes <= 0:
      return
    cache = self.prefix_cache
    have = lambda b: hashes[b] in cache and (b != state_blk or "ssm" in cache.peek(hashes[b])[0])
    blks = [b for b in blks if not have(b)]
    if not blks:
      return
    state_blk = state_blk if state_blk in blks else None
    bs = self.block_size
    length = min(bucket, self.max_seq)
    start = min(blks[0] * bs, self.max_seq - length)   # the slice must lie inside the cache
    payload = []
    for st, state in zip(self.stages, self.states):
      k, v = distributed.call_on_stage(steps.read_kv, st.device, state, np.int32(slot),
                                       np.int32(start), length=length)
      entry = {"k": k, "v": v}
      if state_blk is not None:
        conv, ssm = at_cut[len(payload)] if at_cut is not None else distributed.call_on_stage(
            steps.read_recurrent, st.device, state, np.int32(slot))
        entry.update(conv=conv, ssm=ssm)
      payload.append(entry)
    self._snaps.append(_Snap(hashes, blks, start, state_blk, payload))
    # Waiting snapshots past the cache's capacity: the oldest go, as the LRU would evict
    # them on insertion anyway (and they hold device memory until stored).
    held = [_snap_bytes(x) for x in self._copying + self._snaps]
    while self._snaps and sum(held) > self.prefix_cache.max_bytes:
      self._snaps.pop(0)
      held.pop(len(self._copying))

  def _start_snapshot_copies(self, limit: int | None = SNAPSHOT_COPY_BYTES):
    """Hand the oldest waiting snapshots, `limit` bytes at most (at least one snapshot; None:
    all), to the copier thread (`_copy_snapshot`: into pinned host memory where the device has
    it, then cut into blocks)."""
    if self._shared:   # each host read is a broadcast, in the same order on every process
      return
    if self._snapshot_thread and self._copier is None:
      self._copier = concurrent.futures.ThreadPoolExecutor(
          max_workers=1, thread_name_prefix="strata-prefix-copy")
    n = 0
    while self._snaps and (n == 0 or limit is None or n < limit):
      item = self._snaps.pop(0)
      if self._snapshot_thread:
        item.host = self._copier.submit(_copy_snapshot, item, self.block_size)
      else:   # started here, read by `_store_copied` a round later
        item.payload = [{k: distributed.start_host_copy(a) for k, a in e.items()}
                        for e in item.payload]
      self._copying.append(item)
      n += _snap_bytes(item)

  def _store_copied(self, wait: bool = False):
    """Store the snapshots whose blocks have reached the host, oldest first (the cache's LRU
    order), stopping at the first still copying unless `wait`. A snapshot with no copier job
    (no snapshot thread, or an engine over several processes) is read here."""
    while self._copying:
      item = self._copying[0]
      if item.host is not None and not (wait or item.host.done()):
        return
      self._copying.pop(0)
      try:
        blocks = item.host.result() if item.host is not None else _cut_blocks(
            item, [{k: self._host(a) for k, a in e.items()} for e in item.payload],
            self.block_size)
      except jax.errors.JaxRuntimeError as e:   # e.g. pinned host memory ran out
        # the cache is only a cache: these blocks are computed again when next asked for
        log.warning("prefix cache: a snapshot's copy to the host failed (%s); its %d blocks "
                    "are not cached", e, len(item.blocks))
        continue
      h, cache = item.hashes, self.prefix_cache
      for blk, payload in blocks:
        if h[blk] not in cache:
          cache.insert(h[blk], payload, h[blk - 1] if blk else None)
        elif blk == item.state_blk and "ssm" not in cache.peek(h[blk])[0]:
          cache.replace(h[blk], payload)   # the block, now with its state

  def _flush_snapshots(self):
    """Store every waiting snapshot now (their copies all started first, so they overlap)."""
    self._start_snapshot_copies(limit=None)
    self._copying, self._snaps = self._copying + self._snaps, []
    self._store_copied(wait=True)

  def _restore_prefix(self, slot: int, toks: list[int], hashes: list[bytes], switch: int) -> int:
    """Load the longest cached block prefix (leaving >= 1 token to compute); returns its length."""
    if self.prefix_cache.max_bytes <= 0:
      return 0
    usable = (len(toks) - 1) // self.block_size
    if usable == 0:
      return 0
    entries = self.prefix_cache.match(hashes[:usable])
    # resume at the deepest matched block that carries the recurrent state
    while entries and "ssm" not in entries[-1][0]:
      entries.pop()
    if not entries:
      return 0
    n = len(entries) * self.block_size
    for i, st in enumerate(self.stages):
      state = self.states[i]
      write_kv = functools.partial(distributed.call_on_stage, steps.write_kv, st.device)
      write_recurrent = functools.partial(distributed.call_on_stage, steps.write_recurrent,
                                          st.device)
      for b, entry in enumerate(entries):
        e = entry[i]
        state = write_kv(state, np.int32(slot), np.int32(b * self.block_size), e["k"], e["v"])
      last = entries[-1][i]   # host arrays go in the jitted call itself, to the stage's device
      state = write_recurrent(state, np.int32(slot), last["conv"], last["ssm"], np.int32(n),
                              np.int32(switch))
      self.states[i] = state
    return n

  # ----- decode ---------------------------------------------------------------------------
  def _decode_rows(self, rows: dict[int, tuple[int, int]]):
    """One decode step for {slot: (token, switch)}; the other rows stay as they are.
    Returns the logits [B, V] on the device."""
    B = self.n_slots
    toks, sw, act = np.zeros(B, np.int32), np.zeros(B, np.int32), np.zeros(B, np.int32)
    for slot, (tok, switch) in rows.items():
      toks[slot], sw[slot], act[slot] = tok, switch, 1
    return self._decode_logits(jnp.asarray(toks), jnp.asarray(sw), jnp.asarray(act))

  def _decode_logits(self, x, sw_d, act_d):
    for i, st in enumerate(self.stages):
      if st.device is not None:
        x, sw_d, act_d = jax.device_put((x, sw_d, act_d), st.device)
      x, self.states[i] = distributed.call_on_stage(
          steps.decode, st.device, st.cfg, st.params, st.lora, self.states[i], x, sw_d, act_d,
          cvec=st.cvec)
    return x

  def _dispatch(self) -> _Chunk | None:
    """Queue the next decode chunk for the rows that may still be active."""
    live = {s: run for s, (_, run) in self._running.items()
            if run.cancel_at is None and run.remaining - run.inflight > 0 and not run.spec}
    if not live:
      return None
    left = [run.remaining - run.inflight for run in live.values()]
    # with requests waiting for a slot, stop where the first row runs out of length
    limit = min(left) if self._pending else max(left)
    reqs = [run.req for _, run in self._running.values()]
    with_logits = any(r.return_logits or r.return_step_logits for r in reqs)
    n = 1 if with_logits or len(self.stages) > 1 else chunk_steps(limit, self.decode_steps)
    plan = host_sampling.plan_for(reqs)
    sp, switch, stop = self._device_rows()
    cols = None
    bucket = next((r for r in self.row_buckets if r >= len(live)), None)
    if len(self.stages) == 1:
      rows = None
      if bucket is not None:
        # the live rows first, then idle slots (inactive: left as they are) to fill the bucket
        idle = [s for s in range(self.n_slots) if s not in live]
        rows = tuple(sorted(live) + idle[:bucket - len(live)])
        cols = {s: i for i, s in enumerate(rows)}
      out = self._decode_chunk(rows, n, plan, with_logits)
    else:   # a layer split: stage by stage, then the sampler on the last stage's device
      if self._shared:   # host values: a committed local array would start a transfer
        logits = self._decode_logits(*(jnp.asarray(np.asarray(a)) for a in (
            self.rows.last, switch, self.rows.active)))
        logits = self._put(self._host(logits))
      else:
        logits = self._decode_logits(self.rows.last, switch, self.rows.active)
      out, self.rows = self._on_last(steps.sample_step, logits, self.rows, sp, stop, plan=plan)
      out = out + ((logits[None] if with_logits else None),)
    for run in live.values():
      run.inflight += n
    return _Chunk(out=out, n=n, runs=sorted(live.items()), plan=plan, cols=cols)

  def _decode_chunk(self, rows: tuple[int, ...] | None, n: int, plan: smp.Plan,
                    with_logits: bool):
    """n decode steps on the single stage: every slot (rows None), or only `rows` (a bucket,
    `steps.decode_sample_rows`). Warmup and dispatch both come here, so they pass the same
    keywords (jit keys on which are passed). Returns the program's outputs."""
    st = self.stages[0]
    sp, switch, stop = self._device_rows()
    fn, extra = (steps.decode_sample, ()) if rows is None else (
        steps.decode_sample_rows, (self._bucket_idx(rows),))
    out, self.rows, self.states[0] = distributed.call_on_stage(
        fn, st.device, st.cfg, st.params, st.lora, self.states[0], self.rows, sp, switch, stop,
        *extra, n_steps=n, plan=plan, with_logits=with_logits, cvec=st.cvec)
    return out

  def _bucket_idx(self, idx: tuple[int, ...]):
    """The device array of a bucket's row list (kept: the same rows recur chunk after chunk)."""
    if idx not in self._idx_dev:
      if len(self._idx_dev) > 64:
        self._idx_dev.clear()
      self._idx_dev[idx] = self._put(np.asarray(idx, np.int32))
    return self._idx_dev[idx]

  def _collect(self, chunk: _Chunk):
    """Read a dispatched chunk's tokens (this waits for it) and hand them on."""
    out = self._read(chunk.out, chunk.plan)
    logits = self._shost(chunk.out[4]) if chunk.out[4] is not None else None
    for slot, run in chunk.runs:
      if self._running.get(slot, (None, None))[1] is not run:
        continue   # finished before this chunk (inactive in it); the slot may be new
      h = self._running[slot][0]
      run.inflight -= chunk.n
      col = slot if chunk.cols is None else chunk.cols[slot]
      self._emit_chunk(slot, run, out, chunk.n, logits[:, col] if logits is not None else None,
                       column=col)
      if run.cancel_at is None and self._finished(slot, run):
        h.result = self._finish(slot, run)
        del self._running[slot]
        self._row_dev = None

  def _read(self, out, plan: smp.Plan):
    """Host copies of what a plan returns: (emitted [n, B], logprob, top ids, top lp)."""
    h = self._shost
    return (h(out[0]), h(out[1]) if plan.logprobs else None, h(out[2]) if plan.n_top else None,
            h(out[3]) if plan.n_top else None)

  def _emit_chunk(self, slot, run, out, n, logits, column=0):
    """Append a row's tokens from host decode outputs (`_read`)."""
    emitted = out[0][:, column]
    r = run.req
    if r.logprobs is not None:
      lp = out[1][:, column]
      if r.logprobs:
        ti, tl = out[2][:, column], out[3][:, column]
    for i in range(n):
      t = int(emitted[i])
      if t < 0:
        break
      if run.tokens:
        self.slot_tokens[slot].append(run.tokens[-1])
      run.tokens.append(t)
      run.remaining -= 1
      if run.cancel_at is not None:
        continue   # read after a cancel: fed to the state, not delivered
      wanted = r.return_logits or r.return_step_logits
      _record_step(run, t, (logits[i] if logits.ndim == 2 else logits) if wanted else None,
                   None if r.logprobs is None else
                   (lp[i], ti[i] if r.logprobs else (), tl[i] if r.logprobs else ()))
      if len(run.tokens) == 1:
        run.t_first = time.perf_counter()
      if r.on_token is not None:
        r.on_token(t)

  # ----- speculative decoding (strata_jax/speculative.py; docs/mtp.md) ---------------------
  def _speculator(self, n: int) -> speculative.SpecDecoder:
    """The engine's SpecDecoder, made on first use; its n grows to the largest asked."""
    if self._spec_decoder is None:
      self._spec_decoder = speculative.SpecDecoder(self.stages, n, self.draft, self.n_slots,
                                                   self.max_seq, self.model.dtype,
                                                   rounds=self.spec_rounds)
    sd = self._spec_decoder
    sd.n = max(sd.n, n)
    return sd

  def _spec_step(self, running: dict):
    """One speculative round for the rows that decode speculatively (their device-sampler
    rows are inactive, so the plain decode chunks leave them alone). Rows accept different
    lengths; each row's tokens stop at its stop ids and length."""
    sd = self._speculator(max(run.spec for _, run in running.values()))
    rows = {}
    for slot, (_, run) in running.items():
      r = run.req
      cap = min(r.max_tokens - len(run.tokens), self.max_seq - 1 - len(self.slot_tokens[slot]))
      rows[slot] = speculative.Row(
          last=run.tokens[-1], switch=run.switch, context=list(r.tokens) + run.tokens,
          cap=max(cap, 1), stop=tuple(r.stop), temperature=r.temperature, top_k=r.top_k,
          top_p=r.top_p, min_p=r.min_p, rng=run.rng, step=len(run.tokens), n=run.spec,
          want_logits=r.return_logits or r.return_step_logits or r.logprobs is not None,
          presence=r.presence_penalty, frequency=r.frequency_penalty, repeat=r.repeat_penalty)
    self.states, out = sd.round(self.states, rows, self.row_params.params())
    for slot, o in out.items():
      h, run = running[slot]
      self.slot_tokens[slot].extend(o.consumed)
      run.proposed += o.proposed
      run.accepted += o.accepted
      r = run.req
      # the logprobs of the round's tokens by the sampler's own math, as a plain step's
      lps = None if r.logprobs is None else jax.device_get(steps.token_logprobs(
          o.logits, jnp.asarray(o.emitted, jnp.int32),
          n_top=smp.MAX_LOGPROBS if r.logprobs else 0))
      wanted = r.return_logits or r.return_step_logits
      for i, tok in enumerate(o.emitted):
        run.tokens.append(tok)
        run.remaining -= 1
        if o.logits is not None:
          _record_step(run, tok, o.logits[i] if wanted else None,
                       None if lps is None else (lps[0][i], lps[1][i], lps[2][i]))
        if r.on_token is not None:
          r.on_token(tok)
      if self._finished(slot, run):
        h.result = self._finish(slot, run)
        del self._running[slot]
        self._row_dev = None

  def _finished(self, slot: int, run: _Running) -> bool:
    r = run.req
    return (run.tokens[-1] in r.stop or len(run.tokens) >= r.max_tokens
            or len(self.slot_tokens[slot]) + 1 >= self.max_seq)

  def _finish(self, slot: int, run: _Running, reason: str | None = None) -> Result:
    r = run.req
    self._release(r)
    now = time.perf_counter()
    toks = run.tokens if run.cancel_at is None else run.tokens[:run.cancel_at]
    n_dec = len(toks) - 1
    stopped = reason is None and toks[-1] in r.stop
    return Result(
        prompt_tokens=[int(t) for t in r.tokens], tokens=list(toks), lora=bool(run.switch),
        finish_reason=reason or ("stop" if stopped else "length"),
        cached_tokens=run.cached, prompt_tokens_computed=run.computed,
        ttft_s=run.t_first - run.t0,
        decode_tokens_per_s=n_dec / (now - run.t_first) if n_dec > 0 and now > run.t_first else 0.0,
        slot=slot, text=self.model.decode(toks[:-1] if stopped else toks),
        prompt_logits=run.prompt_logits,
        step_logits=(np.stack(run.step_logits) if (r.return_logits or r.return_step_logits)
                     and run.step_logits else None),
        logprobs=run.logprobs, adapters=r.lora.as_json(),
        draft={"proposed": run.proposed, "accepted": run.accepted} if run.spec else None)

  # ----- sessions -------------------------------------------------------------------------
  def _session_fingerprint(self, choice: AdapterChoice | None = None) -> str:
    """Session identity (api.model_fingerprint's format): the model's; `+lora:<id>` with the
    slot's adapter identity when its switch was on (None: the default `lora: true` identity,
    nothing when no adapter is loaded), and unless that is one adapter at scale 1,
    `+mix:<content id>*<scale>;...` (so another engine with those adapters can verify it);
    then `+cvec:<id>`."""
    fp = self.model.fingerprint
    if choice is None:
      choice = self.adapters.default_choice() if self.has_lora else OFF
      lora_id = self.adapter_id if self.has_lora else 0
    else:
      lora_id = choice.identity
    if lora_id:
      fp += f"+lora:{lora_id:016x}"
      pairs = [(self.adapters.entries[i].content_id, sc) for i, sc in choice.pairs
               if i in self.adapters.entries]
      if pairs and not (len(pairs) == 1 and pairs[0] == (lora_id, 1.0)):
        fp += "+mix:" + ";".join(f"{c:016x}*{sc!r}" for c, sc in sorted(pairs))
    if self.control_vector is not None:
      fp += f"+cvec:{self.control_vector.control_vector_id:016x}"
    return fp

  def _session_choice(self, path) -> AdapterChoice | None:
    """The adapters a session file was saved under, when this engine has them loaded (the
    `+mix:` tail names their contents and scales, checked against the `+lora:` id); OFF for a
    session without adapters. None when this engine cannot run it (the fingerprint check then
    refuses the file)."""
    try:
      saved = sess.read_session_meta(str(path)).fingerprint
    except SessionError:
      return None
    head = saved.partition("+cvec:")[0]
    base, sep, rest = head.partition("+lora:")
    if base != self.model.fingerprint:
      return None
    if not sep:   # saved without adapters: as before, only an engine without them takes it
      return None if self.has_lora else OFF
    hexid, _, mix = rest.partition("+mix:")
    try:
      lora_id = int(hexid, 16)
      pairs = ([(int(c, 16), float(sc)) for c, _, sc in
                (item.partition("*") for item in mix.split(";"))] if mix else [(lora_id, 1.0)])
    except ValueError:
      return None
    by_content = {}
    for e in self.adapters.loaded():
      by_content.setdefault(e.content_id, e.id)
    if choice_identity(pairs) != lora_id or any(c not in by_content for c, _ in pairs):
      return None
    return self.adapters.resolve([{"id": by_content[c], "scale": sc} for c, sc in pairs])

  def _read_limits(self, supported_versions=frozenset({1, 2}),
                   choice: AdapterChoice | None = None) -> sess.SessionReadLimits:
    return sess.SessionReadLimits(
        max_tokens=self.max_seq - 1, max_stages=len(self.stages),
        stage_layers=tuple(st.layers for st in self.stages),
        stage_shapes=tuple(sess.stage_shapes_for(st.cfg, self.model.dtype) for st in self.stages),
        fingerprint=self._session_fingerprint(choice),
        supported_versions=frozenset(supported_versions))

  def save_session(self, slot: int, path) -> dict:
    """Save a slot's conversation (token ids and every layer's state) to `path` (atomic).
    Format v1 for one stage, v2 for a layer-split model. Returns size and timing."""
    self._check_slot(slot)
    self._check_single_process("save_session")
    toks = self.slot_tokens[slot]
    n = len(toks)
    stages = []
    for state in self.states:
      k, v = steps.read_kv(state, np.int32(slot), np.int32(0), length=self.max_seq)
      conv, ssm = steps.read_recurrent(state, np.int32(slot))
      stages.append({"k": np.asarray(k)[:, :n], "v": np.asarray(v)[:, :n],
                     "conv": np.asarray(conv), "ssm": np.asarray(ssm)})
    flags = sess.FLAG_LORA_ON if self.slot_key[slot][0] else 0
    choice = self.slot_choice[slot] if flags else None
    return sess.save_session(str(path), stages, np.asarray(toks, np.int32),
                             fingerprint=self._session_fingerprint(choice), flags=flags,
                             layer_ranges=[st.layers for st in self.stages])

  def load_session(self, slot: int, path, *, supported_versions=frozenset({1, 2})) -> dict:
    """Restore a session into `slot`; everything is checked against this engine's limits
    before any array is read. The slot then holds the conversation under the switch it was
    saved with. Returns {"n_tokens", "lora", "version"}."""
    self._check_slot(slot)
    self._check_single_process("load_session")
    saved = self._session_choice(path)
    self._check_session_control_vector(path, saved)
    meta, stages, tokens = sess.load_session(str(path),
                                             self._read_limits(supported_versions, saved))
    n = int(meta.n_tokens)
    self._reset(slot)
    switch = int(meta.lora_on)
    choice = saved if switch and saved is not None else OFF
    for i, (st, arrays) in enumerate(zip(self.stages, stages)):
      state = self.states[i]
      La = arrays["k"].shape[0]
      pad = lambda a: np.concatenate(
          [a, np.zeros((La, self.max_seq - n) + a.shape[2:], a.dtype)], axis=1)
      put = (lambda a: jax.device_put(a, st.device)) if st.device is not None else jnp.asarray
      state = steps.write_kv(state, np.int32(slot), np.int32(0), put(pad(arrays["k"])),
                             put(pad(arrays["v"])))
      self.states[i] = steps.write_recurrent(state, np.int32(slot), put(arrays["conv"]),
                                             put(arrays["ssm"]), np.int32(n), np.int32(switch))
    self.slot_tokens[slot] = [int(t) for t in tokens]
    self.slot_key[slot] = (switch, choice.identity if switch else 0, self.control_vector_id)
    self.slot_choice[slot] = choice
    self._lru.move_to_end(slot)
    return {"n_tokens": n, "lora": bool(switch), "version": meta.version}

  def _check_session_control_vector(self, path, choice=None):
    """A session made under another control vector (or none) is refused with that reason (the
    id is the `+cvec:<16 hex>` tail of the session's fingerprint)."""
    try:
      saved = sess.read_session_meta(str(path)).fingerprint
    except SessionError:
      return    # load_session reports it, with the limits
    live = self._session_fingerprint(choice)
    split = lambda fp: fp.rpartition("+cvec:") if "+cvec:" in fp else (fp, "", "")
    (s_base, _, s_id), (l_base, _, l_id) = split(saved), split(live)
    if s_base != l_base or s_id == l_id:
      return    # another model or adapter (load_session says so), or the same vector
    said = f"with control vector {s_id}" if s_id else "without a control vector"
    runs = f"control vector {l_id}" if l_id else "without a control vector"
    raise SessionError(f"{path}: session was saved {said}, this engine runs {runs}; load it "
                       "in an engine with the same control vector (same files, scales, range)")

  def erase_slot(self, slot: int):
    """Forget a slot's conversation (its state is cleared; nothing is cached from it)."""
    self._check_slot(slot)
    if slot in self._running:
      raise RequestError(f"slot {slot} is busy")
    self._reset(slot)
    self.slot_key[slot] = (0, 0, 0)
    self.slot_choice[slot] = OFF

  @staticmethod
  def erase_session(path) -> bool:
    return sess.erase_session(str(path))

  def slot_info(self, slot: int) -> dict:
    self._check_slot(slot)
    return {"id": slot, "n_tokens": len(self.slot_tokens[slot]),
            "lora": bool(self.slot_key[slot][0]),
            "busy": slot in self._running}

  def _check_single_process(self, what: str):
    if self._shared:
      raise ValueError(f"{what}: sessions of a model split across processes (jax.distributed) "
                       f"are not supported; save from a single-process engine")

  def _check_slot(self, slot: int):
    if not (isinstance(slot, (int, np.integer)) and 0 <= slot < self.n_slots):
      raise RequestError(f"slot {slot!r} does not exist (this engine has {self.n_slots} slots)")
