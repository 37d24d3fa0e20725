"""Where a dual-view kernel's tile of x comes from: x itself, or the elementwise op that produces it
(`numerics.produced.Produced`), computed from tiles of that op's inputs in the kernel's own pass.

`launch_inputs(x, tile)` gives the arrays and BlockSpecs a launch reads for x, and a function that wraps the
kernel's refs of them into a tile object with `shape` ([bm/2, 2, bk/2], the pair layout of `common`) and
`bits()`: the float32 bits of x[2i + p, 2j + q] keyed (p, q), which `common.tile_elements` splits into
magnitudes and signs. Every input is read in that pair layout (two bf16 neighbours along K per uint32 word), so
one element's inputs sit in the same lane and position of their tiles:
  * "swiglu": x = h [M, F] of y [M, 2F]; the tile at column block j reads y's gate block j and up block j + F/bk.

The sigmoid the kernel computes is the one XLA:GPU compiles `jax.nn.sigmoid` (`lax.logistic`) into in JAX 0.11.2:
1 + exp(-g) by libdevice's expf, then the approximate reciprocal `rcp.approx.f32` (XLA's float32 division by
a constant numerator). Pallas would lower 1 / d to `div.full.f32`, which need not give the same bits, so the
reciprocal is inline PTX. In interpret mode (CPU) the kernel calls `jax.nn.sigmoid` itself, as XLA:CPU's
reference does. The GPU tests compare the kernel's values with XLA's for every bf16 g.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from fp4jax.numerics import ieee, produced
from fp4jax.numerics.produced import Produced
from fp4jax.ops.quantize.pallas.tiling import QuantTile


def pair_words(a: jax.Array) -> jax.Array:
  """bf16 a [R, C] as uint32 words of two neighbours along C split by row parity [R/2, 2, C/2] (free)."""
  r, c = a.shape
  return jax.lax.bitcast_convert_type(a.reshape(r // 2, 2, c // 2, 2), jnp.uint32)


def pair_bits(ref) -> dict:
  """float32 bits (int32 [h, w]) of the tile of bf16 pairs `ref` [h, 2, w], keyed (p, q): element [2i + p,
  2j + q] of the tile (the even column in a word's low half)."""
  words = [jax.lax.bitcast_convert_type(ref[:, p, :], jnp.int32) for p in range(2)]  # [h, w] each
  return {(p, 0): words[p] << 16 for p in range(2)} | {(p, 1): words[p] & -65536 for p in range(2)}


def gpu_sigmoid(g: jax.Array) -> jax.Array:
  """XLA:GPU's float32 `lax.logistic` (module docstring): rcp.approx.f32(1 + exp(-g))."""
  d = 1.0 + jnp.exp(-g)
  [r] = pltriton.elementwise_inline_asm("rcp.approx.f32 $0, $1;", args=[d], constraints="=f,f", pack=1,
                                        result_shape_dtypes=[jax.ShapeDtypeStruct(d.shape, jnp.float32)])
  return r


def _bf16_bits(v: jax.Array) -> jax.Array:
  """float32 bits of float32 v rounded to bf16 (round to nearest even), as XLA's convert gives them: read back
  by `ieee.bf16_to_f32`, since XLA:GPU drops a convert pair float32 -> bf16 -> float32, which it compiles in
  interpret mode on a GPU host."""
  return jax.lax.bitcast_convert_type(ieee.bf16_to_f32(v.astype(jnp.bfloat16)), jnp.int32)


def _f32(bits: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


@dataclasses.dataclass(frozen=True)
class _Plain:
  ref: object

  @property
  def shape(self):
    return self.ref.shape

  def bits(self) -> dict:
    return pair_bits(self.ref)


@dataclasses.dataclass(frozen=True)
class _Swiglu:
  gate: object
  up: object
  sigmoid: Callable

  @property
  def shape(self):
    return self.gate.shape

  def bits(self) -> dict:
    g, u = pair_bits(self.gate), pair_bits(self.up)
    return {pq: _bf16_bits(produced.swiglu_f32(_f32(g[pq]), _f32(u[pq]), self.sigmoid)) for pq in g}


def _plain_tile(refs) -> _Plain:
  return _Plain(refs[0])


def _swiglu_tile(refs, *, sigmoid: Callable) -> _Swiglu:
  return _Swiglu(refs[0], refs[1], sigmoid)


def launch_inputs(x: jax.Array | Produced, t: QuantTile, *, interpret: bool
                  ) -> tuple[list[tuple[jax.Array, pl.BlockSpec]], Callable[[list], object]]:
  """(the (array, BlockSpec) pairs a launch over x's [bm, bk] tiles reads, refs -> the tile object of x); the
  index maps take the grid ids (i, j) of the tile. Raises NotImplementedError for a `Produced` it cannot tile
  (module docstring), so that the caller quantizes its value."""
  h, w = t.block_m // 2, t.block_k // 2
  block = (h, 2, w)
  if not isinstance(x, Produced):
    return [(pair_words(x), pl.BlockSpec(block, lambda i, j: (i, 0, j)))], _plain_tile
  if x.kind != "swiglu":
    raise NotImplementedError(f"no kernel source for {x.kind!r}")
  (y,) = x.inputs
  if y.ndim != 2 or y.dtype != jnp.bfloat16:
    raise NotImplementedError(f"swiglu of y {y.dtype} {y.shape}: a 2-D bf16 array")
  nf = y.shape[1] // 2 // t.block_k  # column blocks per half of y (x's own: F is a multiple of bk)
  words = pair_words(y)
  sigmoid = jax.nn.sigmoid if interpret else gpu_sigmoid
  specs = [(words, pl.BlockSpec(block, lambda i, j: (i, 0, j))),
           (words, pl.BlockSpec(block, lambda i, j: (i, 0, j + nf)))]
  return specs, functools.partial(_swiglu_tile, sigmoid=sigmoid)
