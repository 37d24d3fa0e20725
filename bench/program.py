"""`python -m bench program`: fingerprints of the program fp4_dot compiles to on the H200, without a GPU.

Lowers fp4_dot forward + backward per route and shape for an (abstract) H200 on any machine, with the Pallas
quantizers and the fp8 GEMM backend (what "auto" picks on Hopper), and prints one hash of the StableHLO and one
per Triton kernel, both with SSA value names and source locations stripped. Two trees that print the same
hashes hand XLA the same program, so a refactor that keeps them keeps the GPU speed; one that changes them
names what moved. (`--dump DIR` writes the normalized texts for a diff.)
"""

from __future__ import annotations

import argparse
import hashlib
import pathlib
import re

import jax
import jax.numpy as jnp

import fp4jax
from bench import args as args_lib, dot, triton
from train.errors import UserError

_SSA = re.compile(r"%[\w#:.-]+")
_LOC = re.compile(r"loc\([^)]*\)|#loc\d*")
_TRITON_IR = re.compile(r'ir = "[^"]*"')


def normalized(text: str) -> str:
  """MLIR text without SSA value names, source locations and embedded Triton bytecode (hashed on its own)."""
  lines = (line for line in text.splitlines() if line.strip() and not line.startswith("#loc"))
  return "\n".join(_SSA.sub("%v", _LOC.sub("", _TRITON_IR.sub("ir = <triton>", line))) for line in lines)


def digest(text: str) -> str:
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def lowered(route: str, m: int, k: int, n: int) -> tuple[str, list[str]]:
  """(normalized StableHLO, normalized Triton IR of each kernel in launch order) of fp4_dot forward +
  backward on bf16 x [m, k], w [k, n] for an H200."""
  impl = fp4jax.Impl(quantizer="pallas", gemm="fp8")
  key = jax.random.key(0)

  def fwd_bwd(x, w, dy):
    y, vjp = jax.vjp(lambda x, w: fp4jax.fp4_dot(x, w, route=route, key=key, impl=impl), x, w)
    return y, *vjp(dy)

  args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((m, k), (k, n), (m, n))]
  with triton.on_abstract_h200() as kernels:
    text = jax.jit(fwd_bwd).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  return normalized(text), [normalized(ir) for ir in kernels]


def add_args(parser: argparse.ArgumentParser) -> None:
  dot.add_shape_args(parser)
  parser.add_argument("--dump", type=lambda value: pathlib.Path(args_lib.out_dir(value)),
                      help="write the normalized texts into this folder")


def run(args: argparse.Namespace) -> None:
  if set(args.routes) <= {"bf16"}:
    raise UserError("bench program: bf16 lowers no quantizer or FP4 GEMM, so it has no program here; name a "
                    "quantized route in --routes")
  shapes, m = dot.selected_shapes(args)
  for sname, k, n in shapes:
    for route in args.routes:
      if route == "bf16":
        continue
      hlo, kernels = lowered(route, m, k, n)
      print(f"{sname:18s} {route:18s} hlo {digest(hlo)}  kernels {' '.join(map(digest, kernels))}", flush=True)
      if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
        stem = f"{route}_{m}x{k}x{n}"
        (args.dump / f"{stem}.stablehlo").write_text(hlo)
        for i, ir in enumerate(kernels):
          (args.dump / f"{stem}.kernel{i}.ttir").write_text(ir)
