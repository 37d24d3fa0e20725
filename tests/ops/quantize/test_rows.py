"""Quantizing rows split over a mesh (`ops.quantize.pallas.rows`): each device's kernel launch on its own rows
gives the whole array's bits, and fp4_dot's tokens are split that way under a mesh.

The device count is fixed when JAX starts, so each check runs in a fresh process with 8 CPU devices (a 2 x 4
("data", "fsdp") mesh, as the training loop's); the kernels run in Pallas interpret mode.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

import cpu_devices
from bench import compile as compile_bench
from seeded import fresh_rng

_PRELUDE = """
import json, jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
AXES = ("data", "fsdp")
seed = {seed}
def same(a, b):
  a, b = np.atleast_1d(np.asarray(a)), np.atleast_1d(np.asarray(b))
  return bool(a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)))
def pallas_calls(jaxpr_text):
  return jaxpr_text.count("pallas_call")
"""

_VIEWS = """
from fp4jax.numerics.spec import OperandKeys, OperandSpec
from fp4jax.ops.quantize import api
ks = jax.random.split(jax.random.key(seed), 4)
clean = jax.random.normal(ks[0], (256, 256)) * jnp.exp2(jax.random.randint(ks[1], (256, 1), -20, 20))
clean = clean.at[96:128, :32].set(0).astype(jnp.bfloat16)  # rows over 40 binades and a zero block
edges = clean.at[37, 5].set(jnp.nan).at[200, 7].set(3e38)  # a NaN (a per-tensor scale: all NaN) and a huge one
rk, tk = OperandKeys(rounding=ks[2]), OperandKeys(transform=ks[3])
sr = OperandKeys(rounding=ks[2], transform=ks[3])
mx = lambda **kw: OperandSpec("mxfp4", **kw)
nv = lambda **kw: OperandSpec("nvfp4", **kw)
views = {  # name: (row spec, column spec, row keys, column keys)
    "rne|rne": (mx(), mx(), OperandKeys(), OperandKeys()),
    "sr|rne": (mx(rounding="sr"), mx(), rk, OperandKeys()),
    "sr|sr shared": (mx(rounding="sr"), mx(rounding="sr"), rk, rk),
    "sr|sr+rht16": (mx(rounding="sr"), mx(rounding="sr", transform="rht16"), rk, sr),
    "rne|rne+h32": (mx(), mx(transform="h32"), OperandKeys(), OperandKeys()),
    "32x32 sr": (mx(rounding="sr", tile_2d=True), mx(rounding="sr", tile_2d=True), rk, rk),
    "noclip 0.87": (mx(scale_rule="noclip", clip_fraction=0.87), mx(rounding="sr"), OperandKeys(), rk),
    "nv rne|rne": (nv(), nv(), OperandKeys(), OperandKeys()),
    "nv dY sr|sr+rht16": (nv(rounding="sr"), nv(rounding="sr", transform="rht16"), rk, sr),
    "nv X rne|rne+rht16": (nv(), nv(transform="rht16"), OperandKeys(), tk),
    "nv 16x16 sr": (nv(rounding="sr", tile_2d=True), nv(rounding="sr", tile_2d=True), rk, rk),
    "nv 4/6": (OperandSpec("nvfp4_46"), OperandSpec("nvfp4_46"), OperandKeys(), OperandKeys()),
}
operands = {  # name: (spec, axis, keys): one view, through the single-view launches
    "sr along K": (mx(rounding="sr"), 1, rk), "sr along M": (mx(rounding="sr"), 0, rk),
    "rne along M (x^T)": (mx(), 0, OperandKeys()), "sr+h32 along M": (mx(rounding="sr", transform="h32"), 0, rk),
    "nv sr along M": (nv(rounding="sr"), 0, rk), "nv rne along M (x^T)": (nv(), 0, OperandKeys()),
    "nv sr along K": (nv(rounding="sr"), 1, rk),
}
leaves = lambda qs: jax.tree.leaves(tuple(qs))
def compare(f, inputs=None):  # f(x, rows_over) on one device against f split over the mesh: equal bits; split?
  result = {"same": [], "split": True}
  for x in inputs or (clean, edges):
    want = jax.jit(f, static_argnums=1)(x, ())
    with jax.set_mesh(mesh):
      xs = jax.device_put(x, NamedSharding(mesh, P(AXES)))
      got = jax.jit(f, static_argnums=1)(xs, AXES)
      result["split"] &= "shard_map" in str(jax.make_jaxpr(f, static_argnums=1)(xs, AXES))
    result["same"] += [same(g, w) for g, w in zip(got, want)]
  return result
out = {}
for name, (row, col, rkeys, ckeys) in views.items():
  out[name] = compare(lambda x, axes: leaves(api.quantize_views(x, row, col, rkeys, ckeys, implementation="interpret",
                                                                rows_over=axes)))
  if row.fmt == "nvfp4" and not row.tile_2d:  # the bf16 values a Hopper GEMM reads (ScaledValues), both views
    out[name + " values"] = compare(lambda x, axes: leaves(api.quantize_views(
        x, row, col, rkeys, ckeys, implementation="interpret", forms=("values", "values"), rows_over=axes)))
for name, (spec, axis, keys) in operands.items():
  out[name] = compare(lambda x, axes: leaves([api.quantize_operand(x, spec, axis, keys, implementation="interpret",
                                                                   rows_over=axes)]))
# MS-EDEN (quartet2's backward): groups of 128 rows along M, so 128 rows per device at the least.
tall = jax.random.normal(ks[0], (1024, 128)) * jnp.exp2(jax.random.randint(ks[1], (1024, 1), -20, 20))
tall = tall.astype(jnp.bfloat16)
eden = OperandSpec("nvfp4", rounding="eden", transform="rht128")
for axis in (1, 0):
  out[f"eden+rht128 along {'KM'[1 - axis]}"] = compare(
      lambda x, axes: leaves([api.quantize_operand(x, eden, axis, sr, implementation="interpret", rows_over=axes)]),
      (tall, tall.at[700, 3].set(jnp.inf)))
out["eden+rht128 along K, 32 rows each"] = compare(  # groups along K: any whole number of 32 rows splits
    lambda x, axes: leaves([api.quantize_operand(x, eden, 1, sr, implementation="interpret", rows_over=axes)]))
# Not split: tile-local NVFP4 (per-row outer factors), and rows that do not make whole 32-row blocks on every
# device.
with jax.set_mesh(mesh):
  tile = OperandSpec("nvfp4_tile")
  out["nvfp4_tile kept whole"] = {"split": "shard_map" in str(jax.make_jaxpr(
      lambda x: api.quantize_views(x, tile, tile, implementation="interpret", rows_over=AXES))(clean))}
  out["128 rows kept whole"] = {"split": "shard_map" in str(jax.make_jaxpr(
      lambda x: api.quantize_views(x, mx(), mx(), implementation="interpret", rows_over=AXES))(clean[:128]))}
print(json.dumps(out))
"""

_DOT = """
import fp4jax
ks = jax.random.split(jax.random.key(seed), 4)
x = jax.random.normal(ks[0], (8, 32, 256), jnp.bfloat16)  # [B, T, K]: B split over the mesh, as a batch is
w = jax.random.normal(ks[1], (256, 192), jnp.bfloat16) * 0.05
g = jax.random.normal(ks[2], (8, 32, 192), jnp.bfloat16)
out = {}
for route in ("mxfp4", "mxfp4_h32", "nvfp4", "quartet2"):
  if route == "quartet2":  # MS-EDEN's groups of 128 tokens: 128 per device
    x, g = (jax.random.normal(k, (8, 128, n), jnp.bfloat16) for k, n in ((ks[0], 256), (ks[2], 192)))
  def f(x, w, key):
    y, vjp = jax.vjp(lambda x, w: fp4jax.fp4_dot(x, w, route=route, key=key, impl=fp4jax.Impl("interpret")), x, w)
    return (y, *vjp(g))
  want = jax.jit(f)(x, w, ks[3])
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P(AXES)))
    got = jax.jit(f, out_shardings=(NamedSharding(mesh, P(AXES)),) * 2 + (NamedSharding(mesh, P()),))(xs, w, ks[3])
    split = str(jax.make_jaxpr(f)(xs, w, ks[3])).count("shard_map")
  dw_err = float(jnp.max(jnp.abs(got[2].astype(jnp.float32) - want[2].astype(jnp.float32))) /
                 jnp.max(jnp.abs(want[2].astype(jnp.float32))))
  out[route] = {"y": same(got[0], want[0]), "dx": same(got[1], want[1]), "dw_err": dw_err, "shard_maps": split}
print(json.dumps(out))
"""


def _run_on_8_cpu_devices(script: str, seed: int) -> dict:
  proc = cpu_devices.run(_PRELUDE.format(seed=seed) + script, 8, timeout=600)
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_row_shards_give_the_whole_arrays_bits():
  """MXFP4 and NVFP4 recipes (RNE and SR, shared SR bits, Hadamard column views, 32x32 and 16x16 tiles,
  clipping, 4/6, NVFP4 views as bf16 values), both views and each single view, on rows split 8 ways, of an
  array over 40 binades with a zero block and of one with a NaN and a huge value: the same codes, scales and
  outer factors as one launch on the whole array, and the launch was split (a shard_map)."""
  out = _run_on_8_cpu_devices(_VIEWS, int(fresh_rng("row shards").integers(2**31)))
  for name, result in out.items():
    if name.endswith("kept whole"):
      assert not result["split"], name
    else:
      assert result["split"], name
      assert all(result["same"]), (name, result["same"])


def test_fp4_dot_splits_tokens_under_a_mesh():
  """fp4_dot forward and both gradients under a 2 x 4 mesh, the batch split over both axes: y and dX bit for
  bit those of one device, dW up to the order of its float32 sums across devices; X's and dY's quantizers ran
  split (W's whole, as its rows are not tokens)."""
  out = _run_on_8_cpu_devices(_DOT, int(fresh_rng("fp4_dot on a mesh").integers(2**31)))
  for route, result in out.items():
    assert result["y"] and result["dx"], (route, result)
    assert result["dw_err"] < 1e-2, (route, result)
    assert result["shard_maps"] >= 2, (route, result)


_H200_DATA_PARALLEL = """
import re, sys, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from bench import compile as compile_bench
from fp4jax import Impl, fp4_dot
mesh = compile_bench._deviceless_h200(2)
key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=NamedSharding(mesh, P()))
x = jax.ShapeDtypeStruct((4096, 2048), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
w = jax.ShapeDtypeStruct((2048, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
impl = Impl(token_axes=() if sys.argv[1] == "whole" else "auto")
loss = lambda x, w, key: jnp.sum(fp4_dot(x, w, route=sys.argv[2], key=key, impl=impl).astype(jnp.float32) ** 2)
f = jax.jit(jax.grad(loss, argnums=(0, 1)), out_shardings=(NamedSharding(mesh, P("data")), NamedSharding(mesh, P())))
with jax.set_mesh(mesh):
  text = f.trace(x, w, key).lower().compile().as_text()
print(len(re.findall(r" all-gather(?:-start)?\\(", text)), len(re.findall(r" all-reduce(?:-start)?\\(", text)))
"""


@pytest.mark.skipif(not compile_bench.cuda_plugin_installed(), reason="needs JAX's CUDA plugin (no GPU)")
def test_h200_data_parallel_step_gathers_no_activations():
  """fp4_dot's mxfp4, nvfp4 and quartet2 forward and backward compiled for two H200s (no GPU needed), x split along its
  tokens: with the quantizers on each device's tokens the program gathers nothing (W's gradient and the tensor
  amaxes are all-reduced); with them on the whole x (token_axes=()), XLA gathers x onto both devices for the
  kernel, as it did before."""
  env = {**os.environ, "XLA_FLAGS": "--xla_gpu_autotune_level=0", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}
  counts = {}
  for mode, route in (("split", "mxfp4"), ("split", "nvfp4"), ("split", "quartet2"), ("whole", "mxfp4")):
    done = subprocess.run([sys.executable, "-c", _H200_DATA_PARALLEL, mode, route], capture_output=True, text=True,
                          env=env, cwd=pathlib.Path(__file__).resolve().parents[3], timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    counts[mode, route] = tuple(int(n) for n in done.stdout.split())
  for route in ("mxfp4", "nvfp4", "quartet2"):
    assert counts["split", route][0] == 0 and counts["split", route][1] >= 1, counts
  assert counts["whole", "mxfp4"][0] >= 1, counts
