"""Hopper (sm90) FP4 GEMM: MXFP4 through one FP8 GEMM, NVFP4 through an exact bf16 GEMM.

Hopper tensor cores have FP8 but no FP4. Two exact re-encodings make the FP4 product run on them:

MXFP4 x MXFP4 -> FP8 (`mx_to_fp8`, `fp8_gemm`). Element k of row r is e2m1(q) * 2^e_b (e_b: its block's E8M0
exponent). With e_row = max(the largest finite block exponent of the row, -120), the row is re-encoded as

    values[r, k]  = RNE_E4M3(e2m1(q) * 2^(e_b - e_row + 6))     float8_e4m3fn
    row_scale[r]  = 2^(e_row - 6)                                float32, built from exponent bits (exact)

so values * row_scale = the MXFP4 value. The "+ 6" puts the row's largest block at 6 * 2^6 = 384 <= 448.
Exactness: with d = e_row - e_b >= 0, every E2M1 value is a multiple of 0.5 with at most 2 significant bits, so
e2m1 * 2^(6 - d) is a multiple of 2^(5 - d): representable in E4M3 (smallest subnormal 2^-9) iff d <= 14.
The encoding is exact for every block with d <= 14. A block with d >= 15 (2^15 times smaller than the row's
largest block) rounds to nearest-even onto the E4M3 subnormal grid 2^-9: each of its elements moves by at most
2^-10 * row_scale = 2^(e_row - 16), and blocks with d >= 19 become exactly 0 (their largest magnitude,
6 * 2^(6 - d) <= 0.75 * 2^-10, is below half the smallest subnormal). Relative to the row's largest block
scale 2^e_row that error is <= 2^-16.
Real rows rarely span 2^15 (RNE quantizers give the block max 4..6 * 2^e_b), but a row holding, say, one
exploding gradient block next to vanishing ones does: use `span_ok` to check, `emulated` when exactness of such
rows matters.

Special values: an E8M0 NaN scale (0xFF) encodes its block as E4M3 NaN (0x7F) and makes the row's row_scale
NaN, so the output row (or column) is NaN, like the dequantized product. e_row ignores NaN blocks; all-zero
blocks count like any other (quantizers give them the smallest scale). The floor -120 keeps row_scale >= 2^-126
a normal float32 (XLA on CPU flushes float32 subnormals to zero).

The GEMM is one `lax.dot_general` of two K-major float8_e4m3fn operands (XLA rewrites it to a cuBLASLt FP8
GEMM, "TN" layout); the row factors of a and b scale rows and columns of the result. Products of two E4M3
values are exact in float32, so with float32 accumulation the result equals the emulated product up to the
order of the sums; cuBLASLt's FP8 fast accumulation (the default, see `fp8_gemm`) adds a little more.
For a bf16/f16 output on GPU the GEMM writes bf16/f16 directly (cuBLASLt accumulates in float32 registers
and rounds once); scaling that by the powers of two after is exact, so the numbers
are those of rounding the float32 result, with half the output bytes.

Fast path (`_gemm_mx_fp8`): applying row factors to the result is a pass over the output (0.35 ms of a
2.26 ms GEMM at 16384 x 4096 -> 14336 on the H200). When each whole tensor spans <= 2^14 (`tensor_span_ok`,
the usual case) the same encoding with ONE factor per tensor is exact too, and written as XLA's scaled-FP8
pattern the factors fold into the cuBLASLt GEMM. A `lax.cond` picks that path or the per-row one at run time,
so the result is exact on both.

NVFP4 (and mixed pairs) -> bf16: e2m1 (<= 2 significant bits) times an E4M3 block scale (<= 4 significant bits)
has at most 6 significant bits and a magnitude in [2^-10, 6 * 448], so q * s_b is exact in bf16 (8 significant
bits, float32's exponent range). A bf16 x bf16 -> float32 dot_general does the GEMM (products exact in float32);
the outer factors (per tensor or per row, float32) multiply the result. An MXFP4 operand in a mixed pair is
dequantized to bf16 the same way (exact while its block exponents stay within [-125, 125]: bf16 normal range).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from fp4jax import ieee
from fp4jax.qtensor import QTensor

E4M3_NAN_BITS = 0x7F
E8M0_NAN = 255
E8M0_BIAS = 127
FP8_HEADROOM = 6  # log2 of the factor putting a row's largest block at <= 6 * 2^6 = 384 (E4M3 max 448).
MAX_EXACT_SPAN = 14  # e_row - e_b up to which the E4M3 re-encoding is exact.
# Floor of e_row, so that row_scale = 2^(e_row - 6) >= 2^-126 stays a normal float32 (XLA flushes subnormals on
# CPU). A row whose blocks are all below 2^-120 then has d = e_row - e_b <= 7: still exact.
E_ROW_MIN = -126 + FP8_HEADROOM

_KMAJOR_DOT = (((1,), (1,)), ((), ()))  # a [M, K] . b [N, K] -> [M, N]


class Fp8Operand(NamedTuple):
  """An MXFP4 operand re-encoded for an FP8 GEMM: values * row_scale[:, None] = the MXFP4 values.

  values: float8_e4m3fn [R, K] (K-major). row_scale: float32 [R], a power of two 2^(e_row - 6), or NaN.
  """

  values: jax.Array
  row_scale: jax.Array


def _check_2d(q: QTensor, what: str) -> None:
  if len(q.shape) != 2:
    raise ValueError(f"{what} needs a 2-D QTensor (K-major [R, K]); got {q.shape=}, {q.axis=}")


def row_exponent(scales: jax.Array) -> jax.Array:
  """e_row: int32 [R], the largest finite E8M0 block exponent of each row of uint8 `scales` [R, K/32].

  At least E_ROW_MIN = -120 (so row_scale is a normal float32); NaN blocks (0xFF) are ignored.
  """
  s = scales.astype(jnp.int32)
  return jnp.maximum(jnp.max(jnp.where(s == E8M0_NAN, 0, s), axis=-1) - E8M0_BIAS, E_ROW_MIN)


def pow2(e: jax.Array) -> jax.Array:
  """2^e as float32, exactly, for int32 e in [-126, 127], from the exponent bits (no exp2, no ldexp loop)."""
  return jax.lax.bitcast_convert_type((e + 127).astype(jnp.int32) << 23, jnp.float32)


def fp8_operand_from_codes(codes: jax.Array, scales: jax.Array) -> Fp8Operand:
  """The `Fp8Operand` of raw MXFP4 arrays: packed uint8 codes [R, K/2] and uint8 E8M0 scales [R, K/32].

  The definition fused kernels reproduce bit for bit (module docstring):
    e_row = row_exponent(scales); shift = e_b - e_row + 6 per block;
    values = float8_e4m3fn(RNE(e2m1(q) * 2^max(shift, -126))), 0x7F where the block's scale is 0xFF;
    row_scale = 2^(e_row - 6) (float32, from exponent bits), NaN where the row has a NaN block.
  """
  r, half_k = codes.shape
  k = 2 * half_k
  nb = scales.shape[-1]
  if scales.shape != (r, nb) or k != 32 * nb:
    raise ValueError(f"MXFP4 arrays disagree: {codes.shape=} (K={k}) needs scales [R, K/32]; {scales.shape=}")
  e_row = row_exponent(scales)  # [R]
  row_nan = jnp.any(scales == E8M0_NAN, axis=-1)
  row_scale = jnp.where(row_nan, jnp.float32(jnp.nan), pow2(e_row - FP8_HEADROOM))  # [R] float32
  return Fp8Operand(_encode_e4m3(codes, scales, e_row[:, None]), row_scale)


def _encode_e4m3(codes: jax.Array, scales: jax.Array, e_ref: jax.Array) -> jax.Array:
  """float8_e4m3fn [R, K] = RNE(e2m1(q) * 2^(e_b - e_ref + 6)), 0x7F (NaN) in NaN blocks.

  e_ref: int32 reference exponent broadcastable to scales' [R, K/32] (per row or per tensor).
  """
  r, half_k = codes.shape
  nb = scales.shape[-1]
  s = scales.astype(jnp.int32)  # [R, K/32]
  shift = s - E8M0_BIAS - e_ref + FP8_HEADROOM  # [R, K/32], <= 6 for finite blocks
  e2m1 = jax.lax.bitcast_convert_type(codes, jnp.float4_e2m1fn).reshape(r, nb, 32).astype(jnp.float32)
  # Exact product with a normal power of two. Clamping the shift at -126 (and float32 subnormal flushing) only
  # touches values below 6 * 2^-126, which round to E4M3 zero either way (< 2^-10); the upper clamp only touches
  # NaN blocks, overwritten below.
  v = e2m1 * pow2(jnp.clip(shift, -126, FP8_HEADROOM))[..., None]  # [R, K/32, 32] float32
  bits = jax.lax.bitcast_convert_type(v.astype(jnp.float8_e4m3fn), jnp.uint8)
  bits = jnp.where((s == E8M0_NAN)[..., None], jnp.uint8(E4M3_NAN_BITS), bits).reshape(r, 2 * half_k)
  return jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn)  # [R, K]


def mx_to_fp8(q: QTensor) -> Fp8Operand:
  """Re-encodes a 2-D MXFP4 QTensor (K-major [R, K]) as E4M3 values with one power-of-two factor per row."""
  _check_2d(q, "mx_to_fp8")
  if q.spec.scale != "e8m0" or q.spec.block != 32 or q.outer is not None:
    raise ValueError(f"mx_to_fp8 needs MXFP4 (E8M0 scales, blocks of 32, no outer factor): {q.fmt=}")
  return fp8_operand_from_codes(q.codes, q.scales)


def span_ok(q: QTensor) -> jax.Array:
  """bool [R]: rows of an MXFP4 QTensor that encode exactly (e_row - e_b <= 14 for every finite block)."""
  s = q.scales.astype(jnp.int32)
  lo = jnp.min(jnp.where(s == E8M0_NAN, 255, s), axis=-1) - E8M0_BIAS
  return row_exponent(q.scales) - lo <= MAX_EXACT_SPAN


def _gemm_out_dtype(out_dtype) -> jnp.dtype:
  """The dtype the FP8 GEMM itself writes: out_dtype if narrower than float32 on GPU (see module doc)."""
  narrow = jnp.dtype(out_dtype).itemsize < 4 and jax.default_backend() == "gpu"
  return jnp.dtype(out_dtype) if narrow else jnp.dtype(jnp.float32)


def fp8_gemm(a8: Fp8Operand, b8: Fp8Operand, out_dtype=jnp.float32, *, fast_accum: bool = True) -> jax.Array:
  """a8 [M, K] times b8 [N, K]^T with the row factors applied: one FP8 GEMM.

  fast_accum: True (default) runs the dot at Precision.DEFAULT, which XLA sends to cuBLASLt FP8 with fast
    accumulation: Hopper's FP8 tensor-core accumulator keeps fewer bits than float32 between promotions.
    Measured on the H200 (16384 x 4096 x 4096, random MXFP4): max |fp8 - emulated| = 1.46x the float32
    reordering bound 2 K 2^-24 |A||B|^T (about 7e-4 of |A||B|^T), far below bf16 output rounding (2^-8).
    False asks for Precision.HIGHEST (flax's FP8 backward does so to promote partial sums to float32);
    unmeasured on the GPU: `python -m fp4jax.bench dot` reports whether it still compiles to a cuBLASLt FP8
    GEMM (XLA's dot-precision pass may upcast non-DEFAULT FP8 dots to float32) and its error vs emulated.
  """
  if a8.values.shape[1] != b8.values.shape[1]:
    raise ValueError(f"K differs: {a8.values.shape=} vs {b8.values.shape=}")
  precision = jax.lax.Precision.DEFAULT if fast_accum else jax.lax.Precision.HIGHEST
  acc = jax.lax.dot_general(a8.values, b8.values, _KMAJOR_DOT, precision=precision,
                            preferred_element_type=_gemm_out_dtype(out_dtype))  # [M, N]
  out = acc.astype(jnp.float32) * a8.row_scale[:, None] * b8.row_scale[None, :]  # exact: powers of two
  return out.astype(out_dtype)


def _bf16_values(q: QTensor) -> jax.Array:
  """e2m1(q) * block scale as bf16 [R, K] (exact, see module docstring); the outer factor is left out."""
  r, k = q.kmajor_shape
  b = q.spec.block
  vals = q.as_float4().astype(jnp.float32).reshape(r, k // b, b)
  if q.spec.scale == "e8m0":
    s = q.scales.astype(jnp.int32)
    scale = jnp.where(s == E8M0_NAN, jnp.nan, jnp.ldexp(jnp.float32(1.0), s - E8M0_BIAS))
  else:
    scale = ieee.e4m3_to_f32(q.scales)  # not astype: XLA:GPU may skip the scales' E4M3 rounding (fp4jax.ieee)
  return (vals * scale[..., None]).reshape(r, k).astype(jnp.bfloat16)


def apply_outer(out: jax.Array, a: QTensor, b: QTensor) -> jax.Array:
  """out [M, N] float32 times a's outer factor (scalar or per row) and b's (scalar or per column)."""
  if a.outer is not None:
    out = out * (a.outer if a.outer.ndim == 0 else a.outer[:, None])
  if b.outer is not None:
    out = out * (b.outer if b.outer.ndim == 0 else b.outer[None, :])
  return out


def tensor_exponent(scales: jax.Array) -> jax.Array:
  """e_T: int32 scalar, the largest finite block exponent of the whole tensor (floored like `row_exponent`)."""
  return jnp.max(row_exponent(scales.reshape(1, -1)))


def fp8_tensor_operand(q: QTensor) -> tuple[jax.Array, jax.Array]:
  """MXFP4 re-encoded with ONE power-of-two factor for the whole tensor: (values [R, K] e4m3, factor ()).

  The `fp8_operand_from_codes` encoding with e_row replaced by the tensor's largest block exponent e_T: exact
  while every finite block has e_T - e_b <= 14 (`tensor_span_ok`). A scalar factor lets XLA fold the scaling
  into the cuBLASLt FP8 GEMM (its a_scale / b_scale), so no pass over the output is needed. NaN blocks encode
  as E4M3 NaN, so their rows / columns of the product are NaN as on the per-row path.
  """
  e_t = tensor_exponent(q.scales)
  return _encode_e4m3(q.codes, q.scales, e_t), pow2(e_t - FP8_HEADROOM)


def tensor_span_ok(q: QTensor) -> jax.Array:
  """bool scalar: the whole tensor encodes exactly with one factor (e_T - e_b <= 14 for every finite block)."""
  s = q.scales.astype(jnp.int32)
  lo = jnp.min(jnp.where(s == E8M0_NAN, 255, s)) - E8M0_BIAS
  return tensor_exponent(q.scales) - lo <= MAX_EXACT_SPAN


def fp8_gemm_tensor_scaled(a: QTensor, b: QTensor, out_dtype) -> jax.Array:
  """One FP8 GEMM with per-tensor factors, written in XLA's scaled-FP8 pattern (dequantize = convert * scalar
  scale, then dot) so the GPU compiler emits a cuBLASLt FP8 GEMM with the scales fused in. Exact only when
  `tensor_span_ok` holds for both operands (`_gemm_mx_fp8` checks)."""
  av, sa = fp8_tensor_operand(a)
  bv, sb = fp8_tensor_operand(b)
  dt = jnp.bfloat16
  a_dq = av.astype(dt) * sa.astype(dt)  # exact: a power of two times an E4M3 value, within bf16's range
  b_dq = bv.astype(dt) * sb.astype(dt)
  out = jax.lax.dot_general(a_dq, b_dq, _KMAJOR_DOT, preferred_element_type=_gemm_out_dtype(out_dtype))
  return out.astype(out_dtype)


def _gemm_mx_fp8(a: QTensor, b: QTensor, out_dtype) -> jax.Array:
  """Per-tensor scaled FP8 GEMM (scales fused into cuBLASLt) when both operands span <= 2^14 overall, else the
  per-row encoding with the factors applied to the result. Both branches give the exact product."""
  return jax.lax.cond(tensor_span_ok(a) & tensor_span_ok(b),
                      lambda: fp8_gemm_tensor_scaled(a, b, out_dtype),
                      lambda: fp8_gemm(mx_to_fp8(a), mx_to_fp8(b), out_dtype))


def _gemm_bf16(a: QTensor, b: QTensor, out_dtype) -> jax.Array:
  acc = jax.lax.dot_general(_bf16_values(a), _bf16_values(b), _KMAJOR_DOT,
                            preferred_element_type=jnp.float32)  # [M, N]
  return apply_outer(acc, a, b).astype(out_dtype)


# (a's scale kind, b's scale kind) -> GEMM.
_GEMMS: dict[tuple[str, str], Callable[[QTensor, QTensor, jnp.dtype], jax.Array]] = {
    ("e8m0", "e8m0"): _gemm_mx_fp8,
    ("e4m3", "e4m3"): _gemm_bf16,
    ("e8m0", "e4m3"): _gemm_bf16,
    ("e4m3", "e8m0"): _gemm_bf16,
}


def supports(a: QTensor, b: QTensor) -> bool:
  """2-D operands with one K, any pair of MXFP4 / NVFP4 formats (MX x MX on FP8, the rest on bf16)."""
  if len(a.shape) != 2 or len(b.shape) != 2 or a.kmajor_shape[1] != b.kmajor_shape[1]:
    return False
  return (a.spec.scale, b.spec.scale) in _GEMMS


def gemm(a: QTensor, b: QTensor, *, out_dtype=jnp.float32) -> jax.Array:
  """dequant(a) @ dequant(b).T for K-major a [M, K], b [N, K] on Hopper FP8 / bf16 tensor cores."""
  if not supports(a, b):
    raise ValueError(f"fp8 gemm does not support {a.fmt=} {a.kmajor_shape=} x {b.fmt=} {b.kmajor_shape=}")
  return _GEMMS[(a.spec.scale, b.spec.scale)](a, b, out_dtype)
