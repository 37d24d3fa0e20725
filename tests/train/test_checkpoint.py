"""Checkpoint verification: a damaged newest step (truncated or flipped data, missing metadata) is detected,
set aside and the newest intact step restored with a warning; with none intact, one line names the step."""

from __future__ import annotations

import errno
import io
import os
import shutil

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


def test_a_write_left_unfinished_is_deleted_when_the_run_resumes(tmp_path):
  """A process killed while Orbax wrote step 3 leaves `3.orbax-checkpoint-tmp` (a partial step, as large as a
  whole one): the resumed run deletes it and restores step 2; the finished steps stay."""
  directory = str(tmp_path / "ckpt")
  _, new = _save_two(directory)
  unfinished = os.path.join(directory, "3.orbax-checkpoint-tmp")
  shutil.copytree(os.path.join(directory, "2"), unfinished)
  _truncate(unfinished)
  ckpt = checkpoint.Checkpointer(directory, log=io.StringIO())
  state, data_state, step = ckpt.restore(_state(3))
  ckpt.close()
  assert step == 2 and data_state == {"position": 2}
  for got, want in zip(_leaves(state), _leaves(new)):
    np.testing.assert_array_equal(got, want)
  assert sorted(os.listdir(directory)) == ["1", "2"] and checkpoint.saved_steps(directory) == [1, 2]


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


@pytest.mark.parametrize("error,full", [
    (OSError(errno.EDQUOT, "Disk quota exceeded"), True),
    (PermissionError(errno.EACCES, "Permission denied"), False),
    (ValueError("PERMISSION_DENIED: Failed to open file [os_error_code='13']"), False),
    (RuntimeError("a bug"), False)])
def test_only_a_full_disk_is_turned_into_one_line(tmp_path, error, full):
  """A full disk (or quota) while saving is a UserError naming the directory and the cause (`train.train` tests
  the run's side); any other error passes unchanged, with its traceback."""
  ckpt = checkpoint.Checkpointer(str(tmp_path / "ckpt"))
  ckpt.save(1, _state(1), {})

  def save(*args, **kwargs):
    raise error

  ckpt._mgr.save = save
  with pytest.raises(UserError if full else type(error)) as raised:
    ckpt.save(2, _state(1), {})
  ckpt.close()
  if full:
    assert str(raised.value) == (f"cannot write a checkpoint to {tmp_path / 'ckpt'}: disk quota exceeded; the "
                                 f"finished steps there (1) are kept: free space and run the same command again to "
                                 f"resume from step 1")
  else:
    assert raised.value is error


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


def test_a_scanned_run_resumes_a_checkpoint_of_its_blocks_per_layer(tmp_path):
  """Scanned runs saved their blocks per layer (`layers.{i}`) before they held them stacked (`stacks.{g}`): such a
  step restores into the stacked state through `train.checkpoint_alternative`, parameters and Adam moments
  alike, with a note; the same step into an unrolled state needs no conversion."""
  from fp4jax.nn.llama.model import unstacked_params  # pylint: disable=g-import-not-at-top
  from train import build, config, train  # pylint: disable=g-import-not-at-top
  cfg = lambda scan: config.from_dict({"model": {"preset": "tiny", "dtype": "float32", "scan_layers": scan},
                                       "route": "mxfp4", "data": {"seq_len": 32, "batch_size": 2},
                                       "run": {"steps": 2, "seed": 5}})
  mesh = build.make_mesh((1, 1), jax.devices()[:1])
  per_layer, stacked = (train.init_train_state(cfg(scan), 257, mesh) for scan in (False, True))
  batch = train.to_global(np.random.default_rng(0).integers(0, 257, (2, 33)).astype(np.int32), per_layer.batch_sharding)
  per_layer.state, _, _ = per_layer.train_step(per_layer.state, batch, np.int32(0))  # moments that are not zero
  directory = str(tmp_path / "ckpt")
  ckpt = checkpoint.Checkpointer(directory)
  ckpt.save(1, per_layer.state, {"position": 1})
  ckpt.close()
  log = io.StringIO()
  ckpt = checkpoint.Checkpointer(directory, log=log)
  restored, data, step = ckpt.restore(stacked.state, alternative=train.checkpoint_alternative(stacked))
  ckpt.close()
  assert step == 1 and data == {"position": 1} and "converted on restoring" in log.getvalue()
  model, _ = nnx.merge(stacked.graphdef, restored)
  assert model.scan_layers and model.stacks[0].mlp.down.kernel[...].shape[0] == 2
  got = unstacked_params(nnx.to_pure_dict(restored), model.block_groups)
  want = nnx.to_pure_dict(per_layer.state)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert train.checkpoint_alternative(per_layer) is None
