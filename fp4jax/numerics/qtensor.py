"""QTensor: a quantized array as a pytree (codes + scales + outer factor as children, layout as static data).

FP4 formats hold packed E2M1 codes and block scales; the FP8 formats (`formats.FORMATS` "fp8_e4m3", "fp8_e5m2")
hold their float8 values as the codes, no block scales, and the per-tensor decode factor as `outer`: one type
for every operand, so quantizers, fp4_dot and the GEMM backends pass FP8 operands like FP4 ones.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax.numerics.codecs import ELEMENT_DECODERS
from fp4jax.numerics.formats import FormatSpec, get_format


def equal_fields(self, other) -> bool:
  """`==` of two pytree dataclasses of one type holding arrays (`QTensor`, `ScaledValues`, `Produced`): field by
  field, as a dataclass's, but a TypeError naming what to compare where two different arrays would meet (an
  array's `==` is elementwise: a dataclass's `==` raises NumPy's "truth value of an array is ambiguous"). The same
  object, or jax.eval_shape's (shapes and dtypes), compare. The hash stays the dataclass's, which jit never takes
  (the arrays are pytree children)."""
  if type(other) is not type(self):
    return NotImplemented
  pairs = [(getattr(self, f.name), getattr(other, f.name)) for f in dataclasses.fields(self)]
  holds_array = lambda v: any(isinstance(leaf, (jax.Array, np.ndarray)) for leaf in jax.tree.leaves(v))
  if any(a is not b and (holds_array(a) or holds_array(b)) for a, b in pairs):
    name = type(self).__name__
    raise TypeError(f"{name} == compares arrays element by element; compare them: jax.tree.all(jax.tree.map("
                    f"jnp.array_equal, a, b)) for the arrays, and the static fields ({name}'s layout)")
  return all(a is b or a == b for a, b in pairs)


class _AlongOneAxis:
  """What every quantized operand (`QTensor`, `ScaledValues`) derives from its static `fmt`, `axis`, `shape`."""

  fmt: str
  axis: int
  shape: tuple[int, ...]

  @property
  def spec(self) -> FormatSpec:
    return get_format(self.fmt)

  @property
  def kmajor_shape(self) -> tuple[int, ...]:
    """Shape of the K-major layout (the unpacked codes): the original shape with `axis` moved last."""
    s = list(self.shape)
    n = s.pop(self.axis)
    return (*s, n)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QTensor(_AlongOneAxis):
  """A tensor quantized to FP4 (or FP8) along one axis.

  Layout ("K-major"): the quantized axis is moved last, the others keep their order. For `x[M, K]` quantized
  along K the codes are `[M, K/2]`; quantized along M (the wgrad view) they are `[K, M/2]`, i.e. already the
  transposed layout the wgrad GEMM reads. `dequantize` moves the axis back.

  Children (arrays):
    codes: FP4: uint8 `[..., n // 2]`, two E2M1 codes per byte, the even element in the low nibble. FP8:
      the float8_e4m3fn / float8_e5m2 values `[..., n]` themselves, what an FP8 GEMM reads.
    scales: `[..., n // block]` block scales, uint8 E8M0 (2**(s - 127); 255 = NaN) or float8_e4m3fn. 2-D
      (tile) quantization stores each tile's scale in every row of the tile, so both orientations read the
      same 1-D layout. None for the FP8 formats (no block scales).
    outer: float32 decode factor on top of the scales, or None (= 1): shape `()` for one factor per tensor
      (NVFP4 global: 1 / S_enc; FP8: 1 / S, its only scale), or `codes.shape[:-1]` for one per row (tile-local
      NVFP4: constant within a row tile). Dequantized value = element(code) * scale * outer.
  Static:
    fmt: format name (a key of `fp4jax.numerics.formats.FORMATS`).
    axis: the quantized axis of the original array (non-negative).
    shape: the original array's shape.
  """

  codes: jax.Array
  scales: jax.Array | None
  outer: jax.Array | None
  fmt: str = dataclasses.field(metadata=dict(static=True))
  axis: int = dataclasses.field(metadata=dict(static=True))
  shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

  __eq__ = equal_fields

  @property
  def nbytes(self) -> int:
    """Bytes held on device (codes + scales + outer)."""
    leaves = (a for a in (self.codes, self.scales, self.outer) if a is not None)
    return sum(int(a.size) * a.dtype.itemsize for a in leaves)

  def check_codes(self, what: str) -> None:
    """A ValueError starting with `what` unless the codes have the shape that `shape`, `axis` and `fmt` give. A
    QTensor that `jax.vmap` returns holds batched codes under one example's static shape: decoded as if
    unbatched, its values came out in a wrong layout."""
    kmajor = self.kmajor_shape
    want = (*kmajor[:-1], kmajor[-1] // self.spec.element_spec.per_byte)
    if tuple(self.codes.shape) != want:
      raise ValueError(f"{what} a QTensor whose codes {tuple(self.codes.shape)} do not fit its shape {self.shape} "
                       f"(axis={self.axis}, fmt={self.fmt!r}: codes {want}); a QTensor that jax.vmap returns keeps "
                       f"one example's shape: decode it under a vmap too, jax.vmap(dequantize)(q)")

  def unpacked_codes(self) -> jax.Array:
    """uint8 codes, one per element, in the K-major layout `kmajor_shape` (FP8: the values' bytes)."""
    if self.spec.element_spec.per_byte == 1:
      return jax.lax.bitcast_convert_type(self.codes, jnp.uint8)
    lo = self.codes & jnp.uint8(0x0F)
    hi = self.codes >> jnp.uint8(4)
    return jnp.stack([lo, hi], axis=-1).reshape(self.kmajor_shape)

  def element_values(self) -> jax.Array:
    """float32 values of the elements (unscaled), K-major `kmajor_shape`, decoded from the codes' bits."""
    return ELEMENT_DECODERS[self.spec.element](self.unpacked_codes())

  def as_float4(self) -> jax.Array:
    """FP4 formats: the codes as a `jnp.float4_e2m1fn` array in the K-major layout (values unscaled); no copy.
    An FP8 QTensor's codes are already its float8 values: a ValueError says so (they are no float4 pairs)."""
    if self.spec.element != "e2m1":
      raise ValueError(f"as_float4 views packed E2M1 codes; a {self.fmt!r} QTensor holds its "
                       f"{self.codes.dtype} values as .codes itself")
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScaledValues(_AlongOneAxis):
  """A 2-D operand quantized along one axis, held as the bf16 values a GEMM on bf16 tensor cores reads:
  element(code) * block scale per element, the outer factor kept apart (`numerics.values`).

  Exact for the NVFP4 formats: an E2M1 value (2 significant bits) times an E4M3 scale (4) has at most 6
  significant bits and a magnitude in [2^-10, 6 * 448], inside bf16's 8 bits and range. Hopper has no FP4
  tensor cores, so its NVFP4 GEMM (`ops.gemm.fp8`) multiplies these values; a quantizer that writes them
  directly saves the pass that would decode packed codes into them.

  Children (arrays):
    values: bfloat16 [R, C]: the array's own layout (`transposed` False) or its transpose, NaN over a
      non-finite block (as `dequantize` gives).
    outer: float32 decode factor, as `QTensor.outer` (scalar, or one per K-major row).
  Static:
    fmt, axis, shape: as `QTensor` (the format, the quantized axis of the original 2-D array, its shape).
    transposed: whether `values` holds the original array transposed; a view quantized along axis 0 and
      stored K-major is. A dual-view kernel stores its column view untransposed, in x's layout (a GEMM
      contracts either axis of a bf16 operand at the same speed), so it never turns a tile.
  Dequantized value = values * outer, each product rounded once (`values.dequantize`): the QTensor's bits.
  """

  values: jax.Array
  outer: jax.Array | None
  fmt: str = dataclasses.field(metadata=dict(static=True))
  axis: int = dataclasses.field(metadata=dict(static=True))
  shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  transposed: bool = dataclasses.field(default=False, metadata=dict(static=True))

  __eq__ = equal_fields

  @property
  def contracting_dim(self) -> int:
    """The dim of `values` that runs along the quantized axis: the one a GEMM contracts."""
    return 1 - self.axis if self.transposed else self.axis

  def kmajor(self) -> jax.Array:
    """`values` in the K-major layout (a transpose where they are not, which XLA may fold into a GEMM)."""
    return self.values if self.contracting_dim == 1 else self.values.T


Quantized = QTensor | ScaledValues  # an FP4 operand in either form
