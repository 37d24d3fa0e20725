"""fp4_dot with the fused Pallas quantizer (interpret mode) gives the reference quantizer's numbers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax import dot
from fp4jax.kernels import quantize_fused


def _value_and_grads(route, x, w, key):
  f = lambda x, w: jnp.sum(dot.fp4_dot(x, w, route=route, key=key).astype(jnp.float32) ** 2)
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, w)


@pytest.mark.parametrize("route", ["mxfp4", "mxfp4_sr"])
def test_fused_quantizer_matches_reference_in_fp4_dot(route, monkeypatch):
  kx, kw, kk = jax.random.split(jax.random.key(7), 3)
  x = jax.random.normal(kx, (64, 64), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(kw, (64, 32), jnp.float32) * 0.1).astype(jnp.bfloat16)
  monkeypatch.setattr(dot, "FUSED_QUANTIZER", "off")
  ref = _value_and_grads(route, x, w, kk)
  monkeypatch.setattr(dot, "FUSED_QUANTIZER", "interpret")
  out = _value_and_grads(route, x, w, kk)
  for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(out)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_fused_quantizer_is_used_and_shared_between_views(monkeypatch):
  """X along K (fprop) and along M (wgrad) come from ONE fused pass; W (32x32 tiles) from another."""
  monkeypatch.setattr(dot, "FUSED_QUANTIZER", "interpret")
  calls = []
  real = quantize_fused.quantize_dual
  monkeypatch.setattr(quantize_fused, "quantize_dual", lambda *a, **k: calls.append(k) or real(*a, **k))
  x = jnp.ones((64, 64), jnp.bfloat16)
  w = jnp.ones((64, 32), jnp.bfloat16)
  jax.make_jaxpr(lambda x, w: jax.vjp(lambda x, w: dot.fp4_dot(x, w, route="mxfp4_rtn"), x, w)[0])(x, w)
  assert [c["tile_2d"] for c in calls] == [False, True]
