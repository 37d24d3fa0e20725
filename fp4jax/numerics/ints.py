"""`is_int`: the integer test of fp4jax's argument checks (sizes, axes, counts), in one place. It imports nothing
from fp4jax, so that every module may use it: hadamard among them, which spec and quantize_args import."""

from __future__ import annotations

import numpy as np


def is_int(value) -> bool:
  """Whether `value` is a Python or NumPy integer scalar (a shape's entry, `np.arange`'s elements), and not a
  bool: True or np.True_ would silently mean 1. A float, a string or an array, 0-d included, is none."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
