import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache


@pytest.fixture(autouse=True)
def _private_compilation_cache(monkeypatch, tmp_path):
  """`python -m bench` turns on JAX's persistent cache (default ~/.cache/fp4jax/jax): here in a temporary
  directory, and off again after each test, so tests neither share nor keep entries. JAX opens the cache
  directory once per process, at the first compile that finds one set: `reset_cache` lets the next test's
  directory take effect (without it a test that checks its own directory fails after any earlier test that
  compiled with another one in the same worker)."""
  monkeypatch.setenv("FP4JAX_CACHE", str(tmp_path / "jax-cache"))
  yield
  jax.config.update("jax_compilation_cache_dir", None)
  compilation_cache.reset_cache()
