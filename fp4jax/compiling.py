"""Compiling a program with its Pallas kernels compiled first, in parallel (`compile_program`).

XLA:GPU compiles the Triton kernel of every `pallas_call` launch configuration in a program as a job of the pool
that also compiles the program's own kernels (`--xla_gpu_force_compilation_parallelism` threads; with one, all on
the thread that emits the program): compiled for an H200 on a 2-core CPU (no GPU), the Llama-30M nvfp4 train
step's 13 launches took 2.9 of its 7.5 s of compile, quartet2's 24 took 4.5 of 10.3 s, which the program no longer
spent once they were compiled beforehand (docs/BENCHMARKS.md, "CPU session of 2026-12-05, 06:44"). Compiled
first, they run side by side on the host's other CPUs while Python traces and lowers the program, instead of
inside the program's compile; on hosts of many CPUs, where the pool already runs them side by side, that gains
little (docs/BENCHMARKS.md, "Session of 2026-12-07, 06:28 UTC").

How: XLA's kernel reuse cache (the `xla_gpu_kernel_cache_file` option). For a Triton call its key is the call's
backend configuration: kernel name, Triton IR, grid, warps and stages, so a kernel compiled in a program of its
own is taken by any program that holds the same call. `compile_program` (`KernelsFirst`) compiles each distinct
Triton launch alone on a thread pool, each into a file of its own, from the moment the launch is traced
(`bind_launch`), while the main thread traces and lowers the program, its threads at a lower CPU priority than
that thread (`_yield_the_cpu`); merges the files (entries of the program's kernels only; a name met with two keys
is left out); and compiles the program with the merged file. XLA reserves every name in the file before it names
new kernels and takes a cached kernel only for an equal key, so the program runs the code it would run otherwise.
The file is keyed by kernel name, so reuse needs one name per launch configuration: fp4jax's kernels are named
so (`ops.quantize.pallas.common.launch_name`); kernels of other names compile as before, in the program.

Where nothing is to gain it compiles the program as `jax.jit` does: no Triton launch (CPU, interpret mode), or
no thread to spare (`threads=0`, the default; on machines of 2 CPUs or fewer with `threads=None`).

The file records a kernel's launch grid as its count of blocks, so a kernel taken from it runs on a one-axis
grid of that many blocks: fp4jax's kernels launch on one axis (`ops.quantize.pallas.common.pallas_call`), which
the file records whole. Before they did, such programs ran wrong on an H100 (NaNs, an input overwritten;
docs/BENCHMARKS.md, 2026-12-05); since, they give the bits of the program compiled alone there.

Opt-in in `train` and `bench` (off by default): on H100 hosts of 16 CPUs it saved 0-1 s of the Llama-30M steps'
first calls (8-11 s), less than the spread between runs (docs/BENCHMARKS.md, "Session of 2026-12-05, 13:48"), and
on 2026-12-07 nothing: the program's compile was 1.5 s shorter, the lowering waited 1.4 s longer for the kernels,
whose slowest took 1.7 s alone ("Session of 2026-12-07, 11:24 UTC"). Started as each kernel is traced, 0.4-1.0 s
of nvfp4's and quartet2's 10-13 s, nothing of mxfp4's: the trace took 1.3-1.9 s longer, slowed by the kernel
compiles beside it ("Session of 2026-12-07, 14:05 UTC"). Their threads' lower priority shortened that on a 2-CPU
machine, not on an H100 host of 16 CPUs, where the trace still took 1.2-1.9 s longer: a compile slows Python in its
own process, not in another (a thread that only compiled launches lowered beforehand halved a Python loop's speed
on the main thread), so only a compile in another process would overlap the trace ("Session of 2026-12-07,
16:50 UTC").
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import os
import pathlib
import shutil
import tempfile
import threading
import time
import warnings
from typing import Any, Callable, Iterator

import jax
import jax.extend

from fp4jax import platform

KERNEL_CACHE_OPTION = "xla_gpu_kernel_cache_file"


@dataclasses.dataclass(frozen=True)
class Launch:
  """One distinct Triton `pallas_call` of a program: its kernel name, the primitive and its parameters, and the
  abstract operands (what compiling it alone needs)."""

  name: str
  primitive: Any
  params: dict
  avals: tuple


@dataclasses.dataclass
class Report:
  """What `KernelsFirst` and `compile_lowered` did: the program's launches compiled alone (`kernels`; 0 when none
  was, or the program's kernel file was there already), how many of them started while it traced (`traced`), on
  how many threads, the seconds from their start to the last one's end (`kernel_s`, overlapping the trace and
  the lowering), the launches that failed to compile alone (`failed`), how long the program's own compile then
  took (`program_s`), and why it compiled without the kernel file (`fallback`, None if it did not)."""

  kernels: int = 0
  traced: int = 0
  threads: int = 0
  kernel_s: float = 0.0
  program_s: float = 0.0
  fallback: str | None = None
  failed: list[str] = dataclasses.field(default_factory=list)

  def summary(self) -> str:
    """One line on how the kernels compiled ("" where none compiled alone and nothing went wrong)."""
    parts = []
    if self.kernels:
      parts.append(f"{self.kernels} Pallas kernels compiled first ({self.traced} from their trace on) on "
                   f"{self.threads} threads in {self.kernel_s:.1f} s, then the program in {self.program_s:.1f} s")
    if self.failed:
      parts.append(f"{len(self.failed)} kernels left to the program ({', '.join(self.failed[:3])})")
    if self.fallback:
      parts.append(f"compiled again without them ({self.fallback})")
    return "; ".join(parts)


def _subjaxprs(value) -> Iterator[Any]:
  """The jaxprs inside one equation parameter (a jaxpr, a closed one, or a tuple of them)."""
  if isinstance(value, jax.extend.core.ClosedJaxpr):
    yield value.jaxpr
  elif isinstance(value, jax.extend.core.Jaxpr):
    yield value
  elif isinstance(value, (tuple, list)):
    for v in value:
      yield from _subjaxprs(v)


def triton_launches(jaxpr) -> list[Launch]:
  """The distinct Triton `pallas_call`s in `jaxpr` and every jaxpr nested in it (scan bodies, custom_vjp and
  checkpoint regions, conds), in first-seen order; interpret-mode and Mosaic GPU calls are not Triton."""
  seen: dict[tuple, Launch] = {}

  def visit(j):
    for eqn in j.eqns:
      if eqn.primitive.name == "pallas_call" and not eqn.params["interpret"] and \
          type(eqn.params["compiler_params"]).__module__.endswith("triton.core"):
        avals = tuple(v.aval for v in eqn.invars)
        key = (eqn.params["name"], repr(eqn.params["grid_mapping"]), avals)
        seen.setdefault(key, Launch(eqn.params["name"], eqn.primitive, dict(eqn.params), avals))
      for value in eqn.params.values():
        for sub in _subjaxprs(value):
          visit(sub)

  visit(jaxpr)
  return list(seen.values())


# Set while a `KernelsFirst` traces on this thread (a context variable: its pool's threads do not inherit it):
# what `bind_launch` hands each traced launch to.
_collector: contextvars.ContextVar[Callable[[Launch], None] | None] = contextvars.ContextVar(
    "fp4jax_kernels_first", default=None)


def bind_launch(launch: Callable, *args):
  """`launch(*args)`, a `pl.pallas_call`'s launch (every fp4jax kernel is bound here or, traced already, by
  `bind_jaxpr`: `ops.quantize.pallas.bodies.launch`). While a `KernelsFirst` traces on this thread, the launch
  is traced to its own jaxpr first and handed over (each Triton `pallas_call` in it, `triton_launches`), then
  bound from that jaxpr: its kernel starts compiling alone while the rest of the program traces, and its body
  is traced once."""
  if _collector.get() is None:
    return launch(*args)
  return bind_jaxpr(*jax.make_jaxpr(launch, return_shape=True)(*args), *args)


def bind_jaxpr(closed, shapes, *args):
  """The outputs (of `shapes`' structure) of the launch traced to `closed`, bound on `args`, its Triton launches
  handed to the `KernelsFirst` that traces on this thread, if one does (`bind_launch`, for a launch traced
  already: `ops.quantize.pallas.bodies`)."""
  collect = _collector.get()
  if collect is not None:
    for found in triton_launches(closed.jaxpr):
      collect(found)
  return jax.tree.unflatten(jax.tree.structure(shapes), jax.extend.core.jaxpr_as_fun(closed)(*args))


def standalone_arg(aval, mesh) -> jax.ShapeDtypeStruct:
  """The abstract argument for compiling a launch alone from one of its operands' avals: a jaxpr's avals carry
  shardings over an abstract mesh, which compile only under a concrete one, so such a sharding is rebuilt on
  `mesh` (the caller's concrete mesh, as an H200 compiled for without one needs) or dropped (None: the default
  device, as a single-device step runs)."""
  sharding = getattr(aval, "sharding", None)
  if sharding is not None and not isinstance(getattr(sharding, "mesh", None), jax.sharding.Mesh):
    sharding = None if mesh is None else jax.sharding.NamedSharding(mesh, sharding.spec)
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding)


def compile_alone(launch: Launch, mesh=None, kernel_file: str | None = None) -> float:
  """Compiles `launch` as a program of its own (under the caller's concrete `mesh`, None for none), its kernel
  written to the kernel file `kernel_file` where one is named; returns the seconds it took (lowering included).
  Inside a program XLA compiles each launch as one job of its pool, so the slowest launch alone bounds how soon
  the program's compile can end (`bench compile --kernels` lists them, slowest first)."""
  args = [standalone_arg(a, mesh) for a in launch.avals]
  fn = jax.jit(lambda *ops: launch.primitive.bind(*ops, **launch.params))
  options = None if kernel_file is None else {KERNEL_CACHE_OPTION: kernel_file}
  t0 = time.perf_counter()
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    fn.trace(*args).lower().compile(compiler_options=options)
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


@functools.cache
def _sources_digest() -> str:
  """A digest of JAX's version and fp4jax's sources: a kept kernel file is taken only by the code it was compiled
  from (a launch's name fixes its configuration, not its kernel's code)."""
  text = jax.__version__ + "".join(p.read_text() for p in sorted(pathlib.Path(__file__).parent.rglob("*.py")))
  return _digest(text)


def _file_name(launch: Launch) -> str:
  """The name of `launch`'s kernel file: its kernel name after a digest of the launch and of the code."""
  return _digest(repr((launch.name, launch.avals, repr(launch.params["grid_mapping"]), _sources_digest()))) + \
      "-" + launch.name


def _write_atomically(path: pathlib.Path, data: bytes) -> None:
  """Writes `path` through a temporary file and a rename: a process reading it sees the old or the new file."""
  tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
  tmp.write_bytes(data)
  os.replace(tmp, path)


KERNEL_NICENESS = 10


def _yield_the_cpu() -> None:
  """Lowers the calling thread's CPU priority (Linux: niceness per thread, inherited by the `ptxas` processes
  XLA starts from it), so that kernels compiling alone take the CPUs the tracing and lowering thread leaves
  idle, not that thread's share. Elsewhere, or where it is refused, the priority stays."""
  with contextlib.suppress(AttributeError, OSError):
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), KERNEL_NICENESS)


class KernelsFirst:
  """A program's Triton kernels compiled alone, in parallel, before the program (module docstring), in steps:

    with KernelsFirst(threads=None, directory=None) as first:
      traced = first.trace(jitted, *args)      # each launch starts compiling as soon as it is traced
      lowered, options = first.lower(traced)   # the rest start; the program lowers; the kernels are waited for
      compiled = compile_lowered(lowered, options, first.report)

  threads: 0 (the default) compiles the program as `jax.jit` does; None one per usable CPU but one, none below 2
  (with one thread the kernels would compile one after the other, as in the program). The options are empty
  where nothing is to gain: no Triton launch (CPU, interpret mode), or no thread.

  `trace` hands each fp4jax launch to the pool as its kernel is traced (`bind_launch`), so the slowest kernels
  compile while the rest of the program traces and lowers, instead of from the end of the trace on (where the
  lowering then waited 1.4 s for them on an H100 host: docs/BENCHMARKS.md, "Session of 2026-12-07, 11:24 UTC").
  `lower` adds the launches the trace did not hand over (kernels traced before, whose traces JAX reused; other
  libraries' kernels). A launch the trace handed over that the program does not run (fp4_dot's custom_vjp
  primal, traced and then differentiated) compiles for nothing; its kernel is not put in the program's file.

  A launch that fails to compile alone is left to the program (`Report.failed`): possibly those inside a
  `shard_map`, whose operands vary over mesh axes, which on a mesh of several GPUs every X and dY quantizer is
  (`ops.quantize.pallas.rows`; not yet tried on such a mesh).
  directory: where the kernel files are kept. None: a temporary directory, deleted on exit. A directory that
  persists (beside JAX's persistent compilation cache: `platform.kernel_cache_dir`) keeps each kernel's file and
  the program's, named by its kernels: a launch whose file is there compiles no more, and a later compile of a
  program with the same kernels takes the program's file (XLA adds the program's other kernels to it, and
  replaces a kernel whose code changed); the file's path, part of JAX's cache key, stays the same from one run
  to the next.
  """

  def __init__(self, *, threads: int | None = 0, directory: str | os.PathLike | None = None):
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 0):
      # checked here: with no Triton launch (a CPU) the value would not be read, and a GPU would fail on it later
      raise ValueError(f"kernels_first's threads takes an int >= 0 or None (one per usable CPU but one), got "
                       f"{threads!r}")
    if threads is None:
      cpus = platform.usable_cpus()
      threads = cpus - 1 if cpus > 2 else 0
    self.threads, self.directory, self.report = threads, directory, Report()
    self._jobs: dict[str, concurrent.futures.Future] = {}  # by file name (`_file_name`)
    self._seen: set[str] = set()  # the file names of the launches handed over, compiled or kept from before
    self._traced: set[str] = set()  # the jobs started while tracing
    self._pool = self._dir = None
    self._keep, self._mesh, self._t0 = False, None, 0.0

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
    mesh = jax.sharding.get_mesh()
    self._mesh = None if mesh is None or mesh.empty else mesh
    return self

  def __exit__(self, *exc) -> None:
    if self._pool is not None:
      self._pool.shutdown(wait=True)  # a compile may be writing into the directory deleted next
    if self._dir is not None and not self._keep:
      shutil.rmtree(self._dir, ignore_errors=True)

  def _submit(self, launch: Launch, name: str | None = None) -> None:
    """Starts compiling `launch` alone, unless it was started before or its kernel file is kept from before.
    name: its `_file_name`, where the caller has it."""
    name = name or _file_name(launch)
    if name in self._seen:
      return
    self._seen.add(name)
    path = self._dir / "kernels" / f"{name}.bin"
    if path.exists():
      return
    if self._pool is None:
      self._pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="fp4jax-kernel",
                                                         initializer=_yield_the_cpu)
      self._t0 = time.perf_counter()
    self._jobs[name] = self._pool.submit(compile_alone, launch, self._mesh, str(path))

  def trace(self, jitted, *args) -> jax.stages.Traced:
    """`jitted.trace(*args)`, each fp4jax launch handed to the pool as it is traced."""
    if self._dir is None:
      return jitted.trace(*args)
    token = _collector.set(self._submit)
    try:
      return jitted.trace(*args)
    finally:
      _collector.reset(token)
      self._traced = set(self._jobs)

  def lower(self, traced: jax.stages.Traced) -> tuple[jax.stages.Lowered, dict]:
    """(`traced` lowered, the compiler options that hand it its kernels): the program's launches not yet
    compiling start, the program lowers meanwhile, and its kernels, once compiled, are merged into the program's
    kernel file."""
    launches = triton_launches(traced.jaxpr.jaxpr)
    if self._dir is None or not launches:
      return traced.lower(), {}
    names = [_file_name(l) for l in launches]
    program_file = self._dir / f"program-{_digest(' '.join(sorted(names)))}.bin"
    if program_file.exists():  # compiled before: XLA takes its kernels (and replaces those that changed)
      return traced.lower(), {KERNEL_CACHE_OPTION: str(program_file)}
    # The largest kernel bodies first (their equations: a proxy of their compile time), so that with fewer
    # threads than launches the last to finish is a short one.
    for i in sorted(range(len(launches)), key=lambda i: -len(launches[i].params["jaxpr"].eqns)):
      self._submit(launches[i], names[i])
    lowered = traced.lower()
    jobs = [self._jobs[n] for n in names if n in self._jobs]
    self.report.kernels, self.report.threads = len(jobs), min(self.threads, len(self._jobs))
    self.report.traced = sum(n in self._traced for n in names)
    for name, launch in zip(names, launches):
      if name in self._jobs and self._jobs[name].exception() is not None:
        self.report.failed.append(f"{launch.name}: {type(self._jobs[name].exception()).__name__}")
    self.report.kernel_s = time.perf_counter() - self._t0 if jobs else 0.0
    paths = [self._dir / "kernels" / f"{n}.bin" for n in names]
    merged, _ = merge_kernel_files([p.read_bytes() for p in paths if p.exists()], {l.name for l in launches})
    _write_atomically(program_file, merged)
    return lowered, {KERNEL_CACHE_OPTION: str(program_file)}


@contextlib.contextmanager
def kernels_first(traced: jax.stages.Traced, *, threads: int | None = 0,
                  directory: str | os.PathLike | None = None) -> Iterator[tuple[jax.stages.Lowered, dict, Report]]:
  """`KernelsFirst` for a program traced already (its kernels start compiling from the end of its trace on).
  Inside: (the lowered program, the compiler options that hand it its kernels, the `Report`)."""
  with KernelsFirst(threads=threads, directory=directory) as first:
    lowered, options = first.lower(traced)
    yield lowered, options, first.report


def compile_lowered(lowered: jax.stages.Lowered, options: dict, report: Report,
                    compiler_options: dict | None = None) -> jax.stages.Compiled:
  """`lowered` compiled with `options` (`kernels_first`'s) added to `compiler_options`; a compile that fails
  with the kernel file runs again without it, with a warning (`report.fallback` says why), and the file is
  deleted."""
  base = dict(compiler_options or {})
  t0 = time.perf_counter()
  try:
    compiled = lowered.compile(compiler_options={**base, **options} or None)
  except Exception as e:  # pylint: disable=broad-except  # any failure with the file: compile as without it
    if not options:
      raise
    report.fallback = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
    warnings.warn(f"compiling with the kernels compiled first failed ({report.fallback}); compiling the "
                  f"program alone", stacklevel=2)
    with contextlib.suppress(OSError):  # a kept file would fail the next compile too: the next builds it anew
      os.remove(options[KERNEL_CACHE_OPTION])
    compiled = lowered.compile(compiler_options=base or None)
  report.program_s = time.perf_counter() - t0
  return compiled


def compile_program(jitted, *args, threads: int | None = 0, directory: str | os.PathLike | None = None,
                    compiler_options: dict | None = None) -> tuple[jax.stages.Compiled, Report]:
  """`jitted` (a `jax.jit` function) traced, lowered and compiled for `args` (arrays or ShapeDtypeStructs), its
  Triton kernels compiled first (`kernels_first`, whose `threads` and `directory` these are); returns the
  compiled program and the `Report`. compiler_options: for the program's compile, the kernel file added."""
  if not isinstance(jitted, jax.stages.Wrapped):
    raise TypeError(f"compile_program takes a jax.jit function (compile_program(jax.jit(step), *args)), got "
                    f"{jitted!r}")
  with KernelsFirst(threads=threads, directory=directory) as first:
    lowered, options = first.lower(first.trace(jitted, *args))
    return compile_lowered(lowered, options, first.report, compiler_options), first.report
