"""fp4_dot with the fused Pallas quantizer (interpret mode) gives the reference quantizer's numbers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax import dot
from fp4jax.hadamard import hadamard as dot_hadamard
from fp4jax.kernels import quantize_fused


def _pallas_launches(jaxpr) -> int:
  """pallas_call equations in a jaxpr, counting each call of a shared sub-jaxpr (printed once) every time."""
  n = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      n += 1
      continue
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
        if hasattr(sub, "eqns"):
          n += _pallas_launches(sub)
  return n


def _value_and_grads(route, x, w, key):
  f = lambda x, w: jnp.sum(dot.fp4_dot(x, w, route=route, key=key).astype(jnp.float32) ** 2)
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, w)


@pytest.mark.parametrize("route", ["mxfp4", "mxfp4_sr", "mxfp4_h32", "nvfp4", "nvfp4_tile_local"])
def test_fused_quantizer_matches_reference_in_fp4_dot(route, monkeypatch):
  kx, kw, kk = jax.random.split(jax.random.key(7), 3)
  x = jax.random.normal(kx, (64, 64), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(kw, (64, 32), jnp.float32) * 0.1).astype(jnp.bfloat16)
  monkeypatch.setattr(dot, "FUSED_QUANTIZER", "xla")
  ref = _value_and_grads(route, x, w, kk)
  monkeypatch.setattr(dot, "FUSED_QUANTIZER", "interpret")
  out = _value_and_grads(route, x, w, kk)
  for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(out)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_fused_eden_matches_reference_in_fp4_dot(monkeypatch):
  """quartet2: MS-EDEN kernels for dY's two views and the requantized X^ (float32 input) and W^."""
  kx, kw, kk = jax.random.split(jax.random.key(8), 3)
  x = jax.random.normal(kx, (256, 128), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(kw, (128, 128), jnp.float32) * 0.1).astype(jnp.bfloat16)
  monkeypatch.setattr(dot, "FUSED_QUANTIZER", "xla")
  ref = _value_and_grads("quartet2", x, w, kk)
  monkeypatch.setattr(dot, "FUSED_QUANTIZER", "interpret")
  out = _value_and_grads("quartet2", x, w, kk)
  for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(out)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_fused_quantizer_is_used_and_shared_between_views(monkeypatch):
  """X along K (fprop) and along M (wgrad, H32) come from ONE fused pass, dY along N (dgrad, SR) and along M
  (wgrad, H32) from another; W (32x32 tiles, read by fprop and dgrad) from a third."""
  monkeypatch.setattr(dot, "FUSED_QUANTIZER", "interpret")
  calls = []
  for name in ("quantize_dual", "quantize_views"):
    real = getattr(quantize_fused, name)
    monkeypatch.setattr(quantize_fused, name,
                        lambda *a, real=real, name=name, **k: calls.append((name, a[1:], k)) or real(*a, **k))
  x = jnp.ones((64, 64), jnp.bfloat16)
  w = jnp.ones((64, 32), jnp.bfloat16)
  key = jax.random.key(0)
  jaxpr = jax.make_jaxpr(lambda x, w: jax.vjp(
      lambda x, w: dot.fp4_dot(x, w, route="mxfp4_h32", key=key), x, w)[1](jnp.ones((64, 32), jnp.bfloat16)))(x, w)
  assert _pallas_launches(jaxpr.jaxpr) == 3  # one kernel launch per array: X, W, dY
  summary = [(name, tuple((v.rounding, v.transform) for v in args if name == "quantize_views"),
              k.get("tile_2d", False)) for name, args, k in calls]
  assert summary == [
      ("quantize_views", (("rne", None), ("rne", "h32")), False),  # X: fprop + wgrad
      ("quantize_views", (("rne", None), ("rne", None)), True),  # W: 32x32 tiles
      ("quantize_views", (("sr", None), ("rne", "h32")), False),  # dY: dgrad + wgrad
  ]


# Fused launches in one fp4_dot forward + backward: one per array read where a kernel covers its recipes.
LAUNCHES = {
    "mxfp4": 3,  # X (fprop + wgrad), W (32x32 tiles), dY (SR dgrad + RNE wgrad)
    "nvfp4_tile_local": 3,  # X, W (dgrad + fprop views), dY (SR + RNE)
    "nvfp4": 5,  # X (fprop + RHT16 wgrad), W (16x16 tiles), dY (SR dgrad + SR RHT16 wgrad); the two RHT16
    # views' rotated amax passes
    "quartet2": 8,  # 4/6 forward in XLA; MS-EDEN X^, W^ and dY's two views: rotated amax + quantizer each
}


@pytest.mark.parametrize("route", sorted(LAUNCHES))
def test_fused_launches_per_route(route, monkeypatch):
  monkeypatch.setattr(dot, "FUSED_QUANTIZER", "interpret")
  x = w = g = jnp.ones((128, 128), jnp.bfloat16)  # quartet2's RHT128 needs multiples of 128
  key = jax.random.key(0)
  jaxpr = jax.make_jaxpr(lambda x, w: jax.vjp(
      lambda x, w: dot.fp4_dot(x, w, route=route, key=key), x, w)[1](g))(x, w)
  assert _pallas_launches(jaxpr.jaxpr) == LAUNCHES[route]


@pytest.mark.parametrize("mode", ["gpu", "xla"])
def test_gpu_mode_uses_every_kernel_and_off_none(mode, monkeypatch):
  """On a GPU backend ("gpu", the default) every covered route quantizes through the kernels, Hadamard views
  included; "xla" leaves all of it to XLA (traced with the backend reported as "gpu"; nothing is compiled)."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  xla_hadamards = []
  monkeypatch.setattr(dot, "hadamard", lambda *a, **k: xla_hadamards.append(k) or dot_hadamard(*a, **k))
  x = w = g = jnp.ones((128, 128), jnp.bfloat16)
  key = jax.random.key(0)
  trace = lambda route: jax.make_jaxpr(lambda x, w: jax.vjp(
      lambda x, w: dot.fp4_dot(x, w, route=route, key=key), x, w)[1](g))(x, w).jaxpr
  routes = ("nvfp4_tile_local", "mxfp4_h32", "nvfp4", "quartet2")
  with dot.fused_quantizer(mode):
    launches = {route: _pallas_launches(trace(route)) for route in routes}
  assert launches == {route: LAUNCHES.get(route, 3) if mode == "gpu" else 0 for route in routes}
  # In XLA: X's and dY's wgrad views (H32, RHT16), quartet2's four RHT128 operands.
  assert len(xla_hadamards) == (0 if mode == "gpu" else 8)


def test_fused_quantizer_mode_is_checked():
  with pytest.raises(ValueError, match="fused quantizer mode 'on'"):
    with dot.fused_quantizer("on"):
      pass


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["mxfp4", "mxfp4_h32", "nvfp4", "nvfp4_tile_local", "quartet2"])
def test_gpu_fused_paths_match_reference_in_fp4_dot(route):
  """Compiled on the GPU: the output and both input gradients equal those of the XLA reference quantizers
  ("xla") bit for bit (same operand bits, same GEMMs), and the kernels did run."""
  kx, kw, kd, kk = jax.random.split(jax.random.key(17), 4)
  x = jax.random.normal(kx, (1024, 512), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(kw, (512, 768), jnp.float32) * 0.05).astype(jnp.bfloat16)
  dy = jax.random.normal(kd, (1024, 768), jnp.float32).astype(jnp.bfloat16)

  def fwd_bwd(x, w, dy):  # a new function per mode below: jit caches traces by the function object
    y, vjp = jax.vjp(lambda x, w: dot.fp4_dot(x, w, route=route, key=kk), x, w)
    return y, *vjp(dy)

  with dot.fused_quantizer("xla"):
    ref = jax.jit(lambda *a: fwd_bwd(*a))(x, w, dy)
  with dot.fused_quantizer("gpu"):
    assert _pallas_launches(jax.make_jaxpr(lambda *a: fwd_bwd(*a))(x, w, dy).jaxpr) == LAUNCHES.get(route, 3)
    out = jax.jit(lambda *a: fwd_bwd(*a))(x, w, dy)
  for a, b in zip(ref, out):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_backward_keeps_the_mode_of_the_call(monkeypatch):
  """The vjp applied after leaving `fused_quantizer` still quantizes dY in the mode fp4_dot was called in."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  x = w = g = jnp.ones((128, 128), jnp.bfloat16)
  key = jax.random.key(0)

  def trace(x, w, g):
    with dot.fused_quantizer("xla"):
      _, vjp = jax.vjp(lambda x, w: dot.fp4_dot(x, w, route="mxfp4", key=key), x, w)
    return vjp(g)  # back in the default "gpu" mode

  assert _pallas_launches(jax.make_jaxpr(trace)(x, w, g).jaxpr) == 0
