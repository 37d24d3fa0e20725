"""Routes: the numeric recipe of one `fp4_dot`, chosen per GEMM operand (six roles), and named presets.

A linear layer runs three GEMMs, each with two operands (docs/ARCHITECTURE.md):
  fprop  Y  = X W      operands fprop_x, fprop_w      contraction K
  dgrad  dX = dY W^T   operands dgrad_dy, dgrad_w     contraction N
  wgrad  dW = X^T dY   operands wgrad_x, wgrad_dy     contraction M (tokens)
An `OperandSpec` (`fp4jax.numerics.spec`) says how one operand is quantized along its GEMM's contraction axis;
a `Route` holds six of them. Both are frozen and hashable, so a route crosses `jit` / `custom_vjp` as one
static object.

Random bits: a route that needs them (`Route.needs_key`) takes one key per call; `operand_key` and
`transform_key` derive a deterministic key per operand role and per GEMM from it (the rule is public so
that references and kernels reproduce it; `prng.fold_in` is fp4jax's cheap counterpart of
`jax.random.fold_in`, see `fp4jax.numerics.prng`):
  operand_key(key, role)  = prng.fold_in(key, ROLE_INDEX[role])   (rounding: SR, MS-EDEN)
  transform_key(key, gemm) = prng.fold_in(key, GEMM_INDEX[gemm])  (random Hadamard signs; the same key for
                                                                   both operands of a GEMM)
"""

from __future__ import annotations

import dataclasses
import types
from typing import Mapping

import jax
import jax.numpy as jnp

from fp4jax.numerics import prng
from fp4jax.numerics.spec import HP, TRANSFORMS, OperandKeys, OperandSpec

ROLES = ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x")
ROLE_INDEX = {role: i for i, role in enumerate(ROLES)}
# GEMM name -> (key index, its two operand roles: the "a" (rows of the result) and "b" operands).
GEMMS: dict[str, tuple[int, str, str]] = {
    "fprop": (6, "fprop_x", "fprop_w"),
    "dgrad": (7, "dgrad_dy", "dgrad_w"),
    "wgrad": (8, "wgrad_x", "wgrad_dy"),
}
GEMM_INDEX = {gemm: idx for gemm, (idx, _, _) in GEMMS.items()}


@dataclasses.dataclass(frozen=True)
class Route:
  """The numeric recipe of one `fp4_dot`: an `OperandSpec` per GEMM operand role (see the module doc).

  A role given as None means high precision. `requantize_saved`: the backward quantizes the *dequantized
  forward FP4* X and W (Quartet II) instead of the original high-precision ones, so only FP4 is saved; it needs
  every operand quantized and no fprop transform (whose dequantized operands are still rotated).
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
    if not isinstance(self.name, str) or not self.name:
      raise TypeError(f"a Route's name is a non-empty str (it keys jit caches and logs), got {self.name!r}")
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
    if not isinstance(self.requantize_saved, bool):  # a truthy string would silently turn it on
      raise TypeError(f"Route {self.name!r}: requantize_saved takes True or False, got {self.requantize_saved!r}")
    if self.requantize_saved and not all(self.spec(r).quantized for r in ROLES):
      raise ValueError(f"Route {self.name!r}: requantize_saved needs every operand quantized (the backward "
                       f"re-quantizes the saved FP4 X and W): {self}")
    if self.requantize_saved and self.fprop_x.transform is not None:
      raise ValueError(f"Route {self.name!r}: requantize_saved re-quantizes the dequantized fprop X and W, which "
                       f"the fprop transform {self.fprop_x.transform!r} leaves rotated along K: the backward would "
                       f"multiply rotated operands (wrong gradients); drop the fprop transform or requantize_saved")

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
  return prng.fold_in(key, ROLE_INDEX[role])


def transform_key(key: jax.Array, gemm: str) -> jax.Array:
  """The random-Hadamard key of one GEMM, shared by both of its operands."""
  return prng.fold_in(key, GEMM_INDEX[gemm])


def _key_indices(spec: OperandSpec, role: str) -> tuple[int | None, int | None]:
  """The fold_in indices of `role`'s rounding key and transform key under `spec` (None where not needed)."""
  rounding = ROLE_INDEX[role] if spec.rounding != "rne" else None
  random_transform = spec.transform is not None and TRANSFORMS[spec.transform].random_signs
  return rounding, GEMM_INDEX[role.split("_")[0]] if random_transform else None  # "wgrad_dy" -> "wgrad"


def operand_keys(spec: OperandSpec, key: jax.Array, role: str) -> OperandKeys:
  """The keys quantizing operand `role` under `spec` takes from the call's key: its rounding key (None for
  round-to-nearest) and its GEMM's transform key (None without random Hadamard signs)."""
  rounding, transform = _key_indices(spec, role)
  return OperandKeys(None if rounding is None else prng.fold_in(key, rounding),
                     None if transform is None else prng.fold_in(key, transform))


def role_keys(route: Route, key: jax.Array | None, roles: tuple[str, ...]) -> dict[str, OperandKeys]:
  """`operand_keys(route.spec(role), key, role)` for each of `roles`, derived in one vectorized `prng.fold_in`
  (the same bits as one call per index: it is elementwise in its data)."""
  wanted = {r: _key_indices(route.spec(r), r) for r in roles}
  indices = sorted({i for pair in wanted.values() for i in pair if i is not None})
  if not indices:
    return {r: OperandKeys(None, None) for r in roles}
  derived = prng.fold_in(key, jnp.asarray(indices, jnp.uint32))
  pick = lambda i: None if i is None else derived[indices.index(i)]
  return {r: OperandKeys(pick(rounding), pick(transform)) for r, (rounding, transform) in wanted.items()}


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
_E4M3 = OperandSpec("fp8_e4m3")  # per-tensor current scaling (`numerics.current_scaling`)
_E5M2 = OperandSpec("fp8_e5m2")

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
    # The stock Hopper FP8 baseline (Transformer Engine's Float8CurrentScaling, HYBRID): per-tensor scales from
    # each tensor's own amax, E4M3 for X and W, E5M2 for dY; one FP8 tensor serves both GEMMs that read it.
    Route("fp8", fprop_x=_E4M3, fprop_w=_E4M3, dgrad_dy=_E5M2, dgrad_w=_E4M3, wgrad_dy=_E5M2, wgrad_x=_E4M3),
)
PRESETS: Mapping[str, Route] = types.MappingProxyType({r.name: r for r in _PRESETS})  # read-only: a name means
# one route process-wide


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
    raise ValueError(f"unknown route {route!r}; routes: {list(PRESETS)}") from None
