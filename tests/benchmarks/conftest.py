import jax
import pytest


@pytest.fixture(autouse=True)
def _private_compilation_cache(monkeypatch, tmp_path):
  """`python -m bench` turns on JAX's persistent cache (default ~/.cache/fp4jax/jax): here in a temporary
  directory, and off again after each test, so tests neither share nor keep entries."""
  monkeypatch.setenv("FP4JAX_CACHE", str(tmp_path / "jax-cache"))
  yield
  jax.config.update("jax_compilation_cache_dir", None)
