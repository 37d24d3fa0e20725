"""Quantizing an array whose rows are split over a device mesh: each device runs the kernel on its own rows.

A Pallas kernel is an opaque custom call to XLA's SPMD partitioner, which therefore gathers its whole input on
every device and runs it there: under data parallelism every GPU would quantize, and then multiply, every
token of the batch (a 2-GPU fp4_dot compiled for H200s held an all-gather of x and GEMMs over all its rows).
`on_row_shards` runs the launch inside `jax.shard_map` instead, on each device's block of rows, and gives the
bits of the whole array. The formats of `FORMATS` keep no state across blocks of 32 rows but a per-tensor
amax: MXFP4's E8M0 block scales, NVFP4's 1x16 blocks and 16x16 tiles, and their column-view and Hadamard
blocks (16 or 32 rows), which a block of rows holds whole when its row count is a multiple of 32; NVFP4's
tensor amax (of x, or of its rotated column view) is taken over every device (`amax_over`, a `pmax`). The SR
draws, keyed by the element's flat index in the whole array, are offset by the block's first index (the
kernels' `counter_offset`). Other recipes (tile-local NVFP4, MS-EDEN) keep the gathered whole-array launch:
the same numbers, without the speed.

The split comes from the mesh in context (`jax.set_mesh`): the named axes that are neither manual (inside a
shard_map over them already) nor of size 1. Outside a mesh, or where the rows do not split into whole blocks
on every device, the launch runs on the whole array as before.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fp4jax.numerics.qtensor import Quantized, ScaledValues
from fp4jax.numerics.spec import OperandSpec

# Formats whose kernels take a counter offset (and an amax over devices) and keep no state across 32-row blocks.
FORMATS = ("mxfp4", "nvfp4", "nvfp4_46")
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


def _row_dim(view: Quantized) -> int:
  """The dim of a view's arrays that runs along x's rows: K-major codes and scales hold them first when the view
  is along K (axis 1), last when along M; bf16 values in x's layout first, transposed last."""
  if isinstance(view, ScaledValues):
    return 1 if view.transposed else 0
  return 0 if view.axis == 1 else 1


def _specs(view: Quantized, axes: tuple[str, ...]) -> list[P]:
  """The partition spec of each array of `view` (its pytree leaves): split along x's rows, a scalar outer factor
  (the same on every device: the amax is taken over all of them) replicated."""
  rows = _row_dim(view)
  return [P() if a.ndim == 0 else P(*(axes if d == rows else None for d in range(a.ndim)))
          for a in jax.tree.leaves(view)]


def on_row_shards(launch: Callable[[jax.Array, jax.Array, tuple[str, ...]], Sequence[Quantized]], x: jax.Array,
                  axes: tuple[str, ...]) -> tuple[Quantized, ...]:
  """launch(x's rows on this device, their first element's flat index in x as uint32, the axes to take a
  tensor amax over) on every device of `axes` (`split`); its views (QTensor or ScaledValues, each with at most
  a scalar outer factor) are reassembled into those of the whole x [R, C]."""
  rows, cols = x.shape
  n = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in axes)
  per_device = (rows // n) * cols % 2**32  # counters wrap at 2^32, and so does their offset
  # The views' structure, from an abstract launch without collectives: what the shard_map's outputs will be.
  local_views = jax.eval_shape(lambda v: tuple(launch(v, jnp.uint32(0), ())),
                               jax.ShapeDtypeStruct((rows // n, cols), x.dtype))
  for q in local_views:
    if q.outer is not None and q.outer.ndim:
      raise AssertionError(f"row shards: a per-row outer factor cannot be split: {q.fmt}")
  leaves, treedef = jax.tree.flatten(local_views)

  def local(x_rows):
    offset = jax.lax.axis_index(axes).astype(jnp.uint32) * jnp.uint32(per_device)
    return jax.tree.leaves(tuple(launch(x_rows, offset, axes)))

  out_specs = [spec for q in local_views for spec in _specs(q, axes)]
  # check_vma off: Pallas states its outputs without the varying axes that checking asks of them.
  parts = jax.shard_map(local, in_specs=P(axes, None), out_specs=out_specs, axis_names=set(axes),
                        check_vma=False)(x)
  assert len(parts) == len(leaves)
  return tuple(dataclasses.replace(q, shape=(rows, cols)) for q in jax.tree.unflatten(treedef, parts))
