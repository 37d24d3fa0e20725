"""The route-quality study (`python -m train.study`) on a tiny Llama (float32, CPU, 3 steps a run): one record per
run, --only, resuming by skipping recorded runs, the report's numbers against the records, and config mistakes."""

from __future__ import annotations

import json
import math
import os
import pathlib
import statistics
import subprocess
import sys

import pytest
import yaml

from train import config, progress, study, study_report, train
from train.config import ConfigError
from train.errors import UserError
from train.main import EXIT_USER_ERROR

TEXT = ("def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n\n" * 300).encode()
RUN_KEYS = ["bf16-seed0", "bf16-seed1", "mxfp4_last1-seed0", "mxfp4_last1-seed1"]


def _study_file(tmp_path, **study_keys) -> str:
  """A tiny study config: 2 entries (bf16; mxfp4 with its last block in bf16) x 2 seeds, 3 steps of 8 x 32."""
  corpus = tmp_path / "corpus.txt"
  corpus.write_bytes(TEXT)
  raw = {"model": {"preset": "tiny", "dtype": "float32"},
         "data": {"sources": [str(corpus)], "seq_len": 32, "batch_size": 8, "eval_fraction": 0.1, "workers": 1,
                  "cache_dir": str(tmp_path / "cache")},
         "optim": {"lr": 1e-2, "warmup": 1},
         "run": {"eval_every": 0, "eval_batches": 2, "log_every": 1, "progress": False,
                 "out_dir": str(tmp_path / "scratch")},
         "study": {"routes": ["bf16", {"name": "mxfp4_last1", "route": "mxfp4", "rules": {"bf16_last": 1}}],
                   "seeds": 2, "tokens": 3 * 8 * 32 - 100, "results": str(tmp_path / "results"), "curve_points": 2,
                   **study_keys}}
  path = tmp_path / "study.yaml"
  path.write_text(yaml.safe_dump(raw))
  return str(path)


def _records(results) -> dict[str, dict]:
  return {p.stem: json.loads(p.read_text()) for p in sorted((results / "runs").glob("*.json"))}


def test_one_run_trains_and_is_recorded(tmp_path):
  """--only trains just the named run (for real: tiny Llama, 3 steps) and records it; its checkpoints stay in the
  scratch directory."""
  path = _study_file(tmp_path)
  results = tmp_path / "results"
  assert study.main(["--config", path, "--only", "bf16:1"]) == 0
  recs = _records(results)
  assert list(recs) == ["bf16-seed1"]
  r = recs["bf16-seed1"]
  assert r["status"] == "ok" and r["route"] == "bf16" and r["rules"]["bf16_last"] == 0 and r["seed"] == 1
  assert r["steps"] == 3 and r["tokens"] == 768  # ceil(668 / 256) steps of 8 x 32 tokens
  assert r["curve"]["step"] == [1, 3] and r["final_logged"] == 3  # 3 logged, subsampled to 2: first and last
  assert r["train_loss"] > 0 and r["eval_loss"] > 0 and r["tokens_per_s"] > 0 and r["device"] and r["commit"]
  assert r["eval_batches"] == 2  # the held-out batches the eval_loss is over (fewer than run.eval_batches if short)
  assert r["config"]["run"]["out_dir"] == str(tmp_path / "scratch" / "bf16-seed1")
  assert os.path.isdir(tmp_path / "scratch" / "bf16-seed1" / "ckpt")
  assert "| bf16 | bf16 | none | 1 | 768 |" in (results / study_report.TABLE).read_text()


def _fake_run_all(calls: list[str], diverge: str = ""):
  """A stand-in for train.run_all: reports the result.json of a run finished in its out_dir with the same settings
  (`train.check_out_dir`, as train.run does), else "trains" (one entry in `calls`): writes its config.yaml, a
  metrics.jsonl whose losses depend on the route and seed, and result.json, and returns that row."""
  def run_all(cfg, *, log=None):
    saved = train.check_out_dir(cfg)
    if saved is not None:
      return [saved]
    key = os.path.basename(cfg.run.out_dir)
    calls.append(key)
    base = 3.0 + 0.1 * (cfg.route != "bf16") + 0.013 * cfg.run.seed ** 2
    os.makedirs(cfg.run.out_dir, exist_ok=True)
    (pathlib.Path(cfg.run.out_dir) / "config.yaml").write_text(yaml.safe_dump(config.to_dict(cfg)))
    with open(os.path.join(cfg.run.out_dir, "metrics.jsonl"), "w") as f:
      for step in sorted({*range(cfg.run.log_every, cfg.run.steps + 1, cfg.run.log_every), cfg.run.steps}):
        f.write(json.dumps({"step": step, "kind": "train", "route": cfg.route, "loss": base + 1 / step}) + "\n")
    if key == diverge:
      raise progress.NonFiniteLossError(f"[{cfg.route}] loss is nan at step 3; stopped. No checkpoint was saved yet.")
    row = {"route": cfg.route, "steps": cfg.run.steps, "eval_loss": base + 0.2 + 0.01 * (cfg.route == "bf16"),
           "tokens_per_s": 1000.0 + cfg.run.seed, "compile_s": 1.0, "first_step_s": 2.0, "peak_bytes": 2 ** 20,
           "peak_kind": "host RSS", "status": "ok"}
    (pathlib.Path(cfg.run.out_dir) / train.RESULT_FILE).write_text(json.dumps(row))
    return [row]
  return run_all


def test_study_resumes_and_reports(tmp_path, monkeypatch, capsys):
  path = _study_file(tmp_path)
  results = tmp_path / "results"
  calls: list[str] = []
  monkeypatch.setattr(train, "run_all", _fake_run_all(calls))
  assert study.main(["--config", path, "--only", "bf16:1"]) == 0 and calls == ["bf16-seed1"]
  assert study.main(["--config", path]) == 0  # the other three
  assert calls == ["bf16-seed1", "bf16-seed0", "mxfp4_last1-seed0", "mxfp4_last1-seed1"]
  recs = _records(results)
  assert list(recs) == RUN_KEYS and all(r["status"] == "ok" and r["steps"] == 3 for r in recs.values())

  # A rerun trains nothing: every run has its record.
  monkeypatch.setattr(train, "run_all", lambda *a, **k: pytest.fail("a recorded run was trained again"))
  table = (results / study_report.TABLE).read_text()
  assert study.main(["--config", path]) == 0
  assert _records(results) == recs and (results / study_report.TABLE).read_text() == table
  assert all((results / f).stat().st_size > 1000 for f in ("curves.png", "gap.png"))

  # The table holds what the records give by hand: mean ± sample std over seeds, gap vs bf16 in %.
  def column(name, key):
    return [recs[f"{name}-seed{s}"][key] for s in (0, 1)]
  b, sb = statistics.mean(column("bf16", "eval_loss")), statistics.stdev(column("bf16", "eval_loss"))
  r, sr = statistics.mean(column("mxfp4_last1", "eval_loss")), statistics.stdev(column("mxfp4_last1", "eval_loss"))
  t, st = statistics.mean(column("mxfp4_last1", "train_loss")), statistics.stdev(column("mxfp4_last1", "train_loss"))
  assert t == pytest.approx(3.1 + 0.013 / 2 + (1 + 1 / 2 + 1 / 3) / 3)  # final train loss: mean of the 3 logged
  gap, err = 100 * (r - b) / b, 100 * math.sqrt(sb ** 2 / 2 + sr ** 2 / 2) / b
  rate = statistics.mean(column("mxfp4_last1", "tokens_per_s"))
  assert (f"| mxfp4_last1 | mxfp4 | last 1 | 2 | 768 | {t:.4f} ± {st:.4f} | {r:.4f} ± {sr:.4f} | {r - b:+.4f} | "
          f"{gap:+.2f}% ± {err:.2f} | {rate:,.0f} |") in table
  assert "| bf16 | bf16 | none | 2 | 768 | " in table
  assert f"{b:.4f} ± {sb:.4f} | — | baseline (seed spread {100 * sb / b:.2f}%) |" in table
  report = {x["name"]: x for x in json.loads((results / "report.json").read_text())}
  assert report["mxfp4_last1"]["gap_pct"] == pytest.approx(gap)
  assert report["mxfp4_last1"]["gap_err_pct"] == pytest.approx(err)

  # --report alone rewrites the same report from the records.
  (results / study_report.TABLE).unlink()
  assert study.main(["--config", path, "--report"]) == 0
  assert (results / study_report.TABLE).read_text() == table
  assert "| mxfp4_last1 | mxfp4 |" in capsys.readouterr().out


def test_a_diverged_run_is_recorded_and_fails_the_call(tmp_path, monkeypatch, capsys):
  path = _study_file(tmp_path, seeds={"bf16": 1, "default": 2})
  calls: list[str] = []
  monkeypatch.setattr(train, "run_all", _fake_run_all(calls, diverge="mxfp4_last1-seed1"))
  assert study.main(["--config", path]) == 1
  assert "1 run(s) diverged: ['mxfp4_last1-seed1']" in capsys.readouterr().err
  recs = _records(tmp_path / "results")
  assert recs["mxfp4_last1-seed1"]["status"].startswith("[mxfp4] loss is nan at step 3")
  assert "| mxfp4_last1 | mxfp4 | last 1 | 1 (1 diverged) |" in (tmp_path / "results" / study_report.TABLE).read_text()
  assert study.main(["--config", path]) == 0 and len(calls) == 3  # recorded: not run again


def test_report_counts_diverged_runs_and_needs_two_seeds_for_a_spread(tmp_path):
  rec = {"route": "bf16", "rules": {"bf16_first": 0, "bf16_last": 0, "extra": []}, "tokens": 1000,
         "tokens_per_s": 10.0, "train_loss": 3.0, "status": "ok"}
  records = [{**rec, "name": "bf16", "seed": 0, "eval_loss": 4.0}, {**rec, "name": "bf16", "seed": 1, "eval_loss": 4.2},
             {**rec, "name": "x", "route": "nvfp4", "seed": 0, "eval_loss": 4.4},
             {**rec, "name": "x", "route": "nvfp4", "seed": 1, "eval_loss": None, "status": "loss is nan at step 2"}]
  rows = {r["name"]: r for r in study_report.summarize(records, ["bf16", "x"], "bf16")}
  assert rows["x"]["ok"] == 1 and rows["x"]["runs"] == 2 and rows["x"]["eval_spread"] is None
  assert rows["x"]["gap_pct"] == pytest.approx(100 * (4.4 - 4.1) / 4.1) and rows["x"]["gap_err_pct"] is None
  table = study_report.format_table(list(rows.values()), "bf16")
  assert "| x | nvfp4 | none | 1 (1 diverged) |" in table and "4.4000 ± n/a | +0.3000 | +7.32% ± n/a |" in table


def test_a_damaged_record_is_named_not_a_traceback(tmp_path, capsys):
  # Records are written whole; one changed afterwards (a merge conflict, a hand edit) must be named, not crash.
  runs = tmp_path / "res" / study_report.RUNS_DIR
  runs.mkdir(parents=True)
  good = json.loads(open("results/study_30m/runs/bf16-seed0.json").read())
  (runs / "bf16-seed0.json").write_text(json.dumps(good))
  assert [r["seed"] for r in study_report.read_records(str(tmp_path / "res"))] == [0]
  for text, problem in (('{"name": "bf16", <<<<<<< HEAD', "not valid JSON"), ("[1, 2]", "not a JSON object"),
                        (json.dumps({k: v for k, v in good.items() if k != "eval_loss"}), "no 'eval_loss'"),
                        (json.dumps({**good, "train_loss": None}), "status ok with train_loss=None, not a finite"),
                        (json.dumps({**good, "eval_loss": "4.2"}), "status ok with eval_loss='4.2'"),
                        (json.dumps({**good, "curve": []}), "curve=\\[\\], expected a mapping"),
                        (json.dumps({**good, "date": None}), "date=None, expected a string"),
                        (json.dumps({**good, "seed": True}), "seed=True, expected an integer")):
    (runs / "bf16-seed1.json").write_text(text)
    with pytest.raises(UserError, match=rf"bf16-seed1.json is not a study run record: {problem}"):
      study_report.read_records(str(tmp_path / "res"))
  (runs / "bf16-seed1.json").unlink()
  (runs / "bf16-seed1.json").mkdir()  # was an IsADirectoryError traceback
  with pytest.raises(UserError, match=r"bf16-seed1.json is not a study run record: not a readable file \(Is a dir"):
    study_report.read_records(str(tmp_path / "res"))
  path = _study_file(tmp_path, results=str(tmp_path / "res"))
  assert study.main(["--config", path, "--report"]) == EXIT_USER_ERROR
  assert "delete it to train that run again" in capsys.readouterr().err


def test_records_are_checked_against_the_study(tmp_path, monkeypatch, capsys):
  """A record made with other settings, or filed under another run's name, stops the call (one line, exit 2)
  before any training; records of runs the config does not have are left out and named, missing runs listed."""
  path = _study_file(tmp_path)
  results = tmp_path / "results"
  calls: list[str] = []
  monkeypatch.setattr(train, "run_all", _fake_run_all(calls))
  assert study.main(["--config", path]) == 0 and len(calls) == 4
  capsys.readouterr()
  for override, change in (("optim.lr=0.03", "optim.lr: 0.01 -> 0.03"),
                           ("study.tokens=2000", "run.steps: 3 -> 8 (study.tokens)"),
                           ("data.seq_len=16", "data.seq_len: 32 -> 16"),
                           ("run.log_every=2", "run.log_every: 1 -> 2 (the final train loss averages")):
    for mode in (["--only", "mxfp4_last1:1"], ["--report"]):
      assert study.main(["--config", path, "--set", override, *mode]) == EXIT_USER_ERROR
      err = capsys.readouterr().err.strip()
      assert err.count("\n") == 0 and "was recorded with other settings than this study's" in err, err
      assert change in err and "use another study.results for the new settings" in err
  assert len(calls) == 4  # nothing trained
  # Data paths are not compared: the GPU host reads the same files from a copy carried with the tree.
  moved = tmp_path / "moved.txt"
  moved.write_bytes(TEXT)
  assert study.main(["--config", path, "--set", f"data.sources=[{moved}]", "--report"]) == 0

  # Fewer seeds: the seed-1 records are left out and named; a missing record is pending.
  assert study.main(["--config", path, "--set", "study.seeds=1", "--report"]) == 0
  table = (results / study_report.TABLE).read_text()
  assert "| bf16 | bf16 | none | 1 |" in table
  assert "Left out: 2 record(s) of runs this config does not have: ['bf16-seed1', 'mxfp4_last1-seed1']." in table
  (results / "runs" / "mxfp4_last1-seed1.json").unlink()
  assert study.main(["--config", path, "--report"]) == 0
  assert "Pending: 1 of the study's 4 runs have no record yet: ['mxfp4_last1-seed1']." in capsys.readouterr().out

  # A copy under another name would count a run twice.
  (results / "runs" / "bf16-seed0.bak.json").write_text((results / "runs" / "bf16-seed0.json").read_text())
  assert study.main(["--config", path, "--report"]) == EXIT_USER_ERROR
  assert "bf16-seed0.bak.json holds the record of bf16-seed0" in capsys.readouterr().err
  assert study.main(["--config", path, "--report", "--only", "bf16:0"]) == EXIT_USER_ERROR
  assert "--only selects runs to train: give one of them" in capsys.readouterr().err


def test_report_averages_every_record_over_one_window(tmp_path, monkeypatch, capsys):
  """Records made under another study.final_logged are averaged again from their curves (which keep every logged
  loss here) and named in a note, or stop the call (one line, exit 2) where the curve was cut to fewer points
  than were logged: a report never mixes windows."""
  path = _study_file(tmp_path, curve_points=3)
  results = tmp_path / "results"
  monkeypatch.setattr(train, "run_all", _fake_run_all([]))
  assert study.main(["--config", path, "--only", "bf16:0"]) == 0  # window 10: all 3 logged losses
  assert study.main(["--config", path, "--only", "bf16:1", "--set", "study.final_logged=1"]) == 0
  recs = _records(results)
  curves = [recs[f"bf16-seed{s}"]["curve"]["loss"] for s in (0, 1)]
  assert [recs[f"bf16-seed{s}"]["final_logged"] for s in (0, 1)] == [3, 1] and all(len(c) == 3 for c in curves)
  last = [c[-1] for c in curves]
  table = (results / study_report.TABLE).read_text()
  assert f"| bf16 | bf16 | none | 2 | 768 | {statistics.mean(last):.4f} ± {statistics.stdev(last):.4f} |" in table
  assert ("Final train loss averaged again from the curves of 1 record(s) averaged over another window, over the "
          "last 1 logged losses (study.final_logged): ['bf16-seed0'].") in table
  assert study.main(["--config", path, "--report"]) == 0
  whole = [statistics.mean(c) for c in curves]
  assert f"| 768 | {statistics.mean(whole):.4f} ± {statistics.stdev(whole):.4f} |" in capsys.readouterr().out

  assert study.main(["--config", path, "--only", "mxfp4_last1:0", "--set", "study.curve_points=2"]) == 0
  capsys.readouterr()
  assert study.main(["--config", path, "--report", "--set", "study.final_logged=1"]) == EXIT_USER_ERROR
  err = capsys.readouterr().err.strip()
  assert err.count("\n") == 0 and ("mxfp4_last1-seed0.json averages its final train loss over its last 3 logged "
                                   "losses, not the 1 of study.final_logged=1, and its curve keeps 2 of its 3") in err


def test_a_finished_scratch_run_without_its_record_trains_again(tmp_path, monkeypatch):
  """A run whose record was deleted trains again: the finished run left in its scratch directory is set aside, not
  reported under this call's settings (here another run.log_every: its curve kept the old spacing), commit and
  device. A checkpoint there is resumed only where the config.yaml beside it is this run's config."""
  path = _study_file(tmp_path, seeds=1)
  results, scratch = tmp_path / "results", tmp_path / "scratch"
  calls: list[str] = []
  monkeypatch.setattr(train, "run_all", _fake_run_all(calls))
  assert study.main(["--config", path]) == 0 and calls == ["bf16-seed0", "mxfp4_last1-seed0"]
  for rec in (results / "runs").glob("*.json"):
    rec.unlink()
  assert study.main(["--config", path, "--set", "run.log_every=2", "--only", "bf16"]) == 0
  assert calls[2:] == ["bf16-seed0"] and _records(results)["bf16-seed0"]["curve"]["step"] == [2, 3]
  [aside] = [d for d in os.listdir(scratch / "bf16-seed0") if d.startswith("previous-")]
  assert sorted(os.listdir(scratch / "bf16-seed0" / aside)) == ["config.yaml", "metrics.jsonl", "result.json"]

  out = scratch / "mxfp4_last1-seed0"
  (out / train.RESULT_FILE).unlink()  # cut short at step 2, its config.yaml this run's: resumed
  (out / "ckpt" / "2").mkdir(parents=True)
  (out / "ckpt" / "2" / "_CHECKPOINT_METADATA").write_text("{}")  # a folder holding no file is no checkpoint
  (results / "runs" / "bf16-seed0.json").unlink()  # recorded with log_every 2, which would stop the calls below
  assert study.main(["--config", path, "--only", "mxfp4_last1"]) == 0
  assert calls[3:] == ["mxfp4_last1-seed0"] and os.listdir(out / "ckpt") == ["2"]
  assert not [d for d in os.listdir(out) if d.startswith("previous-")]
  (out / train.RESULT_FILE).unlink()
  (results / "runs" / "mxfp4_last1-seed0.json").unlink()
  assert study.main(["--config", path, "--only", "mxfp4_last1", "--set", "run.log_every=2"]) == 0
  assert calls[4:] == ["mxfp4_last1-seed0"] and not (out / "ckpt").exists()
  [aside] = [d for d in os.listdir(out) if d.startswith("previous-")]
  assert os.listdir(out / aside / "ckpt") == ["2"]


def test_a_refused_run_leaves_its_scratch_directory_as_it_found_it(tmp_path):
  """A run that train.run_all refuses before training (here: too few held-out tokens for one batch) leaves no scratch
  folder or LOCK file of the study's own; a folder and LOCK there before (a run cut short) stay."""
  path = _study_file(tmp_path)
  scratch, too_few = tmp_path / "scratch", ["--set", "data.eval_fraction=0.001"]
  assert study.main(["--config", path, "--only", "bf16:0", *too_few]) == EXIT_USER_ERROR
  assert not scratch.exists()
  (scratch / "bf16-seed0").mkdir(parents=True)
  (scratch / "bf16-seed0" / "LOCK").write_text("")
  (scratch / "bf16-seed1").mkdir()
  for key in ("bf16:0", "bf16:1"):
    assert study.main(["--config", path, "--only", key, *too_few]) == EXIT_USER_ERROR
  assert os.listdir(scratch / "bf16-seed0") == ["LOCK"] and os.listdir(scratch / "bf16-seed1") == []
  assert sorted(os.listdir(scratch)) == ["bf16-seed0", "bf16-seed1"]


def test_sigterm_while_the_study_holds_a_scratch_lock_leaves_no_lock(tmp_path):
  """SIGTERM while the study holds a run's scratch LOCK to set its contents aside (`clear_scratch`), outside any
  `train.run_all`: handled as Ctrl-C is, the LOCK it made removed, one line, exit status 143 (SIGTERM's default
  action ended the process there and left the LOCK behind). A process of its own: that action would end pytest."""
  path = _study_file(tmp_path)
  scratch = tmp_path / "scratch" / "bf16-seed0"
  scratch.mkdir(parents=True)  # a run cut short before it wrote anything: its folder stays, empty
  code = ("import os, signal, sys; from train import study; "
          "study.clear_scratch = lambda run, log: os.kill(os.getpid(), signal.SIGTERM); "
          "sys.exit(study.main(sys.argv[1:]))")
  done = subprocess.run([sys.executable, "-c", code, "--config", path, "--only", "bf16:0"], capture_output=True,
                        text=True, timeout=300, env={**os.environ, "PYTHONPATH": os.getcwd()})
  assert done.returncode == 143, (done.returncode, done.stderr)
  assert done.stderr.splitlines()[-1] == ("python -m train.study: stopped by SIGTERM outside the training steps: no "
                                          "checkpoint was written (what earlier steps and routes saved is kept)")
  assert os.listdir(scratch) == [] and not (tmp_path / "results" / "runs" / "bf16-seed0.json").exists()


def test_a_finished_run_without_its_log_is_not_recorded_as_ok(tmp_path, monkeypatch):
  path = _study_file(tmp_path)
  monkeypatch.setattr(train, "run_all", lambda cfg, log=None: [{"route": cfg.route, "eval_loss": 4.0}])
  assert study.main(["--config", path, "--only", "bf16:0"]) == EXIT_USER_ERROR  # no metrics.jsonl in its out_dir
  assert not (tmp_path / "results" / "runs" / "bf16-seed0.json").exists()


def test_report_without_records_or_shared_curve_steps(tmp_path):
  """No record left: table.md says so and the earlier report's other outputs go. Runs whose curves share no step
  (logged at other intervals) still get their table and plots."""
  results = tmp_path / "res"
  (results / "runs").mkdir(parents=True)
  for name in study_report.OUTPUTS:
    (results / name).write_text("old")
  assert study_report.write(str(results), ["bf16"], "bf16").startswith("no run recorded yet under /")
  assert sorted(os.listdir(results)) == ["runs", study_report.TABLE]
  good = json.loads(open("results/study_30m/runs/bf16-seed0.json").read())
  other = {**good, "seed": 1, "curve": {"step": [7, 9], "loss": [5.0, 4.0]}}
  table = study_report.write(str(results), ["bf16"], "bf16", [good, other])
  assert "| bf16 | bf16 | none | 2 |" in table and (results / "curves.png").stat().st_size > 1000


def test_report_of_no_records_names_no_plots(tmp_path, capsys):
  """`--report` before any run: table.md says no run is recorded, and the closing line promises no plots (it
  said "plots beside it", and none were written)."""
  assert study.main(["--config", _study_file(tmp_path), "--report"]) == 0
  captured = capsys.readouterr()
  assert "no run recorded yet" in captured.out and "[study] report:" in captured.err
  assert "plots" not in captured.err and not (tmp_path / "results" / "curves.png").exists()


def test_subsample_keeps_the_ends():
  points = list(range(1000))
  out = study.subsample(points, 200)
  assert len(out) <= 200 and out[0] == 0 and out[-1] == 999 and out == sorted(out)
  assert study.subsample(points[:5], 200) == points[:5]


@pytest.mark.parametrize("override, match", [
    ("study.routes=[bf16, nope]", r"study.routes\[1\] \(nope\): route='nope' is not a route; routes: \["),
    ("study.routes=[bf16, {route: nvfp4, rules: {bf16_lst: 2}}]",
     r"study.routes\[1\] \(nvfp4\): unknown key\(s\) \['rules.bf16_lst'\]"),
    ("study.routes=[bf16, {name: a, rules: {bf16_last: 1}}]", r"study.routes\[1\]: names no route"),
    ("study.routes=[bf16, {name: bf16, route: nvfp4}]", r"study.routes\[1\]: name 'bf16' is used twice"),
    ("study.routes=[bf16, {name: 'a b', route: nvfp4}]", r"name 'a b' must be letters, digits"),
    ("study.routes=[bf16, {route: nvfp4, colour: red}]", r"unknown key\(s\) \['study.routes\[1\].colour'\]"),
    ("study.routes=[]", r"study.routes: expected a non-empty list"),
    ("study.seeds={bf16: 3}", r"study.seeds gives no count for \['mxfp4_last1'\]: add them or a default"),
    ("study.seeds={bf16: 3, mxfp4: 2, default: 1}", r"study.seeds names \['mxfp4'\], which are not entries"),
    ("study.seeds=0", r"study.seeds.bf16=0 must be >= 1"),
    ("study.tokens=-5", r"study.tokens=-5.0 must be a finite number > 0"),
    ("study.tokens=lots", r"study.tokens: expected a number, got 'lots'"),
    ("study.baseline=fp32", r"study.baseline='fp32' is not an entry of study.routes"),
    ("study.colour=red", r"unknown key\(s\) \['study.colour'\]; valid keys in study: \['routes'"),
    ("run.steps=10", r"run.steps cannot be set in a study config: study.tokens sets it"),
    ("run.routes=[bf16]", r"run.routes cannot be set in a study config"),
    ("optim.lr=-1", r"optim.lr=-1.0 must be a finite number > 0"),
    ("route=nvfp4", r"--set route=nvfp4: a study does not read route, its routes come from the study's entries"),
    ("rules.bf16_last=0", r"rules.bf16_last is set by the study's entries \['mxfp4_last1'\], whose own rules.bf16"),
    ("rules={bf16_first: 1, bf16_last: 1}", r"--set rules=\{bf16_first: 1, bf16_last: 1\}: rules.bf16_last is set"),
    ("study.routes=[bf16, {name: a, route: nvfp4, rules: {bf16_first: 2, bf16_last: 1}}]",
     r"study.routes\[1\] \(a\): rules.bf16_first=2 \+ rules.bf16_last=1 blocks in bf16 is more than the model's 2"),
])
def test_bad_study_configs(tmp_path, override, match):
  with pytest.raises(ConfigError, match=match):
    study.load(_study_file(tmp_path), [override])


def test_set_keeps_the_text_of_string_study_keys(tmp_path):
  """`--set study.results=...` is a string key's text as typed, as for the training keys (YAML made 1.10 1.1)."""
  s = study.load(_study_file(tmp_path), ["study.results=1.10", "run.out_dir=0x10", "study.tokens=1e3"])
  assert s.settings.results == "1.10" and s.settings.tokens == 1000.0
  assert s.runs[0].cfg.run.out_dir == os.path.join("0x10", "bf16-seed0")


def test_only_selects_runs_by_name_and_seed_or_by_name(tmp_path):
  s = study.load(_study_file(tmp_path), [])
  keys = lambda only: [f"{r.name}:{r.seed}" for r in study.select(s, only)]
  assert keys([]) == ["bf16:0", "bf16:1", "mxfp4_last1:0", "mxfp4_last1:1"]
  assert keys(["mxfp4_last1:1", "bf16"]) == ["mxfp4_last1:1", "bf16:0", "bf16:1"]  # the order given
  assert keys(["bf16", "bf16:1"]) == ["bf16:0", "bf16:1"]  # each run once
  with pytest.raises(ConfigError, match=r"--only 'bf16:x' names no run of this study"):
    study.select(s, ["bf16:x"])


def test_mistakes_are_one_line_exit_2(tmp_path, capsys):
  path = _study_file(tmp_path)
  assert study.main(["--config", path, "--only", "bf16:7"]) == EXIT_USER_ERROR
  err = capsys.readouterr().err.strip()
  assert err.count("\n") == 0 and err.startswith("python -m train.study: error: --only 'bf16:7' names no run")
  assert "'bf16:0', 'bf16:1', 'mxfp4_last1:0', 'mxfp4_last1:1'" in err
  assert study.main(["--config", path, "--set", "route=nvfp4"]) == EXIT_USER_ERROR  # the entries set the routes
  err = capsys.readouterr().err.strip()
  assert err.count("\n") == 0 and "a study does not read route, its routes come from the study's entries" in err
  assert [r.cfg.rules.bf16_first for r in study.load(path, ["rules.bf16_first=1"]).runs] == [1] * 4  # no entry's
  (tmp_path / "plain.yaml").write_text("route: bf16\n")
  assert study.main(["--config", str(tmp_path / "plain.yaml")]) == EXIT_USER_ERROR
  assert "has no study: section" in capsys.readouterr().err
  assert not (tmp_path / "results").exists()  # nothing written before the config is right


@pytest.mark.parametrize("config", ["configs/study_30m.yaml", "configs/study_125m.yaml"])
def test_shipped_study_records_are_committable(config):
  """The records a shipped study writes must not fall under .gitignore (a bare `runs/` pattern once hid
  results/<study>/runs/*.json, so finished runs could not be committed); its scratch out_dir must."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  if not os.path.isdir(os.path.join(root, ".git")):
    pytest.skip("not a git checkout")
  loaded = study.load(os.path.join(root, config))
  record = os.path.relpath(loaded.record_path(loaded.runs[0]), root)
  scratch = os.path.join(loaded.runs[0].cfg.run.out_dir, "metrics.jsonl")
  ignored = lambda path: subprocess.run(["git", "-C", root, "check-ignore", "-q", path]).returncode == 0
  assert not ignored(record) and ignored(scratch)
