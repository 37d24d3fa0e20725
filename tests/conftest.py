"""Shared pytest set-up: CPU by default, float32 matmuls at full precision, GPU tests skipped without a GPU."""

import jax
import pytest

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
