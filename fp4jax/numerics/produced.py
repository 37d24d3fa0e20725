"""Operands given by the elementwise op that produces them (`Produced`), so that a quantizer can compute them in its
own pass instead of reading them from memory.

In a Llama MLP, the down projection's X is SwiGLU of the gate|up product's output y. Written out, h = SwiGLU(y)
is a bf16 array that one XLA kernel writes and the down product's quantizer reads back. Given to fp4_dot as
`Produced("swiglu", (y,))`, the MXFP4 dual-view kernel (`ops.quantize.pallas.mxfp4`) reads y and computes h in
registers; every other quantizer implementation quantizes `value()`, the same numbers computed by XLA
(`ops.quantize.api`), and fp4_dot's backward takes the cotangent of y through `jax.vjp` of the producer.

The backward's counterpart, SwiGLU's derivative computed inside the gate|up product's dY quantizer, was built
and measured (docs/BENCHMARKS.md, "Session of 2026-12-06, 09:58 UTC") and does not pay: it cost the kernel more
than XLA's pass it saved, and a scanned block's y had to be copied out of its stack for a kernel to read it.

SwiGLU is defined here once, for the Llama MLP whether a quantizer computes it or not
(`fp4jax.nn.llama.layers.MLP`): h = bf16(silu(g) * u) computed in float32 from the stored bf16 g and u, and the
derivative JAX's reverse mode takes of that, its float32 operations written out in the order of `jax.vjp`'s
program (`swiglu_grad_f32`; a test compares the two bit for bit). The sigmoid is a parameter: a kernel passes
the instructions XLA:GPU compiles `jax.nn.sigmoid` into (`ops.quantize.pallas.sources`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from fp4jax.numerics import ieee
from fp4jax.numerics.qtensor import equal_fields

Sigmoid = Callable[[jax.Array], jax.Array]


def swiglu_f32(g: jax.Array, u: jax.Array, sigmoid: Sigmoid = jax.nn.sigmoid) -> jax.Array:
  """float32 silu(g) * u (silu(g) = g * sigmoid(g), as `jax.nn.silu`) of float32 g, u, before rounding."""
  return g * sigmoid(g) * u


def swiglu_grad_f32(g: jax.Array, u: jax.Array, dh: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(dg, du) in float32: the reverse-mode derivative of `swiglu_f32` at float32 g, u for the cotangent dh, with
  the operations of `jax.vjp(swiglu_f32)` in their order: s = sigmoid(g), n = dh * u, dg = n * s + (g * n) *
  (s * (1 - s)), du = (g * s) * dh."""
  s = jax.nn.sigmoid(g)
  n = dh * u
  return n * s + (g * n) * (s * (1.0 - s)), (g * s) * dh


def _pair_value(gate: jax.Array, up: jax.Array) -> jax.Array:
  return swiglu_f32(ieee.to_float32(gate), ieee.to_float32(up)).astype(gate.dtype)


def _pair_grads(gate: jax.Array, up: jax.Array, dh: jax.Array) -> tuple[jax.Array, jax.Array]:
  dg, du = swiglu_grad_f32(ieee.to_float32(gate), ieee.to_float32(up), ieee.to_float32(dh))
  return dg.astype(gate.dtype), du.astype(up.dtype)


@jax.custom_vjp
def swiglu_pair(gate: jax.Array, up: jax.Array) -> jax.Array:
  """h = silu(gate) * up computed in float32 from the inputs' stored values, rounded once to gate's dtype.

  The inputs are read by their bits (`ieee.to_float32`), as the kernels read them: XLA:GPU would otherwise be
  free to feed `astype(float32)` the unrounded float32 that a GEMM computed before its cast to bf16
  (`--xla_allow_excess_precision`, on by default), which it did for Hopper's NVFP4 GEMMs on bf16 values. Its
  derivative is `swiglu_grad_f32`'s, the inputs and dh read the same way."""
  return _pair_value(gate, up)


swiglu_pair.defvjp(lambda gate, up: (_pair_value(gate, up), (gate, up)), lambda res, dh: _pair_grads(*res, dh))


def _halves(y: jax.Array) -> tuple[jax.Array, jax.Array]:
  f = y.shape[-1] // 2
  return y[..., :f], y[..., f:]


@jax.custom_vjp
def swiglu(y: jax.Array) -> jax.Array:
  """h [..., F] = `swiglu_pair(gate, up)` of y [..., 2F] = gate | up; its derivative is dgate | dup side by
  side (as JAX's of `jnp.split`, where one through slices would add zeros: -0 turned +0)."""
  return _pair_value(*_halves(y))


swiglu.defvjp(lambda y: (_pair_value(*_halves(y)), y),
              lambda y, dh: (jnp.concatenate(_pair_grads(*_halves(y), dh), axis=-1),))


@dataclasses.dataclass(frozen=True)
class Producer:
  """An elementwise op that a `Produced` names: value(*inputs) -> the operand; shape(*input shapes) -> its shape;
  check(*inputs) -> None or a ValueError saying what the inputs lack."""

  value: Callable[..., jax.Array]
  shape: Callable[..., tuple[int, ...]]
  check: Callable[..., None]


def _check_swiglu(y) -> None:
  if y.ndim < 1 or y.shape[-1] % 2:
    raise ValueError(f"swiglu takes y [..., 2F] (gate | up), an even last dim: got {y.shape}")


# The name scope of a producer's ops where XLA computes them (`Produced.value`), read by `bench.breakdown`.
SCOPE = "fp4jax_producer"

PRODUCERS: dict[str, Producer] = {
    "swiglu": Producer(swiglu, lambda y: (*y[:-1], y[-1] // 2), _check_swiglu),
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Produced:
  """The operand PRODUCERS[kind].value(*inputs), not yet computed: a quantizer may compute it in its own pass.

  A pytree (the inputs are its leaves), so it crosses jit like an array. `shape`, `ndim` and `dtype` are the
  operand's (its dtype is the first input's, as `swiglu` gives).
  """

  kind: str = dataclasses.field(metadata=dict(static=True))
  inputs: tuple[jax.Array, ...]

  __eq__ = equal_fields

  def __post_init__(self):
    if self.kind not in PRODUCERS:
      raise ValueError(f"Produced's kind takes one of {sorted(PRODUCERS)}, got {self.kind!r}")
    if all(hasattr(a, "shape") for a in self.inputs):  # not while JAX rebuilds it from other leaves
      PRODUCERS[self.kind].check(*self.inputs)

  @property
  def shape(self) -> tuple[int, ...]:
    return PRODUCERS[self.kind].shape(*(a.shape for a in self.inputs))

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def dtype(self):
    return self.inputs[0].dtype

  def value(self) -> jax.Array:
    """The operand itself, computed by XLA, under the name scope `SCOPE` (its derivative too), so that a
    profile's breakdown counts the op as the model's own elementwise work wherever fp4_dot computes it."""
    with jax.named_scope(SCOPE):
      return PRODUCERS[self.kind].value(*self.inputs)


def value(x: jax.Array | Produced) -> jax.Array:
  """x's value: x itself for an array, computed for a `Produced`."""
  return x.value() if isinstance(x, Produced) else x
