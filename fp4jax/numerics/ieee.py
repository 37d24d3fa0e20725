"""float32 arithmetic with the same bits on every backend, where XLA's own operations do not guarantee them.

Three XLA:GPU behaviours (measured on an H200, JAX 0.11.2) made the reference quantizers' NVFP4 codes depend on
the backend, and disagree with a GPU kernel that follows their definition:
  * float32 division is not correctly rounded: it compiles to PTX `div.full.f32`, an approximation within
    2 ulps (29% of 2^20 random quotients off, against 3 on CPU, all three in the subnormal range that XLA:CPU
    flushes to zero). `div` computes the correctly rounded quotient through float64.
  * a float32 -> float8_e4m3fn -> float32 round trip inside one computation does not round (131,071 of
    131,072 values came back unrounded): XLA may drop such convert pairs (`--xla_allow_excess_precision`,
    on by default). `e4m3_to_f32` decodes the float8 bytes instead, which nothing can simplify away. The same
    pass drops a float32 -> bf16 -> float32 pair, so `to_float32` reads a bf16 x from its bits (`bf16_to_f32`).
  * a float64 quotient of two float32 operands whose only use is its cast back to float32 is narrowed by LLVM
    into a float32 division, which XLA:GPU then emits as an approximation (`rcp.approx.f32` for 1 / b in the
    PTX of an H200 target): `div` gives its float64 quotient a second use wherever no run-time factor
    follows the division (`tests/test_dot_kernels.py` reads fp4_dot's PTX for any approximation).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_SIGN = np.uint32(0x80000000)
_EXP_INF = np.uint32(0x7F800000)
_TINY = 2.0**-126  # the smallest normal float32
_SUBNORMAL_UNITS = 2.0**149  # float32 subnormals are integer multiples of 2^-149


def to_float32(x: jax.Array) -> jax.Array:
  """x as float32, the quantizers' working precision. A float64 x (jax_enable_x64) is rounded once; its finite
  values beyond float32's range saturate to +-3.4028235e38, where the cast alone would make them inf and their
  blocks NaN (inf and NaN stay). Narrower float dtypes convert exactly; bf16 from its bits (`bf16_to_f32`)."""
  if x.dtype == jnp.float64:
    top = jnp.float64(np.finfo(np.float32).max)
    x = jnp.where(jnp.isfinite(x), jnp.clip(x, -top, top), x)
  return bf16_to_f32(x) if x.dtype == jnp.bfloat16 else x.astype(jnp.float32)


def bf16_to_f32(x: jax.Array) -> jax.Array:
  """A bf16 x as float32, from its stored bits (the high half of a float32). XLA:GPU drops a float32 -> bf16 ->
  float32 convert pair (`--xla_allow_excess_precision`, on by default), so `x.astype(jnp.float32)` of a bf16 x
  computed from float32 in the same program (a cotangent dY cast to the output's dtype) gave the quantizers
  the unrounded float32, and their codes differed from the kernels', which read x's bits
  (`tests/test_dot_kernels.py` reads an H200 program for dropped pairs)."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def div(a: jax.Array, b: jax.Array, *, b_normal: bool = False, normal_result: bool = False) -> jax.Array:
  """a / b in float32, rounded to nearest even as IEEE 754 specifies (subnormal results included). Broadcasts
  like `/`; NaN, infinities and zeros follow IEEE 754.

  The quotient is taken in float64 and rounded to float32. Rounding twice is exact here: a quotient of two
  24-bit significands rounded to 53 bits, then to p <= 24 bits, equals the quotient rounded to p bits once
  whenever 53 >= 2p + 2 (Figueroa, "When is double rounding innocuous?", SIGNUM 1995), and float64 division
  is correctly rounded on CPU and GPU alike, unlike XLA:GPU's float32 `/`. What XLA:CPU does to subnormals
  is kept out: subnormal operands enter lifted by 2^64 (`lift`, from their bits), and a subnormal quotient
  is assembled from its integer count of 2^-149 (the cast would flush it to zero). A few dozen operations
  where an integer long division took about a hundred: the NVFP4 set-up divides a few times per operand, and
  the change cut a scanned NVFP4 train step's program by over a third (docs/BENCHMARKS.md).

  Lifting is most of those operations, so it is skipped where it cannot matter: a NumPy or Python operand (a
  constant numerator) is lifted while tracing, and `b_normal=True` is the caller's promise that b is never
  subnormal (normal, zero, infinite or NaN), so b enters as it is. `normal_result=True` promises that no
  quotient is subnormal (a zero, which the float64 -> float32 cast keeps with its sign, is fine): the
  subnormal assembly, a dozen operations, is left out. Where no operand is lifted at run time (constants, or
  `b_normal`), nothing would use the float64 quotient but its cast to float32, which XLA:GPU narrows into its
  approximate division (the module docstring); a comparison of |q| with the smallest normal, which turns the
  quotients the promise excludes into signed zeros, keeps it in a second use (three operations, not twelve).
  """
  la, sa = lift(a)
  lb, sb = (jnp.asarray(b, jnp.float32), 0) if b_normal else lift(b)  # a = la * 2^-sa, b = lb * 2^-sb
  scaled = not (_is_zero(sa) and _is_zero(sb))  # a shift known only at run time: q is scaled in float64
  la, lb = jnp.broadcast_arrays(la, lb)
  with jax.enable_x64(True):
    q = la.astype(jnp.float64) / lb.astype(jnp.float64)
    if scaled:
      q = q * _pow2_f64(jnp.broadcast_to(jnp.asarray(sb) - jnp.asarray(sa), q.shape))  # exact: normal range
    if normal_result:
      r = q.astype(jnp.float32)
      return r if scaled else jnp.where(jnp.abs(q) < _TINY, r * 0, r)  # a second use of q (docstring)
    mag = jnp.abs(q)
    units = jnp.rint(mag * _SUBNORMAL_UNITS)  # subnormal results: RNE to a multiple of 2^-149 (<= 2^23)
    sign = jnp.where(jnp.signbit(q), _SIGN, np.uint32(0))
    subnormal = jax.lax.bitcast_convert_type(sign | units.astype(jnp.uint32), jnp.float32)
    return jnp.where(mag < _TINY, subnormal, q.astype(jnp.float32))


def _is_zero(shift) -> bool:
  """Whether a `lift` shift is known while tracing to be 0 everywhere (a constant operand, or b_normal)."""
  return isinstance(shift, (int, np.integer, np.ndarray)) and not np.any(shift)


def _pow2_f64(e: jax.Array) -> jax.Array:
  """float64 2**e for int32 e in [-1022, 1023], from the exponent bits (call under `jax.enable_x64`)."""
  return jax.lax.bitcast_convert_type((e.astype(jnp.int64) + 1023) << 52, jnp.float64)


def amax_factor(numerator: jax.Array, amax: jax.Array) -> jax.Array:
  """The encode factor a scale-from-amax recipe aims with: fp32(numerator / amax) correctly rounded (`div`),
  1 where amax = 0 (nothing to scale), at most float32 max (an amax so small the quotient overflows); NaN
  stays NaN. NVFP4's S_enc (numerator 448 * 6, over a headroom) and FP8 current scaling's S (the element max)
  are both this.

  A constant numerator >= 4 (theirs) keeps every quotient normal: amax is at most float32 max, and 4 / float32
  max > 2^-126; an infinite amax gives 0. So `div` skips its subnormal assembly then, and the lift of a
  subnormal amax too: its quotient is above 4 * 2^126 > float32 max, and a backend that reads it as zero
  (XLA:CPU's `amax == 0` is true for it) takes the amax = 0 branch. The lift could not change a result, and its
  bit arithmetic was a good part of the scalar chain XLA compiles per NVFP4 quantization (docs/BENCHMARKS.md,
  "Session of 2026-12-07, 03:39 UTC")."""
  normal = isinstance(numerator, (np.ndarray, np.generic, float, int)) and bool(np.all(np.asarray(numerator) >= 4))
  s = div(numerator, jnp.where(amax == 0, 1.0, amax), b_normal=normal, normal_result=normal)
  return jnp.where(amax == 0, 1.0, jnp.minimum(s, jnp.finfo(jnp.float32).max))


def div_pow2(a: jax.Array, d: jax.Array) -> jax.Array:
  """a / d for d a normal power of two whose reciprocal is normal too (|d| in [2^-126, 2^126]): a times the
  exact reciprocal, one rounding, so the correctly rounded quotient for normal a and quotient (subnormals
  follow the backend's multiplication: XLA:CPU treats them as zero, GPUs keep them)."""
  db = jax.lax.bitcast_convert_type(jnp.asarray(d, jnp.float32), jnp.uint32)
  recip = ((254 - ((db >> 23) & 0xFF)) << 23) | (db & _SIGN)
  return a * jax.lax.bitcast_convert_type(recip, jnp.float32)


def pow2(e: jax.Array) -> jax.Array:
  """float32 2**e for int32 e in [-126, 127], built from the exponent bits (exact on every backend; `jnp.exp2`
  is not exact on GPU for integer arguments)."""
  return jax.lax.bitcast_convert_type(((e + 127) << 23).astype(jnp.int32), jnp.float32)


def e4m3_bits_to_f32(b: jax.Array) -> jax.Array:
  """float32 values of E4M3 bytes held in a (u)int32 array (0..255), by integer arithmetic: normal
  (8 + m) * 2^(e - 10), subnormal m * 2^-9, NaN for 0x7F / 0xFF. Runs inside Pallas kernels too."""
  e, m = (b >> 3) & 0xF, b & 7
  normal = jax.lax.bitcast_convert_type(((e + 120) << 23) | (m << 20), jnp.float32)
  mag = jnp.where(e == 0, m.astype(jnp.float32) * jnp.float32(2.0**-9), normal)  # subnormal: exact
  mag = jnp.where((b & 0x7F) == 0x7F, jnp.float32(jnp.nan), mag)
  return jnp.where((b & 0x80) != 0, -mag, mag)


def e5m2_bits_to_f32(b: jax.Array) -> jax.Array:
  """float32 values of E5M2 bytes held in a (u)int32 array (0..255), by integer arithmetic: normal
  (4 + m) * 2^(e - 17), subnormal m * 2^-16, +-Inf for exponent 31 with m = 0, NaN with m != 0."""
  e, m = (b >> 2) & 0x1F, b & 3
  normal = jax.lax.bitcast_convert_type(((e + 112) << 23) | (m << 21), jnp.float32)
  mag = jnp.where(e == 0, m.astype(jnp.float32) * jnp.float32(2.0**-16), normal)  # subnormal: exact
  mag = jnp.where(e == 31, jnp.where(m == 0, jnp.float32(jnp.inf), jnp.float32(jnp.nan)), mag)
  return jnp.where((b & 0x80) != 0, -mag, mag)


def e4m3_to_f32(s: jax.Array) -> jax.Array:
  """float32 values of a float8_e4m3fn array, decoded from its bytes (see the module docstring for why not
  `s.astype(jnp.float32)`). NaN for 0x7F / 0xFF."""
  return e4m3_bits_to_f32(jax.lax.bitcast_convert_type(s, jnp.uint8).astype(jnp.uint32))


LIFT = 64  # a subnormal float32 times 2^64 is normal (>= 2^-85)


def lift(f: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(f * 2^shift exactly, shift) for float32 f: shift = `LIFT` where f is subnormal (the result then normal,
  built from f's bits, so no flush-to-zero can touch it), else 0 and f itself. A NumPy or Python `f` (a
  constant) is lifted by NumPy while tracing: no operations are staged, and the results are NumPy arrays."""
  if isinstance(f, (np.ndarray, np.generic, float, int)):
    f = np.asarray(f, np.float32)
    subnormal = (f != 0) & (np.abs(f) < np.float32(_TINY))
    lifted = np.where(subnormal, f, 0) * np.float32(2.0**LIFT)  # only subnormals scaled: no overflow warning
    return np.where(subnormal, lifted, f), np.where(subnormal, LIFT, 0).astype(np.int32)
  f = jnp.asarray(f, jnp.float32)
  bits = jax.lax.bitcast_convert_type(f, jnp.uint32)
  mant = bits & np.uint32(0x7FFFFF)
  subnormal = ((bits & _EXP_INF) == 0) & (mant != 0)
  lifted = mant.astype(jnp.int32).astype(jnp.float32) * jnp.float32(2.0 ** (LIFT - 149))  # exact
  lifted = jnp.where((bits & _SIGN) != 0, -lifted, lifted)
  return jnp.where(subnormal, lifted, f), jnp.where(subnormal, LIFT, 0).astype(jnp.int32)


def mul_scale(x: jax.Array, f: jax.Array) -> jax.Array:
  """x * f rounded once, also where the float32 factor f is subnormal.

  XLA:CPU treats subnormal operands as zero (DAZ), so multiplying by a subnormal scale (an E8M0 2^-127, an
  NVFP4 outer factor 1 / S_enc of a tensor with amax below ~3.2e-35) would give 0 there and the right value
  on a GPU. A subnormal f enters lifted by 2^64 (`lift`), and the product, rounded once, is scaled back by
  2^-64, exact unless the result itself is subnormal (then the backend's flush applies, as to any subnormal
  result). Normal f: plain x * f.
  """
  lifted, shift = lift(f)
  return jnp.where(shift > 0, (x * lifted) * jnp.float32(2.0**-LIFT), x * jnp.asarray(f, jnp.float32))


def split_pow2(f: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(m, e) with f = m * 2^e exactly, for float32 f: |m| in [1, 2) and e in [-149, 127] for finite nonzero f
  (subnormals included: `lift` reads them from their bits, so no flush touches them); m = f and e = 0 for a
  zero, infinite or NaN f."""
  f = jnp.asarray(f, jnp.float32)
  lifted, shift = lift(f)
  bits = jax.lax.bitcast_convert_type(lifted, jnp.uint32)
  biased = ((bits >> 23) & np.uint32(0xFF)).astype(jnp.int32)
  m = jax.lax.bitcast_convert_type((bits & np.uint32(0x807FFFFF)) | np.uint32(0x3F800000), jnp.float32)
  regular = (biased != 0) & (biased != 255)
  return jnp.where(regular, m, f), jnp.where(regular, biased - 127 - shift, 0)


def mul_scales(x: jax.Array, f: jax.Array, g: jax.Array) -> jax.Array:
  """(x * f) * g, each product rounded once, with no overflow or underflow on the way where the result is normal.

  f and g enter as m * 2^e (`split_pow2`): x is multiplied by the two m's, then by the summed power of two in
  two halves (each partial product lies between x * m_f * m_g and the result). Where x * f is a normal float32
  this is `mul_scale(mul_scale(x, f), g)` bit for bit (scaling by a power of two commutes with rounding in the
  normal range); where that product overflowed (f huge, g tiny: a gradient near float32's maximum times a small
  weight's factor) or lost bits as a subnormal, this gives the finite, correctly scaled result. Zero, infinite
  and NaN factors multiply as themselves."""
  # The four factors leave their scalar (or per-row) chain through a barrier: fused into x's elementwise
  # consumer, the chain was recomputed per element and analysed anew by XLA's priority fusion for each GEMM
  # output of a program (docs/BENCHMARKS.md, "Session of 2026-12-07, 00:24 UTC"; `params._stage` says more).
  if jnp.ndim(f) == 0 and jnp.ndim(g) == 0:  # per-tensor factors: the same steps on one [2] vector, not two
    # scalar chains, and the four factors as one [4] vector (fewer XLA instructions and fusions)
    m, e = split_pow2(jnp.stack([jnp.asarray(f, jnp.float32), jnp.asarray(g, jnp.float32)]))
    factors = jax.lax.optimization_barrier(jnp.concatenate([m, pow2(jnp.stack(_exponent_halves(e[0] + e[1])))]))
    return (x * factors[0]) * factors[1] * factors[2] * factors[3]
  mf, ef = split_pow2(f)
  mg, eg = split_pow2(g)
  low, high = _exponent_halves(ef + eg)
  mf, mg, low, high = jax.lax.optimization_barrier((mf, mg, pow2(low), pow2(high)))
  return (x * mf) * mg * low * high


def _exponent_halves(e: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`mul_scales`' summed exponent e in [-298, 254] as two halves in [-126, 127], each a normal power of two;
  they sum to e but where the result is below the normal range."""
  half = jnp.clip(e >> 1, -126, 127)
  return half, jnp.clip(e - half, -126, 127)
