"""What is specific to the MS-EDEN kernel: its pre-SR targets t (exposed for tests), explicit column blocks,
quartet2's dequantized input, a given amax, its coverage, and in its Triton IR the exact divisions and no turned
outputs. Its bits against the reference in fp4_dot's recipes: test_conformance.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax.numerics import reference
from fp4jax.numerics.hadamard import hadamard
from fp4jax.numerics.spec import OperandKeys, OperandSpec
from fp4jax.ops.quantize import pallas
from fp4jax.ops.quantize.pallas import common, eden
from quantize_inputs import INPUTS, bits, rng_for, tile_turns

KEY, TKEY = jax.random.key(5), jax.random.key(6)
KEYS = OperandKeys(KEY, TKEY)


def _spec(transform="rht128"):
  return OperandSpec("nvfp4", "eden", transform=transform)


def _reference(x, axis, transform, tensor_amax=None):
  xt = hadamard(x, transform, axis=axis, key=TKEY) if transform else x
  q = reference.quantize(xt, "nvfp4", axis=axis, rounding="eden", key=KEY, tensor_amax=tensor_amax)
  xk = jnp.moveaxis(xt.astype(jnp.float32), axis, -1)
  t = reference._eden_targets(xk.reshape(*xk.shape[:-1], -1, 16), tensor_amax)[1]  # pylint: disable=protected-access
  return q, t


def _check(x, axis=0, transform="rht128", *, tensor_amax=None, **opts):
  """Codes, scales, outer and the pre-SR targets t against the reference, compared as bit patterns."""
  got, t = eden.operand(x, _spec(transform), axis, KEYS, tensor_amax=tensor_amax, targets=True,
                        **{"interpret": True, **opts})
  want, want_t = _reference(x, axis, transform, tensor_amax)
  assert (got.fmt, got.axis, got.shape) == (want.fmt, want.axis % 2, want.shape)
  for name, g, w in (("codes", got.codes, want.codes), ("scales", got.scales, want.scales),
                     ("outer", got.outer, want.outer), ("t", t, want_t)):
    g, w = bits(g), bits(w)
    assert g.shape == w.shape, (name, g.shape, w.shape)
    bad = np.argwhere(g != w)
    assert bad.size == 0, f"{name}: {len(bad)} mismatches, first at {bad[:3].tolist()}"
  return got


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("kind", ["heavy", "special"])
def test_targets_match_reference(kind, axis):
  """bf16 dY as quartet2's backward sees it: both views, a 2 x 4 grid of programs (block_c 16)."""
  x = INPUTS[kind](rng_for("eden", kind, axis), (64, 256))
  x = x.T if axis == 0 else x  # 256 along the quantized axis
  _check(jnp.asarray(x, jnp.bfloat16), axis, block_c=16)


def test_dequantized_fp4_input():
  """quartet2's X^: the 4/6 NVFP4 values of X, dequantized in float32, then rotated and quantized along M."""
  x = jnp.asarray(INPUTS["heavy"](np.random.default_rng(3), (128, 64)))
  _check(reference.dequantize(reference.quantize(x, "nvfp4_46")), 0)


def test_zeros_and_nonfinite():
  _check(jnp.zeros((128, 32), jnp.bfloat16), 0)  # s_dec = 1, every den = 0 -> c = 1
  x = INPUTS["normal"](np.random.default_rng(4), (256, 32))
  x[3, 5], x[200, 7], x[130, 9] = np.nan, np.inf, -np.inf  # three groups NaN, the others normal
  _check(jnp.asarray(x, jnp.bfloat16), 0, None, tensor_amax=jnp.float32(4.0))
  _check(jnp.asarray(x, jnp.bfloat16), 0)  # rotated amax NaN: every group bad, outer NaN


@pytest.mark.parametrize("scale", [1e-30, 1e30])
def test_tiny_and_huge_tensors(scale):
  x = INPUTS["normal"](np.random.default_rng(8), (128, 32)) * np.float32(scale)
  _check(jnp.asarray(x), 0)


@pytest.mark.parametrize("amax", [0.5, 1e-3, float("inf"), -1.0])
def test_given_tensor_amax(amax):
  """A given (e.g. delayed) amax below the true one: s_b clamps at 448, |ys| beyond 6 saturates; one that is
  infinite or negative makes the tensor NaN (`quantize_args.amax_value`)."""
  _check(jnp.asarray(INPUTS["normal"](np.random.default_rng(9), (128, 32))), 0, tensor_amax=jnp.float32(amax))


@pytest.mark.parametrize("spec,x,axis,why", [
    (OperandSpec("nvfp4", "sr"), (128, 64), 0, "MS-EDEN kernel"),
    (_spec(), (64, 256), 0, "quantized axis a multiple of 128"),
    (_spec(), (128, 24), 0, "the other of 16"),
    (_spec("rht128"), (2, 128, 64), 1, "2-D"),
])
def test_uncovered_cases_raise_not_implemented(spec, x, axis, why):
  with pytest.raises(NotImplementedError, match=why):
    eden.operand(jnp.ones(x, jnp.bfloat16), spec, axis, KEYS, interpret=True)
  with pytest.raises(NotImplementedError, match="float16"):
    eden.operand(jnp.ones((128, 64), jnp.float16), _spec(), 0, KEYS, interpret=True)


def test_errors():
  x = jnp.ones((128, 32), jnp.bfloat16)
  with pytest.raises(ValueError, match="needs a transform key"):
    eden.operand(x, _spec(), 0, OperandKeys(KEY), interpret=True)
  with pytest.raises(ValueError, match="pass a rounding key"):
    eden.operand(x, _spec(None), 0, OperandKeys(), interpret=True)


def test_triton_lowering_divides_exactly(triton_modules):
  """The Triton IR (lowered on CPU for an abstract H200): no float division of Triton's own (approximate), the
  divisions and the products feeding sums as PTX asm with explicit rounding."""
  modules = triton_modules(lambda x: eden.operand(x, _spec(), 1, KEYS), (256, 256))
  assert len(modules) == 2  # the rotated amax, the quantizer
  assert all("divf" not in m for m in modules)
  assert "div.rn.f32" in modules[1] and "mul.rn.f32" in modules[1]


@pytest.mark.parametrize("axis, turns", [(1, 1), (0, 0)])
def test_quantizer_stores_what_it_holds(triton_modules, axis, turns):
  """The quantizer turns no value it stores: only the row view's loaded tile is transposed in registers.
  Transposes of its outputs make XLA's Triton lowering of this kernel an order of magnitude slower to compile
  (docs/BENCHMARKS.md); the codes and scales leave it as held and XLA turns them."""
  modules = triton_modules(lambda x: eden.operand(x, _spec(), axis, KEYS), (256, 256))
  assert tile_turns(modules[1]) == turns


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_views_are_one_kernel_whatever_the_shape_and_axis(triton_modules, dtype):
  """Through fp4_dot's dispatch (`pallas.operand`: dY's dgrad view along K and wgrad view along M, quartet2's
  requantized X^ and W^ in float32), operands of three shapes and both axes lower to one amax kernel and one
  quantizer: a view along K runs on the canonical [M * K / 128, 128] layout, whose strides do not depend on
  the shape, and a view along M as the view along K of x^T."""
  irs = set()
  for shape in ((256, 384), (512, 1024), (1024, 256)):
    for axis in (0, 1):
      modules = triton_modules(lambda x: pallas.operand(x.astype(dtype), _spec(), axis, KEYS, interpret=False),
                               shape)
      assert len(modules) == 2  # the rotated amax, the quantizer
      irs.add(tuple(map(common.without_launch_digests, modules)))  # each launch has its own name
  assert len(irs) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("axis", [0, 1])
def test_gpu_targets_match_reference(axis):
  """The compiled kernels' pre-SR targets on [1024, 512] heavy-tailed inputs against the reference compiled for
  the GPU (exact divisions)."""
  x = jnp.asarray(INPUTS["heavy"](rng_for("gpu eden", axis), (1024, 512)), jnp.bfloat16)
  got, t = eden.operand(x, _spec(), axis, KEYS, targets=True)
  want, want_t = jax.jit(lambda x: _reference(x, axis, "rht128"))(x)
  for name, g, w in (("codes", got.codes, want.codes), ("scales", got.scales, want.scales),
                     ("outer", got.outer, want.outer), ("t", t, want_t)):
    assert np.array_equal(bits(g), bits(w)), (name, int(np.sum(bits(g) != bits(w))))
