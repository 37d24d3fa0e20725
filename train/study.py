"""Route-quality study: routes x seeds at one token budget, one small JSON record per finished run, then a report.

`python -m train.study --config configs/study_30m.yaml [--set key=value ...] [--only NAME[:SEED] ...] [--report]`

A study config is a training config (every section as for `python -m train`) plus a `study:` section:

  study:
    routes:                          # entries: a route name, or {name, route, rules}
      - bf16
      - mxfp4
      - {name: nvfp4_last2_bf16, route: nvfp4, rules: {bf16_last: 2}}
    seeds: {bf16: 3, default: 2}     # runs per entry: one int for all, or per entry name with an optional default
    tokens: 100e6                    # training tokens per run
    results: results/study_30m       # where the records and the report go (committed)
    baseline: bf16                   # the entry the gaps are measured against (default bf16)
    final_logged: 10                 # final train loss = mean of the last this many logged train losses
    curve_points: 200                # a record's loss curve keeps at most this many (step, loss) points
                                     # (both applied when a run is recorded; a report averages a record of
                                     # another final_logged again from its curve, or stops if that was cut)

Each run is one `train.train.run_all` call on the config with `route` set to the entry's route, the entry's
`rules` keys replacing the config's (`rules: {bf16_last: 2}` keeps the config's bf16_first), run.seed = the
config's run.seed + k for the entry's k-th run (the seed draws the initial weights, the data order and the step
keys), run.steps = ceil(tokens / (data.batch_size * data.seq_len)) (so a run trains at least `tokens`, less than
one step more), and run.out_dir = <the config's run.out_dir>/<name>-seed<seed>: the scratch directory of that
run (checkpoints, metrics, not committed). run.steps and run.routes must not be set: the study sets them.

When a run finishes, its record goes to <results>/runs/<name>-seed<seed>.json: the settings, the final train and
held-out loss, throughput, compile and first-step time, the step's planned memory, date, git commit (or
$FP4JAX_COMMIT where the tree has no git), device, and its logged train-loss curve subsampled to <= curve_points
points. A run whose record exists is not run again, so a study goes on across processes, machines and sessions
(one run per call with --only); a run cut short resumes from the checkpoint in its scratch directory if that is
still there and was saved with the same config; a finished run found there without its record is trained again
(`clear_scratch`). Every record is checked against its run's config first (`study_records`: other settings stop
the call). A run whose loss goes non-finite is recorded with that status (the report counts it, its loss is left
out). After the runs (or alone with --report) the report is written from every record: see `train.study_report`.

Exit status: 0 when no run of this call diverged, 1 when one did (it is recorded all the same), 2 for a mistake in
the config (one line, before any work).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import re
import subprocess
import sys
import typing
from typing import Any, TextIO

from train import config as config_lib, interrupt, lock, main as main_lib, metrics, study_report
from train.config import ConfigError
from train.errors import UserError

_KEYS = ("routes", "seeds", "tokens", "results", "baseline", "final_logged", "curve_points")
_NAME = re.compile(r"[A-Za-z0-9_.+]+$")  # an entry's name makes file names and --only arguments


@dataclasses.dataclass(frozen=True)
class Entry:
  """One study entry: `name` (its records, table row and curves) trains `route` with `rules` over the config's."""
  name: str = ""
  route: str = ""
  rules: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Settings:
  """The scalar keys of `study:` (routes and seeds are parsed apart: each takes more than one form)."""
  tokens: float = 0.0
  results: str = ""
  baseline: str = "bf16"
  final_logged: int = 10
  curve_points: int = 200

  def __post_init__(self):
    config_lib.expand_home(self, "results")
    for name, ok, need in (("tokens", 0 < self.tokens < math.inf, "a finite number > 0"),
                           ("results", bool(self.results), "a directory path, not empty"),
                           ("final_logged", self.final_logged >= 1, ">= 1"),
                           ("curve_points", self.curve_points >= 2, ">= 2")):
      if not ok:
        raise ConfigError(f"study.{name}={getattr(self, name)!r} must be {need}")


@dataclasses.dataclass(frozen=True)
class Run:
  """One (entry, seed) run and the full training config it runs with."""
  name: str
  seed: int
  cfg: config_lib.Config

  @property
  def key(self) -> str:
    return f"{self.name}-seed{self.seed}"


@dataclasses.dataclass(frozen=True)
class Study:
  """A loaded study: its settings, its entries in config order, and every (entry, seed) run with its config."""
  settings: Settings
  entries: tuple[Entry, ...]
  runs: tuple[Run, ...]

  def record_path(self, run: Run) -> str:
    """Where `run`'s record goes (and, when it exists, why the run is skipped)."""
    return os.path.join(self.settings.results, study_report.RUNS_DIR, f"{run.key}.json")


def load(path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> Study:
  """The study of a config file plus dotted overrides (`study.tokens=1e6` too); every run's config is checked."""
  raw = config_lib.with_overrides(config_lib.read_yaml(path), overrides,
                                 {**typing.get_type_hints(config_lib.Config), "study": Settings})
  section = raw.pop("study", None)
  if section is None:
    raise ConfigError(f"{path or 'the config'} has no study: section (routes, seeds, tokens, results); see "
                      f"configs/study_30m.yaml, or use python -m train for a single run")
  if not isinstance(section, dict):
    raise ConfigError(f"study: expected a mapping, got {section!r}")
  unknown = sorted(set(section) - set(_KEYS))
  if unknown:
    raise ConfigError(f"unknown key(s) {['study.' + k for k in unknown]}; valid keys in study: {list(_KEYS)}")
  missing = [k for k in ("routes", "tokens", "results") if k not in section]
  if missing:
    raise ConfigError(f"study.{missing[0]} is missing; a study needs routes, tokens and results")
  entries = _entries(section["routes"])
  _check_entry_overrides(overrides, entries)
  run_raw = raw.get("run") if isinstance(raw.get("run"), dict) else {}
  for key, why in (("steps", "study.tokens sets it (--set study.tokens=... to change the budget)"),
                   ("routes", "list the routes in study.routes")):
    if key in run_raw:
      raise ConfigError(f"run.{key} cannot be set in a study config: {why}")
  base = config_lib.from_dict(raw)  # the shared settings, checked once before the per-entry ones
  settings = config_lib.build(Settings, {k: v for k, v in section.items() if k not in ("routes", "seeds")}, "study")
  names = [e.name for e in entries]
  if settings.baseline not in names:
    raise ConfigError(f"study.baseline={settings.baseline!r} is not an entry of study.routes {names}")
  seeds = _seed_counts(section.get("seeds", 1), names)
  steps = math.ceil(settings.tokens / (base.data.batch_size * base.data.seq_len))
  runs = []
  for i, e in enumerate(entries):
    for k in range(seeds[e.name]):
      seed = base.run.seed + k
      sub = config_lib.with_overrides(raw)
      sub["route"] = e.route
      sub["rules"] = {**(raw.get("rules") or {}), **e.rules}
      sub["run"] = {**run_raw, "seed": seed, "steps": steps, "out_dir": os.path.join(base.run.out_dir,
                                                                                      f"{e.name}-seed{seed}")}
      try:
        runs.append(Run(e.name, seed, config_lib.from_dict(sub)))
      except ConfigError as err:
        raise ConfigError(f"study.routes[{i}] ({e.name}): {err}") from err
  return Study(settings, tuple(entries), tuple(runs))


def _entries(value: Any) -> list[Entry]:
  if isinstance(value, str):
    value = [value]
  if not isinstance(value, list) or not value:
    raise ConfigError(f"study.routes: expected a non-empty list of route names or {{name, route, rules}} entries, "
                      f"got {value!r}")
  entries: list[Entry] = []
  for i, item in enumerate(value):
    where = f"study.routes[{i}]"
    if isinstance(item, str):
      entry = Entry(item, item)
    elif isinstance(item, dict):
      entry = config_lib.build(Entry, item, where)
      if not entry.route:
        raise ConfigError(f"{where}: names no route; give route: <a route name>")
      entry = dataclasses.replace(entry, name=entry.name or entry.route)
    else:
      raise ConfigError(f"{where}: expected a route name or a mapping {{name, route, rules}}, got {item!r}")
    if not _NAME.match(entry.name):
      raise ConfigError(f"{where}: name {entry.name!r} must be letters, digits, '_', '.' or '+' (it names files)")
    if entry.name in [e.name for e in entries]:
      raise ConfigError(f"{where}: name {entry.name!r} is used twice; give each entry its own name")
    entries.append(entry)
  return entries


def _check_entry_overrides(overrides: list[str] | tuple[str, ...], entries: list[Entry]) -> None:
  """A --set of what each entry sets over the config (its route, the rules keys it names) would not be read: a
  ConfigError naming the entries that set it."""
  for o in overrides:
    tree = config_lib.with_overrides({}, [o])
    if "route" in tree:
      raise ConfigError(f"--set {o}: a study does not read route, its routes come from the study's entries "
                        f"(study.routes); change those, e.g. --set 'study.routes=[bf16, nvfp4]'")
    rules = tree.get("rules")
    for key in sorted(rules) if isinstance(rules, dict) else ():
      setters = [e.name for e in entries if key in e.rules]
      if setters:
        raise ConfigError(f"--set {o}: rules.{key} is set by the study's entries {setters}, whose own "
                          f"rules.{key} replaces it; change it in their study.routes entries")


def _seed_counts(value: Any, names: list[str]) -> dict[str, int]:
  """{entry name: number of seeds} from an int (all entries) or a mapping by name with an optional `default`."""
  if isinstance(value, dict):
    unknown = sorted(set(value) - set(names) - {"default"})
    if unknown:
      raise ConfigError(f"study.seeds names {unknown}, which are not entries of study.routes {names} nor 'default'")
    counts = {n: value.get(n, value.get("default")) for n in names}
    missing = [n for n, c in counts.items() if c is None]
    if missing:
      raise ConfigError(f"study.seeds gives no count for {missing}: add them or a default")
  else:
    counts = {n: value for n in names}
  out = {}
  for n, c in counts.items():
    out[n] = config_lib.convert(c, int, f"study.seeds.{n}")
    if out[n] < 1:
      raise ConfigError(f"study.seeds.{n}={out[n]} must be >= 1")
  return out


def select(study: Study, only: list[str]) -> list[Run]:
  """The runs named by --only arguments, NAME:SEED for one run or NAME for every seed of an entry, in the order
  given (all runs without any)."""
  if not only:
    return list(study.runs)
  by_key = {f"{r.name}:{r.seed}": r for r in study.runs}
  chosen: dict[str, Run] = {}
  for o in only:
    keys = [o] if o in by_key else [k for k, r in by_key.items() if r.name == o]
    if not keys:
      raise ConfigError(f"--only {o!r} names no run of this study; runs: {list(by_key)} (or an entry's name for "
                        f"all its seeds)")
    chosen.update((k, by_key[k]) for k in keys)
  return list(chosen.values())


# A record's config names its data by path, and the GPU host reads a copy carried with the tree (.data/...): the
# same files under another path. Records are compared on every other result-relevant setting.
_PATHS = {"data": {"sources", "eval_sources", "tokenizer_path"}}


def record_changes(run: Run, rec: dict[str, Any]) -> list[str]:
  """'key: recorded -> now' for each result-relevant setting in which `rec` (a record of `run`'s name and seed)
  differs from `run`'s config: its step count (study.tokens) and every setting `config.changed_settings` compares,
  data paths aside."""
  steps = [] if rec.get("steps") == run.cfg.run.steps else [
      f"run.steps: {rec.get('steps')!r} -> {run.cfg.run.steps!r} (study.tokens)"]
  saved = rec.get("config") if isinstance(rec.get("config"), dict) else {}
  # run.log_every is neutral to a training run, not to a record: its final train loss averages the last
  # study.final_logged *logged* losses, which log_every spaces out.
  logged = (saved.get("run") or {}).get("log_every", run.cfg.run.log_every)
  spacing = [] if logged == run.cfg.run.log_every else [
      f"run.log_every: {logged!r} -> {run.cfg.run.log_every!r} (the final train loss averages the last "
      f"study.final_logged logged losses)"]
  return steps + spacing + config_lib.changed_settings(saved, config_lib.to_dict(run.cfg), also_neutral=_PATHS)


def study_records(study: Study) -> tuple[list[dict[str, Any]], list[str]]:
  """(the records of this study's runs, note lines for the report). A record made with other settings than its
  run's, or filed under another run's name, is a UserError: averaging it in would mix token budgets, learning
  rates or models without a trace. A final train loss averaged over another window than study.final_logged is
  averaged again from the record's curve (`study_report.same_window`, a UserError where it cannot be) and named in
  a note. Records of runs this config does not have (another seed count, an entry since removed) are left out and
  named in a note, as are the runs with no record yet."""
  by_key = {r.key: r for r in study.runs}
  kept, stray, again = [], [], []
  for path, rec in study_report.read_record_files(study.settings.results):
    key = f"{rec['name']}-seed{rec['seed']}"
    if os.path.basename(path) != f"{key}.json":
      raise UserError(f"{path} holds the record of {key}: a record is filed as <name>-seed<seed>.json; rename it, "
                      f"or delete it if it is a copy")
    if key not in by_key:
      stray.append(key)
      continue
    changes = record_changes(by_key[key], rec)
    if changes:
      raise UserError(f"{path} was recorded with other settings than this study's ({'; '.join(changes[:4])}): use "
                      f"another study.results for the new settings, or delete the record to train that run again")
    cfg = by_key[key].cfg.run  # the record's steps and log_every: record_changes compared them
    redone = study_report.same_window(path, rec, study.settings.final_logged,
                                      rec.get("logged", study_report.logged_count(cfg.steps, cfg.log_every)))
    again += [key] if redone else []
    kept.append(redone or rec)
  notes = [f"Left out: {len(stray)} record(s) of runs this config does not have: {stray}."] if stray else []
  if again:
    notes.append(f"Final train loss averaged again from the curves of {len(again)} record(s) averaged over another "
                 f"window, over the last {study.settings.final_logged} logged losses (study.final_logged): {again}.")
  done = {f"{r['name']}-seed{r['seed']}" for r in kept}
  pending = [r.key for r in study.runs if r.key not in done]
  if pending:
    notes.append(f"Pending: {len(pending)} of the study's {len(study.runs)} runs have no record yet: {pending}.")
  return kept, notes


def run_study(study: Study, runs: list[Run], *, log: TextIO = sys.stderr) -> list[str]:
  """Trains each of `runs` that has no record yet and writes its record; returns the keys of those not ok."""
  import jax
  from train import progress, train
  todo = [r for r in runs if not os.path.exists(study.record_path(r))]
  log.write(f"[study] {len(study.runs)} runs, {sum(os.path.exists(study.record_path(r)) for r in study.runs)} "
            f"recorded; running {len(todo)} of the {len(runs)} selected: {[r.key for r in todo]}\n")
  failed = []
  # SIGTERM between and around the runs too (the LOCK held for clear_scratch) is handled as Ctrl-C is, as in run_all
  with interrupt.sigterm_raises(enabled=jax.process_count() == 1):
    for r in todo:
      if jax.process_index() == 0 and os.path.isdir(r.cfg.run.out_dir):  # a missing one holds nothing to set aside
        held = lock.RunLock(r.cfg.run.out_dir, log=log)  # not under a run of it going on now
        held.acquire()
        try:
          clear_scratch(r, log=log)
        finally:  # a LOCK made here goes: run_all takes its own, and removes it again if it refuses the run
          held.release(remove=True)
      if jax.process_count() > 1:  # every process finds the scratch directory as the first left it
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(f"study scratch {r.key}")
      try:
        row, status = train.run_all(r.cfg, log=log)[0], "ok"
      except progress.NonFiniteLossError as e:
        row, status = {}, str(e)
        failed.append(r.key)
      if jax.process_index() == 0:
        os.makedirs(os.path.dirname(study.record_path(r)), exist_ok=True)
        metrics.write_json(study.record_path(r), record(study, r, row, status, device_name(jax)))
        log.write(f"[study] recorded {study.record_path(r)} ({status})\n")
  return failed


def clear_scratch(run: Run, *, log: TextIO) -> None:
  """Sets aside what `run`'s scratch directory holds unless it is this run cut short with these very settings, so
  that no record reports a run under settings, code or a device it did not use. A finished run there has no
  record (deleted to train it again, or lost): `train.run` would report its result.json, which names neither its
  commit nor its device and passes settings a record depends on (run.log_every), so it is trained again. A
  checkpoint is resumed only where the config.yaml beside it is this run's config, exactly."""
  from train import checkpoint, train
  out = run.cfg.run.out_dir
  why = "of a finished run without its study record"
  if not os.path.exists(os.path.join(out, train.RESULT_FILE)):
    if not checkpoint.saved_steps(os.path.join(out, "ckpt")):
      return  # nothing to resume (train.run sets aside a log left without a checkpoint)
    try:
      if config_lib.read_yaml(os.path.join(out, "config.yaml")) == config_lib.to_dict(run.cfg):
        return
    except ConfigError:  # missing or damaged: not this run's settings for all it shows
      pass
    why = "of a run checkpointed with other settings"
  metrics.set_aside(out, log=log, names=metrics.RUN_OUTPUTS + ("ckpt",), why=f"{why}; {run.key} trains afresh")


def record(study: Study, run: Run, row: dict[str, Any], status: str, device: str) -> dict[str, Any]:
  """The committed record of a finished run: `row` (train.run's) plus its curve from out_dir/metrics.jsonl."""
  cfg, s = run.cfg, study.settings
  path = os.path.join(cfg.run.out_dir, "metrics.jsonl")
  records = metrics.read_jsonl(path) if os.path.exists(path) else []
  train_pts = [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
  if status == "ok" and not train_pts:  # a finished run re-recorded from result.json after its log was removed
    raise UserError(f"{run.key} finished, but {path} holds no train loss, so its record would have no final train "
                    f"loss or curve: delete {cfg.run.out_dir} to train that run again")
  eval_pts = [(r["step"], r["loss"]) for r in records if r["kind"] == "eval"]
  tail = [loss for _, loss in train_pts[-s.final_logged:]]
  per_step = cfg.data.batch_size * cfg.data.seq_len
  return {
      "name": run.name, "route": cfg.route, "rules": config_lib.to_dict(cfg.rules), "seed": run.seed,
      "status": status, "steps": cfg.run.steps, "tokens": cfg.run.steps * per_step, "tokens_per_step": per_step,
      "train_loss": sum(tail) / len(tail) if tail else None, "final_logged": len(tail), "logged": len(train_pts),
      "log_every": cfg.run.log_every, "eval_loss": row.get("eval_loss"), "eval_batches": row.get("eval_batches"),
      "tokens_per_s": row.get("tokens_per_s"),
      "compile_s": row.get("compile_s"), "first_step_s": row.get("first_step_s"),
      "peak_bytes": row.get("peak_bytes"), "peak_kind": row.get("peak_kind"),
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      "commit": git_commit(s.results), "device": device,
      "curve": _columns(subsample(train_pts, s.curve_points)), "eval_curve": _columns(eval_pts),
      "config": config_lib.to_dict(cfg),
  }


def subsample(points: list[Any], limit: int) -> list[Any]:
  """At most `limit` items, evenly spaced by index, always the first and the last."""
  if len(points) <= limit:
    return list(points)
  return [points[i] for i in sorted({round(j * (len(points) - 1) / (limit - 1)) for j in range(limit)})]


def _columns(points: list[tuple[int, float]]) -> dict[str, list[Any]]:
  return {"step": [p[0] for p in points], "loss": [p[1] for p in points]}


def git_commit(results: str) -> str:
  """$FP4JAX_COMMIT, else HEAD's short hash, '+dirty' when tracked files outside `results` differ from it."""
  if os.environ.get("FP4JAX_COMMIT"):
    return os.environ["FP4JAX_COMMIT"]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  git = ["git", "-C", root]
  try:
    head = subprocess.run(git + ["rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=True,
                          timeout=20).stdout.strip()
    rel = os.path.relpath(os.path.abspath(results), root)
    spec = ["--", "."] + ([f":(exclude){rel}"] if not rel.startswith("..") else [])
    dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"] + spec, capture_output=True,
                           text=True, check=True, timeout=20).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return "unknown"
  return head + ("+dirty" if dirty else "")


def device_name(jax: Any) -> str:
  devices = jax.devices()
  return f"{len(devices)} x {devices[0].device_kind} ({devices[0].platform})"


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m train.study", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True, help="a study config (configs/study_*.yaml)")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="dotted override, repeatable: --set study.tokens=1e6 --set data.batch_size=32; the "
                      "value is read as YAML, a string key's (a path, a name) kept as typed")
  p.add_argument("--only", nargs="+", action="extend", default=[], metavar="NAME:SEED",
                 help="run only these runs (e.g. --only mxfp4:1, one run per GPU call; --only mxfp4 for all of "
                      "an entry's seeds)")
  p.add_argument("--report", action="store_true", help="write the report from the records; train nothing")
  p.add_argument("--debug", action="store_true", help="show the traceback of a config/data/run-directory error too")
  args = p.parse_args(argv)
  return main_lib.guarded(p.prog, args.debug, lambda: _main(args))


def _main(args: argparse.Namespace) -> int:
  study = load(args.config, args.set)  # every run's config checked before JAX starts
  if args.report and args.only:
    raise UserError("--report writes the report of every recorded run and trains nothing; --only selects runs "
                    "to train: give one of them")
  runs = select(study, args.only)
  s = study.settings
  runs_dir = os.path.join(s.results, study_report.RUNS_DIR)
  try:  # a results path that cannot hold records fails now, not after the first run has trained
    os.makedirs(runs_dir, exist_ok=True)
  except OSError as e:
    raise UserError(f"study.results={s.results!r} cannot hold the run records ({e})") from e
  records, notes = study_records(study)  # records made with other settings stop the call before any training
  failed = []
  if not args.report:
    jax = main_lib.start_jax(study.runs[0].cfg)
    failed = run_study(study, runs)
    if jax.process_index():
      return main_lib.EXIT_FAILED_RUN if failed else 0
    records, notes = study_records(study)  # with the records this call added
  table = study_report.write(s.results, [e.name for e in study.entries], s.baseline, records, notes)
  print(table)
  beside = " (plots beside it)" if records else ""  # with no record, table.md says so and no plot is written
  print(f"[study] report: {os.path.join(s.results, study_report.TABLE)}{beside}", file=sys.stderr)
  if failed:
    print(f"python -m train.study: {len(failed)} run(s) diverged: {failed}", file=sys.stderr)
  return main_lib.EXIT_FAILED_RUN if failed else 0


if __name__ == "__main__":  # spawned data workers import this module too; they must not train
  interrupt.exit_process(main())
