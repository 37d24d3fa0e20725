"""One training process per run directory: an exclusive lock on `out_dir/LOCK` holding the owner's pid and host.

The lock is an `fcntl.flock` on the file, so the kernel drops it when its process dies, however it dies; the file's
content only says who holds it. A second process on the same out_dir therefore fails at once with the holder's pid
and host (instead of waiting on Orbax's barrier, or interleaving two runs' metrics). A file whose recorded process
is gone (a crash, a kill -9) is stale: the next run takes it over with a warning. A record from another host can
not be checked from here (and flock may not reach across hosts on a network file system), so it is refused.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from typing import TextIO

from train.errors import UserError


def alive(pid: int) -> bool:
  """Whether process `pid` of this host exists (one of another user's counts)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # exists, owned by someone else
    return True
  return True


class RunLock:
  """`with RunLock(out_dir): ...` holds out_dir/LOCK for the block; raises UserError if another run holds it, whose
  message ends with `advice` (what to do instead: a tool that reads a run directory waits, it takes no other)."""

  def __init__(self, out_dir: str, *, log: TextIO = sys.stderr,
               advice: str = "wait for it to finish or use another run.out_dir"):
    self.path = os.path.join(os.path.abspath(out_dir), "LOCK")
    self.log = log
    self.advice = advice
    self.created = False  # whether `acquire` made the file
    self._fd: int | None = None

  def _holder(self) -> dict:
    os.lseek(self._fd, 0, os.SEEK_SET)
    text = os.read(self._fd, 4096).decode(errors="replace")
    try:
      record = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
      record = None
    return record if isinstance(record, dict) else {"unreadable": text[:80]}

  def _open_locked(self) -> bool:
    """Opens the file, making it if missing (`created`), and flocks it; returns whether flock works here. A file
    removed meanwhile (`release(remove=True)` removes it while holding it) is opened again: a lock on a file no
    longer at `path` would not keep out the next run, which makes a new one."""
    while True:
      try:
        self._fd, self.created = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
      except FileExistsError:
        try:
          self._fd, self.created = os.open(self.path, os.O_RDWR), False
        except FileNotFoundError:
          continue
      try:
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        holder = self._holder()
        self._close()
        raise UserError(f"{os.path.dirname(self.path)} is in use by another run (pid {holder.get('pid', '?')} on "
                        f"{holder.get('host', '?')}, since {holder.get('started', '?')}); {self.advice}") from None
      except OSError as e:  # a file system without flock: the recorded pid is all there is to go on
        self.log.write(f"[train] warning: cannot lock {self.path} ({e.strerror}); checking its recorded pid only\n")
        return False
      try:
        if os.path.samestat(os.fstat(self._fd), os.stat(self.path)):
          return True
      except FileNotFoundError:
        pass
      self._close()

  def acquire(self) -> None:
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    locked = self._open_locked()
    host = socket.gethostname()
    holder = self._holder()  # what a run that did not release the lock left behind
    if "unreadable" in holder:  # no record of ours (a hand-edited or damaged file)
      if not locked:
        self._close()
        raise UserError(f"{self.path} holds no lock record ({holder['unreadable']!r}) and this file system cannot "
                        f"lock it; if no run uses {os.path.dirname(self.path)}, delete {self.path}")
      self.log.write(f"[train] warning: taking over {self.path}, which held no lock record "
                     f"({holder['unreadable']!r}) and no process holds\n")
      holder = {}
    if holder.get("host") not in (None, host):
      self._close()
      raise UserError(f"{self.path} records a run of pid {holder.get('pid')} on host {holder.get('host')}, which "
                      f"cannot be checked from {host}; if it has ended, delete {self.path}")
    if holder.get("pid") not in (None, os.getpid()):
      if not locked and isinstance(holder["pid"], int) and alive(holder["pid"]):
        self._close()
        raise UserError(f"{os.path.dirname(self.path)} is in use by pid {holder['pid']} on {host}; {self.advice}")
      self.log.write(f"[train] warning: taking over the stale lock {self.path} of pid {holder.get('pid')} on "
                     f"{host}, which is no longer running\n")
    record = {"pid": os.getpid(), "host": host, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(self._fd, 0)
    os.pwrite(self._fd, json.dumps(record).encode(), 0)
    os.fsync(self._fd)

  def release(self, *, remove: bool = False) -> None:
    """Empties the file (an empty LOCK is free) and drops the lock. The file stays, unless `remove` (a run refused
    before it trains leaves the directory as it found it) and this lock made it: then it is removed while still
    held, so that a process that opened it meanwhile opens the new one instead (`_open_locked`)."""
    if self._fd is not None:
      if remove and self.created:
        os.unlink(self.path)
      else:
        os.ftruncate(self._fd, 0)
      self._close()

  def _close(self) -> None:
    os.close(self._fd)  # also drops the flock
    self._fd = None

  def __enter__(self) -> RunLock:
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()
