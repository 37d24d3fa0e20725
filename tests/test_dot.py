"""fp4_dot: forward and gradients against a reference written from the formulas, unbiasedness of the
stochastic routes, residual memory, transformations (jit, grad, vmap, remat) and errors."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, PartitionSpec as P, use_abstract_mesh

import cpu_devices
from fp4jax import Impl
from fp4jax import route as routes
from fp4jax import dot as dot_lib
from fp4jax.dot import fp4_dot, other_orientation
from fp4jax.numerics import prng
from fp4jax.numerics.hadamard import hadamard
from fp4jax.numerics.reference import dequantize, quantize
from jaxprs import equations
from mx_operands import fp8_tolerance

# The documented key rule (fp4jax/route.py): fold_in(key, index), one index per operand role and per GEMM.
ROLE_INDEX = dict(fprop_x=0, fprop_w=1, dgrad_dy=2, dgrad_w=3, wgrad_dy=4, wgrad_x=5)
GEMM_INDEX = dict(fprop=6, dgrad=7, wgrad=8)
FP4_ROUTES = [n for n in routes.names() if n != "bf16"]
M, K, N = 128, 64, 128  # M and N: 128 so that quartet2's RHT128 fits the wgrad and dgrad contractions.


def _fake_quant(v, spec, axis, key, role, gemm):
  """dequantize(quantize(v)) along `axis`, in v's layout, after the spec's transform (float32)."""
  v = v.astype(jnp.float32)
  if spec.fmt is None:
    return v
  if spec.transform is not None:
    tkey = prng.fold_in(key, GEMM_INDEX[gemm]) if spec.transform.startswith("rht") else None
    v = hadamard(v, spec.transform, axis=axis, key=tkey)
  rkey = prng.fold_in(key, ROLE_INDEX[role]) if spec.rounding != "rne" else None
  q = quantize(v, spec.fmt, axis=axis, rounding=spec.rounding, key=rkey, scale_rule=spec.scale_rule,
               tile_2d=spec.tile_2d, clip_fraction=spec.clip_fraction)
  return dequantize(q)


def _dot(a, b):
  return jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST)


def reference_dot_vjp(x, w, dy, route, key):
  """(y, dx, dw) of x [M, K] @ w [K, N] under `route`, straight from the formulas of docs/NUMERICS.md."""
  xq = _fake_quant(x, route.fprop_x, 1, key, "fprop_x", "fprop")
  wq = _fake_quant(w, route.fprop_w, 0, key, "fprop_w", "fprop")
  y = _dot(xq, wq)
  xs, ws = (xq, wq) if route.requantize_saved else (x, w)
  dx = _dot(_fake_quant(dy, route.dgrad_dy, 1, key, "dgrad_dy", "dgrad"),
            _fake_quant(ws, route.dgrad_w, 1, key, "dgrad_w", "dgrad").T)
  dw = _dot(_fake_quant(xs, route.wgrad_x, 0, key, "wgrad_x", "wgrad").T,
            _fake_quant(dy, route.wgrad_dy, 0, key, "wgrad_dy", "wgrad"))
  return y, dx, dw


def _data(m=M, k=K, n=N, dtype=jnp.float32, seed=0):
  kx, kw, kd, ks = jax.random.split(jax.random.key(seed), 4)
  rows = jnp.exp2(jax.random.uniform(ks, (m, 1), minval=-4, maxval=4))  # Rows over many binades.
  x = (jax.random.normal(kx, (m, k)) * rows).astype(dtype)
  w = (jax.random.normal(kw, (k, n)) * 0.1).astype(dtype)
  dy = jax.random.normal(kd, (m, n)).astype(dtype)
  return x, w, dy


def _vjp(route, x, w, dy, key=None, impl=None):
  impl = Impl(gemm=impl) if isinstance(impl, str) else impl
  y, f = jax.vjp(lambda x, w: fp4_dot(x, w, route=route, key=key, impl=impl), x, w)
  return (y, *f(dy))


def _close(actual, desired, tol=1e-5):
  desired = np.asarray(desired, np.float32)
  np.testing.assert_allclose(np.asarray(actual, np.float32), desired, rtol=1e-5,
                             atol=tol * np.abs(desired).max())


def test_bf16_route_is_exactly_jnp_dot():
  x, w, dy = _data(dtype=jnp.bfloat16)
  x3, dy3 = x.reshape(4, 32, K), dy.reshape(4, 32, N)
  got = jax.vjp(lambda x, w: fp4_dot(x, w, route="bf16"), x3, w)
  want = jax.vjp(jnp.dot, x3, w)
  got, want = (got[0], *got[1](dy3)), (want[0], *want[1](dy3))
  for g, e in zip(got, want):
    assert g.dtype == e.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(e, np.float32))


# Routes mixing high-precision and FP4 operands (one operand of a GEMM quantized: a plain float32 dot).
MIXED_ROUTES = {
    "weight_only": routes.Route("weight_only", fprop_w=routes.OperandSpec("mxfp4", tile_2d=True),
                                dgrad_w=routes.OperandSpec("mxfp4", tile_2d=True)),
    "fp4_wgrad_only": routes.Route("fp4_wgrad_only", wgrad_x=routes.OperandSpec("nvfp4", transform="h16"),
                                   wgrad_dy=routes.OperandSpec("nvfp4", rounding="sr", transform="h16")),
}


@pytest.mark.parametrize("name", FP4_ROUTES + list(MIXED_ROUTES))
def test_route_matches_formula_reference(name):
  route = MIXED_ROUTES.get(name) or routes.get(name)
  x, w, dy = _data()
  key = jax.random.key(42)
  y, dx, dw = _vjp(route, x.reshape(2, M // 2, K), w, dy.reshape(2, M // 2, N), key=key)
  ry, rdx, rdw = reference_dot_vjp(x, w, dy, route, key)
  # The fp8 route's E4M3 products lose bits in a GPU's FP8 tensor-core sums; MXFP4's E2M1 codes sum exactly there.
  tol = fp8_tolerance(1e-5) if name == "fp8" else 1e-5
  _close(y.reshape(M, N), ry, tol)
  _close(dx.reshape(M, K), rdx, tol)
  _close(dw, rdw, tol)
  # Not trivially equal to the exact products: the route did quantize.
  exact = [(y.reshape(M, N), _dot(x, w)), (dw, _dot(x.T, dy))]
  assert not all(np.allclose(a, b, rtol=1e-3) for a, b in exact)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_tile_2d_other_orientation_is_the_other_quantization(fmt):
  x, w, _ = _data()
  for axis in (0, 1):
    got = other_orientation(quantize(w, fmt, axis=axis, tile_2d=True))
    want = quantize(w, fmt, axis=1 - axis, tile_2d=True)
    assert (got.axis, got.shape) == (want.axis, want.shape)
    for g, e in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
      np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(e.astype(jnp.float32)))


def _named_calls(jaxpr, name):
  """How many calls of the jitted function `name` a jaxpr makes, nested calls included."""
  return sum(eqn.params.get("name") == name for eqn in equations(jaxpr))


@pytest.mark.parametrize("name, calls", [("bf16", 0), ("mxfp4", 3), ("mxfp4_sr", 4), ("nvfp4", 3)])
def test_forward_quantizes_w_once_with_2d_tiles(name, calls):
  """fprop X, fprop W, wgrad X: with 32x32 / 16x16 tiles dgrad reads the fprop W codes, no 4th quantize."""
  x, w, _ = _data()
  fwd = lambda x, w: jax.vjp(lambda x, w: fp4_dot(x, w, route=name, key=jax.random.key(0)), x, w)[0]
  assert _named_calls(jax.make_jaxpr(fwd)(x, w).jaxpr, "quantize") == calls


def _grads_over_keys(route, x, w, dy, n_keys):
  def one(k):
    return _vjp(route, x, w, dy, key=k)[1:]
  keys = jax.random.split(jax.random.key(1), n_keys)
  return jax.lax.map(one, keys, batch_size=256)


def _mse_of_mean(samples, target, bs):
  """Relative squared error of the mean of b samples, averaged over the disjoint groups of b."""
  s = np.asarray(samples, np.float64)
  t = np.asarray(target, np.float64)
  out = []
  for b in bs:
    means = s[: (len(s) // b) * b].reshape(-1, b, *s.shape[1:]).mean(1)
    out.append(((means - t) ** 2).sum(axis=tuple(range(1, s.ndim))).mean() / (t ** 2).sum())
  return np.array(out)


BS = 2 ** np.arange(9)  # 1 .. 256


def _slope(mse, bs=BS):
  return np.polyfit(np.log(bs), np.log(mse), 1)[0]


def _unbiased_targets(name, x, w, dy):
  """E[dX], E[dW] of the unbiased GEMMs of a route (None: that gradient is biased by design)."""
  deq = lambda v, fmt, axis, **kw: dequantize(quantize(v, fmt, axis=axis, **kw))
  targets = {
      "mxfp4_sr": (dy @ w.T, x.T @ dy),
      "nvfp4_sr": (dy @ w.T, x.T @ dy),
      # dgrad: SR dY times the deterministic 16x16 W codes. wgrad: RTN X after a random RHT16 (biased).
      "nvfp4": (dy @ deq(w, "nvfp4", 1, tile_2d=True).T, None),
      # Unbiased around the saved FP4 forward operands it re-quantizes.
      "quartet2": (dy @ deq(w, "nvfp4_46", 0).T, deq(x, "nvfp4_46", 1).T @ dy),
  }
  return targets[name]


# Log-log slope bounds of the error of the mean over B = 1..256 (unbiased: -1). NVFP4 SR aims block maxima at
# 6 * 16/17, so the E4M3-rounded scale never clips (measured -1.00 +- 0.01 for every route here; without the
# headroom NVFP4 measured -0.83..-0.88).
SLOPES = {"mxfp4_sr": (-1.1, -0.9), "quartet2": (-1.1, -0.9), "nvfp4_sr": (-1.1, -0.9), "nvfp4": (-1.1, -0.9)}


@pytest.mark.parametrize("name", list(SLOPES))
def test_stochastic_gradients_are_unbiased(name):
  x, w, dy = _data(seed=3)
  dx, dw = _grads_over_keys(name, x, w, dy, 1024)
  lo, hi = SLOPES[name]
  for samples, target in zip((dx, dw), _unbiased_targets(name, x, w, dy)):
    if target is None:
      continue
    mse = _mse_of_mean(samples, target, BS)
    assert lo < _slope(mse) < hi, (name, mse)


def test_rtn_weights_make_dgrad_error_plateau():
  """Hu's mxfp4: SR on dY is averaged away, the RTN W tiles are not: the error stops falling."""
  x, w, dy = _data(seed=3)
  dx, _ = _grads_over_keys("mxfp4", x, w, dy, 1024)
  mse = _mse_of_mean(dx, dy @ w.T, BS)
  assert _slope(mse[4:], BS[4:]) > -0.3, mse  # B = 16 .. 256.
  assert mse[-1] > 0.2 * mse[0]  # Unbiased would give mse[0] / 256.


def _residual_bytes(route, x, w):
  _, vjp_fn = jax.vjp(lambda x, w: fp4_dot(x, w, route=route, key=jax.random.key(0)), x, w)
  leaves = jax.tree_util.tree_leaves(vjp_fn)
  as_arrays = [jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a
               for a in leaves]
  return sum(a.size * a.dtype.itemsize for a in as_arrays)


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4", "quartet2"])
def test_residuals_are_fp4(name):
  x, w, _ = _data(dtype=jnp.bfloat16)
  fp4, bf16 = _residual_bytes(name, x, w), _residual_bytes("bf16", x, w)
  assert bf16 == x.nbytes + w.nbytes
  assert fp4 < 0.35 * bf16, (fp4, bf16)  # 4.25-4.5 bits per element plus a key, against 16 bits.


def test_jit_value_and_grad_and_remat_match_eager():
  x, w, _ = _data()
  key = jax.random.key(5)
  loss = lambda x, w, k: jnp.sum(fp4_dot(x, w, route="nvfp4", key=k) ** 2)
  eager = jax.value_and_grad(loss, argnums=(0, 1))(x, w, key)
  jitted = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w, key)
  remat = jax.jit(jax.value_and_grad(jax.checkpoint(loss), argnums=(0, 1)))(x, w, key)
  for a, b, c in zip(jax.tree_util.tree_leaves(eager), jax.tree_util.tree_leaves(jitted),
                     jax.tree_util.tree_leaves(remat)):
    _close(b, a)
    np.testing.assert_array_equal(b, c)


@pytest.mark.parametrize("route", ["mxfp4_rtn", "nvfp4"])
def test_second_derivative_of_a_quantized_route_is_an_error(route):
  """Differentiating fp4_dot's backward would differentiate its quantizers' rounding: zeros (MXFP4) or noise
  (NVFP4's per-tensor scale) where x W W^T is the answer. Each way in is refused; bf16 is a plain dot."""
  x, w = jnp.ones((4, 32)), jnp.ones((32, 16))
  key = jax.random.key(0)
  dx = lambda x, w, c=1.0: jax.grad(lambda x: jnp.sum(fp4_dot(x, w, route=route, key=key) ** 2 * c))(x)
  second = {"grad of grad (x)": lambda: jax.grad(lambda x: jnp.sum(dx(x, w)))(x),
            "grad of grad (w)": lambda: jax.grad(lambda w: jnp.sum(dx(x, w)))(w),
            "through dY only": lambda: jax.grad(lambda c: jnp.sum(dx(x, w, c)))(1.0),
            "jvp of grad": lambda: jax.jvp(lambda x: dx(x, w), (x,), (x,))}
  for what, f in second.items():
    with pytest.raises(TypeError, match=f"route '{route}' is differentiable once"):
      f()
      pytest.fail(what)
  bf16 = jax.grad(lambda x: jnp.sum(jax.grad(lambda x: jnp.sum(fp4_dot(x, w, route="bf16") ** 2))(x)))(x)
  np.testing.assert_array_equal(bf16, jnp.full((4, 32), 2 * 32 * 16.0))


def test_vmap_over_examples_equals_a_loop():
  x, w, dy = _data()
  xs, dys = x.reshape(2, 64, K), dy.reshape(2, 64, N)
  key = jax.random.key(9)
  f = lambda x, dy: _vjp("mxfp4_h32", x, w, dy, key=key)
  batched = jax.vmap(f)(xs, dys)
  for i in range(2):
    for b, e in zip(batched, f(xs[i], dys[i])):
      _close(b[i], e)


def test_dtypes_follow_inputs():
  x, w, dy = _data(dtype=jnp.bfloat16)
  y, dx, dw = _vjp("mxfp4_rtn", x, w.astype(jnp.float32), dy)
  assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)


def test_key_rules():
  x, w, _ = _data()
  with pytest.raises(ValueError, match="'nvfp4' draws random bits.*key="):
    fp4_dot(x, w, route="nvfp4")
  y1 = fp4_dot(x, w, route="mxfp4_rtn")
  y2 = fp4_dot(x, w, route="mxfp4_rtn", key=jax.random.key(3))
  np.testing.assert_array_equal(y1, y2)
  raw = jax.random.PRNGKey(3)  # Raw uint32[2] keys work as well.
  _, dx_raw, _ = _vjp("nvfp4", x, w, x @ w, key=raw)
  _, dx_typed, _ = _vjp("nvfp4", x, w, x @ w, key=jax.random.wrap_key_data(raw))
  np.testing.assert_array_equal(dx_raw, dx_typed)
  for impl in ("rbg", "unsafe_rbg"):  # Typed keys of any impl (rbg's data is uint32[4], not a raw threefry key).
    assert all(np.isfinite(a).all() for a in _vjp("nvfp4_sr", x, w, x @ w, key=jax.random.key(3, impl=impl)))


@pytest.mark.parametrize("shape_x, shape_w, match", [
    ((64, 64), (32, 64), r"x \[\.\.\., K\] and w \[K, N\]"),
    ((), (64, 64), r"x \[\.\.\., K\] and w \[K, N\]"),
    ((64, 64), (64,), r"x \[\.\.\., K\] and w \[K, N\]"),
])
def test_shape_errors(shape_x, shape_w, match):
  with pytest.raises(ValueError, match=match):
    fp4_dot(jnp.ones(shape_x), jnp.ones(shape_w), route="mxfp4", key=jax.random.key(0))


def test_input_type_errors():
  w = jnp.ones((64, 64))
  with pytest.raises(TypeError, match=r"x is a list \(wrap it in jnp.asarray\)"):
    fp4_dot([[1.0] * 64], w, route="mxfp4", key=jax.random.key(0))
  with pytest.raises(ValueError, match="floating-point arrays: w has dtype int32"):
    fp4_dot(jnp.ones((8, 64)), jnp.ones((64, 64), jnp.int32), route="mxfp4", key=jax.random.key(0))
  np_x = np.ones((32, 64), np.float32)  # NumPy arrays are arrays
  assert fp4_dot(np_x, w, route="mxfp4_rtn").shape == (32, 64)


def _padded_vjp(route, x, w, dy, key, mult):
  """(y, dx, dw) of fp4_dot on x, w explicitly zero-padded to multiples of `mult` (M, K, N), sliced back."""
  m, k = x.shape
  n = w.shape[1]
  mp, kp, np_ = (-(-d // q) * q for d, q in zip((m, k, n), mult))
  pad = lambda a, r, c: jnp.pad(a, ((0, r - a.shape[0]), (0, c - a.shape[1])))
  y, vjp = jax.vjp(lambda x, w: fp4_dot(x, w, route=route, key=key), pad(x, mp, kp), pad(w, kp, np_))
  dx, dw = vjp(pad(dy, mp, np_))
  return y[:m, :n], dx[:m, :k], dw[:k, :n]


@pytest.mark.parametrize("name, m, k, n", [(name, 48, 72, 64) for name in FP4_ROUTES] + [
    ("mxfp4", 1, 64, 40), ("quartet2", 1, 64, 40), ("nvfp4", 130, 96, 136)])
def test_any_shape_equals_explicit_zero_padding(name, m, k, n):
  """M, K, N that are not whole blocks (48 tokens, K=72, one token, ...): fp4_dot pads inside, forward and
  backward, and gives the bits of padding by hand."""
  route = routes.get(name)
  mult = dot_lib.padding_multiples(route)
  x, w, dy = _data(m, k, n, dtype=jnp.bfloat16)
  key = jax.random.key(5)
  got = jax.jit(lambda x, w, dy: _vjp(name, x, w, dy, key=key))(x, w, dy)
  want = jax.jit(lambda x, w, dy: _padded_vjp(route, x, w, dy, key, mult))(x, w, dy)
  for g, e in zip(got, want):
    assert (g.shape, g.dtype) == (e.shape, e.dtype)
    np.testing.assert_array_equal(g, e)
  assert np.all(np.isfinite(np.asarray(got[0], np.float32)))


def test_padding_multiples_by_route():
  assert dot_lib.padding_multiples(routes.get("bf16")) == (1, 1, 1)
  assert dot_lib.padding_multiples(routes.get("mxfp4")) == (32, 32, 32)  # blocks; W's 32x32 tiles
  assert dot_lib.padding_multiples(routes.get("nvfp4")) == (16, 16, 16)  # blocks, RHT16 on wgrad
  assert dot_lib.padding_multiples(routes.get("quartet2")) == (128, 16, 128)  # RHT128 + MS-EDEN on dY, X
  assert dot_lib.padding_multiples("quartet2") == (128, 16, 128)  # a name, as fp4_dot takes
  tiled_dy = routes.Route("tiled_dy", dgrad_dy=routes.OperandSpec("mxfp4", tile_2d=True),
                          dgrad_w=routes.OperandSpec("mxfp4"))
  assert dot_lib.padding_multiples(tiled_dy) == (32, 1, 32)  # dY's 32x32 tiles span M too


def test_zero_padding_is_exact():
  """Padding changes no quantized value: a deterministic forward on K=64 equals the same data padded to
  K=96 with zeros, to float32 summation order."""
  x, w, _ = _data(64, 64, 64)
  xp, wp = jnp.pad(x, ((0, 0), (0, 32))), jnp.pad(w, ((0, 32), (0, 0)))
  for name in ("mxfp4_rtn", "nvfp4"):
    key = jax.random.key(1)
    np.testing.assert_allclose(fp4_dot(xp, wp, route=name, key=key), fp4_dot(x, w, route=name, key=key),
                               rtol=1e-6, atol=0)


def test_vector_x_gives_a_vector():
  x, w, _ = _data(1, 64, 64)
  y = fp4_dot(x[0], w, route="quartet2", key=jax.random.key(0))
  assert y.shape == (64,)
  np.testing.assert_array_equal(y, fp4_dot(x, w, route="quartet2", key=jax.random.key(0))[0])


@pytest.mark.parametrize("shape_x, shape_w", [((2, 0, 64), (64, 32)), ((32, 0), (0, 32)), ((32, 64), (64, 0))])
@pytest.mark.parametrize("name", ["nvfp4", "quartet2"])
def test_empty_operands_give_the_empty_product(shape_x, shape_w, name):
  """Zero tokens (or K = 0, N = 0): the product of empty operands, zero gradients, as jnp.dot."""
  x, w = jnp.ones(shape_x, jnp.bfloat16), jnp.ones(shape_w)
  loss = lambda f: lambda x, w: jnp.sum(f(x, w).astype(jnp.float32))
  got = jax.value_and_grad(loss(lambda x, w: fp4_dot(x, w, route=name, key=jax.random.key(0))),
                           argnums=(0, 1))(x, w)
  want = jax.value_and_grad(loss(lambda x, w: jnp.dot(x, w).astype(x.dtype)), argnums=(0, 1))(x, w)
  for g, e in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    assert (g.shape, g.dtype) == (e.shape, e.dtype)
    np.testing.assert_array_equal(g, e)


def test_impl_choices_and_errors(cpu_backend):
  x, w, _ = _data()
  with pytest.raises(ValueError, match="unknown GEMM backend 'nope'.*emulated"):
    Impl(gemm="nope")
  with pytest.raises(ValueError, match="unknown quantizer implementation 'cuda'"):
    Impl(quantizer="cuda")
  with pytest.raises(TypeError, match="impl= takes an fp4jax.Impl"):
    fp4_dot(x, w, route="mxfp4_rtn", impl="emulated")
  with pytest.raises(ValueError, match="compiles the Pallas kernels for a GPU"):
    fp4_dot(x, w, route="mxfp4_rtn", impl=Impl(quantizer="pallas"))
  _close(fp4_dot(x, w, route="mxfp4_rtn", impl=Impl(gemm="emulated")), fp4_dot(x, w, route="mxfp4_rtn"))
  with pytest.raises(ValueError, match="GEMM backend 'native' does not support"):
    fp4_dot(x, w, route=routes.Route("mx_nv", fprop_x=routes.OperandSpec("mxfp4"),
                                     fprop_w=routes.OperandSpec("nvfp4")), impl=Impl(gemm="native"))
  with pytest.raises(ValueError, match="token_axes takes 'auto' or a tuple of mesh-axis names"):
    Impl(token_axes="data")
  with pytest.raises(ValueError, match="token_axes names an axis twice"):
    Impl(token_axes=("data", "data"))
  with jax.set_mesh(jax.make_mesh((1,), ("data",))):  # a misspelt axis would quietly gather the kernels' inputs
    with pytest.raises(ValueError, match=r"token_axes \['dta'\] are no axes of the mesh in context"):
      fp4_dot(x, w, route="mxfp4_rtn", impl=Impl(token_axes=("dta",)))


@pytest.mark.parametrize("key", [0, jnp.zeros(2), jnp.zeros(2, jnp.int32), jax.random.split(jax.random.key(0)),
                                 jnp.zeros(4, jnp.uint32), jnp.zeros(1, jnp.uint32), jnp.zeros(3, jnp.uint32),
                                 jax.random.split(jax.random.PRNGKey(0))],
                         ids=["int", "float32", "int32", "batch_of_keys", "raw_uint32_4", "raw_uint32_1",
                              "raw_uint32_3", "batch_of_raw_keys"])
def test_bad_key_fails_at_the_call(key):
  """The forward of the SR routes reads no key (RNE); a bad key must fail at the call, not in the backward (a raw
  key of the wrong length used to pass and fail in jax.grad with JAX's "invalid PRNG key data")."""
  x, w, _ = _data()
  with pytest.raises(ValueError, match="fp4_dot needs a key: one JAX PRNG key.*dtype="):
    fp4_dot(x, w, route="nvfp4_sr", key=key)


@pytest.mark.parametrize("route", ["bf16", "mxfp4_rtn"])
@pytest.mark.parametrize("out_dtype", [jnp.int32, jnp.uint8, jnp.bool_, "int8", "fp32", 3, jnp.complex64,
                                       jnp.float8_e4m3fn],
                         ids=["int32", "uint8", "bool", "int8_str", "fp32_str", "int", "complex64", "float8"])
def test_out_dtype_errors(out_dtype, route):
  """out_dtype takes floating-point dtypes of 16 bits or more: an integer one used to truncate the float32
  accumulator silently, a float8 one to turn values past its range into NaN, a bogus name to fail with numpy's
  "data type not understood"."""
  x, w, _ = _data()
  with pytest.raises(ValueError, match="fp4_dot's out_dtype= takes a floating-point dtype of 16 bits"):
    fp4_dot(x, w, route=route, out_dtype=out_dtype)


@pytest.mark.skipif(jax.config.jax_enable_x64, reason="float64 is float64 with jax_enable_x64")
def test_numpy_float64_inputs_are_held_as_jax_holds_them():
  """NumPy float64 operands run as the float32 arrays JAX makes of them, with no truncation warning from inside
  fp4_dot, and give the float32 call's result and dtype."""
  x, w, _ = _data()
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for route in ("bf16", "mxfp4_rtn"):
      y = fp4_dot(x64, w64, route=route)
      assert y.dtype == jnp.float32
      np.testing.assert_array_equal(y, fp4_dot(jnp.asarray(x64), jnp.asarray(w64), route=route))


@pytest.mark.skipif(jax.config.jax_enable_x64, reason="float64 is a valid out_dtype with jax_enable_x64")
def test_out_dtype_float64_needs_x64():
  """Without jax_enable_x64 JAX would truncate a float64 result to float32 (with a warning)."""
  x, w, _ = _data()
  with pytest.raises(ValueError, match="out_dtype=float64 needs jax_enable_x64"):
    fp4_dot(x, w, route="mxfp4_rtn", out_dtype=jnp.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mxfp4", "nvfp4"])
def test_default_gpu_backend_equals_emulated(name):
  x, w, dy = _data()
  key = jax.random.key(0)
  for got, want in zip(_vjp(name, x, w, dy, key=key), _vjp(name, x, w, dy, key=key, impl="emulated")):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(jnp.abs(want).max()))


_SHARDED = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from fp4jax.dot import fp4_dot
mesh = Mesh(np.array(jax.devices()), ("data",))
x = jax.random.normal(jax.random.key(0), (4, 32, 64))
w = jax.random.normal(jax.random.key(1), (64, 128))
loss = lambda x, w, k: jnp.sum(jnp.sin(fp4_dot(x, w, route="nvfp4", key=k)))
f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
key = jax.random.key(2)
want = f(x, w, key)
xs = jax.device_put(x, NamedSharding(mesh, P("data")))
ws = jax.device_put(w, NamedSharding(mesh, P(None, "data")))
got = f(xs, ws, key)
assert len(got[1][0].sharding.device_set) == 2
for g, e in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
  np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5 * float(jnp.abs(e).max()))
"""


def _run_on_2_cpu_devices(script):
  cpu_devices.run(script, 2)


def test_sharded_jit_matches_unsharded():
  """Data-parallel x and column-sharded w over 2 CPU devices give the unsharded numbers: the NVFP4 tensor
  amax and the SR counters are global."""
  _run_on_2_cpu_devices(_SHARDED)


_SHARD_MAP = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from fp4jax.dot import fp4_dot
mesh = jax.make_mesh((2,), ("x",))
x = jax.random.normal(jax.random.key(0), (2, 32, 64))
w = jax.random.normal(jax.random.key(1), (64, 32))
key = jax.random.key(2)
local = lambda x, w: fp4_dot(x, w, route="nvfp4", key=key)
loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))
# (x spec, w spec, out spec, the same per-shard computation as a vmap over the shards)
split_n = lambda f: lambda x, w: jnp.concatenate(jax.vmap(f, (None, 1), 0)(x, w.reshape(64, 2, 16)), axis=-1)
cases = [
    (P("x"), P(), P("x"), lambda f: jax.vmap(f, (0, None))),  # data parallel: dW summed over the shards
    (P(), P(None, "x"), P(None, None, "x"), split_n),  # column-parallel w: dX summed over the shards
]
for xs, ws, ys, per_shard in cases:
  f = jax.shard_map(local, mesh=mesh, in_specs=(xs, ws), out_specs=ys)
  args = jax.device_put(x, NamedSharding(mesh, xs)), jax.device_put(w, NamedSharding(mesh, ws))
  got = jax.jit(jax.value_and_grad(loss(f), argnums=(0, 1)))(*args)
  # Each device quantizes its own shard (the NVFP4 tensor amax is per shard), as vmap does per example.
  want = jax.jit(jax.value_and_grad(loss(per_shard(local)), argnums=(0, 1)))(x, w)
  for g, e in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5 * float(jnp.abs(e).max()))
"""


_EXPLICIT = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from fp4jax.dot import fp4_dot
mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
x = jax.random.normal(jax.random.key(0), (4, 32, 64), jnp.bfloat16)
w = jax.random.normal(jax.random.key(1), (64, 96), jnp.bfloat16)
key = jax.random.key(2)
for route in ("mxfp4", "nvfp4", "quartet2", "fp8"):
  loss = lambda x, w: jnp.sum(jnp.sin(fp4_dot(x, w, route=route, key=key).astype(jnp.float32)))
  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  want = f(x, w)
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    got = f(xs, w)
    assert jax.typeof(got[1][0]).sharding.spec[0] == "data", jax.typeof(got[1][0]).sharding
    # FSDP's layout: one axis splits both the batch and w's N (the output keeps it on the batch only)
    again = f(xs, jax.device_put(w, NamedSharding(mesh, P(None, "data"))))
  for g, e in zip(jax.tree_util.tree_leaves(again), jax.tree_util.tree_leaves(got)):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(e, np.float32), rtol=1e-2,
                               atol=1e-2 * float(jnp.abs(e.astype(jnp.float32)).max()), err_msg=route)
  # dW: two bf16 partial sums added (the device split of the tokens) where one device rounds once.
  for g, e, tol in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), (1e-5, 1e-5, 1e-2)):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(e, np.float32), rtol=tol,
                               atol=tol * float(jnp.abs(e.astype(jnp.float32)).max()), err_msg=route)
"""


def test_explicit_axes_mesh_gives_the_unsharded_numbers():
  """Under a mesh of Explicit axes (`jax.make_mesh`'s default), x split along its batch: the unsharded numbers,
  and dX keeps x's sharding (every quantized route used to fail in the quantizers' table lookups or in the
  wgrad GEMM's contraction over the split tokens)."""
  _run_on_2_cpu_devices(_EXPLICIT)


def test_shard_map_value_and_grad_matches_vmap_over_shards():
  """Inside jax.shard_map, with one operand replicated (its gradient summed over the shards), under jit and
  value_and_grad: the numbers of fp4_dot run on each shard (a vmap over the shards, itself equal to a loop:
  test_vmap_over_examples_equals_a_loop)."""
  _run_on_2_cpu_devices(_SHARD_MAP)


_SHARD_MAP_KERNELS = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
from fp4jax import Impl
from fp4jax.dot import fp4_dot
mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
x = jax.random.normal(jax.random.key(0), (64, 64), jnp.bfloat16)
w = jax.random.normal(jax.random.key(1), (64, 32), jnp.bfloat16)
for route in ("mxfp4", "nvfp4", "quartet2"):
  out = {}
  for q in ("interpret", "xla"):
    local = lambda x, w, q=q: fp4_dot(x, w, route=route, key=jax.random.key(2), impl=Impl(quantizer=q))
    f = jax.shard_map(local, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))
    loss = lambda x, w: jnp.sum(jnp.sin(f(x, w).astype(jnp.float32)))
    out[q] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)
  for a, b in zip(jax.tree.leaves(out["interpret"]), jax.tree.leaves(out["xla"])):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=route)
"""


def test_shard_map_with_the_kernels_in_interpret_mode():
  """Inside jax.shard_map (its varying-axes check on), Impl(quantizer="interpret") gives the XLA quantizers'
  numbers: interpret mode declines there and XLA's quantizers take over (every FP4 route used to fail on the
  kernels' outputs, which declared no varying axes)."""
  _run_on_2_cpu_devices(_SHARD_MAP_KERNELS)


@pytest.mark.parametrize("route", ["mxfp4", "nvfp4", "quartet2"])
def test_shard_map_lowers_with_the_kernels_for_an_h200(route):
  """On a GPU inside jax.shard_map the Pallas kernels run: their outputs vary over the mesh axes their inputs
  vary over, so fp4_dot's forward and backward lower for an H200 with the kernels in the program."""
  mesh = AbstractMesh((2,), ("data",), axis_types=(AxisType.Auto,),
                      abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))
  loss = lambda x, w: jnp.sum(fp4_dot(x, w, route=route, key=jax.random.key(0),
                                      impl=Impl(quantizer="pallas")).astype(jnp.float32))
  f = jax.shard_map(jax.grad(loss, (0, 1)), mesh=mesh, in_specs=(P("data"), P()), out_specs=(P("data"), P()))
  x, w = jax.ShapeDtypeStruct((128, 128), jnp.bfloat16), jax.ShapeDtypeStruct((128, 256), jnp.bfloat16)
  with use_abstract_mesh(mesh):
    text = jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("triton") >= 3, route  # X's, W's and dY's quantizers at least


def _dot_operand_dtypes(jaxpr) -> list[tuple[str, str]]:
  """(lhs dtype, rhs dtype) of every dot_general in a jaxpr, nested calls included."""
  return [tuple(str(v.aval.dtype) for v in eqn.invars) for eqn in equations(jaxpr)
          if eqn.primitive.name == "dot_general"]


def test_bf16_route_float32_out_backward_is_bf16_gemms():
  """A bf16 route with float32 out (logits): the backward GEMMs read the cotangent rounded to bf16, as a bf16
  output's would be, instead of a float32 x float32 GEMM (TF32 on Hopper, slow); the numbers are the
  plain dots' on that rounded cotangent."""
  kx, kw, kg = jax.random.split(jax.random.key(5), 3)
  x = jax.random.normal(kx, (2, 24, 64), jnp.bfloat16)
  w = jax.random.normal(kw, (64, 40), jnp.bfloat16)
  g = jax.random.normal(kg, (2, 24, 40), jnp.float32)
  f = lambda x, w: fp4_dot(x, w, route="bf16", out_dtype=jnp.float32)
  y, vjp = jax.vjp(f, x, w)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(jnp.dot(x, w, preferred_element_type=jnp.float32)))
  dx, dw = vjp(g)
  g16 = g.astype(jnp.bfloat16)
  np.testing.assert_array_equal(
      np.asarray(dx, np.float32),
      np.asarray(jnp.dot(g16, w.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16), np.float32))
  np.testing.assert_array_equal(
      np.asarray(dw, np.float32),
      np.asarray(jnp.einsum("btk,btn->kn", x, g16, preferred_element_type=jnp.float32).astype(jnp.bfloat16),
                 np.float32))
  loss = lambda x, w: jnp.sum(f(x, w) ** 2)
  dots = _dot_operand_dtypes(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w).jaxpr)
  assert len(dots) == 3 and all(d == ("bfloat16", "bfloat16") for d in dots), dots


@pytest.mark.parametrize("x_dtype,w_dtype,out_dtype", [
    (jnp.bfloat16, jnp.float32, jnp.bfloat16),  # x's own dtype, passed: the default's bits
    (jnp.float32, jnp.float32, jnp.bfloat16),
    (jnp.bfloat16, jnp.bfloat16, jnp.float16),
    (jnp.float16, jnp.float16, jnp.bfloat16)])
def test_bf16_route_rounds_the_float32_accumulator_once_to_out_dtype(x_dtype, w_dtype, out_dtype):
  """Any out_dtype is the float32 accumulator rounded once, as for the FP4 routes. `preferred_element_type=
  out_dtype` had XLA round the operands to out_dtype first: passing x's own dtype changed 1683 of 4096 outputs."""
  kx, kw = jax.random.split(jax.random.key(11))
  x = jax.random.normal(kx, (16, 1024), x_dtype)
  w = jax.random.normal(kw, (1024, 64), w_dtype)
  want = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(out_dtype)
  got = fp4_dot(x, w, route="bf16", out_dtype=out_dtype)
  assert got.dtype == out_dtype
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_bf16_route_float16_operands_keep_a_wide_cotangent():
  """float16 operands with float32 out: the backward reads the cotangent in float32, not rounded to float16,
  where a cotangent past 65504 became inf and the gradients inf and NaN (a plain dot's are finite)."""
  kx, kw = jax.random.split(jax.random.key(0))
  x = (jax.random.normal(kx, (4, 32)) * 1e-3).astype(jnp.float16)
  w = (jax.random.normal(kw, (32, 8)) * 1e-3).astype(jnp.float16)
  c = jnp.zeros((4, 8), jnp.float32).at[:, 0].set(1e5)
  grads = lambda f: jax.grad(lambda x, w: jnp.sum(f(x, w) * c), argnums=(0, 1))(x, w)
  got = grads(lambda x, w: fp4_dot(x, w, route="bf16", out_dtype=jnp.float32))
  want = grads(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))
  for g, ww in zip(got, want):
    assert g.dtype == jnp.float16 and np.isfinite(np.asarray(g, np.float32)).all()
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(ww, np.float32), rtol=2e-3)


@pytest.mark.parametrize("route", ["bf16", "mxfp4_rtn"])
def test_float8_operands_need_an_out_dtype(route):
  """The result defaults to x's dtype, and a float8 result turns values past its range into NaN (all 32 of a
  product of E4M3 operands did), as `out_dtype=float8` would and is refused for."""
  x = jnp.full((4, 64), 16.0, jnp.float8_e4m3fn)
  w = jnp.full((64, 8), 16.0, jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match="x's dtype, float8_e4m3fn.*pass out_dtype="):
    fp4_dot(x, w, route=route)
  y = fp4_dot(x, w, route=route, out_dtype=jnp.bfloat16)
  assert y.dtype == jnp.bfloat16 and np.isfinite(np.asarray(y, np.float32)).all()


@pytest.mark.parametrize("route", ["bf16", "mxfp4", "nvfp4"])
def test_out_dtype_float32_is_the_accumulator_and_keeps_grad_dtypes(route):
  """out_dtype=float32 returns the unrounded float32 result (rounding it gives the default bf16 output);
  gradients keep the bf16 dtypes of x and w."""
  kx, kw, kk = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(kx, (64, 64), jnp.bfloat16)
  w = jax.random.normal(kw, (64, 32), jnp.bfloat16)
  y32 = fp4_dot(x, w, route=route, key=kk, out_dtype=jnp.float32)
  y16 = fp4_dot(x, w, route=route, key=kk)
  assert y32.dtype == jnp.float32 and y16.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(y32.astype(jnp.bfloat16), np.float32), np.asarray(y16, np.float32))
  assert not np.array_equal(np.asarray(y32), np.asarray(y16, np.float32))  # really float32, not widened bf16
  loss = lambda x, w: jnp.sum(fp4_dot(x, w, route=route, key=kk, out_dtype=jnp.float32) ** 2)
  dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
  assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16


@pytest.mark.parametrize("gemm", ["auto", "fp8"])
@pytest.mark.parametrize("name", ["nvfp4", "quartet2"])
def test_huge_finite_cotangent_gives_finite_gradients(name, gemm):
  """dY entries near float32 max (apart, so that no Hadamard block sums past it) give finite gradients where the
  exact ones are finite: under nvfp4 the SR-quantized dY's top codes once decoded to inf, making dX inf and NaN;
  and the fp8 backend's GEMM (Hopper's, also run on a CPU) once multiplied its sum by dY's huge outer factor
  before W's tiny one, which overflowed (`ieee.mul_scales`)."""
  kx, kw, kd = jax.random.split(jax.random.key(0), 3)
  x, w = jax.random.normal(kx, (M, K)) * 1e-3, jax.random.normal(kw, (K, N)) * 1e-3
  dy = jax.random.normal(kd, (M, N)).at[3, 5].set(3.3e38).at[40, 20].set(-3.3e38)
  dy = dy.at[41, 30].set(np.finfo(np.float32).max)
  _, dx, dw = _vjp(name, x, w, dy, key=jax.random.key(1), impl=Impl(gemm=gemm))
  d64 = np.asarray(dy, np.float64)
  for got, exact in ((dx, d64 @ np.asarray(w, np.float64).T), (dw, np.asarray(x, np.float64).T @ d64)):
    got = np.asarray(got, np.float64)
    assert np.isfinite(exact).all() and np.isfinite(got).all()
    assert np.abs(got - exact).max() < 0.5 * np.abs(exact).max()
