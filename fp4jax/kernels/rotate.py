"""The Hadamard rotation inside the Pallas kernels, and the rotated tensor's amax as a Pallas pass.

A global-scale format (NVFP4, MS-EDEN) quantizing a rotated view needs the amax of the *rotated* tensor before
any block scale: `rotated_amax` is that pre-pass, the same butterfly as the quantizer's and a max of |bits| per
program, reduced by XLA. `rotate_rows` is `hadamard.hadamard(., axis=0)` on a tile whose rows run along the
rotated axis, with `hadamard.fwht`'s float32 operations in its order (pairs picked by exact integer sums, as
`quantize_fused.hadamard_pairs` does on its row-parity layout), so kernel and reference agree bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from fp4jax import hadamard
from fp4jax.kernels.quantize_fused import as_f32, as_i32, pick

AMAX_KERNEL_NAME = "fp4jax_rotated_amax"
SIGN_WORDS = 4  # uint32 words of -1 signs: up to 128 (rht128)
TILE_ROWS = (128, 64, 32, 16)  # rows of the rotated axis per program, largest first
TILE_COLS = (64, 32, 16)

_F32_ABS = 0x7FFFFFFF
_F32_INF = 0x7F800000


def sign_words(transform: str | None, key: jax.Array | None) -> jax.Array:
  """uint32 [SIGN_WORDS] of `transform`'s -1 signs (`hadamard.negative_words`; zeros for no transform): what
  kernels read."""
  if transform is None:
    return jnp.zeros((SIGN_WORDS,), jnp.uint32)
  return hadamard.negative_words(transform, key, SIGN_WORDS)


def tile_bits(x_ref, axis: int) -> jax.Array:
  """float32 bits of a tile of x with `axis` (0 or 1) turned down the rows: [rows, cols] int32."""
  v = x_ref[...].astype(jnp.float32)
  return as_i32(v.T if axis == 1 else v)


def rotate_rows(bits: jax.Array, n: int, words: list) -> jax.Array:
  """The size-n transform along the rows of float32 bits [L, C] (L a multiple of n): signs (bit-31 flips;
  `words`: int32 scalars, sign r in bit r % 32 of word r // 32), butterfly stages at row distance 1, 2, ...,
  n/2 in `hadamard.fwht`'s order, then the 1/sqrt(n) scale. float32 bits out."""
  rows, cols = bits.shape
  r = jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 0) % n  # position in its Hadamard block
  word = words[0]
  for i in range(1, n // 32):
    word = jnp.where(r >= 32 * i, words[i], word)
  y = bits ^ (((word >> (r & 31)) & 1) << 31)
  d = 1
  while d < n:
    pairs = y.reshape(rows // (2 * d), 2, d * cols)  # row pairs (i, i + d) of each run of 2d rows
    lo, hi = as_f32(pick(pairs, 0)), as_f32(pick(pairs, 1))
    first = jax.lax.broadcasted_iota(jnp.int32, pairs.shape, 1) == 0
    y = jnp.where(first, as_i32(lo + hi)[:, None, :], as_i32(lo - hi)[:, None, :]).reshape(rows, cols)
    d *= 2
  return as_i32(as_f32(y) * jnp.float32(1 / math.sqrt(n)))


def read_words(ref, first: int) -> list:
  """The SIGN_WORDS sign words at ref[first:], as int32 scalars."""
  return [jax.lax.bitcast_convert_type(ref[first + i], jnp.int32) for i in range(SIGN_WORDS)]


@dataclasses.dataclass(frozen=True)
class AmaxConfig:
  axis: int
  transform: str | None
  rows: int
  cols: int
  num_warps: int = 4
  interpret: bool = False


def _amax_kernel(w_ref, x_ref, o_ref, *, cfg: AmaxConfig):
  """max |rotated x| float32 bits of one tile (NaN/Inf patterns above all finite ones), in all 16 slots."""
  bits = tile_bits(x_ref, cfg.axis)
  if cfg.transform is not None:
    bits = rotate_rows(bits, hadamard.KINDS[cfg.transform].n, read_words(w_ref, 0))
  top = jnp.max(jnp.max(bits & _F32_ABS, axis=1, keepdims=True), axis=0, keepdims=True)  # [1, 1]
  o_ref[...] = jnp.broadcast_to(top, (1, 16))


@functools.partial(jax.jit, static_argnames=("cfg",))
def _amax_call(x: jax.Array, words: jax.Array, cfg: AmaxConfig) -> jax.Array:
  length, other = x.shape if cfg.axis == 0 else x.shape[::-1]
  grid = (length // cfg.rows, other // cfg.cols)
  block = (cfg.rows, cfg.cols) if cfg.axis == 0 else (cfg.cols, cfg.rows)
  tops = pl.pallas_call(
      functools.partial(_amax_kernel, cfg=cfg),
      out_shape=jax.ShapeDtypeStruct((grid[0], grid[1] * 16), jnp.int32),
      grid=grid,
      in_specs=[pl.BlockSpec((SIGN_WORDS,), lambda i, j: (0,)),
                pl.BlockSpec(block, (lambda i, j: (i, j)) if cfg.axis == 0 else (lambda i, j: (j, i)))],
      out_specs=pl.BlockSpec((1, 16), lambda i, j: (i, j)),
      compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
      interpret=cfg.interpret,
      name=AMAX_KERNEL_NAME,
  )(words, x)
  top = jnp.max(tops)
  return jnp.where(top >= _F32_INF, jnp.float32(jnp.nan), jax.lax.bitcast_convert_type(top, jnp.float32))


def _fit(size: int, options: tuple[int, ...], at_least: int = 1) -> int | None:
  return next((b for b in options if size % b == 0 and b >= at_least), None)


def rotated_amax(x: jax.Array, transform: str | None, key: jax.Array | None = None, *, axis: int = 0,
                 interpret: bool = False) -> jax.Array:
  """`reference._amax(hadamard(x, transform, axis=axis, key=key))` (of x itself for transform None) from one
  Pallas pass over a 2-D x: float32, NaN if anything is non-finite. Both dims must be multiples of 16."""
  if x.ndim != 2:
    raise ValueError(f"rotated_amax takes a 2-D x, got {x.shape=}")
  n = hadamard.KINDS[transform].n if transform is not None else 1
  length, other = x.shape if axis == 0 else x.shape[::-1]
  rows, cols = _fit(length, TILE_ROWS, n), _fit(other, TILE_COLS)
  if rows is None or cols is None:
    raise ValueError(f"rotated_amax needs dims that are multiples of 16 (and of the transform size along "
                     f"{axis=}): {x.shape=}, {transform=}")
  return _amax_call(x, sign_words(transform, key), AmaxConfig(axis, transform, rows, cols, interpret=interpret))
