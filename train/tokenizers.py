"""Offline tokenizers: byte-level, GPT-2 BPE (tiktoken over local files), SentencePiece (local .model).

Every tokenizer has `name` (a cache key that changes when the vocabulary changes), `vocab_size`, `eos_id`,
`encode_batch(texts) -> list[list[int]]`, `encode_docs(texts) -> int array` (each document followed by
eos) and `decode(ids) -> str`. None of them touches the network.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
from typing import Callable, Protocol, Sequence

import numpy as np

from train.errors import UserError


class Tokenizer(Protocol):
  name: str
  vocab_size: int
  eos_id: int

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

  def encode_docs(self, texts: Sequence[str]) -> np.ndarray: ...

  def decode(self, ids: Sequence[int]) -> str: ...


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
  """UTF-8 bytes 0..255 plus one end-of-document token (256)."""
  name: str = "byte"
  vocab_size: int = 257
  eos_id: int = 256

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [list(t.encode("utf-8")) for t in texts]

  def encode_docs(self, texts: Sequence[str]) -> np.ndarray:
    if not texts:
      return np.zeros(0, np.int32)
    encoded = [t.encode("utf-8") for t in texts]
    joined = np.frombuffer(b"\0".join(encoded) + b"\0", np.uint8).astype(np.int32)
    joined[np.cumsum([len(e) + 1 for e in encoded]) - 1] = self.eos_id  # each separator becomes eos
    return joined

  def decode(self, ids: Sequence[int]) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _join_with_eos(docs: list[list[int]], eos_id: int) -> np.ndarray:
  out = np.empty(sum(len(d) + 1 for d in docs), np.int32)
  pos = 0
  for d in docs:
    out[pos:pos + len(d)] = d
    out[pos + len(d)] = eos_id
    pos += len(d) + 1
  return out


def _file_digest(*paths: str) -> str:
  h = hashlib.sha256()
  for p in paths:
    with open(p, "rb") as f:
      h.update(f.read())
  return h.hexdigest()[:12]


@contextlib.contextmanager
def _no_tiktoken_cache():
  """tiktoken caches files by path under /tmp; with local files that would serve a stale copy after an edit."""
  old = os.environ.get("TIKTOKEN_CACHE_DIR")
  os.environ["TIKTOKEN_CACHE_DIR"] = ""
  try:
    yield
  finally:
    if old is None:
      del os.environ["TIKTOKEN_CACHE_DIR"]
    else:
      os.environ["TIKTOKEN_CACHE_DIR"] = old


# GPT-2's pre-tokenizer regex (the r50k pattern, as published with GPT-2's encoder.py).
_GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


class GPT2Tokenizer:
  """GPT-2 byte-level BPE from a directory holding OpenAI's encoder.json and vocab.bpe."""

  def __init__(self, path: str):
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    enc_json, bpe = os.path.join(path, "encoder.json"), os.path.join(path, "vocab.bpe")
    for p in (enc_json, bpe):
      if not os.path.isfile(p):
        raise UserError(f"GPT-2 tokenizer needs {p} (set data.tokenizer_path to the directory)")
    try:
      with _no_tiktoken_cache():
        ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=bpe, encoder_json_file=enc_json)
    except (ValueError, TypeError, KeyError, AttributeError, AssertionError) as err:  # tiktoken's parse of them
      raise UserError(f"the GPT-2 tokenizer files in {path} are damaged ({type(err).__name__}: "
                      f"{str(err)[:100]}): fetch encoder.json and vocab.bpe again") from err
    self.eos_id = len(ranks)  # 50256
    self._enc = tiktoken.Encoding(name="gpt2-local", pat_str=_GPT2_PATTERN, mergeable_ranks=ranks,
                                  special_tokens={"<|endoftext|>": self.eos_id})
    self.vocab_size = self._enc.n_vocab
    self.name = f"gpt2-{_file_digest(enc_json, bpe)}"

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return self._enc.encode_ordinary_batch(list(texts), num_threads=1)

  def encode_docs(self, texts: Sequence[str]) -> np.ndarray:
    return _join_with_eos(self.encode_batch(texts), self.eos_id)

  def decode(self, ids: Sequence[int]) -> str:
    return self._enc.decode(list(ids))


class SentencePieceTokenizer:
  """A SentencePiece .model file (e.g. Llama/Mistral); needs the optional `sentencepiece` package."""

  def __init__(self, path: str):
    try:
      import sentencepiece
    except ImportError:
      raise UserError("data.tokenizer=sentencepiece needs the `sentencepiece` package "
                        "(pip install sentencepiece); it is not a default dependency") from None
    if not os.path.isfile(path):
      raise UserError(f"SentencePiece model {path!r} not found (set data.tokenizer_path)")
    try:
      self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
    except (RuntimeError, OSError) as err:
      raise UserError(f"SentencePiece model {path!r} cannot be read ({str(err)[:100]})") from err
    self.vocab_size = self._sp.get_piece_size()
    self.eos_id = self._sp.eos_id()
    if not 0 <= self.eos_id < self.vocab_size:  # SentencePiece says -1 when the model has no eos piece
      raise UserError(f"SentencePiece model {path!r} has no end-of-document piece (eos_id={self.eos_id}); "
                       f"documents are joined with eos, so it needs one")
    self.name = f"sp-{_file_digest(path)}"

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return self._sp.encode(list(texts))

  def encode_docs(self, texts: Sequence[str]) -> np.ndarray:
    return _join_with_eos(self.encode_batch(texts), self.eos_id)

  def decode(self, ids: Sequence[int]) -> str:
    return self._sp.decode(list(ids))


_TOKENIZERS: dict[str, Callable[[str], Tokenizer]] = {
    "byte": lambda path: ByteTokenizer(),
    "gpt2": GPT2Tokenizer,
    "sentencepiece": SentencePieceTokenizer,
}


def get_tokenizer(kind: str, path: str = "") -> Tokenizer:
  if kind not in _TOKENIZERS:
    raise UserError(f"unknown tokenizer {kind=}; valid: {sorted(_TOKENIZERS)}")
  return _TOKENIZERS[kind](path)
