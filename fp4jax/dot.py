"""fp4_dot: a matmul whose three GEMMs (fprop, dgrad, wgrad) each quantize their operands per a `Route`.

`fp4_dot(x, w, route=..., key=...)` computes x @ w for x [..., K], w [K, N] as a `jax.custom_vjp`:

  fprop  Y  = Q(X along K) Q(W along K)           a = X  K-major [M, K], b = W  K-major [N, K]
  dgrad  dX = Q(dY along N) Q(W along N)^T        a = dY K-major [M, N], b = W  K-major [K, N]
  wgrad  dW = Q(X along M)^T Q(dY along M)        a = X  K-major [K, M], b = dY K-major [N, M]

Each GEMM runs on a backend of `fp4jax.ops.gemm` (dequant(a) @ dequant(b).T). A transform of a GEMM (fixed or
random Hadamard) is applied to both of its operands along the contraction axis, with the same signs, so it
cancels in the product. Random bits: one `key` per call, split per operand role and per GEMM by
`fp4jax.route.operand_key` / `transform_key` (`prng.fold_in` with fixed indices).

Residuals (what the forward saves for the backward): only what the backward GEMMs read, already quantized:
  * X for wgrad: the QTensor of X quantized along M (wgrad_x spec), or X itself if wgrad_x is high precision.
  * W for dgrad: the QTensor of W quantized along N (dgrad_w spec), or W itself if dgrad_w is high precision.
    With 2-D tiles and dgrad_w == fprop_w (RNE, no transform) it is the fprop QTensor read in the other
    orientation (same codes and tile scales, no second quantization).
  * the key.
  * for an x given as a `numerics.produced.Produced`, the op's inputs (y of `Produced("swiglu", (y,))`), through
    whose `jax.vjp` the backward turns dX into their cotangents.
  Each saved array is tagged `checkpoint_name(..., RESIDUALS)`, so a `jax.checkpoint` policy (the scanned Llama
  blocks') can keep them instead of re-running the quantizers in the backward.
  With `requantize_saved` (Quartet II) those QTensors are quantized from the dequantized fprop FP4 X and W,
  never from the high-precision inputs. Quantizing X and W for the backward in the forward pass gives the same
  numbers as doing it in the backward (same keys) and keeps FP4, not bf16, alive between the passes.

Implementation (`impl`, an `fp4jax.Impl`): the quantizers come from `ops.quantize` ("auto": the fused Pallas
kernels on a GPU, else XLA's reference quantizer; the two operands read from one array -- X for fprop and
wgrad, dY for dgrad and wgrad, W for dgrad and fprop -- from one pass where a kernel covers both recipes), the
GEMMs from `ops.gemm` ("auto": the fastest backend for the device). Every implementation gives the same bits.
Where the backend multiplies bf16 values (`ops.gemm.operand_form`: Hopper's NVFP4 GEMMs), the operands a GEMM
reads at once -- the fprop views of X and W, both views of dY -- are quantized to `ScaledValues` (`_form`),
which the NVFP4 kernel writes itself; the residuals stay packed codes.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax.ad_checkpoint import checkpoint_name

from fp4jax import platform, route as route_lib
from fp4jax.impl import Impl
from fp4jax.numerics import prng, produced
from fp4jax.numerics.formats import FORMATS
from fp4jax.numerics.produced import Produced
from fp4jax.numerics.qtensor import QTensor, Quantized, pack_codes
from fp4jax.numerics.values import dequantize
from fp4jax.numerics.spec import OperandKeys, OperandSpec, check_x64
from fp4jax.ops import gemm as gemm_lib
from fp4jax.ops.gemm import emulated
from fp4jax.ops.quantize import api as quantize_api
from fp4jax.route import Route

Operand = Quantized | jax.Array  # A GEMM operand: quantized, or high precision in its K-major layout.


@dataclasses.dataclass(frozen=True)
class _Plan:
  """The static configuration crossing the custom_vjp boundary."""

  route: Route
  impl: Impl  # resolved at the call: the backward (traced later, when the vjp is applied) runs the same way
  x_dtype: np.dtype
  w_dtype: np.dtype
  out_dtype: np.dtype


def fp4_dot(x: jax.Array, w: jax.Array, *, route: str | Route, key: jax.Array | None = None,
            impl: Impl | None = None, out_dtype=None) -> jax.Array:
  """x @ w with each GEMM operand quantized per `route`; output in x's dtype (or `out_dtype`).

  Args:
    x: [..., K] activations (leading dims are flattened to M tokens), or a `numerics.produced.Produced`: the
      elementwise op that produces them with its inputs, e.g. `Produced("swiglu", (y,))` for SwiGLU of a gate|up
      product's output y [..., 2K]. The quantizers then compute x in their own pass where a kernel covers the op
      (the MXFP4 dual-view kernel: x is never written out), else quantize its value; the numbers are those of
      `fp4_dot(x.value(), ...)` and the gradient reaches the op's inputs. It is x's value that is used where
      `impl.fuse_producers` is off, the route is high precision, x needs zero padding along M or K, or a mesh of
      Explicit axes splits it.
    w: [K, N] weights.
    route: a `fp4jax.route.Route` or a preset name (`fp4jax.route.names()`).
    key: one JAX PRNG key (typed, or raw uint32[2]); required if `route.needs_key` (SR, MS-EDEN, random Hadamard).
    impl: an `fp4jax.Impl` (quantizer implementation, GEMM backend); None is `Impl()`: the fastest for the
      device. The numbers do not depend on it.
    out_dtype: the result's dtype (default x.dtype), written straight from the float32 accumulator (one
      rounding, every route), e.g. float32 logits from bf16 inputs; a floating-point dtype of 16 bits or more (an
      integer one would truncate, a float8 one overflow to NaN), so float8 operands need one. Gradients keep x's
      and w's dtypes.
  Any M, K, N: where the route needs whole blocks (`padding_multiples`), x and w are zero-padded inside and
  the result sliced back, forward and backward, which is exact; the padded work costs its share of time.
  Differentiable once in reverse mode (jax.grad, jax.vjp: a custom_vjp); forward mode (jax.jvp) is not defined,
  and a second derivative through a quantized route (grad of grad, jax.hessian) is a TypeError: its quantizers'
  rounding has no derivative, so one would come out as zeros or noise.
  A NaN or inf input makes its whole scale unit NaN (block, 2-D tile, or tensor for per-tensor scales),
  docs/NUMERICS.md "Special values".
  Returns:
    [..., N] in out_dtype.
  """
  route = route_lib.get(route)
  for name, a in (("w", w),) if isinstance(x, Produced) else (("x", x), ("w", w)):
    if not isinstance(a, (jax.Array, np.ndarray)):
      raise TypeError(f"fp4_dot takes arrays: {name} is a {type(a).__name__} (wrap it in jnp.asarray)")
    if not jnp.issubdtype(a.dtype, jnp.floating):
      raise ValueError(f"fp4_dot takes floating-point arrays: {name} has dtype {a.dtype}")
  # NumPy float64 as JAX holds it (float32 unless x64)
  x, w = (jnp.asarray(a) if isinstance(a, np.ndarray) else a for a in (x, w))
  if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
    raise ValueError(f"fp4_dot needs x [..., K] and w [K, N]: {x.shape=}, {w.shape=}")
  if impl is None:
    impl = Impl()
  elif not isinstance(impl, Impl):
    raise TypeError(f"fp4_dot's impl= takes an fp4jax.Impl(quantizer=..., gemm=...), got {impl!r}")
  if out_dtype is not None:
    out_dtype = check_out_dtype(out_dtype, "fp4_dot's out_dtype=")
  elif x.dtype.itemsize < 2:  # the default, x's dtype, would turn results past its range into NaN
    raise ValueError(f"fp4_dot writes its result in x's dtype, {x.dtype}, where an 8-bit float would turn values "
                     f"past its range into NaN: pass out_dtype= (jnp.bfloat16, jnp.float32, ...)")
  if key is not None:
    prng.check_key(key, "fp4_dot")
  elif route.needs_key:
    raise ValueError(f"route {route.name!r} draws random bits (SR, MS-EDEN or random Hadamard): pass key=")
  *lead, k = x.shape
  n = w.shape[1]
  m = math.prod(lead)
  mp, kp, np_ = (-(-d // mult) * mult for d, mult in zip((m, k, n), padding_multiples(route)))
  if isinstance(x, Produced) and not (impl.fuse_producers and not route.high_precision and 0 not in (m, k, n)
                                      and (mp, kp) == (m, k) and not platform.splits_explicit_axes()):
    x = x.value()  # where the quantizers are not handed x (the docstring)
  if route.high_precision or 0 in (m, k, n):  # Empty operands: the product is zeros (or empty) in any route.
    return _high_precision_dot(x, w, out_dtype)
  if key is None:
    key = jax.random.key(0)  # Never read: keeps one signature for every route.
  if platform.splits_explicit_axes():  # see _on_auto_axes
    return _on_auto_axes(x, w, key, route, impl, out_dtype)
  plan = _Plan(route, impl.resolved(), np.dtype(x.dtype), np.dtype(w.dtype),
               np.dtype(x.dtype) if out_dtype is None else out_dtype)
  if isinstance(x, Produced):  # no padding along M or K (above)
    *inputs, w = platform.vary_alike(*x.inputs, w, also=(key,))
    x2d = Produced(x.kind, tuple(a.reshape(m, a.shape[-1]) for a in inputs))
  else:
    x, w = _vary_alike(x, w, key)
    x2d = _pad2d(x.reshape(m, k), mp, kp)
  y = _dot2d(plan, x2d, _pad2d(w, kp, np_), key)  # [Mp, Np]
  if (mp, np_) != (m, n):
    y = y[:m, :n]
  return y.reshape(*lead, n)


def _on_auto_axes(x, w, key, route: Route, impl: Impl, out_dtype) -> jax.Array:
  """fp4_dot under a mesh of Explicit axes (`jax.make_mesh`'s default) that split, run with those axes Auto: the
  quantizers' table lookups and the wgrad GEMM's contraction over sharded tokens have no explicit sharding
  rule, and XLA's partitioner places them as under an Auto mesh. The result has x's sharding along its leading
  dims and w's along N."""
  spec = lambda a: tuple(jax.typeof(a).sharding.spec) + (None,) * a.ndim
  lead = spec(x)[:x.ndim - 1]
  taken = {a for s in lead if s is not None for a in ((s,) if isinstance(s, str) else s)}
  n_axes = spec(w)[1]  # N keeps w's axes but those x's leading dims use (FSDP: one axis splits both)
  n_axes = tuple(a for a in ((n_axes,) if isinstance(n_axes, str) else n_axes or ()) if a not in taken) or None
  out = jax.sharding.PartitionSpec(*lead, n_axes)
  run = lambda x, w, key: fp4_dot(x, w, route=route, key=key, impl=impl, out_dtype=out_dtype)
  return jax.sharding.auto_axes(run, out_sharding=out)(x, w, key)


def _high_precision_dot(x: jax.Array, w: jax.Array, out_dtype) -> jax.Array:
  """x @ w unquantized, the float32 (or wider) accumulator rounded once to out_dtype (default: x's dtype, which
  JAX's own dot rounds to). Another out_dtype goes through `_rounded_dot`, whose backward GEMMs read the cotangent
  in the operands' dtype where that holds float32's range."""
  out_dtype = x.dtype if out_dtype is None else out_dtype
  # float8 operands widened (exactly): JAX promotes no 8-bit float implicitly, not even against bf16
  x, w = (a.astype(jnp.float32) if a.dtype.itemsize == 1 else a for a in (x, w))
  if out_dtype == x.dtype:
    return jnp.dot(x, w).astype(out_dtype)
  x, w = _vary_alike(x, w)
  return _rounded_dot(np.dtype(out_dtype), x, w)


def _accumulator(*arrays: jax.Array) -> np.dtype:
  """The dtype a product of `arrays` accumulates in: their common dtype, at least float32."""
  return np.dtype(jnp.promote_types(jnp.result_type(*arrays), jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rounded_dot(out_dtype: np.dtype, x: jax.Array, w: jax.Array) -> jax.Array:
  """x [..., K] @ w [K, N] accumulated in float32 (or the operands' wider dtype) and rounded once to out_dtype.
  Not `preferred_element_type=out_dtype`: for an out_dtype narrower than the operands' XLA rounds the operands to
  it before the dot.

  The backward rounds the cotangent (in out_dtype) to the operands' common dtype before its two GEMMs, as a
  bf16 output's would be, wherever that dtype's range holds the cotangent's (bf16, float32): left to JAX's own
  rule, a float32 cotangent times a bf16 operand becomes a float32 x float32 GEMM (TF32 on Hopper): the
  Llama-1B lm_head's two gradient GEMMs (float32 logits) took 24.8 ms per step on an H200, all three of its
  GEMMs 13.5 ms once bf16 (docs/BENCHMARKS.md). float16 operands would overflow past 65504, so they keep the
  cotangent's dtype."""
  return jnp.dot(x, w, preferred_element_type=_accumulator(x, w)).astype(out_dtype)


def _rounded_dot_fwd(out_dtype, x, w):
  return _rounded_dot(out_dtype, x, w), (x, w)


def _rounded_dot_bwd(out_dtype, res, g):
  del out_dtype
  x, w = res
  common = jnp.result_type(x, w)
  if jnp.finfo(common).maxexp >= jnp.finfo(g.dtype).maxexp:
    g = g.astype(common)  # [..., N]
  lead = tuple(range(x.ndim - 1))
  dx = jnp.dot(g, w.T, preferred_element_type=_accumulator(g, w)).astype(x.dtype)  # [..., K]
  dw = jnp.tensordot(x, g, axes=(lead, lead), preferred_element_type=_accumulator(x, g)).astype(w.dtype)  # [K, N]
  return dx, dw


_rounded_dot.defvjp(_rounded_dot_fwd, _rounded_dot_bwd)


# `checkpoint_name` of the residuals (module docstring).
RESIDUALS = "fp4jax.fp4_dot.residuals"


def _pad2d(a: jax.Array, rows: int, cols: int) -> jax.Array:
  """a [R, C] zero-padded to [rows, cols] (a itself when nothing is padded)."""
  if a.shape == (rows, cols):
    return a
  return jnp.pad(a, ((0, rows - a.shape[0]), (0, cols - a.shape[1])))


def padding_multiples(route: str | Route) -> tuple[int, int, int]:
  """(M, K, N): what each dim is zero-padded up to a multiple of, so that every quantized operand's contraction
  dim is a whole number of its blocks, Hadamard blocks and MS-EDEN groups (and, for 2-D tiles, its other dim a
  whole number of tiles). (1, 1, 1) for a high-precision route. `route`: a name or a Route, as in fp4_dot.

  Zero padding is exact: zeros add nothing to a dot product, raise no block maximum, quantize to zero under any
  rounding and keep a Hadamard-rotated block's product with its partner (both operands are rotated alike).
  Padding costs work in proportion (quartet2 pads a single token to 128).
  """
  contraction = {"fprop": "K", "dgrad": "N", "wgrad": "M"}
  tile_other = {"fprop_x": "M", "fprop_w": "N", "dgrad_dy": "M", "dgrad_w": "K", "wgrad_x": "K", "wgrad_dy": "N"}
  need = {"M": 1, "K": 1, "N": 1}
  route = route_lib.get(route)
  for gemm, (_, *roles) in route_lib.GEMMS.items():
    for role in roles:
      spec = route.spec(role)
      for mult in spec.blocks.values():
        need[contraction[gemm]] = math.lcm(need[contraction[gemm]], mult)
      if spec.tile_2d:
        need[tile_other[role]] = math.lcm(need[tile_other[role]], FORMATS[spec.fmt].block)
  return need["M"], need["K"], need["N"]


def check_out_dtype(out_dtype, what: str) -> np.dtype:
  """out_dtype as a NumPy dtype, if a floating-point one of 16 bits or more that JAX can produce (float64 only
  with jax_enable_x64); else a ValueError starting with `what`. The result is written from the float32
  accumulator: an integer dtype would truncate it silently, and an 8-bit float turns values past its range into
  NaN (e4m3fn has no inf)."""
  try:
    dtype = jnp.dtype(out_dtype)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize < 2:
    raise ValueError(f"{what} takes a floating-point dtype of 16 bits or more (jnp.float32, jnp.bfloat16, ...), "
                     f"got {out_dtype!r}")
  check_x64(dtype, what)
  return np.dtype(dtype)


def _vary_alike(x: jax.Array, w: jax.Array, key: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """x and w cast to vary over every shard_map axis that any of x, w (and key) varies over
  (`platform.vary_alike`).

  Inside `shard_map` a custom_vjp must return cotangents of its primals' types: dW of a replicated w computed
  from a sharded x varies over the mesh axis, w does not. Casting w to varying first (as a plain dot does
  implicitly) makes the types agree, and the cast's transpose sums dW over that axis. No-op outside shard_map.
  """
  return platform.vary_alike(x, w, also=() if key is None else (key,))


def _prepare(v: jax.Array, spec: OperandSpec, axis: int, keys: OperandKeys, impl: Impl,
             form: str = "codes", tokens: bool = False) -> Operand:
  """One GEMM operand from a 2-D array `v`, reduced along `axis`, K-major (`axis` last): quantized per `spec`
  with its role's `keys` (`route.role_keys`) in `form` (`_form`), or `v` itself for a high-precision spec.
  tokens: v's rows are tokens (X, dY), split over `impl.token_axes`."""
  if not spec.quantized:
    return jnp.moveaxis(produced.value(v), axis, -1)
  return quantize_api.quantize_operand(v, spec, axis, keys, implementation=impl.quantizer, form=form,
                                       rows_over=impl.token_axes if tokens else ())


def _prepare_views(v: jax.Array, row: OperandSpec, col: OperandSpec, keys: tuple[OperandKeys, OperandKeys],
                   impl: Impl, forms: tuple[str, str] = ("codes", "codes"),
                   tokens: bool = False) -> tuple[Operand, Operand]:
  """The two operands read from one 2-D array: `v` along axis 1 (`row`, K-major [R, C]) and along axis 0
  (`col`, K-major [C, R]), e.g. X for fprop and wgrad, dY for dgrad and wgrad, W for dgrad and fprop: from one
  pass over `v` where a kernel covers both recipes (each with its own rounding and key), in `forms`; `tokens`
  as for `_prepare`."""
  if not (row.quantized and col.quantized):
    return (_prepare(v, row, 1, keys[0], impl, forms[0], tokens),
            _prepare(v, col, 0, keys[1], impl, forms[1], tokens))
  return quantize_api.quantize_views(v, row, col, *keys, implementation=impl.quantizer, forms=forms,
                                     rows_over=impl.token_axes if tokens else ())


def _form(a: OperandSpec, b: OperandSpec, impl: Impl) -> str:
  """The form of the operands of a GEMM of specs a and b that it reads at once, never a residual (values take
  2 bytes an element where codes take half of one): "values" where the backend multiplies bf16 values
  (`ops.gemm.operand_form`), so the quantizer writes them and no pass decodes codes into them; else
  "codes"."""
  if not (a.quantized and b.quantized):
    return "codes"
  return gemm_lib.operand_form(a.fmt, b.fmt, backend=impl.gemm)


def other_orientation(q: QTensor) -> QTensor:
  """A 2-D-tiled QTensor of a 2-D array read along its other axis: the same codes and tile scales.

  quantize(w, axis=1-a, tile_2d=True) equals other_orientation(quantize(w, axis=a, tile_2d=True)) bit for
  bit (tile scales are stored in every row of a tile, docs/ARCHITECTURE.md). Needs `q.outer` None or scalar.
  """
  if len(q.shape) != 2 or (q.outer is not None and q.outer.ndim):
    raise ValueError(f"other_orientation needs a 2-D QTensor with a per-tensor outer factor: {q.shape=}")
  b = q.spec.block
  codes = q.unpacked_codes().T  # [R, C] -> [C, R]
  scales = jnp.repeat(q.scales[::b].T, b, axis=0)  # [R, C/b] -> [R/b, C/b] -> [C/b, R/b] -> [C, R/b]
  return QTensor(pack_codes(codes), scales, q.outer, q.fmt, 1 - q.axis, q.shape)


def _reuses_fprop_w(route: Route) -> bool:
  """True if dgrad reads the fprop W codes (2-D tiles, same spec, deterministic, no transform)."""
  spec = route.fprop_w
  return (spec == route.dgrad_w and spec.tile_2d and spec.rounding == "rne" and spec.transform is None
          and not route.requantize_saved and FORMATS[spec.fmt].outer in ("none", "tensor"))


def _gemm(a: Operand, b: Operand, out_dtype, impl: Impl) -> jax.Array:
  """a [R, C] (K-major) times b [S, C]^T -> [R, S]: an FP4 backend GEMM, or a plain dot otherwise."""
  quantized = lambda o: isinstance(o, Quantized)
  if quantized(a) and quantized(b):
    return gemm_lib.gemm(a, b, out_dtype=out_dtype, backend=impl.gemm)
  dims = (((1,), (1,)), ((), ()))
  if not quantized(a) and not quantized(b):
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32).astype(out_dtype)
  # One quantized, one high-precision operand: exact float32 product of the dequantized values.
  av, bv = (emulated.kmajor_f32(o) if quantized(o) else o.astype(jnp.float32) for o in (a, b))
  return jax.lax.dot_general(av, bv, dims, precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32).astype(out_dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _first_order_only(route: str, a: jax.Array) -> jax.Array:
  """`a` itself, for the forward with residuals and the backward of a quantized fp4_dot: JAX differentiates
  those only for a second derivative, which would run through the quantizers (rounding, zero derivative) and
  give zeros or noise; differentiating this raises instead."""
  return a


@_first_order_only.defjvp
def _first_order_only_jvp(route, primals, tangents):
  raise TypeError(f"fp4_dot under route {route!r} is differentiable once: a second derivative (grad of grad, "
                  f"jax.hessian, jvp of grad) would differentiate its quantizers' rounding, zeros or noise; "
                  f"take it under route='bf16' or differentiate fp4_dot once")


# The primal, the forward with residuals and the backward are each jitted with the plan static: a model calls
# fp4_dot from many layers with a few distinct shapes, and each distinct (plan, shapes) is then traced and
# lowered once (one function XLA inlines at every call site) instead of once per layer.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dot2d(plan: _Plan, x, w, key):
  return _forward(plan, x, w, key)


@functools.partial(jax.jit, static_argnums=0)
def _forward(plan: _Plan, x, w, key):
  r = plan.route
  keys = route_lib.role_keys(r, key, ("fprop_x", "fprop_w"))
  form = _form(r.fprop_x, r.fprop_w, plan.impl)
  xa = _prepare(x, r.fprop_x, 1, keys["fprop_x"], plan.impl, form, tokens=True)  # [M, K]
  wb = _prepare(w, r.fprop_w, 0, keys["fprop_w"], plan.impl, form)  # K-major [N, K]
  return _gemm(xa, wb, plan.out_dtype, plan.impl)


@functools.partial(jax.jit, static_argnums=0)
def _forward_saving(plan: _Plan, x, w, key):
  r = plan.route
  x, w = (jax.tree.map(functools.partial(_first_order_only, r.name), a) for a in (x, w))
  keys = route_lib.role_keys(r, key, ("fprop_x", "fprop_w", "wgrad_x", "dgrad_w"))
  form = _form(r.fprop_x, r.fprop_w, plan.impl)  # the fprop views are read at once; the backward's are kept
  if r.requantize_saved:  # Quartet II: the backward's X and W come from the fprop FP4 values
    xa = _prepare(x, r.fprop_x, 1, keys["fprop_x"], plan.impl, form, tokens=True)  # [M, K]
    wb = _prepare(w, r.fprop_w, 0, keys["fprop_w"], plan.impl, form)  # K-major [N, K]
    x_wgrad = _prepare(dequantize(xa), r.wgrad_x, 0, keys["wgrad_x"], plan.impl, tokens=True)  # K-major [K, M]
    w_dgrad = _prepare(dequantize(wb), r.dgrad_w, 1, keys["dgrad_w"], plan.impl)  # K-major [K, N]
  else:
    xa, x_wgrad = _prepare_views(x, r.fprop_x, r.wgrad_x, (keys["fprop_x"], keys["wgrad_x"]), plan.impl,
                                 (form, "codes"), tokens=True)
    if _reuses_fprop_w(r):  # one set of codes serves both GEMMs, kept for dgrad
      wb = _prepare(w, r.fprop_w, 0, keys["fprop_w"], plan.impl)
      w_dgrad = other_orientation(wb)
    else:
      w_dgrad, wb = _prepare_views(w, r.dgrad_w, r.fprop_w, (keys["dgrad_w"], keys["fprop_w"]), plan.impl,
                                   ("codes", form))
  producer = x if isinstance(x, Produced) else None  # its inputs, for the backward's vjp
  saved = jax.tree.map(lambda a: checkpoint_name(a, RESIDUALS), (x_wgrad, w_dgrad, producer))
  return _gemm(xa, wb, plan.out_dtype, plan.impl), (*saved, key)


@functools.partial(jax.jit, static_argnums=0)
def _backward(plan: _Plan, res, g):
  x_wgrad, w_dgrad, producer, key = res
  r = plan.route
  g = _first_order_only(r.name, g)
  keys = route_lib.role_keys(r, key, ("dgrad_dy", "wgrad_dy"))
  forms = (_form(r.dgrad_dy, r.dgrad_w, plan.impl), _form(r.wgrad_x, r.wgrad_dy, plan.impl))
  dy_d, dy_w = _prepare_views(g, r.dgrad_dy, r.wgrad_dy, (keys["dgrad_dy"], keys["wgrad_dy"]), plan.impl,
                              forms, tokens=True)  # [M, N], [N, M]: both read at once
  dx = _gemm(dy_d, w_dgrad, plan.x_dtype, plan.impl)  # [M, K]
  dw = _gemm(x_wgrad, dy_w, plan.w_dtype, plan.impl)  # [K, N]
  if producer is not None:  # x was the op's value: dX is carried back to the op's inputs
    _, vjp = jax.vjp(lambda *inputs: Produced(producer.kind, inputs).value(), *producer.inputs)
    dx = Produced(producer.kind, vjp(dx))
  return dx, dw, None


_dot2d.defvjp(_forward_saving, _backward)
