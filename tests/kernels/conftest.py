"""Fixtures of the kernel tests."""

import importlib.util
import pathlib

import pytest


@pytest.fixture(scope="session")
def compile_time_script():
  """scripts/triton_compile_time.py as a module: its kernel list and Triton-IR lowering (no GPU needed)."""
  path = pathlib.Path(__file__).parents[2] / "scripts" / "triton_compile_time.py"
  spec = importlib.util.spec_from_file_location("triton_compile_time", path)
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  return script


@pytest.fixture
def triton_modules(compile_time_script):
  """lower(fn, shape) -> the Triton IR text of every Pallas kernel in `fn` applied to a bf16 array of `shape`,
  lowered on CPU for an abstract H200."""
  return compile_time_script.triton_irs
