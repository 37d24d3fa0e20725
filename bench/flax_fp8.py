"""`bench step --routes flax_fp8`: the ecosystem's FP8 peer of the `fp8` route, each block linear's product run by
Flax's own FP8 op, `flax.linen.fp8_ops.fp8_scaled_dot_general` (what its `Fp8DirectDotGeneralOp` runs).

Flax's recipe is delayed scaling, as Transformer Engine's: x and the kernel in E4M3, the output gradient in E5M2,
each scaled from the largest amax of a 1024-step history, and the scales and histories kept as state that the
backward pass returns in place of their gradients ("overwrite with gradient"). Flax ships the op as Linen
modules only. Here every block FP4Linear of a bf16 model with unfused linears (a fused q|k|v or gate|up product
goes through fp4_dot, not through the layer's `__call__`) becomes a `FlaxFp8Linear` holding that state as
`Fp8Meta` variables, and the train step writes their "gradients" back into the model instead of handing them to
the optimizer (`split_grads`). A baseline of the step benchmark, not a route of the library: fp4_dot is
stateless, delayed scaling is not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import fp8_ops
from jax.ad_checkpoint import checkpoint_name

from fp4jax.nn import linear
from fp4jax.nn.linear import FP4Linear

NAME = "flax_fp8"
HISTORY = 1024  # amax history length, Flax's default (Fp8DotGeneralBase.amax_history_length)
_SCALES = ("input_scale", "kernel_scale", "output_grad_scale")
_HISTORIES = ("input_amax_history", "kernel_amax_history", "output_grad_amax_history")


class Fp8Meta(nnx.Variable):
  """Flax FP8 state of one linear: a scale [1] or an amax history [HISTORY] per operand (x, kernel, output
  gradient); each step's backward returns its next value, which replaces it (`split_grads`)."""


class FlaxFp8Linear(FP4Linear):
  """An FP4Linear whose product is Flax's FP8 op under delayed scaling (module docstring); made by `convert`."""

  def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
    del key  # delayed scaling draws no random bits
    if x.shape[-1] != self.in_features:
      raise ValueError(f"input feature size {x.shape[-1]} != {self.in_features=}")
    x = checkpoint_name(x.astype(self.dtype), linear.INPUT)
    kernel = checkpoint_name(self.kernel[...].astype(self.dtype), linear.KERNEL)
    y = fp8_ops.fp8_scaled_dot_general(
        x, kernel, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=self.dtype,
        lhs_scale=self.input_scale[...], rhs_scale=self.kernel_scale[...], grad_scale=self.output_grad_scale[...],
        lhs_amax_history=self.input_amax_history[...], rhs_amax_history=self.kernel_amax_history[...],
        grad_amax_history=self.output_grad_amax_history[...], quantize_compute_type=self.dtype)
    return checkpoint_name(y.astype(self.out_dtype), linear.OUTPUT)


def convert(model: nnx.Module) -> int:
  """Turns every FP4Linear of `model.layers` (the blocks: the lm_head stays bf16 as in every route) into a
  FlaxFp8Linear with fresh state (scales 1, empty histories, as Flax initializes them); returns how many.

  Needs a bf16 model with unfused linears (`LlamaConfig.fuse_linears=False`) and unrolled blocks (a scanned
  model holds its blocks stacked, `Llama.stacks`): raises ValueError otherwise."""
  if getattr(model, "scan_layers", False):
    raise ValueError(f"{NAME} converts the linears of unrolled blocks: build the model with scan_layers=False")
  converted = 0
  for path, module in nnx.iter_graph(model.layers):
    where = ".".join(map(str, ("layers", *path)))
    if getattr(module, "fused", False):
      raise ValueError(f"{NAME} needs unfused linears (LlamaConfig.fuse_linears=False): {where} fuses its "
                       f"products through fp4_dot")
    if not isinstance(module, FP4Linear):
      continue
    if module.route.name != "bf16":
      raise ValueError(f"{NAME} replaces bf16 products; {where} runs {module.route.name}")
    module.__class__ = FlaxFp8Linear
    for name in _SCALES:
      setattr(module, name, Fp8Meta(jnp.ones((1,), jnp.float32)))
    for name in _HISTORIES:
      setattr(module, name, Fp8Meta(jnp.zeros((HISTORY,), jnp.float32)))
    converted += 1
  return converted


def split_grads(grads: nnx.State) -> tuple[nnx.State, nnx.State]:
  """(the Param gradients for the optimizer, the Fp8Meta values to write into the model with `nnx.update`) of
  gradients taken with respect to `nnx.DiffState(0, (nnx.Param, Fp8Meta))`."""
  return nnx.split_state(grads, nnx.Param, Fp8Meta)
