"""fp4jax: FP4 (MXFP4, NVFP4) LLM pretraining in JAX.

Flat re-exports only; see README.md and docs/ARCHITECTURE.md for the tour. The Flax modules (`FP4Linear`,
`RouteRules`, `fp4jax.nn`) load on first use, so `import fp4jax` does not import Flax; `fp4jax.diagnostics`
(no Flax) and `fp4jax.compiling` load on first use too.
"""

import importlib

from fp4jax import routes
from fp4jax.dot import fp4_dot
from fp4jax.impl import Impl
from fp4jax.numerics.formats import FORMATS, FormatSpec
from fp4jax.numerics.qtensor import QTensor
from fp4jax.numerics.reference import dequantize, quantize
from fp4jax.numerics.spec import OperandSpec
from fp4jax.route import Route

__version__ = "0.1.0"

_LAZY = {"FP4Linear": "fp4jax.nn", "RouteRules": "fp4jax.nn", "nn": None, "diagnostics": None, "compiling": None}


def __getattr__(name: str):
  if name not in _LAZY:
    raise AttributeError(f"module 'fp4jax' has no attribute {name!r}")
  module = importlib.import_module(_LAZY[name] or f"fp4jax.{name}")
  return module if _LAZY[name] is None else getattr(module, name)
