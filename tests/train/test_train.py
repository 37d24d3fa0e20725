"""The training loop on a tiny Llama (float32 compute, CPU): loss goes down, exact resume, NaN stop (one
step behind, never saving a bad state), compare mode outputs, and a sharded step on an 8-device CPU mesh
equal to the single-device step."""

import dataclasses
import errno
import gc
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml
from flax import nnx

import cpu_devices
from fp4jax import platform
from train import build, checkpoint, config, data, interrupt, metrics, objective, progress, tokenizers, train
from train import main as main_lib
from train.errors import UserError
from train.main import EXIT_FAILED_RUN, main
from tiny_steps import tiny_steps

TEXT = ("def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n\n" * 300).encode()
TOKENS = np.frombuffer(TEXT, np.uint8).astype(np.uint16)


def tiny_cfg(tmp_path, *overrides):
  raw = {"model": {"preset": "tiny", "dtype": "float32"},
         "data": {"seq_len": 32, "batch_size": 8},
         "optim": {"lr": 1e-2, "warmup": 2},
         "run": {"steps": 8, "eval_every": 0, "eval_batches": 2, "log_every": 1, "progress": False,
                 "out_dir": str(tmp_path / "run")}}
  return config.from_dict(raw, overrides)


def test_loss_decreases_and_resume_is_bit_identical(tmp_path):
  cfg = tiny_cfg(tmp_path, "run.ckpt_every=4")
  full = train.run(cfg, TOKENS, TOKENS[:2000], 257)
  assert sorted(full["losses"]) == list(range(1, 9))  # 1-based, as the checkpoints count
  losses = [full["losses"][s] for s in range(1, 9)]
  assert losses[-1] < losses[0] - 1.0, losses
  out = cfg.run.out_dir
  assert os.path.exists(os.path.join(out, "loss.png")) and os.path.exists(os.path.join(out, "config.yaml"))
  assert [r["step"] for r in metrics.read_jsonl(os.path.join(out, "metrics.jsonl")) if r["kind"] == "train"] == \
      list(range(1, 9))

  # An interrupted run: the same run directory holding only the step-4 checkpoint.
  resumed_dir = tmp_path / "resumed"
  shutil.copytree(os.path.join(out, "ckpt"), resumed_dir / "ckpt")
  shutil.copy(os.path.join(out, "config.yaml"), resumed_dir)
  shutil.rmtree(resumed_dir / "ckpt" / "8")
  resumed = train.run(config.replace(cfg, run={"out_dir": str(resumed_dir)}), TOKENS, TOKENS[:2000], 257)
  assert sorted(resumed["losses"]) == [5, 6, 7, 8]
  for s in range(5, 9):
    assert resumed["losses"][s] == full["losses"][s], s  # bit-identical, not approximately equal
  assert resumed["eval_loss"] == full["eval_loss"]
  with pytest.raises(UserError, match=r"holds a run checkpointed at step 8, past run.steps=6: use another run.out_dir"):
    train.run(config.replace(cfg, run={"steps": 6}), TOKENS, TOKENS[:2000], 257)
  with pytest.raises(UserError, match=r"with other settings \(optim.lr: 0.01 -> 0.02\): use another run.out_dir"):
    train.run(config.replace(cfg, optim={"lr": 0.02}), TOKENS, TOKENS[:2000], 257)
  for damaged in ("model: [unclosed\n", ""):  # a torn or emptied config.yaml: one line naming it, not a traceback
    (resumed_dir / "config.yaml").write_text(damaged)
    with pytest.raises(UserError, match=r"config.yaml is damaged or empty, so its settings cannot be compared"):
      train.run(config.replace(cfg, run={"out_dir": str(resumed_dir)}), TOKENS, TOKENS[:2000], 257)
  # A deleted one too: other settings would have passed unchecked, and a finished run's result been reported
  # as theirs.
  (resumed_dir / "config.yaml").unlink()
  with pytest.raises(UserError, match=r"config.yaml is missing, so its settings cannot be compared"):
    train.run(config.replace(cfg, run={"out_dir": str(resumed_dir)}, optim={"lr": 0.02}), TOKENS, TOKENS[:2000], 257)


def test_resumed_run_logs_and_reports_what_an_uninterrupted_one_does(tmp_path):
  """Interrupted after its step-4 checkpoint with steps 5-6 logged: the resumed run drops those records, logs the
  3-step window that straddles the checkpoint in full, and reports the same train loss (mean of the last 10
  steps, restored ones included). A longer run.steps is refused: the learning-rate schedule spans it."""
  cfg = tiny_cfg(tmp_path, "run.ckpt_every=4", "run.log_every=3")
  full = train.run(cfg, TOKENS, TOKENS[:2000], 257)
  cut = tmp_path / "cut"
  shutil.copytree(cfg.run.out_dir, cut, ignore=shutil.ignore_patterns("8", "result.json"))
  with open(cut / "metrics.jsonl", "a") as f:  # a record of the interrupted process past its checkpoint
    f.write(json.dumps({"step": 7, "kind": "train", "route": "bf16", "loss": 99.0}) + "\n")
  resumed = train.run(config.replace(cfg, run={"out_dir": str(cut)}), TOKENS, TOKENS[:2000], 257)
  assert sorted(resumed["losses"]) == [5, 6, 7, 8]
  assert resumed["train_loss"] == full["train_loss"]
  untimed = [[{k: v for k, v in r.items() if k != "tokens_per_s"}
              for r in metrics.read_jsonl(os.path.join(d, "metrics.jsonl"))] for d in (cut, cfg.run.out_dir)]
  assert untimed[0] == untimed[1]
  # Stopped after its final checkpoint, before result.json: nothing left to run, the same report, throughput
  # and compile times included (the checkpoint carries the timed steps and seconds, and the first call's times:
  # they were n/a).
  done = tmp_path / "done"
  shutil.copytree(cfg.run.out_dir, done, ignore=shutil.ignore_patterns("result.json"))
  again = train.run(config.replace(cfg, run={"out_dir": str(done)}), TOKENS, TOKENS[:2000], 257)
  assert again["losses"] == {} and again["train_loss"] == full["train_loss"]
  assert again["tokens_per_s"] == full["tokens_per_s"] > 0
  assert again["compile_s"] == full["compile_s"] > 0 and again["first_step_s"] == full["first_step_s"] > 0
  shutil.rmtree(cut / "ckpt" / "8")
  with pytest.raises(UserError, match=r"run.steps=8 learning-rate schedule; run.steps=12 would go on"):
    train.run(config.replace(cfg, run={"out_dir": str(cut), "steps": 12}), TOKENS, TOKENS[:2000], 257)


def test_a_finished_run_whose_checkpoints_were_deleted_reports_its_result(tmp_path):
  """Deleting a finished run's checkpoints (to free the disk) leaves its result: a rerun reports it instead of
  training over it, and refuses other settings or run.resume=false in one line, as it does with them."""
  cfg = tiny_cfg(tmp_path, "run.steps=4")
  full = train.run(cfg, TOKENS, TOKENS[:2000], 257)
  ckpt = os.path.join(cfg.run.out_dir, "ckpt")
  shutil.rmtree(ckpt)
  again = train.run(cfg, TOKENS, TOKENS[:2000], 257)
  assert again["losses"] == {} and again["train_loss"] == full["train_loss"] and not os.path.exists(ckpt)
  with pytest.raises(UserError, match=r"holds a finished run \(result.json, no checkpoint\) with other settings"):
    train.run(config.replace(cfg, optim={"lr": 0.02}), TOKENS, TOKENS[:2000], 257)
  with pytest.raises(UserError, match=r"holds a finished run .* and run.resume=false"):
    train.run(config.replace(cfg, run={"resume": False}), TOKENS, TOKENS[:2000], 257)
  with pytest.raises(UserError, match=r"of a run.steps=4 learning-rate schedule; run.steps=6 would go on"):
    train.run(config.replace(cfg, run={"steps": 6}), TOKENS, TOKENS[:2000], 257)
  assert not os.path.exists(ckpt)  # nothing trained
  result = os.path.join(cfg.run.out_dir, "result.json")
  for damaged in ('{"route": "bf16", "st', "", "[]", '{"loss": 1}'):  # a copy cut short, an emptied or edited file
    with open(result, "w") as f:
      f.write(damaged)
    with pytest.raises(UserError, match=r"result.json is damaged \(it holds no result row of a run\): delete it to "
                                        r"train the run again, or use another run.out_dir"):
      train.run(cfg, TOKENS, TOKENS[:2000], 257)


def test_an_empty_step_folder_is_set_aside_like_other_damaged_steps(tmp_path, capsys):
  """A step folder that holds no file (made by hand, or by a save that never wrote) is a damaged step wherever its
  number lies: set aside with a warning and the newest intact step resumed. Past run.steps, it stopped the run as
  a checkpoint of a longer run before."""
  cfg = tiny_cfg(tmp_path, "run.steps=4", "run.ckpt_every=2")
  full = train.run(cfg, TOKENS, TOKENS[:2000], 257)
  ckpt = os.path.join(cfg.run.out_dir, "ckpt")
  shutil.rmtree(os.path.join(ckpt, "4"))
  os.remove(os.path.join(cfg.run.out_dir, train.RESULT_FILE))
  for step in ("3", "9"):  # at or below run.steps, and past it
    os.makedirs(os.path.join(ckpt, step))
  capsys.readouterr()
  resumed = train.run(cfg, TOKENS, TOKENS[:2000], 257)
  assert resumed["losses"] == {s: full["losses"][s] for s in (3, 4)}
  err = capsys.readouterr().err
  assert f"checkpoint step 9 in {ckpt} is damaged: its folder holds no file" in err
  assert sorted(n.split("-")[0] for n in os.listdir(ckpt + "-damaged")) == ["3", "9"]  # kept, not deleted
  assert checkpoint.saved_steps(ckpt) == [2, 4]


def test_fresh_start_sets_an_earlier_runs_outputs_aside(tmp_path, capsys):
  """A run that left no checkpoint (ckpt_every 0, stopped early) is not continued: its log moves to
  previous-<time>/ instead of mixing into the new run's curve, and nothing of it is deleted."""
  cfg = tiny_cfg(tmp_path, "run.steps=3")
  out = cfg.run.out_dir
  os.makedirs(out)
  old = [json.dumps({"step": s, "kind": "train", "route": "bf16", "loss": 9.0}) + "\n" for s in range(1, 7)]
  with open(os.path.join(out, "metrics.jsonl"), "w") as f:
    f.writelines(old)
  train.run(cfg, TOKENS, TOKENS[:2000], 257)
  records = [r for r in metrics.read_jsonl(os.path.join(out, "metrics.jsonl")) if r["kind"] == "train"]
  assert [r["step"] for r in records] == [1, 2, 3] and all(r["loss"] != 9.0 for r in records)
  [aside] = [d for d in os.listdir(out) if d.startswith("previous-")]
  assert open(os.path.join(out, aside, "metrics.jsonl")).readlines() == old
  assert "moved metrics.jsonl" in capsys.readouterr().err


def _nan_loss_at(monkeypatch, bad_step: int) -> list[int]:
  """Makes train.run's step return a NaN loss at `bad_step` (state untouched); returns the dispatched steps."""
  dispatched = []
  real_init = train.init_train_state

  def init(*args, **kwargs):
    ts = real_init(*args, **kwargs)
    real_step = ts.train_step

    def step_fn(state, batch, step):
      dispatched.append(int(step))
      state, loss, gnorm = real_step(state, batch, step)
      return state, jnp.where(step == bad_step, jnp.nan, loss), gnorm

    ts.train_step = step_fn
    return ts

  monkeypatch.setattr(train, "init_train_state", init)
  return dispatched


@pytest.mark.parametrize("ckpt_every,last_good", [(1, "Last good checkpoint: step 3 in .*ckpt"),
                                                   (0, "No checkpoint was saved yet in .*ckpt")])
def test_non_finite_loss_stops_with_message(tmp_path, monkeypatch, ckpt_every, last_good):
  dispatched = _nan_loss_at(monkeypatch, 3)  # the 4th update's loss (its PRNG step index is 3)
  cfg = tiny_cfg(tmp_path, f"run.ckpt_every={ckpt_every}")
  with pytest.raises(progress.NonFiniteLossError, match=rf"loss is nan at step 4; stopped. {last_good}"):
    train.run(cfg, TOKENS, TOKENS[:2000], 257)
  # Saving after step 4 checks its loss first; otherwise it is read once step 5 runs (no per-step sync).
  assert dispatched == ([0, 1, 2, 3] if ckpt_every else [0, 1, 2, 3, 4])
  assert checkpoint.Checkpointer(os.path.join(cfg.run.out_dir, "ckpt")).latest_step() == (3 if ckpt_every
                                                                                            else None)


def test_huge_lr_stops_naming_steps_as_the_checkpoints_count(tmp_path):
  # lr=1e30: the first update leaves finite (huge) parameters; at the second the loss is still finite but its
  # gradient is not, and the update would overflow them (found then as a non-finite state before saving step 2).
  # Steps count updates from 1, as checkpoints do: checkpoint 1 is the last finite one.
  cfg = tiny_cfg(tmp_path, "optim.lr=1e30", "optim.warmup=0", "run.ckpt_every=1")
  with pytest.raises(progress.NonFiniteLossError,
                     match=r"gradient norm is nan at step 2; stopped. Last good checkpoint: step 1 in .*ckpt"):
    train.run(cfg, TOKENS, TOKENS[:2000], 257)
  assert checkpoint.Checkpointer(os.path.join(cfg.run.out_dir, "ckpt")).latest_step() == 1
  # lr=1e39 (infinite in float32): the first update itself overflows, its loss and gradient finite.
  cfg = tiny_cfg(tmp_path / "inf", "optim.lr=1e39", "optim.warmup=0", "run.ckpt_every=1")
  with pytest.raises(progress.NonFiniteLossError,
                     match=r"state is non-finite after step 1 \(whose loss was finite\); stopped before saving it. "
                           r"No checkpoint"):
    train.run(cfg, TOKENS, TOKENS[:2000], 257)


@pytest.mark.parametrize("signum,eval_every", [(signal.SIGINT, 0), (signal.SIGTERM, 3)])
def test_a_stop_signal_saves_the_step_in_flight_and_the_rerun_resumes_it(tmp_path, monkeypatch, capsys, signum,
                                                                          eval_every):
  """SIGINT / SIGTERM while step 3's batch is drawn: the loop finishes that step, checkpoints it (none is due:
  ckpt_every 0) and stops; `main`'s handling prints one line and returns 128 + the signal. The same run then
  resumes from step 3 with the losses, log and evaluation of an uninterrupted run, and the handlers are back."""
  cfg = tiny_cfg(tmp_path, f"run.eval_every={eval_every}")
  full = train.run(cfg, TOKENS, TOKENS[:2000], 257)
  draw = data.WindowIterator.__next__
  drawn = []

  def next_batch(self):
    drawn.append(None)
    if len(drawn) == 3:
      os.kill(os.getpid(), signum)  # the handler runs before the next bytecode: a signal mid-step
    return draw(self)

  cut = config.replace(cfg, run={"out_dir": str(tmp_path / "cut")})
  monkeypatch.setattr(data.WindowIterator, "__next__", next_batch)
  before = {s: signal.getsignal(s) for s in interrupt.SIGNALS}
  with pytest.raises(interrupt.Interrupted) as stopped:
    train.run(cut, TOKENS, TOKENS[:2000], 257)
  assert {s: signal.getsignal(s) for s in interrupt.SIGNALS} == before
  assert (stopped.value.step, stopped.value.exit_status) == (3, 128 + signum)
  assert checkpoint.saved_steps(os.path.join(cut.run.out_dir, "ckpt")) == [3]

  def body():
    raise stopped.value

  assert main_lib.guarded("python -m train", False, body) == 128 + signum
  assert capsys.readouterr().err.endswith(f"python -m train: [bf16] stopped by {signal.Signals(signum).name} after "
                                          f"step 3: checkpoint saved in {cut.run.out_dir}/ckpt; run the same "
                                          f"command again to resume\n")

  monkeypatch.setattr(data.WindowIterator, "__next__", draw)
  resumed = train.run(cut, TOKENS, TOKENS[:2000], 257)
  assert resumed["losses"] == {s: full["losses"][s] for s in range(4, 9)}  # bit-identical
  assert (resumed["eval_loss"], resumed["train_loss"]) == (full["eval_loss"], full["train_loss"])
  untimed = [[{k: v for k, v in r.items() if k != "tokens_per_s"}
              for r in metrics.read_jsonl(os.path.join(d, "metrics.jsonl"))] for d in (cut.run.out_dir,
                                                                                      cfg.run.out_dir)]
  assert untimed[0] == untimed[1]


def test_a_second_ctrl_c_while_the_stopped_run_writes_its_checkpoint_ends_it_at_once(tmp_path, capsys):
  """Ctrl-C during step 3 (step 2 checkpointed before), then a second one while the process waits for step 3's
  write: the process ends at once, no traceback, as the first one's message says. It raised KeyboardInterrupt
  there: one line said no checkpoint was written, and the process left through the interpreter's shutdown, under
  which Orbax's writer threads failed in pages of tracebacks. Step 2 stays intact, and the same command resumes
  from the newest finished step with the losses of an uninterrupted run. A process of its own: the second signal's
  default action would end pytest."""
  cfg = _corpus_cfg(tmp_path, "run.ckpt_every=2")
  full = train.run_all(config.replace(cfg, run={"out_dir": str(tmp_path / "full")}))[0]
  path = tmp_path / "run.yaml"
  path.write_text(yaml.safe_dump(config.to_dict(cfg)))
  code = textwrap.dedent("""
      import os, signal, sys
      import orbax.checkpoint as ocp
      from train import checkpoint, data, interrupt
      from train.main import main
      draw, save = data.WindowIterator.__next__, checkpoint.Checkpointer.save
      wait = ocp.CheckpointManager.wait_until_finished
      drawn, saved = [], []

      def next_batch(self):
        drawn.append(None)
        if len(drawn) == 3:
          os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C, during step 3
        return draw(self)

      def saving(self, step, *args):
        save(self, step, *args)
        saved.append(step)

      def waiting(self):
        if 3 in saved:  # step 3's write in flight (Orbax's save also waits, for the step before)
          os.kill(os.getpid(), signal.SIGINT)
        return wait(self)

      data.WindowIterator.__next__, checkpoint.Checkpointer.save = next_batch, saving
      ocp.CheckpointManager.wait_until_finished = waiting
      interrupt.exit_process(main(sys.argv[1:]))
      """)
  done = subprocess.run([sys.executable, "-c", code, "--config", str(path)], capture_output=True, text=True,
                        timeout=300, env={**os.environ, "PYTHONPATH": os.getcwd()})
  assert done.returncode == -signal.SIGINT and "Traceback" not in done.stderr, (done.returncode, done.stderr)
  ckpt = os.path.join(cfg.run.out_dir, "ckpt")
  steps = checkpoint.saved_steps(ckpt)
  assert steps in ([2], [2, 3]), steps  # step 3 finished or not, as far as its write got
  capsys.readouterr()
  (resumed,) = train.run_all(cfg)
  assert "damaged" not in capsys.readouterr().err
  assert resumed["losses"] == {s: full["losses"][s] for s in range(steps[-1] + 1, 9)}  # bit-identical
  assert resumed["eval_loss"] == full["eval_loss"]


# The two forms a full disk takes while a step is written: Python's OSError (the JSON item, Orbax's metadata),
# raised as the save starts, and TensorStore's error (the arrays), raised in Orbax's writer thread (which logs it
# with its traceback) and again where the run next waits for the step: at the next save, or at the end.
_NO_SPACE = {
    "save": OSError(errno.ENOSPC, "No space left on device"),
    "writer": ValueError("RESOURCE_EXHAUSTED: Error writing \"0.layers.0.attn.k.kernel/0.0\" in OCDBT database: "
                         "Failed to write 225254 bytes to file 11: No space left on device [os_error_code='28']"),
}


@pytest.mark.parametrize("form, bad", [("save", 4), ("writer", 4), ("writer", 6)])  # 6: the last, found in close
def test_a_full_disk_while_saving_is_one_line_and_the_rerun_resumes(tmp_path, monkeypatch, capsys, caplog, form, bad):
  """A full disk while step `bad` is written stops the run with one line naming the checkpoint directory and the
  cause, exit status 2 (it was pages of traceback, Orbax's logged ones included), the traceback of --debug naming
  it once; the steps before are kept, and once space is freed the same run resumes from the newest."""
  cfg = tiny_cfg(tmp_path, "run.steps=6", "run.ckpt_every=2")
  full = train.run(cfg, TOKENS, TOKENS[:2000], 257)
  cut = config.replace(cfg, run={"out_dir": str(tmp_path / "cut")})
  error, failed = type(_NO_SPACE[form])(*_NO_SPACE[form].args), []  # new: a raised one keeps what it was raised in
  save, wait = ocp.CheckpointManager.save, ocp.CheckpointManager.wait_until_finished

  def full_disk_save(self, step, *args, **kwargs):
    if step != bad:
      return save(self, step, *args, **kwargs)
    wait(self)  # as Orbax's save does first: the step before is written
    if form == "save":
      raise error
    logging.getLogger("absl").error("_SignalingThread.run() raised an exception: %s", error, exc_info=error)
    failed.append(step)  # nothing of the step written: it fails in the writer thread
    return True

  def full_disk_wait(self):
    if failed:
      raise error
    return wait(self)

  monkeypatch.setattr(ocp.CheckpointManager, "save", full_disk_save)
  monkeypatch.setattr(ocp.CheckpointManager, "wait_until_finished", full_disk_wait)
  closed, close = [], metrics.MetricsLogger.close
  monkeypatch.setattr(metrics.MetricsLogger, "close", lambda self: (closed.append(self), close(self)))
  capsys.readouterr()
  assert main_lib.guarded("python -m train", True, lambda: train.run(cut, TOKENS, TOKENS[:2000], 257)) == 2
  ckpt, kept = os.path.join(cut.run.out_dir, "ckpt"), list(range(2, bad, 2))
  err = capsys.readouterr().err
  assert err.splitlines()[-1] == (
      f"python -m train: error: cannot write a checkpoint to {ckpt}: no space left on device; the finished steps "
      f"there ({', '.join(map(str, kept))}) are kept: free space and run the same command again to resume from "
      f"step {kept[-1]}")
  # --debug's traceback: the error once (closing the checkpointer raised it again, and left the metrics log open)
  assert err.count("train.errors.UserError: cannot write a checkpoint") == 1 and len(closed) == 1, err
  assert not [r for r in caplog.records if "No space" in r.getMessage()]
  assert checkpoint.saved_steps(ckpt) == kept
  monkeypatch.undo()  # space freed
  resumed = train.run(cut, TOKENS, TOKENS[:2000], 257)
  assert resumed["losses"] == {s: full["losses"][s] for s in range(bad - 1, 7)}  # bit-identical


def test_stop_request_gives_the_second_signal_its_default_action():
  before = signal.getsignal(signal.SIGINT)  # Python's handler, or SIG_IGN in a process started in the background
  with interrupt.StopRequest("x") as stop:
    assert stop.signum is None and signal.getsignal(signal.SIGTERM) == stop._handle
    stop._handle(signal.SIGTERM, None)  # what the first signal runs
    assert stop.signum == signal.SIGTERM
    assert all(signal.getsignal(s) == signal.SIG_DFL for s in interrupt.SIGNALS)
  assert signal.getsignal(signal.SIGINT) == before
  with interrupt.StopRequest("x", enabled=False):
    assert signal.getsignal(signal.SIGINT) == before


def test_sigterm_raises_once_and_keeps_its_default_action_after_a_stop_request():
  """Inside `sigterm_raises` the first SIGTERM raises Terminated (a KeyboardInterrupt, so that a call undoes what it
  made as on Ctrl-C) and the second takes the default action; a StopRequest inside takes SIGTERM over and, once a
  signal came, leaves it at the default action while the stopped run winds down, as outside `sigterm_raises`."""
  before = signal.getsignal(signal.SIGTERM)
  with interrupt.sigterm_raises():
    with pytest.raises(KeyboardInterrupt) as stopped:
      signal.raise_signal(signal.SIGTERM)
    assert isinstance(stopped.value, interrupt.Terminated) and stopped.value.exit_status == 143
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # a second one ends the process at once
  assert signal.getsignal(signal.SIGTERM) == before
  with interrupt.sigterm_raises():
    raising = signal.getsignal(signal.SIGTERM)
    with interrupt.StopRequest("x"):
      pass
    assert signal.getsignal(signal.SIGTERM) == raising  # no signal came: SIGTERM raises again
    with interrupt.StopRequest("x") as stop:
      stop._handle(signal.SIGTERM, None)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
  assert signal.getsignal(signal.SIGTERM) == before
  with interrupt.sigterm_raises():  # nested (train.study's around train.run_all's): the outer one restores SIGTERM
    with interrupt.sigterm_raises():
      with interrupt.StopRequest("x") as stop:
        stop._handle(signal.SIGTERM, None)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # not raising again while the stopped run winds down
  assert signal.getsignal(signal.SIGTERM) == before
  with interrupt.sigterm_raises(enabled=False):
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_signal_while_the_command_exits_ends_it_without_a_traceback():
  """`python -m train` and `train.study` leave through `interrupt.exit_process`: a Ctrl-C that arrives while the
  process runs its exit handlers (here one sends it) ends the process at once, where `sys.exit` would print a
  KeyboardInterrupt traceback from inside the handler and exit with the status."""
  code = ("import atexit, os, signal; from train import interrupt; "
          "atexit.register(lambda: os.kill(os.getpid(), signal.SIGINT)); interrupt.exit_process(3)")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                        env={**os.environ, "PYTHONPATH": os.getcwd()})
  assert done.returncode == -signal.SIGINT and "Traceback" not in done.stderr, (done.returncode, done.stderr)


def _corpus_cfg(tmp_path, *overrides):
  corpus = tmp_path / "corpus.txt"
  corpus.write_bytes(TEXT)
  return tiny_cfg(tmp_path, f"data.sources=[{corpus}]", f"data.cache_dir={tmp_path / 'cache'}", "data.workers=1",
                  "data.eval_fraction=0.1", *overrides)


def test_compare_mode_writes_table_and_plot_and_a_rerun_keeps_them(tmp_path, monkeypatch):
  cfg = _corpus_cfg(tmp_path, "run.steps=3", "run.routes=[bf16, mxfp4]")
  rows = train.run_all(cfg)
  assert [r["route"] for r in rows] == ["bf16", "mxfp4"] and all(r["status"] == "ok" for r in rows)
  out = cfg.run.out_dir
  table = open(os.path.join(out, "table.md")).read()
  assert "| bf16 | 3 |" in table and "| mxfp4 | 3 |" in table and "held-out ppl" in table and "n/a" not in table
  assert "| compile | first step |" in table and all(0 < r["compile_s"] <= r["first_step_s"] for r in rows)
  # Each route's memory is its own step's plan, not the process's peak, which held bf16's run under mxfp4's.
  assert [r["peak_kind"] for r in rows] == ["step plan"] * 2 and "(step plan)" in table
  assert os.path.getsize(os.path.join(out, "loss.png")) > 1000
  summary = json.load(open(os.path.join(out, "summary.json")))
  assert summary[1]["route"] == "mxfp4" and summary[1]["eval_loss"] > 0
  records = metrics.read_jsonl(os.path.join(out, "mxfp4", "metrics.jsonl"))
  assert records and {r["route"] for r in records} == {"mxfp4"}

  # A rerun of the finished runs reports their saved results (no training, nothing lost) ...
  monkeypatch.setattr(train, "init_train_state", lambda *a, **k: pytest.fail("a finished run was trained again"))
  assert [r["train_loss"] for r in train.run_all(cfg)] == [r["train_loss"] for r in rows]
  assert open(os.path.join(out, "table.md")).read() == table
  assert json.load(open(os.path.join(out, "summary.json"))) == summary
  # ... and a shorter one stops before any work with one line, leaving them as they were.
  with pytest.raises(UserError, match=r"bf16 holds a run checkpointed at step 3, past run.steps=2"):
    train.run_all(config.replace(cfg, run={"steps": 2, "routes": ("bf16", "nvfp4")}))
  assert open(os.path.join(out, "table.md")).read() == table
  # A single route's run there would overwrite the compare's plot and table with its own: refused too.
  plot = open(os.path.join(out, "loss.png"), "rb").read()
  with pytest.raises(UserError, match=r"holds the loss.png, table.md, summary.json of a compare run \(run.routes\), "
                     r"which a single route's run would overwrite: use another run.out_dir, e.g. .*/run-bf16$"):
    train.run_all(config.replace(cfg, run={"routes": ()}))
  assert open(os.path.join(out, "table.md")).read() == table
  assert open(os.path.join(out, "loss.png"), "rb").read() == plot
  assert not os.path.exists(os.path.join(out, "config.yaml"))


def test_a_compare_run_keeps_a_single_route_runs_outputs(tmp_path, monkeypatch):
  """A compare run (run.routes) into the out_dir of a single route's run wrote its own loss.png, table.md and
  summary.json over that run's: it is refused before any work, in one line naming them, and nothing changes."""
  cfg = _corpus_cfg(tmp_path, "run.steps=3")  # the compare test's bf16 run: the same compiled steps
  train.run_all(cfg)
  out = cfg.run.out_dir
  before = {name: open(os.path.join(out, name), "rb").read() for name in ("loss.png", "table.md", "summary.json")}
  monkeypatch.setattr(data, "load_splits", lambda *a, **k: pytest.fail("the compare run started its work"))
  with pytest.raises(UserError, match=r"run.out_dir='.*/run' holds a single-route run \(ckpt, config.yaml, loss.png, "
                     r"metrics.jsonl, result.json, summary.json, table.md, tb\); a compare run \(run.routes\) "
                     r"would write its own loss.png, table.md, summary.json there: use another run.out_dir, "
                     r"e.g. .*/run-compare$"):
    train.run_all(config.replace(cfg, run={"routes": ("bf16", "mxfp4")}))
  assert {name: open(os.path.join(out, name), "rb").read() for name in before} == before


def test_fewer_held_out_batches_than_asked_are_said_and_recorded(tmp_path, capsys):
  """run.eval_batches beyond what the held-out text holds was cut to that silently (the study configs ask for 16
  of a split that holds 6): the run says so before compiling, and its result records the number it used."""
  cfg = _corpus_cfg(tmp_path, "run.steps=1", "run.eval_batches=50")
  (row,) = train.run_all(cfg)
  err = capsys.readouterr().err
  assert ("[train] warning: run.eval_batches=50, but the 2,311 held-out tokens hold 9 batch(es) of data.batch_size=8 "
          "x data.seq_len=32: the held-out loss is over those 9 (the result's eval_batches); for 50, raise "
          "data.eval_fraction or add data.eval_sources") in err
  assert err.index("warning") < err.index("train step compiled")
  assert row["eval_batches"] == 9
  assert json.load(open(os.path.join(cfg.run.out_dir, train.RESULT_FILE)))["eval_batches"] == 9


def _files(root) -> dict[str, bytes | None]:
  return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def test_a_run_refused_for_too_few_tokens_leaves_the_out_dir_as_it_found_it(tmp_path):
  """data.seq_len too long for the held-out text is refused before anything is written: it left out_dir/LOCK and
  config.yaml (which the next run set aside as an earlier run's output), in compare mode each route's; a resumed
  run's files stay as they were."""
  cfg = _corpus_cfg(tmp_path, "data.seq_len=512", "run.routes=[bf16, mxfp4]")
  with pytest.raises(UserError, match=r"the held-out split has 2,311 tokens, not one batch of data.batch_size=8 x "):
    train.run_all(cfg)
  assert not os.path.exists(cfg.run.out_dir)
  for steps in (None, 2):  # `run` itself: a fresh out_dir, and one it resumes (from step 1 of 2)
    cfg = tiny_cfg(tmp_path, "run.steps=2", "run.ckpt_every=1")
    if steps:
      train.run(cfg, TOKENS, TOKENS[:2000], 257)
      os.remove(os.path.join(cfg.run.out_dir, train.RESULT_FILE))
      shutil.rmtree(os.path.join(cfg.run.out_dir, "ckpt", "2"))
    found = _files(tmp_path)
    with pytest.raises(UserError, match=r"the held-out split has 200 tokens"):
      train.run(cfg, TOKENS, TOKENS[:200], 257)
    assert _files(tmp_path) == found


def test_a_run_checks_the_head_of_each_source_file_once(tmp_path, monkeypatch):
  """The preflight's resolution of the sources (globs, the head of every file checked to be text) was done again
  by load_splits: twice per run. The preflight's result is what the run loads."""
  cfg = _corpus_cfg(tmp_path)
  (tmp_path / "heldout.txt").write_bytes(TEXT[:4000])
  cfg = config.replace(cfg, data={"eval_sources": (str(tmp_path / "heldout.txt"),)})
  checked = []
  check_text = data._check_text
  monkeypatch.setattr(data, "_check_text", lambda path: (checked.append(path), check_text(path)))

  class Tokenizing(Exception):
    pass

  def tokenizing(files, *args, **kwargs):
    raise Tokenizing(files)

  monkeypatch.setattr(data, "build_token_cache", tokenizing)
  with pytest.raises(Tokenizing) as stopped:
    train.run_all(cfg)
  assert sorted(checked) == sorted([*cfg.data.sources, *cfg.data.eval_sources])
  assert stopped.value.args == (list(cfg.data.sources),)


def test_a_run_loads_its_tokenizer_once(tmp_path, monkeypatch):
  """The tokenizer (the GPT-2 ranks take ~0.3 s to load) was loaded by the preflight, by load_splits, by the token
  cache of each split and by the tokenizing of each: up to 6 times per run. The preflight's is the one used."""
  cfg = _corpus_cfg(tmp_path)
  (tmp_path / "heldout.txt").write_bytes(TEXT[:4000])
  cfg = config.replace(cfg, data={"eval_sources": (str(tmp_path / "heldout.txt"),)})
  loads = []
  get_tokenizer = tokenizers.get_tokenizer
  monkeypatch.setattr(tokenizers, "get_tokenizer", lambda *a: (loads.append(a), get_tokenizer(*a))[1])

  class Loaded(Exception):
    pass

  def route_data(cfg, train_tokens, eval_tokens):
    raise Loaded(len(train_tokens), len(eval_tokens))

  monkeypatch.setattr(train, "route_data", route_data)  # the run's first use of its tokens: stop there
  for _ in range(2):  # tokenized, then read from the token cache
    loads.clear()
    with pytest.raises(Loaded) as stopped:
      train.run_all(cfg)
    assert stopped.value.args[1] == 4000 + 1 and loads == [("byte", "")]  # the held-out text and its eos


def test_step_memory_is_the_compiled_steps_plan():
  """XLA's plan of the step (arguments + outputs + temporaries - donated), whatever ran before in the process, or
  the eval step's where that is larger; the process's peak (named so) where no train step was compiled."""
  step = jax.jit(lambda a: (a @ a.T).sum(axis=0), donate_argnums=0)
  x = jnp.ones((256, 512))
  compiled = step.lower(x).compile()
  got, kind = train.step_memory(compiled, jax.devices())
  stats = compiled.memory_analysis()
  assert kind == "step plan" and got == (stats.argument_size_in_bytes + stats.output_size_in_bytes
                                         + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
  assert got >= 256 * 512 * 4
  assert train.step_memory(None, jax.devices())[1] in ("process peak", "process RSS")
  # With the eval step's plan too (it runs between train steps, on the same devices): the larger of them.
  evaluate = jax.jit(lambda a: jnp.tanh(a @ a.T).sum()).lower(jnp.ones((1024, 512))).compile()
  assert metrics.planned_bytes(evaluate) > got
  assert train.step_memory(compiled, jax.devices(), evaluate) == (metrics.planned_bytes(evaluate), "step plan")
  assert train.step_memory(compiled, jax.devices(), None) == (got, "step plan")


def test_compare_mode_fails_when_routes_diverge(tmp_path, monkeypatch, capsys):
  def diverge(cfg, *args, label=None):
    raise progress.NonFiniteLossError(f"[{label}] loss is nan at step 2; stopped. No checkpoint was saved yet in x.")
  monkeypatch.setattr(train, "run", diverge)
  cfg = _corpus_cfg(tmp_path)
  os.makedirs(cfg.run.out_dir)
  open(os.path.join(cfg.run.out_dir, "loss.png"), "wb").close()  # an earlier call's plot is not this one's
  assert main(["--set", f"data.sources={list(cfg.data.sources)}", "--set", f"data.cache_dir={cfg.data.cache_dir}",
               "--set", "data.eval_fraction=0.1", "--set", "data.seq_len=32", "--set", "data.batch_size=8",
               "--set", f"run.out_dir={cfg.run.out_dir}", "--set", "run.routes=[bf16, mxfp4]"]) == EXIT_FAILED_RUN
  err = capsys.readouterr().err
  assert ("python -m train: 2 of 2 route(s) failed: bf16 (loss is nan at step 2); mxfp4 (loss is nan at step 2)"
          in err), err
  assert "loss plot: none" in err and not os.path.exists(os.path.join(cfg.run.out_dir, "loss.png"))


def test_compare_mode_runs_the_other_routes_when_one_fails(tmp_path, monkeypatch, capsys):
  """A route that raises (a bug, a backend that cannot run it) is reported with its traceback and a failed row;
  the routes after it still run (it ended the whole call before, without a table)."""
  ran = []

  def fail(cfg, *args, label=None):
    ran.append(label)
    if label == "bf16":
      raise RuntimeError("a bug in one route")
    raise progress.NonFiniteLossError(f"[{label}] loss is nan at step 2; stopped. No checkpoint was saved yet in x.")
  monkeypatch.setattr(train, "run", fail)
  cfg = _corpus_cfg(tmp_path)
  assert main(["--set", f"data.sources={list(cfg.data.sources)}", "--set", f"data.cache_dir={cfg.data.cache_dir}",
               "--set", "data.eval_fraction=0.1", "--set", "data.seq_len=32", "--set", "data.batch_size=8",
               "--set", f"run.out_dir={cfg.run.out_dir}", "--set", "run.routes=[bf16, mxfp4]"]) == EXIT_FAILED_RUN
  err = capsys.readouterr().err
  assert ran == ["bf16", "mxfp4"]
  assert "[bf16] failed:\nTraceback" in err and "RuntimeError: a bug in one route" in err
  assert ("python -m train: 2 of 2 route(s) failed: bf16 (raised RuntimeError); mxfp4 (loss is nan at step 2)"
          in err), err
  assert os.path.exists(os.path.join(cfg.run.out_dir, "table.md"))


def test_compile_ticker_reports_while_it_lasts(capsys):
  with progress.compile_ticker("mxfp4", every=0.05) as elapsed:
    time.sleep(0.3)
  assert elapsed() >= 0.3
  err = capsys.readouterr().err.splitlines()
  assert err[0].startswith("[mxfp4] compiling the train step: ") and len(err) >= 3
  assert err[-1].startswith("[mxfp4] train step compiled in 0.")
  with progress.compile_ticker("bf16", enabled=False):
    pass
  assert capsys.readouterr().err == ""
  with pytest.raises(ValueError), progress.compile_ticker("fp8"):  # a failure is not reported as compiled
    raise ValueError("no backend runs it")
  assert capsys.readouterr().err.startswith("[fp8] train step's first call failed after 0.")
  # A compile begun ahead (`CompiledOnFirstCall.compile_ahead`): its seconds from its start, its own time last.
  with progress.compile_ticker("nvfp4", every=0.05, since=time.time() - 100, took=lambda: 42.0):
    time.sleep(0.12)
  err = capsys.readouterr().err.splitlines()
  assert err[0] == "[nvfp4] compiling the train step: 100 s" and err[-1] == "[nvfp4] train step compiled in 42.0 s"


def test_main_sets_xla_flags_and_the_compilation_cache(tmp_path, monkeypatch):
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  monkeypatch.setattr(train, "run_all", lambda cfg: [])
  cfg = _corpus_cfg(tmp_path)
  args = ["--set", f"data.sources={list(cfg.data.sources)}", "--set", f"run.out_dir={cfg.run.out_dir}"]
  saved = jax.config.jax_compilation_cache_dir
  try:
    assert main(args) == 0
    assert os.environ["XLA_FLAGS"] == " ".join(platform.DEFAULT_XLA_FLAGS)
    assert jax.config.jax_compilation_cache_dir == os.environ["FP4JAX_CACHE"]  # run.compile_cache: auto
    assert main(args + ["--set", "run.compile_cache=none"]) == 0
    assert jax.config.jax_compilation_cache_dir is None
    assert main(args + ["--set", f"run.compile_cache={tmp_path / 'mine'}"]) == 0
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
  finally:
    jax.config.update("jax_compilation_cache_dir", saved)


def test_the_compiled_steps_do_not_depend_on_the_seed(tmp_path):
  """The keys are arguments of the jitted steps: runs that differ only in run.seed (a study's seeds) lower to
  the same program, so the second one finds the first one's persistent-cache entry. A key closed over by the
  step was a constant in it, so every seed of a keyed route (SR, Hadamard signs) compiled afresh."""
  texts = []
  for seed in (0, 1):
    cfg = tiny_cfg(tmp_path, "route=mxfp4", "kernels.quantizer=xla", f"run.seed={seed}")  # SR: keyed
    ts = train.init_train_state(cfg, 257, build.make_mesh((1, 1), jax.devices()[:1]))
    batch = jax.ShapeDtypeStruct((cfg.data.batch_size, cfg.data.seq_len + 1), jnp.int32)
    step, evaluate = ts.train_step, ts.eval_step
    texts.append((step.jitted.lower(ts.state, batch, jnp.int32(0), *step.bound).as_text(),
                  evaluate.jitted.lower(ts.state, batch, *evaluate.bound).as_text()))
  assert texts[0] == texts[1]


def test_microbatches_give_the_whole_batch_update():
  """data.microbatches splits a step's batch into sequential passes whose gradients are averaged: the same
  losses and parameters as one pass, up to the order of float32 sums (same bounds as the sharded test below);
  a lost or doubled microbatch would move the loss by > 1e-3."""
  rng = np.random.default_rng(0)
  batches = [rng.integers(0, 257, (8, 33)).astype(np.int32) for _ in range(3)]
  mesh = build.make_mesh((1, 1), jax.devices()[:1])
  out = {m: tiny_steps(batches, mesh, m) for m in (1, 2, 4)}
  for microbatches in (2, 4):
    np.testing.assert_allclose(out[microbatches]["losses"], out[1]["losses"], rtol=2e-6, err_msg=str(microbatches))
    got, want = out[microbatches]["params"], out[1]["params"]
    assert np.isclose(got, want, rtol=1e-4, atol=1e-6).mean() > 1 - 1e-4, microbatches
    assert np.abs(got - want).max() <= 3 * 2 * 1e-3, microbatches


def test_microbatches_draw_their_own_keys():
  """Under a keyed route (mxfp4's SR dY) each microbatch draws its own bits: two microbatches holding the same
  rows give a different gradient than one pass would only through those draws, and the step still runs."""
  cfg = config.from_dict({"model": {"preset": "tiny", "dtype": "float32"}, "route": "mxfp4",
                          "kernels": {"quantizer": "xla"},
                          "data": {"seq_len": 32, "batch_size": 4, "microbatches": 2},
                          "optim": {"lr": 1e-3, "warmup": 0}, "run": {"steps": 2}})
  ts = train.init_train_state(cfg, 257, build.make_mesh((1, 1), jax.devices()[:1]))
  model, _ = nnx.merge(ts.graphdef, ts.state)
  row = np.random.default_rng(1).integers(0, 257, (1, 33)).astype(np.int32)
  batch = jnp.asarray(np.repeat(row, 4, axis=0))  # microbatch 0 = rows 0, 2; microbatch 1 = rows 1, 3: equal
  key = jax.random.key(3)
  _, split = objective.loss_and_grads(model, batch, key, 2)
  _, whole = objective.loss_and_grads(model, batch[:2], jax.random.fold_in(key, 0), 1)
  _, again = objective.loss_and_grads(model, batch[:2], jax.random.fold_in(key, 1), 1)
  mean = jax.tree.map(lambda a, b: (a + b) / 2, whole, again)
  for got, want in zip(jax.tree.leaves(split), jax.tree.leaves(mean)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)
  assert any(not np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(again)))  # the two draws differ


def test_eval_runs_in_the_train_steps_microbatches():
  """The eval step splits its batch into data.microbatches passes as the train step does: the whole batch's loss
  up to float32 summation order, from a program that XLA plans on one microbatch's activations (it ran the whole
  batch at once, so a batch that fit only in microbatches could run out of memory at the first eval)."""
  batch = np.random.default_rng(0).integers(0, 257, (8, 33)).astype(np.int32)
  mesh = build.make_mesh((1, 1), jax.devices()[:1])
  loss, temp = {}, {}
  for m in (1, 4):
    cfg = config.from_dict({"model": {"preset": "tiny", "dtype": "float32"}, "run": {"steps": 2},
                            "data": {"seq_len": 32, "batch_size": 8, "microbatches": m}})
    ts = train.init_train_state(cfg, 257, mesh)
    loss[m] = float(ts.eval_step(ts.state, train.to_global(batch, ts.batch_sharding)))
    temp[m] = ts.eval_step.compiled.memory_analysis().temp_size_in_bytes
  np.testing.assert_allclose(loss[4], loss[1], rtol=2e-6)
  # Planned on one microbatch: at least 3/4 of the whole batch's float32 logits [8, 32, 257] less temporary memory
  # (0.35 MB less on CPU; the same program before). Not a ratio of the totals: on a GPU both hold cuBLAS's 32 MiB
  # workspace (0.99 there).
  assert temp[1] - temp[4] > 0.75 * 8 * 32 * 257 * 4, temp


_SHARDED = textwrap.dedent("""
  import json, sys
  import jax, numpy as np
  sys.path.insert(0, "tests/train")
  from tiny_steps import tiny_steps
  from train import build
  out = {}
  # "..._mb2": 16 sequences in 2 microbatches of 8, each split over the 8 devices. "..._scanned": the blocks as
  # one loop (fp4jax.nn.scan.run_layers) over sharded stacked parameters.
  for name, shape, devs, batch, microbatches, scan in [
      ("single", (1, 1), jax.devices()[:1], 8, 1, "auto"), ("fsdp8", (1, 8), None, 8, 1, "auto"),
      ("data2_fsdp4", (2, 4), None, 8, 1, "auto"), ("single_16", (1, 1), jax.devices()[:1], 16, 1, "auto"),
      ("data2_fsdp4_mb2", (2, 4), None, 16, 2, "auto"), ("data2_fsdp4_scanned", (2, 4), None, 8, 1, True)]:
    batches = [np.random.default_rng(i).integers(0, 257, (batch, 33)).astype(np.int32) for i in range(3)]
    run = tiny_steps(batches, build.make_mesh(shape, devs), microbatches, scan)
    out[name] = dict(run, params=run["params"].tolist())
  json.dump(out, sys.stdout)
""")


def test_sharded_step_matches_single_device():
  out = json.loads(cpu_devices.run(_SHARDED, 8, timeout=240).stdout)
  assert any("fsdp" in s for s in out["fsdp8"]["specs"]), out["fsdp8"]["specs"]
  for name, ref in (("fsdp8", out["single"]), ("data2_fsdp4", out["single"]),
                    ("data2_fsdp4_mb2", out["single_16"]), ("data2_fsdp4_scanned", out["single"])):
    # Sharding only reorders float32 sums (the batch mean, gradient reductions across shards); all-gathers are
    # exact. That moves the loss by a few float32 ulps of each sum (~1e-7 relative); a wrong shard or a
    # dropped slice moves it by > 1e-3.
    np.testing.assert_allclose(out[name]["losses"], ref["losses"], rtol=2e-6, err_msg=name)
    # Parameters after 3 AdamW steps (lr 1e-3): the update lr * m / (sqrt(v) + eps) is ~lr in size even for a
    # near-zero gradient, whose reordered sum can differ relatively a lot. So: nearly all elements agree to
    # 1e-4 relative, and none differs by more than the 2 * lr per step that such a flip can cause.
    got, want = np.asarray(out[name]["params"]), np.asarray(ref["params"])
    close = np.isclose(got, want, rtol=1e-4, atol=1e-6)
    assert close.mean() > 1 - 1e-4, (name, int((~close).sum()))
    assert np.abs(got - want).max() <= 3 * 2 * 1e-3, name


_SHARDED_FP4 = _SHARDED.split("out = {}")[0] + """
from fp4jax.ops.quantize.pallas import rows
split = []  # launches run on each device's rows, counted while the steps trace
on_row_shards = rows.on_row_shards
rows.on_row_shards = lambda *a, **k: split.append(1) or on_row_shards(*a, **k)
batches = [np.random.default_rng(i).integers(0, 257, (8, 33)).astype(np.int32) for i in range(2)]
settings = dict(route="mxfp4", model={"dtype": "bfloat16"}, kernels={"quantizer": "interpret"})
out = {}
for name, shape, devs in [("single", (1, 1), jax.devices()[:1]), ("data2_fsdp4", (2, 4), None)]:
  split.clear()
  out[name] = {"losses": tiny_steps(batches, build.make_mesh(shape, devs), 1, "auto", **settings)["losses"],
               "split": len(split)}
json.dump(out, sys.stdout)
"""


def test_sharded_fp4_step_quantizes_each_devices_tokens():
  """An mxfp4 step with the Pallas kernels (interpret mode) on a 2 x 4 mesh: its first loss is the one-device
  loss up to the order of the batch mean (each device quantizes its own tokens with the whole batch's bits,
  `fp4jax.Impl.token_axes`); the second follows a gradient summed across devices in another order."""
  out = json.loads(cpu_devices.run(_SHARDED_FP4, 8, timeout=600).stdout)
  assert out["single"]["split"] == 0 and out["data2_fsdp4"]["split"] > 0, out
  np.testing.assert_allclose(out["data2_fsdp4"]["losses"][0], out["single"]["losses"][0], rtol=2e-6)
  np.testing.assert_allclose(out["data2_fsdp4"]["losses"][1], out["single"]["losses"][1], rtol=1e-2)


def test_lr_schedules():
  o = config.OptimConfig(lr=1.0, warmup=10, min_lr_ratio=0.1, schedule="wsd", decay_fraction=0.2)
  wsd = objective.lr_schedule(o, 100)
  np.testing.assert_allclose([wsd(0), wsd(5), wsd(10), wsd(79), wsd(80), wsd(90), wsd(100)],
                             [0.0, 0.5, 1.0, 1.0, 1.0, 0.55, 0.1], atol=1e-6)
  cos = objective.lr_schedule(config.replace(config.Config(), optim={"lr": 1.0, "warmup": 10, "min_lr_ratio": 0.1}
                                         ).optim, 100)
  np.testing.assert_allclose([cos(10), cos(55), cos(100)], [1.0, 0.55, 0.1], atol=1e-6)
  with pytest.raises(config.ConfigError, match=r"optim.schedule='linear' must be one of \['cosine', 'wsd'\]"):
    objective.lr_schedule(config.OptimConfig(schedule="linear"), 10)



def test_a_signal_is_handled_while_the_first_step_compiles():
  """The first call compiles on a worker thread (`progress.on_worker_thread`) while the main thread waits in short
  joins: a signal's handler runs at once, where a compile on the main thread held it (and a second Ctrl-C,
  meant to stop at once) until the compile ended. The worker's result and exceptions come back."""
  class Stop(Exception):
    pass

  def handler(signum, frame):
    raise Stop

  previous = signal.signal(signal.SIGUSR1, handler)
  try:
    t0 = time.monotonic()
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1)).start()
    with pytest.raises(Stop):
      progress.on_worker_thread(lambda: time.sleep(5))  # a compile: the GIL released, the main thread waiting
    assert time.monotonic() - t0 < 2
  finally:
    signal.signal(signal.SIGUSR1, previous)
  assert progress.on_worker_thread(lambda: 42) == 42
  with pytest.raises(ZeroDivisionError):
    progress.on_worker_thread(lambda: 1 / 0)


def test_steps_compiled_ahead_are_taken_by_their_first_calls():
  """`CompiledOnFirstCall.compile_ahead` compiles on a worker thread and returns at once; the first call waits for
  that program and runs it; a first call of other shapes than compiled for compiles its own; an error comes out
  of the failed program's first call, and the programs after it compile at theirs."""
  mesh = build.make_mesh((1, 1), jax.devices()[:1])
  traced = []

  def program(fn):
    def traced_fn(x, y):
      traced.append(x.shape)  # once per trace
      return fn(x, y)
    return progress.CompiledOnFirstCall(jax.jit(traced_fn), jnp.float32(2), threads=0, directory=None, mesh=mesh)

  double, minus = program(lambda x, y: x * y), program(lambda x, y: x - y)
  spec = jax.ShapeDtypeStruct((4,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  progress.CompiledOnFirstCall.compile_ahead([(double, (spec,)), (minus, (spec,))])
  minus.wait()  # after double's, on the one worker
  assert double.started <= minus.started and double.compile_s > 0 and traced == [(4,), (4,)]
  x = jax.device_put(jnp.arange(4.0), jax.devices()[0])
  np.testing.assert_array_equal(double(x), 2 * np.arange(4.0))
  np.testing.assert_array_equal(minus(x), np.arange(4.0) - 2)
  assert traced == [(4,), (4,)]  # taken, not traced again
  other = program(lambda x, y: x * y)  # compiled ahead for [4], first called with [3]
  progress.CompiledOnFirstCall.compile_ahead([(other, (spec,))])
  np.testing.assert_array_equal(other(jnp.arange(3.0)), 2 * np.arange(3.0))
  assert traced[-2:] == [(4,), (3,)]

  failing, after = program(lambda x, y: x @ y), program(lambda x, y: x + y)  # a matmul of a scalar: refused
  progress.CompiledOnFirstCall.compile_ahead([(failing, (spec,)), (after, (spec,))])
  with pytest.raises(ValueError, match="matmul input operand 1 must have ndim at least 1"):
    failing(x)
  np.testing.assert_array_equal(after(x), np.arange(4.0) + 2)


def test_a_step_traces_with_old_objects_frozen():
  """`CompiledOnFirstCall` traces its program inside `platform.old_objects_frozen` (a step's tracing makes enough
  objects to start full collections of the whole heap) and leaves nothing frozen; its program runs."""
  gc.unfreeze()  # the interpreter's start-up objects, if it froze them: so that the compile's freeze shows
  seen = []

  def fn(x, y):
    seen.append(gc.get_freeze_count())
    return x * y

  program = progress.CompiledOnFirstCall(jax.jit(fn), jnp.float32(2), threads=0, directory=None,
                                         mesh=build.make_mesh((1, 1), jax.devices()[:1]))
  np.testing.assert_array_equal(program(jnp.arange(4.0)), 2 * np.arange(4.0))
  assert seen and seen[0] > 0, seen
  assert gc.get_freeze_count() == 0


def test_start_jax_sets_the_apps_xla_flags_and_jax_options_first(monkeypatch):
  """`python -m train` sets XLA's flags and JAX's options (the user's environment winning, `platform`'s tests)
  before the compilation cache; a stand-in records the order."""
  calls = []
  monkeypatch.setattr(platform, "set_xla_flags", lambda: calls.append("xla flags"))
  monkeypatch.setattr(platform, "set_jax_options", lambda: calls.append("jax options"))
  monkeypatch.setattr(main_lib, "enable_compilation_cache", lambda setting, what: calls.append(f"cache {setting}"))
  monkeypatch.delenv("FP4JAX_DISTRIBUTED", raising=False)
  cfg = types.SimpleNamespace(run=types.SimpleNamespace(compile_cache="off"))
  assert main_lib.start_jax(cfg) is jax
  assert calls == ["xla flags", "jax options", "cache off"]


def _compiling_ahead() -> bool:
  """Whether a `compile_ahead` worker thread is still running."""
  return any(t.name == "fp4jax-compile-ahead" and t.is_alive() for t in threading.enumerate())


def test_an_abandoned_compile_ahead_drops_the_jobs_not_begun():
  """`compile_ahead`'s abandon (a set-up that failed) waits for the compile in progress and drops the jobs after
  it: nothing of a failed run compiles on; a dropped program's first call compiles it."""
  mesh = build.make_mesh((1, 1), jax.devices()[:1])
  release = threading.Event()

  def slow(x, y):
    release.wait(10)  # while tracing: abandon is called before this compile can end
    return x * y

  first, second = (progress.CompiledOnFirstCall(jax.jit(fn), jnp.float32(2), threads=0, directory=None, mesh=mesh)
                   for fn in (slow, lambda x, y: x - y))
  spec = jax.ShapeDtypeStruct((4,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  abandon = progress.CompiledOnFirstCall.compile_ahead([(first, (spec,)), (second, (spec,))])
  threading.Timer(0.3, release.set).start()
  abandon()
  assert not _compiling_ahead()
  assert first.compiled is not None and second.compiled is None and second.started is None
  x = jax.device_put(jnp.arange(4.0), jax.devices()[0])
  np.testing.assert_array_equal(second(x), np.arange(4.0) - 2)  # compiled at its first call


def test_a_failed_set_up_leaves_no_compile_running(tmp_path, monkeypatch):
  """An initializer that fails (out of memory, say) ends the run's set-up only once the steps' compile begun ahead
  has ended, the eval step's dropped: a study's next run does not compile beside it."""

  def compile_initializer(*args, **kwargs):
    raise RuntimeError("RESOURCE_EXHAUSTED: the initializer")

  monkeypatch.setattr(platform, "compile_initializer", compile_initializer)
  built = []
  real_ahead = progress.CompiledOnFirstCall.compile_ahead
  monkeypatch.setattr(progress.CompiledOnFirstCall, "compile_ahead",
                      staticmethod(lambda jobs: built.append(jobs) or real_ahead(jobs)))
  with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
    train.run(tiny_cfg(tmp_path), TOKENS, TOKENS[:2000], 257)
  assert not _compiling_ahead()
  (train_step, _), (eval_step, _) = built[0]
  assert train_step.compiled is not None and eval_step.started is None


def test_a_failed_first_step_leaves_no_compile_running(tmp_path, monkeypatch):
  """A first step that fails (out of memory, say) leaves the run once the eval step's compile begun ahead has
  ended or been dropped."""
  real_init = train.init_train_state

  def init(*args, **kwargs):
    ts = real_init(*args, **kwargs)

    def failing(*args):
      raise RuntimeError("RESOURCE_EXHAUSTED: the first step")

    return dataclasses.replace(ts, train_step=failing)

  monkeypatch.setattr(train, "init_train_state", init)
  with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
    train.run(tiny_cfg(tmp_path), TOKENS, TOKENS[:2000], 257)
  assert not _compiling_ahead()


def test_a_run_compiles_its_steps_while_the_state_initializes(tmp_path, monkeypatch):
  """The train step's compile begins before the state's initializer runs, and the eval step's after it on the
  same worker; the table's compile time is the train step's, its first step time counts from the set-up."""
  from fp4jax import platform
  initialized = []
  real = platform.compile_initializer

  def compile_initializer(*args, **kwargs):
    fn = real(*args, **kwargs)
    return lambda: (fn(), initialized.append(time.time()))[0]

  monkeypatch.setattr(platform, "compile_initializer", compile_initializer)
  built = []
  real_init = train.init_train_state
  monkeypatch.setattr(train, "init_train_state", lambda *a, **k: built.append(real_init(*a, **k)) or built[-1])
  row = train.run(tiny_cfg(tmp_path), TOKENS, TOKENS[:2000], 257)
  ts, = built
  assert ts.train_step.started < initialized[0] and ts.train_step.started <= ts.eval_step.started
  assert row["compile_s"] == ts.train_step.compile_s and 0 < row["compile_s"] < row["first_step_s"]


def test_logging_is_left_out_of_the_throughput(tmp_path):
  """A slow metrics write (the process's first one took 0.78 s on an H100, which only the first route of a compare
  run paid) counts as a pause, as an evaluation or a checkpoint does."""
  cfg = tiny_cfg(tmp_path, "run.log_every=2")

  class SlowLog:
    def log(self, *args, **kwargs):
      time.sleep(0.2)

  rec = progress.StepRecorder(cfg, "bf16", None, SlowLog(), metrics.ProgressBar(8, "bf16", enabled=False))
  t0 = time.time()
  for step in range(1, 7):
    rec.record(step, jnp.float32(1.0), jnp.float32(1.0))
  assert time.time() - t0 >= 0.6  # three logs slept
  assert rec.rate > rec.tokens_per_step * 5 / 0.2, rec.rate  # 5 timed steps in far less than one sleep


def test_a_logged_step_still_counts_in_the_throughput(tmp_path):
  """Step t's record, read while step t + 1 runs as the loop does, logs the learning rate: eager device ops queued
  behind step t + 1, so reading it waits for that step, which is training, not a pause (counted as one, each
  logged step left the next one out of the throughput: 11% more tokens/s at log_every 10, 70x at 1 on a CPU)."""
  cfg = tiny_cfg(tmp_path, "run.log_every=1")

  class NoLog:
    def log(self, *args, **kwargs):
      pass

  step = jax.jit(lambda x: jnp.tanh(x @ x) @ x)  # ~30 ms on a CPU core
  x = jnp.full((1024, 1024), 1e-3, jnp.float32)
  step(x).block_until_ready()
  rec = progress.StepRecorder(cfg, "bf16", None, NoLog(), metrics.ProgressBar(8, "bf16", enabled=False))
  pending = None
  for i in range(1, 7):
    loss = step(x).sum()  # dispatched; the previous step recorded while it runs
    if pending:
      rec.record(*pending)
      if i == 2:
        t0 = time.time()  # the timing starts at the first record
    pending = (i, loss, loss)
  rec.record(*pending)
  wall = time.time() - t0
  assert rec.rate < 2 * rec.tokens_per_step * 5 / wall, (rec.rate, rec.tokens_per_step * 5 / wall)
