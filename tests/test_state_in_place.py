"""The layer scan updates the state stacks in place (issue 17, item 4): the K/V caches, and at a
fused decode step the GDN recurrent state, ride in the scan's carry and each layer writes its
own index. The stacked mixers against their one-layer calls, a decode step against the layers
run one by one on their own state, idle rows bit for bit, and what XLA is given: the stacks in
the carry, and no copy of the K/V stack in the compiled step."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_walk import eqns
from model_fixtures import TINY, tiny_model

from strata_jax import steps
from strata_jax.forms import Forms
from strata_jax.model import forward
from strata_jax.model.attention import attn_mixer
from strata_jax.model.gdn import gdn_mixer
from strata_jax.parallel.split import slice_layers
from strata_jax.state import init_state

FORMS = {"xla": Forms(gdn_decode="xla", lora_impl="xla"),
         "step": Forms(gdn_decode="pallas_interpret", lora_impl="xla"),
         "fused": Forms(gdn_decode="pallas_fused_interpret", lora_impl="xla")}
CHUNK = 8


def _model(form):
  # the Pallas step kernel's tiles are at least 16 wide (TINY's Dv is 8)
  dv = {"gdn_d_v": 16} if form == "step" else {}
  return tiny_model(dataclasses.replace(TINY, forms=FORMS[form], **dv))


def _bits(a):
  """The bytes of every leaf: equality is bit for bit (-0.0 differs from 0.0)."""
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(a)]


def _prefilled(model, batch=3):
  """A state whose rows hold a prompt each (rows of different lengths)."""
  cfg = model.cfg
  state = init_state(cfg, batch, 64)
  for slot in range(batch):
    n = 3 + 2 * slot
    chunk = np.zeros(CHUNK, np.int32)
    chunk[:n] = np.arange(n) * (slot + 2) % cfg.vocab_size
    _, state = steps.prefill(cfg, model.params, None, state, jnp.int32(slot), jnp.asarray(chunk),
                             jnp.int32(n), jnp.int32(0))
  return state


def _random_state(cfg, batch, seed):
  rng = np.random.default_rng(seed)
  st = init_state(cfg, batch, 16)
  rnd = lambda a: jnp.asarray(rng.standard_normal(a.shape).astype(np.float32))
  return st.replace(k=rnd(st.k), v=rnd(st.v), conv=rnd(st.conv), ssm=rnd(st.ssm))


# ----- the mixers: the stacked call is the one-layer call, at its index --------------------------

@pytest.mark.parametrize("form,T", [("xla", 1), ("fused", 1), ("step", 1), ("xla", 5)],
                         ids=["xla-T1", "fused-T1", "step-T1", "xla-T5"])
def test_stacked_gdn_mixer_is_the_one_layer_call_at_its_index(form, T):
  model = _model(form)
  cfg, B, il = model.cfg, 3, 4
  st = _random_state(cfg, B, seed=T)
  p = jax.tree.map(lambda a: a[il], model.params.layers.gdn)
  x = jnp.asarray(np.random.default_rng(7).standard_normal((B, T, cfg.d_model)), jnp.float32)
  n_new = jnp.asarray([T, 0, 1], jnp.int32)            # row 1 idle
  one = jax.jit(lambda c, s: gdn_mixer(cfg, p, x, c, s, n_new, None, None, jnp.int32(0)))
  stacked = jax.jit(lambda c, s, i: gdn_mixer(cfg, p, x, c, s, n_new, None, None, jnp.int32(0),
                                              layer=i))
  y1, c1, s1 = one(st.conv[il], st.ssm[il])
  y2, c2, s2 = stacked(st.conv[il], st.ssm, jnp.int32(il))
  assert _bits((y2, c2, s2[il])) == _bits((y1, c1, s1))
  others = np.asarray([i for i in range(cfg.n_gdn) if i != il])
  assert _bits(s2[others]) == _bits(st.ssm[others])
  if T == 1:   # an idle row keeps its state bit for bit
    assert _bits((c2[1], s2[il, 1])) == _bits((st.conv[il, 1], st.ssm[il, 1]))


@pytest.mark.parametrize("T", [1, 3])
def test_stacked_attention_writes_only_its_layer(T):
  model = _model("xla")
  cfg, B, il = model.cfg, 3, 1
  st = _random_state(cfg, B, seed=10 + T)
  p = jax.tree.map(lambda a: a[il], model.params.layers.attn)
  x = jnp.asarray(np.random.default_rng(3).standard_normal((B, T, cfg.d_model)), jnp.float32)
  pos, n_new = jnp.asarray([4, 9, 0], jnp.int32), jnp.asarray([T, 0, 1], jnp.int32)
  run = lambda k, v, **kw: attn_mixer(cfg, p, x, k, v, pos, n_new, None, None, jnp.int32(0), **kw)
  y1, k1, v1 = jax.jit(run)(st.k[il], st.v[il])
  y2, k2, v2 = jax.jit(lambda k, v, i: run(k, v, layer=i))(st.k, st.v, jnp.int32(il))
  assert _bits((y2, k2[il], v2[il])) == _bits((y1, k1, v1))
  assert _bits((k2[0], v2[0], k2[il, 1], v2[il, 1])) == _bits((st.k[0], st.v[0], st.k[il, 1],
                                                               st.v[il, 1]))


# ----- a decode step --------------------------------------------------------------------------

_one_layer = jax.jit(forward.layers_scan, static_argnums=0)


def _decode_layer_by_layer(model, state, tokens, active):
  """`steps.decode` as the layers run one at a time, each on its own slice of the state (one
  layer's config, stacks of one): the oracle for the whole-stack carry. Returns (the last
  layer's hidden [B, D], state)."""
  cfg, p = model.cfg, model.params
  n_new = jnp.asarray(active, jnp.int32)
  x = forward.embed(p, tokens[:, None])
  k, v, conv, ssm = ([a[i] for i in range(a.shape[0])]
                     for a in (state.k, state.v, state.conv, state.ssm))
  for il in range(cfg.n_layers):
    g, a = cfg.layer_types[:il].count("G"), cfg.layer_types[:il].count("A")
    gdn = cfg.layer_types[il] == "G"
    # this layer's state as a stack of one; the other kind's stacks are empty
    one = lambda lst, i, mine, full: jnp.stack([lst[i]]) if mine else full[:0]
    x, (k1, v1), (c1, s1) = _one_layer(
        cfg.stage(il, il + 1), slice_layers(cfg, p.layers, il, il + 1), None,
        (one(k, a, not gdn, state.k), one(v, a, not gdn, state.v)),
        (one(conv, g, gdn, state.conv), one(ssm, g, gdn, state.ssm)),
        x, state.pos, n_new, jnp.zeros_like(n_new))
    if gdn:
      conv[g], ssm[g] = c1[0], s1[0]
    else:
      k[a], v[a] = k1[0], v1[0]
  return x[:, 0], state.replace(k=jnp.stack(k), v=jnp.stack(v), conv=jnp.stack(conv),
                               ssm=jnp.stack(ssm), pos=state.pos + n_new)


@pytest.mark.parametrize("form", ["xla", "fused", "step"])
def test_decode_equals_the_layers_run_one_by_one(form):
  """Bit for bit: the hidden state the layers hand on, and every state stack. (The hidden, not
  the logits: the final norm and matmul compiled into another program may round otherwise; a
  stage with no lm_head returns the hidden, as in a layer split.)"""
  model = _model(form)
  state = _prefilled(model)
  tokens, active = jnp.asarray([5, 9, 11], jnp.int32), jnp.asarray([1, 0, 1], jnp.int32)
  want_hidden, want = _decode_layer_by_layer(model, state, tokens, active)
  got_hidden, got = steps.decode(model.cfg, model.params.replace(lm_head=None), None, state,
                                 tokens, jnp.zeros(3, jnp.int32), active)
  assert _bits(got_hidden) == _bits(want_hidden)
  for name in ("k", "v", "conv", "ssm", "pos"):
    assert _bits(getattr(got, name)) == _bits(getattr(want, name)), name


@pytest.mark.parametrize("form", ["xla", "fused", "step"])
def test_decode_keeps_an_idle_row_bit_for_bit(form):
  """Negative zeros included: the delta rule with g = beta = 0 would give S + 0 = +0."""
  model = _model(form)
  state = _prefilled(model)
  state = state.replace(ssm=state.ssm.at[:, 1, :, 0].set(-0.0), conv=state.conv.at[:, 1].set(-0.0))
  before = jax.tree.map(np.asarray, state)
  _, after = steps.decode(model.cfg, model.params, None, state, jnp.asarray([5, 9, 11], jnp.int32),
                          jnp.zeros(3, jnp.int32), jnp.asarray([1, 0, 1], jnp.int32))
  for name in ("k", "v", "conv", "ssm"):
    assert _bits(getattr(after, name)[:, 1]) == _bits(getattr(before, name)[:, 1]), name


# ----- what XLA is given ------------------------------------------------------------------------

def _layer_scan(cfg, params, state):
  tok = jnp.zeros((state.pos.shape[0],), jnp.int32)
  jaxpr = jax.make_jaxpr(steps.decode, static_argnums=0)(cfg, params, None, state, tok, tok,
                                                         tok + 1).jaxpr
  scans = [e for e in eqns(jaxpr) if e.primitive.name == "scan"
           and e.params["length"] == cfg.n_layers // forward.pattern_period(cfg.layer_types)]
  assert len(scans) == 1
  e = scans[0]
  nc, nk = e.params["num_consts"], e.params["num_carry"]
  shapes = lambda vs: [tuple(v.aval.shape) for v in vs]
  return e, shapes(e.invars[nc:nc + nk]), shapes(e.invars[nc + nk:])


@pytest.mark.parametrize("form", ["xla", "fused", "step"])
def test_decode_layer_scan_carries_the_state_stacks(form):
  model = _model(form)
  cfg, st = model.cfg, init_state(model.cfg, 3, 64)
  e, carry, xs = _layer_scan(cfg, model.params, st)
  assert tuple(st.k.shape) in carry and tuple(st.v.shape) in carry
  blocked = lambda a: (cfg.n_layers // 4, a.shape[0] // (cfg.n_layers // 4), *a.shape[1:])
  assert blocked(st.k) not in xs
  if form in ("fused", "step"):   # a Pallas decode kernel: the stack updated in place
    assert tuple(st.ssm.shape) in carry and blocked(st.ssm) not in xs
    # every GDN layer hands the kernel the whole stack (read and written in place)
    calls = [c for c in eqns(e.params["jaxpr"].jaxpr) if c.primitive.name == "pallas_call"]
    assert len(calls) == cfg.layer_types[:4].count("G")
    assert all(tuple(c.invars[-1].aval.shape) == tuple(st.ssm.shape) for c in calls)
  else:   # a jnp read of a carried stack would make XLA copy it (forward.layers_scan)
    assert blocked(st.ssm) in xs


@pytest.mark.parametrize("form", ["fused", "step"])
def test_decode_gdn_kernels_take_n_new_without_a_per_layer_conversion(form):
  """The GDN decode kernels read the step's n_new as their `valid`: no int32 [B] made from it
  inside the layer scan, where XLA ran that conversion as one kernel an iteration."""
  model = _model(form)
  cfg, st = model.cfg, init_state(model.cfg, 3, 64)
  e, _, _ = _layer_scan(cfg, model.params, st)
  made = [c for c in eqns(e.params["jaxpr"].jaxpr, into_kernels=False)
          if c.primitive.name == "convert_element_type"
          and c.outvars[0].aval.dtype == jnp.int32 and tuple(c.outvars[0].aval.shape) == (3,)]
  assert made == []


def test_compiled_decode_has_no_copy_of_the_kv_stack():
  model = _model("xla")
  cfg, st = model.cfg, init_state(model.cfg, 3, 64)
  tok = jnp.zeros((3,), jnp.int32)
  hlo = steps.decode.lower(cfg, model.params, None, st, tok, tok, tok + 1).compile().as_text()
  kv = ",".join(map(str, st.k.shape))
  # the old xs/ys form sliced [n_blocks, 1, B, S, G, Hd] blocks and copied and broadcast them
  n_b = cfg.n_layers // 4
  blocks = ",".join(map(str, (n_b, st.k.shape[0] // n_b, *st.k.shape[1:])))
  for shape in (kv, blocks):
    ops = re.findall(r"= f32\[" + shape + r"\]\S* (copy|broadcast|select)\(", hlo)
    assert not ops, (shape, ops)
  assert re.search(r"= f32\[" + kv + r"\]\S* scatter\(", hlo)   # written in place
