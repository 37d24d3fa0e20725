"""Blockwise Hadamard transforms for FP4 GEMM operands (docs/NUMERICS.md, "Hadamard transforms").

A transform M = H_n · diag(d) / sqrt(n) (H_n the Sylvester Hadamard matrix, d a sign vector) is applied to every
block of n consecutive elements along `axis`: y_block = M x_block. M is orthogonal, so applying it to both
operands of a GEMM along the contraction axis leaves the product unchanged while spreading outliers.

Kinds:
  "h16", "h32": fixed signs d16 = [1,1,1,-1,1,-1,-1,-1,-1,-1,-1,1,-1,1,-1,-1] (TE's wgrad signs, bitmask 0x2817);
    H32 applies d16 to each half, i.e. d = [d16, d16] with H_32 (= H16 on each half, then a cross add/subtract).
  "rht16", "rht32", "rht128": random signs from `key` (`fp4jax.prng`, stream STREAM_HADAMARD_SIGNS, counter = the
    position in the block; negative iff the top bit of the hash is set), one vector shared by all blocks.
The +-1 matrix is applied in float32 as a fast Walsh-Hadamard butterfly in a fixed order (`fwht`), the
1/sqrt(n) scale afterwards, in float32: every operation is an IEEE float32 add, subtract or multiply in a
pinned order, so any device (and the fused quantizer kernels, which run the same butterfly) gets the same bits.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax.numerics import ieee, prng
from fp4jax.numerics.ints import is_int

D16 = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


@dataclasses.dataclass(frozen=True)
class HadamardKind:
  """One transform: its size and whether its signs are fixed (d16 repeated) or drawn from a key."""
  n: int
  random_signs: bool


KINDS: dict[str, HadamardKind] = {
    "h16": HadamardKind(16, False),
    "h32": HadamardKind(32, False),
    "rht16": HadamardKind(16, True),
    "rht32": HadamardKind(32, True),
    "rht128": HadamardKind(128, True),
}


def _kind(kind: str) -> HadamardKind:
  try:
    return KINDS[kind]
  except KeyError:
    raise ValueError(f"unknown Hadamard {kind=}; known kinds: {sorted(KINDS)}") from None


def _check_int(value, what: str) -> None:
  """A TypeError naming `what` (the argument and what it takes) unless `value` is a Python or NumPy integer; a
  bool is none (True would silently be 1), nor a float or a string (they fail deep inside, naming no argument)."""
  if not is_int(value):
    raise TypeError(f"{what}, got {value!r}")


def _check_bool(value, what: str) -> None:
  """A TypeError naming `what` unless `value` is a Python or NumPy bool: any other value would be taken by its
  truth, so `inverse="no"` would silently invert."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{what}, got {value!r}")


def sylvester(n: int) -> np.ndarray:
  """The n x n Sylvester Hadamard matrix (n a power of two), entries +-1, float32."""
  _check_int(n, "sylvester: n= takes an int (a power of two)")
  if n < 1 or n & (n - 1):
    raise ValueError(f"Sylvester Hadamard size {n=} must be a power of two")
  h = np.ones((1, 1), np.float32)
  while h.shape[0] < n:
    h = np.block([[h, h], [h, -h]])
  return h


def _negative_bits(kind: str, key: jax.Array | None, *, barrier: bool = True):
  """uint32 [n]: 1 where `kind`'s sign is -1; a NumPy array for fixed signs, drawn from `key` for random ones
  (`barrier`: `prng.seed_words`')."""
  spec = _kind(kind)
  if not spec.random_signs:
    if key is not None:  # unread by fixed signs; a malformed one is still a caller's mistake, said now
      prng.check_key(key, f"Hadamard {kind=} (fixed signs: key= unused)")
    return (np.tile(np.asarray(D16, np.float32), spec.n // 16) < 0).astype(np.uint32)
  prng.check_key(key, f"random-sign Hadamard {kind=}")  # None too; seed_words would read an int's or a batch's words
  k0, k1 = prng.seed_words(key, prng.STREAM_HADAMARD_SIGNS, barrier=barrier)
  return prng.hash_bits(k0, k1, jax.lax.iota(jnp.uint32, spec.n)) >> 31


def hadamard_signs(kind: str, key: jax.Array | None = None) -> jax.Array:
  """float32 [n] sign vector (+-1) of `kind`; random kinds draw it from `key` (fixed ones are a constant)."""
  return jnp.asarray(np.float32(1.0) - np.float32(2.0) * _negative_bits(kind, key).astype(np.float32))


def negative_words(kind: str, key: jax.Array | None = None, words: int = 4) -> jax.Array:
  """uint32 [words] bitmask of `kind`'s -1 signs for any n <= 32 * words: sign r is bit r % 32 of word r // 32
  (words past n are zero): how kernels take the signs. Packed by shifts and a sum of distinct powers of two, a
  handful of XLA instructions (every quantizer launch with a transform builds its words; a scatter-add took a
  few dozen), and a constant for fixed signs."""
  n = _kind(kind).n
  _check_int(words, "negative_words: words= takes an int (how many uint32 words hold the signs)")
  if n > 32 * words:
    raise ValueError(f"negative_words: {kind=} has {n} signs, more than {words} words hold")
  per = min(n, 32)
  negative = _negative_bits(kind, key, barrier=False)  # packed into a few words: no per-element use
  shifted = (negative << (np.arange(n, dtype=np.uint32) % 32)).reshape(n // per, per)
  packed = jnp.asarray(shifted.sum(1, dtype=np.uint32))  # NumPy for fixed signs, XLA for random ones
  return jnp.concatenate([packed, jnp.zeros((words - n // per,), jnp.uint32)]) if words > n // per else packed


def hadamard_matrix(kind: str, key: jax.Array | None = None, *, normalized: bool = True) -> jax.Array:
  """[n, n] float32 matrix M of `kind` (y = M x per block): H_n · diag(signs), times 1/sqrt(n) if `normalized`.

  normalized=False gives the +-1 entries a kernel keeps in low precision, applying 1/sqrt(n) in float32 itself.
  """
  _check_bool(normalized, "hadamard_matrix: normalized= takes a bool")
  signs = hadamard_signs(kind, key)
  m = jnp.asarray(sylvester(signs.shape[0])) * signs[None, :]
  return m * jnp.float32(1 / math.sqrt(signs.shape[0])) if normalized else m


def fwht(a: jax.Array) -> jax.Array:
  """H_n a along the last axis (n = a.shape[-1], a power of two; Sylvester order), as log2(n) butterflies.

  Stage s = 1, 2, 4, ..., n/2 replaces each pair (a[i], a[i + s]) with i & s == 0 by (a[i] + a[i + s],
  a[i] - a[i + s]), in float32. This order is part of the contract: kernels reproduce it bit for bit.
  """
  n = a.shape[-1]
  if n < 1 or n & (n - 1):  # the butterflies' reshape would fail, naming none of this
    raise ValueError(f"fwht: a.shape[-1]={n} (a.shape={a.shape}) must be a power of two")
  s = 1
  while s < n:
    pairs = a.reshape(*a.shape[:-1], n // (2 * s), 2, s)
    lo, hi = pairs[..., 0, :], pairs[..., 1, :]
    a = jnp.stack([lo + hi, lo - hi], axis=-2).reshape(*a.shape[:-1], n)
    s *= 2
  return a


@functools.partial(jax.jit, static_argnames=("kind", "axis", "inverse"))
def hadamard(x: jax.Array, kind: str, *, axis: int = -1, key: jax.Array | None = None,
             inverse: bool = False) -> jax.Array:
  """Applies the blockwise transform of `kind` along `axis` (its inverse, M^T, if `inverse`); float32 result."""
  spec = _kind(kind)
  _check_int(axis, f"Hadamard {kind=}: axis= takes an int (an axis of x)")
  _check_bool(inverse, f"Hadamard {kind=}: inverse= takes a bool")
  if not -x.ndim <= axis < x.ndim:  # x.shape[axis] would fail as "tuple index out of range"
    raise ValueError(f"Hadamard {kind=}: {axis=} is out of range for x.shape={x.shape}")
  n, length = spec.n, x.shape[axis]
  if length % n:
    raise ValueError(f"Hadamard {kind=}: axis length {length} (x.shape={x.shape}, {axis=}) must be a multiple "
                     f"of {n}")
  signs = hadamard_signs(kind, key)  # [n]
  xk = jnp.moveaxis(ieee.to_float32(x), axis, -1)
  xb = xk.reshape(*xk.shape[:-1], length // n, n)  # [..., blocks, n]
  scale = jnp.float32(1 / math.sqrt(n))
  yb = fwht(xb) * scale * signs if inverse else fwht(xb * signs) * scale
  return jnp.moveaxis(yb.reshape(xk.shape), -1, axis)
