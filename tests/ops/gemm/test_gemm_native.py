"""native (Blackwell) GEMM backend, on CPU: the operands/scales handed to jax.nn.scaled_matmul have the types and
layouts XLA's cuDNN block-scaled dot takes, the CUDA lowering is that custom call, and the numbers (CPU
reference lowering of scaled_matmul) equal the emulated product."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.dot import random_qtensor
from fp4jax.ops.gemm import emulated as gemm_emulated
from fp4jax.ops.gemm import native as gemm_native
from fp4jax.numerics.reference import dequantize
from mx_operands import summation_bound

# fmt -> (values dtype, scales dtype, block) the cuDNN path needs.
_LAYOUT = {
    "nvfp4": (jnp.float4_e2m1fn, jnp.float8_e4m3fn, 16),
    "nvfp4_tile": (jnp.float4_e2m1fn, jnp.float8_e4m3fn, 16),
    "mxfp4": (jnp.float8_e4m3fn, jnp.float8_e8m0fnu, 32),
}


@pytest.mark.parametrize("fmt", sorted(_LAYOUT))
def test_scaled_operand_layout(fmt):
  r, k = 24, 128
  q = random_qtensor(jax.random.key(1), fmt, r, k)
  op = gemm_native.scaled_operand(q)
  vdt, sdt, block = _LAYOUT[fmt]
  assert op.values.dtype == vdt and op.values.shape == (1, r, k)
  assert op.scales.dtype == sdt and op.scales.shape == (1, r, k // block)
  # Same numbers: values * repeated scales == dequantized value without the outer factor.
  scaled = op.values[0].astype(jnp.float32) * jnp.repeat(op.scales[0].astype(jnp.float32), block, axis=1)
  no_outer = dequantize(type(q)(q.codes, q.scales, None, q.fmt, q.axis, q.shape))
  np.testing.assert_array_equal(np.asarray(scaled), np.asarray(no_outer))


@pytest.mark.parametrize("fmt", sorted(_LAYOUT))
def test_cuda_lowering_is_cudnn_block_scaled_dot(fmt):
  a = random_qtensor(jax.random.key(2), fmt, 128, 256)
  b = random_qtensor(jax.random.key(3), fmt, 64, 256)
  fn = jax.jit(lambda a, b: gemm_native.gemm(a, b, out_dtype=jnp.bfloat16))
  assert jax.eval_shape(fn, a, b) == jax.ShapeDtypeStruct((128, 64), jnp.bfloat16)
  text = fn.trace(a, b).lower(lowering_platforms=("cuda",)).as_text()
  calls = [l for l in text.splitlines() if "__op$block_scaled_dot" in l]
  assert len(calls) == 1, calls
  vdt, sdt, block = _LAYOUT[fmt]
  v, s = jnp.dtype(vdt).name, jnp.dtype(sdt).name
  ir = {"float4_e2m1fn": "f4E2M1FN", "float8_e4m3fn": "f8E4M3FN", "float8_e8m0fnu": "f8E8M0FNU"}
  types = re.search(r":\s*\((.*)\)\s*->", calls[0]).group(1)
  assert types == (f"tensor<1x128x256x{ir[v]}>, tensor<1x64x256x{ir[v]}>, "
                   f"tensor<1x128x{256 // block}x{ir[s]}>, tensor<1x64x{256 // block}x{ir[s]}>")


@pytest.mark.parametrize("fmt", sorted(_LAYOUT))
def test_matches_emulated_on_cpu(fmt):
  """CPU runs scaled_matmul's reference lowering: exact products, float32 sums in another order."""
  m, n, k = 16, 24, 256
  a = random_qtensor(jax.random.key(4), fmt, m, k, span=10)
  b = random_qtensor(jax.random.key(5), fmt, n, k, span=10)
  out = np.asarray(jax.jit(lambda a, b: gemm_native.gemm(a, b, out_dtype=jnp.float32))(a, b))
  ref = np.asarray(gemm_emulated.gemm(a, b, out_dtype=jnp.float32))
  assert np.all(np.abs(out - ref) <= summation_bound(a, b, k))


def test_supports():
  key = jax.random.key(0)
  mx, nv = random_qtensor(key, "mxfp4", 8, 64), random_qtensor(key, "nvfp4", 8, 64)
  assert gemm_native.supports(mx, mx) and gemm_native.supports(nv, nv)
  assert not gemm_native.supports(mx, nv)
  assert not gemm_native.supports(nv, random_qtensor(key, "nvfp4", 8, 128))
  with pytest.raises(ValueError, match="does not support"):
    gemm_native.gemm(mx, nv, out_dtype=jnp.float32)
