"""fp4jax.hadamard: orthogonality, inverse, the fixed sign vector and key-drawn signs."""

import jax
import jax.numpy as jnp
import numpy as np
import numpy_ref  # tests/numpy_ref.py
import pytest

from fp4jax.numerics import prng
from fp4jax.numerics.hadamard import (D16, KINDS, fwht, hadamard, hadamard_matrix, hadamard_signs, negative_words,
                                      sylvester)

KEY = jax.random.key(11)


def _sylvester(n):
  h = np.array([[1.0]])
  for _ in range(int(np.log2(n))):
    h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
  return h


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_matrix_is_orthogonal_and_applied_blockwise(kind):
  m = np.asarray(hadamard_matrix(kind, KEY), np.float64)
  n = m.shape[0]
  np.testing.assert_allclose(m @ m.T, np.eye(n), atol=1e-6)
  np.testing.assert_array_equal(np.abs(np.asarray(hadamard_matrix(kind, KEY, normalized=False))), 1.0)
  x = np.random.default_rng(0).standard_normal((3, 2 * n)).astype(np.float32)
  want = np.einsum("ij,bkj->bki", m, x.reshape(3, 2, n).astype(np.float64)).reshape(3, 2 * n)
  y = hadamard(jnp.asarray(x), kind, key=KEY)
  assert y.dtype == jnp.float32
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(hadamard(y, kind, key=KEY, inverse=True), x, rtol=1e-5, atol=1e-5)
  # Along axis 0, and as bf16 input.
  np.testing.assert_allclose(hadamard(jnp.asarray(x.T), kind, axis=0, key=KEY), want.T, rtol=1e-5, atol=1e-5)
  xb = jnp.asarray(x, jnp.bfloat16)
  np.testing.assert_allclose(hadamard(xb, kind, key=KEY), hadamard(xb.astype(jnp.float32), kind, key=KEY))


def test_fixed_signs():
  d16 = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], np.float32)
  np.testing.assert_array_equal(D16, d16)
  np.testing.assert_array_equal(hadamard_signs("h16"), d16)
  bitmask = sum(1 << i for i, s in enumerate(d16) if s > 0)
  assert bitmask == 0x2817
  np.testing.assert_allclose(hadamard_matrix("h16"), _sylvester(16) * d16 / 4, atol=0)
  # H32: d16 on each half, H16 on each half, then a cross add/subtract, scaled 1/sqrt(32).
  x = np.random.default_rng(1).standard_normal(32)
  h16 = _sylvester(16) * d16
  a, b = h16 @ x[:16], h16 @ x[16:]
  want = np.concatenate([a + b, a - b]) / np.sqrt(32)
  np.testing.assert_allclose(hadamard(jnp.asarray(x, jnp.float32), "h32"), want, rtol=1e-5, atol=1e-6)


def test_random_signs():
  s1, s1b, s2 = (np.asarray(hadamard_signs("rht128", k)) for k in (KEY, KEY, jax.random.key(12)))
  np.testing.assert_array_equal(s1, s1b)
  assert (s1 != s2).any()
  assert 32 < (s1 < 0).sum() < 96
  # Drawn from fp4jax.prng's stream for Hadamard signs, counter = position.
  want = np.where(numpy_ref.sign_bits(KEY, prng.STREAM_HADAMARD_SIGNS, 128) == 1, -1.0, 1.0)
  np.testing.assert_array_equal(s1, want)
  np.testing.assert_array_equal(hadamard_signs("rht16", KEY), s1[:16])


def test_gemm_invariance():
  a = jax.random.normal(jax.random.key(0), (8, 256))
  b = jax.random.normal(jax.random.key(1), (16, 256))
  hi = jax.lax.Precision.HIGHEST
  got = jnp.dot(hadamard(a, "rht128", key=KEY), hadamard(b, "rht128", key=KEY).T, precision=hi)
  np.testing.assert_allclose(got, jnp.dot(a, b.T, precision=hi), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("call,match", [
    (lambda: hadamard(jnp.ones((4, 32)), "rht16"), "needs a key"),
    (lambda: hadamard_matrix("rht32"), "needs a key"),
    (lambda: hadamard(jnp.ones((4, 32)), "rht16", key=3), "rht16'.* needs a key: one JAX PRNG key"),
    (lambda: hadamard(jnp.ones((4, 32)), "rht16", key=jax.random.split(KEY, 2)), "needs a key: one JAX PRNG key"),
    (lambda: hadamard(jnp.ones((4, 32)), "h16", key=jnp.zeros(2)), "fixed signs: key= unused.* needs a key"),
    (lambda: hadamard(jnp.ones((4, 48)), "h32"), "multiple of 32"),
    (lambda: hadamard(jnp.ones((4, 32)), "h64"), "known kinds"),
    (lambda: hadamard(jnp.ones((32, 32)), "h16", axis=2), r"axis=2 is out of range for x.shape=\(32, 32\)"),
    (lambda: hadamard(jnp.ones((32,)), "h16", axis=-2), "axis=-2 is out of range"),
    (lambda: fwht(jnp.ones((4, 12))), r"fwht: a.shape\[-1\]=12 \(a.shape=\(4, 12\)\) must be a power of two"),
])
def test_invalid_calls(call, match):
  with pytest.raises(ValueError, match=match):
    call()


@pytest.mark.parametrize("call,match", [
    (lambda: hadamard(jnp.ones((4, 32)), "h32", axis=1.0), r"^Hadamard kind='h32': axis= takes an int \(an axis of "
                                                            r"x\), got 1.0"),
    (lambda: hadamard(jnp.ones((32, 16)), "h16", axis=True), "axis= takes an int .*, got True"),  # was axis 1
    (lambda: hadamard(jnp.ones((4, 32)), "h32", axis="1"), "axis= takes an int .*, got '1'"),
    (lambda: hadamard(jnp.ones((4, 32)), "h32", axis=np.True_), "axis= takes an int .*, got np.True_"),
    (lambda: sylvester(16.0), r"^sylvester: n= takes an int \(a power of two\), got 16.0$"),
    (lambda: sylvester(True), "n= takes an int .*, got True$"),  # was the 1 x 1 matrix
    (lambda: negative_words("h32", words=4.0), r"^negative_words: words= takes an int \(how many uint32 words hold "
                                                r"the signs\), got 4.0$"),
    (lambda: negative_words("h16", words=True), "words= takes an int .*, got True$"),  # was one word
])
def test_a_non_integer_size_or_axis_is_a_type_error(call, match):
  """A float, bool or string where an int goes failed deep inside (a float axis as "tuple indices must be
  integers or slices, not float") or, a bool, silently stood for 0 or 1."""
  with pytest.raises(TypeError, match=match):
    call()


@pytest.mark.parametrize("call,match", [
    (lambda: hadamard(jnp.ones((4, 32)), "h32", inverse="no"), r"^Hadamard kind='h32': inverse= takes a bool, "
                                                                r"got 'no'"),  # was the inverse
    (lambda: hadamard(jnp.ones((4, 32)), "h32", inverse=0), "inverse= takes a bool, got 0"),
    (lambda: hadamard_matrix("h16", normalized="no"), r"^hadamard_matrix: normalized= takes a bool, got 'no'$"),
])
def test_a_flag_that_is_no_bool_is_a_type_error(call, match):
  """Flags were taken by their truth: inverse="no" inverted, normalized="no" normalized."""
  with pytest.raises(TypeError, match=match):
    call()
  x = jax.random.normal(KEY, (4, 32))
  np.testing.assert_array_equal(hadamard(x, "h32", inverse=np.True_), hadamard(x, "h32", inverse=True))


def test_numpy_integers_are_integers():
  x = jax.random.normal(KEY, (32, 64))
  np.testing.assert_array_equal(hadamard(x, "h32", axis=np.int64(0)), hadamard(x, "h32", axis=0))
  np.testing.assert_array_equal(sylvester(np.int32(16)), sylvester(16))
  np.testing.assert_array_equal(negative_words("h16", words=np.uint8(2)), negative_words("h16", words=2))


def _fwht_recursive(a: np.ndarray) -> np.ndarray:
  """H_n a along the last axis in float32 by the recursion H_2n [u; v] = [H_n u + H_n v; H_n u - H_n v]."""
  n = a.shape[-1]
  if n == 1:
    return a
  u, v = _fwht_recursive(a[..., : n // 2]), _fwht_recursive(a[..., n // 2:])
  return np.concatenate([u + v, u - v], axis=-1)


@pytest.mark.parametrize("n", [2, 16, 32, 128])
def test_fwht_order_is_pinned(n):
  # Bit for bit: the fused kernels rely on this exact float32 operation order.
  x = np.random.default_rng(n).standard_normal((5, n)).astype(np.float32) * np.float32(2.0) ** \
      np.random.default_rng(n + 1).integers(-20, 20, (5, n)).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(fwht(jnp.asarray(x))), _fwht_recursive(x))
  np.testing.assert_allclose(np.asarray(fwht(jnp.asarray(x)), np.float64), x.astype(np.float64) @ _sylvester(n).T,
                             rtol=1e-5, atol=1e-5 * np.abs(x).max())


def test_negative_words():
  for kind in ("h16", "rht32", "rht128"):
    signs = np.asarray(hadamard_signs(kind, KEY))
    words = np.asarray(negative_words(kind, KEY))
    bits = [(int(words[r // 32]) >> (r % 32)) & 1 for r in range(len(signs))]
    np.testing.assert_array_equal(bits, signs < 0)
    assert not any(words[len(signs) // 32 + (len(signs) % 32 > 0):])
  with pytest.raises(ValueError, match="more than 1 words"):
    negative_words("rht128", KEY, words=1)


