"""The engine: batch slots decoding together, sampling, a conversation cache per slot and a
prefix block cache shared by the slots. Host-side orchestration in numpy; every device call
goes through `strata_jax.steps`."""
from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax import session as sess
from strata_jax import speculative, steps
from strata_jax.api import model_fingerprint
from strata_jax.engine.prefix_cache import PrefixCache, block_hashes
from strata_jax.engine.sampling import sample
from strata_jax.errors import ControlVectorError, RequestError, SessionError, StrataError
from strata_jax.forms import Forms
from strata_jax.parallel import distributed
from strata_jax.parallel.plan import describe, plan_auto
from strata_jax.parallel.split import make_stages, slice_cvec
from strata_jax.params import LORA_RANK_BUCKET, empty_lora, lora_rank_bucket, pad_lora_rank
from strata_jax.state import init_state

log = logging.getLogger("strata_jax")


@dataclasses.dataclass
class Request:
  """One generation request. `lora`: None means on when an adapter is loaded."""
  tokens: list[int]
  max_tokens: int = 32
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  stop: Sequence[int] = ()
  lora: bool | None = None
  return_logits: bool = False
  on_token: Callable[[int], None] | None = None   # called with each token as it is sampled
  spec: int | None = None   # speculative drafts per step (0 off; None: the engine's `spec`)


@dataclasses.dataclass
class Result:
  prompt_tokens: list[int]
  tokens: list[int]
  lora: bool
  finish_reason: str            # "stop" | "length" | "cancelled"
  cached_tokens: int            # prompt tokens read from a cache
  prompt_tokens_computed: int
  ttft_s: float
  decode_tokens_per_s: float
  slot: int
  text: str | None = None
  prompt_logits: np.ndarray | None = None   # [T, V] (return_logits)
  step_logits: np.ndarray | None = None     # [n, V] the logits each token was chosen from
  draft: dict | None = None   # speculative decoding: {"proposed": p, "accepted": a}


class Handle:
  """A submitted request; `result` is None until it finishes."""

  def __init__(self, req: Request):
    self.req, self.result, self.cancelled = req, None, False

  def cancel(self):
    """Stop generating at the next step (finish_reason "cancelled")."""
    self.cancelled = True

  @property
  def done(self) -> bool:
    return self.result is not None


@dataclasses.dataclass
class _Running:
  req: Request
  switch: int
  tokens: list[int]
  rng: np.random.Generator
  t0: float
  t_first: float = 0.0
  cached: int = 0
  computed: int = 0
  step_logits: list = dataclasses.field(default_factory=list)
  prompt_logits: np.ndarray | None = None
  spec: int = 0            # drafts per round (0: plain decoding)
  proposed: int = 0
  accepted: int = 0


class Engine:
  """Batch slots over one model (optionally split into stages), an optional LoRA set and an
  optional control vector.

  Args:
    model: a `strata_jax.Model` (from `load_model`).
    lora: a `LoraSet` from `load_lora`, or None.
    control_vector: a `ControlVector` from `load_control_vector`, or None. It applies to every
      row (as llama.cpp's); `set_control_vector` swaps it without recompiling.
    slots: number of rows decoding together.
    max_seq: K/V capacity per slot (tokens).
    block_size: prefix-cache block and prefill chunk size (tokens).
    prefix_cache_bytes: host memory bound of the prefix block cache (0 disables it).
    state_every: keep the GDN state with every this-many blocks (and with each prompt's last
      full block); K/V are kept for every block. The recurrent state is fixed-size and, for
      large models, far bigger than a block's K/V (80B-A3B: 74 MiB vs 1.5 MiB per 64 tokens).
    spec: speculative decoding, drafts per step for requests that do not say (0: off).
    draft: the drafter, "mtp" (the model's MTP head; the default when it has one) or "ngram"
      (prompt lookup). `strata_jax.speculative`.
  """

  def __init__(self, model, lora=None, slots: int = 1, max_seq: int | None = None,
               block_size: int = 64, prefix_cache_bytes: int = 256 << 20, state_every: int = 8,
               forms: Forms | None = None, control_vector=None, spec: int = 0,
               draft: str | None = None):
    self.model, self.lora_set, self.n_slots = model, lora, int(slots)
    # Forms live in the config, the steps' static argument: an engine with other forms
    # compiles and runs its own programs beside this model's other engines.
    cfg = model.cfg if forms is None else dataclasses.replace(
        model.cfg, forms=forms.resolve(jax.default_backend(), model.dtype))
    self.cfg = cfg
    self.block_size = int(block_size)
    self.state_every = max(1, int(state_every))
    cap = max_seq or min(cfg.context_length, 4096)
    self.max_seq = -(-int(cap) // self.block_size) * self.block_size
    # Without an adapter the engine runs the very same program with an all-zero adapter and
    # every switch off: "off" is then bit-identical to "no adapter" by construction, on any
    # backend (GPU autotuning may otherwise pick different GEMM code for two programs).
    rank = lora_rank_bucket(lora.params.gdn_a.shape[1]) if lora is not None else LORA_RANK_BUCKET
    lora_params = (pad_lora_rank(lora.params, rank) if lora is not None
                   else empty_lora(cfg, rank, model.dtype))
    ranges = model.layer_ranges
    placed = getattr(model, "stage_params", None)   # loaded with a split: stages on devices
    if ranges == "auto":
      if placed is not None:
        raise StrataError("a model loaded with a layer split keeps the ranges it was loaded "
                          "with; reload it to change them")
      ranges = plan_auto(model, model.devices, lora, self.n_slots, self.max_seq)
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
    if lora is not None:
      lp = lora.params
      n_adapted = int(sum(np.count_nonzero(np.abs(np.asarray(a, np.float32)).sum(axis=(1, 2)))
                          for a in (lp.gdn_b, lp.attn_b)))
      per_dev = ", ".join(
          f"{sum(a.nbytes for a in jax.tree.leaves(st.lora)) / 2**20:.2f} MiB"
          for st in self.stages)
      log.info("LoRA: %d files, %d layers adapted, %s per device", len(lora.files), n_adapted,
               per_dev)
    self.states = []
    for st in self.stages:
      s = init_state(st.cfg, self.n_slots, self.max_seq, model.dtype)
      self.states.append(jax.device_put(s, st.device) if st.device is not None else s)
    self.adapter_id = lora.adapter_id if lora is not None else 0
    self.control_vector_id = control_vector.control_vector_id if control_vector else 0
    self.prefix_cache = PrefixCache(prefix_cache_bytes, self.block_size)
    # per slot: the tokens whose state the row holds, and the (switch, adapter id, control
    # vector id) it was under
    self.slot_tokens: list[list[int]] = [[] for _ in range(self.n_slots)]
    self.slot_key: list[tuple[int, int, int]] = [(0, 0, 0)] * self.n_slots
    self._lru = collections.OrderedDict((s, None) for s in range(self.n_slots))
    self._pending: collections.deque = collections.deque()
    self._running: dict = {}
    has_mtp = len(self.stages) == 1 and self.stages[0].params.mtp is not None
    self.spec = int(spec) if isinstance(spec, (int, np.integer)) else spec
    self.draft = speculative.check_spec(self.spec, draft, has_mtp)
    self._spec_decoder = None

  # ----- public API -----------------------------------------------------------------------
  @property
  def has_lora(self) -> bool:
    return self.lora_set is not None

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
    h = Handle(req)
    self._pending.append(h)
    return h

  @property
  def busy(self) -> bool:
    return bool(self._pending or self._running)

  def step(self):
    """One scheduling round: free slots take queued requests (prefill), then every running
    row decodes one token together. A finished slot takes the next request next round."""
    while self._pending and len(self._running) < self.n_slots:
      h = self._pending.popleft()
      if h.cancelled:
        continue
      slot = self._pick_slot(h.req, exclude=self._running.keys())
      run = self._start(slot, h.req)
      if self._finished(slot, run):
        h.result = self._finish(slot, run)
      else:
        self._running[slot] = (h, run)
    for slot in [s for s, (h, _) in self._running.items() if h.cancelled]:
      h, run = self._running.pop(slot)
      h.result = self._finish(slot, run, reason="cancelled")
    if self._running:
      self._decode_step(self._running)
      for slot in list(self._running):
        h, run = self._running[slot]
        if self._finished(slot, run):
          h.result = self._finish(slot, run)
          del self._running[slot]

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
    if r.max_tokens < 1:
      raise RequestError(f"max_tokens must be >= 1, got {r.max_tokens}")
    if r.lora and not self.has_lora:
      raise RequestError("the request asks for the LoRA adapter but none is loaded")
    if r.spec is not None:
      speculative.check_spec(r.spec, None, True, where="speculative n")
    if self._spec_n(r) and len(self.stages) > 1:
      raise RequestError("speculative decoding runs on a one-stage model (no layer split)")
    if self._spec_n(r) and r.return_logits:
      raise RequestError("speculative decoding does not return per-step logits; use spec 0")

  def _spec_n(self, r: Request) -> int:
    return self.spec if r.spec is None else int(r.spec)

  def _switch(self, r: Request) -> int:
    return int(self.has_lora if r.lora is None else bool(r.lora))

  def _cache_key(self, switch: int) -> tuple[int, int, int]:
    return (switch, self.adapter_id if switch else 0, self.control_vector_id)

  def _conv_match(self, slot: int, req: Request) -> int:
    """Tokens of the slot's conversation the request can reuse (0 if none)."""
    have = self.slot_tokens[slot]
    if (req.return_logits or self.slot_key[slot] != self._cache_key(self._switch(req))
        or not have or len(have) >= len(req.tokens) or req.tokens[:len(have)] != have):
      return 0
    return len(have)

  def _pick_slot(self, req: Request, exclude) -> int:
    free = [s for s in self._lru if s not in exclude]
    best = max(free, key=lambda s: self._conv_match(s, req))
    return best if self._conv_match(best, req) > 0 else free[0]

  # ----- prefill --------------------------------------------------------------------------
  def _start(self, slot: int, req: Request) -> _Running:
    self._lru.move_to_end(slot)
    switch = self._switch(req)
    run = _Running(req=req, switch=switch, tokens=[], rng=np.random.default_rng(req.seed),
                   t0=time.perf_counter())
    toks = list(map(int, req.tokens))
    start = self._conv_match(slot, req)
    aligned = start == 0
    # the chain of the prompt's full blocks, under the adapter id its switch state uses
    hashes = (block_hashes(toks, self.block_size, self._cache_key(switch)[1],
                           control_vector_id=self.control_vector_id) if aligned else [])
    if aligned:
      self._reset(slot)
      start = self._restore_prefix(slot, toks, hashes, switch) if not req.return_logits else 0
    run.cached = start
    logits_parts = []
    pos = start
    if not aligned and len(toks) - start == 1 and not req.return_logits:
      # One new token on a kept conversation (e.g. a resumed session): the decode step, so the
      # continuation computes exactly what an uninterrupted run would have.
      out, n, pos = self._decode_rows({slot: (toks[-1], switch)})[slot], 1, len(toks)
    while pos < len(toks):
      # Chunks end on block boundaries, so every full block can be snapshotted.
      n = min(self.block_size - pos % self.block_size, len(toks) - pos)
      chunk = np.zeros(self.block_size, np.int32)
      chunk[:n] = toks[pos:pos + n]
      out = self._prefill_chunk(slot, chunk, n, switch, all_logits=req.return_logits)
      logits_parts.append(self._host(out)[:n] if req.return_logits else None)
      pos += n
      blk = pos // self.block_size - 1
      if aligned and pos % self.block_size == 0 and blk < len(hashes):
        # K/V for every block; the (much larger) GDN state every `state_every` blocks and at
        # the prompt's last full block, where shared prefixes usually end.
        with_state = (blk + 1) % self.state_every == 0 or blk == len(hashes) - 1
        self._snapshot(slot, hashes, blk, with_state)
    run.computed = len(toks) - start
    last = self._host(out)[n - 1] if req.return_logits else self._host(out)
    if req.return_logits:
      run.prompt_logits = np.concatenate(logits_parts, axis=0)
    self.slot_tokens[slot] = toks
    self.slot_key[slot] = self._cache_key(switch)
    self._emit(run, last)
    run.spec = self._spec_n(req)
    if run.spec:
      self._speculator(run.spec).restart(slot, len(toks))
    return run

  def _prefill_chunk(self, slot, chunk, n, switch, all_logits):
    x = jnp.asarray(chunk)
    for i, st in enumerate(self.stages):
      if st.device is not None:
        x = jax.device_put(x, st.device)
      x, self.states[i] = distributed.call_on_stage(
          steps.prefill, st.device, st.cfg, st.params, st.lora, self.states[i],
          jnp.int32(slot), x, jnp.int32(n), jnp.int32(switch), all_logits=all_logits,
          cvec=st.cvec)
    return x

  def _reset(self, slot: int):
    rows = jnp.asarray(np.arange(self.n_slots) == slot, jnp.int32)
    for i, st in enumerate(self.stages):
      r = jax.device_put(rows, st.device) if st.device is not None else rows
      self.states[i] = distributed.call_on_stage(steps.reset_rows, st.device, self.states[i], r)
    self.slot_tokens[slot] = []

  def _snapshot(self, slot: int, hashes: list[bytes], blk: int, with_state: bool):
    if self.prefix_cache.max_bytes <= 0:
      return
    if hashes[blk] in self.prefix_cache:
      if not with_state or "ssm" in self.prefix_cache.peek(hashes[blk])[0]:
        return
    payload = []
    for st, state in zip(self.stages, self.states):
      k, v = distributed.call_on_stage(steps.read_kv, st.device, state, jnp.int32(slot),
                                       jnp.int32(blk * self.block_size), length=self.block_size)
      entry = {"k": self._host(k), "v": self._host(v)}
      if with_state:
        conv, ssm = distributed.call_on_stage(steps.read_recurrent, st.device, state,
                                              jnp.int32(slot))
        entry.update(conv=self._host(conv), ssm=self._host(ssm))
      payload.append(entry)
    if hashes[blk] in self.prefix_cache:
      self.prefix_cache.replace(hashes[blk], tuple(payload))
    else:
      self.prefix_cache.insert(hashes[blk], tuple(payload), hashes[blk - 1] if blk else None)

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
        state = write_kv(state, jnp.int32(slot), jnp.int32(b * self.block_size),
                         jnp.asarray(e["k"]), jnp.asarray(e["v"]))
      last = entries[-1][i]
      state = write_recurrent(state, jnp.int32(slot), jnp.asarray(last["conv"]),
                              jnp.asarray(last["ssm"]), jnp.int32(n), jnp.int32(switch))
      self.states[i] = state
    return n

  # ----- decode ---------------------------------------------------------------------------
  def _decode_rows(self, rows: dict[int, tuple[int, int]]) -> np.ndarray:
    """One decode step for {slot: (token, switch)}; the other rows stay as they are."""
    B = self.n_slots
    toks, sw, act = np.zeros(B, np.int32), np.zeros(B, np.int32), np.zeros(B, np.int32)
    for slot, (tok, switch) in rows.items():
      toks[slot], sw[slot], act[slot] = tok, switch, 1
    x, sw_d, act_d = jnp.asarray(toks), jnp.asarray(sw), jnp.asarray(act)
    for i, st in enumerate(self.stages):
      if st.device is not None:
        x, sw_d, act_d = jax.device_put((x, sw_d, act_d), st.device)
      x, self.states[i] = distributed.call_on_stage(
          steps.decode, st.device, st.cfg, st.params, st.lora, self.states[i], x, sw_d, act_d,
          cvec=st.cvec)
    return self._host(x)

  def _speculator(self, n: int) -> speculative.SpecDecoder:
    """The engine's SpecDecoder, made on first use; its n grows to the largest asked."""
    st = self.stages[0]
    if self._spec_decoder is None:
      self._spec_decoder = speculative.SpecDecoder(
          st.cfg, st.params, st.lora, n, self.draft, self.n_slots, self.max_seq,
          self.model.dtype, cvec=st.cvec)
    sd = self._spec_decoder
    sd.n, sd.cvec = max(sd.n, n), st.cvec
    return sd

  def _spec_step(self, running: dict):
    """One speculative round for every running row (a row with spec 0 takes no drafts: it
    decodes one token, through the verification program). Rows accept different lengths."""
    sd = self._speculator(max(run.spec for _, run in running.values()))
    rows = {}
    for slot, (_, run) in running.items():
      r = run.req
      cap = min(r.max_tokens - len(run.tokens),
                self.max_seq - 1 - len(self.slot_tokens[slot]))
      rows[slot] = speculative.Row(
          last=run.tokens[-1], switch=run.switch, context=list(r.tokens) + run.tokens,
          cap=max(cap, 1), stop=tuple(r.stop), temperature=r.temperature, top_k=r.top_k,
          top_p=r.top_p, rng=run.rng, n=run.spec)
    self.states[0], out = sd.round(self.states[0], rows)
    for slot, o in out.items():
      _, run = running[slot]
      self.slot_tokens[slot].extend(o.consumed)
      run.proposed += o.proposed
      run.accepted += o.accepted
      for tok in o.emitted:
        run.tokens.append(tok)
        if run.req.on_token is not None:
          run.req.on_token(tok)

  def _decode_step(self, running: dict):
    if any(run.spec for _, run in running.values()):
      return self._spec_step(running)
    logits = self._decode_rows({s: (run.tokens[-1], run.switch) for s, (_, run) in running.items()})
    for slot, (_, run) in running.items():
      self.slot_tokens[slot].append(run.tokens[-1])
      self._emit(run, logits[slot])

  def _emit(self, run: _Running, logits: np.ndarray):
    r = run.req
    if r.return_logits:
      run.step_logits.append(np.asarray(logits, np.float32))
    run.tokens.append(sample(logits, run.rng, r.temperature, r.top_k, r.top_p))
    if r.on_token is not None:
      r.on_token(run.tokens[-1])
    if len(run.tokens) == 1:
      run.t_first = time.perf_counter()

  def _finished(self, slot: int, run: _Running) -> bool:
    r = run.req
    return (run.tokens[-1] in r.stop or len(run.tokens) >= r.max_tokens
            or len(self.slot_tokens[slot]) + 1 >= self.max_seq)

  def _finish(self, slot: int, run: _Running, reason: str | None = None) -> Result:
    r = run.req
    now = time.perf_counter()
    n_dec = len(run.tokens) - 1
    stopped = run.tokens[-1] in r.stop
    return Result(
        prompt_tokens=[int(t) for t in r.tokens], tokens=list(run.tokens), lora=bool(run.switch),
        finish_reason=reason or ("stop" if stopped else "length"),
        cached_tokens=run.cached, prompt_tokens_computed=run.computed,
        ttft_s=run.t_first - run.t0,
        decode_tokens_per_s=n_dec / (now - run.t_first) if n_dec and now > run.t_first else 0.0,
        slot=slot, text=self.model.decode(run.tokens[:-1] if stopped else run.tokens),
        prompt_logits=run.prompt_logits,
        step_logits=np.stack(run.step_logits) if r.return_logits else None,
        draft={"proposed": run.proposed, "accepted": run.accepted} if run.spec else None)

  # ----- sessions -------------------------------------------------------------------------
  def _read_limits(self, supported_versions=frozenset({1, 2})) -> sess.SessionReadLimits:
    return sess.SessionReadLimits(
        max_tokens=self.max_seq - 1, max_stages=len(self.stages),
        stage_layers=tuple(st.layers for st in self.stages),
        stage_shapes=tuple(sess.stage_shapes_for(st.cfg, self.model.dtype) for st in self.stages),
        fingerprint=model_fingerprint(self.model, self.lora_set, self.control_vector),
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
      k, v = steps.read_kv(state, jnp.int32(slot), jnp.int32(0), length=self.max_seq)
      conv, ssm = steps.read_recurrent(state, jnp.int32(slot))
      stages.append({"k": np.asarray(k)[:, :n], "v": np.asarray(v)[:, :n],
                     "conv": np.asarray(conv), "ssm": np.asarray(ssm)})
    flags = sess.FLAG_LORA_ON if self.slot_key[slot][0] else 0
    return sess.save_session(str(path), stages, np.asarray(toks, np.int32),
                             fingerprint=model_fingerprint(self.model, self.lora_set,
                                                           self.control_vector), flags=flags,
                             layer_ranges=[st.layers for st in self.stages])

  def load_session(self, slot: int, path, *, supported_versions=frozenset({1, 2})) -> dict:
    """Restore a session into `slot`; everything is checked against this engine's limits
    before any array is read. The slot then holds the conversation under the switch it was
    saved with. Returns {"n_tokens", "lora", "version"}."""
    self._check_slot(slot)
    self._check_single_process("load_session")
    self._check_session_control_vector(path)
    meta, stages, tokens = sess.load_session(str(path), self._read_limits(supported_versions))
    n = int(meta.n_tokens)
    self._reset(slot)
    switch = int(meta.lora_on)
    for i, (st, arrays) in enumerate(zip(self.stages, stages)):
      state = self.states[i]
      La = arrays["k"].shape[0]
      pad = lambda a: np.concatenate(
          [a, np.zeros((La, self.max_seq - n) + a.shape[2:], a.dtype)], axis=1)
      put = (lambda a: jax.device_put(a, st.device)) if st.device is not None else jnp.asarray
      state = steps.write_kv(state, jnp.int32(slot), jnp.int32(0), put(pad(arrays["k"])),
                             put(pad(arrays["v"])))
      self.states[i] = steps.write_recurrent(state, jnp.int32(slot), put(arrays["conv"]),
                                             put(arrays["ssm"]), jnp.int32(n), jnp.int32(switch))
    self.slot_tokens[slot] = [int(t) for t in tokens]
    self.slot_key[slot] = self._cache_key(switch)
    self._lru.move_to_end(slot)
    return {"n_tokens": n, "lora": bool(switch), "version": meta.version}

  def _check_session_control_vector(self, path):
    """A session made under another control vector (or none) is refused with that reason (the
    id is the `+cvec:<16 hex>` tail of the session's fingerprint)."""
    try:
      saved = sess.read_session_meta(str(path)).fingerprint
    except SessionError:
      return    # load_session reports it, with the limits
    live = model_fingerprint(self.model, self.lora_set, self.control_vector)
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
