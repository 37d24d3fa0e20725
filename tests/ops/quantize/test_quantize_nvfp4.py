"""What is specific to the NVFP4 dual-view kernel: explicit tiles and row tiles, 4/6 (not yet in fp4_dot's
dispatch), a caller's tensor amax, its division-free encode factor, its coverage, launch and Triton IR. Its bits
against the reference on every recipe fp4_dot uses: test_conformance.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax.numerics import ieee, reference
from fp4jax.numerics.qtensor import QTensor, ScaledValues
from fp4jax.numerics.values import scaled_values
from fp4jax.numerics.spec import OperandKeys, OperandSpec
from fp4jax.ops.quantize import pallas, xla
from fp4jax.ops.quantize.pallas import amax, common, nvfp4, params
from fp4jax.ops.quantize.pallas.tiling import QuantTile
from jaxprs import primitive_count
from quantize_inputs import INPUTS, assert_same, bits, rng_for, tile_turns

SHAPE = (64, 128)
TILE = QuantTile(32, 64, num_warps=4)  # 2 x 2 programs: exercises the tile offsets and the SR counters
TILE_ROWS = 64  # "nvfp4_tile": 1 row tile per 2 programs along M, 2 column tiles along K
S = OperandSpec
NV, NV_SR, NV_W = S("nvfp4"), S("nvfp4", "sr"), S("nvfp4", tile_2d=True)


def _bf16(a):
  return jnp.asarray(a).astype(jnp.bfloat16)


def _check(x, row, col, *, seed=0, **opts):
  """Runs the kernel and compares both views with the reference; row and column SR use different keys."""
  rk, ck = OperandKeys(jax.random.key(seed)), OperandKeys(jax.random.key(seed + 1), jax.random.key(seed + 2))
  if row.tile_2d:
    ck = rk
  got = nvfp4.views(x, row, col, rk, ck, interpret=True, **{"tile": TILE, **opts})
  ref_opts = {k: v for k, v in opts.items() if k in ("tile_rows", "tensor_amax")}
  for g, spec, axis, keys in ((got[0], row, 1, rk), (got[1], col, 0, ck)):
    assert_same(g, _reference(x, spec, axis, keys, **ref_opts))
  return got


def _reference(x, spec, axis, keys, **opts):
  if not opts:
    return xla.operand(x, spec, axis, keys)
  return reference.quantize(x, spec.fmt, axis=axis, rounding=spec.rounding, key=keys.rounding,
                            tile_2d=spec.tile_2d, **opts)


@pytest.mark.parametrize("kind,row,col", [
    ("special", NV_SR, NV), ("heavy", S("nvfp4_tile", "sr"), S("nvfp4_tile")),
    ("nonfinite", S("nvfp4", "sr", tile_2d=True), S("nvfp4", "sr", tile_2d=True)),
    ("heavy", S("nvfp4_tile", tile_2d=True), S("nvfp4_tile", tile_2d=True)),
    ("special", NV_SR, S("nvfp4", "sr", transform="rht16"))])
def test_explicit_tile_matches_reference(kind, row, col):
  rng = rng_for("nv tile", kind, row, col)
  opts = dict(tile_rows=TILE_ROWS) if row.fmt == "nvfp4_tile" else {}
  _check(_bf16(INPUTS[kind](rng, SHAPE)), row, col, seed=int(rng.integers(1 << 30)), **opts)


@pytest.mark.parametrize("kind", ["normal", "heavy", "special", "nonfinite"])
def test_four_over_six_matches_reference(kind):
  """4/6 (quartet2's forward): both targets' codes and squared errors per block, the lower kept."""
  x = _bf16(INPUTS[kind](rng_for("46", kind), SHAPE))
  row, _ = _check(x, S("nvfp4_46"), S("nvfp4_46"))
  if kind in ("normal", "heavy"):  # some blocks keep the 6-target scale, others take the 4-target one
    xb = np.asarray(x, np.float32).reshape(SHAPE[0], -1, 16)
    s_enc = reference.nvfp4_encode_scale(jnp.float32(np.abs(xb).max()), 256.0)
    s6 = reference._nv_block_scale(jnp.asarray(np.abs(xb).max(-1)), s_enc, 6.0)  # pylint: disable=protected-access
    six = np.asarray(row.scales).view(np.uint8) == np.asarray(s6).view(np.uint8)
    assert six.any() and not six.all()


def test_tile_local_ragged_last_tiles():
  """M and K not multiples of tile_rows: the last row tile and the last column tile are shorter."""
  rng = np.random.default_rng(14)
  x = rng.standard_t(2, (96, 160)).astype(np.float32) * np.exp2(rng.integers(-20, 1, (96, 1))).astype(np.float32)
  _check(_bf16(x), S("nvfp4_tile", "sr"), S("nvfp4_tile"), tile_rows=TILE_ROWS, tile=QuantTile(32, 32))


@pytest.mark.parametrize("amax_given", [None, 4.0])
def test_tile_2d_nonfinite(amax_given):
  """NaN / Inf: with the computed amax everything is NaN; with a given one only the tiles holding them."""
  x = INPUTS["nonfinite"](np.random.default_rng(16), SHAPE)
  x[32:48, 0:16] = 0.0  # a zero tile
  tensor_amax = None if amax_given is None else jnp.float32(amax_given)
  spec = S("nvfp4", "sr", tile_2d=True)
  row, _ = _check(_bf16(x), spec, spec, seed=17, tensor_amax=tensor_amax)
  nan_tiles = np.asarray(row.scales).view(np.uint8).reshape(4, 16, 8).max(axis=1) == 0x7F  # [M/16, K/16]
  assert nan_tiles.sum() == (nan_tiles.size if amax_given is None else 2)  # [0:16, 16:32], [32:48, 80:96]


@pytest.mark.parametrize("tensor_amax", [4.0, 1e-30, float("inf"), float("nan"), -1.0])
def test_given_tensor_amax(tensor_amax):
  """A caller's amax: NaN / Inf blocks alone get NaN scales; a stale small amax saturates at 448 and 6."""
  x = _bf16(INPUTS["nonfinite"](np.random.default_rng(9), SHAPE))
  row, _ = _check(x, NV, NV_SR, tensor_amax=jnp.float32(tensor_amax))
  if tensor_amax == 4.0:
    nan_blocks = np.asarray(row.scales).view(np.uint8) == 0x7F
    assert 0 < nan_blocks.sum() < nan_blocks.size


def test_sr_views_differ_by_key():
  """Row SR and column SR draw from their own keys: the same key on both would give other column codes."""
  x = _bf16(INPUTS["normal"](np.random.default_rng(5), SHAPE))
  _, col = _check(x, NV_SR, NV_SR, seed=7)
  same_key = reference.quantize(x, "nvfp4", axis=0, rounding="sr", key=jax.random.key(7))
  assert not np.array_equal(np.asarray(col.codes), np.asarray(same_key.codes))


def test_bf16_amax_matches_reference():
  x = INPUTS["nonfinite"](np.random.default_rng(10), SHAPE)
  for a in (x, np.where(np.isnan(x), 1.0, x), np.where(np.isfinite(x), x, 1.0), -np.abs(x), np.zeros(SHAPE)):
    want = reference._amax(_bf16(a).astype(jnp.float32))  # pylint: disable=protected-access
    got = amax.bf16_amax(_bf16(a))
    assert np.asarray(got).view(np.uint32) == np.asarray(want).view(np.uint32), (got, want)


@pytest.mark.parametrize("s_enc", [1.0, 2688.0 / 3.0, 2529.8823 / 3e38, 3.4028235e38, 2688.0 / 1e-30, 2688.0 / 2e-35])
def test_block_encode_is_the_exact_quotient(s_enc):
  """The kernel's table lookup q_j * 2^(L - e) equals the reference's enc_b for every E4M3 s_b (0 -> 0), and
  that is 1 / fl(s_b * outer) in IEEE float32 (TE's order) wherever the product is normal."""
  sf = jnp.asarray(np.arange(0x7F, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32))
  outer = ieee.div(jnp.float32(1.0), jnp.float32(s_enc))
  o, shift = ieee.lift(outer)
  q = ieee.div(jnp.float32(1.0), o * jnp.asarray(params.MANTISSAS))
  row = jnp.zeros((1, 16)).at[0, 1:9].set(q).at[0, params.SHIFT_SLOT].set(shift)
  got = nvfp4._block_encode(sf, row)  # pylint: disable=protected-access
  want = reference.nv_block_encode(sf, outer)
  np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))
  # TE's IEEE float32 order, wherever s_b * outer is a normal float32 (numpy keeps subnormals: no flush).
  o32, s32 = np.float32(np.asarray(outer)), np.asarray(sf, np.float32)
  with np.errstate(divide="ignore", over="ignore"):
    te = np.where(s32 == 0, np.float32(0), np.minimum(np.float32(1) / (s32 * o32), np.finfo(np.float32).max))
  normal = s32.astype(np.float64) * np.float64(o32) >= 2.0**-126
  assert normal.sum() >= 40
  got_bits, te_bits = np.asarray(got).view(np.uint32), te.astype(np.float32).view(np.uint32)
  np.testing.assert_array_equal(got_bits[normal], te_bits[normal])


def test_one_named_kernel_in_lowering():
  x = jnp.ones(SHAPE, jnp.bfloat16)
  fn = jax.jit(lambda x: nvfp4.views(x, NV, NV, tile=TILE, interpret=True))
  assert str(jax.make_jaxpr(fn)(x)).count(f"name={nvfp4.KERNEL_NAME}") == 1
  assert nvfp4.KERNEL_NAME in fn.lower(x).as_text(debug_info=True)


@pytest.mark.parametrize("row,col", [(NV_SR, NV), (S("nvfp4_tile", "sr"), S("nvfp4_tile")),
                                     (S("nvfp4", "sr", tile_2d=True), S("nvfp4", "sr", tile_2d=True)),
                                     (S("nvfp4_46"), S("nvfp4_46"))])
def test_triton_lowering_has_no_float_division(row, col, triton_modules):
  """The Triton IR (lowered on CPU for an abstract H200) has no float division: Triton's would be approximate."""
  keys = OperandKeys(jax.random.key(0))
  modules = triton_modules(lambda x: nvfp4.views(x, row, col, keys, keys), (256, 256))
  assert len(modules) == 1 and "tt.load" in modules[0]
  assert "divf" not in modules[0] and "fdiv" not in modules[0]


def test_one_view_launches_are_one_kernel_whatever_the_shape(triton_modules, monkeypatch):
  """quartet2's forward operands (4/6 along K of x [M, K], and of w [K, N] along K = axis 0) at three model
  widths lower to one Triton kernel but for the grid's first extent: one-view launches run on the canonical
  layout (`pallas.CANONICAL_K`), a column view as x^T along K, so the IR holds none of the operand's extents (it
  used to be one kernel per shape and view: six in quartet2's 30M step) but the number of row tiles, which
  decodes the program's ids on its one-axis launch (`common.grid_ids`; here read as 1)."""
  real = common.grid_ids
  monkeypatch.setattr(common, "grid_ids", lambda grid, pid=None: real((1, *grid[1:]), pid))
  spec = S("nvfp4_46")
  irs = set()
  for shape in ((256, 384), (512, 1024), (1024, 256)):
    for axis in (1, 0):
      modules = triton_modules(lambda x: pallas.operand(x, spec, axis, OperandKeys(), interpret=False), shape)
      assert len(modules) == 1
      irs.add(common.without_launch_digests(modules[0]))  # each launch has its own name
  assert len(irs) == 1


@pytest.mark.parametrize("row,col,x,why", [
    (S("mxfp4"), S("mxfp4"), (64, 128), "formats"),
    (S("nvfp4_46", "sr"), S("nvfp4_46"), (64, 128), "4/6 with SR"),
    (S("nvfp4_46", tile_2d=True), S("nvfp4_46", tile_2d=True), (64, 128), "4/6 with SR or 2-D tiles"),
    (S("nvfp4_46"), S("nvfp4_46", transform="rht16"), (64, 128), "transforms"),
    (S("nvfp4", "sr", tile_2d=True), S("nvfp4", tile_2d=True), (64, 128), "2-D tiles"),
    (S("nvfp4", transform="rht16"), NV, (64, 128), "transforms"),
    (NV, S("nvfp4_tile", transform="rht16"), (64, 128), "formats"),
    (S("nvfp4_tile"), S("nvfp4_tile", transform="rht16"), (64, 128), "transforms"),
    (NV, S("nvfp4", transform="rht128"), (128, 128), "transforms"),
    (NV, NV, (48, 128), "no tile"),
    (NV, NV, (2, 64, 128), "2-D bf16"),
])
def test_uncovered_cases_raise_not_implemented(row, col, x, why):
  with pytest.raises(NotImplementedError, match=f"nvfp4 kernel: .*{why}"):
    nvfp4.views(jnp.ones(x, jnp.bfloat16), row, col, interpret=True)


def test_dtype_and_row_tiles_not_covered():
  with pytest.raises(NotImplementedError, match="float32"):
    nvfp4.views(jnp.ones((64, 128), jnp.float32), NV, NV, interpret=True)
  with pytest.raises(NotImplementedError, match="tile_rows=48"):
    nvfp4.check(jnp.ones((64, 128), jnp.bfloat16), S("nvfp4_tile"), S("nvfp4_tile"), tile_rows=48)


def test_errors():
  x = jnp.ones(SHAPE, jnp.bfloat16)
  with pytest.raises(ValueError, match="multiple of the tile"):
    nvfp4.views(jnp.ones((96, 128), jnp.bfloat16), NV, NV, tile=QuantTile(64, 64), interpret=True)
  with pytest.raises(ValueError, match="needs col_key"):
    nvfp4.views(x, NV, NV_SR, interpret=True)
  with pytest.raises(ValueError, match="tensor_amax applies"):
    nvfp4.views(x, S("nvfp4_tile"), S("nvfp4_tile"), tensor_amax=jnp.float32(1.0), interpret=True)
  with pytest.raises(ValueError, match="tensor_amax is the amax of x"):
    nvfp4.views(x, NV, S("nvfp4", transform="h16"), tensor_amax=jnp.float32(1.0), interpret=True)
  with pytest.raises(ValueError, match="tile_rows=32 to be a multiple"):
    nvfp4.views(x, S("nvfp4_tile"), S("nvfp4_tile"), tile_rows=32, tile=TILE, interpret=True)


def test_default_tile_of_the_nvfp4_dy_views():
  """The nvfp4 route's dY (SR both ways, RHT16 column view) takes its own default tile, [32, 64] by 4 warps:
  bit for bit the reference there too (8 x 2 programs)."""
  x = _bf16(INPUTS["heavy"](rng_for("nv dY tile"), (256, 128)))
  col = S("nvfp4", "sr", transform="rht16")
  assert nvfp4._pick_tile(*x.shape, "nvfp4", nvfp4._rounding(NV_SR, col), 128) == QuantTile(32, 64, num_warps=4)
  _check(x, NV_SR, col, seed=5, tile=None)


def test_default_tile_for_small_row_tiles():
  x = _bf16(INPUTS["heavy"](np.random.default_rng(12), SHAPE))
  row, col = nvfp4.views(x, S("nvfp4_tile"), S("nvfp4_tile"), tile_rows=32, interpret=True)  # 32 x 32 tiles
  assert_same(row, reference.quantize(x, "nvfp4_tile", axis=-1, tile_rows=32))
  assert_same(col, reference.quantize(x, "nvfp4_tile", axis=0, tile_rows=32))


@pytest.mark.gpu
def test_gpu_four_over_six_matches_reference():
  """The compiled 4/6 kernel (default tile) on special and heavy-tailed blocks tiled over a larger array."""
  for kind in ("special", "heavy", "nonfinite"):
    x = _bf16(np.tile(INPUTS[kind](rng_for("gpu 46", kind), SHAPE), (16, 8)))  # [1024, 1024]
    spec = S("nvfp4_46")
    row, col = nvfp4.views(x, spec, spec)
    assert_same(row, xla.operand(x, spec, 1, OperandKeys()))
    assert_same(col, xla.operand(x, spec, 0, OperandKeys()))


def _assert_values(got, want_q):
  """`got` is the ScaledValues of reference QTensor `want_q`: x's layout, the same outer and the same bf16 bits
  but for the payload of a NaN (the kernel writes 0x7FC0, XLA's decode on a GPU 0x7FFF)."""
  want = scaled_values(want_q)
  assert isinstance(got, ScaledValues) and not got.transposed
  assert (got.fmt, got.axis, got.shape, got.values.shape) == (want.fmt, want.axis, want.shape, got.shape)
  g, w = np.asarray(got.kmajor(), np.float32), np.asarray(want.kmajor(), np.float32)
  np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
  np.testing.assert_array_equal(bits(np.where(np.isnan(g), 0, g)), bits(np.where(np.isnan(w), 0, w)))
  np.testing.assert_array_equal(bits(got.outer), bits(want.outer))


@pytest.mark.parametrize("kind,row,col", [
    ("special", NV_SR, S("nvfp4", "sr", transform="rht16")),  # the nvfp4 route's dY
    ("nonfinite", NV, S("nvfp4", transform="rht16")),  # its X
    ("heavy", NV_SR, NV), ("row_spread", S("nvfp4_tile", "sr"), S("nvfp4_tile")), ("normal", NV, NV_SR)])
@pytest.mark.parametrize("forms", [("values", "values"), ("values", "codes"), ("codes", "values")])
def test_views_as_values_match_reference(kind, row, col, forms):
  """A view asked as "values" is written as bf16 element(code) * scale in x's layout, bit for bit the
  reference QTensor's values (NaN blocks, zeros, huge and tiny blocks, SR, a Hadamard column view, row-tile
  outers); a view asked as codes next to it is unchanged."""
  rng = rng_for("nv values", kind, row, col, forms)
  x = _bf16(INPUTS[kind](rng, SHAPE))
  opts = dict(tile_rows=TILE_ROWS) if row.fmt == "nvfp4_tile" else {}
  seed = int(rng.integers(1 << 30))
  rk, ck = OperandKeys(jax.random.key(seed)), OperandKeys(jax.random.key(seed + 1), jax.random.key(seed + 2))
  got = nvfp4.views(x, row, col, rk, ck, interpret=True, tile=TILE, forms=forms, **opts)
  for g, spec, axis, keys, form in zip(got, (row, col), (1, 0), (rk, ck), forms):
    want = _reference(x, spec, axis, keys, **opts)
    if form == "values":
      _assert_values(g, want)
    else:
      assert_same(g, want)


@pytest.mark.parametrize("row,col", [(S("nvfp4_46"), S("nvfp4_46")), (NV_W, NV_W)])
def test_values_not_written_for_four_over_six_or_tiles(row, col):
  """4/6 and 16x16 tiles keep their codes when values are asked for (`ops.quantize.api` decodes them)."""
  x = _bf16(INPUTS["normal"](rng_for("nv values 46", row), SHAPE))
  got = nvfp4.views(x, row, col, interpret=True, tile=TILE, forms=("values", "values"))
  assert all(isinstance(g, QTensor) for g in got)


def test_values_launch_stores_no_codes(triton_modules):
  """Values leave the kernel in x's layout, so the launch that writes them turns no tile (the codes launch
  turns its column view's codes and scales)."""
  row, col = NV_SR, S("nvfp4", "sr", transform="rht16")
  keys = OperandKeys(jax.random.key(0), jax.random.key(1))
  lower = lambda forms: triton_modules(
      lambda x: nvfp4.views(x, row, col, keys, keys, forms=forms), (256, 256))
  values, codes = lower(("values", "values"))[-1], lower(("codes", "codes"))[-1]  # after the rotated amax
  assert tile_turns(codes) > 0 and tile_turns(values) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("row,col", [(NV_SR, S("nvfp4", "sr", transform="rht16")),
                                     (NV, S("nvfp4", transform="rht16")), (S("nvfp4_tile", "sr"), S("nvfp4_tile"))])
def test_gpu_views_as_values_match_reference(row, col):
  """Compiled (default tiles): both views as values, over special, heavy-tailed and non-finite blocks tiled over
  a larger array, equal the reference QTensors' values bit for bit."""
  keys = OperandKeys(jax.random.key(5)), OperandKeys(jax.random.key(6), jax.random.key(7))
  for kind in ("special", "heavy", "nonfinite"):
    x = _bf16(np.tile(INPUTS[kind](rng_for("gpu values", kind, row), SHAPE), (16, 8)))  # [1024, 1024]
    got = nvfp4.views(x, row, col, *keys, forms=("values", "values"))
    for g, spec, axis, k in zip(got, (row, col), (1, 0), keys):
      _assert_values(g, xla.operand(x, spec, axis, k))


def test_parameter_chains_reach_xla_in_stages():
  """The NVFP4 parameter rows' scalar chain leaves each of its five stages through an optimization barrier
  (`params._stage`), and a GEMM's two outer factors leave theirs through one (`ieee.mul_scales`): left whole,
  XLA's priority fusion grew each chain into one fusion after another and copied it into its consumers, most of
  its time in a scanned NVFP4 step (docs/BENCHMARKS.md, "Session of 2026-12-07, 00:24 UTC"). The values are
  the conformance tests'."""
  a = jnp.float32(3.0)
  rows = jax.make_jaxpr(lambda a: params.view_params((a, a), ("rne", "sr"), (32, 32), "nvfp4"))(a)
  assert primitive_count(rows.jaxpr, "optimization_barrier") == 5
  factors = jax.make_jaxpr(ieee.mul_scales)(jnp.ones((4, 4), jnp.float32), a, a)
  assert primitive_count(factors.jaxpr, "optimization_barrier") == 1
