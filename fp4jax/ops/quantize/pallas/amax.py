"""The amaxes a global-scale format needs before its block scales: XLA reductions over bf16 bit patterns, and
the amax of a Hadamard-rotated view as a Pallas pass.

NVFP4's S_enc and MS-EDEN's s_dec need the amax of the whole tensor (or row tile) before any block scale: a
synchronisation point, so it is a separate pass. `bf16_amax` / `tile_amaxes` are one integer max of x's bf16
|bit patterns| (NaN when anything is NaN or Inf, as `reference._amax`). A rotated view needs the amax of the
*rotated* tensor: `rotated_amax` runs the quantizers' butterfly (`common.butterfly`, `hadamard.fwht`'s order)
on each tile and writes one max of |bits| per program, reduced by XLA, so it agrees with the reference bit for
bit. Along the rows of a tile (the column views, axis 0) with a transform of up to `PLANES_MAX` points the tile
is loaded as one strided plane per row of a Hadamard block, so every butterfly stage is elementwise between
planes; the reshaping form (each stage a [rows/2e, 2, e * cols] regrouping) ran 3.4-6.0x slower on the H200
(rht16: 1015 -> 168 us at 16384 x 16384, about the 132 us of the plain amax; docs/BENCHMARKS.md, 2026-12-04).
`with_plain=True` also returns the amax of x itself from the same loaded tiles: an NVFP4 launch whose row view
is plain and whose column view is rotated (the nvfp4 route's X and dY) then reads x twice (this pass, the
kernel) instead of three times (an XLA reduction besides).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from fp4jax.numerics import hadamard
from fp4jax.ops.quantize.pallas import common

AMAX_KERNEL_NAME = "fp4jax_rotated_amax"
TILE_ROWS = (128, 64, 32, 16)  # rows of the rotated axis per program, largest first
TILE_COLS = (64, 32, 16)
# Transforms along the rows of a tile (axis 0) up to this size load the tile as one plane per row of a Hadamard
# block (`_planes`); larger ones (rht128) keep the reshaping butterfly on one plane.
PLANES_MAX = 32

_BF16_ABS = 0x7FFF
_BF16_INF = 0x7F80


def tile_bits(x_ref, axis: int) -> jax.Array:
  """float32 bits of a tile of x with `axis` (0 or 1) turned down the rows: [rows, cols] int32."""
  v = x_ref[...].astype(jnp.float32)
  return common.as_i32(v.T if axis == 1 else v)


@dataclasses.dataclass(frozen=True)
class AmaxConfig:
  axis: int
  transform: str | None
  rows: int
  cols: int
  plain: bool = False  # also the max of |x| before the transform (`rotated_amax(..., with_plain=True)`)
  num_warps: int = 4
  interpret: bool = False


def _planes(x_ref, n: int) -> list[jax.Array]:
  """float32 bits of a [rows, cols] tile as n planes [rows / n, cols], plane p holding rows p, p + n, ...: strided
  loads, so that every butterfly stage pairs whole planes (elementwise, no reshape of a tile)."""
  rows = x_ref.shape[0]
  return [common.as_i32(x_ref[pl.ds(p, rows // n, stride=n), :].astype(jnp.float32)) for p in range(n)]


def _top(planes: list[jax.Array]) -> jax.Array:
  """[1, 1] max of |bits| over every plane (NaN/Inf patterns above all finite ones)."""
  bits = functools.reduce(jnp.maximum, [b & common.F32_ABS for b in planes])
  return jnp.max(jnp.max(bits, axis=1, keepdims=True), axis=0, keepdims=True)


def _amax_kernel(w_ref, x_ref, o_ref, *, cfg: AmaxConfig):
  """max |rotated x| float32 bits of one tile in the 16 slots of o_ref, or (`cfg.plain`) in slots 0-7 and the
  max |x| of the tile as loaded in slots 8-15."""
  n = hadamard.KINDS[cfg.transform].n if cfg.transform is not None else 1
  planes = _planes(x_ref, n) if cfg.axis == 0 and 1 < n <= PLANES_MAX else [tile_bits(x_ref, cfg.axis)]
  plain = _top(planes) if cfg.plain else None
  if n > 1:
    planes = common.butterfly(planes, n, common.read_words(w_ref, 0))
  top = jnp.broadcast_to(_top(planes), (1, 16))
  if cfg.plain:
    top = jnp.where(jax.lax.broadcasted_iota(jnp.int32, (1, 16), 1) < 8, top, jnp.broadcast_to(plain, (1, 16)))
  o_ref[...] = top


def _to_amax(top: jax.Array) -> jax.Array:
  return jnp.where(top >= common.F32_INF, jnp.float32(jnp.nan), jax.lax.bitcast_convert_type(top, jnp.float32))


@functools.partial(jax.jit, static_argnames=("cfg",))
def _amax_call(x: jax.Array, words: jax.Array, cfg: AmaxConfig) -> jax.Array | tuple[jax.Array, jax.Array]:
  length, other = x.shape if cfg.axis == 0 else x.shape[::-1]
  grid = (length // cfg.rows, other // cfg.cols)
  block = (cfg.rows, cfg.cols) if cfg.axis == 0 else (cfg.cols, cfg.rows)
  # One 16-slot row of maxima per program, laid out like x's tiles: for the row view (axis 1) the rows of x
  # lead, so a launch on `pallas.operand`'s canonical [rows, 128] layout has strides that do not depend on
  # the row count (the same kernel for every operand shape).
  tops_shape = (grid[0], grid[1] * 16) if cfg.axis == 0 else (grid[1], grid[0] * 16)
  tile_index = (lambda i, j: (i, j)) if cfg.axis == 0 else (lambda i, j: (j, i))
  tops = common.pallas_call(
      functools.partial(_amax_kernel, cfg=cfg),
      out_shape=jax.ShapeDtypeStruct(tops_shape, jnp.int32),
      grid=grid,
      in_specs=[pl.BlockSpec((common.SIGN_WORDS,), lambda i, j: (0,)), pl.BlockSpec(block, tile_index)],
      out_specs=pl.BlockSpec((1, 16), tile_index),
      compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
      interpret=cfg.interpret,
      name=common.launch_name(AMAX_KERNEL_NAME, cfg, x.shape, x.dtype),
  )(words, x)
  if not cfg.plain:
    return _to_amax(jnp.max(tops))
  slots = tops.reshape(-1, 16)
  return _to_amax(jnp.max(slots[:, 0])), _to_amax(jnp.max(slots[:, 8]))


def _fit(size: int, options: tuple[int, ...], at_least: int = 1) -> int | None:
  return next((b for b in options if size % b == 0 and b >= at_least), None)


def rotated_amax(x: jax.Array, transform: str | None, key: jax.Array | None = None, *, axis: int = 0,
                 with_plain: bool = False, interpret: bool = False,
                 words: jax.Array | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
  """`reference._amax(hadamard(x, transform, axis=axis, key=key))` (of x itself for transform None) from one
  Pallas pass over a 2-D x: float32, NaN if anything is non-finite. Both dims must be multiples of 16.
  with_plain: returns (that amax, `bf16_amax(x)`), both from the one pass. words: `common.sign_words(transform,
  key)`, where the caller has built them for its own kernel too (one set of instructions drawing the signs)."""
  if x.ndim != 2:
    raise ValueError(f"rotated_amax takes a 2-D x, got {x.shape=}")
  n = hadamard.KINDS[transform].n if transform is not None else 1
  length, other = x.shape if axis == 0 else x.shape[::-1]
  rows, cols = _fit(length, TILE_ROWS, n), _fit(other, TILE_COLS)
  if rows is None or cols is None:
    raise ValueError(f"rotated_amax needs dims that are multiples of 16 (and of the transform size along "
                     f"{axis=}): {x.shape=}, {transform=}")
  cfg = AmaxConfig(axis, transform, rows, cols, plain=with_plain, interpret=interpret)
  return _amax_call(x, common.sign_words(transform, key) if words is None else words, cfg)


def _bf16_abs_bits(x: jax.Array) -> jax.Array:
  """int32 bf16 bit patterns of |x|: monotone in |x|, NaN/Inf patterns (>= 0x7F80) above every finite one."""
  return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.int32) & _BF16_ABS


def _bits_to_amax(m: jax.Array) -> jax.Array:
  """float32 amax from a max of `_bf16_abs_bits`, NaN when the reduced elements hold a NaN or Inf."""
  val = jax.lax.bitcast_convert_type(m << 16, jnp.float32)
  return jnp.where(m >= _BF16_INF, jnp.nan, val)


def over_devices(amax: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """The largest of the devices' amaxes (>= 0, or NaN), NaN where any is, inside a shard_map over `axes`: taken
  over their float32 bits as int32, which order as the values and put NaN above inf (a float `pmax` dropped
  NaN on XLA:CPU)."""
  bits = jax.lax.bitcast_convert_type(jnp.abs(amax), jnp.int32)
  return jax.lax.bitcast_convert_type(jax.lax.pmax(bits, axes), jnp.float32)


def bf16_amax(x: jax.Array) -> jax.Array:
  """max |x| of a bf16 array as float32 (NaN if anything is non-finite): `reference._amax`, one reduction."""
  return _bits_to_amax(jnp.max(_bf16_abs_bits(x)))


def tile_amaxes(x: jax.Array, tile_rows: int) -> tuple[jax.Array, jax.Array]:
  """Per-row / per-column amax of x [M, K] under "nvfp4_tile" ([M], [K], each tile's value repeated).

  One reduction of x to a [M/T, K/T] grid of T x T maxima (T = tile_rows, the last tile may be shorter), then
  its rows give the row view's tiles (T rows of x by all of K) and its columns the column view's.
  """
  m, k = x.shape
  tm, tk = -(-m // tile_rows), -(-k // tile_rows)
  bits = jnp.pad(_bf16_abs_bits(x), ((0, tm * tile_rows - m), (0, tk * tile_rows - k)))
  grid = jnp.max(bits.reshape(tm, tile_rows, tk, tile_rows), axis=(1, 3))  # [M/T, K/T]
  row = jnp.repeat(_bits_to_amax(jnp.max(grid, axis=1)), tile_rows)[:m]
  col = jnp.repeat(_bits_to_amax(jnp.max(grid, axis=0)), tile_rows)[:k]
  return row, col
