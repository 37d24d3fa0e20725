"""The formats fp4jax knows, as one table: the FP4 formats and the FP8 baseline's.

Every quantizer, kernel and GEMM backend looks a format up here instead of branching on its name.
docs/NUMERICS.md holds the formulas; `fp4jax.numerics.reference` implements them (the FP8 formats through
`fp4jax.numerics.current_scaling`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax.numpy as jnp

# E2M1 ("FP4") magnitudes by code 0..7; bit 3 of a code is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_SIGNED_VALUES = E2M1_VALUES + tuple(-v for v in E2M1_VALUES)  # by code 0..15 (code 8 is -0.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# The largest MXFP4 scale exponent: 6 * 2^125 is the largest block max float32 holds (the no-clip rule would
# give an amax above 1.5 * 2^127 the scale 2^126, whose codes then dequantize to inf).
MX_E_MAX = 125
E5M2_MAX = 57344.0

ScaleKind = Literal["e8m0", "e4m3", "none"]
OuterKind = Literal["none", "tensor", "row_tile"]
ElementKind = Literal["e2m1", "e4m3", "e5m2"]


@dataclasses.dataclass(frozen=True)
class Element:
  """How one element is stored.

  Attributes:
    dtype: the JAX dtype of its values (`QTensor.codes` holds FP8 elements as that dtype, E2M1 packed in uint8).
    max: the largest finite magnitude; quantizers saturate there.
    per_byte: elements per byte of `QTensor.codes`: 2 (E2M1 nibbles) or 1.
  """

  dtype: Any
  max: float
  per_byte: int


ELEMENTS: dict[str, Element] = {
    "e2m1": Element(jnp.float4_e2m1fn, E2M1_MAX, per_byte=2),
    "e4m3": Element(jnp.float8_e4m3fn, E4M3_MAX, per_byte=1),
    "e5m2": Element(jnp.float8_e5m2, E5M2_MAX, per_byte=1),
}


@dataclasses.dataclass(frozen=True)
class FormatSpec:
  """How one format encodes its elements and scales its blocks.

  Attributes:
    name: the key in `FORMATS`.
    block: elements that share one scale, along the quantized axis (1 for the FP8 formats: no blocks, so no
      length constraint).
    scale: block-scale encoding: "e8m0" (power of two, uint8 = E + 127), "e4m3" (`float8_e4m3fn`) or "none" (no
      block scales: the FP8 formats, scaled per tensor by `outer` alone).
    outer: the FP32 factor on top of the block scales: "none" (MX), "tensor" (one per tensor, NVFP4's global
      scale, the FP8 formats' only scale) or "row_tile" (one per tile of `tile_rows` rows, constant along the
      quantized axis: tile-local).
    scale_max: NVFP4: the largest block scale the global scale aims for (448 = E4M3 max; 256 for 4/6, so the
      1.5x larger v=4 scale still fits).
    four_over_six: per block, try target maxima 6 and 4 and keep the one with the lower squared error.
    element: the element encoding, a key of `ELEMENTS`: "e2m1" (FP4), "e4m3" or "e5m2" (FP8).
  """

  name: str
  block: int
  scale: ScaleKind
  outer: OuterKind = "none"
  scale_max: float = E4M3_MAX
  four_over_six: bool = False
  element: ElementKind = "e2m1"

  @property
  def scale_dtype(self):
    """The dtype of `QTensor.scales`, None for a format without block scales."""
    return {"e8m0": jnp.uint8, "e4m3": jnp.float8_e4m3fn}.get(self.scale)

  @property
  def block_scaled(self) -> bool:
    """True for the FP4 formats (a scale per block); False for the FP8 ones (one factor per tensor)."""
    return self.scale != "none"

  @property
  def element_spec(self) -> Element:
    return ELEMENTS[self.element]


FORMATS: dict[str, FormatSpec] = {
    "mxfp4": FormatSpec("mxfp4", block=32, scale="e8m0"),
    "nvfp4": FormatSpec("nvfp4", block=16, scale="e4m3", outer="tensor"),
    "nvfp4_46": FormatSpec("nvfp4_46", block=16, scale="e4m3", outer="tensor", scale_max=256.0,
                           four_over_six=True),
    "nvfp4_tile": FormatSpec("nvfp4_tile", block=16, scale="e4m3", outer="row_tile"),
    # Per-tensor current scaling (Transformer Engine's Float8CurrentScaling, the stock Hopper FP8 recipe): FP8
    # elements, no block scales, one FP32 decode factor per tensor (`numerics.current_scaling`).
    "fp8_e4m3": FormatSpec("fp8_e4m3", block=1, scale="none", outer="tensor", element="e4m3"),
    "fp8_e5m2": FormatSpec("fp8_e5m2", block=1, scale="none", outer="tensor", element="e5m2"),
}


def get_format(fmt: str | FormatSpec) -> FormatSpec:
  """Looks a format up by name; an unknown name fails with the list of known ones."""
  if isinstance(fmt, FormatSpec):
    return fmt
  try:
    return FORMATS[fmt]
  except KeyError:
    raise ValueError(f"unknown format {fmt!r}; known formats: {sorted(FORMATS)}") from None
