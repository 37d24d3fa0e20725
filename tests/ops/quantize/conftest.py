"""Fixtures of the quantizer tests."""

import pytest


@pytest.fixture
def triton_modules():
  """lower(fn, shape) -> the Triton IR text of every Pallas kernel `fn` launches on a bf16 array of `shape`,
  lowered on CPU for an abstract H200 (`bench.triton`)."""
  from bench import triton  # pylint: disable=g-import-not-at-top
  return triton.triton_irs
