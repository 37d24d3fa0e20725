"""One run per out_dir: a second one fails at once naming the holder; a dead holder's lock is taken over."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys

import pytest

from train import data, lock
from train.errors import UserError
from train.main import EXIT_USER_ERROR, main


def test_second_run_refused_then_free_after_release(tmp_path):
  first = lock.RunLock(str(tmp_path))
  first.acquire()
  with pytest.raises(UserError, match=rf"{tmp_path} is in use by another run \(pid \d+ on {socket.gethostname()}, "
                                      r"since .*\); wait for it to finish or use another run.out_dir"):
    lock.RunLock(str(tmp_path)).acquire()
  first.release()
  log = io.StringIO()
  with lock.RunLock(str(tmp_path), log=log):
    pass
  assert log.getvalue() == ""  # a released lock is free, not stale


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  (tmp_path / "LOCK").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "x"}))
  log = io.StringIO()
  with lock.RunLock(str(tmp_path), log=log) as held:
    assert json.loads((tmp_path / "LOCK").read_text())["pid"] != dead.pid
  assert f"taking over the stale lock {held.path} of pid {dead.pid}" in log.getvalue()
  (tmp_path / "LOCK").write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "x"}))
  with pytest.raises(UserError, match="records a run of pid 1 on host elsewhere, which cannot be checked"):
    lock.RunLock(str(tmp_path)).acquire()


@pytest.mark.parametrize("content", ["12345", "[1, 2]", "garbage", "{bad"])
def test_a_lock_file_without_a_record_is_taken_over_when_no_process_holds_it(tmp_path, content):
  """A LOCK holding no record of ours (a bare pid, a list: an AttributeError traceback before; text: refused
  for good, as "pid ? on host ?") is free when flock says no process holds it."""
  (tmp_path / "LOCK").write_text(content)
  log = io.StringIO()
  with lock.RunLock(str(tmp_path), log=log) as held:
    assert json.loads((tmp_path / "LOCK").read_text())["host"] == socket.gethostname()
  assert f"taking over {held.path}, which held no lock record ({content!r})" in log.getvalue()


def test_cli_refuses_a_busy_out_dir_at_once(tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(data, "load_splits", lambda *a, **k: pytest.fail("trained on a locked out_dir"))
  with lock.RunLock(str(tmp_path / "run")):
    assert main(["--config", "configs/cpu_compare.yaml", "--set", f"run.out_dir={tmp_path / 'run'}"]) == \
        EXIT_USER_ERROR
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "is in use by another run (pid" in err, err


def test_compare_mode_also_holds_each_routes_directory(tmp_path, capsys, monkeypatch):
  """Compare mode trains into out_dir/<route>, which a single-route run may name as its own out_dir: a run
  there holds it, so the compare run is refused at once (both trained into it side by side before)."""
  monkeypatch.setattr(data, "load_splits", lambda *a, **k: pytest.fail("trained into a busy route directory"))
  with lock.RunLock(str(tmp_path / "run" / "mxfp4")):
    assert main(["--config", "configs/cpu_compare.yaml", "--set", f"run.out_dir={tmp_path / 'run'}"]) == \
        EXIT_USER_ERROR
  err = capsys.readouterr().err.strip()
  assert f"{tmp_path / 'run' / 'mxfp4'} is in use by another run" in err, err
  assert _tree(tmp_path) == ["run", "run/mxfp4", "run/mxfp4/LOCK"]  # as the call found it: the holder's LOCK only


def test_a_lock_taken_on_a_file_removed_meanwhile_is_taken_again_on_the_new_one(tmp_path, monkeypatch):
  """A refused run removes the LOCK it made while holding it (`release(remove=True)`): a process that opened that
  file just before takes its lock once it is free, on a file no longer in the directory, which would not keep out
  the next run; it opens the new one instead."""
  flock, calls = lock.fcntl.flock, []

  def removed_first(fd, operation):
    if not calls:  # between this process's open and its flock: the file removed, and another made
      (tmp_path / "LOCK").unlink()
      (tmp_path / "LOCK").write_text("")
    calls.append(fd)
    return flock(fd, operation)

  monkeypatch.setattr(lock.fcntl, "flock", removed_first)
  with lock.RunLock(str(tmp_path)) as held:
    assert len(calls) == 2 and os.path.samestat(os.fstat(held._fd), os.stat(held.path))
  monkeypatch.undo()
  held = lock.RunLock(str(tmp_path))
  held.acquire()
  assert not held.created
  held.release(remove=True)  # not made by this lock: kept
  assert (tmp_path / "LOCK").read_text() == ""


def _tree(root) -> list[str]:
  return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_refused_run_leaves_the_out_dir_as_it_found_it(tmp_path, capsys, monkeypatch):
  """A compare run refused before any route runs (here: out_dir holds a single-route run, or the data is refused)
  removes the folders and LOCK files it made, and only those; it left out_dir/LOCK and out_dir/<route>/LOCK
  behind, in folders of their own."""
  monkeypatch.setattr(data, "load_splits", lambda *a, **k: pytest.fail("trained in a refused run"))
  single = tmp_path / "single"
  single.mkdir()
  (single / "metrics.jsonl").write_text("")
  (single / "bf16").mkdir()  # a folder of the user's, which the compare run would use as its route's
  (single / "LOCK").write_text("")  # left by the single-route run: not made by the compare run, so kept
  found = _tree(tmp_path)
  compare = ["--config", "configs/cpu_compare.yaml", "--set"]
  assert main(compare + [f"run.out_dir={single}"]) == EXIT_USER_ERROR
  assert "holds a single-route run (metrics.jsonl)" in capsys.readouterr().err
  assert _tree(tmp_path) == found

  def refused(*args, **kwargs):
    raise UserError("data refused")

  monkeypatch.setattr(data, "load_splits", refused)  # the last check before the routes run, once all is locked
  assert main(compare + [f"run.out_dir={tmp_path / 'new' / 'run'}"]) == EXIT_USER_ERROR
  assert capsys.readouterr().err.strip() == "python -m train: error: data refused"
  assert _tree(tmp_path) == found


def test_a_run_stopped_before_its_first_step_leaves_the_out_dir_as_it_found_it(tmp_path, capsys, monkeypatch):
  """Ctrl-C after the call has locked its directories and loaded the data, before the first step (here while the
  first route builds its state): the LOCK files and folders the call made are removed, as for a refused run (an
  empty LOCK was left behind); what was there before stays."""
  from train import train
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("def add(a, b):\n    return a + b\n\n" * 300)
  root = tmp_path / "out"
  (root / "old").mkdir(parents=True)
  (root / "old" / "LOCK").write_text("")  # an earlier run's: kept

  def stopped(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(train, "init_train_state", stopped)
  found = _tree(root)
  common = ["--set", "model.dtype=float32", "--set", "data.seq_len=32", "--set", "data.batch_size=8", "--set",
            f"data.sources=[{corpus}]", "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "data.workers=1",
            "--set", "data.eval_fraction=0.1", "--set", "run.eval_batches=1"]
  for out_dir, routes in ((root / "new" / "run", "[bf16, mxfp4]"), (root / "old", "[]")):
    assert main(common + ["--set", f"run.out_dir={out_dir}", "--set", f"run.routes={routes}"]) == 130
    assert "interrupted outside the training steps" in capsys.readouterr().err
    assert _tree(root) == found


def test_sigterm_before_the_first_step_leaves_the_out_dir_as_it_found_it(tmp_path):
  """SIGTERM (a scheduler's preemption, `timeout`) before the first step, here while the route builds its state:
  as for Ctrl-C, the LOCK file and folders the call made are removed, one line says so and the exit status is 143
  (SIGTERM's default action ended the process there and left its LOCK behind). A process of its own: the
  signal's default action would end pytest."""
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("def add(a, b):\n    return a + b\n\n" * 300)
  root = tmp_path / "out"
  (root / "old").mkdir(parents=True)
  (root / "old" / "LOCK").write_text("")  # an earlier run's: kept
  found = _tree(root)
  code = ("import os, signal, sys; from train import train; from train.main import main; "
          "train.init_train_state = lambda *a, **k: os.kill(os.getpid(), signal.SIGTERM); "
          "sys.exit(main(sys.argv[1:]))")
  sets = ["model.dtype=float32", "data.seq_len=32", "data.batch_size=8", f"data.sources=[{corpus}]",
          f"data.cache_dir={tmp_path / 'cache'}", "data.workers=1", "data.eval_fraction=0.1", "run.eval_batches=1",
          f"run.out_dir={root / 'new' / 'run'}"]
  done = subprocess.run([sys.executable, "-c", code] + [a for s in sets for a in ("--set", s)], capture_output=True,
                        text=True, timeout=300, env={**os.environ, "PYTHONPATH": os.getcwd()})
  assert done.returncode == 143, (done.returncode, done.stderr)
  assert done.stderr.splitlines()[-1] == ("python -m train: stopped by SIGTERM outside the training steps: no "
                                          "checkpoint was written (what earlier steps and routes saved is kept)")
  assert _tree(root) == found
