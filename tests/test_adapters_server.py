"""The server's adapters as llama.cpp's: GET / POST /lora-adapters, per-request
`"lora": [{"id", "scale"}]`, hot load and unload, and a concurrent stress with random adapter
choices and a hot load mid-run (issue 19 §2)."""
import concurrent.futures

import httpx
import numpy as np
import pytest
from adapter_fixtures import write_adapter
from model_fixtures import TINY, tiny_model
from server_fixtures import start_server

import strata_jax as sj
from strata_jax.engine.engine import Request

SLOTS, SEQ, BS = 4, 128, 32


@pytest.fixture(scope="module")
def model():
  return tiny_model()


@pytest.fixture(scope="module")
def files(model, tmp_path_factory):
  d = tmp_path_factory.mktemp("adapters")
  return [write_adapter(d / f"a{i}.gguf", TINY, rank=4 + 4 * i, seed=20 + i)[0]
          for i in range(4)]


def _engine(model, files):
  lora = [(sj.load_lora(model, [f]), 1.0, f) for f in files]
  return sj.Engine(model, lora=lora, slots=SLOTS, max_seq=SEQ, block_size=BS)


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


def _choice(rng, ids, default=True):
  kind = rng.integers(0, 4)
  if kind == 0:
    return False
  if kind == 1:   # the default: every loaded adapter at its default scale, fixed at submit
    return None if default else [{"id": int(rng.choice(ids))}]
  picked = rng.choice(ids, size=min(len(ids), int(kind) - 1), replace=False)
  return [{"id": int(i), "scale": float(rng.choice([0.5, 1.0, 1.5]))} for i in picked]


def test_concurrent_stress_with_a_hot_load(model, files):
  """60 requests, 4 at a time, random adapter choices, a hot load mid-run: no errors, and
  every answer equals its request run alone on an engine with the same adapters."""
  rng = np.random.default_rng(19)
  prefix = [int(t) for t in rng.integers(0, TINY.vocab_size, 40)]
  prompts = [prefix[:int(rng.integers(10, 40))] + [int(t) for t in rng.integers(0, 256, 3)]
             for _ in range(60)]
  eng = _engine(model, files[:3])
  results = {}
  with start_server(eng) as s, concurrent.futures.ThreadPoolExecutor(4) as pool:
    first = {pool.submit(_complete, s.url, prompts[i], c, 3): (i, c)
             for i, c in ((i, _choice(rng, [0, 1, 2], default=False)) for i in range(30))}
    r = httpx.post(f"{s.url}/lora-adapters/load", json={"path": files[3]}, timeout=120)
    assert r.status_code == 200 and r.json()["id"] == 3
    # (the default, none or true, means every adapter from here on: asked after the load)
    second = {pool.submit(_complete, s.url, prompts[i], c, 3): (i, c)
              for i, c in ((i, _choice(rng, [0, 1, 2, 3])) for i in range(30, 60))}
    for fut, (i, c) in {**first, **second}.items():
      resp = fut.result()
      assert resp.status_code == 200, (i, resp.text)
      results[i] = (c, resp.json()["choices"][0]["tokens"])
  assert len(results) == 60
  alone = _engine(model, files)          # ids 0..3, as the server had them after the load
  for i in range(60):
    c, tokens = results[i]
    ref = alone.run([Request(tokens=prompts[i], max_tokens=3, lora=c)])[0]
    assert ref.tokens == tokens, (i, c)


def test_server_lora_list_equals_python_request(model, files):
  """`"lora": [...]` over HTTP is the engine's `Request(lora=[...])`."""
  choice = [{"id": 0, "scale": 0.5}, {"id": 1, "scale": 2.0}]
  prompt = [7, 7, 1, 2, 3]
  want = _engine(model, files[:2]).generate(tokens=prompt, max_tokens=4, lora=choice).tokens
  with start_server(_engine(model, files[:2])) as s:
    got = _complete(s.url, prompt, choice).json()["choices"][0]["tokens"]
  assert got == want
