"""Orbax checkpoints of the whole training state: params, optimizer state (incl. its step) and data position.

The array state is saved as the pure nested dict of the NNX state of (model, optimizer); restoring uses the
live state as the abstract target, so arrays come back with their current shardings (works across meshes
as long as the shapes match). The data iterator's state is a small JSON item next to it.

Verification: the JSON item also holds a digest of every array's bits, computed on the device when the step is
saved. A restore recomputes it, and checks the state finite, before trusting a step, so a truncated or missing
file (which fails inside Orbax/TensorStore) and flipped bytes (which would restore silently) both count as
damage. `restore` then falls back to the newest intact step with a warning, moving the damaged ones aside
(out of the way of the steps the resumed run will save), or fails with one line naming the damaged step.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import sys
import time
from typing import Any, Callable, NamedTuple, TextIO

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from train.errors import UserError

DIGEST_KEY = "state_digest"
_FULL = (errno.ENOSPC, errno.EDQUOT)  # a full disk, a full quota: freeing space lets the run go on


def _full_disk(err: BaseException | None) -> int | None:
  """The errno of a full disk that `err`, or an error it was raised from, reports; else None. Python's writes
  raise an OSError; TensorStore's (the arrays) a ValueError that names the code, "[os_error_code='28']"."""
  while err is not None:
    for code in _FULL:
      if (isinstance(err, OSError) and err.errno == code) or f"[os_error_code='{code}']" in str(err):
        return code
    err = err.__cause__
  return None


class _DropFullDiskLogs(logging.Filter):
  """Orbax's writer threads log each error with its traceback before it reaches `save` or `close`; a full disk's,
  which those report in one line (`Checkpointer._writing`), are dropped: pages of the same error."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.exc_info and _full_disk(record.exc_info[1]))


_DROP_FULL_DISK_LOGS = _DropFullDiskLogs()


class Alternative(NamedTuple):
  """Another layout a state may have been saved in: `target`, that layout's pure dict of abstract arrays (with
  their shardings), and `convert`, which takes a state restored into it to the live state's layout (e.g. the
  per-layer blocks that scanned runs saved before they held them stacked, `train.train.checkpoint_alternative`)."""

  target: Any
  convert: Callable[[Any], Any]


def saved_steps(directory: str) -> list[int]:
  """The finished checkpoint steps under `directory`, ascending, read from the directory names (Orbax writes a step
  under a temporary name and renames it when complete). A step folder that holds no file is no checkpoint (made by
  hand, or by a save that never wrote): left out here, it is judged, like other damage, when a run restores
  (`Checkpointer.restore` sets it aside)."""
  if not os.path.isdir(directory):
    return []
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit() and _holds_files(os.path.join(directory, n)))


def _holds_files(path: str) -> bool:
  """Whether directory `path` holds a file, at any depth (a checkpoint holds several at its top)."""
  return any(files for _, _, files in os.walk(path))


@jax.jit
def _fingerprint(tree: Any) -> tuple[jax.Array, jax.Array]:
  """(uint32 digest of every leaf's bits, whether every float leaf is finite), in one pass on the device.

  Per leaf: the sum of its 32-bit words and their sum weighted by odd position factors (mod 2^32, so the
  result does not depend on the reduction order or the sharding), folded over the leaves in tree order.
  """
  digest, finite = jnp.uint32(0), jnp.bool_(True)
  for x in jax.tree.leaves(tree):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    if jnp.issubdtype(x.dtype, jnp.inexact):
      finite &= jnp.isfinite(x).all()
    bits = x.reshape(-1)
    if bits.dtype.itemsize == 8:
      bits = jax.lax.bitcast_convert_type(bits, jnp.uint32).reshape(-1)
    elif bits.dtype == jnp.bool_:
      bits = bits.astype(jnp.uint32)
    else:
      bits = jax.lax.bitcast_convert_type(bits, jnp.dtype(f"uint{8 * bits.dtype.itemsize}")).astype(jnp.uint32)
    weights = jnp.arange(bits.size, dtype=jnp.uint32) * 2 + 1
    digest = digest * jnp.uint32(0x9E3779B1) + bits.sum(dtype=jnp.uint32) + (bits * weights).sum(dtype=jnp.uint32)
  return digest, finite


def _layout(tree: Any) -> dict[str, tuple[int, ...]]:
  """{dotted key path: shape} of the arrays (or array metadata) of a pure state tree; keys as strings, since
  Orbax's metadata names list entries "0", "1", ..."""
  return {".".join(str(getattr(k, "key", k)) for k in path): tuple(leaf.shape)
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0] if hasattr(leaf, "shape")}


def abstract_state(state: nnx.State) -> Any:
  """The pure dict of `state` as abstract arrays (shape, dtype, sharding): what a restore fills."""
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.to_pure_dict(state))


def state_digest(state_dict: Any) -> tuple[str, bool]:
  """(hex digest of the arrays' bits, all finite) of a pure state dict."""
  digest, finite = _fingerprint(state_dict)
  return f"{int(digest):08x}", bool(finite)


class Checkpointer:
  """`save(step, state, data_state)` / `restore(state) -> (state, data_state, step)` under `directory`."""

  def __init__(self, directory: str, *, max_to_keep: int = 2, log: TextIO | None = None):
    self.directory = os.path.abspath(directory)
    self.log = sys.stderr if log is None else log  # the stderr of now, not of the import
    # cleanup_tmp_directories: a write that a killed process left unfinished (`<step>.orbax-checkpoint-tmp`, as
    # large as a step) is deleted when the run resumes; Orbax renames a step into place only once it is whole, so
    # nothing finished goes. Safe because a Checkpointer opens only a run's own directory under its LOCK.
    self._mgr = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True, cleanup_tmp_directories=True),
        item_handlers={"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler()})
    logging.getLogger("absl").addFilter(_DROP_FULL_DISK_LOGS)  # once: the same filter is not added twice
    self._full = False  # a full disk was reported (`_writing`): `close` does not report it again

  def latest_step(self) -> int | None:
    return self._mgr.latest_step()

  def save(self, step: int, state: nnx.State, data_state: dict[str, Any]) -> None:
    """Starts writing `step` (Orbax finishes it in the background). `data_state` (JSON values) is copied now:
    the writer serializes it later, and the caller may keep changing what it holds (the open loss window)."""
    pure = nnx.to_pure_dict(state)
    data_state = json.loads(json.dumps({**data_state, DIGEST_KEY: state_digest(pure)[0]}))
    with self._writing():
      self._mgr.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(pure), data=ocp.args.JsonSave(data_state)))

  @contextlib.contextmanager
  def _writing(self):
    """Turns a full disk while a step is written (it surfaces in `save`, which waits for the step before, or in
    `wait`/`close`) into a UserError naming the directory and the steps kept; any other error passes unchanged.
    Orbax writes a step under a temporary name and renames it once complete, and drops the oldest step only then:
    the finished steps stay intact, and a run of the same command resumes the newest."""
    try:
      yield
    except Exception as e:  # pylint: disable=broad-except  # only a full disk's is turned into a UserError
      code = _full_disk(e)
      if code is None:
        raise
      with contextlib.suppress(Exception):  # another step still in flight: finished (or failed) before the list
        self._mgr.wait_until_finished()
      steps = saved_steps(self.directory)
      kept = (f"the finished steps there ({', '.join(map(str, steps))}) are kept: free space and run the same "
              f"command again to resume from step {steps[-1]}" if steps else
              "no step was finished there: free space and run the same command again to train from the start")
      self._full = True
      raise UserError(f"cannot write a checkpoint to {self.directory}: {os.strerror(code).lower()}; {kept}") from e

  def _problem(self, target: Any, step: int) -> tuple[str | None, Any]:
    """(None, restored items) for an intact step, else (what is wrong with it, None)."""
    if not _holds_files(os.path.join(self.directory, str(step))):
      return "its folder holds no file (a save that never wrote, or a folder made by hand)", None
    try:
      out = self._mgr.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
    except Exception as e:  # pylint: disable=broad-except  # damaged files fail in many Orbax/TensorStore ways
      first = (str(e).strip().splitlines() or [""])[0].split(" See full TensorStore details")[0]
      return f"it does not restore: {type(e).__name__}: {first[:160]}", None
    digest, finite = state_digest(out["state"])
    saved = out["data"].get(DIGEST_KEY)
    if saved is not None and saved != digest:
      return f"its arrays do not match the digest saved with them ({digest} != {saved})", None
    if not finite:
      return "it holds non-finite values", None
    if saved is None:
      self.log.write(f"[ckpt] warning: step {step} in {self.directory} has no digest (saved by an older version); "
                     f"only checked finite\n")
    return None, out

  def restore(self, state: nnx.State, *, alternative: Alternative | None = None
              ) -> tuple[nnx.State, dict[str, Any], int]:
    """Restores the newest intact step into a copy of `state`'s structure and shardings.

    Damaged newer steps are moved to `<directory>-damaged/` with a warning; if no step is intact, raises a
    UserError naming the newest one. A step saved in `alternative`'s layout is restored into it and converted,
    with a note on the log; one of any other layout is a UserError (`_layout_of`).
    """
    steps = sorted(self._mgr.all_steps(), reverse=True)
    if not steps:
      raise FileNotFoundError(f"no checkpoint under {self.directory}")
    target = abstract_state(state)
    damaged: list[tuple[int, str]] = []
    for step in steps:
      convert = self._layout_of(target, step, alternative)
      problem, out = self._problem(alternative.target if convert else target, step)
      if problem is None:
        if convert:
          self.log.write(f"[ckpt] step {step} in {self.directory} holds another layout of this state (saved by "
                         f"an older fp4jax): converted on restoring\n")
        restored = alternative.convert(out["state"]) if convert else out["state"]
        break
      damaged.append((step, problem))
      self.log.write(f"[ckpt] warning: checkpoint step {step} in {self.directory} is damaged: {problem}\n")
    else:
      newest, problem = damaged[0]
      raise UserError(f"checkpoint step {newest} in {self.directory} is damaged ({problem}) and no older step is "
                      f"intact: delete {self.directory} to train from scratch, or use another run.out_dir")
    if damaged:
      self._set_aside([s for s, _ in damaged])
      self.log.write(f"[ckpt] resuming from step {step}, the newest intact one\n")
    nnx.replace_by_pure_dict(state, restored)
    data_state = {k: v for k, v in out["data"].items() if k != DIGEST_KEY}
    return state, data_state, step

  def _layout_of(self, target: Any, step: int, alternative: Alternative | None) -> bool:
    """Whether `step` holds `alternative`'s layout rather than `target`'s. A UserError when it holds other arrays
    (names or shapes) than either: a state saved by another model layout, which restoring would report as damage
    and move aside. Unreadable metadata is left to `_problem` (False)."""
    try:
      saved = _layout(getattr(tree := self._mgr.item_metadata(step)["state"], "tree", tree))
    except Exception:  # pylint: disable=broad-except  # damaged metadata fails in many Orbax ways
      return False
    want = _layout(target)
    if not saved or saved == want:
      return False
    if alternative is not None and saved == _layout(alternative.target):
      return True
    differ = ([f"{k} only in the checkpoint" for k in saved if k not in want][:2]
              + [f"{k} only in this run's model" for k in want if k not in saved][:2]
              + [f"{k}: {saved[k]} saved, {want[k]} now" for k in want if k in saved and saved[k] != want[k]][:2])
    raise UserError(f"checkpoint step {step} in {self.directory} holds another state layout than this run's model "
                    f"({'; '.join(differ)}): it was saved with other model settings (a scanned model holds its "
                    f"blocks stacked, stacks.*, an unrolled one per layer, layers.*); nothing was changed there: use "
                    f"another run.out_dir, or the settings it was saved with")

  def _set_aside(self, steps: list[int]) -> None:
    """Moves damaged steps out of the manager's directory (kept for inspection, never reused)."""
    aside = f"{self.directory}-damaged"
    os.makedirs(aside, exist_ok=True)
    for step in steps:
      dest = os.path.join(aside, f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
      os.replace(os.path.join(self.directory, str(step)), dest)
      self.log.write(f"[ckpt] moved damaged step {step} to {dest}\n")
    self._mgr.reload()

  def wait(self) -> None:
    with self._writing():
      self._mgr.wait_until_finished()

  def close(self) -> None:
    """Waits for the step in flight, then closes the manager. After a full disk was reported, the failed write
    fails again here (Orbax raises it at every wait): not reported twice, the run already stops on it."""
    if self._full:
      with contextlib.suppress(Exception):
        self._mgr.close()
      return
    self.wait()
    self._mgr.close()
