"""Control vectors (llama.cpp's control-vector GGUF): the reader, its checks and identity, and
their application in the layer stack (after each layer's MoE residual add, as llama.cpp's
`build_cvec(cur, il)`), keyed in the caches and sessions."""
import json
import warnings

import gguf
import jax
import numpy as np
import pytest
import xxhash
from model_fixtures import TINY, tiny_model

import strata_jax as sj
from strata_jax import steps
from strata_jax.errors import ControlVectorError, SessionError
from strata_jax.gguf.control_vector import (
  ControlVectorWarning,
  effective_layer_range,
  read_control_vectors,
  write_control_vector,
)
from strata_jax.model import forward

L, D = TINY.n_layers, TINY.d_model


def _dirs(seed, layers, scale=0.5, dim=D):
  rng = np.random.default_rng(seed)
  return {il: (scale * rng.standard_normal(dim)).astype(np.float32) for il in layers}


@pytest.fixture(scope="module")
def cv_files(tmp_path_factory):
  d = tmp_path_factory.mktemp("cvec")
  a, b = d / "a.gguf", d / "b.gguf"
  da, db = _dirs(1, range(1, L)), _dirs(2, [2, 3, 5, 6])
  write_control_vector(a, da, layer_count=L - 1)
  write_control_vector(b, db, layer_count=4)
  return d, (str(a), da), (str(b), db)


# ----- reader ------------------------------------------------------------------------------------

def test_direction_il_is_row_il_and_layer_0_gets_nothing(cv_files):
  _, (a, da), _ = cv_files
  cv = read_control_vectors(TINY, [a])
  v = np.asarray(cv.vectors)
  assert v.shape == (L, D) and v.dtype == np.float32
  assert not v[0].any()
  for il in range(1, L):
    assert np.array_equal(v[il], da[il]), il
  assert cv.layer_range == (1, L - 1) and cv.files[0].layers == tuple(range(1, L))


def test_two_files_sum_with_their_scales_in_float32_as_llama_cpp(cv_files):
  _, (a, da), (b, db) = cv_files
  cv = read_control_vectors(TINY, [a, b], scales=[0.75, -1.5])
  v = np.asarray(cv.vectors)
  for il in range(1, L):
    want = da[il] * np.float32(0.75)   # llama.cpp: per file dst += src * strength (from 0) ...
    if il in db:
      want = want + db[il] * np.float32(-1.5)   # ... then result += cur, in file order
    assert np.array_equal(v[il], want), il


@pytest.mark.parametrize("rng,want", [(None, (1, 7)), ((0, 0), (1, 7)), ((2, 5), (2, 5)),
                                      ((0, 3), (1, 3)), ((3, 0), (3, 7)), ((-4, 100), (1, 7)),
                                      ((7, 7), (7, 7))], ids=str)
def test_layer_range_is_inclusive_with_llama_cpp_defaults(cv_files, rng, want):
  _, (a, da), _ = cv_files
  cv = read_control_vectors(TINY, [a], layer_range=rng)
  assert cv.layer_range == want
  v = np.asarray(cv.vectors)
  for il in range(L):
    assert np.array_equal(v[il], da[il] if want[0] <= il <= want[1] else np.zeros(D)), il


@pytest.mark.parametrize("rng", [(5, 2), (8, 10), (1.5, 3), (1,), "2 5", (True, 3)], ids=str)
def test_layer_range_selecting_nothing_or_malformed_is_refused(cv_files, rng):
  _, (a, _), _ = cv_files
  with pytest.raises(ControlVectorError, match="layer range"):
    read_control_vectors(TINY, [a], layer_range=rng)


def test_negative_scale_steers_the_other_way(cv_files):
  _, (a, _), _ = cv_files
  pos = np.asarray(read_control_vectors(TINY, [a], scales=[0.5]).vectors)
  neg = np.asarray(read_control_vectors(TINY, [a], scales=[-0.5]).vectors)
  assert np.array_equal(neg, -pos) and pos.any()


def test_compute_dtype(cv_files):
  _, (a, da), _ = cv_files
  v = read_control_vectors(TINY, [a], dtype=jax.numpy.bfloat16).vectors
  assert v.dtype == jax.numpy.bfloat16
  assert np.array_equal(np.asarray(v[3], np.float32),
                        np.asarray(jax.numpy.asarray(da[3], jax.numpy.bfloat16), np.float32))


def test_identity_from_contents_scales_and_effective_range(cv_files, tmp_path):
  d, (a, da), (b, _) = cv_files
  ident = lambda *args, **kw: read_control_vectors(TINY, *args, **kw).control_vector_id
  base = ident([a])
  assert base != 0
  copy = tmp_path / "copy-of-a.gguf"
  copy.write_bytes(open(a, "rb").read())
  assert ident([str(copy)]) == base                       # contents, not the path
  assert ident([a], layer_range=(0, 0)) == base           # llama.cpp's defaults are the full range
  assert ident([a], layer_range=(1, L)) == base           # clipped to the layers 1..L-1
  assert ident([a], scales=[-0.0]) == ident([a], scales=[0.0])
  others = {ident([a], scales=[0.5]), ident([a], layer_range=(2, 5)), ident([a, b]),
            ident([b, a]), ident([b])}
  assert base not in others and len(others) == 5
  changed = tmp_path / "changed.gguf"
  write_control_vector(changed, {**da, 3: da[3] + np.float32(1e-3)}, layer_count=L - 1)
  assert ident([str(changed)]) != base


def test_load_control_vector_api(cv_files):
  _, (a, _), (b, _) = cv_files
  model = tiny_model()
  cv = sj.load_control_vector(model, [a, b], scales=[1.0, 0.5], layer_range=(2, 6))
  assert cv.layer_range == (2, 6) and len(cv.files) == 2
  assert sj.load_control_vector(model, a).control_vector_id == \
      sj.load_control_vector(model, [a]).control_vector_id


# ----- bad input ---------------------------------------------------------------------------------

def _write_raw(path, tensors, arch="controlvector", kv=None):
  w = gguf.GGUFWriter(str(path), arch)
  for k, v in (kv or {}).items():
    w.add_string(k, v) if isinstance(v, str) else w.add_int32(k, v)
  for name, (arr, raw_dtype) in tensors.items():
    w.add_tensor(name, arr, raw_dtype=raw_dtype)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)


def _bad_cases(d):
  f32 = lambda n=D: (np.ones(n, np.float32), None)
  return {
      "other n_embd": (_write_raw(d / "n_embd.gguf", {"direction.1": f32(32)}),
                       "n_embd 32 does not match the model's n_embd 64"),
      "more layers": (_write_raw(d / "deep.gguf", {"direction.1": f32(), "direction.8": f32()}),
                      "layer 8, this model has 8 layers"),
      "layer_count": (_write_raw(d / "count.gguf", {"direction.1": f32()},
                                 kv={"controlvector.layer_count": 47}),
                      "layer_count = 47"),
      "layer 0": (_write_raw(d / "zero.gguf", {"direction.0": f32()}), r"invalid \(zero\)"),
      "bad name": (_write_raw(d / "name.gguf", {"blk.1.attn_norm.weight": f32()}),
                   "unparsable direction tensor"),
      "f16": (_write_raw(d / "f16.gguf", {"direction.1": (np.ones(D, np.float16), None)}),
              r"non-F32\) direction tensor type F16"),
      "2-D": (_write_raw(d / "2d.gguf", {"direction.1": (np.ones((2, D), np.float32), None)}),
              r"non-1D"),
      "no tensors": (_write_raw(d / "empty.gguf", {}), "no direction tensors"),
      "nan data": (_write_raw(d / "nan.gguf", {"direction.1": (np.full(D, np.nan, np.float32),
                                                               None)}), "non-finite"),
      "model file": (_write_raw(d / "model.gguf", {"token_embd.weight": f32()}, arch="qwen3next"),
                     "not a control vector: general.architecture is 'qwen3next'"),
      "lora file": (sj.api.asset_path(sj.api.DEFAULT_ADAPTER),
                    "not a control vector: general.architecture is 'qwen3next'"),
  }


@pytest.mark.parametrize("case", ["other n_embd", "more layers", "layer_count", "layer 0",
                                  "bad name", "f16", "2-D", "no tensors", "nan data",
                                  "model file", "lora file"])
def test_bad_control_vector_files_name_the_file_and_problem(tmp_path, case):
  path, msg = _bad_cases(tmp_path)[case]
  with pytest.raises(ControlVectorError, match=msg) as e:
    read_control_vectors(TINY, [path])
  assert path in str(e.value)
  assert isinstance(e.value, ValueError)


def test_unreadable_files(cv_files, tmp_path):
  _, (a, _), _ = cv_files
  text = tmp_path / "notes.txt"
  text.write_text("not a gguf at all")
  trunc = tmp_path / "trunc.gguf"
  trunc.write_bytes(open(a, "rb").read()[:-100])
  for path, msg in ((tmp_path / "missing.gguf", "no such file"), (text, "not a GGUF"),
                    (trunc, "truncated")):
    with pytest.raises(ControlVectorError, match=msg) as e:
      read_control_vectors(TINY, [str(path)])
    assert str(path) in str(e.value)


@pytest.mark.parametrize("scale,msg", [(float("nan"), "not finite"), (float("inf"), "not finite"),
                                       ("big", "not a number"), (None, "not a number")], ids=str)
def test_bad_scales(cv_files, scale, msg):
  _, (a, _), _ = cv_files
  with pytest.raises(ControlVectorError, match=msg) as e:
    read_control_vectors(TINY, [a], scales=[scale])
  assert a in str(e.value)


def test_scale_count_and_no_files(cv_files):
  _, (a, _), (b, _) = cv_files
  with pytest.raises(ControlVectorError, match="1 control vector scale"):
    read_control_vectors(TINY, [a, b], scales=[1.0])
  with pytest.raises(ControlVectorError, match="no control vector file"):
    read_control_vectors(TINY, [])


def test_hints_that_it_was_made_for_another_model_warn(tmp_path):
  other = tmp_path / "llama.gguf"
  write_control_vector(other, _dirs(3, [1, 2]), model_hint="llama", layer_count=2)
  with pytest.warns(ControlVectorWarning) as rec:
    read_control_vectors(TINY, [str(other)])
  msgs = " ".join(str(r.message) for r in rec)
  assert "model_hint is 'llama'" in msgs and "3-layer model" in msgs
  fine = tmp_path / "fine.gguf"
  write_control_vector(fine, _dirs(3, [2, 4]), layer_count=2)   # a partial vector: no warning
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    read_control_vectors(TINY, [str(fine)])


def test_effective_layer_range_one_layer_model_refuses():
  with pytest.raises(ControlVectorError, match="selects no layer"):
    effective_layer_range(1, None)


# ----- block hashes -------------------------------------------------------------------------------

def test_block_hashes_without_control_vector_unchanged_and_with_it_seeded():
  toks = list(range(10, 26))
  raw = np.asarray(toks, "<i4").tobytes()
  h = lambda b: xxhash.xxh3_128_intdigest(b, seed=0).to_bytes(16, "little")
  aid, cid = 0x1234_5678_9ABC_DEF0, 0x0FED_CBA9_8765_4321
  # the public contract, byte for byte
  assert sj.block_hashes(toks, 8) == [h(raw[:32]), h(h(raw[:32]) + raw[32:])]
  assert sj.block_hashes(toks, 8, aid)[0] == h(aid.to_bytes(8, "little") + raw[:32])
  assert sj.block_hashes(toks, 8, control_vector_id=0) == sj.block_hashes(toks, 8)
  # a control vector: 8 bytes adapter id (0 too) then 8 bytes control vector id, little-endian
  for a in (0, aid):
    got = sj.block_hashes(toks, 8, a, control_vector_id=cid)
    b0 = h(a.to_bytes(8, "little") + cid.to_bytes(8, "little") + raw[:32])
    assert got == [b0, h(b0 + raw[32:])]
  assert len({sj.block_hashes(toks, 8, a, control_vector_id=c)[0]
              for a in (0, aid) for c in (0, cid)}) == 4


# ----- the model and the engine ----------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
  return tiny_model()


@pytest.fixture(scope="module")
def cvs(cv_files, model):
  _, (a, _), (b, _) = cv_files
  return (sj.load_control_vector(model, [a], scales=[0.8]),
          sj.load_control_vector(model, [a, b], scales=[0.5, -1.0], layer_range=(2, 6)))


_layer = jax.jit(forward.layers_scan, static_argnums=0)   # one layer: cfg.stage(il, il + 1)


def _reference_logits(model, ids, cvec):
  """The layer stack run layer by layer in plain Python with the vector added to each
  layer's output, as an independent oracle for the scan."""
  from strata_jax.parallel.split import slice_layers
  from strata_jax.state import init_state
  cfg, p = model.cfg, model.params
  x = forward.embed(p, np.asarray([ids], np.int32))
  st = init_state(cfg, 1, 64, model.dtype)
  pos, nv, sw = np.zeros(1, np.int32), np.asarray([len(ids)], np.int32), np.zeros(1, np.int32)
  for il in range(cfg.n_layers):
    c1 = cfg.stage(il, il + 1)
    layers = slice_layers(cfg, p.layers, il, il + 1)
    g = slice(cfg.layer_types[:il].count("G"), cfg.layer_types[:il + 1].count("G"))
    a = slice(cfg.layer_types[:il].count("A"), cfg.layer_types[:il + 1].count("A"))
    x, _, _ = _layer(c1, layers, None, (st.k[a], st.v[a]), (st.conv[g], st.ssm[g]), x, pos,
                     nv, sw)
    x = x + np.asarray(cvec.vectors[il])
  return np.asarray(forward.logits_from_hidden(cfg, p, x[0]))


def test_engine_adds_row_il_after_layer_il(model, cvs):
  ids = list(range(3, 40))
  base = sj.Engine(model, slots=1, max_seq=64, block_size=16).generate(
      tokens=ids, max_tokens=1, return_logits=True).prompt_logits
  for cv in cvs:
    eng = sj.Engine(model, slots=1, max_seq=64, block_size=16, control_vector=cv)
    got = eng.generate(tokens=ids, max_tokens=1, return_logits=True).prompt_logits
    np.testing.assert_allclose(got, _reference_logits(model, ids, cv), atol=1e-5, rtol=0)
    assert np.abs(got - base).max() > 1e-2    # the vector changes the logits


def test_without_control_vector_the_program_is_todays(model):
  """control_vector=None passes cvec=None down: the very program (same jit cache entry, same
  lowered text) as a call that never mentions a control vector."""
  eng = sj.Engine(model, slots=1, max_seq=64, block_size=16)
  st = eng.stages[0]
  args = (st.cfg, st.params, st.lora, eng.states[0], np.zeros(1, np.int32), np.zeros(1, np.int32),
          np.ones(1, np.int32))
  assert steps.decode.lower(*args).as_text() == steps.decode.lower(*args, cvec=None).as_text()
  a = eng.generate(tokens=[5, 6, 7], max_tokens=4, return_logits=True)
  b = sj.Engine(model, slots=1, max_seq=64, block_size=16, control_vector=None).generate(
      tokens=[5, 6, 7], max_tokens=4, return_logits=True)
  assert np.array_equal(a.prompt_logits, b.prompt_logits)
  assert np.array_equal(a.step_logits, b.step_logits)


def test_one_program_serves_every_control_vector(model, cvs):
  eng = sj.Engine(model, slots=1, max_seq=64, block_size=16, prefix_cache_bytes=0,
                  control_vector=cvs[0])
  # both runs ask for the prompt logits: an all-logits prefill is a program of its own (alone,
  # this test used to count that compile as the control vector's)
  r0 = eng.generate(tokens=[5, 6, 7, 8], max_tokens=3, return_logits=True)
  n_prefill, n_decode = steps.prefill._cache_size(), steps.decode._cache_size()
  eng.set_control_vector(cvs[1])
  r1 = eng.generate(tokens=[5, 6, 7, 8], max_tokens=3, return_logits=True)
  assert (steps.prefill._cache_size(), steps.decode._cache_size()) == (n_prefill, n_decode)
  fresh = sj.Engine(model, slots=1, max_seq=64, block_size=16, control_vector=cvs[1])
  assert np.array_equal(r1.prompt_logits,
                        fresh.generate(tokens=[5, 6, 7, 8], max_tokens=1,
                                       return_logits=True).prompt_logits)
  assert len(r0.tokens) == 3


def test_caches_are_keyed_by_the_control_vector(model, cvs):
  a, b = cvs
  prompt = list(range(10, 50))                 # 2 full blocks of 16, and 8 tokens
  eng = sj.Engine(model, slots=1, max_seq=64, block_size=16, state_every=1, control_vector=a)
  first = eng.generate(tokens=prompt, max_tokens=2)
  assert first.cached_tokens == 0
  # conversation cache: the slot's tokens extend under the same vector ...
  cont = prompt + first.tokens + [3, 4]
  assert eng.generate(tokens=cont, max_tokens=1).cached_tokens == len(prompt) + 1
  eng.set_control_vector(b)
  # ... and not under another: neither the conversation nor the prefix cache serves it
  other = eng.generate(tokens=cont, max_tokens=1)
  assert other.cached_tokens == 0
  eng.set_control_vector(a)
  again = eng.generate(tokens=prompt + [99, 98], max_tokens=1)
  assert again.cached_tokens == 32                 # the prefix blocks computed under `a`
  eng.set_control_vector(None)
  assert eng.generate(tokens=prompt + [99, 98], max_tokens=1).cached_tokens == 0


def test_sessions_carry_the_control_vector(model, cvs, tmp_path):
  a, b = cvs
  ids = list(range(20, 45))
  eng = sj.Engine(model, slots=1, max_seq=64, block_size=16, control_vector=a)
  r = eng.generate(tokens=ids, max_tokens=3)
  eng.save_session(0, tmp_path / "s")
  plain = sj.Engine(model, slots=1, max_seq=64, block_size=16)
  plain.generate(tokens=ids, max_tokens=3)
  plain.save_session(0, tmp_path / "plain")
  with pytest.raises(SessionError, match="control vector") as e:
    sj.Engine(model, slots=1, max_seq=64, block_size=16, control_vector=b).load_session(
        0, tmp_path / "s")
  assert f"{a.control_vector_id:016x}" in str(e.value)
  assert f"{b.control_vector_id:016x}" in str(e.value)
  with pytest.raises(SessionError, match="without a control vector"):
    plain.load_session(0, tmp_path / "s")
  with pytest.raises(SessionError, match="saved without a control vector"):
    eng.load_session(0, tmp_path / "plain")
  # the same vector (loaded again, from the same files) restores and continues exactly
  same = sj.Engine(model, slots=1, max_seq=64, block_size=16, control_vector=a)
  info = same.load_session(0, tmp_path / "s")
  assert info["n_tokens"] == len(ids) + 2
  cont = ids + r.tokens + [7]
  got = same.generate(tokens=cont, max_tokens=2)
  want = sj.Engine(model, slots=1, max_seq=64, block_size=16, prefix_cache_bytes=0,
                   control_vector=a).generate(tokens=cont, max_tokens=2)
  assert got.cached_tokens == len(ids) + 2 and got.tokens == want.tokens
  plain.load_session(0, tmp_path / "plain")         # no control vector: reads as before


def test_layer_split_slices_the_control_vector(model, cvs):
  import dataclasses
  split = dataclasses.replace(model, layer_ranges=[(0, 4), (4, 8)])
  ids = list(range(3, 30))
  cv = cvs[1]
  one = sj.Engine(model, slots=1, max_seq=64, block_size=16, control_vector=cv)
  two = sj.Engine(split, slots=1, max_seq=64, block_size=16, control_vector=cv)
  assert [st.cvec.shape[0] for st in two.stages] == [4, 4]
  assert np.array_equal(np.asarray(two.stages[1].cvec), np.asarray(cv.vectors[4:]))
  r1 = one.generate(tokens=ids, max_tokens=1, return_logits=True)
  r2 = two.generate(tokens=ids, max_tokens=1, return_logits=True)
  np.testing.assert_allclose(r2.prompt_logits, r1.prompt_logits, atol=1e-5, rtol=0)


def test_engine_refuses_a_control_vector_for_another_model(cvs):
  import dataclasses
  deeper = tiny_model(dataclasses.replace(TINY, layer_types="GGGA" * 3))
  with pytest.raises(ControlVectorError, match="8 layers"):
    sj.Engine(deeper, slots=1, max_seq=64, block_size=16, control_vector=cvs[0])


# ----- parity with transformers (vectors added by forward hooks on the decoder layers) ------------

@pytest.fixture(scope="module")
def hf(tmp_path_factory):
  from gguf_fixtures import save_tiny_hf

  from strata_jax.cli import main as cli_main
  d = tmp_path_factory.mktemp("hf_cvec")
  _, hf_model = save_tiny_hf(d / "model", seed=0, tokenizer=False)
  assert cli_main(["convert", "hf", str(d / "model"), str(d / "model.gguf")]) == 0
  model = sj.load_model(str(d / "model.gguf"))
  n, dim = model.cfg.n_layers, model.cfg.d_model
  files = {}
  for name, seed, layers in (("a", 11, range(1, n)), ("b", 12, [2, 3])):
    dirs = _dirs(seed, layers, scale=0.2, dim=dim)
    write_control_vector(d / f"{name}.gguf", dirs, layer_count=len(dirs))
    files[name] = (str(d / f"{name}.gguf"), dirs)
  return hf_model.eval(), model, files


def _hooked(hf_model, rows):
  """transformers' model with rows[il] added to decoder layer il's output (llama.cpp's
  `build_cvec(cur, il)` after the MoE residual); returns the hook handles."""
  import torch
  handles = []
  for il, layer in enumerate(hf_model.model.layers):
    if rows[il].any():
      v = torch.tensor(rows[il])
      hook = lambda mod, inp, out, v=v: (out[0] + v,) + tuple(out[1:]) \
          if isinstance(out, tuple) else out + v
      handles.append(layer.register_forward_hook(hook))
  return handles


@pytest.mark.parity
@pytest.mark.parametrize("case", ["one file", "two scaled files, layers 2..3"])
def test_parity_with_transformers_hooks(hf, case):
  import torch
  from tolerances import MODEL_LOGITS_ABS_FP32, assert_close
  hf_model, model, files = hf
  n, dim = model.cfg.n_layers, model.cfg.d_model
  rows = np.zeros((n, dim), np.float32)
  if case == "one file":
    cv = sj.load_control_vector(model, files["a"][0])
    for il, v in files["a"][1].items():
      rows[il] += v
  else:
    scales, rng = (0.7, -1.3), (2, 3)
    cv = sj.load_control_vector(model, [files["a"][0], files["b"][0]], scales=scales,
                                layer_range=rng)
    for (_, dirs), s in zip((files["a"], files["b"]), scales):
      for il, v in dirs.items():
        if rng[0] <= il <= rng[1]:
          rows[il] += np.float32(s) * v
  ids = list(np.random.default_rng(5).integers(0, model.cfg.vocab_size, 63))
  eng = sj.Engine(model, slots=1, max_seq=128, block_size=64, control_vector=cv)
  res = eng.generate(tokens=ids, max_tokens=8, return_logits=True)
  handles = _hooked(hf_model, rows)
  try:
    with torch.no_grad():
      want = hf_model(torch.tensor([ids])).logits[0].numpy()
      out = hf_model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                              min_new_tokens=8, eos_token_id=None, pad_token_id=0)
  finally:
    for h in handles:
      h.remove()
  with torch.no_grad():
    plain = hf_model(torch.tensor([ids])).logits[0].numpy()
  assert np.abs(want - plain).max() > 50 * MODEL_LOGITS_ABS_FP32   # the vectors matter
  assert_close(res.prompt_logits, want, abs_=MODEL_LOGITS_ABS_FP32, what=case)
  assert res.tokens == out[0, len(ids):].tolist()


# ----- command line ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
  from strata_jax.gguf.convert_hf import write_model_gguf
  from strata_jax.gguf.names import params_to_gguf_tensors
  from strata_jax.params import params_to_flat
  d = tmp_path_factory.mktemp("cvec_cli")
  flat = {k: np.asarray(v, np.float32) for k, v in params_to_flat(tiny_model().params).items()}
  write_model_gguf(str(d / "tiny.gguf"), TINY, params_to_gguf_tensors(TINY, flat))
  return str(d / "tiny.gguf")


def _cli(monkeypatch, capsys, *argv):
  from strata_jax.cli import main as cli_main
  monkeypatch.setenv("STRATA_JAX_CACHE", "0")   # leave this process's compilation cache alone
  rc = cli_main(list(argv))
  out, err = capsys.readouterr()
  return rc, out, err


def test_cli_generate_with_llama_cpp_flags(cv_files, tiny_gguf, tmp_path, monkeypatch, capsys):
  _, (a, _), (b, _) = cv_files
  rc, out, _ = _cli(monkeypatch, capsys, "generate", "--model", tiny_gguf,
                    "--control-vector-scaled", f"{a}:0.8", "--control-vector", b,
                    "--control-vector-layer-range", "2", "6", "--prompt-tokens", "5,6,7,8",
                    "-n", "3", "--json", "--dump-logits", str(tmp_path / "cv.npz"))
  assert rc == 0
  res = json.loads(out.strip().splitlines()[-1])
  model = sj.load_model(tiny_gguf)
  cv = sj.load_control_vector(model, [a, b], scales=[0.8, 1.0], layer_range=(2, 6))
  want = sj.Engine(model, slots=1, max_seq=256, control_vector=cv).generate(
      tokens=[5, 6, 7, 8], max_tokens=3, return_logits=True)
  assert res["tokens"] == want.tokens
  np.testing.assert_array_equal(np.load(tmp_path / "cv.npz")["prompt"], want.prompt_logits)


@pytest.mark.parametrize("flags,msg", [
    (["--control-vector", "{n_embd}"], "n_embd 32 does not match"),
    (["--control-vector-scaled", "{a}:nan"], "scale nan is not finite"),
    (["--control-vector-scaled", "{a}"], "expected FILE:SCALE"),
    (["--control-vector", "{lora}"], "not a control vector"),
    (["--control-vector", "{a}", "--control-vector-layer-range", "9", "12"], "selects no layer"),
], ids=["n_embd", "nan scale", "no scale", "lora file", "empty range"])
def test_cli_bad_control_vectors_exit_2(cv_files, tiny_gguf, tmp_path, monkeypatch, capsys,
                                        flags, msg):
  _, (a, _), _ = cv_files
  paths = {"a": a, "n_embd": _write_raw(tmp_path / "n.gguf",
                                         {"direction.1": (np.ones(32, np.float32), None)}),
           "lora": sj.api.asset_path(sj.api.DEFAULT_ADAPTER)}
  rc, _, err = _cli(monkeypatch, capsys, "generate", "--model", tiny_gguf, "--prompt-tokens",
                    "5,6", "-n", "1", *[f.format(**paths) for f in flags])
  assert rc == 2 and err.startswith("error: ") and msg in err and "Traceback" not in err
