"""float32 arithmetic with the same bits on every backend, where XLA's own operations do not guarantee them.

Two XLA:GPU behaviours (measured on an H200, JAX 0.11.2) made the reference quantizers' NVFP4 codes depend on
the backend, and disagree with a GPU kernel that follows their definition:
  * float32 division is not correctly rounded: it compiles to PTX `div.full.f32`, an approximation within
    2 ulps (29% of 2^20 random quotients off, against 3 on CPU, all three in the subnormal range that XLA:CPU
    flushes to zero). `div` computes the correctly rounded quotient from the operands' bits.
  * a float32 -> float8_e4m3fn -> float32 round trip inside one computation does not round (131,071 of
    131,072 values came back unrounded): XLA may drop such convert pairs (`--xla_allow_excess_precision`,
    on by default). `e4m3_to_f32` decodes the float8 bytes instead, which nothing can simplify away.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_SIGN = np.uint32(0x80000000)
_ABS = np.uint32(0x7FFFFFFF)
_EXP_INF = np.uint32(0x7F800000)
_QNAN = np.uint32(0x7FC00000)
_HIDDEN = np.uint32(1 << 23)
_QUOTIENT_BITS = 26  # 24 significand bits, a guard and a round bit; the remainder gives the sticky bit


def _unpack(bits: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(significand with its leading one at bit 23, unbiased-by-127 exponent) of finite nonzero float32 bits;
  subnormals are normalized (exponent below 1). Zeros come out with significand 0."""
  e = ((bits >> 23) & 0xFF).astype(jnp.int32)
  m = bits & 0x7FFFFF
  shift = jnp.maximum(jax.lax.clz(m).astype(jnp.int32) - 8, 0)  # subnormal: bring the leading one to bit 23
  sub = e == 0
  m = jnp.where(sub, m << shift.astype(jnp.uint32), m | _HIDDEN)
  return m, jnp.where(sub, 1 - shift, e)


# The quotient's bits after the leading one, in digits of at most 7 bits: r << 7 < 2^31 stays in int32.
_DIGITS = (7, 7, 7, 4)
assert sum(_DIGITS) == _QUOTIENT_BITS - 1


def _long_division(r: jax.Array, m: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(floor(r * 2^25 / m), remainder) for uint32 0 <= r < m < 2^24, a digit of up to 7 bits per step.

  Each digit is estimated in float32 (r * 2^k / m < 2^7 with a relative error of a few 2^-24: off by at
  most one) and fixed with exact int32 arithmetic, so the result does not depend on how the backend
  rounds the estimate. Four steps, not 25 binary ones: XLA:CPU took ~9 s to compile the binary form.
  """
  r, m = r.astype(jnp.int32), m.astype(jnp.int32)
  inv = 1.0 / m.astype(jnp.float32)
  q = jnp.zeros_like(r)
  for k in _DIGITS:
    r = r << k  # < m * 2^7 < 2^31
    d = jnp.clip(jnp.floor(r.astype(jnp.float32) * inv), 0, (1 << k) - 1).astype(jnp.int32)
    rem = r - d * m  # d * m <= 2^31 - 2^24: no overflow; rem in (-m, 2m)
    low, high = rem < 0, rem >= m
    d = d - low.astype(jnp.int32) + high.astype(jnp.int32)
    r = jnp.where(low, rem + m, jnp.where(high, rem - m, rem))
    q = (q << k) | d
  return q.astype(jnp.uint32), r.astype(jnp.uint32)


def div(a: jax.Array, b: jax.Array) -> jax.Array:
  """a / b in float32, rounded to nearest even as IEEE 754 specifies (subnormal results included), by integer
  long division of the significands. Broadcasts like `/`; NaN, infinities and zeros follow IEEE 754."""
  a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
  ia, ib = (jax.lax.bitcast_convert_type(v, jnp.uint32) for v in (a, b))
  sign = (ia ^ ib) & _SIGN
  ma, ea = _unpack(ia)
  mb, eb = _unpack(ib)
  smaller = ma < mb
  r = jnp.where(smaller, ma << 1, ma)  # r / mb in [1, 2): the quotient's leading bit is 1
  e = ea - eb + 127 - smaller.astype(jnp.int32)  # biased exponent of the quotient
  q, r = _long_division(r - mb, mb)
  q = q | (jnp.uint32(1) << (_QUOTIENT_BITS - 1))
  # q / 2^25 * 2^(e - 127): a normal result keeps q >> 2; a subnormal one (e < 1) m = q >> (3 - e), as m * 2^-149.
  shift = jnp.minimum(2 + jnp.maximum(1 - e, 0), _QUOTIENT_BITS + 1).astype(jnp.uint32)
  kept = q >> shift
  rest = q & ((jnp.uint32(1) << shift) - 1)
  half = jnp.uint32(1) << (shift - 1)
  up = (rest > half) | ((rest == half) & ((r != 0) | ((kept & 1) == 1)))
  kept = kept + up.astype(jnp.uint32)
  e_field = (jnp.clip(e, 1, 255) - 1).astype(jnp.uint32)  # the hidden bit in kept adds the last 1
  mag = jnp.where(e > 254, _EXP_INF, jnp.minimum((e_field << 23) + kept, _EXP_INF))  # rounding may overflow
  abs_a, abs_b = ia & _ABS, ib & _ABS
  a_nan, b_nan = abs_a > _EXP_INF, abs_b > _EXP_INF
  a_inf, b_inf = abs_a == _EXP_INF, abs_b == _EXP_INF
  a_zero, b_zero = abs_a == 0, abs_b == 0
  mag = jnp.where(a_inf | b_zero, _EXP_INF, mag)
  mag = jnp.where(a_zero | b_inf, jnp.uint32(0), mag)
  out = jnp.where(a_nan | b_nan | (a_zero & b_zero) | (a_inf & b_inf), _QNAN, sign | mag)
  return jax.lax.bitcast_convert_type(out.astype(jnp.uint32), jnp.float32)


def amax_factor(numerator: jax.Array, amax: jax.Array) -> jax.Array:
  """The encode factor a scale-from-amax recipe aims with: fp32(numerator / amax) correctly rounded (`div`),
  1 where amax = 0 (nothing to scale), at most float32 max (an amax so small the quotient overflows); NaN
  stays NaN. NVFP4's S_enc (numerator 448 * 6, over a headroom) and FP8 current scaling's S (the element max)
  are both this."""
  s = div(numerator, jnp.where(amax == 0, 1.0, amax))
  return jnp.where(amax == 0, 1.0, jnp.minimum(s, jnp.finfo(jnp.float32).max))


def div_pow2(a: jax.Array, d: jax.Array) -> jax.Array:
  """a / d for d a normal power of two whose reciprocal is normal too (|d| in [2^-126, 2^126]): a times the
  exact reciprocal, one rounding, so the correctly rounded quotient for normal a and quotient (subnormals
  follow the backend's multiplication: XLA:CPU treats them as zero, GPUs keep them)."""
  db = jax.lax.bitcast_convert_type(jnp.asarray(d, jnp.float32), jnp.uint32)
  recip = ((254 - ((db >> 23) & 0xFF)) << 23) | (db & _SIGN)
  return a * jax.lax.bitcast_convert_type(recip, jnp.float32)


def pow2(e: jax.Array) -> jax.Array:
  """float32 2**e for int32 e in [-126, 127], built from the exponent bits (exact on every backend; `jnp.exp2`
  is not exact on GPU for integer arguments)."""
  return jax.lax.bitcast_convert_type(((e + 127) << 23).astype(jnp.int32), jnp.float32)


def e4m3_bits_to_f32(b: jax.Array) -> jax.Array:
  """float32 values of E4M3 bytes held in a (u)int32 array (0..255), by integer arithmetic: normal
  (8 + m) * 2^(e - 10), subnormal m * 2^-9, NaN for 0x7F / 0xFF. Runs inside Pallas kernels too."""
  e, m = (b >> 3) & 0xF, b & 7
  normal = jax.lax.bitcast_convert_type(((e + 120) << 23) | (m << 20), jnp.float32)
  mag = jnp.where(e == 0, m.astype(jnp.float32) * jnp.float32(2.0**-9), normal)  # subnormal: exact
  mag = jnp.where((b & 0x7F) == 0x7F, jnp.float32(jnp.nan), mag)
  return jnp.where((b & 0x80) != 0, -mag, mag)


def e5m2_bits_to_f32(b: jax.Array) -> jax.Array:
  """float32 values of E5M2 bytes held in a (u)int32 array (0..255), by integer arithmetic: normal
  (4 + m) * 2^(e - 17), subnormal m * 2^-16, +-Inf for exponent 31 with m = 0, NaN with m != 0."""
  e, m = (b >> 2) & 0x1F, b & 3
  normal = jax.lax.bitcast_convert_type(((e + 112) << 23) | (m << 21), jnp.float32)
  mag = jnp.where(e == 0, m.astype(jnp.float32) * jnp.float32(2.0**-16), normal)  # subnormal: exact
  mag = jnp.where(e == 31, jnp.where(m == 0, jnp.float32(jnp.inf), jnp.float32(jnp.nan)), mag)
  return jnp.where((b & 0x80) != 0, -mag, mag)


def e4m3_to_f32(s: jax.Array) -> jax.Array:
  """float32 values of a float8_e4m3fn array, decoded from its bytes (see the module docstring for why not
  `s.astype(jnp.float32)`). NaN for 0x7F / 0xFF."""
  return e4m3_bits_to_f32(jax.lax.bitcast_convert_type(s, jnp.uint8).astype(jnp.uint32))


LIFT = 64  # a subnormal float32 times 2^64 is normal (>= 2^-85)


def lift(f: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(f * 2^shift exactly, shift) for float32 f: shift = `LIFT` where f is subnormal (the result then normal,
  built from f's bits, so no flush-to-zero can touch it), else 0 and f itself."""
  f = jnp.asarray(f, jnp.float32)
  bits = jax.lax.bitcast_convert_type(f, jnp.uint32)
  mant = bits & np.uint32(0x7FFFFF)
  subnormal = ((bits & _EXP_INF) == 0) & (mant != 0)
  lifted = mant.astype(jnp.int32).astype(jnp.float32) * jnp.float32(2.0 ** (LIFT - 149))  # exact
  lifted = jnp.where((bits & _SIGN) != 0, -lifted, lifted)
  return jnp.where(subnormal, lifted, f), jnp.where(subnormal, LIFT, 0).astype(jnp.int32)


def mul_scale(x: jax.Array, f: jax.Array) -> jax.Array:
  """x * f rounded once, also where the float32 factor f is subnormal.

  XLA:CPU treats subnormal operands as zero (DAZ), so multiplying by a subnormal scale (an E8M0 2^-127, an
  NVFP4 outer factor 1 / S_enc of a tensor with amax below ~3.2e-35) would give 0 there and the right value
  on a GPU. A subnormal f enters lifted by 2^64 (`lift`), and the product, rounded once, is scaled back by
  2^-64, exact unless the result itself is subnormal (then the backend's flush applies, as to any subnormal
  result). Normal f: plain x * f.
  """
  lifted, shift = lift(f)
  return jnp.where(shift > 0, (x * lifted) * jnp.float32(2.0**-LIFT), x * jnp.asarray(f, jnp.float32))
