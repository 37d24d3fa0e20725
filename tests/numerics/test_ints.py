"""`fp4jax.numerics.ints.is_int`, and the argument checks that read it: quantize's axis and tile_rows, a
Hadamard matrix's size, operand_report's samples, FP4Linear's sizes."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fp4jax import FP4Linear, diagnostics
from fp4jax.numerics import reference
from fp4jax.numerics.hadamard import sylvester
from fp4jax.numerics.ints import is_int


@pytest.mark.parametrize("value, want", [
    (3, True), (0, True), (-1, True), (2**70, True), (np.int64(3), True), (np.uint8(3), True), (np.int32(-2), True),
    (True, False), (False, False), (np.True_, False), (np.array(3), False), (np.array([3]), False),
    (3.0, False), (np.float32(3), False), ("3", False), (None, False), (jnp.int32(3), False),
])
def test_is_int(value, want):
  """A Python or NumPy integer scalar, not a bool of either kind, nor an array (0-d included) or a float."""
  assert is_int(value) is want


_CHECKS = {
    "quantize axis": lambda v: reference.quantize(jnp.ones((32, 32)), "mxfp4", axis=v),
    "quantize tile_rows": lambda v: reference.quantize(jnp.ones((32, 32)), "nvfp4_tile", tile_rows=v),
    "sylvester n": sylvester,  # hadamard's axis too
    "operand_report samples": lambda v: diagnostics.operand_report(*(jnp.ones((32, 32)),) * 3, "bf16", samples=v),
    "FP4Linear in_features": lambda v: FP4Linear(v, 32, rngs=nnx.Rngs(0)),
}


@pytest.mark.parametrize("what", sorted(_CHECKS))
@pytest.mark.parametrize("value", [np.True_, True, 1.0])
def test_argument_checks_refuse_what_is_no_int(what, value):
  """Each check refuses a bool (NumPy's too) and a float by name, as is_int does. (An array, 0-d too, is no int
  either; where the argument is a jit's static one, as quantize's and hadamard's are, JAX refuses it first, as
  unhashable.)"""
  with pytest.raises((TypeError, ValueError), match=r"(int|axis).*, got "):
    _CHECKS[what](value)
