"""How fp4_dot runs, as one frozen value: which quantizer implementation, which GEMM backend, and over which
mesh axes the tokens are split.

`Impl` changes where and how fast the numbers are computed, never the numbers: every quantizer
implementation gives the reference's bits, every GEMM backend the emulated product (up to the order of
float32 sums; the fp8 backend's MXFP4 re-encoding only while a row's block scales span <= 2^14, `numerics.fp8`),
and a device quantizing only its own tokens the bits of the whole batch. It is hashable and
static, like a route: fp4_dot carries it in its plan across jit and custom_vjp, FP4Linear and Llama hold it,
and the training config sets it (`kernels:`).
"""

from __future__ import annotations

import dataclasses

import jax

from fp4jax.numerics.spec import check_choice
from fp4jax.ops import gemm
from fp4jax.ops.quantize import api as quantize_api


@dataclasses.dataclass(frozen=True)
class Impl:
  """The implementation choice of an fp4_dot.

  Attributes:
    quantizer: "auto" (the fused Pallas kernels on a GPU backend, else XLA), "pallas" (the kernels, compiled
      for the GPU), "interpret" (the kernels in Pallas interpret mode, on any backend: slow, for tests) or
      "xla" (the reference quantizers compiled by XLA). Wherever a kernel does not cover an operand, the XLA
      reference quantizes it (`ops.quantize.api`).
    gemm: "auto" (the fastest backend the device generation and the operands allow), "emulated"
      (dequantize and dot, anywhere), "fp8" (Hopper FP8 tensor cores), "mosaic" (Hopper: MXFP4 pairs in one
      Mosaic GPU kernel applying the per-row factors, `ops.gemm.mosaic`) or "native" (Blackwell block-scaled).
    token_axes: the mesh axes (of the mesh in context, `jax.set_mesh`) over which the tokens (x's and dY's
      rows) are split, so that each device quantizes only its own with the fused kernels
      (`ops.quantize.pallas.rows`: MXFP4, NVFP4 and MS-EDEN recipes; tile-local NVFP4 is gathered whole, as
      XLA partitions a kernel it cannot see into); "auto": every axis of that mesh, as a data-parallel or
      FSDP batch is split (the training loop's ("data", "fsdp")); () splits none.
    fuse_producers: where fp4_dot's x is given as the elementwise op that produces it
      (`numerics.produced.Produced`: the Llama MLP's SwiGLU before its down projection), the quantizers compute
      x from that op's inputs in their own pass where a kernel covers the op, so x is not written out and read
      back. False writes x out first, as separate ops would. The numbers are the same.
  """

  quantizer: str = "auto"
  gemm: str = "auto"
  token_axes: str | tuple[str, ...] = "auto"
  fuse_producers: bool = True

  def __post_init__(self):
    check_choice("quantizer implementation", self.quantizer, quantize_api.CHOICES)
    gemm.registry.check_choice(self.gemm)
    axes = self.token_axes
    if axes != "auto" and not (isinstance(axes, tuple) and all(isinstance(a, str) for a in axes)):
      raise ValueError(f"Impl's token_axes takes 'auto' or a tuple of mesh-axis names, got {axes!r}")
    if axes != "auto" and len(set(axes)) != len(axes):
      raise ValueError(f"Impl's token_axes names an axis twice: {axes!r}")
    if not isinstance(self.fuse_producers, bool):
      raise ValueError(f"Impl's fuse_producers takes True or False, got {self.fuse_producers!r}")

  def resolved(self) -> Impl:
    """This choice with "auto" quantizing resolved for the current default backend and "auto" token axes for
    the mesh in context (at trace time); a "pallas" choice where the default backend is not a GPU fails here,
    naming the alternatives."""
    quantizer = quantize_api.resolve(self.quantizer)
    if quantizer == "pallas" and quantize_api.resolve("auto") != "pallas":
      raise ValueError("Impl(quantizer='pallas') compiles the Pallas kernels for a GPU, but JAX's default "
                       "backend is not one: use 'auto', 'xla' or 'interpret'")
    axes, mesh = self.token_axes, jax.sharding.get_abstract_mesh()
    if axes == "auto":
      axes = tuple(mesh.axis_names)
    elif not mesh.empty and (unknown := [a for a in axes if a not in mesh.axis_names]):
      raise ValueError(f"Impl's token_axes {unknown} are no axes of the mesh in context {mesh.axis_names}")
    return dataclasses.replace(self, quantizer=quantizer, token_axes=axes)
