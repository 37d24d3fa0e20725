"""The report of a route-quality study (`train.study`): a Markdown table, report.json and two plots, from the records.

Reads every <results>/runs/*.json record and writes, beside them, table.md, report.json (the same numbers
unrounded), curves.png and gap.png. Statistics, per entry, over its runs whose status is "ok" (n of them):

- final train loss: each run's mean of its last `final_logged` logged train losses (each logged loss is itself the
  mean over `run.log_every` steps), the same window for every run (`same_window`); held-out loss: the loss on the
  held-out windows after the last step.
- mean: the arithmetic mean over the n runs; spread: the sample standard deviation (n - 1 in the denominator),
  undefined (n/a) for n = 1. Tables show `mean ± spread`.
- gap vs the baseline (bf16) in held-out loss: delta = mean_route - mean_bf16 (loss units, as Quartet II reports
  it) and gap = 100 * delta / mean_bf16 (%, as Hu et al. report it). Its error bar is the standard error of that
  difference of means, 100 * sqrt(s_route^2 / n_route + s_bf16^2 / n_bf16) / mean_bf16 (%), where s is the spread;
  undefined unless both have n >= 2. The baseline row shows the bf16 seed spread instead: 100 * s_bf16 / mean_bf16.
- tok/s: the mean over the n runs of each run's training throughput (steps after the first, compiling one).

curves.png: per entry, the train-loss curve averaged over its runs at the steps all of them logged (the stored,
subsampled points), with the min-max range over the runs shaded. gap.png: the gap (%) per entry with its error
bar (a hollow marker where there is none), its number of runs under its name, and the bf16 seed spread (+- one
sample standard deviation, in %) shaded around zero.
"""

from __future__ import annotations

import glob
import json
import math
import os
import statistics
from typing import Any

from train import metrics
from train.errors import UserError

RUNS_DIR = "runs"
TABLE = "table.md"
COLUMNS = ("entry", "route", "bf16 blocks", "runs", "tokens", "final train loss", "held-out loss",
           "Δ held-out vs {b}", "gap vs {b}", "tok/s")


# What every record holds (train.study.record writes more) and what each must be; the report reads them as such.
_REQUIRED = ("name", "seed", "status", "route", "rules", "tokens", "tokens_per_step", "train_loss", "eval_loss",
             "tokens_per_s", "date", "commit", "device", "curve")
_TYPES = {"name": str, "seed": int, "status": str, "route": str, "rules": dict, "tokens": int, "tokens_per_step": int,
          "date": str, "commit": str, "device": str, "curve": dict}
_KINDS = {str: "a string", int: "an integer", dict: "a mapping"}


def _number(v: Any) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _problem(rec: Any) -> str | None:
  """Why `rec` is not a usable record, or None."""
  if not isinstance(rec, dict):
    return "not a JSON object"
  missing = next((k for k in _REQUIRED if k not in rec), None)
  if missing:
    return f"no {missing!r}"
  wrong = next((k for k, t in _TYPES.items() if not isinstance(rec[k], t) or isinstance(rec[k], bool)), None)
  if wrong:
    return f"{wrong}={rec[wrong]!r}, expected {_KINDS[_TYPES[wrong]]}"
  curve = rec["curve"]
  if not (isinstance(curve.get("step"), list) and isinstance(curve.get("loss"), list)
          and len(curve["step"]) == len(curve["loss"])):
    return "curve is not {step: [...], loss: [...]} of one length"
  if rec["status"] == "ok":
    bad = next((k for k in ("train_loss", "eval_loss") if not _number(rec[k])), None)
    if bad:
      return f"status ok with {bad}={rec[bad]!r}, not a finite number"
  if rec["tokens_per_s"] is not None and not _number(rec["tokens_per_s"]):
    return f"tokens_per_s={rec['tokens_per_s']!r} is not a number"
  return None


def read_record_files(results: str) -> list[tuple[str, dict[str, Any]]]:
  """(path, record) of every run record under results/runs, in file-name order. A file that is not a record (a
  hand edit, a merge conflict in a committed record) raises a UserError naming it: records are written whole
  (`metrics.write_json`), so it was changed after its run."""
  out = []
  for path in sorted(glob.glob(os.path.join(results, RUNS_DIR, "*.json"))):
    rec = None
    try:
      with open(path) as f:
        rec = json.load(f)
      problem = _problem(rec)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      problem = f"not valid JSON ({e})"
    except OSError as e:  # a folder of that name, a file it may not read
      problem = f"not a readable file ({e.strerror})"
    if problem:
      raise UserError(f"{path} is not a study run record: {problem}. Restore it (git checkout), or delete it to "
                      f"train that run again")
    out.append((path, rec))
  return out


def logged_count(steps: int, log_every: int) -> int:
  """How many train losses a run of `steps` steps logs: one every `log_every` steps and one at the last
  (`train.train`)."""
  return steps // log_every + (steps % log_every != 0)


def same_window(path: str, rec: dict[str, Any], window: int, logged: int) -> dict[str, Any] | None:
  """`rec` with its final train loss the mean of its last `window` (study.final_logged) of `logged` logged train
  losses, so that a report averages every run over one window: None when it already is; a copy averaged again
  from its curve when that holds every logged loss; a UserError when the curve was subsampled (study.curve_points)
  and that window cannot be recovered."""
  want, have = min(window, logged), rec.get("final_logged")
  if rec["status"] != "ok" or have == want:  # a diverged run's train loss is in no statistic
    return None
  losses = rec["curve"]["loss"]
  if len(losses) != logged:
    raise UserError(f"{path} averages its final train loss over its last {have} logged losses, not the {want} of "
                    f"study.final_logged={window}, and its curve keeps {len(losses)} of its {logged} (cut to study."
                    f"curve_points), too few to average again: set study.final_logged={have}, or use another "
                    f"study.results for the new window")
  return {**rec, "train_loss": sum(losses[-want:]) / want, "final_logged": want}  # as `train.study.record` does


def read_records(results: str) -> list[dict[str, Any]]:
  """The records of `read_record_files`, without their paths."""
  return [rec for _, rec in read_record_files(results)]


def mean_spread(values: list[float]) -> tuple[float | None, float | None]:
  """(mean, sample standard deviation); the spread is None below two values, both are None for none."""
  if not values:
    return None, None
  return statistics.fmean(values), statistics.stdev(values) if len(values) >= 2 else None


def summarize(records: list[dict[str, Any]], names: list[str], baseline: str) -> list[dict[str, Any]]:
  """One row of statistics per entry (`names` first, in order, then any other name found in the records)."""
  by_name: dict[str, list[dict[str, Any]]] = {}
  for r in records:
    by_name.setdefault(r["name"], []).append(r)
  order = [n for n in names if n in by_name] + sorted(set(by_name) - set(names))
  rows = []
  for name in order:
    runs = by_name[name]
    ok = [r for r in runs if r["status"] == "ok"]
    train_mean, train_spread = mean_spread([r["train_loss"] for r in ok])
    eval_mean, eval_spread = mean_spread([r["eval_loss"] for r in ok])
    rates = [r["tokens_per_s"] for r in ok if r.get("tokens_per_s")]
    rows.append({"name": name, "route": runs[0]["route"], "rules": runs[0]["rules"], "runs": len(runs),
                 "ok": len(ok), "seeds": sorted(r["seed"] for r in ok), "tokens": sorted({r["tokens"] for r in runs}),
                 "train_mean": train_mean, "train_spread": train_spread, "eval_mean": eval_mean,
                 "eval_spread": eval_spread, "tokens_per_s": statistics.fmean(rates) if rates else None})
  base = next((r for r in rows if r["name"] == baseline), None)
  for r in rows:
    r.update(delta=None, gap_pct=None, gap_err_pct=None, baseline_spread_pct=None)
    if base is None or base["eval_mean"] is None or r["eval_mean"] is None:
      continue
    b = base["eval_mean"]
    r["delta"] = r["eval_mean"] - b
    r["gap_pct"] = 100 * r["delta"] / b
    if r["eval_spread"] is not None and base["eval_spread"] is not None:
      r["gap_err_pct"] = 100 * math.sqrt(r["eval_spread"] ** 2 / r["ok"] + base["eval_spread"] ** 2 / base["ok"]) / b
    if base["eval_spread"] is not None:
      r["baseline_spread_pct"] = 100 * base["eval_spread"] / b
  return rows


def _pm(mean: float | None, spread: float | None) -> str:
  if mean is None:
    return "n/a"
  return f"{mean:.4f} ± {spread:.4f}" if spread is not None else f"{mean:.4f} ± n/a"


def _blocks(rules: dict[str, Any]) -> str:
  parts = [f"{k.removeprefix('bf16_')} {rules[k]}" for k in ("bf16_first", "bf16_last") if rules.get(k)]
  parts += [f"+{len(rules['extra'])} rule(s)"] if rules.get("extra") else []
  return ", ".join(parts) or "none"


def _tokens(n: int) -> str:
  return f"{n / 1e6:.1f}M" if n >= 100_000 else f"{n:,}"


def format_table(rows: list[dict[str, Any]], baseline: str) -> str:
  """The Markdown table of `summarize` rows (the statistics are defined in this module's docstring)."""
  lines = ["| " + " | ".join(c.format(b=baseline) for c in COLUMNS) + " |", "|---|---|---|" + "---:|" * 7]
  for r in rows:
    if r["name"] == baseline:
      spread = r["baseline_spread_pct"]
      gap = "baseline" + (f" (seed spread {spread:.2f}%)" if spread is not None else "")
      delta = "—"
    else:
      gap = "n/a" if r["gap_pct"] is None else f"{r['gap_pct']:+.2f}% ± " + (
          f"{r['gap_err_pct']:.2f}" if r["gap_err_pct"] is not None else "n/a")
      delta = "n/a" if r["delta"] is None else f"{r['delta']:+.4f}"
    runs = f"{r['ok']}" + (f" ({r['runs'] - r['ok']} diverged)" if r["runs"] > r["ok"] else "")
    cells = [r["name"], r["route"], _blocks(r["rules"]), runs, " / ".join(map(_tokens, r["tokens"])),
             _pm(r["train_mean"], r["train_spread"]), _pm(r["eval_mean"], r["eval_spread"]), delta, gap,
             f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "n/a"]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _provenance(records: list[dict[str, Any]]) -> str:
  dates = sorted(r["date"] for r in records)
  commits = sorted({r["commit"] for r in records})
  devices = sorted({r["device"] for r in records})
  return (f"{len(records)} run(s), {dates[0]} to {dates[-1]}; commit(s) {', '.join(commits)}; "
          f"device(s) {', '.join(devices)}. Mean ± sample std over seeds; gap = 100 (route - {{b}}) / {{b}} in "
          f"held-out loss, ± the standard error of the difference (train/study_report.py).")


OUTPUTS = (TABLE, "report.json", "curves.png", "gap.png")


def write(results: str, names: list[str], baseline: str, records: list[dict[str, Any]] | None = None,
          notes: tuple[str, ...] | list[str] = ()) -> str:
  """Writes table.md, report.json, curves.png and gap.png under `results` from `records` (default: every record
  there), with `notes` (e.g. runs still to do) below the table; returns the table. With no record, table.md says
  so and the other outputs of an earlier report are removed (they would describe records that are gone)."""
  records = read_records(results) if records is None else records
  if not records:
    table = f"no run recorded yet under {os.path.abspath(os.path.join(results, RUNS_DIR))}"
    for name in OUTPUTS[1:]:
      if os.path.exists(os.path.join(results, name)):
        os.remove(os.path.join(results, name))
  else:
    rows = summarize(records, names, baseline)
    table = format_table(rows, baseline) + "\n\n" + _provenance(records).format(b=baseline)
    metrics.write_json(os.path.join(results, "report.json"), rows)
    plot_curves(records, rows, os.path.join(results, "curves.png"))
    plot_gaps(rows, baseline, os.path.join(results, "gap.png"))
  table = "\n".join([table, *notes])
  os.makedirs(results, exist_ok=True)
  with open(os.path.join(results, TABLE), "w") as f:
    f.write(table + "\n")
  return table


def mean_curve(runs: list[dict[str, Any]]) -> tuple[list[int], list[float], list[float], list[float]]:
  """(steps, mean, min, max) of the runs' stored train losses at the steps every one of them holds (none when
  their curves share no step, e.g. runs logged at other intervals)."""
  steps = sorted(set.intersection(*(set(r["curve"]["step"]) for r in runs)))
  at = [dict(zip(r["curve"]["step"], r["curve"]["loss"])) for r in runs]
  values = [[a[s] for a in at] for s in steps]
  return steps, [statistics.fmean(v) for v in values], [min(v) for v in values], [max(v) for v in values]


def plot_curves(records: list[dict[str, Any]], rows: list[dict[str, Any]], path: str) -> None:
  plt = metrics.pyplot()
  fig, ax = plt.subplots(figsize=(8, 5))
  tops = []
  for i, row in enumerate(rows):
    runs = [r for r in records if r["name"] == row["name"] and r["status"] == "ok" and r["curve"]["step"]]
    if not runs:
      continue
    steps, mean, low, high = mean_curve(runs)
    if not steps:
      continue
    tokens = [s * runs[0]["tokens_per_step"] / 1e6 for s in steps]
    ax.plot(tokens, mean, color=f"C{i}", label=f"{row['name']} (n={len(runs)})")
    ax.fill_between(tokens, low, high, color=f"C{i}", alpha=0.2, linewidth=0)
    tops.append(mean[len(mean) // 10])  # zoom past the first tenth: the early losses dwarf the differences
  if tops:
    ax.set_ylim(top=max(tops))
  ax.set_xlabel("training tokens (M)")
  ax.set_ylabel("train loss (nats/token), mean over seeds; min-max shaded")
  ax.grid(alpha=0.3)
  if tops:
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_gaps(rows: list[dict[str, Any]], baseline: str, path: str) -> None:
  plt = metrics.pyplot()
  shown = [r for r in rows if r["name"] != baseline and r["gap_pct"] is not None]
  fig, ax = plt.subplots(figsize=(8, 4.5))
  spread = next((r["baseline_spread_pct"] for r in rows if r["baseline_spread_pct"] is not None), None)
  if spread:
    ax.axhspan(-spread, spread, color="0.85", label=f"{baseline} seed spread (± 1 sample std)")
  ax.axhline(0, color="0.4", linewidth=0.8)
  # An entry with an error bar is filled; one without (fewer than two runs here or in the baseline) is hollow,
  # so a single run does not read as a precise one.
  for has_error in (True, False):
    at = [i for i, r in enumerate(shown) if (r["gap_err_pct"] is not None) == has_error]
    if at:
      errors = [shown[i]["gap_err_pct"] for i in at] if has_error else None
      ax.errorbar(at, [shown[i]["gap_pct"] for i in at], yerr=errors,
                  fmt="o", capsize=4, color="C0", mfc="C0" if has_error else "none",
                  label="± standard error of the gap" if has_error else "no error bar (fewer than 2 runs)")
  ax.set_xticks(range(len(shown)), [f"{r['name']}\n{r['ok']} run{'s' * (r['ok'] != 1)}" for r in shown],
                rotation=20)
  ax.set_ylabel(f"held-out loss gap vs {baseline} (%)")
  ax.grid(alpha=0.3, axis="y")
  if ax.get_legend_handles_labels()[0]:  # nothing to label when only the baseline has runs
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
