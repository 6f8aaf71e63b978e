"""The public CLI contract (DESIGN.md): flags, --json, --dump-logits arrays, exit status 2."""
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from adapter_fixtures import write_adapter
from model_fixtures import TINY
from tolerances import KERNEL_REL, assert_close

from strata_jax.gguf.convert_hf import write_model_gguf
from strata_jax.gguf.names import params_to_gguf_tensors
from strata_jax.params import init_params, params_to_flat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  d = tmp_path_factory.mktemp("cli")
  params = init_params(TINY, 0, scale=0.1)
  flat = {k: np.asarray(v, np.float32) for k, v in params_to_flat(params).items()}
  model = str(d / "tiny.gguf")
  write_model_gguf(model, TINY, params_to_gguf_tensors(TINY, flat))
  a, _ = write_adapter(d / "a.gguf", TINY, rank=4, alpha=8.0, seed=1)
  b, _ = write_adapter(d / "b.gguf", TINY, rank=2, alpha=0.0, seed=2)
  return d, model, a, b


def cli(*args, check=True):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  p = subprocess.run([sys.executable, "-m", "strata_jax", *args], capture_output=True, text=True,
                     env=env, timeout=600)
  if check:
    assert p.returncode == 0, p.stderr[-2000:]
  return p


def test_generate_json_and_dump_logits(files):
  d, model, a, b = files
  out = d / "on.npz"
  p = cli("generate", "--model", model, "--lora", a, "--lora-scaled", f"{b}:0.5",
          "--prompt-tokens", "5,6,7,8,9", "-n", "4", "--json", "--dump-logits", str(out),
          "--logprobs", "3")
  res = json.loads(p.stdout.strip().splitlines()[-1])
  assert set(res) == {"prompt_tokens", "tokens", "text", "lora", "logprobs"}
  assert res["prompt_tokens"] == [5, 6, 7, 8, 9] and len(res["tokens"]) == 4 and res["lora"] is True
  z = np.load(out)
  assert not (d / "on.npz.part").exists()
  assert z["prompt"].shape == (5, TINY.vocab_size) and z["prompt"].dtype == np.float32
  assert np.array_equal(z["prompt_last"], z["prompt"][-1])
  assert z["steps"].shape == (4, TINY.vocab_size)
  assert res["tokens"][0] == int(np.argmax(z["prompt_last"]))
  assert [int(np.argmax(s)) for s in z["steps"]] == res["tokens"]
  # --logprobs K: [{"token": id, "logprob": x, "top": {id: x, ...}}] per token (DESIGN.md),
  # log_softmax of the logits the token was chosen from
  zs = z["steps"].astype(np.float64)
  lsm = zs - zs.max(-1, keepdims=True)
  lsm -= np.log(np.exp(lsm).sum(-1, keepdims=True))
  assert [e["token"] for e in res["logprobs"]] == res["tokens"]
  for i, e in enumerate(res["logprobs"]):
    assert set(e) == {"token", "logprob", "top"} and len(e["top"]) == 3
    assert_close(e["logprob"], lsm[i, e["token"]], rel=KERNEL_REL["float32"], what="logprob")
    ids = [int(k) for k in e["top"]]
    assert ids == list(np.argsort(-lsm[i], kind="stable")[:3])
    assert_close(list(e["top"].values()), lsm[i, ids], rel=KERNEL_REL["float32"], what="top")
  # --lora-off loads the adapters but is bit-identical to no adapter at all
  cli("generate", "--model", model, "--lora", a, "--lora-off", "--prompt-tokens", "5,6,7,8,9",
      "-n", "4", "--dump-logits", str(d / "off.npz"))
  cli("generate", "--model", model, "--prompt-tokens", "5,6,7,8,9", "-n", "4",
      "--dump-logits", str(d / "base.npz"))
  off, base = np.load(d / "off.npz"), np.load(d / "base.npz")
  for k in ("prompt", "prompt_last", "steps"):
    assert np.array_equal(off[k], base[k]), k
  assert not np.array_equal(z["prompt"], base["prompt"])


# --lora per occurrence: a numbered adapter; --lora A,B: one adapter stacking both files
# (docs/adapters.md). Listed as (id, path, rank): a is rank 4, b rank 2.
LORA_FORMS = {
    "numbered": (lambda a, b: ["--lora", a, "--lora", b],
                 lambda a, b: [(0, a, 4), (1, b, 2)]),
    "stacked": (lambda a, b: ["--lora", f"{a},{b}"], lambda a, b: [(0, f"{a},{b}", 6)]),
}


@pytest.mark.parametrize("form", LORA_FORMS)
def test_generate_lora_flags_give_numbered_or_stacked_adapters(files, form, monkeypatch,
                                                               capsys):
  """The engine `generate` builds holds one adapter per --lora flag, ids 0, 1, ...; a
  comma-separated group is one adapter whose rank is the files' sum."""
  import strata_jax as sj  # noqa: PLC0415
  from strata_jax.cli import main as cli_main  # noqa: PLC0415
  _, model, a, b = files
  flags, want = LORA_FORMS[form]
  built = []

  class Recorded(sj.Engine):
    def __init__(self, *args, **kw):
      super().__init__(*args, **kw)
      built.append(self)

  monkeypatch.setattr(sj, "Engine", Recorded)
  assert cli_main(["generate", "--model", model, *flags(a, b), "--prompt-tokens", "5,6,7",
                   "-n", "2", "--json"]) == 0
  res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert res["lora"] is True and len(res["tokens"]) == 2
  (eng,) = built
  got = [(x["id"], x["path"], x["rank"], x["scale"]) for x in eng.lora_adapters()]
  assert got == [(i, path, rank, 1.0) for i, path, rank in want(a, b)]


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_serve_lora_flags_list_numbered_and_stacked_adapters(files, tmp_path):
  """`strata-jax serve --lora A --lora B --lora A,B`: GET /lora-adapters lists three adapters,
  the last stacking both files (one server process checks both forms)."""
  import httpx  # noqa: PLC0415
  _, model, a, b = files
  flags = LORA_FORMS["numbered"][0](a, b) + LORA_FORMS["stacked"][0](a, b)
  want = LORA_FORMS["numbered"][1](a, b) + [(2, f"{a},{b}", 6)]
  port = _free_port()
  log = tmp_path / "serve.log"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  with open(log, "w") as err:
    proc = subprocess.Popen(
        [sys.executable, "-m", "strata_jax", "serve", "--model", model, *flags,
         "--port", str(port), "--slots", "1", "--ctx-size", "64"],
        stdout=subprocess.DEVNULL, stderr=err, env=env)
  try:
    deadline = time.monotonic() + 300
    while True:
      assert proc.poll() is None, log.read_text()[-2000:]
      assert time.monotonic() < deadline, log.read_text()[-2000:]
      try:
        r = httpx.get(f"http://127.0.0.1:{port}/lora-adapters", timeout=10)
        break
      except httpx.TransportError:
        time.sleep(0.2)
    assert r.status_code == 200, r.text
    got = [(x["id"], x["path"], x["rank"], x["scale"]) for x in r.json()]
    assert got == [(i, path, rank, 1.0) for i, path, rank in want]
  finally:
    proc.terminate()
    proc.wait(timeout=60)


@pytest.mark.parametrize("args,needle", [
    (["--model", "/nonexistent.gguf", "--prompt-tokens", "1"], "no such model file"),
    (["--prompt-tokens", "1,x"], "--prompt-tokens"),
    (["--lora-scaled", "nocolon", "--prompt-tokens", "1"], "FILE:SCALE"),
    (["--lora", "/nonexistent-adapter.gguf", "--prompt-tokens", "1"], "nonexistent-adapter"),
    (["--prompt-tokens", "99999999"], "vocabulary"),
    (["--layer-split", "1,x", "--prompt-tokens", "1"], "layer-split"),
    (["--temperature", "-0.5", "--prompt-tokens", "1"], "--temperature"),
    (["--temperature", "nan", "--prompt-tokens", "1"], "--temperature"),
    (["--top-p", "1.5", "--prompt-tokens", "1"], "--top-p"),
    (["--logprobs", "21", "--prompt-tokens", "1"], "--logprobs"),
    # usage mistakes argparse finds: the contract's `error: ...` line too, exit 2
    (["--bogus", "1", "--prompt-tokens", "1"], "unrecognized arguments: --bogus"),
    (["-n", "x", "--prompt-tokens", "1"], "-n"),
    (["--dtype", "float16", "--prompt-tokens", "1"], "--dtype"),
    (["-n", "3"], "--prompt"),   # no prompt: the contract's grammar requires one
    (["--split-devices", "5", "--prompt-tokens", "1"], "--split-devices"),
    (["--prompt-tokens", "1", "--dump-logits", "/nonexistent-dir/z.npz"], "nonexistent-dir"),
])
def test_errors_exit_2_without_traceback(files, args, needle):
  _, model, _, _ = files
  if "--model" not in args:
    args = ["--model", model, *args]
  p = cli("generate", *args, check=False)
  assert p.returncode == 2, p.stderr[-2000:]
  assert p.stderr.strip().splitlines()[-1].startswith("error: ") and needle in p.stderr
  assert "Traceback" not in p.stderr


@pytest.mark.parametrize("module", ["fastapi", "uvicorn"])
def test_serve_without_server_extra_names_it(module):
  """`strata-jax serve` where the server stack is not installed: one line naming the extra."""
  code = (f"import sys; sys.modules[{module!r}] = None; "   # `import` then fails as if absent
          "from strata_jax.cli import main; sys.exit(main(['serve']))")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                     timeout=300)
  assert p.returncode == 2, p.stderr[-2000:]
  last = p.stderr.strip().splitlines()[-1]
  assert last.startswith("error: ") and module in last, p.stderr[-2000:]
  assert "pip install 'strata-jax[serve]'" in last
  assert "Traceback" not in p.stderr


def test_split_devices_alone_split_over_those_devices():
  """`--split-devices` without `--layer-split` is an "auto" split over the devices named (as
  llama.cpp's --device), not ignored: here one stage on device 0, decoding as the unsplit
  model does."""
  import strata_jax as sj  # noqa: PLC0415
  split, plain = sj.load_model(split_devices="0"), sj.load_model()
  assert split.devices is not None and len(split.devices) == 1 and split.params is None
  assert plain.devices is None
  toks = [sj.Engine(m, max_seq=64).generate(tokens=[1, 2, 3], max_tokens=4).tokens
          for m in (split, plain)]
  assert toks[0] == toks[1]


def test_not_a_gguf_exits_2(tmp_path):
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(b"not a gguf at all")
  p = cli("generate", "--model", str(bad), "--prompt-tokens", "1", check=False)
  assert p.returncode == 2 and "error: " in p.stderr and str(bad) in p.stderr


def test_default_model_prints_text():
  p = cli("generate", "--prompt", "The function returns", "-n", "8", "--json")
  res = json.loads(p.stdout.strip().splitlines()[-1])
  assert isinstance(res["text"], str) and res["tokens"] and res["lora"] is False


def _split_env():
  """A subprocess environment with one CPU device (conftest's other XLA flags kept, so every
  run's programs compile alike)."""
  e = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  e["XLA_FLAGS"] = " ".join(f for f in e.get("XLA_FLAGS", "").split() if "device_count" not in f)
  return e


def test_layer_split_on_two_devices_and_on_two_processes_match_one_device(files):
  """One unsplit run, then the same command split two ways: --layer-split / --split-devices
  on two fake CPU devices of one process, and a stage per process on two processes
  (STRATA_COORDINATOR, ...). Both give the unsplit tokens and logits within 1e-6; the split
  run logs its stages, and of the two processes only process 0 prints and writes."""
  d, model, a, _ = files
  common = ["--model", model, "--lora", a, "--prompt-tokens", "3,1,4,1,5,9", "-n", "4", "--json"]
  e = _split_env()

  def run(extra, out, env):
    p = subprocess.run([sys.executable, "-m", "strata_jax", "generate", *common, *extra,
                        "--dump-logits", str(out)], capture_output=True, text=True, env=env,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), np.load(out), p.stderr

  single, zs, _ = run([], d / "single.npz", e)
  two_devices = dict(e, XLA_FLAGS=e["XLA_FLAGS"] + " --xla_force_host_platform_device_count=2")
  split, zp, err = run(["--layer-split", "3,5", "--split-devices", "0,1"], d / "split.npz",
                       two_devices)
  assert "layers 0-2 (dev0), 3-7 (dev1)" in err
  assert split["tokens"] == single["tokens"]
  for k in ("prompt", "steps"):
    assert np.abs(zp[k] - zs[k]).max() <= 1e-6, k

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  procs = [subprocess.Popen(
      [sys.executable, "-m", "strata_jax", "generate", *common, "--layer-split", "3,5",
       "--dump-logits", str(d / f"mp{i}.npz")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True, env=dict(e, STRATA_COORDINATOR=f"127.0.0.1:{port}", STRATA_NUM_PROCESSES="2",
                          STRATA_PROCESS_ID=str(i)))
      for i in range(2)]
  outs = [q.communicate(timeout=600) for q in procs]
  for q, (_, err) in zip(procs, outs):
    assert q.returncode == 0, err[-2000:]
  split = json.loads(outs[0][0].strip().splitlines()[-1])
  # (gloo logs a connection line on stdout; the result is the only JSON line)
  assert not [ln for ln in outs[1][0].splitlines() if ln.startswith("{")]
  assert not (d / "mp1.npz").exists()
  assert split["tokens"] == single["tokens"]
  zp = np.load(d / "mp0.npz")
  for k in ("prompt", "steps"):
    assert np.abs(zp[k] - zs[k]).max() <= 1e-6, k
