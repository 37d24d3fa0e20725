"""fp4jax: FP4 (MXFP4, NVFP4) LLM pretraining in JAX.

Flat re-exports only; see README.md and docs/ARCHITECTURE.md for the tour.
"""

from fp4jax import routes
from fp4jax.dot import fp4_dot
from fp4jax.formats import FORMATS, FormatSpec
from fp4jax.nn import FP4Linear, RouteRules
from fp4jax.qtensor import QTensor
from fp4jax.reference import dequantize, quantize
from fp4jax.route import OperandSpec, Route

__version__ = "0.1.0"
