"""Checks and times the fused quantizers on the GPU at full size.

`python -m fp4jax.kernels.bench_quantize [--shapes 16384x4096,...] [--out DIR]` (or `python -m fp4jax.bench
quantize ...`). For every shape: checks each fused variant bit for bit against the jitted `reference.quantize`
(both views, codes and scales; "+fp8" variants also against `gemm_fp8.mx_to_fp8`; "views" variants give each
view its own recipe, as fp4_dot's X and dY passes: `quantize_fused.quantize_views`; "eden" variants both
MS-EDEN views of dY, `quantize_eden`, amax pass included), then times it, the
XLA-compiled reference producing the same outputs, and a copy of x (`-x`: one read and one write of x, the
bandwidth ceiling). "to_fp8" rows time `quantize_fp8.mx_to_fp8` alone against `gemm_fp8.mx_to_fp8` (XLA).
Bytes are the fewest a pass must move: x read once plus every output written once. Prints a table last;
`--out DIR` also gets the table and a JSON log. `--interpret` runs a small CPU smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from fp4jax import reference
from fp4jax.hadamard import hadamard
from fp4jax.kernels import gemm_fp8, quantize_eden, quantize_fp8, quantize_fused, quantize_fused_nv
from fp4jax.kernels.quantize_fp8 import Fp8Tile
from fp4jax.kernels.quantize_fused import ViewSpec
from fp4jax.kernels.tiling import QuantTile

SHAPES = ((16384, 4096), (16384, 14336), (4096, 14336))
# (label, quantize_dual options -- or views=(row ViewSpec, column ViewSpec) for quantize_views, or
# nv=(format, row rounding, column rounding) for quantize_fused_nv --, tile or None for the heuristic default)
_W = dict(rounding="rne", scale_rule="noclip", tile_2d=True, clip_fraction=0.87)  # Hu's 32x32 weight tiles
_RNE, _SR = ViewSpec("rne", "ocp"), ViewSpec("sr", "noclip")
VARIANTS = (
    ("rne/ocp", dict(rounding="rne", scale_rule="ocp"), None),
    ("sr/noclip", dict(rounding="sr", scale_rule="noclip"), None),
    ("rne/ocp+fp8", dict(rounding="rne", scale_rule="ocp", fp8=True), None),
    ("sr/noclip+fp8", dict(rounding="sr", scale_rule="noclip", fp8=True), None),
    ("w32x32/noclip/0.87", _W, None),
    ("w32x32/noclip/0.87+fp8", dict(_W, fp8=True), None),
    ("views dY sr|rne", dict(views=(_SR, _RNE)), None),  # mxfp4's dY: dgrad SR, wgrad RNE
    ("views X rne|rne+h32", dict(views=(_RNE, ViewSpec("rne", "ocp", transform="h32"))), None),  # mxfp4_h32's X
    ("views dY sr|rne+h32", dict(views=(_SR, ViewSpec("rne", "ocp", transform="h32"))), None),  # and its dY
    ("views h32 32x128w4", dict(views=(_RNE, ViewSpec("rne", "ocp", transform="h32"))),
     QuantTile(32, 128, num_warps=4)),
    ("views h32 64x64w4", dict(views=(_RNE, ViewSpec("rne", "ocp", transform="h32"))),
     QuantTile(64, 64, num_warps=4)),
    ("nv rne|rne", dict(nv=("nvfp4", "rne", "rne")), None),  # NVFP4 X (global scale: amax pass + kernel)
    ("nv dY sr|rne", dict(nv=("nvfp4", "sr", "rne")), None),
    ("nvtile rne|rne", dict(nv=("nvfp4_tile", "rne", "rne")), None),  # tile-local NVFP4
    ("nvtile dY sr|rne", dict(nv=("nvfp4_tile", "sr", "rne")), None),
    ("nv X rne|rne+rht16", dict(nv=("nvfp4", "rne", "rne"), col_transform="rht16"), None),  # the nvfp4 route's X
    ("nv dY sr|sr+rht16", dict(nv=("nvfp4", "sr", "sr"), col_transform="rht16"), None),  # and its dY
    ("nv W 16x16", dict(nv=("nvfp4", "rne", "rne"), tile_2d=True), None),  # and its W
    ("nv 4/6", dict(nv=("nvfp4_46", "rne", "rne")), None),  # quartet2's forward X and W
    # quartet2's dY: both MS-EDEN views (RHT128 along N for dgrad, along M for wgrad), two launches each
    ("eden dY rht128", dict(eden=dict()), None),
    ("eden dY rht128 c32w4", dict(eden=dict(block_c=32)), None),
    ("eden dY rht128 c64w8", dict(eden=dict(block_c=64, num_warps=8)), None),
    # Fewer warps keep the column view's butterfly in registers (Triton PTX on CPU: 52 shared-memory stores at
    # 1 warp, 821 at 4); not yet timed.
    ("eden dY rht128 c16w1", dict(eden=dict(num_warps=1)), None),
    ("eden dY rht128 c16w2", dict(eden=dict(num_warps=2)), None),
    ("rne 64x128w8", dict(rounding="rne", scale_rule="ocp"), QuantTile(64, 128, num_warps=8)),
    ("rne 32x256w4", dict(rounding="rne", scale_rule="ocp"), QuantTile(32, 256, num_warps=4)),
    ("sr 64x64w4", dict(rounding="sr", scale_rule="noclip"), QuantTile(64, 64, num_warps=4)),
)

FP8_TILES = (Fp8Tile(8, 16, num_warps=4), Fp8Tile(16, 16, num_warps=4), Fp8Tile(4, 16, num_warps=4))


def _time(fn, args, iters: int = 20, reps: int = 7) -> float:
  """Median seconds per call over `reps` batches of `iters` calls (after a warm-up)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / iters)
  return statistics.median(times)


def _nbytes(tree) -> int:
  return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


def _eden_views(x, key, quantize):
  """quantize(x, axis, rounding key, transform key) for dY's dgrad view (axis 1) and wgrad view (axis 0)."""
  return tuple(quantize(x, axis, k, t) for axis, k, t in zip((1, 0), _view_keys(key),
                                                            (_transform_key(key), jax.random.fold_in(key, 4))))


def _reference_dual(x, key, fp8=False, views=None, nv=None, eden=None, **opts):
  if eden is not None:
    return _eden_views(x, key, lambda x, axis, k, t: reference.quantize(
        hadamard(x, "rht128", axis=axis, key=t), "nvfp4", axis=axis, rounding="eden", key=k))
  if nv is not None:  # opts: tile_2d (both views draw the row key's bits) or col_transform
    fmt, *roundings = nv
    row_key, col_key = _view_keys(key)
    keys = (row_key, row_key if opts.get("tile_2d") else col_key)
    xs = (x, hadamard(x, opts["col_transform"], axis=0, key=_transform_key(key))
          if opts.get("col_transform") else x)
    return tuple(reference.quantize(a, fmt, axis=axis, rounding=r, key=k, tile_2d=opts.get("tile_2d", False))
                 for a, axis, r, k in zip(xs, (-1, 0), roundings, keys))
  if views is not None:  # quantize_views: each view its recipe and key
    row_v, col_v = views
    xc = hadamard(x, col_v.transform, axis=0) if col_v.transform else x
    return tuple(reference.quantize(a, "mxfp4", axis=axis, rounding=v.rounding, key=k, scale_rule=v.scale_rule,
                                    clip_fraction=v.clip_fraction)
                 for a, axis, v, k in zip((x, xc), (-1, 0), views, _view_keys(key)))
  row = reference.quantize(x, "mxfp4", axis=-1, key=key, **opts)
  col = reference.quantize(x, "mxfp4", axis=0, key=key, **opts)
  return (row, col, (gemm_fp8.mx_to_fp8(row), gemm_fp8.mx_to_fp8(col))) if fp8 else (row, col)


def _view_keys(key):
  return jax.random.fold_in(key, 1), jax.random.fold_in(key, 2)


def _transform_key(key):
  return jax.random.fold_in(key, 3)


def _fused(x, key, tile, interpret, views=None, nv=None, eden=None, **opts):
  if eden is not None:
    return _eden_views(x, key, lambda x, axis, k, t: quantize_eden.quantize_eden(
        x, axis=axis, key=k, transform="rht128", transform_key=t, interpret=interpret, **eden))
  if nv is not None:
    fmt, row_rounding, col_rounding = nv
    row_key, col_key = _view_keys(key)
    if opts.get("tile_2d"):
      col_key = row_key
    if opts.get("col_transform"):
      opts = dict(opts, transform_key=_transform_key(key))
    return quantize_fused_nv.quantize_dual_nv(x, fmt, row_rounding=row_rounding, col_rounding=col_rounding,
                                              row_key=row_key, col_key=col_key, tile=tile, interpret=interpret,
                                              **opts)
  if views is not None:
    row_key, col_key = _view_keys(key)
    return quantize_fused.quantize_views(x, *views, row_key=row_key, col_key=col_key, tile=tile,
                                         interpret=interpret)
  return quantize_fused.quantize_dual(x, "mxfp4", key=key, tile=tile, interpret=interpret, **opts)


def _mismatches(got, want) -> dict[str, int]:
  """Count of differing elements per output leaf, comparing bit patterns (NaN == NaN)."""
  def as_bits(a):
    return jax.lax.bitcast_convert_type(a, {1: jnp.uint8, 4: jnp.uint32}[a.dtype.itemsize])
  paths = jax.tree_util.tree_flatten_with_path(got)[0]
  return {jax.tree_util.keystr(p): int(jnp.sum(as_bits(g) != as_bits(w)))
          for (p, g), w in zip(paths, jax.tree.leaves(want))}


def _input(shape, seed: int) -> jax.Array:
  """bf16 normal with a per-row scale spread of 2^[-8, 8] and a few large outliers."""
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(k1, shape, jnp.float32)
  x = x * jnp.exp2(jnp.round(jax.random.uniform(k2, (shape[0], 1), minval=-8, maxval=8)))
  x = jnp.where(jax.random.uniform(k3, shape) < 1e-4, x * 1000.0, x)
  return x.astype(jnp.bfloat16)


def run(shapes, variants, log: list, interpret: bool = False) -> list[tuple]:
  rows = []
  key = jax.random.key(7)
  copy = jax.jit(lambda x: -x)  # one read and one write of x: the copy bandwidth ceiling
  for shape in shapes:
    x = _input(shape, sum(shape))
    t_copy = _time(copy, (x,))
    copy_bytes = 2 * x.size * x.dtype.itemsize
    copy_bw = copy_bytes / t_copy
    rows.append((f"{shape[0]}x{shape[1]}", "copy (-x)", t_copy, copy_bytes, copy_bw, 1.0, float("nan"), "-"))
    xla_times = {}
    for label, opts, tile in variants:
      try:
        t, moved, ok, bad, base = _check_and_time(label, opts, tile, x, key, interpret, xla_times, rows,
                                                  copy_bw)
      except Exception as e:  # a variant that fails to compile must not hide the others' numbers
        print(f"{shape} {label}: FAILED {type(e).__name__}: {str(e)[:3000]}", flush=True)
        rows.append((f"{shape[0]}x{shape[1]}", f"fused {label}", float("nan"), 0, float("nan"), float("nan"),
                     float("nan"), "MISMATCH (failed)"))
        continue
      rows.append((f"{shape[0]}x{shape[1]}", f"fused {label}", t, moved, moved / t, moved / t / copy_bw,
                   xla_times[base] / t, ok))
      log.append(dict(shape=shape, variant=label, seconds=t, bytes=moved, check=bad))
      print(f"{shape} {label}: {t * 1e6:.1f} us, check {ok}", flush=True)
    for tile in FP8_TILES:
      try:
        rows.append(_fp8_row(x, tile, copy_bw, interpret, log))
      except Exception as e:
        print(f"{shape} to_fp8 {tile}: FAILED {type(e).__name__}: {str(e)[:3000]}", flush=True)
  return rows


def _fp8_row(x, tile, copy_bw, interpret, log) -> tuple:
  """Times the MXFP4 -> FP8 re-encoding alone (Pallas vs gemm_fp8's XLA) on the row view of x."""
  q = reference.quantize(x, "mxfp4")
  label = f"to_fp8 {tile.block_r}x{tile.block_b}w{tile.num_warps}"
  kern = jax.jit(lambda q: quantize_fp8.mx_to_fp8(q, tile=tile, interpret=interpret))
  xla = jax.jit(gemm_fp8.mx_to_fp8)
  got = kern(q)
  bad = _mismatches(got, xla(q))
  ok = "ok" if not any(bad.values()) else f"MISMATCH {bad}"
  moved = _nbytes(q) + _nbytes(got)
  t, t_xla = _time(kern, (q,)), _time(xla, (q,))
  log.append(dict(shape=x.shape, variant=label, seconds=t, xla_seconds=t_xla, bytes=moved, check=bad))
  print(f"{x.shape} {label}: {t * 1e6:.1f} us (xla {t_xla * 1e6:.1f} us), check {ok}", flush=True)
  return (f"{x.shape[0]}x{x.shape[1]}", label, t, moved, moved / t, moved / t / copy_bw, t_xla / t, ok)


def _check_and_time(label, opts, tile, x, key, interpret, xla_times, rows, copy_bw):
  """Checks one fused variant bit for bit against the jitted reference, then times it (and XLA, once)."""
  kern = jax.jit(lambda x, key: _fused(x, key, tile, interpret, **opts))
  ref = jax.jit(lambda x, key: _reference_dual(x, key, **opts))
  got = kern(x, key)
  bad = _mismatches(got, ref(x, key))
  ok = "ok" if not any(bad.values()) else f"MISMATCH {bad}"
  moved = x.size * x.dtype.itemsize + _nbytes(got)
  base = "eden" if "eden" in opts else repr(sorted(opts.items()))  # the eden rows share one XLA baseline
  if base not in xla_times:
    xla_times[base] = t_xla = _time(ref, (x, key))
    rows.append((f"{x.shape[0]}x{x.shape[1]}", f"xla ref {label}", t_xla, moved, moved / t_xla,
                 moved / t_xla / copy_bw, 1.0, "-"))
  return _time(kern, (x, key)), moved, ok, bad, base


def _table(rows) -> str:
  head = f"{'shape':<12} {'impl':<24} {'time_us':>9} {'MB':>8} {'GB/s':>7} {'%copy':>6} {'vs_xla':>7} check"
  lines = [head]
  for shape, impl, t, b, bw, frac, speed, ok in rows:
    lines.append(f"{shape:<12} {impl:<24} {t * 1e6:9.1f} {b / 1e6:8.1f} {bw / 1e9:7.0f} {100 * frac:6.1f} "
                 f"{speed:7.2f} {ok}")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="bench_quantize", description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", default=",".join(f"{m}x{k}" for m, k in SHAPES),
                      help="comma-separated MxK list")
  parser.add_argument("--variants", default=",".join(v[0] for v in VARIANTS),
                      help="comma-separated variant labels to run")
  parser.add_argument("--out", default=None, help="directory for the JSON log")
  parser.add_argument("--interpret", action="store_true", help="Pallas interpret mode (a CPU smoke run)")
  args = parser.parse_args(argv)
  shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
  wanted = args.variants.split(",")
  unknown = sorted(set(wanted) - {v[0] for v in VARIANTS})
  if unknown:
    parser.error(f"unknown variants {unknown}; known: {', '.join(v[0] for v in VARIANTS)}")
  variants = [v for v in VARIANTS if v[0] in wanted]
  print(f"devices: {jax.devices()}", flush=True)
  log: list = []
  rows = run(shapes, variants, log, args.interpret)
  table = _table(rows)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(f"{args.out}/bench_quantize.json", "w") as f:
      json.dump(log, f, indent=1, default=str)
    with open(f"{args.out}/bench_quantize_table.txt", "w") as f:
      f.write(table + "\n")
  print(table)
  failed = [r for r in rows if r[-1].startswith("MISMATCH")]
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
