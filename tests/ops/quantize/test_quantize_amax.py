"""The rotated-amax pre-pass (NVFP4's Hadamard column views, MS-EDEN) equals the reference's amax of the
rotated tensor bit for bit, NaN when anything is non-finite."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from fp4jax.numerics import reference
from fp4jax.numerics.hadamard import hadamard
from fp4jax.ops.quantize.pallas import amax
from quantize_inputs import INPUTS, bits, rng_for

TKEY = jax.random.key(6)


@pytest.mark.parametrize("transform", [None, "h16", "rht16", "rht32", "rht128"])
@pytest.mark.parametrize("axis", [0, 1])
def test_rotated_amax_matches_reference(transform, axis):
  rng = rng_for("amax", transform, axis)
  x = jnp.asarray(INPUTS["heavy"](rng, (256, 128)), jnp.bfloat16)
  got = amax.rotated_amax(x, transform, TKEY, axis=axis, interpret=True)
  xt = hadamard(x, transform, axis=axis, key=TKEY) if transform else x.astype(jnp.float32)
  assert bits(got) == bits(reference._amax(xt))  # pylint: disable=protected-access
  y = np.asarray(x, np.float32).copy()
  y[17, 33] = np.inf
  assert np.isnan(amax.rotated_amax(jnp.asarray(y), transform, TKEY, axis=axis, interpret=True))


@pytest.mark.parametrize("transform", ["h16", "rht16", "rht32"])
def test_planes_rotate_every_element_like_hadamard(transform):
  """The strided planes behind the column views' amax hold hadamard(x, axis=0) element for element (the amax
  test above sees only one element per tile)."""
  n = amax.hadamard.KINDS[transform].n
  x = jnp.asarray(INPUTS["heavy"](rng_for("planes", transform), (128, 64)), jnp.bfloat16)

  def kernel(w_ref, x_ref, o_ref):
    planes = amax.common.butterfly(amax._planes(x_ref, n), n, amax.common.read_words(w_ref, 0))
    for p, plane in enumerate(planes):
      o_ref[pl.ds(p, x.shape[0] // n, stride=n), :] = plane

  got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, jnp.int32), interpret=True)(
      amax.common.sign_words(transform, TKEY), x)
  want = jax.lax.bitcast_convert_type(hadamard(x, transform, axis=0, key=TKEY), jnp.int32)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("transform,axis", [("rht16", 0), ("h32", 0), ("rht128", 1), (None, 0)])
def test_with_plain_also_returns_the_amax_of_x(transform, axis):
  """One pass gives the rotated amax and the plain one (the nvfp4 route's X and dY: row view plain, column view
  rotated), each bit for bit; a lone outlier makes the two differ, so slots read the wrong way round fail."""
  rng = rng_for("plain", transform, axis)
  y = np.asarray(INPUTS["heavy"](rng, (256, 128)), np.float32)
  y[200, 100] = 3.0e30  # a lone outlier above the rest: rotation spreads it, so the two amaxes differ
  x = jnp.asarray(y, jnp.bfloat16)
  rotated, plain = amax.rotated_amax(x, transform, TKEY, axis=axis, with_plain=True, interpret=True)
  assert bits(rotated) == bits(amax.rotated_amax(x, transform, TKEY, axis=axis, interpret=True))
  assert bits(plain) == bits(amax.bf16_amax(x)) == bits(jnp.float32(x[200, 100]))
  if transform is not None:
    assert bits(rotated) != bits(plain)
  y[3, 5] = np.nan
  assert all(np.isnan(a) for a in amax.rotated_amax(jnp.asarray(y, jnp.bfloat16), transform, TKEY, axis=axis,
                                                     with_plain=True, interpret=True))
