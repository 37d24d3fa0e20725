"""Route diagnostics: the metrics on cases whose answer is known, the stress inputs' promised properties, the
captured x, w, dy of a model's linears against jax.grad, and `python -m bench diagnose` end to end."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bench.__main__ import main
from fp4jax import Route, diagnostics
from fp4jax.numerics.reference import dequantize, quantize
from fp4jax.numerics.spec import OperandSpec
from fp4jax.nn import RouteRules
from fp4jax.nn.diagnostics import capture_linears, linear_paths
from fp4jax.nn.llama import Llama, LlamaConfig

M, K, N = 64, 128, 64


def _case(seed: int = 0) -> diagnostics.GemmInputs:
  return diagnostics.stress_cases(M, K, N, seed)["normal"]


def _rows(rows: list[dict], kind: str) -> dict[str, dict]:
  return {r["name"]: r for r in rows if r["kind"] == kind}


def test_bf16_route_is_exact():
  rows = diagnostics.operand_report(*_case(), "bf16", samples=np.int64(2))  # a NumPy int counts as one
  assert json.loads(json.dumps(rows)) == rows
  assert len(rows) == 9
  for r in _rows(rows, "operand").values():
    assert (r["rel_sq_error"], r["zero_fraction"], r["clip_fraction"]) == (0.0, 0.0, 0.0)
  for r in _rows(rows, "gemm").values():
    assert r["cosine"] == pytest.approx(1.0, abs=1e-6) and r["rel_error"] < 1e-6 and r["deterministic"]


def test_non_finite_operands_and_bad_arguments():
  """A NaN or inf operand gives NaN metrics, never the 0.0 of a lossless one; bad arguments are named."""
  x, w, dy = (np.array(a) for a in _case())
  for bad in (np.nan, np.inf):
    x[0, 0] = bad
    rows = diagnostics.operand_report(x, w, dy, "mxfp4_rtn", samples=1)
    assert math.isnan(_rows(rows, "operand")["fprop_x"]["rel_sq_error"])
    assert math.isnan(_rows(rows, "gemm")["fprop"]["cosine"])
  x, w, dy = _case()
  with pytest.raises(ValueError, match="operand_report needs a key"):
    diagnostics.operand_report(x, w, dy, "nvfp4", key=0)
  with pytest.raises(ValueError, match="samples must be an int >= 1, got 2.5"):
    diagnostics.operand_report(x, w, dy, "mxfp4_rtn", samples=2.5)
  with pytest.raises(ValueError, match="needs non-empty operands"):
    diagnostics.operand_report(x[:0], w, dy[:0], "mxfp4_rtn")
  with pytest.raises(ValueError, match="role 'foo' is not an operand role"):
    diagnostics.operand_metrics(x, OperandSpec("mxfp4"), 1, jax.random.key(0), role="foo")
  with pytest.raises(ValueError, match="operand_metrics .* needs a key"):
    diagnostics.operand_metrics(x, OperandSpec("mxfp4", rounding="sr"), 1, None, role="fprop_x")
  with pytest.raises(ValueError, match="operand_metrics .* needs a key"):
    diagnostics.operand_metrics(x, OperandSpec("mxfp4"), 1, jnp.zeros(2), role="fprop_x")


def test_mxfp4_sr_report():
  """mxfp4_sr: RNE forward (deterministic), SR on every backward operand (unbiased dgrad and wgrad), 64 keys;
  one test so that its compiled GEMMs are shared by the all-zero case (same route, shapes and samples)."""
  x, w, dy = _case()
  rows = diagnostics.operand_report(x, w, dy, "mxfp4_sr", jax.random.key(3), samples=64)
  gemms, operands = _rows(rows, "gemm"), _rows(rows, "operand")
  fprop = gemms["fprop"]
  assert fprop["deterministic"] and fprop["spread"] == 0.0 and fprop["unbiased_bias"] == 0.0
  assert fprop["bias"] == pytest.approx(fprop["rel_error"], rel=1e-5)
  assert 0.9 < fprop["cosine"] < 1.0
  for name in ("dgrad", "wgrad"):
    g = gemms[name]
    assert not g["deterministic"] and g["spread"] > 0 and g["samples"] == 64
    assert g["unbiased_bias"] == pytest.approx(g["rel_error"] / 8)
    # Unbiased: the mean over 64 keys is ~8x closer than one sample, as error / sqrt(samples) predicts.
    assert g["bias"] < 0.3 * g["rel_error"], g
    assert 0.5 < g["bias"] / g["unbiased_bias"] < 2.0, g
  # The operand rows are those of a direct quantization (fprop_x: MXFP4 RNE, OCP scale, along K).
  direct = dequantize(quantize(jnp.asarray(x), "mxfp4", axis=1))
  expected = float(jnp.sum((direct - x) ** 2) / jnp.sum(x ** 2))
  assert operands["fprop_x"]["rel_sq_error"] == pytest.approx(expected, rel=1e-5)
  assert 0 < operands["fprop_x"]["zero_fraction"] < 0.5
  assert operands["fprop_x"]["clip_fraction"] > 0  # OCP: block maxima above 6 clip
  assert operands["dgrad_dy"]["clip_fraction"] == 0.0  # SR takes the no-clip scale
  # All-zero inputs: zero error, nothing relative to divide by, no NaN.
  zeros = [np.zeros_like(a) for a in (x, w, dy)]
  for r in diagnostics.operand_report(*zeros, "mxfp4_sr", samples=64):
    assert not any(math.isnan(v) for v in r.values() if isinstance(v, float)), r
    assert r.get("rel_sq_error", 0.0) == 0.0 and r.get("zero_fraction", 0.0) == 0.0 and r.get("bias", 0.0) == 0.0
    assert r.get("cosine", 1.0) == 1.0


@pytest.mark.parametrize("rule,clip", [("ocp", 1 / 32), ("noclip", 0.0)])
def test_zero_and_clip_fractions_known_answer(rule, clip):
  # Each 32-block: one maximum 7.5 (OCP: E = floor(log2 7.5) - 2 = 0, so 7.5 / 2^0 > 6 clips) and 31 values of
  # 0.2, below half the smallest step of either scale (0.25 under E = 0, 0.5 under no-clip E = 1): zero codes.
  v = np.full((4, 64), 0.2, np.float32)
  v[:, ::32] = 7.5
  m = diagnostics.operand_metrics(jnp.asarray(v), OperandSpec("mxfp4", scale_rule=rule), 1, jax.random.key(0),
                                  "fprop_x")
  assert m["zero_fraction"] == pytest.approx(31 / 32)
  assert m["clip_fraction"] == pytest.approx(clip)


def test_stress_inputs_have_their_properties():
  t = diagnostics.stress_inputs((64, 128), seed=5)
  assert set(t) == set(diagnostics.STRESS_KINDS)
  assert all(a.dtype == np.float32 for a in t.values())
  assert all(a.shape == (64, 128) for k, a in t.items() if k != "ragged_k")
  assert t["ragged_k"].shape[0] == 64 and t["ragged_k"].shape[1] % 16 != 0
  assert 0.85 < np.mean(t["sparse"] == 0) < 0.95
  tiles = np.abs(t["zero_blocks"]).reshape(2, 32, 4, 32).max(axis=(1, 3))
  assert (tiles == 0).any() and (tiles > 0).any()
  assert np.mean(t["zero_blocks"] == 0) == pytest.approx(np.mean(tiles == 0))  # zeros come only as whole tiles
  assert 1e-7 < np.std(t["tiny"]) < 1e-5
  assert ((np.abs(t["outliers"]) >= 1e3).sum(axis=1) == 1).all()
  assert np.max(np.abs(t["heavy_tailed"])) > 10 * np.std(t["normal"])
  cases = diagnostics.stress_cases(32, 64, 32)
  assert all(c.x.shape[1] == c.w.shape[0] and c.dy.shape == (32, 32) for c in cases.values())


def test_capture_linears_matches_jax_grad():
  cfg = LlamaConfig.preset("tiny", n_layers=1, ffn_dim=64, vocab_size=64)
  model = Llama(cfg, rules=RouteRules.standard("bf16", n_layers=cfg.n_layers), rngs=nnx.Rngs(0),
                dtype=jnp.float32)
  tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)
  names = ["layers.0.attn.q", "layers.0.mlp.down", "lm_head"]
  captured = capture_linears(model, tokens, None, names=names)
  assert list(captured) == names
  assert all(type(m).__name__ == "FP4Linear" for m in linear_paths(model).values())  # classes restored

  def loss(model):
    logp = jax.nn.log_softmax(model(tokens[:, :-1]), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

  grads = nnx.jit(nnx.grad(loss))(model)
  layers = linear_paths(model)
  for name, (x, w, dy) in captured.items():
    module = layers[name]
    assert x.shape == (16, module.in_features) and dy.shape == (16, module.out_features)
    np.testing.assert_array_equal(w, module.kernel[...])
    dw = grads
    for part in name.split("."):
      dw = dw[int(part) if part.isdigit() else part]
    dw = dw["kernel"][...]
    np.testing.assert_allclose(x.T @ dy, dw, rtol=1e-4, atol=1e-6 * float(jnp.max(jnp.abs(dw))))


def test_cli_tiny_preset(tmp_path, capsys):
  main(["--compile-cache", "off", "diagnose", "--routes", "bf16", "mxfp4_sr", "--tokens", "2x16", "--samples", "2",
        "--linears", "layers.0.attn.q", "--out", str(tmp_path)])
  printed = capsys.readouterr().out
  assert "layers.0.attn.q" in printed and "mxfp4_sr" in printed and "wgrad" in printed
  assert "[1/1] layers.0.attn.q" in printed  # progress, one line per captured linear
  log = json.loads((tmp_path / "diagnose.json").read_text())
  assert len(log["rows"]) == 2 * 9 and (tmp_path / "diagnose.png").stat().st_size > 0


def test_cli_stress(tmp_path, capsys):
  main(["--compile-cache", "off", "diagnose", "--stress", "--shape", "32", "64", "32", "--routes", "bf16",
        "mxfp4_sr", "--samples", "2", "--out", str(tmp_path)])
  rows = json.loads((tmp_path / "diagnose.json").read_text())["rows"]
  assert {r["input"] for r in rows} == set(diagnostics.STRESS_KINDS)
  ragged = [r for r in rows if r["input"] == "ragged_k" and r["kind"] == "gemm"]
  assert len(ragged) == 6 and all(r["cosine"] > 0.9 for r in ragged), ragged  # fp4_dot pads K inside
  assert "tiny" in capsys.readouterr().out


@pytest.fixture(scope="module")
def _tiny_llama():
  cfg = LlamaConfig.preset("tiny", n_layers=1, dim=32, n_heads=2, n_kv_heads=1, ffn_dim=32, vocab_size=64)
  return Llama(cfg, rules=RouteRules.standard("bf16", n_layers=1), rngs=nnx.Rngs(0), dtype=jnp.float32)


@pytest.mark.parametrize("tokens, match", [
    (jnp.zeros((1, 9), jnp.int32).at[0, 3].set(64), r"ids in \[0, 64\], outside \[0, vocab_size=64\)"),  # NaN dy
    (jnp.zeros((1, 9), jnp.int32).at[0, 3].set(-1), r"ids in \[-1, 0\], outside \[0, vocab_size=64\)"),
    (np.zeros((1, 9), np.int64), None),  # numpy ids are fine
    (jnp.zeros((2, 1), jnp.int32), r"needs B >= 1 and T >= 1 .* got shape \(2, 1\)"),  # was empty [0, K] arrays
    (jnp.zeros((0, 9), jnp.int32), r"needs B >= 1 and T >= 1 .* got shape \(0, 9\)"),
    (jnp.zeros((9,), jnp.int32), r"tokens takes an integer array \[B, T \+ 1\] .* got ArrayImpl int32\[9\]"),
    (jnp.zeros((1, 9), jnp.float32), r"tokens takes an integer array .* got ArrayImpl float32\[1, 9\]"),
    ([[1, 2, 3]], r"tokens takes an integer array .* got list"),
])
def test_capture_linears_checks_tokens(_tiny_llama, tokens, match):
  if match is None:
    assert capture_linears(_tiny_llama, tokens, names=["lm_head"])["lm_head"].dy.shape == (8, 64)
  else:
    with pytest.raises(ValueError, match=match):
      capture_linears(_tiny_llama, tokens, names=["lm_head"])


def test_capture_linears_checks_traced_tokens_by_shape_only(_tiny_llama):
  """Traced tokens have no values to check; their shape and dtype still are."""
  dy = jax.jit(lambda t: capture_linears(_tiny_llama, t, names=["lm_head"])["lm_head"].dy)(
      jnp.ones((1, 5), jnp.int32))
  assert dy.shape == (4, 64)
  with pytest.raises(ValueError, match="needs B >= 1 and T >= 1"):
    jax.jit(lambda t: capture_linears(_tiny_llama, t))(jnp.ones((1, 1), jnp.int32))


def test_capture_linears_names_must_be_a_list(_tiny_llama):
  with pytest.raises(TypeError, match=r"names takes a list of module paths, got the string 'lm_head': use "
                                      r"\['lm_head'\]"):
    capture_linears(_tiny_llama, jnp.ones((1, 5), jnp.int32), names="lm_head")


def test_saved_operands_drawn_at_random_are_not_deterministic():
  """With requantize_saved the backward's X and W are re-quantized from the fprop's FP4 values: SR in the
  forward makes dgrad and wgrad vary by key even where their own recipes are RNE."""
  sr, rne = OperandSpec("mxfp4", rounding="sr"), OperandSpec("mxfp4")
  route = Route("sr_fprop_saved", fprop_x=sr, fprop_w=sr, dgrad_dy=rne, dgrad_w=rne, wgrad_dy=rne, wgrad_x=rne,
                requantize_saved=True)
  x, w, dy = _case()
  gemms = _rows(diagnostics.operand_report(x, w, dy, route, jax.random.key(1), samples=4), "gemm")
  for name in ("fprop", "dgrad", "wgrad"):
    assert not gemms[name]["deterministic"] and gemms[name]["spread"] > 0, (name, gemms[name])
