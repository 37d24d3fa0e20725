"""Routes: the numeric recipe of one `fp4_dot`, chosen per GEMM operand (six roles), and named presets.

A linear layer runs three GEMMs, each with two operands (docs/ARCHITECTURE.md):
  fprop  Y  = X W      operands fprop_x, fprop_w      contraction K
  dgrad  dX = dY W^T   operands dgrad_dy, dgrad_w     contraction N
  wgrad  dW = X^T dY   operands wgrad_x, wgrad_dy     contraction M (tokens)
An `OperandSpec` says how one operand is quantized along its GEMM's contraction axis; a `Route` holds six
of them. Both are frozen and hashable, so a route crosses `jit` / `custom_vjp` as one static object.

Random bits: a route that needs them (`Route.needs_key`) takes one key per call; `operand_key` and
`transform_key` derive a deterministic key per operand role and per GEMM from it (the rule is public so
that references and kernels reproduce it):
  operand_key(key, role)  = jax.random.fold_in(key, ROLE_INDEX[role])   (rounding: SR, MS-EDEN)
  transform_key(key, gemm) = jax.random.fold_in(key, GEMM_INDEX[gemm])  (random Hadamard signs; the same
                                                                         key for both operands of a GEMM)
"""

from __future__ import annotations

import dataclasses

import jax

from fp4jax.formats import FORMATS
from fp4jax.hadamard import KINDS
from fp4jax.reference import EDEN_GROUP

ROUNDINGS = ("rne", "sr", "eden")
# Transform name -> its block size along the contraction axis and whether its signs are random.
TRANSFORMS = KINDS
SCALE_RULES = ("ocp", "noclip")
ROLES = ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x")
ROLE_INDEX = {role: i for i, role in enumerate(ROLES)}
# GEMM name -> (key index, its two operand roles: the "a" (rows of the result) and "b" operands).
GEMMS: dict[str, tuple[int, str, str]] = {
    "fprop": (6, "fprop_x", "fprop_w"),
    "dgrad": (7, "dgrad_dy", "dgrad_w"),
    "wgrad": (8, "wgrad_x", "wgrad_dy"),
}
GEMM_INDEX = {gemm: idx for gemm, (idx, _, _) in GEMMS.items()}


def _check_choice(what: str, value, valid) -> None:
  if value not in valid:
    raise ValueError(f"unknown {what} {value!r}; valid values: {sorted(valid, key=str)}")


@dataclasses.dataclass(frozen=True)
class OperandSpec:
  """How one GEMM operand is quantized along the GEMM's contraction axis.

  Attributes:
    fmt: a key of `fp4jax.formats.FORMATS`, or None to keep the operand in high precision.
    rounding: "rne" (round to nearest even), "sr" (stochastic) or "eden" (MS-EDEN: NVFP4 formats only,
      normally after a random Hadamard transform).
    transform: None or a key of `TRANSFORMS`, applied along the contraction axis (to both operands of the
      GEMM, so it cancels in the product).
    tile_2d: one scale per 2-D tile (32x32 MX, 16x16 NV), so both orientations share the same codes.
    scale_rule: MXFP4 block-exponent rule ("ocp" or "noclip"); None = the quantizer's default.
    clip_fraction: Hu's bounded clipping for MX 2-D tiles (e.g. 0.87), or None.
  """

  fmt: str | None
  rounding: str = "rne"
  transform: str | None = None
  tile_2d: bool = False
  scale_rule: str | None = None
  clip_fraction: float | None = None

  def __post_init__(self):
    if self.fmt is None:
      if (self.rounding, self.transform, self.tile_2d, self.scale_rule, self.clip_fraction) != (
          "rne", None, False, None, None):
        raise ValueError(f"a high-precision operand (fmt=None) takes no other options: {self}")
      return
    _check_choice("FP4 format", self.fmt, FORMATS)
    _check_choice("rounding", self.rounding, ROUNDINGS)
    if self.transform is not None:
      _check_choice("transform", self.transform, TRANSFORMS)
    if self.scale_rule is not None:
      _check_choice("scale_rule", self.scale_rule, SCALE_RULES)
    if self.rounding == "eden" and (self.fmt != "nvfp4" or self.tile_2d):
      raise ValueError(f"rounding='eden' (MS-EDEN) needs fmt='nvfp4' with 1-D blocks: {self}")
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
    return self.rounding in ("sr", "eden") or random_transform

  @property
  def blocks(self) -> dict[str, int]:
    """Divisibility this operand needs along the contraction axis: {reason: multiple}."""
    if self.fmt is None:
      return {}
    out = {f"{self.fmt} block": FORMATS[self.fmt].block}
    if self.transform is not None:
      out[f"{self.transform} transform"] = TRANSFORMS[self.transform].n
    if self.rounding == "eden":
      out["MS-EDEN group"] = EDEN_GROUP
    return out


HP = OperandSpec(None)


@dataclasses.dataclass(frozen=True)
class Route:
  """The numeric recipe of one `fp4_dot`: an `OperandSpec` per GEMM operand role (see the module doc).

  A role given as None means high precision. `requantize_saved`: the backward quantizes the *dequantized
  forward FP4* X and W (Quartet II) instead of the original high-precision ones, so only FP4 is saved.
  """

  name: str
  fprop_x: OperandSpec = HP
  fprop_w: OperandSpec = HP
  dgrad_dy: OperandSpec = HP
  dgrad_w: OperandSpec = HP
  wgrad_dy: OperandSpec = HP
  wgrad_x: OperandSpec = HP
  requantize_saved: bool = False

  def __post_init__(self):
    for role in ROLES:
      spec = getattr(self, role)
      if spec is None:
        object.__setattr__(self, role, HP)
      elif not isinstance(spec, OperandSpec):
        raise TypeError(f"Route {self.name!r}: {role} must be an OperandSpec or None, got {spec!r}")
    for gemm, (_, a, b) in GEMMS.items():
      ta, tb = getattr(self, a).transform, getattr(self, b).transform
      if ta != tb:
        raise ValueError(f"Route {self.name!r}: the {gemm} transform must be applied to both operands "
                         f"(it cancels only then): {a}.transform={ta!r}, {b}.transform={tb!r}")
    if self.requantize_saved and not all(self.spec(r).quantized for r in ROLES):
      raise ValueError(f"Route {self.name!r}: requantize_saved needs every operand quantized (the backward "
                       f"re-quantizes the saved FP4 X and W): {self}")

  def spec(self, role: str) -> OperandSpec:
    return getattr(self, role)

  @property
  def needs_key(self) -> bool:
    return any(self.spec(r).needs_key for r in ROLES)

  @property
  def high_precision(self) -> bool:
    """True if no operand is quantized (the route is a plain dot)."""
    return not any(self.spec(r).quantized for r in ROLES)


def operand_key(key: jax.Array, role: str) -> jax.Array:
  """The rounding key of one operand role (see the module docstring)."""
  return jax.random.fold_in(key, ROLE_INDEX[role])


def transform_key(key: jax.Array, gemm: str) -> jax.Array:
  """The random-Hadamard key of one GEMM, shared by both of its operands."""
  return jax.random.fold_in(key, GEMM_INDEX[gemm])


_MX = OperandSpec("mxfp4")
_MX_SR = OperandSpec("mxfp4", rounding="sr")
_MX_W = OperandSpec("mxfp4", tile_2d=True, scale_rule="noclip", clip_fraction=0.87)  # Hu's 32x32 tiles
_MX_H32 = OperandSpec("mxfp4", transform="h32")
_MX_T = OperandSpec("mxfp4", tile_2d=True)
_NV = OperandSpec("nvfp4")
_NV_W = OperandSpec("nvfp4", tile_2d=True)
_NV_SR = OperandSpec("nvfp4", rounding="sr")
_NV_TL = OperandSpec("nvfp4_tile")
_NV_TL_SR = OperandSpec("nvfp4_tile", rounding="sr")
_NV46 = OperandSpec("nvfp4_46")
_EDEN128 = OperandSpec("nvfp4", rounding="eden", transform="rht128")

_PRESETS: tuple[Route, ...] = (
    Route("bf16"),
    # Hu (MXFP4): RTN activations, 32x32 weight tiles reused by dgrad, SR on the dgrad gradient.
    Route("mxfp4", fprop_x=_MX, fprop_w=_MX_W, dgrad_dy=_MX_SR, dgrad_w=_MX_W, wgrad_dy=_MX, wgrad_x=_MX),
    # Hu's balanced recipe: as mxfp4, plus a fixed H32 on both wgrad operands (along tokens).
    Route("mxfp4_h32", fprop_x=_MX, fprop_w=_MX_W, dgrad_dy=_MX_SR, dgrad_w=_MX_W, wgrad_dy=_MX_H32,
          wgrad_x=_MX_H32),
    # All round-to-nearest MXFP4 (deterministic, biased gradients): the RTN baseline.
    Route("mxfp4_rtn", fprop_x=_MX, fprop_w=_MX_T, dgrad_dy=_MX, dgrad_w=_MX_T, wgrad_dy=_MX, wgrad_x=_MX),
    # Stochastic rounding on every backward operand, no reuse: unbiased dX and dW (test/ablation route).
    Route("mxfp4_sr", fprop_x=_MX, fprop_w=_MX, dgrad_dy=_MX_SR, dgrad_w=_MX_SR, wgrad_dy=_MX_SR,
          wgrad_x=_MX_SR),
    # NVIDIA / Transformer Engine: 16x16 weight tiles, SR gradients, RHT16 on both wgrad operands.
    Route("nvfp4", fprop_x=_NV, fprop_w=_NV_W, dgrad_dy=_NV_SR, dgrad_w=_NV_W,
          wgrad_dy=OperandSpec("nvfp4", rounding="sr", transform="rht16"),
          wgrad_x=OperandSpec("nvfp4", transform="rht16")),
    # Hu's CTA-local NVFP4: one FP32 factor per 128-row tile instead of a tensor-wide amax.
    Route("nvfp4_tile_local", fprop_x=_NV_TL, fprop_w=_NV_TL, dgrad_dy=_NV_TL_SR, dgrad_w=_NV_TL,
          wgrad_dy=_NV_TL, wgrad_x=_NV_TL),
    # NVFP4 with the 4/6 block choice in every GEMM, round to nearest (deterministic).
    Route("nvfp4_46", fprop_x=_NV46, fprop_w=_NV46, dgrad_dy=_NV46, dgrad_w=_NV46, wgrad_dy=_NV46,
          wgrad_x=_NV46),
    # Stochastic rounding on every backward NVFP4 operand, no reuse (test/ablation route).
    Route("nvfp4_sr", fprop_x=_NV, fprop_w=_NV, dgrad_dy=_NV_SR, dgrad_w=_NV_SR, wgrad_dy=_NV_SR,
          wgrad_x=_NV_SR),
    # Quartet II: 4/6 RTN forward; backward re-quantizes the saved FP4 X, W with RHT128 + MS-EDEN.
    Route("quartet2", fprop_x=_NV46, fprop_w=_NV46, dgrad_dy=_EDEN128, dgrad_w=_EDEN128,
          wgrad_dy=_EDEN128, wgrad_x=_EDEN128, requantize_saved=True),
)
PRESETS: dict[str, Route] = {r.name: r for r in _PRESETS}


def names() -> tuple[str, ...]:
  """Names of the preset routes."""
  return tuple(PRESETS)


def get(route: str | Route) -> Route:
  """A preset route by name (a Route passes through); an unknown name fails with the known ones."""
  if isinstance(route, Route):
    return route
  try:
    return PRESETS[route]
  except (KeyError, TypeError):
    raise ValueError(f"unknown route {route!r}; presets: {list(PRESETS)}") from None
