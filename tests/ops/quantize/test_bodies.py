"""Kernel bodies traced once per configuration (`pallas.bodies`): launches that differ only in their grid share one
traced body and give the outputs and the Triton IR of a body traced for each (interpret mode; IR lowered on CPU
for an abstract H200)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from fp4jax.numerics.spec import OperandKeys, OperandSpec
from fp4jax.ops.quantize.pallas import bodies, common, eden, nvfp4

TRACES = []


def _scaled_rows(x_ref, o_ref, *, factor):
  """A kernel of a function and keywords (what `bodies.body_key` keys): each row block times `factor`
  plus its program id along the row axis (exact for a power-of-two factor), so a grid mixed up between
  launches shows."""
  TRACES.append(factor)
  row = common.grid_ids(())[0]
  o_ref[...] = x_ref[...] * factor + row.astype(x_ref.dtype)


def _launch(x, kernel, block=(8, 128)):
  return common.pallas_call(kernel, grid=(x.shape[0] // block[0],), in_specs=[pl.BlockSpec(block, lambda i: (i, 0))],
                            out_specs=pl.BlockSpec(block, lambda i: (i, 0)),
                            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True,
                            name=f"test_scaled_rows_{x.shape[0]}")(x)


def _want(x, factor, block_rows=8):
  return np.asarray(x) * factor + (np.arange(x.shape[0]) // block_rows)[:, None].astype(np.float32)


@pytest.fixture(autouse=True)
def _fresh():
  bodies._BODIES.clear()
  TRACES.clear()


def test_launches_of_one_configuration_trace_their_body_once():
  """Three launches on 2, 5 and 2 row blocks trace the kernel once, and each gives its own grid's outputs."""
  rng = np.random.default_rng(0)
  xs = [jnp.asarray(rng.standard_normal((r, 128)), jnp.float32) for r in (16, 40, 16)]
  kernel = functools.partial(_scaled_rows, factor=4.0)
  outs = jax.jit(lambda *xs: [_launch(x, kernel) for x in xs])(*xs)
  assert TRACES == [4.0]
  for x, out in zip(xs, outs):
    np.testing.assert_array_equal(np.asarray(out), _want(x, 4.0))


@pytest.mark.parametrize("other", ["keyword", "block", "dtype", "closure"])
def test_another_configuration_traces_its_own_body(other):
  """A kernel keyword, a block shape or an operand dtype of its own is another body; a closure (it may hold
  anything) is traced at every launch."""
  x = jnp.asarray(np.random.default_rng(1).standard_normal((32, 128)), jnp.float32)
  first = functools.partial(_scaled_rows, factor=2.0)
  second, block, y = first, (8, 128), x
  if other == "keyword":
    second = functools.partial(_scaled_rows, factor=8.0)
  elif other == "block":
    block = (16, 128)
  elif other == "dtype":
    y = x.astype(jnp.bfloat16)
  else:  # one closure (it holds `factor`), launched on 4 and 8 row blocks
    factor = 2.0
    first = second = lambda x_ref, o_ref: _scaled_rows(x_ref, o_ref, factor=factor)
    y = jnp.concatenate([x, -x])
  a, b = jax.jit(lambda x, y: (_launch(x, first), _launch(y, second, block)))(x, y)
  assert len(TRACES) == 2
  np.testing.assert_array_equal(np.asarray(a), _want(x, 2.0))
  factor = 8.0 if other == "keyword" else 2.0
  want_b = _want(y.astype(jnp.float32), factor, block[0]).astype(y.dtype)
  np.testing.assert_array_equal(np.asarray(b, np.float32), np.asarray(want_b, np.float32))


def test_key_leaves_out_the_name_and_the_grid():
  x = jnp.zeros((16, 128))
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  key = lambda rows, name: bodies.body_key(functools.partial(_scaled_rows, factor=1.0), [spec], spec,
                                           [jnp.zeros((rows, 128))], x, {"interpret": True, "name": name})
  assert key(16, "a") == key(64, "b")
  held = 1.0
  assert bodies.body_key(lambda x_ref, o_ref: held, [spec], spec, [x], x, {}) is None


def test_nested_partials_key_by_what_they_hold():
  """`common.dual_view_call` launches a partial holding the format's kernel partial: two built alike are one
  key, one holding another argument is another."""
  x = jnp.zeros((16, 128))
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  outer = lambda f: functools.partial(_scaled_rows, factor=functools.partial(_want, block_rows=f))
  key = lambda kernel: bodies.body_key(kernel, [spec], spec, [x], x, {})
  assert key(outer(8)) is not None and key(outer(8)) == key(outer(8)) != key(outer(16))
  assert key(functools.partial(_scaled_rows, factor=1)) != key(functools.partial(_scaled_rows, factor=1.0))


def _stripped(ir: str) -> str:
  """Triton IR without its locations and kernel names (one per launch configuration)."""
  ir = re.sub(r"loc\([^)]*\)", "", re.sub(r"^#loc.*$", "", ir, flags=re.M))
  return re.sub(r"fp4jax_\w+k\b", "NAME", ir)


def test_shared_body_lowers_to_the_ir_of_its_own_trace(triton_modules):
  """MS-EDEN's launches (its rotated amax, then the quantizer) at three operand sizes in one program: two bodies
  traced, and each launch's Triton IR (names and locations aside) that of the launch lowered alone with nothing
  traced before."""
  spec = OperandSpec("nvfp4", "eden", transform="rht128")
  launch = lambda x: eden.operand(x, spec, 1, OperandKeys(jax.random.key(1), jax.random.key(2)))
  rows = (128, 384, 1024)
  together = triton_modules(lambda x: [launch(x[:r]) for r in rows], (1024, 256))
  assert len(together) == 6 and len(bodies._BODIES) == 2
  for i, r in enumerate(rows):
    bodies._BODIES.clear()
    alone = triton_modules(launch, (r, 256))
    assert [_stripped(m) for m in together[2 * i:2 * i + 2]] == [_stripped(m) for m in alone]


@pytest.mark.parametrize("rounding, traced", [("rne", 1), ("sr", 2)])
def test_dual_views_share_a_body_unless_they_draw(triton_modules, rounding, traced):
  """NVFP4's dual-view launches on x of 128 and 256 rows: deterministic ones share one body (x's shape is not in
  their code), stochastic ones each trace their own (their draws are keyed by x's flat index); each launch's
  Triton IR, names and locations aside, that of its own trace."""
  spec = OperandSpec("nvfp4", rounding)
  keys = OperandKeys(jax.random.key(1), jax.random.key(2))
  launch = lambda x: nvfp4.views(x, spec, spec, keys, keys)
  duals = lambda modules: [m for m in modules if "quantize_dual" in m]
  together = duals(triton_modules(lambda x: [launch(x[:r]) for r in (128, 256)], (256, 256)))
  assert len(together) == 2 and len([k for k in bodies._BODIES if "_nv_kernel" in repr(k)]) == traced
  for r, ir in zip((128, 256), together):
    bodies._BODIES.clear()
    assert _stripped(ir) == _stripped(duals(triton_modules(launch, (r, 256)))[0])
