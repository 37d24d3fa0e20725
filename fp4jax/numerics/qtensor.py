"""QTensor: an FP4-quantized array as a pytree (packed codes + scales as children, layout as static data)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fp4jax.numerics.formats import FormatSpec, get_format


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QTensor:
  """A tensor quantized to FP4 along one axis.

  Layout ("K-major"): the quantized axis is moved last, the others keep their order. For `x[M, K]` quantized
  along K the codes are `[M, K/2]`; quantized along M (the wgrad view) they are `[K, M/2]`, i.e. already the
  transposed layout the wgrad GEMM reads. `dequantize` moves the axis back.

  Children (arrays):
    codes: uint8 `[..., n // 2]`, two E2M1 codes per byte, the even element in the low nibble.
    scales: `[..., n // block]` block scales, uint8 E8M0 (2**(s - 127); 255 = NaN) or float8_e4m3fn. 2-D
      (tile) quantization stores each tile's scale in every row of the tile, so both orientations read the
      same 1-D layout.
    outer: float32 decode factor on top of the scales, or None (= 1): shape `()` for one factor per tensor
      (NVFP4 global: 1 / S_enc), or `codes.shape[:-1]` for one per row (tile-local NVFP4: constant within a
      row tile). Dequantized value = e2m1(code) * scale * outer.
  Static:
    fmt: format name (a key of `fp4jax.formats.FORMATS`).
    axis: the quantized axis of the original array (non-negative).
    shape: the original array's shape.
  """

  codes: jax.Array
  scales: jax.Array
  outer: jax.Array | None
  fmt: str = dataclasses.field(metadata=dict(static=True))
  axis: int = dataclasses.field(metadata=dict(static=True))
  shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

  @property
  def spec(self) -> FormatSpec:
    return get_format(self.fmt)

  @property
  def kmajor_shape(self) -> tuple[int, ...]:
    """Shape of the unpacked codes: the original shape with `axis` moved last."""
    s = list(self.shape)
    n = s.pop(self.axis)
    return (*s, n)

  @property
  def nbytes(self) -> int:
    """Bytes held on device (codes + scales + outer)."""
    leaves = [self.codes, self.scales] + ([] if self.outer is None else [self.outer])
    return sum(int(a.size) * a.dtype.itemsize for a in leaves)

  def unpacked_codes(self) -> jax.Array:
    """uint8 codes, one per element, in the K-major layout `kmajor_shape`."""
    lo = self.codes & jnp.uint8(0x0F)
    hi = self.codes >> jnp.uint8(4)
    return jnp.stack([lo, hi], axis=-1).reshape(self.kmajor_shape)

  def as_float4(self) -> jax.Array:
    """The codes as a `jnp.float4_e2m1fn` array in the K-major layout (values unscaled); no copy of data."""
    return jax.lax.bitcast_convert_type(self.codes, jnp.float4_e2m1fn).reshape(self.kmajor_shape)


def pack_codes(codes: jax.Array) -> jax.Array:
  """Packs uint8 codes (last axis even) two per byte, the even element in the low nibble."""
  if codes.shape[-1] % 2:
    raise ValueError(f"cannot pack an odd number of codes along the last axis: {codes.shape=}")
  pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2).astype(jnp.uint8)
  return pairs[..., 0] | (pairs[..., 1] << jnp.uint8(4))


def codes_from_float4(x: jax.Array) -> jax.Array:
  """Packed uint8 codes of a `jnp.float4_e2m1fn` array (last axis even): the inverse of `as_float4`."""
  if x.shape[-1] % 2:
    raise ValueError(f"cannot pack an odd number of float4 values along the last axis: {x.shape=}")
  return jax.lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2), jnp.uint8)
