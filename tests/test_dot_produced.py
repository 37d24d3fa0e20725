"""fp4_dot of an x given as the op that produces it (`numerics.produced.Produced`): the numbers of fp4_dot of its
value, forward and backward, the gradient carried to the op's inputs; the Llama MLP hands down its SwiGLU so."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fp4jax import Impl, fp4_dot
from fp4jax.nn import RouteRules
from fp4jax.nn.llama import Llama, LlamaConfig
from fp4jax.numerics.produced import Produced, swiglu
from fp4jax.ops.quantize.pallas import sources
from seeded import fresh_rng

KEY = jax.random.key(2)


def _operands(f=128, n=64, lead=(2, 16), seed=""):
  """y [*lead, 2f] (a gate|up output) and w [f, n] in bf16."""
  rng = fresh_rng(f"produced dot/{f}/{n}/{lead}/{seed}")
  y = jnp.asarray(rng.standard_normal((*lead, 2 * f)) * 2, jnp.bfloat16)
  return y, jnp.asarray(rng.standard_normal((f, n)) * 0.1, jnp.bfloat16)


def _value_and_grads(y, w, route, impl, produced: bool):
  x = (lambda y: Produced("swiglu", (y,))) if produced else swiglu
  z, vjp = jax.vjp(lambda y, w: fp4_dot(x(y), w, route=route, key=KEY, impl=impl), y, w)
  return (z, *vjp(jnp.cos(z.astype(jnp.float32)).astype(z.dtype)))


def _assert_equal(got, want):
  for g, w in zip(got, want):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


@pytest.fixture
def launches(monkeypatch):
  """The kinds of x the dual-view kernels were launched on ("array" or a `Produced` kind)."""
  jax.clear_caches()  # kernels traced by earlier tests would not reach the spy
  seen, launch = [], sources.launch_inputs
  monkeypatch.setattr(sources, "launch_inputs", lambda x, t, **kw: seen.append(getattr(x, "kind", "array")) or
                      launch(x, t, **kw))
  return seen


@pytest.mark.parametrize("route,quantizer,gemm", [
    ("mxfp4", "interpret", "fp8"), ("mxfp4_h32", "interpret", "emulated"), ("nvfp4", "interpret", "fp8"),
    ("quartet2", "xla", "emulated"), ("bf16", "xla", "emulated")])
def test_produced_x_has_the_bits_of_its_value(route, quantizer, gemm, launches):
  y, w = _operands(seed=route)
  impl = Impl(quantizer=quantizer, gemm=gemm)
  got = jax.jit(lambda y, w: _value_and_grads(y, w, route, impl, True))(y, w)
  _assert_equal(got, jax.jit(lambda y, w: _value_and_grads(y, w, route, impl, False))(y, w))
  assert ("swiglu" in launches) == route.startswith("mxfp4")  # the MXFP4 kernel computes it, the others not


@pytest.mark.parametrize("lead,f", [((7,), 128), ((2, 16), 80)])  # M or K not whole MXFP4 blocks: zero padding
def test_produced_x_that_needs_padding_is_its_value(lead, f, launches):
  y, w = _operands(f=f, lead=lead)
  impl = Impl(quantizer="interpret", gemm="emulated")
  _assert_equal(_value_and_grads(y, w, "mxfp4", impl, True), _value_and_grads(y, w, "mxfp4", impl, False))
  assert "swiglu" not in launches


def test_fuse_producers_off_writes_the_value_first(launches):
  y, w = _operands()
  impl = Impl(quantizer="interpret", gemm="emulated", fuse_producers=False)
  fp4_dot(Produced("swiglu", (y,)), w, route="mxfp4", key=KEY, impl=impl)
  assert "array" in launches and "swiglu" not in launches
  with pytest.raises(ValueError, match="fuse_producers takes True or False"):
    Impl(fuse_producers="yes")


def test_produced_x_of_the_wrong_size_is_refused_by_name():
  y, w = _operands()
  with pytest.raises(ValueError, match=r"fp4_dot needs x \[..., K\] and w \[K, N\]"):
    fp4_dot(Produced("swiglu", (y,)), w[1:], route="mxfp4", key=KEY)


def test_equality_of_produced_operands_is_a_clear_type_error():
  """`==` of two `Produced` of their own arrays would compare the arrays element by element (NumPy's "truth value
  ... is ambiguous"): a TypeError saying what to compare instead; the same object and shape-only ones compare."""
  y = jnp.ones((4, 64), jnp.bfloat16)
  with pytest.raises(TypeError, match="Produced == compares arrays element by element"):
    _ = Produced("swiglu", (y,)) == Produced("swiglu", (y + 1,))
  p = Produced("swiglu", (y,))
  assert p == p and p != y
  abstract = jax.eval_shape(lambda y: Produced("swiglu", (y,)), y)
  assert abstract == jax.eval_shape(lambda y: Produced("swiglu", (y,)), y)


@pytest.mark.parametrize("scan", [False, True])
def test_llama_hands_down_its_swiglu_with_the_same_numbers(scan, launches):
  """A Llama under mxfp4_sr gives the same loss and gradients with `Impl.fuse_producers` on (down's quantizers
  compute SwiGLU) and off (SwiGLU written out first), unrolled and scanned."""
  config = dataclasses.replace(LlamaConfig.preset("tiny"), n_layers=2, attention_impl="xla")
  rules = RouteRules.standard("mxfp4_sr", n_layers=2, bf16_first=0, bf16_last=0)
  tokens = jax.random.randint(jax.random.key(0), (2, 33), 0, config.vocab_size, jnp.int32)
  results = []
  for fuse in (True, False):
    impl = Impl(quantizer="interpret", gemm="fp8", fuse_producers=fuse)
    graphdef, state = nnx.split(Llama(config, rules=rules, rngs=nnx.Rngs(0), impl=impl, scan_layers=scan))

    def loss(s):
      logits = nnx.merge(graphdef, s)(tokens[:, :-1], key=jax.random.key(5))
      return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

    value, grads = jax.jit(jax.value_and_grad(loss))(state)
    results.append((value, jax.tree.leaves(grads)))
    assert ("swiglu" in launches) == fuse
    launches.clear()
  (v1, g1), (v2, g2) = results
  assert v1 == v2
  _assert_equal(g1, g2)


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["mxfp4", "mxfp4_h32", "nvfp4"])
def test_gpu_produced_x_has_the_bits_of_its_value(route):
  """On the GPU with the kernels and the fp8 backend, at a Llama-like shape (M = 2048, F = 1024)."""
  y, w = _operands(f=1024, n=512, lead=(4, 512), seed=route)
  got = jax.jit(lambda y, w: _value_and_grads(y, w, route, Impl(), True))(y, w)
  _assert_equal(got, jax.jit(lambda y, w: _value_and_grads(y, w, route, Impl(), False))(y, w))
