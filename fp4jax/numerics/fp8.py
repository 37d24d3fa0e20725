"""The exact re-encoding of an MXFP4 operand as FP8 (E4M3) values with power-of-two factors: what lets a
Hopper FP8 tensor core compute an MXFP4 product (`ops/gemm/fp8.py`), defined once for the GEMM and the Pallas
encoder (`ops/quantize/pallas/fp8.py`).

Element k of row r is e2m1(q) * 2^e_b (e_b: its block's E8M0 exponent). With e_row = max(the largest finite
block exponent of the row, -120), the row is re-encoded as

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
exploding gradient block next to vanishing ones does: use `span_ok` to check, the emulated GEMM when exactness
of such rows matters.

One factor per tensor (`fp8_tensor_operand`): the same encoding with e_row replaced by the tensor's largest
block exponent e_T, exact while every finite block has e_T - e_b <= 14 (`tensor_span_ok`).

Special values: an E8M0 NaN scale (0xFF) encodes its block as E4M3 NaN (0x7F) and makes the row's row_scale
NaN, so the output row (or column) is NaN, like the dequantized product. e_row ignores NaN blocks; all-zero
blocks count like any other (quantizers give them the smallest scale). The floor -120 keeps row_scale >= 2^-126
a normal float32 (XLA on CPU flushes float32 subnormals to zero).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax.numerics import ieee
from fp4jax.numerics.qtensor import QTensor

E4M3_NAN_BITS = 0x7F
E8M0_NAN = 255
E8M0_BIAS = 127
FP8_HEADROOM = 6  # log2 of the factor putting a row's largest block at <= 6 * 2^6 = 384 (E4M3 max 448).
MAX_EXACT_SPAN = 14  # e_row - e_b up to which the E4M3 re-encoding is exact.
# Floor of e_row, so that row_scale = 2^(e_row - 6) >= 2^-126 stays a normal float32 (XLA flushes subnormals on
# CPU). A row whose blocks are all below 2^-120 then has d = e_row - e_b <= 7: still exact.
E_ROW_MIN = -126 + FP8_HEADROOM


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
  return Fp8Operand(_encode_e4m3(codes, scales, e_row[:, None]), row_factors(scales, e_row))


def row_factors(scales: jax.Array, e_row: jax.Array) -> jax.Array:
  """row_scale float32 [R]: 2^(e_row - 6) from exponent bits, NaN where the row of `scales` has a NaN block."""
  row_nan = jnp.any(scales == E8M0_NAN, axis=-1)
  return jnp.where(row_nan, jnp.float32(jnp.nan), ieee.pow2(e_row - FP8_HEADROOM))


def e4m3_bits(code: jax.Array, d: jax.Array, xp=jnp) -> jax.Array:
  """int32 E4M3 bytes of e2m1(code) * 2^d, rounded to nearest-even (int32 `code` with its sign in bit 3, int32
  `d` <= 6 broadcastable to it): integer arithmetic only, the definition behind the Pallas encoder and the
  lookup table of the XLA one (`_WORD_TABLE`).

  An E2M1 magnitude m >= 2 is (1 + (m & 1) / 2) * 2^((m >> 1) - 1), m = 1 is 2^-1. Shifted by d, its exponent
  te gives the normal byte (te + 7) << 3 | mantissa << 2 for te >= -6; below, the value is v / 2^t units of
  the smallest subnormal 2^-9 (v = 8 or 12, t = -(te + 6) >= 1), rounded to nearest-even, and t >= 5 rounds
  to 0 (v < 2^4), so any d below the range gives a signed zero as the float conversion would. xp: the array
  module (numpy builds `_WORD_TABLE` at import, outside any JAX trace or mesh).
  """
  m = code & 7
  is_norm2 = m >= 2
  mb = xp.where(is_norm2, m & 1, 0)  # the E2M1 mantissa bit
  te = xp.where(is_norm2, (m >> 1) - 1, -1) + d  # exponent of the shifted value
  normal = ((te + 7) << 3) | (mb << 2)
  t = xp.clip(-(te + 6), 1, 5)
  v = 8 + 4 * mb
  sub = (v + (1 << (t - 1)) - 1 + ((v >> t) & 1)) >> t  # round to nearest, ties to even
  mag = xp.where(m == 0, 0, xp.where(te >= -6, normal, sub))
  return mag | ((code & 8) << 4)


def _byte_words(packed: jax.Array, d: jax.Array, xp=jnp) -> jax.Array:
  """int32 words of int32 packed bytes at shifts d: the low nibble's E4M3 byte low, the high nibble's high."""
  return e4m3_bits(packed & 15, d, xp) | (e4m3_bits(packed >> 4, d, xp) << 8)


def encode_words(codes: jax.Array, scales: jax.Array, e_ref: jax.Array) -> jax.Array:
  """uint16 [..., 16] words of the E4M3 encoding of packed codes [..., 16] (one scale block per trailing row of
  16 bytes) with uint8 scales [...] against int32 reference exponents e_ref (broadcastable to scales): the low
  byte encodes a byte's low nibble (the even element), the high byte its high nibble; 0x7F7F in NaN blocks.
  One uint16 per input byte keeps the pass elementwise (no interleave of the two nibbles)."""
  c = codes.astype(jnp.int32)
  s = scales.astype(jnp.int32)
  d = (s - E8M0_BIAS - e_ref + FP8_HEADROOM)[..., None]  # <= 6 for finite blocks
  return jnp.where((s == E8M0_NAN)[..., None], E4M3_NAN_BITS * 257, _byte_words(c, d)).astype(jnp.uint16)


def words_to_values(words: jax.Array, r: int, k: int) -> jax.Array:
  """float8_e4m3fn [r, k] from the uint16 words of `encode_words` (little-endian: even element first)."""
  return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(r, k),
                                      jnp.float8_e4m3fn)


# Shifts below this give signed zeros only: 6 * 2^-13 = 0.75 * 2^-10 is under half the smallest subnormal 2^-9.
_ZERO_SHIFT = -13
_NAN_ROW = FP8_HEADROOM - _ZERO_SHIFT + 1  # the _WORD_TABLE row of NaN blocks, after one row per shift


def _word_table() -> np.ndarray:
  """uint16 [21, 256]: `encode_words` of every packed byte at every shift from _ZERO_SHIFT to 6 (rows 0..19)
  and for NaN blocks (row _NAN_ROW = 20), built from `e4m3_bits` itself in numpy: a constant of whatever
  program is being traced, on any platform or (abstract) mesh."""
  packed = np.arange(256, dtype=np.int32)
  shifts = np.arange(_ZERO_SHIFT, FP8_HEADROOM + 1, dtype=np.int32)[:, None]
  words = _byte_words(packed, shifts, np)
  return np.concatenate([words, np.full((1, 256), E4M3_NAN_BITS * 257)]).astype(np.uint16)


_WORD_TABLE = _word_table()


def _encode_e4m3(codes: jax.Array, scales: jax.Array, e_ref: jax.Array) -> jax.Array:
  """float8_e4m3fn [R, K] = RNE(e2m1(q) * 2^(e_b - e_ref + 6)), 0x7F (NaN) in NaN blocks: `encode_words` as a
  lookup of each packed byte in `_WORD_TABLE`, one row per block shift.

  e_ref: int32 reference exponent broadcastable to scales' [R, K/32] (per row or per tensor). On the H200 the
  arithmetic forms (float conversions E2M1 -> float32 -> E4M3, or `e4m3_bits`'s integer ops) ran this pass at
  0.4-0.7 TB/s, bound by instructions, and the lookup at about twice that (docs/BENCHMARKS.md).
  """
  r, half_k = codes.shape
  nb = scales.shape[-1]
  s = scales.astype(jnp.int32)
  shift = s - E8M0_BIAS - e_ref + FP8_HEADROOM  # [R, K/32], <= 6 for finite blocks
  row = jnp.where(s == E8M0_NAN, _NAN_ROW, jnp.clip(shift, _ZERO_SHIFT, FP8_HEADROOM) - _ZERO_SHIFT)
  # Unsigned, so that the lookup carries no wrap of negative indices (a compare and a select per byte): 6-19%
  # less time on the H200 (docs/BENCHMARKS.md, 2026-12-04).
  index = row.astype(jnp.uint32)[..., None] * 256 + codes.reshape(r, nb, 16).astype(jnp.uint32)  # [R, K/32, 16]
  return words_to_values(jnp.asarray(_WORD_TABLE).reshape(-1)[index], r, 2 * half_k)


def mx_to_fp8(q: QTensor) -> Fp8Operand:
  """Re-encodes a 2-D MXFP4 QTensor (K-major [R, K]) as E4M3 values with one power-of-two factor per row."""
  _check_2d(q, "mx_to_fp8")
  if q.spec.scale != "e8m0" or q.spec.block != 32 or q.outer is not None:
    raise ValueError(f"mx_to_fp8 needs MXFP4 (E8M0 scales, blocks of 32, no outer factor): {q.fmt=}")
  return fp8_operand_from_codes(q.codes, q.scales)


def _lowest_exponent(scales: jax.Array, axis: int | None) -> jax.Array:
  """The smallest finite E8M0 block exponent of uint8 `scales` along `axis` (None: the whole tensor)."""
  s = scales.astype(jnp.int32)
  return jnp.min(jnp.where(s == E8M0_NAN, 255, s), axis=axis) - E8M0_BIAS


def span_ok(q: QTensor) -> jax.Array:
  """bool [R]: rows of an MXFP4 QTensor that encode exactly (e_row - e_b <= 14 for every finite block)."""
  return row_exponent(q.scales) - _lowest_exponent(q.scales, -1) <= MAX_EXACT_SPAN


def tensor_exponent(scales: jax.Array) -> jax.Array:
  """e_T: int32 scalar, the largest finite block exponent of the whole tensor (floored like `row_exponent`)."""
  return jnp.max(row_exponent(scales))


class Exponents(NamedTuple):
  """What a GEMM that picks per-row or per-tensor factors at run time needs of one operand's uint8 E8M0 `scales`
  [R, K/32] (`exponents`): e_row int32 [R] (`row_exponent`), row_scale float32 [R] (`row_factors`), e_t the
  int32 e_T (`tensor_exponent`), ok the bool `tensor_span_ok`."""

  e_row: jax.Array
  row_scale: jax.Array
  e_t: jax.Array
  ok: jax.Array


def exponents(scales: jax.Array) -> Exponents:
  """`Exponents` of uint8 E8M0 `scales` [R, K/32] from reductions along each row, then over the rows' results:
  XLA fuses each stage into one kernel, where reducing the whole tensor at once took kernels of its own (a
  GEMM's glue is the bulk of an FP4 step's distinct kernels, each compiled on the step's first call)."""
  e_row = row_exponent(scales)
  e_t = jnp.max(e_row)  # the floor commutes with the max: tensor_exponent
  ok = e_t - jnp.min(_lowest_exponent(scales, -1)) <= MAX_EXACT_SPAN
  return Exponents(e_row, row_factors(scales, e_row), e_t, ok)


def fp8_tensor_operand(q: QTensor) -> tuple[jax.Array, jax.Array]:
  """MXFP4 re-encoded with ONE power-of-two factor for the whole tensor: (values [R, K] e4m3, factor ()).

  The `fp8_operand_from_codes` encoding with e_row replaced by the tensor's largest block exponent e_T: exact
  while every finite block has e_T - e_b <= 14 (`tensor_span_ok`). A scalar factor lets XLA fold the scaling
  into the cuBLASLt FP8 GEMM (its a_scale / b_scale), so no pass over the output is needed. NaN blocks encode
  as E4M3 NaN, so their rows / columns of the product are NaN as on the per-row path.
  """
  e_t = tensor_exponent(q.scales)
  return _encode_e4m3(q.codes, q.scales, e_t), ieee.pow2(e_t - FP8_HEADROOM)


def fp8_values(q: QTensor, e_ref: jax.Array) -> jax.Array:
  """float8_e4m3fn [R, K]: a 2-D MXFP4 QTensor encoded against int32 reference exponents `e_ref` [R] (one per
  row): `row_exponent` gives `mx_to_fp8`'s values, e_T broadcast `fp8_tensor_operand`'s. Lets one encoding
  serve a GEMM that picks per-row or per-tensor factors at run time (`ops/gemm/fp8.py`)."""
  _check_2d(q, "fp8_values")
  return _encode_e4m3(q.codes, q.scales, e_ref[:, None])


def tensor_span_ok(q: QTensor) -> jax.Array:
  """bool scalar: the whole tensor encodes exactly with one factor (e_T - e_b <= 14 for every finite block)."""
  return exponents(q.scales).ok
