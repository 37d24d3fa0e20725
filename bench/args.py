"""Argument types shared by the bench subcommands: a bad route, preset, batch, shape or count is argparse's
one-line usage error (exit status 2) before any work, not a traceback from deep inside a run."""

from __future__ import annotations

import argparse
import re
from typing import Callable

from fp4jax import platform, route as route_lib
from fp4jax.nn.llama.config import PRESETS as LLAMA_PRESETS

_PAIR = re.compile(r"[1-9]\d*x[1-9]\d*")  # AxB, two positive integers


def route(*extra: str) -> Callable[[str], str]:
  """A type accepting fp4jax's route names and `extra` names (a subcommand's own baselines)."""
  known = (*route_lib.names(), *extra)

  def parse(value: str) -> str:
    if value not in known:
      raise argparse.ArgumentTypeError(f"unknown route {value!r}; routes: {', '.join(known)}")
    return value
  return parse


def preset(value: str) -> str:
  """A Llama preset name (`fp4jax.nn.llama` PRESETS)."""
  if value not in LLAMA_PRESETS:
    raise argparse.ArgumentTypeError(f"unknown Llama preset {value!r}; presets: {', '.join(LLAMA_PRESETS)}")
  return value


def _pair(value: str, form: str, example: str) -> tuple[int, int]:
  """AxB with two positive integers, as (A, B); `form` and `example` name it in the error."""
  if not _PAIR.fullmatch(value):
    raise argparse.ArgumentTypeError(f"{value!r} is not {form} with two positive integers, e.g. {example}")
  a, b = value.split("x")
  return int(a), int(b)


def tokens(value: str) -> tuple[int, int]:
  """BATCHxSEQ with two positive integers, as (batch, seq)."""
  return _pair(value, "BATCHxSEQ", "8x1024")


def shape(value: str) -> tuple[int, int]:
  """One MxK shape with positive sizes, as (M, K)."""
  return _pair(value, "MxK", "16384x4096")


def int_at_least(low: int) -> Callable[[str], int]:
  """A type accepting integers >= `low` (a count of steps, layers or samples)."""
  def parse(value: str) -> int:
    try:
      number = int(value)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if number < low:
      raise argparse.ArgumentTypeError(f"{number} must be >= {low}")
    return number
  return parse


def shapes(value: str) -> list[tuple[int, int]]:
  """A comma-separated list of MxK shapes with positive sizes, as [(M, K), ...]."""
  return [shape(item) for item in value.split(",")]


def scan_value(value: str) -> str:
  """`--scan`'s optional value: "auto" (`add_scan`)."""
  if value != "auto":
    raise argparse.ArgumentTypeError(f"takes no value (every route scanned) or 'auto' (quantized routes scanned, "
                                     f"bf16 unrolled), got {value!r}")
  return value


def add_scan(parser: argparse.ArgumentParser, prefix: str = "") -> None:
  """`--scan` (True: every route's blocks as one scanned body), `--scan auto` (as training's default
  `model.scan_layers: auto` runs them: scanned for a quantized route, unrolled for bf16), default False
  (unrolled). `step.scanned` resolves it per route."""
  parser.add_argument("--scan", nargs="?", const=True, default=False, type=scan_value, metavar="auto",
                      help=f"{prefix}run same-route blocks as one scanned body; 'auto': only a quantized route's, "
                           f"as training's model.scan_layers: auto does")


def kernels_first_value(value: str) -> str:
  """bench's --kernels-first: on, off, or a thread count."""
  if value not in ("on", "off") and not value.isdigit():
    raise argparse.ArgumentTypeError(f"--kernels-first takes on, off or a thread count, got {value!r}")
  return value


def kernels_first(args: argparse.Namespace, cache: bool = True) -> dict:
  """`fp4jax.compiling.kernels_first`'s keywords for bench's `--kernels-first` (on: the kernels compile alone
  first, on its default threads; N: on N threads; off: in the program, as jax.jit compiles) and
  `--compile-cache` (the kernel files kept beside a cache that is on and `cache`, else in a temporary
  directory)."""
  threads = {"on": None, "off": 0}[args.kernels_first] if args.kernels_first in ("on", "off") else \
      int(args.kernels_first)
  return {"threads": threads,
          "directory": platform.kernel_cache_dir(platform.cache_dir(args.compile_cache)) if cache else None}
