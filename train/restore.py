"""A trained model back from a `python -m train` run directory, for tools that inspect one (`python -m bench
diagnose --run DIR`): the run's own config.yaml, its newest intact checkpoint, and held-out batches of its data.

A run directory is what `run.out_dir` names (in compare mode, each route's `out_dir/<route>/`): `python -m
train` writes config.yaml there before the first step and checkpoints under ckpt/.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from typing import Any, TextIO

import jax
import numpy as np
from flax import nnx

from train import build, checkpoint, data, lock, tokenizers
from train import config as config_lib
from train import train
from train.errors import UserError


@dataclasses.dataclass
class TrainedRun:
  """`model`: the run's Llama (an nnx.Module) at checkpoint `step`; `config`: the run's settings."""
  model: Any
  config: config_lib.Config
  step: int

  def heldout_batch(self, batch_size: int, *, log: TextIO | None = sys.stderr,
                    asked_by: str = "heldout_batch") -> np.ndarray:
    """int32 [batch_size, seq_len + 1]: the first `batch_size` windows of the run's held-out tokens (tokenized,
    or read from the token cache), text its evaluation read and its training did not. Fewer windows than that is
    a UserError that starts with `asked_by`, the setting that asked for them."""
    cfg = self.config
    _, eval_tokens, _ = data.load_splits(cfg.data, log=log)
    windows = (len(eval_tokens) - 1) // cfg.data.seq_len
    if windows < batch_size:  # eval_windows' own message would blame data.batch_size, which this is not
      raise UserError(f"{asked_by} asks for {batch_size} held-out windows: the run's held-out split has "
                      f"{len(eval_tokens):,} tokens: {windows} windows of its data.seq_len={cfg.data.seq_len}, "
                      f"fewer than the {batch_size} asked for")
    (batch,) = data.eval_windows(eval_tokens, cfg.data.seq_len, batch_size, 1)
    return np.asarray(batch, np.int32)


def load(run_dir: str, *, route: str | None = None, scan_layers: bool | str | None = None,
         log: TextIO = sys.stderr) -> TrainedRun:
  """The model of `run_dir` at its newest intact checkpoint, built from the run's config.yaml.

  route / scan_layers: build the model with this route (every block; the parameters are the same whatever the
  route) or this `model.scan_layers` instead of the run's; None keeps the run's. Diagnostics take route "bf16"
  (exact activations and gradients to quantize) and scan_layers False (`capture_linears` probes unrolled
  blocks). The checkpoint is restored into the run's own model, whose layout it was saved in (a scanned run
  holds its blocks stacked, `fp4jax.nn.llama.model`), then copied into the one asked for (`copy_params`).
  Raises UserError when `run_dir` holds no config.yaml or no checkpoint (a run with run.ckpt_every = 0 saves
  one at its last step only). Holds the run's lock while it reads: a UserError when a run holds it."""
  path = os.path.join(run_dir, "config.yaml")
  if not os.path.isfile(path):
    raise UserError(f"{run_dir} is not a run directory of python -m train (no config.yaml there); in compare mode "
                    f"each route has its own, <run.out_dir>/<route>/")
  with _locked(run_dir, log):
    return _load(run_dir, path, route, scan_layers, log)


@contextlib.contextmanager
def _locked(run_dir: str, log: TextIO):
  """Holds `run_dir`'s lock (`train.lock.RunLock`, the one a training run holds) for the block: a run going on
  there writes the config and checkpoints this would read, and a restore sets damaged steps aside. A directory
  whose lock cannot be written (read-only: no run of this user writes there) is read with a warning."""
  held = lock.RunLock(run_dir, log=log, advice="wait for it to finish (it writes the checkpoints this reads)")
  try:
    held.acquire()
  except OSError as e:
    log.write(f"[restore] warning: cannot lock {held.path} ({e.strerror or e}); reading {run_dir} unlocked\n")
  try:
    yield
  finally:
    held.release()


def _load(run_dir: str, path: str, route: str | None, scan_layers: bool | str | None, log: TextIO) -> TrainedRun:
  from fp4jax.nn.llama.model import copy_params  # pylint: disable=g-import-not-at-top
  saved = config_lib.from_dict(config_lib.read_yaml(path))
  cfg = saved
  if route is not None:
    cfg = config_lib.replace(cfg, route=route, rules={"bf16_first": 0, "bf16_last": 0, "extra": ()})
  if scan_layers is not None:
    cfg = config_lib.replace(cfg, model={"scan_layers": scan_layers})
  ckpt_dir = os.path.join(run_dir, "ckpt")
  if not checkpoint.saved_steps(ckpt_dir):
    raise UserError(f"{run_dir} has no checkpoint under ckpt/: the run has not saved one yet (run.ckpt_every, or "
                    f"its last step)")
  tok = tokenizers.get_tokenizer(saved.data.tokenizer, saved.data.tokenizer_path)
  # One device, whatever mesh the run trained on (checkpoints restore across meshes); none of the training-only
  # checks (`build.preflight`): they judged the training machine's devices and made the run's own run.out_dir.
  ts = train.init_train_state(saved, tok.vocab_size, build.make_mesh((1, 1), jax.devices()[:1]))
  ckpt = checkpoint.Checkpointer(ckpt_dir, log=log)
  try:
    ts.state, _, step = ckpt.restore(ts.state, alternative=train.checkpoint_alternative(ts))
  finally:
    ckpt.close()
  model, _ = nnx.merge(ts.graphdef, ts.state)
  if cfg != saved:
    lcfg = build.llama_config(cfg, tok.vocab_size)
    wanted = nnx.eval_shape(lambda: build.build_model(cfg, lcfg))  # every parameter is copied in below
    copy_params(model, wanted)
    model = wanted
  return TrainedRun(model, cfg, step)
