"""Operands given as the op that produces them (`numerics.produced`): the MXFP4 dual-view kernel computes SwiGLU
from y in its own pass, with the bits of quantizing its value; every other case quantizes the value, with the
same bits. SwiGLU's derivative is JAX's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax.numerics import produced
from fp4jax.numerics.produced import Produced
from fp4jax.numerics.spec import OperandKeys, OperandSpec
from fp4jax.ops.quantize import api
from fp4jax.ops.quantize.pallas import sources
from fp4jax.ops.quantize.pallas.tiling import QuantTile
from quantize_inputs import INPUTS, assert_same, bits, rng_for

S = OperandSpec
SR, RNE = S("mxfp4", "sr"), S("mxfp4")
KEYS = (OperandKeys(jax.random.key(1)), OperandKeys(jax.random.key(2), transform=jax.random.key(3)))


def _y(kind: str, m: int, f: int, rng) -> jax.Array:
  """y [m, 2f] (gate | up) in bf16: `kind` of quantize_inputs for the gate (the sigmoid's tails, zeros, NaN
  and huge values), normal up."""
  gate = INPUTS[kind](rng, (m, f))
  up = INPUTS["normal"](rng, (m, f)) * 3
  return jnp.asarray(np.concatenate([gate, up], axis=1), jnp.bfloat16)


@pytest.fixture
def launches(monkeypatch):
  """The kinds of x the dual-view kernels were launched on ("array" or a `Produced` kind), in order."""
  jax.clear_caches()  # kernels traced by earlier tests would not reach the spy
  seen, launch = [], sources.launch_inputs

  def spy(x, t, **kw):
    seen.append(getattr(x, "kind", "array"))
    return launch(x, t, **kw)

  monkeypatch.setattr(sources, "launch_inputs", spy)
  return seen


@pytest.mark.parametrize("kind,row,col,m,f", [
    ("normal", RNE, RNE, 64, 128),
    ("special", SR, S("mxfp4", transform="h32"), 64, 128),
    ("nonfinite", SR, RNE, 64, 128),
    ("heavy", RNE, S("mxfp4", "sr", transform="rht16"), 32, 256),
])
def test_kernel_computes_the_produced_operand(kind, row, col, m, f, launches):
  x = Produced("swiglu", (_y(kind, m, f, rng_for("produced", kind, m, f)),))
  got = api.quantize_views(x, row, col, *KEYS, implementation="interpret")
  want = api.quantize_views(x.value(), row, col, *KEYS, implementation="xla")
  assert launches == ["swiglu"]  # computed in the kernel, not from a value
  for g, w in zip(got, want):
    assert_same(g, w)


def test_uncovered_cases_quantize_the_value(launches):
  """NVFP4's kernel needs x's tensor amax before its pass: it quantizes the value, with the same bits."""
  x = Produced("swiglu", (_y("normal", 32, 128, rng_for("produced", "nvfp4")),))
  got = api.quantize_views(x, S("nvfp4"), S("nvfp4"), *KEYS, implementation="interpret")
  want = api.quantize_views(x.value(), S("nvfp4"), S("nvfp4"), *KEYS, implementation="xla")
  for g, w in zip(got, want):
    assert_same(g, w)
  assert launches == ["array"]


def test_one_view_takes_the_value():
  x = Produced("swiglu", (_y("normal", 32, 128, rng_for("produced", "one view")),))
  got = api.quantize_operand(x, SR, 0, KEYS[0], implementation="interpret")
  assert_same(got, api.quantize_operand(x.value(), SR, 0, KEYS[0], implementation="xla"))


def test_produced_checks_its_inputs():
  with pytest.raises(ValueError, match="kind takes one of"):
    Produced("gelu", (jnp.zeros((4, 6), jnp.bfloat16),))
  with pytest.raises(ValueError, match="even last dim"):
    Produced("swiglu", (jnp.zeros((4, 5), jnp.bfloat16),))
  x = Produced("swiglu", (jnp.zeros((2, 4, 6), jnp.bfloat16),))
  assert (x.shape, x.ndim, x.dtype) == ((2, 4, 3), 3, jnp.bfloat16)
  assert jax.tree.leaves(x) == list(x.inputs)


def _silu_mlp(y):
  """SwiGLU as JAX differentiates it: `jax.nn.silu` (what the Llama MLP computed before `produced.swiglu`)."""
  gate, up = jnp.split(y, 2, axis=-1)
  return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(y.dtype)


def test_swiglu_and_its_derivative_are_jaxs():
  """`swiglu` and its derivative equal JAX's own of `jax.nn.silu(g) * u`, bit for bit, for every bf16 gate of
  magnitude up to 80, in XLA:CPU's programs (beyond 80 its vectorized exp rounds unlike its scalar one, so two
  differently fused CPU programs differ; the GPU test below takes every bf16 gate through the kernel). XLA:GPU's
  two programs differed in 255 derivatives near zero, +-0 against values below 1e-37 (docs/BENCHMARKS.md,
  "Session of 2026-12-06, 09:58 UTC")."""
  with jax.default_device(jax.devices("cpu")[0]):
    _swiglu_and_its_derivative_are_jaxs()


def _swiglu_and_its_derivative_are_jaxs():
  g = np.arange(1 << 16, dtype=np.uint16).view(jnp.bfloat16)
  g = g[np.abs(g.astype(np.float32)) <= 80]  # NaNs dropped too
  rng = rng_for("produced", "jax")
  u, dh = (jnp.asarray(rng.standard_normal(g.size) * 4, jnp.bfloat16) for _ in range(2))
  y = jnp.concatenate([jnp.asarray(g), u])[None]
  for fn in (_silu_mlp, produced.swiglu):
    h, vjp = jax.jit(lambda y, fn=fn: jax.vjp(fn, y))(y)
    if fn is _silu_mlp:
      want = bits(h), bits(jax.jit(vjp)(dh[None])[0])
    else:
      np.testing.assert_array_equal(bits(h), want[0])
      np.testing.assert_array_equal(bits(jax.jit(vjp)(dh[None])[0]), want[1])


def _kernel_values(x: Produced, interpret: bool) -> np.ndarray:
  """x's values as a Pallas kernel computes them from `sources.launch_inputs`' tiles: float32 bits [M, K]."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  m, k = x.shape
  t = QuantTile(32, 64)
  inputs, tile_of = sources.launch_inputs(x, t, interpret=interpret)

  def kernel(*refs):
    got = tile_of(refs[:-1]).bits()
    for (p, q), b in got.items():
      refs[-1][2 * p + q] = b

  out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((4, m // 2, k // 2), jnp.int32),
                       grid=(m // t.block_m, k // t.block_k), in_specs=[spec for _, spec in inputs],
                       out_specs=pl.BlockSpec((4, t.block_m // 2, t.block_k // 2), lambda i, j: (0, i, j)),
                       interpret=interpret)(*[a for a, _ in inputs])
  return np.asarray(out).reshape(2, 2, m // 2, k // 2).transpose(2, 0, 3, 1).reshape(m, k)


def _every_gate_check(interpret: bool, gates: np.ndarray) -> None:
  """The kernel's SwiGLU values equal XLA's (`swiglu`) bit for bit for the bf16 `gates` [n, 128, 128] (one
  y [128, 256] each) against random up values."""
  rng = rng_for("produced", "every gate", interpret)
  for gate in gates:
    up = rng.standard_normal(gate.shape).astype(np.float32) * 4
    x = Produced("swiglu", (jnp.asarray(np.concatenate([gate.astype(np.float32), up], axis=1), jnp.bfloat16),))
    want = np.asarray(jax.jit(lambda x: x.value())(x), np.float32).view(np.int32)
    got = _kernel_values(x, interpret)
    nan = np.isnan(want.view(np.float32))
    np.testing.assert_array_equal(np.isnan(got.view(np.float32)), nan)
    np.testing.assert_array_equal(got[~nan], want[~nan])


def test_kernel_values_equal_xlas_in_interpret_mode():
  """In interpret mode, against XLA:CPU, for gates of magnitude up to 80 (see the test above)."""
  g = np.arange(1 << 16, dtype=np.uint16).view(jnp.bfloat16)
  g = g[np.abs(g.astype(np.float32)) <= 80][:128 * 128]
  _every_gate_check(True, g.reshape(1, 128, 128))


@pytest.mark.gpu
def test_gpu_kernel_values_equal_xlas_for_every_bf16_gate():
  """On the GPU: the kernel's SwiGLU (libdevice's expf, the inline rcp.approx) equals XLA:GPU's for all 65,536
  bf16 gates, NaNs and infinities included."""
  _every_gate_check(False, np.arange(1 << 16, dtype=np.uint16).view(jnp.bfloat16).reshape(4, 128, 128))
