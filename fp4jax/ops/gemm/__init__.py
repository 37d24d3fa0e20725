"""FP4 GEMMs on K-major QTensors, one backend per hardware path: `emulated` (the reference, anywhere), `fp8`
(Hopper FP8 tensor cores), `mosaic` (Hopper: MXFP4 pairs as one Mosaic GPU kernel), `native` (Blackwell
block-scaled GEMMs)."""

from fp4jax.ops.gemm.registry import BACKENDS, CHOICES, device_generation, gemm, operand_form, select
