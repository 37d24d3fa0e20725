"""`python -m bench compile`: where compile time goes, per route.

  python -m bench compile [--shapes 0] [--routes ...]                fp4_dot forward and forward+backward
  python -m bench compile --step 30m [--tokens 8x512] [--layers N] [--scan [auto]] [--unfused-linears] [--h200]
                          [--routes ...]                           a whole train step
  python -m bench compile --step 30m --passes 25 ...       and the 25 XLA compile events that took longest
  python -m bench compile --step 30m --repeat 5 ...        each first call in 5 fresh processes: medians
  python -m bench compile --step 30m --h200 --xla ...      compiled for an H200 by XLA:GPU, without a GPU
  python -m bench compile --step 30m --kernels ...         and each Pallas launch compiled alone, slowest first

Each row splits the first call into its phases: tracing (Python: jaxpr of the step), lowering (StableHLO, with
every Pallas kernel's Triton IR) and XLA compilation (passes, GEMM autotuning, Triton -> PTX of each kernel),
counts the Pallas kernels in the lowered module (call sites; distinct Triton IR; distinct launch configurations,
which XLA compiles one each) and its HLO instructions with
every called computation inlined (`inlined_size`: what XLA's passes work through). The train step is a Llama
preset's forward, backward and AdamW update (bf16 compute, the route on every linear but the embedding and
lm_head). `--h200` lowers for an abstract H200 on any machine (no compile phase): tracing and lowering are host
work, so their seconds carry over to the GPU machine's host roughly as the CPUs compare.

`--passes N` compiles under `jax.profiler` and prints the N host events of XLA's compile with the most time (HLO
pass pipelines and passes, backend and code generation; they nest, so a pipeline includes its passes), summed by
name: where the XLA compile phase itself goes, on the machine it runs on. Then the N longest single events, each
with its thread and its start after the first event: work on the calling thread is serial (the HLO passes, IR
emission), work on XLA's pool threads (`tf_...`: each kernel's LLVM -> PTX -> cubin, and each Pallas kernel's
Triton pipeline where the kernels compile in the program, `--kernels-first off`; beside it, their own threads'
events are recorded too) runs in parallel, so a sum over threads can exceed the wall time, and only the single
events tell one long kernel from many short ones. A last line splits the compile by thread: the calling thread's
span, and the pool's (its threads' busy seconds, when its first job started and its last ended, its longest job),
so that a pool that ends long after its first job or a long job at the end shows what bounds the compile. Its
compile seconds then include the profiler's own start and stop.

`--h200 --xla` compiles too, with XLA:GPU itself for an H200 target, on a machine without a GPU (deviceless
ahead-of-time compilation; it needs JAX's CUDA plugin: `pip install "jax[cuda13]==0.11.2"`). Every phase then
runs as on the GPU machine's host, XLA's passes and each kernel's LLVM -> PTX -> cubin included, except that
GEMM autotuning has no device to time its candidates on: with autotuning on, XLA still compiles them
(`config-assigner` in `--passes`), so compare routes with `XLA_FLAGS=--xla_gpu_autotune_level=0`, where both
machines compile the same kernels. The seconds follow this machine's CPUs (the per-kernel work runs on
`--xla_gpu_force_compilation_parallelism` threads, one per usable CPU), so compare routes within one machine.

Each row of a compiled step (a GPU, or `--h200 --xla`) ends with `xla kernels N`: the distinct kernels XLA
generated for the program's fusions (`xla_kernels`), each lowered and run through ptxas, besides the Pallas
kernels' launch configurations.

`--h200 --triton` compiles each distinct Pallas kernel's Triton IR for sm_90 with the `triton` package (not an
fp4jax dependency: `pip install triton==3.5.1`) and prints the count, total and slowest seconds: a CPU proxy for
the Triton share of XLA's compile (XLA compiles the same IR with its own Triton build, as `bench triton` says).
A rough one: XLA compiles each launch configuration, not each IR, on parallel threads, and its Triton lowering
of a kernel can take several times the proxy's (docs/BENCHMARKS.md, H200 session of 2026-12-03, 06:55); on a
GPU, `--passes` shows XLA's own events (CompileModuleToLlvmIr: Triton -> LLVM, PTX->CUBIN).

`--kernels` (on a GPU, or with `--h200 --xla`) then compiles each distinct Pallas launch of the program alone
with XLA, one after another, and lists them slowest first (kernel, block count, largest operand, size of its
program, seconds): compiled in the program (`--kernels-first off`), XLA compiles each launch as one job of its
pool after the HLO passes, and compiled beside it (the default) on a pool of their own from the end of the
lowering on; either way, on a host of many CPUs the slowest launch, not their sum, is what the program's compile
may wait for, and a kernel that compiles slowly shows here by name (the `triton` package's proxy above times the
IR; this times XLA's own compile).

`--repeat N` (with `--step`) measures each route's first call N times, each in a fresh process (what a
training run pays when it starts), the routes interleaved round by round so that drift of the host spreads
over all of them, and ends with each route's median and range and the medians' ratios to bf16's: on the
H200's host one program's first call varied up to 2x between runs (docs/BENCHMARKS.md, "H200 session of
2026-12-03, 15:20"), so one run does not decide a ratio. `--out FILE` writes the rows as JSON.

`python -m bench --kernels-first on compile ...` (or N, on N threads) has a GPU (or `--h200 --xla`) compile the
program's Pallas kernels alone, side by side, beside the program's own compile (`fp4jax.compiling`; the row says
how many, and how far into the program's compile the last was ready); off, they compile in the program, as
jax.jit does.

Compiles are cold (the persistent cache is off) unless `--warm`. Each step row ends with its first call (trace +
lower + compile: what a training run waits for before its first step), and with bf16 among the routes a last line
gives each route's first call against bf16's: with `--scan auto`, as training runs them by default (a quantized
route's blocks scanned, bf16's unrolled), issue 12's comparison.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import importlib.util
import json
import math
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp

from bench import args as args_lib
from bench import dot, triton
from bench.step import llama_step
from fp4jax import compiling, platform
from fp4jax.ops.quantize.pallas import common
from train.errors import UserError


STEP_TOKENS = (8, 512)  # --step's default batch


def add_args(parser: argparse.ArgumentParser) -> None:
  dot.add_shape_args(parser)
  parser.add_argument("--warm", action="store_true",
                      help="keep the persistent compilation cache on (default: off, every compile is cold)")
  parser.add_argument("--step", metavar="PRESET", type=args_lib.preset,
                      help="time a whole Llama train step of this preset instead")
  parser.add_argument("--tokens", type=args_lib.tokens,
                      help=f"--step's batch: BATCHxSEQ (default: {STEP_TOKENS[0]}x{STEP_TOKENS[1]})")
  parser.add_argument("--layers", type=args_lib.int_at_least(1),
                      help="--step: keep the preset's layer shapes with this many layers (as `bench step --layers`)")
  args_lib.add_scan(parser, "--step: ")
  parser.add_argument("--unfused-linears", action="store_true",
                      help="--step: one product per linear (LlamaConfig.fuse_linears=False)")
  parser.add_argument("--h200", action="store_true", help="lower for an abstract H200 (any machine; no compile)")
  parser.add_argument("--xla", action="store_true",
                      help="with --h200: compile with XLA:GPU for an H200 target on this machine (no GPU needed; "
                           "needs JAX's CUDA plugin)")
  parser.add_argument("--passes", type=args_lib.int_at_least(0), default=0, metavar="N",
                      help="print the N XLA compile events (passes, backend) that took longest")
  parser.add_argument("--repeat", type=args_lib.int_at_least(1), default=1, metavar="N",
                      help="--step: each route's first call N times, each in a fresh process, routes interleaved; "
                           "prints the median and range")
  parser.add_argument("--out", type=args_lib.out_file, help="write the rows as JSON to this file (replaced)")
  parser.add_argument("--hlo", metavar="DIR", type=args_lib.out_dir,
                      help="write each compiled program's optimized HLO text here")
  parser.add_argument("--kernels", action="store_true",
                      help="after each compiled step (a GPU, or --h200 --xla): each distinct Pallas launch compiled "
                           "alone by XLA, longest first")
  parser.add_argument("--triton", action="store_true",
                      help="with --h200: compile each distinct Pallas kernel's Triton IR for sm_90 with the `triton` "
                           "package and print the seconds (a proxy for that share of XLA's compile)")


# The backend config of a Pallas Triton call in lowered text: {grid_x = .., ir = "<Triton IR bytecode>", ...}.
_TRITON_CONFIG = re.compile(r'backend_config = \{([^}]*ir = "[^"]*"[^}]*)\}')


def kernel_counts(lowered_text: str) -> tuple[int, int, int]:
  """(Pallas kernel call sites, distinct Triton IR, distinct launch configurations) in a lowered module's text.

  XLA compiles a Triton kernel once per distinct launch configuration: its kernel cache is keyed by the whole
  backend config, the IR's bytes (source locations included) and the grid, warps and stages with them. The IR
  is compared without the kernels' launch names (`common.without_launch_digests`)."""
  configs = _TRITON_CONFIG.findall(lowered_text)
  irs = {common.without_launch_digests(re.search(r'ir = "([^"]*)"', c).group(1)) for c in configs}
  return len(configs), len(irs), len(set(configs))


_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_CALLEES = re.compile(r"(?:to_apply|calls|true_computation|false_computation|body|condition)=%?([\w.\-]+)")


def inlined_size(hlo_text: str) -> int:
  """HLO instructions of a module (text of `lowered.compiler_ir("hlo")`) once every called computation is
  counted at each of its call sites, as XLA's inliner expands them: a proxy for the work of XLA's passes (the
  30M mxfp4 step's compile was 2/3 HLO passes on the H200, docs/BENCHMARKS.md). Parameters and sharding
  annotations (`Sharding` custom calls, one per value under a mesh) are not counted."""
  own: dict[str, int] = {}
  callees: dict[str, list[str]] = {}
  current = None
  for line in hlo_text.splitlines():
    m = _COMPUTATION.match(line)
    if m and not line.startswith(" "):
      current = m.group(1)
      own[current], callees[current] = 0, []
    elif current and " = " in line:
      if 'custom_call_target="Sharding"' not in line and " parameter(" not in line:
        own[current] += 1
      callees[current] += _CALLEES.findall(line)
      for branches in re.findall(r"branch_computations=\{([^}]*)\}", line):
        callees[current] += [b.strip().lstrip("%") for b in branches.split(",")]
  entry = next((m.group(1) for line in hlo_text.splitlines() if line.startswith("ENTRY")
                for m in [_COMPUTATION.match(line)] if m), None)
  sizes: dict[str, int] = {}

  def size(name: str) -> int:
    if name not in sizes:
      sizes[name] = own.get(name, 0) + sum(size(c) for c in callees.get(name, []))
    return sizes[name]

  return size(entry) if entry else 0


_FUSION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*? fusion\(")


def xla_kernels(compiled_hlo_text: str) -> int:
  """Distinct kernels XLA generates for a compiled program's fusions (text of `compiled.as_text()`): one per
  fusion, a computation's ROOT among them, less those marked `deduplicated_name` (they launch another fusion's
  kernel). Each is lowered and run through ptxas on the first call, so the count tracks the compile phase's code
  generation (docs/BENCHMARKS.md, "CPU session of 2026-12-04")."""
  names = set()
  for line in compiled_hlo_text.splitlines():
    m = _FUSION.match(line)
    if m:
      shared = re.search(r'deduplicated_name="([^"]+)"', line)
      names.add(shared.group(1) if shared else m.group(1))
  return len(names)


class CompileEvent(NamedTuple):
  """One host event XLA recorded while compiling: its name, the thread (profile line) it ran on, its start in
  seconds after the first recorded event, and its duration in seconds."""

  name: str
  thread: str
  start: float
  seconds: float


class ThreadUse(NamedTuple):
  """One thread's share of a compile: its busy seconds (the sum of its outermost events: the events it nests
  inside others counted once; work XLA records no event for, such as a Pallas kernel's Triton pipeline before its
  LLVM module, is left out), its first event's start and its last one's end (seconds after the first event of any
  thread), and its longest outermost event."""

  busy: float
  start: float
  end: float
  longest: CompileEvent


def thread_use(events: list[CompileEvent]) -> dict[str, ThreadUse]:
  """`ThreadUse` of each thread that recorded `events` (`compile_events`' single events, every one of them)."""
  by_thread: dict[str, list[CompileEvent]] = collections.defaultdict(list)
  for event in events:
    by_thread[event.thread].append(event)
  use = {}
  for thread, mine in by_thread.items():
    mine.sort(key=lambda e: (e.start, -e.seconds))  # an enclosing event before those it holds
    outermost, end = [], -1.0
    for event in mine:
      if event.start >= end:  # not inside the last outermost event (XLA's events on one thread nest)
        outermost.append(event)
        end = event.start + event.seconds
    use[thread] = ThreadUse(sum(e.seconds for e in outermost), mine[0].start,
                            max(e.start + e.seconds for e in mine), max(outermost, key=lambda e: e.seconds))
  return use


def threads_line(use: dict[str, ThreadUse]) -> str:
  """The compile split by thread: the calling thread (the one whose outermost event is the longest: the compile
  itself) and the others, XLA's compile pool, summed."""
  caller = max(use, key=lambda t: use[t].longest.seconds)
  line = f"threads: calling ({caller[:24]}) {use[caller].start:.2f}-{use[caller].end:.2f} s"
  pool = [u for t, u in use.items() if t != caller]
  if not pool:
    return line + "; no other thread"
  longest = max((u.longest for u in pool), key=lambda e: e.seconds)
  return (f"{line}; {len(pool)} others busy {sum(u.busy for u in pool):.2f} s in all, "
          f"from {min(u.start for u in pool):.2f} to {max(u.end for u in pool):.2f} s, longest job "
          f"{longest.seconds:.2f} s ({longest.name[:40]})")


def compile_events(lowered, compiler_options: dict | None = None
                   ) -> tuple[float, list[tuple[str, int, float]], list[CompileEvent], jax.stages.Compiled]:
  """Compiles `lowered` (with `compiler_options`) under `jax.profiler`: (seconds, [(event name, count, seconds)]
  of the host events XLA recorded while compiling, summed by name, longest first, every single event, longest
  first, and the compiled program). Python frames are left out; nested events are each counted."""
  from jax.profiler import ProfileData  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as tmp:
    t0 = time.perf_counter()
    with jax.profiler.trace(tmp):
      compiled = lowered.compile(compiler_options=compiler_options or None)
    seconds = time.perf_counter() - t0
    data = ProfileData.from_file(glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)[0])
  raw = [(event.name, line.name, event.start_ns, event.duration_ns) for plane in data.planes
         if plane.name.startswith("/host") for line in plane.lines for event in line.events
         if not event.name.startswith("$")]
  first = min((start for _, _, start, _ in raw), default=0)
  singles = sorted((CompileEvent(name, thread, (start - first) * 1e-9, ns * 1e-9) for name, thread, start, ns in raw),
                   key=lambda e: -e.seconds)
  totals: dict[str, float] = collections.defaultdict(float)
  counts: collections.Counter = collections.Counter()
  for event in singles:
    totals[event.name] += event.seconds
    counts[event.name] += 1
  return (seconds, [(name, counts[name], s) for name, s in sorted(totals.items(), key=lambda e: -e[1])], singles,
          compiled)


def kernel_name(ir: str) -> str:
  """The kernel's name in its Triton IR (a Pallas kernel's `name=`, e.g. fp4jax_nvfp4_quantize_dual), without
  the digest of its launch (`common.launch_name`)."""
  found = re.search(r"tt\.func (?:public )?@([\w$.]+)", ir)
  return common.without_launch_digests(found.group(1)) if found else "?"


def triton_seconds(modules: list[str]) -> list[tuple[str, float, int]]:
  """(kernel name, cold compile seconds, IR characters) of each distinct Triton IR module in `modules` (sm_90,
  4 warps: Pallas passes each kernel's own num_warps to XLA outside the IR, so the proxy fixes one), slowest
  first. Kernels of one name differ by shape constants, dtypes or view: each distinct IR compiles anew (IR
  compared without the launches' names, `common.without_launch_digests`)."""
  os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
  distinct = {common.without_launch_digests(ir): ir for ir in modules}.values()
  timed = ((kernel_name(ir), triton.compile_ir(ir)[0], len(ir)) for ir in distinct)
  return sorted(timed, key=lambda k: -k[1])


def _triton_lines(kernels: list[tuple[str, float, int]]) -> list[str]:
  """The summary of `triton_seconds`, then one line per kernel name, the costliest first."""
  seconds = [s for _, s, _ in kernels]
  lines = [f"      triton (sm_90, `triton` package): {len(seconds)} kernels {sum(seconds):.1f} s, slowest "
           + ", ".join(f"{s:.1f}" for s in seconds[:5]) + " s"]
  by_name: dict[str, list[tuple[float, int]]] = collections.defaultdict(list)
  for name, s, size in kernels:
    by_name[name].append((s, size))
  for name, rows in sorted(by_name.items(), key=lambda kv: -sum(s for s, _ in kv[1])):
    each = [s for s, _ in rows]
    lines.append(f"        {name}: {len(rows)} distinct, {sum(each):.1f} s ({min(each):.1f}-{max(each):.1f} s "
                 f"each), IR up to {max(size for _, size in rows) / 1e3:.0f}k chars")
  return lines


# The target of `--h200 --xla`: an H200 as XLA's GpuTargetConfig describes a device (NVIDIA's H200 SXM figures:
# 132 SMs, 4.8 TB/s, 50 MiB L2, 228 KiB shared memory per SM, 143,771 MiB of memory). The cuDNN and CUDA runtime
# versions only gate which library calls XLA may emit.
_H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 shared_memory_per_block_optin: 232448 threads_per_core_limit: 2048
  core_count: 132 fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 150754820096 cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
runtime_version { major: 13 minor: 0 }
device_description_str: "NVIDIA H200"
"""


def cuda_plugin_installed() -> bool:
  """Whether JAX's CUDA 13 plugin (`jax[cuda13]`) is installed: what `--h200 --xla` compiles with."""
  try:
    return importlib.util.find_spec("jax_plugins.xla_cuda13") is not None
  except ModuleNotFoundError:  # no `jax_plugins` package at all
    return False


def _deviceless_h200(devices: int = 1) -> jax.sharding.Mesh:
  """A ("data", "fsdp") mesh of `devices` H200s (all along "data") that XLA:GPU compiles for without one
  (`--h200 --xla`; the tests compile multi-GPU programs on it)."""
  if not cuda_plugin_installed():
    raise UserError('bench compile: --xla compiles with XLA:GPU and needs JAX\'s CUDA plugin (pip install '
                    '"jax[cuda13]==0.11.2"; no GPU needed)')
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  topology = topologies.get_topology_desc(platform="cuda", target_config=_H200_TARGET, topology=f"1x1x{devices}")
  return topologies.make_mesh(topology, (devices, 1), ("data", "fsdp"))


def _on(mesh: jax.sharding.Mesh, tree):
  """Abstract arguments `tree` replicated over `mesh`."""
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), tree)


def _phases(fn, args, *, h200: bool, xla: jax.sharding.Mesh | None = None, passes: int = 0,
            triton_compile: bool = False, keep_hlo: bool = False, kernels_first: dict | None = None,
            kernels: bool = False) -> dict:
  """Seconds of trace, lower and compile of `jax.jit(fn)(*args)` and the kernel counts (and with `passes`,
  the longest XLA compile events; with `triton_compile` and `h200`, each distinct kernel's Triton compile).
  `xla`: the mesh of `_deviceless_h200`: compiled for it (`--h200 --xla`) rather than only lowered.
  `kernels_first`: `fp4jax.compiling.KernelsFirst`'s keywords (None: compile as jax.jit does); the Pallas
  kernels then compile alone beside the program's compile (with `passes`, their events among the program's).
  `keep_hlo`: the result has the compiled program's HLO text as "compiled_hlo" (None where nothing compiled).
  `kernels`: the result's "kernels_alone" has each distinct Pallas launch compiled alone, after the program
  (`kernel_compiles`; None where nothing compiled)."""
  lowering_only = h200 and xla is None  # --h200 without --xla: nothing compiles
  if xla is not None:
    target, args = jax.set_mesh(xla), _on(xla, args)
  else:
    target = triton.on_abstract_h200() if h200 else contextlib.nullcontext()
  # lowered only: nothing compiles, so no kernel either
  first = compiling.KernelsFirst(**({"threads": 0} if lowering_only or not kernels_first else kernels_first))
  with target as modules, platform.old_objects_frozen(), first:  # as train and `bench step` compile
    t0 = time.perf_counter()
    traced = jax.jit(fn).trace(*args)
    t1 = time.perf_counter()
    lowered, options = (_lower_abstract(traced), {}) if lowering_only else first.lower(traced)
    t2 = time.perf_counter()
    compile_s, events, singles, compiled = None, [], [], None
    if not lowering_only and passes:
      compile_s, events, singles, compiled = compile_events(lowered, options)
    elif not lowering_only:
      compiled = first.compile(lowered, options)
      compile_s = time.perf_counter() - t2
  report = first.report
  compiled_hlo = compiled.as_text() if compiled is not None else None
  alone = kernel_compiles(lowered, xla) if kernels and not lowering_only else None
  sites, distinct, launches = kernel_counts(lowered.as_text())
  first_call = None if compile_s is None else t2 - t0 + compile_s  # what a run waits for before its first step
  return {"trace": t1 - t0, "lower": t2 - t1, "compile": compile_s, "first_call": first_call, "sites": sites,
          "distinct": distinct,
          "launches": launches,
          "hlo": inlined_size(lowered.compiler_ir("hlo").as_hlo_text()), "events": events[:passes],
          "singles": singles[:passes], "threads": thread_use(singles) if singles else None,
          "triton": triton_seconds(modules) if lowering_only and triton_compile else None,
          "xla_kernels": None if compiled_hlo is None else xla_kernels(compiled_hlo),
          "kernels_first": report.kernels, "kernels_first_ready_s": report.ready_s,
          "kernels_alone": alone,
          "compiled_hlo": compiled_hlo if keep_hlo else None}


def kernel_compiles(lowered, mesh: jax.sharding.Mesh | None) -> list[dict]:
  """Each distinct Triton call of `lowered` (`fp4jax.compiling.triton_calls`) compiled alone by XLA, one after
  another on this machine (for `mesh`'s first device: `--h200 --xla`'s, or None for JAX's first), slowest first:
  its kernel name (without the launch digest), its grid's block count, its largest operand, the size of its
  program (Triton IR included) and seconds. XLA compiles each call of a program as one job of its compile pool,
  after the program's HLO passes: the slowest call bounds how soon the program's compile can end, however many
  CPUs the pool has (docs/BENCHMARKS.md, "Session of 2026-12-07, 11:24 UTC")."""
  device = compiling.first_device(mesh)
  rows = []
  for call in compiling.triton_calls(lowered):
    operand = max(call.operands, key=lambda t: math.prod(_tensor_shape(t)))
    rows.append({"kernel": common.without_launch_digests(call.name), "blocks": call.blocks, "operand": operand,
                 "bytes": len(call.module), "seconds": compiling.compile_alone(call, device)})
  return sorted(rows, key=lambda r: -r["seconds"])


def _tensor_shape(mlir_type: str) -> tuple[int, ...]:
  """The shape of an MLIR tensor type's text (tensor<32768x384xbf16> -> (32768, 384); a scalar -> ())."""
  dims = mlir_type.removeprefix("tensor<").removesuffix(">").split("x")[:-1]
  return tuple(int(d) for d in dims)


def _kernels_lines(rows: list[dict]) -> list[str]:
  """`kernel_compiles`' rows as `_line` prints them: a summary, then one line per call."""
  if not rows:
    return ["      pallas launches compiled alone: none"]
  seconds = [r["seconds"] for r in rows]
  lines = [f"      pallas launches compiled alone by XLA, one after another: {len(rows)} in {sum(seconds):.1f} s, "
           f"slowest {seconds[0]:.2f} s"]
  lines += [f"      {r['seconds']:7.2f} s  {r['kernel']}  {r['blocks']} blocks  largest operand {r['operand']}  "
            f"{r['bytes'] / 1e3:.0f} kB of program" for r in rows]
  return lines


def _lower_abstract(traced):
  """`traced` lowered for the abstract H200 of `triton.on_abstract_h200`. Where JAX's CUDA plugin is installed,
  the Llama steps take cuDNN's attention, whose custom call lowers only with a device: that is a one-line error
  pointing at --xla (the plugin's deviceless H200), not JAX's AbstractMesh traceback."""
  try:
    return traced.lower(lowering_platforms=("cuda",))
  except ValueError as e:
    if "AbstractMesh cannot be used" not in str(e):
      raise
    raise UserError("bench compile --h200: this program holds a call that lowers only with a device (cuDNN's "
                    "attention, taken where JAX's CUDA plugin is installed): add --xla to compile it for the "
                    "plugin's deviceless H200 instead") from e


def _line(name: str, p: dict) -> str:
  compiled = "   n/a" if p["compile"] is None else f"{p['compile']:6.1f}"
  first = "" if p["first_call"] is None else f"  first call {p['first_call']:6.1f} s"
  line = (f"  {name:44s} trace {p['trace']:6.1f} s  lower {p['lower']:6.1f} s  compile {compiled} s{first}  "
          f"pallas kernels {p['sites']} sites / {p['distinct']} distinct IR / {p['launches']} launch configs  "
          f"hlo {p['hlo'] / 1e3:.1f}k")
  if p.get("xla_kernels") is not None:
    line += f"  xla kernels {p['xla_kernels']}"
  if p.get("kernels_first"):
    ready = p.get("kernels_first_ready_s")
    line += (f"  ({p['kernels_first']} kernels compiled alone beside the compile"
             f"{'' if ready is None else f', the last ready {ready:.1f} s into it'})")
  if p.get("triton") is not None:
    line = "\n".join([line, *_triton_lines(p["triton"])])
  lines = [line, *(f"      {s:7.2f} s {n:5d}x  {event}" for event, n, s in p.get("events", []))]
  if p.get("singles"):
    lines.append("      longest single events (seconds, start, thread, event):")
    lines += [f"      {e.seconds:7.2f} s  at {e.start:6.2f} s  {e.thread[:24]:24s}  {e.name}" for e in p["singles"]]
  if p.get("threads"):
    lines.append(f"      {threads_line(p['threads'])}")
  if p.get("kernels_alone") is not None:
    lines += _kernels_lines(p["kernels_alone"])
  return "\n".join(lines)


_ROW_KEYS = ("trace", "lower", "compile", "first_call", "sites", "distinct", "launches", "hlo", "xla_kernels",
             "kernels_first", "kernels_first_ready_s", "kernels_alone")


def _row(name: str, route: str, phases: dict) -> dict:
  """The JSON row (`--out`) of one measured first call."""
  return {"name": name, "route": route, **{k: phases[k] for k in _ROW_KEYS}}


def _write(path: str | None, rows: list[dict], info: dict | None = None) -> None:
  """`--out`: the rows and `info` (default: this process's device, JAX version and date) as JSON."""
  if path:
    with open(args_lib.made_parent(path), "w") as f:
      json.dump({"info": info or dot.device_info(), "rows": rows}, f, indent=1)


def _write_hlo(directory: str | None, name: str, phases: dict) -> None:
  """`--hlo DIR`: the compiled program of row `name` as DIR/<name, spaces as _>.hlo.txt."""
  if directory and phases["compiled_hlo"] is not None:
    path = pathlib.Path(directory) / (re.sub(r"[^\w.+-]+", "_", name) + ".hlo.txt")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(phases["compiled_hlo"])


def _x_bf16(first_calls: dict[str, float]) -> str | None:
  """"route ratio, ..." of each route's first call against bf16's, or None without bf16 and another route."""
  if "bf16" not in first_calls or len(first_calls) < 2:
    return None
  return ", ".join(f"{route} {s / first_calls['bf16']:.2f}" for route, s in first_calls.items() if route != "bf16")


def _child_argv(args: argparse.Namespace, route: str, out: str) -> list[str]:
  """The command measuring one route's first call of `args.step` in a fresh process (`--repeat`)."""
  batch, seq = args.tokens
  scan = [] if not args.scan else ["--scan"] if args.scan is True else ["--scan", args.scan]
  return [sys.executable, "-m", "bench", "--compile-cache", args.compile_cache if args.warm else "off",
          "--kernels-first", args.kernels_first or "on", "compile",
          "--step", args.step, *(["--layers", str(args.layers)] if args.layers else []), "--tokens",
          f"{batch}x{seq}", *scan,
          *(["--unfused-linears"] if args.unfused_linears else []), *(["--warm"] if args.warm else []),
          *(["--h200", "--xla"] if args.xla else []),
          "--routes", route, "--out", out]


def _repeat(args: argparse.Namespace) -> None:
  """`--repeat`: args.repeat rounds of one fresh process per route; a line per measurement, then the summary.

  This process never starts a JAX backend (the device in the header and in --out is the children's): on a GPU
  it would hold most of the device's memory (JAX preallocates) while the children compile and autotune."""
  print(f"bench compile --repeat {args.repeat}: each first call in a fresh process, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
  rows, seconds, info = [], collections.defaultdict(list), None
  with tempfile.TemporaryDirectory() as tmp:
    for i in range(args.repeat):
      for route in args.routes:
        out = os.path.join(tmp, f"{i}-{route}.json")
        argv = _child_argv(args, route, out)
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode:
          last = ([l for l in (done.stderr or done.stdout).splitlines() if l.strip()] or ["no output"])[-1]
          raise UserError(f"bench compile --repeat: the run of {route} exited with {done.returncode}: {last} "
                          f"(command: {' '.join(argv)})")
        with open(out) as f:
          child = json.load(f)
        if info is None:
          info = child["info"]
          print(f"  device: {info}", flush=True)
        (row,) = child["rows"]
        rows.append({**row, "round": i + 1})
        seconds[route].append(row["first_call"])
        ready, beside = row.get("kernels_first_ready_s"), ""
        if row.get("kernels_first"):
          beside = f"; {row['kernels_first']} kernels beside it"
          beside += "" if ready is None else f", ready at {ready:.1f} s"
        print(f"  round {i + 1}/{args.repeat}  {route:12s} first call {row['first_call']:6.1f} s  (trace "
              f"{row['trace']:.1f}, lower {row['lower']:.1f}, compile {row['compile']:.1f} s{beside}; hlo "
              f"{row['hlo'] / 1e3:.1f}k)", flush=True)
  medians = {route: statistics.median(s) for route, s in seconds.items()}
  for route, s in seconds.items():
    print(f"  {route:12s} first call median {medians[route]:6.1f} s  (range {min(s):.1f}-{max(s):.1f} s over "
          f"{len(s)} processes)", flush=True)
  if ratios := _x_bf16(medians):
    print(f"  median first call x bf16's: {ratios}", flush=True)
  _write(args.out, rows, info)


def run(args: argparse.Namespace) -> None:
  """Prints one line per route (and per shape and direction for fp4_dot) with the phases of its first call."""
  if args.repeat > 1 and (not args.step or (args.h200 and not args.xla) or args.passes or args.triton or args.hlo):
    raise UserError("bench compile: --repeat times whole steps' first calls (--step), without --h200 (unless with "
                    "--xla), --passes, --triton or --hlo")
  step_only = [o for o, v in (("--tokens", args.tokens), ("--layers", args.layers), ("--scan", args.scan),
                                ("--unfused-linears", args.unfused_linears)) if v]
  if step_only and not args.step:
    raise UserError(f"bench compile: {', '.join(step_only)} shape a whole step; add --step PRESET")
  if args.step and (args.small or args.shapes):
    raise UserError("bench compile: --small and --shapes choose fp4_dot's shapes, and --step times a whole step "
                    "instead; drop one")
  if args.warm and platform.cache_dir(args.compile_cache) is None:
    raise UserError("bench compile: --warm keeps the persistent cache on, and --compile-cache turns it off; drop "
                    "one")
  args.tokens = args.tokens or STEP_TOKENS
  if args.xla and not args.h200:
    raise UserError("bench compile: --xla compiles an --h200 lowering with XLA:GPU; add --h200")
  if args.triton and (not args.h200 or args.xla):
    raise UserError("bench compile: --triton compiles the kernels of an --h200 lowering with the `triton` package; "
                    "use --h200 without --xla (which compiles them with XLA's own Triton)")
  if args.hlo and args.h200 and not args.xla:
    raise UserError("bench compile: --hlo writes compiled programs, and --h200 only lowers (no compile); add --xla "
                    "or drop --h200")
  if args.passes and args.h200 and not args.xla:
    raise UserError("bench compile: --passes lists XLA's compile events, and --h200 only lowers (no compile); "
                    "add --xla or drop --h200")
  if args.kernels and ((args.h200 and not args.xla) or args.warm or args.repeat > 1):
    raise UserError("bench compile: --kernels compiles each Pallas launch alone, cold, after the program: on a GPU "
                    "or with --h200 --xla, without --warm or --repeat")
  if args.triton and importlib.util.find_spec("triton") is None:
    raise UserError("bench compile: --triton needs the `triton` package (pip install triton==3.5.1)")
  if args.xla:  # before JAX starts its backends: the CUDA plugin's version checks need a GPU driver
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  if args.repeat > 1:
    _repeat(args)
    return
  if not args.warm:
    platform.enable_compilation_cache(None)
  xla = _deviceless_h200() if args.xla else None
  where = ("H200 target, compiled by XLA:GPU on this machine's CPUs" if xla is not None else
           "abstract H200 (lowering only)" if args.h200 else dot.device_info())
  info = {**dot.device_info(), "target": "H200, deviceless XLA:GPU compile"} if xla is not None else None
  print(f"bench compile: {where} XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
  key = jax.random.key(0)
  rows = []
  if args.step:
    batch, seq = args.tokens
    first_calls = {}
    for route in args.routes:
      step, _, state, tokens, _, scan = llama_step(args.step, route, batch=batch, seq=seq, scan=args.scan,
                                                   layers=args.layers, fuse_linears=not args.unfused_linears)
      name = (f"{args.step}{f' {args.layers}l' if args.layers else ''} {'scanned' if scan else 'unrolled'}"
              f"{' unfused' if args.unfused_linears else ''} {batch}x{seq} {route}")
      phases = _phases(step, (state, tokens, jax.ShapeDtypeStruct((), jnp.int32)), h200=args.h200, xla=xla,
                       passes=args.passes, triton_compile=args.triton, keep_hlo=bool(args.hlo),
                       kernels_first=args_lib.kernels_first(args, cache=args.warm), kernels=args.kernels)
      print(_line(name, phases), flush=True)
      _write_hlo(args.hlo, name, phases)
      rows.append(_row(name, route, phases))
      if phases["first_call"] is not None:
        first_calls[route] = phases["first_call"]
    if ratios := _x_bf16(first_calls):
      print(f"  first call x bf16's: {ratios}", flush=True)
    _write(args.out, rows, info)
    return
  shapes, m = dot.selected_shapes(args)
  for sname, k, n in shapes:
    x, w, dy = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((m, k), (k, n), (m, n)))
    for route in args.routes:
      fwd, fwd_bwd = dot.fp4_dot_fns(route, key)
      for name, fn, fargs in (("fwd", fwd, (x, w)), ("fwd+bwd", fwd_bwd, (x, w, dy))):
        phases = _phases(fn, fargs, h200=args.h200, xla=xla, passes=args.passes, triton_compile=args.triton,
                         keep_hlo=bool(args.hlo), kernels_first=args_lib.kernels_first(args, cache=args.warm),
                         kernels=args.kernels)
        print(_line(f"{sname} {route} {name}", phases), flush=True)
        _write_hlo(args.hlo, f"{sname} {route} {name}", phases)
        rows.append(_row(f"{sname} {route} {name}", route, phases))
  _write(args.out, rows, info)
