"""Run outputs: metrics.jsonl records, TensorBoard event files read back by TensorBoard's own reader."""

from __future__ import annotations

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from train import metrics


def test_tensorboard_events_read_back(tmp_path):
  log = metrics.MetricsLogger(str(tmp_path))
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
  assert records[0] == {"step": 1, "kind": "train", "loss": 2.5, "lr": 1e-3}
