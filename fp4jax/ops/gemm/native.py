"""Blackwell (sm100+) FP4 GEMM through `jax.nn.scaled_matmul` (XLA's cuDNN block-scaled dot).

UNMEASURED HERE: no Blackwell GPU was available; the operand and scale layouts are tested on CPU only, where
`scaled_matmul` runs its reference lowering (upcast, scale, dot), which lets the tests compare numbers too.

The API takes K-major operands [B, M, K], [B, N, K] and scales [B, M, K / block], [B, N, K / block] in the plain
row-major layout: XLA's block-scaling rewriter pads the scales to 128 x 4 tiles and swizzles them into the
tcgen05 layout cuDNN wants, so we hand over our QTensor arrays as they are (a batch axis of 1 added). XLA sends
two operand/scale type pairs to cuDNN (anything else falls back to a dequantize-and-dot composite):
  * NVFP4: float4_e2m1fn values, float8_e4m3fn scales, blocks of 16. Our NVFP4 QTensors, bit for bit
    (`QTensor.as_float4`); the outer factors (1/S_enc per tensor, or per row for tile-local) multiply the
    float32 result.
  * MXFP8: float8_e4m3fn values, float8_e8m0fnu scales, blocks of 32. cuDNN has no E2M1 x E8M0 pair behind
    XLA's matcher, so an MXFP4 operand goes in as MXFP8: its E2M1 values converted to E4M3 (exact: every E2M1
    value is an E4M3 value) with its E8M0 scale bytes unchanged (uint8 E + 127, 0xFF NaN, the same encoding
    as float8_e8m0fnu). Exact, at MXFP8 rather than FP4 tensor-core rate.
Mixed MX x NV pairs are not supported (block sizes and scale types differ): use "fp8" or "emulated".
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fp4jax.numerics.qtensor import QTensor
from fp4jax.ops.gemm.base import apply_outer


class ScaledOperand(NamedTuple):
  """One `scaled_matmul` operand: values [1, R, K] and block scales [1, R, K / block]."""

  values: jax.Array
  scales: jax.Array


def _nvfp4_operand(q: QTensor) -> ScaledOperand:
  return ScaledOperand(q.as_float4()[None], q.scales[None])


def _mxfp4_as_mxfp8(q: QTensor) -> ScaledOperand:
  values = q.as_float4().astype(jnp.float8_e4m3fn)  # exact
  scales = jax.lax.bitcast_convert_type(q.scales, jnp.float8_e8m0fnu)
  return ScaledOperand(values[None], scales[None])


# Scale kind -> (operand builder, block size cuDNN expects).
_OPERANDS = {
    "e4m3": (_nvfp4_operand, 16),
    "e8m0": (_mxfp4_as_mxfp8, 32),
}


def scaled_operand(q: QTensor) -> ScaledOperand:
  """The `scaled_matmul` operand of a 2-D K-major QTensor (outer factor left out)."""
  if len(q.shape) != 2:
    raise ValueError(f"native gemm needs a 2-D QTensor: {q.shape=}")
  build, block = _OPERANDS[q.spec.scale]
  if q.spec.block != block:
    raise ValueError(f"native gemm needs blocks of {block} for {q.spec.scale} scales: {q.fmt=}")
  return build(q)


def supports(a: QTensor, b: QTensor) -> bool:
  """2-D QTensors (packed codes, not `ScaledValues`) with one K and the same scale kind, NVFP4 (blocks of 16)
  or MXFP4 (blocks of 32)."""
  return (isinstance(a, QTensor) and isinstance(b, QTensor) and len(a.shape) == 2 and len(b.shape) == 2
          and a.kmajor_shape[1] == b.kmajor_shape[1] and a.spec.scale == b.spec.scale and a.spec.scale in _OPERANDS
          and a.spec.block == b.spec.block == _OPERANDS[a.spec.scale][1])


def gemm(a: QTensor, b: QTensor, *, out_dtype=jnp.float32) -> jax.Array:
  """dequant(a) @ dequant(b).T for K-major a [M, K], b [N, K] on Blackwell block-scaled tensor cores."""
  if not supports(a, b):
    raise ValueError(f"native gemm does not support {a.fmt=} {a.kmajor_shape=} x {b.fmt=} {b.kmajor_shape=}")
  sa, sb = scaled_operand(a), scaled_operand(b)
  out = jax.nn.scaled_matmul(sa.values, sb.values, sa.scales, sb.scales,
                             preferred_element_type=jnp.float32)[0]  # [M, N]
  return apply_outer(out, a, b).astype(out_dtype)
