"""`python -m bench dot`: GEMMs and fp4_dot at Llama-8B linear-layer shapes (16384 tokens; 4096->14336,
14336->4096, 4096->4096) against a bf16 dot and a per-tensor FP8 dot; `--small` for a CPU smoke run. Also
checks that the fp8 backend compiles to a cuBLAS(Lt) FP8 GEMM and equals the emulated product.

Times are medians of `timing.bench` (block_until_ready per call, inputs rotated when small vs L2). The table
comes last; `--out` writes every number as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import time
import traceback
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import fp4jax
from bench import args as args_lib
from bench import timing
from fp4jax import route as route_lib
from fp4jax.numerics import fp8 as fp8_encoding
from fp4jax.numerics.formats import get_format
from fp4jax.numerics.qtensor import QTensor
from fp4jax.ops import gemm as gemm_lib
from fp4jax.ops.gemm import emulated as gemm_emulated
from fp4jax.ops.gemm import fp8 as gemm_fp8
from fp4jax.ops.quantize import quantize_operand
from fp4jax.platform import compiles_for_gpu
from train.errors import UserError

# (name, K, N) for x [tokens, K] @ w [K, N].
LLAMA8B_SHAPES = (("up 4096->14336", 4096, 14336), ("down 14336->4096", 14336, 4096),
                  ("attn 4096->4096", 4096, 4096))
LLAMA8B_TOKENS = 16384
SMALL_SHAPES = (("up 256->512", 256, 512), ("down 512->256", 512, 256), ("sq 256->256", 256, 256))
SMALL_TOKENS = 128
DEFAULT_ROUTES = ("bf16", "mxfp4", "mxfp4_h32", "nvfp4", "nvfp4_tile_local", "quartet2")
_KMAJOR_DOT = (((1,), (1,)), ((), ()))


def random_qtensor(key: jax.Array, fmt: str, rows: int, k: int, *, span: int = 4) -> QTensor:
  """A K-major [rows, k] QTensor with uniformly random codes and random scales (no quantizer involved).

  MX: each row draws e_row in [-8, 8] and block exponents in [e_row - span, e_row]. NV: block scales are
  random positive normal E4M3 values; the outer factor is one float32 per tensor ("tensor") or per row
  ("row_tile") drawn in [2^-12, 2^-6].
  """
  spec = get_format(fmt)
  kc, ks, ke, ko = jax.random.split(key, 4)
  codes = jax.random.randint(kc, (rows, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
  nb = k // spec.block
  if spec.scale == "e8m0":
    e_row = jax.random.randint(ke, (rows, 1), -8, 9)
    e = e_row - jax.random.randint(ks, (rows, nb), 0, span + 1)
    scales = (e + 127).astype(jnp.uint8)
  else:
    bits = jax.random.randint(ks, (rows, nb), 0x08, 0x7F, jnp.int32).astype(jnp.uint8)  # normal, finite
    scales = jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn)
  outer_shape = {"none": None, "tensor": (), "row_tile": (rows,)}[spec.outer]
  outer = None
  if outer_shape is not None:
    outer = jnp.exp2(jax.random.uniform(ko, outer_shape, jnp.float32, -12.0, -6.0))
  return QTensor(codes, scales, outer, fmt, 1, (rows, k))


def device_info() -> dict:
  d = jax.devices()[0]
  return {"device": f"{d.platform}:{d.device_kind}", "jax": jax.__version__,
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def cublas_fp8_gemms(hlo_text: str) -> list[str]:
  """Custom-call targets in compiled HLO text that are cuBLAS(Lt) GEMMs reading float8_e4m3fn operands.

  Operands are printed either with their types (`custom-call(f8e4m3fn[8,32]{1,0} %a, ...)`) or by name only;
  names are looked up in the instruction definitions (`%a = f8e4m3fn[8,32]{1,0} parameter(0)`).
  """
  types = dict(re.findall(r"^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*\(?([a-z0-9]+)\[", hlo_text, re.M))
  found = []
  for line in hlo_text.splitlines():
    target = re.search(r'custom_call_target="([^"]+)"', line)
    operands = re.search(r"custom-call\(([^)]*)\)", line)
    if not (target and operands and "cublas" in target.group(1)):
      continue
    names = re.findall(r"%[\w.\-]+", operands.group(1))
    if "f8e4m3fn" in operands.group(1) or any(types.get(n) == "f8e4m3fn" for n in names):
      found.append(target.group(1))
  return found


def gemm_targets(hlo_text: str) -> list[str]:
  """Every custom-call target and Triton GEMM fusion named in compiled HLO text (what ran the GEMM)."""
  targets = re.findall(r'custom_call_target="([^"]+)"', hlo_text)
  targets += sorted(set(re.findall(r'"kind":"(__triton_gemm|__cudnn\$[a-z]+)"', hlo_text)))
  return targets


@jax.jit
def _err_stats(out: jax.Array, ref: jax.Array, bound: jax.Array) -> dict:
  out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
  fin = ~jnp.isnan(ref)
  diff = jnp.where(fin, jnp.abs(out - ref), 0.0)
  return {"nan_pattern_equal": jnp.all(jnp.isnan(out) == ~fin),
          "bitwise_equal_frac": jnp.sum(fin & (out == ref)) / jnp.maximum(jnp.sum(fin), 1),
          "max_abs_diff": jnp.max(diff), "max_diff_over_bound": jnp.max(diff / jnp.maximum(bound, 1e-30))}


def _err_vs(out: jax.Array, ref: jax.Array, bound: jax.Array) -> dict:
  """Agreement of `out` with `ref`, computed on device: NaN pattern, bitwise-equal share, max |diff| / bound."""
  return {k: (bool(v) if v.dtype == jnp.bool_ else float(v)) for k, v in _err_stats(out, ref, bound).items()}


def check_fp8_backend(m: int, k: int, n: int, key: jax.Array) -> dict:
  """fp8-backend results vs emulated (MXFP4 x MXFP4, NVFP4 x NVFP4), float32 and bf16 outputs.

  bound = 2 K 2^-24 (|A| |B|^T) + 2^-24 |ref|: the two sides accumulate the same exact products in float32 in
  different orders (plus one rounding of the outer factors for NVFP4). On a GPU the MXFP4 pair's FP8 GEMM sums
  on FP8 tensor cores, with fewer bits than float32 (cuBLASLt's fast accumulation: 1.46 times the float32 bound
  on the H200, docs/BENCHMARKS.md): 2 K 2^-24 becomes `FAST_ACCUM_SUM_BOUND` (2^-9) there, as in the tests.
  The bf16 outputs are compared with the float32 reference rounded to bf16, with one bf16 ulp (<= 2^-7 |ref|)
  added to the bound.
  """
  res = {}
  for fmt in ("mxfp4", "nvfp4"):
    ka, kb = jax.random.split(jax.random.fold_in(key, len(fmt)))
    a, b = random_qtensor(ka, fmt, m, k), random_qtensor(kb, fmt, n, k)
    ref = jax.jit(lambda a, b: gemm_emulated.gemm(a, b, out_dtype=jnp.float32))(a, b)
    absprod = jax.jit(lambda a, b: gemm_emulated.gemm(abs_codes(a), abs_codes(b), out_dtype=jnp.float32))(a, b)
    sums = gemm_fp8.FAST_ACCUM_SUM_BOUND if fmt == "mxfp4" and compiles_for_gpu() else 2 * k * 2.0**-24
    bound = sums * absprod + 2.0**-24 * jnp.abs(ref)
    for dt in (jnp.float32, jnp.bfloat16):
      out = jax.jit(lambda a, b, dt=dt: gemm_fp8.gemm(a, b, out_dtype=dt))(a, b)
      r = ref if dt == jnp.float32 else ref.astype(jnp.bfloat16)
      bd = bound if dt == jnp.float32 else bound + 2.0**-7 * jnp.abs(ref)
      res[f"{fmt} {jnp.dtype(dt).name}"] = _err_vs(out, r, bd)
    if fmt == "mxfp4":
      precise = jax.jit(lambda a, b: gemm_fp8.fp8_gemm(
          fp8_encoding.mx_to_fp8(a), fp8_encoding.mx_to_fp8(b), jnp.float32, fast_accum=False))(a, b)
      res["mxfp4 float32 fast_accum=False"] = _err_vs(precise, ref, bound)
  return res


def abs_codes(q: QTensor) -> QTensor:
  """|q|: the same QTensor with every code's sign bit cleared (scales are positive here)."""
  return QTensor(q.codes & jnp.uint8(0x77), q.scales, q.outer, q.fmt, q.axis, q.shape)


class _Rows:
  """Collects timing rows; prints each as it lands and writes the JSON after each (a killed run keeps them)."""

  def __init__(self, out: str | None, meta: dict):
    self.out, self.meta, self.rows = out, meta, []

  def add(self, shape: str, name: str, fn: Callable, args: tuple, flops: float, *, base: str | None,
          warmup: int, iters: int) -> None:
    row = {"shape": shape, "name": name, "flops": flops, "base": base}
    print(f"  {shape:18s} {name:34s} compiling and timing...", flush=True)
    stats = {}
    try:
      t = timing.bench(fn, *args, warmup=warmup, iters=iters, stats=stats)
      row.update(ms=t * 1e3, tflops=flops / t / 1e12, first_call_s=stats["first_call_s"])
    except Exception as e:  # pylint: disable=broad-except  (one failing row must not lose the others)
      row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
      traceback.print_exc(limit=3)
    self.rows.append(row)
    print(f"  {shape:18s} {name:34s} " + (f"{row['ms']:9.3f} ms (first call {row['first_call_s']:.1f} s)"
                                           if "ms" in row else row["error"]), flush=True)
    self.dump()

  def dump(self) -> None:
    if self.out:
      with open(args_lib.made_parent(self.out), "w") as f:
        json.dump({**self.meta, "rows": self.rows}, f, indent=1)

  def table(self) -> str:
    times = {(r["shape"], r["name"]): r.get("ms") for r in self.rows}
    lines = [f"{'shape':18s} {'row':34s} {'ms':>9s} {'TFLOP/s':>8s} {'x base':>7s}  base"]
    for r in self.rows:
      if "ms" not in r:
        lines.append(f"{r['shape']:18s} {r['name']:34s} FAILED {r['error']}")
        continue
      b = times.get((r["shape"], r["base"])) if r["base"] else None
      ratio = f"{b / r['ms']:7.2f}" if b else "      -"
      lines.append(f"{r['shape']:18s} {r['name']:34s} {r['ms']:9.3f} {r['tflops']:8.1f} {ratio}  "
                   f"{r['base'] or ''}")
    return "\n".join(lines)


def fp4_dot_fns(route: str, key: jax.Array, quantizer: str = "auto"):
  """(forward, forward+backward) jitted functions of fp4_dot with `route`, quantizing with `quantizer`."""
  impl = fp4jax.Impl(quantizer=quantizer)

  def fwd(x, w):
    return fp4jax.fp4_dot(x, w, route=route, key=key, impl=impl)

  def fwd_bwd(x, w, dy):
    y, vjp = jax.vjp(fwd, x, w)
    return y, *vjp(dy)

  return jax.jit(fwd), jax.jit(fwd_bwd)


def _fp4_fprop_prequantized_w(route: str, key: jax.Array):
  """(quantize W, forward with that W): the fprop of fp4_dot with W quantized once, outside the timed call, as
  a training step does once per step for all its micro-batches (the DESIGN target's definition)."""
  r = route_lib.get(route)
  keys = {role: route_lib.operand_keys(r.spec(role), key, role) for role in ("fprop_x", "fprop_w")}
  prep_w = jax.jit(lambda w: quantize_operand(w, r.fprop_w, 0, keys["fprop_w"]))
  fwd = jax.jit(lambda x, wq: gemm_lib.gemm(quantize_operand(x, r.fprop_x, 1, keys["fprop_x"]), wq,
                                            out_dtype=x.dtype))
  return prep_w, fwd


def selected_shapes(args: argparse.Namespace) -> tuple[tuple, int]:
  """((name, K, N) shapes picked by --small / --shapes, tokens M)."""
  shapes = SMALL_SHAPES if args.small else LLAMA8B_SHAPES
  unknown = sorted(set(args.shapes or ()) - set(range(len(shapes))))
  if unknown:
    raise UserError(f"bench: --shapes {unknown[0]} is no shape; the {'--small ' * args.small}shapes are "
                    + ", ".join(f"{i}: {name} {k}x{n}" for i, (name, k, n) in enumerate(shapes)))
  if args.shapes:
    shapes = tuple(s for i, s in enumerate(shapes) if i in args.shapes)
  return shapes, SMALL_TOKENS if args.small else LLAMA8B_TOKENS


def run(args: argparse.Namespace) -> int | None:
  """The `dot` subcommand."""
  shapes, m = selected_shapes(args)
  meta = device_info()
  print(f"bench dot: {meta}", flush=True)
  meta["copy_bandwidth_GBps"] = timing.copy_bandwidth(2**30 if not args.small else 2**22) / 1e9
  print(f"copy bandwidth (read + write): {meta['copy_bandwidth_GBps']:.0f} GB/s", flush=True)
  rows = _Rows(args.out, meta)
  key = jax.random.key(args.seed)
  bf16_out = jnp.bfloat16

  # HLO check: did the fp8 backend's MXFP4 GEMM become a cuBLAS(Lt) FP8 GEMM?
  print("HLO check: compiling the fp8 backend's GEMMs...", flush=True)
  t_hlo = time.perf_counter()
  _, k0, n0 = shapes[0]
  a0, b0 = random_qtensor(key, "mxfp4", m, k0), random_qtensor(key, "mxfp4", n0, k0)
  hlo = jax.jit(lambda a, b: gemm_fp8.gemm(a, b, out_dtype=bf16_out)).lower(a0, b0).compile().as_text()
  nv0 = random_qtensor(key, "nvfp4", m, k0), random_qtensor(key, "nvfp4", n0, k0)
  hlo_nv = jax.jit(lambda a, b: gemm_fp8.gemm(a, b, out_dtype=bf16_out)).lower(*nv0).compile().as_text()
  fp8_targets = cublas_fp8_gemms(hlo)
  a8_0, b8_0 = fp8_encoding.mx_to_fp8(a0), fp8_encoding.mx_to_fp8(b0)
  hlo_precise = jax.jit(lambda a, b: gemm_fp8.fp8_gemm(a, b, bf16_out, fast_accum=False)).lower(
      a8_0, b8_0).compile().as_text()
  meta["hlo_check"] = {"mxfp4_fp8_cublas_targets": fp8_targets, "mxfp4_all_targets": gemm_targets(hlo),
                       "fp8_gemm_no_fast_accum_cublas_fp8_targets": cublas_fp8_gemms(hlo_precise),
                       "fp8_gemm_no_fast_accum_all_targets": gemm_targets(hlo_precise),
                       "nvfp4_bf16_targets": gemm_targets(hlo_nv),
                       "fp8_is_cublas_fp8_gemm": bool(fp8_targets)}
  print(f"HLO check ({time.perf_counter() - t_hlo:.1f} s): fp8 backend MXFP4 GEMM -> cuBLAS(Lt) FP8 custom call: "
        f"{bool(fp8_targets)} "
        f"{fp8_targets or gemm_targets(hlo)}; fast_accum=False -> {gemm_targets(hlo_precise)}; "
        f"NVFP4 bf16 path -> {gemm_targets(hlo_nv)}", flush=True)
  if args.check:
    _, kc, nc = shapes[-1]
    mc = min(m, 4096)
    meta["check_vs_emulated"] = check_fp8_backend(mc, kc, nc, key)
    for name, r in meta["check_vs_emulated"].items():
      print(f"check fp8 backend vs emulated [{mc}x{kc}x{nc}] {name}: {r}", flush=True)

  def operands(si: int, k: int, n: int):
    kx, kw, kd = jax.random.split(jax.random.fold_in(key, si), 3)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    return kx, x, w, jax.random.normal(kd, (m, n), jnp.bfloat16)

  common = dict(warmup=args.warmup, iters=args.iters)
  for si, (sname, k, n) in enumerate(shapes if args.gemm_rows else ()):  # GEMM rows first (a run cut short
    # keeps them for every shape); --no-gemm-rows times only bf16 and fp4_dot.
    kx, x, w, _ = operands(si, k, n)
    flops = 2.0 * m * k * n
    rows.add(sname, "bf16 dot", jax.jit(lambda x, w: jnp.dot(x, w)), (x, w), flops, base=None, **common)

    # Per-tensor FP8 (pre-cast operands, both K-major), scalar rescale fused into the GEMM epilogue.
    sx, sw = 448.0 / jnp.max(jnp.abs(x)).astype(jnp.float32), 448.0 / jnp.max(jnp.abs(w)).astype(jnp.float32)
    x8 = (x.astype(jnp.float32) * sx).astype(jnp.float8_e4m3fn)
    w8 = (w.T.astype(jnp.float32) * sw).astype(jnp.float8_e4m3fn)  # [N, K]
    inv = 1.0 / (sx * sw)
    per_tensor = jax.jit(lambda x8, w8, inv: (jax.lax.dot_general(
        x8, w8, _KMAJOR_DOT, preferred_element_type=jnp.float32) * inv).astype(bf16_out))
    rows.add(sname, "fp8 per-tensor dot (fast accum)", per_tensor, (x8, w8, inv), flops, base="bf16 dot",
             **common)

    ka, kb = jax.random.split(kx)
    qa = {f: random_qtensor(ka, f, m, k) for f in ("mxfp4", "nvfp4")}
    qb = {f: random_qtensor(kb, f, n, k) for f in ("mxfp4", "nvfp4")}
    fp8_fn = jax.jit(lambda a, b: gemm_fp8.gemm(a, b, out_dtype=bf16_out))
    rows.add(sname, "fp4 gemm fp8 backend MXFP4", fp8_fn, (qa["mxfp4"], qb["mxfp4"]), flops,
             base="bf16 dot", **common)
    a8, b8 = fp8_encoding.mx_to_fp8(qa["mxfp4"]), fp8_encoding.mx_to_fp8(qb["mxfp4"])
    for fast in (True, False):
      fn = jax.jit(lambda a, b, fast=fast: gemm_fp8.fp8_gemm(a, b, bf16_out, fast_accum=fast))
      name = f"  fp8_gemm only{'' if fast else ' no-fast-accum'} (Fp8Operand in)"
      rows.add(sname, name, fn, (a8, b8), flops, base="bf16 dot", **common)
    raw = jax.jit(lambda a, b: jax.lax.dot_general(a.values, b.values, _KMAJOR_DOT,
                                                   preferred_element_type=bf16_out))
    rows.add(sname, "  fp8 GEMM alone (fast, no scales)", raw, (a8, b8), flops, base="bf16 dot", **common)
    rows.add(sname, "fp4 gemm fp8 backend NVFP4 (bf16)", fp8_fn, (qa["nvfp4"], qb["nvfp4"]), flops,
             base="bf16 dot", **common)
    emu = jax.jit(lambda a, b: gemm_emulated.gemm(a, b, out_dtype=bf16_out))
    rows.add(sname, "fp4 gemm emulated MXFP4", emu, (qa["mxfp4"], qb["mxfp4"]), flops, base="bf16 dot",
             warmup=1, iters=max(2, args.iters // 4))
    del qa, qb, a8, b8, x8, w8

  for si, (sname, k, n) in enumerate(shapes):
    _, x, w, dy = operands(si, k, n)
    flops = 2.0 * m * k * n
    if not args.gemm_rows:
      rows.add(sname, "bf16 dot", jax.jit(lambda x, w: jnp.dot(x, w)), (x, w), flops, base=None, **common)
    for route in args.routes:
      unfused = args.unfused and not route_lib.get(route).high_precision
      for quantizer in ("auto", "xla") if unfused else ("auto",):
        tag = " [xla quant]" if quantizer == "xla" else ""
        fwd, fwd_bwd = fp4_dot_fns(route, jax.random.fold_in(key, 7), quantizer)
        rows.add(sname, f"fp4_dot {route} fwd{tag}", fwd, (x, w), flops, base="bf16 dot", **common)
        if route != "bf16" and quantizer != "xla":
          prep_w, fwd_q = _fp4_fprop_prequantized_w(route, jax.random.fold_in(key, 7))
          rows.add(sname, f"fp4_dot {route} fwd, W pre-quantized", fwd_q, (x, prep_w(w)), flops,
                   base="bf16 dot", **common)
        rows.add(sname, f"fp4_dot {route} fwd+bwd{tag}", fwd_bwd, (x, w, dy), 3 * flops,
                 base="fp4_dot bf16 fwd+bwd" if "bf16" in args.routes else None, **common)

  print("\nfp4_dot rows quantize X and W (and dY) inside the timed call; GEMM rows use pre-quantized operands.")
  print(f"{meta['device']}  jax {meta['jax']}  {meta['date']}  M={m}")
  print(rows.table())
  failed = [row["name"] for row in rows.rows if "error" in row]
  if failed:  # the table shows them; the exit status tells a script
    print(f"{len(failed)} row(s) FAILED: {', '.join(dict.fromkeys(failed))}", file=sys.stderr)
    return 1


def add_shape_args(p: argparse.ArgumentParser) -> None:
  """The options `selected_shapes` reads, and the routes: shared by `dot` and `compile`."""
  p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
  p.add_argument("--shapes", type=int, nargs="+", help="indices of the shapes to run (default: all)")
  p.add_argument("--routes", nargs="+", type=args_lib.route(), default=list(DEFAULT_ROUTES), help="fp4_dot routes")


def add_args(p: argparse.ArgumentParser) -> None:
  add_shape_args(p)
  p.add_argument("--warmup", type=args_lib.int_at_least(0), default=3)
  p.add_argument("--iters", type=args_lib.int_at_least(1), default=20)
  p.add_argument("--seed", type=args_lib.seed, default=0)
  p.add_argument("--no-check", dest="check", action="store_false", help="skip the fp8 vs emulated check")
  p.add_argument("--no-gemm-rows", dest="gemm_rows", action="store_false",
                 help="time only bf16 dot and the fp4_dot rows (skip the pre-quantized GEMM rows)")
  p.add_argument("--unfused", action="store_true",
                 help="time each quantized route again with XLA's reference quantizers (Impl(quantizer='xla'))")
  p.add_argument("--out", type=args_lib.out_file, help="write all numbers as JSON to this file (replaced)")
