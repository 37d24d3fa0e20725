"""What is specific to the MXFP4 dual-view kernel: explicit tiles (2 x 2 programs), its coverage, its launch and
its tiling heuristic. Its bits against the reference on every recipe: test_conformance.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax.numerics.spec import OperandKeys, OperandSpec
from fp4jax.ops.quantize import xla
from fp4jax.ops.quantize.pallas import mxfp4
from fp4jax.ops.quantize.pallas.tiling import QuantTile, default_tile
from quantize_inputs import INPUTS, assert_same, rng_for

SHAPE = (64, 128)
TILE = QuantTile(32, 64, num_warps=4)  # 2 x 2 programs: exercises the tile offsets and the SR counters
S = OperandSpec
SR, RNE = S("mxfp4", "sr"), S("mxfp4")
# (input, row view, column view): the default tiles of test_conformance.py give 1 x 2 or 2 x 1 programs.
TILED_CASES = [
    ("special", SR, S("mxfp4", transform="h32")),
    ("row_spread", RNE, S("mxfp4", "sr", clip_fraction=0.87)),
    ("nonfinite", S("mxfp4", tile_2d=True, scale_rule="noclip", clip_fraction=0.87),
     S("mxfp4", tile_2d=True, scale_rule="noclip", clip_fraction=0.87)),
    ("heavy", SR, S("mxfp4", "sr", transform="rht16")),
]


@pytest.mark.parametrize("kind,row,col", TILED_CASES)
def test_explicit_tile_matches_reference(kind, row, col):
  rng = rng_for("mx tile", kind, row, col)
  x = jnp.asarray(INPUTS[kind](rng, SHAPE)).astype(jnp.bfloat16)
  k = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 3)
  row_keys = OperandKeys(k[0] if row.rounding == "sr" else None)
  col_keys = row_keys if row.tile_2d else OperandKeys(k[1] if col.rounding == "sr" else None, k[2])
  got = mxfp4.views(x, row, col, row_keys, col_keys, tile=TILE, interpret=True)
  for g, w in zip(got, (xla.operand(x, row, 1, row_keys), xla.operand(x, col, 0, col_keys))):
    assert_same(g, w)


def test_one_keys_object_for_an_rne_and_an_sr_view():
  """One keys object for both views where only the column view rounds stochastically: the column view draws
  its own bits (it used to take the RNE row view's, which it has none of, and the trace failed)."""
  keys = OperandKeys(jax.random.key(7))
  x = jnp.asarray(INPUTS["normal"](rng_for("rne|sr", 0), (64, 128))).astype(jnp.bfloat16)
  got = mxfp4.views(x, RNE, SR, keys, keys, interpret=True)
  for g, w in zip(got, (xla.operand(x, RNE, 1, keys), xla.operand(x, SR, 0, keys)), strict=True):
    assert_same(g, w)


def test_transform_nonfinite_block():
  # A NaN or Inf spreads through its Hadamard block: the column blocks holding it get the NaN scale.
  x = np.zeros((64, 64), np.float32)
  x[5, 3], x[40, 9] = np.nan, np.inf
  x = jnp.asarray(x).astype(jnp.bfloat16)
  _, col = mxfp4.views(x, RNE, S("mxfp4", transform="h32"), tile=QuantTile(64, 64), interpret=True)
  nan_scales = np.argwhere(np.asarray(col.scales) == 255)  # [K, M/32]: (column, block of 32 rows)
  assert nan_scales.tolist() == [[3, 0], [9, 1]]


@pytest.mark.parametrize("row,col,x,why", [
    (RNE, S("nvfp4"), jnp.ones((64, 64), jnp.bfloat16), "formats"),
    (S("mxfp4", transform="h32"), RNE, jnp.ones((64, 64), jnp.bfloat16), "transforms 'h32' .row view"),
    (RNE, S("mxfp4", transform="rht128"), jnp.ones((128, 64), jnp.bfloat16), "transforms"),
    (S("mxfp4", tile_2d=True), S("mxfp4", "sr", tile_2d=True), jnp.ones((64, 64), jnp.bfloat16), "2-D tiles"),
    (RNE, RNE, jnp.ones((64, 64), jnp.float32), "2-D bf16"),
    (RNE, RNE, jnp.ones((48, 64), jnp.bfloat16), "no tile"),
])
def test_uncovered_cases_raise_not_implemented(row, col, x, why):
  with pytest.raises(NotImplementedError, match=f"mxfp4 kernel: .*{why}"):
    mxfp4.views(x, row, col, interpret=True)


def test_covered_cases():
  x = jnp.ones((64, 64), jnp.bfloat16)
  mxfp4.check(x, SR, S("mxfp4", transform="rht16"))  # random signs: the key comes with the call
  mxfp4.check(x, S("mxfp4", tile_2d=True, clip_fraction=0.87), S("mxfp4", tile_2d=True, clip_fraction=0.87))
  key = OperandKeys(jax.random.key(0))
  mxfp4.check(x, S("mxfp4", "sr", tile_2d=True), S("mxfp4", "sr", tile_2d=True), key, key)


def test_errors():
  with pytest.raises(ValueError, match="multiple of the tile"):
    mxfp4.views(jnp.ones((96, 128), jnp.bfloat16), RNE, RNE, tile=QuantTile(64, 64), interpret=True)
  with pytest.raises(ValueError, match="column view needs a key"):
    mxfp4.views(jnp.ones((64, 64), jnp.bfloat16), RNE, SR, interpret=True)


def test_one_named_kernel_in_lowering():
  x = jnp.ones(SHAPE, jnp.bfloat16)
  fn = jax.jit(lambda x: mxfp4.views(x, RNE, RNE, tile=TILE, interpret=True))
  assert str(jax.make_jaxpr(fn)(x)).count(f"name={mxfp4.KERNEL_NAME}") == 1
  assert mxfp4.KERNEL_NAME in fn.lower(x).as_text(debug_info=True)


def test_default_tile_heuristic():
  assert default_tile(16384, 4096, rounding="rne") == QuantTile(64, 64, num_warps=4)
  assert default_tile(16384, 4096, rounding="sr") == QuantTile(32, 128, num_warps=4)
  assert default_tile(96, 96) == QuantTile(32, 32, num_warps=4)
  with pytest.raises(ValueError, match="no tile"):
    default_tile(48, 128)


def test_h32_view_reads_x_once_and_never_divides(triton_modules):
  (ir,) = triton_modules(lambda x: mxfp4.views(x, RNE, S("mxfp4", transform="h32")), (256, 256))
  x_loads = [l for l in ir.splitlines() if "tt.load" in l and "tensor<" in l and "ptr<i32>" in l]
  assert len(x_loads) == 2 and ir.count("tt.store") == 8  # x once (per row parity), 4 outputs x 2 parities
  assert "divf" not in ir  # no float division (Triton's is approximate)
