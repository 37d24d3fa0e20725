"""The ops fp4_dot is built from, one package each: `quantize` (operands to FP4) and `gemm` (FP4 products)."""
