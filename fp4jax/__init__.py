"""fp4jax: FP4 (MXFP4, NVFP4) LLM pretraining in JAX.

Flat re-exports only; see README.md and docs/ for the tour.
"""

from fp4jax.formats import FORMATS, FormatSpec
from fp4jax.qtensor import QTensor
from fp4jax.reference import dequantize, quantize

__version__ = "0.1.0"
