"""fp4jax.qtensor: pytree behaviour, float4 views, packing and byte counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax.numerics.qtensor import QTensor, codes_from_float4, pack_codes
from fp4jax.numerics.reference import dequantize, e2m1_decode, quantize
from fp4jax.numerics.values import scaled_values


def _q(fmt="nvfp4", shape=(32, 64), axis=-1):
  return quantize(jax.random.normal(jax.random.key(0), shape), fmt, axis=axis)


def test_pytree_round_trip():
  q = _q()
  leaves, treedef = jax.tree_util.tree_flatten(q)
  assert len(leaves) == 3  # codes, scales, outer; fmt / axis / shape are static
  q2 = jax.tree_util.tree_unflatten(treedef, leaves)
  assert (q2.fmt, q2.axis, q2.shape) == (q.fmt, q.axis, q.shape)
  np.testing.assert_array_equal(dequantize(q2), dequantize(q))
  through_jit = jax.jit(lambda t: t)(q)
  np.testing.assert_array_equal(through_jit.codes, q.codes)
  mx = _q("mxfp4")
  assert mx.outer is None and len(jax.tree_util.tree_leaves(mx)) == 2


def test_equality_of_quantized_arrays_is_a_clear_type_error():
  """`==` between two QTensors (or ScaledValues) of their own arrays would compare them element by element: it
  raised NumPy's "truth value of an array ... is ambiguous" (from `!=` and `in` too). The same object, and two of
  jax.eval_shape's (no arrays to compare), still compare."""
  q, again = _q(), _q()
  for a, b in ((q, again), (scaled_values(q), scaled_values(again))):
    for compare in (lambda: a == b, lambda: a != b, lambda: a in [b]):
      with pytest.raises(TypeError, match=f"{type(a).__name__} == compares arrays element by element; compare "
                                          f"them: jax.tree.all"):
        compare()
    assert a == a and not a != a  # pylint: disable=comparison-with-itself
  assert q != "q"
  abstract = lambda fmt: jax.eval_shape(lambda x: quantize(x, fmt), jnp.ones((32, 64)))
  assert abstract("nvfp4") == abstract("nvfp4") and abstract("nvfp4") != abstract("mxfp4")
  assert jax.tree.all(jax.tree.map(jnp.array_equal, q, again))  # what the message suggests


def test_float4_views():
  q = _q(axis=0)
  f4 = q.as_float4()
  assert f4.dtype == jnp.float4_e2m1fn and f4.shape == q.kmajor_shape == (64, 32)
  np.testing.assert_array_equal(f4.astype(jnp.float32), e2m1_decode(q.unpacked_codes()))
  np.testing.assert_array_equal(codes_from_float4(f4), q.codes)


def test_float4_view_of_an_fp8_qtensor_is_refused():
  with pytest.raises(ValueError, match="as_float4 views packed E2M1 codes; a 'fp8_e4m3' QTensor"):
    _q("fp8_e4m3").as_float4()


def test_packing():
  codes = jnp.arange(16, dtype=jnp.uint8).reshape(2, 8)
  packed = pack_codes(codes)
  np.testing.assert_array_equal(packed[0], [0x10, 0x32, 0x54, 0x76])  # even element in the low nibble
  q = QTensor(packed, jnp.zeros((2, 1), jnp.float8_e4m3fn), None, fmt="nvfp4", axis=1, shape=(2, 8))
  np.testing.assert_array_equal(q.unpacked_codes(), codes)
  with pytest.raises(ValueError, match="odd"):
    pack_codes(jnp.zeros((2, 3), jnp.uint8))


@pytest.mark.parametrize("fmt,extra", [("mxfp4", 0), ("nvfp4", 4), ("nvfp4_tile", 4 * 32)])
def test_nbytes(fmt, extra):
  q = _q(fmt)  # [32, 64]
  block = q.spec.block
  assert q.nbytes == 32 * 64 // 2 + 32 * 64 // block + extra
