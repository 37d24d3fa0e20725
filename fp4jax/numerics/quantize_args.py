"""The arguments of `reference.quantize`, checked and completed into one static `Cfg`: every mistake a caller can
make (a wrong type, an axis out of range, a length that is no whole number of blocks, a rounding that needs a
key or another format) is a TypeError or ValueError naming it, before any array work."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax.numerics import prng
from fp4jax.numerics.formats import FormatSpec
from fp4jax.numerics.ints import is_int
from fp4jax.numerics.spec import EDEN_GROUP, ROUNDINGS, SCALE_RULES, check_clip_fraction_type, default_scale_rule


@dataclasses.dataclass(frozen=True)
class Cfg:
  """The static options of one quantize call, after validation and defaults."""
  spec: FormatSpec
  axis: int  # non-negative, in the original array
  rounding: str
  scale_rule: str | None
  tile_2d: bool
  clip_fraction: float | None
  tile_rows: int


def check(x, spec: FormatSpec, axis, rounding, key, scale_rule, tile_2d, clip_fraction, tile_rows,
           tensor_amax) -> Cfg:
  """Validates a quantize call and fills in defaults."""
  if not isinstance(x, (jax.Array, np.ndarray)):
    raise TypeError(f"quantize takes an array, got a {type(x).__name__} (wrap it in jnp.asarray)")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"quantize needs a floating-point input, got {x.dtype=}")
  if not is_int(axis):
    raise TypeError(f"quantize's axis must be an int, got {axis!r}")
  if rounding not in ROUNDINGS:
    raise ValueError(f"unknown {rounding=}; valid roundings: {tuple(ROUNDINGS)}")
  if not -x.ndim <= axis < x.ndim:
    raise ValueError(f"{axis=} is out of range for an input of {x.shape=}")
  if not isinstance(tile_2d, (bool, np.bool_)):  # a truthy string would silently mean 2-D tiles
    raise TypeError(f"quantize's tile_2d takes True or False, got {tile_2d!r}")
  if tensor_amax is not None and np.size(tensor_amax) != 1:
    raise ValueError(f"tensor_amax is one value (the tensor's max |x|), got shape {np.shape(tensor_amax)}")
  axis %= x.ndim
  n, block = x.shape[axis], spec.block
  if n % block:
    raise ValueError(f"quantized axis length {n=} (x.shape={x.shape}, {axis=}) must be a multiple of the "
                     f"{spec.name} {block=}")
  if ROUNDINGS[rounding].random:
    prng.check_key(key, f"quantize's {rounding=}")
  elif key is not None:  # unread by this rounding; a malformed one is still a caller's mistake, said now
    prng.check_key(key, f"quantize's key= (unused by {rounding=})")
  if rounding == "eden":
    if spec.name != "nvfp4":
      raise ValueError(f"rounding='eden' (MS-EDEN) needs fmt='nvfp4', got fmt={spec.name!r}")
    if tile_2d:
      raise ValueError("rounding='eden' works on 1-D blocks only; tile_2d=True is not supported")
    if n % EDEN_GROUP:
      raise ValueError(f"rounding='eden' corrects scales per {EDEN_GROUP}-element group: {n=} must be a "
                       f"multiple of {EDEN_GROUP}")
  if tile_2d:
    if x.ndim != 2:
      raise ValueError(f"tile_2d needs a 2-D input, got {x.shape=}")
    m = x.shape[1 - axis]
    if m % block:
      raise ValueError(f"tile_2d: the other axis {m=} (x.shape={x.shape}) must be a multiple of the "
                       f"{block}x{block} tile")
  if spec.scale == "e8m0":
    if scale_rule is None:
      scale_rule = default_scale_rule(rounding, tile_2d)
    if scale_rule not in SCALE_RULES:
      raise ValueError(f"unknown {scale_rule=}; valid rules: {SCALE_RULES}")
    if tensor_amax is not None:
      raise ValueError(f"tensor_amax applies to formats with a tensor scale, not fmt={spec.name!r}")
  else:
    if scale_rule is not None or clip_fraction is not None:
      raise ValueError(f"{scale_rule=} and {clip_fraction=} apply to mxfp4 only, not fmt={spec.name!r}")
    if tensor_amax is not None and spec.outer != "tensor":
      raise ValueError(f"tensor_amax applies to formats with a tensor scale, not fmt={spec.name!r}")
  check_clip_fraction_type(clip_fraction, "quantize's ")
  if clip_fraction is not None and not 0 < clip_fraction <= 1:
    raise ValueError(f"{clip_fraction=} must lie in (0, 1]")
  if not is_int(tile_rows):  # 2.5 or True would silently mean 2 or 1 rows
    raise TypeError(f"quantize's tile_rows takes an int, got {tile_rows!r}")
  if tile_rows < 1:
    raise ValueError(f"{tile_rows=} must be positive")
  return Cfg(spec, axis, rounding, scale_rule, bool(tile_2d), clip_fraction, int(tile_rows))


def amax_value(tensor_amax) -> jax.Array:
  """A passed `tensor_amax` as the float32 scalar the quantizers scale with: NaN unless it is a finite number
  >= 0, so that an infinite or negative amax (a traced value: it cannot be refused here) makes its tensor NaN,
  as a non-finite element of x does, instead of scaling it by 0 or a negative factor."""
  amax = jnp.asarray(tensor_amax, jnp.float32).reshape(())
  return jnp.where(jnp.isfinite(amax) & (amax >= 0), amax, jnp.nan)
