"""The Pallas MXFP4 -> FP8 re-encoding equals `gemm_fp8.mx_to_fp8` bit for bit (interpret mode on CPU)."""

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax import reference
from fp4jax.kernels import gemm_fp8, quantize_fp8, quantize_fused
from fp4jax.kernels.tiling import QuantTile


def _bits(a):
  return np.asarray(jax.lax.bitcast_convert_type(a, {1: jnp.uint8, 4: jnp.uint32}[a.dtype.itemsize]))


def _assert_same(got, want):
  for g, w in zip(got, want):
    assert g.dtype == w.dtype and g.shape == w.shape
    bad = np.argwhere(_bits(g) != _bits(w))
    assert bad.size == 0, f"{len(bad)} mismatches, first at {bad[:3].tolist()}"


def _wide_span_input():
  """Rows whose block scales span up to 2^40 (E4M3 subnormals, underflow), zero and tiny rows, NaN/Inf blocks."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((64, 256)).astype(np.float32)
  x *= np.exp2(rng.integers(-20, 20, (64, 8, 1))).repeat(32, axis=2).reshape(64, 256)
  x[5] *= np.exp2(np.arange(256) // 32 * -3.0)  # 0, -3, ..., -21: a span crossing the exact limit of 14
  x[6, :32] = -0.0
  x[7, 40] = np.nan
  x[9, 200] = -np.inf
  x[10] = 0.0  # e_row at its floor
  x[11] *= 1e-36  # block exponents near -120 and below
  return jnp.asarray(x).astype(jnp.bfloat16)


def test_mx_to_fp8_matches_gemm_fp8():
  x = _wide_span_input()
  for axis in (-1, 0):
    for rounding in ("rne", "sr"):
      q = reference.quantize(x, "mxfp4", axis=axis, rounding=rounding, key=jax.random.key(1))
      _assert_same(quantize_fp8.mx_to_fp8(q, interpret=True), gemm_fp8.mx_to_fp8(q))


def test_quantize_dual_fp8():
  x = _wide_span_input()
  row, col, (row8, col8) = quantize_fused.quantize_dual(x, fp8=True, tile=QuantTile(32, 128, num_warps=4),
                                                        interpret=True)
  _assert_same(row8, gemm_fp8.mx_to_fp8(reference.quantize(x, "mxfp4", axis=-1)))
  _assert_same(col8, gemm_fp8.mx_to_fp8(reference.quantize(x, "mxfp4", axis=0)))


def test_one_named_kernel_in_lowering():
  q = reference.quantize(_wide_span_input(), "mxfp4")
  jaxpr = str(jax.make_jaxpr(lambda q: quantize_fp8.mx_to_fp8(q, interpret=True))(q))
  assert jaxpr.count(f"name={quantize_fp8.KERNEL_NAME}") == 1
