"""Run output: a one-line progress bar on stderr, JSONL + TensorBoard metrics, a loss plot and a summary table."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Sequence, TextIO

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from train.errors import UserError


def _fmt_duration(s: float) -> str:
  s = int(max(s, 0))
  return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _record(line: str) -> dict | None:
  """A metrics.jsonl line's record; None for a blank line or a torn one (a process stopped mid-write)."""
  try:
    record = json.loads(line)
  except json.JSONDecodeError:
    return None
  return record if isinstance(record, dict) and "step" in record else None


class ProgressBar:
  """[route] step/total, loss, tok/s, elapsed and ETA on stderr (no tqdm dependency).

  On a terminal one line refreshed in place with `\\r` at every step; otherwise (a log file, a pipe) a plain line
  every `every` steps and at the last one, so logs hold one readable line per report.
  """

  def __init__(self, total: int, label: str, *, stream: TextIO = sys.stderr, enabled: bool = True, every: int = 1):
    self.total, self.label, self.stream, self.enabled, self.every = total, label, stream, enabled, every
    self.tty = stream.isatty()
    self.t0 = time.time()

  def update(self, step: int, loss: float, tokens_per_s: float, eta_s: float | None) -> None:
    if not self.enabled or (not self.tty and step % self.every and step != self.total):
      return
    width = 20
    done = int(width * step / max(self.total, 1))
    eta = _fmt_duration(eta_s) if eta_s is not None else "?"
    line = (f"[{self.label}] |{'#' * done}{'.' * (width - done)}| {step}/{self.total} loss {loss:.4f} "
            f"{tokens_per_s:,.0f} tok/s {_fmt_duration(time.time() - self.t0)} eta {eta}")
    self.stream.write(f"\r{line}   " if self.tty else f"{line}\n")
    self.stream.flush()

  def close(self) -> None:
    if self.enabled and self.tty:
      self.stream.write("\n")
      self.stream.flush()


class MetricsLogger:
  """Appends {"step", "kind", "route", ...} records to metrics.jsonl and the same scalars to a TensorBoard event file
  (tensorboard's own writer: its TFRecord framing and protos, no TensorFlow needed)."""

  def __init__(self, out_dir: str, route: str, *, after: int = 0):
    """Appends to out_dir's metrics.jsonl, first dropping its records past step `after` (a resumed run's
    checkpoint step: the steps after it run again and log again). The TensorBoard events of those steps stay in
    the earlier event file; a SessionLog.START at step after + 1 makes TensorBoard drop them (its purge of a
    restarted run's orphaned steps: every START after a run's first drops the events at or past its step)."""
    self.route = route
    os.makedirs(out_dir, exist_ok=True)
    self.jsonl_path = os.path.join(out_dir, "metrics.jsonl")
    if os.path.exists(self.jsonl_path):
      with open(self.jsonl_path) as f:
        kept = [line for line in f if (record := _record(line)) is not None and record["step"] <= after]
      with open(self.jsonl_path + ".tmp", "w") as f:
        f.writelines(kept)
      os.replace(self.jsonl_path + ".tmp", self.jsonl_path)
    self._jsonl = open(self.jsonl_path, "a")
    self._tb = EventFileWriter(os.path.join(out_dir, "tb"))
    self._tb.add_event(event_pb2.Event(wall_time=time.time(), step=after + 1,
                                       session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))

  def log(self, step: int, kind: str, values: dict[str, float]) -> None:
    self._jsonl.write(json.dumps({"step": step, "kind": kind, "route": self.route, **values}) + "\n")
    self._jsonl.flush()
    summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=f"{kind}/{k}", simple_value=v)
                                         for k, v in values.items()])
    self._tb.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))
    self._tb.flush()

  def close(self) -> None:
    self._jsonl.close()
    self._tb.close()


# What a run writes into its out_dir besides checkpoints: `set_aside` moves them off before a fresh start.
RUN_OUTPUTS = ("metrics.jsonl", "tb", "loss.png", "result.json", "config.yaml")


def set_aside(out_dir: str, *, log: TextIO, names: Sequence[str] = RUN_OUTPUTS,
              why: str = "of an earlier run without a checkpoint to resume") -> str | None:
  """Moves the outputs of an earlier run that left no checkpoint (`RUN_OUTPUTS`, or `names`) to
  out_dir/previous-<time>/ (-2, -3, ... for a second one within the same second), so a fresh start neither
  appends to its log (read back as one curve) nor deletes it.
  Returns that folder, or None when there was nothing to move."""
  found = [name for name in names if os.path.exists(os.path.join(out_dir, name))]
  if not found:
    return None
  stamp = os.path.join(out_dir, f"previous-{time.strftime('%Y%m%d-%H%M%S')}")
  aside, n = stamp, 1
  while os.path.lexists(aside):  # a second set-aside within the same second
    n += 1
    aside = f"{stamp}-{n}"
  os.makedirs(aside)
  for name in found:
    os.replace(os.path.join(out_dir, name), os.path.join(aside, name))
  log.write(f"[train] {out_dir} held outputs {why}: moved {', '.join(found)} to {aside}\n")
  return aside


# What `train.run_all` writes into run.out_dir itself once its routes are done: their table, and the loss plot (in
# compare mode, run.routes, every route's curve: each route's run is in out_dir/<route>/).
CALL_OUTPUTS = ("loss.png", "table.md", "summary.json")
# What only a single route's run writes into out_dir: config.yaml first, before any other output.
ROUTE_RUN_MARKS = ("config.yaml", "result.json", "metrics.jsonl", "tb", "ckpt")


def check_layout(out_dir: str, *, compare: bool, route: str) -> None:
  """Fails with a UserError, before any work, when out_dir holds a run of the other layout, whose loss.png and
  table the call would overwrite: in compare mode, a single route's run (`ROUTE_RUN_MARKS`); in single-route
  mode, a compare run's `CALL_OUTPUTS` beside no such run."""
  def present(names):
    return [n for n in names if os.path.lexists(os.path.join(out_dir, n))]

  marks, outputs = present(ROUTE_RUN_MARKS), present(CALL_OUTPUTS)
  base = os.path.normpath(out_dir)
  if compare and marks:
    raise UserError(f"run.out_dir={out_dir!r} holds a single-route run ({', '.join(sorted(marks + outputs))}); a "
                    f"compare run (run.routes) would write its own {', '.join(CALL_OUTPUTS)} there: use another "
                    f"run.out_dir, e.g. {base}-compare")
  if not compare and outputs and not marks:
    raise UserError(f"run.out_dir={out_dir!r} holds the {', '.join(outputs)} of a compare run (run.routes), "
                    f"which a single route's run would overwrite: use another run.out_dir, e.g. {base}-{route}")


def write_json(path: str, obj: Any) -> None:
  """Writes `obj` as indented JSON through a temporary file and a rename: never a half-written file."""
  with open(path + ".tmp", "w") as f:
    json.dump(obj, f, indent=1)
  os.replace(path + ".tmp", path)


def read_jsonl(path: str) -> list[dict[str, Any]]:
  """metrics.jsonl records; on resume the file holds repeated steps, so the last record per (kind, step) wins."""
  latest: dict[tuple[str, int], dict[str, Any]] = {}
  with open(path) as f:
    for line in f:
      if (r := _record(line)) is not None and "kind" in r:
        latest[(r["kind"], r["step"])] = r
  return sorted(latest.values(), key=lambda r: (r["step"], r["kind"]))


def pyplot():
  """matplotlib.pyplot on the non-interactive Agg backend (files only; no display needed)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def plot_losses(curves: dict[str, list[dict[str, Any]]], path: str, title: str = "") -> bool:
  """One PNG: train loss (solid) and held-out loss (dots) per route, from read_jsonl records.

  Returns whether it wrote one: with no point to draw (every route failed before logging) it writes nothing.
  """
  if not any(r["kind"] in ("train", "eval") for records in curves.values() for r in records):
    return False
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(8, 5))
  for i, (name, records) in enumerate(curves.items()):
    color = f"C{i}"
    train = [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
    evals = [(r["step"], r["loss"]) for r in records if r["kind"] == "eval"]
    if train:
      ax.plot(*zip(*train), color=color, label=f"{name} train")
    if evals:
      ax.plot(*zip(*evals), "o--", color=color, label=f"{name} held-out")
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats/token)")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def planned_bytes(compiled) -> int | None:
  """XLA's memory plan for a compiled call: arguments + outputs + temporaries - aliased (donated) bytes (None
  where the backend gives no plan)."""
  m = compiled.memory_analysis()
  if m is None:
    return None
  return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
          - m.alias_size_in_bytes)


TABLE_COLUMNS = ("route", "steps", "train loss", "held-out loss", "held-out ppl", "tok/s", "compile", "first step",
                 "peak mem", "status")


def _fmt_bytes(n: float | None) -> str:
  return "n/a" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
  """Markdown table of per-route results (`train.train.run` rows): train loss = mean of the last 10 steps,
  held-out loss after the last step, tok/s over the train steps after the first (compile) step, the train
  step's compile (tracing, lowering and XLA: `progress.CompiledOnFirstCall`), and the wall time from the route's
  set-up (its state initialized while the step compiles) to the end of its first step.
  """
  lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
  for r in rows:
    eval_loss = r.get("eval_loss")
    ppl = math.exp(eval_loss) if eval_loss is not None and eval_loss < 50 else None
    cells = [
        r["route"], str(r["steps"]), f"{r['train_loss']:.4f}" if r.get("train_loss") is not None else "n/a",
        f"{eval_loss:.4f}" if eval_loss is not None else "n/a", f"{ppl:.2f}" if ppl is not None else "n/a",
        f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "n/a",
        f"{r['compile_s']:.1f} s" if r.get("compile_s") is not None else "n/a",
        f"{r['first_step_s']:.1f} s" if r.get("first_step_s") is not None else "n/a",
        _fmt_bytes(r.get("peak_bytes")) + (f" ({r['peak_kind']})" if r.get("peak_kind") else ""),
        r.get("status", "ok"),
    ]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)
