"""Fixtures of the kernel tests."""

import jax
import jax.numpy as jnp
import pytest


@pytest.fixture
def triton_modules(monkeypatch):
  """lower(fn, shape) -> the Triton IR text of every Pallas kernel in `fn` applied to a bf16 array of `shape`,
  lowered on CPU for an abstract H200 (no GPU needed)."""
  from jax._src.pallas.triton import pallas_call_registration as registration  # pylint: disable=g-direct-jax-src
  from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
  real = registration.lowering.lower_jaxpr_to_triton_module

  def lower(fn, shape):
    modules = []

    def spy(*args, **kwargs):
      result = real(*args, **kwargs)
      modules.append(str(result.module.operation))
      return result

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", spy)
    mesh = AbstractMesh((1,), ("d",), abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))
    with use_abstract_mesh(mesh):
      jax.jit(fn).trace(jax.ShapeDtypeStruct(shape, jnp.bfloat16)).lower(lowering_platforms=("cuda",))
    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", real)
    return modules

  return lower
