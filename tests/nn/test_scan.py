"""fp4jax.nn.scan.run_layers: the numbers of jax.lax.scan and of a Python loop, saved values in uninitialized
stacks, and nothing stored that the backward can take from the layer's own inputs."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_devices
from fp4jax.nn import scan

L, B, D = 4, 6, 16


def _body(h, params, invariants, layer):
  """A layer that reads every kind of input: parameters (float and int), the index, an int and a key invariant."""
  positions, key = invariants
  noise = jax.random.uniform(jax.random.fold_in(key, layer), h.shape, h.dtype, -0.01, 0.01)
  z = jnp.tanh(h @ params["w"].astype(h.dtype) + params["b"]) * (1 + params["n"].astype(h.dtype))
  z = jax.ad_checkpoint.checkpoint_name(z, "z")
  return h + z * z * jnp.cos(positions.astype(h.dtype))[:, None] + noise  # z * z: the backward reads z


def _inputs(seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  stacked = {"w": (jax.random.normal(k[0], (L, D, D)) / 4).astype(jnp.bfloat16),  # a cast weight, as in Llama
             "b": jax.random.normal(k[1], (L, D)) / 4,
             "n": jnp.arange(L, dtype=jnp.int32)}  # a parameter leaf that gets no gradient
  h = jax.random.normal(k[2], (B, D))
  invariants = (jnp.arange(B, dtype=jnp.int32), k[3])
  return h, stacked, invariants


def _python_loop(body, h, stacked, invariants, first_layer):
  for l in range(L):  # The barrier keeps XLA from fusing across layers, as a loop's boundary does.
    h = jax.lax.optimization_barrier(body(h, jax.tree.map(lambda x: x[l], stacked), invariants,
                                          jnp.int32(first_layer + l)))
  return h


def _lax_scan(body, h, stacked, invariants, first_layer):
  step = lambda h, xs: (body(h, xs[0], invariants, xs[1]), None)
  return jax.lax.scan(step, h, (stacked, first_layer + jnp.arange(L, dtype=jnp.int32)))[0]


def _value_and_grads(run, body):
  def loss(h, stacked, invariants):
    return jnp.sum(run(body, h, stacked, invariants, first_layer=3) ** 2)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), allow_int=True))(*_inputs())


@pytest.mark.parametrize("reference", [_lax_scan, _python_loop])
@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.save_only_these_names("z")])
def test_run_layers_matches_lax_scan_and_a_loop_bit_for_bit(policy, reference):
  body = _body if policy is None else jax.checkpoint(_body, policy=policy)
  (value, grads), (value_ref, grads_ref) = _value_and_grads(scan.run_layers, body), _value_and_grads(reference, body)
  assert value == value_ref
  assert jax.tree.structure(grads) == jax.tree.structure(grads_ref)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype != jax.dtypes.float0:
      np.testing.assert_array_equal(got, want)
  # Every layer received its own gradient (the reversed loop wrote each slice).
  assert all(np.any(np.asarray(grads[1]["b"][l]) != 0) for l in range(L))
  assert len({np.asarray(grads[1]["w"][l]).tobytes() for l in range(L)}) == L


def _stacks(body):
  """dtype[shape] of the stacks run_layers' forward allocates for its backward."""
  h, stacked, invariants = _inputs()
  forward = lambda h, s: jax.vjp(lambda h, s: scan.run_layers(body, h, s, invariants), h, s)[0]
  jaxpr = jax.make_jaxpr(forward)(h, stacked)
  return sorted(e.outvars[0].aval.str_short(short_dtypes=True) for e in jaxpr.eqns if e.primitive.name == "empty")


def test_run_layers_stores_computed_values_only():
  # Saving only z: the stacks hold z and each layer's input h; the weights, biases, positions, key and layer
  # index, which the backward reads too, come from the stacked parameters and the invariants instead.
  saved_z = jax.checkpoint(_body, policy=jax.checkpoint_policies.save_only_these_names("z"))
  assert _stacks(saved_z) == [f"f32[{L},{B},{D}]"] * 2
  # Without a policy the VJP keeps more (tanh's output, the float32 weight, ...), but never an input.
  everything = _stacks(_body)
  assert len(everything) > 2 and all(re.fullmatch(rf"f32\[{L}(,\d+)*\]", s) for s in everything), everything


def test_run_layers_lowers_its_stacks_to_uninitialized_buffers_on_gpu():
  # Lowered for CUDA (on any machine), each stack is an AllocateBuffer, never a broadcast of zeros; jax.lax.scan
  # writes zeros into its stacked outputs first. On the CPU `lax.empty` is zeros; the tests run there.
  def grads(run):
    def loss(h, stacked, invariants):
      return jnp.sum(run(_body, h, stacked, invariants))
    return jax.jit(jax.grad(loss, argnums=1, allow_int=True)).trace(*_inputs()).lower(
        lowering_platforms=("cuda",)).as_text()
  text = grads(lambda body, h, s, inv: scan.run_layers(body, h, s, inv))
  allocations = text.count("custom_call @AllocateBuffer()")
  assert allocations == len(_stacks(_body)) + 2, allocations  # + the gradients of w and b
  assert "AllocateBuffer" not in grads(functools.partial(_lax_scan, first_layer=0))


def test_run_layers_runs_under_a_mesh_of_explicit_axes():
  # Under a mesh of explicit axes every value computed in the loop carries the mesh; the stacks they are
  # written into must carry it too (lax.empty takes none from the context), or dynamic_update_slice refuses
  # to write (`bench compile --h200` lowered a scanned step so). The gradients are those of no mesh.
  _assert_same_gradients_under_explicit_axes(
      jax.checkpoint(_body, policy=jax.checkpoint_policies.save_only_these_names("z")))


def _assert_same_gradients_under_explicit_axes(body):
  """run_layers' value and gradients under a one-device mesh of explicit axes equal those of no mesh."""
  mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:1])
  want = _value_and_grads(scan.run_layers, body)
  with jax.set_mesh(mesh):
    got = _value_and_grads(scan.run_layers, body)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    if g.dtype != jax.dtypes.float0:
      np.testing.assert_array_equal(g, w)


def test_run_layers_stacks_a_residual_whose_shape_has_no_sharding_under_explicit_axes():
  # `jax.eval_shape` gives some primitives' outputs no sharding where the traced value has one: cuDNN's
  # attention (`bench compile --step 30m --scan auto --h200` with JAX's CUDA plugin installed) and a
  # pure_callback, whose output is saved here. A stack made from that shape had no mesh, and writing the value
  # into it failed under a mesh of explicit axes.
  def doubled(x):
    return jax.pure_callback(lambda a: np.asarray(a) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

  @jax.custom_vjp
  def double(x):
    return doubled(x)

  double.defvjp(lambda x: (doubled(x), None), lambda _, g: (2 * g,))
  _assert_same_gradients_under_explicit_axes(
      lambda h, params, invariants, layer: jnp.tanh(double(h) * params["b"]))  # saves double(h)


_SPLIT_OVER_EXPLICIT_AXES = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from fp4jax.nn import scan
k = jax.random.split(jax.random.key(0), 3)
h, stacked = jax.random.normal(k[0], (8, 16)), {"w": (jax.random.normal(k[1], (3, 16, 16)) / 4).astype(jnp.bfloat16)}
body = lambda h, p, positions, layer: h + jnp.tanh(h @ p["w"].astype(h.dtype)) * jnp.cos(positions * 1.0)[:, None]
loss = lambda h, stacked, positions: jnp.sum(scan.run_layers(body, h, stacked, positions) ** 2)
step = lambda *args: jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(*args)
want = step(h, stacked, jnp.arange(8))
mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
with jax.set_mesh(mesh):
  split = lambda x: jax.device_put(x, NamedSharding(mesh, P("d")))
  got = step(split(h), stacked, jnp.arange(8))  # the positions replicated
  assert got[1][0].sharding.spec == P("d", None), got[1][0].sharding
for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
  np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
"""


def test_run_layers_splits_over_a_mesh_of_explicit_axes():
  """h split over an Explicit axis of 2 CPU devices: the loop runs with the axes Auto, gives the numbers of no
  mesh, and dh keeps h's sharding. (A bf16 weight read as float32, as Llama's are, gave its gradient slice the
  batch's sharding, which dynamic_update_slice refused to write into the unsharded gradient stack.)"""
  cpu_devices.run(_SPLIT_OVER_EXPLICIT_AXES, 2)


def test_run_layers_refuses_differentiable_invariants():
  h, stacked, _ = _inputs()
  with pytest.raises(TypeError, match=r"invariants get no gradient.*float32\[6\]"):
    scan.run_layers(_body, h, stacked, (jnp.ones(B), jax.random.key(0)))


@pytest.mark.parametrize("stacked, shown", [
    ({"w": jnp.ones((L, D, D)), "b": jnp.ones((L - 1, D))}, f"sizes ['b']: {L - 1}, ['w']: {L} "),
    ({"w": jnp.ones((0, D, D))}, "sizes ['w']: 0 "),
    ({"w": jnp.ones((L, D, D)), "s": jnp.float32(1)}, f"sizes ['s']: None, ['w']: {L} "),
    ({}, "sizes no leaf "),
])
def test_run_layers_refuses_stacks_without_one_layer_count(stacked, shown):
  """A leaf with fewer layers than the others was read at a clamped index (its last slice again), silently."""
  with pytest.raises(ValueError, match=re.escape(shown)):
    scan.run_layers(lambda h, p, i, l: h, jnp.ones((B, D)), stacked)


def test_read_as_casts_each_slice_in_the_loop():
  """`read_as`: a float32 stack read as bf16 gives the numbers of the bf16 stack passed in (its cast's gradient,
  converted), with the loop's weight-gradient stack kept in bf16 and returned in float32 for the float32 stack."""
  h, stacked, invariants = _inputs()
  master = dict(stacked, w=stacked["w"].astype(jnp.float32))  # exact: the bf16 weights as float32 masters

  def value_and_grads(stack, read_as=None):
    def loss(h, stack):
      return jnp.sum(scan.run_layers(_body, h, stack, invariants, first_layer=3, read_as=read_as) ** 2)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), allow_int=True))(h, stack)

  read_w = lambda path, x: jnp.bfloat16 if path[-1].key == "w" else None
  (value, (dh, grads)), (value_ref, (dh_ref, grads_ref)) = value_and_grads(master, read_w), value_and_grads(stacked)
  assert value == value_ref
  np.testing.assert_array_equal(dh, dh_ref)
  assert grads["w"].dtype == jnp.float32 and grads_ref["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(grads["w"], grads_ref["w"].astype(jnp.float32))
  np.testing.assert_array_equal(grads["b"], grads_ref["b"])
  # The weight-gradient stack the backward allocates is bf16, what the layers read, not the stack's float32
  # (saving z only: no weight is stored for the backward either).
  saved_z = jax.checkpoint(_body, policy=jax.checkpoint_policies.save_only_these_names("z"))
  jaxpr = jax.make_jaxpr(jax.grad(lambda s: jnp.sum(scan.run_layers(saved_z, h, s, invariants, read_as=read_w)),
                                  allow_int=True))(master)
  empties = [e.outvars[0].aval.str_short(short_dtypes=True) for e in jaxpr.eqns if e.primitive.name == "empty"]
  assert f"bf16[{L},{D},{D}]" in empties and f"f32[{L},{D},{D}]" not in empties, empties


def test_a_layer_is_traced_once_under_grad():
  """The forward's stacks take their shapes from the loop body's own trace: one trace of the layer per
  differentiated call (an FP4 layer's trace is most of a train step's)."""
  traces = []

  def body(h, params, invariants, layer):
    traces.append(layer)
    return _body(h, params, invariants, layer)

  value, _ = _value_and_grads(scan.run_layers, body)
  assert np.isfinite(value)
  assert len(traces) == 1
