"""Data: document parsing (.gz/.xz/.bz2/WikiExtractor), the token cache, held-out split, resumable iterator."""

import bz2
import gzip
import io
import lzma
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from train import config, data
from train.errors import UserError


def _corpus(tmp_path):
  (tmp_path / "a.txt").write_text("plain file one\n")
  with gzip.open(tmp_path / "b.txt.gz", "wt") as f:
    f.write("gzip file two\n")
  with lzma.open(tmp_path / "c.xz", "wt") as f:
    f.write('<doc id="1" url="u" title="T1">\nT1\n\nBody one.\n</doc>\n<doc id="2" title="T2">\nT2\n</doc>\n')
  return [str(tmp_path / n) for n in ("a.txt", "b.txt.gz", "c.xz")]


def test_documents_and_sources(tmp_path):
  files = _corpus(tmp_path)
  assert data.read_documents(files[0]) == ["plain file one\n"]
  assert data.read_documents(files[1]) == ["gzip file two\n"]
  assert data.read_documents(files[2]) == ["T1\n\nBody one.", "T2"]
  assert data.resolve_sources([str(tmp_path / "*.txt*"), files[2]]) == files
  with pytest.raises(UserError, match=r"data.sources: '.*\*.md' matches no files .*; fix the path or glob"):
    data.resolve_sources([str(tmp_path / "*.md")])
  (tmp_path / "texts").mkdir()
  with pytest.raises(UserError, match=r"data.sources: '.*texts' is a directory; name its files with a glob, e.g. "
                                      r"'.*texts/\*' \('.*texts/\*\*/\*' with its subfolders' files\)$"):
    data.resolve_sources([str(tmp_path / "texts")])  # not "matches no files": it is there
  (tmp_path / "empty.txt").write_text("")
  with pytest.raises(UserError, match=r"data.sources: .*empty.txt is empty; fill it or remove it"):
    data.resolve_sources([str(tmp_path / "empty.txt")])  # was "cannot mmap an empty file" after tokenizing
  with pytest.raises(UserError, match="no data files to tokenize"):  # was an IndexError
    data.build_token_cache([], "byte", "", str(tmp_path / "cache"))
  std = data.stdlib_files()
  assert std == sorted(std) and any(p.endswith("/os.py") for p in std)
  assert not any("-packages" in p for p in std)


def _stdlib_once() -> list[str]:
  """`data.stdlib_files()`, each file by its first path only: a host's standard library may name one module by two
  paths (a symbolic link: on a GPU host with Ubuntu's Python 3.12, `_sysconfigdata__x86_64-linux-gnu.py`), and a
  corpus reads such a file once."""
  first = {}
  for p in data.stdlib_files():
    first.setdefault(os.path.realpath(p), p)
  return list(first.values())


def test_a_file_matched_by_two_sources_is_read_once(tmp_path):
  # Overlapping sources put a file in the stream once per match: its text was trained on twice, silently.
  files = _corpus(tmp_path)
  (tmp_path / "sub").mkdir()
  (tmp_path / "sub" / "link.txt").symlink_to(files[0])  # the same file by another path
  sources = [str(tmp_path / "*.txt*"), files[0], str(tmp_path / "*"), str(tmp_path / "sub" / "*"),
             f"{tmp_path}/./c.xz"]
  assert data.resolve_sources(sources) == files  # first-seen order
  assert data.resolve_sources(["stdlib", "stdlib"]) == _stdlib_once()


def test_a_file_named_with_glob_characters_is_a_source(tmp_path):
  """`a[1].txt` as a glob matches `a1.txt`, not itself: the source 'matched no files'."""
  (tmp_path / "a[1].txt").write_text("text\n")
  (tmp_path / "b*.txt").write_text("text\n")
  assert data.resolve_sources([str(tmp_path / "a[1].txt"), str(tmp_path / "b*.txt")]) == \
      [str(tmp_path / "a[1].txt"), str(tmp_path / "b*.txt")]


def test_cache_built_once(tmp_path, monkeypatch):
  files = _corpus(tmp_path)
  cache = str(tmp_path / "cache")
  toks = data.build_token_cache(files, "byte", "", cache, workers=2, log=None)
  expected = np.concatenate([np.frombuffer(d.encode(), np.uint8).tolist() + [256]
                             for f in files for d in data.read_documents(f)])
  np.testing.assert_array_equal(toks, expected)
  assert toks.dtype == np.uint16
  monkeypatch.setattr(data, "_map_files", lambda *_: pytest.fail("cache was rebuilt"))
  np.testing.assert_array_equal(data.build_token_cache(files, "byte", "", cache, log=None), expected)
  (tmp_path / "a.txt").write_text("changed\n")  # new size/mtime -> new key -> rebuild
  with pytest.raises(pytest.fail.Exception, match="cache was rebuilt"):
    data.build_token_cache(files, "byte", "", cache, log=None)


def test_bz2_and_plain_text_of_any_extension(tmp_path):
  # .bz2 was read as text: the model trained on b"BZh91AY&SY..." with replacement characters.
  text = '<doc id="1" title="T">\nbz2 body\n</doc>\n'
  with bz2.open(tmp_path / "a.txt.bz2", "wt") as f:
    f.write(text)
  with lzma.open(tmp_path / "b.lzma", "wt", format=lzma.FORMAT_ALONE) as f:
    f.write("lzma alone\n")
  with gzip.open(tmp_path / "C.TXT.GZ", "wt") as f:  # extensions are matched case-insensitively
    f.write("upper case\n")
  (tmp_path / "d.md").write_text("markdown\n")
  (tmp_path / "e").write_text("no extension\n")
  assert data.read_documents(str(tmp_path / "a.txt.bz2")) == ["bz2 body"]
  assert data.read_documents(str(tmp_path / "b.lzma")) == ["lzma alone\n"]
  assert data.read_documents(str(tmp_path / "C.TXT.GZ")) == ["upper case\n"]
  assert data.read_documents(str(tmp_path / "d.md")) == ["markdown\n"]
  assert data.read_documents(str(tmp_path / "e")) == ["no extension\n"]
  assert len(data.resolve_sources([str(tmp_path / "*")])) == 5


@pytest.mark.parametrize("name", ["a.txt.zst", "a.ZSTD", "a.lz4", "a.zip", "a.7z", "a.tar", "a.tar.gz", "a.tgz"])
def test_unsupported_compression_is_refused(tmp_path, name):
  # These were decoded as text with replacement characters and trained on, with exit status 0.
  path = tmp_path / name
  path.write_bytes(b"\x28\xb5\x2f\xfd binary payload")
  match = rf"data source .*{name}: \.\S+ files are not supported .*plain text or \.gz, \.xz, \.lzma, \.bz2"
  with pytest.raises(UserError, match=match):
    data.read_documents(str(path))
  (tmp_path / "ok.txt").write_text("fine\n")
  with pytest.raises(UserError, match=match):  # refused when the sources are resolved, before any tokenizing
    data.resolve_sources([str(tmp_path / "*")])


def _damaged(tmp_path, name):
  """A compressed file cut short, or one with the right extension but not the right format."""
  payload = ("some text that compresses " * 200).encode()
  path = tmp_path / name
  if name.endswith("bad.gz"):
    path.write_bytes(b"this is not gzip data at all\n")
    return str(path)
  compress = {".gz": gzip.compress, ".xz": lzma.compress, ".bz2": bz2.compress}[os.path.splitext(name)[1]]
  blob = compress(payload)
  path.write_bytes(blob[:len(blob) // 2])
  return str(path)


@pytest.mark.parametrize("name", ["cut.txt.gz", "cut.xz", "cut.bz2", "bad.gz"])
def test_damaged_source_names_the_file(tmp_path, name):
  # Was a bare EOFError / LZMAError / BadGzipFile traceback that did not say which source file is damaged.
  path = _damaged(tmp_path, name)
  with pytest.raises(UserError, match=rf"cannot read data source {path} \((EOFError|BadGzipFile|LZMAError|OSError):"
                                      r".*\); replace it .* or remove it from the sources") as e:
    data.read_documents(path)
  assert "\n" not in str(e.value)


def test_a_source_that_is_not_utf8_text_is_refused_before_tokenizing(tmp_path):
  # A binary file given as a text source (token ids, an array) was decoded with replacement characters and
  # trained on as text, with exit status 0.
  ids = np.array([464, 3290, 318, 257, 1332] * 1000, np.uint16)  # GPT-2 ids as nanoGPT saves them
  ids.tofile(tmp_path / "train.bin")
  with gzip.open(tmp_path / "ids.gz", "wb") as f:
    f.write(ids.tobytes())
  text = _corpus(tmp_path)
  cache = data.build_token_cache(text, "byte", "", str(tmp_path / "cache"), log=None)  # this repo's own ids
  (tmp_path / "latin1.txt").write_bytes("caf\u00e9 ".encode("latin-1") * 10)
  (tmp_path / "cut.txt").write_bytes("caf\u00e9".encode()[:-1])  # ends inside a character
  for path, byte in [(tmp_path / "train.bin", r"byte 0: b'\\xd0'"), (tmp_path / "ids.gz", r"byte 0: b'\\xd0'"),
                     (cache.filename, r"byte 1: b'\\x00'"), (tmp_path / "latin1.txt", r"byte 3: b'\\xe9'"),
                     (tmp_path / "cut.txt", r"byte 3: b'\\xc3'")]:
    with pytest.raises(UserError, match=rf"data source {path} is not UTF-8 text \({byte}\), a binary file\? Sources "
                                        r"are text, tokenized by data.tokenizer \(files of token ids are not read\)"):
      data.resolve_sources([*text, str(path)])
  # Only the start of a file is read, and a character that straddles its end is no error.
  (tmp_path / "long.txt").write_text("x" * (data._HEAD_BYTES - 1) + "\u00e9" + "\0")
  assert data.resolve_sources([str(tmp_path / "long.txt")]) == [str(tmp_path / "long.txt")]
  # The standard library corpus is taken as it is (a few test modules are Latin-1 or KOI8-R on purpose).
  assert data.resolve_sources(["stdlib"]) == _stdlib_once()
  with pytest.raises(UserError, match=r"cannot read data source .*bad.gz \(BadGzipFile"):  # found early too
    data.resolve_sources([_damaged(tmp_path, "bad.gz")])


@pytest.mark.parametrize("workers", [1, 2])
def test_damaged_source_in_token_cache(tmp_path, workers):
  # With worker processes the error must reach the parent as the same UserError, and no partial file is left.
  files = _corpus(tmp_path) + [_damaged(tmp_path, "cut.txt.gz")]
  cache = tmp_path / "cache"
  with pytest.raises(UserError, match=rf"cannot read data source {files[-1]} \(EOFError: "):
    data.build_token_cache(files, "byte", "", str(cache), workers=workers, log=None)
  assert os.listdir(cache) == []


@pytest.mark.parametrize("damage", ["truncate", "delete", "extend", "bad_meta"])
def test_damaged_cache_is_rebuilt(tmp_path, damage):
  # A .bin deleted or cut short while its .json stayed crashed every later run ("mmap length is greater than file
  # size", FileNotFoundError); a too long one would be silently served.
  files = _corpus(tmp_path)
  cache = tmp_path / "cache"
  good = np.array(data.build_token_cache(files, "byte", "", str(cache), log=None))
  (bin_path,) = cache.glob("*.bin")
  meta_path = bin_path.with_suffix(".json")
  if damage == "truncate":
    os.truncate(bin_path, 10)
  elif damage == "delete":
    bin_path.unlink()
  elif damage == "extend":
    with open(bin_path, "ab") as f:
      f.write(b"\0\0")
  else:
    meta_path.write_text('{"tokens": 3')
  log = io.StringIO()
  toks = data.build_token_cache(files, "byte", "", str(cache), log=log)
  np.testing.assert_array_equal(toks, good)
  why = {"truncate": r"\.bin holds 10 bytes, not the 96 of its 48 recorded tokens", "delete": r"\.bin is missing",
         "extend": r"\.bin holds 98 bytes, not the 96 of its 48 recorded tokens",
         "bad_meta": r"its metadata .*\.json is unreadable \(JSONDecodeError: .*\)"}
  assert re.match(rf"\[data\] rebuilding the token cache: .*{why[damage]}\n\[data\] tokenized 3 files",
                  log.getvalue()), log.getvalue()
  assert os.path.getsize(bin_path) == good.nbytes and sorted(os.listdir(cache)) == [bin_path.name, meta_path.name]
  log = io.StringIO()
  np.testing.assert_array_equal(data.build_token_cache(files, "byte", "", str(cache), log=log), good)
  assert log.getvalue() == ""  # the rebuilt entry is used as is


def test_split_heldout_at_document_boundary():
  eos = 9
  toks = np.array([1, 2, eos, 3, 4, 5, eos, 6, eos, 7, 7, eos])
  train, held = data.split_heldout(toks, eos, 0.5)
  # 12 * 0.5 = 6 lands on the eos ending document 2, so the held-out part starts right after it.
  assert train.tolist() == [1, 2, eos, 3, 4, 5, eos] and held.tolist() == [6, eos, 7, 7, eos]
  train, held = data.split_heldout(toks, eos, 0.4)  # cut 7 is inside document 3: move to its end
  assert train.tolist() == [1, 2, eos, 3, 4, 5, eos, 6, eos] and held.tolist() == [7, 7, eos]
  train, held = data.split_heldout(toks, eos, 0.2)  # inside the last document: no boundary, cut there
  assert train.tolist() == toks[:9].tolist() and held.tolist() == [7, 7, eos]
  one_doc = np.array([1, 2, 3, 4, 5, 6, 7, 8, 8, eos])
  assert data.split_heldout(one_doc, eos, 0.3)[1].tolist() == [8, 8, eos]


def test_iterator_deterministic_and_resumable():
  toks = np.arange(1000, dtype=np.uint16)
  a = data.WindowIterator(toks, seq_len=10, batch_size=7, seed=3)
  batches = [next(a) for _ in range(30)]  # > 1 epoch of 99 windows
  assert batches[0].shape == (7, 11) and batches[0].dtype == np.int32
  np.testing.assert_array_equal(batches[0][:, 1:], batches[0][:, :-1] + 1)  # contiguous windows
  starts = np.concatenate([b[:, 0] for b in batches[:15]])[:99]
  assert sorted(starts.tolist()) == list(range(0, 990, 10))  # epoch 0 visits every window once
  b = data.WindowIterator(toks, seq_len=10, batch_size=7, seed=3)
  for _ in range(12):
    next(b)
  state = b.state()
  c = data.WindowIterator(toks, seq_len=10, batch_size=7, seed=3)
  c.restore(state)
  for want in batches[12:]:
    np.testing.assert_array_equal(next(c), want)
  other = data.WindowIterator(toks, seq_len=10, batch_size=7, seed=4)
  assert not np.array_equal(next(other), batches[0])
  with pytest.raises(UserError, match="seed"):
    other.restore(state)


@pytest.mark.parametrize("changed,match", [
    (dict(batch_size=5), "data batch_size=7 != this run's batch_size=5"),
    (dict(seq_len=9), "data seq_len=10 != this run's seq_len=9"),
    (dict(tokens=np.arange(2000, dtype=np.uint16)), "data n_windows=99 != this run's n_windows=199"),
])
def test_restore_rejects_a_different_window_layout(changed, match):
  # The position counts batches of one layout; under another it would silently resume on other windows.
  a = data.WindowIterator(np.arange(1000, dtype=np.uint16), seq_len=10, batch_size=7, seed=3)
  next(a)
  kwargs = dict(tokens=np.arange(1000, dtype=np.uint16), seq_len=10, batch_size=7, seed=3) | changed
  with pytest.raises(UserError, match=match):
    data.WindowIterator(**kwargs).restore(a.state())
  legacy = {"position": 1, "seed": 3}  # checkpoints written before the layout was recorded
  b = data.WindowIterator(np.arange(1000, dtype=np.uint16), seq_len=10, batch_size=7, seed=3)
  b.restore(legacy)
  np.testing.assert_array_equal(next(b), next(a))


def test_load_splits_with_eval_file(tmp_path):
  files = _corpus(tmp_path)
  cfg = config.DataConfig(sources=tuple(files[:2]), eval_sources=(files[2],), cache_dir=str(tmp_path / "c"))
  train, held, tok = data.load_splits(cfg, log=None)
  assert tok.name == "byte" and len(train) == 31 and held[-1] == tok.eos_id
  both = config.DataConfig(sources=(str(tmp_path / "*"),), eval_sources=tuple(files[1:]), cache_dir=cfg.cache_dir)
  with pytest.raises(UserError, match=re.escape(f"data.eval_sources: {files[1]}, {files[2]} are also matched by "
                                                f"data.sources, so the evaluation would not be on held-out text; "
                                                f"remove them from one of the two")):
    data.load_splits(both, log=None)  # was trained on, then evaluated as held-out text
  assert len(data.eval_windows(np.arange(100), 9, 2, 3)) == 3
  for n in (10, 0):
    with pytest.raises(UserError, match="not one batch"):
      data.eval_windows(np.arange(n), 9, 2, 3)
  shape = config.DataConfig(seq_len=9, batch_size=2)
  assert data.short_heldout(100, shape, 6).startswith("run.eval_batches=6, but the 100 held-out tokens hold 5 ")
  assert data.short_heldout(100, shape, 5) is None and data.short_heldout(10, shape, 6) is None  # enough; none


def test_partial_token_files_of_stopped_processes_are_removed(tmp_path):
  """A tokenizing process killed outright (SIGTERM's default action) leaves its `.bin.tmp-<host>-<pid>`; the
  next build of that cache on the same host deletes it, and leaves a live process's and another host's alone."""
  files = _corpus(tmp_path)
  cache = tmp_path / "cache"
  data.build_token_cache(files, "byte", "", str(cache), log=None)
  bin_path = next(cache.glob("*.bin"))
  gone = subprocess.Popen([sys.executable, "-c", "pass"])
  gone.wait()
  stale, live = (pathlib.Path(f"{bin_path}.tmp-{socket.gethostname()}-{pid}") for pid in (gone.pid, os.getppid()))
  elsewhere = pathlib.Path(f"{bin_path}.tmp-another-host-{gone.pid}")  # a pid there says nothing here
  for p in (stale, live, elsewhere):
    p.write_bytes(b"partial")
  for p in cache.iterdir():  # a rebuild: the cached tokens are gone
    if p.suffix in (".bin", ".json"):
      p.unlink()
  data.build_token_cache(files, "byte", "", str(cache), log=None)
  assert not stale.exists() and live.exists() and elsewhere.exists()


def test_two_processes_building_one_cache_at_once_both_finish(tmp_path, monkeypatch):
  """The hosts of a multi-host run (or two runs) tokenize the same files into one cache directory at once: a second
  process that finishes while the first is between writing the cache's metadata and renaming it into place must
  not take the first's file (both wrote `<key>.json.tmp`: the first's rename then raised FileNotFoundError)."""
  files = _corpus(tmp_path)
  cache = tmp_path / "cache"
  code = ("import sys; from train import data; "
          "data.build_token_cache(sys.argv[1:-1], 'byte', '', sys.argv[-1], log=None)")
  replace = os.replace

  def replace_after_another_build(src, dst):
    if str(dst).endswith(".json") and not os.path.exists(dst):  # the other process finds no metadata: it builds
      subprocess.run([sys.executable, "-c", code, *files, str(cache)], check=True, timeout=120,
                     env={**os.environ, "PYTHONPATH": os.getcwd()})
    replace(src, dst)
  monkeypatch.setattr(data.os, "replace", replace_after_another_build)
  toks = data.build_token_cache(files, "byte", "", str(cache), log=None)
  monkeypatch.setattr(data.os, "replace", replace)
  np.testing.assert_array_equal(toks, data.build_token_cache(files, "byte", "", str(cache), log=None))
  assert sorted(p.suffix for p in cache.iterdir()) == [".bin", ".json"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal is Linux's")
def test_tokenizing_alone_leaves_the_process_alive_after_its_parent(tmp_path):
  """With one worker (one source file, or data.workers=1) the training process tokenizes by itself: it must not
  ask to die with its parent, or a run launched from a shell that then exits is stopped by SIGTERM."""
  (tmp_path / "a.txt").write_text("hello world\n" * 50)
  code = textwrap.dedent("""
      import ctypes, sys
      from train import data
      data.build_token_cache([sys.argv[1]], "byte", "", sys.argv[2], log=None)
      sig = ctypes.c_int(-1)
      ctypes.CDLL(None).prctl(2, ctypes.byref(sig))  # PR_GET_PDEATHSIG
      print(sig.value)
      """)
  done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "a.txt"), str(tmp_path / "cache")],
                        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
  assert done.returncode == 0 and done.stdout.split()[-1] == "0", (done.stdout, done.stderr[-2000:])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal is Linux's")
def test_tokenizer_workers_die_with_a_killed_parent(tmp_path):
  """A parent killed while its pool tokenizes (SIGTERM's default action, a preemption: no cleanup runs) takes
  its workers along; they stayed behind, blocked writing results to a queue no one reads (`_die_with_parent`)."""
  files = []
  for i in range(6):  # large results: a worker's write blocks once the queue's pipe is full
    files.append(str(tmp_path / f"f{i}.txt"))
    with open(files[-1], "w") as f:
      f.write(("lorem ipsum dolor sit amet " * 40 + "\n") * 8000)
  code = textwrap.dedent("""
      import multiprocessing, os, signal, sys
      from train import data
      if __name__ == "__main__":
        with data._map_files("byte", "", sys.argv[1:], 2) as results:
          next(iter(results))
          print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
          os.kill(os.getpid(), signal.SIGKILL)
      """)
  script = tmp_path / "parent.py"
  script.write_text(code)
  out = tmp_path / "out.txt"  # a file, not a pipe: workers left behind would hold a pipe open
  with open(out, "w") as f:
    done = subprocess.run([sys.executable, str(script), *files], stdout=f, stderr=subprocess.STDOUT, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
  workers = [int(p) for p in out.read_text().split()[:2]]
  assert done.returncode == -signal.SIGKILL and len(workers) == 2, (done.returncode, out.read_text())
  deadline = time.time() + 20
  alive = lambda: [p for p in workers if os.path.exists(f"/proc/{p}") and
                   open(f"/proc/{p}/stat").read().split()[2] != "Z"]
  while alive() and time.time() < deadline:
    time.sleep(0.1)
  left = alive()
  for p in left:
    os.kill(p, signal.SIGKILL)
  assert not left, f"workers {left} outlived their parent"
