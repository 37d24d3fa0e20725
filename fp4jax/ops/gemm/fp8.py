"""Hopper (sm90) GEMM: MXFP4 through one FP8 GEMM, NVFP4 through an exact bf16 GEMM, and the FP8 formats of
the fp8 route (per-tensor current scaling) through one FP8 GEMM with their scales folded in.

Hopper tensor cores have FP8 but no FP4. Two exact re-encodings make the FP4 product run on them:

MXFP4 x MXFP4 -> FP8: each operand re-encoded as E4M3 values with power-of-two factors (`numerics.fp8`, which
states when that is exact), then one `lax.dot_general` of two K-major float8_e4m3fn operands (XLA rewrites it
to a cuBLASLt FP8 GEMM, "TN" layout); the row factors of a and b scale rows and columns of the result. Products
of two E4M3 values are exact in float32, so with float32 accumulation the result equals the emulated product up
to the order of the sums; cuBLASLt's FP8 fast accumulation (the default, see `fp8_gemm`) adds a little more.
For a bf16/f16 output on GPU the GEMM writes bf16/f16 directly (cuBLASLt accumulates in float32 registers
and rounds once); scaling that by the powers of two after is exact, so the numbers are those of rounding the
float32 result, with half the output bytes.

Fast path (`_gemm_mx_fp8`): applying row factors to the result is a pass over the output. When each whole
tensor spans <= 2^14 in block exponents (`numerics.fp8.tensor_span_ok`, the usual case) the encoding with ONE
factor per tensor is exact too, and written as XLA's scaled-FP8 pattern the factors fold into the cuBLASLt
GEMM. A `lax.cond` picks that path or the per-row one at run time, so both give the per-row encoding's numbers
(exact while each row spans <= 2^14, `numerics.fp8`).

NVFP4 (and mixed pairs) -> bf16: e2m1 (<= 2 significant bits) times an E4M3 block scale (<= 4 significant bits)
has at most 6 significant bits and a magnitude in [2^-10, 6 * 448], so q * s_b is exact in bf16 (8 significant
bits, float32's exponent range). A bf16 x bf16 -> float32 dot_general does the GEMM (products exact in float32);
the outer factors (per tensor or per row, float32) multiply the result. An MXFP4 operand in a mixed pair is
dequantized to bf16 the same way (exact while its block exponents stay within [-125, 125]: bf16 normal range).

FP8 x FP8 (the fp8 route, `numerics.current_scaling`): the operands already are float8 values with one float32
decode factor per tensor, so the GEMM is `scaled_fp8_dot` as it stands, the scaled-FP8 pattern the MXFP4 fast
path writes too: ONE cuBLASLt FP8 GEMM on Hopper with both factors as its a_scale / b_scale, writing
float32 (`_gemm_tensor_fp8` rounds to out_dtype after). A probe on the H200 (2026-12-02, 4096 x 2048 x 3072,
XLA's Triton GEMMs off as the apps and tests run them) found that a float32-dequantized scaled-FP8 dot writing
bf16 does not compile ("GEMM is not supported by cublasLt"), whether its float8 operands were passed in, read
from their bytes or cast inside the program, while writing float32 gives `__cublas$lt$matmul$f8`. The values
are read from their bytes (`fp8_operand`, the form of the MXFP4 path's encoding), so that XLA cannot fold a
cast pair f32 -> float8 -> f32 away (excess precision allowed, as seen for E4M3 round trips: `numerics.ieee`);
whether the bytes are still needed once the GEMM writes float32 was not isolated.
`test_gpu_forward_is_one_cublaslt_fp8_gemm` checks the forward (one FP8 GEMM) and forward + backward (three)
on a GPU; it passed on the H200 (2026-12-02).
XLA:CPU computes the same program by upcasting: value * factor rounded once per element as `dequantize` does,
then a float32 dot, so it equals the emulated product up to the order of the sums. Accumulation follows
Transformer Engine's HYBRID recipe: FP8 fast accumulation for fprop (E4M3 x E4M3), partial sums promoted to
float32 in the GEMMs of the E5M2 gradient (dgrad, wgrad). cuBLASLt has no E5M2 x E5M2 GEMM, so that pair is
not supported here.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from fp4jax.numerics import fp8 as encoding
from fp4jax.numerics import ieee
from fp4jax.numerics.formats import get_format
from fp4jax.numerics.qtensor import QTensor, Quantized, ScaledValues
from fp4jax.numerics.values import scaled_values
from fp4jax.ops.gemm import base
from fp4jax.ops.gemm.base import KMAJOR_DOT
from fp4jax.platform import compiles_for_gpu


def _gemm_out_dtype(out_dtype) -> jnp.dtype:
  """The dtype the FP8 GEMM itself writes: out_dtype if narrower than float32 on GPU (see module doc)."""
  narrow = jnp.dtype(out_dtype).itemsize < 4 and compiles_for_gpu()
  return jnp.dtype(out_dtype) if narrow else jnp.dtype(jnp.float32)


# |difference| of an FP8 GEMM's float32 result on a GPU from another order of its exact products, relative to
# |A| |B|^T: FP8 tensor cores (cuBLASLt's fast accumulation, WGMMA) keep about 14 bits in their sums
# (DeepSeek-V3, section 3.3.2). The bound the GPU tests and `bench dot`'s check hold these GEMMs to.
FAST_ACCUM_SUM_BOUND = 2.0**-9


def fp8_gemm(a8: encoding.Fp8Operand, b8: encoding.Fp8Operand, out_dtype=jnp.float32, *,
             fast_accum: bool = True) -> jax.Array:
  """a8 [M, K] times b8 [N, K]^T with the row factors applied: one FP8 GEMM.

  fast_accum: True (default) runs the dot at Precision.DEFAULT, which XLA sends to cuBLASLt FP8 with fast
    accumulation: Hopper's FP8 tensor-core accumulator keeps fewer bits than float32 between promotions.
    Its error stays far below bf16 output rounding (docs/BENCHMARKS.md, the fp8 backend section).
    False asks for Precision.HIGHEST (flax's FP8 backward does so to promote partial sums to float32);
    `python -m bench dot` reports whether that still compiles to a cuBLASLt FP8 GEMM and its error.
  """
  if a8.values.shape[1] != b8.values.shape[1]:
    raise ValueError(f"K differs: {a8.values.shape=} vs {b8.values.shape=}")
  precision = jax.lax.Precision.DEFAULT if fast_accum else jax.lax.Precision.HIGHEST
  acc = jax.lax.dot_general(a8.values, b8.values, KMAJOR_DOT, precision=precision,
                            preferred_element_type=_gemm_out_dtype(out_dtype))  # [M, N]
  out = apply_factors(acc.astype(jnp.float32), a8.row_scale[:, None], b8.row_scale[None, :])
  return out.astype(out_dtype)


def apply_factors(acc: jax.Array, row_f: jax.Array, col_f: jax.Array) -> jax.Array:
  """acc * row_f * col_f for factors that are normal powers of two (or NaN), broadcast against acc; exact
  wherever the result is a normal float32. Also the epilogue of the mosaic backend's kernel (`ops.gemm.mosaic`),
  so its ops are ones Mosaic GPU lowers (NaN found as x != x).

  One factor after the other can overflow (or underflow) on the way where the result does not: row factor
  2^114 then column factor 2^-116 (blocks of 6 * 2^120 against 6 * 2^-110, K = 32) gave inf for a result of
  1179648. The summed exponent e is applied in two halves instead: each partial product lies between acc and
  the result, so neither leaves the range first.
  """
  exponent = lambda r: (jax.lax.bitcast_convert_type(r, jnp.int32) >> 23) - 127  # 2^e = r, in [-126, 121]
  e = exponent(row_f) + exponent(col_f)
  half = e >> 1  # floor(e / 2): both halves stay in [-126, 121], where `ieee.pow2` is exact
  out = acc * ieee.pow2(half) * ieee.pow2(e - half)
  return jnp.where((row_f != row_f) | (col_f != col_f), jnp.float32(jnp.nan), out)


def scaled_fp8_dot(a: jax.Array, a_scale: jax.Array, b: jax.Array, b_scale: jax.Array, out_dtype, *,
                   dq_dtype=jnp.float32, precision: jax.lax.Precision | None = None) -> jax.Array:
  """(a * a_scale) @ (b * b_scale)^T for float8 a [M, K], b [N, K] (K-major) and scalar float32 scales: ONE FP8
  GEMM on a GPU.

  Written in XLA's scaled-FP8 pattern (dequantize = convert to `dq_dtype` times a broadcast scalar, then dot), so
  the GPU compiler emits a cuBLASLt FP8 GEMM ("TN": both operands K-major) with the scales fused in as its
  a_scale / b_scale, and writes `out_dtype` directly where narrower than float32 (`_gemm_out_dtype`). Elsewhere
  XLA computes it as written. dq_dtype must hold value * scale exactly where the caller needs exactness (bf16
  for power-of-two scales; float32 rounds each product once, as `dequantize` does). precision: the dot's
  (None: JAX's default); on Hopper DEFAULT selects FP8 fast accumulation, HIGHEST promotes partial sums.
  """
  a_dq = a.astype(dq_dtype) * a_scale.astype(dq_dtype)
  b_dq = b.astype(dq_dtype) * b_scale.astype(dq_dtype)
  out = jax.lax.dot_general(a_dq, b_dq, KMAJOR_DOT, precision=precision,
                            preferred_element_type=_gemm_out_dtype(out_dtype))
  return out.astype(out_dtype)


def fp8_gemm_tensor_scaled(a: QTensor, b: QTensor, out_dtype) -> jax.Array:
  """MXFP4 operands as one FP8 GEMM with per-tensor factors (`scaled_fp8_dot`, bf16 dequantization: exact, a
  power of two times an E4M3 value within bf16's range). Exact only when `tensor_span_ok` holds for both
  operands (`_gemm_mx_fp8` checks)."""
  av, sa = encoding.fp8_tensor_operand(a)
  bv, sb = encoding.fp8_tensor_operand(b)
  return scaled_fp8_dot(av, sa, bv, sb, out_dtype, dq_dtype=jnp.bfloat16)


def _gemm_mx_fp8(a: QTensor, b: QTensor, out_dtype) -> jax.Array:
  """Per-tensor scaled FP8 GEMM (scales fused into cuBLASLt) when both operands span <= 2^14 overall, else the
  per-row encoding with the factors applied to the result. Both branches give the per-row encoding's product
  (exact while each row spans <= 2^14: `numerics.fp8`).

  Each operand is encoded once, outside the `lax.cond`, against per-row reference exponents: the tensor's e_T
  on every row where the per-tensor path is taken, each row's own e_row otherwise (the same bits as
  `fp8_tensor_operand` and `mx_to_fp8`), and its factors come from the same reductions (`encoding.exponents`).
  The branches then hold only a GEMM and its scaling: XLA compiles both, and with the encodings inside them every
  fp4_dot compiled four (a third of an mxfp4 train step's program)."""
  ea, eb = encoding.exponents(a.scales), encoding.exponents(b.scales)
  ok = ea.ok & eb.ok
  av, bv = (encoding.fp8_values(q, jnp.where(ok, e.e_t, e.e_row)) for q, e in ((a, ea), (b, eb)))

  def per_tensor():
    return scaled_fp8_dot(av, ieee.pow2(ea.e_t - encoding.FP8_HEADROOM), bv,
                          ieee.pow2(eb.e_t - encoding.FP8_HEADROOM), out_dtype, dq_dtype=jnp.bfloat16)

  def per_row():
    return fp8_gemm(encoding.Fp8Operand(av, ea.row_scale), encoding.Fp8Operand(bv, eb.row_scale), out_dtype)

  return jax.lax.cond(ok, per_tensor, per_row)


# (a's element, b's element) of two FP8 operands -> the dot's precision (module docstring: TE's HYBRID recipe,
# fast accumulation for fprop only). A pair missing here has no cuBLASLt FP8 GEMM.
_FP8_PRECISION: dict[tuple[str, str], jax.lax.Precision] = {
    ("e4m3", "e4m3"): jax.lax.Precision.DEFAULT,  # fprop X W
    ("e5m2", "e4m3"): jax.lax.Precision.HIGHEST,  # dgrad dY W^T
    ("e4m3", "e5m2"): jax.lax.Precision.HIGHEST,  # wgrad X^T dY
}


def fp8_operand(q: QTensor) -> jax.Array:
  """The float8 values of a per-tensor FP8 QTensor as the GEMM reads them: their bytes through uint8 and a
  select that writes NaN (0x7F, NaN in E4M3 and E5M2) where the decode factor is NaN, where every value
  already is NaN (`numerics.current_scaling`). The same numbers, in the form of the MXFP4 path's encoding
  (`numerics.fp8`): XLA cannot fold such values back into the float32 they were cast from (module doc)."""
  bits = jax.lax.bitcast_convert_type(q.codes, jnp.uint8)
  bits = jnp.where(jnp.isnan(q.outer), jnp.uint8(encoding.E4M3_NAN_BITS), bits)
  return jax.lax.bitcast_convert_type(bits, q.codes.dtype)


def _gemm_tensor_fp8(a: QTensor, b: QTensor, out_dtype) -> jax.Array:
  """FP8 operands with one decode factor per tensor (the fp8 route): one scaled FP8 GEMM writing float32,
  rounded to out_dtype after (writing bf16 does not compile on Hopper: module docstring)."""
  precision = _FP8_PRECISION[(a.spec.element, b.spec.element)]
  out = scaled_fp8_dot(fp8_operand(a), a.outer, fp8_operand(b), b.outer, jnp.float32, precision=precision)
  return out.astype(out_dtype)


def _gemm_bf16(a: Quantized, b: Quantized, out_dtype) -> jax.Array:
  """One bf16 GEMM of both operands' `ScaledValues` (decoded in XLA from a QTensor, `numerics.values`, unless
  the quantizer wrote them), contracting each along its quantized dim, whichever layout it is stored in."""
  a, b = scaled_values(a), scaled_values(b)
  dims = (((a.contracting_dim,), (b.contracting_dim,)), ((), ()))
  acc = jax.lax.dot_general(a.values, b.values, dims, preferred_element_type=jnp.float32)  # [M, N]
  return base.apply_outer(acc, a, b).astype(out_dtype)


# (a's scale kind, b's scale kind) -> GEMM ("none": an FP8 format, scaled per tensor).
_GEMMS: dict[tuple[str, str], Callable[[QTensor, QTensor, jnp.dtype], jax.Array]] = {
    ("e8m0", "e8m0"): _gemm_mx_fp8,
    ("e4m3", "e4m3"): _gemm_bf16,
    ("e8m0", "e4m3"): _gemm_bf16,
    ("e4m3", "e8m0"): _gemm_bf16,
    ("none", "none"): _gemm_tensor_fp8,
}


def reads_values(fmt_a: str, fmt_b: str) -> bool:
  """Whether this backend multiplies operands of these formats as bf16 `ScaledValues` (`_gemm_bf16`: every
  pair with an NVFP4 format), so that their quantizer may write those values instead of packed codes."""
  return _GEMMS.get((get_format(fmt_a).scale, get_format(fmt_b).scale)) is _gemm_bf16


def supports(a: Quantized, b: Quantized) -> bool:
  """2-D operands with one K: any pair of MXFP4 / NVFP4 formats (MX x MX on FP8, the rest on bf16), or two FP8
  operands of a pair cuBLASLt multiplies (`_FP8_PRECISION`: not E5M2 x E5M2). `ScaledValues` only in the
  pairs multiplied as bf16 values (`reads_values`)."""
  if len(a.shape) != 2 or len(b.shape) != 2 or a.kmajor_shape[1] != b.kmajor_shape[1]:
    return False
  if (isinstance(a, ScaledValues) or isinstance(b, ScaledValues)) and not reads_values(a.fmt, b.fmt):
    return False
  kinds = (a.spec.scale, b.spec.scale)
  return kinds in _GEMMS and (kinds != ("none", "none") or (a.spec.element, b.spec.element) in _FP8_PRECISION)


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def gemm(a: Quantized, b: Quantized, *, out_dtype=jnp.float32) -> jax.Array:
  """dequant(a) @ dequant(b).T for K-major a [M, K], b [N, K] on Hopper FP8 / bf16 tensor cores.

  Jitted so that the GEMMs of one operand-shape pair in a program share one trace and one lowering of their
  glue (docs/BENCHMARKS.md, "CPU session of 2026-12-04")."""
  if not supports(a, b):
    raise ValueError(f"fp8 gemm does not support {a.fmt=} {a.kmajor_shape=} x {b.fmt=} {b.kmajor_shape=}")
  return _GEMMS[(a.spec.scale, b.spec.scale)](a, b, out_dtype)
