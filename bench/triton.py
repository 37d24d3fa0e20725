"""`python -m bench triton`: compile time of the fused Pallas kernels without a GPU: Triton IR from the Pallas
lowering, compiled to PTX and cubin for sm_90 by the `triton` package (not an fp4jax dependency:
`pip install triton==3.5.1`).

  python -m bench triton [--shape 4096x4096] [kernel ...]

XLA compiles the same Triton IR with its own Triton build, so the seconds are a proxy; a kernel that is slow here
(e.g. one pass taking most of the time: rerun with MLIR_ENABLE_TIMING=1) was slow on the H200 too. Prints, per
kernel: IR size, compile seconds, and from the PTX the instructions per thread (straight-line kernels, so what
each thread issues), the machine code's (SASS, by the package's nvdisasm) with those on the integer ALU and on
the FMA pipes (the quantizers are bound by the ALU's: docs/BENCHMARKS.md), the shared-memory and shuffle traffic
(layout conversions), the registers and spill stores `ptxas -v` reports (the `triton` package's ptxas), and a
fingerprint of the PTX's code (`ptx_fingerprint`): run before and after a change to the kernels' Python, equal
fingerprints show on a CPU that the GPU code did not change.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import os
import re
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
from jax._src.pallas.triton import pallas_call_registration as registration  # pylint: disable=g-direct-jax-src
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

from bench import args as args_lib
from fp4jax.numerics.spec import OperandKeys, OperandSpec
from fp4jax.ops.quantize import pallas
from fp4jax.ops.quantize.pallas import amax, eden, mxfp4, nvfp4
from train.errors import UserError

_MX, _MX_SR = OperandSpec("mxfp4"), OperandSpec("mxfp4", "sr")
_NV, _NV_SR = OperandSpec("nvfp4"), OperandSpec("nvfp4", "sr")
_NV_RHT16, _NV_SR_RHT16 = OperandSpec("nvfp4", transform="rht16"), OperandSpec("nvfp4", "sr", transform="rht16")
_EDEN = OperandSpec("nvfp4", "eden", transform="rht128")
_W32 = OperandSpec("mxfp4", tile_2d=True, scale_rule="noclip", clip_fraction=0.87)


def _keys() -> OperandKeys:
  """Keys for the kernels that take them, made when a kernel is lowered: a key made at import would start a
  JAX backend before the app sets XLA_FLAGS (`bench.__main__`)."""
  key = jax.random.key(0)
  return OperandKeys(key, key)


KERNELS = {
    "mx rne": lambda x: mxfp4.views(x, _MX, _MX),
    "mx dY sr|rne": lambda x: mxfp4.views(x, _MX_SR, _MX, _keys()),
    "mx X rne|rne+h32": lambda x: mxfp4.views(x, _MX, OperandSpec("mxfp4", transform="h32")),
    "mx w32x32": lambda x: mxfp4.views(x, _W32, _W32),
    "nv rne|rne": lambda x: nvfp4.views(x, _NV, _NV),
    "nv 16x16": lambda x: nvfp4.views(x, OperandSpec("nvfp4", tile_2d=True), OperandSpec("nvfp4", tile_2d=True)),
    "nv 4/6": lambda x: nvfp4.views(x, OperandSpec("nvfp4_46"), OperandSpec("nvfp4_46")),
    "nv 4/6 row view": lambda x: pallas.operand(x, OperandSpec("nvfp4_46"), 1, OperandKeys(), interpret=False),
    "nv 4/6 column view": lambda x: pallas.operand(x, OperandSpec("nvfp4_46"), 0, OperandKeys(),
                                                   interpret=False),
    "nv X rne|rne+rht16": lambda x: nvfp4.views(x, _NV, _NV_RHT16, OperandKeys(), _keys()),
    "nv dY sr|sr+rht16": lambda x: nvfp4.views(x, _NV_SR, _NV_SR_RHT16, _keys(), _keys()),
    # the nvfp4 route's X and dY as fp4_dot launches them on Hopper: the views read at once as bf16 values
    "nv X values": lambda x: nvfp4.views(x, _NV, _NV_RHT16, OperandKeys(), _keys(), forms=("values", "codes")),
    "nv dY values": lambda x: nvfp4.views(x, _NV_SR, _NV_SR_RHT16, _keys(), _keys(), forms=("values", "values")),
    # MS-EDEN: the quantizer alone (given amax) and its rotated-amax pre-pass, each view.
    "eden col rht128": lambda x: eden.operand(x, _EDEN, 0, _keys(), tensor_amax=1.0),
    "eden row rht128": lambda x: eden.operand(x, _EDEN, 1, _keys(), tensor_amax=1.0),
    "eden amax rht128": lambda x: amax.rotated_amax(x, "rht128", jax.random.key(0)),
}


@contextlib.contextmanager
def on_abstract_h200():
  """Inside: JAX lowers for an (abstract) H200 on any machine; yields the list that collects the Triton IR
  module text of every Pallas kernel lowered meanwhile, in launch order."""
  modules = []
  lower = registration.lowering.lower_jaxpr_to_triton_module

  def spy(*args, **kwargs):
    result = lower(*args, **kwargs)
    modules.append(result.module.operation.get_asm(enable_debug_info=False))
    return result

  jax.clear_caches()  # a kernel lowered before (e.g. an inner jit traced the same way) would not lower again
  registration.lowering.lower_jaxpr_to_triton_module = spy
  try:
    # Auto, as train's mesh (`train.build.make_mesh`): an Explicit axis would lower a sharding constraint after
    # nearly every operation (4k in the 30M bf16 step), which no real run holds.
    mesh = AbstractMesh((1,), ("d",), axis_types=(AxisType.Auto,),
                        abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))
    with use_abstract_mesh(mesh):
      yield modules
  finally:
    registration.lowering.lower_jaxpr_to_triton_module = lower


def triton_irs(fn, shape: tuple[int, int]) -> list[str]:
  """The Triton IR module text of every Pallas kernel `fn` launches on a bf16 array of `shape`, in launch
  order, lowered on CPU for an (abstract) H200."""
  with on_abstract_h200() as modules:
    jax.jit(fn).trace(jax.ShapeDtypeStruct(shape, jnp.bfloat16)).lower(lowering_platforms=("cuda",))
  return modules


def triton_ir(fn, shape: tuple[int, int]) -> str:
  """The Triton IR of the last Pallas kernel `fn` launches (the quantizer, after any amax pre-pass such as
  `amax.rotated_amax`)."""
  modules = triton_irs(fn, shape)
  if not modules:
    raise RuntimeError("no Pallas kernel lowered")
  return modules[-1]


def compile_ir(ir: str, num_warps: int = 4):
  """(seconds, compiled kernel) of Triton IR text compiled for sm_90 by the `triton` package (ImportError where
  it is missing). The caller sets TRITON_CACHE_DIR to an empty directory for a cold compile."""
  import triton  # pylint: disable=g-import-not-at-top
  from triton.backends.compiler import GPUTarget  # pylint: disable=g-import-not-at-top
  with tempfile.NamedTemporaryFile("w", suffix=".ttir", delete=False) as f:
    f.write(ir)
  try:
    t0 = time.perf_counter()
    kernel = triton.compile(f.name, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    return time.perf_counter() - t0, kernel
  finally:
    os.unlink(f.name)


_PTX_INSTRUCTION = re.compile(r"^\s+(?:@!?%p\d+\s+)?[a-z]", re.M)  # an opcode line, predicated or not


def ptx_instructions(ptx: str) -> int:
  """Instruction lines of PTX text (directives, labels, braces and comments excluded)."""
  return len(_PTX_INSTRUCTION.findall(ptx))


_PTX_DEBUG = re.compile(r"^\s*(?:\.loc|\.file|//|\$L__(?:tmp|func_begin|func_end))")


def ptx_fingerprint(ptx: str) -> str:
  """12 hex digits of a hash of the PTX's code: every line but source locations, comments, debug labels and
  the debug sections, which move with the Python source. A refactor that leaves the GPU code as it was keeps
  it (docs/BENCHMARKS.md, 2026-12-04, 19:52: tracing the kernels op by op)."""
  code = re.split(r"^\s*\.section\s+\.debug", ptx, maxsplit=1, flags=re.M)[0]
  lines = [line for line in code.splitlines() if line.strip() and not _PTX_DEBUG.match(line)]
  return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12]


# SASS opcodes a Hopper SM issues on its integer ALU (integer and logic ops, compares, selects, min/max, byte
# permutes) and on its FMA pipes (float multiply-adds, and the integer multiply-adds IMAD that ptxas also uses
# for adds, moves and left shifts to balance the two). The quantizers are bound by the ALU's share
# (docs/BENCHMARKS.md, "Session of 2026-12-06, 07:06 UTC").
ALU_OPCODES = frozenset({"LOP3", "SHF", "IADD3", "VIADD", "VIMNMX", "VIMNMX3", "ISETP", "SEL", "PRMT", "LEA", "SGXT",
                         "BMSK", "ISCADD", "FSETP", "FSEL", "FSET", "FMNMX"})
FMA_OPCODES = frozenset({"IMAD", "FFMA", "FMUL", "FADD", "I2FP"})
_SASS_OPCODE = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", re.M)


def sass_pipes(sass: str) -> tuple[int, int, int]:
  """(instructions, integer-ALU ones, FMA-pipe ones) of `nvdisasm -c` output: per thread, the kernels being
  straight-line code."""
  opcodes = _SASS_OPCODE.findall(sass)
  return len(opcodes), sum(o in ALU_OPCODES for o in opcodes), sum(o in FMA_OPCODES for o in opcodes)


def disassemble(cubin: bytes) -> str:
  """SASS text of a cubin by the `triton` package's nvdisasm (beside its ptxas)."""
  from triton import knobs  # pylint: disable=g-import-not-at-top
  nvdisasm = os.path.join(os.path.dirname(knobs.nvidia.ptxas.path), "nvdisasm")
  with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "kernel.cubin")
    with open(path, "wb") as f:
      f.write(cubin)
    return subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout


def ptxas_usage(ptx: str) -> tuple[int, int]:
  """(registers per thread, spill-store bytes) that the `triton` package's ptxas reports for sm_90a PTX. The
  package's tool settings (`triton.knobs`) name it: `get_ptxas()` of 3.5.1 returns that setting, and later
  versions (a PyTorch install's) take the target architecture, `get_ptxas(arch)`, returning it below sm_100."""
  from triton import knobs  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "kernel.ptx")
    with open(path, "w") as f:
      f.write(ptx)
    report = subprocess.run([knobs.nvidia.ptxas.path, "-v", "-arch=sm_90a", path, "-o", os.devnull],
                            capture_output=True, text=True, check=True).stderr
  registers, spills = re.search(r"Used (\d+) registers", report), re.search(r"(\d+) bytes spill stores", report)
  return int(registers.group(1)) if registers else -1, int(spills.group(1)) if spills else 0


def add_args(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("kernels", nargs="*", default=list(KERNELS), help=f"any of {list(KERNELS)}")
  parser.add_argument("--shape", type=args_lib.shape, default="4096x4096", help="MxK of x (default: %(default)s)")
  parser.add_argument("--num-warps", type=args_lib.num_warps, default=4, help="a power of two (default: 4)")


def run(args: argparse.Namespace) -> None:
  unknown = sorted(set(args.kernels) - set(KERNELS))
  if unknown:
    raise UserError(f"bench triton: unknown kernels {unknown}; known: {list(KERNELS)}")
  shape = args.shape
  os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # a cold cache: every kernel really compiles
  have_triton = importlib.util.find_spec("triton") is not None
  if not have_triton:
    print("the `triton` package is missing: printing IR sizes only (pip install triton==3.5.1)")
  for name in args.kernels:
    try:
      ir = triton_ir(KERNELS[name], shape)
    except (NotImplementedError, ValueError) as e:  # the kernel's checks: a shape its tiles do not cover
      raise UserError(f"bench triton: kernel {name!r} does not take --shape {shape[0]}x{shape[1]}: {e}") from e
    line = f"{name:20s} IR {ir.count(chr(10)):6d} lines"
    if have_triton:
      seconds, kernel = compile_ir(ir, args.num_warps)
      ptx = kernel.asm["ptx"]
      count = lambda pattern: len(re.findall(pattern, ptx))
      registers, spills = ptxas_usage(ptx)
      sass, alu, fma = sass_pipes(disassemble(kernel.asm["cubin"]))
      line += (f"  compile {seconds:6.1f} s  PTX {ptx.count(chr(10)):6d} lines, {ptx_instructions(ptx):6d} "
               f"instructions  SASS {sass} (ALU {alu}, FMA {fma})  st/ld.shared {count(r'st\.shared')}/"
               f"{count(r'ld\.shared')}  shfl {count(r'shfl')}  smem {kernel.metadata.shared} B  registers "
               f"{registers} (spills {spills} B)  PTX code {ptx_fingerprint(ptx)}")
    print(line, flush=True)
