"""FP8 with per-tensor current scaling: the stock Hopper FP8 training recipe, the ground truth of the formats
"fp8_e4m3" and "fp8_e5m2" (`reference.quantize` hands them here).

Transformer Engine's `Float8CurrentScaling` recipe (HYBRID: E4M3 for X and W, E5M2 for dY): each tensor t is
scaled by a factor computed from t itself at every call, no amax history. In float32 (bf16 / f16 inputs are
upcast exactly), in this order (TE's `compute_scale_from_amax` and cast):
  amax  = max |t| over the whole tensor              (NaN if any element is NaN or +-Inf)
  S     = fp32(FP8_MAX / amax), correctly rounded     1 where amax = 0; float32 max where the quotient overflows
  q     = RNE_fp8(clip(t * S, -FP8_MAX, FP8_MAX))     one float32 product, a saturating cast
  outer = fp32(1 / S)                                 the decode factor (TE's scale_inv): QTensor.outer
  dequantized = q * outer                             (`reference.dequantize`)
FP8_MAX = 448 (E4M3) or 57344 (E5M2), from `formats.ELEMENTS`. The QTensor holds q as float8 values (its
codes), no block scales, and outer as a float32 scalar; nothing is padded (block 1).

No blocks: quantizing along either axis encodes every element alike and gives the same values in that axis'
K-major layout, so one quantization serves both GEMMs that read a tensor (`other_view`), as TE keeps one FP8
tensor and its transpose.

Exactness across backends: the division is `ieee.div` (TE uses `__fdiv_rn`; XLA:GPU's `/` is approximate) and
so is 1 / S; the product t * S is one IEEE rounding everywhere, and XLA's float32 -> float8 cast is
round-to-nearest-even on CPU and GPU. Readers decode the values from their bytes (`QTensor.element_values`),
so no compiler can drop the cast's rounding. One difference is outside the contract, as for every format:
XLA:CPU reads subnormal float32 inputs (|t| < 2^-126) as zero.

Non-finite input follows fp4jax's rule for every format, not TE's: a NaN or +-Inf anywhere makes amax NaN,
so S, outer and every value are NaN and the tensor dequantizes to NaN (TE's amax skips NaN and an infinite
amax gives S = 1, so its tensor keeps finite values). A finite `tensor_amax` passed in keeps NaN elements NaN.
NaN reaches the values through the product, the clip and the cast, whose NaN encoding (E5M2 has several) is
the backend's. How the GEMM hands these values to XLA:GPU's FP8 rewrite is the GEMM's concern
(`ops/gemm/fp8.py`, `fp8_operand`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax.numerics import ieee, quantize_args
from fp4jax.numerics.formats import FormatSpec
from fp4jax.numerics.qtensor import QTensor


def encode_factor(amax: jax.Array, fp8_max: float) -> jax.Array:
  """S = fp32(fp8_max / amax), correctly rounded; 1 where amax = 0, at most float32 max; NaN stays NaN
  (`ieee.amax_factor`)."""
  return ieee.amax_factor(np.float32(fp8_max), amax)


def quantize(x: jax.Array, spec: FormatSpec, axis: int, *, rounding: str = "rne", tile_2d: bool = False,
             tensor_amax: jax.Array | None = None) -> QTensor:
  """`x` quantized to the FP8 format `spec` with one factor per tensor (module docstring), K-major along `axis`.

  Called by `reference.quantize`, which has validated the call; `rounding` and `tile_2d` are checked here.
  tensor_amax: a precomputed amax; computed from x when None.
  """
  if rounding != "rne" or tile_2d:
    raise ValueError(f"fmt={spec.name!r} scales per tensor: it takes rounding='rne' and no 2-D tiles, got "
                     f"{rounding=}, {tile_2d=}")
  element = spec.element_spec
  xk = jnp.moveaxis(ieee.to_float32(x), axis, -1)  # [..., n]
  if tensor_amax is None:
    amax = jnp.max(jnp.abs(xk), initial=0.0)
    amax = jnp.where(jnp.all(jnp.isfinite(xk)), amax, jnp.nan)
  else:
    amax = quantize_args.amax_value(tensor_amax)
  s = encode_factor(amax, element.max)  # NaN for a non-finite amax: both branches make it NaN
  values = jnp.clip(xk * s, -element.max, element.max).astype(element.dtype)
  outer = ieee.div(np.float32(1.0), s, b_normal=True)  # NaN where s is; s >= fp8_max / float32 max: normal
  return QTensor(values, None, outer, fmt=spec.name, axis=axis, shape=tuple(x.shape))


def other_view(q: QTensor) -> QTensor:
  """A 2-D FP8 QTensor read along its other axis: the values transposed, the same factor. Bit for bit what
  quantizing the tensor along the other axis gives (module docstring), without a second pass over it.

  The values are transposed as their uint8 bits: XLA's constant folding (JAX 0.11.2) transposed a float8 array
  folded across two nested jits wrongly, so the fp8 route's gradients came out wrong under jit wherever x, w
  or dY was a constant of the program (a closed-over batch); tests/test_fp8_route.py has the case."""
  if q.scales is not None or len(q.shape) != 2:
    raise ValueError(f"other_view needs a 2-D per-tensor-scaled (FP8) QTensor: {q.fmt=}, {q.shape=}")
  bits = jax.lax.bitcast_convert_type(q.codes, jnp.uint8).T
  return dataclasses.replace(q, codes=jax.lax.bitcast_convert_type(bits, q.codes.dtype), axis=1 - q.axis)
