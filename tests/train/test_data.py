"""Data: document parsing (.gz/.xz/WikiExtractor), the token cache, held-out split, resumable iterator."""

import gzip
import lzma

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
  (tmp_path / "empty.txt").write_text("")
  with pytest.raises(UserError, match=r"data.sources: .*empty.txt is empty; fill it or remove it"):
    data.resolve_sources([str(tmp_path / "empty.txt")])  # was "cannot mmap an empty file" after tokenizing
  with pytest.raises(UserError, match="no data files to tokenize"):  # was an IndexError
    data.build_token_cache([], "byte", "", str(tmp_path / "cache"))
  std = data.stdlib_files()
  assert std == sorted(std) and any(p.endswith("/os.py") for p in std)
  assert not any("-packages" in p for p in std)


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
  assert len(data.eval_windows(np.arange(100), 9, 2, 3)) == 3
  for n in (10, 0):
    with pytest.raises(UserError, match="not one batch"):
      data.eval_windows(np.arange(n), 9, 2, 3)
