"""Shared pytest set-up: float32 matmuls at full precision, GPU tests skipped without a GPU, the apps' XLA flags
(set before the first backend starts, as `python -m train` and `python -m bench` do) and, on a GPU, run-to-run
determinism; the `cpu_backend` fixture for tests of what fp4jax does off a GPU."""

import jax
import pytest

from fp4jax import platform

# XLA:GPU sums a scatter-add (the embedding's gradient) in the order its atomic adds land unless told otherwise:
# the last bits of a step then vary from run to run, and the tests that compare runs bit for bit (a resumed run
# against an uninterrupted one, scanned layers against unrolled ones) would fail by chance. XLA:CPU ignores it.
platform.set_xla_flags((*platform.DEFAULT_XLA_FLAGS, "--xla_gpu_deterministic_ops=true"))
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
