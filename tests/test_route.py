"""Routes: operand-spec validation, presets per docs/NUMERICS.md, hashing, key derivation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import numpy_ref  # tests/numpy_ref.py
import pytest

from fp4jax import route as routes
from fp4jax.route import OperandSpec, Route


def test_presets_listed_and_fetched():
  for name in ("bf16", "mxfp4", "mxfp4_h32", "nvfp4", "nvfp4_tile_local", "quartet2", "fp8"):
    assert name in routes.names()
    assert routes.get(name).name == name
  r = routes.get("mxfp4")
  assert routes.get(r) is r


def test_unknown_route_lists_presets():
  with pytest.raises(ValueError, match="nope.*mxfp4.*quartet2"):
    routes.get("nope")


@pytest.mark.parametrize("kwargs, match", [
    (dict(fmt="fp5"), r"format 'fp5'.*mxfp4"),
    (dict(fmt="mxfp4", rounding="up"), r"rounding 'up'.*'eden'.*'rne'.*'sr'"),
    (dict(fmt="mxfp4", transform="h64"), r"transform 'h64'.*h16.*rht128"),
    (dict(fmt="mxfp4", scale_rule="max"), r"scale_rule 'max'.*noclip.*ocp"),
    (dict(fmt="mxfp4", rounding="eden"), r"eden.*nvfp4"),
    (dict(fmt="nvfp4_46", rounding="eden"), r"eden.*nvfp4"),
    (dict(fmt="nvfp4", rounding="eden", tile_2d=True), r"eden.*1-D blocks"),
    (dict(fmt="nvfp4", scale_rule="ocp"), r"scale_rule='ocp' applies to MX formats only"),
    (dict(fmt="nvfp4", clip_fraction=0.87), r"clip_fraction=0.87 applies to MX formats only"),
    (dict(fmt="mxfp4", tile_2d=True, clip_fraction=1.5), r"clip_fraction=1.5"),
    (dict(fmt=None, rounding="sr"), r"high-precision"),
    (dict(fmt="fp8_e5m2", rounding="sr"), r"'fp8_e5m2' scales per tensor: it takes rounding='rne'"),
    (dict(fmt="fp8_e4m3", tile_2d=True), r"'fp8_e4m3' scales per tensor.*no 2-D tiles"),
    (dict(fmt="fp8_e4m3", scale_rule="ocp"), r"scale_rule='ocp' applies to MX formats only"),
])
def test_operand_spec_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    OperandSpec(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(fmt="mxfp4", tile_2d="no"), r"tile_2d takes True or False, got 'no'"),
    (dict(fmt="mxfp4", clip_fraction="0.5"), r"clip_fraction takes a number in \(0, 1\] or None, got '0.5'"),
    (dict(fmt=["mxfp4"]), r"fmt takes a name \(str\), got \['mxfp4'\]"),
])
def test_operand_spec_types(kwargs, match):
  """Options of the wrong type are named (a truthy string used to mean 2-D tiles silently)."""
  with pytest.raises(TypeError, match=match):
    OperandSpec(**kwargs)


def test_route_names_are_strings_and_presets_read_only():
  with pytest.raises(TypeError, match=r"a Route's name is a non-empty str .*got \['r'\]"):
    Route(["r"], fprop_x=OperandSpec("mxfp4"), fprop_w=OperandSpec("mxfp4"))
  with pytest.raises(TypeError):
    routes.PRESETS["bf16"] = routes.get("mxfp4")  # would change what route="bf16" means process-wide


def test_operand_spec_needs_key():
  assert not OperandSpec("mxfp4").needs_key
  assert not OperandSpec("mxfp4", transform="h32").needs_key
  assert OperandSpec("mxfp4", rounding="sr").needs_key
  assert OperandSpec("nvfp4", transform="rht16").needs_key
  assert OperandSpec("nvfp4", rounding="eden", transform="rht128").needs_key
  assert not OperandSpec(None).needs_key


def test_route_transform_must_be_on_both_operands():
  with pytest.raises(ValueError, match="wgrad transform.*both operands"):
    Route("bad", wgrad_x=OperandSpec("mxfp4", transform="h32"), wgrad_dy=OperandSpec("mxfp4"))


def test_route_requantize_saved_needs_quantized_operands():
  with pytest.raises(ValueError, match="requantize_saved"):
    Route("bad", fprop_x=OperandSpec("nvfp4"), fprop_w=OperandSpec("nvfp4"), requantize_saved=True)
  with pytest.raises(TypeError, match="requantize_saved takes True or False, got 'no'"):  # a truthy str: on
    Route("bad", requantize_saved="no")
  # The saved fprop operands dequantize to rotated values: the backward's products would be of rotated X and W
  # (dX and dW came out with cosine -0.12 against the true gradients).
  h, nv = OperandSpec("nvfp4", transform="h16"), OperandSpec("nvfp4")
  with pytest.raises(ValueError, match="requantize_saved .* fprop transform 'h16'"):
    Route("bad", fprop_x=h, fprop_w=h, dgrad_dy=nv, dgrad_w=nv, wgrad_dy=nv, wgrad_x=nv, requantize_saved=True)
  Route("ok", fprop_x=h, fprop_w=h, dgrad_dy=nv, dgrad_w=nv, wgrad_dy=nv, wgrad_x=nv)
  assert OperandSpec("mxfp4", clip_fraction=np.float32(0.87)).clip_fraction == np.float32(0.87)


def test_route_none_means_high_precision_and_is_hashable():
  r = Route("w_only", fprop_x=None, fprop_w=OperandSpec("mxfp4"))
  assert r.fprop_x == OperandSpec(None) and not r.fprop_x.quantized
  assert hash(r) == hash(Route("w_only", fprop_w=OperandSpec("mxfp4")))
  with pytest.raises(dataclasses.FrozenInstanceError):
    r.name = "x"
  with pytest.raises(TypeError, match="fprop_x"):
    Route("bad", fprop_x="mxfp4")


def test_route_needs_key():
  assert [n for n in routes.names() if not routes.get(n).needs_key] == ["bf16", "mxfp4_rtn", "nvfp4_46", "fp8"]
  assert routes.get("bf16").high_precision and not routes.get("mxfp4").high_precision


def test_presets_follow_numerics_table():
  mx = routes.get("mxfp4")
  assert mx.fprop_x == OperandSpec("mxfp4") and mx.fprop_w.tile_2d and mx.fprop_w.clip_fraction == 0.87
  assert mx.dgrad_w == mx.fprop_w and mx.dgrad_dy.rounding == "sr"
  assert mx.wgrad_x.rounding == mx.wgrad_dy.rounding == "rne"
  h32 = routes.get("mxfp4_h32")
  assert h32.wgrad_x.transform == h32.wgrad_dy.transform == "h32"
  assert dataclasses.replace(h32, name="mxfp4", wgrad_x=mx.wgrad_x, wgrad_dy=mx.wgrad_dy) == mx
  nv = routes.get("nvfp4")
  assert nv.fprop_w == nv.dgrad_w == OperandSpec("nvfp4", tile_2d=True)
  assert nv.dgrad_dy.rounding == nv.wgrad_dy.rounding == "sr" and nv.wgrad_x.rounding == "rne"
  assert nv.wgrad_x.transform == nv.wgrad_dy.transform == "rht16"
  assert {routes.get("nvfp4_tile_local").spec(r).fmt for r in routes.ROLES} == {"nvfp4_tile"}
  q2 = routes.get("quartet2")
  assert q2.requantize_saved and q2.fprop_x == q2.fprop_w == OperandSpec("nvfp4_46")
  for role in ("dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x"):
    assert q2.spec(role) == OperandSpec("nvfp4", rounding="eden", transform="rht128")
  fp8 = routes.get("fp8")  # Transformer Engine's Float8CurrentScaling, HYBRID: E4M3 forward, E5M2 gradients
  assert {r: fp8.spec(r).fmt for r in routes.ROLES} == {
      "fprop_x": "fp8_e4m3", "fprop_w": "fp8_e4m3", "dgrad_w": "fp8_e4m3", "wgrad_x": "fp8_e4m3",
      "dgrad_dy": "fp8_e5m2", "wgrad_dy": "fp8_e5m2"}
  assert not fp8.needs_key and not fp8.requantize_saved


def test_keys_are_deterministic_and_distinct_per_role():
  key = jax.random.key(7)
  keys = [routes.operand_key(key, r) for r in routes.ROLES] + [routes.transform_key(key, g)
                                                                for g in routes.GEMMS]
  data = jnp.stack([jax.random.key_data(k) for k in keys])
  assert len({tuple(map(int, d)) for d in data}) == 9
  np.testing.assert_array_equal(jax.random.key_data(routes.operand_key(key, "wgrad_x")),
                                numpy_ref.fold_in_words(key, 5))
  np.testing.assert_array_equal(jax.random.key_data(routes.transform_key(key, "wgrad")),
                                numpy_ref.fold_in_words(key, 8))


def test_route_is_a_static_jit_argument():
  traces = []

  def g(x, route):
    traces.append(route.name)
    return x * 2

  gj = jax.jit(g, static_argnames="route")
  x = jnp.ones(3)
  gj(x, route=routes.get("nvfp4"))
  gj(x, route=dataclasses.replace(routes.get("nvfp4")))  # Equal route: no retrace.
  gj(x, route=routes.get("mxfp4"))
  assert traces == ["nvfp4", "mxfp4"]


@pytest.mark.parametrize("name", routes.names())
@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
def test_role_keys_equal_operand_keys_one_by_one(name, make_key):
  """`role_keys` derives a pass's keys in one vectorized fold_in: the same bits as `operand_keys` per role."""
  route, key = routes.get(name), make_key(7)
  got = routes.role_keys(route, key, routes.ROLES)
  for role in routes.ROLES:
    want = routes.operand_keys(route.spec(role), key, role)
    for g, w in zip(got[role], want):
      assert (g is None) == (w is None), (role, g, w)
      if w is not None:
        unwrap = jax.random.key_data if jnp.issubdtype(w.dtype, jax.dtypes.prng_key) else (lambda k: k)
        assert (unwrap(g) == unwrap(w)).all(), role
