"""Argument types shared by the bench subcommands: a bad route, preset, batch, shape or count is argparse's
one-line usage error (exit status 2) before any work, not a traceback from deep inside a run."""

from __future__ import annotations

import argparse
import os
import re
from typing import Callable

from fp4jax import platform, route as route_lib
from fp4jax.nn.llama.config import PRESETS as LLAMA_PRESETS
from train import errors

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


def _pair(value: str, form: str, example: str, most: int) -> tuple[int, int]:
  """AxB with two positive integers whose product is at most `most`, as (A, B); `form` and `example` name it in
  the error."""
  if not _PAIR.fullmatch(value):
    raise argparse.ArgumentTypeError(f"{value!r} is not {form} with two positive integers, e.g. {example}")
  a, b = (int(n) for n in value.split("x"))
  if a * b > most:  # past it XLA fails deep inside (an overflowing extent, a divide trap) or runs out of memory
    raise argparse.ArgumentTypeError(f"{value}: {a * b:,} is more than the {most:,} bench takes")
  return a, b


def tokens(value: str) -> tuple[int, int]:
  """BATCHxSEQ with two positive integers, as (batch, seq), at most 2^22 tokens (256 times Llama-1B's 8x2048)."""
  return _pair(value, "BATCHxSEQ", "8x1024", 2**22)


def shape(value: str) -> tuple[int, int]:
  """One MxK shape with positive sizes, as (M, K), at most 2^31 - 1 elements (the kernels index in int32)."""
  return _pair(value, "MxK", "16384x4096", 2**31 - 1)


def out_file(value: str) -> str:
  """A file bench writes (replacing one that is there; `made_parent` makes its folder when it writes), checked
  before any work: not a directory, in a folder that is writable or can be made (`out_dir`)."""
  if not value:  # an unset $VAR: the rows were written nowhere, silently
    raise argparse.ArgumentTypeError("an empty path; name the file to write")
  path = os.path.expanduser(value)
  if os.path.isdir(path) or path.endswith(os.sep):  # "new/" names a folder, where open() fails after the work
    raise argparse.ArgumentTypeError(f"{value!r} is a directory; name a file in it")
  _usable_dir(os.path.dirname(path) or ".", "its directory")
  return path


def made_parent(path: str) -> str:
  """`path` (an `out_file`), its folder made if missing: what a writer opens, so that a command refused after
  parsing leaves no folder behind."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  return path


def out_dir(value: str) -> str:
  """A directory bench writes files into (made by the writer if missing; files of the same names are replaced),
  checked before any work (`_usable_dir`). Nothing is made here, so a command refused after parsing leaves no
  empty folder."""
  path = os.path.expanduser(value)
  _usable_dir(path, "directory")
  return path


def _usable_dir(path: str, what: str) -> None:
  """Refuses (ArgumentTypeError) a `path` that is not a writable directory and cannot be made one: the nearest
  existing folder above a missing path must be a writable directory."""
  if os.path.isdir(path):
    _writable_dir(path, what)
    return
  above = path
  while not os.path.lexists(above):
    above = os.path.dirname(above) or "."
  if not os.path.isdir(above) or not os.access(above, os.W_OK | os.X_OK):
    why = "not a directory" if not os.path.isdir(above) else "not writable"
    raise argparse.ArgumentTypeError(f"{what}={path!r}: cannot use it as a directory ({above!r} is {why}); "
                                     f"choose another")


def _writable_dir(path: str, what: str) -> None:
  try:
    errors.check_writable_dir(path, what)
  except errors.UserError as err:
    raise argparse.ArgumentTypeError(str(err)) from None


def num_warps(value: str) -> int:
  """A Triton warp count: a power of two from 1 to 32."""
  number = int_at_least(1)(value)
  if number > 32 or number & (number - 1):
    raise argparse.ArgumentTypeError(f"{number} is not a power of two from 1 to 32")
  return number


def int_at_least(low: int, below: int | None = None) -> Callable[[str], int]:
  """A type accepting integers >= `low` (a count of steps, layers or samples), and < `below` if given."""
  def parse(value: str) -> int:
    try:
      number = int(value)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if number < low or (below is not None and number >= below):
      raise argparse.ArgumentTypeError(f"{number} must be >= {low}" + ("" if below is None else f" and < {below}"))
    return number
  return parse


# A random seed: what jax.random.key and NumPy's generators take (non-negative C longs), with room for the
# seed + k that diagnose draws further inputs with.
seed = int_at_least(0, 2**62)


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
  """`fp4jax.compiling.KernelsFirst`'s keywords for bench's `--kernels-first` (on, the default: the kernels
  compile alone beside the program, on its default threads; N: on N threads; off: in the program, as jax.jit
  compiles) and `--compile-cache` (the kernel files kept beside a cache that is on and `cache`, else in a
  temporary directory)."""
  value = args.kernels_first or "on"  # not given: on
  threads = {"on": None, "off": 0}[value] if value in ("on", "off") else int(value)
  return {"threads": threads,
          "directory": platform.kernel_cache_dir(platform.cache_dir(args.compile_cache)) if cache else None}
