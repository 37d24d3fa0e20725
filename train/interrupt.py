"""Stopping a training run on SIGINT (Ctrl-C) or SIGTERM (a scheduler's preemption, `timeout`) without losing
its progress.

While `StopRequest` is entered, the first of those signals only sets `signum`: the training loop finishes the
step in flight, saves a checkpoint of the state after it and raises `Interrupted`, which `python -m train` and
`python -m train.study` turn into one line and exit status 128 + the signal number (130 for Ctrl-C, 143 for
SIGTERM). Running the same command again resumes from that checkpoint. The handler then gives both signals their
default action back, so a second one ends the process at once, saving nothing: the way out of a compile or a
checkpoint write that takes too long.

Outside the steps, where Ctrl-C raises KeyboardInterrupt, `sigterm_raises` has SIGTERM raise `Terminated` (a
KeyboardInterrupt) in its place, so that what a call undoes on Ctrl-C (`train.run_all`: the LOCK files and folders
made before a first step) is undone on SIGTERM too, where its default action ended the process and left them.

Only one process's main thread installs handlers. With several processes the checkpoint is written by all of them
together (Orbax), so one process stopping on its own signal would leave the others waiting in that write; there the
signals keep their default actions.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import NoReturn

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_process(status: int) -> NoReturn:
  """`sys.exit(status)` for a command's `__main__`, with SIGINT and SIGTERM at their default action while the
  process winds down (Orbax's background writes, JAX's exit handlers): a signal sent then ends it at once, where
  Python's handler would raise KeyboardInterrupt inside an exit handler and print its traceback."""
  for s in SIGNALS:
    signal.signal(s, signal.SIG_DFL)
  sys.exit(status)


class Interrupted(Exception):
  """A run stopped by `signum` after saving its checkpoint of `step` in `directory`."""

  def __init__(self, signum: int, label: str, step: int, directory: str):
    self.signum, self.step, self.directory = signum, step, directory
    self.exit_status = 128 + signum
    super().__init__(f"[{label}] stopped by {signal.Signals(signum).name} after step {step}: checkpoint saved in "
                     f"{directory}; run the same command again to resume")


class Terminated(KeyboardInterrupt):
  """SIGTERM inside `sigterm_raises`: handled as Ctrl-C's KeyboardInterrupt, with SIGTERM's exit status."""
  exit_status = 128 + signal.SIGTERM


def _raise_terminated(signum: int, frame) -> None:
  del signum, frame
  signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once, as after a stop request
  raise Terminated


@contextlib.contextmanager
def sigterm_raises(*, enabled: bool = True):
  """Context manager: inside, the first SIGTERM raises `Terminated` on the main thread (module docstring), at its
  next bytecode: a long call into C that holds the main thread (compiling a state's initialization, a native
  tokenizer's file) ends first; a second SIGTERM ends the process at once. `StopRequest` takes SIGTERM over inside
  the steps. `enabled=False` (several processes), or entering it outside the main thread, installs nothing; the
  handler in place before is restored on exit. Inside another `sigterm_raises` (`train.study` around each run's
  `train.run_all`) it changes nothing: the outer one restores SIGTERM, so that one a stop request or a first SIGTERM
  gave its default action keeps it until then."""
  if (not enabled or threading.current_thread() is not threading.main_thread()
      or signal.getsignal(signal.SIGTERM) is _raise_terminated):
    yield
    return
  previous = signal.signal(signal.SIGTERM, _raise_terminated)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)


class StopRequest:
  """Context manager: inside, the first SIGINT or SIGTERM sets `signum` (module docstring).

  `enabled=False` (several processes), or entering it outside the main thread, installs nothing: `signum` then
  stays None. The handlers that were in place before are restored on exit, but for `sigterm_raises`'s once a signal
  came: SIGTERM then keeps its default action while the stopped run winds down. The stopped run's checkpoint is
  written inside (`train.run` waits for it before raising `Interrupted`): after the exit a second Ctrl-C would
  raise KeyboardInterrupt again, taken for a stop outside the steps while Orbax's threads still wrote.
  """

  def __init__(self, label: str, *, enabled: bool = True):
    self.label = label
    self.enabled = enabled and threading.current_thread() is threading.main_thread()
    self.signum: int | None = None
    self._previous: dict[int, object] = {}

  def _handle(self, signum: int, frame) -> None:
    del frame
    self.signum = signum
    for s in SIGNALS:  # a second signal takes the default action: the process ends at once
      signal.signal(s, signal.SIG_DFL)
    # os.write, not print: the handler may run while the main thread is inside a print to stderr (the progress bar)
    os.write(2, f"\n[{self.label}] {signal.Signals(signum).name}: stopping after the step in flight and saving a "
                f"checkpoint (send it again to stop at once without saving)\n".encode())

  def __enter__(self) -> StopRequest:
    if self.enabled:
      self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
    return self

  def __exit__(self, *exc) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, signal.SIG_DFL if self.signum is not None and handler is _raise_terminated else handler)
    self._previous = {}
