"""Inputs and comparisons shared by the quantizer tests: random and adversarial arrays, bitwise QTensor checks."""

from __future__ import annotations

import re

import numpy as np
from seeded import fresh_rng


def rng_for(*parts) -> np.random.Generator:
  """Fresh inputs for the test case named by `parts`: a new seed each run, printed for a failure to replay
  (`seeded.fresh_rng`), so every run checks the kernels on inputs no earlier run saw."""
  return fresh_rng("/".join(map(str, parts)))


def normal(rng, shape):
  return rng.standard_normal(shape).astype(np.float32)


def heavy(rng, shape):
  """Student-t (2 degrees of freedom) with rare 1e4 outliers and per-column scales over 2^[-20, 0]: blocks far
  below the tensor amax, E4M3 scales across their whole range (subnormal ones included)."""
  x = rng.standard_t(2, shape).astype(np.float32)
  x[rng.random(shape) < 0.01] *= 1e4
  return x * np.exp2(rng.integers(-20, 1, (1, shape[1]))).astype(np.float32)


def row_spread(rng, shape):
  """Rows over 2^[-40, 40]: block exponents far apart in one tensor."""
  return normal(rng, shape) * np.exp2(rng.integers(-40, 40, (shape[0], 1))).astype(np.float32)


def special(rng, shape):
  """Zero and signed-zero blocks, 1e-30 and 1e30 regions, exact-grid values and E2M1 ties (scaled and not),
  3e38 entries, scales across E4M3's range: every 32x32 corner of a [>= 64, >= 128] array (smaller arrays get
  the heavy-tailed input)."""
  if shape[0] < 64 or shape[1] < 128:
    return heavy(rng, shape)
  x = normal(rng, shape)
  x[0:32, 0:32] = 0.0
  x[32:64, 0:32] = -0.0
  x[0:32, 32:64] *= 1e-30
  x[32:64, 32:64] *= np.exp2(rng.integers(-22, -8, (32, 1))).astype(np.float32)  # NVFP4 s_b below 2^-6 or 0
  x[0:32, 64:96] = rng.choice([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -2.5, -0.25], (32, 32))
  x[32:64, 64:96] *= 1e30
  x[0:64, 96:128] *= np.exp2(rng.integers(-16, 0, (64, 32))).astype(np.float32)
  x[5, 100] = 3e38
  x[60, 70] = -3e38
  return x


def nonfinite(rng, shape):
  """NaN and +-Inf in a few blocks, the rest normal."""
  x = normal(rng, shape)
  m, k = shape
  x[3 % m, 20 % k] = np.nan
  x[7 % m, 25 % k] = np.inf
  x[40 % m, 90 % k] = -np.inf
  return x


INPUTS = {"normal": normal, "heavy": heavy, "row_spread": row_spread, "special": special, "nonfinite": nonfinite}


def bits(a) -> np.ndarray:
  """The bit patterns of an array (NaN compares equal to the same NaN)."""
  a = np.asarray(a)
  return a.view(f"u{a.itemsize}")


def assert_same(got, want) -> None:
  """Two QTensors hold the same codes, scales and outer factor bit for bit, and the same layout."""
  assert (got.fmt, got.axis, got.shape) == (want.fmt, want.axis, want.shape), (got.fmt, got.axis, got.shape,
                                                                              want.fmt, want.axis, want.shape)
  for leaf in ("codes", "scales", "outer"):
    g, w = getattr(got, leaf), getattr(want, leaf)
    if g is None or w is None:
      assert g is None and w is None, leaf
      continue
    g, w = bits(g), bits(w)
    assert g.shape == w.shape, (leaf, g.shape, w.shape)
    bad = np.argwhere(g != w)
    assert bad.size == 0, (f"{leaf}: {len(bad)} mismatches, first at {bad[:3].tolist()}: "
                           f"{g[tuple(bad[0])]:#x} vs {w[tuple(bad[0])]:#x}")


def tile_turns(ir: str) -> int:
  """`tt.trans` ops of Triton IR that turn a tile: those that only move a size-2 pair axis to or from the minor
  position (`common.halves` / `interleave`: Triton's split and join) are not counted."""
  ops = re.findall(r"tt\.trans .*?: tensor<([0-9x]+)x\w+> -> tensor<([0-9x]+)x\w+>", ir)
  assert len(ops) == ir.count("tt.trans")  # every transpose parsed
  return sum(not (a.endswith("x2") or b.endswith("x2")) for a, b in ops)
