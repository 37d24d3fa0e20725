"""Fused MS-EDEN quantizer (Quartet II's backward, route "quartet2"): rotation, codes and corrected scales in
one Pallas pass per view, bit for bit `reference.quantize(hadamard(x, transform, axis=axis, key=transform_key),
"nvfp4", axis=axis, rounding="eden", key=key)`.

Two launches per view, with the one global dependency between them explicit:
  1. `amax.rotated_amax`: the amax of the rotated tensor (s_dec needs it before any block scale). A Pallas
     pass that runs the same butterfly as the quantizer and writes one max of |y| bits per program (NaN/Inf bit
     patterns sort above every finite one, so a non-finite tensor gives a NaN amax, as `reference._amax`);
     XLA reduces the per-program maxima and derives s_dec with the reference's own `eden_decode_scale`.
  2. the quantizer: one program per group of 128 along the quantized axis times `block_c` positions of the
     other axis. The tile is turned so that the quantized axis runs down its rows (the row view transposes its
     [block_c, 128] tile in registers, so no XLA transpose of x), then, in `reference`'s order:
       signs, the Hadamard butterfly along the rows and the 1/sqrt(n) scale (`common.butterfly`);
       per 16-block: amax_b, s_b = e4m3_RN(min((amax_b * fp32(1/val_max)) / s_dec, 448)) (1 where 0);
       ys = y / (s_b * s_dec) per element; codes = E2M1_RNE(ys);
       per 128-group: num = tree(ys * ys), den = tree(ys * q) (`common.halving_sum`: the reference's
       `_tree_sum` order over the rows), c = num / den (1 when den = 0), t = min(s_b * c, cap) (cap =
       `reference.scale_cap(s_dec)`, 448 but for an amax near float32 max);
       scale = e4m3_SR(t) with one draw per block from stream `STREAM_SCALE_SR`, counter = the block's flat
       index in the K-major scales array.
     The program writes its codes and scales as it holds them, the quantized axis down the rows: blocks
     [L/2, block_c] and [L/16, block_c] of arrays [other / block_c, L/2, block_c] and [.., L/16, ..], whose
     strides do not depend on the other axis (one kernel for every shape of `pallas`'s canonical layout);
     XLA turns those into the K-major layout (a pass over bytes, a quarter of a bf16 x's size, that XLA may
     fuse into the consumer). Turning them in registers instead makes XLA's Triton lowering of this kernel
     an order of magnitude slower to compile, for a kernel no faster overall (docs/BENCHMARKS.md).
Every division is correctly rounded and every product feeding a sum rounded on its own (`exact`: PTX
div.rn.f32 / mul.rn.f32 on the GPU, `ieee.div` / a barrier in interpret mode); the rest is float32 adds,
multiplies, mins and integer/bit arithmetic whose results no contraction can change. A group (and every block
in it) holding a NaN or Inf, or a non-finite s_dec, gets zero codes and NaN scales (0x7F), as the reference.

Input: a 2-D bf16 or float32 x (float32 for the requantized X^ and W^ of quartet2, dequantized by XLA first),
quantized along `axis` in groups of 128 (that length a multiple of 128), the other axis a multiple of 16.
Backend: Pallas through the Triton lowering (`mxfp4` says why not Mosaic GPU), interpret mode on CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from fp4jax.numerics import hadamard, prng, quantize_args, reference
from fp4jax.numerics.codecs import e4m3_rn_bytes, e4m3_sr_bytes
from fp4jax.numerics.formats import E2M1_MAX, E4M3_MAX
from fp4jax.numerics.qtensor import QTensor
from fp4jax.numerics.spec import EDEN_GROUP, OperandKeys, OperandSpec
from fp4jax.ops.quantize.pallas import amax as amax_lib
from fp4jax.ops.quantize.pallas import common, exact
from fp4jax.ops.quantize.pallas.common import (F32_ABS, F32_INF, as_f32, as_i32, butterfly, e2m1_magnitude,
                                               encode_rne, halving_sum, halves, launch_name, magnitude_and_sign,
                                               pack_nibbles, read_words, sign_words, with_sign)

KERNEL_NAME = "fp4jax_eden_quantize"
GROUP = EDEN_GROUP  # 128 elements along the quantized axis: one correction factor, one program
BLOCK = 16
TRANSFORMS = ("h16", "h32", "rht16", "rht32", "rht128")
DTYPES = (jnp.bfloat16, jnp.float32)
# Positions of the other axis per program, largest first (16 columns at 4 warps, the default, was the fastest
# measured: docs/BENCHMARKS.md).
BLOCK_C = (64, 32, 16)

_E4M3_NAN = 0x7F
# Parameter words handed to every program: [scale-SR seed k0, k1, sign words 0..3, s_dec bits, counter offset].
_N_PARAMS = 8
_WORDS_SLOT, _S_DEC_SLOT, _OFFSET_SLOT = 2, 6, 7


@dataclasses.dataclass(frozen=True)
class EdenConfig:
  """Static options of one launch (hashable: crosses jit as one object).

  axis: the quantized axis of x (0: the column view, written K-major [C, R]; 1: the row view).
  block_c: positions of the non-quantized axis per program; num_warps: warps per program.
  targets: also return t, the corrected scale before its SR (float32, the scales' layout): for tests.
  offset, scales_per_row: where x is a block of a larger array (`operand`'s counter_offset): the scale draws'
  counters start at the offset parameter word, their rows `scales_per_row` apart (None: x's own).
  """

  axis: int = 0
  transform: str | None = "rht128"
  block_c: int = 16
  num_warps: int = 4
  targets: bool = False
  interpret: bool = False
  offset: bool = False
  scales_per_row: int | None = None


def check(x: jax.Array, spec: OperandSpec, axis: int) -> None:
  """Raises NotImplementedError saying why, when `operand` does not cover this call: fmt "nvfp4", rounding
  "eden", 1-D blocks, a transform of `TRANSFORMS` or none, a 2-D bf16 / float32 x whose `axis` is a multiple
  of 128 and other axis of 16."""
  why = None
  if (spec.fmt, spec.rounding, spec.tile_2d) != ("nvfp4", "eden", False):
    why = f"{spec}"
  elif spec.transform not in (None, *TRANSFORMS):
    why = f"transform {spec.transform!r}"
  elif x.ndim != 2 or jnp.dtype(x.dtype) not in DTYPES or axis not in (0, 1, -1, -2):
    why = f"x {x.dtype} {x.shape}, {axis=}: a 2-D bf16 or float32 array"
  elif x.shape[axis] % GROUP or x.shape[1 - axis % 2] % BLOCK_C[-1]:
    why = f"x {x.shape} along {axis=}: the quantized axis a multiple of {GROUP}, the other of {BLOCK_C[-1]}"
  if why is not None:
    raise NotImplementedError(f"MS-EDEN kernel: {why}")


def _eden_kernel(p_ref, x_ref, codes_ref, scales_ref, *t_ref, cfg: EdenConfig, scales_per_row: int,
                 groups: int):
  """One [128 along the quantized axis, block_c] tile -> codes [64, block_c], scale bytes [8, block_c] (and t),
  transposed (module docstring)."""
  div = functools.partial(exact.div_rn, interpret=cfg.interpret)
  bits = amax_lib.tile_bits(x_ref, cfg.axis)  # [L, C]
  if cfg.transform is not None:
    bits = butterfly([bits], hadamard.KINDS[cfg.transform].n, read_words(p_ref, _WORDS_SLOT))[0]
  rows, cols = bits.shape
  nb = rows // BLOCK
  s_dec = jax.lax.bitcast_convert_type(p_ref[_S_DEC_SLOT], jnp.float32)
  mag, _ = magnitude_and_sign(bits)
  amax = jnp.max(mag.reshape(nb, BLOCK, cols), axis=1)  # [nb, C] |y| bits
  bad = (jnp.max(amax, axis=0, keepdims=True) >= F32_INF) | ((as_i32(s_dec) & F32_ABS) >= F32_INF)  # [1, C]
  amax_b = as_f32(jnp.where(bad, 0, amax))
  _, s_b = e4m3_rn_bytes(jnp.minimum(div(amax_b * jnp.float32(1 / reference.EDEN_VAL_MAX), s_dec), E4M3_MAX))
  s_b = jnp.where(s_b == 0, 1.0, s_b)  # [nb, C]
  d_b = jnp.broadcast_to((s_b * s_dec)[:, None, :], (nb, BLOCK, cols))
  ys = div(as_f32(bits).reshape(nb, BLOCK, cols), d_b).reshape(rows, cols)
  ymag, sign = magnitude_and_sign(as_i32(ys))
  ymag = as_f32(ymag)
  code = encode_rne(jnp.minimum(ymag, E2M1_MAX), None)  # saturating, as e2m1_encode_rne of the unclamped ys
  # |ys|^2 and |ys| * |q| equal ys * ys and ys * q: both products are >= +0 (q carries ys's sign).
  group = (1, rows, cols)  # the tree runs down the rows (the group's elements in the reference's order)
  num = halving_sum(exact.mul_rn(ymag, ymag, interpret=cfg.interpret), group, 1).reshape(1, cols)
  den = halving_sum(exact.mul_rn(ymag, e2m1_magnitude(code), interpret=cfg.interpret), group, 1).reshape(1, cols)
  c = jnp.where(den == 0, 1.0, div(num, jnp.where(den == 0, 1.0, den)))
  t = jnp.where(bad, 1.0, jnp.minimum(s_b * c, reference.scale_cap(s_dec)))  # [nb, C]
  k0, k1 = p_ref[0], p_ref[1]
  group_id, column_id = common.grid_ids((groups,))
  col = jax.lax.broadcasted_iota(jnp.uint32, (nb, cols), 1) + (column_id * cols).astype(jnp.uint32)
  blk = jax.lax.broadcasted_iota(jnp.uint32, (nb, cols), 0) + (group_id * nb).astype(jnp.uint32)
  counter = col * jnp.uint32(cfg.scales_per_row or scales_per_row) + blk
  u24 = prng.hash_bits(k0, k1, counter + p_ref[_OFFSET_SLOT] if cfg.offset else counter) >> 8
  u = jax.lax.bitcast_convert_type(u24, jnp.int32).astype(jnp.float32) * jnp.float32(2.0**-24)
  scale = jnp.where(bad, _E4M3_NAN, e4m3_sr_bytes(t, u))
  code = jnp.where(bad, 0, with_sign(code, sign)).reshape(rows // 2, 2, cols)
  lo, hi = halves(code)
  codes_ref[0, :, :] = pack_nibbles(lo, hi).astype(jnp.uint8)  # [L/2, C]
  scales_ref[0, :, :] = scale.astype(jnp.uint8)  # [L/16, C]
  if cfg.targets:
    t_ref[0][0, :, :] = t


def _grid(shape: tuple[int, int], cfg: EdenConfig):
  """(grid, x BlockSpec): program (i, j) = group i along the quantized axis, column block j of the other."""
  length, other = (shape[0], shape[1]) if cfg.axis == 0 else (shape[1], shape[0])
  grid = (length // GROUP, other // cfg.block_c)
  if cfg.axis == 0:
    return grid, pl.BlockSpec((GROUP, cfg.block_c), lambda i, j: (i, j))
  return grid, pl.BlockSpec((cfg.block_c, GROUP), lambda i, j: (j, i))


@functools.partial(jax.jit, static_argnames=("cfg",))
def _eden_call(x: jax.Array, params: jax.Array, cfg: EdenConfig):
  grid, x_spec = _grid(x.shape, cfg)
  length = grid[0] * GROUP
  n_scales = length // BLOCK
  bc = cfg.block_c
  # Outputs as the programs hold them (module docstring): codes [other / bc, L/2, bc], scales (and t)
  # [other / bc, L/16, bc].
  out_shape = [jax.ShapeDtypeStruct((grid[1], length // 2, bc), jnp.uint8),
               jax.ShapeDtypeStruct((grid[1], n_scales, bc), jnp.uint8)]
  out_specs = [pl.BlockSpec((1, GROUP // 2, bc), lambda i, j: (j, i, 0)),
               pl.BlockSpec((1, GROUP // BLOCK, bc), lambda i, j: (j, i, 0))]
  if cfg.targets:
    out_shape.append(jax.ShapeDtypeStruct((grid[1], n_scales, bc), jnp.float32))
    out_specs.append(pl.BlockSpec((1, GROUP // BLOCK, bc), lambda i, j: (j, i, 0)))
  return common.pallas_call(
      functools.partial(_eden_kernel, cfg=cfg, scales_per_row=n_scales, groups=grid[0]),
      out_shape=tuple(out_shape),
      grid=grid,
      in_specs=[pl.BlockSpec((_N_PARAMS,), lambda i, j: (0,)), x_spec],
      out_specs=tuple(out_specs),
      compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
      interpret=cfg.interpret,
      name=launch_name(KERNEL_NAME, cfg, x.shape, x.dtype, n_scales),
  )(params, x)


def _block_c(other: int, block_c: int) -> int:
  """The largest of `BLOCK_C` up to `block_c` dividing the non-quantized axis."""
  for b in BLOCK_C:
    if b <= block_c and other % b == 0:
      return b
  raise ValueError(f"the non-quantized axis ({other}) must be a multiple of {BLOCK_C[-1]}")


def operand(x: jax.Array, spec: OperandSpec, axis: int, keys: OperandKeys, *,
            tensor_amax: jax.Array | None = None, block_c: int = 16, num_warps: int = 4, targets: bool = False,
            interpret: bool = False, counter_offset: jax.Array | None = None, scales_per_row: int | None = None,
            amax_over: tuple[str, ...] = ()):
  """MS-EDEN NVFP4 of a 2-D x along `axis`, rotated first by `spec.transform` (None: no rotation), in two
  Pallas launches (the rotated amax, then the quantizer).

  Equal bit for bit to `reference.quantize(hadamard(x, spec.transform, axis=axis, key=keys.transform) if
  spec.transform else x, "nvfp4", axis=axis, rounding="eden", key=keys.rounding, tensor_amax=tensor_amax)`;
  `tensor_amax` (the amax of the *rotated* x) skips the first launch. `targets=True` also returns t (float32
  [other, length/16]), the corrected scales before their SR. Raises NotImplementedError where `check` does;
  `interpret=True` runs both kernels in Pallas interpret mode (CPU).
  Where x is a block of a larger array (`pallas.rows`, inside a shard_map): the scale draws' counters are the
  larger array's, `counter_offset` (uint32) plus x's own with its K-major rows `scales_per_row` apart (None:
  x's), and the amax is taken over the mesh axes `amax_over`.
  """
  check(x, spec, axis)
  axis %= 2
  transform, key, transform_key = spec.transform, keys.rounding, keys.transform
  if key is None:
    raise ValueError("MS-EDEN draws its scale rounding: pass a rounding key")
  if transform is not None and hadamard.KINDS[transform].random_signs and transform_key is None:
    raise ValueError(f"random-sign {transform=} needs a transform key")
  other = x.shape[1 - axis]
  cfg = EdenConfig(axis=axis, transform=transform, block_c=_block_c(other, block_c), num_warps=num_warps,
                   targets=targets, interpret=interpret, offset=counter_offset is not None,
                   scales_per_row=scales_per_row)
  words = sign_words(transform, transform_key)
  if tensor_amax is None:
    amax = amax_lib.rotated_amax(x, transform, transform_key, axis=axis, interpret=interpret, words=words)
  else:
    amax = quantize_args.amax_value(tensor_amax)
  if amax_over and tensor_amax is None:
    amax = amax_lib.over_devices(amax, amax_over)
  s_dec = reference.eden_decode_scale(amax)
  # Built inside the concatenate, as the zero word always was: an unsplit launch's program stays the same.
  offset = lambda: (jnp.zeros((1,), jnp.uint32) if counter_offset is None else
                    jnp.asarray(counter_offset, jnp.uint32).reshape(1))
  params = jnp.concatenate([jnp.stack(prng.seed_words(key, prng.STREAM_SCALE_SR, barrier=False)), words,
                            jax.lax.bitcast_convert_type(s_dec, jnp.uint32)[None], offset()])
  # To the K-major layout: [other / bc, n, bc] -> [other, n].
  codes, scales, *t = (a.transpose(0, 2, 1).reshape(other, -1) for a in _eden_call(x, params, cfg))
  outer = jnp.where(jnp.isfinite(s_dec), s_dec, jnp.nan)
  q = QTensor(codes, jax.lax.bitcast_convert_type(scales, jnp.float8_e4m3fn), outer, fmt="nvfp4", axis=axis,
              shape=x.shape)
  return (q, t[0]) if targets else q
