"""A trained model back from its run directory (`train.restore`), and `python -m bench diagnose --run` on it."""

from __future__ import annotations

import io
import os

import jax
import numpy as np
import pytest
import yaml

from bench.__main__ import main as bench_main
from train import build, config, lock, restore, train
from train.errors import UserError

TEXT = ("def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n\n" * 300).encode()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """A finished 3-step mxfp4 run of the tiny Llama (blocks scanned, as FP4 routes train), checkpointed at the end."""
  tmp = tmp_path_factory.mktemp("restore")
  (tmp / "corpus.txt").write_bytes(TEXT)
  cfg = config.from_dict({
      "model": {"preset": "tiny", "dtype": "float32", "scan_layers": "auto"}, "route": "mxfp4",
      "data": {"sources": [str(tmp / "corpus.txt")], "cache_dir": str(tmp / "cache"), "workers": 1,
               "eval_fraction": 0.1, "seq_len": 32, "batch_size": 8},
      "optim": {"lr": 1e-2, "warmup": 2},
      "run": {"steps": 3, "eval_every": 0, "eval_batches": 2, "log_every": 1, "progress": False,
              "out_dir": str(tmp / "run")}})
  train.run_all(cfg)
  return cfg.run.out_dir


def _kernels(model) -> list[np.ndarray]:
  """Each block's mlp.down kernel, from per-layer blocks or from the stacks of a scanned model."""
  if model.scan_layers:
    return [np.asarray(k) for stack in model.stacks for k in stack.mlp.down.kernel[...]]
  return [np.asarray(layer.mlp.down.kernel[...]) for layer in model.layers]


def test_load_restores_the_trained_weights_in_any_form(run_dir):
  trained = restore.load(run_dir)
  assert trained.step == 3 and trained.config.route == "mxfp4" and trained.model.scan_layers
  fresh = restore.load(run_dir, route="bf16", scan_layers=False)
  assert fresh.config.route == "bf16" and not fresh.model.scan_layers
  # The same trained parameters whatever the route and layout the model is rebuilt with ...
  jax.tree.map(np.testing.assert_array_equal, _kernels(trained.model), _kernels(fresh.model))
  # ... and not the initial ones: 3 steps at lr 1e-2 moved them.
  initial = train.init_train_state(trained.config, 257, build.check_mesh(trained.config))
  init_down = np.asarray(initial.state[0]["stacks"][0]["mlp"]["down"]["kernel"][...][0])
  assert not np.array_equal(init_down, _kernels(trained.model)[0])
  batch = trained.heldout_batch(2, log=None)
  assert batch.shape == (2, trained.config.data.seq_len + 1) and batch.dtype == np.int32


def test_load_on_other_devices_leaves_the_recorded_out_dir_alone(run_dir, tmp_path, monkeypatch):
  """A run copied elsewhere, trained on a mesh of 4 devices, loads on this one device without touching the
  out_dir its config records (it used to be refused for the mesh, and that out_dir made or refused)."""
  moved = tmp_path / "moved"
  os.makedirs(moved)
  os.symlink(os.path.join(run_dir, "ckpt"), moved / "ckpt")
  recorded = config.read_yaml(os.path.join(run_dir, "config.yaml"))
  recorded["run"].update(mesh=[2, 2], out_dir="runs/elsewhere")
  (moved / "config.yaml").write_text(yaml.safe_dump(recorded, sort_keys=False))
  monkeypatch.chdir(tmp_path)
  trained = restore.load(str(moved))
  assert trained.step == 3 and not (tmp_path / "runs").exists()
  jax.tree.map(np.testing.assert_array_equal, _kernels(trained.model), _kernels(restore.load(run_dir).model))


def test_load_refuses_what_is_not_a_finished_run(run_dir, tmp_path):
  with pytest.raises(UserError, match="not a run directory of python -m train"):
    restore.load(str(tmp_path))
  (tmp_path / "config.yaml").write_text(open(os.path.join(run_dir, "config.yaml")).read())
  with pytest.raises(UserError, match="has no checkpoint under ckpt/"):
    restore.load(str(tmp_path))


def test_bench_diagnose_reads_a_trained_run(run_dir, capsys):
  bench_main(["--compile-cache", "off", "diagnose", "--run", run_dir, "--routes", "mxfp4", "nvfp4",
              "--linears", "layers.0.mlp.down", "--samples", "2", "--tokens", "2x32"])
  out = capsys.readouterr().out
  assert f"run {run_dir} (Llama tiny at step 3, run in bf16) on 2 x 32 held-out tokens" in out
  rows = [line.split() for line in out.splitlines() if line.startswith("layers.0.mlp.down")]
  assert {(r[1], r[2]) for r in rows} == {(route, kind) for route in ("mxfp4", "nvfp4") for kind in ("operand", "gemm")}
  assert bench_main(["diagnose", "--run", run_dir, "--stress"]) == 2
  assert "--stress and --run are two different inputs" in capsys.readouterr().err
  # More windows than the held-out split holds: one line that names --tokens, not the run's data.batch_size.
  assert bench_main(["--compile-cache", "off", "diagnose", "--run", run_dir, "--tokens", "4096x32"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.count("\n") == 0 and "--tokens asks for 4096 held-out windows: the run's held-out split has" in err
  assert "fewer than the 4096 asked for" in err and "data.batch_size" not in err


def test_bench_diagnose_on_a_directory_that_is_no_run_is_one_line_exit_2(tmp_path, capsys):
  assert bench_main(["--compile-cache", "off", "diagnose", "--run", str(tmp_path)]) == 2
  err = capsys.readouterr().err.strip()
  assert err.count("\n") == 0 and err.startswith(f"python -m bench diagnose: error: {tmp_path} is not a run directory")


def test_bench_diagnose_waits_for_a_run_going_on_in_its_directory(run_dir, capsys, monkeypatch):
  """The training run's lock is taken while the run directory is read: with a run holding it (one that may be
  writing the checkpoint), one line, exit status 2; it read the directory regardless before. A lock that cannot be
  written (a read-only directory, where no run of this user writes) is a warning."""
  with lock.RunLock(run_dir):
    assert bench_main(["--compile-cache", "off", "diagnose", "--run", run_dir, "--samples", "1"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.count("\n") == 0 and err.startswith(f"python -m bench diagnose: error: {run_dir} is in use by another "
                                                 f"run (pid {os.getpid()} on ")
  assert err.endswith("; wait for it to finish (it writes the checkpoints this reads)")

  def read_only(self):
    raise PermissionError(13, "Permission denied", self.path)

  monkeypatch.setattr(lock.RunLock, "acquire", read_only)
  log = io.StringIO()
  assert restore.load(run_dir, log=log).step == 3
  assert log.getvalue() == (f"[restore] warning: cannot lock {run_dir}/LOCK (Permission denied); reading {run_dir} "
                            f"unlocked\n")
