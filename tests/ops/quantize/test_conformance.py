"""Conformance: every quantizer implementation x every operand recipe equals the reference quantizer bit for bit.

Each case quantizes through the public API (`ops.quantize.quantize_views` / `quantize_operand`) with one
implementation and compares codes, scales and outer factor with `ops.quantize.xla` (the reference quantizer
after the spec's Hadamard transform), on random, heavy-tailed, spread, special (zeros, ties, 1e-30, 1e30, 3e38,
subnormal scales) and non-finite inputs. `kernel` says whether the case must run a Pallas kernel: a kernel that
silently stopped covering its recipes would otherwise pass through the XLA fallback. "interpret" runs the
kernels in Pallas interpret mode (CPU, CI); "pallas" compiles them for the GPU (`-m gpu`), on larger inputs.
Kernel files keep only what is specific to a kernel (tiles, its launches, its Triton IR, its options).
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax.numerics import reference
from fp4jax.numerics.qtensor import ScaledValues
from fp4jax.numerics.spec import OperandKeys, OperandSpec
from fp4jax.numerics.values import scaled_values
from fp4jax.ops.quantize import api, xla
from quantize_inputs import INPUTS, assert_same, bits, rng_for

S = OperandSpec
MX, MX_NC, MX_SR = S("mxfp4"), S("mxfp4", scale_rule="noclip"), S("mxfp4", "sr")
MX_SR_OCP, MX_CLIP = S("mxfp4", "sr", scale_rule="ocp"), S("mxfp4", scale_rule="noclip", clip_fraction=0.87)
MX_W = S("mxfp4", tile_2d=True, scale_rule="noclip", clip_fraction=0.87)
NV, NV_SR, NV_W = S("nvfp4"), S("nvfp4", "sr"), S("nvfp4", tile_2d=True)
NVT, NVT_SR = S("nvfp4_tile"), S("nvfp4_tile", "sr")
EDEN = S("nvfp4", "eden", transform="rht128")
E4M3, E5M2 = S("fp8_e4m3"), S("fp8_e5m2")  # the fp8 route's per-tensor current scaling


@dataclasses.dataclass(frozen=True)
class Case:
  """Both views (`col` given) or one operand along `axis` of an input of `shape` / `dtype`; `kernel`: a Pallas
  kernel must serve it; `shared`: one keys object for both views (one recipe, one draw per element)."""

  name: str
  row: OperandSpec
  col: OperandSpec | None = None
  axis: int = 1
  kernel: bool = True
  shared: bool = False
  shape: tuple[int, ...] = (64, 128)
  dtype: str = "bfloat16"


CASES = [
    # MXFP4 views: the mxfp4 routes' X, dY and W recipes, and every option the kernel takes.
    Case("mx rne|rne", MX, MX),
    Case("mx noclip|noclip", MX_NC, MX_NC),
    Case("mx sr|sr shared key", MX_SR, MX_SR, shared=True),
    Case("mx sr ocp|sr ocp", MX_SR_OCP, MX_SR_OCP),
    Case("mx dY sr|rne", MX_SR, MX),
    Case("mx rne|sr clip", MX, S("mxfp4", "sr", clip_fraction=0.87)),
    Case("mx clip|clip", MX_CLIP, MX_CLIP),
    Case("mx X rne|rne+h32", MX, S("mxfp4", transform="h32")),
    Case("mx dY sr|rne+h32", MX_SR, S("mxfp4", transform="h32")),
    Case("mx noclip|sr+h16", MX_NC, S("mxfp4", "sr", transform="h16")),
    Case("mx sr|sr+rht16", MX_SR, S("mxfp4", "sr", transform="rht16")),
    Case("mx rne|rne+rht32", MX, S("mxfp4", transform="rht32")),
    Case("mx W 32x32 clip", MX_W, MX_W),
    Case("mx 32x32 ocp", S("mxfp4", tile_2d=True, scale_rule="ocp"), S("mxfp4", tile_2d=True, scale_rule="ocp")),
    Case("mx 32x32 sr shared key", S("mxfp4", "sr", tile_2d=True), S("mxfp4", "sr", tile_2d=True), shared=True),
    # Two SR keys for one tile recipe: no single pass draws both views, so one launch per view.
    Case("mx 32x32 sr two keys", S("mxfp4", "sr", tile_2d=True), S("mxfp4", "sr", tile_2d=True)),
    # NVFP4 views: global, 16x16 tiles, tile-local, the Hadamard column view.
    Case("nv rne|rne", NV, NV),
    Case("nv sr|rne", NV_SR, NV),
    Case("nv rne|sr", NV, NV_SR),
    Case("nv sr|sr", NV_SR, NV_SR),
    Case("nv X rne|rne+rht16", NV, S("nvfp4", transform="rht16")),
    Case("nv dY sr|sr+rht16", NV_SR, S("nvfp4", "sr", transform="rht16")),
    Case("nv rne|sr+h32", NV, S("nvfp4", "sr", transform="h32")),
    Case("nv W 16x16", NV_W, NV_W),
    Case("nv 16x16 sr shared key", S("nvfp4", "sr", tile_2d=True), S("nvfp4", "sr", tile_2d=True), shared=True),
    Case("nvtile rne|rne", NVT, NVT),
    Case("nvtile sr|rne", NVT_SR, NVT),
    Case("nvtile rne|sr", NVT, NVT_SR),
    Case("nvtile 16x16", S("nvfp4_tile", tile_2d=True), S("nvfp4_tile", tile_2d=True)),
    # 4/6: both RNE views in one pass; an SR view (no 4/6 kernel) falls back to XLA, the RNE view keeps its kernel.
    Case("nv46 rne|rne", S("nvfp4_46"), S("nvfp4_46")),
    Case("nv46 sr|rne", S("nvfp4_46", "sr"), S("nvfp4_46")),
    # Mixed formats: one launch per view.
    Case("mx|nv: one launch per view", MX, NV),
    # MS-EDEN: one kernel per view (quartet2's dY, and its requantized float32 X^, W^).
    Case("eden rht128 views", EDEN, EDEN, shape=(128, 128)),
    Case("eden rht128 float32", EDEN, EDEN, shape=(128, 128), dtype="float32"),
    Case("eden no transform axis 0", S("nvfp4", "eden"), axis=0, shape=(128, 64)),
    Case("eden h16 axis 1", S("nvfp4", "eden", transform="h16"), axis=1, shape=(64, 128)),
    # One operand: a dual-view kernel launched for that view alone, and the cases only XLA covers.
    Case("mx W axis 1", MX_W, axis=1),
    Case("mx W axis 0", MX_W, axis=0),
    Case("mx sr axis 0", MX_SR, axis=0),
    Case("mx h32 axis 0: the column view alone", S("mxfp4", transform="h32"), axis=0),
    Case("nv sr axis 0", NV_SR, axis=0),
    Case("nv sr+rht16 axis 0: rotated amax only", S("nvfp4", "sr", transform="rht16"), axis=0),
    Case("nv 16x16 axis 0", NV_W, axis=0),
    Case("nvtile axis 1", NVT, axis=1),
    Case("nvtile axis 0: x^T along K", NVT, axis=0, shape=(128, 64)),
    Case("nv rne axis 1: 2048 x 96 on the canonical layout", NV, axis=1, shape=(2048, 96)),
    Case("mx sr axis 1: canonical layout, SR keyed by x's flat index", MX_SR, axis=1, shape=(256, 160)),
    Case("nvtile 16x16 axis 0", S("nvfp4_tile", tile_2d=True), axis=0),
    Case("nv46 X axis 1 (quartet2's forward)", S("nvfp4_46"), axis=1),
    Case("nv46 W axis 0 (quartet2's forward)", S("nvfp4_46"), axis=0),
    Case("mx rht128 along K", S("mxfp4", transform="rht128"), axis=1, kernel=False),
    Case("mx float32", MX, axis=1, kernel=False, dtype="float32"),
    Case("mx 48 rows: no kernel tile", MX, axis=1, kernel=False, shape=(48, 64)),
    Case("nv 3-D", NV_SR, axis=2, kernel=False, shape=(2, 32, 64)),
    # FP8, scaled per tensor: no Pallas kernel (they cover FP4); the chain's XLA link quantizes once and reads
    # the other view as the transpose, bit for bit the reference's second quantization.
    Case("fp8 X e4m3 views", E4M3, E4M3, kernel=False),
    Case("fp8 dY e5m2 views", E5M2, E5M2, kernel=False),
    Case("fp8 e5m2 views float32", E5M2, E5M2, kernel=False, dtype="float32"),
    Case("fp8 e4m3|e5m2", E4M3, E5M2, kernel=False),
    Case("fp8 odd shape axis 0", E4M3, axis=0, kernel=False, shape=(48, 72)),
    Case("fp8 3-D", E5M2, axis=1, kernel=False, shape=(2, 24, 40)),
]
KINDS = ("normal", "heavy", "row_spread")
# "xla" is the reference itself; the GPU-compiled reference is checked against numpy in tests/numerics.
IMPLEMENTATIONS = ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)]


def _keys(spec: OperandSpec, key: jax.Array, index: int) -> OperandKeys:
  """The keys fp4_dot would hand this spec: a rounding key for SR / MS-EDEN, a transform key for random signs."""
  rounding = jax.random.fold_in(key, index) if spec.rounding != "rne" else None
  transform = jax.random.fold_in(key, 10 + index) if spec.needs_key and spec.transform else None
  return OperandKeys(rounding, transform)


def _input(case: Case, kind: str, implementation: str) -> tuple[jax.Array, jax.Array]:
  rng = rng_for(case.name, kind)
  shape = case.shape
  if implementation == "pallas":  # the compiled kernel: many programs of default tiles (an odd count, and a
    shape = (*shape[:-2], shape[-2] * 9, shape[-1] * 9)  # dim that was not a multiple of 32 still is not)
  x = np.broadcast_to(INPUTS[kind](rng, shape[-2:]), shape)
  return jnp.asarray(x).astype(case.dtype), jax.random.key(int(rng.integers(1 << 30)))


def _api_call(case: Case, implementation: str):
  """The API call of a case, jitted once (inputs and keys are arguments)."""
  if case.col is None:
    return jax.jit(lambda x, row_keys, col_keys: (
        api.quantize_operand(x, case.row, case.axis, row_keys, implementation=implementation),))
  return jax.jit(lambda x, row_keys, col_keys: api.quantize_views(x, case.row, case.col, row_keys, col_keys,
                                                                   implementation=implementation))


def _reference(case: Case, x: jax.Array, row_keys: OperandKeys, col_keys: OperandKeys):
  if case.col is None:
    return (xla.operand(x, case.row, case.axis, row_keys),)
  return xla.operand(x, case.row, 1, row_keys), xla.operand(x, case.col, 0, col_keys)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_reference(case: Case, implementation: str):
  call = _api_call(case, implementation)
  for i, kind in enumerate(("special", "nonfinite", KINDS[zlib.crc32(case.name.encode()) % len(KINDS)])):
    x, key = _input(case, kind, implementation)
    row_keys = _keys(case.row, key, 1)
    col_keys = row_keys if case.shared or case.col is None else _keys(case.col, key, 2)
    if i == 0:
      uses_kernel = "pallas_call" in str(jax.make_jaxpr(call)(x, row_keys, col_keys))
      assert uses_kernel == case.kernel, case
    for g, w in zip(call(x, row_keys, col_keys), _reference(case, x, row_keys, col_keys), strict=True):
      assert_same(g, w)


EDGE_SPECS = [("mx dY sr|rne+h32", MX_SR, S("mxfp4", transform="h32")), ("nv dY sr|sr+rht16", NV_SR,
              S("nvfp4", "sr", transform="rht16")), ("nvtile W 16x16", S("nvfp4_tile", tile_2d=True),
              S("nvfp4_tile", tile_2d=True)), ("eden", EDEN, EDEN), ("fp8 e4m3 views", E4M3, E4M3),
              ("fp8 e5m2 views", E5M2, E5M2)]
EDGE_INPUTS = {
    "zeros": lambda shape: np.zeros(shape, np.float32),
    "tiny": lambda shape: np.full(shape, 3e-39, np.float32) * np.arange(1, shape[1] + 1),  # bf16 subnormals
    "huge": lambda shape: np.full(shape, -3e38, np.float32),
    "nan": lambda shape: np.full(shape, np.nan, np.float32),
    "one-hot": lambda shape: np.eye(*shape, dtype=np.float32) * 1e30,
}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name,row,col", EDGE_SPECS, ids=[e[0] for e in EDGE_SPECS])
def test_edge_tensors_match_reference(name, row, col, implementation):
  """Whole tensors of zeros, bf16 subnormals, huge values, NaN, or a single huge entry per row."""
  del name
  shape = (128, 128) if implementation != "pallas" else (256, 512)
  key = jax.random.key(3)
  row_keys, col_keys = _keys(row, key, 1), _keys(col, key, 2)
  for make in EDGE_INPUTS.values():
    x = jnp.asarray(make(shape)).astype(jnp.bfloat16)
    got = api.quantize_views(x, row, col, row_keys, col_keys, implementation=implementation)
    for g, w in zip(got, (xla.operand(x, row, 1, row_keys), xla.operand(x, col, 0, col_keys)), strict=True):
      assert_same(g, w)


NEAR_MAX_SPECS = [("nv sr|sr", NV_SR, NV_SR), ("nvtile sr|sr", NVT_SR, NVT_SR),
                  ("nv 16x16 sr", S("nvfp4", "sr", tile_2d=True), S("nvfp4", "sr", tile_2d=True)),
                  ("nv46 rne|rne", S("nvfp4_46"), S("nvfp4_46")), ("eden", S("nvfp4", "eden"), S("nvfp4", "eden"))]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name,row,col", NEAR_MAX_SPECS, ids=[e[0] for e in NEAR_MAX_SPECS])
def test_near_float32_max_saturates(name, row, col, implementation):
  """bf16 max entries, and a block of 0.8x it (MS-EDEN's correction ~1.2): the reference decodes them finite
  (block scales under `reference.scale_cap`; SR and MS-EDEN once decoded them to inf) and the kernels agree."""
  del name
  shape = (128, 128) if implementation != "pallas" else (256, 512)
  big = float(jnp.finfo(jnp.bfloat16).max)
  x = np.asarray(INPUTS["normal"](rng_for("near max"), shape))
  x[:16, :16] = 0.8 * big
  x[0, 0], x[5, 5], x[70, 40] = big, -big, -big
  x = jnp.asarray(x).astype(jnp.bfloat16)
  keys = OperandKeys(jax.random.key(4))
  row_keys, col_keys = keys, keys if row.tile_2d else OperandKeys(jax.random.key(5))
  want = (xla.operand(x, row, 1, row_keys), xla.operand(x, col, 0, col_keys))
  for w in want:
    assert np.isfinite(np.asarray(reference.dequantize(w))).all()
  got = api.quantize_views(x, row, col, row_keys, col_keys, implementation=implementation)
  for g, w in zip(got, want, strict=True):
    assert_same(g, w)


@pytest.mark.parametrize("implementation", ["xla", "interpret"])
def test_bad_input_is_an_error_not_a_fallback(implementation):
  """What no implementation can quantize fails with a ValueError naming the problem, whichever is chosen."""
  x = jnp.ones((64, 48), jnp.bfloat16)
  with pytest.raises(ValueError, match="must be a multiple of the mxfp4 block=32"):
    api.quantize_operand(x, MX, 1, implementation=implementation)
  with pytest.raises(ValueError, match="needs a key"):
    api.quantize_views(jnp.ones((64, 64), jnp.bfloat16), MX_SR, MX, implementation=implementation)
  with pytest.raises(ValueError, match="an FP4 format"):
    api.quantize_operand(x, S(None), 1, implementation=implementation)
  with pytest.raises(ValueError, match="unknown quantizer implementation 'triton'"):
    api.quantize_operand(x, MX, 0, implementation="triton")
  with pytest.raises(ValueError, match="unknown operand form 'bf16'"):
    api.quantize_operand(x, MX, 0, implementation=implementation, form="bf16")


@pytest.mark.parametrize("implementation", ["xla", "interpret"])
@pytest.mark.parametrize("row,col", [(S("nvfp4", "sr"), S("nvfp4", "sr", transform="rht16")),
                                     (MX, S("mxfp4", transform="h32")), (S("nvfp4_46"), S("nvfp4_46"))])
def test_forms_are_met_whoever_quantizes(implementation, row, col):
  """Each view comes in the form asked for, whether a kernel wrote its values (NVFP4 1-D blocks) or the API
  decoded them from codes (XLA, MXFP4, 4/6): the same values as decoding the reference codes."""
  x = jnp.asarray(INPUTS["heavy"](rng_for("forms", row, col), (64, 128))).astype(jnp.bfloat16)
  row_keys, col_keys = OperandKeys(jax.random.key(1)), OperandKeys(jax.random.key(2), jax.random.key(3))
  want = (xla.operand(x, row, 1, row_keys), xla.operand(x, col, 0, col_keys))
  for forms in (("values", "codes"), ("codes", "values")):
    got = api.quantize_views(x, row, col, row_keys, col_keys, implementation=implementation, forms=forms)
    for g, w, form in zip(got, want, forms, strict=True):
      if form == "codes":
        assert_same(g, w)
        continue
      assert isinstance(g, ScaledValues)
      np.testing.assert_array_equal(bits(g.kmajor()), bits(scaled_values(w).values))
  one = api.quantize_operand(x, col, 0, col_keys, implementation=implementation, form="values")
  np.testing.assert_array_equal(bits(one.kmajor()), bits(scaled_values(want[1]).values))
