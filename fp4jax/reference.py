"""Pure-jnp FP4 quantizers: the ground truth every kernel and backend is checked against, bit for bit.

The formulas are docs/NUMERICS.md's. Everything here is jit-able and runs on any backend.

Conventions (the contract the kernels reproduce):
  * Blocks run along `axis`; the result's layout is K-major (`fp4jax.qtensor.QTensor`).
  * Arithmetic is float32 whatever the input dtype (bf16 / f16 / f32 inputs are upcast exactly).
  * Powers of two are built by exponent arithmetic (`jnp.ldexp`, `jnp.frexp`), never `exp2`/`log2`.
  * Stochastic rounding draws its uniform for element i from `fp4jax.prng` with counter = i's row-major flat
    index in the *original* array, stream `STREAM_ELEMENT_SR`: round up iff u < (v - lo) / (hi - lo).
  * Non-finite input: a block holding NaN or +-Inf gets a NaN scale (E8M0 0xFF, E4M3 0x7F) and zero codes, so it
    dequantizes to NaN; a non-finite tensor amax makes the global NVFP4 factor NaN. Never finite garbage.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp4jax import prng
from fp4jax.formats import E2M1_MAX, E2M1_VALUES, FORMATS, get_format
from fp4jax.qtensor import QTensor, pack_codes

ROUNDINGS = ("rne", "sr", "eden")

# Midpoints between neighbouring E2M1 magnitudes; a tie at midpoint i goes up iff i is odd (to the even code).
_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(E2M1_VALUES[:-1], E2M1_VALUES[1:]))


def e2m1_encode_rne(v: jax.Array) -> jax.Array:
  """uint8 E2M1 codes (sign in bit 3) of float32 `v`, round-to-nearest-even, saturating at +-6."""
  mag = jnp.abs(v)
  code = jnp.zeros(v.shape, jnp.uint8)
  for i, m in enumerate(_MIDPOINTS):
    up = (mag > m) | ((mag == m) & (i % 2 == 1))
    code = code + up.astype(jnp.uint8)
  return code | jnp.where(jnp.signbit(v), jnp.uint8(8), jnp.uint8(0))


def e2m1_decode(codes: jax.Array) -> jax.Array:
  """float32 values of uint8 E2M1 codes."""
  table = jnp.asarray(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), jnp.float32)
  return table[(codes & jnp.uint8(0xF)).astype(jnp.int32)]


def quantize(x: jax.Array, fmt: str = "mxfp4", *, axis: int = -1, rounding: str = "rne",
             key: jax.Array | None = None, **options) -> QTensor:
  """Quantizes `x` to FP4 along `axis`. See the module docstring and docs/NUMERICS.md."""
  raise NotImplementedError("filled in by the numerics-core work")


def dequantize(q: QTensor, dtype=jnp.float32) -> jax.Array:
  """The values a QTensor stands for, in the original shape, as `dtype`."""
  spec = q.spec
  vals = e2m1_decode(q.unpacked_codes())  # [..., n]
  if spec.scale == "e8m0":
    s = q.scales.astype(jnp.int32)
    scale = jnp.where(s == 255, jnp.nan, jnp.ldexp(jnp.float32(1.0), s - 127))
  else:
    scale = q.scales.astype(jnp.float32)
  vals = (vals.reshape(*vals.shape[:-1], -1, spec.block) * scale[..., None]).reshape(vals.shape)
  if q.outer is not None:
    outer = q.outer if q.outer.ndim == 0 else q.outer[..., None]
    vals = vals * outer
  return jnp.moveaxis(vals, -1, q.axis).astype(dtype)
