"""FP4Linear: a Flax NNX dense layer whose matmul is `fp4jax.fp4_dot` under a route.

Two ways to put FP4 GEMMs into an NNX model:
  * `FP4Linear(in, out, route=...)`: our own layer; `__call__(x, key=...)` takes the per-call random key
    that stochastic-rounding / random-Hadamard routes need.
  * `nnx.Linear(in, out, dot_general=fp4_dot_general(route, key))`: the stock layer with a hook. The hook
    has no way to receive a key per call (nnx.Linear passes none), so a keyed route sees the *same* key on
    every call, i.e. the same rounding noise each step. Use it for deterministic routes or quick trials.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from fp4jax import route as route_lib
from fp4jax.dot import check_out_dtype, fp4_dot, padding_multiples
from fp4jax.impl import Impl
from fp4jax.numerics import prng
from fp4jax.numerics.ints import is_int
from fp4jax.numerics.produced import Produced
from fp4jax.numerics.spec import float_dtype
from fp4jax.route import Route

Initializer = Callable[..., jax.Array]
default_kernel_init: Initializer = nnx.initializers.lecun_normal()  # as nnx.Linear


def sharded_init(init: Initializer, names: Sequence[str | None]) -> Initializer:
  """`init` whose Param carries mesh-axis names (`nnx.get_partition_spec` reads them), placed lazily.

  Eager sharding (flax's default) would place the value on creation and then requires an active mesh;
  we keep it off so models build anywhere, and the trainer places the state with NamedShardings built
  from `nnx.get_partition_spec(nnx.state(model))`.
  """
  return nnx.with_partitioning(init, tuple(names), eager_sharding=False)


# `checkpoint_name`s of every FP4Linear's output and of the bf16 operands of its product, for `jax.checkpoint`
# policies (fp4jax.nn.llama.model): the output is what the next op's backward reads; the operands are what a
# high-precision route's backward GEMMs read (an FP4 route saves its quantized operands instead, fp4jax.dot).
OUTPUT = "fp4jax.linear.output"
INPUT = "fp4jax.linear.input"
KERNEL = "fp4jax.linear.kernel"


class FP4Linear(nnx.Module):
  """y = x @ kernel (+ bias), the matmul done by `fp4_dot` under `route`.

  The kernel is stored in `param_dtype` ([in, out], as nnx.Linear) and cast to `dtype` before the dot, so
  the optimizer updates full-precision master weights while the GEMM sees bf16 (then FP4 per the route).
  The route and the implementation choice (`impl`: quantizer implementation, GEMM backend) are kept as static
  attributes: they are part of the graph definition, not of the state, so changing them means building a new
  module. The output and the product's bf16 operands are tagged `checkpoint_name(..., OUTPUT / INPUT / KERNEL)`.
  """

  def __init__(
      self,
      in_features: int,
      out_features: int,
      *,
      route: str | Route = "bf16",
      impl: Impl = Impl(),
      use_bias: bool = False,
      dtype: Any = jnp.bfloat16,
      param_dtype: Any = jnp.float32,
      kernel_init: Initializer = default_kernel_init,
      kernel_sharding: Sequence[str | None] = (None, None),
      out_dtype: Any = None,
      rngs: nnx.Rngs,
  ):
    for name, size in (("in_features", in_features), ("out_features", out_features)):
      if not is_int(size) or size < 1:
        raise ValueError(f"FP4Linear's {name} takes an int >= 1, got {size!r}")
    in_features, out_features = int(in_features), int(out_features)  # NumPy ints too (a shape's entries)
    float_dtype(param_dtype, "FP4Linear's param_dtype=")
    if (isinstance(kernel_sharding, str) or not isinstance(kernel_sharding, Sequence) or len(kernel_sharding) != 2
        or not all(a is None or isinstance(a, str) for a in kernel_sharding)):
      raise ValueError(f"FP4Linear's kernel_sharding takes 2 mesh-axis names or None ([in, out], e.g. "
                       f"('fsdp', None)), got {kernel_sharding!r}")
    self.in_features = in_features
    self.out_features = out_features
    self.route = route_lib.get(route)
    if not isinstance(impl, Impl):
      raise TypeError(f"FP4Linear's impl= takes an fp4jax.Impl, got {impl!r}")
    self.impl = impl
    self.dtype = check_out_dtype(dtype, "FP4Linear's dtype=")  # the operands' dtype: floating, as fp4_dot's
    # e.g. float32 logits from bf16 operands (the float32 accumulator)
    self.out_dtype = check_out_dtype(out_dtype or dtype, "FP4Linear's out_dtype=")
    self.param_dtype = param_dtype
    init = sharded_init(kernel_init, kernel_sharding)
    self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), param_dtype))  # [in, out]
    if use_bias:
      bias_init = sharded_init(nnx.initializers.zeros_init(), (kernel_sharding[1],))
      self.bias = nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype))  # [out]
    else:
      self.bias = nnx.data(None)

  def __call__(self, x: jax.Array | Produced, *, key: jax.Array | None = None) -> jax.Array:
    """x [..., in] -> [..., out] in `out_dtype`. `key`: the random key of this call (keyed routes only). x may be
    a `numerics.produced.Produced` (the op that produces it, which fp4_dot's quantizers may compute)."""
    _check_input(x, self.in_features, "FP4Linear")
    y = _product([self], x, key)
    if self.bias is not None:
      y = y + self.bias[...].astype(self.out_dtype)
    return checkpoint_name(y, OUTPUT)  # [..., out]


def fusable(linears: Sequence[FP4Linear]) -> bool:
  """True if `fused_call` can run these layers as one product: same input size, route, implementation and
  dtypes, no bias, and each output size a multiple of what the route quantizes together along the output axis
  (`padding_multiples`' N: dgrad's W blocks, 2-D tiles, MS-EDEN groups), so that no block or tile straddles
  two layers: a 32x32 MXFP4 tile over a 40- and a 24-wide layer gave the smaller one the larger one's scale."""
  if not linears:
    raise ValueError("fused_call needs at least one FP4Linear")
  return not _unfusable(linears)


def _unfusable(linears: Sequence[FP4Linear]) -> list[str]:
  """What keeps `linears` from `fusable`, for messages: each setting they differ in with every layer's value, the
  layers with a bias, output sizes that the first layer's route would straddle."""
  first = linears[0]
  show = lambda value: value.name if isinstance(value, Route) else str(value)
  out = [f"{name} differs ({' / '.join(show(getattr(m, name)) for m in linears)})"
         for name in ("in_features", "route", "impl", "dtype", "out_dtype")
         if any(getattr(m, name) != getattr(first, name) for m in linears)]
  if any(m.bias is not None for m in linears):
    out.append(f"linears {[i for i, m in enumerate(linears) if m.bias is not None]} have a bias")
  n_multiple = padding_multiples(first.route)[2]
  if any(m.out_features % n_multiple for m in linears):
    out.append(f"output sizes {[m.out_features for m in linears]} are not all multiples of {n_multiple}")
  return out


def fused_call(linears: Sequence[FP4Linear], x: jax.Array, *, key: jax.Array | None = None) -> list[jax.Array]:
  """x [..., in] through every layer of `linears` (`fusable`) as ONE `fp4_dot` of x and their kernels
  concatenated along the output axis; returns each layer's output [..., out_i], split back.

  What it saves against separate calls: x is quantized once instead of once per layer (both its views), and
  one larger GEMM replaces several (q, k, v of a GQA block: N = 4096 + 1024 + 1024 at Llama-3-8B). The numbers
  are those of one linear with the concatenated kernel: the same math, with these differences from separate
  calls. dX is one float32 sum over every layer's outputs, rounded once (separate calls round each layer's dX
  and add them); a per-tensor scale (NVFP4's global scale) spans the concatenated kernel and dY; and a keyed
  route draws its random bits from `key` for the whole product (the first layer's key, say), not one key per
  layer. Block-scaled formats with blocks inside each layer's columns (MXFP4, NVFP4 along K) quantize x and
  each kernel column as separate calls do. The parameters stay one kernel per layer. Tags as `__call__`:
  INPUT on x, KERNEL on the concatenated kernel, OUTPUT on the product before the split.
  """
  bounds = list(itertools.accumulate(m.out_features for m in linears))[:-1]
  return jnp.split(fused_product(linears, x, key=key), bounds, axis=-1)


def fused_product(linears: Sequence[FP4Linear], x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
  """`fused_call`'s product before its split: the layers' outputs side by side [..., sum(out)], tagged OUTPUT
  (e.g. gate | up, which `numerics.produced.swiglu` reads)."""
  if not fusable(linears):
    raise ValueError(f"fused_call needs linears with one input size, route, impl and dtypes, no bias and output "
                     f"sizes in whole blocks of the route; here {'; '.join(_unfusable(linears))}")
  _check_input(x, linears[0].in_features, "fused_call")
  return checkpoint_name(_product(linears, x, key), OUTPUT)  # [..., sum(out)]


def _check_input(x, in_features: int, what: str) -> None:
  """A ValueError naming `what` unless x is an array [..., in_features]."""
  if not hasattr(x, "ndim") or x.ndim < 1:
    raise ValueError(f"{what} takes an array x [..., {in_features}], got {type(x).__name__} "
                     f"{getattr(x, 'shape', '')}")
  if x.shape[-1] != in_features:
    raise ValueError(f"input feature size {x.shape[-1]} != {what}'s in_features={in_features}")


def _product(linears: Sequence[FP4Linear], x: jax.Array, key: jax.Array | None) -> jax.Array:
  """x [..., in] @ the kernels of `linears` (one, or `fusable` ones) concatenated along the output axis, by
  `fp4_dot` under the first one's route, with the INPUT and KERNEL tags; no bias, x's size already checked.
  One kernel is used as it is (a concatenation of one array is that array)."""
  first = linears[0]
  if isinstance(x, Produced) and (x.dtype != first.dtype or first.route.high_precision
                                  or not first.impl.fuse_producers):
    x = x.value()  # written out, and tagged INPUT: what a high-precision backward reads
  x = jax.tree.map(lambda a: checkpoint_name(a.astype(first.dtype), INPUT), x)  # a Produced: its inputs
  kernel = jnp.concatenate([m.kernel[...].astype(first.dtype) for m in linears], axis=1)  # [in, sum(out)]
  kernel = checkpoint_name(kernel, KERNEL)
  return fp4_dot(x, kernel, route=first.route, key=key, impl=first.impl, out_dtype=first.out_dtype)


def fp4_dot_general(route: str | Route, key: jax.Array | None = None,
                    impl: Impl = Impl()) -> Callable[..., jax.Array]:
  """A `dot_general` hook for stock `nnx.Linear(..., dot_general=fp4_dot_general(route))`.

  Handles only what nnx.Linear issues: lhs [..., K] contracted on its last axis with a 2-D rhs [K, N] on
  axis 0, no batch dimensions. `precision` is ignored (the route fixes the numerics). `key` is fixed when
  the hook is made: a keyed route draws the same random bits on every call (see the module docstring).
  """
  resolved = route_lib.get(route)
  if resolved.needs_key and key is None:
    raise ValueError(f"route {resolved.name!r} needs a random key: fp4_dot_general(route, key=...)")
  if key is not None:
    prng.check_key(key, "fp4_dot_general")
  if not isinstance(impl, Impl):
    raise TypeError(f"fp4_dot_general's impl= takes an fp4jax.Impl, got {impl!r}")

  def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                  out_sharding=None):
    del precision  # The route decides the numerics.
    standard = (((lhs.ndim - 1,), (0,)), ((), ()))
    (lc, rc), (lb, rb) = dimension_numbers
    dims = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
    if rhs.ndim != 2:
      raise NotImplementedError(f"fp4_dot_general takes a 2-D rhs [K, N], got rhs.shape={rhs.shape} (e.g. "
                                f"nnx.LinearGeneral's kernel): use nnx.Linear or FP4Linear")
    if dims != standard:
      raise NotImplementedError(
          f"fp4_dot_general handles only x[..., K] @ w[K, N]: got lhs.shape={lhs.shape}, "
          f"rhs.shape={rhs.shape}, {dimension_numbers=}, expected {standard}")
    if out_sharding is not None:
      raise NotImplementedError(f"fp4_dot_general does not take {out_sharding=}")
    # preferred_element_type (e.g. float32 from bf16 operands) is written straight from the float32 accumulator.
    return fp4_dot(lhs, rhs.astype(lhs.dtype), route=resolved, key=key, impl=impl,
                   out_dtype=preferred_element_type)

  return dot_general
