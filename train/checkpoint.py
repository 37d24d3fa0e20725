"""Orbax checkpoints of the whole training state: params, optimizer state (incl. its step) and data position.

The array state is saved as the pure nested dict of the NNX state of (model, optimizer); restoring uses the
live state as the abstract target, so arrays come back with their current shardings (works across meshes
as long as the shapes match). The data iterator's state is a small JSON item next to it.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx


def saved_steps(directory: str) -> list[int]:
  """The finished checkpoint steps under `directory`, ascending, read from the directory names alone (Orbax writes
  a step under a temporary name and renames it when complete)."""
  if not os.path.isdir(directory):
    return []
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


class Checkpointer:
  """`save(step, state, data_state)` / `restore(state) -> (state, data_state, step)` under `directory`."""

  def __init__(self, directory: str, *, max_to_keep: int = 2):
    self.directory = os.path.abspath(directory)
    self._mgr = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        item_names=("state", "data"))

  def latest_step(self) -> int | None:
    return self._mgr.latest_step()

  def save(self, step: int, state: nnx.State, data_state: dict[str, Any]) -> None:
    self._mgr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(nnx.to_pure_dict(state)), data=ocp.args.JsonSave(data_state)))

  def restore(self, state: nnx.State, step: int | None = None) -> tuple[nnx.State, dict[str, Any], int]:
    """Restores `step` (default latest) into a copy of `state`'s structure and shardings."""
    step = self._mgr.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {self.directory}")
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.to_pure_dict(state))
    out = self._mgr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
    nnx.replace_by_pure_dict(state, out["state"])
    return state, dict(out["data"]), step

  def wait(self) -> None:
    self._mgr.wait_until_finished()

  def close(self) -> None:
    self._mgr.wait_until_finished()
    self._mgr.close()
