"""fp4jax.ieee: correctly rounded float32 division from the operands' bits, against numpy's IEEE division."""

import warnings

import jax
import numpy as np
import pytest

from fp4jax.numerics import ieee

_SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1e-40, 5.9e-39, 1.17549435e-38,
                      3.4028235e38, -3.4028235e38, 1.0, 3.0, 6.0, 448.0, 2688.0, 1.875, 0.1], np.float32)


def _cases(seed: int, n: int = 1 << 16) -> tuple[np.ndarray, np.ndarray]:
  """Random bit patterns (every exponent, subnormals, NaN payloads), random normals of moderate range, and
  every pair of special values."""
  rng = np.random.default_rng(seed)
  bits = lambda: rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
  normal = lambda: (rng.standard_normal(n) * np.exp2(rng.integers(-60, 60, n))).astype(np.float32)
  sa, sb = (v.ravel() for v in np.meshgrid(_SPECIALS, _SPECIALS))
  return np.concatenate([bits(), normal(), sa]), np.concatenate([bits(), normal(), sb])


def _assert_bits_equal(got, want):
  got, want = np.asarray(got), np.asarray(want)
  bad = (got.view(np.uint32) != want.view(np.uint32)) & ~(np.isnan(got) & np.isnan(want))
  assert not bad.any(), f"{bad.sum()} differ, e.g. {got[bad][:4]} vs {want[bad][:4]}"


def _not_subnormal(v: np.ndarray) -> np.ndarray:
  """Where float32 v is zero or not subnormal (normal, infinite or NaN): a divisor `b_normal` accepts, and a
  quotient `normal_result` promises."""
  return (v == 0) | ~(np.abs(v) < np.finfo(np.float32).tiny)


def _numpy(op, a, b):
  """numpy's IEEE float32 `op` (numpy does not flush subnormals), without its overflow warnings."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return op(a, b)


def _numpy_div(a, b):
  return _numpy(np.divide, a, b)


def _numpy_mul(a, b):
  return _numpy(np.multiply, a, b)


@pytest.mark.parametrize("seed", [0, 1])
def test_div_is_correctly_rounded(seed):
  a, b = _cases(seed)
  _assert_bits_equal(jax.jit(ieee.div)(a, b), _numpy_div(a, b))


def test_div_ties_and_exact_quotients():
  """Quotients exactly halfway between float32 neighbours (round to even), exact ones, and subnormal ties."""
  rng = np.random.default_rng(3)
  m = rng.integers(1 << 23, 1 << 24, 4096).astype(np.float64)
  a = np.concatenate([(2 * m + 1) * 3.0, m * 7.0, (2 * m + 1) * 2.0**-160]).astype(np.float32)
  b = np.concatenate([np.full(4096, 6.0), np.full(4096, 7.0), np.full(4096, 2.0**-12)]).astype(np.float32)
  _assert_bits_equal(jax.jit(ieee.div)(a, b), _numpy_div(a, b))


def test_div_broadcasts():
  a = np.arange(1, 13, dtype=np.float32).reshape(3, 4)
  b = np.array([3.0, 7.0, 0.1, 6.0], np.float32)
  _assert_bits_equal(ieee.div(a, b), _numpy_div(a, b))


def test_div_by_constants_and_normal_divisors():
  """A NumPy numerator (lifted while tracing, subnormal ones included) and `b_normal=True` (b not lifted) give
  the same correctly rounded quotients as the general path; neither stages the lifting."""
  a, b = _cases(7)
  normal_b = b[_not_subnormal(b)]
  for const in (np.float32(1.0), np.float32(2688.0), np.float32(1e-40), np.float32(-3e-39), np.float32(0.0)):
    _assert_bits_equal(jax.jit(lambda b, c=const: ieee.div(c, b))(b), _numpy_div(const, b))
    _assert_bits_equal(jax.jit(lambda b, c=const: ieee.div(c, b, b_normal=True))(normal_b),
                       _numpy_div(const, normal_b))
  _assert_bits_equal(jax.jit(lambda a, b: ieee.div(a, b, b_normal=True))(a[:normal_b.size], normal_b),
                     _numpy_div(a[:normal_b.size], normal_b))
  eqns = lambda f, *args: len(jax.make_jaxpr(f)(*args).jaxpr.eqns)
  general = eqns(ieee.div, a[:4], b[:4])
  assert eqns(lambda b: ieee.div(np.float32(1.0), b), b[:4]) < general
  assert eqns(lambda b: ieee.div(np.float32(1.0), b, b_normal=True), b[:4]) < eqns(
      lambda b: ieee.div(np.float32(1.0), b), b[:4])


def test_normal_result_where_the_quotient_cannot_be_subnormal():
  """`normal_result=True` (no subnormal assembly) keeps the bits of the general path where its promise holds:
  a constant numerator >= 4 over any divisor (`amax_factor`'s case: every bit pattern, zero, float32 max, inf,
  NaN), with fewer operations. Such a numerator needs no lift of a subnormal divisor either (`amax_factor` passes
  b_normal): the quotient overflows whether the backend reads the divisor as itself or as zero."""
  a, b = _cases(11)
  for num in (np.float32(4.0), np.float32(448.0), np.float32(2688.0 / (17 / 16))):
    general = jax.jit(lambda b, n=num: ieee.div(n, b))(b)
    _assert_bits_equal(jax.jit(lambda b, n=num: ieee.div(n, b, normal_result=True))(b), general)
    _assert_bits_equal(jax.jit(lambda b, n=num: ieee.div(n, b, b_normal=True, normal_result=True))(b), general)
  eqns = lambda f, *args: len(jax.make_jaxpr(f)(*args).jaxpr.eqns)
  assert eqns(lambda b: ieee.div(np.float32(4.0), b, normal_result=True), b[:4]) < eqns(
      lambda b: ieee.div(np.float32(4.0), b), b[:4])


def test_lift_of_a_constant_matches_the_traced_lift():
  values = np.concatenate([_SPECIALS, _cases(8, 256)[0]])
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # float32 max and infinities: no overflow on the way
    lifted = ieee.lift(values)
  for got, want in zip(lifted, jax.jit(ieee.lift)(values)):
    assert isinstance(got, np.ndarray)
    _assert_bits_equal(got.astype(np.float32), np.asarray(want).astype(np.float32))


def test_div_pow2():
  """Exact wherever a and the quotient are not subnormal (a product: XLA:CPU treats subnormals as zero)."""
  a = _cases(4)[0]
  for e in (-126, -9, -1, 0, 5, 126):
    d = np.float32(2.0**e)
    want = _numpy_div(a, d)
    keep = _not_subnormal(a) & _not_subnormal(want)
    _assert_bits_equal(ieee.div_pow2(a[keep], d), want[keep])


@pytest.mark.parametrize("seed", [0, 1])
def test_mul_scales_is_two_products_where_they_stay_normal(seed):
  """Every pattern of f and g (subnormal, zero, infinite, NaN ones included) against numpy's (x * f) * g,
  wherever x * f and the result are not subnormal (XLA:CPU flushes those) and x * f did not overflow."""
  f, g = _cases(seed)
  x = (np.random.default_rng(seed).standard_normal(f.size) * 1e3).astype(np.float32)
  xf = _numpy_mul(x, f)
  want = _numpy_mul(xf, g)
  keep = _not_subnormal(xf) & _not_subnormal(want) & ~(np.isinf(xf) & np.isfinite(f))
  assert keep.mean() > 0.4
  _assert_bits_equal(jax.jit(ieee.mul_scales)(x[keep], f[keep], g[keep]), want[keep])


def test_mul_scales_has_no_overflow_or_underflow_on_the_way():
  """A huge f with a tiny g (and the reverse, and a subnormal f) overflows or flushes x * f, not the result."""
  x = np.array([7.2e6, -7.2e6, 1e3, 2688.0], np.float32)
  f = np.array([1.26e35, 1.5e-6, 1e-42, 3.4e38], np.float32)
  g = np.array([1.5e-6, 1.26e35, 1e30, 1e-37], np.float32)
  exact = x.astype(np.float64) * f.astype(np.float64) * g.astype(np.float64)
  got = np.asarray(jax.jit(ieee.mul_scales)(x, f, g), np.float64)
  np.testing.assert_allclose(got, exact, rtol=2**-22)
  assert np.isinf(_numpy_mul(_numpy_mul(x[0], f[0]), g[0]))  # what the plain products give


@pytest.mark.parametrize("seed", [0, 1])
def test_mul_scales_of_per_tensor_factors_is_the_elementwise_form(seed):
  """Scalar f and g (one factor per tensor, its own vectorized path) give the bits of the elementwise form, for
  every pattern of f and g (subnormal, zero, infinite, NaN ones included): under vmap each pair is scalar, and
  once more for an array x with a few special pairs."""
  f, g = _cases(seed)
  x = (np.random.default_rng(seed).standard_normal(f.size) * 1e3).astype(np.float32)
  _assert_bits_equal(jax.jit(jax.vmap(ieee.mul_scales))(x, f, g), jax.jit(ieee.mul_scales)(x, f, g))
  pairs = [(1.26e35, 1.5e-6), (1e-42, 1e30), (0.0, np.inf), (np.nan, 1.0), (2.0**-149, 2.0**127)]
  for a, b in pairs:
    fa, gb = np.float32(a), np.float32(b)
    _assert_bits_equal(jax.jit(ieee.mul_scales)(x, fa, gb),
                       jax.jit(ieee.mul_scales)(x, np.full_like(x, fa), np.full_like(x, gb)))


@pytest.mark.gpu
def test_div_on_gpu_is_correctly_rounded():
  """XLA's `/` on NVIDIA GPUs is div.full.f32 (within 2 ulps); ieee.div must not depend on it, in any of the
  forms the library calls: the general one, a constant numerator over a normal divisor with and without
  normal_result (the NVFP4 set-up's 1 / b, which once compiled to rcp.approx.f32), and `amax_factor`'s."""
  a, b = _cases(5, 1 << 20)
  gpu = jax.devices("gpu")[0]
  on_gpu = lambda v: jax.device_put(v, gpu)
  _assert_bits_equal(jax.jit(ieee.div)(on_gpu(a), on_gpu(b)), _numpy_div(a, b))
  normal_b = b[_not_subnormal(b)]
  one = np.float32(1.0)
  quotient = _numpy_div(one, normal_b)
  _assert_bits_equal(jax.jit(lambda b: ieee.div(one, b, b_normal=True))(on_gpu(normal_b)), quotient)
  kept = _not_subnormal(quotient)
  _assert_bits_equal(jax.jit(lambda b: ieee.div(one, b, b_normal=True, normal_result=True))(on_gpu(normal_b[kept])),
                     quotient[kept])
  numerator = np.float32(2688.0)
  _assert_bits_equal(jax.jit(lambda b: ieee.div(numerator, b, normal_result=True))(on_gpu(b)),
                     _numpy_div(numerator, b))
  _assert_bits_equal(jax.jit(lambda b: ieee.div(numerator, b, b_normal=True, normal_result=True))(on_gpu(b)),
                     _numpy_div(numerator, b))


def test_normal_result_without_a_run_time_lift():
  """A constant numerator over a normal divisor with `normal_result` (the NVFP4 set-up's 1 / b): nothing is
  lifted at run time, so `div` keeps the float64 quotient in a comparison (on XLA:GPU a quotient used only by
  its cast compiled to rcp.approx.f32); the general path's bits wherever the promise holds, signed zeros too."""
  b = _cases(12)[1]
  normal_b = b[_not_subnormal(b)]
  one = np.float32(1.0)
  quotient = _numpy_div(one, normal_b)
  kept = _not_subnormal(quotient)
  _assert_bits_equal(jax.jit(lambda b: ieee.div(one, b, b_normal=True, normal_result=True))(normal_b[kept]),
                     quotient[kept])
  _assert_bits_equal(ieee.div(one, np.array([np.inf, -np.inf], np.float32), b_normal=True, normal_result=True),
                     np.array([0.0, -0.0], np.float32))


def test_e4m3_to_f32_every_byte():
  import jax.numpy as jnp
  import ml_dtypes
  b = np.arange(256, dtype=np.uint8)
  want = b.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  got = ieee.e4m3_to_f32(jax.lax.bitcast_convert_type(jnp.asarray(b), jnp.float8_e4m3fn))
  _assert_bits_equal(got, want)


@pytest.mark.gpu
def test_e4m3_round_trip_rounds_on_gpu():
  """float32 -> E4M3 -> float32 in one jitted computation on the GPU: astype may come back unrounded there,
  e4m3_to_f32 must not."""
  import jax.numpy as jnp
  import ml_dtypes
  t = np.random.default_rng(6).uniform(0, 448, 1 << 16).astype(np.float32)
  want = t.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
  got = jax.jit(lambda t: ieee.e4m3_to_f32(t.astype(jnp.float8_e4m3fn)))(jax.device_put(t, jax.devices("gpu")[0]))
  _assert_bits_equal(got, want)
