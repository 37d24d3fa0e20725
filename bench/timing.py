"""Timing helpers of the benchmarks: median wall time of a jitted call, and a copy-bandwidth probe.

Device work is asynchronous, so every timed call ends in `block_until_ready`. Inputs much smaller than the L2
cache (60 MB on an H200) would be timed out of L2, so `bench` rotates among fresh copies of the inputs until
the copies together are a few times the L2 size.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

L2_BYTES = 60 * 2**20  # H200 (50 MB on H100); rotation only needs the order of magnitude.
MAX_INPUT_SETS = 8


def tree_nbytes(tree: Any) -> int:
  """Bytes held by the array leaves of a pytree."""
  return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def input_sets(args: tuple, *, l2_bytes: int = L2_BYTES) -> list[tuple]:
  """`args` plus fresh device copies, enough that all sets together hold >= 3x `l2_bytes` (at most 8 sets)."""
  nbytes = max(tree_nbytes(args), 1)
  n = min(MAX_INPUT_SETS, max(1, math.ceil(3 * l2_bytes / nbytes)))
  copies = [jax.tree.map(lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x, args)
            for _ in range(n - 1)]
  return [args] + copies


def bench(fn: Callable, *args, warmup: int = 3, iters: int = 20, rotate: bool = True, batches: int = 0,
          stats: dict | None = None) -> float:
  """Median seconds of one `fn(*args)` call (fn should be jitted), rotating input copies when small vs L2.

  batches: 0 times each call on its own (dispatch latency included: what a step sees); N > 0 times N batches
    of `iters` back-to-back calls, synchronised once per batch, and returns the median batch time / iters
    (throughput: the dispatch of the next call overlaps the current one, as in a stream of kernels).
  stats: if given, receives "first_call_s", the wall time of the first call (compilation included).
  """
  sets = input_sets(args) if rotate else [args]
  for i in range(max(warmup, len(sets))):  # Compiles, and touches every input set once.
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*sets[i % len(sets)]))
    if i == 0 and stats is not None:
      stats["first_call_s"] = time.perf_counter() - t0
  times = []
  calls = iters if batches else 1
  for b in range(batches or iters):
    inputs = [sets[(b + i) % len(sets)] for i in range(calls)]
    out = None  # the previous result is freed before the clock starts, not inside the timed call
    t0 = time.perf_counter()
    for a in inputs:
      out = fn(*a)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / calls)
  return statistics.median(times)


def copy_bandwidth(nbytes: int = 2**30, *, iters: int = 20) -> float:
  """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written (2 * nbytes).

  The copy is a jitted negation of a float32 buffer: XLA cannot elide it; it reads and writes each byte once.
  """
  x = jnp.arange(nbytes // 4, dtype=jnp.float32)
  neg = jax.jit(jnp.negative)
  return 2 * nbytes / bench(neg, x, iters=iters, rotate=False)
