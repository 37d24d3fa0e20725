"""fp4jax.compiling: the Triton launches it finds, the kernel files it merges, the kernels' launch names, a
program compiled with its kernels first for an H200 (JAX's CUDA plugin, no GPU) and run on a GPU."""

import functools
import inspect
import json
import os
import pathlib
import re
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import compile as compile_bench
from bench import triton as bench_triton
from fp4jax import Impl, compiling, fp4_dot
from fp4jax.ops.quantize.pallas import common
from seeded import fresh_rng


def _varint(n: int) -> bytes:
  out = b""
  while True:
    byte, n = n & 0x7F, n >> 7
    out += bytes([byte | (0x80 if n else 0)])
    if not n:
      return out


def _field(number: int, payload: bytes) -> bytes:
  return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _kernel_file(*entries: tuple[str, str], version: int = 3) -> bytes:
  """A CompilationCacheProto of (name, key) entries, each with a binary field (5) besides its key (1)."""
  body = b"".join(_field(1, _field(1, n.encode()) + _field(2, _field(1, k.encode()) + _field(5, b"\x7fELF")))
                  for n, k in entries)
  return body + _varint(2 << 3) + _varint(version)


def test_merge_keeps_each_named_kernel_once_and_drops_a_name_with_two_keys():
  a = _kernel_file(("k1", "key1"), ("other", "x"), ("k2", "key2"))
  b = _kernel_file(("k1", "key1"), ("k3", "key3a"))
  c = _kernel_file(("k3", "key3b"), version=3)
  merged, count = compiling.merge_kernel_files([a, b, c], {"k1", "k2", "k3"})
  entries, version = compiling.kernel_entries(merged)
  assert [(n, k) for n, k, _ in entries] == [("k1", b"key1"), ("k2", b"key2")] and count == 2
  assert version == _varint(2 << 3) + _varint(3)
  assert compiling.kernel_entries(_kernel_file(("k1", "key1")))[0][0][2] in merged  # entries copied whole


def test_launch_names_follow_the_configuration_and_not_the_process():
  cfg = Impl(quantizer="xla")  # any frozen dataclass: its repr is its fields
  name = common.launch_name("k", cfg, (4, 8))
  assert name == common.launch_name("k", Impl(quantizer="xla"), (4, 8)) and name.startswith("k_")
  assert name[-1].isalpha()  # XLA's name uniquer would read trailing digits as a variant number
  assert len({name, common.launch_name("k", cfg, (8, 4)), common.launch_name("k", Impl(), (4, 8))}) == 3
  # pylint: disable-next=protected-access
  described = common._describe((functools.partial(common.launch_name, "k"), [cfg]))
  assert "0x" not in described  # no memory address, nested or not
  # fp4_dot's launches (forward and backward) are named alike in another process.
  other = subprocess.run([sys.executable, "-c", _LAUNCH_NAMES], capture_output=True, text=True, check=True,
                         cwd=pathlib.Path(__file__).resolve().parents[1]).stdout.split()
  assert other == _launch_names() and len(set(other)) == len(other) > 0


def _launch_names() -> list[str]:
  f, args = _fwd_bwd("nvfp4", Impl(quantizer="pallas"))
  with bench_triton.on_abstract_h200():
    return [l.name for l in compiling.triton_launches(jax.jit(f).trace(*args).jaxpr.jaxpr)]


_LAUNCH_NAMES = """
import sys
import threading
sys.path.insert(0, "tests")
from test_compiling import _launch_names
print(" ".join(_launch_names()))
"""


def _fwd_bwd(route: str, impl: Impl):
  def f(x, w, dy, key):
    y, vjp = jax.vjp(lambda x, w: fp4_dot(x, w, route=route, key=key, impl=impl), x, w)
    return y, *vjp(dy)
  args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((256, 512), (512, 384), (256, 384))]
  return f, args + [jax.eval_shape(lambda: jax.random.key(0))]


@pytest.mark.parametrize("route", ["nvfp4", "quartet2", "mxfp4"])
def test_every_distinct_launch_is_found_in_forward_and_backward(route):
  """The launches found in the traced jaxpr (custom_vjp backward included) are the lowered program's distinct
  Triton launch configurations, each with its own name, each on a grid of one axis (XLA's kernel file keeps a
  launch's block count only: `common.pallas_call`); interpret-mode kernels are none."""
  f, args = _fwd_bwd(route, Impl(quantizer="pallas"))
  with bench_triton.on_abstract_h200():
    traced = jax.jit(f).trace(*args)
    launches = compiling.triton_launches(traced.jaxpr.jaxpr)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
  _, _, configs = compile_bench.kernel_counts(text)
  assert len(launches) == configs > 0
  assert len({l.name for l in launches}) == len(launches)
  grids = [dict(re.findall(r"grid_([xyz]) = (\d+)", line)) for line in text.splitlines() if "xla.gpu.triton" in line]
  assert len(grids) >= configs and all(g["y"] == g["z"] == "1" for g in grids), grids
  f, args = _fwd_bwd(route, Impl(quantizer="interpret"))
  assert compiling.triton_launches(jax.jit(f).trace(*args).jaxpr.jaxpr) == []


@pytest.mark.parametrize("route", ["nvfp4", "mxfp4"])
def test_each_launch_reaches_a_kernels_first_compile_as_it_is_traced(route):
  """While a kernels-first compile traces (`compiling.KernelsFirst.trace`), `common.pallas_call` hands it each
  Triton launch as it is traced (`compiling.bind_launch`), so its kernel can compile while the rest of the program
  traces: every launch of the program is handed over before the trace ends, and the program traced is the one
  traced without it."""
  f, args = _fwd_bwd(route, Impl(quantizer="pallas"))
  seen = []
  with bench_triton.on_abstract_h200():
    jax.clear_caches()  # fp4jax's quantizers are jitted: a trace JAX kept would not run their launches' code
    token = compiling._collector.set(seen.append)  # pylint: disable=protected-access  # what `trace` sets
    try:
      traced = jax.jit(f).trace(*args)
    finally:
      compiling._collector.reset(token)  # pylint: disable=protected-access
    launches = compiling.triton_launches(traced.jaxpr.jaxpr)
    jax.clear_caches()
    plain = jax.jit(f).trace(*args)
  assert launches and {(l.name, l.avals) for l in launches} <= {(l.name, l.avals) for l in seen}
  assert str(traced.jaxpr) == str(plain.jaxpr)


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread niceness is a Linux feature")
def test_kernel_threads_yield_the_cpu_to_the_tracing_thread():
  """The pool's threads run at a niceness `KERNEL_NICENESS` above the process's (the `ptxas` processes XLA starts
  from them inherit it): on the GPU host fifteen kernel compiles at normal priority took 1.3-1.9 s from the trace
  (docs/BENCHMARKS.md, "Session of 2026-12-07, 14:05 UTC"). The calling thread keeps its own."""
  before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
  seen = []
  def worker():
    compiling._yield_the_cpu()  # pylint: disable=protected-access  # the pool's initializer
    seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
  thread = threading.Thread(target=worker)
  thread.start()
  thread.join()
  assert seen == [min(before + compiling.KERNEL_NICENESS, 19)]
  assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


def test_a_kept_kernel_file_is_not_compiled_again(tmp_path, monkeypatch):
  """In a kept directory a launch whose kernel file is there (from an earlier run of the same code) starts no
  compile; one without starts one, once however often it is handed over."""
  started = []
  monkeypatch.setattr(compiling, "compile_alone", lambda launch, mesh, path: started.append(launch.name))
  launch = lambda name: compiling.Launch(name, None, {"grid_mapping": "grid"}, ())
  with compiling.KernelsFirst(threads=2, directory=tmp_path) as first:
    kept = tmp_path / "kernels" / (compiling._file_name(launch("k_old")) + ".bin")  # pylint: disable=protected-access
    kept.write_bytes(b"")
    for name in ("k_old", "k_new", "k_new"):
      first._submit(launch(name))  # pylint: disable=protected-access  # what `bind_launch` calls while tracing
  assert started == ["k_new"]


def test_a_program_without_triton_launches_compiles_as_jax_jit_does():
  fn = jax.jit(lambda x: jnp.sin(x) * 2)
  compiled, report = compiling.compile_program(fn, jnp.arange(4.0), threads=4)
  assert report.kernels == 0 and report.fallback is None
  np.testing.assert_array_equal(compiled(jnp.arange(4.0)), fn(jnp.arange(4.0)))


@pytest.mark.parametrize("jitted, threads, error, match", [
    (jax.jit(jnp.sin), -1, ValueError, "threads takes an int >= 0 or None .*got -1"),
    (jax.jit(jnp.sin), "4", ValueError, "threads takes an int >= 0 or None .*got '4'"),
    (jax.jit(jnp.sin), 1.5, ValueError, "threads takes an int >= 0 or None .*got 1.5"),
    (lambda x: x, 0, TypeError, "compile_program takes a jax.jit function"),
])
def test_bad_arguments_are_named_on_any_host(jitted, threads, error, match):
  """Refused before any work: a CPU reads threads only once it finds a Triton launch (it has none), a GPU failed
  on a string or float later with Python's comparison error; a plain function had no `trace`."""
  with pytest.raises(error, match=match):
    compiling.compile_program(jitted, jnp.arange(4.0), threads=threads)


_H200_KERNELS_FIRST = r"""
import json, pathlib, re, sys, warnings
import jax, jax.numpy as jnp
from bench import compile as compile_bench
from fp4jax import Impl, compiling, fp4_dot
sys.path.insert(0, "tests")
from test_compiling import _fwd_bwd
mesh = compile_bench._deviceless_h200()
out = {}

def launches_run(dump):  # (kernel, grid, threads) of each fp4jax kernel the program's thunks launch
  [path] = pathlib.Path(dump).glob("*jit_f*thunk_sequence_after_thunk_passes.txt")
  pattern = re.compile(r"(fp4jax_\S+) grid: (\[[^]]*\]) threads: (\[[^]]*\])")
  return sorted(m.groups() for m in map(pattern.search, path.read_text().splitlines()) if m)

for route in ("nvfp4", "quartet2"):
  f, args = _fwd_bwd(route, Impl())
  dump = pathlib.Path(sys.argv[1]) / "dump" / route
  with jax.set_mesh(mesh):
    args = compile_bench._on(mesh, args)
    directory = pathlib.Path(sys.argv[1]) / route
    jax.clear_caches()  # traced anew: each launch reaches the kernels-first compile as it is traced
    compiled, report = compiling.compile_program(jax.jit(f), *args, threads=2, directory=directory,
                                                 compiler_options={"xla_dump_to": str(dump / "first")})
    # the same trace (JAX's), compiled alone: a trace of its own would put its own call sites in the kernels' IR
    plain = jax.jit(f).trace(*args).lower().compile({"xla_dump_to": str(dump / "alone")}).as_text()
    launches = compiling.triton_launches(jax.jit(f).trace(*args).jaxpr.jaxpr)
    with compiling.kernels_first(jax.jit(f).trace(*args), threads=2, directory=directory) as (_, again, rerun):
      pass  # the kept program file: nothing compiles alone, the same path (JAX's cache key)
  [program_file] = directory.glob("program-*.bin")
  out[route + " again"] = {"kernels": rerun.kernels, "same_file": again == {compiling.KERNEL_CACHE_OPTION:
                                                                               str(program_file)}}
  entries, _ = compiling.kernel_entries(program_file.read_bytes())
  out[route] = {"same_program": compiled.as_text() == plain, "kernels": report.kernels, "traced": report.traced,
                "launches": sorted(l.name for l in launches), "fallback": report.fallback, "failed": report.failed,
                "fp4jax_entries": sorted(n for n, _, _ in entries if n.startswith("fp4jax")),
                "launch_grids": launches_run(dump / "alone") == launches_run(dump / "first") != []}
blocked = pathlib.Path(sys.argv[1]) / "a-file"
blocked.write_text("")
f, args = _fwd_bwd("nvfp4", Impl())
with jax.set_mesh(mesh), warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  args = compile_bench._on(mesh, args)
  _, report = compiling.compile_program(jax.jit(f), *args, threads=2, directory=blocked / "k")
out["unwritable"] = {"kernels": report.kernels, "warned": any("cannot keep kernel files" in str(w.message)
                                                               for w in caught)}
print(json.dumps(out))
"""


@pytest.mark.skipif(not compile_bench.cuda_plugin_installed(), reason="needs JAX's CUDA plugin (no GPU)")
def test_h200_program_takes_every_kernel_compiled_first(tmp_path):
  """Compiled for an H200 (no GPU needed), fp4_dot's forward and backward with its kernels compiled first: the
  same optimized program as compiled alone, every launch compiled alone, none failed, and the program's kernel
  file afterwards holds exactly those kernels under their names: XLA took each (a kernel it had compiled itself
  would have been added under a name of its own, `name_1`), and launches each on the grid the program compiled
  alone does (XLA's file keeps a block count only: `common.pallas_call`). A second compile with that directory
  takes the file as it is (no kernel compiled alone, the same path). A kernel directory that cannot be made is a
  warning, and the kernels go to a temporary one."""
  env = {**os.environ, "XLA_FLAGS": "--xla_gpu_autotune_level=0", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}
  done = subprocess.run([sys.executable, "-c", _H200_KERNELS_FIRST, str(tmp_path)], capture_output=True, text=True,
                        env=env, cwd=pathlib.Path(__file__).resolve().parents[1])
  assert done.returncode == 0, done.stderr[-2000:]
  results = json.loads(done.stdout.strip().splitlines()[-1])
  unwritable = results.pop("unwritable")  # a directory that cannot be made: a warning, and a temporary one
  assert unwritable["warned"] and unwritable["kernels"] > 0, unwritable
  for route in ("nvfp4", "quartet2"):
    assert results.pop(route + " again") == {"kernels": 0, "same_file": True}, route
  for route, r in results.items():
    assert r["same_program"] and r["fallback"] is None and not r["failed"], (route, r)
    assert r["launch_grids"], (route, r)  # each kernel taken from the file runs on the grid it runs on alone
    assert r["kernels"] == len(r["launches"]) > 0 and r["fp4jax_entries"] == r["launches"], (route, r)
    assert r["traced"] == r["kernels"], (route, r)  # every one started compiling while the program traced


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["nvfp4", "quartet2", "mxfp4"])
def test_gpu_program_with_kernels_compiled_first_gives_the_same_bits(route, tmp_path):
  """On the GPU: fp4_dot's forward and backward compiled with its kernels compiled first runs, and gives the
  bits of the program compiled alone, on fresh random inputs (it gave NaNs and overwrote x while kernels launched
  on two grid axes, which XLA's kernel file does not keep)."""
  f, _ = _fwd_bwd(route, Impl())
  rng = fresh_rng(f"kernels first, {route}")
  args = [jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in ((256, 512), (512, 384), (256, 384))]
  args.append(jax.random.key(int(rng.integers(2**31))))
  compiled, report = compiling.compile_program(jax.jit(f), *args, threads=4, directory=tmp_path)
  assert report.kernels > 0 and report.fallback is None and not report.failed
  for got, want in zip(compiled(*args), jax.jit(f)(*args)):
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))


def test_standalone_args_compile_off_the_main_thread_whatever_mesh_the_jaxpr_names():
  """A traced step's avals name an abstract mesh; a launch compiled alone, on a worker thread with no mesh, gets
  its operands on the default device (one GPU's step), or on the caller's concrete mesh where there is one."""
  mesh = jax.make_mesh((1, 1), ("data", "fsdp"))
  x = jax.device_put(jnp.ones((8, 8)), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None)))
  aval = jax.jit(lambda x: x * 2).trace(x).jaxpr.jaxpr.invars[0].aval
  assert compiling.standalone_arg(aval, None).sharding is None
  on_mesh = compiling.standalone_arg(aval, mesh).sharding
  assert on_mesh.mesh is mesh and on_mesh.spec == aval.sharding.spec
  done = []
  worker = threading.Thread(target=lambda: done.append(
      jax.jit(lambda v: v + 1).trace(compiling.standalone_arg(aval, None)).lower().compile()))
  worker.start()
  worker.join()
  assert len(done) == 1


def test_a_compile_that_fails_with_the_kernel_file_compiles_again_without_it(tmp_path):
  """The fallback: a warning, the program compiled as jax.jit would, and the kernel file deleted."""
  bad = tmp_path / "program-x.bin"
  bad.write_bytes(b"not a kernel file")

  class Lowered:  # fails with the kernel file, compiles without it
    def compile(self, compiler_options=None):
      if compiler_options and compiling.KERNEL_CACHE_OPTION in compiler_options:
        raise RuntimeError("cannot link cached kernels")
      return "compiled"

  report = compiling.Report()
  with pytest.warns(UserWarning, match="cannot link cached kernels"):
    assert compiling.compile_lowered(Lowered(), {compiling.KERNEL_CACHE_OPTION: str(bad)}, report) == "compiled"
  assert report.fallback == "RuntimeError: cannot link cached kernels" and not bad.exists()

  class Broken:  # fails however it is compiled
    def compile(self, compiler_options=None):
      raise RuntimeError("the program's own error")

  with pytest.raises(RuntimeError, match="the program's own error"):  # no kernel file: nothing to fall back from
    compiling.compile_lowered(Broken(), {}, compiling.Report())


def test_report_summary_says_how_the_kernels_compiled():
  report = compiling.Report(kernels=13, traced=11, threads=15, kernel_s=1.25, program_s=4.0)
  assert report.summary() == ("13 Pallas kernels compiled first (11 from their trace on) on 15 threads in 1.2 s, "
                              "then the program in 4.0 s")
  report = compiling.Report(failed=["k_1: TypeError"], fallback="XlaRuntimeError: link")
  assert report.summary() == ("1 kernels left to the program (k_1: TypeError); compiled again without them "
                              "(XlaRuntimeError: link)")
  assert compiling.Report().summary() == ""


def test_kernels_first_is_off_unless_asked_for(monkeypatch):
  """Kernels compiled first are opt-in (they saved 0-1 s of a 30M first call on an H100 host): the library
  (threads=0), `train` (run.kernels_first) and `bench` (--kernels-first) compile as jax.jit does by default."""
  from bench.__main__ import main as bench_main  # pylint: disable=g-import-not-at-top
  from train import config  # pylint: disable=g-import-not-at-top
  assert inspect.signature(compiling.compile_program).parameters["threads"].default == 0
  assert inspect.signature(compiling.kernels_first).parameters["threads"].default == 0
  assert config.RunConfig().kernels_first is False
  seen = {}
  monkeypatch.setattr("bench.compile.run", lambda args: seen.setdefault("value", args.kernels_first) and 0)
  bench_main(["compile", "--small"])
  assert seen["value"] == "off"
