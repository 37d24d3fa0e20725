"""The fused MS-EDEN quantizer and the rotated-amax pass equal the reference bit for bit (Pallas interpret mode
on CPU; the compiled kernels in the `gpu` tests)."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax import hadamard as hadamard_lib
from fp4jax import ieee, reference
from fp4jax.hadamard import hadamard
from fp4jax.kernels import exact, quantize_fused, rotate
from fp4jax.kernels import quantize_eden as qe

KEY, TKEY = jax.random.key(5), jax.random.key(6)


def _normal(rng, shape):
  return rng.standard_normal(shape).astype(np.float32)


def _heavy(rng, shape):
  """Student-t (2 dof) with rare 1e4 outliers and per-column scales over 2^[-20, 0]: s_b across E4M3's range,
  subnormal E4M3 scales (|ys| above 6) and blocks whose s_b rounds to 0 (-> 1)."""
  x = rng.standard_t(2, shape).astype(np.float32)
  x[rng.random(shape) < 0.01] *= 1e4
  return x * np.exp2(rng.integers(-20, 1, (1, shape[1]))).astype(np.float32)


def _special(rng, shape):
  """A zero group, a signed-zero group, E2M1 ties and grid values, 1e-30 and 3e38 entries."""
  x = _normal(rng, shape)
  x[:128, 0] = 0.0
  x[:128, 1] = -0.0
  x[:, 2] = rng.choice([0.25, 0.75, 2.5, 5.0, 6.0, -0.25, -3.5], shape[0])
  x[:, 3] *= 1e-30
  x[5, 4] = 3e38
  x[-1, -1] = -3e38
  return x


INPUTS = {"normal": _normal, "heavy": _heavy, "special": _special}


def _reference(x, axis, transform, tensor_amax=None):
  xt = hadamard(x, transform, axis=axis, key=TKEY) if transform else x
  q = reference.quantize(xt, "nvfp4", axis=axis, rounding="eden", key=KEY, tensor_amax=tensor_amax)
  xk = jnp.moveaxis(xt.astype(jnp.float32), axis, -1)
  t = reference._eden_targets(xk.reshape(*xk.shape[:-1], -1, 16), tensor_amax)[1]  # pylint: disable=protected-access
  return q, t


def _bits(a):
  a = np.asarray(a)
  return a.view(f"u{a.itemsize}")


def _check(x, axis=0, transform="rht128", *, tensor_amax=None, **opts):
  """Codes, scales, outer and the pre-SR targets t against the reference, compared as bit patterns."""
  got, t = qe.quantize_eden(x, axis=axis, key=KEY, transform=transform, transform_key=TKEY,
                            tensor_amax=tensor_amax, targets=True, **{"interpret": True, **opts})
  want, want_t = _reference(x, axis, transform, tensor_amax)
  assert (got.fmt, got.axis, got.shape) == (want.fmt, want.axis % 2, want.shape)
  for name, g, w in (("codes", got.codes, want.codes), ("scales", got.scales, want.scales),
                     ("outer", got.outer, want.outer), ("t", t, want_t)):
    g, w = _bits(g), _bits(w)
    assert g.shape == w.shape, (name, g.shape, w.shape)
    bad = np.argwhere(g != w)
    assert bad.size == 0, f"{name}: {len(bad)} mismatches, first at {bad[:3].tolist()}"
  return got


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("kind", sorted(INPUTS))
def test_rht128_matches_reference(kind, axis):
  """bf16 dY as quartet2's backward sees it: both views, a 2 x 4 grid of programs (block_c 16)."""
  rng = np.random.default_rng(zlib.crc32(f"{kind}/{axis}".encode()))
  x = INPUTS[kind](rng, (256, 64))
  _check(jnp.asarray(x if axis == 0 else x.T, jnp.bfloat16), axis, block_c=16)


@pytest.mark.parametrize("transform,axis", [(None, 0), ("h16", 1), ("rht32", 0)])
def test_float32_input_and_other_transforms(transform, axis):
  """float32 input (quartet2's requantized X^ and W^), no rotation, and transforms shorter than a group."""
  rng = np.random.default_rng(zlib.crc32(f"f32/{transform}/{axis}".encode()))
  x = _heavy(rng, (128, 96))
  _check(jnp.asarray(x if axis == 0 else x.T), axis, transform)


def test_dequantized_fp4_input():
  """quartet2's X^: the 4/6 NVFP4 values of X, dequantized in float32, then rotated and quantized along M."""
  x = jnp.asarray(_heavy(np.random.default_rng(3), (128, 64)))
  _check(reference.dequantize(reference.quantize(x, "nvfp4_46")), 0)


def test_zeros_and_nonfinite():
  _check(jnp.zeros((128, 32), jnp.bfloat16), 0)  # s_dec = 1, every den = 0 -> c = 1
  x = _normal(np.random.default_rng(4), (256, 32))
  x[3, 5], x[200, 7], x[130, 9] = np.nan, np.inf, -np.inf  # three groups NaN, the others normal
  _check(jnp.asarray(x, jnp.bfloat16), 0, None, tensor_amax=jnp.float32(4.0))
  _check(jnp.asarray(x, jnp.bfloat16), 0)  # rotated amax NaN: every group bad, outer NaN


@pytest.mark.parametrize("scale", [1e-30, 1e30])
def test_tiny_and_huge_tensors(scale):
  x = _normal(np.random.default_rng(8), (128, 32)) * np.float32(scale)
  _check(jnp.asarray(x), 0)


@pytest.mark.parametrize("amax", [0.5, 1e-3])
def test_given_tensor_amax(amax):
  """A given (e.g. delayed) amax below the true one: s_b clamps at 448, |ys| beyond 6 saturates."""
  _check(jnp.asarray(_normal(np.random.default_rng(9), (128, 32))), 0, tensor_amax=jnp.float32(amax))


@pytest.mark.parametrize("transform", [None, "h16", "rht16", "rht32", "rht128"])
@pytest.mark.parametrize("axis", [0, 1])
def test_rotated_amax_matches_reference(transform, axis):
  rng = np.random.default_rng(zlib.crc32(f"amax/{transform}/{axis}".encode()))
  x = jnp.asarray(_heavy(rng, (256, 128)), jnp.bfloat16)
  got = rotate.rotated_amax(x, transform, TKEY, axis=axis, interpret=True)
  xt = hadamard(x, transform, axis=axis, key=TKEY) if transform else x.astype(jnp.float32)
  assert _bits(got) == _bits(reference._amax(xt))  # pylint: disable=protected-access
  y = np.asarray(x, np.float32).copy()
  y[17, 33] = np.inf
  assert np.isnan(rotate.rotated_amax(jnp.asarray(y), transform, TKEY, axis=axis, interpret=True))


def test_negative_words():
  for kind in ("h16", "rht32", "rht128"):
    signs = np.asarray(hadamard_lib.hadamard_signs(kind, TKEY))
    words = np.asarray(hadamard_lib.negative_words(kind, TKEY))
    bits = [(int(words[r // 32]) >> (r % 32)) & 1 for r in range(len(signs))]
    np.testing.assert_array_equal(bits, signs < 0)
    assert not any(words[len(signs) // 32 + (len(signs) % 32 > 0):])
  np.testing.assert_array_equal(np.asarray(hadamard_lib.negative_words("h32"))[:1].view(np.int32),
                                np.asarray(hadamard_lib.negative_mask("h32"))[None])
  with pytest.raises(ValueError, match="more than 1 words"):
    hadamard_lib.negative_words("rht128", TKEY, words=1)


def test_exact_helpers_in_interpret_mode():
  rng = np.random.default_rng(10)
  a, b = (jnp.asarray(rng.standard_normal(4096).astype(np.float32) * np.exp2(rng.integers(-60, 60, 4096)))
          for _ in range(2))
  np.testing.assert_array_equal(_bits(exact.div_rn(a, b, interpret=True)), _bits(ieee.div(a, b)))
  np.testing.assert_array_equal(_bits(exact.mul_rn(a, b, interpret=True)), _bits(a * b))


def test_scale_sr_and_e2m1_values_match_reference():
  """The kernel's bit-arithmetic E4M3 SR of t (every E4M3 value, midpoints, neighbours, random t) against
  `reference.e4m3_sr`, and its E2M1 magnitudes against `reference.e2m1_decode`."""
  grid = np.arange(0x7F, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32)
  mids = (grid[:-1] + grid[1:]) / 2
  rng = np.random.default_rng(12)
  t = np.concatenate([grid, mids, np.nextafter(mids, 0), np.nextafter(grid, np.inf),
                      np.exp2(rng.uniform(-12, np.log2(448), 20000))])
  t = jnp.asarray(np.clip(t, 0, 448).astype(np.float32))
  u = jnp.asarray((rng.integers(0, 1 << 24, t.shape) * 2.0**-24).astype(np.float32))
  got = qe._e4m3_sr(t, u)  # pylint: disable=protected-access
  np.testing.assert_array_equal(np.asarray(got), _bits(reference.e4m3_sr(t, u)))
  codes = jnp.arange(8, dtype=jnp.int32)
  np.testing.assert_array_equal(np.asarray(quantize_fused.e2m1_magnitude(codes)),
                                np.asarray(reference.e2m1_decode(codes.astype(jnp.uint8))))


def test_supported_and_errors():
  assert qe.supported("nvfp4", "eden", shape=(256, 64), dtype=jnp.bfloat16, axis=0, transform="rht128")
  assert qe.supported("nvfp4", "eden", shape=(64, 256), dtype=jnp.float32, axis=1)
  assert not qe.supported("nvfp4", "eden", shape=(64, 256), axis=0)  # 64 rows: not a group of 128
  assert not qe.supported("nvfp4", "eden", shape=(128, 24), axis=0)  # 24 columns: not a multiple of 16
  assert not qe.supported("nvfp4", "sr") and not qe.supported("nvfp4_46", "eden")
  assert not qe.supported("nvfp4", "eden", dtype=jnp.float16)
  assert not qe.supported("nvfp4", "eden", tile_2d=True)
  assert not qe.supported("nvfp4", "eden", clip_fraction=0.9)
  assert qe.supported("nvfp4", "eden", scale_rule=None)
  x = jnp.ones((128, 32), jnp.bfloat16)
  with pytest.raises(ValueError, match="does not cover"):
    qe.quantize_eden(x, axis=1, key=KEY, transform_key=TKEY, interpret=True)
  with pytest.raises(ValueError, match="needs transform_key"):
    qe.quantize_eden(x, key=KEY, interpret=True)
  with pytest.raises(ValueError, match="pass key="):
    qe.quantize_eden(x, key=None, transform=None, interpret=True)


def test_triton_lowering_divides_exactly(triton_modules):
  """The Triton IR (lowered on CPU for an abstract H200): no float division of Triton's own (approximate), the
  divisions and the products feeding sums as PTX asm with explicit rounding."""
  modules = triton_modules(lambda x: qe.quantize_eden(x, axis=1, key=KEY, transform_key=TKEY), (256, 256))
  assert len(modules) == 2  # the rotated amax, the quantizer
  assert all("divf" not in m for m in modules)
  assert "div.rn.f32" in modules[1] and "mul.rn.f32" in modules[1]


# --- Compiled on the GPU --------------------------------------------------------------------------------------


def _gpu_check(x, axis, **opts):
  got, t = qe.quantize_eden(x, axis=axis, key=KEY, transform="rht128", transform_key=TKEY, targets=True, **opts)
  want, want_t = jax.jit(lambda x: _reference(x, axis, "rht128"))(x)
  for name, g, w in (("codes", got.codes, want.codes), ("scales", got.scales, want.scales),
                     ("outer", got.outer, want.outer), ("t", t, want_t)):
    assert np.array_equal(_bits(g), _bits(w)), (name, int(np.sum(_bits(g) != _bits(w))))


@pytest.mark.gpu
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("kind", ["heavy", "special"])
def test_gpu_matches_reference(kind, axis):
  """The compiled kernels on [1024, 512] inputs against the reference compiled for the GPU (exact divisions)."""
  rng = np.random.default_rng(zlib.crc32(f"gpu/{kind}/{axis}".encode()))
  _gpu_check(jnp.asarray(INPUTS[kind](rng, (1024, 512)), jnp.bfloat16), axis)


@pytest.mark.gpu
def test_gpu_float32_dequantized_input():
  x = jnp.asarray(_heavy(np.random.default_rng(30), (512, 1024)))
  _gpu_check(reference.dequantize(reference.quantize(x, "nvfp4_46")), 0)


@pytest.mark.gpu
def test_gpu_exact_asm_helpers():
  """div.rn.f32 / mul.rn.f32 in a compiled kernel equal `ieee.div` and XLA's product on 2^20 random pairs,
  subnormal, huge and special operands included."""
  from jax.experimental import pallas as pl
  rng = np.random.default_rng(31)
  n = 1 << 20
  bits = rng.integers(0, 1 << 32, (2, n), dtype=np.uint64).astype(np.uint32)
  bits[:, :64] = np.array([0, 0x80000000, 1, 0x7F800000, 0xFF800000, 0x7FC00000, 0x00800000, 0x7F7FFFFF] * 8)
  a, b = (jnp.asarray(v.view(np.float32)).reshape(1024, 1024) for v in bits)

  def kernel(a_ref, b_ref, q_ref, p_ref):
    q_ref[...] = exact.div_rn(a_ref[...], b_ref[...], interpret=False)
    p_ref[...] = exact.mul_rn(a_ref[...], b_ref[...], interpret=False)

  spec = pl.BlockSpec((64, 128), lambda i, j: (i, j))
  q, p = pl.pallas_call(kernel, out_shape=(jax.ShapeDtypeStruct(a.shape, jnp.float32),) * 2, grid=(16, 8),
                        in_specs=[spec, spec], out_specs=(spec, spec))(a, b)
  want_q, want_p = jax.jit(ieee.div)(a, b), jax.jit(lambda a, b: a * b)(a, b)
  nan = np.isnan(np.asarray(want_q))
  assert np.array_equal(np.isnan(np.asarray(q)), nan)
  assert np.array_equal(_bits(q)[~nan], _bits(want_q)[~nan])
  nan = np.isnan(np.asarray(want_p))
  assert np.array_equal(_bits(p)[~nan], _bits(want_p)[~nan])
