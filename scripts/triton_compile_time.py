"""Compile time of the fused Pallas kernels without a GPU: Triton IR from the Pallas lowering, compiled to PTX and
cubin for sm_90 by the `triton` package (not an fp4jax dependency: `pip install triton==3.5.1`).

  python scripts/triton_compile_time.py [--shape 4096x4096] [kernel ...]

XLA compiles the same Triton IR with its own Triton build, so the seconds are a proxy; a kernel that is slow here
(e.g. one pass taking most of the time: rerun with MLIR_ENABLE_TIMING=1) was slow on the H200 too. Prints, per
kernel: IR size, compile seconds, and from the PTX the shared-memory and shuffle traffic (layout conversions).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from jax._src.pallas.triton import pallas_call_registration as registration  # pylint: disable=g-direct-jax-src
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fp4jax.kernels import quantize_eden as qe, quantize_fused as qf, quantize_fused_nv as qnv, rotate  # pylint: disable=g-import-not-at-top

V = qf.ViewSpec
KEY = jax.random.key(0)
KERNELS = {
    "mx rne": lambda x: qf.quantize_views(x, V(), V()),
    "mx dY sr|rne": lambda x: qf.quantize_views(x, V("sr", "noclip"), V(), row_key=KEY),
    "mx X rne|rne+h32": lambda x: qf.quantize_views(x, V(), V(transform="h32")),
    "mx w32x32": lambda x: qf.quantize_dual(x, tile_2d=True, scale_rule="noclip", clip_fraction=0.87),
    "nv rne|rne": lambda x: qnv.quantize_dual_nv(x, "nvfp4"),
    "nv 16x16": lambda x: qnv.quantize_dual_nv(x, "nvfp4", tile_2d=True),
    "nv 4/6": lambda x: qnv.quantize_dual_nv(x, "nvfp4_46"),
    "nv dY sr|sr+rht16": lambda x: qnv.quantize_dual_nv(x, "nvfp4", row_rounding="sr", col_rounding="sr",
                                                        row_key=KEY, col_key=KEY, col_transform="rht16",
                                                        transform_key=KEY),
    # MS-EDEN: the quantizer alone (given amax) and its rotated-amax pre-pass, each view.
    "eden col rht128": lambda x: qe.quantize_eden(x, axis=0, key=KEY, transform_key=KEY, tensor_amax=1.0),
    "eden row rht128": lambda x: qe.quantize_eden(x, axis=1, key=KEY, transform_key=KEY, tensor_amax=1.0),
    "eden amax rht128": lambda x: rotate.rotated_amax(x, "rht128", KEY),
}


def triton_irs(fn, shape: tuple[int, int]) -> list[str]:
  """The Triton IR module text of every Pallas kernel `fn` launches on a bf16 array of `shape`, in launch
  order, lowered on CPU for an (abstract) H200."""
  jax.clear_caches()  # a kernel lowered before (e.g. an inner jit traced the same way) would not lower again
  modules = []
  lower = registration.lowering.lower_jaxpr_to_triton_module

  def spy(*args, **kwargs):
    result = lower(*args, **kwargs)
    modules.append(result.module.operation.get_asm(enable_debug_info=False))
    return result

  registration.lowering.lower_jaxpr_to_triton_module = spy
  try:
    mesh = AbstractMesh((1,), ("d",), abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))
    with use_abstract_mesh(mesh):
      jax.jit(fn).trace(jax.ShapeDtypeStruct(shape, jnp.bfloat16)).lower(lowering_platforms=("cuda",))
  finally:
    registration.lowering.lower_jaxpr_to_triton_module = lower
  return modules


def triton_ir(fn, shape: tuple[int, int]) -> str:
  """The Triton IR of the last Pallas kernel `fn` launches (the quantizer, after any amax pre-pass such as
  `rotate.rotated_amax`)."""
  modules = triton_irs(fn, shape)
  if not modules:
    raise RuntimeError("no Pallas kernel lowered")
  return modules[-1]


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("kernels", nargs="*", default=list(KERNELS), help=f"any of {list(KERNELS)}")
  parser.add_argument("--shape", default="4096x4096")
  parser.add_argument("--num-warps", type=int, default=4)
  args = parser.parse_args(argv)
  shape = tuple(int(d) for d in args.shape.split("x"))
  os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # a cold cache: every kernel really compiles
  try:
    import triton  # pylint: disable=g-import-not-at-top
    from triton.backends.compiler import GPUTarget  # pylint: disable=g-import-not-at-top
  except ImportError:
    triton = None
    print("the `triton` package is missing: printing IR sizes only (pip install triton==3.5.1)")
  for name in args.kernels:
    ir = triton_ir(KERNELS[name], shape)
    line = f"{name:20s} IR {ir.count(chr(10)):6d} lines"
    if triton is not None:
      with tempfile.NamedTemporaryFile("w", suffix=".ttir", delete=False) as f:
        f.write(ir)
      t0 = time.perf_counter()
      kernel = triton.compile(f.name, target=GPUTarget("cuda", 90, 32), options={"num_warps": args.num_warps})
      seconds = time.perf_counter() - t0
      os.unlink(f.name)
      ptx = kernel.asm["ptx"]
      count = lambda pattern: len(re.findall(pattern, ptx))
      line += (f"  compile {seconds:6.1f} s  PTX {ptx.count(chr(10)):6d} lines  st/ld.shared "
               f"{count(r'st\.shared')}/{count(r'ld\.shared')}  shfl {count(r'shfl')}  smem {kernel.metadata.shared} B")
    print(line, flush=True)


if __name__ == "__main__":
  main()
