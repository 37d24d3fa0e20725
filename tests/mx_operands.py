"""MXFP4 QTensors built from chosen codes and block exponents, shared by the FP8 encoding and GEMM tests."""

import jax
import jax.numpy as jnp
import numpy as np

from bench.dot import abs_codes
from fp4jax.numerics.qtensor import QTensor, pack_codes
from fp4jax.numerics.reference import dequantize
from fp4jax.ops.gemm import emulated
from fp4jax.ops.gemm.fp8 import FAST_ACCUM_SUM_BOUND


def mx_qtensor(codes: np.ndarray, exps: np.ndarray) -> QTensor:
  """MXFP4 QTensor [R, K] from uint8 codes [R, K] and block exponents [R, K/32] (None entries: NaN)."""
  r, k = codes.shape
  scales = np.where(np.isnan(exps), 255, np.nan_to_num(exps) + 127).astype(np.uint8)
  return QTensor(pack_codes(jnp.asarray(codes, jnp.uint8)), jnp.asarray(scales), None, "mxfp4", 1, (r, k))


def random_mx(seed: int, r: int, k: int, span: int, lo: int = -20, hi: int = 20) -> QTensor:
  rng = np.random.default_rng(seed)
  codes = rng.integers(0, 16, (r, k))
  e_row = rng.integers(lo, hi + 1, (r, 1))
  exps = (e_row - rng.integers(0, span + 1, (r, k // 32))).astype(np.float64)
  exps[:, 0] = e_row[:, 0] - span  # every row spans exactly `span`
  exps[:, -1] = e_row[:, 0]
  return mx_qtensor(codes, exps)


def dequantized(q: QTensor) -> np.ndarray:
  return np.asarray(dequantize(q, jnp.float32))


def abs_product(a: QTensor, b: QTensor) -> np.ndarray:
  """|A| |B|^T of K-major operands (float32, emulated): what bounds the error of any sum of their products."""
  return np.asarray(emulated.gemm(abs_codes(a), abs_codes(b), out_dtype=jnp.float32))


def float32_sum_bound(absprod: np.ndarray, k: int) -> np.ndarray:
  """|diff| bound of two float32 sums of the same K exact products, given |A| |B|^T: 2 K 2^-24 |A| |B|^T, with
  2^-20 relative slack for a rounding of the outer factors."""
  return 2 * k * 2.0**-24 * absprod * (1 + 2.0**-20)


def summation_bound(a: QTensor, b: QTensor, k: int) -> np.ndarray:
  """`float32_sum_bound` of two K-major QTensors."""
  return float32_sum_bound(abs_product(a, b), k)


def fp8_sum_bound(absprod: np.ndarray, k: int) -> np.ndarray:
  """|diff| bound of an FP8 GEMM's float32 result from another sum of its exact products, given |A| |B|^T.

  Where the default backend is a CPU, XLA sums in float32 (`float32_sum_bound`). On a GPU, FP8 tensor cores keep
  fewer bits in their sums: `FAST_ACCUM_SUM_BOUND` |A| |B|^T, which the mosaic GEMM's GPU test held to on an H100
  and the cuBLASLt tests on the H200 (docs/BENCHMARKS.md, 2026-12-05, 22:14)."""
  if jax.default_backend() == "gpu":
    return FAST_ACCUM_SUM_BOUND * absprod
  return float32_sum_bound(absprod, k)


def fp8_tolerance(cpu: float) -> float:
  """A tolerance, relative to a result's largest |value|, for results of FP8 GEMMs: `cpu` where the default
  backend is a CPU, `FAST_ACCUM_SUM_BOUND` on a GPU (its FP8 tensor cores' sums)."""
  return FAST_ACCUM_SUM_BOUND if jax.default_backend() == "gpu" else cpu
