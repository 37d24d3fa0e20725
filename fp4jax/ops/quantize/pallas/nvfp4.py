"""Fused NVFP4 quantizer: one read of bf16 x[M, K] writes the row view (along K) and the column view (along M).

Equal bit for bit to `(reference.quantize(x, fmt, axis=-1, rounding=row_rounding, key=row_key, ...),
reference.quantize(x, fmt, axis=0, rounding=col_rounding, key=col_key, ...))` for fmt "nvfp4" (one FP32 outer
per tensor), "nvfp4_46" (the same with 4/6 block scales, RNE) and "nvfp4_tile" (one outer per `tile_rows`
rows of each K-major view), 1x16 blocks or 16x16
tiles, rounding "rne" or "sr" chosen per view (the backward pass of fp4_dot quantizes dY by SR along one axis
and RNE along the other). The kernel uses the MXFP4 kernel's layout (`common.dual_view_call`): x read as uint32
words of two bf16 neighbours along K, split by row parity, so packing is elementwise and only the column view
is transposed.

Two passes over x, with an explicit synchronisation between them:
  1. amax (XLA, `amax.bf16_amax` / `amax.tile_amaxes`): a block scale needs S_enc, which needs the amax of the whole
     tensor (or row tile), so the amax is a separate reduction that completes before the kernel starts: one
     integer max of x's bf16 |bit patterns| (NaN if any element is NaN or Inf, as `reference._amax`; for
     "nvfp4_tile" one reduction to a grid of tile maxima serving both views; a Hadamard column view needs the
     amax of the rotated values: `amax.rotated_amax`, a Pallas pass with the kernel's butterfly, which also
     returns the row view's plain amax from the same read). A caller
     may pass `tensor_amax` (e.g. a delayed amax) to skip it for "nvfp4". Every per-tensor (per-tile) scalar
     is derived from it in XLA with the reference's own functions: S_enc (`nvfp4_encode_scale`, a correctly
     rounded division), g = S_enc * c (c = `nv_inv_target`), outer = 1 / S_enc, the eight quotients
     q_j = 1 / fl((1 + j/8) * outer), j = 0..7 (`ieee.div`, correctly rounded), and the scale cap
     (`scale_cap`: 448 but for an amax near float32 max, where 6 * 448 * outer would overflow).
  2. the Pallas kernel: per block, amax_b from |x|'s float32 bits; s_b = e4m3_RN(min(amax_b * g, cap)) by bit
     arithmetic (RNE on the float32 bits for normal E4M3, t * 2^9 rounded to an integer by the add of 2^23 for
     subnormal); enc_b = 1 / fl(s_b * outer) (Transformer Engine's order); codes from |x| * enc_b clamped to 6
     (`common.encode_rne/_sr`).

Exactness without in-kernel division. Pallas's Triton lowering maps a float32 `lax.div` to `arith.divf`, which
Triton compiles to an approximate division, and exposes no `div_rn` (only raw PTX through
`pltriton.elementwise_inline_asm`), so the kernel divides nowhere. The reference's only per-block division is
enc_b (`reference.nv_block_encode`): with s_b = (1 + j/8) * 2^e (an E4M3 value, subnormals too: m * 2^-9 with
m = 1..7 is 1, 1, 1.5, 1, 1.25, 1.5, 1.75 times a power of two) and O = outer * 2^L (L = 64 for a subnormal
outer, else 0), enc_b = fl(1 / fl((1 + j/8) * O)) * 2^(L - e): the reference computes exactly that, and the
kernel reads the first factor from a table of eight per tensor (or row tile) computed in XLA (`ieee.div`,
correctly rounded) and builds 2^(L - e) from exponent bits (e in [-9, 8]: always normal). The product is exact
below float32 max and inf above, which min(., f32 max) maps to f32 max on both sides.
Everything else per element or per block is a multiplication, a min, or integer/bit arithmetic, each one
IEEE-rounded in Triton as in XLA; where an add follows a product (the 2^23 tricks), the product is exact, so an
FMA contraction cannot change it. Subnormal float32 results are kept: the kernels' PTX for an H200 holds no
`.ftz` instruction (`tests/test_dot_kernels.py` reads it). They matter little: only |x| * enc_b of a
bf16-subnormal x in a block with a much larger max can be subnormal: RNE gives code 0 either way (anything below
0.25 does), SR rounds it up iff its draw u is exactly 0 (p = 2^-24), which a flush would turn off.

4/6 ("nvfp4_46", RNE, `_view_46`): per block both E4M3 scale candidates (targets 6 and 4, from g and g4 in the
parameter row), the codes under each, their squared errors (q * s_b - x * S_enc)^2 summed in the reference's
halving order, the lower kept (ties: 6). x * S_enc and the squares feed a difference and sums, so they are
PTX mul.rn.f32 (`exact`), which no FMA contraction can merge; q * s_b is exact. Equal to the reference on an
H200 (`test_gpu_four_over_six_matches_reference`), so in fp4_dot's dispatch (`pallas.VIEW_KERNELS`): quartet2's
forward operands, X along K and W along K, each a launch of one view (`write`; W's as W^T along K:
`pallas.operand`), since quartet2's backward re-quantizes the dequantized values; the 4/6 view is most of the
kernel (Triton IR of 2.8k lines for one view, 5.5k for both: `python -m bench triton "nv 4/6" "nv 4/6 row
view"`).

Tile-local ("nvfp4_tile"): the row view's outer runs over `tile_rows` rows of x, the column view's over
`tile_rows` columns of x (rows of its K-major [K, M] layout), each over the full other axis. Both amax vectors
come from the one pre-pass; a program then sees one S_enc per view as long as `tile_rows` is a multiple of the
tile's block_m and block_k (`check` requires it), handed in as per-program parameter rows.

2-D tiles (`tile_2d`, `reference.quantize(..., tile_2d=True)`): one E4M3 scale per 16x16 tile of x, from the
tile amax (8 row pairs by 8 column pairs of the loaded words), the same for both views; every row (column) of
the row (column) view's scales repeats it. Both views use one rounding and the row key: the reference keys SR
draws by x's flat index whatever the axis, so one draw per element serves both. For "nvfp4" the views then
share S_enc too and hold the same codes, computed once and packed both ways (as `mxfp4._tiles_2d`);
for "nvfp4_tile" each view encodes with its own row-tile S_enc.

Backend: Pallas through the Triton lowering (`pltriton.CompilerParams`), `interpret=True` on CPU (the tests);
see `mxfp4` for why not Mosaic GPU. bf16 inputs only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from fp4jax.numerics import hadamard, prng, quantize_args
from fp4jax.numerics.codecs import e4m3_rn_bytes
from fp4jax.numerics.formats import E2M1_MAX, E4M3_MAX
from fp4jax.numerics.produced import Produced
from fp4jax.numerics.qtensor import QTensor, Quantized, ScaledValues
from fp4jax.numerics.spec import OperandKeys, OperandSpec
from fp4jax.ops.quantize.pallas import amax as amax_lib
from fp4jax.ops.quantize.pallas import common, exact, params
from fp4jax.ops.quantize.pallas.tiling import QuantTile, default_tile

KERNEL_NAME = "fp4jax_nvfp4_quantize_dual"
FORMATS = ("nvfp4", "nvfp4_46", "nvfp4_tile")
_GLOBAL = ("nvfp4", "nvfp4_46")  # one S_enc per tensor
ROUNDINGS = ("rne", "sr")
BLOCK = 16
TRANSFORMS = ("h16", "h32", "rht16", "rht32")  # column-view Hadamards (one sign word: sizes up to 32)

_E4M3_NAN = 0x7F
_F32_MAX = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class NvDualConfig:
  """Static options of one fused NVFP4 launch (hashable: crosses jit as one object).

  tile_2d: one scale per 16x16 tile; row_rounding (== col_rounding) and the row seed serve both views.
  write: which views (row, column) the launch computes and stores (`common.dual_view_call`).
  values: which views are stored as bf16 `ScaledValues` in x's layout (`_values`; 1-D blocks, not 4/6).
  offset: the SR counters start at a traced offset, a sixth seed word (`views`' counter_offset).
  """

  fmt: str = "nvfp4"
  row_rounding: str = "rne"
  col_rounding: str = "rne"
  tile_2d: bool = False
  col_transform: str | None = None
  tile: QuantTile = QuantTile()
  interpret: bool = False
  write: tuple[bool, bool] = common.BOTH
  values: tuple[bool, bool] = (False, False)
  offset: bool = False


def _pick_tile(m: int, k: int, fmt: str, rounding: str, tile_rows: int) -> QuantTile:
  """`tiling.default_tile` for `rounding` (`_rounding`), or the smallest tile when the default does not divide
  "nvfp4_tile"'s row tiles."""
  tile = default_tile(m, k, BLOCK, rounding)
  if fmt == "nvfp4_tile" and (tile_rows % tile.block_m or tile_rows % tile.block_k):
    tile = QuantTile(32, 32, num_warps=4)
  return tile


def _check_tile(tile: QuantTile, m: int, k: int, fmt: str, tile_rows: int) -> None:
  tile.check(m, k, BLOCK)
  if fmt == "nvfp4_tile" and (tile_rows % tile.block_m or tile_rows % tile.block_k):
    raise ValueError(f"{fmt=} needs {tile_rows=} to be a multiple of the kernel tile "
                     f"(block_m={tile.block_m}, block_k={tile.block_k})")


def _block_encode(sf: jax.Array, p_ref) -> jax.Array:
  """enc_b = 1 / fl(s_b * outer) (0 when s_b = 0, at most f32 max) as q_j * 2^(L - e) for s_b = (1 + j/8) * 2^e."""
  b = jax.lax.bitcast_convert_type(sf, jnp.int32)
  j = (b >> 20) & 7
  q = p_ref[0, 1]
  for i in range(1, 8):
    q = jnp.where(j == i, p_ref[0, 1 + i], q)
  shift = p_ref[0, params.SHIFT_SLOT].astype(jnp.int32)
  pow2 = jax.lax.bitcast_convert_type((254 + shift - (b >> 23)) << 23, jnp.float32)  # exact: a normal 2^(L - e)
  return jnp.where(sf == 0, 0.0, jnp.minimum(q * pow2, _F32_MAX))


def _scale_candidate(amax: jax.Array, p_ref, slot: int = 0):
  """(ok, enc_b, E4M3 scale byte, its value) of scale units with int32 amax bits `amax` aiming at the target
  whose g = S_enc * c is in parameter `slot` (0: 6, capped at `reference.scale_cap(outer)`; params.G4_SLOT: 4/6's
  4, uncapped: `_view_46` drops it where over its cap). ok is False for a non-finite unit or a NaN S_enc: NaN
  scale (0x7F), and the caller zeroes the codes."""
  g = p_ref[0, slot]
  ok = (amax < common.F32_INF) & (g == g)
  cap = p_ref[0, params.CAP_SLOT] if slot == 0 else E4M3_MAX
  t = jnp.minimum(jax.lax.bitcast_convert_type(jnp.where(ok, amax, 0), jnp.float32) * g, cap)
  byte, sf = e4m3_rn_bytes(t)
  return ok, _block_encode(sf, p_ref), jnp.where(ok, byte, _E4M3_NAN), sf


def _unit_scale(amax: jax.Array, p_ref):
  """(ok, enc_b, E4M3 scale byte) of scale units with int32 amax bits `amax`; p_ref: the parameter row."""
  return _scale_candidate(amax, p_ref)[:3]


def _codes(a, sign, r24, enc, blocks: tuple[int, ...], rounding: str) -> jax.Array:
  """int32 E2M1 codes (sign in bit 3) of elements with |x| bits `a` [h, w] under unit encoders `enc`."""
  mag = jnp.minimum(jax.lax.bitcast_convert_type(a, jnp.float32).reshape(blocks) * enc, E2M1_MAX)
  encode = common.ENCODERS[rounding]
  # An OR, not `common.with_sign`'s add: here the add raised the values kernels' integer instructions
  # (docs/BENCHMARKS.md, "Session of 2026-12-06, 07:06 UTC").
  return encode(mag, None if r24 is None else r24.reshape(blocks)) | sign.reshape(blocks)


def _view(abs_lo, abs_hi, sign_lo, sign_hi, r24_lo, r24_hi, blocks: tuple[int, int, int], axis: int, p_ref,
          rounding: str):
  """`common.pack_view` under NVFP4's E4M3 block scales (blocks of 16; p_ref: this program's
  parameter row)."""
  return common.pack_view(abs_lo, abs_hi, sign_lo, sign_hi, r24_lo, r24_hi, blocks, axis,
                                  lambda amax: _unit_scale(amax, p_ref),
                                  lambda a, sign, r24, enc: _codes(a, sign, r24, enc, blocks, rounding))


def _values(abs_lo, abs_hi, sign_lo, sign_hi, r24_lo, r24_hi, blocks: tuple[int, int, int], axis: int, p_ref,
            rounding: str):
  """`_view`'s codes and scales as the bf16 bits of element(code) * s_b (`common.view_values`)."""
  return common.view_values(abs_lo, abs_hi, sign_lo, sign_hi, r24_lo, r24_hi, blocks, axis,
                            lambda amax: _scale_candidate(amax, p_ref),
                            lambda a, sign, r24, enc: _codes(a, sign, r24, enc, blocks, rounding))


def _view_46(abs_lo, abs_hi, sign_lo, sign_hi, r24_lo, r24_hi, blocks: tuple[int, int, int], axis: int, p_ref,
             rounding: str, *, interpret: bool):
  """`_view` under 4/6 (RNE; `reference._four_over_six`): per block the codes for target maxima 6 and 4, their
  squared errors (q * s_b - x * S_enc)^2 in the S_enc-scaled domain summed in the reference's tree order, the
  scale with the lower error kept (ties: 6), target 4 only up to its cap (CAP4_SLOT). Products that feed a
  difference or a sum are `exact.mul_rn`."""
  del r24_lo, r24_hi, rounding  # RNE only
  amax = jnp.max(jnp.maximum(abs_lo, abs_hi).reshape(blocks), axis=axis, keepdims=True)
  xs = [jax.lax.bitcast_convert_type(a, jnp.float32).reshape(blocks) for a in (abs_lo, abs_hi)]
  targets = [exact.mul_rn(x, p_ref[0, params.S_ENC_SLOT], interpret=interpret) for x in xs]
  candidates = []
  for slot in (0, params.G4_SLOT):
    ok, enc, byte, sf = _scale_candidate(amax, p_ref, slot)
    mags = [common.encode_rne(jnp.minimum(x * enc, E2M1_MAX), None) for x in xs]
    # q * s_b is exact (a 2-bit E2M1 value times an E4M3 one). Block element e = 2j + parity: the reference's
    # 16-element tree halves over j within each parity (pairs j, j + 4; j, j + 2; j, j + 1), then adds lo + hi.
    sq = [exact.mul_rn(d, d, interpret=interpret)
          for d in (common.e2m1_magnitude(m) * sf - t for m, t in zip(mags, targets))]
    err = common.halving_sum(sq[0], blocks, axis) + common.halving_sum(sq[1], blocks, axis)
    candidates.append((ok, byte, mags, err, sf))
  (ok, byte6, mags6, err6, _), (_, byte4, mags4, err4, sf4) = candidates
  four = (err4 < err6) & (sf4 <= p_ref[0, params.CAP4_SLOT])
  lo, hi = (common.with_sign(jnp.where(four, m4, m6), s.reshape(blocks))
            for m6, m4, s in zip(mags6, mags4, (sign_lo, sign_hi)))
  packed = jnp.where(ok, common.pack_nibbles(lo, hi), 0)
  return (packed.reshape(abs_lo.shape).astype(jnp.uint8),
          jnp.squeeze(jnp.where(four, byte4, byte6), axis).astype(jnp.uint8))


def _tile_codes(mag, sign, r24, amax, p_ref, rounding: str, tiles: tuple[int, int, int, int]):
  """One view under one scale per 16x16 tile: (codes per element set, [h/8, 8, w/8, 8], zero in non-finite
  tiles; scale bytes [h/8, 1, w/8, 1]). amax: int32 tile amax bits [h/8, 1, w/8, 1]."""
  ok, enc, scale = _unit_scale(amax, p_ref)
  codes = {pq: jnp.where(ok, _codes(mag[pq], sign[pq], r24[pq], enc, tiles, rounding), 0) for pq in mag}
  return codes, scale


def _store_tiles(row, col, rc_ref, rs_ref, cc_ref, cs_ref, h: int, w: int) -> None:
  """Packs `_tile_codes` results both ways: row parity p packs columns (2j, 2j+1), column parity q rows
  (2i, 2i+1), transposed; every row (column) of a tile repeats the tile's scale, as in the reference. A view
  whose refs are None (not written) is skipped."""
  if rc_ref is not None:
    rcodes, rscale = row
    rscale = jnp.broadcast_to(rscale, (h // 8, 8, w // 8, 1)).reshape(h, w // 8).astype(jnp.uint8)
    for p in range(2):
      rc_ref[:, p, :] = common.pack_nibbles(rcodes[p, 0], rcodes[p, 1]).reshape(h, w).astype(jnp.uint8)  # [h, w]
      rs_ref[:, p, :] = rscale  # [h, w/8]
  if cc_ref is not None:
    ccodes, cscale = col
    cscale = jnp.broadcast_to(cscale, (h // 8, 1, w // 8, 8)).reshape(h // 8, w).T.astype(jnp.uint8)
    for p in range(2):
      cc_ref[:, p, :] = common.pack_nibbles(ccodes[0, p], ccodes[1, p]).reshape(h, w).T.astype(jnp.uint8)  # [w, h]
      cs_ref[:, p, :] = cscale  # [w, h/8]


def _nv_kernel(seed_ref, prow_ref, pcol_ref, x_tile, rc_ref, rs_ref, cc_ref, cs_ref, *, cfg: NvDualConfig,
               shape: tuple[int, int] | None):
  """One tile of x as bf16 pairs -> both views (or the one `cfg.write` names; the other's refs are None).

  seed_ref: uint32 [5], the row view's then the column view's SR seed words, then the column transform's
  sign word (`common.sign_words`), and with `cfg.offset` the SR counters' offset. prow_ref / pcol_ref: float32
  [1, 16] parameter rows (`params.view_params`). x_tile: x's tile (`sources`) of bf16 pairs [bm/2, 2, bk/2]
  (row pair, row parity, column pair), the even column in the low half. Outputs, parity split out as in
  `mxfp4`: row codes [bm/2, 2, bk/2], row scales [bm/2, 2, bk/16], column codes [bk/2, 2, bm/2], column scales
  [bk/2, 2, bm/16].
  """
  h, _, w = x_tile.shape
  bits, mag, sign = common.tile_elements(x_tile)  # x[2i + p, 2j + q] keyed (p, q)
  index = common.PairIndex(tuple(bits), h, w, shape)

  offset = seed_ref[5] if cfg.offset else None
  r24 = common.random_bits(seed_ref, 0, index, cfg.row_rounding if cfg.write[0] or cfg.tile_2d else "rne",
                           offset)
  if cfg.tile_2d:  # one scale per 16x16 tile: 8 row pairs x 8 column pairs; both views draw the row seed's bits
    tiles = (h // 8, 8, w // 8, 8)  # (tile row, row pair, tile column, column pair)
    amax = functools.reduce(jnp.maximum, mag.values()).reshape(tiles)
    amax = jnp.max(jnp.max(amax, axis=3, keepdims=True), axis=1, keepdims=True)  # [h/8, 1, w/8, 1]
    # "nvfp4": one S_enc for both views, so one set of codes; "nvfp4_tile": each view's own S_enc.
    codes = functools.partial(_tile_codes, mag, sign, r24, amax, rounding=cfg.row_rounding, tiles=tiles)
    row = codes(prow_ref) if cfg.write[0] or cfg.fmt == "nvfp4" else None
    col = row if cfg.fmt == "nvfp4" else (codes(pcol_ref) if cfg.write[1] else None)
    _store_tiles(row, col, rc_ref, rs_ref, cc_ref, cs_ref, h, w)
    return
  view = functools.partial(_view_46, interpret=cfg.interpret) if cfg.fmt == "nvfp4_46" else _view
  # Row view: blocks of 16 along K = 8 column pairs; row parity p packs columns (2j, 2j+1).
  for p in range(2 if cfg.write[0] else 0):
    sets = (mag[p, 0], mag[p, 1], sign[p, 0], sign[p, 1], r24[p, 0], r24[p, 1], (h, w // 8, 8), 2, prow_ref,
            cfg.row_rounding)
    if cfg.values[0]:
      rc_ref[:, p, :] = common.bf16_words(*_values(*sets))  # [h, w] pairs along K, as x
      continue
    codes, scales = view(*sets)
    rc_ref[:, p, :] = codes  # [h, w]
    rs_ref[:, p, :] = scales  # [h, w/8]
  if not cfg.write[1]:
    return
  r24 = common.random_bits(seed_ref, 1, index, cfg.col_rounding, offset)
  if cfg.col_transform is not None:  # the column view of hadamard(x, axis=0): the same butterfly as MXFP4's
    n = hadamard.KINDS[cfg.col_transform].n
    negative = jax.lax.bitcast_convert_type(seed_ref[4], jnp.int32)
    for q in range(2):
      bits[0, q], bits[1, q] = common.butterfly([bits[0, q], bits[1, q]], n, [negative])
      for p in range(2):
        mag[p, q], sign[p, q] = common.magnitude_and_sign(bits[p, q])
  values = {}
  for q in range(2):  # column view: blocks of 16 along M = 8 row pairs; column parity q packs rows (2i, 2i+1)
    sets = (mag[0, q], mag[1, q], sign[0, q], sign[1, q], r24[0, q], r24[1, q], (h // 8, 8, w), 1, pcol_ref,
            cfg.col_rounding)
    if cfg.values[1]:
      values[0, q], values[1, q] = _values(*sets)
      continue
    codes, scales = view(*sets)
    cc_ref[:, q, :] = codes.T  # [w, h]
    cs_ref[:, q, :] = scales.T  # [w, h/8]
  for p in range(2 if cfg.values[1] else 0):  # stored untransposed, in x's layout: no tile turns
    cc_ref[:, p, :] = common.bf16_words(values[p, 0], values[p, 1])


@functools.partial(jax.jit, static_argnames=("cfg",))
def _nv_call(x: jax.Array, seeds: jax.Array, prow: jax.Array, pcol: jax.Array, cfg: NvDualConfig):
  # One parameter row for every program (a global S_enc), or one per row / column block.
  row_map, col_map = ((lambda i, j: (0, 0),) * 2 if cfg.fmt in _GLOBAL else
                      (lambda i, j: (i, 0), lambda i, j: (j, 0)))
  inputs = [(seeds, pl.BlockSpec(seeds.shape, lambda i, j: (0,))),
            (prow, pl.BlockSpec((1, params.N_PARAMS), row_map)),
            (pcol, pl.BlockSpec((1, params.N_PARAMS), col_map))]
  shape = common.draw_shape(x.shape, cfg.row_rounding, cfg.col_rounding)  # None: the same body for every x
  kernel = functools.partial(_nv_kernel, cfg=cfg, shape=shape)
  return common.dual_view_call(kernel, x, cfg.tile, BLOCK, inputs, interpret=cfg.interpret, name=KERNEL_NAME,
                               write=cfg.write, values=cfg.values)


def _seeds(rounding: str, key: jax.Array | None, name: str) -> jax.Array:
  """uint32 [2] SR seed words of one view (zeros for RNE, which draws nothing)."""
  if rounding != "sr":
    return jnp.zeros((2,), jnp.uint32)
  if key is None:
    raise ValueError(f"{name}_rounding='sr' draws random bits and needs {name}_key")
  return jnp.stack(prng.seed_words(key, prng.STREAM_ELEMENT_SR, barrier=False))


def check(x: jax.Array, row: OperandSpec, col: OperandSpec, row_keys: OperandKeys = OperandKeys(),
          col_keys: OperandKeys = OperandKeys(), *, tile_rows: int = 128) -> None:
  """Raises NotImplementedError saying why, when `views` does not cover this call.

  Covered: one format of `FORMATS` on both views ("nvfp4_tile" with `tile_rows` a multiple of 32), rounding
  "rne" / "sr" per view, 1x16 blocks or 16x16 tiles (`tile_2d`: one rounding and one SR key for both views);
  for "nvfp4" with 1-D blocks a Hadamard of `mxfp4.TRANSFORMS` on the column view; "nvfp4_46" (4/6) with RNE
  on both views, 1-D blocks and no transform; a 2-D bf16 x whose dims are multiples of 32.
  """
  fmt, why = row.fmt, None
  if fmt not in FORMATS or col.fmt != fmt:
    why = f"formats {row.fmt!r}, {col.fmt!r}"
  elif row.rounding not in ROUNDINGS or col.rounding not in ROUNDINGS:
    why = f"roundings {row.rounding!r}, {col.rounding!r}"
  elif row.tile_2d != col.tile_2d or (row.tile_2d and (
      row.rounding != col.rounding or (row.rounding == "sr" and row_keys.rounding is not col_keys.rounding))):
    why = "2-D tiles with two different roundings or SR keys"
  elif row.transform is not None or col.transform not in (None, *TRANSFORMS) or (
      col.transform is not None and (fmt != "nvfp4" or col.tile_2d)):
    why = f"transforms {row.transform!r} (row view), {col.transform!r} (column view) for {fmt!r}"
  elif fmt == "nvfp4_46" and (row.rounding, col.rounding, row.tile_2d) != ("rne", "rne", False):
    why = "4/6 with SR or 2-D tiles"
  elif fmt == "nvfp4_tile" and (tile_rows < 32 or tile_rows % 32):
    why = f"{tile_rows=} (a multiple of 32)"
  elif isinstance(x, Produced):  # its tensor amax needs x first: the API quantizes its value (`ops.quantize.api`)
    why = f"x given as {x.kind!r} of its inputs"
  elif x.dtype != jnp.bfloat16 or x.ndim != 2:
    why = f"x {x.dtype} {x.shape}: a 2-D bf16 array"
  else:
    try:
      _check_tile(_pick_tile(*x.shape, fmt, _rounding(row, col), tile_rows), *x.shape, fmt, tile_rows)
    except ValueError as e:
      why = str(e)
  if why is not None:
    raise NotImplementedError(f"nvfp4 kernel: {why}")


def _rounding(row: OperandSpec, col: OperandSpec) -> str:
  """The kind of tile (`tiling.default_tile`) that suits the launch: "sr transform", "sr" or "rne"."""
  kind = "sr" if "sr" in (row.rounding, col.rounding) else "rne"
  return "sr transform" if kind == "sr" and col.transform is not None else kind


def views(x: jax.Array, row: OperandSpec, col: OperandSpec, row_keys: OperandKeys = OperandKeys(),
          col_keys: OperandKeys = OperandKeys(), *, tensor_amax: jax.Array | None = None, tile_rows: int = 128,
          tile: QuantTile | None = None, interpret: bool = False, write: tuple[bool, bool] = common.BOTH,
          forms: tuple[str, str] = ("codes", "codes"), counter_offset: jax.Array | None = None,
          amax_over: tuple[str, ...] = ()) -> tuple[Quantized | None, Quantized | None]:
  """Both NVFP4 views of bf16 x[M, K] from one fused pass: (row view along K, column view along M).

  Equal bit for bit to `reference.quantize(x, row.fmt, axis=-1, rounding=row.rounding, key=row_keys.rounding,
  tensor_amax=tensor_amax, tile_rows=tile_rows, tile_2d=row.tile_2d)` and the column view's counterpart along
  axis 0 (of `hadamard(x, col.transform, axis=0, key=col_keys.transform)` with a transform). With 2-D tiles
  and "nvfp4" both views hold the same codes, computed once. `tensor_amax` ("nvfp4", no transform): a
  precomputed amax; else `amax.bf16_amax(x)` runs first (one XLA reduction). A transformed column view's amax
  comes from a first Pallas pass that runs the same butterfly (`amax.rotated_amax`), and so does the row view's
  then (the same pass, `with_plain`). `write` (row, column):
  the views to compute, None in place of the other (`common.ROW`, `common.COLUMN`: one operand, half the
  kernel's work, and only the amax pass that view reads). `forms` (row, column): a view asked as "values"
  comes as `ScaledValues` in x's layout where its blocks are 1-D and not 4/6, else as codes. Raises
  NotImplementedError where `check` does; `interpret=True` runs the kernels in Pallas interpret mode (CPU).
  Where x is a block of rows of a larger array (`pallas.rows`, inside a shard_map): `counter_offset` (uint32)
  is added to every SR counter, and the tensor amaxes are taken over the mesh axes `amax_over` (a `pmax`), so
  that the codes are the larger array's.
  """
  check(x, row, col, row_keys, col_keys, tile_rows=tile_rows)
  fmt, transform = row.fmt, col.transform
  if transform is not None and tensor_amax is not None:
    raise ValueError("tensor_amax is the amax of x, not of the column view's transformed x: pass one or the "
                     "other")
  if tensor_amax is not None and fmt not in _GLOBAL:
    raise ValueError(f"tensor_amax applies to fmt='nvfp4' (one scale per tensor), not {fmt=}")
  m, k = x.shape
  tile = tile or _pick_tile(m, k, fmt, _rounding(row, col), tile_rows)
  _check_tile(tile, m, k, fmt, tile_rows)
  row_key, col_key = row_keys.rounding, col_keys.rounding
  if row.tile_2d:
    col_key = row_key  # one draw per element serves both views (`check` made sure they share the key)
  words = common.sign_words(transform, col_keys.transform)  # the kernel reads the first (transforms <= 32)
  offset = counter_offset is not None and "sr" in (row.rounding, col.rounding)  # only SR draws read it
  seeds = jnp.concatenate([_seeds(row.rounding, row_key, "row"), _seeds(col.rounding, col_key, "col"), words[:1],
                           *([jnp.asarray(counter_offset, jnp.uint32).reshape(1)] if offset else [])])
  write_row, write_col = write
  if fmt in _GLOBAL:
    rotated = transform is not None and write_col
    if rotated:  # the rotated view's own amax (and the row view's, from the same read): a Pallas pass first
      amaxes = amax_lib.rotated_amax(x, transform, col_keys.transform, axis=0, with_plain=write_row,
                                     interpret=interpret, words=words)
      col_amax, row_amax = amaxes if write_row else (amaxes, amaxes)  # a view not written: any parameters do
    else:
      row_amax = col_amax = (amax_lib.bf16_amax(x) if tensor_amax is None else
                             quantize_args.amax_value(tensor_amax))
    if amax_over and tensor_amax is None:  # the whole array's
      row_amax, col_amax = (amax_lib.over_devices(a, amax_over) for a in (row_amax, col_amax))
  else:
    row_amax, col_amax = amax_lib.tile_amaxes(x, tile_rows)  # [M], [K]
  (prow, pcol), (row_outer, col_outer) = params.view_params((row_amax, col_amax), (row.rounding, col.rounding),
                                                            (tile.block_m, tile.block_k), fmt)
  values = tuple(bool(w) and f == "values" and not row.tile_2d and fmt != "nvfp4_46" for w, f in zip(write, forms))
  cfg = NvDualConfig(fmt=fmt, row_rounding=row.rounding, col_rounding=col.rounding, tile_2d=row.tile_2d,
                     col_transform=transform, tile=tile, interpret=interpret, write=tuple(write), values=values,
                     offset=offset)
  rc, rs, cc, cs = _nv_call(x, seeds, prow, pcol, cfg)
  e4m3 = jnp.float8_e4m3fn

  def view(codes, scales, outer, axis, as_values):
    if as_values:
      return ScaledValues(codes, outer, fmt=fmt, axis=axis, shape=(m, k))
    return QTensor(codes, jax.lax.bitcast_convert_type(scales, e4m3), outer, fmt=fmt, axis=axis, shape=(m, k))

  return (view(rc, rs, row_outer, 1, values[0]) if write_row else None,
          view(cc, cs, col_outer, 0, values[1]) if write_col else None)
