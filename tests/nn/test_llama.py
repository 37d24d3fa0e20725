"""Llama: shapes, causality, RoPE (Llama 3.1 scaling), GQA, tied embeddings, routes by path, param counts."""

import dataclasses
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import cpu_devices
from jaxprs import primitive_count
from bench import compile as compile_bench
from fp4jax import Impl
from fp4jax.nn import RouteRules, linear
from fp4jax.nn.llama import PRESETS, Llama, Llama3RopeScaling, LlamaConfig
from fp4jax.nn.llama import layers, model as model_lib
from fp4jax.nn.llama.model import SCAN_POLICIES

TINY = LlamaConfig.preset("tiny")
EMULATED = Impl(gemm="emulated")
B, T = 2, 32


def _tokens(seed=0, t=T):
  return jax.random.randint(jax.random.key(seed), (B, t), 0, TINY.vocab_size, jnp.int32)


def _model(config=TINY, route="bf16", impl=Impl(), **kw):
  rules = RouteRules.standard(route, n_layers=config.n_layers, **kw)
  return Llama(config, rules=rules, rngs=nnx.Rngs(0), impl=impl)


@pytest.fixture(scope="module")
def bf16_model():
  return _model()


@nnx.jit
def _forward(model, tokens):
  return model(tokens)


def _param_count(model):
  return sum(v.size for v in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_shapes_dtypes_and_param_count(bf16_model):
  model = bf16_model
  logits = _forward(model, _tokens())
  assert logits.shape == (B, T, TINY.vocab_size) and logits.dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(logits)))
  assert _param_count(model) == TINY.num_params()
  assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_routes_follow_the_documented_paths():
  rules = RouteRules.parse([r"layers\.0\..*=bf16", r"layers\.\d+\.attn\..*=mxfp4_rtn",
                            r"layers\.\d+\.mlp\..*=nvfp4_46", "lm_head=mxfp4"])
  model = Llama(TINY, rules=rules, rngs=nnx.Rngs(0))
  routes = model.routes()
  # Every FP4Linear sits at the path its route was resolved from.
  assert routes == {path: rules.resolve(path).name for path in routes}
  expected = {f"layers.{i}.{g}.{n}" for i in range(TINY.n_layers)
              for g, names in (("attn", "qkvo"), ("mlp", ("gate", "up", "down"))) for n in names}
  assert set(routes) == expected | {"lm_head"}
  assert routes["layers.1.attn.k"] == "mxfp4_rtn" and routes["layers.1.mlp.down"] == "nvfp4_46"
  assert routes["layers.0.mlp.down"] == "bf16" and routes["lm_head"] == "mxfp4"
  # Each linear gets its own key index, the lm_head the one after every block's.
  indices = [layers.linear_index(p, n_layers=TINY.n_layers) for p in routes]
  assert sorted(indices) == list(range(layers.LINEARS_PER_BLOCK * TINY.n_layers + 1))
  assert layers.linear_index("lm_head", n_layers=TINY.n_layers) == layers.LINEARS_PER_BLOCK * TINY.n_layers
  with pytest.raises(ValueError, match=r"linear_index\('lm_head'\) needs the model's n_layers="):
    layers.linear_index("lm_head")  # was "not enough values to unpack"
  for path in ("layers.0.attn.gate", "embed", "layers.2.mlp.up"):  # the last: past the model's blocks
    with pytest.raises(ValueError, match=rf"path of a Llama linear, .* or lm_head, got '{path}'"):
      layers.linear_index(path, n_layers=TINY.n_layers)


@pytest.mark.parametrize("route", ["bf16", "mxfp4_rtn"])
def test_causal(route, bf16_model):
  model = bf16_model if route == "bf16" else _model(route=route)
  tokens = _tokens()
  changed = tokens.at[:, 20].set((tokens[:, 20] + 1) % TINY.vocab_size)
  a, b = _forward(model, tokens), _forward(model, changed)
  np.testing.assert_allclose(a[:, :20], b[:, :20], rtol=1e-6, atol=1e-6)
  assert float(jnp.max(jnp.abs(a[:, 20:] - b[:, 20:]))) > 1e-3


def _next_token_grads(tokens):
  """A jitted (model, key) -> (next-token loss, grads) over tokens [B, T + 1]."""

  @nnx.jit
  def grads(model, key):
    def loss(model):
      logits = model(tokens[:, :-1], key=key)
      return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))
    return nnx.value_and_grad(loss)(model)

  return grads


@pytest.mark.parametrize("key", [jnp.array([0.3, 0.9]), 3, jnp.zeros(4, jnp.uint32)])
def test_a_key_that_is_no_key_is_refused(key):
  """A float pair, an int, raw data of the wrong shape: before any linear derives its key from it (a float pair
  trained the unrolled model, seeded by its float bits)."""
  model = Llama(TINY, rules=RouteRules.parse([r"layers\.1\.mlp\.up=mxfp4_sr"]), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="Llama needs a key"):
    model(_tokens(t=T), key=key)


@pytest.mark.parametrize("tokens, match", [
    (jnp.zeros((T,), jnp.int32), r"int32\[32\]"), (jnp.zeros((B, T, 1), jnp.int32), r"int32\[2, 32, 1\]"),
    (jnp.zeros((B, T)), r"float32\[2, 32\]"), ([[1, 2]], "a list"),
])
def test_tokens_of_another_shape_or_dtype_are_refused(bf16_model, tokens, match):
  """One sequence [T], a trailing axis, float ids, a list: "not enough values to unpack", "Input type must be an
  integer" or an AttributeError before."""
  with pytest.raises(ValueError, match=r"^Llama takes tokens \[B, T\] of an integer dtype, got " + match + "$"):
    bf16_model(tokens)


def test_forward_backward_fp4_with_keys():
  # One deep linear on a keyed route (a single FP4 linear keeps the compile short).
  model = Llama(TINY, rules=RouteRules.parse([r"layers\.1\.mlp\.up=mxfp4_sr"]), rngs=nnx.Rngs(0))
  tokens = _tokens(t=T + 1)  # T inputs and T targets: M = B * T tokens, a multiple of the FP4 block.

  grads = _next_token_grads(tokens)

  value, g1 = grads(model, jax.random.key(1))
  _, g1_again = grads(model, jax.random.key(1))
  _, g2 = grads(model, jax.random.key(2))
  assert abs(float(value) - math.log(TINY.vocab_size)) < 0.5
  leaves = jax.tree.leaves(g1)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
  kernel = lambda g: g["layers"][1]["mlp"]["up"]["kernel"][...]
  np.testing.assert_array_equal(kernel(g1), kernel(g1_again))  # Same key, same stochastic rounding.
  assert not np.array_equal(kernel(g1), kernel(g2))
  with pytest.raises(ValueError, match="mxfp4_sr.*pass key"):
    _forward(model, tokens[:, :-1])  # Fails while tracing, before any compile.


def test_rope_llama3_scaling_formula():
  scaling = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position=8192)
  head_dim, theta = 128, 500000.0
  got = layers.rope_frequencies(head_dim, theta, scaling)
  bands = []
  for j, f in enumerate(got):
    base = theta ** (-2 * j / head_dim)
    wavelen = 2 * math.pi / base
    if wavelen < 8192 / 4:  # High frequencies: unchanged.
      want, band = base, "high"
    elif wavelen > 8192 / 1:  # Low frequencies: divided by the factor.
      want, band = base / 8, "low"
    else:
      s = (8192 / wavelen - 1) / (4 - 1)
      want, band = (1 - s) * base / 8 + s * base, "mid"
    bands.append(band)
    assert f == pytest.approx(want, rel=1e-12), (j, band)
  assert {"high", "mid", "low"} <= set(bands)
  np.testing.assert_allclose(layers.rope_frequencies(head_dim, theta, None),
                             theta ** (-np.arange(0, head_dim, 2) / head_dim), rtol=1e-12)


def test_rope_is_a_relative_rotation():
  freqs = layers.rope_frequencies(16, 10000.0, Llama3RopeScaling(original_max_position=16))
  q = jax.random.normal(jax.random.key(0), (1, 1, 1, 16))
  k = jax.random.normal(jax.random.key(1), (1, 1, 1, 16))
  rot = lambda x, p: layers.apply_rope(x, jnp.full((1, 1), p), freqs)
  np.testing.assert_allclose(jnp.linalg.norm(rot(q, 5)), jnp.linalg.norm(q), rtol=1e-5)
  dots = [float(jnp.sum(rot(q, m) * rot(k, m - 3))) for m in (3, 7, 40)]
  np.testing.assert_allclose(dots, dots[0], rtol=1e-4)


def test_gqa_matches_repeated_kv_reference(bf16_model):
  config, model = TINY, bf16_model
  assert (config.n_heads, config.n_kv_heads) == (4, 2)
  attn = model.layers[0].attn
  hd = config.head_dim
  assert attn.k.kernel.shape == (config.dim, 2 * hd) and attn.q.kernel.shape == (config.dim, 4 * hd)
  x = jax.random.normal(jax.random.key(3), (B, T, config.dim)).astype(jnp.bfloat16)
  positions = jnp.broadcast_to(jnp.arange(T), (B, T))
  got = attn(x, positions)

  # Float32 reference: query head h reads kv head h // (n_heads / n_kv_heads).
  f32 = lambda a: a.astype(jnp.float32)
  freqs = layers.rope_frequencies(hd, config.rope_theta, None)
  q = layers.apply_rope((f32(x) @ attn.q.kernel[...]).reshape(B, T, 4, hd), positions, freqs)
  k = layers.apply_rope((f32(x) @ attn.k.kernel[...]).reshape(B, T, 2, hd), positions, freqs)
  v = (f32(x) @ attn.v.kernel[...]).reshape(B, T, 2, hd)
  k, v = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
  scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -jnp.inf)
  out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(B, T, 4 * hd)
  want = out @ attn.o.kernel[...]
  np.testing.assert_allclose(f32(got), want, atol=0.02 * float(jnp.max(jnp.abs(want))))


def test_tied_and_untied_embeddings():
  tokens = _tokens(t=16)  # Some vocab rows are unused by these tokens.
  unused = np.setdiff1d(np.arange(TINY.vocab_size), np.asarray(tokens))

  @nnx.jit
  def embed_grad(model):
    g = nnx.grad(lambda m: jnp.mean(m(tokens) ** 2))(model)
    return g["embed"]["embedding"][...]

  config = dataclasses.replace(TINY, n_layers=1)
  untied = _model(config)
  assert untied.lm_head is not None
  assert not bool(jnp.any(embed_grad(untied)[unused]))  # Only looked-up rows learn.
  tied_config = dataclasses.replace(config, tie_embeddings=True)
  tied = _model(tied_config)
  assert tied.lm_head is None and "lm_head" not in tied.routes()
  assert bool(jnp.all(jnp.any(embed_grad(tied)[unused] != 0, axis=-1)))  # The output head trains them too.
  assert _param_count(untied) - _param_count(tied) == config.dim * config.vocab_size
  assert _param_count(tied) == tied_config.num_params()


@pytest.mark.parametrize("tied", [True, False])
def test_head_logits_are_float32_accumulated(tied):
  # The bf16 head (tied embedding or untied lm_head) multiplies bf16 operands but must not round the logits
  # to bf16 before the softmax.
  model = _model(dataclasses.replace(TINY, n_layers=1, tie_embeddings=tied))
  tokens = _tokens()
  logits = _forward(model, tokens)

  @nnx.jit
  def final_hidden(model, tokens):
    x = model.embed(tokens)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    # The model rounds each block group's output to bf16 (an optimization barrier); so must the reference.
    return model.norm(jax.lax.optimization_barrier(model.layers[0](x, positions)))  # [B, T, D] bf16

  x = np.asarray(final_hidden(model, tokens), np.float64)
  head = model.embed.embedding[...] if tied else model.lm_head.kernel[...].T
  table = np.asarray(head.astype(jnp.bfloat16), np.float64)  # [V, D]
  want = x @ table.T  # exact products of the bf16 operands
  # float32 accumulation: ~1e-6 relative; bf16-rounded logits would be off by up to 2^-9 of each.
  np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_sharding_specs_place_on_a_mesh(bf16_model):
  model = bf16_model
  specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
  P = jax.sharding.PartitionSpec
  assert specs["embed"]["embedding"].get_value() == P("fsdp", None)  # [V, D]: vocab
  assert specs["lm_head"]["kernel"].get_value() == P(None, "fsdp")  # [D, V]: vocab
  mlp = specs["layers"][0]["mlp"]
  assert mlp["up"]["kernel"].get_value() == P(None, "fsdp")  # [D, F]
  assert mlp["down"]["kernel"].get_value() == P("fsdp", None)  # [F, D]
  assert specs["layers"][0]["attn"]["k"]["kernel"].get_value() == P("fsdp", None)  # [D, K*Dh]
  assert specs["norm"]["scale"].get_value() == P(None)
  mesh = jax.make_mesh((1, 1), ("data", "fsdp"))
  shardings = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), nnx.to_pure_dict(specs),
                           is_leaf=lambda s: isinstance(s, P))
  placed = jax.device_put(nnx.to_pure_dict(nnx.state(model, nnx.Param)), shardings)
  assert placed["embed"]["embedding"].sharding.spec == P("fsdp", None)


def test_stacked_and_unrolled_layouts_hold_the_same_parameters():
  """A scanned model holds each run of same-route blocks stacked ([L_g, ...], `stacks.{g}`), initialized as the
  unrolled model (`layers.{i}`); the two convert into each other bit for bit, also between other route groups."""
  config = dataclasses.replace(TINY, n_layers=4)
  rules = RouteRules.standard("mxfp4", n_layers=4, bf16_first=1, bf16_last=1)
  unrolled = Llama(config, rules=rules, rngs=nnx.Rngs(0))
  scanned = Llama(config, rules=rules, rngs=nnx.Rngs(0), scan_layers=True)
  groups = scanned.block_groups
  assert groups == (range(0, 1), range(1, 3), range(3, 4)) and scanned.routes() == unrolled.routes()
  per_layer, stacked = (nnx.to_pure_dict(nnx.state(m)) for m in (unrolled, scanned))
  assert "stacks" not in per_layer and "layers" not in stacked
  assert stacked["stacks"][1]["mlp"]["down"]["kernel"].shape == (2, TINY.ffn_dim, TINY.dim)
  jax.tree.map(np.testing.assert_array_equal, model_lib.unstacked_params(stacked, groups), per_layer)
  jax.tree.map(np.testing.assert_array_equal, model_lib.stacked_params(per_layer, groups), stacked)
  # copy_params: into a model of other rules (bf16 everywhere: one group of 4) and back into an unrolled one.
  one_run = Llama(config, rules=RouteRules.standard("bf16", n_layers=4), rngs=nnx.Rngs(1), scan_layers=True)
  back = Llama(config, rules=rules, rngs=nnx.Rngs(2))
  model_lib.copy_params(scanned, one_run)
  model_lib.copy_params(one_run, back)
  assert one_run.block_groups == (range(0, 4),)
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(back)), per_layer)
  # Into a model of bf16 parameters: the values are cast to them (they took src's float32 and changed its dtype).
  bf16 = Llama(config, rules=rules, rngs=nnx.Rngs(3), param_dtype=jnp.bfloat16, scan_layers=True)
  model_lib.copy_params(back, bf16)
  assert {p.dtype for p in jax.tree.leaves(nnx.state(bf16))} == {jnp.dtype(jnp.bfloat16)}
  cast = jax.tree.map(lambda p: np.asarray(p.astype(jnp.bfloat16)), per_layer)
  jax.tree.map(np.testing.assert_array_equal, model_lib.unstacked_params(nnx.to_pure_dict(nnx.state(bf16)), groups),
               cast, is_leaf=lambda p: isinstance(p, np.ndarray))
  with pytest.raises(ValueError, match="copy_params needs two models of one config"):
    model_lib.copy_params(scanned, Llama(TINY, rules=RouteRules.standard("bf16", n_layers=TINY.n_layers),
                                         rngs=nnx.Rngs(0)))
  # A stacked parameter's layer axis is not sharded; the rest of its spec is the per-layer one.
  P = jax.sharding.PartitionSpec
  specs = nnx.get_partition_spec(nnx.state(scanned, nnx.Param))
  assert specs["stacks"][1]["attn"]["k"]["kernel"].get_value() == P(None, "fsdp", None)
  assert specs["stacks"][1]["mlp"]["up"]["kernel"].get_value() == P(None, None, "fsdp")


@pytest.mark.parametrize("scan,jit", [(False, True), (True, True), (False, False)])
def test_blocks_drawn_together_are_the_blocks_drawn_one_by_one(scan, jit, monkeypatch):
  """The blocks' parameters come from one draw per parameter over all blocks (`model._drawn_blocks`, vmapped over
  the stream's counts), bit for bit what drawing block after block gives: the same keys, and the stream left where
  the loop leaves it (the untied lm_head drawn after the blocks matches too). A separate "params" stream, mixed
  routes and unfused linears change nothing."""
  config = dataclasses.replace(TINY, n_layers=4, tie_embeddings=False, fuse_linears=False)
  rules = RouteRules.standard("mxfp4", n_layers=4, bf16_first=1, bf16_last=0)

  def state():
    create = lambda: nnx.to_pure_dict(nnx.state(Llama(config, rules=rules, rngs=nnx.Rngs(params=5, other=7),
                                                      scan_layers=scan)))
    return jax.jit(create)() if jit else create()
  together = state()
  monkeypatch.setattr(model_lib, "_drawn_blocks", lambda n, build, rngs: ([build(i, rngs) for i in range(n)], None))
  one_by_one = state()
  assert jax.tree.structure(together) == jax.tree.structure(one_by_one)
  jax.tree.map(np.testing.assert_array_equal, together, one_by_one)
  assert not np.array_equal(together["lm_head"]["kernel"][:, :TINY.dim], together["embed"]["embedding"].T)


def test_the_initializer_draws_once_per_parameter_whatever_the_depth():
  """A jitted initializer holds one random draw per parameter of a block, not one per parameter and block: each
  draw was a kernel of its own (a Llama-1B state took 20 s to compile, docs/BENCHMARKS.md)."""
  def draws(n_layers):
    config = dataclasses.replace(TINY, n_layers=n_layers)
    rules = RouteRules.standard("bf16", n_layers=n_layers)
    return primitive_count(jax.make_jaxpr(lambda: nnx.state(Llama(config, rules=rules, rngs=nnx.Rngs(0))))().jaxpr,
                           "random_bits")
  assert draws(2) == draws(6) > 0


@pytest.mark.parametrize("scan", [False, True])
def test_weight_decay_reaches_matrices_only_stacked_or_not(scan):
  # Norm scales, [D] per layer, are [L, D] when stacked: a 2-D leaf that must still not decay.
  model = Llama(TINY, rules=RouteRules.standard("mxfp4", n_layers=TINY.n_layers), rngs=nnx.Rngs(0),
                scan_layers=scan)
  optimizer = nnx.Optimizer(model, optax.adamw(0.1, weight_decay=0.5, mask=model_lib.weight_decay_mask),
                            wrt=nnx.Param)
  before = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  optimizer.update(model, jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param)))  # only the decay moves
  after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  moved = jax.tree_util.tree_map_with_path(lambda path, a, b: (jax.tree_util.keystr(path), bool((a != b).any())),
                                           before, after)
  moved = dict(jax.tree.leaves(moved, is_leaf=lambda x: isinstance(x, tuple)))
  assert moved and all(v == ("kernel" in k or "embedding" in k) for k, v in moved.items()), moved


def test_config_validation_and_presets(bf16_model):
  with pytest.raises(ValueError, match="self.n_heads=6 must be a multiple of self.n_kv_heads=4"):
    dataclasses.replace(TINY, dim=96, n_heads=6, n_kv_heads=4)
  with pytest.raises(ValueError, match="route rules made for 16 blocks .* given a model of 2 blocks"):
    Llama(TINY, rules=RouteRules.standard("mxfp4", n_layers=16, bf16_last=2), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="unknown Llama preset 'huge'"):
    LlamaConfig.preset("huge")
  with pytest.raises(ValueError, match="sequence length 200 exceeds"):
    bf16_model(jnp.zeros((1, 200), jnp.int32))
  assert LlamaConfig.preset("125m", vocab_size=256).vocab_size == 256
  assert set(PRESETS) == {"tiny", "30m", "125m", "350m", "1b", "llama3_8b"}
  for name, target in (("30m", 30e6), ("125m", 125e6), ("350m", 350e6), ("1b", 1.0e9)):
    assert abs(PRESETS[name].num_params() / target - 1) < 0.2, name
  assert abs(PRESETS["llama3_8b"].num_params() - 8.03e9) < 0.01e9  # Llama 3.1 8B: 8,030,261,248.


@pytest.mark.parametrize("field, value, error, match", [
    ("n_heads", 0, ValueError, r"^LlamaConfig.n_heads=0 must be >= 1$"),  # was a ZeroDivisionError
    ("n_layers", 0, ValueError, r"LlamaConfig.n_layers=0 must be >= 1"),
    ("dim", 64.0, TypeError, r"LlamaConfig.dim takes an int, got 64.0"),
    ("vocab_size", True, TypeError, r"LlamaConfig.vocab_size takes an int, got True"),
    ("rope_theta", 0, ValueError, r"LlamaConfig.rope_theta=0.0 must be a finite number > 0"),  # NaN logits
    ("norm_eps", -1e-5, ValueError, r"LlamaConfig.norm_eps=-1e-05 must be a finite number > 0"),
    ("init_std", math.nan, ValueError, r"LlamaConfig.init_std=nan must be a finite number > 0"),
    ("rope_theta", "1e4", TypeError, r"LlamaConfig.rope_theta takes a number, got '1e4'"),
    ("tie_embeddings", "false", TypeError, r"LlamaConfig.tie_embeddings takes True or False, got 'false'"),
    ("fuse_linears", 1, TypeError, r"LlamaConfig.fuse_linears takes True or False, got 1"),
    ("rope_scaling", {"factor": 8.0}, TypeError, r"rope_scaling takes a Llama3RopeScaling or None, got \{'fac"),
])
def test_config_fields_are_checked_on_construction(field, value, error, match):
  """Library users get the training CLI's checks: a string flag was truthy, a dict stood for a
  Llama3RopeScaling, rope_theta=0 or a negative norm_eps gave NaN logits."""
  with pytest.raises(error, match=match):
    dataclasses.replace(TINY, **{field: value})


def test_rope_scaling_fields_are_checked_and_numpy_scalars_stored_as_python_numbers():
  with pytest.raises(ValueError, match=r"Llama3RopeScaling.factor=0.0 must be a finite number > 0"):
    Llama3RopeScaling(factor=0)
  with pytest.raises(ValueError, match=r"Llama3RopeScaling.original_max_position=0 must be >= 1"):
    Llama3RopeScaling(original_max_position=0)
  config = dataclasses.replace(TINY, dim=np.int64(64), rope_theta=np.float32(1e4))
  assert type(config.dim) is int and type(config.rope_theta) is float and config == TINY


@pytest.mark.skipif(jax.config.jax_enable_x64, reason="float64 is float64 with jax_enable_x64")
@pytest.mark.parametrize("kwarg", ["param_dtype", "dtype"])
def test_a_float64_dtype_without_x64_is_refused_before_anything_is_built(kwarg, monkeypatch):
  """The blocks' FP4Linears refused it, but only after the [vocab, dim] embedding was built: slow at a large
  vocab."""
  monkeypatch.setattr(nnx, "Embed", lambda *a, **k: pytest.fail("built the embedding before checking the dtypes"))
  rules = RouteRules.standard("bf16", n_layers=TINY.n_layers)
  with pytest.raises(ValueError, match=rf"^Llama's {kwarg}=float64 needs jax_enable_x64 \(JAX would truncate it "):
    Llama(TINY, rules=rules, rngs=nnx.Rngs(0), **{kwarg: jnp.float64})


@pytest.mark.parametrize("config, rules, match", [
    ("tiny", RouteRules(()), r"^Llama takes a LlamaConfig .* got 'tiny'"),
    (TINY, "mxfp4", r"^Llama's rules= takes a RouteRules .* got 'mxfp4'"),
    (TINY, None, r"^Llama's rules= takes a RouteRules .* got None"),
])
def test_arguments_of_other_types_are_refused_by_name(config, rules, match):
  """They failed with AttributeErrors ('str' object has no attribute 'check_depth' / 'n_layers')."""
  with pytest.raises(TypeError, match=match):
    Llama(config, rules=rules, rngs=nnx.Rngs(0))


def test_a_scan_policy_by_name_is_refused_at_construction():
  """It failed in the first call of a scanned model ("'str' object is not callable"), and an unrolled one
  ignored it."""
  rules = RouteRules.standard("bf16", n_layers=TINY.n_layers)
  with pytest.raises(TypeError, match=r"^Llama's scan_policy= takes .*SCAN_POLICIES\[name\] \(names: \['outputs', "):
    Llama(TINY, rules=rules, rngs=nnx.Rngs(0), scan_layers=True, scan_policy="outputs")


@pytest.mark.parametrize("route, groups, saves", [("bf16", [range(0, 4)], "outputs"),
                                                  ("bf16", [range(0, 4)], "operands"),
                                                  ("mxfp4_sr", [range(0, 1), range(1, 3), range(3, 4)], "outputs")])
def test_scanned_layers_match_unrolled_bit_for_bit(route, groups, saves):
  # bf16 first/last blocks: an FP4 run in the middle is scanned, the ends run alone; all-bf16 is one scan.
  config = dataclasses.replace(TINY, n_layers=4)
  rules = RouteRules.standard(route, n_layers=4, bf16_first=1, bf16_last=1)
  tokens = _tokens(t=T + 1)

  grads = _next_token_grads(tokens)

  results, models = {}, {}
  for scan in (False, True):
    models[scan] = Llama(config, rules=rules, rngs=nnx.Rngs(0), scan_layers=scan, scan_policy=SCAN_POLICIES[saves])
    value, g = grads(models[scan], jax.random.key(3))
    results[scan] = value, jax.tree.map(np.asarray, nnx.to_pure_dict(g))
  assert list(models[True].block_groups) == groups
  assert models[False].block_groups == tuple(range(i, i + 1) for i in range(4))
  (value, g_unrolled), (value_scanned, g_scanned) = results[False], results[True]
  assert value == value_scanned
  # The scanned model holds each group's parameters stacked ([L_g, ...]); split back into layers, the gradients
  # have the unrolled tree and the same bits in every leaf.
  assert [s["mlp"]["up"]["kernel"].shape[0] for s in g_scanned["stacks"].values()] == [len(g) for g in groups]
  g_split = model_lib.unstacked_params(g_scanned, models[True].block_groups)
  assert jax.tree.structure(g_unrolled) == jax.tree.structure(g_split)
  jax.tree.map(np.testing.assert_array_equal, g_unrolled, g_split)
  # Each scanned block received its own gradient.
  assert not np.array_equal(g_split["layers"][1]["mlp"]["up"]["kernel"], g_split["layers"][2]["mlp"]["up"]["kernel"])


def _scan_residuals(route, saves):
  """dtype[shape] of each stack a 3-block scanned run allocates for its backward (one slice per block)."""
  config = dataclasses.replace(TINY, n_layers=3, attention_impl="xla")
  model = Llama(config, rules=RouteRules.standard(route, n_layers=3, bf16_first=0, bf16_last=0),
                rngs=nnx.Rngs(0), scan_layers=True, scan_policy=SCAN_POLICIES[saves])
  graphdef, state = nnx.split(model)
  tokens = _tokens()
  forward = lambda s: jax.vjp(lambda s: nnx.merge(graphdef, s)(tokens, key=jax.random.key(0)).sum(), s)[0]
  jaxpr = jax.make_jaxpr(forward)(state)  # the forward only: its `lax.empty` stacks (fp4jax.nn.scan)
  return [e.outvars[0].aval.str_short(short_dtypes=True) for e in jaxpr.eqns if e.primitive.name == "empty"]


@pytest.mark.parametrize("route", ["bf16", "mxfp4"])
def test_scanned_blocks_save_only_bf16_activations_and_quantized_operands(route):
  # Under "outputs" a scan stacks the linears' bf16 outputs and fp4_dot's uint8 codes and scales; never
  # RMSNorm's or SwiGLU's float32 intermediates (JAX's default saved them all: twice the unrolled step's
  # memory at 1B on an H200).
  stacked = _scan_residuals(route, "outputs")
  assert {dtype.split("[")[0] for dtype in stacked} == ({"bf16"} if route == "bf16" else {"bf16", "u8"}), stacked
  assert all(shape.startswith(("bf16[3,", "u8[3,")) for shape in stacked), stacked
  # "operands" adds the bf16 weights a high-precision route's backward reads (the kernels of its 4 products:
  # q|k|v and gate|up fused, o, down), and no more for an FP4 route, whose backward reads its quantized operands.
  operands = _scan_residuals(route, "operands")
  weights = [shape for shape in operands if re.fullmatch(r"bf16\[3,(64|192),(64|128|384)\]", shape)]
  if route == "bf16":
    assert sorted(weights) == ["bf16[3,192,64]", "bf16[3,64,128]", "bf16[3,64,384]", "bf16[3,64,64]"], operands
    assert len(operands) > len(stacked), operands
  else:
    assert sorted(operands) == sorted(stacked), (operands, stacked)


def _qkv():
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (2, 16, 4, 32), jnp.bfloat16)
  return (q, *(jax.random.normal(kk_, (2, 16, 2, 32), jnp.bfloat16) for kk_ in (kk, kv)))


def test_attention_auto_is_xla_off_gpu(cpu_backend):
  """attention_impl="auto" where JAX's default backend is not a GPU: XLA's attention, bit for bit."""
  q, k, v = _qkv()
  np.testing.assert_array_equal(layers.attention(q, k, v, "auto"), layers.attention(q, k, v, "xla"))
  with pytest.raises(ValueError, match=r"LlamaConfig.attention_impl='flash' must be one of \['auto', 'xla', "):
    dataclasses.replace(TINY, attention_impl="flash")


def test_float16_attention_runs_jitted_off_gpu(cpu_backend):
  """JAX's XLA attention asks for float32 products of float16 operands, which XLA:CPU refuses in a jitted program
  (eagerly JAX falls back); `layers.attention` computes them in float32, within float16's rounding of JAX's eager
  result, and a float16 Llama trains on a CPU."""
  q, k, v = (a.astype(jnp.float16) for a in _qkv())
  got = jax.jit(lambda q, k, v: layers.attention(q, k, v, "auto"))(q, k, v)
  want = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
  assert got.dtype == jnp.float16
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-3, atol=2e-3)
  model = Llama(TINY, rules=RouteRules.standard("bf16", n_layers=TINY.n_layers), rngs=nnx.Rngs(0),
                dtype=jnp.float16)
  value, _ = _next_token_grads(_tokens(t=T + 1))(model, jax.random.key(0))
  assert np.isfinite(value)


@pytest.mark.skipif(compile_bench.cuda_plugin_installed(), reason="JAX's CUDA plugin brings cuDNN, whose call lowers "
                    "only with a device")
def test_attention_auto_falls_back_without_cudnn():
  """Lowering for an H200 on a machine without cuDNN takes the cuDNN path, which refuses at trace time, so it
  warns and uses XLA's attention."""
  q, k, v = _qkv()
  from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
  mesh = AbstractMesh((1,), ("d",), abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))
  with use_abstract_mesh(mesh):
    with pytest.warns(UserWarning, match="cuDNN attention unavailable"):
      jax.jit(lambda q, k, v: layers.attention(q, k, v, "auto")).trace(q, k, v).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("head_dim, hopper, cudnn", [
    (128, False, True), (136, False, False), (136, True, True), (256, True, True), (264, True, False),
    (132, True, False),
])
def test_attention_auto_takes_cudnn_up_to_its_head_dim_limit(monkeypatch, head_dim, hopper, cudnn):
  """attention_impl="auto" on a GPU takes cuDNN's flash attention for every head dim it runs: a multiple of 8 up
  to 256 on Hopper and later (it sent 136..256 to XLA's attention, which materializes the scores), up to 128
  before. Here the platform only says it compiles for a GPU of the given kind, and a recorder stands in for
  cuDNN's call."""
  calls = []
  monkeypatch.setattr(layers.platform, "compiles_for_gpu", lambda: True)
  monkeypatch.setattr(layers.cudnn_attention, "check_compute_capability", lambda capability: hopper)
  monkeypatch.setattr(layers, "_cudnn_attention", lambda q, k, v, layer: calls.append(q.shape[-1]) or q)
  q, k, v = (jnp.zeros(a.shape[:-1] + (head_dim,), a.dtype) for a in _qkv())
  layers.attention(q, k, v, "auto")
  assert calls == ([head_dim] if cudnn else [])
  assert layers.cudnn_head_dim_max() == (256 if hopper else 128)


def test_cudnn_head_dim_max_is_128_without_a_gpu_to_ask():
  """Compiling for a GPU on a machine without one reads no compute capability: the conservative limit."""
  if jax.default_backend() == "gpu":
    pytest.skip("a GPU answers for itself")
  from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
  mesh = AbstractMesh((1,), ("d",), abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))
  with use_abstract_mesh(mesh):
    assert layers.cudnn_head_dim_max() == 128


@pytest.mark.parametrize("flags", ["", "--xla_gpu_deterministic_ops=true"])
def test_cudnn_attention_under_deterministic_ops_has_a_seed_per_block(monkeypatch, flags):
  """Under deterministic ops each block's cuDNN call carries its layer as the (unread) dropout seed, so that no
  two calls are alike (`layers._cudnn_attention`, openxla/xla#46500); otherwise it is JAX's public call. XLA's
  attention stands in for cuDNN's here: what is checked is which call each block makes."""
  xla_attention = jax.nn.dot_product_attention
  calls = []

  def public(q, k, v, *, is_causal, implementation):
    calls.append(("public", is_causal, implementation))
    return xla_attention(q, k, v, is_causal=True, implementation="xla")

  def seeded(q, k, v, *, scale, mask_type, seed):
    calls.append(("seeded", scale, mask_type, seed))
    return xla_attention(q, k, v, is_causal=True, implementation="xla")

  monkeypatch.setenv("XLA_FLAGS", flags)
  monkeypatch.setattr(jax.nn, "dot_product_attention", public)
  monkeypatch.setattr(layers.cudnn_attention, "dot_product_attention", seeded)
  config = dataclasses.replace(TINY, n_layers=3, attention_impl="cudnn")
  _model(config)(_tokens(), key=jax.random.key(0))
  if flags:
    causal, scale = layers.cudnn_attention.MaskType.CAUSAL, 1 / math.sqrt(config.head_dim)
    assert calls == [("seeded", pytest.approx(scale, rel=1e-15), causal, layer) for layer in range(3)]
  else:
    assert calls == [("public", True, "cudnn")] * 3


@pytest.mark.gpu
def test_cudnn_attention_backward_of_two_blocks_runs_deterministic_on_the_gpu():
  """The tests run with deterministic ops (conftest). Two unrolled blocks of one shape made XLA:GPU's program
  fail at its start with an IndexError (`raw_hash_map<>::at`) before each block's cuDNN call got its own seed;
  now the step runs on cuDNN's backward and gives the same bits twice."""
  from fp4jax import platform  # pylint: disable=g-import-not-at-top
  assert platform.deterministic_ops()
  model = _model(dataclasses.replace(TINY, n_layers=2, attention_impl="cudnn"))
  tokens = _tokens(t=T + 1)
  graphdef, state = nnx.split(model)

  def loss(state):
    logits = nnx.merge(graphdef, state)(tokens[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

  step = jax.jit(jax.grad(loss)).lower(state).compile()
  assert len(re.findall(r'custom_call_target="__cudnn\$fmha\w*Backward"', step.as_text())) == 2
  first, second = (jax.tree.map(np.asarray, step(state)) for _ in range(2))
  jax.tree.map(np.testing.assert_array_equal, first, second)


def _dots_per_forward(model, tokens):
  """dot_general equations in the jaxpr of the model's forward (XLA attention: 2 per block)."""
  jaxpr = jax.make_jaxpr(lambda m: m(tokens, key=jax.random.key(0)))(model).jaxpr

  def count(j):
    return sum((e.primitive.name == "dot_general") + sum(count(getattr(p.jaxpr, "jaxpr", p.jaxpr))
               for p in e.params.values() if hasattr(p, "jaxpr")) for e in j.eqns)
  return count(jaxpr)


@pytest.mark.parametrize("route", ["bf16", "mxfp4"])
def test_fused_linears_are_one_product_with_the_same_parameters(route):
  """fuse_linears (the default) runs q|k|v and gate|up as one product each: 4 GEMMs per block instead of 7, the
  same parameter tree, and the same forward numbers up to the order of the GEMM's sums (x and each kernel column
  quantize alike: RNE, per-block scales along K); the gradients differ as that, the fused dX sums and a keyed
  dY do. The emulated GEMM on every device: `_dots_per_forward` counts its dot_general (on Hopper the fp8
  backend's GEMM is a cond of two)."""
  config = dataclasses.replace(TINY, attention_impl="xla", n_layers=1)
  fused = _model(config, route, EMULATED)
  unfused = _model(dataclasses.replace(config, fuse_linears=False), route, EMULATED)
  assert fused.layers[0].attn.fused and fused.layers[0].mlp.fused and not unfused.layers[0].attn.fused
  assert jax.tree.structure(nnx.state(fused)) == jax.tree.structure(nnx.state(unfused))
  for a, b in zip(jax.tree.leaves(nnx.state(fused)), jax.tree.leaves(nnx.state(unfused))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  tokens = _tokens()
  assert _dots_per_forward(fused, tokens) + 3 == _dots_per_forward(unfused, tokens)
  logits = [np.asarray(m(tokens, key=jax.random.key(0)), np.float32) for m in (fused, unfused)]
  np.testing.assert_allclose(logits[0], logits[1], rtol=1e-6, atol=1e-6)

  def grads(model):
    graphdef, state = nnx.split(model)
    return jax.grad(lambda s: jnp.mean(nnx.merge(graphdef, s)(tokens, key=jax.random.key(0)) ** 2))(state)
  g_fused, g_unfused = grads(fused), grads(unfused)
  q = [np.asarray(g["layers"][0]["attn"]["q"]["kernel"][...], np.float32) for g in (g_fused, g_unfused)]
  scale = np.abs(q[1]).max()
  # bf16: one GEMM of N = 128 instead of three sums in another order, so the bf16 activations differ by an ulp
  # here and there; mxfp4's dY views round stochastically: other keys, other bits.
  tolerance = 0.02 if route == "bf16" else 0.25
  np.testing.assert_allclose(q[0], q[1], atol=tolerance * scale)


def test_linears_with_different_routes_are_not_fused():
  rules = RouteRules.parse([r"layers\.0\.attn\.k=mxfp4", r"layers\.0\.mlp\.up=nvfp4"], default="bf16")
  model = Llama(dataclasses.replace(TINY, n_layers=1), rules=rules, rngs=nnx.Rngs(0))
  assert not model.layers[0].attn.fused and not model.layers[0].mlp.fused
  with pytest.raises(ValueError, match="one input size, route"):
    linear.fused_call([model.layers[0].attn.q, model.layers[0].attn.k], jnp.zeros((2, TINY.dim), jnp.bfloat16))


def test_scan_layers_auto_scans_quantized_blocks_only():
  assert not _model().scan_layers  # the library's default: unrolled
  rules = lambda route, **kw: RouteRules.standard(route, n_layers=TINY.n_layers, **kw)
  auto = lambda r: Llama(TINY, rules=r, rngs=nnx.Rngs(0), scan_layers="auto").scan_layers
  assert auto(rules("mxfp4")) and auto(rules("fp8")) and not auto(rules("bf16"))
  assert not auto(rules("mxfp4", bf16_first=1, bf16_last=1))  # both tiny blocks in bf16: nothing to gain
  with pytest.raises(ValueError, match="scan_layers takes True, False or 'auto'"):
    Llama(TINY, rules=rules("bf16"), rngs=nnx.Rngs(0), scan_layers="yes")


def test_scanned_blocks_read_their_stacked_master_weights_as_bf16():
  # A scanned model's state holds each parameter once, float32 [L, ...]. The loop takes those very arrays (no
  # cast or stacked copy of them is made per step) and reads each layer's kernel slice as the bf16 its product
  # uses, so the backward's gradient stacks of kernels are bf16 (half the bytes); norm scales stay float32.
  config = dataclasses.replace(TINY, n_layers=3)
  model = Llama(config, rules=RouteRules.standard("mxfp4", n_layers=3, bf16_first=0, bf16_last=0),
                rngs=nnx.Rngs(0), scan_layers=True)
  graphdef, state = nnx.split(model)
  d, f, kv = TINY.dim, TINY.ffn_dim, TINY.n_kv_heads * TINY.dim // TINY.n_heads
  kernels = [(3, d, d)] * 2 + [(3, d, kv)] * 2 + [(3, d, f)] * 2 + [(3, f, d)]
  stack = nnx.state(model.stacks[0])
  assert sorted(x.shape for x in jax.tree.leaves(stack)) == sorted(kernels + [(3, d)] * 2)
  assert {x.dtype for x in jax.tree.leaves(stack)} == {np.dtype(np.float32)}
  loss = lambda s: nnx.merge(graphdef, s)(_tokens(), key=jax.random.key(0)).sum()
  jaxpr = jax.make_jaxpr(jax.grad(loss))(state)
  sizes = {math.prod(x.shape) for x in jax.tree.leaves(stack)}
  whole = [(e.primitive.name, a) for e in jaxpr.eqns if e.outvars and (a := e.outvars[0].aval).shape[:1] == (3,)
           and math.prod(a.shape) in sizes and jnp.issubdtype(a.dtype, jnp.floating)]
  # Outside the loops a stack is only reshaped ([L, prod(shape)] in the loop), and the gradient stacks are
  # allocated and the bf16 ones converted once to float32: no whole-stack cast to bf16.
  assert {name for name, _ in whole} == {"empty", "convert_element_type", "reshape"}, whole
  assert all(a.dtype == jnp.float32 for name, a in whole if name == "convert_element_type"), whole
  grads = sorted((str(a.dtype), a.shape[1]) for name, a in whole if name == "empty" and a.ndim == 2)  # [L, size]
  assert grads == sorted([("bfloat16", math.prod(k[1:])) for k in kernels] + [("float32", d)] * 2), grads


_EXPLICIT_MESH = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from fp4jax.nn import RouteRules
from fp4jax.nn.llama import Llama, LlamaConfig
route, scan = sys.argv[1], sys.argv[2] == "scan"
build = lambda: Llama(LlamaConfig.preset("tiny"), rules=RouteRules.standard(route, n_layers=2), rngs=nnx.Rngs(0),
                      scan_layers=scan)
loss = lambda model, tokens, key: jnp.mean(model(tokens, key=key) ** 2)
step = lambda *args: nnx.jit(nnx.value_and_grad(loss))(*args)
tokens, key = jax.random.randint(jax.random.key(0), (4, 32), 0, 256), jax.random.key(3)
want = step(build(), tokens, key)
def on_mesh(axis_type):
  mesh = jax.make_mesh((2, 2), ("data", "fsdp"), axis_types=(axis_type,) * 2)
  with jax.set_mesh(mesh):
    model = build()
    state = nnx.state(model)  # FSDP: each matrix split along "fsdp" (the model's sharding metadata)
    nnx.update(model, jax.tree.map(lambda v, s: jax.device_put(v, NamedSharding(mesh, s)), state,
                                   nnx.get_partition_spec(state)))
    specs = [str(v.sharding.spec) for v in jax.tree.leaves(nnx.state(model))]
    return step(model, jax.device_put(tokens, NamedSharding(mesh, P(("data", "fsdp")))), key), specs
(got, specs), (auto, _) = on_mesh(jax.sharding.AxisType.Explicit), on_mesh(jax.sharding.AxisType.Auto)
grads = lambda out: jax.tree.leaves(out[1])
error = lambda a, b: [float(np.abs(np.asarray(x) - y).max() / np.abs(y).max()) for x, y in zip(grads(a), grads(b))]
print(json.dumps({"losses": [float(want[0]), float(got[0]), float(auto[0])], "param_specs": specs,
                  "grad_specs": [str(g.sharding.spec) for g in grads(got)],
                  "vs_one_device": error(got, want), "vs_auto": error(got, auto)}))
"""


@pytest.mark.parametrize("route,how", [("mxfp4", "scan"), ("bf16", "unrolled")])
def test_a_mesh_of_explicit_axes_gives_the_one_device_numbers(route, how):
  """Under `jax.make_mesh`'s default, Explicit axes (2 x 2, data and FSDP, 4 CPU devices): the embedding's gather
  and the scanned blocks used to fail for want of output shardings; now the loss is the one-device loss, the
  gradients are those of the same mesh with Auto axes up to bf16 rounding, each split as its parameter is."""
  out = json.loads(cpu_devices.run(_EXPLICIT_MESH, 4, route, how).stdout)
  np.testing.assert_allclose(out["losses"][1:], [out["losses"][0]] * 2, rtol=1e-6)
  assert out["grad_specs"] == out["param_specs"] and any("fsdp" in s for s in out["param_specs"]), out
  # bf16 partial sums added across devices in another order move a gradient by up to ~0.6% of its largest
  # element against the Auto mesh's, ~3% against one device's; a shard lost or summed twice would move it ~100%.
  assert max(out["vs_auto"]) < 1e-2 and max(out["vs_one_device"]) < 5e-2, out
