"""`python -m train --config configs/cpu_compare.yaml [--set section.key=value ...]`."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m train", description=__doc__)
  p.add_argument("--config", help="YAML file (see configs/)")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="dotted override, repeatable: --set optim.lr=1e-3 --set route=nvfp4")
  args = p.parse_args(argv)

  import jax
  if os.environ.get("FP4JAX_DISTRIBUTED") == "1":
    jax.distributed.initialize()  # coordinator/process ids from the environment (see train/train.py)
  from train import config, metrics, train

  try:
    cfg = config.load_config(args.config, args.set)
  except config.ConfigError as e:
    p.error(str(e))
  try:
    rows = train.run_all(cfg)
  except train.NonFiniteLossError:
    return 1
  if jax.process_index() == 0:
    print(metrics.format_table(rows))
    out = os.path.abspath(cfg.run.out_dir)
    print(f"outputs: {out} (loss plot: {os.path.join(out, 'loss.png')}, table: {os.path.join(out, 'table.md')})",
          file=sys.stderr)
  return 0
