"""IEEE float32 division and product inside a Pallas kernel, with the reference's bits (`fp4jax.ieee`).

Pallas's Triton lowering turns a float32 `lax.div` into `arith.divf`, which Triton compiles to an approximate
division, and the compiler may contract a product into a following add (an FMA rounds once where the reference
rounds twice). MS-EDEN (`quantize_eden`) divides per element and sums products, so its kernel needs both
operations pinned:
  * `div_rn`: PTX `div.rn.f32` through `pltriton.elementwise_inline_asm`, the IEEE correctly rounded quotient
    (no .ftz: subnormals kept), which is what `ieee.div` computes. (`ieee.div`'s former integer long division inside
    the Triton kernel was tried as well: on the H200, XLA's compile of the MS-EDEN kernel with it had not
    finished after minutes, so it is not offered.)
  * `mul_rn`: PTX `mul.rn.f32`: an instruction with an explicit rounding modifier is never fused into an FMA,
    and the compiler cannot look through an asm result.
Interpret mode (CPU) has no asm: there `div_rn` is `ieee.div` and `mul_rn` a product behind an optimization
barrier (which keeps XLA:CPU from contracting it into the add that consumes it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

from fp4jax.numerics import ieee

def _asm(op: str, a: jax.Array, b: jax.Array) -> jax.Array:
  a, b = jnp.broadcast_arrays(a.astype(jnp.float32), b.astype(jnp.float32))
  [out] = pltriton.elementwise_inline_asm(f"{op} $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
                                          result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
  return out


def div_rn(a: jax.Array, b: jax.Array, *, interpret: bool) -> jax.Array:
  """a / b correctly rounded (broadcasting)."""
  if interpret:
    return ieee.div(a, b)
  return _asm("div.rn.f32", a, b)


def mul_rn(a: jax.Array, b: jax.Array, *, interpret: bool) -> jax.Array:
  """a * b rounded to float32 on its own, never fused into a later add (broadcasting)."""
  if interpret:
    return jax.lax.optimization_barrier(a * b)
  return _asm("mul.rn.f32", a, b)
