"""MXFP4 -> FP8 re-encoding for the Hopper GEMM as one Pallas pass: `numerics.fp8.mx_to_fp8`, bit for bit.

values[r, k] = RNE_E4M3(e2m1(q) * 2^(e_b - e_row + 6)), row_scale[r] = 2^(e_row - 6) (`numerics.fp8` defines
it, NaN blocks and rows included). e_row is the largest finite block exponent of a whole row, a
reduction over all of K: it comes from the uint8 scales in a tiny XLA reduction (1 byte per 32 elements), and
the kernel streams the packed codes (0.5 byte per element) once, writing the E4M3 bytes (1 byte per element).
That is why the fused quantizer leaves this to a second pass: a tile of x cannot write its E4M3 values before
every tile of its row has been seen, and re-reading the codes costs a quarter of re-reading x.

The E4M3 bytes come from `encoding.encode_words`: integer arithmetic (`encoding.e4m3_bits`), the definition
from which the XLA encoder's lookup table is built.
Backend: Pallas on GPU through the Triton lowering (see mxfp4.py); interpret mode on CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from fp4jax.numerics import fp8 as encoding
from fp4jax.numerics.qtensor import QTensor
from fp4jax.ops.quantize.pallas import common

KERNEL_NAME = "fp4jax_mxfp4_to_fp8"
_BLOCK = 32  # MXFP4 elements per scale


@dataclasses.dataclass(frozen=True)
class Fp8Tile:
  """Per program: block_r rows x block_b scale blocks of the codes viewed as [R, K/32, 16] bytes."""

  # The default was the fastest of the tiles timed on the H200 (docs/BENCHMARKS.md).
  block_r: int = 8
  block_b: int = 16
  num_warps: int = 4
  interpret: bool = False


def _pick_tile(r: int, nb: int, tile: Fp8Tile) -> Fp8Tile:
  """`tile` shrunk to powers of two dividing [r, nb] (rows, scale blocks)."""
  block_r = next(b for b in (tile.block_r, 16, 8, 4, 2, 1) if b <= tile.block_r and r % b == 0)
  block_b = next(b for b in (tile.block_b, 8, 4, 2, 1) if b <= tile.block_b and nb % b == 0)
  return dataclasses.replace(tile, block_r=block_r, block_b=block_b)


def _kernel(codes_ref, scales_ref, erow_ref, out_ref):
  """codes [br, bb, 16] uint8, scales [br, bb] uint8, e_row [br, 1] int32 -> out [br, bb, 16] uint16."""
  out_ref[...] = encoding.encode_words(codes_ref[...], scales_ref[...], erow_ref[...])


@functools.partial(jax.jit, static_argnames=("tile",))
def _call(codes: jax.Array, scales: jax.Array, tile: Fp8Tile) -> encoding.Fp8Operand:
  r, nb = scales.shape
  e_row = encoding.row_exponent(scales)  # [R]
  br, bb = tile.block_r, tile.block_b
  words = common.pallas_call(
      _kernel,
      out_shape=jax.ShapeDtypeStruct((r, nb, 16), jnp.uint16),
      grid=(r // br, nb // bb),
      in_specs=[pl.BlockSpec((br, bb, 16), lambda i, j: (i, j, 0)),
                pl.BlockSpec((br, bb), lambda i, j: (i, j)),
                pl.BlockSpec((br, 1), lambda i, j: (i, 0))],
      out_specs=pl.BlockSpec((br, bb, 16), lambda i, j: (i, j, 0)),
      compiler_params=pltriton.CompilerParams(num_warps=tile.num_warps),
      interpret=tile.interpret,
      name=common.launch_name(KERNEL_NAME, tile, codes.shape, scales.shape),
  )(codes.reshape(r, nb, 16), scales, e_row[:, None])
  values = encoding.words_to_values(words, r, 32 * nb)  # [R, K]
  return encoding.Fp8Operand(values, encoding.row_factors(scales, e_row))


def mx_to_fp8(q: QTensor, *, tile: Fp8Tile | None = None, interpret: bool = False) -> encoding.Fp8Operand:
  """`encoding.mx_to_fp8(q)` bit for bit, as one Pallas pass over the packed codes of a 2-D MXFP4 QTensor."""
  if len(q.shape) != 2 or q.spec.scale != "e8m0" or q.spec.block != _BLOCK or q.outer is not None:
    raise ValueError(f"mx_to_fp8 needs a 2-D MXFP4 QTensor; got {q.fmt=} {q.shape=}")
  tile = dataclasses.replace(tile or Fp8Tile(), interpret=interpret)
  return _call(q.codes, q.scales, _pick_tile(*q.scales.shape, tile))
