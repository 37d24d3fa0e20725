"""The Pallas MXFP4 -> FP8 re-encoding equals `numerics.fp8.mx_to_fp8` bit for bit (interpret mode on CPU; compiled
in the `gpu` test), on rows whose block scales span past the exact range, NaN / Inf blocks, zero and tiny rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax.numerics import fp8 as encoding
from fp4jax.numerics import reference
from fp4jax.ops.quantize.pallas import fp8
from quantize_inputs import bits


def _assert_same(got, want):
  for g, w in zip(got, want):
    assert g.dtype == w.dtype and g.shape == w.shape
    bad = np.argwhere(bits(g) != bits(w))
    assert bad.size == 0, f"{len(bad)} mismatches, first at {bad[:3].tolist()}"


def _wide_span_input(reps=(1, 1)):
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
  return jnp.asarray(np.tile(x, reps)).astype(jnp.bfloat16)


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=pytest.mark.gpu)])
def test_mx_to_fp8_matches_the_encoding(interpret):
  x = _wide_span_input((1, 1) if interpret else (16, 8))
  for axis in (-1, 0):
    for rounding in ("rne", "sr"):
      q = reference.quantize(x, "mxfp4", axis=axis, rounding=rounding, key=jax.random.key(1))
      _assert_same(fp8.mx_to_fp8(q, interpret=interpret), encoding.mx_to_fp8(q))


def test_one_named_kernel_in_lowering():
  q = reference.quantize(_wide_span_input(), "mxfp4")
  jaxpr = str(jax.make_jaxpr(lambda q: fp8.mx_to_fp8(q, interpret=True))(q))
  assert jaxpr.count(f"name={fp8.KERNEL_NAME}") == 1
  with pytest.raises(ValueError, match="2-D MXFP4"):
    fp8.mx_to_fp8(reference.quantize(jnp.ones((64, 64)), "nvfp4"), interpret=True)
