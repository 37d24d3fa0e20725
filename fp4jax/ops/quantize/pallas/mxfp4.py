"""Fused MXFP4 quantizer: one read of bf16 x[M, K] writes both the row view (along K) and the column view
(along M).

One Pallas program per [block_m, block_k] tile of x. It loads the tile once and writes
  * the row view: codes [M, K/2] + E8M0 scales [M, K/32] (`reference.quantize(x, axis=-1)`), and
  * the column view, already transposed to K-major: codes [K, M/2] + scales [K, M/32]
    (`reference.quantize(x, axis=0)`), the layout the wgrad GEMM reads,
bit for bit equal to the reference: RNE or SR (bits from `prng` keyed by the element's row-major flat index in
x), scale rule "ocp" or "noclip", optional `clip_fraction`, and 1x32 blocks or 32x32 tiles (`tile_2d`: one
scale per tile, so the two views hold the same codes, computed once).

Each view has its own `OperandSpec` (`views`): rounding, scale rule, clip fraction, SR key, and for the column
view a Hadamard transform along M (`TRANSFORMS`, the same float32 butterfly as `hadamard`), so one pass serves
a GEMM pair with different recipes: dY's dgrad view (SR) and wgrad view (RNE, Hadamard), or X's fprop view and
its Hadamard-transformed wgrad view. The layout, bit tricks and butterfly are `common`'s. The per-element
work (two views, and for SR a 2-round hash per element) rather than memory traffic is what limits it, so the
numerics are integer and bit arithmetic with few operations per element: E from the block amax's exponent
bits, the block multiplier 2^-E from exponent bits, E2M1 codes from the float32 bits of |x| * 2^-E.

The column view's butterfly runs on the loaded tile (`common.butterfly` on the two row parities). A form that
split the tile into 32 row slices was as exact, but its 32 loads and 32 strided stores made Triton's
coalescing pass take ~50 s per compile.

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

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fp4jax.numerics import hadamard, prng
from fp4jax.numerics.formats import MX_E_MAX
from fp4jax.numerics.qtensor import QTensor
from fp4jax.numerics.spec import OperandKeys, OperandSpec
from fp4jax.ops.quantize.pallas import common
from fp4jax.ops.quantize.pallas.tiling import QuantTile, default_tile

KERNEL_NAME = "fp4jax_mxfp4_quantize_dual"
BLOCK = 32
ROUNDINGS = ("rne", "sr")
TRANSFORMS = ("h16", "h32", "rht16", "rht32")  # column-view Hadamards (one sign word: sizes up to 32)

_MANT_1P5 = 0x400000  # mantissa bits of 1.5: above them a block max m * 2^e exceeds 6 * 2^(e - 2)
_E8M0_BIAS = 127
_E8M0_NAN = 255
_E_MIN, _E_MAX = -127, MX_E_MAX


@dataclasses.dataclass(frozen=True)
class DualConfig:
  """Static options of one launch (hashable: crosses jit as one object). row / col: the views' specs with
  their scale rule filled in; shared_bits: both views use SR with the same key, so each element's random bits
  are drawn once; write: which views (row, column) the launch computes and stores (`common.dual_view_call`);
  offset: the SR counters start at a traced offset, a parameter word (`views`' counter_offset)."""

  row: OperandSpec
  col: OperandSpec
  tile_2d: bool = False
  shared_bits: bool = False
  tile: QuantTile = QuantTile()
  interpret: bool = False
  write: tuple[bool, bool] = common.BOTH
  offset: bool = False

  @property
  def needs_params(self) -> bool:
    """Whether the kernel reads the uint32 parameter words (SR seeds, Hadamard sign mask, and the counter
    offset, which only SR reads)."""
    return "sr" in (self.row.rounding, self.col.rounding) or self.col.transform is not None


def _resolved(spec: OperandSpec) -> OperandSpec:
  return dataclasses.replace(spec, scale_rule=spec.mx_scale_rule)


def check(x: jax.Array, row: OperandSpec, col: OperandSpec, row_keys: OperandKeys = OperandKeys(),
          col_keys: OperandKeys = OperandKeys()) -> None:
  """Raises NotImplementedError saying why, when `views` does not cover this call.

  Covered: "mxfp4" on both views, rounding "rne" / "sr" each, any scale rule and clip fraction, a Hadamard of
  `TRANSFORMS` on the column view only; 32x32 tiles (`tile_2d`) with one spec and one SR key for both views
  and no transform; a 2-D bf16 x whose dims are multiples of 32.
  """
  why = None
  if (row.fmt, col.fmt) != ("mxfp4", "mxfp4"):
    why = f"formats {row.fmt!r}, {col.fmt!r}"
  elif row.rounding not in ROUNDINGS or col.rounding not in ROUNDINGS:
    why = f"roundings {row.rounding!r}, {col.rounding!r}"
  elif row.transform is not None or col.transform not in (None, *TRANSFORMS):
    why = f"transforms {row.transform!r} (row view), {col.transform!r} (column view)"
  elif row.tile_2d != col.tile_2d or (row.tile_2d and (
      _resolved(row) != _resolved(col) or (row.rounding == "sr" and row_keys.rounding is not col_keys.rounding))):
    why = "2-D tiles with two different recipes or SR keys"
  elif x.dtype != jnp.bfloat16 or x.ndim != 2:
    why = f"x {x.dtype} {x.shape}: a 2-D bf16 array"
  else:
    try:
      _default_tile(x.shape, row, col)
    except ValueError as e:
      why = str(e)
  if why is not None:
    raise NotImplementedError(f"mxfp4 kernel: {why}")


def _default_tile(shape: tuple[int, int], row: OperandSpec, col: OperandSpec) -> QuantTile:
  kind = "transform" if col.transform else ("sr" if "sr" in (row.rounding, col.rounding) else "rne")
  return default_tile(*shape, rounding=kind)


def _block_exponent(amax_bits: jax.Array, cfg: OperandSpec) -> jax.Array:
  """int32 E of each block from the float32 bits of its amax (clamped to [-127, 125], as the reference)."""
  e = (amax_bits >> 23) - (_E8M0_BIAS + 2)  # floor(log2 amax) - 2: OCP's rule, amax / 2^e = 4 * 1.mant
  if cfg.scale_rule == "noclip":  # ceil(log2(amax / 6)): one up when the mantissa exceeds 1.5's
    coarser = (amax_bits & 0x7FFFFF) > _MANT_1P5
    e = e + coarser.astype(jnp.int32)
  if cfg.clip_fraction is not None:  # one finer when amax / 2^e < fp32(6 * clip_fraction) (Hu's bounded clipping)
    m1 = jax.lax.bitcast_convert_type((amax_bits & 0x7FFFFF) | (_E8M0_BIAS << 23), jnp.float32)  # 1.mant
    ratio = m1 * (jnp.where(coarser, 2.0, 4.0) if cfg.scale_rule == "noclip" else 4.0)  # amax / 2^e, exact
    e = e - (ratio < jnp.float32(6.0 * cfg.clip_fraction)).astype(jnp.int32)
  return jnp.clip(e, _E_MIN, _E_MAX)  # a zero or subnormal amax lands on -127, as in the reference


def _pow2_neg(e: jax.Array) -> jax.Array:
  """float32 2^-e for int32 e in [-127, 126], from exponent bits."""
  return jax.lax.bitcast_convert_type((_E8M0_BIAS - e) << 23, jnp.float32)


def _block_scale(amax: jax.Array, cfg: OperandSpec):
  """(finite, multiplier 2^-E, E8M0 scale byte) of blocks with int32 amax bits `amax` (NaN/Inf -> 0xFF)."""
  finite = amax < common.F32_INF
  e = _block_exponent(amax, cfg)
  return finite, _pow2_neg(e), jnp.where(finite, e + _E8M0_BIAS, _E8M0_NAN)


def _codes(a, sign, r24, mul, blocks: tuple[int, ...], cfg: OperandSpec) -> jax.Array:
  """int32 E2M1 codes (sign in bit 3) of elements with |x| bits `a` [h, w] under block multipliers `mul`."""
  mag = jax.lax.bitcast_convert_type(a, jnp.float32).reshape(blocks) * mul  # exact: a power of two
  encode = common.ENCODERS[cfg.rounding]
  return common.with_sign(encode(mag, None if r24 is None else r24.reshape(blocks)), sign.reshape(blocks))


def _view(abs_lo, abs_hi, sign_lo, sign_hi, r24_lo, r24_hi, blocks: tuple[int, int, int], axis: int,
          cfg: OperandSpec):
  """`pack_view` under MXFP4's E8M0 block scales and `cfg`'s rounding."""
  return common.pack_view(abs_lo, abs_hi, sign_lo, sign_hi, r24_lo, r24_hi, blocks, axis,
                          lambda amax: _block_scale(amax, cfg),
                          lambda a, sign, r24, mul: _codes(a, sign, r24, mul, blocks, cfg))


def _tiles_2d(mag, sign, r24, h: int, w: int, cfg: OperandSpec):
  """Both views under one scale per 32x32 tile: the codes are computed once and packed both ways.

  Returns (row codes per row parity [h, w], row scales [h, w/16], column codes per column parity [w, h],
  column scales [w, h/16]); every row (column) of a tile repeats the tile's scale, as in the reference.
  """
  tiles = (h // 16, 16, w // 16, 16)  # (tile row, row pair, tile column, column pair)
  amax = functools.reduce(jnp.maximum, mag.values()).reshape(tiles)
  amax = jnp.max(jnp.max(amax, axis=3, keepdims=True), axis=1, keepdims=True)  # [h/16, 1, w/16, 1]
  finite, mul, scale = _block_scale(amax, cfg)
  codes = {pq: jnp.where(finite, _codes(mag[pq], sign[pq], r24[pq], mul, tiles, cfg), 0) for pq in mag}
  row_codes = [common.pack_nibbles(codes[p, 0], codes[p, 1]).reshape(h, w).astype(jnp.uint8) for p in range(2)]
  col_codes = [common.pack_nibbles(codes[0, q], codes[1, q]).reshape(h, w).T.astype(jnp.uint8) for q in range(2)]
  scale = scale.astype(jnp.uint8)
  row_scales = jnp.broadcast_to(scale, (h // 16, 16, w // 16, 1)).reshape(h, w // 16)
  col_scales = jnp.broadcast_to(scale, (h // 16, 1, w // 16, 16)).reshape(h // 16, w).T
  return row_codes, row_scales, col_codes, col_scales


def _dual_kernel(*refs, cfg: DualConfig, shape: tuple[int, int] | None):
  """One tile of x as bf16 pairs -> both views (or the one `cfg.write` names; the other's refs are None).

  x_tile: x's tile (`sources`: read, or computed from the inputs of the op that produces x) of bf16 pairs
  (row pair, row parity, column pair) [bm/2, 2, bk/2]; a uint32 holds two bf16 neighbours along K (the even one
  in the low half). Outputs, with the parity axis split out the same way (so the wrapper's reshapes are free):
  row codes [bm/2, 2, bk/2], row scales [bm/2, 2, bk/32], column codes [bk/2, 2, bm/2],
  column scales [bk/2, 2, bm/32].
  """
  seed_ref, (x_tile, rc_ref, rs_ref, cc_ref, cs_ref) = (refs[0], refs[1:]) if cfg.needs_params else (None, refs)
  h, _, w = x_tile.shape  # h = bm / 2 row pairs, w = bk / 2 column pairs
  bits, mag, sign = common.tile_elements(x_tile)  # x[2i + p, 2j + q] keyed (p, q)
  index = common.PairIndex(tuple(bits), h, w, shape)
  write_row, write_col = cfg.write
  shared = cfg.shared_bits
  offset = seed_ref[5] if cfg.offset else None
  # The row seed's bits: the row view's, and the column view's too when shared (or for 2-D tiles).
  row_r24 = common.random_bits(seed_ref, 0, index, cfg.row.rounding if write_row or shared or cfg.tile_2d
                               else "rne", offset)
  if cfg.tile_2d:
    row_codes, row_scales, col_codes, col_scales = _tiles_2d(mag, sign, row_r24, h, w, cfg.row)
    for p in range(2):
      if write_row:
        rc_ref[:, p, :] = row_codes[p]
        rs_ref[:, p, :] = row_scales
      if write_col:
        cc_ref[:, p, :] = col_codes[p]
        cs_ref[:, p, :] = col_scales
    return
  # Row view (blocks of 32 along K = 16 column pairs): row parity p packs columns (2j, 2j + 1).
  for p in range(2 if write_row else 0):
    codes, scales = _view(mag[p, 0], mag[p, 1], sign[p, 0], sign[p, 1], row_r24[p, 0], row_r24[p, 1],
                          (h, w // 16, 16), 2, cfg.row)
    rc_ref[:, p, :] = codes  # [h, w]
    rs_ref[:, p, :] = scales  # [h, w/16]
  if not write_col:
    return
  col_r24 = row_r24 if shared else common.random_bits(seed_ref, 1, index, cfg.col.rounding, offset)
  if cfg.col.transform:
    negative = jax.lax.bitcast_convert_type(seed_ref[4], jnp.int32)  # the Hadamard's sign word
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


def _transform_view(even, odd, r24_even, r24_odd, negative, cfg: OperandSpec):
  """Packed codes [h, w] and scale bytes [h/16, w] of the Hadamard-transformed column view of one column
  parity: `even`, `odd` are the float32 bits [h, w] of rows 2i and 2i + 1; `negative` the sign word."""
  h, w = even.shape
  even, odd = common.butterfly([even, odd], hadamard.KINDS[cfg.transform].n, [negative])
  (mag_even, sign_even), (mag_odd, sign_odd) = common.magnitude_and_sign(even), common.magnitude_and_sign(odd)
  return _view(mag_even, mag_odd, sign_even, sign_odd, r24_even, r24_odd,
               (h // 16, 16, w), 1, cfg)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _dual_call(x: jax.Array, params: jax.Array | None, cfg: DualConfig):
  extra = [(params, pl.BlockSpec(params.shape, lambda i, j: (0,)))] if cfg.needs_params else []
  shape = common.draw_shape(x.shape, cfg.row.rounding, cfg.col.rounding)  # None: the same body for every x
  kernel = functools.partial(_dual_kernel, cfg=cfg, shape=shape)
  return common.dual_view_call(kernel, x, cfg.tile, BLOCK, extra, interpret=cfg.interpret, name=KERNEL_NAME,
                               write=cfg.write)


def _seed_words(key: jax.Array | None, view: str) -> tuple[jax.Array, jax.Array]:
  if key is None:
    raise ValueError(f"rounding='sr' in the {view} view needs a key")
  return prng.seed_words(key, prng.STREAM_ELEMENT_SR, barrier=False)


def views(x: jax.Array, row: OperandSpec, col: OperandSpec, row_keys: OperandKeys = OperandKeys(),
          col_keys: OperandKeys = OperandKeys(), *, tile: QuantTile | None = None, interpret: bool = False,
          write: tuple[bool, bool] = common.BOTH,
          counter_offset: jax.Array | None = None) -> tuple[QTensor | None, QTensor | None]:
  """Both MXFP4 views of a bf16 x[M, K] from one fused pass, each with its own recipe.

  Equal bit for bit to `(reference.quantize(x, "mxfp4", axis=-1, ...row's options, key=row_keys.rounding),
  reference.quantize(hadamard(x, col.transform, axis=0, key=col_keys.transform) if col.transform else x,
  "mxfp4", axis=0, ...col's options, key=col_keys.rounding))`. Passing the same key object as both views'
  rounding key draws each element's random bits once for both. `write` (row, column): the views to compute,
  None in place of the other (`common.ROW`, `common.COLUMN`: one operand, half the kernel's work). Raises
  NotImplementedError where `check` does; `interpret=True` runs the kernel in Pallas interpret mode (CPU).
  counter_offset: a uint32 scalar added to every SR counter, where x is a block of rows of a larger array
  (`ops.quantize.pallas.rows`), so that the draws are the larger array's; None draws as x's own (offset 0).
  """
  check(x, row, col, row_keys, col_keys)
  m, k = x.shape
  row, col = _resolved(row), _resolved(col)
  tile = tile or _default_tile((m, k), row, col)
  tile.check(m, k, BLOCK)
  row_key, col_key = row_keys.rounding, col_keys.rounding
  shared = row_key is not None and row_key is col_key and row.rounding == col.rounding == "sr"
  offset = counter_offset is not None and "sr" in (row.rounding, col.rounding)  # only SR draws read it
  cfg = DualConfig(row, col, tile_2d=row.tile_2d, shared_bits=shared,
                   tile=tile, interpret=interpret, write=tuple(write), offset=offset)
  params = None  # [row seed words, column seed words, Hadamard sign mask, counter offset if any]
  if cfg.needs_params:
    zero = (jnp.uint32(0), jnp.uint32(0))
    words = [_seed_words(kk, view) if v.rounding == "sr" else zero
             for kk, v, view in ((row_key, row, "row"), (col_key, col, "column"))]
    mask = common.sign_words(col.transform, col_keys.transform, 1)[0]
    params = jnp.stack([*words[0], *words[1], mask, *([jnp.asarray(counter_offset, jnp.uint32)] if offset else [])])
  rc, rs, cc, cs = _dual_call(x, params, cfg)
  return (QTensor(rc, rs, None, fmt="mxfp4", axis=1, shape=(m, k)) if cfg.write[0] else None,
          QTensor(cc, cs, None, fmt="mxfp4", axis=0, shape=(m, k)) if cfg.write[1] else None)
