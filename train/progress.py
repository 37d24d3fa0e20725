"""A run's progress around its steps: the first call compiled off the main thread (so that Ctrl-C is heard),
a ticker while it compiles, and the recorder that checks each step's loss one step behind the dispatch, logs it
and measures the throughput."""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh

from train import checkpoint, config as config_lib, metrics
from train.objective import lr_schedule


class NonFiniteLossError(RuntimeError):
  """Training produced a NaN/inf loss or state; the run stopped without checkpointing the bad state."""


class CompiledOnFirstCall:
  """`jitted(*args, *bound)`, compiled by `fp4jax.compiling.compile_program` (the Pallas kernels alone and in
  parallel first, on `threads`, kept in `directory`; threads=0 compiles as jax.jit does), then run as that
  compiled program. It is traced under `mesh` (`jax.set_mesh`), so that fp4_dot's quantizers run on each
  device's own tokens (`fp4jax.Impl.token_axes`).

  The compile happens on the first call, or earlier on a worker thread (`compile_ahead`, for arguments given
  as ShapeDtypeStructs with their shardings), while the caller does other work; the first call then waits for
  it, and compiles for its own arguments where they differ from those compiled for (shapes, dtypes, shardings,
  tree). Later calls must pass arguments of the first call's kinds, as a training loop does: they are not
  checked here (it cost about 1 ms a step for a 125M model's state), the compiled program refuses others.
  `started`: when the latest compile began (`time.time()`), `compile_s`: the seconds it took (tracing, lowering
  and XLA); None before.
  """

  def __init__(self, jitted, *bound, threads: int | None, directory, mesh: Mesh):
    self.jitted, self.bound, self.threads, self.directory, self.mesh = jitted, bound, threads, directory, mesh
    # self._signature: what the program was compiled for (`_signature`), until the first call has checked it
    self.compiled = self.report = self.compile_s = self.started = self._signature = None
    self._ahead: threading.Event | None = None  # set when a compile started by `compile_ahead` has ended
    self._ahead_error: BaseException | None = None

  def compile(self, *args) -> None:
    """Compiles for `args` (arrays, or ShapeDtypeStructs with shardings) on this thread."""
    from fp4jax import compiling, platform
    t0 = self.started = time.time()
    with jax.set_mesh(self.mesh), platform.old_objects_frozen():
      compiled, report = compiling.compile_program(self.jitted, *args, *self.bound, threads=self.threads,
                                                   directory=self.directory)
    self.compiled, self.report, self._signature = compiled, report, _signature(args)
    self.compile_s = time.time() - t0

  @staticmethod
  def compile_ahead(jobs: list[tuple[CompiledOnFirstCall, tuple]]) -> Callable[[], None]:
    """Compiles each (program, args) of `jobs` in turn on one worker thread (a daemon) and returns at once: the
    caller goes on (initializing the state, reading data) while XLA compiles, and each program's first call (or
    `wait`) waits for its own. An error is raised by that program's first call; the programs after it are
    compiled by their own first calls.

    Returns `abandon`, for a caller whose set-up failed: the jobs not yet begun are dropped (a first call would
    compile them), and it waits, in short joins, for the one compiling, so that a failed run's compile does not
    go on beside what the process does next (a study's next run, `train.study`)."""
    done = [threading.Event() for _ in jobs]
    dropped = threading.Event()
    for (program, _), event in zip(jobs, done):
      program._ahead = event

    def run():
      for i, (program, args) in enumerate(jobs):
        if dropped.is_set():
          break
        try:
          program.compile(*args)
        except BaseException as err:  # pylint: disable=broad-except  # raised by the program's first call
          program._ahead_error = err
          break
        done[i].set()
      for event in done:
        event.set()

    worker = threading.Thread(target=run, name="fp4jax-compile-ahead", daemon=True)
    worker.start()

    def abandon() -> None:
      dropped.set()
      join(worker)

    return abandon

  def wait(self) -> None:
    """Returns once a compile started ahead has ended (at once if none was started); raises its error. Waits in
    short joins, so that a signal is handled at once (`on_worker_thread`)."""
    ahead, self._ahead = self._ahead, None
    if ahead is not None:
      while not ahead.wait(0.2):
        pass
      error, self._ahead_error = self._ahead_error, None
      if error is not None:
        raise error

  def __call__(self, *args):
    self.wait()
    if self.compiled is None or (self._signature is not None and _signature(args) != self._signature):
      on_worker_thread(lambda: self.compile(*args))
    self._signature = None  # the first call's arguments are checked, not every step's
    return self.compiled(*args, *self.bound)


def _signature(args) -> tuple:
  """What a compiled program is specific to: the tree of `args` and each leaf's shape, dtype and sharding (None
  for an abstract leaf without one)."""
  leaves, tree = jax.tree.flatten(args)
  return tree, tuple((np.shape(x), getattr(x, "dtype", None), getattr(x, "sharding", None)) for x in leaves)


def join(thread: threading.Thread, poll: float = 0.2) -> None:
  """Waits for `thread` in joins of `poll` seconds, so that a signal is handled at once (`on_worker_thread`)."""
  while thread.is_alive():
    thread.join(poll)


def on_worker_thread(fn: Callable[[], Any], poll: float = 0.2) -> Any:
  """fn() run on another thread while this one waits in short joins, so that a signal is handled at once:
  Python runs signal handlers on the main thread only, between bytecodes, and a minutes-long XLA compile on
  it held a Ctrl-C (and the second one, meant to stop at once) until the compile ended. fn's exception is
  raised here; a KeyboardInterrupt or a handler's exception leaves the worker behind (a daemon thread)."""
  result: dict[str, Any] = {}

  def run():
    try:
      result["value"] = fn()
    except BaseException as err:  # re-raised on the calling thread
      result["error"] = err

  worker = threading.Thread(target=run, name="fp4jax-compile", daemon=True)
  worker.start()
  join(worker, poll)
  if "error" in result:
    raise result["error"]
  return result["value"]


class StepRecorder:
  """Checks and records each step's loss once it is read to the host, one step behind the dispatch.

  `record` blocks on the loss array, so the loop calls it for step t only after step t+1 is dispatched (and
  synchronously before an eval or a checkpoint). Throughput counts the wall time from the end of the
  first (compiling) step of this process to the end of the latest one, less the eval/checkpoint pauses.
  The last `TAIL` losses, the open log window and the timed steps and seconds so far go into each checkpoint
  (`saved`, `resume`), so a resumed run reports and logs the numbers an uninterrupted one would, and its
  throughput covers every process's timed steps (also when it resumes at the final step and runs none).
  `first_step_s` is the wall time from `started` (the route's set-up; default: now) to the first step's end.
  """

  TAIL = 10  # the table's train loss: the mean of the last TAIL step losses

  def __init__(self, cfg: config_lib.Config, label: str, ckpt: checkpoint.Checkpointer,
               log: metrics.MetricsLogger | None, bar: metrics.ProgressBar, *, started: float | None = None):
    self.cfg, self.label, self.ckpt, self.log, self.bar = cfg, label, ckpt, log, bar
    self.schedule = lr_schedule(cfg.optim, cfg.run.steps)
    float(self.schedule(0))  # its eager jnp ops compiled now, not in the first logged step (0.78 s on an H100)
    self.tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    self.losses: dict[int, float] = {}  # the steps this process ran
    self.tail: list[float] = []  # the last TAIL step losses, restored ones included
    self.rate = 0.0
    self._window: list[float] = []
    self._t_first: float | None = None
    self.t_start = time.time() if started is None else started  # the first step's wall time counts from here
    self.first_step_s: float | None = None
    self.compile_s: float | None = None  # the first call of the train step (this process's, else a checkpoint's)
    self._n_timed, self._pause_s, self._timed_s = 0, 0.0, 0.0
    self._before_n, self._before_s = 0, 0.0  # timed steps and seconds of earlier processes (`resume`)

  @contextlib.contextmanager
  def paused(self):
    """Time spent inside (eval, checkpoint, logging) is left out of the throughput."""
    t0 = time.time()
    try:
      yield
    finally:
      self._pause_s += time.time() - t0

  def record(self, step: int, loss: jax.Array, gnorm: jax.Array) -> None:
    """Checks and logs the loss of `step` (1-based: the step-th optimizer update, as checkpoints count)."""
    value, grad_norm = float(loss), float(gnorm)  # blocks until the step has run
    for what, v in (("loss", value), ("gradient norm", grad_norm)):  # a NaN gradient leaves its update NaN
      if not math.isfinite(v):
        raise NonFiniteLossError(f"[{self.label}] {what} is {v} at step {step}; stopped. {last_good(self.ckpt)}")
    now = time.time()
    if self._t_first is None:
      self._t_first, self._pause_s = now, 0.0
      self.first_step_s = now - self.t_start
    else:
      self._n_timed += 1
      self._timed_s = now - self._t_first - self._pause_s
      self.rate = self._rate()
    self.losses[step] = value
    self.tail = (self.tail + [value])[-self.TAIL:]
    self._window.append(value)
    total = self.cfg.run.steps
    eta = (total - step) * self.tokens_per_step / self.rate if self.rate else None
    self.bar.update(step, value, self.rate, eta)
    if self.log and (step % self.cfg.run.log_every == 0 or step == total):
      # Read before the pause: the schedule's eager ops queue on the device behind the step in flight (step + 1)
      # and wait for it to run, which is training time, not logging.
      lr = float(self.schedule(step - 1))
      with self.paused():  # host work, not training (the writers' first write is slow)
        self.log.log(step, "train", {"loss": float(np.mean(self._window)), "grad_norm": grad_norm,
                                     "tokens_per_s": self.rate, "lr": lr})
      self._window = []

  def _rate(self) -> float:
    seconds = self._before_s + self._timed_s
    return (self._before_n + self._n_timed) * self.tokens_per_step / seconds if seconds > 0 else 0.0

  def saved(self) -> dict[str, Any]:
    """What a checkpoint keeps of the losses and the timing (JSON, beside the data position)."""
    return {"loss_tail": self.tail, "loss_window": self._window,
            "timed_steps": self._before_n + self._n_timed, "timed_s": self._before_s + self._timed_s,
            "compile_s": self.compile_s, "first_step_s": self.first_step_s}

  def resume(self, saved: dict[str, Any]) -> None:
    """Takes `saved`'s losses and timing back (checkpoints of older versions have none: the first window then
    starts empty, and the throughput counts this process's steps only)."""
    self.tail = [float(v) for v in saved.get("loss_tail", [])]
    self._window = [float(v) for v in saved.get("loss_window", [])]
    self._before_n, self._before_s = int(saved.get("timed_steps", 0)), float(saved.get("timed_s", 0.0))
    self.rate = self._rate()
    self.compile_s, self.first_step_s = saved.get("compile_s"), saved.get("first_step_s")  # until this process's


@contextlib.contextmanager
def compile_ticker(label: str, *, enabled: bool = True, every: float = 10.0, since: float | None = None,
                   took: Callable[[], float | None] | None = None):
  """While inside (the first call of the train step, which waits for its compile), prints a plain line every
  `every` seconds so a long compile is not silence; yields a function returning the seconds spent inside.
  since: when the compile began (`time.time()`; default: on entry), for the lines' seconds; took: the compile's
  own seconds once it ended, for the last line (default: the seconds inside)."""
  t0 = time.time()
  start = t0 if since is None else since
  stop = threading.Event()

  def tick():
    while not stop.wait(every):
      print(f"[{label}] compiling the train step: {time.time() - start:.0f} s", file=sys.stderr, flush=True)

  thread = threading.Thread(target=tick, daemon=True)
  if enabled:
    thread.start()
  elapsed, failed = [None], False
  try:
    yield lambda: elapsed[0]
  except BaseException:
    failed = True  # not reported as compiled
    raise
  finally:
    elapsed[0] = time.time() - t0
    stop.set()
    if enabled:
      thread.join()
      seconds = None if failed or took is None else took()
      ended = "train step's first call failed after" if failed else "train step compiled in"
      print(f"[{label}] {ended} {elapsed[0] if seconds is None else seconds:.1f} s", file=sys.stderr, flush=True)


def last_good(ckpt: checkpoint.Checkpointer) -> str:
  """The divergence message's tail: the newest checkpoint to go back to, if any."""
  step = ckpt.latest_step()
  if step is None:
    return f"No checkpoint was saved yet in {ckpt.directory}."
  return f"Last good checkpoint: step {step} in {ckpt.directory}"
