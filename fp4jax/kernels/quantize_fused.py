"""Fused MXFP4 quantizer: one read of x[M, K] writes both the row view (along K) and the column view (along M).

One Pallas program per [block_m, block_k] tile of x. It loads the tile once and writes
  * the row view: codes [M, K/2] + E8M0 scales [M, K/32] (`reference.quantize(x, axis=-1)`), and
  * the column view, already transposed to K-major: codes [K, M/2] + scales [K, M/32]
    (`reference.quantize(x, axis=0)`), the layout the wgrad GEMM reads,
bit for bit equal to `fp4jax.reference.quantize`: RNE or SR (bits from `fp4jax.prng` keyed by the element's
row-major flat index in x), scale rule "ocp" or "noclip", optional `clip_fraction`, and 1x32 blocks or 32x32
tiles (`tile_2d`: one scale per tile, so the two views hold the same codes, computed once).
`quantize_dual(..., fp8=True)` adds the Hopper FP8 GEMM operands (`quantize_fp8`).

Each view has its own `ViewSpec` (`quantize_views`): rounding, scale rule, clip fraction, SR key, and for the
column view a fixed-sign Hadamard transform along M ("h16", "h32": `fp4jax.hadamard`, the same float32
butterfly), so one pass serves a GEMM pair with different recipes: dY's dgrad view (SR) and wgrad view (RNE,
Hadamard), or X's fprop view and its Hadamard-transformed wgrad view.

The input is read as uint32 words, each two bf16 neighbours along K (a free bitcast of x), split by row parity:
the low and high halves of a word are the two nibbles of a row-view byte, the same half of two consecutive rows
the two nibbles of a column-view byte, so packing is elementwise and only the column view's bytes and scales
are transposed in registers. At about half the copy bandwidth on an H200 the per-element work (two views,
and for SR a 2-round hash per element) rather than memory traffic looks like the limit, so the numerics are
integer and bit arithmetic with few operations per element (no float4 casts, no exp2/log2, no PRNG primitive):
  * block amax as the max of |x|'s float32 bit patterns (monotone for non-negative floats; NaN/Inf patterns
    sort above every finite one, which flags non-finite blocks without relying on float max NaN semantics);
  * E from amax's exponent bits, the block multiplier 2^-E built from exponent bits;
  * E2M1 codes from the float32 bits of |x| * 2^-E (`encode_rne`, `encode_sr`), equal to the reference's
    midpoint comparisons and its u < (|v| - lo) / (hi - lo) test.
bf16 inputs only (`supported`); other dtypes fall back to the reference.

With a column transform (`hadamard_pairs`) the column view runs the Hadamard butterfly on the loaded tile:
the stage at distance 1 between the two row parities, each further stage on row pairs i and i + d of the tile
viewed as [h / 2d, 2, d * w], the pair picked by exact integer sums (Triton tensors cannot be sliced). An
earlier version that split the tile into 32 row slices was as exact, but its 32 loads and 32 strided stores
made Triton's coalescing pass take ~50 s per compile (on the H200; 51 s with Triton 3.5.1 on CPU,
`scripts/triton_compile_time.py`), where this one takes 2.3-2.5 s. Its GPU speed is not yet measured.

Backend: Pallas on GPU through the Triton lowering (`pallas_call`'s default on CUDA in JAX 0.11.2, chosen
explicitly with `CompilerParams`). The kernel needs per-block reductions along the minor axis ([h, w] ->
[h, w/16, 16]) and an in-register transpose for the column view. Mosaic GPU in JAX 0.11.2 has no lowering rule
for `lax.transpose_p`, reduces along one axis only in tiled layouts, and reshapes tiled layouts only in their
leading dimensions, so it cannot express either step without a hand-written SMEM round trip. On CPU the same
kernel runs in Pallas interpret mode (the tests).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from fp4jax import hadamard, prng
from fp4jax.formats import get_format
from fp4jax.kernels import quantize_fp8
from fp4jax.kernels.tiling import QuantTile, default_tile
from fp4jax.qtensor import QTensor

KERNEL_NAME = "fp4jax_mxfp4_quantize_dual"
ROUNDINGS = ("rne", "sr")
SCALE_RULES = ("ocp", "noclip")
# The scale rule `reference.quantize` uses when none is given, by (rounding, tile_2d).
DEFAULT_SCALE_RULE = {("rne", False): "ocp", ("sr", False): "noclip", ("rne", True): "noclip",
                      ("sr", True): "noclip"}

_F32_ABS = 0x7FFFFFFF
_F32_INF = 0x7F800000
_MANT_1P5 = 0x400000  # mantissa bits of 1.5: above them a block max m * 2^e exceeds 6 * 2^(e - 2)
_E8M0_BIAS = 127
_E8M0_NAN = 255
_E_MIN, _E_MAX = -127, 127


# Hadamard transforms the column view can apply along M (fixed signs, or random signs from a transform key).
TRANSFORMS = ("h16", "h32", "rht16", "rht32")


@dataclasses.dataclass(frozen=True)
class ViewSpec:
  """How one view is quantized (`reference.quantize` options of that view).

  transform: None, or a Hadamard of `TRANSFORMS` applied along the view's axis before quantizing (column view
  only), as `quantize(hadamard(x, transform, axis=0, key=transform_key), axis=0)`.
  """

  rounding: str = "rne"
  scale_rule: str = "ocp"
  clip_fraction: float | None = None
  transform: str | None = None

  @classmethod
  def make(cls, rounding: str = "rne", scale_rule: str | None = None, clip_fraction: float | None = None,
           transform: str | None = None, tile_2d: bool = False) -> "ViewSpec":
    """A ViewSpec with `reference.quantize`'s default scale rule for (rounding, tile_2d) when none is given."""
    return cls(rounding, scale_rule or DEFAULT_SCALE_RULE.get((rounding, tile_2d), "ocp"), clip_fraction,
               transform)

  def valid(self) -> bool:
    """Whether every field is one the kernel implements."""
    return (self.rounding in ROUNDINGS and self.scale_rule in SCALE_RULES and self.transform in (None, *TRANSFORMS)
            and (self.clip_fraction is None or 0 < self.clip_fraction <= 1))


@dataclasses.dataclass(frozen=True)
class DualConfig:
  """Static options of one fused quantizer launch (hashable: crosses jit as one object).

  shared_bits: both views use SR with the same key, so each element's random bits are drawn once.
  """

  row: ViewSpec = ViewSpec()
  col: ViewSpec = ViewSpec()
  tile_2d: bool = False
  shared_bits: bool = False
  tile: QuantTile = QuantTile()
  interpret: bool = False

  @property
  def needs_params(self) -> bool:
    """Whether the kernel reads the uint32 parameter words (SR seeds, Hadamard sign mask)."""
    return "sr" in (self.row.rounding, self.col.rounding) or self.col.transform is not None


def supported(fmt: str, rounding: str = "rne", *, shape: tuple[int, ...] | None = None, dtype=None,
              scale_rule: str | None = None, tile_2d: bool = False, clip_fraction: float | None = None,
              **options) -> bool:
  """Whether `quantize_dual` covers this case; dot.py falls back to `reference.quantize` otherwise.

  Covered: fmt "mxfp4", rounding "rne" / "sr", scale rule "ocp" / "noclip", `clip_fraction`, 1-D blocks or
  32x32 tiles (`tile_2d`), a bf16 x [M, K] with M and K multiples of 32
  (`tiling.default_tile`), no other reference options.
  """
  if options or rounding not in ROUNDINGS:
    return False
  view = ViewSpec.make(rounding, scale_rule, clip_fraction, tile_2d=tile_2d)
  return supported_views(fmt, view, view, shape=shape, dtype=dtype, tile_2d=tile_2d)


def supported_views(fmt: str, row: ViewSpec, col: ViewSpec, *, shape: tuple[int, ...] | None = None,
                    dtype=None, tile_2d: bool = False) -> bool:
  """Whether `quantize_views` covers (row, col) on a `dtype` x of `shape` (None: not checked).

  Besides `supported`'s rules: a transform on the column view only, and 2-D tiles only with identical views.
  """
  if get_format(fmt).name != "mxfp4" or not (row.valid() and col.valid()) or row.transform is not None:
    return False
  if tile_2d and (row != col or col.transform is not None):
    return False
  if dtype is not None and jnp.dtype(dtype) != jnp.bfloat16:
    return False
  if shape is not None:
    if len(shape) != 2:
      return False
    try:
      _default_tile(shape, row, col)
    except ValueError:
      return False
  return True


def _default_tile(shape: tuple[int, int], row: ViewSpec, col: ViewSpec) -> QuantTile:
  kind = "transform" if col.transform else ("sr" if "sr" in (row.rounding, col.rounding) else "rne")
  return default_tile(*shape, rounding=kind)


def _block_exponent(amax_bits: jax.Array, cfg: ViewSpec) -> jax.Array:
  """int32 E of each block from the float32 bits of its amax (clamped to E8M0's [-127, 127])."""
  e = (amax_bits >> 23) - (_E8M0_BIAS + 2)  # floor(log2 amax) - 2: OCP's rule, amax / 2^e = 4 * 1.mant
  if cfg.scale_rule == "noclip":  # ceil(log2(amax / 6)): one up when the mantissa exceeds 1.5's
    coarser = (amax_bits & 0x7FFFFF) > _MANT_1P5
    e = e + coarser.astype(jnp.int32)
  if cfg.clip_fraction is not None:  # one finer when amax / (6 * 2^e) < clip_fraction (Hu's bounded clipping)
    m1 = jax.lax.bitcast_convert_type((amax_bits & 0x7FFFFF) | (_E8M0_BIAS << 23), jnp.float32)  # 1.mant
    ratio = m1 * (jnp.where(coarser, 2.0, 4.0) if cfg.scale_rule == "noclip" else 4.0)  # amax / 2^e, exact
    e = e - (ratio < jnp.float32(6.0 * cfg.clip_fraction)).astype(jnp.int32)
  return jnp.clip(e, _E_MIN, _E_MAX)  # a zero or subnormal amax lands on -127, as in the reference


def _pow2_neg(e: jax.Array) -> jax.Array:
  """float32 2^-e for int32 e in [-127, 126], from exponent bits."""
  return jax.lax.bitcast_convert_type((_E8M0_BIAS - e) << 23, jnp.float32)


def encode_rne(mag: jax.Array, r24: jax.Array | None) -> jax.Array:
  """int32 E2M1 magnitude codes of float32 magnitudes in [0, 8), round-to-nearest-even, saturating at 6.

  [1, 8): E2M1 is a float with one mantissa bit, so RNE on the float32 bits (add half an ulp of the kept bit,
  plus one when that bit is odd) leaves (biased exponent, mantissa bit) = code + 252 in bits 22 and up.
  [0, 1): the grid is 0, 0.5, 1: RNE(2 * mag) by the float32 add of 2^23 (one ulp = 1 there).
  """
  del r24
  b = jax.lax.bitcast_convert_type(mag, jnp.int32)
  big = jnp.minimum((b + ((b >> 22) & 1) + (0x1FFFFF - (252 << 22))) >> 22, 7)
  small = jax.lax.bitcast_convert_type(mag * 2.0 + 8388608.0, jnp.int32) - 0x4B000000
  return jnp.where(mag < 1.0, small, big)


def encode_sr(mag: jax.Array, r24: jax.Array) -> jax.Array:
  """int32 E2M1 magnitude codes by stochastic rounding: up from lo iff u < (mag - lo) / (hi - lo).

  u = r24 * 2^-24 (`prng.uniform_from_bits`). On [1, 8) the fraction is the 22 mantissa bits below the kept
  one, exactly trunc * 2^-22, so the test is the integer compare r24 < 4 * trunc; on [0, 1) it is done in
  float32 on 2 * mag, exact as well. Magnitudes of 6 and above give 7 (the reference clips to 6 first).
  """
  b = jax.lax.bitcast_convert_type(mag, jnp.int32)
  big = (b >> 22) - 252 + (r24 < ((b & 0x3FFFFF) << 2)).astype(jnp.int32)
  y = mag * 2.0
  lo = (y >= 1.0).astype(jnp.float32)
  u = r24.astype(jnp.float32) * jnp.float32(2.0**-24)
  small = lo.astype(jnp.int32) + (u < y - lo).astype(jnp.int32)
  return jnp.where(mag < 1.0, small, jnp.minimum(big, 7))


ENCODERS = {"rne": encode_rne, "sr": encode_sr}


def e2m1_magnitude(code: jax.Array) -> jax.Array:
  """float32 magnitude of int32 E2M1 magnitude codes 0..7 (0, 0.5, 1, 1.5, 2, 3, 4, 6) from exponent bits."""
  normal = as_f32((((code >> 1) + 126) << 23) | ((code & 1) << 22))  # code >= 2: (1 + m/2) * 2^(e - 1)
  return jnp.where(code >= 2, normal, code.astype(jnp.float32) * 0.5)


def _block_scale(amax: jax.Array, cfg: ViewSpec):
  """(finite, multiplier 2^-E, E8M0 scale byte) of blocks with int32 amax bits `amax` (NaN/Inf -> 0xFF)."""
  finite = amax < _F32_INF
  e = _block_exponent(amax, cfg)
  return finite, _pow2_neg(e), jnp.where(finite, e + _E8M0_BIAS, _E8M0_NAN)


def _codes(a, sign, r24, mul, blocks: tuple[int, ...], cfg: ViewSpec) -> jax.Array:
  """int32 E2M1 codes (sign in bit 3) of elements with |x| bits `a` [h, w] under block multipliers `mul`."""
  mag = jax.lax.bitcast_convert_type(a, jnp.float32).reshape(blocks) * mul  # exact: a power of two
  encode = ENCODERS[cfg.rounding]
  return encode(mag, None if r24 is None else r24.reshape(blocks)) | sign.reshape(blocks)


def pack_view(abs_lo, abs_hi, sign_lo, sign_hi, r24_lo, r24_hi, blocks: tuple[int, int, int], axis: int,
              block_scale: Callable, codes: Callable):
  """Packed codes [h, w] and scale bytes of one view of two element sets sharing their blocks (any format).

  abs_*: int32 |x| float32 bits [h, w] of the elements for the low and high nibbles (neighbours along the
  view's quantized axis, so in the same block); `blocks` reshapes [h, w] so that `axis` runs along a block.
  block_scale(amax bits) -> (finite, per-block multiplier, scale bytes); codes(abs bits, sign, r24,
  multiplier) -> int32 codes shaped `blocks`. Non-finite blocks get zero codes.
  """
  amax = jnp.max(jnp.maximum(abs_lo, abs_hi).reshape(blocks), axis=axis, keepdims=True)
  finite, mul, scale = block_scale(amax)
  packed = codes(abs_lo, sign_lo, r24_lo, mul) | (codes(abs_hi, sign_hi, r24_hi, mul) << 4)
  packed = jnp.where(finite, packed, 0)
  return packed.reshape(abs_lo.shape).astype(jnp.uint8), jnp.squeeze(scale, axis).astype(jnp.uint8)


def _view(abs_lo, abs_hi, sign_lo, sign_hi, r24_lo, r24_hi, blocks: tuple[int, int, int], axis: int,
          cfg: ViewSpec):
  """`pack_view` under MXFP4's E8M0 block scales and `cfg`'s rounding."""
  return pack_view(abs_lo, abs_hi, sign_lo, sign_hi, r24_lo, r24_hi, blocks, axis,
                   lambda amax: _block_scale(amax, cfg),
                   lambda a, sign, r24, mul: _codes(a, sign, r24, mul, blocks, cfg))


def _tiles_2d(mag, sign, r24, h: int, w: int, cfg: ViewSpec):
  """Both views under one scale per 32x32 tile: the codes are computed once and packed both ways.

  Returns (row codes per row parity [h, w], row scales [h, w/16], column codes per column parity [w, h],
  column scales [w, h/16]); every row (column) of a tile repeats the tile's scale, as in the reference.
  """
  tiles = (h // 16, 16, w // 16, 16)  # (tile row, row pair, tile column, column pair)
  amax = functools.reduce(jnp.maximum, mag.values()).reshape(tiles)
  amax = jnp.max(jnp.max(amax, axis=3, keepdims=True), axis=1, keepdims=True)  # [h/16, 1, w/16, 1]
  finite, mul, scale = _block_scale(amax, cfg)
  codes = {pq: jnp.where(finite, _codes(mag[pq], sign[pq], r24[pq], mul, tiles, cfg), 0) for pq in mag}
  row_codes = [(codes[p, 0] | (codes[p, 1] << 4)).reshape(h, w).astype(jnp.uint8) for p in range(2)]
  col_codes = [(codes[0, q] | (codes[1, q] << 4)).reshape(h, w).T.astype(jnp.uint8) for q in range(2)]
  scale = scale.astype(jnp.uint8)
  row_scales = jnp.broadcast_to(scale, (h // 16, 16, w // 16, 1)).reshape(h, w // 16)
  col_scales = jnp.broadcast_to(scale, (h // 16, 1, w // 16, 16)).reshape(h // 16, w).T
  return row_codes, row_scales, col_codes, col_scales


def random_bits(seed_ref, which: int, index, rounding: str = "sr") -> dict:
  """int32 top 24 hash bits (`prng.hash_bits(...) >> 8`) of each element set of `index` (its position in x),
  with seed pair `which` (0: row view, 1: column view); None per set for a view rounding other than "sr"
  (nothing drawn)."""
  if rounding != "sr":
    return dict.fromkeys(index.keys)
  out = {}
  for key_ in index.keys:
    rows, cols = index(key_)
    r = prng.hash_bits(seed_ref[2 * which], seed_ref[2 * which + 1], rows * jnp.uint32(index.k) + cols) >> 8
    out[key_] = jax.lax.bitcast_convert_type(r, jnp.int32)
  return out


@dataclasses.dataclass(frozen=True)
class PairIndex:
  """Positions in x of the tile's element sets x[2i + p, 2j + q], (p, q) in `keys`, as uint32 [h, w]."""

  keys: tuple
  h: int
  w: int
  k: int

  def __call__(self, pq) -> tuple[jax.Array, jax.Array]:
    p, q = pq
    rows = jax.lax.broadcasted_iota(jnp.uint32, (self.h, self.w), 0) * 2 + \
        (pl.program_id(0) * 2 * self.h + p).astype(jnp.uint32)
    cols = jax.lax.broadcasted_iota(jnp.uint32, (self.h, self.w), 1) * 2 + \
        (pl.program_id(1) * 2 * self.w + q).astype(jnp.uint32)
    return rows, cols


def magnitude_and_sign(bits: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(|x| float32 bits, the E2M1 sign bit 8 or 0) of float32 bits."""
  return bits & _F32_ABS, (bits >> 28) & 8


def tile_elements(x_ref) -> tuple[dict, dict, dict]:
  """(float32 bits, |bits|, sign) of a tile of bf16 pairs [h, 2, w] (uint32 words, the even column in the low
  half), each a dict of [h, w] arrays keyed (p, q): x[2i + p, 2j + q], p = row parity (which load), q = column
  parity (which half)."""
  words = [jax.lax.bitcast_convert_type(x_ref[:, p, :], jnp.int32) for p in range(2)]  # [h, w] each
  bits = {(p, 0): words[p] << 16 for p in range(2)} | {(p, 1): words[p] & -65536 for p in range(2)}
  split = {pq: magnitude_and_sign(b) for pq, b in bits.items()}
  return bits, {pq: ms[0] for pq, ms in split.items()}, {pq: ms[1] for pq, ms in split.items()}


def _dual_kernel(*refs, cfg: DualConfig, k: int):
  """One tile of x as bf16 pairs -> both views.

  x_ref: uint32 (row pair, row parity, column pair) [bm/2, 2, bk/2]; a uint32 holds two bf16 neighbours along
  K (the even one in the low half). Outputs, with the parity axis split out the same way (so the wrapper's
  reshapes are free): row codes [bm/2, 2, bk/2], row scales [bm/2, 2, bk/32], column codes [bk/2, 2, bm/2],
  column scales [bk/2, 2, bm/32].
  """
  seed_ref, (x_ref, rc_ref, rs_ref, cc_ref, cs_ref) = (refs[0], refs[1:]) if cfg.needs_params else (None, refs)
  h, _, w = x_ref.shape  # h = bm / 2 row pairs, w = bk / 2 column pairs
  bits, mag, sign = tile_elements(x_ref)  # x[2i + p, 2j + q] keyed (p, q)
  index = PairIndex(tuple(bits), h, w, k)
  row_r24 = random_bits(seed_ref, 0, index, cfg.row.rounding)
  if cfg.tile_2d:
    row_codes, row_scales, col_codes, col_scales = _tiles_2d(mag, sign, row_r24, h, w, cfg.row)
    for p in range(2):
      rc_ref[:, p, :] = row_codes[p]
      rs_ref[:, p, :] = row_scales
      cc_ref[:, p, :] = col_codes[p]
      cs_ref[:, p, :] = col_scales
    return
  # Row view (blocks of 32 along K = 16 column pairs): row parity p packs columns (2j, 2j + 1).
  for p in range(2):
    codes, scales = _view(mag[p, 0], mag[p, 1], sign[p, 0], sign[p, 1], row_r24[p, 0], row_r24[p, 1],
                          (h, w // 16, 16), 2, cfg.row)
    rc_ref[:, p, :] = codes  # [h, w]
    rs_ref[:, p, :] = scales  # [h, w/16]
  shared = cfg.shared_bits and cfg.col.rounding == "sr"
  col_r24 = row_r24 if shared else random_bits(seed_ref, 1, index, cfg.col.rounding)
  if cfg.col.transform:
    negative = jax.lax.bitcast_convert_type(seed_ref[4], jnp.int32)  # the Hadamard's sign mask
    for q in range(2):
      codes, scales = _transform_view(bits[0, q], bits[1, q], col_r24[0, q], col_r24[1, q], negative, cfg.col)
      cc_ref[:, q, :] = codes.T  # [w, h]
      cs_ref[:, q, :] = scales.T  # [w, h / 16]
    return
  # Column view (blocks of 32 along M = 16 row pairs): column parity q packs rows (2i, 2i + 1), transposed.
  for q in range(2):
    codes, scales = _view(mag[0, q], mag[1, q], sign[0, q], sign[1, q], col_r24[0, q], col_r24[1, q],
                          (h // 16, 16, w), 1, cfg.col)
    cc_ref[:, q, :] = codes.T  # [w, h]
    cs_ref[:, q, :] = scales.T  # [w, h / 16]


def pick(a: jax.Array, which: int) -> jax.Array:
  """a[:, which, :] of an int32 [A, 2, B] as an exact integer sum (Triton tensors cannot be sliced)."""
  sel = jax.lax.broadcasted_iota(jnp.int32, a.shape, 1) == which
  return jnp.sum(jnp.where(sel, a, 0), axis=1)


def halving_sum(a: jax.Array, blocks: tuple[int, ...], axis: int) -> jax.Array:
  """`reference._tree_sum` of float32 `a` (any shape holding `blocks`' elements) along `axis` of it viewed as
  `blocks` (a power-of-two length): a[:h] + a[h:2h], h halving to 1, pairs picked by exact integer sums. The
  result keeps `axis` with length 1."""
  lead, trailing = math.prod(blocks[:axis]), math.prod(blocks[axis + 1:])
  b = as_i32(a)
  n = blocks[axis]
  while n > 1:
    n //= 2
    pairs = b.reshape(lead, 2, n * trailing)
    b = as_i32(as_f32(pick(pairs, 0)) + as_f32(pick(pairs, 1)))
  return as_f32(b).reshape(blocks[:axis] + (1,) + blocks[axis + 1:])


def as_f32(b: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(b, jnp.float32)


def as_i32(v: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(v, jnp.int32)


def hadamard_pairs(even: jax.Array, odd: jax.Array, n: int, negative) -> tuple[jax.Array, jax.Array]:
  """`hadamard.hadamard(., kind, axis=0)` (size n, signs `hadamard.negative_mask(kind)` = `negative`, an int32)
  of rows 2i (`even`) and 2i + 1 (`odd`) given as float32 bits [h, w], h a multiple of n / 2.

  The same float32 operations in the same order as `hadamard.fwht`: signs (exact sign flips), the stage at
  distance 1 between the parities, then each stage at distance 2, 4, ... on row pairs i and i + d (viewed as
  [h / 2d, 2, d * w], the pair picked by exact integer sums), then the 1/sqrt(n) scale. Returns the
  transformed even and odd rows as float32 bits.
  """
  h, w = even.shape
  r = jax.lax.broadcasted_iota(jnp.int32, (h, w), 0) * 2 % n  # position of row 2i in its block of n
  even = even ^ (((negative >> r) & 1) << 31)
  odd = odd ^ (((negative >> (r + 1)) & 1) << 31)
  even, odd = as_i32(as_f32(even) + as_f32(odd)), as_i32(as_f32(even) - as_f32(odd))
  out = []
  for y in (even, odd):
    d = 1
    while 2 * d < n:
      pairs = y.reshape(h // (2 * d), 2, d * w)
      lo, hi = as_f32(pick(pairs, 0)), as_f32(pick(pairs, 1))
      first = jax.lax.broadcasted_iota(jnp.int32, pairs.shape, 1) == 0
      y = jnp.where(first, as_i32(lo + hi)[:, None, :], as_i32(lo - hi)[:, None, :]).reshape(h, w)
      d *= 2
    out.append(as_i32(as_f32(y) * jnp.float32(1 / math.sqrt(n))))
  return out[0], out[1]


def _transform_view(even, odd, r24_even, r24_odd, negative, cfg: ViewSpec):
  """Packed codes [h, w] and scale bytes [h/16, w] of the Hadamard-transformed column view of one column
  parity: `even`, `odd` are the float32 bits [h, w] of rows 2i and 2i + 1; `negative` the sign mask."""
  h, w = even.shape
  even, odd = hadamard_pairs(even, odd, hadamard.KINDS[cfg.transform].n, negative)
  (mag_even, sign_even), (mag_odd, sign_odd) = magnitude_and_sign(even), magnitude_and_sign(odd)
  return _view(mag_even, mag_odd, sign_even, sign_odd, r24_even, r24_odd,
               (h // 16, 16, w), 1, cfg)


def view_outputs(m: int, k: int, t: QuantTile, block: int) -> tuple[tuple, tuple]:
  """(out_shape, out_specs) of a dual-view kernel on x [M, K] with `block` elements per scale: row codes
  [M/2, 2, K/2], row scales [M/2, 2, K/block], column codes [K/2, 2, M/2], column scales [K/2, 2, M/block],
  each a free reshape of its QTensor array, tiled per program as the x tile [bm/2, 2, bk/2] dictates."""
  h, w, per = t.block_m // 2, t.block_k // 2, block // 2
  outs = [((m // 2, 2, k // 2), (h, 2, w), lambda i, j: (i, 0, j)),
          ((m // 2, 2, k // block), (h, 2, w // per), lambda i, j: (i, 0, j)),
          ((k // 2, 2, m // 2), (w, 2, h), lambda i, j: (j, 0, i)),
          ((k // 2, 2, m // block), (w, 2, h // per), lambda i, j: (j, 0, i))]
  return (tuple(jax.ShapeDtypeStruct(shape, jnp.uint8) for shape, _, _ in outs),
          tuple(pl.BlockSpec(b, index) for _, b, index in outs))


def view_arrays(rc, rs, cc, cs, m: int, k: int, block: int):
  """`view_outputs`' four arrays reshaped to the QTensor layouts (free)."""
  return rc.reshape(m, k // 2), rs.reshape(m, k // block), cc.reshape(k, m // 2), cs.reshape(k, m // block)


def dual_view_call(kernel: Callable, x: jax.Array, t: QuantTile, block: int, params: list, *, interpret: bool,
                   name: str):
  """One launch of a dual-view kernel over bf16 x [M, K] (the MXFP4 and NVFP4 kernels share it).

  The kernel gets `params`' arrays first ((array, BlockSpec) pairs), then x as uint32 words of two bf16
  neighbours along K split by row parity [M/2, 2, K/2] in (bm/2, 2, bk/2) tiles, then `view_outputs`' four
  outputs; returns the row codes, row scales, column codes and column scales in the QTensor layouts.
  """
  m, k = x.shape
  xw = jax.lax.bitcast_convert_type(x.reshape(m // 2, 2, k // 2, 2), jnp.uint32)  # [M/2, 2, K/2], free
  out_shape, out_specs = view_outputs(m, k, t, block)
  outs = pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=(m // t.block_m, k // t.block_k),
      in_specs=[spec for _, spec in params] + [pl.BlockSpec((t.block_m // 2, 2, t.block_k // 2),
                                                            lambda i, j: (i, 0, j))],
      out_specs=out_specs,
      compiler_params=pltriton.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
      interpret=interpret,
      name=name,
  )(*[a for a, _ in params], xw)
  return view_arrays(*outs, m, k, block)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _dual_call(x: jax.Array, params: jax.Array | None, cfg: DualConfig):
  extra = [(params, pl.BlockSpec((5,), lambda i, j: (0,)))] if cfg.needs_params else []
  return dual_view_call(functools.partial(_dual_kernel, cfg=cfg, k=x.shape[1]), x, cfg.tile, 32, extra,
                        interpret=cfg.interpret, name=KERNEL_NAME)


def _seed_words(key: jax.Array | None, view: str) -> tuple[jax.Array, jax.Array]:
  if key is None:
    raise ValueError(f"rounding='sr' in the {view} view needs a key")
  return prng.seed_words(key, prng.STREAM_ELEMENT_SR)


def quantize_views(x: jax.Array, row: ViewSpec, col: ViewSpec, *, row_key: jax.Array | None = None,
                   col_key: jax.Array | None = None, transform_key: jax.Array | None = None,
                   tile_2d: bool = False, tile: QuantTile | None = None,
                   interpret: bool = False) -> tuple[QTensor, QTensor]:
  """Both MXFP4 views of a bf16 x[M, K] from one fused pass, each with its own recipe.

  Equal bit for bit to `(reference.quantize(x, "mxfp4", axis=-1, rounding=row.rounding, key=row_key,
  scale_rule=row.scale_rule, clip_fraction=row.clip_fraction), reference.quantize(hadamard(x, col.transform,
  axis=0, key=transform_key) if col.transform else x, "mxfp4", axis=0, ...col's options, key=col_key))`
  (`transform_key`: the random-sign kinds' key); with `tile_2d`, both
  views share one scale per 32x32 tile (row == col required). `supported_views` says what is covered.
  Passing the same key object as row_key and col_key draws each element's random bits once for both views.
  """
  if not supported_views("mxfp4", row, col, dtype=x.dtype, tile_2d=tile_2d):
    raise ValueError(f"quantize_views does not cover {row=}, {col=}, {tile_2d=}, {x.dtype=}; check "
                     f"`supported_views(...)` and fall back to reference.quantize")
  if x.ndim != 2:
    raise ValueError(f"quantize_views takes a 2-D x, got {x.shape=}")
  m, k = x.shape
  tile = tile or _default_tile((m, k), row, col)
  tile.check(m, k, 32)
  cfg = DualConfig(row, col, tile_2d=tile_2d, shared_bits=row_key is not None and row_key is col_key,
                   tile=tile, interpret=interpret)
  params = None  # [row seed words, column seed words, Hadamard sign mask]
  if cfg.needs_params:
    zero = (jnp.uint32(0), jnp.uint32(0))
    words = [_seed_words(kk, view) if v.rounding == "sr" else zero
             for kk, v, view in ((row_key, row, "row"), (col_key, col, "column"))]
    mask = jnp.uint32(0)
    if col.transform is not None:
      mask = jax.lax.bitcast_convert_type(hadamard.negative_mask(col.transform, transform_key), jnp.uint32)
    params = jnp.stack([*words[0], *words[1], mask])
  rc, rs, cc, cs = _dual_call(x, params, cfg)
  return (QTensor(rc, rs, None, fmt="mxfp4", axis=1, shape=(m, k)),
          QTensor(cc, cs, None, fmt="mxfp4", axis=0, shape=(m, k)))


def quantize_dual(x: jax.Array, fmt: str = "mxfp4", *, rounding: str = "rne", key: jax.Array | None = None,
                  scale_rule: str | None = None, tile_2d: bool = False, clip_fraction: float | None = None,
                  fp8: bool = False, tile: QuantTile | None = None, interpret: bool = False):
  """Both MXFP4 views of x[M, K] from one fused pass with ONE recipe: (row view along K, column view along M).

  Equal bit for bit to `(reference.quantize(x, fmt, axis=-1, ...), reference.quantize(x, fmt, axis=0, ...))`
  with the same rounding, key, scale rule, tile_2d and clip_fraction (with tile_2d, one scale per 32x32 tile:
  both views hold the same codes). `interpret=True` runs the kernel in Pallas interpret mode (CPU).

  fp8=True also returns the Hopper GEMM's operands `(gemm_fp8.mx_to_fp8(row), gemm_fp8.mx_to_fp8(col))`, as
  a third element, from `quantize_fp8.mx_to_fp8`: a second Pallas pass over the packed codes. e_row is a
  maximum over a whole row (all of K, or all of M for the column view), so a tile cannot write its E4M3 values
  before every tile of its row is done; re-reading the codes (0.5 B + 1/32 B per element) costs less than any
  pre-pass over x (2 B per element) that would let the fused pass write them directly.
  """
  if not supported(fmt, rounding, scale_rule=scale_rule, dtype=x.dtype, tile_2d=tile_2d,
                   clip_fraction=clip_fraction):
    raise ValueError(f"quantize_dual does not cover {fmt=}, {rounding=}, {scale_rule=}, {tile_2d=}, "
                     f"{clip_fraction=}, {x.dtype=}; "
                     f"check `supported(...)` and fall back to reference.quantize")
  if rounding == "sr" and key is None:
    raise ValueError("rounding='sr' needs a key")
  view = ViewSpec.make(rounding, scale_rule, clip_fraction, tile_2d=tile_2d)
  row, col = quantize_views(x, view, view, row_key=key, col_key=key, tile_2d=tile_2d, tile=tile,
                            interpret=interpret)
  if fp8:
    return row, col, (quantize_fp8.mx_to_fp8(row, interpret=interpret),
                      quantize_fp8.mx_to_fp8(col, interpret=interpret))
  return row, col
