"""Pure-jnp FP4 quantizers: the ground truth every kernel and backend is checked against, bit for bit.

The formulas are docs/NUMERICS.md's. Everything here is jit-able and runs on any backend.

Conventions (the contract the kernels reproduce):
  * Blocks run along `axis`; the result's layout is K-major (`fp4jax.numerics.qtensor.QTensor`).
  * Arithmetic is float32 whatever the input dtype (bf16 / f16 / f32 inputs are upcast exactly).
  * Powers of two are built by exponent bit arithmetic, never `exp2`/`log2`.
  * A "scale unit" is what one scale covers: a 1-D block, or a 2-D tile (`tile_2d`).
  * MXFP4: E from the unit amax's float32 exponent bits; "ocp": E = floor(log2 amax) - 2; "noclip": the
    smallest E with amax / 2^E <= 6. E is clamped to [-127, 125] (`MX_E_MAX`); a zero unit gets byte 0 (2^-127) and
    zero codes. `clip_fraction` (Hu's bounded clipping) takes E - 1 when amax / 2^E < fp32(6 * clip_fraction)
    (5.2199998 for 0.87): when the no-clip scale leaves more than that fraction of the E2M1 range unused.
  * NVFP4 (TE): S_enc = scale_max * 6 / amax (1 when amax = 0, at most float32 max), s_b = e4m3_RN(min(amax_b *
    (S_enc * fp32(1/6)), 448)), outer = fp32(1 / S_enc), enc_b = 1 / fp32(s_b * outer) (`nv_block_encode`),
    q = E2M1(clamp(x * enc_b, +-6)); dequantized = q * s_b * outer.
  * NVFP4 SR leaves headroom H = 17/16 (`NV_HEADROOM`, as Quartet II's SR) so that nothing clips and SR is
    unbiased: S_enc = fp32(scale_max * 6 / H) / amax, s_b = e4m3_RN(min(amax_b * (S_enc * c), 448)) with
    c = `nv_inv_target(6, H)`; 4/6 divides both targets by H. docs/NUMERICS.md ("NVFP4 SR headroom") proves that
    nothing then clips and says what is not covered (subnormal E4M3 scales).
  * 4/6: per unit, s_b for target maxima 6 and 4, keep the one whose RNE codes have the lower sum of squared
    errors (q * s_b - x * S_enc)^2 (ties -> 6; the S_enc-scaled domain cannot over/underflow); under SR the choice
    is still made on the RNE codes, so it does not depend on the draws.
  * Tile-local NVFP4: rows = all non-quantized positions of the K-major layout, flattened; each run of
    `tile_rows` rows (the last may be shorter) uses its own amax in the NVFP4 formula; outer is per row.
  * Stochastic rounding draws its uniform for element i from `numerics.prng` with counter = i's row-major flat
    index in the *original* array, stream `STREAM_ELEMENT_SR`: round up iff u < (|v| - lo) / (hi - lo).
  * MS-EDEN (rounding="eden", "nvfp4" only, 1-D): docs/NUMERICS.md ("MS-EDEN: float32 operation order") lists
    its steps; every one is one float32 rounding in that order (`_eden_targets` computes up to t), because the
    scale's SR exposes every ulp of t.
  * Divisions by a computed value are correctly rounded (`ieee.div`; by a power of two `ieee.div_pow2`), never
    XLA's `/` (rewritten by its simplifier, approximate on NVIDIA GPUs: docs/NUMERICS.md); a constant divisor is
    a multiplication by its float32 reciprocal.
  * Sums that decide something (4/6 errors, EDEN's correction) are pairwise halving trees in a fixed order over
    float32 values (`_tree_sum` keeps products out of the first level: no FMA); a 2-D tile is summed along the
    original array's columns first, then its rows, so both orientations agree.
  * Non-finite input: a scale unit holding NaN or +-Inf gets a NaN scale (E8M0 0xFF, E4M3 0x7F) and zero codes,
    so it dequantizes to NaN; a non-finite tensor (or row-tile) amax makes outer NaN and every scale it governs
    NaN with zero codes. Never finite garbage.
  * Huge finite values saturate (no inf scales, no value decoding to inf): NVFP4 and MS-EDEN block scales are
    capped at `scale_cap` (448 but near float32 max, where SR's headroom or EDEN's correction would pass it);
    tiny blocks keep their values where the format can hold them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from fractions import Fraction
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax.numerics import current_scaling, ieee, prng, quantize_args
from fp4jax.numerics.codecs import e2m1_decode, e2m1_encode_rne, e2m1_encode_sr, e4m3_rn, e4m3_sr
from fp4jax.numerics.formats import E2M1_MAX, E4M3_MAX, MX_E_MAX, FormatSpec, get_format
from fp4jax.numerics.qtensor import QTensor, pack_codes
from fp4jax.numerics.quantize_args import Cfg as _Cfg, check as _check
from fp4jax.numerics.spec import EDEN_GROUP, float_dtype

_E8M0_NAN = 0xFF
_E4M3_NAN = 0x7F
_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).tiny)
# MS-EDEN constants (Quartet II backward): the scaled block max targets val_max = 6 / s_o.
EDEN_SCALE_OVERSHOOT = (17 / 16) * 0.93
EDEN_VAL_MAX = E2M1_MAX / EDEN_SCALE_OVERSHOOT
EDEN_AMAX_DIV = 255.99
# NVFP4 target headroom per rounding (module docstring): SR aims maxima at v / (17/16) so nothing clips.
NV_HEADROOM: dict[str, float] = {"rne": 1.0, "sr": 17 / 16}


def _tree_sum(a: jax.Array, axis: int) -> jax.Array:
  """Sum along `axis` (a power-of-two length) by halving: a[:n/2] + a[n/2:], repeated. A fixed order.

  The barrier makes the tree add `a` as rounded float32 values: otherwise XLA fuses the producer of `a` into the
  first level and contracts p * q + r * s into an FMA (measured on CPU: 25% of random float32 cases differ).
  """
  a = jax.lax.optimization_barrier(a)
  axis = axis % a.ndim
  while a.shape[axis] > 1:
    h = a.shape[axis] // 2
    a = jax.lax.slice_in_dim(a, 0, h, axis=axis) + jax.lax.slice_in_dim(a, h, 2 * h, axis=axis)
  return jnp.squeeze(a, axis)


# Scale units (a 1-D block of `spec.block` elements, or a block x block tile), per-format scale methods.
class _Result(NamedTuple):
  codes: jax.Array  # uint8 [..., nb, B], unpacked
  scales: jax.Array  # [..., nb]
  outer: jax.Array | None
  bad: jax.Array  # bool [..., nb]: the unit's scale is NaN and its codes zero


def _unit_max(a: jax.Array, cfg: _Cfg) -> jax.Array:
  """Max of `a` [..., nb, B] over each scale unit, one value per block: [..., nb]."""
  m = jnp.max(a, axis=-1)  # [..., nb]
  if not cfg.tile_2d:
    return m
  r, nb = m.shape
  b = cfg.spec.block
  t = jnp.max(m.reshape(r // b, b, nb), axis=1, keepdims=True)  # [R/b, 1, nb]
  return jnp.broadcast_to(t, (r // b, b, nb)).reshape(r, nb)


def _unit_sum(a: jax.Array, cfg: _Cfg) -> jax.Array:
  """Sum of `a` [..., nb, B] over each scale unit in a fixed order that both tile orientations share."""
  if not cfg.tile_2d:
    return _tree_sum(a, -1)
  r, nb, b = a.shape
  t = a.reshape(r // b, b, nb, b)  # [tile row, row in tile, block, element]
  # Along the original array's columns first: K-major rows when axis == 0, block elements when axis == 1.
  s = _tree_sum(_tree_sum(t, 1), 2) if cfg.axis == 0 else _tree_sum(_tree_sum(t, 3), 1)  # [R/b, nb]
  return jnp.broadcast_to(s[:, None, :], (r // b, b, nb)).reshape(r, nb)


def _unit_nonfinite(xb: jax.Array, cfg: _Cfg) -> jax.Array:
  return _unit_max((~jnp.isfinite(xb)).astype(jnp.uint8), cfg) > 0


def _amax(a: jax.Array, axis=None) -> jax.Array:
  """max |a|, NaN when anything is non-finite (an Inf must not look like a finite amax)."""
  m = jnp.max(jnp.abs(a), axis=axis, initial=0.0)  # 0 for an empty tensor
  return jnp.where(jnp.all(jnp.isfinite(a), axis=axis), m, jnp.nan)


def _encode(v: jax.Array, cfg: _Cfg, u: jax.Array | None) -> jax.Array:
  v = jnp.clip(v, -E2M1_MAX, E2M1_MAX)
  return _ENCODERS[cfg.rounding](v, u)


_ENCODERS: dict[str, Callable] = {"rne": lambda v, u: e2m1_encode_rne(v), "sr": e2m1_encode_sr}


def _mx_exponent(amax: jax.Array, cfg: _Cfg) -> jax.Array:
  """int32 E8M0 exponent per unit from the float32 bits of the unit amax (>= 0)."""
  bits = jax.lax.bitcast_convert_type(amax, jnp.uint32)
  biased = (bits >> 23).astype(jnp.int32)  # floor(log2 amax) + 127 for a normal amax
  mant = bits & jnp.uint32(0x7FFFFF)
  e = biased - 129  # OCP: floor(log2 amax) - 2, so amax / 2^e in [4, 8)
  if cfg.scale_rule == "noclip":
    e = e + (mant > 0x400000).astype(jnp.int32)  # amax / 2^e = 4 * 1.mant > 6: one step coarser
  if cfg.clip_fraction is not None:
    m1 = jax.lax.bitcast_convert_type(mant | jnp.uint32(127 << 23), jnp.float32)  # 1.mant in [1, 2)
    ratio = m1 * ieee.pow2(biased - 127 - e)  # amax / 2^e, exact
    e = e - (ratio < jnp.float32(E2M1_MAX * cfg.clip_fraction)).astype(jnp.int32)
  # A zero or subnormal amax (biased 0) gets the smallest scale, 2^-127.
  return jnp.where(biased == 0, -127, jnp.clip(e, -127, MX_E_MAX))


def _quantize_mx(xb, cfg: _Cfg, *, u, key, tensor_amax) -> _Result:
  """MXFP4: E8M0 scale 2^E per unit, x / 2^E encoded to E2M1."""
  del key, tensor_amax
  bad = _unit_nonfinite(xb, cfg)
  e = _mx_exponent(jnp.where(bad, 0.0, _unit_max(jnp.abs(xb), cfg)), cfg)  # [..., nb]
  v = xb * ieee.pow2(jnp.maximum(-e, -126))[..., None]  # exact: a power-of-two multiplier
  return _Result(_encode(v, cfg, u), (e + 127).astype(jnp.uint8), None, bad)


def _tensor_amax(xk: jax.Array, cfg: _Cfg, tensor_amax) -> jax.Array:
  """One amax for the whole tensor: shape ()."""
  if tensor_amax is not None:
    return quantize_args.amax_value(tensor_amax)
  return _amax(xk)


def _row_tile_amax(xk: jax.Array, cfg: _Cfg, tensor_amax) -> jax.Array:
  """One amax per run of `tile_rows` rows of the K-major layout, repeated per row: shape xk.shape[:-1]."""
  del tensor_amax
  lead, n = xk.shape[:-1], xk.shape[-1]
  rows = math.prod(lead)
  tiles = -(-rows // cfg.tile_rows)
  row_amax = _amax(xk.reshape(rows, n), axis=-1)  # [R]
  padded = jnp.pad(row_amax, (0, tiles * cfg.tile_rows - rows))
  tile_amax = jnp.max(padded.reshape(tiles, cfg.tile_rows), axis=-1)  # [T]; NaN propagates
  tile_amax = jnp.where(jnp.isnan(padded.reshape(tiles, cfg.tile_rows)).any(-1), jnp.nan, tile_amax)
  return jnp.repeat(tile_amax, cfg.tile_rows)[:rows].reshape(lead)


_OUTER_AMAX: dict[str, Callable] = {"tensor": _tensor_amax, "row_tile": _row_tile_amax}


def nvfp4_encode_scale(amax: jax.Array, scale_max: float) -> jax.Array:
  """S_enc = scale_max * 6 / amax (1 when amax = 0, at most float32 max; NaN stays NaN: `ieee.amax_factor`)."""
  return ieee.amax_factor(np.float32(scale_max * E2M1_MAX), amax)


def nvfp4_outer(s_enc: jax.Array) -> jax.Array:
  """1 / S_enc, the FP32 decode factor (NaN where S_enc is not finite); S_enc >= 6 / float32 max: not lifted."""
  return jnp.where(jnp.isfinite(s_enc), ieee.div(np.float32(1.0), s_enc, b_normal=True), jnp.nan)


@functools.cache
def nv_inv_target(v_max: float, headroom: float) -> np.float32:
  """The float32 c in s_b = e4m3_RN(amax_b * (S_enc * c)) that aims a block max at v_max / headroom.

  fp32(1 / v_max) without headroom (TE); with headroom the smallest float32 >= (headroom / v_max) * (1 + 2^-22),
  whose margin covers the float32 roundings of the no-clip bound (module docstring).
  """
  if headroom == 1:
    return np.float32(1 / v_max)
  # Exact: NumPy 2 compares a float32 with a Python float in float32, which once left c one ulp low.
  want = Fraction(headroom) / Fraction(v_max) * (1 + Fraction(1, 2**22))
  c = np.float32(float(want))
  return c if Fraction(float(c)) >= want else np.nextafter(c, np.float32(np.inf))


# E4M3 values above 240, ascending: the block scales `scale_cap` may return (240 where none of them fits).
_CAP_FLOOR, _CAP_STEPS = 240.0, (256.0, 288.0, 320.0, 352.0, 384.0, 416.0, E4M3_MAX)


def scale_cap(factor: jax.Array, v_max: float = E2M1_MAX) -> jax.Array:
  """The largest E4M3 value T <= 448 whose top decoded value fp32(v_max * T) * factor is finite, for the FP32
  decode factor of an NVFP4 tensor (outer) or of MS-EDEN (s_dec): block scales are capped at it, so that huge
  finite inputs saturate instead of decoding to inf (docs/NUMERICS.md, "Special values"). 448 wherever
  factor <= float32 max / (448 * v_max), so ordinary tensors are untouched. The factors the quantizers pass are at
  most float32 max / 1445 (amax <= float32 max over the smallest numerator, 4/6's with SR headroom; EDEN's
  1554), so T >= 240 and only `_CAP_STEPS` need trying. Products and compares: the Pallas kernels run it too."""
  cap = np.float32(_CAP_FLOOR)
  for t in _CAP_STEPS:  # v_max * t is exact; the product with the factor is the one `dequantize` rounds
    cap = jnp.where(np.float32(v_max * t) * factor <= _F32_MAX, np.float32(t), cap)
  return cap


def scale_caps(factor: jax.Array, v_maxes: tuple[float, ...]) -> list[jax.Array]:
  """[`scale_cap(factor, v) for v in v_maxes`] as one comparison and a sum (the steps that fit are a prefix, the
  cap 240 plus their rises): XLA's form, where the chain of selects was a fifth of the NVFP4 rows' compile
  (`pallas.params`; docs/BENCHMARKS.md, "Session of 2026-12-07, 03:39 UTC"). Kernels run `scale_cap` (Triton's
  shapes are powers of two)."""
  tops = np.array([[v * t for t in _CAP_STEPS] for v in v_maxes], np.float32)  # exact, as in scale_cap
  fits = jnp.asarray(factor)[..., None, None] * tops <= _F32_MAX  # [..., targets, steps]
  rises = np.diff(np.array((_CAP_FLOOR, *_CAP_STEPS), np.float32))
  caps = np.float32(_CAP_FLOOR) + jnp.sum(jnp.where(fits, rises, np.float32(0)), axis=-1)  # integers: exact
  return [caps[..., i] for i in range(len(v_maxes))]


def _nv_block_scale(amax_b: jax.Array, s_enc: jax.Array, v_max: float, headroom: float = 1.0,
                    cap: jax.Array | float = E4M3_MAX) -> jax.Array:
  """E4M3 block scale aiming the block max at `v_max / headroom`: e4m3_RN(min(amax_b * (S_enc * c), cap)), cap
  `scale_cap(outer)` (448 but for tensors near float32 max; an E4M3 value, so capping before or after the RN
  is the same)."""
  return e4m3_rn(jnp.minimum(amax_b * (s_enc * nv_inv_target(v_max, headroom)), cap))


def nv_block_encode(sf: jax.Array, outer: jax.Array) -> jax.Array:
  """enc_b = 1 / fp32(s_b * outer) (Transformer Engine's order; 0 where s_b = 0, at most float32 max) for float32
  block scales `sf`, with the product rounded to 24 bits whatever its exponent: fp32(m * outer * 2^L) * 2^(e - L)
  for s_b = m * 2^e and a subnormal outer lifted by 2^L (docs/NUMERICS.md, "NVFP4 encode order"); what the
  Pallas kernel computes from its table of eight fp32(1 / (m * outer * 2^L)).
  """
  o, shift = ieee.lift(outer)
  bits = jax.lax.bitcast_convert_type(jnp.where(sf == 0, 1.0, sf), jnp.int32)  # E4M3 values: normal float32
  m = jax.lax.bitcast_convert_type((bits & 0x7FFFFF) | (127 << 23), jnp.float32)  # significand in [1, 2)
  e = (bits >> 23) - 127
  enc = ieee.div(np.float32(1.0), m * o, b_normal=True) * ieee.pow2(shift - e)  # 2^(L - e) in [2^-8, 2^73]
  return jnp.where(sf == 0, 0.0, jnp.minimum(enc, _F32_MAX))


def _nv_scaled(xb: jax.Array, s_b: jax.Array, outer: jax.Array) -> jax.Array:
  """x * enc_b (`nv_block_encode`) in E2M1 units, clamped to +-6."""
  enc = nv_block_encode(ieee.e4m3_to_f32(s_b), outer)
  return jnp.clip(xb * enc[..., None], -E2M1_MAX, E2M1_MAX)


def _four_over_six(xb, amax_b, s_enc, outer, cfg: _Cfg, headroom: float) -> jax.Array:
  """Per unit, the E4M3 scale for target max 6 or 4 whose RNE codes have the lower squared error; target 4 only
  where 4 * s_b * outer is finite (`scale_cap`): its codes stay <= 4 (below 5 under RNE; SR: the headroom)."""
  # [..., nb, B]: x in the S_enc-scaled domain, rounded to float32 here: the barrier keeps XLA from contracting
  # the product into the subtraction below (an FMA). q * s_b is exact, so that side needs none.
  target = jax.lax.optimization_barrier(xb * s_enc[..., None])

  def err(s_b):
    q = e2m1_decode(e2m1_encode_rne(_nv_scaled(xb, s_b, outer)))
    return _unit_sum(jnp.square(q * ieee.e4m3_to_f32(s_b)[..., None] - target), cfg)

  s6 = _nv_block_scale(amax_b, s_enc, 6.0, headroom, scale_cap(outer))
  s4 = _nv_block_scale(amax_b, s_enc, 4.0, headroom)
  four = (err(s4) < err(s6)) & (ieee.e4m3_to_f32(s4) <= scale_cap(outer, 4.0))
  return jnp.where(four, s4, s6)


def _quantize_nv(xb, cfg: _Cfg, *, u, key, tensor_amax) -> _Result:
  """NVFP4 (global, 4/6 or tile-local): E4M3 block scales under an FP32 outer factor 1 / S_enc."""
  del key
  spec = cfg.spec
  xk = xb.reshape(*xb.shape[:-2], xb.shape[-2] * xb.shape[-1])  # [..., n]
  amax = _OUTER_AMAX[spec.outer](xk, cfg, tensor_amax)  # () or [...]
  headroom = NV_HEADROOM[cfg.rounding]
  s_enc = nvfp4_encode_scale(amax, spec.scale_max / headroom)
  s_enc_b = s_enc if s_enc.ndim == 0 else s_enc[..., None]  # broadcasts against [..., nb]
  bad = _unit_nonfinite(xb, cfg) | ~jnp.isfinite(s_enc_b)
  amax_b = jnp.where(bad, 0.0, _unit_max(jnp.abs(xb), cfg))  # [..., nb]
  s_enc_b = jnp.where(bad, 1.0, s_enc_b)
  outer = nvfp4_outer(s_enc)
  outer_b = jnp.where(bad, 1.0, outer if outer.ndim == 0 else outer[..., None])  # 1 / s_enc_b, divided once
  if spec.four_over_six:
    s_b = _four_over_six(xb, amax_b, s_enc_b, outer_b, cfg, headroom)
  else:
    s_b = _nv_block_scale(amax_b, s_enc_b, E2M1_MAX, headroom, scale_cap(outer_b))
  codes = _encode(_nv_scaled(xb, s_b, outer_b), cfg, u)
  return _Result(codes, s_b, outer, bad)


def eden_decode_scale(amax: jax.Array) -> jax.Array:
  """MS-EDEN's per-tensor decode scale s_dec = amax * fp32(1 / (255.99 * val_max)) (1 when amax = 0, at least
  float32 tiny; NaN stays NaN), also the QTensor's outer factor."""
  s_dec = amax * jnp.float32(1 / (EDEN_AMAX_DIV * EDEN_VAL_MAX))
  return jnp.where(amax == 0, 1.0, jnp.maximum(s_dec, _F32_TINY))


def _eden_targets(xb: jax.Array, tensor_amax) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """MS-EDEN up to the scale's SR: (codes [..., nb, B], t [..., nb], s_dec, bad [..., nb]) (module docstring)."""
  lead, nb = xb.shape[:-2], xb.shape[-2]
  amax = _amax(xb) if tensor_amax is None else quantize_args.amax_value(tensor_amax)
  s_dec = eden_decode_scale(amax)
  per_group = EDEN_GROUP // xb.shape[-1]
  bad = jnp.any(~jnp.isfinite(xb), axis=-1)  # [..., nb]
  bad = jnp.repeat(bad.reshape(*lead, nb // per_group, per_group).any(-1), per_group, axis=-1)
  bad = bad | ~jnp.isfinite(s_dec)
  amax_b = jnp.where(bad, 0.0, jnp.max(jnp.abs(xb), axis=-1))  # [..., nb]
  s_b = ieee.e4m3_to_f32(e4m3_rn(jnp.minimum(ieee.div(amax_b * jnp.float32(1 / EDEN_VAL_MAX), s_dec), E4M3_MAX)))
  s_b = jnp.where(s_b == 0, 1.0, s_b)
  ys = ieee.div(xb, (s_b * s_dec)[..., None])  # [..., nb, B]
  codes = e2m1_encode_rne(ys)
  q = e2m1_decode(codes)
  groups = (*lead, nb // per_group, EDEN_GROUP)
  num = _tree_sum((ys * ys).reshape(groups), -1)  # [..., n / 128]
  den = _tree_sum((ys * q).reshape(groups), -1)
  c = jnp.where(den == 0, 1.0, ieee.div(num, jnp.where(den == 0, 1.0, den)))
  t = jnp.minimum(s_b * jnp.repeat(c, per_group, axis=-1), scale_cap(s_dec))  # [..., nb]
  return codes, jnp.where(bad, 1.0, t), s_dec, bad


def _quantize_eden(xb, cfg: _Cfg, *, u, key, tensor_amax) -> _Result:
  """MS-EDEN (Quartet II): RTN codes, E4M3 scales corrected per 128 group and rounded stochastically."""
  del u, cfg
  codes, t, s_dec, bad = _eden_targets(xb, tensor_amax)
  k0, k1 = prng.seed_words(key, prng.STREAM_SCALE_SR)
  scales = e4m3_sr(t, prng.uniform_from_bits(prng.hash_bits(k0, k1, prng.flat_index(t.shape))))
  return _Result(codes, scales, jnp.where(jnp.isfinite(s_dec), s_dec, jnp.nan), bad)


_METHODS: dict[str, Callable[..., _Result]] = {"e8m0": _quantize_mx, "e4m3": _quantize_nv, "eden": _quantize_eden}
_NAN_SCALE_BITS = {"e8m0": _E8M0_NAN, "e4m3": _E4M3_NAN}


@functools.partial(jax.jit, static_argnames=("fmt", "axis", "rounding", "scale_rule", "tile_2d",
                                             "clip_fraction", "tile_rows"))
def quantize(x: jax.Array, fmt: str = "mxfp4", *, axis: int = -1, rounding: str = "rne",
             key: jax.Array | None = None, scale_rule: str | None = None, tile_2d: bool = False,
             clip_fraction: float | None = None, tile_rows: int = 128,
             tensor_amax: jax.Array | None = None) -> QTensor:
  """Quantizes `x` to FP4 along `axis` (see the module docstring and docs/NUMERICS.md).

  Args:
    x: floating-point array (bf16 / f16 / f32; f64 under jax_enable_x64), any rank; `x.shape[axis]` a multiple
      of the format's block. Computed in float32 (`ieee.to_float32`): a float64 x is rounded to float32 first, its
      finite values beyond float32's range saturating, so a value within float32's rounding of an FP4 rounding
      boundary rounds as its float32 neighbour does.
    fmt: a key of `fp4jax.numerics.formats.FORMATS` (the FP8 ones: `numerics.current_scaling`, rounding "rne" only).
    axis: the quantized (contraction) axis; it becomes the last axis of the K-major result.
    rounding: "rne", "sr" (stochastic; needs `key`) or "eden" (MS-EDEN, fmt "nvfp4", input already rotated,
      axis length a multiple of 128; needs `key`).
    key: JAX PRNG key for "sr" / "eden".
    scale_rule: mxfp4 only: "ocp" or "noclip"; default "noclip" for SR and 2-D tiles, else "ocp".
    tile_2d: 2-D inputs only: one scale per block x block tile, the same for both orientations.
    clip_fraction: mxfp4 only: Hu's bounded clipping (0.87), one exponent finer when amax / (6 * 2^E) is below it.
    tile_rows: rows per tile of "nvfp4_tile".
    tensor_amax: a precomputed amax for the tensor scale (global NVFP4 / EDEN); computed from `x` when None. One
      that is infinite, NaN or negative makes the tensor NaN (`quantize_args.amax_value`).

  Returns:
    QTensor with K-major codes `[..., n // 2]`, scales `[..., n // block]` and the format's outer factor.

  Not a differentiable fake-quantizer: the codes are integers, so `jax.grad` through quantize -> dequantize is
  zero, but for a spike at the element that sets a per-tensor amax. Training quantizes through `fp4_dot`,
  whose custom VJP quantizes each GEMM's operands by the route.
  """
  spec = get_format(fmt)
  cfg = _check(x, spec, axis, rounding, key, scale_rule, tile_2d, clip_fraction, tile_rows, tensor_amax)
  if not spec.block_scaled:  # FP8, one factor per tensor (`numerics.current_scaling`)
    return current_scaling.quantize(x, spec, cfg.axis, rounding=rounding, tile_2d=tile_2d, tensor_amax=tensor_amax)
  xk = jnp.moveaxis(ieee.to_float32(x), cfg.axis, -1)  # [..., n]
  lead, n = xk.shape[:-1], xk.shape[-1]
  xb = xk.reshape(*lead, n // spec.block, spec.block)  # [..., nb, B]
  u = None
  if rounding == "sr":
    counters = jnp.moveaxis(prng.flat_index(x.shape), cfg.axis, -1).reshape(xb.shape)
    k0, k1 = prng.seed_words(key, prng.STREAM_ELEMENT_SR)
    u = prng.uniform_from_bits(prng.hash_bits(k0, k1, counters))
  method = "eden" if rounding == "eden" else spec.scale
  res = _METHODS[method](xb, cfg, u=u, key=key, tensor_amax=tensor_amax)
  codes = jnp.where(res.bad[..., None], jnp.uint8(0), res.codes).reshape(*lead, n)
  nan_scale = jax.lax.bitcast_convert_type(jnp.uint8(_NAN_SCALE_BITS[spec.scale]), spec.scale_dtype)
  scales = jnp.where(res.bad, nan_scale, res.scales.astype(spec.scale_dtype))
  return QTensor(pack_codes(codes), scales, res.outer, fmt=spec.name, axis=cfg.axis, shape=tuple(x.shape))


@jax.jit
def encode_like(x: jax.Array, like: QTensor) -> QTensor:
  """RNE-encodes `x` (shaped like `like.shape`) onto the scales and outer factor of an existing QTensor.

  v = x / (scale * outer) per block. Values that `like` represents come back as `like`'s own codes, whatever
  rounding produced them; blocks whose scale is NaN get zero codes, blocks whose scale is 0 (all-zero blocks)
  signed zeros. `like` is a block-scaled (FP4) QTensor: an FP8 one has no scales to encode onto.
  """
  _check_qtensor(like, "encode_like's like=")
  if like.scales is None:
    raise ValueError(f"encode_like encodes onto a block-scaled QTensor's scales; {like.fmt!r} has none")
  if tuple(x.shape) != tuple(like.shape):  # a transposed x of as many elements would reshape into garbage
    raise ValueError(f"encode_like takes x shaped like the QTensor it encodes onto: x.shape={tuple(x.shape)}, "
                     f"like.shape={tuple(like.shape)}")
  spec = like.spec
  xk = jnp.moveaxis(ieee.to_float32(x), like.axis, -1)  # [..., n]
  lead, n = xk.shape[:-1], xk.shape[-1]
  scale = decode_scales(like.scales, spec)  # [..., nb]
  if like.outer is not None:
    scale = scale * (like.outer if like.outer.ndim == 0 else like.outer[..., None])
  xb = xk.reshape(*lead, n // spec.block, spec.block)
  v = jnp.where(scale[..., None] == 0, jnp.copysign(jnp.float32(0), xb), ieee.div(xb, scale[..., None]))
  codes = jnp.where(jnp.isnan(scale)[..., None], jnp.uint8(0), e2m1_encode_rne(jnp.clip(v, -E2M1_MAX, E2M1_MAX)))
  return dataclasses.replace(like, codes=pack_codes(codes.reshape(*lead, n)))


def _check_qtensor(q, what: str) -> None:
  """A TypeError starting with `what` unless `q` is a QTensor (an array's missing fields fail obscurely)."""
  if not isinstance(q, QTensor):
    got = f"an array of shape {q.shape}" if hasattr(q, "shape") else f"a {type(q).__name__}"
    raise TypeError(f"{what} takes a QTensor (from quantize), got {got}")


def decode_scales(scales: jax.Array, spec: FormatSpec) -> jax.Array:
  """float32 block scales: 2^(s - 127) for E8M0 (255 -> NaN), the E4M3 value otherwise."""
  if spec.scale == "e8m0":
    s = scales.astype(jnp.int32)
    bits = jnp.where(s == 0, 1 << 22, s << 23)  # 2^(s - 127) from its bits; byte 0 is the subnormal 2^-127
    return jnp.where(s == _E8M0_NAN, jnp.nan, jax.lax.bitcast_convert_type(bits, jnp.float32))
  return ieee.e4m3_to_f32(scales)


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize(q: QTensor, dtype=jnp.float32) -> jax.Array:
  """The values a QTensor stands for, in the original shape, as `dtype`: element(code) * scale * outer (FP8: no
  block scale), each product rounded once whatever the backend's flush-to-zero (`ieee.mul_scale`). `dtype`: a
  floating-point dtype (an integer one would truncate the values; float64 needs jax_enable_x64, without which JAX
  would return float32)."""
  _check_qtensor(q, "dequantize")
  q.check_codes("dequantize got")
  dtype = float_dtype(dtype, "dequantize's dtype=")
  spec, vals = q.spec, q.element_values()  # [..., n]
  *lead, n = vals.shape
  if q.scales is not None:  # 2^-127 (E8M0 byte 0) is subnormal: `ieee.mul_scale` keeps it
    scale = decode_scales(q.scales, spec)[..., None]
    vals = ieee.mul_scale(vals.reshape(*lead, n // spec.block, spec.block), scale).reshape(vals.shape)
  if q.outer is not None:
    vals = ieee.mul_scale(vals, q.outer if q.outer.ndim == 0 else q.outer[..., None])
  return jnp.moveaxis(vals, -1, q.axis).astype(dtype)
