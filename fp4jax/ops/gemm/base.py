"""What every GEMM backend shares: the K-major contraction and the outer factors applied to its result.

A backend is a module with `supports(a, b) -> bool` and `gemm(a, b, *, out_dtype) -> Array` computing
dequant(a) @ dequant(b).T for 2-D K-major operands a [M, K], b [N, K] (docs/ARCHITECTURE.md), with the numbers
of `emulated`; `registry` maps names to them.
"""

from __future__ import annotations

import jax

from fp4jax.numerics import ieee
from fp4jax.numerics.qtensor import Quantized

KMAJOR_DOT = (((1,), (1,)), ((), ()))  # a [M, K] . b [N, K] -> [M, N]


def apply_outer(out: jax.Array, a: Quantized, b: Quantized) -> jax.Array:
  """out [M, N] float32 times a's outer factor (scalar or per row) and b's (scalar or per column): each product
  rounded once also for a subnormal factor (`ieee.mul_scale`), and with both factors, no overflow on the way
  where the result is finite (`ieee.mul_scales`: a huge factor times a tiny one)."""
  fa = a.outer if a.outer is None or a.outer.ndim == 0 else a.outer[:, None]
  fb = b.outer if b.outer is None or b.outer.ndim == 0 else b.outer[None, :]
  if fa is None or fb is None:  # one factor or none: nothing on the way to overflow
    f = fb if fa is None else fa
    return out if f is None else ieee.mul_scale(out, f)
  return ieee.mul_scales(out, fa, fb)
