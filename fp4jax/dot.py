"""fp4_dot: a matmul whose three GEMMs (fprop, dgrad, wgrad) each quantize their operands per a `Route`.

`fp4_dot(x, w, route=..., key=...)` computes x @ w for x [..., K], w [K, N] as a `jax.custom_vjp`:

  fprop  Y  = Q(X along K) Q(W along K)           a = X  K-major [M, K], b = W  K-major [N, K]
  dgrad  dX = Q(dY along N) Q(W along N)^T        a = dY K-major [M, N], b = W  K-major [K, N]
  wgrad  dW = Q(X along M)^T Q(dY along M)        a = X  K-major [K, M], b = dY K-major [N, M]

Each GEMM runs on a backend of `fp4jax.kernels` (dequant(a) @ dequant(b).T). A transform of a GEMM (fixed or
random Hadamard) is applied to both of its operands along the contraction axis, with the same signs, so it
cancels in the product. Random bits: one `key` per call, split per operand role and per GEMM by
`fp4jax.route.operand_key` / `transform_key` (fold_in with fixed indices).

Residuals (what the forward saves for the backward): only what the backward GEMMs read, already quantized:
  * X for wgrad: the QTensor of X quantized along M (wgrad_x spec), or X itself if wgrad_x is high precision.
  * W for dgrad: the QTensor of W quantized along N (dgrad_w spec), or W itself if dgrad_w is high precision.
    With 2-D tiles and dgrad_w == fprop_w (RNE, no transform) it is the fprop QTensor read in the other
    orientation (same codes and tile scales, no second quantization).
  * the key.
  With `requantize_saved` (Quartet II) those QTensors are quantized from the dequantized fprop FP4 X and W,
  never from the high-precision inputs. Quantizing X and W for the backward in the forward pass gives the same
  numbers as doing it in the backward (same keys) and keeps FP4, not bf16, alive between the passes.

Fused quantization (on a GPU, `FUSED_QUANTIZER`): the two operands read from one array -- X for fprop (along
K) and wgrad (along M), dY for dgrad (along N) and wgrad (along M) -- come from ONE pass of
`kernels.quantize_fused` (MXFP4) or `kernels.quantize_fused_nv` (NVFP4) where it covers both recipes (each
with its own rounding, key and a Hadamard on the wgrad view), bit for bit the reference quantizer's numbers;
an MS-EDEN operand (quartet2's backward, each view its own rotation) from `kernels.quantize_eden`, one view per
launch; anything else falls back to `reference.quantize` compiled by XLA.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax import kernels
from fp4jax import route as route_lib
from fp4jax.formats import FORMATS
from fp4jax.hadamard import hadamard
from fp4jax.kernels import gemm_emulated, quantize_eden, quantize_fused, quantize_fused_nv
from fp4jax.qtensor import QTensor, pack_codes
from fp4jax.reference import dequantize, quantize
from fp4jax.route import OperandSpec, Route

Operand = QTensor | jax.Array  # A GEMM operand: quantized, or high precision in its K-major layout.


@dataclasses.dataclass(frozen=True)
class _Plan:
  """The static configuration crossing the custom_vjp boundary."""

  route: Route
  impl: str | None
  x_dtype: np.dtype
  w_dtype: np.dtype
  out_dtype: np.dtype
  quantizer: str  # `_quantizer_mode()` read once at the call, so the backward (traced later, when the vjp is
  # applied) quantizes dY the way the forward was set up to, whatever FUSED_QUANTIZER is by then


def fp4_dot(x: jax.Array, w: jax.Array, *, route: str | Route, key: jax.Array | None = None,
            impl: str | None = None, out_dtype=None) -> jax.Array:
  """x @ w with each GEMM operand quantized per `route`; output in x's dtype (or `out_dtype`).

  Args:
    x: [..., K] activations (leading dims are flattened to M tokens).
    w: [K, N] weights.
    route: a `fp4jax.route.Route` or a preset name (`fp4jax.route.names()`).
    key: a JAX PRNG key (typed or raw); required if `route.needs_key` (SR, MS-EDEN, random Hadamard).
    impl: GEMM backend name (`fp4jax.kernels.BACKENDS`); None picks the fastest for the device.
    out_dtype: the result's dtype (default x.dtype), written straight from the float32 accumulator, e.g.
      float32 logits from bf16 inputs. Gradients keep x's and w's dtypes.
  Returns:
    [..., N] in out_dtype.
  """
  route = route_lib.get(route)
  if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
    raise ValueError(f"fp4_dot needs x [..., K] and w [K, N]: {x.shape=}, {w.shape=}")
  if impl is not None and impl not in kernels.BACKENDS:
    raise ValueError(f"unknown GEMM backend {impl=}; known: {list(kernels.BACKENDS)}")
  if key is not None:
    _check_key(key)
  elif route.needs_key:
    raise ValueError(f"route {route.name!r} draws random bits (SR, MS-EDEN or random Hadamard): pass key=")
  *lead, k = x.shape
  n = w.shape[1]
  m = math.prod(lead)
  _check_dims(route, m=m, k=k, n=n)
  if route.high_precision or 0 in (m, k, n):  # Empty operands: the product is zeros (or empty) in any route.
    if out_dtype is None:
      return jnp.dot(x, w).astype(x.dtype)
    return jnp.dot(x, w, preferred_element_type=out_dtype)
  if key is None:
    key = jax.random.key(0)  # Never read: keeps one signature for every route.
  plan = _Plan(route, impl, np.dtype(x.dtype), np.dtype(w.dtype), np.dtype(out_dtype or x.dtype),
               _quantizer_mode())
  x, w = _vary_alike(x, w, key)
  y = _dot2d(plan, x.reshape(m, k), w, key)  # [M, N]
  return y.reshape(*lead, n)


def _check_key(key) -> None:
  """A single key: typed (`jax.random.key`) of shape (), or raw (`jax.random.PRNGKey`) uint32 [n]."""
  dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
  typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
  if not (shape == () if typed else dtype == jnp.uint32 and len(shape) == 1):
    raise ValueError(f"fp4_dot needs key= one JAX PRNG key (jax.random.key, or a raw uint32 key from "
                     f"jax.random.PRNGKey; jax.vmap over a batch of keys), got {type(key).__name__} with "
                     f"{dtype=}, {shape=}")


def _vary_alike(x: jax.Array, w: jax.Array, key: jax.Array) -> tuple[jax.Array, jax.Array]:
  """x and w cast to vary over every shard_map axis that any of x, w, key varies over.

  Inside `shard_map` a custom_vjp must return cotangents of its primals' types: dW of a replicated w computed
  from a sharded x varies over the mesh axis, w does not. Casting w to varying first (as a plain dot does
  implicitly) makes the types agree, and the cast's transpose sums dW over that axis. No-op outside shard_map.
  """
  varying = lambda a: jax.typeof(a).manual_axis_type.varying
  axes = frozenset().union(*(varying(a) for a in (x, w, key)))
  return tuple(jax.lax.pcast(a, tuple(sorted(axes - varying(a), key=str)), to="varying") for a in (x, w))


def _check_dims(route: Route, *, m: int, k: int, n: int) -> None:
  """Each quantized operand needs its GEMM's contraction dim (and, for 2-D tiles, the other) divisible."""
  contraction = {"fprop": ("K", k), "dgrad": ("N", n), "wgrad": ("M", m)}
  # The non-contraction dim of each operand (2-D tiles span it too).
  tile_other = {"fprop_x": ("M", m), "fprop_w": ("N", n), "dgrad_dy": ("M", m), "dgrad_w": ("K", k),
                "wgrad_x": ("K", k), "wgrad_dy": ("N", n)}
  for gemm, (_, *roles) in route_lib.GEMMS.items():
    for role in roles:
      spec = route.spec(role)
      checks = [(*contraction[gemm], f"{gemm} contraction", reason, mult)
                for reason, mult in spec.blocks.items()]
      if spec.tile_2d:
        checks.append((*tile_other[role], "2-D tile", f"{spec.fmt} tile", FORMATS[spec.fmt].block))
      for dim, value, why, reason, mult in checks:
        if value % mult:
          raise ValueError(f"fp4_dot route {route.name!r}: {dim}={value} ({why}) must be a multiple of "
                           f"{mult} ({role}: {reason})")


def _prepare(v: jax.Array, spec: OperandSpec, axis: int, key: jax.Array, role: str, quantizer: str) -> Operand:
  """One GEMM operand (`role`, e.g. "fprop_x") from a 2-D array `v`, reduced along `axis`, K-major (`axis` last);
  `quantizer` a `_quantizer_mode()`."""
  if not spec.quantized:
    return jnp.moveaxis(v, axis, -1)
  views = _fused_views(v, spec, spec, key, (role, role), quantizer)  # one recipe on both views: keep ours
  if views is not None:
    return views[0] if axis == 1 else views[1]
  fused = _FUSED_OPERAND.get(spec.rounding)
  if fused is not None and quantizer != "xla":
    q = fused(v, spec, axis, key, role, quantizer == "interpret")
    if q is not None:
      return q
  if spec.transform is not None:
    v = hadamard(v.astype(jnp.float32), spec.transform, axis=axis, key=_transform_key(spec, key, role))
  return quantize(v, spec.fmt, axis=axis, rounding=spec.rounding, key=_rounding_key(spec, key, role),
                  scale_rule=spec.scale_rule, tile_2d=spec.tile_2d, clip_fraction=spec.clip_fraction)


def _prepare_views(v: jax.Array, row: OperandSpec, col: OperandSpec, key: jax.Array,
                   roles: tuple[str, str], quantizer: str) -> tuple[Operand, Operand]:
  """The two operands read from one 2-D array: `v` along axis 1 (`row`, K-major [R, C]) and along axis 0
  (`col`, K-major [C, R]), e.g. X for fprop and wgrad, dY for dgrad and wgrad, W for dgrad and fprop.

  Where a fused quantizer covers both recipes (each with its own rounding and key), one pass over `v` writes
  both; otherwise each is prepared on its own.
  """
  views = _fused_views(v, row, col, key, roles, quantizer)
  if views is not None:
    return views
  return _prepare(v, row, 1, key, roles[0], quantizer), _prepare(v, col, 0, key, roles[1], quantizer)


def _mx_views(v, row: OperandSpec, col: OperandSpec, keys: dict, interpret: bool):
  views = [quantize_fused.ViewSpec.make(s.rounding, s.scale_rule, s.clip_fraction, s.transform, s.tile_2d)
           for s in (row, col)]
  if not quantize_fused.supported_views(row.fmt, *views, shape=v.shape, dtype=v.dtype, tile_2d=row.tile_2d):
    return None
  return quantize_fused.quantize_views(v, *views, tile_2d=row.tile_2d, interpret=interpret, **keys)


def _nv_views(v, row: OperandSpec, col: OperandSpec, keys: dict, interpret: bool):
  if row.transform or not quantize_fused_nv.supported(
      row.fmt, row.rounding, col.rounding, shape=v.shape, dtype=v.dtype, tile_2d=row.tile_2d,
      col_transform=col.transform):
    return None
  return quantize_fused_nv.quantize_dual_nv(v, row.fmt, row_rounding=row.rounding, col_rounding=col.rounding,
                                            tile_2d=row.tile_2d, col_transform=col.transform,
                                            interpret=interpret, **keys)


# Fused dual-view quantizers by format: (v, row spec, col spec, keys, interpret) -> (row, col) or None; keys
# holds row_key, col_key (rounding) and transform_key (the column view's random Hadamard signs).
_FUSED_VIEWS = {"mxfp4": _mx_views, "nvfp4": _nv_views, "nvfp4_tile": _nv_views}


def _fused_views(v: jax.Array, row: OperandSpec, col: OperandSpec, key: jax.Array,
                 roles: tuple[str, str], quantizer: str) -> tuple[QTensor, QTensor] | None:
  """Both views of `v` from one fused-quantizer pass (bit for bit the reference's), or None if none covers
  them. A transform is covered only where the kernel applies it itself (on the column view)."""
  fused = _FUSED_VIEWS.get(row.fmt)
  if quantizer == "xla" or fused is None or row.fmt != col.fmt or row.tile_2d != col.tile_2d:
    return None
  row_key, col_key = (_rounding_key(s, key, role) for s, role in zip((row, col), roles))
  if roles[0] == roles[1]:
    col_key = row_key  # one recipe for both views: the same bits
  keys = dict(row_key=row_key, col_key=col_key, transform_key=_transform_key(col, key, roles[1]))
  return fused(v, row, col, keys, quantizer == "interpret")


def _eden_operand(v, spec: OperandSpec, axis: int, key, role: str, interpret: bool):
  if not quantize_eden.supported(spec.fmt, spec.rounding, shape=v.shape, dtype=v.dtype, axis=axis,
                                 transform=spec.transform, tile_2d=spec.tile_2d, scale_rule=spec.scale_rule,
                                 clip_fraction=spec.clip_fraction):
    return None
  return quantize_eden.quantize_eden(v, axis=axis, key=_rounding_key(spec, key, role), transform=spec.transform,
                                     transform_key=_transform_key(spec, key, role), interpret=interpret)


# Fused single-view quantizers by rounding, for recipes no dual-view kernel covers (MS-EDEN: one rotation, one
# group correction per view): (v, spec, axis, key, role, interpret) -> QTensor or None.
_FUSED_OPERAND = {"eden": _eden_operand}


def _gemm_of(role: str) -> str:
  return role.split("_")[0]  # "wgrad_dy" -> "wgrad"


def _transform_key(spec: OperandSpec, key: jax.Array, role: str) -> jax.Array | None:
  """The key of the operand's random Hadamard signs (shared by both operands of its GEMM), else None."""
  if spec.transform is None or not route_lib.TRANSFORMS[spec.transform].random_signs:
    return None
  return route_lib.transform_key(key, _gemm_of(role))


def _rounding_key(spec: OperandSpec, key: jax.Array, role: str) -> jax.Array | None:
  """The key of the operand's random rounding (SR, MS-EDEN), None for round-to-nearest."""
  return route_lib.operand_key(key, role) if spec.rounding != "rne" else None


# Where the fused Pallas quantizers replace `reference.quantize` (same bits): "gpu" (on a GPU backend, the
# default), "interpret" (everywhere, in Pallas interpret mode: tests), or "xla" (XLA's reference quantizers).
FUSED_QUANTIZER = "gpu"
FUSED_QUANTIZER_MODES = ("gpu", "interpret", "xla")


@contextlib.contextmanager
def fused_quantizer(mode: str):
  """`FUSED_QUANTIZER` set to `mode` while inside. fp4_dot reads it when it traces, so trace inside, and not
  a jitted function already traced in another mode: jit reuses its trace for the same function object."""
  global FUSED_QUANTIZER
  if mode not in FUSED_QUANTIZER_MODES:
    raise ValueError(f"fused quantizer mode {mode!r}: expected one of {FUSED_QUANTIZER_MODES}")
  saved, FUSED_QUANTIZER = FUSED_QUANTIZER, mode
  try:
    yield
  finally:
    FUSED_QUANTIZER = saved


def _quantizer_mode() -> str:
  """How this call quantizes: "kernel" (the fused kernels, compiled), "interpret" or "xla" (reference only)."""
  if FUSED_QUANTIZER == "gpu":
    return "kernel" if jax.default_backend() == "gpu" else "xla"
  return FUSED_QUANTIZER


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


def _gemm(a: Operand, b: Operand, out_dtype, impl: str | None) -> jax.Array:
  """a [R, C] (K-major) times b [S, C]^T -> [R, S]: an FP4 backend GEMM, or a plain dot otherwise."""
  if isinstance(a, QTensor) and isinstance(b, QTensor):
    return kernels.gemm(a, b, out_dtype=out_dtype, impl=impl)
  dims = (((1,), (1,)), ((), ()))
  if not isinstance(a, QTensor) and not isinstance(b, QTensor):
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32).astype(out_dtype)
  # One quantized, one high-precision operand: exact float32 product of the dequantized values.
  av, bv = (gemm_emulated.kmajor_f32(o) if isinstance(o, QTensor) else o.astype(jnp.float32) for o in (a, b))
  return jax.lax.dot_general(av, bv, dims, precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dot2d(plan: _Plan, x, w, key):
  r = plan.route
  xa = _prepare(x, r.fprop_x, 1, key, "fprop_x", plan.quantizer)  # [M, K]
  wb = _prepare(w, r.fprop_w, 0, key, "fprop_w", plan.quantizer)  # K-major [N, K]
  return _gemm(xa, wb, plan.out_dtype, plan.impl)


def _dot2d_fwd(plan: _Plan, x, w, key):
  r = plan.route
  if r.requantize_saved:  # Quartet II: the backward's X and W come from the fprop FP4 values
    xa = _prepare(x, r.fprop_x, 1, key, "fprop_x", plan.quantizer)  # [M, K]
    wb = _prepare(w, r.fprop_w, 0, key, "fprop_w", plan.quantizer)  # K-major [N, K]
    x_wgrad = _prepare(dequantize(xa), r.wgrad_x, 0, key, "wgrad_x", plan.quantizer)  # K-major [K, M]
    w_dgrad = _prepare(dequantize(wb), r.dgrad_w, 1, key, "dgrad_w", plan.quantizer)  # K-major [K, N]
  else:
    xa, x_wgrad = _prepare_views(x, r.fprop_x, r.wgrad_x, key, ("fprop_x", "wgrad_x"), plan.quantizer)
    if _reuses_fprop_w(r):
      wb = _prepare(w, r.fprop_w, 0, key, "fprop_w", plan.quantizer)
      w_dgrad = other_orientation(wb)
    else:
      w_dgrad, wb = _prepare_views(w, r.dgrad_w, r.fprop_w, key, ("dgrad_w", "fprop_w"), plan.quantizer)
  return _gemm(xa, wb, plan.out_dtype, plan.impl), (x_wgrad, w_dgrad, key)


def _dot2d_bwd(plan: _Plan, res, g):
  x_wgrad, w_dgrad, key = res
  r = plan.route
  dy_d, dy_w = _prepare_views(g, r.dgrad_dy, r.wgrad_dy, key, ("dgrad_dy", "wgrad_dy"),
                              plan.quantizer)  # [M, N], [N, M]
  dx = _gemm(dy_d, w_dgrad, plan.x_dtype, plan.impl)  # [M, K]
  dw = _gemm(x_wgrad, dy_w, plan.w_dtype, plan.impl)  # [K, N]
  return dx, dw, None


_dot2d.defvjp(_dot2d_fwd, _dot2d_bwd)
