"""Run outputs: metrics.jsonl records, TensorBoard event files read back by TensorBoard's own reader."""

from __future__ import annotations

import io
import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from train import metrics


def test_tensorboard_events_read_back(tmp_path):
  log = metrics.MetricsLogger(str(tmp_path), "nvfp4")
  log.log(1, "train", {"loss": 2.5, "lr": 1e-3})
  log.log(300, "train", {"loss": 1.25})
  log.log(300, "eval", {"loss": 3.0})
  log.close()
  acc = EventAccumulator(str(tmp_path / "tb"))
  acc.Reload()
  assert sorted(acc.Tags()["scalars"]) == ["eval/loss", "train/loss", "train/lr"]
  assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 2.5), (300, 1.25)]
  assert acc.Scalars("train/lr")[0].value == pytest.approx(1e-3)
  records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert records[0] == {"step": 1, "kind": "train", "route": "nvfp4", "loss": 2.5, "lr": 1e-3}


def test_resume_replaces_the_steps_it_runs_again(tmp_path):
  """A run resumed from its step-5 checkpoint logs steps 6.. again: metrics.jsonl and TensorBoard both show the
  second run's values from step 6 on, once, and keep the first run's steps 1-5."""
  first = metrics.MetricsLogger(str(tmp_path), "mxfp4")
  for step in range(1, 9):
    first.log(step, "train", {"loss": float(step)})
  first.close()
  again = metrics.MetricsLogger(str(tmp_path), "mxfp4", after=5)
  for step in range(6, 8):
    again.log(step, "train", {"loss": 10.0 * step})
  again.close()
  expected = [(s, float(s)) for s in range(1, 6)] + [(6, 60.0), (7, 70.0)]
  acc = EventAccumulator(str(tmp_path / "tb"))
  acc.Reload()
  assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == expected
  assert [(r["step"], r["loss"]) for r in metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))] == expected


def test_a_torn_last_line_is_dropped_on_resume(tmp_path):
  """A process stopped mid-write leaves a torn last line in metrics.jsonl: resuming and reading drop it (they
  raised a JSONDecodeError, which blocked the resume)."""
  first = metrics.MetricsLogger(str(tmp_path), "mxfp4")
  for step in range(1, 4):
    first.log(step, "train", {"loss": float(step)})
  first.close()
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 4, "kind": "tra')
  assert [r["step"] for r in metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))] == [1, 2, 3]
  again = metrics.MetricsLogger(str(tmp_path), "mxfp4", after=3)
  again.log(4, "train", {"loss": 4.0})
  again.close()
  assert [r["step"] for r in metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))] == [1, 2, 3, 4]


class _Terminal(io.StringIO):
  def isatty(self) -> bool:
    return True


def test_progress_plain_lines_unless_a_terminal():
  log = io.StringIO()
  bar = metrics.ProgressBar(12, "mxfp4", stream=log, every=5)
  for step in range(1, 13):
    bar.update(step, 2.0, 1000.0, 3.0)
  bar.close()
  lines = log.getvalue().splitlines()
  assert "\r" not in log.getvalue() and [l.split("| ")[1].split()[0] for l in lines] == ["5/12", "10/12", "12/12"]
  tty = _Terminal()
  bar = metrics.ProgressBar(12, "mxfp4", stream=tty, every=5)
  for step in range(1, 13):
    bar.update(step, 2.0, 1000.0, 3.0)
  assert tty.getvalue().count("\r") == 12


def test_two_set_asides_within_a_second_keep_both(tmp_path, monkeypatch):
  """Each set-aside gets its own previous-<time> folder, also when the clock shows the same second (a study
  clearing a scratch run, then the run setting aside what it finds)."""
  monkeypatch.setattr(metrics.time, "strftime", lambda fmt: "20261205-200000")
  for text in ("first", "second"):
    (tmp_path / "metrics.jsonl").write_text(text)
    metrics.set_aside(str(tmp_path), log=io.StringIO())
  asides = sorted(p.name for p in tmp_path.iterdir())
  assert asides == ["previous-20261205-200000", "previous-20261205-200000-2"]
  assert [(tmp_path / a / "metrics.jsonl").read_text() for a in asides] == ["first", "second"]
