"""Shared pytest set-up: float32 matmuls at full precision, GPU tests skipped without a GPU, the apps' XLA flags
(set before the first backend starts, as `python -m train` and `python -m bench` do), and the `cpu_backend`
fixture for tests of what fp4jax does off a GPU."""

import jax
import pytest

from fp4jax import platform

platform.set_xla_flags()
jax.config.update("jax_default_matmul_precision", "highest")


def _has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
  if HAS_GPU:
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture
def cpu_backend(monkeypatch):
  """`jax.default_backend()` reads "cpu" in the test, on any host: fp4jax's choices and refusals off a GPU (the
  quantizers, attention, GEMM backends and their errors) are what it tests. Arrays still live on the host's
  devices."""
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
