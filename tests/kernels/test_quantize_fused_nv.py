"""The fused dual-view NVFP4 quantizer equals `reference.quantize` bit for bit (Pallas interpret mode on CPU)."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax import ieee, reference
from fp4jax.hadamard import hadamard
from fp4jax.kernels import quantize_fused_nv as qnv
from fp4jax.kernels.tiling import QuantTile

SHAPE = (64, 128)
TILE = QuantTile(32, 64, num_warps=4)  # 2 x 2 programs: exercises the tile offsets and the SR counters
TILE_ROWS = 64  # "nvfp4_tile": 1 row tile per 2 programs along M, 2 column tiles along K


def _normal(rng):
  return rng.standard_normal(SHAPE).astype(np.float32)


def _heavy(rng):
  """Student-t (2 degrees of freedom) with rare 1e4 outliers: many blocks far below the tensor amax."""
  x = rng.standard_t(2, SHAPE).astype(np.float32)
  x[rng.random(SHAPE) < 0.01] *= 1e4
  return x


def _special_blocks(rng):
  """Zero, signed-zero, 1e-30, E4M3-subnormal-scale, exact-grid, tie and 3e38 blocks; no NaN / Inf."""
  x = _normal(rng)
  x[0:16, 0:16] = 0.0
  x[16:32, 0:16] = -0.0
  x[32:48, 0:16] *= 1e-30
  x[48:64, 0:16] *= np.exp2(rng.integers(-22, -8, (16, 1))).astype(np.float32)  # s_b below 2^-6 or 0
  x[0:32, 16:32] = rng.choice([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -2.5, -0.25], (32, 16))
  x[32:64, 16:32] *= np.exp2(rng.integers(-16, 0, (32, 16))).astype(np.float32)  # scales across E4M3's range
  x[5, 40] = 3e38
  x[60, 100] = -3e38
  return x


def _nonfinite(rng):
  """NaN and +-Inf inside one 16x16 region (one block per view and orientation), the rest normal."""
  x = _normal(rng)
  x[3, 20] = np.nan
  x[7, 25] = np.inf
  x[40, 90] = -np.inf
  return x


INPUTS = {"normal": _normal, "heavy": _heavy, "special": _special_blocks}
ROUNDINGS = [("rne", "rne"), ("sr", "rne"), ("rne", "sr"), ("sr", "sr")]


def _assert_same(got, want):
  for leaf in ("codes", "scales", "outer"):
    g, w = np.asarray(getattr(got, leaf)), np.asarray(getattr(want, leaf))
    assert g.dtype == w.dtype and g.shape == w.shape, (leaf, g.dtype, w.dtype, g.shape, w.shape)
    g, w = g.view(f"u{g.itemsize}"), w.view(f"u{w.itemsize}")  # bit patterns: NaN scales and outers compare
    bad = np.argwhere(g != w)
    assert bad.size == 0, f"{leaf}: {len(bad)} mismatches, first at {bad[:3].tolist()}: " \
                          f"{g[tuple(bad[0])]:#x} vs {w[tuple(bad[0])]:#x}"
  assert (got.fmt, got.axis, got.shape) == (want.fmt, want.axis, want.shape)


def _check(x, fmt="nvfp4", row_rounding="rne", col_rounding="rne", *, seed=0, tensor_amax=None):
  """Runs the kernel and compares both views with the reference; row and column SR use different keys."""
  kr, kc = jax.random.key(seed), jax.random.key(seed + 1)
  opts = dict(tile_rows=TILE_ROWS) if fmt == "nvfp4_tile" else dict(tensor_amax=tensor_amax)
  row, col = qnv.quantize_dual_nv(x, fmt, row_rounding=row_rounding, col_rounding=col_rounding, row_key=kr,
                                  col_key=kc, tile=TILE, interpret=True, **opts)
  _assert_same(row, reference.quantize(x, fmt, axis=-1, rounding=row_rounding, key=kr, **opts))
  _assert_same(col, reference.quantize(x, fmt, axis=0, rounding=col_rounding, key=kc, **opts))
  return row, col


def _bf16(a):
  return jnp.asarray(a).astype(jnp.bfloat16)


@pytest.mark.parametrize("row_rounding,col_rounding", ROUNDINGS)
@pytest.mark.parametrize("kind", sorted(INPUTS))
def test_global_matches_reference(kind, row_rounding, col_rounding):
  rng = np.random.default_rng(zlib.crc32(f"{kind}/{row_rounding}/{col_rounding}".encode()))
  _check(_bf16(INPUTS[kind](rng)), "nvfp4", row_rounding, col_rounding, seed=int(rng.integers(1 << 30)))


@pytest.mark.parametrize("row_rounding,col_rounding", [("rne", "rne"), ("sr", "rne"), ("sr", "sr")])
@pytest.mark.parametrize("kind", ["heavy", "special"])
def test_tile_local_matches_reference(kind, row_rounding, col_rounding):
  rng = np.random.default_rng(zlib.crc32(f"tile/{kind}/{row_rounding}/{col_rounding}".encode()))
  x = INPUTS[kind](rng) * np.exp2(rng.integers(-40, 1, (1, SHAPE[1]))).astype(np.float32)  # column tiles differ
  _check(_bf16(x), "nvfp4_tile", row_rounding, col_rounding, seed=int(rng.integers(1 << 30)))


def _check_transform(x, transform, row_rounding, col_rounding, seed=0, tile=TILE):
  """The column view of hadamard(x, transform, axis=0) (its own amax and S_enc), the row view of x."""
  kr, kc, kt = jax.random.key(seed), jax.random.key(seed + 1), jax.random.key(seed + 2)
  row, col = qnv.quantize_dual_nv(x, "nvfp4", row_rounding=row_rounding, col_rounding=col_rounding, row_key=kr,
                                  col_key=kc, col_transform=transform, transform_key=kt, tile=tile,
                                  interpret=tile is not None)
  _assert_same(row, reference.quantize(x, "nvfp4", axis=-1, rounding=row_rounding, key=kr))
  xt = hadamard(x, transform, axis=0, key=kt)
  _assert_same(col, reference.quantize(xt, "nvfp4", axis=0, rounding=col_rounding, key=kc))


# The nvfp4 route's X (RNE, RHT16 wgrad view) and dY (SR dgrad view, SR RHT16 wgrad view), and fixed signs.
@pytest.mark.parametrize("kind,transform,row_rounding,col_rounding", [
    ("heavy", "rht16", "rne", "rne"), ("special", "rht16", "sr", "sr"), ("normal", "h16", "rne", "sr"),
    ("heavy", "rht32", "sr", "rne")])
def test_column_transform_matches_reference(kind, transform, row_rounding, col_rounding):
  rng = np.random.default_rng(zlib.crc32(f"t/{kind}/{transform}/{row_rounding}/{col_rounding}".encode()))
  _check_transform(_bf16(INPUTS[kind](rng)), transform, row_rounding, col_rounding, int(rng.integers(1 << 30)))


@pytest.mark.parametrize("kind", sorted(INPUTS) + ["nonfinite"])
def test_four_over_six_matches_reference(kind):
  """4/6 (quartet2's forward): both targets' codes and squared errors per block, the lower kept."""
  make = {**INPUTS, "nonfinite": _nonfinite}[kind]
  x = _bf16(make(np.random.default_rng(zlib.crc32(f"46/{kind}".encode()))))
  row, col = _check(x, "nvfp4_46")
  if kind in ("normal", "heavy"):  # some blocks keep the 6-target scale, others take the 4-target one
    xb = np.asarray(x, np.float32).reshape(SHAPE[0], -1, 16)
    s_enc = reference.nvfp4_encode_scale(jnp.float32(np.abs(xb).max()), 256.0)
    s6 = reference._nv_block_scale(jnp.asarray(np.abs(xb).max(-1)), s_enc, 6.0)  # pylint: disable=protected-access
    six = np.asarray(row.scales).view(np.uint8) == np.asarray(s6).view(np.uint8)
    assert six.any() and not six.all()


def test_column_transform_nonfinite():
  x = _nonfinite(np.random.default_rng(21))  # NaN/Inf spread through their Hadamard blocks
  _check_transform(_bf16(x), "rht16", "rne", "rne")


def test_tile_local_ragged_last_tiles():
  """M and K not multiples of tile_rows: the last row tile and the last column tile are shorter."""
  rng = np.random.default_rng(14)
  x = rng.standard_t(2, (96, 160)).astype(np.float32) * np.exp2(rng.integers(-20, 1, (96, 1))).astype(np.float32)
  kr = jax.random.key(15)
  row, col = qnv.quantize_dual_nv(_bf16(x), "nvfp4_tile", row_rounding="sr", row_key=kr, tile_rows=TILE_ROWS,
                                  tile=QuantTile(32, 32), interpret=True)
  _assert_same(row, reference.quantize(_bf16(x), "nvfp4_tile", axis=-1, rounding="sr", key=kr,
                                       tile_rows=TILE_ROWS))
  _assert_same(col, reference.quantize(_bf16(x), "nvfp4_tile", axis=0, tile_rows=TILE_ROWS))


def _check_2d(x, fmt="nvfp4", rounding="rne", *, seed=0, tensor_amax=None):
  """tile_2d: both views against the reference with one rounding and one key; "nvfp4" views hold equal values."""
  key = jax.random.key(seed)
  opts = dict(tile_rows=TILE_ROWS) if fmt == "nvfp4_tile" else dict(tensor_amax=tensor_amax)
  row, col = qnv.quantize_dual_nv(x, fmt, row_rounding=rounding, col_rounding=rounding, row_key=key,
                                  col_key=key, tile_2d=True, tile=TILE, interpret=True, **opts)
  for got, axis in ((row, -1), (col, 0)):
    _assert_same(got, reference.quantize(x, fmt, axis=axis, rounding=rounding, key=key, tile_2d=True, **opts))
  if fmt == "nvfp4":  # one scale per tile and one S_enc: the same codes in both layouts
    dq_row, dq_col = (np.asarray(reference.dequantize(q)) for q in (row, col))
    np.testing.assert_array_equal(dq_row.view(np.uint32), dq_col.view(np.uint32))
  return row, col


@pytest.mark.parametrize("rounding", ["rne", "sr"])
@pytest.mark.parametrize("kind", sorted(INPUTS))
def test_tile_2d_matches_reference(kind, rounding):
  rng = np.random.default_rng(zlib.crc32(f"2d/{kind}/{rounding}".encode()))
  _check_2d(_bf16(INPUTS[kind](rng)), "nvfp4", rounding, seed=int(rng.integers(1 << 30)))


@pytest.mark.parametrize("rounding", ["rne", "sr"])
def test_tile_2d_tile_local_matches_reference(rounding):
  """"nvfp4_tile" with 2-D tiles: one tile scale, each view under its own row-tile S_enc (different codes)."""
  rng = np.random.default_rng(zlib.crc32(f"2d/tile/{rounding}".encode()))
  x = _heavy(rng) * np.exp2(rng.integers(-40, 1, (1, SHAPE[1]))).astype(np.float32)
  row, col = _check_2d(_bf16(x), "nvfp4_tile", rounding, seed=int(rng.integers(1 << 30)))
  assert not np.array_equal(np.asarray(reference.dequantize(row)), np.asarray(reference.dequantize(col)))


@pytest.mark.parametrize("amax", [None, 4.0])
def test_tile_2d_nonfinite(amax):
  """NaN / Inf: with the computed amax everything is NaN; with a given one only the tiles holding them."""
  x = _nonfinite(np.random.default_rng(16))
  x[32:48, 0:16] = 0.0  # a zero tile
  row, _ = _check_2d(_bf16(x), "nvfp4", "sr", seed=17, tensor_amax=None if amax is None else jnp.float32(amax))
  nan_tiles = np.asarray(row.scales).view(np.uint8).reshape(4, 16, 8).max(axis=1) == 0x7F  # [M/16, K/16]
  assert nan_tiles.sum() == (nan_tiles.size if amax is None else 2)  # [0:16, 16:32] and [32:48, 80:96]
  _check_2d(_bf16(x), "nvfp4_tile", "rne")


def test_sr_views_differ_by_key():
  """Row SR and column SR draw from their own keys: the same key on both would give other column codes."""
  x = _bf16(_normal(np.random.default_rng(5)))
  _, col = _check(x, "nvfp4", "sr", "sr", seed=7)
  same_key = reference.quantize(x, "nvfp4", axis=0, rounding="sr", key=jax.random.key(7))
  assert not np.array_equal(np.asarray(col.codes), np.asarray(same_key.codes))


def test_zeros():
  for x in (jnp.zeros(SHAPE, jnp.bfloat16), -jnp.zeros(SHAPE, jnp.bfloat16)):
    row, col = _check(x, "nvfp4", "sr", "rne")
    assert float(row.outer) == 1.0 and not np.asarray(row.scales, np.float32).any()
  _check(jnp.zeros(SHAPE, jnp.bfloat16), "nvfp4_tile", "rne", "sr")


@pytest.mark.parametrize("scale", [1e-30, 1e-39, 3e38])
def test_tiny_and_huge_tensors(scale):
  """Tensors with amax 1e-30, a bf16 subnormal amax (S_enc clamps to f32 max, enc_b overflows), near bf16 max."""
  x = _normal(np.random.default_rng(6))
  x = _bf16(x * np.float32(scale / np.abs(x).max()))
  _check(x, "nvfp4", "rne", "sr")
  _check(x, "nvfp4", "sr", "rne")


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_tile"])
def test_nonfinite(fmt):
  """NaN / Inf make the (tile) amax NaN: outer NaN, every scale it governs NaN (0x7F), codes zero."""
  row, col = _check(_bf16(_nonfinite(np.random.default_rng(8))), fmt, "sr", "rne")
  assert np.isnan(np.asarray(row.outer)).any() and np.isnan(np.asarray(col.outer)).any()


@pytest.mark.parametrize("amax", [4.0, 1e-30, float("inf")])
def test_given_tensor_amax(amax):
  """A caller's amax: NaN / Inf blocks alone get NaN scales; a stale small amax saturates at 448 and 6."""
  x = _bf16(_nonfinite(np.random.default_rng(9)))
  row, _ = _check(x, "nvfp4", "rne", "sr", tensor_amax=jnp.float32(amax))
  if amax == 4.0:
    nan_blocks = np.asarray(row.scales).view(np.uint8) == 0x7F
    assert 0 < nan_blocks.sum() < nan_blocks.size


def test_bf16_amax_matches_reference():
  x = _nonfinite(np.random.default_rng(10))
  for a in (x, np.where(np.isnan(x), 1.0, x), np.where(np.isfinite(x), x, 1.0), -np.abs(x), np.zeros(SHAPE)):
    got, want = qnv.bf16_amax(_bf16(a)), reference._amax(_bf16(a).astype(jnp.float32))
    assert np.asarray(got).view(np.uint32) == np.asarray(want).view(np.uint32), (got, want)


def test_e4m3_rn_matches_xla():
  """The kernel's bit-arithmetic E4M3 rounding against XLA's cast: every value, midpoint and its neighbours."""
  grid = np.arange(0x7F, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32)  # all finite E4M3 >= 0
  mids = (grid[:-1] + grid[1:]) / 2
  t = np.concatenate([grid, mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf), np.nextafter(grid, 0)])
  t = np.concatenate([t, np.exp2(np.random.default_rng(11).uniform(-14, np.log2(448), 20000))])
  t = jnp.asarray(np.clip(t, 0, 448).astype(np.float32))
  byte, value = qnv.e4m3_rn_bits(t)
  want = reference.e4m3_rn(t)
  np.testing.assert_array_equal(np.asarray(byte), np.asarray(want).view(np.uint8))
  np.testing.assert_array_equal(np.asarray(value), np.asarray(want.astype(jnp.float32)))


@pytest.mark.parametrize("s_enc", [1.0, 2688.0 / 3.0, 2529.8823 / 3e38, 3.4028235e38, 2688.0 / 1e-30])
def test_block_encode_is_the_exact_quotient(s_enc):
  """q_j * 2^-e equals the reference's correctly rounded S_enc / s_b for every E4M3 s_b (0 -> 0)."""
  sf = jnp.asarray(np.arange(0x7F, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32))
  s = jnp.float32(s_enc)
  params = jnp.concatenate([jnp.zeros((1,)), ieee.div(s, jnp.asarray(qnv._MANTISSAS))])[None]  # [1, 9]
  got = qnv._block_encode(sf, params)
  safe = jnp.where(sf == 0, 1.0, sf)
  want = jnp.where(sf == 0, 0.0, jnp.minimum(ieee.div(jnp.broadcast_to(s, sf.shape), safe), 3.4028235e38))
  np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))


def test_one_named_kernel_in_lowering():
  x = jnp.ones(SHAPE, jnp.bfloat16)
  fn = jax.jit(lambda x: qnv.quantize_dual_nv(x, tile=TILE, interpret=True))
  assert str(jax.make_jaxpr(fn)(x)).count(f"name={qnv.KERNEL_NAME}") == 1
  assert qnv.KERNEL_NAME in fn.lower(x).as_text(debug_info=True)


@pytest.mark.parametrize("fmt,tile_2d", [("nvfp4", False), ("nvfp4_tile", False), ("nvfp4", True)])
def test_triton_lowering_has_no_float_division(fmt, tile_2d, triton_modules):
  """The Triton IR (lowered on CPU for an abstract H200) has no float division: Triton's would be approximate."""
  col_rounding = "sr" if tile_2d else "rne"
  modules = triton_modules(lambda x: qnv.quantize_dual_nv(x, fmt, row_rounding="sr", col_rounding=col_rounding,
                                                          row_key=jax.random.key(0), tile_2d=tile_2d), (256, 256))
  assert len(modules) == 1 and "tt.load" in modules[0]
  assert "divf" not in modules[0] and "fdiv" not in modules[0]


def test_supported():
  assert qnv.supported("nvfp4", "sr", "rne", shape=(64, 128), dtype=jnp.bfloat16)
  assert qnv.supported("nvfp4_tile", "rne", "sr", shape=(256, 384), tile_rows=128)
  assert not qnv.supported("mxfp4", "rne", "rne")
  assert qnv.supported("nvfp4_46", "rne", "rne", shape=(64, 128), dtype=jnp.bfloat16)
  assert not qnv.supported("nvfp4_46", "sr", "rne") and not qnv.supported("nvfp4_46", "rne", "rne", tile_2d=True)
  assert not qnv.supported("nvfp4_46", "rne", "rne", col_transform="rht16")
  assert not qnv.supported("nvfp4", "eden", "rne")
  assert qnv.supported("nvfp4", "sr", "sr", tile_2d=True, shape=(64, 128), dtype=jnp.bfloat16)
  assert qnv.supported("nvfp4_tile", "rne", "rne", tile_2d=True, tile_rows=64)
  assert not qnv.supported("nvfp4", "sr", "rne", tile_2d=True)
  assert not qnv.supported("nvfp4", "rne", "rne", transform="rht16")  # a row-view transform
  assert qnv.supported("nvfp4", "sr", "sr", col_transform="rht16", shape=(64, 128))
  assert not qnv.supported("nvfp4_tile", "rne", "rne", col_transform="rht16")
  assert not qnv.supported("nvfp4", "rne", "rne", col_transform="rht128")
  assert qnv.supported("nvfp4", "rne", "rne", tile_2d=False, scale_rule=None)
  assert not qnv.supported("nvfp4", "rne", "rne", dtype=jnp.float32)
  assert not qnv.supported("nvfp4", "rne", "rne", shape=(48, 128))
  assert not qnv.supported("nvfp4", "rne", "rne", shape=(2, 64, 128))
  assert not qnv.supported("nvfp4_tile", "rne", "rne", tile_rows=48)


def test_errors():
  x = jnp.ones(SHAPE, jnp.bfloat16)
  with pytest.raises(ValueError, match="multiple of the tile"):
    qnv.quantize_dual_nv(jnp.ones((96, 128), jnp.bfloat16), tile=QuantTile(64, 64), interpret=True)
  with pytest.raises(ValueError, match="no tile"):
    qnv.quantize_dual_nv(jnp.ones((48, 128), jnp.bfloat16), interpret=True)
  with pytest.raises(ValueError, match="does not cover"):
    qnv.quantize_dual_nv(x.astype(jnp.float32), interpret=True)
  with pytest.raises(ValueError, match="does not cover"):
    qnv.quantize_dual_nv(x, "mxfp4", interpret=True)
  with pytest.raises(ValueError, match="2-D"):
    qnv.quantize_dual_nv(x.reshape(2, 32, 128), interpret=True)
  with pytest.raises(ValueError, match="needs col_key"):
    qnv.quantize_dual_nv(x, col_rounding="sr", row_key=jax.random.key(0), interpret=True)
  with pytest.raises(ValueError, match="tensor_amax applies"):
    qnv.quantize_dual_nv(x, "nvfp4_tile", tensor_amax=jnp.float32(1.0), interpret=True)
  with pytest.raises(ValueError, match="does not cover"):
    qnv.quantize_dual_nv(x, row_rounding="sr", row_key=jax.random.key(0), tile_2d=True, interpret=True)
  with pytest.raises(ValueError, match="col_key=None or the row_key"):
    qnv.quantize_dual_nv(x, row_rounding="sr", col_rounding="sr", row_key=jax.random.key(0),
                         col_key=jax.random.key(1), tile_2d=True, interpret=True)
  with pytest.raises(ValueError, match="tile_rows=32 to be a multiple"):
    qnv.quantize_dual_nv(x, "nvfp4_tile", tile_rows=32, tile=TILE, interpret=True)


def test_default_tile():
  x = _bf16(_heavy(np.random.default_rng(12)))
  row, col = qnv.quantize_dual_nv(x, "nvfp4_tile", tile_rows=32, interpret=True)  # falls back to 32 x 32
  _assert_same(row, reference.quantize(x, "nvfp4_tile", axis=-1, tile_rows=32))
  _assert_same(col, reference.quantize(x, "nvfp4_tile", axis=0, tile_rows=32))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_tile"])
@pytest.mark.parametrize("row_rounding,col_rounding", [("rne", "rne"), ("sr", "rne"), ("sr", "sr")])
def test_gpu_matches_reference(fmt, row_rounding, col_rounding):
  """The compiled Triton kernel (default tile) on special blocks tiled over a larger array."""
  x = _bf16(np.tile(_special_blocks(np.random.default_rng(13)), (16, 8)))  # [1024, 1024]
  kr, kc = jax.random.key(3), jax.random.key(4)
  row, col = qnv.quantize_dual_nv(x, fmt, row_rounding=row_rounding, col_rounding=col_rounding, row_key=kr,
                                  col_key=kc)
  _assert_same(row, reference.quantize(x, fmt, axis=-1, rounding=row_rounding, key=kr))
  _assert_same(col, reference.quantize(x, fmt, axis=0, rounding=col_rounding, key=kc))


@pytest.mark.gpu
def test_gpu_four_over_six_matches_reference():
  """The compiled 4/6 kernel (default tile) on special and heavy-tailed blocks tiled over a larger array."""
  for make, seed in ((_special_blocks, 23), (_heavy, 24)):
    x = _bf16(np.tile(make(np.random.default_rng(seed)), (16, 8)))  # [1024, 1024]
    row, col = qnv.quantize_dual_nv(x, "nvfp4_46")
    _assert_same(row, reference.quantize(x, "nvfp4_46", axis=-1))
    _assert_same(col, reference.quantize(x, "nvfp4_46", axis=0))


@pytest.mark.gpu
@pytest.mark.parametrize("transform,rounding", [("rht16", "rne"), ("rht16", "sr")])
def test_gpu_column_transform_matches_reference(transform, rounding):
  """The compiled kernel (default tile) with the column view's Hadamard, on tiled special blocks."""
  _check_transform(_bf16(np.tile(_special_blocks(np.random.default_rng(22)), (16, 8))), transform, "sr",
                   rounding, tile=None)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_tile"])
@pytest.mark.parametrize("rounding", ["rne", "sr"])
def test_gpu_tile_2d_matches_reference(fmt, rounding):
  """The compiled Triton kernel with 16x16 tiles (default tile) on special blocks tiled over a larger array."""
  x = _bf16(np.tile(_special_blocks(np.random.default_rng(18)), (16, 8)))  # [1024, 1024]
  key = jax.random.key(19)
  row, col = qnv.quantize_dual_nv(x, fmt, row_rounding=rounding, col_rounding=rounding, row_key=key, tile_2d=True)
  for got, axis in ((row, -1), (col, 0)):
    _assert_same(got, reference.quantize(x, fmt, axis=axis, rounding=rounding, key=key, tile_2d=True))
