"""`python -m bench quantize`: checks and times the fused quantizers on the GPU at full size.

For every shape: checks each variant (a pair of operand specs, one per view, or both MS-EDEN views of dY, and
optionally a tile) bit for bit against the XLA-compiled reference quantizer (both views, codes and scales;
"+fp8" variants also the FP8 re-encoding against `numerics.fp8.mx_to_fp8`), then times it, the reference
producing the same outputs, and a copy of x (`-x`: one read and one write of x, the bandwidth ceiling).
"to_fp8" rows time the Pallas FP8 re-encoding alone against XLA's. Bytes are the fewest a pass must move: x
read once plus every output written once. Times are throughputs (`timing.bench(batches=7)`: 7 batches of 20
back-to-back calls). Prints a table last; `--out DIR` also gets the table and a JSON log. `--interpret` runs a
small CPU smoke test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp

from bench import args as args_lib
from bench import timing
from fp4jax import route as route_lib
from fp4jax.numerics import fp8 as fp8_encoding
from fp4jax.numerics import reference
from fp4jax.numerics.qtensor import QTensor, ScaledValues
from fp4jax.numerics.spec import OperandKeys, OperandSpec
from fp4jax.numerics.values import scaled_values
from fp4jax.ops.quantize import pallas, xla
from fp4jax.ops.quantize.pallas import eden, fp8, mxfp4, nvfp4
from fp4jax.ops.quantize.pallas.fp8 import Fp8Tile
from fp4jax.ops.quantize.pallas.tiling import QuantTile
from train.errors import UserError

SHAPES = ((16384, 4096), (16384, 14336), (4096, 14336))
SMOKE_SHAPES = ((128, 256),)  # --interpret: every variant and tile fits; all of them in ~2.5 min on 2 CPU cores


@dataclasses.dataclass(frozen=True)
class Variant:
  """One fused pass to check and time: the row view's and the column view's spec (one keys object for both
  when they are equal, as fp4_dot passes for one recipe), an explicit kernel tile or the default, the FP8
  re-encoding of both views after it (MXFP4), or MS-EDEN's options (`eden.operand`: both views of dY, each
  its own launch pair). `axis`: one operand only, `row` along that axis (1: the row view, 0: the column view)
  through the dispatch fp4_dot uses for one operand (`ops.quantize.pallas.operand`), or with `eden` through
  the MS-EDEN kernel of that view itself. `forms`: the NVFP4 kernel's (`nvfp4.views`), a view asked as values
  checked against the reference's decoded values in x's layout."""

  row: OperandSpec
  col: OperandSpec
  tile: QuantTile | None = None
  fp8: bool = False
  eden: dict | None = None
  axis: int | None = None
  forms: tuple[str, str] | None = None


_MX, _MX_SR = OperandSpec("mxfp4", scale_rule="ocp"), OperandSpec("mxfp4", "sr", scale_rule="noclip")
_MX_H32 = OperandSpec("mxfp4", transform="h32")
_W32 = OperandSpec("mxfp4", tile_2d=True, scale_rule="noclip", clip_fraction=0.87)  # Hu's 32x32 weight tiles
_NV, _NV_SR = OperandSpec("nvfp4"), OperandSpec("nvfp4", "sr")
# the nvfp4 route's column views: X's (RNE) and dY's (SR), each after a random Hadamard of size 16
_NV_RHT16, _NV_SR_RHT16 = OperandSpec("nvfp4", transform="rht16"), OperandSpec("nvfp4", "sr", transform="rht16")
_NVT, _NVT_SR = OperandSpec("nvfp4_tile"), OperandSpec("nvfp4_tile", "sr")
_EDEN = OperandSpec("nvfp4", "eden", transform="rht128")
VARIANTS: dict[str, Variant] = {
    "rne/ocp": Variant(_MX, _MX),
    "sr/noclip": Variant(_MX_SR, _MX_SR),
    "rne/ocp+fp8": Variant(_MX, _MX, fp8=True),
    "sr/noclip+fp8": Variant(_MX_SR, _MX_SR, fp8=True),
    "w32x32/noclip/0.87": Variant(_W32, _W32),
    "w32x32/noclip/0.87+fp8": Variant(_W32, _W32, fp8=True),
    "views dY sr|rne": Variant(_MX_SR, _MX),  # mxfp4's dY: dgrad SR, wgrad RNE
    "views X rne|rne+h32": Variant(_MX, _MX_H32),  # mxfp4_h32's X
    "views dY sr|rne+h32": Variant(_MX_SR, _MX_H32),  # and its dY
    "views h32 32x128w4": Variant(_MX, _MX_H32, QuantTile(32, 128, num_warps=4)),
    "views h32 64x64w4": Variant(_MX, _MX_H32, QuantTile(64, 64, num_warps=4)),
    "nv rne|rne": Variant(_NV, _NV),  # NVFP4 X (global scale: amax pass + kernel)
    "nv dY sr|rne": Variant(_NV_SR, _NV),
    "nvtile rne|rne": Variant(_NVT, _NVT),  # tile-local NVFP4
    "nvtile dY sr|rne": Variant(_NVT_SR, _NVT),
    "nv X rne|rne+rht16": Variant(_NV, _NV_RHT16),  # the nvfp4 route's X
    "nv dY sr|sr+rht16": Variant(_NV_SR, _NV_SR_RHT16),  # and its dY
    "nv W 16x16": Variant(OperandSpec("nvfp4", tile_2d=True), OperandSpec("nvfp4", tile_2d=True)),  # and its W
    # the nvfp4 route's X and dY as fp4_dot quantizes them for Hopper: the views read at once as bf16 values
    "nv X rne|rne+rht16 values": Variant(_NV, _NV_RHT16, forms=("values", "codes")),
    "nv dY sr|sr+rht16 values": Variant(_NV_SR, _NV_SR_RHT16, forms=("values", "values")),
    "nv 4/6": Variant(OperandSpec("nvfp4_46"), OperandSpec("nvfp4_46")),  # both views in one pass
    # quartet2's forward X (along K) and W (along K = its column view): one view each
    "nv 4/6 row view": Variant(OperandSpec("nvfp4_46"), OperandSpec("nvfp4_46"), axis=1),
    "nv 4/6 column view": Variant(OperandSpec("nvfp4_46"), OperandSpec("nvfp4_46"), axis=0),
    # quartet2's dY: both MS-EDEN views (RHT128 along N for dgrad, along M for wgrad), two launches each: through
    # fp4_dot's dispatch (the column view as x^T along K), and through the kernel of each view
    "eden dY views": Variant(_EDEN, _EDEN, eden=None),
    "eden dY rht128": Variant(_EDEN, _EDEN, eden={}),
    # one view each: the dispatch (the column view as x^T along K, XLA's transpose included) and the kernels
    "eden row view": Variant(_EDEN, _EDEN, axis=1),
    "eden column view": Variant(_EDEN, _EDEN, axis=0),
    "eden column view kernel": Variant(_EDEN, _EDEN, eden={}, axis=0),
    "eden dY rht128 c32w4": Variant(_EDEN, _EDEN, eden=dict(block_c=32)),
    "eden dY rht128 c64w8": Variant(_EDEN, _EDEN, eden=dict(block_c=64, num_warps=8)),
    # Fewer warps keep the column view's butterfly in registers (Triton PTX on CPU: 52 shared-memory stores at
    # 1 warp, 821 at 4).
    "eden dY rht128 c16w1": Variant(_EDEN, _EDEN, eden=dict(num_warps=1)),
    "eden dY rht128 c16w2": Variant(_EDEN, _EDEN, eden=dict(num_warps=2)),
    "rne 64x128w8": Variant(_MX, _MX, QuantTile(64, 128, num_warps=8)),
    "rne 32x256w4": Variant(_MX, _MX, QuantTile(32, 256, num_warps=4)),
    "sr 64x64w4": Variant(_MX_SR, _MX_SR, QuantTile(64, 64, num_warps=4)),
    # The nvfp4 route's values launches on other tiles than their defaults (64 x 64 / 4 for X, 32 x 64 / 4 for
    # dY): the fastest in one round at 8192x28672 (docs/BENCHMARKS.md, 2026-12-04, 19:52), not yet the defaults.
    "nv X values 32x128w4": Variant(_NV, _NV_RHT16, QuantTile(32, 128, num_warps=4), forms=("values", "codes")),
    "nv dY values 32x256w8": Variant(_NV_SR, _NV_SR_RHT16, QuantTile(32, 256, num_warps=8),
                                     forms=("values", "values")),
}
# The variants docs/BENCHMARKS.md's tables show (scripts/gpu_bench.sh's default).
DOC_VARIANTS = ("rne/ocp", "w32x32/noclip/0.87", "views dY sr|rne", "views X rne|rne+h32", "views dY sr|rne+h32",
                "nv rne|rne", "nv dY sr|rne", "nvtile rne|rne", "nvtile dY sr|rne", "nv X rne|rne+rht16",
                "nv dY sr|sr+rht16", "nv W 16x16", "eden dY views")

FP8_TILES = (Fp8Tile(8, 16, num_warps=4), Fp8Tile(16, 16, num_warps=4), Fp8Tile(4, 16, num_warps=4))


def _time(fn, *args) -> float:
  """Seconds per call: the median of 7 batches of 20 back-to-back calls (after a warm-up call)."""
  return timing.bench(fn, *args, warmup=1, iters=20, rotate=False, batches=7)


def _keys(v: Variant, key: jax.Array) -> tuple[OperandKeys, OperandKeys]:
  """Each view's keys as fp4_dot derives them (dY's dgrad and wgrad roles); one object for one dual-view
  recipe, as fp4_dot passes when it quantizes one operand."""
  row = route_lib.operand_keys(v.row, key, "dgrad_dy")
  shared = v.row == v.col and v.eden is None and v.row.rounding != "eden"  # MS-EDEN: one launch pair per view
  return row, row if shared else route_lib.operand_keys(v.col, key, "wgrad_dy")


def _views(v: Variant, x: jax.Array, key: jax.Array, interpret: bool):
  """The fused pass(es) of a variant: (row view, column view) [+ (row FP8, column FP8)]."""
  row_keys, col_keys = _keys(v, key)
  if v.axis is not None and v.eden is not None:
    return eden.operand(x, v.row, v.axis, row_keys, interpret=interpret, **v.eden)
  if v.axis is not None:
    return pallas.operand(x, v.row, v.axis, row_keys, interpret=interpret)
  if v.eden is not None:
    return tuple(eden.operand(x, spec, axis, k, interpret=interpret, **v.eden)
                 for spec, axis, k in ((v.row, 1, row_keys), (v.col, 0, col_keys)))
  if v.row.rounding == "eden":  # no dual-view kernel: one dispatched launch pair per view, as fp4_dot runs it
    return (pallas.operand(x, v.row, 1, row_keys, interpret=interpret),
            pallas.operand(x, v.col, 0, col_keys, interpret=interpret))
  family = mxfp4 if v.row.fmt == "mxfp4" else nvfp4
  forms = {} if v.forms is None else {"forms": v.forms}
  out = family.views(x, v.row, v.col, row_keys, col_keys, tile=v.tile, interpret=interpret, **forms)
  if v.fp8:
    out = (*out, tuple(fp8.mx_to_fp8(q, interpret=interpret) for q in out))
  return out


def _reference(v: Variant, x: jax.Array, key: jax.Array):
  """The XLA reference of `_views`."""
  row_keys, col_keys = _keys(v, key)
  if v.axis is not None:
    return xla.operand(x, v.row, v.axis, row_keys)
  out = (xla.operand(x, v.row, 1, row_keys), xla.operand(x, v.col, 0, col_keys))
  if v.forms is not None:
    out = tuple(_in_x_layout(q) if form == "values" else q for q, form in zip(out, v.forms))
  if v.fp8:
    out = (*out, tuple(fp8_encoding.mx_to_fp8(q) for q in out))
  return out


def _in_x_layout(q: QTensor) -> ScaledValues:
  """A reference view as the NVFP4 kernel stores one asked as values: its bf16 values in x's own layout."""
  v = scaled_values(q).kmajor()
  return ScaledValues(v if q.axis == 1 else v.T, q.outer, fmt=q.fmt, axis=q.axis, shape=q.shape)


def _mismatches(got, want) -> dict[str, int]:
  """Count of differing elements per output leaf, comparing bit patterns (NaN == NaN)."""
  def as_bits(a):
    return jax.lax.bitcast_convert_type(a, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize])
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


def measure(shapes, variants, log: list, interpret: bool = False) -> list[tuple]:
  rows = []
  key = jax.random.key(7)
  copy = jax.jit(lambda x: -x)  # one read and one write of x: the copy bandwidth ceiling
  for shape in shapes:
    x = _input(shape, sum(shape))
    t_copy = _time(copy, x)
    copy_bytes = 2 * x.size * x.dtype.itemsize
    copy_bw = copy_bytes / t_copy
    rows.append((f"{shape[0]}x{shape[1]}", "copy (-x)", t_copy, copy_bytes, copy_bw, 1.0, float("nan"), "-"))
    xla_times = {}
    for label, variant in variants:
      try:
        t, moved, ok, bad, base = _check_and_time(label, variant, x, key, interpret, xla_times, rows, copy_bw)
      except Exception as e:  # a variant that fails to compile must not hide the others' numbers
        print(f"{shape} {label}: FAILED {type(e).__name__}: {str(e)[:3000]}", flush=True)
        rows.append(_failed_row(shape, f"fused {label}"))
        continue
      rows.append((f"{shape[0]}x{shape[1]}", f"fused {label}", t, moved, moved / t, moved / t / copy_bw,
                   xla_times[base] / t, ok))
      log.append(dict(shape=shape, variant=label, seconds=t, bytes=moved, check=bad))
      print(f"{shape} {label}: {t * 1e6:.1f} us, check {ok}", flush=True)
    for tile in FP8_TILES:
      try:
        rows.append(_fp8_row(x, tile, copy_bw, interpret, log))
      except Exception as e:  # pylint: disable=broad-except  (a FAILED row, as a variant gets)
        print(f"{shape} {_fp8_label(tile)}: FAILED {type(e).__name__}: {str(e)[:3000]}", flush=True)
        rows.append(_failed_row(shape, _fp8_label(tile)))
  return rows


def _failed_row(shape: tuple[int, int], label: str) -> tuple:
  """The table row of a variant or re-encode that raised (its error printed above the table)."""
  return (f"{shape[0]}x{shape[1]}", label, float("nan"), 0, float("nan"), float("nan"), float("nan"),
          "FAILED (error above)")


def _fp8_label(tile) -> str:
  return f"to_fp8 {tile.block_r}x{tile.block_b}w{tile.num_warps}"


def _fp8_row(x, tile, copy_bw, interpret, log) -> tuple:
  """Times the MXFP4 -> FP8 re-encoding alone (Pallas vs XLA) on the row view of x."""
  q = reference.quantize(x, "mxfp4")
  label = _fp8_label(tile)
  kern = jax.jit(lambda q: fp8.mx_to_fp8(q, tile=tile, interpret=interpret))
  ref = jax.jit(fp8_encoding.mx_to_fp8)
  got = kern(q)
  bad = _mismatches(got, ref(q))
  ok = "ok" if not any(bad.values()) else f"MISMATCH {bad}"
  moved = timing.tree_nbytes(q) + timing.tree_nbytes(got)
  t, t_xla = _time(kern, q), _time(ref, q)
  log.append(dict(shape=x.shape, variant=label, seconds=t, xla_seconds=t_xla, bytes=moved, check=bad))
  print(f"{x.shape} {label}: {t * 1e6:.1f} us (xla {t_xla * 1e6:.1f} us), check {ok}", flush=True)
  return (f"{x.shape[0]}x{x.shape[1]}", label, t, moved, moved / t, moved / t / copy_bw, t_xla / t, ok)


def _check_and_time(label, variant: Variant, x, key, interpret, xla_times, rows, copy_bw):
  """Checks one fused variant bit for bit against the jitted reference, then times it (and XLA, once per
  recipe: variants differing only in their tile or kernel options share one baseline)."""
  kern = jax.jit(lambda x, key: _views(variant, x, key, interpret))
  ref = jax.jit(lambda x, key: _reference(variant, x, key))
  got = kern(x, key)
  bad = _mismatches(got, ref(x, key))
  ok = "ok" if not any(bad.values()) else f"MISMATCH {bad}"
  moved = x.size * x.dtype.itemsize + timing.tree_nbytes(got)
  base = (variant.row, variant.col, variant.fp8, variant.axis, variant.forms)  # what the reference writes
  if base not in xla_times:
    xla_times[base] = t_xla = _time(ref, x, key)
    rows.append((f"{x.shape[0]}x{x.shape[1]}", f"xla ref {label}", t_xla, moved, moved / t_xla,
                 moved / t_xla / copy_bw, 1.0, "-"))
  return _time(kern, x, key), moved, ok, bad, base


def _table(rows) -> str:
  head = f"{'shape':<12} {'impl':<24} {'time_us':>9} {'MB':>8} {'GB/s':>7} {'%copy':>6} {'vs_xla':>7} check"
  lines = [head]
  for shape, impl, t, b, bw, frac, speed, ok in rows:
    lines.append(f"{shape:<12} {impl:<24} {t * 1e6:9.1f} {b / 1e6:8.1f} {bw / 1e9:7.0f} {100 * frac:6.1f} "
                 f"{speed:7.2f} {ok}")
  return "\n".join(lines)


def add_args(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--shapes", type=args_lib.shapes, default=None,
                      help=f"comma-separated MxK list (default: {','.join(f'{m}x{k}' for m, k in SHAPES)}; with "
                           f"--interpret {','.join(f'{m}x{k}' for m, k in SMOKE_SHAPES)})")
  parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated variant labels to run")
  parser.add_argument("--out", default=None, type=args_lib.out_dir,
                      help="directory for the JSON log and the table (files of those names replaced)")
  parser.add_argument("--interpret", action="store_true", help="Pallas interpret mode (a CPU smoke run)")


def run(args: argparse.Namespace) -> int:
  shapes = args.shapes or (SMOKE_SHAPES if args.interpret else SHAPES)
  wanted = args.variants.split(",")
  unknown = sorted(set(wanted) - set(VARIANTS))
  if unknown:
    raise UserError(f"bench quantize: unknown variants {unknown}; known: {', '.join(VARIANTS)}")
  if not args.interpret and jax.default_backend() != "gpu":  # else every variant fails alike, each in a line
    raise UserError(f"bench quantize: the fused kernels compile for a GPU (this backend: {jax.default_backend()}); "
                    f"add --interpret for a CPU smoke run in Pallas interpret mode")
  variants = [(label, VARIANTS[label]) for label in wanted]
  print(f"devices: {jax.devices()}", flush=True)
  log: list = []
  rows = measure(shapes, variants, log, args.interpret)
  table = _table(rows)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(f"{args.out}/bench_quantize.json", "w") as f:
      json.dump(log, f, indent=1, default=str)
    with open(f"{args.out}/bench_quantize_table.txt", "w") as f:
      f.write(table + "\n")
  print(table)
  failed = [r for r in rows if r[-1].startswith(("MISMATCH", "FAILED"))]
  return 1 if failed else 0
