"""The helpers every Pallas quantizer shares: the Hadamard butterfly (both plane layouts) against
`hadamard.hadamard`, E2M1 magnitudes, and the exact division / product (interpret mode; PTX asm on the GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax.numerics import codecs, hadamard as hadamard_lib, ieee
from fp4jax.ops.quantize.pallas import common, exact
from quantize_inputs import bits

TKEY = jax.random.key(6)


@pytest.mark.parametrize("kind", ["h16", "h32", "rht16", "rht128"])
@pytest.mark.parametrize("planes", [1, 2])
def test_butterfly_matches_hadamard(kind, planes):
  """The butterfly on rows held as one plane or as two row-parity planes equals `hadamard(x, axis=0)`."""
  x = np.random.default_rng(len(kind) + planes).standard_normal((256, 8)).astype(np.float32) * 1e3
  x[7, 3] = 1e-38
  signs = hadamard_lib.negative_words(kind, TKEY)
  words = [jax.lax.bitcast_convert_type(w, jnp.int32) for w in signs]
  split = [common.as_i32(jnp.asarray(x[p::planes])) for p in range(planes)]
  out = np.empty_like(x)
  for p, y in enumerate(common.butterfly(split, hadamard_lib.KINDS[kind].n, words)):
    out[p::planes] = np.asarray(common.as_f32(y))
  want = hadamard_lib.hadamard(jnp.asarray(x), kind, axis=0, key=TKEY)
  np.testing.assert_array_equal(bits(out), bits(want))


def test_e2m1_magnitudes():
  codes = jnp.arange(8, dtype=jnp.int32)
  np.testing.assert_array_equal(np.asarray(common.e2m1_magnitude(codes)),
                                np.asarray(codecs.e2m1_decode(codes.astype(jnp.uint8))))


def test_encode_rne_matches_the_codec_on_every_float_in_1_to_8():
  """`common.encode_rne` (float adds, used by every RNE kernel) equals `codecs.e2m1_encode_rne` on every float32
  in [1, 8) (each of its binades: every tie and saturation case), and on [0, 1) at every 61st float plus the
  ties and their neighbours."""
  encode = jax.jit(lambda m: common.encode_rne(m, None).astype(jnp.uint8))
  want = jax.jit(codecs.e2m1_encode_rne)
  one, eight = (int(np.float32(v).view(np.uint32)) for v in (1.0, 8.0))
  chunks = [np.arange(start, min(start + (1 << 22), eight), dtype=np.uint32) for start in range(one, eight, 1 << 22)]
  ties = np.float32([0.25, 0.75]).view(np.uint32)
  chunks.append(np.concatenate([np.arange(0, one, 61, dtype=np.uint32), *[t + np.arange(-3, 4) for t in ties]]))
  for c in chunks:
    m = jnp.asarray(c.view(np.float32))
    np.testing.assert_array_equal(np.asarray(encode(m)), np.asarray(want(m)))


def test_pack_nibbles_and_with_sign_are_or():
  codes = jnp.arange(16, dtype=jnp.int32)
  lo, hi = jnp.meshgrid(codes, codes)
  np.testing.assert_array_equal(np.asarray(common.pack_nibbles(lo, hi)), np.asarray(lo | (hi << 4)))
  mags, signs = jnp.meshgrid(jnp.arange(8, dtype=jnp.int32), jnp.int32([0, 8]))
  np.testing.assert_array_equal(np.asarray(common.with_sign(mags, signs)), np.asarray(mags | signs))


def test_exact_helpers_in_interpret_mode():
  rng = np.random.default_rng(10)
  a, b = (jnp.asarray(rng.standard_normal(4096).astype(np.float32) * np.exp2(rng.integers(-60, 60, 4096)))
          for _ in range(2))
  np.testing.assert_array_equal(bits(exact.div_rn(a, b, interpret=True)), bits(ieee.div(a, b)))
  np.testing.assert_array_equal(bits(exact.mul_rn(a, b, interpret=True)), bits(a * b))


@pytest.mark.gpu
def test_gpu_exact_asm_helpers():
  """div.rn.f32 / mul.rn.f32 in a compiled kernel equal `ieee.div` and XLA's product on 2^20 random pairs,
  subnormal, huge and special operands included."""
  from jax.experimental import pallas as pl
  rng = np.random.default_rng(31)
  n = 1 << 20
  words = rng.integers(0, 1 << 32, (2, n), dtype=np.uint64).astype(np.uint32)
  words[:, :64] = np.array([0, 0x80000000, 1, 0x7F800000, 0xFF800000, 0x7FC00000, 0x00800000, 0x7F7FFFFF] * 8)
  a, b = (jnp.asarray(v.view(np.float32)).reshape(1024, 1024) for v in words)

  def kernel(a_ref, b_ref, q_ref, p_ref):
    q_ref[...] = exact.div_rn(a_ref[...], b_ref[...], interpret=False)
    p_ref[...] = exact.mul_rn(a_ref[...], b_ref[...], interpret=False)

  spec = pl.BlockSpec((64, 128), lambda i, j: (i, j))
  q, p = pl.pallas_call(kernel, out_shape=(jax.ShapeDtypeStruct(a.shape, jnp.float32),) * 2, grid=(16, 8),
                        in_specs=[spec, spec], out_specs=(spec, spec))(a, b)
  want_q, want_p = jax.jit(ieee.div)(a, b), jax.jit(lambda a, b: a * b)(a, b)
  nan = np.isnan(np.asarray(want_q))
  assert np.array_equal(np.isnan(np.asarray(q)), nan)
  assert np.array_equal(bits(q)[~nan], bits(want_q)[~nan])
  nan = np.isnan(np.asarray(want_p))
  assert np.array_equal(bits(p)[~nan], bits(want_p)[~nan])
