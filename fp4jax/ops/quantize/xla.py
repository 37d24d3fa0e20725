"""The XLA implementation of quantizing an operand: the reference quantizer (after the spec's Hadamard
transform) compiled by XLA. It covers every valid spec, any rank and dtype: the end of every fallback chain.

Both views of an array (`views`) come from one quantization only for the FP8 formats, scaled per tensor: their
column view is the row view transposed. Every other recipe quantizes each view on its own (`operand`).
"""

from __future__ import annotations

import jax

from fp4jax.numerics import current_scaling, ieee
from fp4jax.numerics.formats import FORMATS
from fp4jax.numerics.hadamard import hadamard
from fp4jax.numerics.qtensor import QTensor
from fp4jax.numerics.reference import quantize
from fp4jax.numerics.spec import OperandKeys, OperandSpec


def operand(x: jax.Array, spec: OperandSpec, axis: int, keys: OperandKeys) -> QTensor:
  """`quantize(hadamard(x, spec.transform, axis=axis, key=keys.transform), spec.fmt, axis=axis, ...)`."""
  if spec.transform is not None:
    x = hadamard(ieee.to_float32(x), spec.transform, axis=axis, key=keys.transform)
  return quantize(x, spec.fmt, axis=axis, rounding=spec.rounding, key=keys.rounding, scale_rule=spec.scale_rule,
                  tile_2d=spec.tile_2d, clip_fraction=spec.clip_fraction)


def views(x: jax.Array, row: OperandSpec, col: OperandSpec, row_keys: OperandKeys,
          col_keys: OperandKeys, forms: tuple[str, str] | None = None) -> tuple[QTensor, QTensor]:
  """(row view along axis 1, column view along axis 0) of a 2-D x from ONE quantization, where one recipe of a
  per-tensor (FP8) format serves both: no blocks and no transform, so the column view holds the row view's values
  transposed (`current_scaling.other_view`), bit for bit `operand(x, col, 0, col_keys)`. Raises
  NotImplementedError for any other pair (the API then quantizes each view on its own). `forms` is not read:
  the API decodes values from these codes."""
  del col_keys, forms  # round to nearest: no random bits
  if row != col or row.transform is not None or FORMATS[row.fmt].block_scaled or x.ndim != 2:
    raise NotImplementedError(f"no single-pass views for {row} | {col}")
  q = operand(x, row, 1, row_keys)
  return q, current_scaling.other_view(q)
