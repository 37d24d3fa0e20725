"""The MXFP4 -> E4M3 re-encoding of the Hopper GEMM (`numerics.fp8`) is exact within a span of 2^14 per row,
and its error is bounded beyond it."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp4jax.numerics import fp8
from fp4jax.numerics.formats import E2M1_SIGNED_VALUES
from mx_operands import dequantized, mx_qtensor, random_mx


def _encoded(op: fp8.Fp8Operand) -> np.ndarray:
  return np.asarray(op.values.astype(jnp.float32)) * np.asarray(op.row_scale)[:, None]


@pytest.mark.parametrize("span", [0, 3, 14])
def test_mx_to_fp8_exact_within_span_14(span):
  q = random_mx(span, 16, 256, span)
  op = fp8.mx_to_fp8(q)
  assert op.values.dtype == jnp.float8_e4m3fn and op.values.shape == (16, 256)
  assert op.row_scale.dtype == jnp.float32 and op.row_scale.shape == (16,)
  np.testing.assert_array_equal(_encoded(op), dequantized(q))
  e_row = np.asarray(q.scales, np.int32).max(axis=1) - 127
  np.testing.assert_array_equal(np.asarray(op.row_scale), np.ldexp(1.0, e_row - 6).astype(np.float32))
  assert np.abs(np.asarray(op.values.astype(jnp.float32))).max() <= 384
  assert bool(jnp.all(fp8.span_ok(q)))


def _with_scales(scales: np.ndarray):
  """An MXFP4 QTensor of zero codes with uint8 E8M0 `scales` [R, K/32]."""
  exps = np.where(scales == 255, np.nan, scales.astype(np.float64) - 127)
  return mx_qtensor(np.zeros((scales.shape[0], 32 * scales.shape[1]), np.int64), exps)


@pytest.mark.parametrize("span", [13, 14, 15, 40])
def test_exponents_match_their_definitions(span):
  """`exponents`: e_row (NaN blocks ignored, floored at -120), the row factors (NaN in rows with a NaN block), e_T
  and the whole tensor's span <= 14, against numpy; with NaN blocks and a row below the floor."""
  rng = np.random.default_rng(span)
  scales = rng.integers(120, 121 + span, (6, 8)).astype(np.uint8)
  scales[0, 0], scales[1, :3] = 120 + span, 120  # the span is reached
  scales[2, 5], scales[3, 1] = 255, 255  # NaN blocks
  scales[4] = rng.integers(0, 5, 8)  # below 2^-120: floored; it widens the tensor's span
  e_row, row_scale, e_t, ok = jax.jit(fp8.exponents)(jnp.asarray(scales))
  finite = np.where(scales == 255, -1, scales.astype(np.int64))
  want_rows = np.maximum(finite.max(axis=1) - 127, fp8.E_ROW_MIN)
  np.testing.assert_array_equal(np.asarray(e_row), want_rows)
  want_scales = np.where((scales == 255).any(axis=1), np.nan, np.ldexp(np.float32(1), want_rows - 6))
  np.testing.assert_array_equal(np.asarray(row_scale), want_scales.astype(np.float32))
  assert int(e_t) == want_rows.max() == int(fp8.tensor_exponent(jnp.asarray(scales)))
  lo = np.where(scales == 255, 255, scales).astype(np.int64).min() - 127
  assert bool(ok) == (want_rows.max() - lo <= 14) == bool(fp8.tensor_span_ok(_with_scales(scales)))
  scales[4] = 121
  assert bool(jax.jit(fp8.exponents)(jnp.asarray(scales)).ok) == (span <= 14)


def test_mx_to_fp8_beyond_span_14_rounds_small_blocks():
  """Blocks 2^15+ below the row max round (RNE) to the E4M3 subnormal grid: error <= 2^(e_row - 16)."""
  q = random_mx(1, 16, 256, 20)
  op = fp8.mx_to_fp8(q)
  exps = np.asarray(q.scales, np.int32) - 127  # [R, K/32]
  e_row = exps.max(axis=1, keepdims=True)
  d = np.repeat(e_row - exps, 32, axis=1)  # [R, K]
  enc, ref = _encoded(op), dequantized(q)
  np.testing.assert_array_equal(enc[d <= 14], ref[d <= 14])
  err = np.abs(enc - ref)
  assert np.all(err <= np.ldexp(1.0, np.repeat(e_row, 256, axis=1) - 16))
  assert np.all(enc[d >= 19] == 0) and np.any(enc[d == 18] != 0)
  assert np.any(err[d == 15] > 0)  # the rounding really happens
  assert not bool(jnp.any(fp8.span_ok(q)))


def test_mx_to_fp8_round_to_nearest_even_at_span_15():
  """d = 15: 0.5 -> 2^-10 ties to 0, 1 -> 2^-9 exact, 1.5 -> 1.5 * 2^-9 ties to 2^-8 (in row_scale units)."""
  codes = np.zeros((1, 64), np.int64)
  codes[0, :4] = [1, 2, 3, 4]  # 0.5, 1, 1.5, 2 in the small block
  codes[0, 32] = 7  # 6 in the large block
  op = fp8.mx_to_fp8(mx_qtensor(codes, np.array([[0.0, 15.0]])))
  np.testing.assert_array_equal(np.asarray(op.values[0, :4].astype(jnp.float32)),
                                [0.0, 2.0**-9, 2.0**-8, 2.0**-8])
  assert float(op.row_scale[0]) == 2.0**9


def test_mx_to_fp8_zero_rows_nan_blocks_and_tiny_rows():
  rng = np.random.default_rng(3)
  codes = rng.integers(0, 16, (4, 64))
  codes[1] = 0  # a zero row
  exps = np.array([[3.0, 1.0], [5.0, 5.0], [np.nan, 2.0], [-127.0, -125.0]])
  q = mx_qtensor(codes, exps)
  op = fp8.mx_to_fp8(q)
  enc, ref = _encoded(op), dequantized(q)
  assert np.all(enc[1] == 0)
  bits = np.asarray(jax.lax.bitcast_convert_type(op.values, jnp.uint8))
  assert np.all(bits[2, :32] == 0x7F) and np.isnan(float(op.row_scale[2]))
  assert np.all(np.isnan(enc[2]))
  assert float(op.row_scale[3]) == 2.0**-126  # e_row floored at -120: a normal float32 row scale
  np.testing.assert_array_equal(enc[[0, 1]], ref[[0, 1]])
  # Row 3 holds float32 subnormals, which dequantize flushes on CPU: compare with the exact float64 values.
  e2m1 = np.array(E2M1_SIGNED_VALUES)
  exact = e2m1[codes[3]] * np.ldexp(1.0, np.repeat(exps[3], 32).astype(int))
  np.testing.assert_array_equal(np.asarray(op.values[3].astype(jnp.float32), np.float64) * 2.0**-126, exact)


def test_e4m3_bits_is_the_rounded_float_conversion_for_every_code_and_shift():
  """The integer encoder (`e4m3_bits`) against numpy's float8_e4m3fn conversion of the exact value: all 16
  codes at every shift from far below the subnormal range to the top (d <= 6), signed zeros included."""
  codes = np.arange(16)
  d = np.arange(-40, 7)
  cc, dd = np.meshgrid(codes, d, indexing="ij")
  e2m1 = np.array(E2M1_SIGNED_VALUES)
  exact = e2m1[cc] * np.ldexp(1.0, dd)  # float64: exact
  want = exact.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
  got = np.asarray(fp8.e4m3_bits(jnp.asarray(cc, jnp.int32), jnp.asarray(dd, jnp.int32)))
  np.testing.assert_array_equal(got, want.astype(np.int32))


def test_lookup_encoding_equals_the_float_definition():
  """`fp8_values` (a table lookup per packed byte) against the definition computed through float conversions, on
  random codes and scales spanning 2^20 per row, NaN blocks and both reference kinds (per row, per tensor)."""
  rng = np.random.default_rng(7)
  exps = rng.integers(-20, 4, (8, 8)).astype(np.float64)
  exps[2, 3] = np.nan
  q = mx_qtensor(rng.integers(0, 16, (8, 256)), exps)
  s = np.asarray(q.scales, np.int32)
  e2m1 = np.array(E2M1_SIGNED_VALUES)
  codes = np.asarray(jax.lax.bitcast_convert_type(q.codes, jnp.uint8)).astype(np.int32)
  nibbles = np.stack([codes & 15, codes >> 4], axis=-1).reshape(8, 256)
  for e_ref in (fp8.row_exponent(q.scales), jnp.full((8,), fp8.tensor_exponent(q.scales))):
    shift = np.repeat(s - 127 - np.asarray(e_ref)[:, None] + 6, 32, axis=1)
    want = (e2m1[nibbles] * np.ldexp(1.0, np.minimum(shift, 6))).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    want = np.where(np.repeat(s == 255, 32, axis=1), 0x7F, want)
    got = np.asarray(jax.lax.bitcast_convert_type(fp8.fp8_values(q, e_ref), jnp.uint8))
    np.testing.assert_array_equal(got, want)


def test_lookup_encoder_lowers_for_an_abstract_h200():
  """The table is built in numpy, so using it inside an abstract-mesh lowering (`bench program`, `bench compile
  --h200`) works; built with jnp ops on first use, it raised there."""
  from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh  # pylint: disable=g-import-not-at-top
  mesh = AbstractMesh((1,), ("d",), abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))
  codes = jax.ShapeDtypeStruct((16, 128), jnp.uint8)
  scales = jax.ShapeDtypeStruct((16, 8), jnp.uint8)
  with use_abstract_mesh(mesh):
    lowered = jax.jit(lambda c, s: fp8._encode_e4m3(c, s, fp8.row_exponent(s)[:, None])).trace(
        codes, scales).lower(lowering_platforms=("cuda",))
  assert "gather" in lowered.as_text()
