"""fp4jax.compiling: the Triton calls it takes out of a lowered program, the kernel files it merges and rewrites
as kernels land, the kernels' launch names, a program compiled beside its kernels for an H200 (JAX's CUDA
plugin, no GPU) and run on a GPU."""

import functools
import inspect
import json
import os
import pathlib
import re
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir

from bench import args as args_lib
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
    return [c.name for c in compiling.triton_calls(jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)))]


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


def _lowered_for_h200(f, args):
  with bench_triton.on_abstract_h200():
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("route", ["nvfp4", "quartet2", "mxfp4"])
def test_every_distinct_triton_call_is_taken_out_whole(route):
  """The calls taken out of the lowered forward and backward are the program's distinct Triton launch
  configurations, each with its own name, each on a grid of one axis (XLA's kernel file keeps a launch's block
  count only: `common.pallas_call`), and each a program of its own that holds the call as it was: the same
  backend configuration (name, Triton IR, grid, warps, stages), operands and results, and nothing of its place
  in the program. Interpret-mode kernels are none."""
  f, args = _fwd_bwd(route, Impl(quantizer="pallas"))
  lowered = _lowered_for_h200(f, args)
  calls = compiling.triton_calls(lowered)
  text = lowered.as_text()
  _, _, configs = compile_bench.kernel_counts(text)
  assert len(calls) == configs > 0 and len({c.name for c in calls}) == len(calls)
  grids = [dict(re.findall(r"grid_([xyz]) = (\d+)", line)) for line in text.splitlines() if "xla.gpu.triton" in line]
  assert len(grids) >= configs and all(g["y"] == g["z"] == "1" for g in grids), grids
  originals = {}
  ops = compiling._ops  # pylint: disable=protected-access
  for op in ops(lowered.compiler_ir("stablehlo").operation):
    if op.name == "stablehlo.custom_call" and "xla.gpu.triton" in str(op.attributes["call_target_name"]):
      originals.setdefault(str(op.attributes["mhlo.backend_config"]), op)
  for call, (config, op) in zip(calls, originals.items()):
    with mlir.make_ir_context():
      module = ir.Module.parse(call.module)
      [alone] = [o for o in ops(module.operation) if o.name == "stablehlo.custom_call"]
      assert str(alone.attributes["mhlo.backend_config"]) == config
      assert [str(v.type) for v in alone.operands] == list(call.operands) == [str(v.type) for v in op.operands]
      assert [str(r.type) for r in alone.results] == [str(r.type) for r in op.results]
      assert "mhlo.sharding" not in alone.attributes and "mhlo.frontend_attributes" not in alone.attributes
    assert call.blocks == int(dict(re.findall(r"grid_([xyz]) = (\d+)", config))["x"])
  f, args = _fwd_bwd(route, Impl(quantizer="interpret"))
  assert compiling.triton_calls(jax.jit(f).trace(*args).lower()) == []


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


class _Lowered:
  """A lowered program whose compile records the kernel file it was handed, as it was when the compile began."""

  def __init__(self, started: threading.Event | None = None):
    self.started, self.seen = started, None

  def compile(self, compiler_options=None):
    path = (compiler_options or {}).get(compiling.KERNEL_CACHE_OPTION)
    self.seen = None if path is None else pathlib.Path(path).read_bytes()
    if self.started is not None:
      self.started.set()
    return "compiled"


def _calls(*names: str) -> list:
  return [compiling.TritonCall(n, f"digest-{n}", 1, (), n.encode() * 8) for n in names]


def _kernels_beside(monkeypatch, tmp_path, calls, compile_alone, lowered):
  monkeypatch.setattr(compiling, "triton_calls", lambda lowered: calls)
  monkeypatch.setattr(compiling, "compile_alone", compile_alone)
  traced = type("Traced", (), {"lower": lambda self: lowered})()
  with compiling.KernelsFirst(threads=2, directory=tmp_path) as first:
    lowered_, options = first.lower(traced)
    first.compile(lowered_, options)
  return first.report, options


def test_the_program_compiles_beside_its_kernels_and_its_file_grows_as_each_lands(tmp_path, monkeypatch):
  """The program's compile starts while its kernels compile alone (each waits here until it has started: a
  `lower` that waited for them would never return), and the program's kernel file, empty at first, holds every
  kernel when XLA writes it back at the end of the compile; the report says how many compiled and when the last
  was ready."""
  started = threading.Event()
  def compile_alone(call, device, path):
    assert started.wait(timeout=30), "the program's compile did not start beside the kernels"
    pathlib.Path(path).write_bytes(_kernel_file((call.name, f"key-{call.name}")))
  lowered = _LoweredWritingItsFile(["k1", "k2", "k3"])
  lowered.started = started
  report, options = _kernels_beside(monkeypatch, tmp_path, _calls("k1", "k2", "k3"), compile_alone, lowered)
  assert compiling.kernel_entries(lowered.seen)[0] == []  # none had landed when the compile began
  program = pathlib.Path(options[compiling.KERNEL_CACHE_OPTION])
  assert [n for n, _, _ in compiling.kernel_entries(program.read_bytes())[0]] == ["k1", "k2", "k3", "loop_fusion"]
  assert report.kernels == 3 and report.threads == 2 and report.kept == 0 and report.ready_s is not None


def _wait_for_kernels(path: pathlib.Path, names: list[str]) -> None:
  """Until the kernel file at `path` holds the kernels `names` (as a compile lasts while its kernels land)."""
  deadline = time.monotonic() + 30
  while [n for n, _, _ in compiling.kernel_entries(path.read_bytes())[0]] != names:
    assert time.monotonic() < deadline, f"kernels {names} never landed in the program's file"
    time.sleep(0.01)


class _LoweredWritingItsFile(_Lowered):
  """A lowered program whose compile lasts until the kernels `landing` are in its kernel file, and ends as XLA's
  does: it writes the file back with a kernel of its own (one of its fusions) added, then says so (`compiled`)."""

  def __init__(self, landing: list[str], compiled: threading.Event | None = None):
    super().__init__()
    self.landing, self.compiled = landing, compiled

  def compile(self, compiler_options=None):
    result = super().compile(compiler_options)
    path = pathlib.Path(compiler_options[compiling.KERNEL_CACHE_OPTION])
    _wait_for_kernels(path, self.landing)
    path.write_bytes(path.read_bytes() + _kernel_file(("loop_fusion", "key-f")))
    if self.compiled is not None:
      self.compiled.set()
    return result


def test_a_kernel_landing_after_the_program_compiled_leaves_xlas_file_as_it_is(tmp_path, monkeypatch):
  """A kernel that lands once the program's compile has returned keeps its own file but does not rewrite the
  program's: that file then holds the program's other kernels, which XLA added at the end of its compile, and a
  rewrite from the landed kernels alone would drop them (a later compile of the program would make them again)."""
  compiled = threading.Event()
  def compile_alone(call, device, path):
    if call.name == "k_late":
      assert compiled.wait(timeout=30)
      time.sleep(0.5)  # the compile has returned: KernelsFirst.compile is waiting for this kernel
    pathlib.Path(path).write_bytes(_kernel_file((call.name, f"key-{call.name}")))
  report, options = _kernels_beside(monkeypatch, tmp_path, _calls("k_early", "k_late"), compile_alone,
                                    _LoweredWritingItsFile(["k_early"], compiled))
  program = pathlib.Path(options[compiling.KERNEL_CACHE_OPTION]).read_bytes()
  assert [n for n, _, _ in compiling.kernel_entries(program)[0]] == ["k_early", "loop_fusion"]
  assert (tmp_path / "kernels" / "digest-k_late-k_late.bin").exists()  # kept for the next program that has it
  assert report.kernels == 2 and report.ready_s > report.program_s


def test_kernels_not_started_when_the_program_has_compiled_are_not_compiled(tmp_path, monkeypatch):
  """A program that compiles before its kernels (taken from JAX's cache, say) waits only for the kernels already
  compiling: those not started are left (XLA compiled them in the program), and the report counts the two that
  ran on the two threads."""
  compiled, started = threading.Event(), []
  def compile_alone(call, device, path):
    started.append(call.name)
    assert compiled.wait(timeout=30)
    time.sleep(0.5)  # the compile has returned: KernelsFirst.compile is waiting for the kernels
    pathlib.Path(path).write_bytes(_kernel_file((call.name, f"key-{call.name}")))
  report, _ = _kernels_beside(monkeypatch, tmp_path, _calls("k1", "k2", "k3", "k4"), compile_alone,
                              _LoweredWritingItsFile([], compiled))
  assert len(started) == 2 and report.kernels == 2 and report.threads == 2
  assert sorted(p.name for p in (tmp_path / "kernels").iterdir()) == sorted(f"digest-{n}-{n}.bin" for n in started)


def test_a_kept_kernel_file_is_not_compiled_again(tmp_path, monkeypatch):
  """In a kept directory a call whose kernel file is there (from an earlier run) starts no compile and is in the
  program's file from the start; a call that fails to compile alone is left to the program; a program compiled
  before with the same kernels takes its file as it is."""
  started, compiling_program = [], threading.Event()
  def compile_alone(call, device, path):
    assert compiling_program.wait(timeout=30)  # so that the program's compile sees the file as it began
    started.append(call.name)
    if call.name == "k_bad":
      raise RuntimeError("no")
    pathlib.Path(path).write_bytes(_kernel_file((call.name, "key")))
  calls = _calls("k_old", "k_new", "k_bad")
  (tmp_path / "kernels").mkdir()
  (tmp_path / "kernels" / "digest-k_old-k_old.bin").write_bytes(_kernel_file(("k_old", "key")))
  lowered = _Lowered(compiling_program)
  report, options = _kernels_beside(monkeypatch, tmp_path, calls, compile_alone, lowered)
  assert sorted(started) == ["k_bad", "k_new"] and report.kept == 1 and report.failed == ["k_bad: RuntimeError"]
  assert [n for n, _, _ in compiling.kernel_entries(lowered.seen)[0]] == ["k_old"]
  report, again = _kernels_beside(monkeypatch, tmp_path, calls, compile_alone, _Lowered(compiling_program))
  assert again == options and report.kept == 3 and report.kernels == 0 and sorted(started) == ["k_bad", "k_new"]


def test_a_program_without_triton_calls_compiles_as_jax_jit_does():
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
    traced = jax.jit(f).trace(*args)  # one trace: a trace of its own would put its own call sites in the IR
    plain = traced.lower().compile({"xla_dump_to": str(dump / "alone")}).as_text()
    calls = compiling.triton_calls(traced.lower())
    runs = {}
    for run in ("beside", "kept", "again"):  # compiled beside its kernels; their files kept; the program's too
      if run == "kept":
        [program_file] = directory.glob("program-*.bin")
        program_file.unlink()
      with compiling.KernelsFirst(threads=2, directory=directory) as first:
        lowered, options = first.lower(traced)
        compiled = first.compile(lowered, options, {"xla_dump_to": str(dump / run)})
      runs[run] = {"same_program": compiled.as_text() == plain, "kernels": first.report.kernels,
                   "kept": first.report.kept, "failed": first.report.failed, "fallback": first.report.fallback,
                   "options": options}
    entries, _ = compiling.kernel_entries(program_file.read_bytes())
  out[route] = {"runs": runs, "calls": sorted(c.name for c in calls), "file": str(program_file),
                "fp4jax_entries": sorted(n for n, _, _ in entries if n.startswith("fp4jax")),
                "launch_grids": launches_run(dump / "alone") == launches_run(dump / "kept") != []}
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
def test_h200_program_takes_every_kernel_compiled_alone(tmp_path):
  """Compiled for an H200 (no GPU needed), fp4_dot's forward and backward beside its kernels compiled alone:
  every call compiled alone, none failed, the same optimized program as compiled as jax.jit does. With their
  files kept (the program's deleted) the kernels are in the program's file from the start: the program takes
  each (a kernel it had compiled itself would have been added under a name of its own, `name_1`) and launches
  each on the grid the program compiled alone does (XLA's file keeps a block count only: `common.pallas_call`).
  A third compile takes the program's file as it is, at the same path (JAX's cache key). A kernel directory
  that cannot be made is a warning, and the kernels go to a temporary one."""
  env = {**os.environ, "XLA_FLAGS": "--xla_gpu_autotune_level=0", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}
  done = subprocess.run([sys.executable, "-c", _H200_KERNELS_FIRST, str(tmp_path)], capture_output=True, text=True,
                        env=env, cwd=pathlib.Path(__file__).resolve().parents[1])
  assert done.returncode == 0, done.stderr[-2000:]
  results = json.loads(done.stdout.strip().splitlines()[-1])
  unwritable = results.pop("unwritable")  # a directory that cannot be made: a warning, and a temporary one
  assert unwritable["warned"] and unwritable["kernels"] > 0, unwritable
  for route, r in results.items():
    runs, calls = r["runs"], r["calls"]
    assert all(run["same_program"] and run["fallback"] is None and not run["failed"] for run in runs.values()), r
    assert runs["beside"]["kernels"] == len(calls) > 0 and runs["beside"]["kept"] == 0, (route, runs)
    assert runs["kept"]["kernels"] == 0 and runs["kept"]["kept"] == len(calls), (route, runs)
    assert r["fp4jax_entries"] == calls and r["launch_grids"], (route, r)
    assert runs["again"]["kept"] == len(calls) and runs["again"]["kernels"] == 0, (route, runs)
    assert {run["options"][compiling.KERNEL_CACHE_OPTION] for run in runs.values()} == {r["file"]}, (route, runs)


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["nvfp4", "quartet2", "mxfp4"])
def test_gpu_program_with_kernels_compiled_alone_gives_the_same_bits(route, tmp_path):
  """On the GPU: fp4_dot's forward and backward compiled beside its kernels compiled alone runs, and gives the
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


def test_a_compile_that_fails_with_the_kernel_file_compiles_again_without_it(tmp_path):
  """The fallback: a warning, the program compiled as jax.jit would, and the kernel file deleted."""
  bad = tmp_path / "program-x.bin"
  bad.write_bytes(b"not a kernel file")

  class Lowered:  # fails with the kernel file, compiles without it
    def compile(self, compiler_options=None):
      if compiler_options and compiling.KERNEL_CACHE_OPTION in compiler_options:
        raise RuntimeError("cannot link cached kernels")
      return "compiled"

  first = compiling.KernelsFirst()
  with pytest.warns(UserWarning, match="cannot link cached kernels"):
    assert first.compile(Lowered(), {compiling.KERNEL_CACHE_OPTION: str(bad)}) == "compiled"
  assert first.report.fallback == "RuntimeError: cannot link cached kernels" and not bad.exists()

  class Broken:  # fails however it is compiled
    def compile(self, compiler_options=None):
      raise RuntimeError("the program's own error")

  with pytest.raises(RuntimeError, match="the program's own error"):  # no kernel file: nothing to fall back from
    compiling.KernelsFirst().compile(Broken(), {})


def test_report_summary_says_how_the_kernels_compiled():
  report = compiling.Report(kernels=13, kept=2, threads=13, ready_s=1.25, program_s=4.0)
  assert report.summary() == ("13 Pallas kernels compiled alone on 13 threads beside the program's compile, the "
                              "last ready 1.2 s into its 4.0 s; 2 kept from before")
  report = compiling.Report(failed=["k_1: TypeError"], fallback="XlaRuntimeError: link")
  assert report.summary() == ("1 kernels left to the program (k_1: TypeError); compiled again without them "
                              "(XlaRuntimeError: link)")
  assert compiling.Report().summary() == ""


def test_kernels_compile_beside_the_program_unless_turned_off(monkeypatch):
  """On by default (on an H200 host they took 1-4 s off a 30M FP4 step's compile): the library (threads=None),
  `train` (run.kernels_first) and `bench` (--kernels-first, on unless given)."""
  from bench.__main__ import main as bench_main  # pylint: disable=g-import-not-at-top
  from train import config  # pylint: disable=g-import-not-at-top
  assert inspect.signature(compiling.compile_program).parameters["threads"].default is None
  assert inspect.signature(compiling.KernelsFirst).parameters["threads"].default is None
  assert config.RunConfig().kernels_first is True
  seen = {}
  monkeypatch.setattr("bench.compile.run", lambda args: seen.setdefault("kw", args_lib.kernels_first(args)) and 0)
  bench_main(["--compile-cache", "off", "compile", "--small"])
  assert seen["kw"] == {"threads": None, "directory": None}
