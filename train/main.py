"""`python -m train --config configs/cpu_compare.yaml [--set section.key=value ...] [--debug]`.

Exit status: 0 when every route trained (or was already finished), 1 when a route diverged or failed, 2 for a
mistake in the config, the data or the run directory, or a disk too full for a checkpoint (printed as one line;
`--debug` adds its traceback), 128 + the signal's number when SIGINT (130) or SIGTERM (143) stopped the run: after
saving a checkpoint where a route was training (`train.interrupt`; the same command resumes it), without one
outside the steps (before the first, the folders and LOCK files the run made are removed).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
import types
from collections.abc import Callable
from typing import TYPE_CHECKING

from train.errors import UserError, check_writable_dir
from train.interrupt import Interrupted, Terminated

if TYPE_CHECKING:
  from train.config import Config

EXIT_FAILED_RUN = 1
EXIT_USER_ERROR = 2


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m train", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", help="YAML file (see configs/)")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="dotted override, repeatable: --set optim.lr=1e-3 --set route=nvfp4; the value is "
                      "read as YAML, a string key's (a path, a name) kept as typed")
  p.add_argument("--debug", action="store_true", help="show the traceback of a config/data/run-directory error too")
  args = p.parse_args(argv)
  return guarded(p.prog, args.debug, lambda: _run(args))


def guarded(prog: str, debug: bool, body: Callable[[], int]) -> int:
  """`body()`'s exit status; or EXIT_USER_ERROR after printing a UserError as one line, or 128 + the signal's number
  after a stop request (`train.interrupt`), also one line (`debug`: each with its traceback)."""
  try:
    return body()
  except UserError as e:
    if debug:
      traceback.print_exc()
    print(f"{prog}: error: {' '.join(str(e).splitlines())}", file=sys.stderr)
    return EXIT_USER_ERROR
  except Interrupted as e:
    if debug:
      traceback.print_exc()
    print(f"{prog}: {e}", file=sys.stderr)
    return e.exit_status
  except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM outside the training steps (loading data, building a state)
    if debug:
      traceback.print_exc()
    how = "stopped by SIGTERM" if isinstance(e, Terminated) else "interrupted"
    print(f"{prog}: {how} outside the training steps: no checkpoint was written (what earlier steps and "
          f"routes saved is kept)", file=sys.stderr)
    return e.exit_status if isinstance(e, Terminated) else 128 + signal.SIGINT


def enable_compilation_cache(setting: str, what: str) -> None:
  """JAX's persistent compilation cache as `setting` names it (`fp4jax.platform.cache_dir`: auto, none/off or a
  directory), train's and bench's: a directory that cannot be used is a UserError naming `what`."""
  from fp4jax import platform
  try:
    cache = platform.cache_dir(setting)
  except ValueError as err:
    raise UserError(f"{what}={setting!r}: {err}") from err
  if cache is not None:  # auto's directory comes from the environment: say so where it is unusable
    auto = setting.strip().lower() == "auto"
    check_writable_dir(cache, f"{what}=auto, whose directory ($FP4JAX_CACHE, else $XDG_CACHE_HOME/fp4jax/jax)"
                       if auto else what)
  platform.enable_compilation_cache(cache)


def start_jax(cfg: Config) -> types.ModuleType:
  """Imports JAX with this run's XLA flags, JAX options and compilation cache (and multi-host set-up); returns the
  module."""
  import jax
  from fp4jax import platform
  platform.set_xla_flags()  # before JAX starts a backend; flags the user set in XLA_FLAGS keep their values
  platform.set_jax_options()  # an option the user set in the environment keeps its value
  enable_compilation_cache(cfg.run.compile_cache, "run.compile_cache")
  if os.environ.get("FP4JAX_DISTRIBUTED") == "1":
    jax.distributed.initialize()  # coordinator/process ids from the environment (see train/train.py)
  return jax


def _run(args: argparse.Namespace) -> int:
  from train import config
  cfg = config.load_config(args.config, args.set)  # every key and value checked before JAX starts
  jax = start_jax(cfg)
  from train import metrics, progress, train
  try:
    rows = train.run_all(cfg)
  except progress.NonFiniteLossError:
    return EXIT_FAILED_RUN
  failed = [r for r in rows if r.get("status") != "ok"]
  if jax.process_index() == 0:
    print(metrics.format_table(rows))
    out = os.path.abspath(cfg.run.out_dir)
    plot = os.path.join(out, "loss.png")
    print(f"outputs: {out} (loss plot: {plot if os.path.exists(plot) else 'none'}, table: "
          f"{os.path.join(out, 'table.md')})", file=sys.stderr)
    if failed:
      print(f"python -m train: {len(failed)} of {len(rows)} route(s) failed: "
            f"{'; '.join(f'{r['route']} ({r['status']})' for r in failed)}", file=sys.stderr)
  return EXIT_FAILED_RUN if failed else 0
