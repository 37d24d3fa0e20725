"""Compiling a program with its Pallas kernels compiled alone, in parallel, beside it (`compile_program`).

XLA:GPU compiles the Triton kernel of every `pallas_call` launch configuration in a program when it emits the
program's code, after its HLO passes and GEMM autotuning, as jobs of its compile pool: the slowest of them then
bounds how soon the compile ends. On an H100 host the Llama-30M nvfp4 step's code generation took 1.50 s against
bf16's 0.27 s, mostly waiting for its kernels (docs/BENCHMARKS.md, "Session of 2026-12-07, 16:50 UTC"). Compiled
alone from the moment the program is lowered, they compile while XLA optimizes the program, and are ready when
it emits code.

How: XLA's kernel reuse cache (the `xla_gpu_kernel_cache_file` option), which XLA reads when it starts emitting
the program's code, not when the compile starts: written 1 s into a 30M nvfp4 compile for an H200 it was taken,
4 s in it was not (CPU, docs/BENCHMARKS.md, "Session of 2026-12-07, 19:30 UTC"). For a Triton call its key is
the call's backend configuration (kernel name, Triton IR, grid, warps and stages), so a kernel compiled in a
program of its own is taken by any program that holds the same call. `KernelsFirst.lower` lowers the program,
takes each distinct Triton call out of its StableHLO as a program of its own (`triton_calls`), and starts
compiling those on a thread pool, each into a file of its own; as each lands, the program's kernel file is
rewritten (a new file renamed into place) with every kernel landed so far. The program compiles meanwhile with
that file: a kernel that lands after XLA read it compiles in the program, as it would without. At the end of its
compile XLA writes the file back with the program's other kernels added (its own fusions): a kernel landing after
the program compiled leaves the file as XLA wrote it, so a later compile of the same program, its JAX cache entry
gone, starts with all of them. XLA reserves
every name in the file before it names new kernels and takes a cached kernel only for an equal key, so the
program runs the code it would run otherwise.

The pool's threads compile bytes (XLA, which releases the GIL); nothing of them runs while Python traces. An
earlier design traced and lowered each launch alone on the pool from its trace on: that slowed the trace by
1.2-1.9 s on an H100 host of 16 CPUs, whatever the threads' priority (docs/BENCHMARKS.md, "Session of
2026-12-07, 16:50 UTC").

Where nothing is to gain it compiles the program as `jax.jit` does: no Triton call (CPU, interpret mode), or no
thread to spare (machines of 2 CPUs or fewer, or `threads=0`). On by default (`train`'s `run.kernels_first`,
`bench`'s `--kernels-first`): on an H200 host of 16 CPUs the compiles of the Llama-30M FP4 steps took 5.1-5.8,
5.2-5.9 and 6.2-6.4 s (mxfp4, nvfp4, quartet2) instead of 6.0-7.4, 7.0-8.8 and 7.9-10.4 s, their kernels all
ready 0.9-1.8 s into them; bf16's, with no Triton call, as before (docs/BENCHMARKS.md, "Session of 2026-12-07,
19:30 UTC").

The file records a kernel's launch grid as its count of blocks, so a kernel taken from it runs on a one-axis
grid of that many blocks: fp4jax's kernels launch on one axis (`ops.quantize.pallas.common.pallas_call`), which
the file records whole. Before they did, such programs ran wrong on an H100 (NaNs, an input overwritten;
docs/BENCHMARKS.md, 2026-12-05); since, they give the bits of the program compiled alone there. The file is
keyed by kernel name: a name met with two keys in one program is left out of it (`merge_kernel_files`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import io
import os
import pathlib
import shutil
import tempfile
import threading
import time
import warnings
from typing import Any, Iterator

import jax
from jax._src import compiler  # get_compile_options, backend_compile_and_load: a program compiled from MLIR
from jax._src.interpreters import mlir
from jax._src.lib import _jax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import func

from fp4jax import platform

KERNEL_CACHE_OPTION = "xla_gpu_kernel_cache_file"
TRITON_TARGET = "__gpu$xla.gpu.triton"  # the custom call a Triton pallas_call lowers to
# A call's attributes that place it in its program (its sharding there, GSPMD's or Shardy's), not its kernel.
_PLACEMENT = ("mhlo.sharding", "mhlo.frontend_attributes", "sdy.")


@dataclasses.dataclass(frozen=True)
class TritonCall:
  """One distinct Triton call of a lowered program as a program of its own: its kernel name, a digest of its
  backend configuration (what XLA's kernel file keys the kernel by) and of JAX's version, the block count of
  its grid, its operand types, and the program (MLIR bytecode: compiled on any thread, in any MLIR context)."""

  name: str
  digest: str
  blocks: int
  operands: tuple[str, ...]
  module: bytes


def _ops(op) -> Iterator[Any]:
  """Every operation nested in `op` (func bodies, scan and cond regions), depth first."""
  for region in op.regions:
    for block in region.blocks:
      for child in block.operations:
        child = child.operation
        yield child
        yield from _ops(child)


def triton_calls(lowered: jax.stages.Lowered) -> list[TritonCall]:
  """The distinct Triton calls of `lowered` (its StableHLO), in first-seen order, each as a program of its own;
  interpret-mode and Mosaic GPU kernels are none."""
  found: dict[str, Any] = {}
  for op in _ops(lowered.compiler_ir("stablehlo").operation):
    if op.name == "stablehlo.custom_call" and \
        ir.StringAttr(op.attributes["call_target_name"]).value == TRITON_TARGET:
      found.setdefault(_digest(jax.__version__ + str(op.attributes["mhlo.backend_config"])), op)
  return [_alone(op, digest) for digest, op in found.items()]


def _alone(op, digest: str) -> TritonCall:
  """The Triton call `op` as a program of its own: its operands the program's parameters, its results the
  program's, its attributes but its placement (`_PLACEMENT`) copied."""
  config = op.attributes["mhlo.backend_config"]
  name = ir.StringAttr(config["name"]).value
  blocks = 1
  for axis in "xyz":
    blocks *= ir.IntegerAttr(config[f"grid_{axis}"]).value
  operands, results = [v.type for v in op.operands], [r.type for r in op.results]
  with op.context, ir.Location.unknown():
    module = ir.Module.create()
    module.operation.attributes["sym_name"] = ir.StringAttr.get(f"alone_{name}")
    with ir.InsertionPoint(module.body):
      main = func.FuncOp("main", ir.FunctionType.get(operands, results))
      main.attributes["sym_visibility"] = ir.StringAttr.get("public")
      block = main.add_entry_block()
      with ir.InsertionPoint(block):
        attributes = {key: op.attributes[key] for key in op.attributes if not key.startswith(_PLACEMENT)}
        call = ir.Operation.create("stablehlo.custom_call", results=results, operands=list(block.arguments),
                                   attributes=attributes)
        func.ReturnOp(call.results)
    data = io.BytesIO()
    module.operation.write_bytecode(data)
  return TritonCall(name, digest, blocks, tuple(map(str, operands)), data.getvalue())


def first_device(mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None):
  """The device a Triton call is compiled alone for: `mesh`'s first where it is a concrete mesh (an H200 compiled
  for without one, `jax.set_mesh`), else JAX's first. A kernel's code is the same on every device of a mesh."""
  concrete = isinstance(mesh, jax.sharding.Mesh) and not mesh.empty
  return mesh.devices.flat[0] if concrete else jax.devices()[0]


def compile_alone(call: TritonCall, device, kernel_file: str | None = None) -> float:
  """Compiles `call`'s program for `device` (a GPU, or a deviceless one's target), its kernel written to the
  kernel file `kernel_file` where one is named; returns the seconds it took. Inside a program XLA compiles each
  call as one job of its pool, so the slowest call alone bounds how soon the program's compile can end (`bench
  compile --kernels` lists them, slowest first)."""
  overrides = {} if kernel_file is None else {KERNEL_CACHE_OPTION: kernel_file}
  options = compiler.get_compile_options(num_replicas=1, num_partitions=1, env_options_overrides=overrides)
  with mlir.make_ir_context():
    module = ir.Module.parse(call.module)
  t0 = time.perf_counter()
  compiler.backend_compile_and_load(device.client, module, _jax.DeviceList((device,)), options, [])
  return time.perf_counter() - t0


# The kernel file is XLA's CompilationCacheProto: entries (field 1, map<string name, entry>; the entry's field 1
# is its key) and compatibility_version (field 2). Read as protobuf wire format.
def _varint(data: bytes, i: int) -> tuple[int, int]:
  value = shift = 0
  while True:
    byte = data[i]
    i += 1
    value |= (byte & 0x7F) << shift
    if not byte & 0x80:
      return value, i
    shift += 7


def _fields(data: bytes) -> Iterator[tuple[int, bytes | int, bytes]]:
  """(field number, value, the field's bytes) of a serialized message; varint and length-delimited fields."""
  i = 0
  while i < len(data):
    start = i
    tag, i = _varint(data, i)
    number, wire = tag >> 3, tag & 7
    if wire == 0:
      value, i = _varint(data, i)
    elif wire == 2:
      size, i = _varint(data, i)
      value, i = data[i:i + size], i + size
    else:
      raise ValueError(f"unexpected protobuf wire type {wire} in an XLA kernel file")
    yield number, value, data[start:i]


def kernel_entries(data: bytes) -> tuple[list[tuple[str, bytes, bytes]], bytes]:
  """((name, key, the entry's bytes) of each kernel, the version field's bytes) of a kernel file's contents."""
  entries, version = [], b""
  for number, value, raw in _fields(data):
    if number == 1:
      pair = {n: v for n, v, _ in _fields(value)}
      entry = {n: v for n, v, _ in _fields(pair.get(2, b""))}
      entries.append((pair[1].decode(), entry.get(1, b""), raw))
    elif number == 2:
      version = raw
  return entries, version


def merge_kernel_files(contents: list[bytes], names: set[str]) -> tuple[bytes, int]:
  """One kernel file of the entries named in `names` from several files' `contents` (a key kept once), and how
  many kernels it holds. A name met with two different keys is left out: the file maps names to kernels."""
  keys: dict[str, set[bytes]] = {}
  raw: dict[str, bytes] = {}
  version = b""
  for data in contents:
    entries, v = kernel_entries(data)
    version = version or v
    for name, key, entry in entries:
      if name in names:
        keys.setdefault(name, set()).add(key)
        raw.setdefault(name, entry)
  kept = [raw[n] for n in sorted(raw) if len(keys[n]) == 1]
  return b"".join(kept) + version, len(kept)


def _digest(text: str) -> str:
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def _own_path(path: pathlib.Path) -> pathlib.Path:
  """A temporary file beside `path` that no other process or thread writes: renamed onto `path` once whole."""
  return path.with_name(f"{path.name}.{os.getpid()}.{threading.get_native_id()}.tmp")


def _write_atomically(path: pathlib.Path, data: bytes) -> None:
  """Writes `path` through a temporary file and a rename: a process reading it sees the old or the new file."""
  tmp = _own_path(path)
  tmp.write_bytes(data)
  os.replace(tmp, path)


KERNEL_NICENESS = 10


def _yield_the_cpu() -> None:
  """Lowers the calling thread's CPU priority (Linux: niceness per thread, inherited by the `ptxas` processes
  XLA starts from it), so that kernels compiling alone take the CPUs the program's compile leaves idle, not its
  share. Elsewhere, or where it is refused, the priority stays."""
  with contextlib.suppress(AttributeError, OSError):
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), KERNEL_NICENESS)


@dataclasses.dataclass
class Report:
  """What `KernelsFirst` did: the program's Triton calls compiled alone (`kernels`) and those whose kernel files
  were kept from before (`kept`), on how many threads; the seconds from the start of the program's compile to
  the moment the last kernel landed in its file (`ready_s`: negative if before, None if none compiled), and the
  program's compile (`program_s`); the calls that failed to compile alone (`failed`, left to the program); and
  why the program compiled without the kernel file (`fallback`, None if it did not)."""

  kernels: int = 0
  kept: int = 0
  threads: int = 0
  ready_s: float | None = None
  program_s: float = 0.0
  fallback: str | None = None
  failed: list[str] = dataclasses.field(default_factory=list)

  def summary(self) -> str:
    """One line on how the kernels compiled ("" where none compiled alone and nothing went wrong)."""
    parts = []
    if self.kernels:
      ready = "" if self.ready_s is None else f", the last ready {self.ready_s:.1f} s into"
      parts.append(f"{self.kernels} Pallas kernels compiled alone on {self.threads} threads beside the program's "
                   f"compile{ready} its {self.program_s:.1f} s")
    if self.kept:
      parts.append(f"{self.kept} kept from before")
    if self.failed:
      parts.append(f"{len(self.failed)} kernels left to the program ({', '.join(self.failed[:3])})")
    if self.fallback:
      parts.append(f"compiled again without them ({self.fallback})")
    return "; ".join(parts)


class KernelsFirst:
  """A program's Triton kernels compiled alone, in parallel, beside the program's own compile (module
  docstring), in steps:

    with KernelsFirst(threads=None, directory=None) as first:
      lowered, options = first.lower(jitted.trace(*args))  # the kernels start compiling
      compiled = first.compile(lowered, options)           # the program compiles beside them

  threads: None (the default) one per usable CPU but one, none below 3 (with one thread the kernels would
  compile one after the other, and the program beside them would share a CPU with them); 0 compiles the program
  as `jax.jit` does. The options are empty where nothing is to gain: no Triton call (CPU, interpret mode), or no
  thread. The kernels compile for the first device of the concrete mesh set on entry (`jax.set_mesh`; an H200
  compiled for without one), else JAX's first device.

  A call that fails to compile alone is left to the program (`Report.failed`), and so is one not started when the
  program's compile returns (taken from JAX's cache, say).
  directory: where the kernel files are kept. None: a temporary directory, deleted on exit. A directory that
  persists (beside JAX's persistent compilation cache: `platform.kernel_cache_dir`) keeps each kernel's file and
  the program's, named by their digests: a call whose file is there compiles no more, and a later compile of a
  program with the same kernels takes the program's file as it is (XLA adds the program's other kernels to it
  at the end of each compile); the file's path, part of JAX's cache key, stays the same from one run to the next.
  """

  def __init__(self, *, threads: int | None = None, directory: str | os.PathLike | None = None):
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 0):
      # checked here: with no Triton call (a CPU) the value would not be read, and a GPU would fail on it later
      raise ValueError(f"kernels_first's threads takes an int >= 0 or None (one per usable CPU but one), got "
                       f"{threads!r}")
    if threads is None:
      cpus = platform.usable_cpus()
      threads = cpus - 1 if cpus > 2 else 0
    self.threads, self.directory, self.report = threads, directory, Report()
    self._pool: concurrent.futures.ThreadPoolExecutor | None = None
    self._dir: pathlib.Path | None = None
    self._keep, self._device = False, None
    self._lock = threading.Lock()
    self._landed: list[bytes] = []  # the kernel files in the program's file, in the order they landed
    self._program: pathlib.Path | None = None
    self._names: set[str] = set()
    self._last_landed: float | None = None  # when the last kernel landed (time.perf_counter)
    self._program_compiled = False  # set once the program's compile returned: its file is XLA's from then on

  def __enter__(self) -> KernelsFirst:
    if self.threads <= 0:
      return self
    keep = self.directory is not None
    if keep:
      try:
        pathlib.Path(self.directory, "kernels").mkdir(parents=True, exist_ok=True)
      except OSError as e:  # an unwritable cache location: this compile keeps its kernel files in a temporary one
        warnings.warn(f"cannot keep kernel files in {self.directory} ({e}); using a temporary directory",
                      stacklevel=2)
        keep = False
    self._keep = keep
    self._dir = pathlib.Path(self.directory) if keep else pathlib.Path(tempfile.mkdtemp(prefix="fp4jax-kernels-"))
    (self._dir / "kernels").mkdir(exist_ok=True)
    self._device = first_device(jax.sharding.get_mesh())
    return self

  def __exit__(self, *exc) -> None:
    if self._pool is not None:
      self._pool.shutdown(wait=True)  # a compile may be writing into the directory deleted next
    if self._dir is not None and not self._keep:
      shutil.rmtree(self._dir, ignore_errors=True)

  def lower(self, traced: jax.stages.Traced) -> tuple[jax.stages.Lowered, dict]:
    """(`traced` lowered, the compiler options that hand it its kernels): the program's Triton calls whose kernel
    files are not kept start compiling alone, the largest first, and its kernel file holds those that are."""
    lowered = traced.lower()
    calls = triton_calls(lowered) if self._dir is not None else []
    if not calls:
      return lowered, {}
    self._program = self._dir / f"program-{_digest(' '.join(sorted(c.digest for c in calls)))}.bin"
    options = {KERNEL_CACHE_OPTION: str(self._program)}
    if self._program.exists():  # compiled before: XLA takes its kernels (and replaces those that changed)
      self.report.kept = len(calls)
      return lowered, options
    self._names = {c.name for c in calls}
    todo = []
    for call in calls:
      path = self._dir / "kernels" / f"{call.digest}-{call.name}.bin"
      if path.exists():
        self._landed.append(path.read_bytes())
      else:
        todo.append((call, path))
    self.report.kept = len(self._landed)
    self._write_program()
    if todo:
      self.report.kernels, self.report.threads = len(todo), min(self.threads, len(todo))
      self._pool = concurrent.futures.ThreadPoolExecutor(self.report.threads, thread_name_prefix="fp4jax-kernel",
                                                         initializer=_yield_the_cpu)
      for call, path in sorted(todo, key=lambda job: -len(job[0].module)):  # the largest (slowest) first
        self._pool.submit(self._compile_alone, call, path)
    return lowered, options

  def _compile_alone(self, call: TritonCall, path: pathlib.Path) -> None:
    """Compiles `call` alone into `path` and adds it to the program's file; a failure is left to the program.
    XLA writes the kernel into a file of this thread's and the file is renamed into place: a process sharing a
    kept directory reads a kernel file whole or not at all."""
    own = _own_path(path)
    try:
      compile_alone(call, self._device, str(own))
      data = own.read_bytes()
      os.replace(own, path)
    except Exception as e:  # pylint: disable=broad-except  # any failure: the program compiles the kernel itself
      with self._lock:
        self.report.failed.append(f"{call.name}: {type(e).__name__}")
      with contextlib.suppress(OSError):
        own.unlink()
      return
    with self._lock:
      self._landed.append(data)
      if not self._program_compiled:  # after it, XLA's file holds the kernel and every kernel XLA added
        self._write_program()
      self._last_landed = time.perf_counter()

  def _write_program(self) -> None:
    """The program's kernel file rewritten with every kernel landed so far (under `_lock`, or before the pool)."""
    merged, _ = merge_kernel_files(self._landed, self._names)
    _write_atomically(self._program, merged)

  def compile(self, lowered: jax.stages.Lowered, options: dict,
              compiler_options: dict | None = None) -> jax.stages.Compiled:
    """`lowered` compiled with `options` (`lower`'s) added to `compiler_options`, beside the kernels compiling
    alone, which it then waits for; a compile that fails with the kernel file runs again without it, with a
    warning (`report.fallback` says why), and the file is deleted."""
    base = dict(compiler_options or {})
    t0 = time.perf_counter()
    try:
      compiled = lowered.compile(compiler_options={**base, **options} or None)
    except Exception as e:  # pylint: disable=broad-except  # any failure with the file: compile as without it
      if not options:
        raise
      self.report.fallback = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
      warnings.warn(f"compiling with the kernels compiled alone failed ({self.report.fallback}); compiling the "
                    f"program alone", stacklevel=2)
      if self._pool is not None:
        self._pool.shutdown(wait=True)  # else a kernel landing next would write the file again
      with contextlib.suppress(OSError):  # a kept file would fail the next compile too: the next builds it anew
        os.remove(options[KERNEL_CACHE_OPTION])
      compiled = lowered.compile(compiler_options=base or None)
    self.report.program_s = time.perf_counter() - t0
    with self._lock:
      self._program_compiled = True
    if self._pool is not None:
      # A kernel not started yet is of no use to this compile (XLA has compiled it in the program): it is not
      # started at all, so that a program taken from JAX's cache while its kernel files were gone waits only for
      # the kernels already compiling. The report counts the kernels that did compile alone.
      self._pool.shutdown(wait=True, cancel_futures=True)
      self.report.kernels = len(self._landed) - self.report.kept + len(self.report.failed)
    if self._last_landed is not None:
      self.report.ready_s = self._last_landed - t0
    return compiled


def compile_program(jitted, *args, threads: int | None = None, directory: str | os.PathLike | None = None,
                    compiler_options: dict | None = None) -> tuple[jax.stages.Compiled, Report]:
  """`jitted` (a `jax.jit` function) traced, lowered and compiled for `args` (arrays or ShapeDtypeStructs), its
  Triton kernels compiled alone beside it (`KernelsFirst`, whose `threads` and `directory` these are); returns
  the compiled program and the `Report`. compiler_options: for the program's compile, the kernel file added."""
  if not isinstance(jitted, jax.stages.Wrapped):
    raise TypeError(f"compile_program takes a jax.jit function (compile_program(jax.jit(step), *args)), got "
                    f"{jitted!r}")
  with KernelsFirst(threads=threads, directory=directory) as first:
    lowered, options = first.lower(jitted.trace(*args))
    return first.compile(lowered, options, compiler_options), first.report
