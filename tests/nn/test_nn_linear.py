"""FP4Linear and the nnx.Linear dot_general hook: shapes, bf16 exactness, gradients under every route."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fp4jax import Impl, route as route_lib
from fp4jax.dot import fp4_dot
from fp4jax.nn import FP4Linear, fp4_dot_general

# [B, T, K] -> [B, T, N]; every dim a multiple of 128 so each preset route (2-D tiles, H/RHT128) applies.
B, T, K, N = 2, 64, 128, 128


def _x(seed=0, dtype=jnp.bfloat16):
  return jax.random.normal(jax.random.key(seed), (B, T, K), jnp.float32).astype(dtype)


def test_shapes_dtypes_and_static_route():
  layer = FP4Linear(K, N, route="mxfp4_rtn", rngs=nnx.Rngs(0))
  assert layer.kernel.shape == (K, N) and layer.kernel.dtype == jnp.float32
  assert layer.route is route_lib.get("mxfp4_rtn")
  y = layer(_x(dtype=jnp.float32))
  assert y.shape == (B, T, N) and y.dtype == jnp.bfloat16  # Computes in `dtype`.
  # The route is graph structure, not state: only the kernel is a Param.
  assert [p for p, _ in nnx.to_flat_state(nnx.state(layer))] == [("kernel",)]


def test_input_size_is_checked():
  layer = FP4Linear(K, N, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="input feature size 64 != FP4Linear's in_features=128"):
    layer(jnp.ones((2, 64), jnp.bfloat16))


def test_unknown_route_is_an_error():
  with pytest.raises(ValueError, match="unknown route 'fp3'"):
    FP4Linear(K, N, route="fp3", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("kwargs, match", [
    ({"dtype": jnp.int8}, "FP4Linear's dtype= takes a floating-point dtype"),
    ({"out_dtype": jnp.int32}, "FP4Linear's out_dtype= takes a floating-point dtype"),
    ({"kernel_sharding": ("a", "b", "c")}, "kernel_sharding takes 2 mesh-axis names or None"),
    ({"kernel_sharding": "ab"}, "kernel_sharding takes 2 mesh-axis names or None"),
    ({"kernel_sharding": (), "use_bias": True}, "kernel_sharding takes 2 mesh-axis names or None"),
    ({"kernel_sharding": None}, r"kernel_sharding takes 2 mesh-axis names or None \(.*\), got None$"),
    ({"param_dtype": jnp.int32}, "param_dtype= takes a floating-point dtype, got int32"),
    ({"param_dtype": "fp32"}, "param_dtype= takes a floating-point dtype, got 'fp32'"),
    ({"param_dtype": jnp.float64}, r"param_dtype=float64 needs jax_enable_x64 \(JAX would truncate it to float32"),
])
def test_bad_settings_are_named_when_the_layer_is_built(kwargs, match):
  """Mistakes fail at construction naming the argument, not at the first call as an error about x."""
  with pytest.raises(ValueError, match=match):
    FP4Linear(K, N, route="mxfp4_rtn", rngs=nnx.Rngs(0), **kwargs)
  with pytest.raises(ValueError, match="out_features takes an int >= 1, got -1"):
    FP4Linear(K, -1, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="FP4Linear takes an array x"):
    FP4Linear(K, N, rngs=nnx.Rngs(0))(jnp.float32(1))
  assert FP4Linear(np.int64(K), N, rngs=nnx.Rngs(0)).in_features == K  # a shape's NumPy int is an int


def test_bf16_equals_nnx_linear_exactly():
  ours = FP4Linear(K, N, route="bf16", use_bias=True, rngs=nnx.Rngs(0))
  ours.bias[...] = jax.random.normal(jax.random.key(3), (N,))
  stock = nnx.Linear(K, N, use_bias=True, dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
  stock.kernel[...] = ours.kernel[...]
  stock.bias[...] = ours.bias[...]
  x = _x()
  np.testing.assert_array_equal(ours(x), stock(x))

  def loss(m):
    return jnp.sum(m(x).astype(jnp.float32) ** 2)

  g_ours, g_stock = nnx.grad(loss)(ours), nnx.grad(loss)(stock)
  np.testing.assert_array_equal(g_ours["kernel"][...], g_stock["kernel"][...])
  np.testing.assert_array_equal(g_ours["bias"][...], g_stock["bias"][...])


def test_sharding_metadata():
  layer = FP4Linear(K, 2 * K, kernel_sharding=(None, "fsdp"), use_bias=True, rngs=nnx.Rngs(0))
  specs = nnx.get_partition_spec(nnx.state(layer))
  assert specs["kernel"].get_value() == jax.sharding.PartitionSpec(None, "fsdp")
  assert specs["bias"].get_value() == jax.sharding.PartitionSpec("fsdp")


@pytest.mark.parametrize("name", route_lib.names())
def test_value_and_grad_every_route(name):
  layer = FP4Linear(K, N, route=name, rngs=nnx.Rngs(0))
  x = _x()
  key = jax.random.key(7)

  @nnx.jit
  def step(m, x):
    def loss(m, x):
      return jnp.mean(m(x, key=key).astype(jnp.float32) ** 2)
    return nnx.value_and_grad(loss, argnums=(0, 1))(m, x)

  value, (g_layer, g_x) = step(layer, x)
  reference = jnp.mean(jnp.dot(x.astype(jnp.float32), layer.kernel[...]) ** 2)
  g_kernel = g_layer["kernel"][...]
  assert g_kernel.shape == (K, N) and g_kernel.dtype == jnp.float32
  assert g_x.shape == x.shape and g_x.dtype == x.dtype
  assert bool(jnp.all(jnp.isfinite(g_kernel))) and bool(jnp.all(jnp.isfinite(g_x.astype(jnp.float32))))
  assert float(jnp.linalg.norm(g_kernel)) > 0
  # FP4 changes the loss by a few percent at most (RNE/SR error ~ 1/8 per element, averaged).
  np.testing.assert_allclose(float(value), float(reference), rtol=0.15)


def test_hook_matches_fp4linear():
  for name in ("bf16", "mxfp4_rtn"):
    ours = FP4Linear(K, N, route=name, rngs=nnx.Rngs(0))
    stock = nnx.Linear(K, N, use_bias=False, dtype=jnp.bfloat16, dot_general=fp4_dot_general(name),
                       rngs=nnx.Rngs(1))
    stock.kernel[...] = ours.kernel[...]
    x = _x()
    np.testing.assert_array_equal(ours(x), stock(x))


def test_hook_needs_key_for_keyed_routes_and_uses_the_fixed_key():
  with pytest.raises(ValueError, match="route 'mxfp4_sr' needs a random key"):
    fp4_dot_general("mxfp4_sr")
  key = jax.random.key(5)
  ours = FP4Linear(K, N, route="mxfp4_sr", rngs=nnx.Rngs(0))
  stock = nnx.Linear(K, N, use_bias=False, dtype=jnp.bfloat16, dot_general=fp4_dot_general("mxfp4_sr", key),
                     rngs=nnx.Rngs(1))
  stock.kernel[...] = ours.kernel[...]
  x = _x()
  g_ours = jax.grad(lambda x: jnp.sum(ours(x, key=key).astype(jnp.float32)))(x)
  g_stock = jax.grad(lambda x: jnp.sum(stock(x).astype(jnp.float32)))(x)
  np.testing.assert_array_equal(g_ours, g_stock)


def test_hook_writes_preferred_element_type_from_the_accumulator():
  """nnx.Linear(preferred_element_type=float32) over bf16 operands gets the float32 product, not a bf16-rounded
  one cast up (fp4_dot's out_dtype)."""
  x = _x()
  w = jax.random.normal(jax.random.key(3), (K, N), jnp.float32).astype(jnp.bfloat16)
  dims = (((2,), (0,)), ((), ()))
  y = fp4_dot_general("mxfp4_rtn")(x, w, dims, preferred_element_type=jnp.float32)
  assert y.dtype == jnp.float32
  np.testing.assert_array_equal(y, fp4_dot(x, w, route="mxfp4_rtn", out_dtype=jnp.float32))
  assert not np.array_equal(y, y.astype(jnp.bfloat16).astype(jnp.float32))  # more than bf16 precision


def test_hook_checks_key_and_impl_when_made():
  with pytest.raises(ValueError, match="fp4_dot_general needs a key"):
    fp4_dot_general("mxfp4_sr", key=3)
  with pytest.raises(TypeError, match="fp4_dot_general's impl= takes an fp4jax.Impl"):
    fp4_dot_general("mxfp4_rtn", impl="xla")
  with pytest.raises(NotImplementedError, match="takes a 2-D rhs \\[K, N\\], got rhs.shape=\\(128, 4, 8\\)"):
    nnx.LinearGeneral(K, (4, 8), dot_general=fp4_dot_general("mxfp4_rtn"), rngs=nnx.Rngs(0))(_x())


def test_hook_rejects_other_contractions():
  dot_general = fp4_dot_general("bf16")
  x, w = jnp.ones((4, 8)), jnp.ones((8, 16))
  with pytest.raises(NotImplementedError, match="only x\\[..., K\\] @ w\\[K, N\\]"):
    dot_general(x, w.T, (((1,), (1,)), ((), ())))
  with pytest.raises(NotImplementedError, match="2-D rhs \\[K, N\\], got rhs.shape=\\(2, 8, 16\\)"):
    dot_general(jnp.ones((2, 4, 8)), jnp.ones((2, 8, 16)), (((2,), (1,)), ((0,), (0,))))
  np.testing.assert_array_equal(dot_general(x, w, (((1,), (0,)), ((), ()))), x @ w)


@pytest.mark.parametrize("kwargs, match", [
    ({"dtype": jnp.float32}, r"here dtype differs \(bfloat16 / float32\); out_dtype differs"),
    ({"impl": Impl(gemm="emulated")}, r"here impl differs \(Impl\(.*gemm='auto'.* / Impl\(.*gemm='emulated'"),
    ({"route": "mxfp4"}, r"here route differs \(bf16 / mxfp4\)"),
    ({"use_bias": True}, r"here linears \[1\] have a bias"),
])
def test_fused_call_names_what_differs(kwargs, match):
  """The message listed each layer's sizes, route and bias only: a dtype or impl mismatch read as no difference."""
  from fp4jax.nn import linear
  layers = [FP4Linear(64, 64, rngs=nnx.Rngs(0)), FP4Linear(64, 64, rngs=nnx.Rngs(1), **kwargs)]
  with pytest.raises(ValueError, match=match):
    linear.fused_call(layers, jnp.zeros((2, 64), jnp.bfloat16))


@pytest.mark.parametrize("x, match", [(jnp.float32(1), r"^fused_call takes an array x \[\.\.\., 64\], got "),
                                      (jnp.ones((2, 8)), r"^input feature size 8 != fused_call's in_features=64$")])
def test_fused_call_checks_x_as_a_layer_does(x, match):
  """A 0-d x raised an IndexError from x.shape[-1]."""
  from fp4jax.nn import linear
  with pytest.raises(ValueError, match=match):
    linear.fused_call([FP4Linear(64, 64, rngs=nnx.Rngs(i)) for i in range(2)], x)


def test_layers_whose_blocks_would_straddle_are_not_fused():
  """A 32x32 MXFP4 weight tile over a 40- and a 24-wide layer would give the smaller one the larger one's
  scale: such layers are not fusable, fused_call refuses them, and sizes in whole blocks fuse to the numbers
  of separate calls (mxfp4_rtn: RNE, no keys)."""
  from fp4jax.nn import linear
  x = jax.random.normal(jax.random.key(0), (64, 64), jnp.bfloat16)
  a, b = (FP4Linear(64, n, route="mxfp4_rtn", rngs=nnx.Rngs(i)) for i, n in enumerate((40, 24)))
  b.kernel[...] = b.kernel[...] * 10
  assert not linear.fusable([a, b])
  with pytest.raises(ValueError, match="multiples of 32"):
    linear.fused_call([a, b], x)
  a, b = (FP4Linear(64, n, route="mxfp4_rtn", rngs=nnx.Rngs(i)) for i, n in enumerate((64, 32)))
  b.kernel[...] = b.kernel[...] * 10
  assert linear.fusable([a, b])
  for fused, alone in zip(linear.fused_call([a, b], x), (a(x), b(x))):
    np.testing.assert_allclose(np.asarray(fused, np.float32), np.asarray(alone, np.float32), rtol=1e-2, atol=1e-2)
