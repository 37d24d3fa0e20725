"""Tokenizers: byte roundtrip, GPT-2 BPE from the shared files against GPT-2's known ids, SentencePiece."""

import os

import numpy as np
import pytest

from train import tokenizers
from train.errors import UserError

SHARED = os.environ.get("FP4JAX_SHARED_DATA",
                        os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data"))
GPT2_DIR = os.path.join(SHARED, "tokenizers", "gpt2")
SP_MODEL = os.path.join(SHARED, "tokenizers", "mistral-7b-v0.1", "tokenizer.model.v1")


def test_byte_roundtrip_and_docs():
  tok = tokenizers.get_tokenizer("byte")
  text = "héllo\n\tworld ✓"
  (ids,) = tok.encode_batch([text])
  assert max(ids) < 256 and tok.decode(ids) == text
  docs = tok.encode_docs(["ab", "", "c\0"])
  np.testing.assert_array_equal(docs, [97, 98, 256, 256, 99, 0, 256])
  assert tok.encode_docs([]).size == 0


@pytest.mark.skipif(not os.path.isdir(GPT2_DIR), reason="shared/data GPT-2 files absent")
def test_gpt2_known_encoding(monkeypatch):
  import socket
  def no_network(*a, **k):
    raise AssertionError("tokenizer tried to open a network connection")
  monkeypatch.setattr(socket, "create_connection", no_network)
  monkeypatch.setattr(socket.socket, "connect", no_network)
  tok = tokenizers.get_tokenizer("gpt2", GPT2_DIR)
  assert (tok.vocab_size, tok.eos_id) == (50257, 50256)
  # GPT-2 ids of this sentence (as tiktoken's published "gpt2" encoding gives them).
  (ids,) = tok.encode_batch(["Hello world, this is a test of GPT-2 tokenization."])
  assert ids == [15496, 995, 11, 428, 318, 257, 1332, 286, 402, 11571, 12, 17, 11241, 1634, 13]
  assert tok.decode(ids) == "Hello world, this is a test of GPT-2 tokenization."
  assert tok.encode_docs(["Hello", " world"]).tolist() == [15496, 50256, 995, 50256]


def test_sentencepiece():
  try:
    import sentencepiece  # noqa: F401
  except ImportError:
    with pytest.raises(UserError, match="pip install sentencepiece"):
      tokenizers.get_tokenizer("sentencepiece", SP_MODEL)
    return
  if not os.path.isfile(SP_MODEL):
    pytest.skip("shared/data SentencePiece model absent")
  tok = tokenizers.get_tokenizer("sentencepiece", SP_MODEL)
  assert tok.vocab_size == 32000 and tok.eos_id == 2
  (ids,) = tok.encode_batch(["Hello world"])
  assert tok.decode(ids) == "Hello world"


def test_sentencepiece_without_eos_is_rejected(tmp_path, monkeypatch):
  # A model trained with eos_id=-1 (no eos piece): -1 would be written to the uint16 cache as 65535.
  import sys
  import types

  class NoEosProcessor:
    def __init__(self, model_file):
      del model_file

    def get_piece_size(self):
      return 1000

    def eos_id(self):
      return -1

  monkeypatch.setitem(sys.modules, "sentencepiece", types.SimpleNamespace(SentencePieceProcessor=NoEosProcessor))
  model = tmp_path / "no_eos.model"
  model.write_bytes(b"model")
  with pytest.raises(UserError, match=r"no_eos.model' has no end-of-document piece \(eos_id=-1\)"):
    tokenizers.get_tokenizer("sentencepiece", str(model))


def test_unknown_kind():
  with pytest.raises(UserError, match=r"unknown tokenizer kind='bpe'.*'byte'"):
    tokenizers.get_tokenizer("bpe")


@pytest.mark.parametrize("encoder,bpe", [("{bad", "#version: 0.2\na b\n"), ("[]", "#version: 0.2\na b\n"),
                                         ('{"a": 0}', "garbage")])
def test_damaged_gpt2_files_are_one_line(tmp_path, encoder, bpe):
  """Truncated or foreign tokenizer files (a download cut short) are a user's fix, not a traceback from
  tiktoken's parser (a JSONDecodeError, an AttributeError or an AssertionError before)."""
  (tmp_path / "encoder.json").write_text(encoder)
  (tmp_path / "vocab.bpe").write_text(bpe)
  with pytest.raises(UserError, match=rf"the GPT-2 tokenizer files in {tmp_path} are damaged .*fetch encoder.json"):
    tokenizers.get_tokenizer("gpt2", str(tmp_path))
