"""Session file format: round trips, the committed v1 fixture, every refusal (checked before any
array is read), crash safety of saves (in-process crash points and real SIGKILLs) and a fuzz of
truncated / bit-flipped files."""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import make_session_fixture as fixture
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import session_kill_helper as kill_helper
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata_jax.errors import SessionError
from strata_jax.session import (
  KNOWN_FLAGS,
  SessionMeta,
  SessionReadLimits,
  atomic,
  erase_session,
  load_session,
  orbax_io,
  read_session_meta,
  save_session,
  schema,
)

BF16 = ml_dtypes.bfloat16
G, HD, K, C, HV, DV, DK = 2, 4, 4, 6, 2, 3, 3


def make_stage(la, lg, n, seed, checkpoint=False):
  rng = np.random.default_rng(seed)
  stage = {
      "k": rng.standard_normal((la, n, G, HD), np.float32).astype(BF16),
      "v": rng.standard_normal((la, n, G, HD), np.float32).astype(BF16),
      "conv": rng.standard_normal((lg, K - 1, C), np.float32).astype(BF16),
      "ssm": rng.standard_normal((lg, HV, DV, DK), np.float32),
  }
  if checkpoint:
    stage["checkpoint"] = {"ssm": rng.standard_normal((2, lg, HV, DV, DK), np.float32),
                           "pos": {"ends": np.array([3, 7], np.int32)}}
  return stage


def stage_spec(la, lg, checkpoint=False):
  spec = {
      "k": ((la, None, G, HD), BF16),
      "v": ((la, None, G, HD), BF16),
      "conv": ((lg, K - 1, C), BF16),
      "ssm": ((lg, HV, DV, DK), np.float32),
  }
  if checkpoint:
    spec["checkpoint/ssm"] = ((2, lg, HV, DV, DK), np.float32)
    spec["checkpoint/pos/ends"] = ((2,), np.int32)
  return spec


# (La, Lg, checkpoint, layer range) per stage, for 1, 2 and 3 stages
GEOMETRIES = {
    1: [(1, 3, True, (0, 4))],
    2: [(1, 3, False, (0, 4)), (0, 2, True, (4, 6))],
    3: [(1, 3, False, (0, 4)), (0, 2, False, (4, 6)), (2, 0, True, (6, 8))],
}


def payload(n_stages=1, n=5, seed=0, flags=1, fingerprint="model-a"):
  geo = GEOMETRIES[n_stages]
  stages = [make_stage(la, lg, n, seed + s, ck) for s, (la, lg, ck, _) in enumerate(geo)]
  tokens = np.arange(100, 100 + n, dtype=np.int32)
  kw = {"fingerprint": fingerprint, "flags": flags, "layer_ranges": [g[3] for g in geo]}
  return stages, tokens, kw


def limits_for(n_stages=1, **overrides):
  geo = GEOMETRIES[n_stages]
  kw = dict(max_tokens=16, max_stages=4, stage_layers=tuple(g[3] for g in geo),
            stage_shapes=tuple(stage_spec(la, lg, ck) for la, lg, ck, _ in geo),
            fingerprint="model-a")
  kw.update(overrides)
  return SessionReadLimits(**kw)


def assert_same(a, b):
  """Bit-exact equality of nested dicts / lists of arrays, dtypes and shapes included."""
  if isinstance(a, dict):
    assert isinstance(b, dict) and a.keys() == b.keys(), (a.keys(), getattr(b, "keys", None))
    for key in a:
      assert_same(a[key], b[key])
  elif isinstance(a, list):
    assert isinstance(b, list) and len(a) == len(b)
    for x, y in zip(a, b):
      assert_same(x, y)
  else:
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    assert a.tobytes() == b.tobytes()


def write_raw(path, tree, header, reseal=True):
  """An orbax checkpoint with an arbitrary header: what a buggy or hostile writer could leave."""
  if reseal:
    header = dict(header, meta_xxh3_64=schema.meta_checksum(header))
  ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).save(
      str(path), args=ocp.args.PyTreeSave(tree), custom_metadata=header)


def tampered(path, edit, n_stages=1, n=5, **payload_kw):
  """Writes payload() at `path` with `edit(tree, header)` applied to what save_session builds."""
  stages, tokens, kw = payload(n_stages, n, **payload_kw)
  tree, header = schema.build(str(path), stages, tokens, kw["fingerprint"], kw["flags"],
                          kw["layer_ranges"])
  header = json.loads(json.dumps(header))
  edit(tree, header)
  write_raw(path, tree, header)
  return path


@pytest.fixture
def restore_calls(monkeypatch):
  """Records every array read: our single restore entry point and orbax's restore itself."""
  calls = []
  real = orbax_io.restore_arrays

  def spy(*args, **kwargs):
    calls.append(("restore_arrays", args))
    return real(*args, **kwargs)

  real_ocp = ocp.Checkpointer.restore

  def spy_ocp(self, *args, **kwargs):
    calls.append(("Checkpointer.restore", args))
    return real_ocp(self, *args, **kwargs)

  monkeypatch.setattr(orbax_io, "restore_arrays", spy)
  monkeypatch.setattr(ocp.Checkpointer, "restore", spy_ocp)
  return calls


def refused(path, limits, pattern, calls):
  """load_session refuses with a message naming the path, before reading any array."""
  with pytest.raises(SessionError, match=pattern) as info:
    load_session(path, limits)
  assert str(path) in str(info.value)
  assert calls == [], f"arrays were read before the refusal: {calls}"
  assert info.value.__cause__ is None   # no orbax traceback chained to what callers see
  assert info.value.__suppress_context__ or info.value.__context__ is None
  return str(info.value)


# ---------------------------------------------------------------------------------------------
# Round trips

@pytest.mark.parametrize("n_stages", [1, 2, 3], ids=["v1", "v2-2stages", "v2-3stages"])
def test_round_trip_bit_exact(tmp_path, n_stages, restore_calls):
  stages, tokens, kw = payload(n_stages, n=7, seed=n_stages)
  path = tmp_path / "s"
  info = save_session(path, stages, tokens, **kw)
  assert info["bytes"] > 0 and info["seconds"] >= 0 and info["n_tokens"] == 7
  assert info["version"] == (1 if n_stages == 1 else 2)

  meta = read_session_meta(path)
  assert meta == SessionMeta(info["version"], 1, "model-a", kw["layer_ranges"], 7)
  assert meta.lora_on and meta.n_stages == n_stages and meta.tokens is None
  assert restore_calls == []

  meta, got, got_tokens = load_session(path, limits_for(n_stages))
  assert_same(stages, got)
  assert_same(tokens, got_tokens)
  assert meta.tokens is got_tokens and meta.version == info["version"]
  assert os.listdir(tmp_path) == ["s"]   # no temp dir or backup left beside it


def test_round_trip_empty_and_replace(tmp_path):
  path = tmp_path / "s"
  stages, tokens, kw = payload(3, n=0, flags=0)   # no tokens: K/V and tokens are zero-size
  save_session(path, stages, tokens, **kw)
  meta, got, got_tokens = load_session(path, limits_for(3))
  assert_same(stages, got)
  assert got_tokens.shape == (0,) and not meta.lora_on

  stages2, tokens2, kw2 = payload(3, n=9, seed=5)   # replacing keeps one whole session
  save_session(path, stages2, tokens2, **kw2)
  _, got, got_tokens = load_session(path, limits_for(3))
  assert_same(stages2, got)
  assert_same(tokens2, got_tokens)
  assert sorted(os.listdir(tmp_path)) == ["s"]
  assert erase_session(path) and not erase_session(path)
  assert os.listdir(tmp_path) == []


def test_replace_without_rename_exchange(tmp_path, monkeypatch):
  monkeypatch.setattr(atomic, "use_exchange", False)
  path = tmp_path / "s"
  for seed in range(3):
    stages, tokens, kw = payload(2, seed=seed)
    save_session(path, stages, tokens, **kw)
    assert_same(stages, load_session(path, limits_for(2))[1])
    assert os.listdir(tmp_path) == ["s"]


def test_fixture_v1_loads(restore_calls):
  """The committed v1 session (tests/make_session_fixture.py) reads on this code unchanged."""
  stages, tokens, kw = fixture.fixture_payload()
  meta = read_session_meta(fixture.FIXTURE)
  assert (meta.version, meta.flags, meta.fingerprint, meta.layer_ranges, meta.n_tokens) == (
      1, 1, fixture.FINGERPRINT, [fixture.LAYERS], fixture.N_TOKENS)
  meta, got, got_tokens = load_session(fixture.FIXTURE, fixture.fixture_limits())
  assert_same(stages, got)
  assert_same(tokens, got_tokens)
  assert meta.lora_on
  assert sum(os.path.getsize(os.path.join(d, f))
             for d, _, fs in os.walk(fixture.FIXTURE) for f in fs) < 200_000


def test_save_rejects_bad_input(tmp_path):
  stages, tokens, kw = payload()
  with pytest.raises(SessionError, match="unknown flag bits 0x2"):
    save_session(tmp_path / "a", stages, tokens, **dict(kw, flags=0b10))
  with pytest.raises(SessionError, match="must have 4 tokens on axis 1"):
    save_session(tmp_path / "a", stages, tokens[:4], **kw)
  with pytest.raises(SessionError, match="1 stages but 2 layer ranges"):
    save_session(tmp_path / "a", stages, tokens, **dict(kw, layer_ranges=[(0, 4), (4, 8)]))
  with pytest.raises(SessionError, match="ssm must be float32"):
    bad = [dict(stages[0], ssm=stages[0]["ssm"].astype(BF16))]
    save_session(tmp_path / "a", bad, tokens, **kw)
  with pytest.raises(SessionError, match="unknown entry 'pos'"):
    save_session(tmp_path / "a", [dict(stages[0], pos=np.zeros(2))], tokens, **kw)
  assert os.listdir(tmp_path) == []
  # never overwrite or erase something that is not a session
  (tmp_path / "notes").mkdir()
  (tmp_path / "notes" / "todo.txt").write_text("keep me")
  with pytest.raises(SessionError, match="not a session directory"):
    save_session(tmp_path / "notes", stages, tokens, **kw)
  with pytest.raises(SessionError, match="not a session directory"):
    erase_session(tmp_path / "notes")
  assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
  # nor another orbax checkpoint (say, model weights)
  ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).save(
      str(tmp_path / "weights"), args=ocp.args.PyTreeSave({"w": np.ones(3, np.float32)}))
  with pytest.raises(SessionError, match="not a session directory"):
    save_session(tmp_path / "weights", stages, tokens, **kw)
  # a session whose files are damaged can still be replaced and erased
  save_session(tmp_path / "s", stages, tokens, **kw)
  shutil.rmtree(tmp_path / "s" / "d")
  save_session(tmp_path / "s", stages, tokens, **kw)
  assert_same(stages, load_session(tmp_path / "s", limits_for())[1])
  shutil.rmtree(tmp_path / "s" / "d")
  assert erase_session(tmp_path / "s") and not (tmp_path / "s").exists()


def test_stage_shapes_for_matches_model_state():
  from strata_jax.config import ModelConfig
  from strata_jax.session import stage_shapes_for
  from strata_jax.state import init_state

  cfg = ModelConfig(vocab_size=32, d_model=16, layer_types="GGGAGGGA", n_head=4, n_kv_head=2,
                    head_dim=8, n_rot=4, rope_base=1e4, gdn_n_k_heads=2, gdn_n_v_heads=4,
                    gdn_d_k=4, gdn_d_v=4, conv_kernel=4, n_experts=2, n_experts_used=1,
                    d_ff_expert=8, d_ff_shared=8)
  part = cfg.stage(4, 8)
  shapes = stage_shapes_for(part, BF16, checkpoint={"ssm": ((2, 3, 4, 4, 4), np.float32)})
  state = init_state(part, batch=1, max_seq=6)
  for name in ("k", "v", "conv", "ssm"):
    want = np.asarray(getattr(state, name)).shape
    want = want[:1] + want[2:]                     # one slot: drop the batch axis
    got = tuple(6 if d is None else d for d in shapes[name][0])
    assert got == want, (name, got, want)
  assert shapes["ssm"][1] == np.float32 and shapes["k"][1] == BF16
  assert "checkpoint/ssm" in shapes
  limits_for(1, stage_shapes=(shapes,))            # accepted as a limits table


def test_limits_validation():
  with pytest.raises(ValueError, match="2 stage layer ranges but 1 stage shape tables"):
    limits_for(1, stage_layers=((0, 4), (4, 8)))
  with pytest.raises(ValueError, match="lacks"):
    limits_for(1, stage_shapes=({"k": ((1, None, 2, 4), BF16)},))


# ---------------------------------------------------------------------------------------------
# Refusals: each before any array is read

def test_refuses_not_a_session(tmp_path, restore_calls):
  lim = limits_for()
  refused(tmp_path / "missing", lim, "not a session: the path does not exist", restore_calls)
  (tmp_path / "file").write_bytes(b"ggsn\x09\x00\x00\x00")   # e.g. a llama.cpp session file
  refused(tmp_path / "file", lim, "not a session: the path is not a directory", restore_calls)
  (tmp_path / "empty").mkdir()
  refused(tmp_path / "empty", lim, "not a session: no readable checkpoint metadata",
          restore_calls)
  # an orbax checkpoint without session metadata
  ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).save(
      str(tmp_path / "plain"), args=ocp.args.PyTreeSave({"x": np.ones(3, np.float32)}))
  refused(tmp_path / "plain", lim, "carries no session metadata", restore_calls)
  with pytest.raises(SessionError, match="not a session"):
    read_session_meta(tmp_path / "plain")


def test_refuses_wrong_magic(tmp_path, restore_calls):
  path = tampered(tmp_path / "s", lambda t, h: h.update(magic="ggsq"))
  refused(path, limits_for(), "wrong magic 'ggsq'", restore_calls)


def test_refuses_unknown_version(tmp_path, restore_calls):
  path = tampered(tmp_path / "s", lambda t, h: h.update(version=3))
  refused(path, limits_for(), r"unknown session format version 3 \(known versions: \[1, 2\]\)",
          restore_calls)
  with pytest.raises(SessionError, match="unknown session format version 3"):
    read_session_meta(path)


def test_v1_only_reader_refuses_v2(tmp_path, restore_calls):
  stages, tokens, kw = payload(2)
  save_session(tmp_path / "s", stages, tokens, **kw)
  lim = limits_for(2, supported_versions=frozenset({1}))
  refused(tmp_path / "s", lim, r"session format v2 \(split model\) is not supported by this "
          r"reader", restore_calls)
  # the same reader still reads v1
  stages, tokens, kw = payload(1)
  save_session(tmp_path / "one", stages, tokens, **kw)
  assert_same(stages, load_session(tmp_path / "one", limits_for(1, supported_versions={1}))[1])


def test_refuses_stage_count_mismatch(tmp_path, restore_calls):
  stages, tokens, kw = payload(3)
  save_session(tmp_path / "s", stages, tokens, **kw)
  refused(tmp_path / "s", limits_for(2), r"stage count mismatch: session has 3 stage\(s\)",
          restore_calls)
  refused(tmp_path / "s", limits_for(3, max_stages=2),
          "session has 3 stages, more than this engine's maximum of 2", restore_calls)


def test_refuses_layer_range_mismatch(tmp_path, restore_calls):
  stages, tokens, kw = payload(2)
  save_session(tmp_path / "s", stages, tokens, **kw)
  lim = limits_for(2, stage_layers=((0, 4), (4, 7)))
  refused(tmp_path / "s", lim, r"layer range mismatch: stage 1 covers layers \[4, 6\) in the "
          r"session, \[4, 7\) here", restore_calls)


def test_refuses_oversized_kv(tmp_path, restore_calls):
  def grow_kv(tree, header):   # K/V with 12 tokens under a header that says 5
    big = make_stage(1, 3, 12, 0)
    for key in ("k", "v"):
      tree["stage0"][key] = big[key]
      header["stages"][0]["arrays"][key] = schema.entry(big[key])
  path = tampered(tmp_path / "a", grow_kv)
  refused(path, limits_for(), "oversized array stage0/k: 12 entries on its token axis but the "
          "session holds 5 tokens", restore_calls)
  refused(path, limits_for(max_tokens=8), "oversized array stage0/k: 12 entries on its token "
          "axis, beyond this engine's capacity of 8 tokens", restore_calls)
  # K/V of another geometry (4 kv-heads) than this engine's
  stages, tokens, kw = payload()
  stages[0]["k"] = stages[0]["v"] = np.zeros((1, 5, 4, HD), BF16)
  save_session(tmp_path / "b", stages, tokens, **kw)
  refused(tmp_path / "b", limits_for(), r"array stage0/k has shape \[1, 5, 4, 4\], this engine "
          r"expects \[1, n_tokens, 2, 4\]", restore_calls)
  # an extra array the engine does not know
  stages, tokens, kw = payload()
  stages[0]["checkpoint"]["huge"] = np.zeros(7, np.float32)
  save_session(tmp_path / "c", stages, tokens, **kw)
  refused(tmp_path / "c", limits_for(), "unexpected array stage0/checkpoint/huge",
          restore_calls)


def test_refuses_stored_arrays_unlike_header(tmp_path, restore_calls):
  """orbax's own array metadata is checked too: a header cannot hide a bigger stored array."""
  def grow_stored(tree, header):
    tree["stage0"]["ssm"] = np.zeros((3, HV, DV, 999), np.float32)
  path = tampered(tmp_path / "s", grow_stored)
  refused(path, limits_for(), r"stored array stage0/ssm is float32\[3, 2, 3, 999\], the "
          r"session metadata says float32\[3, 2, 3, 3\]", restore_calls)

  def drop_stored(tree, header):
    del tree["stage0"]["conv"]
  path = tampered(tmp_path / "t", drop_stored)
  refused(path, limits_for(), r"stored arrays do not match the session metadata \(unexpected "
          r"\[\], missing \['stage0/conv'\]\)", restore_calls)


def test_refuses_token_count_over_capacity(tmp_path, restore_calls):
  stages, tokens, kw = payload(n=12)
  save_session(tmp_path / "s", stages, tokens, **kw)
  refused(tmp_path / "s", limits_for(max_tokens=11), "session holds 12 tokens, over this "
          "engine's capacity of 11 tokens", restore_calls)


def test_refuses_fingerprint_mismatch(tmp_path, restore_calls):
  stages, tokens, kw = payload(fingerprint="model-a+adapter-1")
  save_session(tmp_path / "s", stages, tokens, **kw)
  refused(tmp_path / "s", limits_for(), "saved with a different model or adapter "
          r"\(fingerprint 'model-a\+adapter-1', this engine 'model-a'\)", restore_calls)


def test_refuses_unknown_flags(tmp_path, restore_calls):
  assert KNOWN_FLAGS == 0b1
  path = tampered(tmp_path / "s", lambda t, h: h.update(flags=0b101))
  refused(path, limits_for(), r"unknown flag bits 0x4 in flags 0x5", restore_calls)
  with pytest.raises(SessionError, match="unknown flag bits 0x4"):
    read_session_meta(path)


def test_refuses_dtype_mismatch(tmp_path, restore_calls):
  stages, tokens, kw = payload()
  stages[0]["conv"] = stages[0]["conv"].astype(np.float32)
  save_session(tmp_path / "s", stages, tokens, **kw)
  refused(tmp_path / "s", limits_for(), "dtype mismatch: array stage0/conv is float32, this "
          "engine expects bfloat16", restore_calls)


def test_refuses_corrupted_metadata(tmp_path, restore_calls):
  """A header edited without its checksum (LoRA bit cleared by a byte flip) is refused."""
  stages, tokens, kw = payload()
  save_session(tmp_path / "s", stages, tokens, **kw)
  md = tmp_path / "s" / "_CHECKPOINT_METADATA"
  md.write_text(md.read_text().replace('"flags": 1', '"flags": 0'))
  refused(tmp_path / "s", limits_for(), r"session metadata is corrupted \(checksum mismatch\)",
          restore_calls)
  path = tampered(tmp_path / "t", lambda t, h: h["stages"][0].update(layers=[4, 2]))
  refused(path, limits_for(), r"malformed session metadata: stage 0 layers \[4, 2\]",
          restore_calls)


MALFORMED = {
    "version-str": (lambda h: h.update(version="1"), "unknown session format version '1'"),
    "flags-negative": (lambda h: h.update(flags=-1), "malformed session metadata: flags -1"),
    "n_tokens-str": (lambda h: h.update(n_tokens="5"), "malformed session metadata: n_tokens"),
    "no-stages": (lambda h: h.update(stages=[]), "malformed session metadata: no stages"),
    "v1-two-stages": (lambda h: h.update(stages=h["stages"] * 2), "exactly one stage, found 2"),
    "shape-negative": (lambda h: h["stages"][0]["arrays"]["ssm"].update(shape=[-3, 2, 3, 3]),
                       "malformed session metadata: shape of stage0/ssm"),
    "dtype-int": (lambda h: h["stages"][0]["arrays"]["k"].update(dtype=5),
                  "malformed session metadata: dtype/checksum of stage0/k"),
    "array-name": (lambda h: h["stages"][0]["arrays"].update({"../x": {}}),
                   r"malformed session metadata: stage 0 array name '../x'"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_refuses_malformed_metadata(tmp_path, restore_calls, case):
  edit, pattern = MALFORMED[case]
  path = tampered(tmp_path / "s", lambda tree, header: edit(header))
  refused(path, limits_for(), pattern, restore_calls)


def test_refuses_deeply_nested_metadata(tmp_path, restore_calls):
  stages, tokens, kw = payload()
  save_session(tmp_path / "s", stages, tokens, **kw)
  md = tmp_path / "s" / "_CHECKPOINT_METADATA"
  deep = "[" * 100_000 + "]" * 100_000
  md.write_text(md.read_text().replace('"flags": 1', f'"extra": {deep}, "flags": 1'))
  refused(tmp_path / "s", limits_for(), "not a session|cannot read session", restore_calls)


def test_refuses_truncated_array_data(tmp_path, capfd):
  stages, tokens, kw = payload()
  save_session(tmp_path / "s", stages, tokens, **kw)
  data = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "s" / "d") for f in fs]
  assert data
  for f in data:
    with open(f, "r+b") as fh:
      fh.truncate(os.path.getsize(f) // 2)
  with pytest.raises(SessionError, match="truncated or corrupted session") as info:
    load_session(tmp_path / "s", limits_for())
  assert str(tmp_path / "s") in str(info.value)
  time.sleep(0.1)
  err = capfd.readouterr().err
  assert "Traceback" not in err and "Event loop is closed" not in err, err[:2000]


def test_refused_read_leaves_no_process_wide_filters(tmp_path, capfd):
  """The noise filters around orbax calls are scoped: after a refused read of damaged data,
  the unraisable hook, warnings filters and logger filters are what they were before."""
  import logging
  import warnings
  stages, tokens, kw = payload()
  save_session(tmp_path / "s", stages, tokens, **kw)
  for dirpath, _, fs in os.walk(tmp_path / "s" / "d"):
    for f in fs:
      with open(os.path.join(dirpath, f), "r+b") as fh:
        fh.truncate(os.path.getsize(os.path.join(dirpath, f)) // 2)
  loggers = [logging.getLogger(n) for n in ("asyncio", "absl")]
  before = (sys.unraisablehook, list(warnings.filters), [list(lg.filters) for lg in loggers])
  with pytest.raises(SessionError, match="truncated or corrupted session"):
    load_session(tmp_path / "s", limits_for())
  after = (sys.unraisablehook, list(warnings.filters), [list(lg.filters) for lg in loggers])
  assert after == before
  time.sleep(0.1)
  err = capfd.readouterr().err
  assert "Traceback" not in err and "Event loop is closed" not in err, err[:2000]


def test_refuses_silently_corrupted_data(tmp_path):
  """Data that orbax reads without complaint but that differs from what was saved."""
  def swap(tree, header):
    tree["stage0"]["ssm"] = tree["stage0"]["ssm"] + np.float32(1e-3)   # header keeps old digest
  path = tampered(tmp_path / "s", swap)
  with pytest.raises(SessionError, match=r"array data of stage0/ssm is corrupted \(checksum "
                     r"mismatch\)"):
    load_session(path, limits_for())


# ---------------------------------------------------------------------------------------------
# Crash safety

class _Crash(BaseException):
  """Stands for SIGKILL in-process: skips every `except Exception` clean-up on its way out."""


CRASH_POINTS = [   # (rename exchange available, step the save dies after, session left)
    (True, "written", "old"), (True, "exchanged", "new"), (True, "cleaned", "new"),
    (False, "written", "old"), (False, "backed_up", "old"), (False, "renamed", "new"),
    (False, "cleaned", "new"),
]


@pytest.mark.parametrize("exchange,step,left", CRASH_POINTS,
                         ids=[f"{'xchg' if x else 'rename'}-{s}" for x, s, _ in CRASH_POINTS])
def test_crash_at_each_step_keeps_a_whole_session(tmp_path, monkeypatch, exchange, step, left):
  monkeypatch.setattr(atomic, "use_exchange", exchange)
  path = tmp_path / "s"
  old, new = payload(2, seed=1), payload(2, seed=2)
  save_session(path, old[0], old[1], **old[2])

  def die(name):
    if name == step:
      raise _Crash(name)
  monkeypatch.setattr(atomic, "step_hook", die)
  with pytest.raises(_Crash):
    save_session(path, new[0], new[1], **new[2])
  monkeypatch.setattr(atomic, "step_hook", None)

  want = old if left == "old" else new
  assert read_session_meta(path).n_tokens == 5      # recovers a missing path from its backup
  _, got, tokens = load_session(path, limits_for(2))
  assert_same(want[0], got)
  # the next save sweeps every leftover of the dead one
  save_session(path, new[0], new[1], **new[2])
  assert os.listdir(tmp_path) == ["s"]
  assert_same(new[0], load_session(path, limits_for(2))[1])


def test_sigkill_during_saves_keeps_previous_session(tmp_path):
  """A child saves 1.5 MB sessions in a loop; SIGKILL at random moments (seeded delays)."""
  path, progress = tmp_path / "s", tmp_path / "progress"
  first = kill_helper.payload(0)
  save_session(path, first[0], first[1], **first[2])
  lim = kill_helper.limits()
  rng = random.Random(1234)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  helper = os.path.join(os.path.dirname(__file__), "session_kill_helper.py")
  start = 1
  for kill in range(4):
    env["STRATA_SESSION_NO_EXCHANGE"] = str(kill % 2)   # both ways of replacing a session
    progress.write_text("")
    child = subprocess.Popen([sys.executable, helper, str(path), str(progress), str(start)],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while "ready" not in progress.read_text():
      assert child.poll() is None, child.stderr.read().decode()[-2000:]
      assert time.monotonic() < deadline
      time.sleep(0.01)
    time.sleep(rng.uniform(0.0, 0.8))
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stderr.close()
    assert child.returncode == -signal.SIGKILL
    done = [int(x) for x in progress.read_text().split() if x.isdigit()]
    last = done[-1] if done else start - 1
    meta, stages, tokens = load_session(path, lim)
    j = int(tokens[0]) // 1000
    # the last finished save, or the one in flight if it got as far as its swap
    assert j in (last, last + 1), (j, last)
    want = kill_helper.payload(j)
    assert_same(want[0], stages)
    assert_same(want[1], tokens)
    assert meta.flags == j & 1
    start = j + 1 if j > last else last + 1
  # the next save cleans up whatever the killed saves left beside the session
  save_session(path, first[0], first[1], **first[2])
  assert sorted(os.listdir(tmp_path)) == ["progress", "s"]


# ---------------------------------------------------------------------------------------------
# Fuzz: truncations and byte flips of every file of a small session

@pytest.fixture(scope="module")
def fuzz_session(tmp_path_factory):
  root = tmp_path_factory.mktemp("fuzz")
  stages, tokens, kw = payload(2, n=4, seed=9)
  save_session(root / "orig", stages, tokens, **kw)
  files = sorted(os.path.relpath(os.path.join(d, f), root / "orig")
                 for d, _, fs in os.walk(root / "orig") for f in fs)
  return root, files, (stages, tokens, kw)


MUTATIONS = st.sampled_from(["truncate", "flip", "overwrite", "append", "delete", "empty"])


@settings(max_examples=500, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(which=st.integers(0, 10_000), kind=MUTATIONS, at=st.floats(0, 1, exclude_max=True),
       bit=st.integers(0, 7), junk=st.binary(min_size=1, max_size=16))
def test_fuzz_truncations_and_flips(fuzz_session, capfd, which, kind, at, bit, junk):
  root, files, (stages, tokens, kw) = fuzz_session
  capfd.readouterr()
  case = tempfile.mkdtemp(dir=root)
  try:
    path = os.path.join(case, "s")
    shutil.copytree(root / "orig", path)
    target = os.path.join(path, files[which % len(files)])
    data = bytearray(open(target, "rb").read())
    i = int(at * len(data)) if data else 0
    if kind == "truncate":
      data = data[:i]
    elif kind == "flip" and data:
      data[i] ^= 1 << bit
    elif kind == "overwrite":
      data[i:i + len(junk)] = junk
    elif kind == "append":
      data += junk
    elif kind == "empty":
      data = b""
    if kind == "delete":
      os.remove(target)
    else:
      with open(target, "wb") as f:
        f.write(data)
    try:
      read_session_meta(path)
    except SessionError:
      pass
    try:
      meta, got, got_tokens = load_session(path, limits_for(2))
    except SessionError:
      err = capfd.readouterr().err   # refused quietly: no orbax/tensorstore noise on stderr
      assert "Traceback" not in err and "Error" not in err, err[:2000]
      return
    # a load that succeeds passed every check and checksum: it is exactly what was saved
    assert_same(stages, got)
    assert_same(tokens, got_tokens)
    assert (meta.flags, meta.fingerprint, meta.layer_ranges) == (
        kw["flags"], kw["fingerprint"], kw["layer_ranges"])
  finally:
    shutil.rmtree(case, ignore_errors=True)
