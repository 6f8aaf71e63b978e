"""The server's adapters as llama.cpp's: GET / POST /lora-adapters, per-request
`"lora": [{"id", "scale"}]`, hot load and unload (deferred while a request holds the adapter),
bad scales, and a concurrent stress with random adapter choices and a hot load and an unload
mid-run (issue 19 §2)."""
import concurrent.futures
import dataclasses
import threading
import time

import httpx
import numpy as np
import pytest
from adapter_fixtures import write_adapter
from model_fixtures import TINY, tiny_model
from server_fixtures import start_server

import strata_jax as sj
from strata_jax.engine.engine import Request

SLOTS, SEQ, BS = 4, 128, 32
# the stress: tokens per answer, and decode chunks short enough for an answer to span four
N_STRESS, STRESS_STEPS = 16, (1, 4)


@pytest.fixture(scope="module")
def model():
  return tiny_model()


@pytest.fixture(scope="module")
def files(model, tmp_path_factory):
  d = tmp_path_factory.mktemp("adapters")
  return [write_adapter(d / f"a{i}.gguf", TINY, rank=4 + 4 * i, seed=20 + i)[0]
          for i in range(4)]


def _engine(model, files, cls=sj.Engine, **kw):
  lora = [(sj.load_lora(model, [f]), 1.0, f) for f in files]
  return cls(model, lora=lora, slots=SLOTS, max_seq=SEQ, block_size=BS, **kw)


class _HoldableEngine(sj.Engine):
  """An Engine the server's worker can be held on between two steps while requests still have
  tokens to compute, so an adapter call lands mid-request by construction, not by timing.

  After `hold(n)`, the first step after which >= n requests are `computing` sets `held`;
  `busy` then reads False, so the worker blocks on its queue and runs the calls that arrive
  while those requests wait, until `release()` and the next call or request wakes it. Each
  adapter call records (name, requests computing, held).
  """

  def __init__(self, *args, **kw):
    super().__init__(*args, **kw)
    self.handles, self.calls = [], []    # handles: (Handle, the tokens it has emitted)
    self.held, self._hold_at = threading.Event(), None

  def hold(self, n: int = 1):
    self._hold_at = n

  def release(self):
    self._hold_at = None
    self.held.clear()

  def computing(self) -> int:
    """Unfinished requests with tokens not yet dispatched: a step dispatches one decode chunk
    (at most max(decode_steps) tokens a row) past the tokens read, so the rest are computed
    after the step, under whatever the adapter table then is."""
    ahead = max(self.decode_steps)
    return sum(not h.done and len(toks) + ahead < h.req.max_tokens for h, toks in self.handles)

  @property
  def busy(self) -> bool:
    return super().busy and not self.held.is_set()

  def submit(self, req):
    toks, inner = [], req.on_token
    h = super().submit(dataclasses.replace(
        req, on_token=lambda t: (toks.append(t), inner and inner(t))))
    self.handles.append((h, toks))
    return h

  def step(self):
    super().step()
    if self._hold_at is not None and self.computing() >= self._hold_at:
      self.held.set()

  def load_adapter(self, *args, **kw):
    self.calls.append(("load", self.computing(), self.held.is_set()))
    return super().load_adapter(*args, **kw)

  def unload_adapter(self, adapter_id):
    self.calls.append(("unload", self.computing(), self.held.is_set()))
    return super().unload_adapter(adapter_id)


def _complete(url, prompt, lora=None, max_tokens=4):
  body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_tokens": True}
  if lora is not None:
    body["lora"] = lora
  return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def _error(r, status):
  assert r.status_code == status, (r.status_code, r.text)
  return r.json()["error"]["message"]


def test_lora_adapter_endpoints(model, files, tmp_path):
  with start_server(_engine(model, files[:2])) as s:
    got = httpx.get(f"{s.url}/lora-adapters").json()
    assert [(a["id"], a["path"], a["scale"]) for a in got] == [(0, files[0], 1.0),
                                                                (1, files[1], 1.0)]
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    one = _complete(s.url, prompt, [{"id": 1, "scale": 0.5}]).json()["choices"][0]["tokens"]
    # POST /lora-adapters sets the defaults; adapters not listed get 0 (llama.cpp)
    r = httpx.post(f"{s.url}/lora-adapters", json=[{"id": 1, "scale": 0.5}])
    assert r.status_code == 200 and r.json() == {"success": True}
    assert [a["scale"] for a in httpx.get(f"{s.url}/lora-adapters").json()] == [0.0, 0.5]
    assert _complete(s.url, prompt).json()["choices"][0]["tokens"] == one
    assert _complete(s.url, prompt, True).json()["choices"][0]["tokens"] == one
    # bad choices: 400 naming the problem, and the server goes on
    assert "does not exist" in _error(_complete(s.url, prompt, [{"id": 7, "scale": 1}]), 400)
    assert ">= 0" in _error(_complete(s.url, prompt, [{"id": 0, "scale": -0.5}]), 400)
    nan = httpx.post(f"{s.url}/v1/completions", timeout=60, headers={
        "content-type": "application/json"}, content=(
        '{"prompt": [1, 2], "max_tokens": 1, "lora": [{"id": 0, "scale": NaN}]}'))
    assert "finite" in _error(nan, 400)
    _error(httpx.post(f"{s.url}/lora-adapters", json=[{"id": 5, "scale": 1}]), 400)
    # hot load: a new id; a file that is not an adapter: 400; unload: the id is refused after
    r = httpx.post(f"{s.url}/lora-adapters/load", json={"path": files[2], "scale": 0.75},
                   timeout=60)
    assert r.status_code == 200 and r.json()["id"] == 2
    assert httpx.get(f"{s.url}/lora-adapters").json()[2]["scale"] == 0.75
    bad = tmp_path / "not-an-adapter.gguf"
    bad.write_bytes(b"GGUF nonsense")
    assert "not-an-adapter.gguf" in _error(httpx.post(
        f"{s.url}/lora-adapters/load", json={"path": str(bad)}, timeout=60), 400)
    assert _complete(s.url, prompt, [{"id": 2}]).status_code == 200
    r = httpx.post(f"{s.url}/lora-adapters/unload", json={"id": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["deferred"] is False
    assert "unloaded" in _error(_complete(s.url, prompt, [{"id": 2}]), 400)
    _error(httpx.post(f"{s.url}/lora-adapters/unload", json={"id": 2}, timeout=60), 400)
    assert [a["id"] for a in httpx.get(f"{s.url}/lora-adapters").json()] == [0, 1]
    assert httpx.get(f"{s.url}/health").json()["status"] == "ok"


def _ids(url):
  return [a["id"] for a in httpx.get(f"{url}/lora-adapters").json()]


def test_unload_of_an_adapter_a_running_request_holds_is_deferred(model, files):
  """POST /lora-adapters/unload while a request runs under that adapter: "deferred": true,
  the id is refused to new requests at once, and the running request finishes under its
  adapter (its tokens equal the request run alone); the adapter is freed after it."""
  prompt, choice = [5, 3, 8, 1, 9, 2, 7], [{"id": 1, "scale": 1.0}]
  ref = _engine(model, files[:2]).generate(tokens=prompt, max_tokens=40, lora=choice).tokens
  eng = _engine(model, files[:2], _HoldableEngine)
  eng.hold()
  with start_server(eng) as s, concurrent.futures.ThreadPoolExecutor(1) as pool:
    fut = pool.submit(_complete, s.url, prompt, choice, 40)
    try:   # (released on failure too, so the request and the server can end)
      assert eng.held.wait(120), "the request never ran"
      assert eng.computing() == 1 and not fut.done()
      r = httpx.post(f"{s.url}/lora-adapters/unload", json={"id": 1}, timeout=60)
      assert r.status_code == 200 and r.json() == {"success": True, "id": 1, "deferred": True}
      assert eng.calls == [("unload", 1, True)], "answered while the request was in flight"
      assert _ids(s.url) == [0]
      assert "unloaded" in _error(_complete(s.url, prompt, [{"id": 1}]), 400)
    finally:
      eng.release()
      httpx.get(f"{s.url}/lora-adapters")   # a call: wakes the held worker
    assert _ids(s.url) == [0]
    resp = fut.result(timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["tokens"] == ref
    assert not {1} & set(eng.adapters.entries), "freed once its last request finished"
    assert "unloaded" in _error(httpx.post(f"{s.url}/lora-adapters/unload", json={"id": 1},
                                           timeout=60), 400)


def test_negative_or_nan_scale_is_400_and_changes_no_adapter(model, files):
  """A negative or NaN scale in POST /lora-adapters or POST /lora-adapters/load: 400 naming
  the scale; the listing stays as it was (no scale set, no adapter added, no id used)."""
  with start_server(_engine(model, files[:2])) as s:
    before = httpx.get(f"{s.url}/lora-adapters").json()
    post = lambda path, text: httpx.post(f"{s.url}{path}", content=text, timeout=60,
                                         headers={"content-type": "application/json"})
    for bad in ("-0.5", "NaN"):   # (raw JSON: httpx does not write NaN)
      # a valid entry first: the call must not apply it and then fail
      msg = _error(post("/lora-adapters", f'[{{"id": 0, "scale": 0.25}}, '
                                          f'{{"id": 1, "scale": {bad}}}]'), 400)
      assert "adapter 1" in msg and "scale must be a finite number >= 0" in msg, msg
      assert httpx.get(f"{s.url}/lora-adapters").json() == before
      msg = _error(post("/lora-adapters/load", f'{{"path": "{files[2]}", "scale": {bad}}}'),
                   400)
      assert "scale must be a finite number >= 0" in msg and str(files[2]) in msg, msg
      assert httpx.get(f"{s.url}/lora-adapters").json() == before
    r = httpx.post(f"{s.url}/lora-adapters/load", json={"path": files[2]}, timeout=60)
    assert r.status_code == 200 and r.json()["id"] == 2, "a refused load takes no id"


def _choice(rng, ids, default=True):
  kind = rng.integers(0, 4)
  if kind == 0:
    return False
  if kind == 1:   # the default: every loaded adapter at its default scale, fixed at submit
    return None if default else [{"id": int(rng.choice(ids))}]
  picked = rng.choice(ids, size=min(len(ids), int(kind) - 1), replace=False)
  return [{"id": int(i), "scale": float(rng.choice([0.5, 1.0, 1.5]))} for i in picked]


def test_concurrent_stress_with_a_hot_load(model, files, tmp_path):
  """60 requests, 4 at a time, random adapter choices; mid-run, with requests in flight, an
  adapter no request uses is unloaded and another hot-loaded into its columns: no errors, and
  every answer (N_STRESS tokens) equals its request run alone under the same adapter table."""
  rng = np.random.default_rng(19)
  prefix = [int(t) for t in rng.integers(0, TINY.vocab_size, 40)]
  prompts = [prefix[:int(rng.integers(10, 40))] + [int(t) for t in rng.integers(0, 256, 3)]
             for _ in range(60)]
  # id 3 is never asked for: the first half names ids 0-2 or none (never the default, which
  # would include it), and it is unloaded before the second half
  unused = write_adapter(tmp_path / "unused.gguf", TINY, rank=32, seed=40)[0]
  eng = _engine(model, files[:3] + [unused], _HoldableEngine, decode_steps=STRESS_STEPS)
  unused_cols = set(eng.adapters.entries[3].columns.tolist())
  results = {}
  with start_server(eng) as s, concurrent.futures.ThreadPoolExecutor(4) as pool:
    first = {pool.submit(_complete, s.url, prompts[i], c, N_STRESS): (i, c)
             for i, c in ((i, _choice(rng, [0, 1, 2], default=False)) for i in range(30))}
    deadline = time.monotonic() + 120
    while sum(f.done() for f in first) < 10:
      assert time.monotonic() < deadline
      time.sleep(0.01)
    # hold the worker after a step that leaves >= 2 requests with tokens still to compute, then
    # unload and hot-load between two of their steps
    eng.hold(2)
    try:
      assert eng.held.wait(120), "no step left two requests computing"
      r = httpx.post(f"{s.url}/lora-adapters/unload", json={"id": 3}, timeout=60)
      assert r.status_code == 200 and r.json()["deferred"] is False, r.text
      r = httpx.post(f"{s.url}/lora-adapters/load", json={"path": files[3]}, timeout=120)
      assert r.status_code == 200 and r.json()["id"] == 4, r.text
    finally:
      eng.release()
      httpx.get(f"{s.url}/lora-adapters")   # a call: wakes the held worker
    assert _ids(s.url) == [0, 1, 2, 4]
    # (the default, none or true, means adapters 0, 1, 2, 4 from here on)
    second = {pool.submit(_complete, s.url, prompts[i], c, N_STRESS): (i, c)
              for i, c in ((i, _choice(rng, [0, 1, 2, 4])) for i in range(30, 60))}
    for fut, (i, c) in {**first, **second}.items():
      resp = fut.result()
      assert resp.status_code == 200, (i, resp.text)
      results[i] = (c, resp.json()["choices"][0]["tokens"])
  assert [(name, held) for name, _, held in eng.calls] == [("unload", True), ("load", True)]
  assert min(n for _, n, _ in eng.calls) >= 2, eng.calls
  assert all(len(results[i][1]) == N_STRESS for i in range(60))
  # the load reused the unloaded adapter's columns: the table did not grow
  assert set(eng.adapters.entries[4].columns.tolist()) <= unused_cols and eng.adapters.rank == 64
  alone = _engine(model, files[:3] + [unused], decode_steps=STRESS_STEPS)  # the server's table
  alone.unload_adapter(3)
  assert alone.load_adapter(sj.load_lora(model, [files[3]])) == 4
  assert np.array_equal(alone.adapters.entries[4].columns, eng.adapters.entries[4].columns)
  for i in range(60):
    c, tokens = results[i]
    ref = alone.run([Request(tokens=prompts[i], max_tokens=N_STRESS, lora=c)])[0]
    assert ref.tokens == tokens, (i, c)


def test_server_lora_list_equals_python_request(model, files):
  """`"lora": [...]` over HTTP is the engine's `Request(lora=[...])`."""
  choice = [{"id": 0, "scale": 0.5}, {"id": 1, "scale": 2.0}]
  prompt = [7, 7, 1, 2, 3]
  want = _engine(model, files[:2]).generate(tokens=prompt, max_tokens=4, lora=choice).tokens
  with start_server(_engine(model, files[:2])) as s:
    got = _complete(s.url, prompt, choice).json()["choices"][0]["tokens"]
  assert got == want
