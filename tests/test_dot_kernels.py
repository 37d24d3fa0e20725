"""fp4_dot through the fused Pallas quantizers: the reference quantizers' numbers, one kernel launch per array
where a kernel covers both of its views, and no kernel with Impl(quantizer="xla")."""

import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import compile as compile_bench
from fp4jax import Impl
from fp4jax.dot import fp4_dot
from fp4jax.numerics.hadamard import hadamard
from fp4jax.ops import gemm as gemm_lib
from fp4jax.ops.quantize import pallas, xla
from fp4jax.ops.quantize.pallas import mxfp4, nvfp4
from jaxprs import equations

INTERPRET, XLA = Impl(quantizer="interpret"), Impl(quantizer="xla")


def _pallas_calls(jaxpr) -> list:
  """pallas_call equations in a jaxpr, listing each call of a shared sub-jaxpr (printed once) every time."""
  return [eqn for eqn in equations(jaxpr, into_kernels=False) if eqn.primitive.name == "pallas_call"]


def _pallas_launches(jaxpr) -> int:
  return len(_pallas_calls(jaxpr))


def _value_and_grads(route, x, w, key, impl):
  f = lambda x, w: jnp.sum(fp4_dot(x, w, route=route, key=key, impl=impl).astype(jnp.float32) ** 2)
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, w)


@pytest.mark.parametrize("route,m,k,n", [("mxfp4", 64, 64, 32), ("mxfp4_sr", 64, 64, 32),
                                         ("mxfp4_h32", 64, 64, 32), ("nvfp4", 64, 64, 32),
                                         ("nvfp4_tile_local", 64, 64, 32), ("quartet2", 256, 128, 128)])
def test_kernels_match_reference_in_fp4_dot(route, m, k, n):
  """The value and both gradients; quartet2 includes its MS-EDEN kernels on the float32 X^ and W^."""
  kx, kw, kk = jax.random.split(jax.random.key(7), 3)
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(kw, (k, n), jnp.float32) * 0.1).astype(jnp.bfloat16)
  ref = _value_and_grads(route, x, w, kk, XLA)
  out = _value_and_grads(route, x, w, kk, INTERPRET)
  for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(out)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_one_pass_per_array(monkeypatch):
  """X along K (fprop) and along M (wgrad, H32) come from ONE fused pass, dY along N (dgrad, SR) and along M
  (wgrad, H32) from another; W (32x32 tiles, read by fprop and dgrad) from a third."""
  calls = []
  real = pallas.VIEW_KERNELS["mxfp4"]
  monkeypatch.setitem(pallas.VIEW_KERNELS, "mxfp4", lambda x, row, col, *a, **k: calls.append((row, col)) or
                      real(x, row, col, *a, **k))
  x, w = jnp.ones((64, 64), jnp.bfloat16), jnp.ones((64, 32), jnp.bfloat16)
  key = jax.random.key(0)
  jax.clear_caches()  # fp4_dot's jitted passes may be traced already by another test: trace them again here
  jaxpr = jax.make_jaxpr(lambda x, w: jax.vjp(lambda x, w: fp4_dot(x, w, route="mxfp4_h32", key=key,
                                                                   impl=INTERPRET), x, w)[1](
      jnp.ones((64, 32), jnp.bfloat16)))(x, w)
  assert _pallas_launches(jaxpr.jaxpr) == 3  # one kernel launch per array: X, W, dY
  assert [(r.rounding, r.transform, c.rounding, c.transform, r.tile_2d) for r, c in calls] == [
      ("rne", None, "rne", "h32", False),  # X: fprop + wgrad
      ("rne", None, "rne", None, True),  # W: 32x32 tiles
      ("sr", None, "rne", "h32", False),  # dY: dgrad + wgrad
  ]


# Kernel launches in one fp4_dot forward + backward: one per array read where a kernel covers its recipes.
LAUNCHES = {
    "mxfp4": 3,  # X (fprop + wgrad), W (32x32 tiles), dY (SR dgrad + RNE wgrad)
    "mxfp4_h32": 3,  # the same, the wgrad views with H32
    "nvfp4_tile_local": 3,  # X, W (dgrad + fprop views), dY (SR + RNE)
    "nvfp4": 5,  # X (fprop + RHT16 wgrad), W (16x16 tiles), dY (SR dgrad + SR RHT16 wgrad); the two RHT16
    # views' rotated amax passes
    "quartet2": 10,  # 4/6 forward X and W (one launch each); MS-EDEN X^, W^ and dY's two views: rotated amax +
    # quantizer each
}


@pytest.mark.parametrize("quantizer", ["auto", "xla"])
def test_kernels_on_a_gpu_backend_and_none_with_xla(quantizer, monkeypatch):
  """On a GPU backend "auto" quantizes every covered route through the kernels, Hadamard views included;
  "xla" leaves all of it to XLA, backward included (traced with the backend reported as "gpu"; nothing is
  compiled)."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  xla_hadamards = []
  monkeypatch.setattr(xla, "hadamard", lambda *a, **k: xla_hadamards.append(k) or hadamard(*a, **k))
  x = w = g = jnp.ones((128, 128), jnp.bfloat16)  # quartet2's RHT128 needs multiples of 128
  key = jax.random.key(0)
  trace = lambda route: jax.make_jaxpr(lambda x, w: jax.vjp(lambda x, w: fp4_dot(
      x, w, route=route, key=key, impl=Impl(quantizer=quantizer)), x, w)[1](g))(x, w).jaxpr
  launches = {route: _pallas_launches(trace(route)) for route in LAUNCHES}
  assert launches == {route: n if quantizer == "auto" else 0 for route, n in LAUNCHES.items()}
  # In XLA: X's and dY's wgrad views (H32 twice, RHT16 twice), quartet2's four RHT128 operands.
  assert len(xla_hadamards) == (0 if quantizer == "auto" else 8)


def _kernel(eqn) -> str:
  """The kernel of a pallas_call equation: its launch name (`common.launch_name`) without the digest."""
  return eqn.params["name"].rsplit("_", 1)[0]


def test_one_operand_launches_write_one_view():
  """quartet2's forward needs X and W along K only (its backward re-quantizes the dequantized values), and an
  evaluation's forward the fprop operands only: each such 4/6 or MXFP4 launch computes and writes one view
  (codes and scales: two outputs), not both views of which one was thrown away."""
  x, w = jnp.ones((128, 128), jnp.bfloat16), jnp.ones((128, 128), jnp.bfloat16)
  key = jax.random.key(0)
  trace = lambda route, f: [(_kernel(e), len(e.outvars))  # the dual-view kernels' launches
                            for e in _pallas_calls(jax.make_jaxpr(f(route))(x, w).jaxpr)
                            if _kernel(e) in (mxfp4.KERNEL_NAME, nvfp4.KERNEL_NAME)]
  train = lambda route: lambda x, w: jax.vjp(lambda x, w: fp4_dot(x, w, route=route, key=key, impl=INTERPRET),
                                             x, w)[0]
  evaluate = lambda route: lambda x, w: fp4_dot(x, w, route=route, key=key, impl=INTERPRET)
  assert trace("quartet2", train) == [(nvfp4.KERNEL_NAME, 2)] * 2
  assert trace("quartet2", evaluate) == [(nvfp4.KERNEL_NAME, 2)] * 2
  assert trace("mxfp4", evaluate) == [(mxfp4.KERNEL_NAME, 2)] * 2
  assert trace("mxfp4", train) == [(mxfp4.KERNEL_NAME, 4), (mxfp4.KERNEL_NAME, 2)]  # X both views, W tiles


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["mxfp4", "mxfp4_h32", "nvfp4", "nvfp4_tile_local", "quartet2"])
def test_gpu_kernels_match_reference_in_fp4_dot(route):
  """Compiled on the GPU: the output and both input gradients equal those of the XLA reference quantizers
  bit for bit (same operand bits, same GEMMs), and the kernels did run."""
  kx, kw, kd, kk = jax.random.split(jax.random.key(17), 4)
  x = jax.random.normal(kx, (1024, 512), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(kw, (512, 768), jnp.float32) * 0.05).astype(jnp.bfloat16)
  dy = jax.random.normal(kd, (1024, 768), jnp.float32).astype(jnp.bfloat16)

  def fwd_bwd(impl):
    def f(x, w, dy):
      y, vjp = jax.vjp(lambda x, w: fp4_dot(x, w, route=route, key=kk, impl=impl), x, w)
      return y, *vjp(dy)
    return f

  ref = jax.jit(fwd_bwd(XLA))(x, w, dy)
  assert _pallas_launches(jax.make_jaxpr(fwd_bwd(Impl()))(x, w, dy).jaxpr) == LAUNCHES[route]
  out = jax.jit(fwd_bwd(Impl()))(x, w, dy)
  for a, b in zip(ref, out):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("route,shape", [("nvfp4", (64, 64, 32)), ("nvfp4_tile_local", (64, 64, 32)),
                                         ("quartet2", (256, 128, 128))])
def test_values_form_matches_codes_in_fp4_dot(route, shape, monkeypatch):
  """With the Hopper backend's GEMMs ("fp8"), the NVFP4 operands a GEMM reads at once (X's fprop view, dY's two
  views) are quantized to bf16 values (`ops.gemm.operand_form`), the NVFP4 dual-view kernel writing them in
  place of codes: the value and both gradients equal those of quantizing every operand to codes, bit for bit."""
  m, k, n = shape
  kx, kw, kk = jax.random.split(jax.random.key(11), 3)
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(kw, (k, n), jnp.float32) * 0.1).astype(jnp.bfloat16)
  impl = Impl(quantizer="interpret", gemm="fp8")
  jax.clear_caches()
  values = _value_and_grads(route, x, w, kk, impl)
  monkeypatch.setattr(gemm_lib, "operand_form", lambda *a, **kw: "codes")
  jax.clear_caches()  # trace fp4_dot's passes again with codes only
  codes = _value_and_grads(route, x, w, kk, impl)
  for a, b in zip(jax.tree.leaves(values), jax.tree.leaves(codes)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_nvfp4_kernels_write_the_values_read_at_once():
  """nvfp4 on the Hopper backend: X's launch writes its fprop view as values (one output) and its saved wgrad
  view as codes and scales (two), W's 16x16-tile launch codes (two), dY's launch both views as values."""
  x, w, g = jnp.ones((128, 128), jnp.bfloat16), jnp.ones((128, 128), jnp.bfloat16), jnp.ones((128, 128),
                                                                                               jnp.bfloat16)
  key = jax.random.key(0)
  impl = Impl(quantizer="interpret", gemm="fp8")
  jax.clear_caches()
  jaxpr = jax.make_jaxpr(lambda x, w: jax.vjp(lambda x, w: fp4_dot(x, w, route="nvfp4", key=key, impl=impl),
                                              x, w)[1](g))(x, w).jaxpr
  outputs = [len(e.outvars) for e in _pallas_calls(jaxpr) if _kernel(e) == nvfp4.KERNEL_NAME]
  assert outputs == [3, 2, 2]  # X, W, dY


_H200_PTX = """
import jax, jax.numpy as jnp
from bench import compile as compile_bench
from fp4jax import Impl, fp4_dot
key = jax.eval_shape(lambda: jax.random.key(0))
mesh = compile_bench._deviceless_h200()
for route in ("nvfp4", "nvfp4_tile_local", "nvfp4_sr", "quartet2", "mxfp4", "fp8"):
  for impl in (Impl(), Impl(quantizer="xla")):
    def f(x, w, dy, key, impl=impl, route=route):
      y, vjp = jax.vjp(lambda x, w: fp4_dot(x, w, route=route, key=key, impl=impl), x, w)
      return y, *vjp(dy)
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((256, 512), (512, 384), (256, 384))] + [key]
    with jax.set_mesh(mesh):
      jax.jit(f).trace(*compile_bench._on(mesh, args)).lower().compile()
"""


def _compile_for_h200(code: str, flags: str) -> None:
  """Runs `code` (it compiles programs for `compile_bench._deviceless_h200`) in a fresh process with XLA `flags`."""
  env = {**os.environ, "XLA_FLAGS": f"--xla_gpu_autotune_level=0 {flags}", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                        cwd=pathlib.Path(__file__).resolve().parents[1])
  assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.skipif(not compile_bench.cuda_plugin_installed(), reason="needs JAX's CUDA plugin (no GPU)")
def test_h200_programs_hold_no_approximate_math(tmp_path):
  """The PTX that XLA:GPU compiles for an H200 (no GPU needed) of fp4_dot's forward and backward, kernels and
  reference alike, holds no approximate instruction (division, reciprocal, exp2, square root): the NVFP4 set-up
  divides correctly rounded (`ieee.div`), and a quotient narrowed to XLA's approximate float32 division once
  broke the kernels' bits on the H200 (docs/BENCHMARKS.md, "H200 session of 2026-12-05"). And the Pallas
  kernels' float32 arithmetic keeps subnormals (no `.ftz` instruction), as `pallas.nvfp4`'s exactness argument
  needs."""
  _compile_for_h200(_H200_PTX, f"--xla_dump_to={tmp_path} --xla_gpu_dump_llvmir=true --xla_dump_emitter_re=.*")
  modules = [p.read_text() for p in tmp_path.glob("*.ptx")]
  ptx = "\n".join(modules)
  assert "div.rn.f64" in ptx  # the PTX was read: ieee.div's float64 division is there
  approximate = re.findall(r"\b[a-z0-9]+\.(?:approx|full)\.[a-z0-9.]+", ptx)  # rcp, div, ex2, sqrt, ...
  assert not approximate, f"{len(approximate)} approximate instructions: {sorted(set(approximate))}"
  kernels = [m for m in modules if ".entry fp4jax_" in m]
  names = {re.search(r"\.entry (fp4jax_[a-z0-9]+_?[a-z]*)", m).group(1).rstrip("_") for m in kernels}
  assert {"fp4jax_nvfp4_quantize", "fp4jax_mxfp4_quantize", "fp4jax_eden_quantize", "fp4jax_rotated_amax"} <= names
  assert not any(".ftz" in m for m in kernels)


_H200_ROUNDED = """
import jax, jax.numpy as jnp
from bench import compile as compile_bench
from fp4jax import Impl, fp4_dot
key = jax.eval_shape(lambda: jax.random.key(0))
mesh = compile_bench._deviceless_h200()
for impl in (Impl(quantizer="interpret"), Impl(quantizer="xla")):
  def f(x, w, dy, key, impl=impl):  # x and dY: bf16 rounded from float32 in the program
    y, vjp = jax.vjp(lambda x, w: fp4_dot(x, w, route="nvfp4", key=key, impl=impl), (x * 3).astype(jnp.bfloat16), w)
    return y, *vjp((dy * 3).astype(jnp.bfloat16))
  args = [jax.ShapeDtypeStruct(s, t) for s, t in (((64, 64), jnp.float32), ((64, 32), jnp.bfloat16),
                                                  ((64, 32), jnp.float32))] + [key]
  with jax.set_mesh(mesh):
    jax.jit(f).trace(*compile_bench._on(mesh, args)).lower().compile()
"""


@pytest.mark.skipif(not compile_bench.cuda_plugin_installed(), reason="needs JAX's CUDA plugin (no GPU)")
def test_h200_quantizers_read_bf16_operands_rounded(tmp_path):
  """x and dY made in the program as bf16 from float32: in the H200 programs of the XLA quantizers and of the
  kernels in interpret mode, XLA:GPU's simplify-fp-conversions pass removes no convert of an operand (it dropped
  the float32 -> bf16 -> float32 pairs, `--xla_allow_excess_precision`): both quantize the bf16 values, as the
  compiled kernels do. On a GPU host interpret mode had differed from XLA in 12-49% of a gradient's elements."""
  _compile_for_h200(_H200_ROUNDED, f"--xla_dump_to={tmp_path} --xla_dump_hlo_pass_re=simplify-fp-conversions")
  converts = lambda path: len(re.findall(r"= \w+\[\d+,\d+\]\{[^}]*\} convert\(", path.read_text()))  # 2-D
  passes = sorted(tmp_path.glob("*simplify-fp-conversions*.txt"))
  pairs = [(a, b) for a, b in zip(passes, passes[1:]) if a.name.endswith(".before_simplify-fp-conversions.txt")]
  assert len(pairs) >= 2 and all(".after_simplify-fp-conversions." in b.name for _, b in pairs)
  assert [converts(a) - converts(b) for a, b in pairs] == [0] * len(pairs)
