"""Train tests compile the same small steps many times (each run builds its own jitted functions): a compilation
cache shared by the session's workers compiles each distinct program once."""

from __future__ import annotations

import os

import pytest

from fp4jax import platform


@pytest.fixture(scope="session", autouse=True)
def _shared_compilation_cache(tmp_path_factory):
  cache = tmp_path_factory.getbasetemp().parent / "jax-compilation-cache"  # the parent is shared by xdist workers
  os.environ["FP4JAX_CACHE"] = str(cache)  # where `python -m train` (run.compile_cache: auto) puts it too
  platform.enable_compilation_cache(cache)
  yield
  platform.enable_compilation_cache(None)
