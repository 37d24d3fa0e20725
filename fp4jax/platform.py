"""Which platform JAX is compiling for, where a choice depends on it (the quantizer implementation "auto", the
fp8 GEMM's output dtype, the attention kernel), and process-wide set-up: the XLA flags, JAX options and JAX's
persistent compilation cache the apps (train, bench) start with, the garbage collector's freeze they compile in
(`old_objects_frozen`), and the Triton dialect's module name that the Pallas kernels' package registers when it
is imported (`alias_triton_dialect_module`).

`vary_alike` casts values inside `jax.shard_map` to one varying type, where fp4_dot and the Pallas kernels
meet both sharded and replicated values.

The default backend answers on a machine with the accelerator; an abstract mesh of GPU devices answers when a
GPU program is lowered on a machine without one (`python -m bench program`), so both see the same program.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import pathlib
import sys
from typing import Iterator

import jax
from jax.experimental.compilation_cache import compilation_cache


def compiles_for_gpu() -> bool:
  """True when JAX compiles for a GPU: the default backend is one, or an abstract mesh of GPU devices is in use."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  return jax.default_backend() == "gpu" or (device is not None and device.platform == "gpu")


def splits_explicit_axes() -> bool:
  """Whether the context's mesh splits arrays over an Explicit axis (`jax.make_mesh`'s default axis type): there
  fp4_dot, `nn.scan.run_layers` and the Llama model run with the mesh's axes Auto (`jax.sharding.auto_axes`),
  where XLA's partitioner places what has no explicit sharding rule (a table lookup, a gather, a loop's stacks)."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and any(mesh.shape[a] > 1 for a in mesh.explicit_axes)


def vary_alike(*arrays: jax.Array, also: tuple[jax.Array, ...] = ()) -> tuple[jax.Array, ...]:
  """`arrays` cast to vary over every `jax.shard_map` axis that any of them (or of `also`) varies over; a no-op
  outside shard_map. Where a computation mixes sharded and replicated values, its results vary with the
  sharded ones: a custom_vjp must return cotangents of its primals' types, a Pallas call declares its outputs'."""
  varying = lambda a: jax.typeof(a).manual_axis_type.varying
  axes = frozenset().union(*(varying(a) for a in arrays + also))
  return tuple(jax.lax.pcast(a, tuple(sorted(axes - varying(a), key=str)), to="varying") for a in arrays)


def usable_cpus() -> int:
  """CPUs this process may run on (its affinity mask where the OS has one, else all of them)."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# XLA flags the apps (train, bench) start with on a GPU (docs/BENCHMARKS.md has the measurements):
#  * Triton GEMM autotuning cost ~45 s per fp4_dot forward + backward on the H200 for the same GEMM speed as
#    cuBLAS ("Compile time").
#  * XLA's dynamic-slice fusion makes a GEMM write straight into a slice of a larger buffer. In a scanned
#    block's forward loop, a GEMM whose output is both used and saved for the backward (a stacked residual)
#    was cloned into such a fusion: o, gate and up ran twice per layer (12 Llama-3-8B blocks scanned in bf16:
#    0.82x the unrolled step with it, 0.92x without; "H200 session of 2026-12-02, 05:02-05:39 UTC").
#  * Compile parallelism: one thread per CPU this process may use for XLA's LLVM -> PTX -> cubin work, most of
#    a train step's compile (Llama-30M nvfp4: 12.7 of 14.7 s in PTX -> CUBIN events, summed over threads). On
#    the H200's 16-core host the first steps compiled 0.9-1.9 s faster (bf16 4.0 -> 3.1 s, mxfp4 11.0 -> 9.1 s,
#    nvfp4 16.4 -> 15.3 s, quartet2 35.4 -> 34.3 s) at the same step time ("H200 session of 2026-12-02,
#    13:08-13:36 UTC").
DEFAULT_XLA_FLAGS = ("--xla_gpu_enable_triton_gemm=false", "--xla_gpu_enable_dynamic_slice_fusion=false",
                     f"--xla_gpu_force_compilation_parallelism={usable_cpus()}")


# XLA options for compiling a state initializer, a program that runs once. XLA:GPU merges the random
# initializers of same-shaped parameters across layers into a few large kernels (horizontal and multi-output
# fusion), which compile slowly: the state of a Llama-1B step (AdamW) took 65.9 s to compile and 0.02 s to
# run; with both passes off 27.7 s (H200, `python -m bench step --preset 1b`, "H200 session of 2026-12-02,
# 08:04-08:40 UTC" in docs/BENCHMARKS.md). XLA ignores the pass names where it has no such pass (CPU).
INIT_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "horizontal_loop_fusion,multi_output_fusion"}


def compile_initializer(fn, *args, **jit_kwargs) -> jax.stages.Compiled:
  """`jax.jit(fn, **jit_kwargs)` lowered for `args` and compiled with INIT_COMPILER_OPTIONS: for functions
  that build state once (same values, a program that compiles faster)."""
  return jax.jit(fn, **jit_kwargs).lower(*args).compile(compiler_options=INIT_COMPILER_OPTIONS)


def deterministic_ops() -> bool:
  """Whether XLA_FLAGS asks XLA:GPU for run-to-run identical results (`--xla_gpu_deterministic_ops` or
  `--xla_gpu_exclude_nondeterministic_ops`, true; the last setting of a name wins, as in XLA's parser). Read
  where fp4jax must build a program differently under it (`nn.llama.layers.attention`)."""
  settings = {}
  for flag in os.environ.get("XLA_FLAGS", "").split():
    name, _, value = flag.partition("=")
    settings[name] = value.lower() in ("", "true", "1")
  return any(settings.get(f"--xla_gpu_{name}", False)
             for name in ("deterministic_ops", "exclude_nondeterministic_ops"))


# JAX options the apps start with (`set_jax_options`):
#  * jax_traceback_in_locations_limit=1: each instruction's metadata in the HLO that XLA compiles holds the
#    innermost frame of the user code that made it, not the Python call stack (JAX keeps up to 100 frames).
#    XLA:GPU walks every instruction's stack, comparing stacks frame by frame, when it builds an executable's
#    profiler annotations, on the thread that compiles: 0.39 s of a Llama-30M nvfp4 step's compile for an H200
#    on a CPU with the full stacks ("Session of 2026-12-07, 09:24 UTC" in docs/BENCHMARKS.md has the rest).
#    The op names (the name stack, jit(...)/scope/op, which profiles show and `bench step`'s breakdown reads)
#    stay whole. jax_include_full_tracebacks_in_locations=False, which also keeps one frame, drops them in JAX
#    0.11.2 (the op name is the bare primitive's).
DEFAULT_JAX_OPTIONS = (("jax_traceback_in_locations_limit", 1),)


def set_jax_options(options: tuple[tuple[str, object], ...] = DEFAULT_JAX_OPTIONS) -> dict[str, object]:
  """Sets each (name, value) of `options` with `jax.config.update`, unless the environment variable of the
  name in upper case is set (the user's choice wins: JAX read it when it was imported); returns what it set."""
  chosen = {name: value for name, value in options if name.upper() not in os.environ}
  for name, value in chosen.items():
    jax.config.update(name, value)
  return chosen


def set_xla_flags(flags: tuple[str, ...] = DEFAULT_XLA_FLAGS) -> str:
  """Adds each `--name=value` of `flags` to the XLA_FLAGS environment variable unless XLA_FLAGS already sets
  that name (the user's choice wins); returns the result. XLA reads XLA_FLAGS once, when JAX first starts a
  backend, so call this before any computation. A single string is a TypeError (its characters would be added
  as flags), a flag not of the form `--name[=value]` a ValueError (XLA would refuse it when its backend starts)."""
  if isinstance(flags, str):
    raise TypeError(f"set_xla_flags takes a tuple of flags, got the string {flags!r}: pass ({flags!r},)")
  for flag in flags:
    if not isinstance(flag, str) or not flag.startswith("--") or len(flag.split()) != 1:
      raise ValueError(f"set_xla_flags takes flags of the form '--name=value', got {flag!r}")
  current = os.environ.get("XLA_FLAGS", "")
  names = {f.split("=")[0] for f in current.split()}
  added = [f for f in flags if f.split("=")[0] not in names]
  os.environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
  return os.environ["XLA_FLAGS"]


@contextlib.contextmanager
def old_objects_frozen() -> Iterator[None]:
  """Inside: Python's cyclic garbage collector skips the objects alive on entry (`gc.freeze`) and scans only
  those made since; the apps compile their steps inside it. Each full collection walks every object the process
  holds (JAX's, Flax's, the model's), and tracing and lowering a train step make enough objects to start
  several: 0.3 s of the Llama-30M nvfp4 step's 2.1 s of tracing and lowering on a CPU, 0.1 of bf16's 0.6 s, at
  the same peak memory (docs/BENCHMARKS.md, "Session of 2026-12-07, 06:28 UTC"). Cycles among new objects are
  collected as before. On exit every frozen object returns to the oldest generation (`gc.unfreeze`), those the
  process froze before included: a process-wide choice, for the apps, which own their process. Two such regions
  at once on two threads (a compile ahead beside the state's initializer) end the freeze with the first to exit."""
  gc.freeze()
  try:
    yield
  finally:
    gc.unfreeze()


def default_cache_dir() -> pathlib.Path:
  """Where the apps keep JAX's persistent compilation cache: $FP4JAX_CACHE, else $XDG_CACHE_HOME/fp4jax/jax
  (~/.cache/fp4jax/jax)."""
  if os.environ.get("FP4JAX_CACHE"):
    return pathlib.Path(os.environ["FP4JAX_CACHE"])
  return pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "fp4jax" / "jax"


CACHE_OFF = ("none", "off")  # the words for "no persistent cache", in train's config and bench's flag alike
CACHE_ON = ("on", "yes", "true")  # words that ask for a cache without naming one: refused, not taken as paths


def _absolute(path: str | os.PathLike) -> pathlib.Path:
  """`path` with a leading ~ expanded, made absolute against the current directory: JAX and the kernel files
  open a cache directory when they first write to it, and a relative one would follow a later os.chdir."""
  return pathlib.Path(os.path.abspath(pathlib.Path(path).expanduser()))


def cache_dir(setting: str) -> pathlib.Path | None:
  """The cache directory an app setting names, absolute (relative to the current directory, `_absolute`):
  "auto" the default (`default_cache_dir`), "none" or "off" no cache (None), in any case; anything else a path,
  a leading ~ expanded (no shell expands it in `--set run.compile_cache=~/c`, and the apps make the directory
  they are given). An empty setting, or one of CACHE_ON in any case, is a ValueError: the first would name the
  current directory, the others a directory of that name in it, where "on" meant the default (such a directory
  is given as ./on)."""
  word = setting.strip().lower()
  if not word:
    raise ValueError("an empty compilation cache setting: give 'auto', 'off' or a directory")
  if word in CACHE_ON:
    raise ValueError(f"{setting.strip()!r} names no compilation cache directory: give 'auto' for the default "
                     f"directory, 'off' for none, or a path (./{setting.strip()} for a directory of that name)")
  if word == "auto":
    return _absolute(default_cache_dir())
  return None if word in CACHE_OFF else _absolute(setting)


def kernel_cache_dir(cache: str | os.PathLike | None) -> pathlib.Path | None:
  """Where `fp4jax.compiling` keeps its kernel files beside the persistent compilation cache `cache` (None: no
  cache, so none kept): the sibling directory `<cache>-xla-kernels` (~/.cache/fp4jax/jax-xla-kernels), absolute."""
  if cache is None:
    return None
  path = _absolute(cache)
  return path.with_name(path.name + "-xla-kernels")


def enable_compilation_cache(directory: str | os.PathLike | None) -> pathlib.Path | None:
  """Turns on JAX's persistent compilation cache in `directory` (created if missing; None turns it off), so a
  second run of the same program loads its executables instead of compiling them (the Pallas kernels' Triton
  code included: it is part of the XLA executable). Every entry is kept (no minimum compile time). JAX writes
  each entry to a temporary file and renames it into place, so processes may share one directory. A relative
  `directory` is taken from the current directory now (returned and given to JAX absolute): JAX opens it only
  when it first reads or writes an entry, after a later os.chdir it would find another directory."""
  path = None if directory is None else _absolute(directory)
  if path is not None:
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  jax.config.update("jax_compilation_cache_dir", None if path is None else str(path))
  compilation_cache.reset_cache()  # JAX opens the directory once per process: a later change needs a reset
  return path


# The name under which MLIR's Python bindings look for the Triton ("tt") dialect's module: the first of their
# dialect search prefixes (`jaxlib.mlir._mlir_libs._mlir.globals.dialect_search_modules`) plus the namespace.
TRITON_DIALECT_LOOKUP = "jaxlib.mlir.dialects.tt"


def alias_triton_dialect_module() -> bool:
  """Registers JAX's Triton dialect module (`jaxlib.triton.dialect`) as `TRITON_DIALECT_LOOKUP`, where MLIR's
  Python bindings look for it; returns whether a module is now imported under that name.

  The bindings import a dialect's module by name (each search prefix + the namespace) for every operation the
  Pallas Triton lowering builds, and remember only an import that succeeded. JAX 0.11.2 ships the "tt" module
  under no such name, so every op cost three failed imports, each a search of sys.path: about 12k for a
  Llama-30M nvfp4 step, a third of its lowering (1.05 -> 0.71 s on a 2-core CPU, the same Triton IR;
  docs/BENCHMARKS.md, 2026-12-04, 15:40). Nothing is replaced: a module already imported under that name is
  kept (True), one that could be imported from there is left to its own import (False), and without JAX's
  Triton bindings nothing is done (False).
  """
  if TRITON_DIALECT_LOOKUP in sys.modules:
    return True
  try:
    from jax._src.lib import triton  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  if importlib.util.find_spec(TRITON_DIALECT_LOOKUP) is not None:
    return False
  sys.modules[TRITON_DIALECT_LOOKUP] = triton.dialect
  return True
