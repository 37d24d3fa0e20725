"""fp4jax.reference.quantize against an independent numpy implementation, bit for bit, plus its properties."""

import functools
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import numpy_ref  # tests/numpy_ref.py: pytest puts tests/ on sys.path
import pytest
from seeded import fresh_rng

from fp4jax.numerics.hadamard import hadamard
from fp4jax.numerics import reference as ref

KEY = jax.random.key(7)

# (id, fmt, options): every format x rounding x tile option the reference supports.
CONFIGS = [
    ("mx_ocp", "mxfp4", {}),
    ("mx_noclip", "mxfp4", {"scale_rule": "noclip"}),
    ("mx_sr", "mxfp4", {"rounding": "sr"}),
    ("mx_2d", "mxfp4", {"tile_2d": True}),
    ("mx_2d_clip", "mxfp4", {"tile_2d": True, "clip_fraction": 0.87}),
    ("mx_2d_sr", "mxfp4", {"tile_2d": True, "rounding": "sr"}),
    ("nv", "nvfp4", {}),
    ("nv_sr", "nvfp4", {"rounding": "sr"}),
    ("nv_2d", "nvfp4", {"tile_2d": True}),
    ("nv_2d_sr", "nvfp4", {"tile_2d": True, "rounding": "sr"}),
    ("nv_eden", "nvfp4", {"rounding": "eden"}),
    ("nv46", "nvfp4_46", {}),
    ("nv46_sr", "nvfp4_46", {"rounding": "sr"}),
    ("nv46_2d", "nvfp4_46", {"tile_2d": True}),
    ("nvtile", "nvfp4_tile", {"tile_rows": 48}),  # 128 rows: a ragged last tile
    ("nvtile_sr", "nvfp4_tile", {"tile_rows": 48, "rounding": "sr"}),
    ("nvtile_2d", "nvfp4_tile", {"tile_rows": 48, "tile_2d": True}),
]
CONFIG_IDS = [c[0] for c in CONFIGS]


SHAPE = (128, 128)  # one shape everywhere, so the tests share compiled quantizers
F32_MAX = float(np.finfo(np.float32).max)


def _inputs(shape=SHAPE) -> dict[str, np.ndarray]:
  """Fresh random inputs of several distributions plus edge cases, all float32 of `shape`."""
  rng = fresh_rng()
  r, c = shape
  normal = rng.standard_normal(shape)
  spread = normal * np.exp2(np.linspace(0, 8, r))[:, None]
  outliers = normal * np.where(rng.random(shape) < 0.01, rng.lognormal(4, 2, shape), 1.0)
  # Every 16-block holds a 6 and E2M1 tie points, so with a block max of 6 (x 2^k per row) the scaled values
  # land exactly on ties for both MX (scale 2^k) and NVFP4 (enc_b a power of two).
  ties = np.tile([6, .25, .75, 1.25, 1.75, 2.5, 3.5, 5, -.25, -.75, -1.25, -1.75, -2.5, -3.5, -5, 0], (r, c // 16))
  ties = ties * np.exp2((np.arange(r) % 5) - 2)[:, None]
  edge = normal.copy()
  edge[0:16] = 0.0  # zero blocks and tiles
  edge[16:32] = 1.5  # all-equal
  edge[32:48] *= 1e-30  # tiny
  edge[48:64] = np.where(rng.random((16, c)) < 0.5, 3e38, -2.9e38)  # huge
  huge = normal * 3e38 / np.abs(normal).max()
  near_max = normal.copy()  # where a block's top decoded value 6 * s_b * outer would pass float32 max
  near_max[:16, :16] = 0.8 * F32_MAX  # RTN codes 4 under MS-EDEN: the correction c ~ 1.2 lifts t above 256
  near_max[0, 0], near_max[5, 5], near_max[r - 1, c - 1] = F32_MAX, -F32_MAX, 3.3e38
  tiny = normal * 1e-30
  nonfinite = normal.copy()
  nonfinite[3, 5] = np.nan
  nonfinite[r // 2 + 3, c - 7] = np.inf
  nonfinite[r - 1, 1] = -np.inf
  return {name: np.asarray(v, np.float32) for name, v in dict(
      normal=normal, student_t=rng.standard_t(2, shape), outliers=outliers, spread=spread, ties=ties, edge=edge,
      huge=huge, near_max=near_max, tiny=tiny, nonfinite=nonfinite).items()}


def _q(x, fmt, **options):
  """quantize with the options of CONFIGS (same key and tile_rows), so compiled versions are shared."""
  if fmt == "nvfp4_tile":
    options.setdefault("tile_rows", 48)
  return ref.quantize(jnp.asarray(x), fmt, key=KEY, **options)


def _bits(q):
  scales = q.scales if q.scales.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(q.scales, jnp.uint8)
  return np.asarray(q.unpacked_codes()), np.asarray(scales)


def _assert_matches_numpy(x, fmt, name="", **kw):
  q = _q(x, fmt, **kw)
  codes, scales, outer = numpy_ref.quantize_np(np.asarray(jnp.asarray(x).astype(jnp.float32)), fmt, key=KEY, **kw)
  got_codes, got_scales = _bits(q)
  np.testing.assert_array_equal(got_scales, scales, err_msg=f"scales {fmt} {kw} {name}")
  np.testing.assert_array_equal(got_codes, codes, err_msg=f"codes {fmt} {kw} {name}")
  if outer is None:
    assert q.outer is None
  else:
    np.testing.assert_array_equal(np.asarray(q.outer), outer, err_msg=f"outer {fmt} {kw} {name}")


@pytest.mark.parametrize("axis", [0, -1])
@pytest.mark.parametrize("fmt,options", [c[1:] for c in CONFIGS], ids=CONFIG_IDS)
def test_matches_numpy(fmt, options, axis):
  for name, x in _inputs().items():
    _assert_matches_numpy(x, fmt, name, axis=axis, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,options", [c[1:] for c in CONFIGS], ids=CONFIG_IDS)
def test_gpu_matches_numpy(fmt, options):
  """Compiled by XLA for the GPU (whose own float32 `/` is approximate there), the same bits as numpy."""
  with jax.default_device(jax.devices("gpu")[0]):
    for name, x in _inputs().items():
      for axis in (0, -1):
        _assert_matches_numpy(x, fmt, name, axis=axis, **options)


@pytest.mark.parametrize("dtype,fmt,options", [
    (jnp.bfloat16, "mxfp4", {"rounding": "sr"}), (jnp.bfloat16, "nvfp4_46", {}), (jnp.float16, "nvfp4", {}),
    (jnp.float16, "nvfp4", {"rounding": "eden"})], ids=["bf16_mx_sr", "bf16_nv46", "f16_nv", "f16_eden"])
def test_low_precision_inputs_match_numpy(dtype, fmt, options):
  x = jnp.asarray(_inputs()["spread"] / 256, dtype)  # f16 range
  _assert_matches_numpy(x, fmt, **options)


@pytest.mark.parametrize("axis,fmt,options", [(0, "mxfp4", {"rounding": "sr"}), (1, "nvfp4_46", {}),
                                               (2, "nvfp4_tile", {"tile_rows": 5, "rounding": "sr"})],
                         ids=["mx_sr_axis0", "nv46_axis1", "nvtile_sr_axis2"])
def test_3d_inputs_match_numpy(axis, fmt, options):
  x = fresh_rng().standard_normal((32, 64, 32)).astype(np.float32)
  _assert_matches_numpy(x, fmt, axis=axis, **options)


def test_matches_numpy_eden_3d():
  x = fresh_rng().standard_normal((2, 256, 3)).astype(np.float32)
  _assert_matches_numpy(x, "nvfp4", axis=1, rounding="eden")


@functools.partial(jax.jit, static_argnames="axis")
def _eden_targets(x, axis):
  """reference.py's MS-EDEN pre-SR scale values t [K-major rows, nb], compiled as inside quantize."""
  xk = jnp.moveaxis(x, axis, -1)
  return ref._eden_targets(xk.reshape(*xk.shape[:-1], -1, 16), None)[1]


@pytest.mark.parametrize("axis", [0, -1])
def test_eden_scale_targets_match_numpy(axis):
  """The value t that the E4M3 scale SR rounds, bit for bit: its SR decision shows an ulp of t only when the
  uniform falls within that ulp (measured: 1 group in ~5e5), so test_matches_numpy alone would flake."""
  for name, x in _inputs().items():
    xk = np.moveaxis(x, axis, -1)
    bad = ~np.isfinite(xk.reshape(*xk.shape[:-1], -1, 16)).all(-1)
    _, want, _, _ = numpy_ref.eden_targets_np(xk.reshape(*xk.shape[:-1], -1, 16), bad)
    got = np.asarray(_eden_targets(jnp.asarray(x), axis))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=name)


@pytest.mark.parametrize("scale,row,col,value", [
    (1.0, 6, 83, "0x1.f004f6p+2"),  # XLA turned x / broadcast(s_b * s_dec) into x * (1 / ...): ys off by ulps
    (0.7071, 120, 3, "0x1.fbdaecp+1"),  # XLA contracted ys * ys + ys * ys in the sum's first level into an FMA
], ids=["broadcast_div", "fma"])
def test_eden_scale_regression(scale, row, col, value):
  """Fixed inputs whose E4M3 scale of block (row, col // 16) came out one code apart in reference.py and
  numpy_ref before both followed the float32 order of reference.py's docstring: the uniform lay between them."""
  i, j = np.meshgrid(np.arange(128), np.arange(128), indexing="ij")
  x = (((i * 131 + j * 71) % 257 - 128) / 16).astype(np.float32) * np.float32(scale)  # exact
  x[row, col] = float.fromhex(value)
  _assert_matches_numpy(x, "nvfp4", rounding="eden")


@pytest.mark.parametrize("rule", ["ocp", "noclip"])
def test_clip_fraction_threshold_is_float32_of_6_cf(rule):
  """Bounded clipping takes E - 1 exactly when the (exact) amax / 2^E is below fp32(6 * clip_fraction), the
  threshold the kernel and numpy_ref share: an amax on it keeps E, the float32 under it goes one finer."""
  t = np.float32(6 * 0.87)
  x = np.zeros((3, 32), np.float32)
  x[:, 0] = [t, np.nextafter(t, np.float32(0)), np.nextafter(t, np.float32(8))]
  q = ref.quantize(jnp.asarray(x), "mxfp4", scale_rule=rule, clip_fraction=0.87)
  np.testing.assert_array_equal(np.asarray(q.scales[:, 0], np.int32) - 127, [0, -1, 0])


@pytest.mark.parametrize("options", [{}, {"scale_rule": "noclip"}, {"tile_2d": True}, {"rounding": "sr"}],
                         ids=["ocp", "noclip", "tile_2d", "sr"])
def test_mxfp4_blocks_near_float32_max_stay_finite(options):
  """Huge finite values saturate, whatever the scale rule: an amax above 1.5 * 2^127 once got the scale 2^126
  under the no-clip rule, and its codes (4 or 6) dequantized to inf."""
  x = np.full((32, 32), 3.3e38, np.float32) * np.where(np.arange(32) % 2, 1, -1).astype(np.float32)
  q = _q(x, "mxfp4", **options)
  assert int(np.asarray(q.scales).max()) - 127 == 125
  out = np.asarray(ref.dequantize(q))
  assert np.isfinite(out).all() and (np.abs(out) == 6 * 2.0**125).all()


@pytest.mark.parametrize("fmt,options", [c[1:] for c in CONFIGS if c[1] != "mxfp4"],
                         ids=[c[0] for c in CONFIGS if c[1] != "mxfp4"])
def test_nvfp4_near_float32_max_saturates(fmt, options):
  """Huge finite values saturate: no block scale whose top decoded value passes float32 max (`scale_cap`). With
  SR's 17/16 headroom or MS-EDEN's correction (up to ~1.7x) the largest code once decoded to inf for an amax
  above ~3.2e38 (SR; ~2e38 for MS-EDEN), while RNE kept these tensors finite, as it still does, unchanged."""
  x = _inputs()["near_max"]
  for axis in (0, -1):
    d = np.asarray(ref.dequantize(_q(x, fmt, axis=axis, **options)))
    assert np.isfinite(d).all(), (axis, np.isinf(d).sum())
    top = np.abs(x) > 3e38
    np.testing.assert_allclose(d[top], x[top], rtol=0.05)


def test_scale_cap_binds_only_near_float32_max():
  """The cap is 448 (no cap) for every amax under RNE, for an SR amax up to 3.2e38 and an MS-EDEN one up to 1.9e38,
  so ordinary tensors keep their bits; 4/6 under RNE never reaches its caps (s_b <= 256 and 384)."""
  def outer(amax, scale_max, headroom):
    return ref.nvfp4_outer(ref.nvfp4_encode_scale(jnp.float32(amax), scale_max / headroom))
  h = ref.NV_HEADROOM["sr"]
  assert float(ref.scale_cap(outer(F32_MAX, 448, 1))) == 448
  assert float(ref.scale_cap(outer(3.2e38, 448, h))) == 448 > float(ref.scale_cap(outer(3.21e38, 448, h)))
  o46 = outer(F32_MAX, 256, 1)
  assert float(ref.scale_cap(o46)) == 256 and float(ref.scale_cap(o46, 4)) == 384
  assert float(ref.scale_cap(ref.eden_decode_scale(jnp.float32(1.9e38)))) == 448
  assert float(ref.scale_cap(ref.eden_decode_scale(jnp.float32(F32_MAX)))) == 256

def test_scale_caps_equal_scale_cap():
  """`scale_caps` (XLA's form: one comparison and a sum) gives `scale_cap`'s bits for every factor: each step's
  threshold float32 max / (v_max * t) and its float32 neighbours, fresh random factors, and the specials."""
  tops = np.array([v * t for v in (6.0, 4.0) for t in ref._CAP_STEPS], np.float64)
  edges = (np.float64(F32_MAX) / tops).astype(np.float32)
  near = np.concatenate([edges, np.nextafter(edges, np.float32(0)), np.nextafter(edges, np.float32(np.inf))])
  rng = fresh_rng()
  drawn = np.exp(rng.uniform(np.log(1e30), np.log(1e36), 256)).astype(np.float32)
  special = np.array([0.0, -0.0, 1e-45, 1.0, -1.0, F32_MAX, np.inf, -np.inf, np.nan], np.float32)
  factor = jnp.asarray(np.concatenate([near, drawn, special]))
  for v_maxes in ((6.0,), (6.0, 4.0)):
    caps = ref.scale_caps(factor, v_maxes)
    for v, cap in zip(v_maxes, caps):
      want = np.asarray(ref.scale_cap(factor, v))
      np.testing.assert_array_equal(np.asarray(cap), want, err_msg=f"{v_maxes=} {v=}")
      assert len(np.unique(want)) > 3, v  # the factors reach several steps
  assert [float(c) for c in ref.scale_caps(jnp.float32(1.0), (6.0, 4.0))] == [448.0, 448.0]  # a scalar factor



def test_tile_2d_orientations_agree():
  cases = [(SHAPE, "mxfp4", {}), (SHAPE, "mxfp4", {"clip_fraction": 0.87}), (SHAPE, "nvfp4", {}),
           (SHAPE, "nvfp4", {"rounding": "sr"}), ((64, 96), "mxfp4", {"rounding": "sr"}), ((64, 96), "nvfp4_46", {})]
  for shape, fmt, options in cases:
    w = jnp.asarray(_inputs(shape)["outliers"])
    a = _q(w, fmt, axis=0, tile_2d=True, **options)
    b = _q(w, fmt, axis=-1, tile_2d=True, **options)
    np.testing.assert_array_equal(a.unpacked_codes(), b.unpacked_codes().T)
    np.testing.assert_array_equal(ref.dequantize(a), ref.dequantize(b))
    # One scale per tile, written into every row of the tile.
    block = a.spec.block
    s = np.asarray(b.scales.astype(jnp.float32)).reshape(shape[0] // block, block, -1)
    assert (s == s[:, :1]).all()


def test_edge_values():
  x = np.zeros(SHAPE, np.float32)
  x[1] = 1e-30
  x[2] = 3e38
  x[3, :32] = np.nan
  q = _q(x, "mxfp4")
  np.testing.assert_array_equal(q.scales[0], 0)  # zero block: 2^-127
  np.testing.assert_array_equal(q.unpacked_codes()[0], 0)
  d = np.asarray(ref.dequantize(q))
  np.testing.assert_allclose(d[1], 1e-30, rtol=0.25)  # tiny blocks keep their values
  assert np.isfinite(d[2]).all() and (d[2] > 2e38).all()  # huge blocks saturate, no inf
  assert np.isnan(d[3, :32]).all() and (d[3, 32:] == 0).all()
  assert q.scales[3, 0] == 0xFF and (q.unpacked_codes()[3, :32] == 0).all()
  for fmt in ["nvfp4", "nvfp4_46", "nvfp4_tile"]:
    for scale in [1e-30, 3e38]:  # the tensor scale carries tiny and huge tensors
      y = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
      y *= np.float32(scale) / np.abs(y).max()
      d = np.asarray(ref.dequantize(_q(y, fmt)), np.float64)
      assert np.isfinite(d).all()
      y64 = y.astype(np.float64)
      assert np.sum((d - y64) ** 2) <= 0.02 * np.sum(y64 ** 2), (fmt, scale)
    q = _q(x, fmt)
    assert np.isnan(np.broadcast_to(q.outer, SHAPE[:1])[3])  # outer per tensor or per row tile
    assert np.isnan(np.asarray(ref.dequantize(q))[3]).all()


@pytest.mark.parametrize("fmt,options", [c[1:] for c in CONFIGS], ids=CONFIG_IDS)
def test_encode_like_reproduces_codes(fmt, options):
  """Dequantized values re-encoded (RNE) onto their own scales give back the codes, whatever the rounding."""
  q = _q(_inputs()["spread"], fmt, **options)
  q2 = ref.encode_like(ref.dequantize(q), q)
  np.testing.assert_array_equal(q2.codes, q.codes)


def test_encode_like_zero_blocks_and_fp8():
  """An all-zero block (scale 0) re-encodes to its own signed-zero codes, not NaN's; FP8 has no block scales."""
  x = jnp.concatenate([jnp.zeros((2, 16)), -jnp.zeros((2, 16)), jnp.ones((2, 16))], 1)
  for fmt in ("nvfp4", "mxfp4"):
    q = ref.quantize(x if fmt == "nvfp4" else jnp.concatenate([x, x], 1), fmt)
    np.testing.assert_array_equal(ref.encode_like(ref.dequantize(q), q).codes, q.codes, err_msg=fmt)
  with pytest.raises(ValueError, match="encode_like .* 'fp8_e4m3' has none"):
    ref.encode_like(x, ref.quantize(x, "fp8_e4m3"))
  q = ref.quantize(jnp.ones((64, 32)), "mxfp4")
  with pytest.raises(ValueError, match=r"x shaped like .*x.shape=\(32, 64\), like.shape=\(64, 32\)"):
    ref.encode_like(jnp.ones((32, 64)), q)  # as many elements, transposed: it reshaped into wrong codes
  with pytest.raises(TypeError, match=r"encode_like's like= takes a QTensor \(from quantize\), got an array of "
                                      r"shape \(64, 32\)"):
    ref.encode_like(jnp.ones((64, 32)), jnp.ones((64, 32)))  # was an AttributeError of a tracer


@pytest.mark.parametrize("fmt,options", [c[1:] for c in CONFIGS if c[2].get("rounding", "rne") == "rne"],
                         ids=[c[0] for c in CONFIGS if c[2].get("rounding", "rne") == "rne"])
def test_quantize_dequantize_is_a_projection(fmt, options):
  """RNE quantization of values it produced is a fixed point.

  MX: the same values bit for bit, and with the OCP rule the same codes and scales (the no-clip rule may pick a
  finer scale for a block whose max rounded down to 3: the same values). NVFP4: the same codes and E4M3 scales;
  the outer factor 1/S_enc may move by an ulp, since 1/(1/S) need not round back to S in float32.
  """
  q = _q(_inputs()["spread"], fmt, **options)
  d = ref.dequantize(q)
  q2 = _q(d, fmt, **options)
  if q.spec.scale == "e8m0":
    np.testing.assert_array_equal(ref.dequantize(q2), d)
  if q.spec.scale == "e4m3" or options.get("scale_rule", "ocp") == "ocp" and not options.get("tile_2d"):
    np.testing.assert_array_equal(q2.codes, q.codes)
    np.testing.assert_array_equal(_bits(q2)[1], _bits(q)[1])
  if q.outer is not None:
    np.testing.assert_allclose(q2.outer, q.outer, rtol=2.5e-7)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_sr_is_unbiased(fmt):
  x = jnp.asarray(np.random.default_rng(1).standard_normal((16, 64)), jnp.float32)
  keys = jax.random.split(jax.random.key(3), 1024)
  sr = jax.jit(jax.vmap(lambda k: ref.dequantize(ref.quantize(x, fmt, rounding="sr", key=k))))(keys)
  rne = ref.dequantize(ref.quantize(x, fmt))
  ns = np.array([16, 64, 256, 1024])
  err = [np.sqrt(np.mean((np.asarray(sr[:n].mean(0)) - np.asarray(x)) ** 2)) for n in ns]
  slope = np.polyfit(np.log(ns), np.log(err), 1)[0]
  assert -0.6 < slope < -0.4, (err, slope)
  assert np.mean((np.asarray(sr[0]) - x) ** 2) > np.mean((np.asarray(rne) - x) ** 2)


# NVFP4 SR configs: every format, 1-D blocks and 16x16 tiles.
NV_SR = [("nvfp4", False), ("nvfp4", True), ("nvfp4_46", False), ("nvfp4_46", True), ("nvfp4_tile", False),
         ("nvfp4_tile", True)]
NV_SR_IDS = [f + ("_2d" if t else "") for f, t in NV_SR]


def _nv_sr_scaled(x: np.ndarray, q) -> np.ndarray:
  """x * enc_b in float32 before the clamp, enc_b = 1 / fl(s_b * fl(1 / S_enc)) from numpy_ref's SR S_enc and
  q's scales.

  x [M, K] quantized along K; tile-local formats use `_q`'s tile_rows = 48.
  """
  fmt = q.spec.name
  rows = 48 if fmt == "nvfp4_tile" else x.shape[0]
  tile_amax = [np.abs(x[i:i + rows]).max() for i in range(0, x.shape[0], rows)]
  s_enc = np.repeat([numpy_ref.nv_s_enc(a, numpy_ref.SCALE_MAX[fmt], "sr") for a in tile_amax], rows)
  s_b = np.asarray(q.scales.astype(jnp.float32))  # [M, K / 16]
  with np.errstate(divide="ignore", over="ignore", invalid="ignore"):  # subnormal-scale blocks; callers mask
    outer = (np.float32(1) / s_enc[: x.shape[0], None].astype(np.float32)).astype(np.float32)
    enc = np.where(s_b == 0, np.float32(0), np.float32(1) / (s_b * outer).astype(np.float32))
    v = x.reshape(*s_b.shape, 16) * enc.astype(np.float32)[..., None]  # [M, K / 16, 16]
  return v


def _adversarial(fmt: str, seed: int = 0, shape=SHAPE) -> np.ndarray:
  """Blocks whose max puts the SR scale's t = amax_b * (S_enc * c) within 4 float32 ulps of an E4M3 rounding
  boundary (the midpoint of two normal codes; the ties 2^e * 17/16 round down), or whose max sits within 4 ulps
  of 6 * 2^e / S_enc. Each row tile's first row holds the amax, random in [1000, 2000)."""
  rng = np.random.default_rng(seed)
  amax = np.float32(1000 * (1 + rng.random()))
  s_enc = numpy_ref.nv_s_enc(amax, numpy_ref.SCALE_MAX[fmt], "sr")
  p = np.float32(s_enc * numpy_ref.inv_target(6.0, "sr"))
  codes = np.arange(8, 0x7F, dtype=np.uint8).view(numpy_ref.E4M3).astype(np.float64)  # normal E4M3 values
  targets = np.concatenate([(codes[:-1] + codes[1:]) / 2 / p, 6 * 2.0 ** np.arange(-6, 9) / s_enc])
  n = shape[0] * shape[1] // 16
  a = targets[rng.integers(len(targets), size=n)].astype(np.float32)
  a = (a.view(np.int32) + rng.integers(-4, 5, n).astype(np.int32)).view(np.float32)
  a = np.minimum(a, amax)
  x = rng.uniform(-1, 1, (n, 16)).astype(np.float32) * a[:, None]
  x[np.arange(n), rng.integers(0, 16, n)] = a * rng.choice(np.float32([-1, 1]), n)
  x = x.reshape(shape)
  x[::48, 0] = amax  # the global's and every 48-row tile's amax
  return x


@pytest.mark.parametrize("v_max", [6.0, 4.0])
def test_nv_inv_target_is_the_smallest_float32_above_the_no_clip_bound(v_max):
  """c >= (17/16 / v_max) (1 + 2^-22) exactly (docs/NUMERICS.md's proof needs the whole margin), and the next
  float32 down is below it. A float comparison got this wrong once: NumPy compares a float32 with a Python
  float in float32 (NEP 50), which left c one ulp low."""
  bound = Fraction(17, 16) / Fraction(v_max) * (1 + Fraction(1, 2**22))
  c = ref.nv_inv_target(v_max, 17 / 16)
  assert c.dtype == np.float32
  assert Fraction(float(c)) >= bound > Fraction(float(np.nextafter(c, np.float32(0))))
  assert ref.nv_inv_target(v_max, 1.0) == np.float32(1 / v_max)


@pytest.mark.parametrize("fmt,tile_2d", NV_SR, ids=NV_SR_IDS)
def test_nvfp4_sr_never_clips(fmt, tile_2d):
  """With the 17/16 headroom no scaled |x| exceeds 6 before the clamp, for every block with a normal E4M3 scale
  (subnormal scales are outside the guarantee: reference.py's docstring)."""
  inputs = _inputs()
  for name in ["normal", "student_t", "outliers", "spread", "ties", "huge", "tiny"]:
    x = inputs[name]
    q = _q(x, fmt, rounding="sr", tile_2d=tile_2d)
    v = np.abs(_nv_sr_scaled(x, q))
    normal = np.asarray(q.scales.astype(jnp.float32)) >= 2.0**-6
    # Heavy outliers (lognormal multipliers up to ~e^12) leave most blocks with subnormal scales: 13% measured.
    assert normal.mean() > 0.05, (name, normal.mean())
    assert v[normal].max() <= 6, (name, v[normal].max())
  for seed in range(8):
    x = _adversarial(fmt, seed)
    q = _q(x, fmt, rounding="sr", tile_2d=tile_2d)
    v = np.abs(_nv_sr_scaled(x, q))
    assert (np.asarray(q.scales.astype(jnp.float32)) >= 2.0**-6).all()
    assert 5.6 < v.max() <= 6, (seed, v.max())


@pytest.mark.parametrize("fmt,tile_2d", NV_SR[::2] + NV_SR[1:2], ids=NV_SR_IDS[::2] + NV_SR_IDS[1:2])
def test_nvfp4_sr_is_unbiased_at_block_maxima(fmt, tile_2d):
  """The mean of SR draws of every unit max converges to it: the summed z-score over all unit maxima is small.

  Each draw is one of the two grid neighbours lo <= v <= hi of the scaled value v, with variance
  (hi - v) (v - lo); a clipped max (the scale without headroom) always rounds down to 6, a bias of up to 6%.
  """
  n = 512
  keys = jax.random.split(jax.random.key(11), n)
  options = dict(rounding="sr", tile_2d=tile_2d, tile_rows=48 if fmt == "nvfp4_tile" else 128)  # as `_q`
  draws = jax.jit(jax.vmap(lambda x, k: ref.dequantize(ref.quantize(x, fmt, key=k, **options)), (None, 0)))
  grid = np.asarray(numpy_ref.GRID, np.float64)
  unit = 16 if tile_2d else 1
  for x in [_adversarial(fmt), _inputs()["spread"]]:
    mean = np.asarray(jnp.mean(draws(jnp.asarray(x), keys), axis=0), np.float64)
    v = np.abs(_nv_sr_scaled(x, _q(x, fmt, **options))).reshape(x.shape).astype(np.float64)
    lo = grid[np.searchsorted(grid, v, side="right") - 1]
    hi = grid[np.minimum(np.searchsorted(grid, v, side="right"), 7)]
    amax_b = np.abs(x).reshape(x.shape[0] // unit, unit, -1, 16).max(axis=(1, 3), keepdims=True)
    is_max = (np.abs(x).reshape(amax_b.shape[0], unit, -1, 16) == amax_b).reshape(x.shape)
    x64 = x.astype(np.float64)[is_max]
    bias = (mean[is_max] - x64) * np.sign(x64)  # < 0: towards zero, as clipping does
    # Var of one draw in x units: (hi - v)(v - lo) in grid units, times (x / v)^2.
    v, lo, hi = v[is_max], lo[is_max], hi[is_max]
    var = np.where(v > 0, (hi - v) * (v - lo) * (x64 / np.where(v > 0, v, 1)) ** 2, 0) / n
    z = np.sum(bias) / np.sqrt(np.sum(var))
    rel_bias = np.mean(bias / np.abs(x64))  # for the message
    assert abs(z) < 5, (z, rel_bias)  # without headroom: z = -35 .. -75, rel_bias = -0.9% .. -1.9%


def _rel_mse(d, x):
  return float(jnp.sum((d - x) ** 2) / jnp.sum(x ** 2))


@functools.lru_cache
def _quartet_inputs(n=1024):
  x = jax.random.normal(jax.random.key(0), (n, 128)) * jnp.exp2(jnp.linspace(0, 8, n))[:, None]
  return hadamard(x, "rht128", key=jax.random.key(1)), jax.random.normal(jax.random.key(2), (n, 128))


def test_quartet2_reference_errors():
  """NUMERICS.md "Reference results" (Quartet II table), within 5%."""
  y, g = _quartet_inputs()
  got = {
      "rht_rtn": _rel_mse(ref.dequantize(ref.quantize(y, "nvfp4")), y),
      "rht_sr": _rel_mse(ref.dequantize(ref.quantize(y, "nvfp4", rounding="sr", key=KEY)), y),
      "rht_eden": _rel_mse(ref.dequantize(ref.quantize(y, "nvfp4", rounding="eden", key=KEY)), y),
      "gauss_rtn": _rel_mse(ref.dequantize(ref.quantize(g, "nvfp4")), g),
      "gauss_46": _rel_mse(ref.dequantize(ref.quantize(g, "nvfp4_46")), g),
      "gauss_16x16": _rel_mse(ref.dequantize(ref.quantize(g, "nvfp4", tile_2d=True)), g),
  }
  want = dict(rht_rtn=9.0e-3, rht_sr=23.5e-3, rht_eden=9.8e-3, gauss_rtn=9.0e-3, gauss_46=7.6e-3,
              gauss_16x16=12.4e-3)
  for name in want:
    assert abs(got[name] / want[name] - 1) < 0.05, (name, got[name], want[name])


@pytest.mark.parametrize("call,match", [
    (lambda x: ref.quantize(x, "fp5"), "known formats"),
    (lambda x: ref.quantize(x, "mxfp4", rounding="up"), "valid roundings"),
    (lambda x: ref.quantize(x[:, :48], "mxfp4"), "multiple of the mxfp4 block=32"),
    (lambda x: ref.quantize(x[:, :40], "nvfp4"), "multiple of the nvfp4 block=16"),
    (lambda x: ref.quantize(x.reshape(2, 32, 64), "mxfp4", tile_2d=True), "2-D input"),
    (lambda x: ref.quantize(x[:48], "mxfp4", axis=1, tile_2d=True), "other axis m=48"),
    (lambda x: ref.quantize(x, "mxfp4", rounding="eden", key=KEY), "needs fmt='nvfp4'"),
    (lambda x: ref.quantize(x, "nvfp4", rounding="eden", key=KEY), "multiple of 128"),
    (lambda x: ref.quantize(x, "nvfp4", rounding="sr"), "needs a key"),
    (lambda x: ref.quantize(x, "nvfp4", rounding="sr", key=3), "needs a key: one JAX PRNG key"),
    (lambda x: ref.quantize(x, "nvfp4", rounding="sr", key=jax.random.split(KEY, 4)),
     "needs a key: one JAX PRNG key"),
    (lambda x: ref.quantize(x, "nvfp4", key=3), r"key= \(unused by rounding='rne'\) needs a key: one JAX PRNG key"),
    (lambda x: ref.quantize(x.astype(jnp.int32), "nvfp4"), "floating-point"),
    (lambda x: ref.quantize(x, "mxfp4", scale_rule="floor"), "valid rules"),
    (lambda x: ref.quantize(x, "nvfp4", scale_rule="ocp"), "mxfp4 only"),
    (lambda x: ref.quantize(x, "mxfp4", axis=2), "out of range"),
    (lambda x: ref.quantize(x, "nvfp4", tensor_amax=jnp.ones(3)), r"one value .* got shape \(3,\)"),
    (lambda x: ref.dequantize(ref.quantize(x, "mxfp4"), jnp.int8), "floating-point dtype, got int8"),
    (lambda x: ref.dequantize(ref.quantize(x, "mxfp4"), "fp32"), "floating-point dtype, got 'fp32'"),
    pytest.param(lambda x: ref.dequantize(ref.quantize(x, "mxfp4"), jnp.float64),  # was float32, silently
                 r"dequantize's dtype=float64 needs jax_enable_x64 \(JAX would truncate it to float32\)",
                 marks=pytest.mark.skipif(jax.config.jax_enable_x64, reason="float64 is float64 with x64")),
])
def test_invalid_calls(call, match):
  with pytest.raises(ValueError, match=match):
    call(jnp.ones((64, 64)))


@pytest.mark.parametrize("call,match", [
    (lambda x: ref.quantize(x, "mxfp4", axis="a"), "axis must be an int, got 'a'"),
    (lambda x: ref.quantize(np.asarray(x).tolist(), "mxfp4"), r"takes an array, got a list"),
    (lambda x: ref.quantize(x, "mxfp4", tile_2d="no"), "tile_2d takes True or False, got 'no'"),  # was True
    (lambda x: ref.dequantize(x), r"takes a QTensor \(from quantize\), got an array of shape \(64, 64\)"),
    (lambda x: ref.quantize(x, "nvfp4_tile", tile_rows=2.5), "tile_rows takes an int, got 2.5"),  # was 2 rows
    (lambda x: ref.quantize(x, "nvfp4_tile", tile_rows=True), "tile_rows takes an int, got True"),
    (lambda x: ref.quantize(x, "mxfp4", clip_fraction="0.87"), "clip_fraction takes a number .* got '0.87'"),
])
def test_invalid_call_types(call, match):
  with pytest.raises(TypeError, match=match):
    call(jnp.ones((64, 64)))


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8_e4m3"])
def test_vmapped_qtensor_dequantizes_under_vmap(fmt):
  """jax.vmap of quantize returns batched codes under one example's static shape: dequantize outside the vmap
  raised a reshape error deep in JAX (FP4) or returned the values transposed, (2, 64, 2) for (2, 2, 64) (FP8).
  It is a ValueError that says to decode under a vmap, which gives each example's values."""
  x = jax.random.normal(KEY, (2, 2, 64))
  q = jax.vmap(lambda a: ref.quantize(a, fmt))(x)
  match = r"codes \(2, 2, \d+\) do not fit its shape \(2, 64\).*jax.vmap\(dequantize\)"
  with pytest.raises(ValueError, match=match):
    ref.dequantize(q)
  for i in range(2):
    np.testing.assert_array_equal(jax.vmap(ref.dequantize)(q)[i], ref.dequantize(ref.quantize(x[i], fmt)))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "nvfp4_tile"])
@pytest.mark.parametrize("shape, axis", [((0, 32), 1), ((4, 0), 1), ((0, 64), 0)])
def test_empty_tensors_round_trip(fmt, shape, axis):
  q = ref.quantize(jnp.ones(shape), fmt, axis=axis)
  assert q.shape == shape
  assert ref.dequantize(q).shape == shape


@pytest.mark.parametrize("fmt, exponent", [("mxfp4", -127), ("nvfp4", -118), ("nvfp4", -60)])
def test_tiny_tensors_dequantize_without_flush_to_zero(fmt, exponent):
  """Codes and scales of tiny (normal) inputs decode to their values on every backend, although an E8M0 scale
  2^-127 (a block amax in [2^-125, 2^-124)) and an NVFP4 outer factor 1 / S_enc of a tensor amax below ~3.2e-35
  are subnormal, which XLA:CPU's multiplication would treat as zero."""
  x = jnp.asarray(np.linspace(2, 6, 64, dtype=np.float32).reshape(2, 32) * np.float32(2.0**exponent))
  q = ref.quantize(x, fmt)
  codes = np.asarray(ref.e2m1_decode(q.unpacked_codes()), np.float64)  # [2, 32]
  if fmt == "mxfp4":
    scales = np.ldexp(1.0, np.asarray(q.scales, np.int64) - 127)  # numpy keeps subnormals
    assert int(np.asarray(q.scales).min()) == 0  # the subnormal scale 2^-127 is in use
  else:
    scales = np.asarray(ref.ieee.e4m3_to_f32(q.scales), np.float64)
  outer = 1.0 if q.outer is None else np.float64(np.asarray(q.outer))
  want = (codes * np.repeat(scales, q.spec.block, axis=-1) * outer).astype(np.float32)  # one rounding
  got = np.asarray(ref.dequantize(q))
  assert np.all(want != 0) and np.all(np.abs(want / np.asarray(x) - 1) < 0.25)
  np.testing.assert_array_equal(got, want)


def test_nvfp4_encodes_in_transformer_engines_order():
  """Transformer Engine (>= 2.8) encodes a block with 1 / fl(s_b * fl(1 / S_enc)), not fl(S_enc / s_b): under
  tensor amax 2000 and block scale 3.5, x = 1.953125 lands at 0.74999994 (code 0.5) in TE's order and on the
  E2M1 tie 0.75 (code 1.0) in the other."""
  x = np.zeros((1, 32), np.float32)
  x[0, 0], x[0, 16], x[0, 17] = 2000.0, 15.6, 1.953125
  q = ref.quantize(jnp.asarray(x), "nvfp4")
  assert float(q.scales.astype(jnp.float32)[0, 1]) == 3.5
  assert float(ref.e2m1_decode(q.unpacked_codes())[0, 17]) == 0.5


@pytest.mark.parametrize("amax", [float("inf"), float("nan"), -1.0])
@pytest.mark.parametrize("fmt,opts", [("nvfp4", {}), ("nvfp4_46", {}), ("nvfp4", {"rounding": "eden", "key": KEY}),
                                      ("fp8_e4m3", {})])
def test_a_given_tensor_amax_that_is_no_finite_magnitude_makes_the_tensor_nan(fmt, opts, amax):
  """An infinite, NaN or negative `tensor_amax` (a traced value, so not refused) is a non-finite amax: outer NaN,
  every scale NaN with zero codes, as a non-finite element gives (docs/NUMERICS.md "Special values"), where an
  infinite one gave S_enc = 0, an infinite outer and zero scales, and a negative one finite values."""
  x = jnp.asarray(np.random.default_rng(3).normal(size=(8, 256)), jnp.float32)
  q = ref.quantize(x, fmt, tensor_amax=jnp.float32(amax), **opts)
  assert np.isnan(float(q.outer))
  if q.scales is not None:
    assert np.isnan(np.asarray(q.scales, np.float32)).all()
    assert not np.asarray(q.codes).any()
  assert np.isnan(np.asarray(ref.dequantize(q))).all()


@pytest.mark.parametrize("fmt,rounding", [("mxfp4", "rne"), ("mxfp4", "sr"), ("nvfp4", "rne")])
def test_float64_input_saturates_into_float32(fmt, rounding):
  """Under jax_enable_x64 a float64 x is quantized as float32 with its finite values beyond float32's range
  saturated (the bits of the clipped float32 input, finite values back): the plain cast made 3e300 inf and its
  block NaN. An infinite element still makes its block (NVFP4: its tensor) NaN."""
  top = np.finfo(np.float32).max
  x = np.array([[3e300, 1.0, -5e39] + [0.5] * 29, [2.0] + [1.0] * 31])
  key = jax.random.key(0) if rounding == "sr" else None
  with jax.enable_x64(True):
    got = ref.quantize(jnp.asarray(x, jnp.float64), fmt, rounding=rounding, key=key)
    values = np.asarray(ref.dequantize(got))
    inf = np.asarray(ref.dequantize(ref.quantize(jnp.asarray(np.where(x == 1.0, np.inf, x), jnp.float64), fmt,
                                                 rounding=rounding, key=key)))
  want = ref.quantize(jnp.asarray(np.clip(x, -top, top), jnp.float32), fmt, rounding=rounding, key=key)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert np.isfinite(values).all() and values[0, 0] > 1e38 and values[0, 2] < -1e38
  assert np.isnan(inf).all()
