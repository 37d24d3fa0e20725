"""Element codecs against independent numpy oracles: E2M1 ties, E4M3 rounding (bit arithmetic vs ml_dtypes'
cast) and E4M3 stochastic rounding, on every E4M3 value, every midpoint, their neighbours and random values."""

import jax.numpy as jnp
import numpy as np

import numpy_ref  # tests/numpy_ref.py
from fp4jax.numerics import codecs, ieee


def _e4m3_probe_values(seed: int) -> np.ndarray:
  """Every finite E4M3 value >= 0, the midpoints between neighbours, their float32 neighbours, random values."""
  grid = np.arange(0x7F, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32)
  mids = (grid[:-1] + grid[1:]) / 2
  rand = np.exp2(np.random.default_rng(seed).uniform(-14, np.log2(448), 20000))
  t = np.concatenate([grid, mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf), np.nextafter(grid, 0),
                      np.nextafter(grid, np.inf), rand])
  return np.clip(t, 0, 448).astype(np.float32)


def test_e2m1_rne_tie_points():
  # NUMERICS.md: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4; saturating at 6.
  v = jnp.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.25, -5.0, 1e9])
  got = codecs.e2m1_decode(codecs.e2m1_encode_rne(v))
  np.testing.assert_array_equal(got, [0, 1, 1, 2, 2, 4, 4, 6, -0.0, -4, 6])


def test_e4m3_rn_bytes_match_ml_dtypes():
  t = _e4m3_probe_values(11)
  byte, value = codecs.e4m3_rn_bytes(jnp.asarray(t))
  want = numpy_ref.e4m3_rn(t)
  np.testing.assert_array_equal(np.asarray(byte), want.view(np.uint8))
  np.testing.assert_array_equal(np.asarray(value), want.astype(np.float32))
  np.testing.assert_array_equal(np.asarray(codecs.e4m3_rn(jnp.asarray(t))).view(np.uint8), want.view(np.uint8))


def test_e4m3_sr_matches_numpy():
  t = _e4m3_probe_values(12)
  u = (np.random.default_rng(13).integers(0, 1 << 24, t.shape) * 2.0**-24).astype(np.float32)
  got = np.asarray(codecs.e4m3_sr(jnp.asarray(t), jnp.asarray(u))).view(np.uint8)
  np.testing.assert_array_equal(got, numpy_ref.e4m3_sr(t, u))


def test_e4m3_bits_decode_every_byte():
  b = np.arange(256, dtype=np.uint8)
  got = np.asarray(ieee.e4m3_bits_to_f32(jnp.asarray(b, jnp.int32)))
  want = b.view(jnp.float8_e4m3fn).astype(np.float32)
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  np.testing.assert_array_equal(got[~np.isnan(want)], want[~np.isnan(want)])
