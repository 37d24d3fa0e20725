"""Fresh random inputs that a failure can replay: `fresh_rng()` draws a new seed each run and prints it, and
pytest shows a failing test's output, so the seed that broke it is in the report. FP4JAX_TEST_SEED=<seed>
replays it."""

import os

import numpy as np


def fresh_rng(label: str = "") -> np.random.Generator:
  """A numpy Generator from a new seed (or FP4JAX_TEST_SEED's), printed with `label` for the failure report."""
  seed = int(os.environ.get("FP4JAX_TEST_SEED") or np.random.SeedSequence().entropy)
  print(f"random inputs{' for ' + label if label else ''} from seed {seed} (replay: FP4JAX_TEST_SEED={seed})")
  return np.random.default_rng(seed)
