"""The fused Pallas quantizers behind one dispatch: which kernel serves an operand spec, by table.

`views` (both views of a 2-D array from one pass) looks the kernel up by format in `VIEW_KERNELS`; `operand`
(one view) launches that kernel for the one view (`write`: it skips the other's work and stores), else a
single-view kernel by rounding (`OPERAND_KERNELS`). Every kernel raises NotImplementedError for a case it does not cover, so
`ops.quantize.api` can fall back to the XLA reference. One file per kernel family (`mxfp4`, `nvfp4`, `eden`,
the amax pre-passes in `amax`, the FP8 re-encoding in `fp8`), their shared helpers in `common`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from fp4jax.numerics.qtensor import QTensor
from fp4jax.numerics.spec import OperandKeys, OperandSpec
from fp4jax.ops.quantize.pallas import common, eden, mxfp4, nvfp4

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


def views(x: jax.Array, row: OperandSpec, col: OperandSpec, row_keys: OperandKeys, col_keys: OperandKeys, *,
          interpret: bool) -> tuple[QTensor, QTensor]:
  """(row view along axis 1, column view along axis 0) of a 2-D x from one dual-view kernel."""
  kernel = VIEW_KERNELS.get(row.fmt)
  if kernel is None:
    raise NotImplementedError(f"no dual-view kernel for fmt={row.fmt!r}")
  return kernel(x, row, col, row_keys, col_keys, interpret=interpret)


def operand(x: jax.Array, spec: OperandSpec, axis: int, keys: OperandKeys, *, interpret: bool) -> QTensor:
  """One view of a 2-D x along `axis` (0 or 1): a dual-view kernel launched for that view alone (it neither
  computes nor stores the other), else a single-view kernel's.

  The unwritten view is given the same recipe without its transform (the dual-view kernels rotate column
  views only), so a Hadamard column view of one operand is covered as in a pair."""
  kernel = VIEW_KERNELS.get(spec.fmt)
  if kernel is not None:
    along_k = axis % 2 == 1
    other = dataclasses.replace(spec, transform=None)
    row, col = (spec, other) if along_k else (other, spec)
    try:
      row_q, col_q = kernel(x, row, col, keys, keys, interpret=interpret,
                            write=common.ROW if along_k else common.COLUMN)
      return row_q if along_k else col_q
    except NotImplementedError:
      pass
  kernel = OPERAND_KERNELS.get(spec.rounding)
  if kernel is None:
    raise NotImplementedError(f"no Pallas kernel for {spec} along {axis=}")
  return kernel(x, spec, axis, keys, interpret=interpret)
