"""ScaledValues and their decode from a QTensor (`numerics.values`): the bf16 values a bf16 GEMM reads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax.numerics import ieee, values
from fp4jax.numerics.qtensor import ScaledValues
from fp4jax.numerics.reference import decode_scales, dequantize, quantize


def _bits(a) -> np.ndarray:
  a = np.asarray(a)
  return a.view(f"u{a.itemsize}")


def _spread_input():
  """Rows 2^40 apart, a zero block, a block of tiny negatives (signed zeros) and a NaN."""
  x = jax.random.normal(jax.random.key(0), (64, 256)) * jnp.exp2(
      jax.random.randint(jax.random.key(1), (64, 1), -20, 20).astype(jnp.float32))
  return x.at[0, :32].set(0.0).at[2, :32].set(-1e-30).at[1, 3].set(jnp.nan)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_values_lookup_equals_the_float4_conversion(fmt):
  """The packed-byte lookup gives the bits of XLA's float4 -> float32 conversion times the decoded scale,
  signed zeros, zero blocks and a NaN block included."""
  q = quantize(_spread_input(), fmt)
  r, k = q.kmajor_shape
  b = q.spec.block
  want = (q.as_float4().astype(jnp.float32).reshape(r, k // b, b)
          * decode_scales(q.scales, q.spec)[..., None]).reshape(r, k).astype(jnp.bfloat16)
  np.testing.assert_array_equal(_bits(values.kmajor_values(q)), _bits(want))


def test_e4m3_scale_table_is_the_bit_decode():
  """Every byte's entry of the NVFP4 values' scale table equals `ieee.e4m3_bits_to_f32` bit for bit (NaN for
  0x7F and 0xFF, subnormals, both signs)."""
  want = ieee.e4m3_bits_to_f32(jnp.arange(256, dtype=jnp.uint32))
  got = jnp.asarray(values.E4M3_SCALES)
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  finite = ~np.isnan(np.asarray(want))
  np.testing.assert_array_equal(_bits(got)[finite], _bits(want)[finite])


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_tile"])
@pytest.mark.parametrize("axis", [0, 1])
def test_scaled_values_dequantize_as_their_qtensor(fmt, axis):
  """values * outer (`values.dequantize`) are the QTensor's dequantized values bit for bit, in either layout of
  the values: K-major (`scaled_values`, transposed for a view along axis 0) and the array's own (as a kernel
  stores them)."""
  x = _spread_input()
  q = quantize(x, fmt, axis=axis, tile_rows=32) if fmt == "nvfp4_tile" else quantize(x, fmt, axis=axis)
  kmajor = values.scaled_values(q)
  assert kmajor.transposed == (axis == 0) and kmajor.values.shape == q.kmajor_shape
  own = ScaledValues(kmajor.kmajor() if axis else kmajor.kmajor().T, q.outer, fmt=fmt, axis=axis, shape=q.shape)
  assert own.values.shape == x.shape and own.contracting_dim == axis and kmajor.contracting_dim == 1
  want = _bits(dequantize(q))
  for v in (kmajor, own):
    np.testing.assert_array_equal(_bits(values.dequantize(v)), want)
    np.testing.assert_array_equal(_bits(v.kmajor()), _bits(kmajor.values))
  assert values.scaled_values(own) is own


def test_scaled_values_need_a_2d_qtensor():
  with pytest.raises(ValueError, match="2-D QTensor"):
    values.scaled_values(quantize(jnp.ones((2, 4, 32)), "nvfp4"))
