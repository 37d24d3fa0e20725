"""The fused dual-view MXFP4 quantizer equals `reference.quantize` bit for bit (Pallas interpret mode on CPU)."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax import reference
from fp4jax.hadamard import hadamard
from fp4jax.kernels import quantize_fused
from fp4jax.kernels.tiling import QuantTile, default_tile

SHAPE = (64, 128)
TILE = QuantTile(32, 64, num_warps=4)  # 2 x 2 programs: exercises the tile offsets and the SR counters


def _normal(rng):
  return rng.standard_normal(SHAPE).astype(np.float32)


def _outliers(rng):
  x = _normal(rng)
  x[rng.random(SHAPE) < 0.01] *= 1e4
  return x


def _row_spread(rng):
  return _normal(rng) * np.exp2(rng.integers(-40, 40, (SHAPE[0], 1))).astype(np.float32)


def _special_blocks(rng):
  """Zero, tiny (1e-30), huge (1e30), exact-grid and tie blocks, NaN and Inf blocks, signed zeros."""
  x = _normal(rng)
  x[0:32, 0:32] = 0.0
  x[32:64, 0:32] = -0.0
  x[:, 32:64] *= 1e-30
  x[0:32, 64:96] *= 1e30
  x[32:64, 64:96] = rng.choice([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -2.5, -0.25], (32, 32))
  x[3, 100] = np.nan
  x[40, 120] = np.inf
  x[50, 97] = -np.inf
  return x


INPUTS = {"normal": _normal, "outliers": _outliers, "row_spread": _row_spread, "special": _special_blocks}
CASES = [("rne", "ocp"), ("rne", "noclip"), ("sr", "noclip"), ("sr", "ocp")]


def _assert_same(got, want):
  for leaf in ("codes", "scales"):
    g, w = np.asarray(getattr(got, leaf)), np.asarray(getattr(want, leaf))
    assert g.dtype == w.dtype and g.shape == w.shape, (leaf, g.dtype, w.dtype, g.shape, w.shape)
    bad = np.argwhere(g != w)
    assert bad.size == 0, f"{leaf}: {len(bad)} mismatches, first at {bad[:3].tolist()}: {g[tuple(bad[0])]} " \
                          f"vs {w[tuple(bad[0])]}"
  assert (got.fmt, got.axis, got.shape, got.outer) == (want.fmt, want.axis, want.shape, want.outer)


@pytest.mark.parametrize("rounding,scale_rule", CASES)
@pytest.mark.parametrize("kind", sorted(INPUTS))
def test_dual_matches_reference(kind, rounding, scale_rule):
  rng = np.random.default_rng(zlib.crc32(f"{kind}/{rounding}/{scale_rule}".encode()))
  x = jnp.asarray(INPUTS[kind](rng)).astype(jnp.bfloat16)
  key = jax.random.key(int(rng.integers(1 << 30)))
  row, col = quantize_fused.quantize_dual(x, rounding=rounding, key=key, scale_rule=scale_rule, tile=TILE,
                                          interpret=True)
  opts = dict(rounding=rounding, key=key, scale_rule=scale_rule)
  _assert_same(row, reference.quantize(x, "mxfp4", axis=-1, **opts))
  _assert_same(col, reference.quantize(x, "mxfp4", axis=0, **opts))


TILE_2D_CASES = [("rne", None, None), ("rne", "noclip", 0.87), ("rne", "ocp", None), ("sr", None, 0.87),
                 ("rne", None, 1.0)]


@pytest.mark.parametrize("rounding,scale_rule,clip_fraction", TILE_2D_CASES)
@pytest.mark.parametrize("kind", ["outliers", "special"])
def test_tile_2d_matches_reference(kind, rounding, scale_rule, clip_fraction):
  rng = np.random.default_rng(zlib.crc32(f"2d/{kind}/{rounding}/{scale_rule}/{clip_fraction}".encode()))
  x = jnp.asarray(INPUTS[kind](rng)).astype(jnp.bfloat16)
  key = jax.random.key(int(rng.integers(1 << 30)))
  opts = dict(rounding=rounding, key=key, scale_rule=scale_rule, tile_2d=True, clip_fraction=clip_fraction)
  row, col = quantize_fused.quantize_dual(x, tile=TILE, interpret=True, **opts)
  _assert_same(row, reference.quantize(x, "mxfp4", axis=-1, **opts))
  _assert_same(col, reference.quantize(x, "mxfp4", axis=0, **opts))


def _views_reference(x, row, col, row_key, col_key, transform_key=None):
  """The reference quantizers of quantize_views' two views."""
  xc = hadamard(x, col.transform, axis=0, key=transform_key) if col.transform else x
  return (reference.quantize(x, "mxfp4", axis=-1, rounding=row.rounding, key=row_key, scale_rule=row.scale_rule,
                             clip_fraction=row.clip_fraction),
          reference.quantize(xc, "mxfp4", axis=0, rounding=col.rounding, key=col_key, scale_rule=col.scale_rule,
                             clip_fraction=col.clip_fraction))


V = quantize_fused.ViewSpec
# (input kind, row view, column view): the dY recipes of the mxfp4 routes (SR dgrad view, RNE wgrad view,
# with and without H32), X's (RNE fprop view, H32 wgrad view), and SR through a transform.
VIEW_CASES = [
    ("special", V("sr", "noclip"), V("rne", "ocp")),
    ("row_spread", V("rne", "ocp"), V("sr", "noclip", clip_fraction=0.87)),
    ("special", V("rne", "ocp"), V("rne", "ocp", transform="h32")),
    ("outliers", V("sr", "noclip"), V("rne", "ocp", transform="h32")),
    ("normal", V("rne", "noclip"), V("sr", "noclip", transform="h16")),
    ("special", V("sr", "noclip"), V("sr", "noclip", transform="rht16")),  # random signs from a key
    ("row_spread", V("rne", "ocp"), V("rne", "ocp", transform="rht32")),
]


@pytest.mark.parametrize("kind,row,col", VIEW_CASES)
def test_views_match_reference(kind, row, col):
  rng = np.random.default_rng(zlib.crc32(f"views/{kind}/{row}/{col}".encode()))
  x = jnp.asarray(INPUTS[kind](rng)).astype(jnp.bfloat16)
  row_key, col_key, transform_key = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 3)
  got = quantize_fused.quantize_views(x, row, col, row_key=row_key, col_key=col_key, transform_key=transform_key,
                                      tile=TILE, interpret=True)
  for g, w in zip(got, _views_reference(x, row, col, row_key, col_key, transform_key)):
    _assert_same(g, w)


def test_views_transform_nonfinite_block():
  # A NaN or Inf spreads through its Hadamard block: the column blocks holding it get the NaN scale.
  x = np.zeros((64, 64), np.float32)
  x[5, 3], x[40, 9] = np.nan, np.inf
  x = jnp.asarray(x).astype(jnp.bfloat16)
  row, col = V(), V(transform="h32")
  got = quantize_fused.quantize_views(x, row, col, tile=QuantTile(64, 64), interpret=True)
  for g, w in zip(got, _views_reference(x, row, col, None, None)):
    _assert_same(g, w)
  nan_scales = np.argwhere(np.asarray(got[1].scales) == 255)  # [K, M/32]: (column, block of 32 rows)
  assert nan_scales.tolist() == [[3, 0], [9, 1]]


def test_views_support():
  assert quantize_fused.supported_views("mxfp4", V("sr", "noclip"), V(transform="h32"), shape=(64, 64))
  assert not quantize_fused.supported_views("mxfp4", V(transform="h32"), V())  # row transform
  assert quantize_fused.supported_views("mxfp4", V(), V(transform="rht16"))  # random signs (key at call)
  assert not quantize_fused.supported_views("mxfp4", V(), V(transform="rht128"))  # beyond one MX block
  assert not quantize_fused.supported_views("mxfp4", V(), V("sr", "noclip"), tile_2d=True)  # views differ
  assert not quantize_fused.supported_views("nvfp4", V(), V())
  with pytest.raises(ValueError, match="column view needs a key"):
    quantize_fused.quantize_views(jnp.ones((64, 64), jnp.bfloat16), V(), V("sr", "noclip"), interpret=True)


def test_clip_fraction_1d():
  x = jnp.asarray(_row_spread(np.random.default_rng(4))).astype(jnp.bfloat16)
  opts = dict(scale_rule="noclip", clip_fraction=0.87)
  row, col = quantize_fused.quantize_dual(x, tile=TILE, interpret=True, **opts)
  _assert_same(row, reference.quantize(x, "mxfp4", axis=-1, **opts))
  _assert_same(col, reference.quantize(x, "mxfp4", axis=0, **opts))


def test_default_rule():
  x = jnp.asarray(_outliers(np.random.default_rng(3))).astype(jnp.bfloat16)
  row, col = quantize_fused.quantize_dual(x, tile=TILE, interpret=True)
  _assert_same(row, reference.quantize(x, "mxfp4", axis=-1))
  _assert_same(col, reference.quantize(x, "mxfp4", axis=0))


def test_one_named_kernel_in_lowering():
  x = jnp.ones(SHAPE, jnp.bfloat16)
  fn = jax.jit(lambda x: quantize_fused.quantize_dual(x, tile=TILE, interpret=True))
  jaxpr = jax.make_jaxpr(fn)(x)
  assert str(jaxpr).count(f"name={quantize_fused.KERNEL_NAME}") == 1
  assert quantize_fused.KERNEL_NAME in fn.lower(x).as_text(debug_info=True)


def test_shape_errors_and_support():
  with pytest.raises(ValueError, match="multiple of the tile"):
    quantize_fused.quantize_dual(jnp.ones((96, 128), jnp.bfloat16), tile=QuantTile(64, 64), interpret=True)
  with pytest.raises(ValueError, match="no tile"):
    default_tile(48, 128)
  assert quantize_fused.supported("mxfp4", "sr", shape=(64, 128))
  assert not quantize_fused.supported("nvfp4", "rne")
  assert not quantize_fused.supported("mxfp4", "eden")
  assert not quantize_fused.supported("mxfp4", "rne", shape=(48, 128))
  assert quantize_fused.supported("mxfp4", "rne", tile_2d=True, clip_fraction=0.87)
  assert not quantize_fused.supported("mxfp4", "rne", clip_fraction=1.5)
  assert not quantize_fused.supported("mxfp4", "rne", dtype=jnp.float32)
  with pytest.raises(ValueError, match="does not cover"):
    quantize_fused.quantize_dual(jnp.ones((64, 64), jnp.float32), interpret=True)


def test_default_tile_heuristic():
  assert default_tile(16384, 4096, rounding="rne") == QuantTile(64, 64, num_warps=4)
  assert default_tile(16384, 4096, rounding="sr") == QuantTile(32, 128, num_warps=4)
  assert default_tile(96, 96) == QuantTile(32, 32, num_warps=4)


@pytest.mark.gpu
@pytest.mark.parametrize("rounding", ["rne", "sr"])
@pytest.mark.parametrize("tile_2d", [False, True])
def test_gpu_matches_reference(rounding, tile_2d):
  """The compiled kernel (not interpret mode) on special blocks tiled over a larger array, and its FP8 form."""
  from fp4jax.kernels import gemm_fp8
  x = jnp.asarray(np.tile(_special_blocks(np.random.default_rng(9)), (16, 8))).astype(jnp.bfloat16)
  opts = dict(rounding=rounding, key=jax.random.key(3), tile_2d=tile_2d,
              clip_fraction=0.87 if tile_2d else None)
  row, col, (row8, col8) = quantize_fused.quantize_dual(x, fp8=True, **opts)
  want_row = reference.quantize(x, "mxfp4", axis=-1, **opts)
  want_col = reference.quantize(x, "mxfp4", axis=0, **opts)
  _assert_same(row, want_row)
  _assert_same(col, want_col)
  for got, want in ((row8, gemm_fp8.mx_to_fp8(want_row)), (col8, gemm_fp8.mx_to_fp8(want_col))):
    assert np.array_equal(np.asarray(got.values).view(np.uint8), np.asarray(want.values).view(np.uint8))
    assert np.array_equal(np.asarray(got.row_scale), np.asarray(want.row_scale), equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,row,col", VIEW_CASES)
def test_gpu_views_match_reference(kind, row, col):
  """The compiled per-view kernel (mixed rounding, Hadamard column view) on tiled inputs with the default tile."""
  x = jnp.asarray(np.tile(INPUTS[kind](np.random.default_rng(5)), (16, 8))).astype(jnp.bfloat16)
  row_key, col_key, transform_key = jax.random.split(jax.random.key(11), 3)
  got = quantize_fused.quantize_views(x, row, col, row_key=row_key, col_key=col_key, transform_key=transform_key)
  for g, w in zip(got, _views_reference(x, row, col, row_key, col_key, transform_key)):
    _assert_same(g, w)


def test_triton_compile_time_script_lowers_every_kernel(compile_time_script):
  """scripts/triton_compile_time.py: every listed kernel lowers to Triton IR (the script compiles it with the
  `triton` package where installed); the H32 view reads x once."""
  script = compile_time_script
  for name, fn in script.KERNELS.items():
    assert "tt.load" in script.triton_ir(fn, (256, 256)), name
  ir = script.triton_ir(script.KERNELS["mx X rne|rne+h32"], (256, 256))
  x_loads = [l for l in ir.splitlines() if "tt.load" in l and "tensor<" in l and "ptr<i32>" in l]
  assert len(x_loads) == 2 and ir.count("tt.store") == 8  # x once (per row parity), 4 outputs x 2 parities
  assert "divf" not in ir  # no float division (Triton's is approximate)
