"""The fused Pallas quantizers behind one dispatch: which kernel serves an operand spec, by table.

`views` (both views of a 2-D array from one pass) looks the kernel up by format in `VIEW_KERNELS`; `operand`
(one view) launches that kernel for the one view (`write`: it skips the other's work and stores), else a
single-view kernel by rounding (`OPERAND_KERNELS`). Every kernel raises NotImplementedError for a case it does
not cover, so `ops.quantize.api` can fall back to the XLA reference. One file per kernel family (`mxfp4`,
`nvfp4`, `eden`, the amax pre-passes in `amax`, the FP8 re-encoding in `fp8`), their shared helpers in `common`.
Given `rows_over` (mesh axes splitting x's rows: fp4_dot's tokens), both run each launch on every device's own
rows inside a shard_map, with the whole array's bits (`rows`; `_on_rows`, `_eden_on_rows`).

One view, one Triton IR. A Pallas kernel's Triton IR holds its operand's extents and strides as constants, so
every operand shape used to be its own IR (quartet2's 30M step: six 4/6 kernels, eleven MS-EDEN quantizers,
twelve rotated-amax passes). A one-view launch along K of a format without per-row state (`_FLAT_ROWS`, MS-EDEN
included) therefore reads x [M, K] as the same bytes shaped [M * K / CANONICAL_K, CANONICAL_K]: its blocks and
MS-EDEN's 128-element groups (and their Hadamard blocks) never straddle a row of either shape (K and
CANONICAL_K are multiples of them), the per-tensor scale is the same, and the kernels key their random draws by
the flat index of the element (SR) or of the block in the K-major scales (MS-EDEN's scale SR), which the
reshape keeps; so every such launch of one recipe and dtype has one IR whatever the operand's shape (one per
call site: JAX writes the caller's frames into the IR's locations), where the
shape allows the layout (M a multiple of 32, K of 32 or of MS-EDEN's 128, M * K of 128 x 64 rows; other shapes,
tile-local NVFP4 and 2-D tiles launch on x as it is). XLA still compiles one kernel per launch configuration
(IR and grid, its kernel cache key), on parallel threads: one IR per recipe did not by itself shorten a step's
compile (docs/BENCHMARKS.md, H200 session of 2026-12-03, 06:55).

A one-view launch along M with a deterministic recipe and no transform quantizes x^T along K instead: the same
blocks and scales in the same K-major layout, so the same bits (an SR draw is keyed by x's flat index, which the
transpose changes, so SR column views keep the column kernel). So does every MS-EDEN column view: its one draw
per block is keyed by the block's K-major scale index, and its random signs by the position along the quantized
axis, which x^T keeps. XLA's transpose is one cheap pass (for a weight it fuses into the cast to bf16): on the
H200 the 4/6 column view of a bf16 operand ran faster as x^T than its column kernel, which turns its bytes in
registers, and so does the MS-EDEN column view, whose kernel keeps its outputs unturned (1.4x, docs/BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from fp4jax import platform
from fp4jax.numerics.produced import Produced
from fp4jax.numerics.qtensor import QTensor, Quantized
from fp4jax.numerics.spec import ROUNDINGS, OperandKeys, OperandSpec
from fp4jax.ops.quantize.pallas import common, eden, mxfp4, nvfp4, rows

platform.alias_triton_dialect_module()  # a third of a step's Pallas lowering time otherwise (its docstring)

# Dual-view kernels by format.
VIEW_KERNELS: dict[str, Callable[..., tuple[QTensor, QTensor]]] = {
    "mxfp4": mxfp4.views,
    "nvfp4": nvfp4.views,
    "nvfp4_46": nvfp4.views,
    "nvfp4_tile": nvfp4.views,
}
# Single-view kernels by rounding, for recipes no dual-view kernel covers (MS-EDEN: one rotation and one group
# correction per view).
OPERAND_KERNELS: dict[str, Callable[..., QTensor]] = {"eden": eden.operand}


# Dual-view kernels that can write a view as bf16 `ScaledValues` (their `forms=`); the others write codes, which
# `ops.quantize.api` decodes where values were asked for.
WRITES_VALUES = (nvfp4.views,)


def views(x: jax.Array, row: OperandSpec, col: OperandSpec, row_keys: OperandKeys, col_keys: OperandKeys, *,
          interpret: bool, forms: tuple[str, str] = ("codes", "codes"),
          rows_over: tuple[str, ...] = ()) -> tuple[Quantized, Quantized]:
  """(row view along axis 1, column view along axis 0) of a 2-D x from one dual-view kernel; `forms` is
  handed to a kernel of `WRITES_VALUES`. rows_over: mesh axes whose devices each quantize their own block of
  x's rows, with the whole array's bits (`rows`; where the recipe allows). x may be a `Produced` (the MXFP4
  kernel computes it, `sources`), except where its rows are split."""
  kernel = VIEW_KERNELS.get(row.fmt)
  if kernel is None:
    raise NotImplementedError(f"no dual-view kernel for fmt={row.fmt!r}")
  extra = {"forms": forms} if kernel in WRITES_VALUES else {}
  if x.ndim == 2 and (axes := rows.split(x.shape[0], (row, col), rows_over)):
    if isinstance(x, Produced):
      raise NotImplementedError(f"{x.kind!r} of inputs whose rows are split over {axes}")
    return rows.on_row_shards(lambda v, where: kernel(v, row, col, row_keys, col_keys, interpret=interpret,
                                                      **extra, **_on_rows(kernel, v, where)), x, axes)
  return kernel(x, row, col, row_keys, col_keys, interpret=interpret, **extra)


def _on_rows(kernel: Callable, v: jax.Array, where: rows.Rows) -> dict:
  """A dual-view kernel's keywords for a launch on the block `v` of x's rows: its SR counters' offset (the
  flat index of v's first element in x), and for a kernel with a tensor amax the mesh axes to take it over."""
  return {"counter_offset": where.element_offset(v.shape[1]),
          **({"amax_over": where.over} if kernel is nvfp4.views else {})}


def operand(x: jax.Array, spec: OperandSpec, axis: int, keys: OperandKeys, *, interpret: bool,
            rows_over: tuple[str, ...] = ()) -> QTensor:
  """One view of a 2-D x along `axis` (0 or 1): a dual-view kernel launched for that view alone (it neither
  computes nor stores the other; along K on the canonical layout, along M as x^T along K where the bits allow:
  module docstring), else a single-view kernel's. rows_over: as for `views`. An x given as a `Produced` is
  refused (NotImplementedError): the API quantizes its value."""
  if isinstance(x, Produced):
    raise NotImplementedError(f"one view of {x.kind!r} of its inputs")
  kernel = VIEW_KERNELS.get(spec.fmt)
  if kernel is not None and x.ndim == 2:
    try:
      if axes := rows.split(x.shape[0], (spec,), rows_over):
        launch = lambda v, where: (_one_view(kernel, v, spec, axis % 2, keys, interpret, _on_rows(kernel, v, where)),)
        return rows.on_row_shards(launch, x, axes)[0]
      return _one_view(kernel, x, spec, axis % 2, keys, interpret)
    except NotImplementedError:
      pass
  kernel = OPERAND_KERNELS.get(spec.rounding)
  if kernel is None:
    raise NotImplementedError(f"no Pallas kernel for {spec} along {axis=}")
  if x.ndim != 2:
    return kernel(x, spec, axis, keys, interpret=interpret)
  if axes := rows.split(x.shape[0], (spec,), rows_over, along_rows=axis % 2 == 0):
    launch = lambda v, where: (_eden_on_rows(kernel, v, spec, axis % 2, keys, interpret, where),)
    return rows.on_row_shards(launch, x, axes)[0]
  return _view(lambda v: kernel(v, spec, 1, keys, interpret=interpret),
               lambda v: kernel(v, spec, 0, keys, interpret=interpret), x, spec, axis % 2)


# Width of the layout a one-view launch along K reads x in (module docstring): a multiple of every block (16,
# 32), of MS-EDEN's group (128) and of the kernels' tile widths (64, 128).
CANONICAL_K = 128
# Formats whose row view keeps no state per row (the tile-local NVFP4 outer runs over rows), in 1-D blocks.
_FLAT_ROWS = ("mxfp4", "nvfp4", "nvfp4_46")
_ROWS_PER_TILE = 64  # the tallest tile of `tiling`: the canonical row count must be a multiple of it


def _one_view(kernel: Callable, x: jax.Array, spec: OperandSpec, axis: int, keys: OperandKeys,
              interpret: bool, extra: dict | None = None) -> QTensor:
  """One view from a dual-view kernel (the unwritten view takes the recipe without its transform: the kernels
  rotate column views only); `extra`: the kernel's keywords for a block of rows (`_on_rows`)."""
  plain = dataclasses.replace(spec, transform=None)
  extra = extra or {}
  return _view(lambda v: kernel(v, spec, plain, keys, keys, interpret=interpret, write=common.ROW, **extra)[0],
               lambda v: kernel(v, plain, spec, keys, keys, interpret=interpret, write=common.COLUMN, **extra)[1],
               x, spec, axis)


def _view(row_view: Callable[[jax.Array], QTensor], column_view: Callable[[jax.Array], QTensor], x: jax.Array,
          spec: OperandSpec, axis: int) -> QTensor:
  """The view of x [M, K] along `axis` (0 or 1) from a kernel's row and column launches: along K on the
  canonical layout, along M as the row view of x^T where that gives the same bits (module docstring: a
  deterministic recipe without transform, or MS-EDEN, whose draws are keyed by the K-major scale index and
  whose signs by the position along the quantized axis), else the column launch on x."""
  if axis == 1:
    return _along_k(row_view, x, spec)
  if spec.rounding == "eden" or (spec.transform is None and not ROUNDINGS[spec.rounding].random):
    return _transposed(_along_k(row_view, x.T, spec), x.shape)
  return column_view(x)


def _eden_on_rows(kernel: Callable, v: jax.Array, spec: OperandSpec, axis: int, keys: OperandKeys,
                  interpret: bool, where: rows.Rows) -> QTensor:
  """MS-EDEN's view of the block `v` [r, C] of x's rows along `axis`, as `_view` launches it on x, with the
  whole x's bits: its scale draws are keyed by the block's index in x's K-major scales, and its amax is x's.
  Along K (on the canonical layout) those indices run on from the rows before; along M, as v^T's row view,
  each row of v^T's scales lies in a row of x^T's, `total / 16` apart (v^T stays unreshaped for that)."""
  if axis == 1:
    offset = where.first * jnp.uint32(v.shape[1] // 16)  # the scales of the rows before: 16 elements per scale
    return _along_k(lambda u: kernel(u, spec, 1, keys, interpret=interpret, counter_offset=offset,
                                     amax_over=where.over), v, spec)
  q = kernel(v.T, spec, 1, keys, interpret=interpret, counter_offset=where.first // jnp.uint32(16),
             scales_per_row=where.total // 16, amax_over=where.over)
  return _transposed(q, v.shape)


def _transposed(q: QTensor, shape: tuple[int, int]) -> QTensor:
  """The row view q of x^T as the column view of x [M, K] (the same K-major codes and scales)."""
  return QTensor(q.codes, q.scales, q.outer, fmt=q.fmt, axis=0, shape=shape)


def _along_k(launch: Callable[[jax.Array], QTensor], x: jax.Array, spec: OperandSpec) -> QTensor:
  """launch(v), the row view of v, for x [M, K]: on the canonical [M * K / CANONICAL_K, CANONICAL_K] layout
  where the format allows (module docstring: no state per row, blocks and rounding groups that divide K),
  else on x as it is."""
  m, k = x.shape
  unit = max(32, ROUNDINGS[spec.rounding].group)  # kernels' blocks, MS-EDEN's groups: never straddle a row
  flat = (spec.fmt in _FLAT_ROWS and not spec.tile_2d and k % unit == 0 and m % 32 == 0
          and (m * k) % (CANONICAL_K * _ROWS_PER_TILE) == 0)
  if not flat:
    return launch(x)
  q = launch(x.reshape(m * k // CANONICAL_K, CANONICAL_K))
  return QTensor(q.codes.reshape(m, -1), q.scales.reshape(m, -1), q.outer, fmt=q.fmt, axis=1, shape=(m, k))
