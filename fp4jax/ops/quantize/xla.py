"""The XLA implementation of quantizing an operand: the reference quantizer (after the spec's Hadamard
transform) compiled by XLA. It covers every valid spec, any rank and dtype: the end of every fallback chain."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp4jax.numerics.hadamard import hadamard
from fp4jax.numerics.qtensor import QTensor
from fp4jax.numerics.reference import quantize
from fp4jax.numerics.spec import OperandKeys, OperandSpec


def operand(x: jax.Array, spec: OperandSpec, axis: int, keys: OperandKeys) -> QTensor:
  """`quantize(hadamard(x, spec.transform, axis=axis, key=keys.transform), spec.fmt, axis=axis, ...)`."""
  if spec.transform is not None:
    x = hadamard(x.astype(jnp.float32), spec.transform, axis=axis, key=keys.transform)
  return quantize(x, spec.fmt, axis=axis, rounding=spec.rounding, key=keys.rounding, scale_rule=spec.scale_rule,
                  tile_2d=spec.tile_2d, clip_fraction=spec.clip_fraction)
