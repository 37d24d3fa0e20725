"""FP8 per-tensor current scaling ("fp8_e4m3", "fp8_e5m2"): quantize and dequantize against an independent numpy
implementation bit for bit (tests/numpy_ref.py), its QTensor, and one quantization serving both axes."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import numpy_ref
from seeded import fresh_rng
from fp4jax.numerics import current_scaling, ieee
from fp4jax.numerics import reference as ref

FMTS = ("fp8_e4m3", "fp8_e5m2")
SHAPE = (48, 40)


def _inputs() -> dict[str, np.ndarray]:
  """Fresh inputs each run: random, heavy tails, outliers, values that land on FP8 subnormals, ties, edges."""
  rng = fresh_rng()
  normal = rng.standard_normal(SHAPE)
  outliers = normal.copy()
  outliers[rng.integers(0, SHAPE[0], 4), rng.integers(0, SHAPE[1], 4)] = [3e38, -1e30, 7e4, -6e4]
  # Magnitudes over 2^[-40, 0] of the tensor max: FP8 normals, subnormals and values that round to zero, all
  # normal float32 (XLA:CPU reads float32 subnormal inputs as zero: outside the contract).
  subnormal = np.sign(normal) * np.exp2(rng.uniform(-40, 0, SHAPE))
  subnormal[0, 0] = 1.0
  # With amax 448 (E4M3) or 57344 (E5M2) the scale is exactly 1: grid points and midpoints between neighbours.
  ties = {}
  for fmt, (dtype, fmax) in numpy_ref.FP8.items():
    grid = np.sort(np.unique(np.abs(np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64))))
    grid = grid[np.isfinite(grid)]
    mids = (grid[:-1] + grid[1:]) / 2
    t = rng.choice(np.concatenate([grid, mids]), SHAPE) * rng.choice([-1, 1], SHAPE)
    t[0, 0] = fmax
    ties[fmt] = t
  zeros = np.zeros(SHAPE)
  zeros[::2] = -0.0
  nan, inf = normal.copy(), normal.copy()
  nan[5, 7] = np.nan
  inf[9, 1] = -np.inf
  return {name: np.asarray(v, np.float32) for name, v in dict(
      normal=normal, student_t=rng.standard_t(2, SHAPE), outliers=outliers, subnormal=subnormal,
      tie_e4m3=ties["fp8_e4m3"], tie_e5m2=ties["fp8_e5m2"], huge=np.full(SHAPE, -3e38),
      tiny=np.sign(normal) * (1 + np.abs(normal)) * 1e-37,  # S overflows to float32 max: a subnormal outer
      zeros=zeros, one_hot=np.eye(*SHAPE) * 1e30, nan=nan, inf=inf).items()}


def _assert_matches_numpy(x, fmt, axis):
  q = ref.quantize(jnp.asarray(x), fmt, axis=axis)
  bits, outer = numpy_ref.fp8_current_np(np.asarray(jnp.asarray(x).astype(jnp.float32)), fmt, axis=axis)
  assert q.scales is None and q.codes.dtype == numpy_ref.FP8[fmt][0] and q.outer.shape == ()
  assert (q.fmt, q.axis % x.ndim, q.shape) == (fmt, axis % x.ndim, x.shape)
  got = np.asarray(q.unpacked_codes())
  nan = np.isnan(bits.view(numpy_ref.FP8[fmt][0]))  # a NaN value may be any NaN encoding (E5M2 has several)
  np.testing.assert_array_equal(np.isnan(got.view(numpy_ref.FP8[fmt][0])), nan, err_msg=f"NaN {fmt} {axis=}")
  np.testing.assert_array_equal(got[~nan], bits[~nan], err_msg=f"values {fmt} {axis=}")
  np.testing.assert_array_equal(np.asarray(q.outer), outer, err_msg=f"outer {fmt}")  # NaN == NaN here
  want = np.moveaxis(numpy_ref.fp8_dequantize_np(bits, outer, fmt), -1, axis % x.ndim)
  np.testing.assert_array_equal(np.asarray(ref.dequantize(q)), want, err_msg=f"dequantize {fmt} {axis=}")


@pytest.mark.parametrize("axis", [0, -1])
@pytest.mark.parametrize("fmt", FMTS)
def test_matches_numpy(fmt, axis):
  for x in _inputs().values():
    _assert_matches_numpy(x, fmt, axis)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
def test_gpu_matches_numpy(fmt):
  """Compiled by XLA for the GPU (its own `/` is approximate there; float8 casts are PTX cvt.rn.satfinite), the
  same bits as numpy."""
  with jax.default_device(jax.devices("gpu")[0]):
    for x in _inputs().values():
      for axis in (0, -1):
        _assert_matches_numpy(x, fmt, axis)


@pytest.mark.parametrize("shape,axis", [((3, 5, 7), 1), ((13,), 0), ((1, 1), 0), ((2, 3, 4, 5), -1)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("fmt", FMTS)
def test_odd_shapes_and_dtypes_match_numpy(fmt, dtype, shape, axis):
  """Any rank and length (no blocks, so no multiple of anything), low-precision inputs upcast exactly."""
  x = jnp.asarray(fresh_rng().standard_normal(shape) * 30, dtype)
  _assert_matches_numpy(x, fmt, axis)


@pytest.mark.parametrize("fmt", FMTS)
def test_one_quantization_serves_both_axes(fmt):
  """Along axis 0 the values are those along axis 1, transposed: `other_view` is the second quantization."""
  x = jnp.asarray(_inputs()["student_t"])
  rows, cols = ref.quantize(x, fmt, axis=1), ref.quantize(x, fmt, axis=0)
  for got, want in ((current_scaling.other_view(rows), cols), (current_scaling.other_view(cols), rows)):
    assert (got.axis, got.shape, got.codes.shape) == (want.axis, want.shape, want.codes.shape)
    np.testing.assert_array_equal(np.asarray(got.unpacked_codes()), np.asarray(want.unpacked_codes()))
    np.testing.assert_array_equal(got.outer, want.outer)
  with pytest.raises(ValueError, match="2-D per-tensor-scaled"):
    current_scaling.other_view(ref.quantize(x[:, :32], "nvfp4"))


def test_scale_follows_transformer_engine():
  """S = fp32(max / amax), correctly rounded; 1 for an all-zero tensor; float32 max where the quotient overflows."""
  amax = jnp.asarray([3.0, 0.0, 1e-37, 7.0e-37, 448.0], jnp.float32)  # normal: XLA:CPU reads subnormals as 0
  s = np.asarray(current_scaling.encode_factor(amax, 448.0))
  np.testing.assert_array_equal(s[:2], [np.float32(448) / np.float32(3), 1.0])
  assert s[2] == s[3] == np.finfo(np.float32).max and s[4] == 1.0
  q = ref.quantize(jnp.full((4, 4), 2e-37, jnp.float32), "fp8_e4m3")  # S clamped: outer 1 / f32 max, subnormal
  assert 0 < float(q.outer) < np.finfo(np.float32).tiny
  np.testing.assert_allclose(ref.dequantize(q), 2e-37, rtol=2**-3)  # decoded through `ieee.mul_scale`: no flush


def test_tensor_amax_and_nan_elements():
  x = jnp.asarray(_inputs()["normal"])
  amax = jnp.max(jnp.abs(x))
  a, b = ref.quantize(x, "fp8_e5m2", tensor_amax=amax), ref.quantize(x, "fp8_e5m2")
  np.testing.assert_array_equal(np.asarray(a.unpacked_codes()), np.asarray(b.unpacked_codes()))
  np.testing.assert_array_equal(a.outer, b.outer)
  # A finite amax passed in: a NaN element stays NaN, the others keep their values.
  c = ref.quantize(x.at[2, 3].set(jnp.nan), "fp8_e4m3", tensor_amax=amax)
  d = np.asarray(ref.dequantize(c))
  assert np.isnan(d[2, 3]) and np.isnan(d).sum() == 1
  # Without it, the tensor's amax is NaN: every value NaN, like a NaN NVFP4 tensor factor.
  assert np.isnan(np.asarray(ref.dequantize(ref.quantize(x.at[2, 3].set(jnp.inf), "fp8_e4m3")))).all()


@pytest.mark.parametrize("fmt", FMTS)
def test_qtensor_of_fp8(fmt):
  x = jax.random.normal(jax.random.key(0), (32, 24), jnp.bfloat16)
  q = ref.quantize(x, fmt, axis=0)
  leaves = jax.tree_util.tree_leaves(q)
  assert len(leaves) == 2 and q.scales is None  # values and the factor; no block scales
  assert q.kmajor_shape == q.codes.shape == (24, 32) and q.nbytes == 24 * 32 + 4
  np.testing.assert_array_equal(q.element_values(), q.codes.astype(jnp.float32))
  through_jit = jax.jit(lambda t: t)(q)
  np.testing.assert_array_equal(np.asarray(through_jit.unpacked_codes()), np.asarray(q.unpacked_codes()))


def test_element_decoders_match_ml_dtypes():
  b = np.arange(256, dtype=np.uint32)
  for decode, dtype in ((ieee.e5m2_bits_to_f32, ml_dtypes.float8_e5m2), (ieee.e4m3_bits_to_f32,
                                                                        ml_dtypes.float8_e4m3fn)):
    got, want = np.asarray(decode(jnp.asarray(b))), b.astype(np.uint8).view(dtype).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)])
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))


@pytest.mark.parametrize("kwargs, match", [
    (dict(rounding="sr", key=jax.random.key(0)), r"'fp8_e4m3' scales per tensor: it takes rounding='rne'"),
    (dict(tile_2d=True), r"scales per tensor.*tile_2d=True"),
    (dict(scale_rule="ocp"), r"apply to mxfp4 only"),
])
def test_invalid_calls(kwargs, match):
  with pytest.raises(ValueError, match=match):
    ref.quantize(jnp.ones((32, 32)), "fp8_e4m3", **kwargs)
