"""mosaic GEMM backend: the bits of the fp8 backend's per-row path (the emulated product up to summation order),
NaN rows and columns, factors at the ends of float32's range; run in Mosaic GPU's interpret mode on the CPU,
lowered for an H200 at the Llama shapes, and on a GPU where there is one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams, force_gpu_interpret_mode
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from fp4jax import Impl
from fp4jax.numerics import fp8 as encoding
from fp4jax.numerics.qtensor import QTensor
from fp4jax.numerics.reference import quantize
from fp4jax.ops import gemm as gemm_lib
from fp4jax.ops.gemm import emulated, fp8, mosaic
from mx_operands import abs_product, mx_qtensor, random_mx, summation_bound


def _per_row_fp8(a: QTensor, b: QTensor, out_dtype) -> np.ndarray:
  """The fp8 backend's per-row path (its numbers wherever a tensor spans more than 2^14)."""
  return np.asarray(fp8.fp8_gemm(encoding.mx_to_fp8(a), encoding.mx_to_fp8(b), out_dtype))


def _interpreted(a: QTensor, b: QTensor, out_dtype) -> np.ndarray:
  with force_gpu_interpret_mode(InterpretGPUParams()):
    return np.asarray(mosaic.gemm(a, b, out_dtype=out_dtype))


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_interpreted_is_the_product_up_to_summation_order(out_dtype):
  """Rows spanning 2^10 with row exponents in [-20, 20], N split across the two warpgroups: the emulated
  product up to the order of float32 sums (the interpreter's WGMMA adds per 128-wide K slice, XLA:CPU's dot
  otherwise), rounded once to out_dtype."""
  a, b = random_mx(1, 128, 256, span=10), random_mx(2, 256, 256, span=10)
  out = _interpreted(a, b, out_dtype)
  assert out.shape == (128, 256) and out.dtype == np.dtype(out_dtype)
  ref = np.asarray(emulated.gemm(a, b, out_dtype=jnp.float32))
  ulp = 2.0**-8 * np.abs(ref) if out_dtype == jnp.bfloat16 else 0
  assert np.all(np.abs(np.asarray(out, np.float32) - ref) <= summation_bound(a, b, a.shape[1]) * (1 + 2.0**-7) + ulp)


def test_interpreted_nan_rows_columns_and_extreme_factors():
  """A NaN block makes its output row (a) or column (b) NaN; block scales 2^114 against 2^-116 (the factors
  applied in two halves, neither overflowing first) give the product, not inf. M split across the warpgroups
  (N = 128)."""
  rng = np.random.default_rng(3)
  a_exp = np.where(np.arange(256)[:, None] % 2 == 0, 114.0, -20.0) * np.ones((1, 4))
  b_exp = np.where(np.arange(128)[:, None] % 3 == 0, 0.0, -116.0) * np.ones((1, 4))
  a = mx_qtensor(rng.integers(0, 16, (256, 128)), a_exp)
  b = mx_qtensor(rng.integers(0, 16, (128, 128)), b_exp)
  a = QTensor(a.codes, a.scales.at[5, 2].set(255), None, "mxfp4", 1, a.shape)
  b = QTensor(b.codes, b.scales.at[7, 0].set(255), None, "mxfp4", 1, b.shape)
  assert mosaic.tile_config(256, 128, 128) == mosaic.TileConfig(split_n=False)
  out = _interpreted(a, b, jnp.float32)
  expect_nan = np.zeros((256, 128), bool)
  expect_nan[5, :] = expect_nan[:, 7] = True
  np.testing.assert_array_equal(np.isnan(out), expect_nan)
  ref = np.asarray(emulated.gemm(a, b, out_dtype=jnp.float32))
  assert np.isfinite(out[~expect_nan]).all() and np.isfinite(ref[~expect_nan]).all()
  assert np.all(np.abs(out - ref)[~expect_nan] <= summation_bound(a, b, a.shape[1])[~expect_nan])


def test_supports_mxfp4_pairs_its_tiles_cover():
  a, b = random_mx(4, 128, 256, span=2), random_mx(5, 256, 256, span=2)
  assert mosaic.supports(a, b) and mosaic.supports(b, a)  # 128 x 256 and 256 x 128 CTA tiles
  assert not mosaic.supports(random_mx(7, 128, 192, span=2), random_mx(8, 256, 192, span=2))  # K % 128
  assert not mosaic.supports(random_mx(9, 96, 256, span=2), b)  # M % 128
  assert mosaic.tile_config(128, 128, 128) is None  # neither M nor N takes two warpgroups' tiles
  assert not mosaic.supports(quantize(jnp.ones((128, 256), jnp.bfloat16), "nvfp4"), b)
  with pytest.raises(ValueError, match="backend 'mosaic' does not support"):
    gemm_lib.select(random_mx(9, 96, 256, span=2), b, "mosaic")
  assert Impl(gemm="mosaic").gemm == "mosaic"


def test_refuses_to_compile_without_a_gpu():
  if jax.default_backend() == "gpu":
    pytest.skip("a GPU is the default backend")
  a, b = random_mx(4, 128, 256, span=2), random_mx(5, 256, 256, span=2)
  with pytest.raises(ValueError, match=r"compiles for a Hopper GPU \(or runs in Mosaic GPU's interpret mode\): "
                                       r"JAX's default backend is not a GPU; choose gemm 'auto' \(the fastest "
                                       r"backend that runs here\) or 'emulated'"):
    mosaic.gemm(a, b, out_dtype=jnp.float32)


@pytest.mark.parametrize("m,n,k,out_dtype", [(16384, 16384, 2048, jnp.bfloat16), (16384, 2048, 16384, jnp.bfloat16),
                                             (2048, 16384, 16384, jnp.bfloat16), (8192, 28672, 4096, jnp.bfloat16),
                                             (8192, 4096, 14336, jnp.bfloat16), (16384, 3072, 2048, jnp.bfloat16),
                                             (2048, 1536, 1024, jnp.float32), (512, 256, 1024, jnp.float32)])
def test_lowers_for_an_h200_at_llama_shapes(m, n, k, out_dtype):
  """Mosaic GPU lowers in Python, applying its hardware checks (shared memory: 227 KiB without a device to ask,
  the H100's and H200's opt-in limit; WGMMA operand layouts)."""
  mesh = AbstractMesh((1,), ("d",), abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))
  with use_abstract_mesh(mesh):
    a = jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn)
    b = jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn)
    r = lambda rows: jax.ShapeDtypeStruct((rows,), jnp.float32)
    fn = lambda a, ra, b, rb: mosaic.scaled_fp8_matmul(a, ra, b, rb, out_dtype=out_dtype)
    text = jax.jit(fn).trace(a, r(m), b, r(n)).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.gpu
def test_gpu_matches_the_fp8_backend():
  """On the GPU, at a shape of several tiles per SM: bf16 outputs bit for bit the fp8 backend's (cuBLASLt); float32
  outputs the emulated product up to FP8 WGMMA's accumulation, which keeps fewer bits than float32 between
  promotions as cuBLASLt's fast accumulation does (about 7e-4 |A| |B| measured: tests/test_fp8_route.py).
  (H100, 2026-12-05: the float32 sums' bound of the CPU tests does not hold here.)"""
  a, b = random_mx(11, 2048, 1024, span=12), random_mx(12, 1536, 1024, span=12)
  out = np.asarray(mosaic.gemm(a, b, out_dtype=jnp.bfloat16))
  np.testing.assert_array_equal(out, _per_row_fp8(a, b, jnp.bfloat16))
  np.testing.assert_array_equal(out, np.asarray(fp8.gemm(a, b, out_dtype=jnp.bfloat16)))
  out32 = np.asarray(mosaic.gemm(a, b, out_dtype=jnp.float32))
  assert np.all(np.abs(out32 - np.asarray(emulated.gemm(a, b, out_dtype=jnp.float32))) <= 2**-9 * abs_product(a, b))
