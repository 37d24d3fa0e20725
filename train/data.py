"""Text corpus -> cached token file -> deterministic, resumable [batch, seq_len + 1] windows.

Sources are files or globs (UTF-8 text: plain, .gz, .xz, .bz2) or "stdlib" (the running Python's standard
library .py files, a zero-setup corpus). Each source file is split into documents (WikiExtractor `<doc ...>`
blocks when present, else the whole file), tokenized once by a process pool and stored as a flat uint16/uint32
file with eos after every document, keyed by a hash of (tokenizer, file list, sizes, mtimes). Later runs
memory-map it.

The training iterator's whole state is one integer (`position`, batches consumed): batch p holds global
windows p*B .. p*B+B-1 of a per-epoch permutation drawn from (seed, epoch), so resuming needs no replay.
"""

from __future__ import annotations

import bz2
import codecs
import contextlib
import glob
import gzip
import hashlib
import json
import lzma
import multiprocessing
import os
import re
import signal
import socket
import sys
import sysconfig
import time
import zlib
from concurrent import futures
from typing import Iterator, Sequence

import numpy as np

from train import lock, tokenizers
from train.errors import UserError

_OPENERS = {".gz": gzip.open, ".xz": lzma.open, ".lzma": lzma.open, ".bz2": bz2.open}
# Compressions and archives read_documents cannot decode: opened as text they would yield replacement characters,
# and the model would train on that garbage without any error.
_UNSUPPORTED = frozenset((".zst", ".zstd", ".tzst", ".lz4", ".lz", ".lzo", ".sz", ".snappy", ".br", ".z", ".zip",
                          ".7z", ".rar", ".tar", ".tgz", ".tbz", ".tbz2", ".txz"))
# What a damaged compressed source raises while it is read (gzip.BadGzipFile is an OSError).
_READ_ERRORS = (OSError, EOFError, lzma.LZMAError, zlib.error)
_HEAD_BYTES = 1 << 12  # how much of each source file (decompressed) is checked to be text, before tokenizing
_DOC_OPEN = re.compile(r"^<doc [^>]*>\s*$", re.M)
_DOC_CLOSE = re.compile(r"^</doc>\s*$", re.M)


def stdlib_files() -> list[str]:
  """The standard library's .py files (site-/dist-packages excluded), sorted for determinism."""
  root = sysconfig.get_paths()["stdlib"]
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
    out.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
  return sorted(out)


def _opener(path: str):
  """The function that opens `path` as text, chosen by its extension (any unknown one is plain text).

  A known compression other than .gz/.xz/.lzma/.bz2, or an archive (.zip, .tar, .tar.gz, ...), is a UserError:
  read as text it would silently train the model on compressed bytes.
  """
  root, ext = os.path.splitext(os.path.basename(path).lower())
  if ext in _UNSUPPORTED or (ext in _OPENERS and root.endswith(".tar")):
    kind = ".tar" + ext if ext in _OPENERS else ext
    raise UserError(f"data source {path}: {kind} files are not supported (they would be read as garbage text); "
                    f"decompress or extract it; sources may be plain text or {', '.join(_OPENERS)}")
  return _OPENERS.get(ext, open)


def resolve_sources(sources: Sequence[str], where: str = "data.sources") -> list[str]:
  """The files of `sources` in order, each once: a file that two sources match (overlapping globs, a glob and a
  file under it, one file by two paths) is read once, where its first source puts it, not trained on twice.

  A source that matches no file, or only empty ones, is a UserError. So is a file in a compression or archive
  format that read_documents cannot decode, or one whose start is not UTF-8 text (`_check_text`), before any
  tokenizing. The "stdlib" corpus is taken as it is: a few of its test modules are in other encodings on purpose.
  """
  files: dict[str, str] = {}  # resolved path -> the path as first matched
  for s in sources:
    if s == "stdlib":
      found = stdlib_files()
    else:
      pattern = os.path.expanduser(s)
      found = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
      if not found and os.path.isfile(pattern):  # a file named with glob characters, a[1].txt, matches itself
        found = [pattern]
    if not found and s != "stdlib" and os.path.isdir(pattern):
      raise UserError(f"{where}: {s!r} is a directory; name its files with a glob, e.g. "
                      f"{os.path.join(s, '*')!r} ({os.path.join(s, '**', '*')!r} with its subfolders' files)")
    if not found:
      raise UserError(f"{where}: {s!r} matches no files (relative paths start at {os.getcwd()}); fix the path "
                      f"or glob")
    if not any(os.path.getsize(p) for p in found):
      what = found[0] if len(found) == 1 else f"all {len(found)} files of {s!r} (first: {found[0]})"
      raise UserError(f"{where}: {what} is empty; fill it or remove it from {where}")
    for p in found:
      _opener(p)
      real = os.path.realpath(p)
      if real not in files:
        if s != "stdlib":
          _check_text(p)
        files[real] = p
  return list(files.values())


def _check_text(path: str) -> None:
  """A UserError unless the first _HEAD_BYTES of `path`, decompressed, are UTF-8 text without NUL bytes.

  read_documents replaces what does not decode, so a binary file given as a source (token ids saved as uint16, a
  .npy array, a model file) was trained on as garbage text. Its first bytes show it: token ids hold NUL bytes (an
  id below 256) or byte sequences that are not UTF-8 within a few ids. Reading only the head keeps the check
  cheap; the whole file is read once, when tokenized.
  """
  try:
    with _opener(path)(path, "rb") as f:
      head = f.read(_HEAD_BYTES)
  except _READ_ERRORS as e:
    raise _read_error(path, e) from e
  nul = head.find(b"\0")
  try:  # a character cut by the end of the head is no error, unless the file ends there
    codecs.getincrementaldecoder("utf-8")().decode(head[:nul] if nul >= 0 else head, final=len(head) < _HEAD_BYTES)
  except UnicodeDecodeError as e:
    nul = e.start
  if nul >= 0:
    raise UserError(f"data source {path} is not UTF-8 text (byte {nul}: {head[nul:nul + 1]!r}), a binary file? "
                    f"Sources are text, tokenized by data.tokenizer (files of token ids are not read): give the text "
                    f"it was made from, or convert it to UTF-8")


def _read_error(path: str, e: BaseException) -> UserError:
  """The one-line error for a source file that cannot be read or decompressed, naming it: the decompressors' own
  errors (EOFError, LZMAError, ...) do not say which of many source files is damaged."""
  return UserError(f"cannot read data source {path} ({type(e).__name__}: {' '.join(str(e).splitlines())}); "
                   f"replace it (a damaged or truncated file?) or remove it from the sources")


def resolve_data(data_cfg) -> tuple[list[str], list[str]]:
  """(train files, held-out files) of a `DataConfig`, the latter empty without data.eval_sources (the held-out
  text is then split off the train files). A file of both is a UserError: its text, trained on, is not held out.
  """
  files = resolve_sources(data_cfg.sources, "data.sources")
  if not data_cfg.eval_sources:
    return files, []
  heldout = resolve_sources(data_cfg.eval_sources, "data.eval_sources")
  trained = {os.path.realpath(p) for p in files}
  both = [p for p in heldout if os.path.realpath(p) in trained]
  if both:
    one = len(both) == 1
    listed = ", ".join(both[:3]) + (f" and {len(both) - 3} more" if len(both) > 3 else "")
    raise UserError(f"data.eval_sources: {listed} {'is' if one else 'are'} also matched by data.sources, so the "
                    f"evaluation would not be on held-out text; remove {'it' if one else 'them'} from one of the two")
  return files, heldout


def read_documents(path: str) -> list[str]:
  """A file's documents: WikiExtractor `<doc>` bodies when present, else the whole file as one.

  A file that cannot be read or decompressed (truncated download, corrupt data) is a UserError naming it
  (`_read_error`).
  """
  opener = _opener(path)
  try:
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
      text = f.read()
  except _READ_ERRORS as e:
    raise _read_error(path, e) from e
  if not _DOC_OPEN.search(text):
    return [text] if text else []
  docs = []
  for chunk in _DOC_OPEN.split(text)[1:]:
    body = _DOC_CLOSE.split(chunk, maxsplit=1)[0].strip("\n")
    if body:
      docs.append(body)
  return docs


# Each pool worker builds its tokenizer once (the GPT-2 ranks take ~0.3 s to load).
_WORKER_TOKENIZER: tokenizers.Tokenizer | None = None


def _init_worker(kind: str, path: str, pool: bool = True, tok: tokenizers.Tokenizer | None = None) -> None:
  """The tokenizer of this process's `_tokenize_file` calls (`tok` where it is loaded already); a pool worker
  (`pool`) also dies with its parent.
  The training process tokenizing by itself (one worker) must not: the request would outlive tokenizing, and a
  run started from a shell or launcher that then exits was stopped by SIGTERM mid-training."""
  global _WORKER_TOKENIZER
  if pool:
    _die_with_parent()
  _WORKER_TOKENIZER = tokenizers.get_tokenizer(kind, path) if tok is None else tok


def _die_with_parent() -> None:
  """On Linux, has the kernel send this pool worker SIGTERM when the process that spawned it dies: a parent
  killed by a signal while tokenizing (SIGTERM's default action, a scheduler's preemption) runs no cleanup, and
  its workers stayed behind, blocked writing results nobody reads. Elsewhere (no prctl) nothing changes."""
  if not sys.platform.startswith("linux"):
    return
  import ctypes  # pylint: disable=g-import-not-at-top
  try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    return
  parent = multiprocessing.parent_process()
  if parent is not None and parent.pid != os.getppid():  # it died before the request took effect
    os._exit(1)


def _tokenize_file(path: str) -> np.ndarray:
  """`path`'s tokens; an unreadable file raises read_documents' UserError, which a pool pickles to the parent."""
  assert _WORKER_TOKENIZER is not None
  return _WORKER_TOKENIZER.encode_docs(read_documents(path))


@contextlib.contextmanager
def _map_files(kind: str, tokenizer_path: str, files: Sequence[str], workers: int,
               tok: tokenizers.Tokenizer | None = None):
  """Token arrays of `files` in order: in this process for one worker (with `tok` where it is loaded already),
  else from a process pool, each worker loading its own.

  The pool spawns (not forks): the parent may already hold JAX's threads, which fork would copy in a broken
  state. A crashed worker raises BrokenProcessPool instead of hanging. An exception in a worker (a UserError
  for a damaged file) is re-raised in the parent as itself when its result is consumed; the files not yet
  started are then cancelled rather than tokenized for nothing. As with any spawn pool, a calling script needs
  the `if __name__ == "__main__":` guard (or data.workers=1).
  """
  if workers <= 1:
    _init_worker(kind, tokenizer_path, pool=False, tok=tok)
    yield map(_tokenize_file, files)
    return
  ctx = multiprocessing.get_context("spawn")
  with futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                   initargs=(kind, tokenizer_path)) as pool:
    try:
      yield pool.map(_tokenize_file, files, chunksize=max(1, len(files) // (8 * workers)))
    except BaseException:
      pool.shutdown(wait=False, cancel_futures=True)
      raise


def _cache_key(files: Sequence[str], tok: tokenizers.Tokenizer) -> str:
  h = hashlib.sha256(tok.name.encode())
  for f in files:
    st = os.stat(f)
    h.update(f"{os.path.abspath(f)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
  return h.hexdigest()[:20]


def token_dtype(vocab_size: int) -> np.dtype:
  return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _cache_problem(bin_path: str, meta_path: str) -> str | None:
  """Why the cache entry whose `meta_path` exists cannot be used (None if it can): a missing or unreadable
  metadata file, or a `bin_path` that is missing or not the recorded token count long (a cleanup of large files,
  a partial copy of the cache dir). Memory-mapping such a .bin fails, or would serve a truncated corpus.
  """
  try:
    with open(meta_path) as f:
      meta = json.load(f)
    tokens = int(meta["tokens"])
    expected = tokens * np.dtype(meta["dtype"]).itemsize
  except (OSError, ValueError, TypeError, KeyError) as e:
    return f"its metadata {meta_path} is unreadable ({type(e).__name__}: {e})"
  if not os.path.exists(bin_path):
    return f"{bin_path} is missing"
  size = os.path.getsize(bin_path)
  if size != expected:
    return f"{bin_path} holds {size:,} bytes, not the {expected:,} of its {tokens:,} recorded tokens"
  return None


def build_token_cache(files: Sequence[str], kind: str, tokenizer_path: str, cache_dir: str, *,
                      workers: int = 0, log=sys.stderr, tok: tokenizers.Tokenizer | None = None) -> np.ndarray:
  """Tokenizes `files` once (cached on disk) and returns the memory-mapped token array. `tok`: the tokenizer of
  `kind` and `tokenizer_path`, where the caller has it loaded already (else loaded here)."""
  if not files:
    raise UserError("no data files to tokenize; give data.sources at least one file (resolve_sources)")
  tok = tokenizers.get_tokenizer(kind, tokenizer_path) if tok is None else tok
  key = _cache_key(files, tok)
  os.makedirs(cache_dir, exist_ok=True)
  bin_path, meta_path = os.path.join(cache_dir, f"{key}.bin"), os.path.join(cache_dir, f"{key}.json")
  dtype = token_dtype(tok.vocab_size)
  if os.path.exists(meta_path):
    problem = _cache_problem(bin_path, meta_path)
    if problem is None:
      with open(meta_path) as f:
        meta = json.load(f)
      return np.memmap(bin_path, dtype=meta["dtype"], mode="r", shape=(meta["tokens"],))
    if log is not None:
      log.write(f"[data] rebuilding the token cache: {problem}\n")
  workers = min(workers or os.cpu_count() or 1, len(files))
  total_bytes = sum(os.path.getsize(f) for f in files)
  t0, n_tokens, done_bytes, shown = time.time(), 0, 0, 0.0
  _remove_stale_temporaries(bin_path, log)
  tmp = f"{_temporaries(bin_path)}{os.getpid()}"
  try:
    with open(tmp, "wb") as out, _map_files(kind, tokenizer_path, files, workers, tok) as results:
      for i, arr in enumerate(results):
        out.write(arr.astype(dtype).tobytes())
        n_tokens += arr.size
        done_bytes += os.path.getsize(files[i])
        dt = time.time() - t0
        if log is not None and (i + 1 == len(files) or (log.isatty() and dt - shown > 0.5)):
          shown = dt  # refreshed in place on a terminal; a log file gets the final count only
          # Sizes on disk (an .xz file's compressed bytes): the share of the work done, not of the text.
          log.write(f"\r[data] tokenizing {i + 1}/{len(files)} files, {done_bytes / 2**20:.0f}/"
                    f"{total_bytes / 2**20:.0f} MiB on disk, {n_tokens:,} tokens, {dt:.1f}s" if log.isatty() else
                    f"[data] tokenized {len(files)} files, {total_bytes / 2**20:.0f} MiB on disk, {n_tokens:,} "
                    f"tokens, {dt:.1f}s")
          log.flush()
  except BaseException:  # a damaged source or Ctrl-C: leave no partial token file behind
    with contextlib.suppress(OSError):
      os.remove(tmp)
    if log is not None and shown:
      log.write("\n")  # ends the progress line, so that the error gets a line of its own
    raise
  if n_tokens == 0:
    os.remove(tmp)
    raise UserError(f"the data files hold no text ({len(files)} file(s), first: {files[0]}); point the sources at "
                    f"non-empty files")
  if log is not None:
    log.write(f"\n[data] cached {n_tokens:,} {tok.name} tokens in {bin_path}\n")  # ends the progress line
  os.replace(tmp, bin_path)
  meta_tmp = f"{_temporaries(meta_path)}{os.getpid()}"  # its own, as the token file's: hosts may build it at once
  with open(meta_tmp, "w") as f:
    json.dump({"tokens": n_tokens, "dtype": dtype.name, "tokenizer": tok.name, "files": len(files)}, f)
  os.replace(meta_tmp, meta_path)
  return np.memmap(bin_path, dtype=dtype, mode="r", shape=(n_tokens,))


def _temporaries(bin_path: str) -> str:
  """The name of this host's partial token files for `bin_path`, but for the writer's pid: a pid names a
  process on its own host only, and a cache directory may be shared by the hosts of a multi-host run."""
  return f"{bin_path}.tmp-{socket.gethostname()}-"


def _remove_stale_temporaries(bin_path: str, log) -> None:
  """Deletes this host's partial token files of `bin_path` whose tokenizing process is gone: a process killed
  outright (SIGTERM's or SIGKILL's default action) cannot remove its own. A live process's is kept, and so is
  every other host's."""
  prefix = _temporaries(bin_path)
  for path in glob.glob(glob.escape(prefix) + "*"):
    pid = path[len(prefix):]
    if not pid.isdigit() or int(pid) == os.getpid() or lock.alive(int(pid)):
      continue
    with contextlib.suppress(OSError):
      os.remove(path)
      if log is not None:
        log.write(f"[data] removed {path}, the partial token file of a process that was stopped (pid {pid})\n")


def split_heldout(tokens: np.ndarray, eos_id: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
  """Train = documents before the first document boundary at or after (1 - fraction) of the tokens.

  Without such a boundary (one long last document) the split falls at exactly (1 - fraction) of the tokens.
  """
  if not 0 < fraction < 1:
    raise ValueError(f"{fraction=} must be in (0, 1)")
  cut = int(len(tokens) * (1 - fraction))
  ends = np.flatnonzero(tokens[cut:-1] == eos_id)
  cut = cut + int(ends[0]) + 1 if ends.size else cut
  return tokens[:cut], tokens[cut:]


WINDOW_DTYPE = np.int32  # what the steps read, whatever the corpus' storage dtype


def batch_shape(seq_len: int, batch_size: int) -> tuple[int, int]:
  """The shape of a batch of windows, train (`WindowIterator`) or held-out (`eval_windows`): batch_size windows of
  seq_len + 1 tokens, the inputs and, one further, each one's next-token target."""
  return batch_size, seq_len + 1


class WindowIterator:
  """Shuffled non-overlapping [batch, seq_len + 1] int32 windows; state = {"position": batches consumed}."""

  def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, position: int = 0):
    self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed
    self.n_windows = (len(tokens) - 1) // seq_len
    if self.n_windows < batch_size:
      raise UserError(f"the train split has {len(tokens):,} tokens: {self.n_windows} windows of data.seq_len="
                      f"{seq_len}, fewer than data.batch_size={batch_size}; lower them or add data")
    self.position = position
    self._perm_epoch, self._perm = -1, np.zeros(0, np.int64)

  def _permutation(self, epoch: int) -> np.ndarray:
    if epoch != self._perm_epoch:
      self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
      self._perm_epoch = epoch
    return self._perm

  def batch_at(self, position: int) -> np.ndarray:
    g = position * self.batch_size + np.arange(self.batch_size)
    starts = np.array([self._permutation(int(e))[i] for e, i in zip(g // self.n_windows, g % self.n_windows)])
    starts *= self.seq_len
    return np.stack([np.asarray(self.tokens[s:s + self.seq_len + 1], WINDOW_DTYPE) for s in starts])  # [B, T+1]

  def __iter__(self) -> Iterator[np.ndarray]:
    return self

  def __next__(self) -> np.ndarray:
    batch = self.batch_at(self.position)
    self.position += 1
    return batch

  def state(self) -> dict[str, int]:
    """The position plus what gives it meaning: a different seed, window shape or corpus size would resume
    on other windows without complaint."""
    return {"position": self.position, "seed": self.seed, "seq_len": self.seq_len,
            "batch_size": self.batch_size, "n_windows": self.n_windows}

  def restore(self, state: dict[str, int]) -> None:
    for name in ("seed", "seq_len", "batch_size", "n_windows"):
      if name in state and int(state[name]) != getattr(self, name):  # older checkpoints hold seed only
        raise UserError(f"checkpointed data {name}={state[name]} != this run's {name}={getattr(self, name)}: "
                        f"resuming would continue on different windows; use another run.out_dir")
    self.position = int(state["position"])


def heldout_batches(n_tokens: int, seq_len: int, batch_size: int) -> int:
  """How many batches of `batch_size` sequential [seq_len + 1] windows `n_tokens` held-out tokens hold."""
  return ((n_tokens - 1) // seq_len) // batch_size


def short_heldout(n_tokens: int, data_cfg, n_batches: int) -> str | None:
  """What to tell the user when `n_tokens` held-out tokens hold fewer than the n_batches (run.eval_batches) asked
  for: the held-out loss is then over those only (a run's result records how many: eval_batches). None if they
  hold enough, or none at all (eval_windows' UserError)."""
  held = heldout_batches(n_tokens, data_cfg.seq_len, data_cfg.batch_size)
  if not 0 < held < n_batches:
    return None
  return (f"run.eval_batches={n_batches}, but the {n_tokens:,} held-out tokens hold {held} batch(es) of "
          f"data.batch_size={data_cfg.batch_size} x data.seq_len={data_cfg.seq_len}: the held-out loss is over those "
          f"{held} (the result's eval_batches); for {n_batches}, raise data.eval_fraction or add data.eval_sources")


def eval_windows(tokens: np.ndarray, seq_len: int, batch_size: int, n_batches: int) -> list[np.ndarray]:
  """The first n_batches * batch_size sequential windows of the held-out tokens (fewer if it is short: the
  caller says so, `heldout_batches`)."""
  n = min(n_batches, heldout_batches(len(tokens), seq_len, batch_size))
  if n <= 0:
    raise UserError(f"the held-out split has {len(tokens):,} tokens, not one batch of data.batch_size={batch_size} "
                    f"x (data.seq_len={seq_len} + 1); raise data.eval_fraction, add data.eval_sources or lower "
                    f"data.seq_len / data.batch_size")
  return [np.stack([np.asarray(tokens[s:s + seq_len + 1], WINDOW_DTYPE)
                    for s in (b * batch_size + np.arange(batch_size)) * seq_len]) for b in range(n)]


def load_splits(data_cfg, *, files: tuple[list[str], list[str]] | None = None,
                tok: tokenizers.Tokenizer | None = None,
                log=sys.stderr) -> tuple[np.ndarray, np.ndarray, tokenizers.Tokenizer]:
  """(train tokens, held-out tokens, tokenizer) for a `DataConfig`. `files` and `tok`: its `resolve_data` and its
  tokenizer, where the caller has them already (`train.build.preflight`: resolving reads the head of every source
  file, and the GPT-2 ranks take ~0.3 s to load); None resolves or loads here."""
  tok = tokenizers.get_tokenizer(data_cfg.tokenizer, data_cfg.tokenizer_path) if tok is None else tok

  def cached(files):
    return build_token_cache(files, data_cfg.tokenizer, data_cfg.tokenizer_path, data_cfg.cache_dir,
                             workers=data_cfg.workers, log=log, tok=tok)

  files, heldout_files = resolve_data(data_cfg) if files is None else files
  tokens = cached(files)
  if heldout_files:
    return tokens, cached(heldout_files), tok
  train, heldout = split_heldout(tokens, tok.eos_id, data_cfg.eval_fraction)
  return train, heldout, tok
