"""The vocabulary of an FP4 operand recipe, defined once: roundings, scale rules, transforms, `OperandSpec`
(and `OperandKeys`, the random keys one operand's quantization takes).

The reference quantizer, the Pallas kernels, routes and fp4_dot all read these tables instead of repeating
their own lists. docs/NUMERICS.md states what each term computes.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax.numerics.formats import FORMATS
from fp4jax.numerics.hadamard import KINDS


@dataclasses.dataclass(frozen=True)
class Rounding:
  """How one rounding mode behaves.

  Attributes:
    random: it draws random bits, so quantizing needs a key.
    group: elements along the quantized axis that share one correction (MS-EDEN: 128), else 1.
    formats: the formats it applies to (None: every format).
    tile_2d: whether it works on 2-D tiles.
  """

  random: bool
  group: int = 1
  formats: tuple[str, ...] | None = None
  tile_2d: bool = True


ROUNDINGS: dict[str, Rounding] = {
    "rne": Rounding(random=False),  # round to nearest, ties to even
    "sr": Rounding(random=True),  # stochastic: up with probability (x - lo) / (hi - lo)
    # MS-EDEN (Quartet II): RTN codes, scales corrected per 128-element group and rounded stochastically.
    "eden": Rounding(random=True, group=128, formats=("nvfp4",), tile_2d=False),
}
EDEN_GROUP = ROUNDINGS["eden"].group

# MXFP4 block-exponent rules: "ocp" (E = floor(log2 amax) - 2: the block max may clip above 6) and "noclip"
# (the smallest E with amax / 2^E <= 6: needed for unbiased SR).
SCALE_RULES = ("ocp", "noclip")

# Hadamard transforms by name: block size along the contraction axis, fixed or random signs.
TRANSFORMS = KINDS


def default_scale_rule(rounding: str, tile_2d: bool) -> str:
  """The MXFP4 scale rule used when none is given: "noclip" for SR and for 2-D tiles, else "ocp"."""
  return "noclip" if rounding == "sr" or tile_2d else "ocp"


def check_choice(what: str, value, valid) -> None:
  """Raises a ValueError naming `value` and the valid ones when `value` is not in `valid`."""
  if value not in valid:
    raise ValueError(f"unknown {what} {value!r}; valid values: {sorted(valid, key=str)}")


def check_clip_fraction_type(value, prefix: str = "") -> None:
  """Raises a TypeError (message starting with `prefix`) unless `value` is None or a number (a bool is none):
  an OperandSpec's and quantize's clip_fraction."""
  if value is not None and (not isinstance(value, (int, float, np.floating)) or isinstance(value, bool)):
    raise TypeError(f"{prefix}clip_fraction takes a number in (0, 1] or None, got {value!r}")


def check_x64(dtype: np.dtype, what: str) -> None:
  """A ValueError starting with `what` if JAX would hold `dtype` as another one: float64 (or int64) without
  jax_enable_x64, which JAX silently truncates to 32 bits."""
  if jax.dtypes.canonicalize_dtype(dtype) != dtype:
    raise ValueError(f"{what}{dtype} needs jax_enable_x64 (JAX would truncate it to "
                     f"{jax.dtypes.canonicalize_dtype(dtype)})")


def float_dtype(value, what: str) -> np.dtype:
  """`value` as a NumPy dtype if it is a floating-point one that JAX holds as itself (`check_x64`); else a
  ValueError starting with `what`, also for a name NumPy does not know ("fp32")."""
  try:
    dtype = np.dtype(jnp.dtype(value))
  except TypeError:
    raise ValueError(f"{what} takes a floating-point dtype, got {value!r}") from None
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"{what} takes a floating-point dtype, got {dtype}")
  check_x64(dtype, what)
  return dtype


@dataclasses.dataclass(frozen=True)
class OperandSpec:
  """How one GEMM operand is quantized along the GEMM's contraction axis.

  Attributes:
    fmt: a key of `FORMATS`, or None to keep the operand in high precision. A format without block scales (FP8,
      one factor per tensor) takes rounding "rne" and no 2-D tiles.
    rounding: a key of `ROUNDINGS` ("rne", "sr", or "eden": MS-EDEN, NVFP4 1-D blocks only, normally after a
      random Hadamard transform).
    transform: None or a key of `TRANSFORMS`, applied along the contraction axis (to both operands of the
      GEMM, so it cancels in the product).
    tile_2d: one scale per 2-D tile (32x32 MX, 16x16 NV), so both orientations share the same codes.
    scale_rule: MXFP4 block-exponent rule (a key of `SCALE_RULES`); None = `default_scale_rule`.
    clip_fraction: Hu's bounded clipping for MX (e.g. 0.87), or None.
  """

  fmt: str | None
  rounding: str = "rne"
  transform: str | None = None
  tile_2d: bool = False
  scale_rule: str | None = None
  clip_fraction: float | None = None

  def __post_init__(self):
    if not isinstance(self.tile_2d, bool):  # a truthy string would silently mean 2-D tiles
      raise TypeError(f"tile_2d takes True or False, got {self.tile_2d!r}")
    check_clip_fraction_type(self.clip_fraction)
    for option in ("fmt", "rounding", "transform", "scale_rule"):
      value = getattr(self, option)
      if value is not None and not isinstance(value, str):
        raise TypeError(f"{option} takes a name (str), got {value!r}")
    if self.fmt is None:
      if (self.rounding, self.transform, self.tile_2d, self.scale_rule, self.clip_fraction) != (
          "rne", None, False, None, None):
        raise ValueError(f"a high-precision operand (fmt=None) takes no other options: {self}")
      return
    check_choice("format", self.fmt, FORMATS)
    check_choice("rounding", self.rounding, ROUNDINGS)
    if self.transform is not None:
      check_choice("transform", self.transform, TRANSFORMS)
    if self.scale_rule is not None:
      check_choice("scale_rule", self.scale_rule, SCALE_RULES)
    if not FORMATS[self.fmt].block_scaled and (self.rounding != "rne" or self.tile_2d):
      raise ValueError(f"fmt={self.fmt!r} scales per tensor: it takes rounding='rne' and no 2-D tiles: {self}")
    rounding = ROUNDINGS[self.rounding]
    if (rounding.formats is not None and self.fmt not in rounding.formats) or (
        self.tile_2d and not rounding.tile_2d):
      raise ValueError(f"rounding={self.rounding!r} needs fmt in {rounding.formats} with 1-D blocks: {self}")
    mx_only = {"scale_rule": self.scale_rule, "clip_fraction": self.clip_fraction}
    for option, value in mx_only.items():
      if value is not None and FORMATS[self.fmt].scale != "e8m0":
        raise ValueError(f"{option}={value!r} applies to MX formats only, got fmt={self.fmt!r}")
    if self.clip_fraction is not None and not 0.0 < self.clip_fraction <= 1.0:
      raise ValueError(f"{self.clip_fraction=} must lie in (0, 1]")

  @property
  def quantized(self) -> bool:
    return self.fmt is not None

  @property
  def needs_key(self) -> bool:
    """True if quantizing this operand draws random bits (SR, MS-EDEN, random Hadamard signs)."""
    random_transform = self.transform is not None and TRANSFORMS[self.transform].random_signs
    return self.quantized and (ROUNDINGS[self.rounding].random or random_transform)

  @property
  def mx_scale_rule(self) -> str | None:
    """The MXFP4 scale rule in effect (`default_scale_rule` when none is given); None for other formats."""
    if self.fmt is None or FORMATS[self.fmt].scale != "e8m0":
      return None
    return self.scale_rule or default_scale_rule(self.rounding, self.tile_2d)

  @property
  def blocks(self) -> dict[str, int]:
    """Divisibility this operand needs along the contraction axis: {reason: multiple}."""
    if self.fmt is None:
      return {}
    out = {f"{self.fmt} block": FORMATS[self.fmt].block}
    if self.transform is not None:
      out[f"{self.transform} transform"] = TRANSFORMS[self.transform].n
    if ROUNDINGS[self.rounding].group > 1:
      out[f"{self.rounding} group"] = ROUNDINGS[self.rounding].group
    return out


HP = OperandSpec(None)


class OperandKeys(NamedTuple):
  """The random keys of quantizing one operand: `rounding` for its SR / MS-EDEN draws, `transform` for its
  random Hadamard signs (shared by both operands of a GEMM). None where the spec draws nothing."""

  rounding: jax.Array | None = None
  transform: jax.Array | None = None
