"""Quantizing GEMM operands: one API (`api`) over the fused Pallas kernels (`pallas`) and the XLA reference
(`xla`), with an ordered fallback."""

from fp4jax.ops.quantize.api import CHOICES, IMPLEMENTATIONS, quantize_operand, quantize_views, resolve
