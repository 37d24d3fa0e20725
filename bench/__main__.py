"""`python -m bench dot|quantize|compile|step|program|triton|diagnose [options]` (`--help` on each)."""

from __future__ import annotations

import argparse
import sys

from bench import args as args_lib
from bench import compile as compile_bench
from bench import diagnose, dot, program, quantize, step, triton
from fp4jax import platform
from train.errors import UserError
from train.main import enable_compilation_cache, guarded

# name -> (module with add_args(parser) and run(args), help)
SUBCOMMANDS = {
    "dot": (dot, "GEMMs and fp4_dot at Llama-8B shapes vs bf16 and FP8"),
    "quantize": (quantize, "the fused quantizers: bit-exactness and speed against XLA and a copy"),
    "compile": (compile_bench, "fp4_dot lower + compile time per route"),
    "step": (step, "a whole Llama train step per route: tokens/s, MFU, memory, time by category"),
    "program": (program, "hashes of the program fp4_dot lowers to on an H200 (CPU, no GPU needed)"),
    "triton": (triton, "Triton compile time of the Pallas kernels (CPU, no GPU needed)"),
    "diagnose": (diagnose, "route diagnostics: operand errors, zero and clip fractions, GEMM cosine and bias"),
}

KERNELS_FIRST = ("compile", "step")  # the subcommands that read --kernels-first


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
  parser.add_argument("--compile-cache", default="auto",
                      help=f"JAX's persistent compilation cache directory, 'off' (or 'none'), or 'auto' "
                           f"(default: auto = {platform.default_cache_dir()})")
  parser.add_argument("--kernels-first", type=args_lib.kernels_first_value, default=None, metavar="on|off|N",
                      help="compile a program's Pallas kernels alone, in parallel, beside the program's own compile "
                           "(on: one thread per CPU but one, none on 2 CPUs or fewer; N: on N threads) or in the "
                           "program (off); fp4jax.compiling (default: on, for bench compile and bench step)")
  sub = parser.add_subparsers(dest="command", required=True)
  for name, (module, help_) in SUBCOMMANDS.items():
    summary = " ".join(module.__doc__.split("\n\n")[0].split())  # the docstring's first paragraph
    module.add_args(sub.add_parser(name, help=help_, description=summary))
  args = parser.parse_args(argv)
  platform.set_xla_flags()  # before JAX starts a backend; an XLA_FLAGS the user set keeps its values
  platform.set_jax_options()  # an option the user set in the environment keeps its value

  def run():
    if args.kernels_first is not None and args.command not in KERNELS_FIRST:
      raise UserError(f"--kernels-first is read by bench {' and '.join(KERNELS_FIRST)} (the programs they compile); "
                      f"bench {args.command} compiles without it: drop it")
    enable_compilation_cache(args.compile_cache, "--compile-cache")
    return SUBCOMMANDS[args.command][0].run(args) or 0
  # A UserError (e.g. `diagnose --run` on a directory that is no run) is one line and exit status 2, as in train.
  return guarded(f"python -m bench {args.command}", False, run)


if __name__ == "__main__":
  sys.exit(main())
