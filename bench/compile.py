"""`python -m bench compile`: lower and compile time of fp4_dot forward and forward+backward per route (no
data, no run), e.g. to compare XLA_FLAGS settings."""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp

from bench import dot

add_args = dot.add_shape_args


def run(args: argparse.Namespace) -> None:
  """Times `jax.jit(f).lower(...)` and `.compile()` of fp4_dot per route and shape."""
  shapes, m = dot.selected_shapes(args)
  print(f"bench compile: {dot.device_info()} XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
  key = jax.random.key(0)
  for sname, k, n in shapes:
    x, w, dy = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((m, k), (k, n), (m, n)))
    for route in args.routes:
      fwd, fwd_bwd = dot.fp4_dot_fns(route, key)
      for name, fn, fargs in (("fwd", fwd, (x, w)), ("fwd+bwd", fwd_bwd, (x, w, dy))):
        t0 = time.perf_counter()
        lowered = fn.lower(*fargs)
        t1 = time.perf_counter()
        lowered.compile()
        t2 = time.perf_counter()
        print(f"  {sname:18s} {route:18s} {name:8s} lower {t1 - t0:6.1f} s  compile {t2 - t1:6.1f} s", flush=True)
