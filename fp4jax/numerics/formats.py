"""The FP4 formats fp4jax knows, as one table.

Every quantizer, kernel and GEMM backend looks a format up here instead of branching on its name.
docs/NUMERICS.md (and ../shared/docs/NUMERICS.md) hold the formulas; `fp4jax.reference` implements them.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

# E2M1 ("FP4") magnitudes by code 0..7; bit 3 of a code is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0

ScaleKind = Literal["e8m0", "e4m3"]
OuterKind = Literal["none", "tensor", "row_tile"]


@dataclasses.dataclass(frozen=True)
class FormatSpec:
  """How one FP4 format scales its blocks.

  Attributes:
    name: the key in `FORMATS`.
    block: elements that share one scale, along the quantized axis.
    scale: block-scale encoding: "e8m0" (power of two, uint8 = E + 127) or "e4m3" (`float8_e4m3fn`).
    outer: the FP32 factor on top of the block scales: "none" (MX), "tensor" (one per tensor, NVFP4's global
      scale) or "row_tile" (one per tile of `tile_rows` rows, constant along the quantized axis: tile-local).
    scale_max: the largest block scale the global scale aims for (448 = E4M3 max; 256 for 4/6, so the 1.5x
      larger v=4 scale still fits).
    four_over_six: per block, try target maxima 6 and 4 and keep the one with the lower squared error.
  """

  name: str
  block: int
  scale: ScaleKind
  outer: OuterKind = "none"
  scale_max: float = E4M3_MAX
  four_over_six: bool = False

  @property
  def scale_dtype(self):
    return jnp.uint8 if self.scale == "e8m0" else jnp.float8_e4m3fn


FORMATS: dict[str, FormatSpec] = {
    "mxfp4": FormatSpec("mxfp4", block=32, scale="e8m0"),
    "nvfp4": FormatSpec("nvfp4", block=16, scale="e4m3", outer="tensor"),
    "nvfp4_46": FormatSpec("nvfp4_46", block=16, scale="e4m3", outer="tensor", scale_max=256.0,
                           four_over_six=True),
    "nvfp4_tile": FormatSpec("nvfp4_tile", block=16, scale="e4m3", outer="row_tile"),
}


def get_format(fmt: str | FormatSpec) -> FormatSpec:
  """Looks a format up by name; an unknown name fails with the list of known ones."""
  if isinstance(fmt, FormatSpec):
    return fmt
  try:
    return FORMATS[fmt]
  except KeyError:
    raise ValueError(f"unknown FP4 format {fmt!r}; known formats: {sorted(FORMATS)}") from None
