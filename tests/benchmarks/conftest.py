import pytest

from fp4jax import platform


@pytest.fixture(autouse=True)
def _private_compilation_cache(monkeypatch, tmp_path):
  """`python -m bench` turns on JAX's persistent cache (default ~/.cache/fp4jax/jax): here in a temporary
  directory, and off again after each test, so tests neither share nor keep entries."""
  monkeypatch.setenv("FP4JAX_CACHE", str(tmp_path / "jax-cache"))
  yield
  platform.enable_compilation_cache(None)
