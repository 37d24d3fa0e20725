"""The training loop: mesh, sharded model + AdamW state, one jitted train step, eval, checkpoints, metrics.

Jit style: functional NNX. `nnx.split((model, optimizer))` gives a static graphdef and one `nnx.State`
pytree; `train_step(state, batch, step)` merges them inside `jax.jit`, takes the gradient with
`nnx.value_and_grad` (in `data.microbatches` sequential passes: `objective.loss_and_grads`), applies
`optimizer.update` and returns the new state; the eval step runs its batch in the same passes
(`objective.eval_loss`). The input state is donated (`donate_argnums=0`), so parameters and Adam moments are
updated in place. The state is created directly with its shardings (`jax.jit(init, out_shardings=...)`), from
the `nnx.with_partitioning` metadata the model puts on its params (mesh axes ("data", "fsdp")); batches are
sharded over both axes.

Randomness: the step key is `fold_in(key(seed), step)`, so a resumed run replays exactly the keys of an
uninterrupted one; the data position is checkpointed with the state.

Non-finite guard without a per-step host sync: step t's loss is read after step t+1 is dispatched, so the
device never waits on the host; before an eval or a checkpoint the latest loss is read synchronously and the
whole state checked finite (a finite loss says nothing of the update that followed it), so a NaN/inf state is
never saved and the run stops naming the step. Steps are 1-based everywhere (messages, metrics, checkpoints,
the table): step N is the N-th optimizer update, and checkpoint N holds the state after it.
A stop signal (SIGINT, SIGTERM) checkpoints the step in flight and ends the run (`train.interrupt`).

Multi-host (documented, untested here): launch one process per host with the usual JAX env
(JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, or a SLURM/TPU environment) and set
FP4JAX_DISTRIBUTED=1; `main` then calls `jax.distributed.initialize()` before touching devices. Every host
builds the same global batch from the same token cache; `jax.make_array_from_callback` keeps only its shards.
Only process 0 writes logs, plots and tables; Orbax coordinates the checkpoint writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import resource
import sys
import time
import traceback
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from train import build, checkpoint, config as config_lib, data, interrupt, lock, metrics, objective, progress
from train.errors import UserError

@dataclasses.dataclass
class TrainState:
  """The jitted functions and live state of one run (what `init_train_state` builds)."""
  graphdef: Any
  state: nnx.State
  mesh: Mesh
  batch_sharding: NamedSharding
  train_step: Any
  eval_step: Any
  all_finite: Any
  abandon_ahead: Callable[[], None]  # ends the steps' compile begun ahead (`compile_ahead`'s abandon; or nothing)


def init_train_state(cfg: config_lib.Config, vocab_size: int, mesh: Mesh, *,
                     compile_ahead: tuple[bool, bool] = (False, False)) -> TrainState:
  """The model and optimizer state, initialized, and the jitted steps. compile_ahead (train step, eval step):
  those compiled on a worker thread from the start, one after the other, for the arguments a run passes, while
  the state initializes here (and the run goes on); their first calls wait for them
  (`progress.CompiledOnFirstCall.compile_ahead`)."""
  from fp4jax import platform
  lcfg = build.llama_config(cfg, vocab_size)
  tx = objective.make_tx(cfg.optim, cfg.run.steps)

  def create():
    model = build.build_model(cfg, lcfg)
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  graphdef, abstract = nnx.split(nnx.eval_shape(create))
  shardings = nnx.get_named_sharding(abstract, mesh)
  # The keys are arguments of the jitted steps, not constants inside them: a constant key would make the
  # program, and so its persistent-cache entry, differ per run.seed (a study's second seed compiled afresh).
  base_key = jax.random.key(cfg.run.seed)
  eval_key = jax.random.fold_in(jax.random.key(cfg.run.seed + 1), 0)

  @functools.partial(jax.jit, donate_argnums=0, out_shardings=(shardings, None, None))
  def keyed_train_step(state, batch, step, base_key):
    model, optimizer = nnx.merge(graphdef, state)
    key = jax.random.fold_in(base_key, step)
    loss, grads = objective.loss_and_grads(model, batch, key, cfg.data.microbatches)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss, optax.tree.norm(grads)

  @jax.jit
  def keyed_eval_step(state, batch, eval_key):
    model, _ = nnx.merge(graphdef, state)
    return objective.eval_loss(model, batch, eval_key, cfg.data.microbatches)

  threads = None if cfg.run.kernels_first else 0
  kernels = platform.kernel_cache_dir(platform.cache_dir(cfg.run.compile_cache))
  # (state, batch, step) and (state, batch)
  train_step = progress.CompiledOnFirstCall(keyed_train_step, base_key, threads=threads, directory=kernels, mesh=mesh)
  eval_step = progress.CompiledOnFirstCall(keyed_eval_step, eval_key, threads=threads, directory=kernels, mesh=mesh)
  batch_sharding = NamedSharding(mesh, P(build.MESH_AXES, None))
  if any(compile_ahead):  # the state as the initializer below returns it, a batch as `data` windows it
    state_spec = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    batch_spec = jax.ShapeDtypeStruct(data.batch_shape(cfg.data.seq_len, cfg.data.batch_size), data.WINDOW_DTYPE,
                                      sharding=batch_sharding)
    jobs = [(train_step, (state_spec, batch_spec, jnp.int32(0))), (eval_step, (state_spec, batch_spec))]
    abandon = progress.CompiledOnFirstCall.compile_ahead([job for job, ahead in zip(jobs, compile_ahead) if ahead])
  else:
    abandon = lambda: None
  try:
    with jax.set_mesh(mesh):
      state = platform.compile_initializer(lambda: nnx.split(create())[1], out_shardings=shardings)()
  except Exception:
    abandon()  # the failed set-up's compile ends before its error leaves (a study goes on to its next run)
    raise

  @jax.jit
  def all_finite(state):
    leaves = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves]))

  return TrainState(graphdef, state, mesh, batch_sharding, train_step, eval_step, all_finite, abandon)


def checkpoint_alternative(ts: TrainState) -> checkpoint.Alternative | None:
  """For a model whose blocks are scanned: the per-layer layout of its state (`layers.{i}`), which scanned runs
  saved before their blocks' parameters were held stacked (3da1e21), and the conversion from it, so that those
  checkpoints resume (`Checkpointer.restore`). None for an unrolled model, whose layout did not change."""
  from fp4jax.nn.llama.model import stacked_params, unstacked_params
  model, _ = nnx.merge(ts.graphdef, ts.state)
  if not model.scan_layers:
    return None
  groups = model.block_groups
  target = checkpoint.abstract_state(ts.state)

  def take(s: jax.ShapeDtypeStruct, _) -> jax.ShapeDtypeStruct:  # one layer of a stacked leaf, its sharding
    sharding = s.sharding
    if isinstance(sharding, NamedSharding):
      sharding = NamedSharding(sharding.mesh, P(*sharding.spec[1:]))
    return jax.ShapeDtypeStruct(s.shape[1:], s.dtype, sharding=sharding)

  shardings = jax.tree.map(lambda s: s.sharding, target)
  return checkpoint.Alternative(unstacked_params(target, groups, take),
                                lambda restored: jax.device_put(stacked_params(restored, groups), shardings))


def to_global(batch: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """The global batch as a sharded array; each process materializes only its addressable shards."""
  return jax.make_array_from_callback(batch.shape, sharding, lambda idx: batch[idx])


def step_memory(compiled, devices, *more) -> tuple[int | None, str]:
  """(bytes, kind) of a route's memory for its table row: XLA's plan of its compiled train step
  (`metrics.planned_bytes`), or the largest plan of it and the `more` compiled steps (the eval step, which runs
  on the same devices between train steps), the route's own whatever ran before it in the process; else (no
  train step compiled in this call: a resumed finished run) the process's peak so far, the max device
  peak_bytes_in_use where the backend reports it, else the max RSS, which holds every earlier route of the
  process too (JAX resets neither: it made a compare run's later routes look as large as the largest before
  them)."""
  planned = None if compiled is None else metrics.planned_bytes(compiled)
  if planned is not None:
    plans = [metrics.planned_bytes(c) for c in more if c is not None]
    return max([planned] + [p for p in plans if p is not None]), "step plan"
  peaks = [s.get("peak_bytes_in_use") for d in devices if (s := d.memory_stats())]
  peaks = [p for p in peaks if p is not None]
  if peaks:
    return max(peaks), "process peak"
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process RSS"


def evaluate(ts: TrainState, batches: list[np.ndarray]) -> float:
  losses = [ts.eval_step(ts.state, to_global(b, ts.batch_sharding)) for b in batches]
  return float(np.mean([float(l) for l in losses]))


def route_data(cfg: config_lib.Config, train_tokens: np.ndarray, eval_tokens: np.ndarray
               ) -> tuple[data.WindowIterator, list[np.ndarray]]:
  """A route's train windows and held-out batches; a UserError when the tokens are too few for a batch of either."""
  it = data.WindowIterator(train_tokens, cfg.data.seq_len, cfg.data.batch_size, cfg.run.seed)
  return it, data.eval_windows(eval_tokens, cfg.data.seq_len, cfg.data.batch_size, cfg.run.eval_batches)


def run(cfg: config_lib.Config, train_tokens: np.ndarray, eval_tokens: np.ndarray, vocab_size: int,
        *, label: str | None = None) -> dict[str, Any]:
  """Trains (or resumes) one route; returns the table row plus per-step losses {step: loss}, steps 1-based."""
  r = cfg.run
  label = label or cfg.route
  lead = jax.process_index() == 0
  saved = check_out_dir(cfg)
  if saved is not None:
    if lead:
      print(f"[{label}] finished earlier: reporting {os.path.join(r.out_dir, RESULT_FILE)} (use another run.out_dir "
            f"to train again)", file=sys.stderr)
    return {**saved, "losses": {}}
  # Every refusal first (the data too short, a checkpoint that cannot continue this run), then the first write:
  # a refused run leaves out_dir as it found it.
  mesh = build.check_mesh(cfg)
  it, eval_batches = route_data(cfg, train_tokens, eval_tokens)
  t_start = time.time()  # the route's set-up: its first step's wall time counts from here
  saved_steps = checkpoint.saved_steps(os.path.join(r.out_dir, "ckpt"))
  # The steps compile while the state initializes (and, the eval step, while training begins); not a train step
  # that a finished run's checkpoint leaves nothing to do for.
  ts = init_train_state(cfg, vocab_size, mesh, compile_ahead=(not saved_steps or saved_steps[-1] < r.steps, True))
  fresh = not saved_steps  # no log to continue: set aside below
  ckpt = checkpoint.Checkpointer(os.path.join(r.out_dir, "ckpt"))
  start, data_state = 0, {}
  if ckpt.latest_step() is not None:
    ts.state, data_state, start = ckpt.restore(ts.state, alternative=checkpoint_alternative(ts))
    it.restore(data_state)
  os.makedirs(r.out_dir, exist_ok=True)
  if lead and fresh:
    metrics.set_aside(r.out_dir, log=sys.stderr)
  if lead:  # written whole or not at all (a process stopped mid-write left a torn file that blocked resuming)
    path = os.path.join(r.out_dir, "config.yaml")
    with open(path + ".tmp", "w") as f:
      yaml.safe_dump(config_lib.to_dict(cfg), f, sort_keys=False)
    os.replace(path + ".tmp", path)
  log = metrics.MetricsLogger(r.out_dir, label, after=start) if lead else None
  bar = metrics.ProgressBar(r.steps, label, enabled=r.progress and lead, every=r.log_every)
  rec = progress.StepRecorder(cfg, label, ckpt, log, bar, started=t_start)
  rec.resume(data_state)
  eval_loss = None
  pending = None  # (step, loss, grad norm) of the last dispatched step, its loss not yet checked
  stop = interrupt.StopRequest(label, enabled=jax.process_count() == 1)
  try:
    with stop:
      for done in range(start + 1, r.steps + 1):  # `done`: 1-based, the updates made once this step has run
        batch = to_global(next(it), ts.batch_sharding)
        if done == start + 1:  # the first call waits for the step's compile: say so while it lasts
          program = ts.train_step
          compile_s = lambda: getattr(program, "compile_s", None)  # pylint: disable=cell-var-from-loop
          with progress.compile_ticker(label, enabled=lead, since=getattr(program, "started", None),
                                       took=compile_s) as timer:
            ts.state, loss, gnorm = program(ts.state, batch, jnp.int32(done - 1))
          rec.compile_s = compile_s() or timer()
          report = getattr(program, "report", None)
          if lead and report is not None and report.summary():
            print(f"[{label}] {report.summary()}", file=sys.stderr, flush=True)
        else:
          ts.state, loss, gnorm = ts.train_step(ts.state, batch, jnp.int32(done - 1))
        if pending:  # the previous step's loss, read while this step runs: no device idle time
          rec.record(*pending)
        if done == start + 2:  # the rest of the eval step's compile, waited for before the timed steps' Python
          with rec.paused():
            ts.eval_step.wait()
        pending = (done, loss, gnorm)
        if (r.eval_every and done % r.eval_every == 0) or done == r.steps:
          rec.record(*pending)
          pending = None
          with rec.paused():
            eval_loss = evaluate(ts, eval_batches)
          if log:
            log.log(done, "eval", {"loss": eval_loss, "perplexity": math.exp(min(eval_loss, 50.0))})
        # A stop request (SIGINT, SIGTERM) saves the state after this step, also when it came during the eval.
        if (r.ckpt_every and done % r.ckpt_every == 0) or done == r.steps or stop.signum is not None:
          if pending:
            rec.record(*pending)
            pending = None
          with rec.paused():
            if not bool(ts.all_finite(ts.state)):  # a finite loss does not prove the update after it finite
              raise progress.NonFiniteLossError(
                  f"[{label}] state is non-finite after step {done} (whose loss was finite); stopped before "
                  f"saving it. {progress.last_good(ckpt)}")
            ckpt.save(done, ts.state, {**it.state(), **rec.saved()})
          if stop.signum is not None:  # written before the handlers are restored: a second signal ends it at once
            ckpt.wait()
            raise interrupt.Interrupted(stop.signum, label, done, ckpt.directory)
  except Exception as err:  # a failed first step: the eval step's compile ends before the error leaves
    if not isinstance(err, interrupt.Interrupted):  # a stop request leaves at once
      ts.abandon_ahead()
    raise
  finally:
    bar.close()
    if log:  # before the checkpointer, whose close may raise (a full disk under the step in flight)
      log.close()
    ckpt.close()
  if eval_loss is None:  # nothing left to train (resumed a finished run): evaluate the restored state
    eval_loss = evaluate(ts, eval_batches)
  peak, peak_kind = step_memory(getattr(ts.train_step, "compiled", None), mesh.devices.flat,
                                getattr(ts.eval_step, "compiled", None))
  row = {"route": label, "steps": r.steps, "train_loss": float(np.mean(rec.tail)) if rec.tail else None,
         "eval_loss": eval_loss, "eval_batches": len(eval_batches), "tokens_per_s": rec.rate or None,
         "first_step_s": rec.first_step_s, "compile_s": rec.compile_s, "peak_bytes": peak,
         "peak_kind": peak_kind, "status": "ok"}
  if lead:
    curves = {label: metrics.read_jsonl(log.jsonl_path)}
    metrics.plot_losses(curves, os.path.join(r.out_dir, "loss.png"), title=label)
    metrics.write_json(os.path.join(r.out_dir, RESULT_FILE), row)  # a rerun reports this instead of re-deriving it
  return {**row, "losses": rec.losses}


RESULT_FILE = "result.json"


def check_out_dir(cfg: config_lib.Config) -> dict[str, Any] | None:
  """The saved result row when run.out_dir holds this run finished, else None (train, from its checkpoint if any).

  Fails with a UserError, before any work, when the checkpoint there cannot continue this config: run.resume is
  false, a result-relevant setting differs from the run that wrote it, or it is past run.steps. A finished run
  whose checkpoints were deleted since (to free the disk) is finished too: its result is reported, or refused
  on the same terms, not trained over.
  """
  r = cfg.run
  steps = checkpoint.saved_steps(os.path.join(r.out_dir, "ckpt"))
  result = os.path.join(r.out_dir, RESULT_FILE)
  finished = os.path.exists(result)
  if not steps and not finished:
    return None
  held = (f"{r.out_dir} holds a run checkpointed at step {steps[-1]}" if steps else
          f"{r.out_dir} holds a finished run ({RESULT_FILE}, no checkpoint)")
  if not r.resume:
    raise UserError(f"{held} and run.resume=false: use another run.out_dir, or delete it to train afresh")
  saved_cfg = os.path.join(r.out_dir, "config.yaml")  # written before the run's first checkpoint
  try:
    with open(saved_cfg) as f:
      saved = yaml.safe_load(f)
  except (FileNotFoundError, yaml.YAMLError, UnicodeDecodeError) as err:
    saved = err
  if not isinstance(saved, dict) or not saved:  # not comparable: its result would pass for these settings'
    state = "missing" if isinstance(saved, FileNotFoundError) else "damaged or empty"
    raise UserError(f"{held}, but its {saved_cfg} is {state}, so its settings cannot be compared with these: "
                    f"restore it (the settings the run was started with), or use another run.out_dir")
  changed = config_lib.changed_settings(saved, config_lib.to_dict(cfg))
  if changed:
    raise UserError(f"{held} with other settings ({'; '.join(changed[:4])}): use another run.out_dir for the new "
                    f"settings")
  if steps and steps[-1] > r.steps:
    raise UserError(f"{held}, past run.steps={r.steps}: use another run.out_dir for a shorter run")
  saved_steps = (saved.get("run") or {}).get("steps", r.steps)
  if saved_steps != r.steps:  # the learning-rate schedule spans run.steps: resuming would switch schedules
    raise UserError(f"{held} of a run.steps={saved_steps} learning-rate schedule; run.steps={r.steps} would go on "
                    f"along another one: use another run.out_dir for a longer run")
  if finished and (not steps or steps[-1] == r.steps):
    return _saved_result(result, checkpointed=bool(steps))
  return None


def _saved_result(path: str, *, checkpointed: bool) -> dict[str, Any]:
  """The table row a finished run saved in `path`; a UserError naming it where it holds none (damaged by a disk,
  a copy cut short or an edit: `metrics.write_json` itself never leaves half a file), which would fail as a
  traceback in the table."""
  try:
    with open(path) as f:
      row = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as err:
    row = err
  if not isinstance(row, dict) or not {"route", "steps", "status"} <= set(row):
    again = "to evaluate its final checkpoint again" if checkpointed else "to train the run again"
    raise UserError(f"{path} is damaged (it holds no result row of a run): delete it {again}, or use another "
                    f"run.out_dir")
  return row


def run_all(cfg: config_lib.Config, *, log=None) -> list[dict[str, Any]]:
  """One run per route of `run.routes` (compare mode, out_dir/<route>/) or of `route`; shared data.

  Writes out_dir/table.md, out_dir/summary.json and (compare mode) out_dir/loss.png with every curve. A
  route whose loss goes non-finite gets a row with that status (not "ok"); compare mode then goes on to the next
  route, and the caller decides the exit status from the rows. A route already finished in its out_dir with the
  same settings is not trained again: its saved result.json row is reported. The config is checked in full first,
  then out_dir, and in compare mode each route's out_dir/<route> (which a single-route run may name), is locked
  for the whole call (`train.lock.RunLock`). An out_dir that holds a run of the other layout (single-route or
  compare), whose plot and table this call would overwrite, is refused (`metrics.check_layout`). A call refused
  (or stopped) before its first route runs, or stopped by Ctrl-C or SIGTERM (`interrupt.sigterm_raises`) before a
  route has a checkpoint (its first step), removes the folders and LOCK files it made, and only those.
  """
  log = sys.stderr if log is None else log
  out_dirs = list(dict.fromkeys([cfg.run.out_dir] + [sub.run.out_dir for _, sub in build.route_configs(cfg)]))
  made = _missing_dirs(out_dirs)  # what this call makes (preflight, the locks), removed again if it is refused
  with contextlib.ExitStack() as held:
    held.enter_context(interrupt.sigterm_raises(enabled=jax.process_count() == 1))  # SIGTERM undoes as Ctrl-C does
    locks: list[lock.RunLock] = []
    try:
      files, tok = build.preflight(cfg, log)
      if jax.process_index() == 0:
        for out_dir in out_dirs:
          locks.append(held.enter_context(lock.RunLock(out_dir, log=log)))
      # under the lock: what a running job writes there is not yet final
      metrics.check_layout(cfg.run.out_dir, compare=bool(cfg.run.routes), route=cfg.route)
      for _, sub in build.route_configs(cfg):
        check_out_dir(sub)
      splits = data.load_splits(cfg.data, files=files, tok=tok, log=log)
      route_data(cfg, *splits[:2])  # the routes differ in route and out_dir only: too few tokens fail here, once
    except BaseException:  # refused (or stopped) before any route ran: the directories as the call found them
      _remove_made(locks, made)
      raise
    try:
      return _run_routes(cfg, splits, log)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM outside the steps (inside them `train.interrupt` saves the step)
      ckpts = [os.path.join(sub.run.out_dir, "ckpt") for _, sub in build.route_configs(cfg)]
      if not any(checkpoint.saved_steps(c) for c in ckpts):  # before the first step: as a refused call
        _remove_made(locks, made)
      raise


def _remove_made(locks: list[lock.RunLock], made: set[str]) -> None:
  """The LOCK files that `locks` made and the folders in `made` that are still empty removed, while the locks are
  held (`RunLock.release(remove=True)`): what a call that trained nothing leaves of its own."""
  for held_lock in reversed(locks):
    held_lock.release(remove=True)
  for path in sorted(made, key=len, reverse=True):  # a folder before the one that holds it
    with contextlib.suppress(OSError):  # one that holds something now stays
      os.rmdir(path)


def _missing_dirs(paths: list[str]) -> set[str]:
  """The directories, `paths` and the folders above them, that do not exist yet."""
  missing = set()
  for path in paths:
    path = os.path.abspath(path)
    while not os.path.lexists(path):
      missing.add(path)
      path = os.path.dirname(path)
  return missing


def _run_routes(cfg: config_lib.Config, splits: tuple[np.ndarray, np.ndarray, Any], log) -> list[dict[str, Any]]:
  compare = bool(cfg.run.routes)
  routes = cfg.run.routes or (cfg.route,)
  train_tokens, eval_tokens, tok = splits
  log.write(f"[train] {len(train_tokens):,} train / {len(eval_tokens):,} held-out {tok.name} tokens; "
            f"routes {list(routes)}; {jax.device_count()} {jax.devices()[0].platform} device(s)\n")
  short = data.short_heldout(len(eval_tokens), cfg.data, cfg.run.eval_batches)
  if short:
    log.write(f"[train] warning: {short}\n")
  rows = []
  for name, sub in build.route_configs(cfg):
    try:
      rows.append(run(sub, train_tokens, eval_tokens, tok.vocab_size, label=name))
    except progress.NonFiniteLossError as e:
      log.write(f"{e}\n")
      if not compare:
        raise
      rows.append({"route": name, "steps": cfg.run.steps, "status": str(e).split(";")[0].split("] ")[-1]})
    except (UserError, interrupt.Interrupted):  # a mistake, or a stop: for the whole call
      raise
    except Exception as e:  # pylint: disable=broad-except  # a bug in one route: the others still run
      if not compare:
        raise
      log.write(f"[{name}] failed:\n{traceback.format_exc()}")
      rows.append({"route": name, "steps": cfg.run.steps, "status": f"raised {type(e).__name__}"})
    if compare:  # each route's row as soon as it is done: a run cut short keeps the finished ones
      log.write(f"[train] done: {metrics.format_table(rows[-1:]).splitlines()[-1]}\n")
  if jax.process_index() == 0:
    table = metrics.format_table(rows)
    with open(os.path.join(cfg.run.out_dir, "table.md"), "w") as f:
      f.write(table + "\n")
    metrics.write_json(os.path.join(cfg.run.out_dir, "summary.json"), [{k: v for k, v in r.items() if k != "losses"}
                                                                 for r in rows])
    if compare:
      curves = {name: metrics.read_jsonl(p) for name in routes
                if os.path.exists(p := os.path.join(cfg.run.out_dir, name, "metrics.jsonl"))}
      plot = os.path.join(cfg.run.out_dir, "loss.png")
      if not metrics.plot_losses(curves, plot, title="routes compared"):
        log.write("[train] no loss curve to plot: no route logged a step\n")
        if os.path.exists(plot):  # an earlier call's, which would pass for this one's
          os.remove(plot)
  return rows
