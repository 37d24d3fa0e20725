"""A quantized operand as the bf16 values a GEMM on bf16 tensor cores reads (`qtensor.ScaledValues`), decoded
from a QTensor's packed codes and block scales in XLA: what the Hopper NVFP4 GEMM (`ops.gemm.fp8`) multiplies,
where no quantizer kernel wrote the values itself (`ops.quantize.api`, `forms`).

The E2M1 values come from a lookup of each packed byte (`_E2M1_PAIRS`), not XLA's float4 -> float32
conversion: the same numbers, in the form that ran twice as fast as the arithmetic ones for the MXFP4 -> E4M3
re-encode on the H200 (`numerics.fp8._encode_e4m3`). E4M3 block scales are looked up too (`E4M3_SCALES`): their
integer decode (`reference.decode_scales`) is a producer XLA:GPU keeps out of a consumer that reads each scale
16 times, so it ran as a fusion of its own, writing and re-reading float32 scales; the lookup fuses into the
decode (the compiled H200 program, docs/BENCHMARKS.md, 2026-12-04, 10:13).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax.numerics import ieee, reference
from fp4jax.numerics.formats import E2M1_SIGNED_VALUES
from fp4jax.numerics.qtensor import QTensor, ScaledValues

# float32 [256, 2]: the E2M1 values of a packed byte's low (even element) and high nibble.
_E2M1_PAIRS = np.array(E2M1_SIGNED_VALUES, np.float32)[np.stack([np.arange(256) & 15, np.arange(256) >> 4], -1)]
# float32 [256]: the value of each E4M3 scale byte (NaN for 0x7F / 0xFF), decoded by NumPy's float8 type, which
# rounds nothing (`ieee.e4m3_bits_to_f32` gives the same values: tests/numerics/test_values.py).
E4M3_SCALES = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32)


def kmajor_values(q: QTensor) -> jax.Array:
  """e2m1(q) * block scale as bf16, K-major [R, K] (exact for NVFP4: `ScaledValues`); the outer factor is left
  out. A 2-D FP4 QTensor (MXFP4 too: exact while its block exponents stay in bf16's normal range)."""
  r, k = q.kmajor_shape
  b = q.spec.block
  pairs = jnp.asarray(_E2M1_PAIRS)[q.codes.reshape(r, k // 2).astype(jnp.int32)]  # [R, K/2, 2]
  vals = pairs.reshape(r, k // b, b)
  if q.spec.scale == "e4m3":
    scale = jnp.asarray(E4M3_SCALES)[jax.lax.bitcast_convert_type(q.scales, jnp.uint8).astype(jnp.int32)]
  else:
    scale = reference.decode_scales(q.scales, q.spec)  # [R, K/b] float32
  return (vals * scale[..., None]).reshape(r, k).astype(jnp.bfloat16)


def scaled_values(q: QTensor | ScaledValues) -> ScaledValues:
  """`q` as `ScaledValues` (K-major, so `transposed` where q was quantized along axis 0); ScaledValues pass
  through unchanged."""
  if isinstance(q, ScaledValues):
    return q
  if len(q.shape) != 2:
    raise ValueError(f"scaled_values needs a 2-D QTensor: {q.shape=}")
  return ScaledValues(kmajor_values(q), q.outer, fmt=q.fmt, axis=q.axis, shape=q.shape, transposed=q.axis == 0)


def dequantize(q: QTensor | ScaledValues, dtype=jnp.float32) -> jax.Array:
  """`reference.dequantize` of either form, in the original shape: a ScaledValues' values * outer, each product
  rounded once as there, give its QTensor's bits (the values are element(code) * scale exactly)."""
  if isinstance(q, QTensor):
    return reference.dequantize(q, dtype)
  vals = q.kmajor().astype(jnp.float32)
  if q.outer is not None:
    vals = ieee.mul_scale(vals, q.outer if q.outer.ndim == 0 else q.outer[..., None])
  return jnp.moveaxis(vals, -1, q.axis).astype(dtype)
