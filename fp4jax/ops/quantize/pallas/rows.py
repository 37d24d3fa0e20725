"""Quantizing an array whose rows are split over a device mesh: each device runs the kernel on its own rows.

A Pallas kernel is an opaque custom call to XLA's SPMD partitioner, which therefore gathers its whole input on
every device and runs it there: under data parallelism every GPU would quantize, and then multiply, every
token of the batch (a 2-GPU fp4_dot compiled for H200s held an all-gather of x and GEMMs over all its rows).
`on_row_shards` runs the launch inside `jax.shard_map` instead, on each device's block of rows, and gives the
bits of the whole array: the formats of `FORMATS` keep no state across blocks of rows (MXFP4: per-block E8M0
scales, and column-view blocks and Hadamard blocks of 32 rows that a block of rows holds whole when its row
count is a multiple of 32), and the SR draws, keyed by the element's flat index in the whole array, are
offset by the block's first index (the kernels' `counter_offset`). Formats with a per-tensor scale (NVFP4's
global amax) or other recipes keep the gathered whole-array launch: the same numbers, without the speed.

The split comes from the mesh in context (`jax.set_mesh`): the named axes that are neither manual (inside a
shard_map over them already) nor of size 1. Outside a mesh, or where the rows do not split into whole blocks
on every device, the launch runs on the whole array as before.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fp4jax.numerics.qtensor import QTensor
from fp4jax.numerics.spec import OperandSpec

FORMATS = ("mxfp4",)  # formats whose kernels take a counter offset and keep no state across 32-row blocks
ROW_BLOCK = 32  # every device's rows: a whole number of column-view blocks, 2-D tiles and Hadamard blocks


def split(rows: int, specs: Sequence[OperandSpec], axes: Sequence[str]) -> tuple[str, ...]:
  """The mesh axes (of `axes`, in context) over which an array of `rows` rows is quantized block by block,
  each device its own rows; () where it is quantized whole (module docstring)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not axes or any(s.fmt not in FORMATS for s in specs):
    return ()
  names = tuple(a for a in axes if a in mesh.axis_names and a not in mesh.manual_axes and mesh.shape[a] > 1)
  n = math.prod(mesh.shape[a] for a in names)
  if n == 1 or rows % (n * ROW_BLOCK):
    return ()
  return names


def _view_specs(axis: int, axes: tuple[str, ...]) -> tuple[P, P]:
  """The partition specs of a view's K-major codes and scales: [rows, ...] along K, [..., rows] along M."""
  spec = P(axes, None) if axis == 1 else P(None, axes)
  return spec, spec


def on_row_shards(launch: Callable[[jax.Array, jax.Array], Sequence[QTensor]], x: jax.Array,
                  axes: tuple[str, ...], view_axes: Sequence[int]) -> tuple[QTensor, ...]:
  """launch(x's rows on this device, their first element's flat index in x as uint32) on every device of
  `axes` (`split`), whose QTensors (one per entry of `view_axes`, the axis each is quantized along) are
  reassembled into those of the whole x [R, C]."""
  rows, cols = x.shape
  n = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in axes)
  per_device = (rows // n) * cols % 2**32  # counters wrap at 2^32, and so does their offset

  formats = []  # each view's format, as the launch traced it

  def local(x_rows):
    offset = jax.lax.axis_index(axes).astype(jnp.uint32) * jnp.uint32(per_device)
    views = launch(x_rows, offset)
    if [q.axis for q in views] != list(view_axes) or any(q.outer is not None for q in views):
      raise AssertionError(f"row shards: expected QTensors along axes {view_axes} without an outer factor")
    formats[:] = [q.fmt for q in views]
    return tuple((q.codes, q.scales) for q in views)

  out_specs = tuple(_view_specs(a, axes) for a in view_axes)
  # check_vma off: Pallas states its outputs without the varying axes that checking asks of them.
  parts = jax.shard_map(local, in_specs=P(axes, None), out_specs=out_specs, axis_names=set(axes),
                        check_vma=False)(x)
  return tuple(QTensor(codes, scales, None, fmt=fmt, axis=a, shape=(rows, cols))
               for (codes, scales), a, fmt in zip(parts, view_axes, formats))
