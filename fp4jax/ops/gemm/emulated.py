"""Emulated FP4 GEMM: dequantize both operands to float32 and dot at HIGHEST precision. The reference backend.

Runs anywhere (CPU, any GPU) with the exact FP4 numerics, at float32 GEMM speed plus the dequantization.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp4jax.numerics.qtensor import Quantized
from fp4jax.numerics.values import dequantize
from fp4jax.ops.gemm.base import KMAJOR_DOT


def kmajor_f32(q: Quantized) -> jax.Array:
  """float32 values of `q` (a QTensor or `ScaledValues`) in its K-major layout (the quantized axis last), as a
  2-D array."""
  v = jnp.moveaxis(dequantize(q, jnp.float32), q.axis, -1)
  return v.reshape(-1, v.shape[-1])


def supports(a: Quantized, b: Quantized) -> bool:
  """Any pair of 2-D operands (QTensor or `ScaledValues`) with equal contraction length."""
  return len(a.shape) == 2 and len(b.shape) == 2 and a.kmajor_shape[-1] == b.kmajor_shape[-1]


def gemm(a: Quantized, b: Quantized, *, out_dtype=jnp.float32) -> jax.Array:
  """dequant(a) @ dequant(b).T for K-major a [M, K], b [N, K]; float32 accumulation, cast to `out_dtype`."""
  if not supports(a, b):
    raise ValueError(f"emulated gemm needs 2-D operands with one K: {a.kmajor_shape=}, {b.kmajor_shape=}")
  av, bv = kmajor_f32(a), kmajor_f32(b)  # [M, K], [N, K]
  out = jax.lax.dot_general(av, bv, KMAJOR_DOT, precision=jax.lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)  # [M, N]
  return out.astype(out_dtype)
