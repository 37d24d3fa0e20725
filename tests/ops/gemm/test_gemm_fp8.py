"""fp8 GEMM backend: the GEMM equals the emulated product up to float32 accumulation order, takes the
per-tensor scaled path exactly when that is exact, and keeps NaN rows and columns; the FP8 formats of the fp8
route (per-tensor current scaling) as one scaled FP8 GEMM."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.dot import cublas_fp8_gemms, gemm_targets, random_qtensor
from fp4jax.numerics import fp8 as fp8_encoding
from fp4jax.numerics.qtensor import QTensor, ScaledValues
from fp4jax.numerics.reference import quantize
from fp4jax.numerics.values import scaled_values
from fp4jax.ops import gemm as gemm_lib
from fp4jax.ops.gemm import emulated as gemm_emulated
from fp4jax.ops.gemm import fp8 as gemm_fp8
from mx_operands import abs_product, dequantized, fp8_sum_bound, mx_qtensor, random_mx, summation_bound


@pytest.mark.parametrize("fmt_a,fmt_b", [("mxfp4", "mxfp4"), ("nvfp4", "nvfp4"), ("nvfp4_tile", "nvfp4_tile"),
                                         ("mxfp4", "nvfp4"), ("nvfp4", "mxfp4")])
def test_gemm_matches_emulated(fmt_a, fmt_b):
  """Both compute the same exact products; only the accumulation (and, for NVFP4, where the outer factor is
  rounded) differs, so |fp8 - emulated| <= 2 K 2^-24 (|A| |B|^T) on a CPU (plus 3 roundings of the outer
  product, covered by 2^-20 relative slack), FP8 tensor cores' accumulation on a GPU (`fp8_sum_bound`)."""
  m, n, k = 24, 40, 256
  ka, kb = jax.random.split(jax.random.key(len(fmt_a) * 10 + len(fmt_b)))
  a, b = random_qtensor(ka, fmt_a, m, k, span=10), random_qtensor(kb, fmt_b, n, k, span=10)
  assert gemm_fp8.supports(a, b)
  ref = np.asarray(gemm_emulated.gemm(a, b, out_dtype=jnp.float32))
  out = np.asarray(jax.jit(lambda a, b: gemm_fp8.gemm(a, b, out_dtype=jnp.float32))(a, b))
  assert out.shape == (m, n) and out.dtype == np.float32
  bound = fp8_sum_bound(abs_product(a, b), k)
  assert np.all(np.abs(out - ref) <= bound)
  out16 = jax.jit(lambda a, b: gemm_fp8.gemm(a, b, out_dtype=jnp.bfloat16))(a, b)
  assert out16.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out16, np.float32), ref, rtol=2**-7, atol=float(bound.max()))


@pytest.mark.parametrize("span_a,span_b", [(3, 14), (14, 0), (15, 2), (2, 20)])
def test_tensor_scaled_path_taken_only_when_exact(span_a, span_b):
  """One factor per tensor (scales fused into the cuBLASLt GEMM) is used exactly when both tensors span <= 2^14;
  otherwise the per-row path runs. Either way the result equals the emulated product up to summation order."""
  m, n, k = 16, 24, 128
  a = random_mx(11 + span_a, m, k, span=0, lo=0, hi=0)
  b = random_mx(17 + span_b, n, k, span=0, lo=0, hi=0)
  # Spread whole rows apart so the *tensor* span, not any row span, is span_a / span_b.
  a = _random_mx_rows(a, span_a)
  b = _random_mx_rows(b, span_b)
  fast = bool(fp8_encoding.tensor_span_ok(a) & fp8_encoding.tensor_span_ok(b))
  assert fast == (span_a <= 14 and span_b <= 14)
  if fast:
    values, factor = fp8_encoding.fp8_tensor_operand(a)
    np.testing.assert_array_equal(np.asarray(values.astype(jnp.float32)) * float(factor), dequantized(a))
  ref = np.asarray(gemm_emulated.gemm(a, b, out_dtype=jnp.float32))
  out = np.asarray(jax.jit(lambda a, b: gemm_fp8.gemm(a, b, out_dtype=jnp.float32))(a, b))
  assert np.all(np.abs(out - ref) <= fp8_sum_bound(abs_product(a, b), k))
  # The shared encoding (one per operand, outside the cond) gives the bits of each path computed on its own.
  own = jax.jit(lambda a, b: gemm_fp8.fp8_gemm_tensor_scaled(a, b, jnp.float32) if fast else
                gemm_fp8.fp8_gemm(fp8_encoding.mx_to_fp8(a), fp8_encoding.mx_to_fp8(b), jnp.float32))
  np.testing.assert_array_equal(out, np.asarray(own(a, b)))


def _random_mx_rows(q: QTensor, span: int) -> QTensor:
  """q with row r's block exponents lowered by r * span // (R - 1): the tensor spans `span`, each row 0."""
  r = q.scales.shape[0]
  drop = (np.arange(r) * span // (r - 1)).astype(np.int32)[:, None]
  scales = (np.asarray(q.scales, np.int32) - drop).astype(np.uint8)
  return QTensor(q.codes, jnp.asarray(scales), None, q.fmt, q.axis, q.shape)


def test_gemm_nan_rows_and_columns():
  rng = np.random.default_rng(5)
  a = mx_qtensor(rng.integers(0, 16, (8, 64)), np.array([[0.0, 1.0]] * 8))
  b = mx_qtensor(rng.integers(0, 16, (6, 64)), np.array([[2.0, -3.0]] * 6))
  a = QTensor(a.codes, a.scales.at[3, 1].set(255), None, "mxfp4", 1, a.shape)
  b = QTensor(b.codes, b.scales.at[4, 0].set(255), None, "mxfp4", 1, b.shape)
  out = np.asarray(gemm_fp8.gemm(a, b, out_dtype=jnp.float32))
  ref = np.asarray(gemm_emulated.gemm(a, b, out_dtype=jnp.float32))
  expect_nan = np.zeros((8, 6), bool)
  expect_nan[3, :] = expect_nan[:, 4] = True
  np.testing.assert_array_equal(np.isnan(out), expect_nan)
  np.testing.assert_array_equal(np.isnan(ref), expect_nan)
  np.testing.assert_allclose(out[~expect_nan], ref[~expect_nan], rtol=1e-6)


@pytest.mark.parametrize("e_a,e_b", [((120, 100), (-110,)), ((-100, -120), (110,)), ((125, 100), (-125,))])
def test_per_row_path_does_not_overflow_on_the_way(e_a, e_b):
  """Rows of a whose block exponents span more than 14 (so the per-row path runs) against b on the far side of
  the range: the results are finite and exact, though a's row factor alone takes acc out of float32's range."""
  k = 64
  a = mx_qtensor(np.full((len(e_a), k), 7), np.array([[e] * (k // 32) for e in e_a], np.float64))  # all 6
  b = mx_qtensor(np.full((len(e_b), k), 7), np.array([[e] * (k // 32) for e in e_b], np.float64))
  assert not bool(fp8_encoding.tensor_span_ok(a))
  want = dequantized(a).astype(np.float64) @ dequantized(b).astype(np.float64).T  # exact: 36 k 2^(e_a + e_b)
  out = np.asarray(jax.jit(lambda a, b: gemm_fp8.gemm(a, b, out_dtype=jnp.float32))(a, b))
  np.testing.assert_array_equal(out, want.astype(np.float32))


def test_supports_and_errors():
  key = jax.random.key(0)
  a = random_qtensor(key, "mxfp4", 4, 64)
  assert not gemm_fp8.supports(a, random_qtensor(key, "mxfp4", 4, 128))  # K differs
  with pytest.raises(ValueError, match="does not support"):
    gemm_fp8.gemm(a, random_qtensor(key, "mxfp4", 4, 128), out_dtype=jnp.float32)
  with pytest.raises(ValueError, match="MXFP4"):
    fp8_encoding.mx_to_fp8(random_qtensor(key, "nvfp4", 4, 64))


@pytest.mark.gpu
def test_fp8_path_is_cublas_fp8_gemm_on_gpu():
  key = jax.random.key(0)
  # At Llama-size shapes (XLA may pick a Triton fusion for small GEMMs: 256x128x512 failed on the H200).
  a, b = random_qtensor(key, "mxfp4", 4096, 4096), random_qtensor(key, "mxfp4", 4096, 4096)
  hlo = jax.jit(lambda a, b: gemm_fp8.gemm(a, b, out_dtype=jnp.bfloat16)).lower(a, b).compile().as_text()
  assert cublas_fp8_gemms(hlo)


FP8_PAIRS = [("fp8_e4m3", "fp8_e4m3"), ("fp8_e5m2", "fp8_e4m3"), ("fp8_e4m3", "fp8_e5m2")]  # fprop, dgrad, wgrad


@pytest.mark.parametrize("fmt_a,fmt_b", FP8_PAIRS)
def test_fp8_formats_gemm_matches_emulated(fmt_a, fmt_b):
  """Per-tensor FP8 operands: XLA:CPU rounds value * factor once per element, as `dequantize` does, and dots in
  float32, so the product differs from the emulated one only in the order of the sums: |diff| <= 2 K 2^-24
  (|A| |B|^T) for the dequantized A, B (on a GPU, FP8 tensor cores' accumulation: `fp8_sum_bound`)."""
  m, n, k = 24, 40, 200
  ka, kb = jax.random.split(jax.random.key(len(fmt_a) + 3 * len(fmt_b)))
  a = quantize(jax.random.normal(ka, (m, k)) * 30, fmt_a)  # K-major [M, K]
  b = quantize(jax.random.normal(kb, (n, k)) * 1e-3, fmt_b)  # K-major [N, K]
  assert gemm_fp8.supports(a, b) and gemm_lib.select(a, b, "fp8") == "fp8"
  ad, bd = dequantized(a).astype(np.float64), dequantized(b).astype(np.float64)
  bound = fp8_sum_bound(np.abs(ad) @ np.abs(bd).T, k)
  ref = np.asarray(gemm_emulated.gemm(a, b, out_dtype=jnp.float32))
  out = np.asarray(jax.jit(lambda a, b: gemm_fp8.gemm(a, b, out_dtype=jnp.float32))(a, b))
  assert out.shape == (m, n) and out.dtype == np.float32
  assert np.all(np.abs(out - ref) <= bound)
  out16 = jax.jit(lambda a, b: gemm_fp8.gemm(a, b, out_dtype=jnp.bfloat16))(a, b)
  assert out16.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out16, np.float32), ref, rtol=2**-8, atol=float(bound.max()))


def test_fp8_pairs_without_a_cublaslt_gemm_are_not_supported():
  """cuBLASLt has no E5M2 x E5M2 FP8 GEMM, and FP8 x FP4 pairs have no FP8 path: "auto" takes the emulated
  backend, a named "fp8" fails clearly."""
  e5 = quantize(jnp.ones((8, 64)), "fp8_e5m2")
  for b in (e5, quantize(jnp.ones((4, 64)), "mxfp4")):
    assert not gemm_fp8.supports(e5, b)
    assert gemm_lib.select(e5, b) == "emulated"
    with pytest.raises(ValueError, match="GEMM backend 'fp8' does not support a.fmt='fp8_e5m2'"):
      gemm_lib.select(e5, b, "fp8")
  assert not gemm_fp8.supports(e5, quantize(jnp.ones((4, 32)), "fp8_e4m3"))  # K differs


@pytest.mark.gpu
@pytest.mark.parametrize("fmt_a,fmt_b", FP8_PAIRS)
def test_fp8_formats_are_one_cublaslt_fp8_gemm_on_gpu(fmt_a, fmt_b):
  """The scales fold into the GEMM: one cuBLASLt FP8 custom call and nothing else that multiplies."""
  ka, kb = jax.random.split(jax.random.key(1))
  a = quantize(jax.random.normal(ka, (4096, 4096), jnp.bfloat16), fmt_a)
  b = quantize(jax.random.normal(kb, (4096, 4096), jnp.bfloat16), fmt_b)
  hlo = jax.jit(lambda a, b: gemm_fp8.gemm(a, b, out_dtype=jnp.bfloat16)).lower(a, b).compile().as_text()
  assert gemm_targets(hlo) == ["__cublas$lt$matmul$f8"], gemm_targets(hlo)


@pytest.mark.parametrize("fmt_a,fmt_b", [("nvfp4", "nvfp4"), ("nvfp4_tile", "nvfp4_tile"), ("mxfp4", "nvfp4")])
def test_scaled_values_operands_give_the_codes_product(fmt_a, fmt_b):
  """The bf16 GEMM of NVFP4 pairs takes `ScaledValues` in either layout (K-major, or transposed as a kernel's
  column view is stored) and gives the product of the same operands as codes: bit for bit where the layouts
  are those of the codes' values, else within the bound of a different order of float32 sums (XLA:CPU sums a
  turned left operand in another order)."""
  m, n, k = 24, 40, 256
  ka, kb = jax.random.split(jax.random.key(3))
  a, b = random_qtensor(ka, fmt_a, m, k, span=10), random_qtensor(kb, fmt_b, n, k, span=10)
  want = np.asarray(gemm_fp8.gemm(a, b, out_dtype=jnp.float32))
  av, bv = scaled_values(a), scaled_values(b)
  turned = lambda v: ScaledValues(v.values.T, v.outer, fmt=v.fmt, axis=1, shape=v.shape,
                                  transposed=True)  # the same values, held [K, R]
  for pair in ((av, bv), (av, b), (a, turned(bv)), (turned(av), turned(bv)), (turned(av), b)):
    assert gemm_fp8.supports(*pair)
    got = np.asarray(gemm_fp8.gemm(*pair, out_dtype=jnp.float32))
    if getattr(pair[0], "transposed", False):
      assert np.all(np.abs(got - want) <= summation_bound(a, b, k))
    else:
      np.testing.assert_array_equal(got, want)


def test_scaled_values_only_where_the_gemm_reads_values():
  """An MXFP4 pair runs on FP8 from its codes: values in it are refused, here and by the Blackwell backend."""
  key = jax.random.key(0)
  a, b = random_qtensor(key, "mxfp4", 4, 64), random_qtensor(key, "mxfp4", 8, 64)
  assert not gemm_fp8.supports(scaled_values(a), b)
  assert gemm_fp8.reads_values("nvfp4", "mxfp4") and not gemm_fp8.reads_values("mxfp4", "mxfp4")
  nv = random_qtensor(key, "nvfp4", 8, 64)
  assert gemm_lib.BACKENDS["native"].supports(random_qtensor(key, "nvfp4", 4, 64), nv)
  assert not gemm_lib.BACKENDS["native"].supports(scaled_values(random_qtensor(key, "nvfp4", 4, 64)), nv)
