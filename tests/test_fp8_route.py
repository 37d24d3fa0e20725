"""The fp8 route, the stock Hopper FP8 baseline (Transformer Engine's Float8CurrentScaling, HYBRID): fp4_dot's
forward and both gradients against the float32-dequantized reference, one quantization per tensor, FP8
residuals, no padding, and on a GPU one cuBLASLt FP8 GEMM per product."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from bench.dot import gemm_targets
from fp4jax import Impl
from fp4jax.dot import fp4_dot, padding_multiples
from fp4jax.numerics.reference import dequantize, quantize
from mx_operands import float32_sum_bound, fp8_sum_bound, fp8_tolerance

IMPLS = {"auto": Impl(), "fp8 gemm": Impl(gemm="fp8"), "emulated": Impl(gemm="emulated"),
         "interpret + fp8 gemm": Impl(quantizer="interpret", gemm="fp8")}


def _data(m, k, n, dtype=jnp.float32, seed=0):
  kx, kw, kd, ks = jax.random.split(jax.random.key(seed), 4)
  rows = jnp.exp2(jax.random.uniform(ks, (m, 1), minval=-6, maxval=6))  # rows over many binades
  x = (jax.random.normal(kx, (m, k)) * rows).astype(dtype)
  w = (jax.random.normal(kw, (k, n)) * 0.05).astype(dtype)
  dy = (jax.random.normal(kd, (m, n)) * 1e-4).astype(dtype)
  return x, w, dy


def _fake_quant(v, fmt):
  """dequantize(quantize(v)) as float64: per tensor, the same values whichever axis a GEMM reduces."""
  return np.asarray(dequantize(quantize(v, fmt)), np.float64)


def reference_vjp(x, w, dy):
  """(y, dx, dw) in float64 from the FP8 operands of docs/NUMERICS.md: E4M3 X and W, E5M2 dY."""
  xq, wq, dyq = _fake_quant(x, "fp8_e4m3"), _fake_quant(w, "fp8_e4m3"), _fake_quant(dy, "fp8_e5m2")
  products = ((xq, wq), (dyq, wq.T), (xq.T, dyq))
  return [(a @ b, np.abs(a) @ np.abs(b)) for a, b in products]


def _vjp(x, w, dy, impl=None):
  y, f = jax.vjp(lambda x, w: fp4_dot(x, w, route="fp8", impl=impl), x, w)
  return (y, *f(dy))


@pytest.mark.parametrize("impl", list(IMPLS))
def test_matches_dequantized_reference(impl):
  """Forward and both gradients equal the float64 product of the dequantized FP8 operands up to the GEMM's
  summation (float32 sums: |diff| <= 2 K 2^-24 |A| |B|; FP8 tensor cores on a GPU: `fp8_sum_bound`) + an ulp of
  the result, on odd shapes that need no padding."""
  m, k, n = 40, 72, 56
  x, w, dy = _data(m, k, n)
  got = jax.jit(lambda x, w, dy: _vjp(x, w, dy, IMPLS[impl]))(x, w, dy)
  sums = float32_sum_bound if impl == "emulated" else fp8_sum_bound
  for out, (ref, absprod), kk in zip(got, reference_vjp(x, w, dy), (k, n, m)):
    assert out.shape == ref.shape and out.dtype == jnp.float32
    bound = sums(absprod, kk) + 2.0**-24 * np.abs(ref)
    assert np.all(np.abs(np.asarray(out, np.float64) - ref) <= bound), impl
  assert not np.allclose(got[0], np.asarray(x, np.float64) @ np.asarray(w, np.float64), rtol=1e-3)  # it quantized


def test_jitted_with_constant_operands():
  """Under jit with x, w and dY constants of the program (a closed-over batch or weight), the same numbers as
  passed in: XLA's constant folding once transposed the float8 view of such a constant wrongly
  (`current_scaling.other_view`), giving dW off by 135% and dX by 97%. (A product XLA folds at compile time
  sums in another order: equal up to float32 rounding on a CPU; on a GPU the folded product sums in float32 on
  the host, the run one on FP8 tensor cores, `fp8_sum_bound`.)"""
  x, w, dy = _data(48, 64, 32, seed=3)
  want = jax.jit(_vjp)(x, w, dy)
  tol = fp8_tolerance(1e-6)
  for got in (jax.jit(lambda: _vjp(x, w, dy))(), jax.jit(lambda w: _vjp(x, w, dy))(w),
              jax.jit(lambda x: _vjp(x, w, dy))(x)):
    for g, e in zip(got, want):
      np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=tol * float(jnp.abs(e).max()))


def test_bf16_inputs_and_leading_dims():
  """Output and gradients in the inputs' dtypes; x [..., K] flattened to tokens."""
  x, w, dy = _data(64, 48, 32, jnp.bfloat16)
  y, dx, dw = _vjp(x.reshape(4, 16, 48), w, dy.reshape(4, 16, 32))
  assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16,) * 3 and y.shape == (4, 16, 32)
  for out, (ref, _) in zip((y.reshape(64, 32), dx.reshape(64, 48), dw), reference_vjp(x, w, dy)):
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=2**-7, atol=2**-7 * np.abs(ref).max())


def test_each_tensor_is_quantized_once():
  """Six operand roles, three quantizations: X, W and dY each serve both of their GEMMs (the other view is the
  transpose of the FP8 values), as Transformer Engine keeps one FP8 tensor and its transpose."""
  x, w, _ = _data(64, 32, 48, jnp.bfloat16)
  calls = {}
  xla = Impl(quantizer="xla")  # the reference quantizers, one `quantize` each (a GPU fuses views into kernels)
  for route in ("fp8", "nvfp4_sr"):  # nvfp4_sr: six operands, six quantizations (no view is shared)
    loss = lambda x, w, route=route: jnp.sum(fp4_dot(x, w, route=route, key=jax.random.key(0), impl=xla) ** 2)
    calls[route] = len(re.findall(r"name=quantize\b", str(jax.make_jaxpr(jax.grad(loss, (0, 1)))(x, w))))
  assert calls == {"fp8": 3, "nvfp4_sr": 6}


def test_residuals_are_fp8():
  """The backward keeps X and W as FP8 (one byte each) plus a float32 factor each, and the key."""
  x, w, _ = _data(64, 32, 48, jnp.bfloat16)
  _, vjp_fn = jax.vjp(lambda x, w: fp4_dot(x, w, route="fp8"), x, w)
  leaves = [jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a
            for a in jax.tree_util.tree_leaves(vjp_fn)]
  dtypes = sorted(str(a.dtype) for a in leaves)
  assert dtypes == ["float32", "float32", "float8_e4m3fn", "float8_e4m3fn", "uint32"], dtypes
  assert sum(a.size * a.dtype.itemsize for a in leaves) == x.size + w.size + 8 + 8


def test_listed_and_needs_no_padding():
  assert "fp8" in fp4jax.routes.names() and fp4jax.routes.get("fp8").name == "fp8"
  assert padding_multiples(fp4jax.routes.get("fp8")) == (1, 1, 1)
  x, w, _ = _data(1, 7, 3)
  np.testing.assert_allclose(fp4_dot(x[0], w, route="fp8"), reference_vjp(x, w, jnp.ones((1, 3)))[0][0][0],
                             rtol=1e-6)


@pytest.mark.gpu
def test_gpu_forward_is_one_cublaslt_fp8_gemm():
  """On a GPU the forward is ONE cuBLASLt FP8 GEMM with both scales folded in (no other GEMM), forward and
  backward three, and the numbers are the dequantized reference's up to FP8 fast accumulation and bf16 output."""
  m, k, n = 4096, 2048, 3072  # Llama-like: XLA may pick a Triton fusion for small GEMMs
  x, w, dy = _data(m, k, n, jnp.bfloat16)
  fwd = jax.jit(lambda x, w: fp4_dot(x, w, route="fp8"))
  assert gemm_targets(fwd.lower(x, w).compile().as_text()) == ["__cublas$lt$matmul$f8"]
  fwd_bwd = jax.jit(lambda x, w, dy: _vjp(x, w, dy))
  assert gemm_targets(fwd_bwd.lower(x, w, dy).compile().as_text()) == ["__cublas$lt$matmul$f8"] * 3
  # bf16 output rounding (2^-9 |ref|, doubled) plus FP8 fast accumulation in fprop: about 7e-4 |A| |B| measured
  # for the MXFP4 path (docs/BENCHMARKS.md); dgrad and wgrad promote their sums to float32.
  for out, (ref, absprod), gemm in zip(fwd_bwd(x, w, dy), reference_vjp(x, w, dy), ("fprop", "dgrad", "wgrad")):
    err = np.abs(np.asarray(out, np.float64) - ref)
    assert np.all(err <= 2**-8 * np.abs(ref) + 2**-9 * absprod), (gemm, float((err / absprod).max()))


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_operand_is_the_codes_through_uint8_bits(fmt):
  # The GEMM reads the float8 values from their bytes (ops/gemm/fp8.py: a cast pair folded away by XLA would
  # leave a float32 GEMM on unquantized values); the numbers are the codes', NaN where the tensor is NaN.
  from fp4jax.ops.gemm.fp8 import fp8_operand  # pylint: disable=g-import-not-at-top
  x, _, _ = _data(64, 96, 8)
  q = quantize(x, fmt)
  bits = lambda v: np.asarray(jax.lax.bitcast_convert_type(v, jnp.uint8))
  np.testing.assert_array_equal(bits(jax.jit(fp8_operand)(q)), bits(q.codes))
  assert np.isnan(np.asarray(fp8_operand(quantize(x.at[3, 5].set(jnp.nan), fmt)), np.float32)).all()
  hlo = jax.jit(lambda x, w: fp4_dot(x, w, route="fp8", impl=Impl(gemm="fp8"))).lower(x, x.T).as_text()
  assert re.search(r"bitcast_convert .*tensor<64x96xui8>\) -> tensor<64x96xf8E4M3FN>", hlo), "no bytes -> float8"
