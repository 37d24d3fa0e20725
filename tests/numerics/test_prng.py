"""fp4jax.prng: distribution of the counter-based bits, layout independence, a numpy re-implementation."""

import jax
import jax.numpy as jnp
import numpy as np
import numpy_ref  # tests/numpy_ref.py
import pytest

from fp4jax.numerics import prng

KEY = jax.random.key(5)


def test_uniform_moments_and_bit_balance():
  n = 1 << 20
  k0, k1 = prng.seed_words(KEY)
  bits = np.asarray(prng.hash_bits(k0, k1, jax.lax.iota(jnp.uint32, n)))
  u = np.asarray(prng.uniform_from_bits(jnp.asarray(bits)), np.float64)
  sigma = np.sqrt(1 / 12 / n)
  assert abs(u.mean() - 0.5) < 5 * sigma
  assert abs(u.var() - 1 / 12) < 5 * np.sqrt(1 / 180 / n)
  assert 0.0 <= u.min() and u.max() < 1.0
  ones = ((bits[:, None] >> np.arange(32, dtype=np.uint32)) & 1).mean(0)  # per bit position
  assert np.all(np.abs(ones - 0.5) < 5 * 0.5 / np.sqrt(n)), ones
  # Neighbouring counters are uncorrelated.
  assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 5 / np.sqrt(n)


def test_same_bits_for_same_counter_whatever_the_layout():
  flat = prng.uniform(KEY, (64 * 48,))
  np.testing.assert_array_equal(prng.uniform(KEY, (64, 48)), flat.reshape(64, 48))
  # A kernel writing the transposed layout computes each element's bits from its original flat index.
  k0, k1 = prng.seed_words(KEY)
  transposed = prng.uniform_from_bits(prng.hash_bits(k0, k1, prng.flat_index((64, 48)).T))
  np.testing.assert_array_equal(transposed, flat.reshape(64, 48).T)


def test_keys_and_streams():
  raw = jax.random.key_data(KEY)
  np.testing.assert_array_equal(prng.uniform(raw, (100,)), prng.uniform(KEY, (100,)))
  a = prng.uniform(KEY, (1000,))
  assert (a != prng.uniform(jax.random.key(6), (1000,))).mean() > 0.99
  assert (a != prng.uniform(KEY, (1000,), stream=prng.STREAM_SCALE_SR)).mean() > 0.99


@pytest.mark.parametrize("stream", [prng.STREAM_ELEMENT_SR, prng.STREAM_SCALE_SR, prng.STREAM_HADAMARD_SIGNS])
def test_seed_words_without_the_barrier_are_the_same_words(stream):
  """barrier=False (what the kernels' seed inputs take) gives the same words, and leaves no barrier to XLA."""
  key = prng.fold_in(jax.random.key(7), 3)
  with_barrier = jax.jit(lambda k: prng.seed_words(k, stream))(key)
  without = jax.jit(lambda k: prng.seed_words(k, stream, barrier=False))(key)
  assert [int(w) for w in with_barrier] == [int(w) for w in without]
  jaxpr = str(jax.make_jaxpr(lambda k: prng.seed_words(k, stream, barrier=False))(key))
  assert "optimization_barrier" not in jaxpr
  assert "optimization_barrier" in str(jax.make_jaxpr(lambda k: prng.seed_words(k, stream))(key))


def test_matches_numpy_reimplementation():
  counters = np.arange(0, 1 << 32, 9973 * 997, dtype=np.uint64).astype(np.uint32)
  for stream in (prng.STREAM_ELEMENT_SR, prng.STREAM_SCALE_SR, prng.STREAM_HADAMARD_SIGNS):
    k0, k1 = prng.seed_words(KEY, stream)
    got = prng.uniform_from_bits(prng.hash_bits(k0, k1, jnp.asarray(counters)))
    np.testing.assert_array_equal(got, numpy_ref.uniforms(KEY, stream, counters))


def test_check_key_accepts_one_key_typed_or_raw():
  prng.check_key(KEY, "f")
  prng.check_key(jax.random.key(5, impl="rbg"), "f")  # a typed key of any impl: its data shape is its own
  prng.check_key(jax.random.PRNGKey(5), "f")
  prng.check_key(np.asarray(jax.random.PRNGKey(5)), "f")
  jax.jit(lambda k: prng.check_key(k, "f"))(KEY)  # tracers carry dtype and shape
  jax.vmap(lambda k: prng.check_key(k, "f"))(jax.random.split(KEY, 3))  # one key per vmapped call
  with jax.default_prng_impl("rbg"):  # a raw key is the default impl's: uint32[4] under rbg
    prng.check_key(jax.random.PRNGKey(5), "f")


@pytest.mark.parametrize("key", [3, None, jnp.zeros(2), jnp.zeros(2, jnp.int32), jnp.zeros(4, jnp.uint32),
                                 jnp.zeros((), jnp.uint32), jax.random.split(KEY, 4),
                                 jax.random.split(jax.random.PRNGKey(0), 4), KEY[None]],
                         ids=["int", "none", "float32", "int32", "raw_uint32_4", "uint32_scalar", "batch_of_keys",
                              "batch_of_raw_keys", "typed_key_of_shape_1"])
def test_check_key_rejects_anything_but_one_key(key):
  """seed_words reads any array's first and last words: a batch of keys or an int would seed silently."""
  with pytest.raises(ValueError, match=r"quantize needs a key: one JAX PRNG key .*uint32\[2\].*dtype="):
    prng.check_key(key, "quantize")


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_fold_in_matches_numpy_and_keeps_the_key_kind(impl):
  """prng.fold_in: a batch of keys of the input's implementation (typed) or raw words, each equal to the numpy
  re-implementation, distinct per value, and changed by every word of the key."""
  key = jax.random.key(11, impl=impl)
  data = jnp.asarray([0, 1, 2, 7, 1 << 31, 0xFFFFFFFF], jnp.uint32)
  derived = prng.fold_in(key, data)
  assert derived.shape == data.shape and jax.random.key_impl(derived) == jax.random.key_impl(key)
  words = np.asarray(jax.random.key_data(derived))
  for d, w in zip(np.asarray(data), words):
    np.testing.assert_array_equal(w, numpy_ref.fold_in_words(key, int(d)))
  assert len({tuple(w) for w in words}) == len(data)
  np.testing.assert_array_equal(prng.fold_in(jax.random.key_data(key), data), words)  # raw key data -> raw
  np.testing.assert_array_equal(jax.random.key_data(prng.fold_in(key, 7)), words[3])  # one value -> one key
  raw = np.asarray(jax.random.key_data(key))
  for i in range(raw.size):  # every word of the key reaches every word of every derived key
    changed = raw.copy()
    changed[i] ^= 1
    other = np.asarray(prng.fold_in(jnp.asarray(changed), data))
    assert (other != words).all(), i


def test_fold_in_rejects_a_batch_of_keys_and_vmaps_over_one():
  keys = jax.random.split(KEY, 3)
  with pytest.raises(ValueError, match="one key"):
    prng.fold_in(keys, 1)
  batched = jax.vmap(lambda k: prng.fold_in(k, 1))(keys)
  for i in range(3):
    np.testing.assert_array_equal(jax.random.key_data(batched[i]), jax.random.key_data(prng.fold_in(keys[i], 1)))
