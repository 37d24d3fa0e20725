"""Shared pytest set-up: CPU by default, float32 matmuls at full precision, GPU tests skipped without a GPU, and
the apps' XLA flags (set before the first backend starts, as `python -m train` and `python -m bench` do)."""

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
