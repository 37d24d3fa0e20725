"""Element codecs: float32 <-> E2M1 codes and E4M3 scale bytes, each rounding written once; the decoders of
every element encoding by name (`ELEMENT_DECODERS`).

The E2M1 encoders are the reference's (midpoint comparisons, the SR test u < (|v| - lo) / (hi - lo)); the
Pallas kernels reach the same codes with float32 bit tricks (`ops/quantize/pallas/common.py`). The E4M3
helpers work on integer bytes with integer and bit arithmetic only, so the reference and the kernels share
them: no float8 conversion is involved (Triton has none on sm90, and XLA:GPU may drop the rounding of a
float32 -> float8 -> float32 round trip: `ieee`).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from fp4jax.numerics import ieee
from fp4jax.numerics.formats import E2M1_SIGNED_VALUES, E2M1_VALUES

# Midpoints between neighbouring E2M1 magnitudes; a tie at midpoint i goes up iff i is odd (to the even code).
_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(E2M1_VALUES[:-1], E2M1_VALUES[1:]))
E4M3_TOP = 0x7E  # the largest finite E4M3 byte (448)
_E4M3_MIN_NORMAL_BITS = 121 << 23  # float32 bits of 2^-6


def e2m1_encode_rne(v: jax.Array) -> jax.Array:
  """uint8 E2M1 codes (sign in bit 3) of float32 `v`, round-to-nearest-even, saturating at +-6."""
  mag = jnp.abs(v)
  code = jnp.zeros(v.shape, jnp.uint8)
  for i, m in enumerate(_MIDPOINTS):
    up = (mag > m) | ((mag == m) & (i % 2 == 1))
    code = code + up.astype(jnp.uint8)
  return code | jnp.where(jnp.signbit(v), jnp.uint8(8), jnp.uint8(0))


def e2m1_encode_sr(v: jax.Array, u: jax.Array) -> jax.Array:
  """uint8 E2M1 codes of float32 `v` (|v| <= 6) by stochastic rounding with float32 uniforms `u` in [0, 1).

  Between neighbouring grid magnitudes lo < hi: up iff u < (|v| - lo) / (hi - lo) (a power-of-two divisor, so
  the probability is exact in float32).
  """
  mag = jnp.abs(v)
  lo_code = jnp.zeros(v.shape, jnp.uint8)
  for g in E2M1_VALUES[1:]:
    lo_code = lo_code + (mag >= g).astype(jnp.uint8)
  table = jnp.asarray(E2M1_VALUES, jnp.float32)
  lo = table[lo_code.astype(jnp.int32)]
  hi = table[jnp.minimum(lo_code + 1, 7).astype(jnp.int32)]
  p = jnp.where(hi > lo, ieee.div_pow2(mag - lo, jnp.where(hi > lo, hi - lo, 1.0)), 0.0)
  code = lo_code + (u < p).astype(jnp.uint8)
  return code | jnp.where(jnp.signbit(v), jnp.uint8(8), jnp.uint8(0))


def e2m1_decode(codes: jax.Array) -> jax.Array:
  """float32 values of uint8 E2M1 codes."""
  table = jnp.asarray(E2M1_SIGNED_VALUES, jnp.float32)
  return table[(codes & jnp.uint8(0xF)).astype(jnp.int32)]


def e4m3_rn_bytes(t: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(int32 E4M3 byte, its float32 value) of float32 t in [0, 448], round-to-nearest-even, by bit arithmetic."""
  tb = jax.lax.bitcast_convert_type(t, jnp.int32)
  # Normal E4M3 (t >= 2^-6): RNE to 3 mantissa bits on the float32 bits; the carry may bump the exponent.
  rb = (tb + 0x7FFFF + ((tb >> 20) & 1)) >> 20  # (float32 biased exponent << 3) | mantissa
  # Subnormal (t < 2^-6): m * 2^-9 with m = RNE(t * 2^9) in 0..8 (8 is the smallest normal, byte 0x08).
  sub = jax.lax.bitcast_convert_type(t * 512.0 + 8388608.0, jnp.int32) - 0x4B000000
  normal = tb >= _E4M3_MIN_NORMAL_BITS
  byte = jnp.where(normal, rb - (120 << 3), sub)
  value = jnp.where(normal, jax.lax.bitcast_convert_type(rb << 20, jnp.float32),
                    sub.astype(jnp.float32) * jnp.float32(2.0**-9))
  return byte, value


def e4m3_rn(v: jax.Array) -> jax.Array:
  """float8_e4m3fn of float32 `v` in [0, 448], round-to-nearest-even."""
  byte, _ = e4m3_rn_bytes(jnp.asarray(v, jnp.float32))
  return jax.lax.bitcast_convert_type(byte.astype(jnp.uint8), jnp.float8_e4m3fn)


def e4m3_sr_bytes(t: jax.Array, u: jax.Array) -> jax.Array:
  """int32 E4M3 bytes of float32 `t` in [0, 448] by stochastic rounding with uniforms `u` in [0, 1): between
  the neighbouring E4M3 values lo <= t < hi, up iff u < (t - lo) / (hi - lo) (exact: t - lo is exact and
  hi - lo a power of two)."""
  rb, value = e4m3_rn_bytes(t)
  above = value > t
  lo_b = jnp.where(above, rb - 1, rb)
  hi_b = jnp.where(above, rb, jnp.minimum(rb + 1, E4M3_TOP))
  lo, hi = ieee.e4m3_bits_to_f32(lo_b), ieee.e4m3_bits_to_f32(hi_b)
  p = jnp.where(hi > lo, ieee.div_pow2(t - lo, jnp.where(hi > lo, hi - lo, 1.0)), 0.0)  # steps 2^-9 .. 32
  return jnp.where(u < p, hi_b, lo_b)


def e4m3_sr(t: jax.Array, u: jax.Array) -> jax.Array:
  """float8_e4m3fn of float32 `t` in [0, 448] by stochastic rounding (`e4m3_sr_bytes`)."""
  return jax.lax.bitcast_convert_type(e4m3_sr_bytes(t, u).astype(jnp.uint8), jnp.float8_e4m3fn)


# Element encoding (`formats.ELEMENTS`) -> float32 values of its uint8 codes, one code per element, decoded from
# the bits (never `astype` from float8: `ieee`).
ELEMENT_DECODERS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "e2m1": e2m1_decode,
    "e4m3": lambda b: ieee.e4m3_bits_to_f32(b.astype(jnp.uint32)),
    "e5m2": lambda b: ieee.e5m2_bits_to_f32(b.astype(jnp.uint32)),
}
