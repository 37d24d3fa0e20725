"""fp8 GEMM backend: the MXFP4 -> E4M3 re-encoding is exact (and its error bounded beyond span 14), and the
GEMM equals the emulated product up to float32 accumulation order."""


import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax import bench
from fp4jax.formats import E2M1_VALUES
from fp4jax.kernels import gemm_emulated, gemm_fp8
from fp4jax.qtensor import QTensor, pack_codes
from fp4jax.reference import dequantize


def _mx(codes: np.ndarray, exps: np.ndarray) -> QTensor:
  """MXFP4 QTensor [R, K] from uint8 codes [R, K] and block exponents [R, K/32] (None entries: NaN)."""
  r, k = codes.shape
  scales = np.where(np.isnan(exps), 255, np.nan_to_num(exps) + 127).astype(np.uint8)
  return QTensor(pack_codes(jnp.asarray(codes, jnp.uint8)), jnp.asarray(scales), None, "mxfp4", 1, (r, k))


def _random_mx(seed: int, r: int, k: int, span: int, lo: int = -20, hi: int = 20) -> QTensor:
  rng = np.random.default_rng(seed)
  codes = rng.integers(0, 16, (r, k))
  e_row = rng.integers(lo, hi + 1, (r, 1))
  exps = (e_row - rng.integers(0, span + 1, (r, k // 32))).astype(np.float64)
  exps[:, 0] = e_row[:, 0] - span  # every row spans exactly `span`
  exps[:, -1] = e_row[:, 0]
  return _mx(codes, exps)


def _encoded(op: gemm_fp8.Fp8Operand) -> np.ndarray:
  return np.asarray(op.values.astype(jnp.float32)) * np.asarray(op.row_scale)[:, None]


def _ref_f32(q: QTensor) -> np.ndarray:
  return np.asarray(dequantize(q, jnp.float32))


@pytest.mark.parametrize("span", [0, 3, 14])
def test_mx_to_fp8_exact_within_span_14(span):
  q = _random_mx(span, 16, 256, span)
  op = gemm_fp8.mx_to_fp8(q)
  assert op.values.dtype == jnp.float8_e4m3fn and op.values.shape == (16, 256)
  assert op.row_scale.dtype == jnp.float32 and op.row_scale.shape == (16,)
  np.testing.assert_array_equal(_encoded(op), _ref_f32(q))
  e_row = np.asarray(q.scales, np.int32).max(axis=1) - 127
  np.testing.assert_array_equal(np.asarray(op.row_scale), np.ldexp(1.0, e_row - 6).astype(np.float32))
  assert np.abs(np.asarray(op.values.astype(jnp.float32))).max() <= 384
  assert bool(jnp.all(gemm_fp8.span_ok(q)))


def test_mx_to_fp8_beyond_span_14_rounds_small_blocks():
  """Blocks 2^15+ below the row max round (RNE) to the E4M3 subnormal grid: error <= 2^(e_row - 16)."""
  q = _random_mx(1, 16, 256, 20)
  op = gemm_fp8.mx_to_fp8(q)
  exps = np.asarray(q.scales, np.int32) - 127  # [R, K/32]
  e_row = exps.max(axis=1, keepdims=True)
  d = np.repeat(e_row - exps, 32, axis=1)  # [R, K]
  enc, ref = _encoded(op), _ref_f32(q)
  np.testing.assert_array_equal(enc[d <= 14], ref[d <= 14])
  err = np.abs(enc - ref)
  assert np.all(err <= np.ldexp(1.0, np.repeat(e_row, 256, axis=1) - 16))
  assert np.all(enc[d >= 19] == 0) and np.any(enc[d == 18] != 0)
  assert np.any(err[d == 15] > 0)  # the rounding really happens
  assert not bool(jnp.any(gemm_fp8.span_ok(q)))


def test_mx_to_fp8_round_to_nearest_even_at_span_15():
  """d = 15: 0.5 -> 2^-10 ties to 0, 1 -> 2^-9 exact, 1.5 -> 1.5 * 2^-9 ties to 2^-8 (in row_scale units)."""
  codes = np.zeros((1, 64), np.int64)
  codes[0, :4] = [1, 2, 3, 4]  # 0.5, 1, 1.5, 2 in the small block
  codes[0, 32] = 7  # 6 in the large block
  op = gemm_fp8.mx_to_fp8(_mx(codes, np.array([[0.0, 15.0]])))
  np.testing.assert_array_equal(np.asarray(op.values[0, :4].astype(jnp.float32)),
                                [0.0, 2.0**-9, 2.0**-8, 2.0**-8])
  assert float(op.row_scale[0]) == 2.0**9


def test_mx_to_fp8_zero_rows_nan_blocks_and_tiny_rows():
  rng = np.random.default_rng(3)
  codes = rng.integers(0, 16, (4, 64))
  codes[1] = 0  # a zero row
  exps = np.array([[3.0, 1.0], [5.0, 5.0], [np.nan, 2.0], [-127.0, -125.0]])
  q = _mx(codes, exps)
  op = gemm_fp8.mx_to_fp8(q)
  enc, ref = _encoded(op), _ref_f32(q)
  assert np.all(enc[1] == 0)
  bits = np.asarray(jax.lax.bitcast_convert_type(op.values, jnp.uint8))
  assert np.all(bits[2, :32] == 0x7F) and np.isnan(float(op.row_scale[2]))
  assert np.all(np.isnan(enc[2]))
  assert float(op.row_scale[3]) == 2.0**-126  # e_row floored at -120: a normal float32 row scale
  np.testing.assert_array_equal(enc[[0, 1]], ref[[0, 1]])
  # Row 3 holds float32 subnormals, which dequantize flushes on CPU: compare with the exact float64 values.
  e2m1 = np.array(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))
  exact = e2m1[codes[3]] * np.ldexp(1.0, np.repeat(exps[3], 32).astype(int))
  np.testing.assert_array_equal(np.asarray(op.values[3].astype(jnp.float32), np.float64) * 2.0**-126, exact)


def _bound(a: QTensor, b: QTensor, k: int) -> np.ndarray:
  """|diff| bound of two float32 sums of the same exact products: 2 K 2^-24 |A| |B|^T, + outer rounding."""
  absprod = gemm_emulated.gemm(bench._abs(a), bench._abs(b), out_dtype=jnp.float32)
  return np.asarray(2 * k * 2.0**-24 * absprod * (1 + 2.0**-20))


@pytest.mark.parametrize("fmt_a,fmt_b", [("mxfp4", "mxfp4"), ("nvfp4", "nvfp4"), ("nvfp4_tile", "nvfp4_tile"),
                                         ("mxfp4", "nvfp4"), ("nvfp4", "mxfp4")])
def test_gemm_matches_emulated(fmt_a, fmt_b):
  """Both compute the same exact products in float32; only the accumulation order (and, for NVFP4, where the
  outer factor is rounded) differs, so |fp8 - emulated| <= 2 K 2^-24 (|A| |B|^T) (plus 3 roundings of the outer
  product, covered by 2^-20 relative slack)."""
  m, n, k = 24, 40, 256
  ka, kb = jax.random.split(jax.random.key(len(fmt_a) * 10 + len(fmt_b)))
  a, b = bench.random_qtensor(ka, fmt_a, m, k, span=10), bench.random_qtensor(kb, fmt_b, n, k, span=10)
  assert gemm_fp8.supports(a, b)
  ref = np.asarray(gemm_emulated.gemm(a, b, out_dtype=jnp.float32))
  out = np.asarray(jax.jit(lambda a, b: gemm_fp8.gemm(a, b, out_dtype=jnp.float32))(a, b))
  assert out.shape == (m, n) and out.dtype == np.float32
  assert np.all(np.abs(out - ref) <= _bound(a, b, k))
  out16 = jax.jit(lambda a, b: gemm_fp8.gemm(a, b, out_dtype=jnp.bfloat16))(a, b)
  assert out16.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out16, np.float32), ref, rtol=2**-7, atol=float(_bound(a, b, k).max()))


@pytest.mark.parametrize("span_a,span_b", [(3, 14), (14, 0), (15, 2), (2, 20)])
def test_tensor_scaled_path_taken_only_when_exact(span_a, span_b):
  """One factor per tensor (scales fused into the cuBLASLt GEMM) is used exactly when both tensors span <= 2^14;
  otherwise the per-row path runs. Either way the result equals the emulated product up to summation order."""
  m, n, k = 16, 24, 128
  a = _random_mx(11 + span_a, m, k, span=0, lo=0, hi=0)
  b = _random_mx(17 + span_b, n, k, span=0, lo=0, hi=0)
  # Spread whole rows apart so the *tensor* span, not any row span, is span_a / span_b.
  a = _random_mx_rows(a, span_a)
  b = _random_mx_rows(b, span_b)
  fast = bool(gemm_fp8.tensor_span_ok(a) & gemm_fp8.tensor_span_ok(b))
  assert fast == (span_a <= 14 and span_b <= 14)
  if fast:
    values, factor = gemm_fp8.fp8_tensor_operand(a)
    np.testing.assert_array_equal(np.asarray(values.astype(jnp.float32)) * float(factor), _ref_f32(a))
  ref = np.asarray(gemm_emulated.gemm(a, b, out_dtype=jnp.float32))
  out = np.asarray(jax.jit(lambda a, b: gemm_fp8.gemm(a, b, out_dtype=jnp.float32))(a, b))
  assert np.all(np.abs(out - ref) <= _bound(a, b, k))


def _random_mx_rows(q: QTensor, span: int) -> QTensor:
  """q with row r's block exponents lowered by r * span // (R - 1): the tensor spans `span`, each row 0."""
  r = q.scales.shape[0]
  drop = (np.arange(r) * span // (r - 1)).astype(np.int32)[:, None]
  scales = (np.asarray(q.scales, np.int32) - drop).astype(np.uint8)
  return QTensor(q.codes, jnp.asarray(scales), None, q.fmt, q.axis, q.shape)


def test_gemm_nan_rows_and_columns():
  rng = np.random.default_rng(5)
  a = _mx(rng.integers(0, 16, (8, 64)), np.array([[0.0, 1.0]] * 8))
  b = _mx(rng.integers(0, 16, (6, 64)), np.array([[2.0, -3.0]] * 6))
  a = QTensor(a.codes, a.scales.at[3, 1].set(255), None, "mxfp4", 1, a.shape)
  b = QTensor(b.codes, b.scales.at[4, 0].set(255), None, "mxfp4", 1, b.shape)
  out = np.asarray(gemm_fp8.gemm(a, b, out_dtype=jnp.float32))
  ref = np.asarray(gemm_emulated.gemm(a, b, out_dtype=jnp.float32))
  expect_nan = np.zeros((8, 6), bool)
  expect_nan[3, :] = expect_nan[:, 4] = True
  np.testing.assert_array_equal(np.isnan(out), expect_nan)
  np.testing.assert_array_equal(np.isnan(ref), expect_nan)
  np.testing.assert_allclose(out[~expect_nan], ref[~expect_nan], rtol=1e-6)


def test_supports_and_errors():
  key = jax.random.key(0)
  a = bench.random_qtensor(key, "mxfp4", 4, 64)
  assert not gemm_fp8.supports(a, bench.random_qtensor(key, "mxfp4", 4, 128))  # K differs
  with pytest.raises(ValueError, match="does not support"):
    gemm_fp8.gemm(a, bench.random_qtensor(key, "mxfp4", 4, 128), out_dtype=jnp.float32)
  with pytest.raises(ValueError, match="MXFP4"):
    gemm_fp8.mx_to_fp8(bench.random_qtensor(key, "nvfp4", 4, 64))


def test_hlo_check_parser():
  text = ('%c = (bf16[8,8]{1,0}, s8[0]{0}) custom-call(f8e4m3fn[8,32]{1,0} %a, f8e4m3fn[8,32]{1,0} %b), '
          'custom_call_target="__cublas$lt$matmul$f8"\n'
          '%d = (bf16[8,8]{1,0}, s8[0]{0}) custom-call(bf16[8,32]{1,0} %a, bf16[8,32]{1,0} %b), '
          'custom_call_target="__cublas$gemm"')
  assert bench.cublas_fp8_gemms(text) == ["__cublas$lt$matmul$f8"]
  by_name = ('%p.1 = f8e4m3fn[8,32]{1,0} parameter(0)\n%f = f8e4m3fn[8,32]{1,0} fusion(%x), kind=kLoop\n'
             'ROOT %c.2 = (bf16[8,8]{1,0}, s8[0]{0}) custom-call(%p.1, %f), '
             'custom_call_target="__cublas$lt$matmul$f8"\n'
             '%g = bf16[8,32]{1,0} parameter(1)\n'
             '%d = (bf16[8,8]{1,0}, s8[0]{0}) custom-call(%g, %g), custom_call_target="__cublas$lt$matmul"')
  assert bench.cublas_fp8_gemms(by_name) == ["__cublas$lt$matmul$f8"]


def test_bench_dot_small_smoke(tmp_path, capsys):
  out = tmp_path / "dot.json"
  bench.main(["dot", "--small", "--shapes", "2", "--routes", "bf16", "--iters", "1", "--warmup", "1",
              "--out", str(out)])
  printed = capsys.readouterr().out
  assert "HLO check" in printed and "fp4 gemm fp8 backend MXFP4" in printed
  import json  # pylint: disable=g-import-not-at-top
  rows = json.loads(out.read_text())["rows"]
  assert all("ms" in r for r in rows), [r for r in rows if "ms" not in r]
  assert {r["name"] for r in rows} >= {"bf16 dot", "fp8 per-tensor dot (fast accum)",
                                       "fp4 gemm fp8 backend MXFP4", "fp4 gemm fp8 backend NVFP4 (bf16)",
                                       "fp4 gemm emulated MXFP4"}
  checks = json.loads(out.read_text())["check_vs_emulated"]
  assert all(c["nan_pattern_equal"] and c["max_diff_over_bound"] <= 1 for c in checks.values())


def test_bench_compile_small_smoke(capsys):
  bench.main(["compile", "--small", "--shapes", "0", "--routes", "mxfp4"])
  lines = [l for l in capsys.readouterr().out.splitlines() if "mxfp4" in l and "compile" in l]
  assert [l.split()[3] for l in lines] == ["fwd", "fwd+bwd"], lines


def test_bench_quantize_interpret_new_variants(tmp_path, capsys):
  # The per-view and NVFP4 variants check bit for bit against the reference, here in interpret mode.
  from fp4jax.kernels import bench_quantize  # pylint: disable=g-import-not-at-top
  rc = bench_quantize.main(["--interpret", "--shapes", "64x64", "--variants", "views dY sr|rne,nv dY sr|rne",
                            "--out", str(tmp_path)])
  table = capsys.readouterr().out
  assert rc == 0 and "fused views dY sr|rne" in table and "fused nv dY sr|rne" in table
  assert "MISMATCH" not in table


def test_bench_quantize_rejects_unknown_variants_and_knows_the_gpu_script_ones(capsys):
  from fp4jax.kernels import bench_quantize  # pylint: disable=g-import-not-at-top
  with pytest.raises(SystemExit):
    bench_quantize.main(["--interpret", "--variants", "rne/ocp,nv rne|rnee"])
  assert "unknown variants ['nv rne|rnee']" in capsys.readouterr().err
  script = open(os.path.join(os.path.dirname(__file__), "..", "scripts", "gpu_bench.sh")).read()
  default = re.search(r"QUANTIZE_VARIANTS:-([^}]*)\}", script).group(1).split(",")
  assert set(default) <= {v[0] for v in bench_quantize.VARIANTS}


def test_bench_quantize_passes_arguments_through(monkeypatch):
  seen = []
  monkeypatch.setattr(bench.bench_quantize, "main", seen.append)
  bench.main(["quantize", "--shapes", "128x256", "--help"])
  assert seen == [["--shapes", "128x256", "--help"]]
  with pytest.raises(SystemExit):
    bench.main(["dot", "--no-such-flag"])


@pytest.mark.gpu
def test_fp8_path_is_cublas_fp8_gemm_on_gpu():
  key = jax.random.key(0)
  # At Llama-size shapes (XLA may pick a Triton fusion for small GEMMs: 256x128x512 failed on the H200).
  a, b = bench.random_qtensor(key, "mxfp4", 4096, 4096), bench.random_qtensor(key, "mxfp4", 4096, 4096)
  hlo = jax.jit(lambda a, b: gemm_fp8.gemm(a, b, out_dtype=jnp.bfloat16)).lower(a, b).compile().as_text()
  assert bench.cublas_fp8_gemms(hlo)
