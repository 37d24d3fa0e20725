"""Train tests compile the same small steps many times (each run builds its own jitted functions): a compilation
cache shared by the session's workers compiles each distinct program once."""

from __future__ import annotations

import jax
import pytest


@pytest.fixture(scope="session", autouse=True)
def _shared_compilation_cache(tmp_path_factory):
  cache = tmp_path_factory.getbasetemp().parent / "jax-compilation-cache"  # the parent is shared by xdist workers
  jax.config.update("jax_compilation_cache_dir", str(cache))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  yield
  jax.config.update("jax_compilation_cache_dir", None)
