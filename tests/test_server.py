"""HTTP server: a real uvicorn on 127.0.0.1 driven by the official openai / anthropic clients.

One adapter server and one no-adapter server per module (same engine shapes everywhere, so the
jitted steps compile once); the slot-session test and the fuzz test start their own servers on
new engines of the same shapes.
"""
import concurrent.futures
import json
import threading
import time

import anthropic
import httpx
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, settings
from model_fixtures import random_lora
from server_fixtures import start_server
from tolerances import SPEC_STATE_REL_FP32, assert_close

import strata_jax as sj
from strata_jax.cli import main as cli_main
from strata_jax.engine.engine import Handle

SLOTS, CTX = 4, 512
SYSTEM = ("You are a careful assistant. Answer briefly, check every number twice, and say so "
          "when you do not know. Prefer plain words to jargon, short sentences to long ones, "
          "and examples to abstractions. Keep code small and readable; name things well; "
          "explain why, not what.")


@pytest.fixture(scope="module")
def model():
  return sj.load_model()


@pytest.fixture(scope="module")
def lora(model):
  return random_lora(cfg=model.cfg, rank=4, seed=1, scale=0.5)


def _engine(model, lora=None):
  return sj.Engine(model, lora=lora, slots=SLOTS, max_seq=CTX)


@pytest.fixture(scope="module")
def srv(model, lora, tmp_path_factory):
  s = start_server(_engine(model, lora), slot_save_path=str(tmp_path_factory.mktemp("slots")))
  yield s
  s.stop()


@pytest.fixture(scope="module")
def base_srv(model):
  s = start_server(_engine(model))
  yield s
  s.stop()


def _oai(s):
  return openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0, timeout=120)


def _anth(s):
  return anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0, timeout=120)


def _chat(s, content, lora=None, max_tokens=8, system=SYSTEM, **kw):
  extra = {} if lora is None else {"lora": lora}
  return _oai(s).chat.completions.create(
      model="demo", messages=[{"role": "system", "content": system},
                              {"role": "user", "content": content}],
      max_tokens=max_tokens, temperature=0, extra_body=extra, **kw)


def _complete(s, prompt, **body):
  r = httpx.post(f"{s.url}/v1/completions", timeout=120,
                 json={"prompt": prompt, "temperature": 0, "return_tokens": True, **body})
  assert r.status_code == 200, r.text
  return r


# ---------------------------------------------------------------------------------------------
def test_health_and_models(srv):
  h = httpx.get(f"{srv.url}/health").json()
  assert h["status"] == "ok" and h["slots"] == SLOTS and h["lora"] is True
  assert [m.id for m in _oai(srv).models.list()] == ["demo"]
  assert [m.id for m in _anth(srv).models.list()] == ["demo"]
  assert _oai(srv).models.retrieve("demo").id == "demo"


def test_openai_chat_complete_and_stream(srv):
  full = _chat(srv, "Name three colours.", lora=False)
  assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
  assert full.usage.prompt_tokens > 64 and full.usage.completion_tokens >= 1
  parts, usage, finish = [], None, None
  for c in _chat(srv, "Name three colours.", lora=False, stream=True,
                 stream_options={"include_usage": True}):
    if c.choices:
      parts.append(c.choices[0].delta.content or "")
      finish = c.choices[0].finish_reason or finish
    else:
      usage = c.usage
  assert "".join(parts) == full.choices[0].message.content
  assert finish == full.choices[0].finish_reason
  assert usage.completion_tokens == full.usage.completion_tokens
  # the repeat in the same state reads the cached prompt prefix
  assert usage.prompt_tokens_details.cached_tokens > 0


def test_openai_completions_complete_and_stream(srv):
  oai = _oai(srv)
  full = oai.completions.create(model="demo", prompt="The capital of France is", max_tokens=6,
                                temperature=0)
  chunks = list(oai.completions.create(model="demo", prompt="The capital of France is",
                                       max_tokens=6, temperature=0, stream=True))
  assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
  assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_a_decode_chunk_streams_as_one_event(base_srv):
  """The worker hands a step's tokens to the loop at once and the stream sends them as one
  delta: fewer text events than tokens, the same text as the answer in one piece."""
  body = {"prompt": "Count: one two three", "max_tokens": 12, "temperature": 0,
          "return_tokens": True}
  full = _complete(base_srv, **body).json()
  with httpx.stream("POST", f"{base_srv.url}/v1/completions", timeout=120,
                    json={**body, "stream": True}) as r:
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
             if line.startswith("data: {")]
  texts = [t for t in texts if t]
  n = len(full["choices"][0]["tokens"])
  assert "".join(texts) == full["choices"][0]["text"]
  assert n >= 6 and len(texts) <= n // 2, (n, texts)


def test_anthropic_messages_complete_and_stream(srv):
  ac = _anth(srv)
  kw = {"model": "demo", "max_tokens": 8, "system": SYSTEM,
        "messages": [{"role": "user", "content": "Write a haiku."}],
        "extra_body": {"temperature": 0, "lora": True}}
  msg = ac.messages.create(**kw)
  assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "text"
  assert msg.stop_reason in ("end_turn", "max_tokens")
  assert msg.usage.output_tokens >= 1
  with ac.messages.stream(**kw) as stream:
    kinds = [e.type for e in stream]
    final = stream.get_final_message()
  for k in ("message_start", "content_block_start", "content_block_delta", "content_block_stop",
            "message_delta", "message_stop"):
    assert k in kinds, kinds
  assert final.content[0].text == msg.content[0].text
  assert final.stop_reason == msg.stop_reason
  assert final.usage.cache_read_input_tokens > 0    # the repeat reads the cached prefix
  assert (final.usage.input_tokens + final.usage.cache_read_input_tokens
          == msg.usage.input_tokens + msg.usage.cache_read_input_tokens)


def test_lora_switch_per_request(srv, base_srv):
  q = "List the planets in order."
  ref = _chat(base_srv, q).choices[0].message.content
  off = _chat(srv, q, lora=False)
  on = _chat(srv, q, lora=True)
  assert off.choices[0].message.content == ref
  assert on.choices[0].message.content != ref
  assert _chat(srv, q).choices[0].message.content == on.choices[0].message.content  # default on
  # Anthropic, same rule
  ac = _anth(base_srv), _anth(srv)
  kw = {"model": "demo", "max_tokens": 8, "messages": [{"role": "user", "content": q}]}
  base_text = ac[0].messages.create(**kw, extra_body={"temperature": 0}).content[0].text
  off_text = ac[1].messages.create(**kw, extra_body={"temperature": 0, "lora": False})
  assert off_text.content[0].text == base_text and off_text.model_extra["lora"] is False


def test_cached_tokens_follow_the_switch(srv):
  q = "Explain what a prefix cache is, in one sentence."
  system = "Nobody has sent this system prompt before. " + SYSTEM   # no cached blocks yet
  first = _chat(srv, q, lora=True, system=system)
  other = _chat(srv, q, lora=False, system=system)
  again = _chat(srv, q, lora=False, system=system)
  on_again = _chat(srv, q, lora=True, system=system)
  assert first.usage.prompt_tokens_details.cached_tokens == 0
  assert other.usage.prompt_tokens_details.cached_tokens == 0, "another state reads 0 cached"
  assert again.usage.prompt_tokens_details.cached_tokens > 0
  assert on_again.usage.prompt_tokens_details.cached_tokens > 0
  assert again.choices[0].message.content == other.choices[0].message.content
  assert on_again.choices[0].message.content == first.choices[0].message.content


def test_stop_strings(srv):
  oai = _oai(srv)
  # the random adapter rambles on: no early end of text
  kw = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
        "extra_body": {"lora": True}}
  text = oai.completions.create(**kw).choices[0].text
  assert len(text) >= 4, text
  stop = text[len(text) // 2:len(text) // 2 + 2]
  cut = text[:text.find(stop)]
  r = oai.completions.create(**kw, stop=[stop])
  assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
  full_tokens = oai.completions.create(**kw).usage.completion_tokens
  assert r.usage.completion_tokens < full_tokens, "a matched stop string ends generation early"
  streamed = "".join(c.choices[0].text for c in oai.completions.create(**kw, stop=[stop],
                                                                       stream=True))
  assert streamed == cut
  msg = _anth(srv).messages.create(
      model="demo", max_tokens=12, stop_sequences=[stop],
      messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once"}],
      extra_body={"temperature": 0})
  assert stop not in msg.content[0].text
  assert msg.stop_reason in ("stop_sequence", "end_turn", "max_tokens")
  if msg.stop_reason == "stop_sequence":
    assert msg.stop_sequence == stop


def test_speculative_body_gives_plain_greedy_tokens_and_logprobs(srv):
  """`"speculative": {"n": 3}` in the body (the demo model's MTP head drafts): the tokens of
  plain greedy decoding, with its logprobs entries (the same top ids; values to the
  verification's rounding), adapter on and off."""
  for lora in (True, False):
    body = {"prompt": "The capital of France is", "max_tokens": 12, "logprobs": 2, "lora": lora}
    plain = _complete(srv, **body).json()["choices"][0]
    spec = _complete(srv, speculative={"n": 3}, **body).json()["choices"][0]
    assert spec["tokens"] == plain["tokens"] and spec["text"] == plain["text"]
    got, want = spec["logprobs"], plain["logprobs"]
    assert got["tokens"] == want["tokens"]
    assert [list(t) for t in got["top_logprobs"]] == [list(t) for t in want["top_logprobs"]]
    assert_close(got["token_logprobs"], want["token_logprobs"], rel=SPEC_STATE_REL_FP32,
                 what=f"logprobs, lora={lora}")


def test_openai_logprobs_shapes_complete_and_stream(srv):
  """Chat `logprobs` / `top_logprobs` and completions `logprobs` in OpenAI's shapes, the same
  entries streamed; greedy: the chosen token is the most likely one."""
  full = _chat(srv, "Name three colours.", lora=False, logprobs=True, top_logprobs=3)
  lp = full.choices[0].logprobs.content
  text = full.choices[0].message.content
  assert len(lp) >= 1 and len(lp) <= full.usage.completion_tokens, len(lp)
  assert b"".join(bytes(e.bytes) for e in lp).decode() == text
  for e in lp:
    assert len(e.top_logprobs) == 3 and e.logprob <= 0
    assert e.token == e.top_logprobs[0].token and e.logprob == e.top_logprobs[0].logprob
    assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs),
                                                         reverse=True)
  streamed = []
  for c in _chat(srv, "Name three colours.", lora=False, logprobs=True, top_logprobs=3,
                 stream=True):
    if c.choices and c.choices[0].logprobs is not None:
      streamed += c.choices[0].logprobs.content
  assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in streamed] == \
      [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in lp]
  assert _chat(srv, "Name three colours.", lora=False).choices[0].logprobs is None
  # completions: tokens, token_logprobs, top_logprobs (k most likely + the chosen), text_offset
  body = {"prompt": "The capital of France is", "max_tokens": 6, "logprobs": 2}
  c = _complete(srv, **body).json()["choices"][0]
  clp = c["logprobs"]
  assert set(clp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
  n = len(clp["tokens"])
  assert n == len(c["tokens"]) and "".join(clp["tokens"]) == c["text"]
  assert clp["text_offset"] == [sum(map(len, clp["tokens"][:i])) for i in range(n)]
  for tok, x, top in zip(clp["tokens"], clp["token_logprobs"], clp["top_logprobs"]):
    assert len(top) == 2 and top[tok] == x == max(top.values())
  r = httpx.post(f"{srv.url}/v1/completions", timeout=120,
                 json={**body, "temperature": 0, "stream": True})
  chunks = [json.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: {")]
  got = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
  for ch in chunks:
    if ch["choices"] and ch["choices"][0]["logprobs"]:
      for k in got:
        got[k] += ch["choices"][0]["logprobs"][k]
  assert got == clp


def test_bad_sampling_parameters_answer_400_naming_them(srv):
  cases = [("/v1/chat/completions", {"temperature": -0.5}, "temperature"),
           ("/v1/chat/completions", {"top_p": 1.5}, "top_p"),
           ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
           ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
           ("/v1/chat/completions", {"min_p": 2.0}, "min_p"),
           ("/v1/completions", {"top_p": -0.1}, "top_p"),
           ("/v1/completions", {"logprobs": 21}, "logprobs"),
           ("/v1/completions", {"repeat_penalty": 0}, "repeat_penalty"),
           ("/v1/completions", {"top_k": -3}, "top_k"),
           ("/v1/messages", {"temperature": -1}, None)]
  for path, extra, param in cases:
    base = ({"prompt": [1, 2], "max_tokens": 1} if path == "/v1/completions" else
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
    r = httpx.post(f"{srv.url}{path}", json={**base, **extra}, timeout=60)
    assert r.status_code == 400, (path, extra, r.text)
    if param is None:   # Anthropic's shape has no param: the message names it
      assert "temperature" in r.json()["error"]["message"]
    else:
      assert r.json()["error"]["param"] == param, r.text
      assert param in r.json()["error"]["message"]
  # NaN (Python's JSON reads it): named, never clamped
  r = httpx.post(f"{srv.url}/v1/completions", timeout=60,
                 headers={"content-type": "application/json"},
                 content=b'{"prompt": [1, 2], "max_tokens": 1, "temperature": NaN}')
  assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text


def test_errors_use_each_api_shape(srv, base_srv):
  u = srv.url

  def post(path, **kw):
    return httpx.post(f"{u}{path}", timeout=60, **kw)

  def openai_error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err

  def anthropic_error(r, status):
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    return body["error"]

  openai_error(post("/v1/chat/completions", content=b"{not json"), 400)
  openai_error(post("/v1/chat/completions", content=b""), 400)
  openai_error(post("/v1/chat/completions", json={"messages": "hi"}), 422)
  openai_error(post("/v1/completions", json={"prompt": "x", "max_tokens": "many"}), 422)
  openai_error(post("/v1/completions", json={"prompt": [1, 2], "lora": "yes"}), 422)
  openai_error(post("/v1/completions", json={"prompt": [10**6], "max_tokens": 1}), 400)
  too_long = openai_error(post("/v1/completions", json={"prompt": [1] * CTX}), 413)
  assert too_long["code"] == "context_length_exceeded"
  assert "lora" in openai_error(httpx.post(f"{base_srv.url}/v1/completions", json={
      "prompt": [1, 2], "max_tokens": 1, "lora": True}), 400)["message"]
  openai_error(httpx.get(f"{u}/v1/nothing"), 404)
  openai_error(post("/v1/completions", json={"prompt": [1], "n": 3}), 400)
  assert anthropic_error(post("/v1/messages", content=b"{"), 400)["type"] == \
      "invalid_request_error"
  anthropic_error(post("/v1/messages", json={"messages": [{"role": "user", "content": "x"}]}),
                  422)   # max_tokens is required
  assert anthropic_error(post("/v1/messages", json={
      "max_tokens": 1, "messages": [{"role": "user", "content": "x " * 600}]}), 413)["type"] == \
      "request_too_large"
  with pytest.raises(anthropic.BadRequestError):
    _anth(base_srv).messages.create(model="demo", max_tokens=1, extra_body={"lora": True},
                                    messages=[{"role": "user", "content": "x"}])
  # slots: unknown slot, escaping names, missing file, unsupported without --slot-save-path
  openai_error(post(f"/slots/{SLOTS}?action=save", json={"filename": "a"}), 404)
  for name in ["../x", "/etc/passwd", "a/b", "..", ".hidden", ""]:
    openai_error(post("/slots/0?action=restore", json={"filename": name}), 400)
  openai_error(post("/slots/0?action=restore", json={"filename": "missing"}), 404)
  openai_error(post("/slots/0?action=fly", json={"filename": "a"}), 422)
  assert "--slot-save-path" in openai_error(httpx.post(
      f"{base_srv.url}/slots/0?action=save", json={"filename": "a"}), 400)["message"]
  # a JSON body is read whatever the Content-Type says (curl -d)
  r = post("/v1/completions", content=json.dumps({"prompt": [1, 2], "max_tokens": 1}).encode(),
           headers={"content-type": "application/x-www-form-urlencoded"})
  assert r.status_code == 200, r.text
  assert httpx.get(f"{u}/health").status_code == 200


def test_slot_save_restore_continues_after_restart(model, lora, tmp_path):
  rng = np.random.default_rng(7)
  prompt = [int(t) for t in rng.integers(0, 4000, 100)]
  body = {"max_tokens": 8, "lora": True}
  with start_server(_engine(model, lora), slot_save_path=str(tmp_path)) as a:
    r1 = _complete(a, prompt, **body)
    slot, gen = int(r1.headers["x-slot-id"]), r1.json()["choices"][0]["tokens"]
    saved = httpx.post(f"{a.url}/slots/{slot}?action=save", json={"filename": "conv"}).json()
    assert saved["id_slot"] == slot and saved["n_saved"] == len(prompt) + len(gen) - 1
    assert saved["n_written"] > 0 and "save_ms" in saved["timings"]
    turn2 = prompt + gen + [11, 12, 13]
    uninterrupted = _complete(a, turn2, **body).json()
  with start_server(_engine(model, lora), slot_save_path=str(tmp_path)) as b:
    restored = httpx.post(f"{b.url}/slots/2?action=restore", json={"filename": "conv"}).json()
    assert restored["n_restored"] == saved["n_saved"] and restored["lora"] is True
    resumed = _complete(b, turn2, **body)
    assert resumed.headers["x-slot-id"] == "2"
    resumed = resumed.json()
    assert resumed["usage"]["prompt_tokens_details"]["cached_tokens"] == saved["n_saved"]
    assert uninterrupted["usage"]["prompt_tokens_details"]["cached_tokens"] == saved["n_saved"]
    assert resumed["choices"][0]["tokens"] == uninterrupted["choices"][0]["tokens"]
    assert resumed["choices"][0]["text"] == uninterrupted["choices"][0]["text"]
    erased = httpx.post(f"{b.url}/slots/0?action=erase", json={"filename": "conv"}).json()
    assert erased["n_erased"] == saved["n_saved"]
    assert httpx.post(f"{b.url}/slots/0?action=restore",
                      json={"filename": "conv"}).status_code == 404


def test_load_mixed_lora_shared_prefix(srv):
  rng = np.random.default_rng(3)
  prefix = [int(t) for t in rng.integers(0, 4000, 400)]
  distinct = [(prefix + [int(t) for t in rng.integers(0, 4000, 1 + i % 5)], i % 2 == 0)
              for i in range(12)]
  want = {}
  for i, (p, sw) in enumerate(distinct):
    want[i] = _complete(srv, p, max_tokens=6, lora=sw).json()["choices"][0]["tokens"]
  jobs = [i % len(distinct) for i in range(60)]
  client = httpx.Client(timeout=120)

  def one(i):
    p, sw = distinct[i]
    r = client.post(f"{srv.url}/v1/completions", json={
        "prompt": p, "max_tokens": 6, "temperature": 0, "lora": sw, "return_tokens": True})
    return i, r.status_code, r.json()

  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    results = list(pool.map(one, jobs))
  elapsed = time.perf_counter() - t0
  client.close()
  assert [s for _, s, _ in results] == [200] * 60
  for i, _, body in results:
    assert body["choices"][0]["tokens"] == want[i], i
    assert body["lora"] is distinct[i][1]
  assert sum(b["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for _, _, b in results) > 50
  assert httpx.get(f"{srv.url}/health").json()["status"] == "ok", elapsed


# ---------------------------------------------------------------------------------------------
class _FakeEngine:
  """Stands in for the Engine to drive the worker's failure paths without compiling."""

  def __init__(self, model, on_step):
    self.model, self.has_lora, self.max_seq, self.n_slots = model, False, 64, 1
    self.handles, self.on_step = [], on_step

  def submit(self, req):
    self.handles.append(Handle(req))
    return self.handles[-1]

  @property
  def busy(self):
    return any(not h.done for h in self.handles)

  def step(self):
    self.on_step(self)


def _finish_all(eng):
  for h in eng.handles:
    if not h.done:
      h.req.on_token(7)
      h.result = sj.Result(prompt_tokens=list(h.req.tokens), tokens=[7], lora=False,
                           finish_reason="length", cached_tokens=0,
                           prompt_tokens_computed=len(h.req.tokens), ttft_s=0.0,
                           decode_tokens_per_s=0.0, slot=0)


def test_dead_worker_answers_503(model):
  def boom(eng):
    raise RuntimeError("device lost")

  with start_server(_FakeEngine(model, boom)) as s:
    r = httpx.post(f"{s.url}/v1/completions", json={"prompt": [1], "max_tokens": 1})
    assert r.status_code == 503 and "device lost" in r.json()["error"]["message"]
    assert httpx.get(f"{s.url}/health").status_code == 503
    r = httpx.post(f"{s.url}/v1/messages", json={
        "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 503 and r.json()["type"] == "error"


def test_overloaded_answers_503(model):
  release = threading.Event()

  def slow(eng):
    time.sleep(0.01)
    if release.is_set():
      _finish_all(eng)

  with (start_server(_FakeEngine(model, slow), max_pending=2) as s,
        concurrent.futures.ThreadPoolExecutor(2) as pool):
    held = [pool.submit(httpx.post, f"{s.url}/v1/completions",
                        json={"prompt": [1], "max_tokens": 1}, timeout=60) for _ in range(2)]
    deadline = time.monotonic() + 30
    while httpx.get(f"{s.url}/health").json()["pending"] < 2:
      assert time.monotonic() < deadline
      time.sleep(0.02)
    r = httpx.post(f"{s.url}/v1/completions", json={"prompt": [1], "max_tokens": 1})
    assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
    release.set()
    assert [f.result().status_code for f in held] == [200, 200]


def test_a_first_token_streams_before_the_step_that_made_it_ends(model):
  """A step that admits a burst of requests prefills them one after another: each request's
  first token reaches its client at once, not when the whole step (every prefill and the
  previous decode chunk's read) is over. The fake step emits the first token, then waits for
  the client to have read it."""
  seen = threading.Event()
  waited = []

  def step(eng):
    for h in eng.handles:
      if not h.done and not waited:
        h.req.on_token(7)
        waited.append(seen.wait(20))   # False: the token was held until the step's end
    _finish_all(eng)

  with start_server(_FakeEngine(model, step)) as s:
    with httpx.stream("POST", f"{s.url}/v1/completions", timeout=60,
                      json={"prompt": [1], "max_tokens": 1, "stream": True}) as r:
      for line in r.iter_lines():
        if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
          seen.set()
  assert waited == [True]


def test_serve_config_errors(tmp_path, capsys):
  cases = {"bad.json": "{not json", "top.json": '{"sampling": {}, "extra": 1}',
           "key.json": '{"sampling": {"temp": 0.5}}', "type.json": '{"sampling": {"top_p": 2}}',
           "lora.json": '{"sampling": {"lora": true}}'}
  for name, text in cases.items():
    (tmp_path / name).write_text(text)
    assert cli_main(["serve", "--config", str(tmp_path / name), "--port", "0"]) == 2, name
    err = capsys.readouterr().err
    assert err.startswith("error: ") and name in err and "Traceback" not in err, err
  assert cli_main(["serve", "--config", str(tmp_path / "missing.json")]) == 2


# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fuzz_server(model, lora, tmp_path_factory):
  s = start_server(_engine(model, lora), slot_save_path=str(tmp_path_factory.mktemp("fuzz")),
                   defaults={"max_tokens": 2, "lora": False}, max_tokens_cap=2)
  yield s
  s.stop()


try:
  import schemathesis
except ImportError:   # the `test` extra brings it
  schemathesis = None


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
  return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")


def _no_server_errors(case, fuzz_server):
  r = case.call(base_url=fuzz_server.url, timeout=120)
  assert r.status_code < 500, f"{case.method} {case.formatted_path}: {r.status_code} {r.text}"
  if r.status_code >= 400:
    assert "error" in r.json(), r.text


if schemathesis is not None:
  # Every route of the app's own OpenAPI schema: schema-conforming and violating bodies, path
  # and query values (the coverage phase adds boundary cases to the 30 random ones per route;
  # 60 took 86 s of the suite on 2 cores).
  test_fuzz_no_server_errors = schemathesis.pytest.from_fixture("api_schema").parametrize()(
      settings(max_examples=30, deadline=None, derandomize=True, database=None,
               suppress_health_check=list(HealthCheck))(_no_server_errors))
else:
  def test_fuzz_no_server_errors():
    pytest.skip("schemathesis is not installed (pip install -e .[test])")


def test_fuzz_server_still_healthy_and_defaults_apply(fuzz_server):
  assert httpx.get(f"{fuzz_server.url}/health").json()["status"] == "ok"
  r = _complete(fuzz_server, [1, 2, 3], max_tokens=50).json()
  assert r["lora"] is False and r["usage"]["completion_tokens"] <= 2
