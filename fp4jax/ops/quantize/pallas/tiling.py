"""Tile configuration of the fused quantization kernels: one frozen config and the heuristic that picks it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class QuantTile:
  """Tile of x that one program of a fused quantizer reads once and quantizes along both axes.

  Attributes:
    block_m: rows per tile; a multiple of the format block (the column view's blocks run along M).
    block_k: columns per tile; a multiple of the format block (the row view's blocks run along K).
    num_warps: warps per program.
    num_stages: software-pipelining depth handed to the compiler.
  """

  block_m: int = 64
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 1

  def check(self, m: int, k: int, block: int) -> None:
    """Raises a ValueError naming the values when `x[m, k]` does not tile evenly (no ragged edges)."""
    for name, b in (("block_m", self.block_m), ("block_k", self.block_k)):
      if b % block or b & (b - 1):
        raise ValueError(f"{name}={b} must be a power of two and a multiple of the format block {block}")
    if m % self.block_m or k % self.block_k:
      raise ValueError(f"x shape ({m=}, {k=}) must be a multiple of the tile "
                       f"(block_m={self.block_m}, block_k={self.block_k})")


# Tiles tried in order by `default_tile`, per rounding: the fastest first, as timed on the H200 by
# `python -m bench quantize` (the tile sweep in docs/BENCHMARKS.md).
_SMALL = (QuantTile(32, 64, num_warps=4), QuantTile(32, 32, num_warps=4))
_CANDIDATES = {
    "rne": (QuantTile(64, 64, num_warps=4), QuantTile(32, 128, num_warps=4)) + _SMALL,
    "sr": (QuantTile(32, 128, num_warps=4), QuantTile(64, 64, num_warps=4)) + _SMALL,
    # Column view with a Hadamard transform (mxfp4_h32's X and dY): 64 x 64 since the butterfly separates its
    # rows by Triton's split (docs/BENCHMARKS.md, 2026-12-04, 15:40; 64 x 128 before).
    "transform": (QuantTile(64, 64, num_warps=4), QuantTile(32, 128, num_warps=4)) + _SMALL,
    # NVFP4, SR with a Hadamard column view (the nvfp4 route's dY): 32 x 64 since the same change (128 x 64 /
    # 8 warps before, 8-9% slower now).
    "sr transform": (QuantTile(32, 64, num_warps=4), QuantTile(128, 64, num_warps=8)) + _SMALL,
}


def default_tile(m: int, k: int, block: int = 32, rounding: str = "rne") -> QuantTile:
  """The fastest measured tile for `rounding` (a key of `_CANDIDATES`) that divides `x[m, k]` evenly, else a
  ValueError naming the shape."""
  for tile in _CANDIDATES[rounding]:
    if m % tile.block_m == 0 and k % tile.block_k == 0 and tile.block_m % block == 0 \
        and tile.block_k % block == 0:
      return tile
  raise ValueError(f"x shape ({m=}, {k=}) has no tile for format block {block}: both dimensions must be "
                   f"multiples of {max(32, block)}")
