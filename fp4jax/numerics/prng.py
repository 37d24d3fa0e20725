"""Counter-based random bits: the same bits from (key, element index) in jnp and in a GPU kernel.

Stochastic rounding needs one uniform number per element. `jax.random` cannot be reproduced inside a Pallas
kernel (Mosaic GPU has no PRNG primitive), so fp4jax draws its bits from a stateless integer hash of
(seed, counter), built from uint32 multiply/xor/shift only. A kernel that knows the element's flat index in the
*original* (un-transposed) tensor computes the identical bits, whatever layout it writes.

The hash is two rounds of the murmur3 32-bit finaliser keyed by the two seed words. It is not
cryptographic; it is equidistributed enough for rounding (tests/numerics/test_prng.py checks the mean, variance
and bit balance). Counters wrap at 2**32 elements.

Keys per operand and per linear (`fold_in`) are derived with the same finaliser, not `jax.random.fold_in`:
every quantized fp4_dot derives its operands' keys and every Llama block its linears' keys inside the
compiled step, and threefry's ~330 XLA instructions per derivation were about a tenth of an FP4 train step's
program (docs/BENCHMARKS.md), where the finaliser chain takes a few dozen. Its keys only ever seed this
module's hash (`seed_words`), never `jax.random`'s samplers.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

_GOLDEN = 0x9E3779B9
# Distinct streams drawn from one key, folded into the first seed word.
STREAM_ELEMENT_SR = 0
STREAM_SCALE_SR = 1
STREAM_HADAMARD_SIGNS = 2


def _u32(v):
  return jnp.uint32(v)


def _xor_shift(h, bits: int):
  return jax.lax.bitwise_xor(h, jax.lax.shift_right_logical(h, np.uint32(bits)))


def fmix32(h):
  """murmur3's 32-bit finaliser (a bijection on uint32 arrays). In `jax.lax` operations rather than operators:
  the same equations, but each `jax.numpy` operator is a call of its own to trace, and a train step traces a few
  hundred finalisers (docs/BENCHMARKS.md, "Session of 2026-12-08, 00:43 UTC")."""
  h = jax.lax.mul(_xor_shift(h, 16), np.uint32(0x85EBCA6B))
  h = jax.lax.mul(_xor_shift(h, 13), np.uint32(0xC2B2AE35))
  return _xor_shift(h, 16)


def check_key(key, what: str) -> None:
  """Raises a ValueError ("{what} needs a key: ...") unless `key` is one JAX PRNG key: typed (`jax.random.key`,
  any impl) of shape (), or raw (`jax.random.PRNGKey`) uint32 data of the default impl's shape, [2] under
  threefry2x32; None is no key. Checked at the call because nothing later would: `seed_words` reads any array's
  first and last words (a batch of keys or an int would seed silently), and `jax.random.fold_in` rejects a raw
  key of the wrong shape only when it runs, e.g. in the backward pass of an SR route whose forward reads no key.
  Under jax.jit and jax.vmap the check reads the tracer's (per-example) dtype and shape."""
  dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
  raw_shape = _raw_key_shape(jax.config.jax_default_prng_impl)
  if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
    ok = shape == ()
  else:
    ok = dtype == jnp.uint32 and shape == raw_shape
  if not ok:
    raise ValueError(f"{what} needs a key: one JAX PRNG key (jax.random.key, or a raw uint32{list(raw_shape)} "
                     f"key from jax.random.PRNGKey; jax.vmap over a batch of keys), got {type(key).__name__} with "
                     f"{dtype=}, {shape=}")


@functools.cache
def _raw_key_shape(impl: str) -> tuple[int, ...]:
  """The shape of a raw key of PRNG implementation `impl` (`jax_default_prng_impl`): (2,) for threefry2x32."""
  return tuple(jax.eval_shape(functools.partial(jax.random.PRNGKey, 0, impl=impl)).shape)


def seed_words(key: jax.Array, stream: int = STREAM_ELEMENT_SR, *, barrier: bool = True
               ) -> tuple[jax.Array, jax.Array]:
  """Two uint32 seed words from a JAX PRNG key (typed or raw uint32[2]) and a stream id.

  `barrier`: the words leave through an optimization barrier. Their finaliser is a chain of scalar operations
  that XLA would otherwise fuse into every consumer, and recompute once per element of an array hashed with
  them (a Llama mxfp4 CPU step ran 30% slower that way). A caller whose consumer is a few words (a Pallas
  kernel's seed input, a Hadamard's sign words) passes False: fused into that consumer, the chain costs nothing
  per element, and it no longer needs a fusion of its own (docs/BENCHMARKS.md, "Session of 2026-12-08, 00:43
  UTC")."""
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  data = jnp.asarray(key, jnp.uint32).reshape(-1)
  k0, k1 = data[0], data[-1]
  k0 = fmix32(k0 ^ _u32((stream * 0x632BE5AB + 0x1B873593) & 0xFFFFFFFF))
  return jax.lax.optimization_barrier((k0, k1)) if barrier else (k0, k1)


def hash_bits(k0, k1, counter):
  """uint32 random bits for uint32 `counter` values under seed words (k0, k1)."""
  c = counter.astype(jnp.uint32)
  h = fmix32(c * _u32(_GOLDEN) ^ k0)
  h = fmix32(h ^ k1)
  return h


def fold_in(key: jax.Array, data) -> jax.Array:
  """Keys derived from one key for each of `data`'s uint32 values (any shape; the result has that shape, a
  batch of keys): what `jax.random.fold_in` does, by the murmur3 finaliser (module docstring). A typed key
  gives typed keys of its implementation, raw key data (uint32[n]) raw data [..., n]. Every word of a derived
  key depends on every word of `key` and on the value, and distinct values give distinct keys."""
  typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
  words = jax.random.key_data(key) if typed else jnp.asarray(key, jnp.uint32)
  if words.ndim != 1:  # a batch of keys would silently derive from its first key's words
    raise ValueError(f"prng.fold_in takes one key (jax.vmap over a batch of keys), got key data of shape "
                     f"{words.shape}")
  h = fmix32(jnp.asarray(data, jnp.uint32) * _u32(_GOLDEN) ^ words[0])
  for j in range(1, words.shape[-1]):  # absorb the rest of the key: h is a bijection of the value
    h = fmix32(h ^ words[j])
  out = [fmix32(h ^ _u32((j + 1) * 0x632BE5AB & 0xFFFFFFFF)) for j in range(words.shape[-1])]
  # Through a barrier: a train step derives keys from keys (a block's linears, then each linear's operands),
  # and XLA otherwise merges a layer's derivations, with what their seed words feed, into multi-output fusions
  # of hundreds of scalar instructions, which its fusion pass grows one instruction at a time, re-analysing each
  # at every step (docs/BENCHMARKS.md, "Session of 2026-12-08, 00:43 UTC").
  derived = jax.lax.optimization_barrier(jnp.stack(out, axis=-1))
  return jax.random.wrap_key_data(derived, impl=jax.random.key_impl(key)) if typed else derived


def uniform_from_bits(bits):
  """float32 uniform in [0, 1) from the top 24 bits (exact: multiples of 2**-24)."""
  return (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def flat_index(shape: tuple[int, ...]) -> jax.Array:
  """uint32 row-major flat index of every element of an array of `shape`."""
  return jax.lax.iota(jnp.uint32, math.prod(shape)).reshape(shape)


def uniform(key: jax.Array, shape: tuple[int, ...], stream: int = STREAM_ELEMENT_SR) -> jax.Array:
  """Uniform [0, 1) float32 per element of `shape`, indexed by row-major flat position."""
  k0, k1 = seed_words(key, stream)
  return uniform_from_bits(hash_bits(k0, k1, flat_index(shape)))
