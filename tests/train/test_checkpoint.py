"""Checkpoint verification: a damaged newest step (truncated or flipped data, missing metadata) is detected,
set aside and the newest intact step restored with a warning; with none intact, one line names the step."""

from __future__ import annotations

import io
import os

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from train import checkpoint
from train.errors import UserError


def _state(seed: int) -> nnx.State:
  model = nnx.Linear(256, 256, rngs=nnx.Rngs(seed))
  return nnx.state((model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)))


def _largest_file(step_dir: str) -> str:
  files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(step_dir, "state")) for f in fs]
  return max(files, key=os.path.getsize)


def _truncate(step_dir: str) -> None:
  path = _largest_file(step_dir)
  os.truncate(path, os.path.getsize(path) // 2)


def _flip_bytes(step_dir: str) -> None:
  path = _largest_file(step_dir)
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2)
    f.write(np.random.default_rng(0).integers(0, 256, 64, dtype=np.uint8).tobytes())


def _drop_metadata(step_dir: str) -> None:
  os.remove(os.path.join(step_dir, "state", "_METADATA"))


def _save_two(directory: str) -> tuple[nnx.State, nnx.State]:
  ckpt = checkpoint.Checkpointer(directory)
  old, new = _state(1), _state(2)
  ckpt.save(1, old, {"position": 1})
  ckpt.save(2, new, {"position": 2})
  ckpt.close()
  return old, new


def _leaves(state: nnx.State) -> list[np.ndarray]:
  return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
          for x in jax.tree.leaves(nnx.to_pure_dict(state))]


@pytest.mark.parametrize("damage", [_truncate, _flip_bytes, _drop_metadata])
def test_damaged_newest_step_falls_back_to_an_intact_one(tmp_path, damage):
  directory = str(tmp_path / "ckpt")
  old, new = _save_two(directory)
  log = io.StringIO()
  state, data_state, step = checkpoint.Checkpointer(directory, log=log).restore(_state(3))
  assert step == 2 and data_state == {"position": 2} and log.getvalue() == ""  # intact: restored as saved
  for got, want in zip(_leaves(state), _leaves(new)):
    np.testing.assert_array_equal(got, want)

  damage(os.path.join(directory, "2"))
  state, data_state, step = checkpoint.Checkpointer(directory, log=log).restore(_state(3))
  assert step == 1 and data_state == {"position": 1}
  for got, want in zip(_leaves(state), _leaves(old)):
    np.testing.assert_array_equal(got, want)
  assert f"checkpoint step 2 in {directory} is damaged: " in log.getvalue()
  assert "resuming from step 1, the newest intact one" in log.getvalue()
  assert checkpoint.saved_steps(directory) == [1]  # step 2 set aside, out of the resumed run's way
  assert os.listdir(directory + "-damaged")[0].startswith("2-")


def test_no_intact_step_is_one_line_naming_it(tmp_path):
  directory = str(tmp_path / "ckpt")
  _save_two(directory)
  _flip_bytes(os.path.join(directory, "2"))
  _drop_metadata(os.path.join(directory, "1"))
  with pytest.raises(UserError, match=rf"checkpoint step 2 in {directory} is damaged \(.*\) and no older step is "
                                      r"intact: delete .* to train from scratch, or use another run.out_dir") as e:
    checkpoint.Checkpointer(directory, log=io.StringIO()).restore(_state(3))
  assert "\n" not in str(e.value)


def test_data_state_is_saved_as_it_was_when_save_returned(tmp_path):
  """Orbax writes a step in the background: a list the caller keeps changing after `save` (the trainer's open
  loss window does, as the next steps run) must be saved as it was at the call. It used to be serialized
  whenever the writer got to it, so a resumed run's first log record sometimes averaged extra losses."""
  ckpt = checkpoint.Checkpointer(str(tmp_path / "ckpt"))
  window = [4.0]
  ckpt.save(4, _state(1), {"loss_window": window})
  window.extend([5.0, 6.0])  # the next steps' losses, recorded while the checkpoint is being written
  ckpt.close()
  _, data, step = checkpoint.Checkpointer(str(tmp_path / "ckpt")).restore(_state(2))
  assert step == 4 and data["loss_window"] == [4.0]


def test_a_state_of_another_layout_is_refused_untouched(tmp_path):
  """A checkpoint whose arrays differ in name or shape from the model's (another layout: scanned blocks stacked,
  unrolled ones per layer) is not damage: one line says so, and no step is moved aside or replaced."""
  directory = str(tmp_path / "ckpt")
  _save_two(directory)
  other = nnx.state((model := nnx.Linear(256, 128, rngs=nnx.Rngs(0)),
                     nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)))
  ckpt = checkpoint.Checkpointer(directory, log=io.StringIO())
  with pytest.raises(UserError, match=r"checkpoint step 2 in .* holds another state layout than this run's model "
                                      r"\(.*kernel: \(256, 256\) saved, \(256, 128\) now.*nothing was changed"):
    ckpt.restore(other)
  ckpt.close()
  assert checkpoint.saved_steps(directory) == [1, 2] and not os.path.exists(directory + "-damaged")
  restored, data, step = checkpoint.Checkpointer(directory).restore(_state(3))
  assert step == 2 and data == {"position": 2}
