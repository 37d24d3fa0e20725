"""An independent numpy implementation of fp4jax's quantizers, written from docs/NUMERICS.md's formulas.

It shares no code with fp4jax.reference: E2M1 rounding by nearest value in a table, E4M3 rounding by ml_dtypes,
MX exponents from np.frexp / log2 with exact correction, the counter hash re-implemented in numpy uint32.
Arithmetic that decides bits is float32 in the order the contract states (fp4jax/reference.py docstring).
Returns unpacked K-major codes (uint8), scales as raw uint8 bits and the outer factor (float32 or None).
"""

from __future__ import annotations

import math
from fractions import Fraction

import jax
import ml_dtypes
import numpy as np

F32 = np.float32
GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], F32)
BLOCK = {"mxfp4": 32, "nvfp4": 16, "nvfp4_46": 16, "nvfp4_tile": 16}
SCALE_MAX = {"nvfp4": 448.0, "nvfp4_46": 256.0, "nvfp4_tile": 448.0}
E4M3 = ml_dtypes.float8_e4m3fn
# NVFP4 SR headroom: targets shrink by 17/16 so that no block max clips (fp4jax/reference.py docstring).
HEADROOM = {"rne": Fraction(1), "sr": Fraction(17, 16)}


def _f32_at_least(q: Fraction) -> np.float32:
  """The smallest float32 >= q (q positive, in the normal range)."""
  c = F32(float(q))
  return c if Fraction(float(c)) >= q else np.nextafter(c, F32(np.inf))


def inv_target(vmax: float, rounding: str) -> np.float32:
  """The block-scale multiplier: fp32(1 / vmax) for RNE, the smallest float32 >= 17/16 / vmax * (1 + 2^-22)
  for SR (the margin covers float32 rounding in the no-clip bound)."""
  h = HEADROOM[rounding]
  return F32(1 / vmax) if h == 1 else _f32_at_least(h / Fraction(vmax) * (1 + Fraction(1, 2**22)))


# ----------------------------------------------------------------------------------------------- counter hash


def _fmix(h: np.ndarray) -> np.ndarray:
  h = h.astype(np.uint32)
  with np.errstate(over="ignore"):
    h ^= h >> np.uint32(16)
    h = (h * np.uint32(0x85EBCA6B)).astype(np.uint32)
    h ^= h >> np.uint32(13)
    h = (h * np.uint32(0xC2B2AE35)).astype(np.uint32)
    h ^= h >> np.uint32(16)
  return h


def seed(key, stream: int) -> tuple[np.uint32, np.uint32]:
  data = np.asarray(jax.random.key_data(key)).astype(np.uint32).reshape(-1)
  salt = np.uint32((stream * 0x632BE5AB + 0x1B873593) & 0xFFFFFFFF)
  return _fmix(np.array([data[0] ^ salt], np.uint32))[0], data[-1]


def uniforms(key, stream: int, counters: np.ndarray) -> np.ndarray:
  """float32 uniforms in [0, 1) for uint32 counters: top 24 bits of the hash times 2^-24."""
  k0, k1 = seed(key, stream)
  with np.errstate(over="ignore"):
    h = _fmix((counters.astype(np.uint32) * np.uint32(0x9E3779B9)).astype(np.uint32) ^ k0)
  h = _fmix(h ^ k1)
  return (h >> np.uint32(8)).astype(F32) * F32(2.0**-24)


def fold_in_words(key, data: int) -> np.ndarray:
  """uint32 key data derived from `key` (typed) for one uint32 `data`: fp4jax's `prng.fold_in`, written from
  its docstring's chain of murmur3 finalisers."""
  words = np.asarray(jax.random.key_data(key)).astype(np.uint32).reshape(-1)
  with np.errstate(over="ignore"):
    h = _fmix(np.array([(data * 0x9E3779B9) & 0xFFFFFFFF], np.uint32) ^ words[0])
    for w in words[1:]:
      h = _fmix(h ^ w)
    out = [_fmix(h ^ np.uint32((j + 1) * 0x632BE5AB & 0xFFFFFFFF))[0] for j in range(len(words))]
  return np.array(out, np.uint32)


def sign_bits(key, stream: int, n: int) -> np.ndarray:
  k0, k1 = seed(key, stream)
  with np.errstate(over="ignore"):
    h = _fmix((np.arange(n, dtype=np.uint32) * np.uint32(0x9E3779B9)).astype(np.uint32) ^ k0)
  return _fmix(h ^ k1) >> np.uint32(31)


# ----------------------------------------------------------------------------------------------- element rounding


def e2m1_rne(v: np.ndarray) -> np.ndarray:
  """Nearest grid magnitude (ties to the even code index), saturating; sign in bit 3."""
  mag = np.minimum(np.abs(v.astype(np.float64)), 6.0)
  dist = np.abs(mag[..., None] - GRID.astype(np.float64))  # [..., 8]
  best = dist.min(-1, keepdims=True)
  cand = dist == best
  # Of (at most two) nearest points, prefer the even index.
  even = cand & (np.arange(8) % 2 == 0)
  idx = np.where(even.any(-1), even.argmax(-1), cand.argmax(-1)).astype(np.uint8)
  return idx | np.where(np.signbit(v), np.uint8(8), np.uint8(0))


def e2m1_sr(v: np.ndarray, u: np.ndarray) -> np.ndarray:
  mag = np.minimum(np.abs(v), F32(6)).astype(F32)
  lo_idx = np.searchsorted(GRID, mag, side="right") - 1
  hi_idx = np.minimum(lo_idx + 1, 7)
  lo, hi = GRID[lo_idx], GRID[hi_idx]
  with np.errstate(invalid="ignore", divide="ignore"):
    p = np.where(hi > lo, (mag - lo) / (hi - lo), F32(0)).astype(F32)
  idx = (lo_idx + (u < p)).astype(np.uint8)
  return idx | np.where(np.signbit(v), np.uint8(8), np.uint8(0))


def e2m1_value(codes: np.ndarray) -> np.ndarray:
  return np.where(codes & 8, -1, 1).astype(F32) * GRID[codes & 7]


def e4m3_rn(v) -> np.ndarray:
  return np.asarray(v, F32).astype(E4M3)


def e4m3_sr(t: np.ndarray, u: np.ndarray) -> np.ndarray:
  """SR between neighbouring E4M3 values, found from the table of all finite positive codes."""
  table = np.arange(0x7F, dtype=np.uint8).view(E4M3).astype(F32)  # codes 0..126, increasing
  lo_b = (np.searchsorted(table, t, side="right") - 1).astype(np.int64)
  hi_b = np.minimum(lo_b + 1, 0x7E)
  lo, hi = table[lo_b], table[hi_b]
  with np.errstate(invalid="ignore", divide="ignore"):
    p = np.where(hi > lo, (t - lo) / (hi - lo), F32(0)).astype(F32)
  return np.where(u < p, hi_b, lo_b).astype(np.uint8)


def scale_cap(factor, vmax: float = 6.0) -> np.ndarray:
  """The largest finite E4M3 value T whose top decoded value fp32(vmax * T) * factor is finite (the block scale
  cap that keeps huge finite inputs from decoding to inf), per element of `factor`; 0 where none is (a NaN)."""
  table = np.arange(0x7F, dtype=np.uint8).view(E4M3).astype(F32)  # codes 0..126, increasing
  with np.errstate(over="ignore", invalid="ignore"):
    ok = np.isfinite((table * F32(vmax)).astype(F32) * np.asarray(factor, F32)[..., None])
  return np.where(ok, table, F32(0)).max(-1).astype(F32)


def tree_sum(a: np.ndarray, axis: int) -> np.ndarray:
  a = np.moveaxis(a, axis, -1)
  while a.shape[-1] > 1:
    h = a.shape[-1] // 2
    a = (a[..., :h] + a[..., h:]).astype(F32)
  return a[..., 0]


# ----------------------------------------------------------------------------------------------- quantizers


def _mx_exponent(amax: float, rule: str, clip_fraction) -> int:
  if amax == 0 or amax < 2.0**-126:
    return -127
  _, e = np.frexp(np.float64(amax))
  floor_log2 = int(e) - 1
  if rule == "ocp":
    ex = floor_log2 - 2
  else:
    ex = math.ceil(math.log2(amax / 6.0))
    while amax / 2.0**ex > 6.0:
      ex += 1
    while amax / 2.0**(ex - 1) <= 6.0:
      ex -= 1
  if clip_fraction is not None and amax / 2.0**ex < F32(6.0 * clip_fraction):
    ex -= 1
  return int(np.clip(ex, -127, 125))  # 6 * 2^125: the largest block max float32 holds


def _units(xk: np.ndarray, block: int, tile_2d: bool, axis: int):
  """Blocks [..., nb, B] of the K-major array, and max / sum over each scale unit (block or 2-D tile)."""
  lead = xk.shape[:-1]
  nb = xk.shape[-1] // block
  xb = xk.reshape(*lead, nb, block)

  def umax(a):
    m = a.max(-1)
    if tile_2d:
      r = m.shape[0]
      m = np.repeat(m.reshape(r // block, block, nb).max(1), block, axis=0)
    return m

  def usum(a):
    if not tile_2d:
      return tree_sum(a, -1)
    r = a.shape[0]
    t = a.reshape(r // block, block, nb, block)
    s = tree_sum(tree_sum(t, 1), 2) if axis == 0 else tree_sum(tree_sum(t, 3), 1)
    return np.repeat(s, block, axis=0)

  return xb, umax, usum


def nv_s_enc(amax, scale_max, rounding="rne"):
  """S_enc = fp32(scale_max * 6 / headroom) / amax (1 for amax = 0, NaN for a non-finite amax)."""
  amax = F32(amax)
  if not np.isfinite(amax):
    return F32(np.nan)
  if amax == 0:
    return F32(1)
  with np.errstate(over="ignore"):
    s = F32(float(Fraction(scale_max) * 6 / HEADROOM[rounding])) / amax
  return F32(min(s, np.finfo(F32).max))


def quantize_np(x, fmt: str, *, axis: int = -1, rounding: str = "rne", key=None, scale_rule=None,
                tile_2d: bool = False, clip_fraction=None, tile_rows: int = 128):
  """(codes [K-major, unpacked] uint8, scale bits uint8 [..., nb], outer float32 or None)."""
  x = np.asarray(x.astype(np.float32) if hasattr(x, "astype") else x, F32)
  axis %= x.ndim
  block = BLOCK[fmt]
  counters = np.moveaxis(np.arange(x.size, dtype=np.uint32).reshape(x.shape), axis, -1)
  xk = np.moveaxis(x, axis, -1)
  lead, n = xk.shape[:-1], xk.shape[-1]
  xb, umax, usum = _units(xk, block, tile_2d, axis)
  bad = umax((~np.isfinite(xb)).astype(np.uint8)) > 0  # [..., nb]
  amax_b = np.where(bad, 0, umax(np.abs(np.where(np.isfinite(xb), xb, 0)))).astype(F32)
  u = uniforms(key, 0, counters).reshape(xb.shape) if rounding == "sr" else None
  enc = (lambda v: e2m1_sr(v, u)) if rounding == "sr" else e2m1_rne
  if fmt == "mxfp4":
    rule = scale_rule or ("noclip" if (rounding == "sr" or tile_2d) else "ocp")
    e = np.vectorize(lambda a: _mx_exponent(float(a), rule, clip_fraction), otypes=[np.int64])(amax_b)
    with np.errstate(over="ignore", invalid="ignore"):  # non-finite blocks; masked below
      v = (xb * np.exp2(-e.astype(np.float64))[..., None]).astype(F32)
    codes = enc(np.clip(v, -6, 6))
    scales = (e + 127).astype(np.uint8)
    codes[bad] = 0
    scales[bad] = 0xFF
    return codes.reshape(*lead, n), scales, None
  if rounding == "eden":
    return _eden_np(xb, key, bad)
  # NVFP4 family: the amax governing each row.
  if fmt == "nvfp4_tile":
    rows = xk.reshape(-1, n)
    r = rows.shape[0]
    row_amax = np.array([np.abs(rows[i:i + tile_rows]).max() if np.isfinite(rows[i:i + tile_rows]).all() else np.nan
                         for i in range(0, r, tile_rows)], F32)
    s_enc_rows = np.repeat([nv_s_enc(a, SCALE_MAX[fmt], rounding) for a in row_amax], tile_rows)[:r].astype(F32)
    s_enc = s_enc_rows.reshape(lead)[..., None]  # [..., 1]
    outer = np.where(np.isfinite(s_enc_rows), F32(1) / s_enc_rows, np.nan).astype(F32).reshape(lead)
  else:
    amax_t = np.abs(x).max() if np.isfinite(x).all() else np.nan
    s = nv_s_enc(amax_t, SCALE_MAX[fmt], rounding)
    s_enc = np.full(lead + (1,), s, F32)
    outer = F32(1) / s if np.isfinite(s) else F32(np.nan)
  bad = bad | ~np.isfinite(s_enc)
  s_enc = np.where(np.isfinite(s_enc), s_enc, F32(1)).astype(F32)

  inv = (F32(1) / s_enc).astype(F32)  # outer, fp32(1 / S_enc), per unit

  def scale_for(vmax, cap=F32(448)):
    return e4m3_rn(np.minimum(amax_b * (s_enc * inv_target(vmax, rounding)), cap))

  def scaled(s_b):  # x * enc_b, enc_b = 1 / fp32(s_b * outer): Transformer Engine's order
    sf = s_b.astype(F32)
    with np.errstate(divide="ignore", over="ignore"):
      e = F32(1) / (np.where(sf == 0, F32(1), sf) * inv).astype(F32)
      e = np.where(sf == 0, F32(0), np.minimum(e, np.finfo(F32).max))
    return np.clip((xb * e.astype(F32)[..., None]).astype(F32), -6, 6)

  if fmt == "nvfp4_46":
    target = (xb * s_enc[..., None]).astype(F32)

    def err(s_b):
      q = e2m1_value(e2m1_rne(scaled(s_b)))
      d = ((q * s_b.astype(F32)[..., None]).astype(F32) - target).astype(F32)
      return usum((d * d).astype(F32))

    s6, s4 = scale_for(6.0, scale_cap(inv)), scale_for(4.0)
    with np.errstate(invalid="ignore", over="ignore"):  # target 4 only where its codes (<= 4) decode finite
      s_b = np.where((err(s4) < err(s6)) & (s4.astype(F32) <= scale_cap(inv, 4.0)), s4, s6)
  else:
    s_b = scale_for(6.0, scale_cap(inv))
  with np.errstate(invalid="ignore"):
    codes = enc(scaled(s_b))
  scales = s_b.view(np.uint8).copy()
  codes[bad] = 0
  scales[bad] = 0x7F
  return codes.reshape(*lead, n), scales, outer


def eden_targets_np(xb, bad):
  """MS-EDEN up to the scale's SR: (codes, t [..., nb] float32, s_dec, bad), in the float32 order of
  fp4jax/reference.py's docstring (every product and quotient rounded to float32 on its own)."""
  lead, nb = xb.shape[:-2], xb.shape[-2]
  amax = np.abs(xb).max() if np.isfinite(xb).all() else np.nan
  val_max = 6.0 / ((17 / 16) * 0.93)
  s_dec = F32(amax) * F32(1 / (255.99 * val_max))
  s_dec = F32(1) if amax == 0 else max(s_dec, np.finfo(F32).tiny)
  if not np.isfinite(amax):
    s_dec = F32(np.nan)
  bad = np.repeat(bad.reshape(*lead, nb // 8, 8).any(-1), 8, -1) | (not np.isfinite(s_dec))
  amax_b = np.where(bad, 0, np.abs(np.where(np.isfinite(xb), xb, 0)).max(-1)).astype(F32)
  with np.errstate(invalid="ignore"):
    s_b = e4m3_rn(np.minimum((amax_b * F32(1 / val_max)).astype(F32) / s_dec, F32(448))).astype(F32)
  s_b = np.where(s_b == 0, F32(1), s_b)
  with np.errstate(invalid="ignore"):
    ys = (xb / (s_b * s_dec).astype(F32)[..., None]).astype(F32)
    codes = e2m1_rne(ys)
    q = e2m1_value(codes)
    g = (*lead, nb // 8, 128)
    num = tree_sum((ys * ys).astype(F32).reshape(g), -1)
    den = tree_sum((ys * q).astype(F32).reshape(g), -1)
    c = np.where(den == 0, F32(1), num / np.where(den == 0, F32(1), den)).astype(F32)
    t = np.minimum((s_b * np.repeat(c, 8, -1)).astype(F32), scale_cap(s_dec))
  return codes, np.where(bad, F32(1), t).astype(F32), F32(s_dec), bad


def _eden_np(xb, key, bad):
  codes, t, s_dec, bad = eden_targets_np(xb, bad)
  u = uniforms(key, 1, np.arange(t.size, dtype=np.uint32)).reshape(t.shape)
  scales = e4m3_sr(t, u)
  codes[bad] = 0
  scales[bad] = 0x7F
  return codes.reshape(*xb.shape[:-2], xb.shape[-2] * 16), scales, s_dec


def dequantize_np(codes, scale_bits, outer, fmt: str) -> np.ndarray:
  """K-major float32 values: e2m1(code) * scale * outer."""
  block = BLOCK[fmt]
  if fmt == "mxfp4":
    s = np.where(scale_bits == 255, np.nan, np.exp2(scale_bits.astype(np.float64) - 127))
  else:
    s = scale_bits.view(E4M3).astype(np.float64)
  v = e2m1_value(codes).reshape(*codes.shape[:-1], -1, block) * s[..., None]
  v = v.reshape(codes.shape)
  if outer is not None:
    v = v * (outer if np.ndim(outer) == 0 else np.asarray(outer)[..., None])
  return v


# ----------------------------------------------------------------------------------------------- FP8, per tensor

FP8 = {"fp8_e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "fp8_e5m2": (ml_dtypes.float8_e5m2, 57344.0)}


def fp8_current_np(x, fmt: str, *, axis: int = -1):
  """Per-tensor current scaling (Transformer Engine's Float8CurrentScaling): (value bytes uint8 [K-major], outer).

  S = fp32(max / amax) (1 for amax 0, float32 max where it overflows), values = RNE(clip(x * S, +-max)) by
  ml_dtypes, outer = fp32(1 / S); any NaN or Inf makes every value NaN and outer NaN.
  """
  dtype, fmax = FP8[fmt]
  xk = np.moveaxis(np.asarray(x, F32), axis, -1)
  if not np.isfinite(xk).all():
    return np.full(xk.shape, np.nan, F32).astype(dtype).view(np.uint8), F32(np.nan)
  amax = np.abs(xk).max(initial=F32(0))
  with np.errstate(over="ignore"):
    s = F32(1) if amax == 0 else np.minimum(F32(fmax) / amax, np.finfo(F32).max)
  values = np.clip((xk * s).astype(F32), -fmax, fmax).astype(dtype)
  return values.view(np.uint8), F32(1) / s


def fp8_dequantize_np(value_bits, outer, fmt: str) -> np.ndarray:
  """K-major float32 values: fp8 value * outer, one rounding."""
  return (value_bits.view(FP8[fmt][0]).astype(np.float64) * np.float64(outer)).astype(F32)
