"""Quantizing an array whose rows are split over a device mesh: each device runs the kernel on its own rows.

A Pallas kernel is an opaque custom call to XLA's SPMD partitioner, which therefore gathers its whole input on
every device and runs it there: under data parallelism every GPU would quantize, and then multiply, every token of
the batch (a 2-GPU fp4_dot compiled for H200s held an all-gather of x and GEMMs over all its rows).
`on_row_shards` runs the launch inside `jax.shard_map` instead, on each device's block of rows, and gives the bits
of the whole array. The formats of `FORMATS` keep no state across blocks of 32 rows but a per-tensor amax: MXFP4's
E8M0 block scales, NVFP4's 1x16 blocks and 16x16 tiles, and their column-view and Hadamard blocks (16 or 32 rows),
which a block of rows holds whole when its row count is a multiple of 32; NVFP4's tensor amax (of x, or of its
rotated column view) is taken over every device (`amax_over`, a `pmax`). The SR draws, keyed by the element's flat
index in the whole array, are offset by the block's first index (the kernels' `counter_offset`). MS-EDEN
(quartet2's backward) splits too, its column views in blocks of 128 rows (its groups and RHT128 blocks along M):
its amax is taken over the devices, and its scale draws, keyed by the block's index in the whole array's K-major
scales, get that array's offset and row stride. Tile-local NVFP4 (a per-row outer factor) keeps the gathered
whole-array launch: the same numbers, without the speed.

The split comes from the mesh in context (`jax.set_mesh`): the named axes that are neither manual (inside a
shard_map over them already) nor of size 1. Outside a mesh, or where the rows do not split into whole blocks
on every device, the launch runs on the whole array as before.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fp4jax.numerics.qtensor import Quantized, ScaledValues
from fp4jax.numerics.spec import OperandSpec

# Formats whose kernels take a counter offset (and an amax over devices) and keep no state across blocks of rows.
FORMATS = ("mxfp4", "nvfp4", "nvfp4_46")
ROW_BLOCK = 32  # every device's rows: a whole number of column-view blocks, 2-D tiles and Hadamard blocks
GROUP_ROWS = 128  # ... and of MS-EDEN's groups (and RHT128 blocks) along them


def split(rows: int, specs: Sequence[OperandSpec], axes: Sequence[str], *, along_rows: bool = True
          ) -> tuple[str, ...]:
  """The mesh axes (of `axes`, in context) over which an array of `rows` rows is quantized block by block,
  each device its own rows; () where it is quantized whole (module docstring). `along_rows`: a view is
  quantized along the rows (a column view), so MS-EDEN's groups run along them."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not axes or any(s.fmt not in FORMATS for s in specs):
    return ()
  names = tuple(a for a in axes if a in mesh.axis_names and a not in mesh.manual_axes and mesh.shape[a] > 1)
  n = math.prod(mesh.shape[a] for a in names)
  block = GROUP_ROWS if along_rows and any(s.rounding == "eden" for s in specs) else ROW_BLOCK
  if n == 1 or rows % (n * block):
    return ()
  return names


class Rows(NamedTuple):
  """Where a launch's rows lie in the whole x: `first` (uint32, traced: the device's first row), `total` (x's
  row count) and `over` (the mesh axes to take a tensor amax over)."""

  first: jax.Array
  total: int
  over: tuple[str, ...]

  def element_offset(self, cols: int) -> jax.Array:
    """The flat index in x of the rows' first element (uint32: counters wrap at 2^32, and so does this)."""
    return self.first * jnp.uint32(cols % 2**32)


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


def on_row_shards(launch: Callable[[jax.Array, Rows], Sequence[Quantized]], x: jax.Array,
                  axes: tuple[str, ...]) -> tuple[Quantized, ...]:
  """launch(x's rows on this device, `Rows`: where they lie in x) on every device of `axes` (`split`); its
  views (QTensor or ScaledValues, each with at most a scalar outer factor) are reassembled into those of the
  whole x [R, C]."""
  rows, cols = x.shape
  n = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in axes)
  # The views' structure, from an abstract launch without collectives: what the shard_map's outputs will be.
  local_views = jax.eval_shape(lambda v: tuple(launch(v, Rows(jnp.uint32(0), rows, ()))),
                               jax.ShapeDtypeStruct((rows // n, cols), x.dtype))
  for q in local_views:
    if q.outer is not None and q.outer.ndim:
      raise AssertionError(f"row shards: a per-row outer factor cannot be split: {q.fmt}")
  leaves, treedef = jax.tree.flatten(local_views)

  def local(x_rows):
    first = jax.lax.axis_index(axes).astype(jnp.uint32) * jnp.uint32(rows // n)
    return jax.tree.leaves(tuple(launch(x_rows, Rows(first, rows, axes))))

  out_specs = [spec for q in local_views for spec in _specs(q, axes)]
  # check_vma off: in interpret mode the kernels decline under the check (`common.pallas_call`), and the
  # launch here must run the kernel itself.
  parts = jax.shard_map(local, in_specs=P(axes, None), out_specs=out_specs, axis_names=set(axes),
                        check_vma=False)(x)
  assert len(parts) == len(leaves)
  return tuple(dataclasses.replace(q, shape=(rows, cols)) for q in jax.tree.unflatten(treedef, parts))
