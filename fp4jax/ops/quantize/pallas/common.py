"""What the Pallas quantizer kernels share: float32 bit tricks for E2M1, the bf16-pair tile layout of the
dual-view kernels, counter-based random bits, fixed-order sums and the Hadamard butterfly.

Every helper is plain jnp on int32 / float32 arrays, so it runs inside a kernel (Triton lowering on the GPU,
interpret mode on CPU) and reproduces the reference's float32 operations in the reference's order:
  * E2M1 codes from the float32 bits of |v| (`encode_rne`, `encode_sr`), equal to
    `numerics.codecs.e2m1_encode_rne` / `e2m1_encode_sr` (no float4 casts, no division);
  * block maxima as maxima of |x|'s float32 bit patterns (monotone for non-negative floats; NaN/Inf patterns
    sort above every finite one, which flags non-finite blocks without relying on float max NaN semantics);
  * `halving_sum`: `reference._tree_sum`'s order; `butterfly`: `hadamard.fwht`'s;
  * Triton tensors cannot be sliced, so pairs of rows are separated and rejoined along a size-2 axis
    (`halves`, `interleave`).

The dual-view layout (`dual_view_call`): x [M, K] read as uint32 words, each two bf16 neighbours along K (a
free bitcast of x), split by row parity; the low and high halves of a word are the two nibbles of a row-view
byte, the same half of two consecutive rows the two nibbles of a column-view byte, so packing is elementwise
and only the column view's bytes and scales are transposed in registers.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import re
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from fp4jax import platform
from fp4jax.numerics import hadamard, prng
from fp4jax.numerics.produced import Produced
from fp4jax.ops.quantize.pallas import bodies, sources
from fp4jax.ops.quantize.pallas.tiling import QuantTile

F32_ABS = 0x7FFFFFFF
F32_INF = 0x7F800000
SIGN_WORDS = 4  # uint32 words of Hadamard -1 signs a kernel reads: sizes up to 128 (rht128)


def as_f32(b: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(b, jnp.float32)


def as_i32(v: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(v, jnp.int32)


def halves(a: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(a[:, 0, :], a[:, 1, :]) of an [A, 2, B] array. Triton tensors cannot be sliced; `jnp.split` lowers to
  Triton's split (a move of the pair axis into each thread's registers), where picking by a masked sum over
  the axis compiled to cross-thread reductions (shuffles) and took 1.3-4.5 times the instructions and up to 4
  times the compile time (docs/BENCHMARKS.md, session of 2026-12-04, 15:40)."""
  lo, hi = jnp.split(a, 2, axis=1)
  return lo.reshape(a.shape[0], a.shape[2]), hi.reshape(a.shape[0], a.shape[2])


def interleave(lo: jax.Array, hi: jax.Array) -> jax.Array:
  """The [A, 2, B] array whose halves (`halves`) are lo and hi [A, B] (Triton's join, then a transpose)."""
  return jnp.transpose(jnp.stack([lo, hi], axis=-1), (0, 2, 1))


def halving_sum(a: jax.Array, blocks: tuple[int, ...], axis: int) -> jax.Array:
  """`reference._tree_sum` of float32 `a` (any shape holding `blocks`' elements) along `axis` of it viewed as
  `blocks` (a power-of-two length): a[:h] + a[h:2h], h halving to 1 (`halves`). The result keeps `axis` with
  length 1."""
  lead, trailing = math.prod(blocks[:axis]), math.prod(blocks[axis + 1:])
  b = as_i32(a)
  n = blocks[axis]
  while n > 1:
    n //= 2
    lo, hi = halves(b.reshape(lead, 2, n * trailing))
    b = as_i32(as_f32(lo) + as_f32(hi))
  return as_f32(b).reshape(blocks[:axis] + (1,) + blocks[axis + 1:])


def magnitude_and_sign(bits: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(|x| float32 bits, the E2M1 sign bit 8 or 0) of float32 bits."""
  return bits & F32_ABS, (bits >> 28) & 8


def encode_rne(mag: jax.Array, r24: jax.Array | None) -> jax.Array:
  """int32 E2M1 magnitude codes of float32 magnitudes in [0, 8), round-to-nearest-even, saturating at 6.

  [1, 8): E2M1 is a float with one mantissa bit: its grid step in mag's binade [2^e, 2^(e+1)) is 2^(e-1), the
  ulp of s = 2^(e+22). So the float32 add mag + s rounds mag to the grid, ties to even, and subtracting s again
  is exact; the result's bits 22 and up are (biased exponent, mantissa bit) = code + 252. Both steps are exact
  but for that one rounding (s is mag's exponent bits times 2^22), so a fused multiply-add formed from them
  gives the same bits. [0, 1): the grid is 0, 0.5, 1: RNE(2 * mag) by the float32 add of 2^23 (one ulp = 1
  there).
  Floating-point adds rather than integer arithmetic on the bits, since the kernels are bound by their integer
  instructions (`pack_nibbles`). tests/ops/quantize/test_quantize_common.py checks every float32 in [1, 8).
  """
  del r24
  s = as_f32(as_i32(mag) & F32_INF) * jnp.float32(2.0**22)
  big = jnp.minimum(as_i32((mag + s) - s) >> 22, 259) - 252
  small = as_i32(mag * 2.0 + 8388608.0) - 0x4B000000
  return jnp.where(mag < 1.0, small, big)


def encode_sr(mag: jax.Array, r24: jax.Array) -> jax.Array:
  """int32 E2M1 magnitude codes by stochastic rounding: up from lo iff u < (mag - lo) / (hi - lo).

  u = r24 * 2^-24 (`prng.uniform_from_bits`). On [1, 8) the fraction is the 22 mantissa bits below the kept
  one, exactly trunc * 2^-22, so the test is the integer compare r24 < 4 * trunc; on [0, 1) it is done in
  float32 on 2 * mag, exact as well. Magnitudes of 6 and above give 7 (the reference clips to 6 first).
  """
  b = jax.lax.bitcast_convert_type(mag, jnp.int32)
  big = (b >> 22) - 252 + (r24 < ((b & 0x3FFFFF) << 2)).astype(jnp.int32)
  y = mag * 2.0
  lo = (y >= 1.0).astype(jnp.float32)
  u = r24.astype(jnp.float32) * jnp.float32(2.0**-24)
  small = lo.astype(jnp.int32) + (u < y - lo).astype(jnp.int32)
  return jnp.where(mag < 1.0, small, jnp.minimum(big, 7))


ENCODERS = {"rne": encode_rne, "sr": encode_sr}


def pack_nibbles(lo: jax.Array, hi: jax.Array) -> jax.Array:
  """int32 lo | hi << 4 of codes 0..15, as lo + 16 * hi (the same bits: the fields do not overlap).

  The quantizers are bound by their integer instructions, not memory (docs/BENCHMARKS.md, "Session of
  2026-12-06, 07:06 UTC"). A GPU issues ORs and shifts on its integer ALU only, where an add or a multiply by a
  power of two can also go to the FMA pipe (IMAD), which ptxas does to balance the two. `with_sign` likewise."""
  return lo + hi * 16


def with_sign(code: jax.Array, sign: jax.Array) -> jax.Array:
  """code | sign for a magnitude code 0..7 and a sign of 0 or 8, as an add (`pack_nibbles`)."""
  return code + sign


def e2m1_magnitude(code: jax.Array) -> jax.Array:
  """float32 magnitude of int32 E2M1 magnitude codes 0..7 (0, 0.5, 1, 1.5, 2, 3, 4, 6) from exponent bits."""
  normal = as_f32((((code >> 1) + 126) << 23) | ((code & 1) << 22))  # code >= 2: (1 + m/2) * 2^(e - 1)
  return jnp.where(code >= 2, normal, code.astype(jnp.float32) * 0.5)


def tile_elements(tile) -> tuple[dict, dict, dict]:
  """(float32 bits, |bits|, sign) of a tile of x in bf16 pairs [h, 2, w] (`sources`: read from x, or computed
  from the inputs of the op that produces x), each a dict of [h, w] arrays keyed (p, q): x[2i + p, 2j + q],
  p = row parity (which load), q = column parity (which half of a uint32 word)."""
  bits = tile.bits()
  split = {pq: magnitude_and_sign(b) for pq, b in bits.items()}
  return bits, {pq: ms[0] for pq, ms in split.items()}, {pq: ms[1] for pq, ms in split.items()}


@dataclasses.dataclass(frozen=True)
class PairIndex:
  """Positions in x [m, k] (`shape`) of the tile's element sets x[2i + p, 2j + q], (p, q) in `keys`, as uint32
  [h, w]. Only random draws read them: a kernel that draws none gets no shape (`draw_shape`), so its body is
  the same for every x and traced once (`bodies`)."""

  keys: tuple
  h: int
  w: int
  shape: tuple[int, int] | None

  def __call__(self, pq) -> tuple[jax.Array, jax.Array]:
    if self.shape is None:
      raise ValueError("PairIndex: positions asked of a kernel launched without x's shape (draw_shape)")
    (p, q), (m, _) = pq, self.shape
    i, j = grid_ids((m // (2 * self.h),))  # `dual_view_call`'s grid
    rows = jax.lax.broadcasted_iota(jnp.uint32, (self.h, self.w), 0) * 2 + (i * 2 * self.h + p).astype(jnp.uint32)
    cols = jax.lax.broadcasted_iota(jnp.uint32, (self.h, self.w), 1) * 2 + (j * 2 * self.w + q).astype(jnp.uint32)
    return rows, cols


def draw_shape(x_shape: tuple[int, ...], *roundings: str) -> tuple[int, int] | None:
  """x's [m, k] for a dual-view kernel whose views round by `roundings`; None where none draws."""
  return tuple(x_shape) if "sr" in roundings else None


def random_bits(seed_ref, which: int, index, rounding: str = "sr", offset=None) -> dict:
  """int32 top 24 hash bits (`prng.hash_bits(...) >> 8`) of each element set of `index` (its position in x),
  with seed pair `which` (0: row view, 1: column view); None per set for a view rounding other than "sr"
  (nothing drawn). `offset`: a uint32 added to every counter, where x is a block of rows of a larger array
  (`ops.quantize.pallas.rows`): its first element's flat index there, so the draws are the larger array's."""
  if rounding != "sr":
    return dict.fromkeys(index.keys)
  out = {}
  for key_ in index.keys:
    rows, cols = index(key_)
    k0, k1 = seed_ref[2 * which], seed_ref[2 * which + 1]  # loaded before the counters, as they always were
    counter = rows * jnp.uint32(index.shape[1]) + cols
    r = prng.hash_bits(k0, k1, counter if offset is None else counter + offset) >> 8
    out[key_] = jax.lax.bitcast_convert_type(r, jnp.int32)
  return out


def pack_view(abs_lo, abs_hi, sign_lo, sign_hi, r24_lo, r24_hi, blocks: tuple[int, int, int], axis: int,
              block_scale: Callable, codes: Callable):
  """Packed codes [h, w] and scale bytes of one view of two element sets sharing their blocks (any format).

  abs_*: int32 |x| float32 bits [h, w] of the elements for the low and high nibbles (neighbours along the
  view's quantized axis, so in the same block); `blocks` reshapes [h, w] so that `axis` runs along a block.
  block_scale(amax bits) -> (finite, per-block multiplier, scale bytes); codes(abs bits, sign, r24,
  multiplier) -> int32 codes shaped `blocks`. Non-finite blocks get zero codes.
  """
  amax = jnp.max(jnp.maximum(abs_lo, abs_hi).reshape(blocks), axis=axis, keepdims=True)
  finite, mul, scale = block_scale(amax)
  packed = pack_nibbles(codes(abs_lo, sign_lo, r24_lo, mul), codes(abs_hi, sign_hi, r24_hi, mul))
  packed = jnp.where(finite, packed, 0)
  return packed.reshape(abs_lo.shape).astype(jnp.uint8), jnp.squeeze(scale, axis).astype(jnp.uint8)


def view_values(abs_lo, abs_hi, sign_lo, sign_hi, r24_lo, r24_hi, blocks: tuple[int, int, int], axis: int,
                block_scale: Callable, codes: Callable) -> tuple[jax.Array, jax.Array]:
  """The bf16 bits (int32 [h, w] each, in the low half) of element(code) * block scale for the two element sets
  of `pack_view` (same arguments), instead of their packed codes and scale bytes: the `ScaledValues` of a view.

  block_scale(amax bits) -> (finite, per-block multiplier, scale byte, scale value as float32); the product of
  an E2M1 magnitude and the scale is exact in float32 and has at most 8 significant bits for the formats that
  ask (NVFP4: 6), so its upper 16 bits are the bf16 value, truncation exact; the sign comes from code bit 3,
  and a non-finite block is NaN (0x7FC0), as `reference.dequantize` gives before its outer factor.
  """
  amax = jnp.max(jnp.maximum(abs_lo, abs_hi).reshape(blocks), axis=axis, keepdims=True)
  finite, mul, _, scale = block_scale(amax)

  def bf16(a, sign, r24):
    c = codes(a, sign, r24, mul)
    b = (as_i32(e2m1_magnitude(c & 7) * scale) >> 16) | ((c & 8) << 12)
    return jnp.where(finite, b, 0x7FC0).reshape(a.shape)

  return bf16(abs_lo, sign_lo, r24_lo), bf16(abs_hi, sign_hi, r24_hi)


def bf16_words(lo: jax.Array, hi: jax.Array) -> jax.Array:
  """uint32 words of two bf16 bit patterns (int32, low halves): lo in the low half, x's pair layout."""
  return jax.lax.bitcast_convert_type((lo & 0xFFFF) | (hi << 16), jnp.uint32)


ROW, COLUMN = (True, False), (False, True)  # `write` of a one-view launch
BOTH = (True, True)


def view_outputs(m: int, k: int, t: QuantTile, block: int, write: tuple[bool, bool] = BOTH,
                 values: tuple[bool, bool] = (False, False)) -> tuple[tuple, tuple]:
  """(out_shape, out_specs) of a dual-view kernel on x [M, K] with `block` elements per scale: row codes
  [M/2, 2, K/2], row scales [M/2, 2, K/block], column codes [K/2, 2, M/2], column scales [K/2, 2, M/block],
  each a free reshape of its QTensor array, tiled per program as the x tile [bm/2, 2, bk/2] dictates; only the
  views `write` (row, column) names. A view in `values` has one output instead of its two: bf16 pairs as
  uint32 words [M/2, 2, K/2] in x's own layout (`view_values`), for the row and the column view alike."""
  h, w, per = t.block_m // 2, t.block_k // 2, block // 2
  as_x = ((m // 2, 2, k // 2), (h, 2, w), lambda i, j: (i, 0, j), jnp.uint32)
  outs = [[((m // 2, 2, k // 2), (h, 2, w), lambda i, j: (i, 0, j), jnp.uint8),
           ((m // 2, 2, k // block), (h, 2, w // per), lambda i, j: (i, 0, j), jnp.uint8)],
          [((k // 2, 2, m // 2), (w, 2, h), lambda i, j: (j, 0, i), jnp.uint8),
           ((k // 2, 2, m // block), (w, 2, h // per), lambda i, j: (j, 0, i), jnp.uint8)]]
  outs = [o for v in range(2) if write[v] for o in ([as_x] if values[v] else outs[v])]
  return (tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, _, _, dtype in outs),
          tuple(pl.BlockSpec(b, index) for _, b, index, _ in outs))


def view_arrays(rc, rs, cc, cs, m: int, k: int, block: int, values: tuple[bool, bool] = (False, False)):
  """`view_outputs`' arrays reshaped to the QTensor layouts (free); None stays None (a view not written). A
  view in `values` comes as (bf16 values [M, K] in x's layout, None)."""
  shapes = ((m, k // 2), (m, k // block), (k, m // 2), (k, m // block))

  def shaped(i, a):
    if a is None:
      return None
    if values[i // 2]:  # the view's values: [M/2, 2, K/2] words -> [M/2, 2, K/2, 2] bf16 -> [M, K]
      return jax.lax.bitcast_convert_type(a, jnp.bfloat16).reshape(m, k)
    return a.reshape(shapes[i])

  return tuple(shaped(i, a) for i, a in enumerate((rc, rs, cc, cs)))


def _describe(obj) -> str:
  """A deterministic text of a kernel's static part: a function by its qualified name, a partial by its function
  and arguments, tuples and lists item by item (configs are frozen dataclasses, whose repr is their fields),
  anything else by repr. No memory address: the same launch gets the same name in every process."""
  if isinstance(obj, functools.partial):
    args = [_describe(a) for a in obj.args] + [f"{k}={_describe(v)}" for k, v in sorted(obj.keywords.items())]
    return f"{_describe(obj.func)}({', '.join(args)})"
  if isinstance(obj, (tuple, list)):
    return f"({', '.join(map(_describe, obj))})"
  if callable(obj) and hasattr(obj, "__qualname__"):
    return f"{obj.__module__}.{obj.__qualname__}"
  return repr(obj)


def launch_name(base: str, *static) -> str:
  """`base` and a digest of `static` (what fixes a launch's kernel besides its code: the kernel function with its
  configuration, shapes, tiles): one name per launch configuration, the same in every process. XLA's kernel file
  keeps kernels by name, so `fp4jax.compiling` can hand a program kernels compiled alone only when distinct
  kernels have distinct names. The digest ends in a letter: a name ending in digits would read as a numbered
  variant of another to XLA's name uniquer."""
  return f"{base}_{hashlib.sha256(_describe(static).encode()).hexdigest()[:12]}k"


_LAUNCH_DIGEST = re.compile(r"_[0-9a-f]{12}k(?![0-9a-z_])")


def without_launch_digests(text: str) -> str:
  """`text` (Triton IR, a lowered module) with the digest of every `launch_name` taken out: kernels compared by
  their code, whatever launch they were named for."""
  return _LAUNCH_DIGEST.sub("", text)


def grid_ids(lead: tuple[int, ...], pid=None) -> tuple:
  """The ids of the program `pid` (in a kernel: `pl.program_id(0)`) of a one-axis launch (`pallas_call`) on a
  grid whose extents but the last are `lead`, the first axis fastest, as a launch on that grid itself runs its
  programs. The last extent is not needed (nor written into the code), so `eden`'s and `amax`'s canonical
  launches, whose grids vary with the operand's shape along their last axis only, stay the same code (and the
  same traced body, `bodies`) for every shape."""
  rest = pl.program_id(0) if pid is None else pid
  ids = []
  for size in lead:
    ids.append(jax.lax.rem(rest, jnp.int32(size)))  # program ids are >= 0: C's remainder and quotient suffice
    rest = jax.lax.div(rest, jnp.int32(size))
  return (*ids, rest)


def pallas_call(kernel: Callable, *, grid: tuple[int, ...], in_specs, out_specs, **kwargs):
  """`pl.pallas_call` on `grid`, launched as one axis of prod(grid) programs in the order a launch on `grid`
  runs them (every fp4jax kernel launches so): the BlockSpecs' index maps take `grid`'s ids as always, and a
  kernel reads its own from `grid_ids(grid[:-1])`. The kernel body is traced once per configuration (`bodies`).

  Why: XLA's kernel file (`fp4jax.compiling`) records a launch's grid as its block count, so a kernel taken from
  it runs on one axis: one launched on [6, 8] ran on [48, 1, 1] (wrong outputs, writes past them:
  docs/BENCHMARKS.md, "H100 call of 2026-12-05"). On one axis, the grid XLA records is the grid it launches."""
  def on_one_axis(spec):
    if isinstance(spec, (list, tuple)):
      return type(spec)(map(on_one_axis, spec))
    return dataclasses.replace(spec, index_map=lambda pid, f=spec.index_map: f(*grid_ids(grid[:-1], pid)))

  out_shape = kwargs.pop("out_shape")
  launch = lambda out_shape, kernel=kernel: pl.pallas_call(
      kernel, grid=(math.prod(grid),), in_specs=on_one_axis(in_specs), out_specs=on_one_axis(out_specs),
      out_shape=out_shape, **kwargs)

  def call(*args):
    """The launch, its outputs varying over every mesh axis an input varies over (inside `jax.shard_map`, whose
    type check needs each output's; the inputs are made to vary alike): the kernel maps tiles to tiles. In
    interpret mode there a NotImplementedError (the next implementation, XLA's, gives the same bits): JAX 0.11.2
    runs the kernel body on the varying inputs with replicated program ids, which its type check refuses.
    In interpret mode the inputs pass an optimization barrier: a launch reads its inputs' stored bits, but a
    kernel body compiled with the program around it lets XLA:GPU drop a float32 -> bf16 -> float32 convert
    pair across the boundary (`ieee.bf16_to_f32`), and a bf16 x made in the program reached it unrounded."""
    if kwargs.get("interpret"):
      args = jax.lax.optimization_barrier(args)
    args = platform.vary_alike(*args)
    varying = frozenset().union(*(jax.typeof(a).manual_axis_type.varying for a in args))
    if not varying:  # the body traced once per configuration
      key = bodies.body_key(kernel, in_specs, out_specs, args, out_shape, kwargs)
      return bodies.launch(lambda k: launch(out_shape, k), kernel, key, *args)
    if kwargs.get("interpret"):
      raise NotImplementedError("Pallas interpret mode inside jax.shard_map's manual axes")
    mat = jax.sharding.ManualAxisType(varying=varying)
    typed = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=mat), out_shape)
    return launch(typed)(*args)

  return call


def _dual_view_body(*refs, kernel: Callable, tile_of: Callable, n_par: int, n_in: int, slots: tuple[bool, ...]):
  """`dual_view_call`'s kernel (a partial of it keys its body, `bodies`): `kernel` on the parameters, x's tile
  and the four output slots (None for a view not written)."""
  outs = iter(refs[n_in:])
  kernel(*refs[:n_par], tile_of(refs[n_par:n_in]), *[next(outs) if slots[i] else None for i in range(4)])


def dual_view_call(kernel: Callable, x: jax.Array, t: QuantTile, block: int, params: list, *, interpret: bool,
                   name: str, write: tuple[bool, bool] = BOTH, values: tuple[bool, bool] = (False, False)):
  """One launch of a dual-view kernel over bf16 x [M, K] (the MXFP4 and NVFP4 kernels share it).

  The kernel gets `params`' arrays first ((array, BlockSpec) pairs), then x's tile (`sources`: x as uint32
  words of two bf16 neighbours along K split by row parity [M/2, 2, K/2] in (bm/2, 2, bk/2) tiles, or for a
  `numerics.produced.Produced` x the tiles of its op's inputs, from which `tile_elements` computes x's), then
  four output refs (row codes, row scales, column codes, column scales), None for a view that `write` (row,
  column) leaves out: the kernel skips that view's work, so a launch for one operand (fp4_dot's
  `quantize_operand`: quartet2's forward X and W, an evaluation's operands) neither computes nor stores the
  other. A view in `values` gets its values ref (`view_outputs`) in the codes slot and None for the scales.
  Returns the row codes, row scales, column codes and column scales in the QTensor layouts (None where not
  written; `view_arrays` for values).
  """
  if not any(write):
    raise ValueError("dual_view_call: write names no view")
  m, k = x.shape
  source, tile_of = sources.launch_inputs(x, t, interpret=interpret)
  out_shape, out_specs = view_outputs(m, k, t, block, write, values)
  n_par, n_in = len(params), len(params) + len(source)
  slots = tuple(write[i // 2] and not (values[i // 2] and i % 2) for i in range(4))  # which of the 4 refs exist

  outs = iter(pallas_call(
      functools.partial(_dual_view_body, kernel=kernel, tile_of=tile_of, n_par=n_par, n_in=n_in, slots=slots),
      out_shape=out_shape,
      grid=(m // t.block_m, k // t.block_k),
      in_specs=[spec for _, spec in params + source],
      out_specs=out_specs,
      compiler_params=pltriton.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
      interpret=interpret,
      name=launch_name(name, kernel, x.shape, t, block, [(a.shape, a.dtype, spec.block_shape) for a, spec in params],
                       write, values, *([x.kind] if isinstance(x, Produced) else [])),
  )(*[a for a, _ in params + source]))
  return view_arrays(*[next(outs) if slots[i] else None for i in range(4)], m, k, block, values)


def sign_words(transform: str | None, key: jax.Array | None, words: int = SIGN_WORDS) -> jax.Array:
  """uint32 [words] of `transform`'s -1 signs (`hadamard.negative_words`; zeros for no transform): what
  kernels read."""
  if transform is None:
    return jnp.zeros((words,), jnp.uint32)
  return hadamard.negative_words(transform, key, words)


def read_words(ref, first: int, count: int = SIGN_WORDS) -> list:
  """`count` sign words at ref[first:], as int32 scalars."""
  return [jax.lax.bitcast_convert_type(ref[first + i], jnp.int32) for i in range(count)]


def butterfly(planes: list[jax.Array], n: int, words: list) -> list[jax.Array]:
  """`hadamard.hadamard(., kind, axis=0)` (size n, signs in `words`) on rows held as interleaved planes.

  planes[p] holds the float32 bits [h, w] of rows p, p + P, p + 2P, ... (P = len(planes): 1 for a tile whose
  rows run along the rotated axis, 2 for the dual-view kernels' row parities); n a multiple of P. `words`:
  int32 scalars, sign r in bit r % 32 of word r // 32. The same float32 operations in `hadamard.fwht`'s order:
  signs (bit-31 flips), butterfly stages at row distance 1, 2, ..., n/2 (between planes while the distance is
  below P, then within each plane, the two rows of each pair separated by `halves`), then the 1/sqrt(n) scale.
  Returns the transformed planes as float32 bits.
  """
  count = len(planes)
  h, w = planes[0].shape
  first_row = jax.lax.broadcasted_iota(jnp.int32, (h, w), 0)
  first_row = (first_row * count if count > 1 else first_row) % n  # plane 0's row in its Hadamard block
  signed = []
  for p, y in enumerate(planes):
    r = first_row + p if p else first_row  # n is a multiple of count: no wrap-around
    word, bit = words[0], r
    if n > 32:
      for i in range(1, n // 32):
        word = jnp.where(r >= 32 * i, words[i], word)
      bit = r & 31
    signed.append(y ^ (((word >> bit) & 1) << 31))
  planes, d = signed, 1
  while d < count:  # stages between planes
    planes = list(planes)
    for p in range(count):
      if p & d == 0:
        a, b = as_f32(planes[p]), as_f32(planes[p + d])
        planes[p], planes[p + d] = as_i32(a + b), as_i32(a - b)
    d *= 2
  out = []
  for y in planes:
    e = d // count  # the distance in rows of this plane
    while e * count < n:
      lo, hi = map(as_f32, halves(y.reshape(h // (2 * e), 2, e * w)))  # rows (i, i + e) of each run of 2e
      y = interleave(as_i32(lo + hi), as_i32(lo - hi)).reshape(h, w)
      e *= 2
    out.append(as_i32(as_f32(y) * jnp.float32(1 / math.sqrt(n))))
  return out
