"""TensorBoard event files: crc32c, TFRecord framing and Event protobuf, read back independently."""

import pytest

from train import tbevents


def test_crc32c_known_vectors():
  assert tbevents.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
  assert tbevents.crc32c(b"") == 0
  assert tbevents.crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros


def test_write_and_read_back(tmp_path):
  w = tbevents.EventWriter(str(tmp_path))
  w.scalars(1, {"train/loss": 2.5, "train/lr": 1e-3})
  w.scalars(300, {"train/loss": 1.25})
  w.close()
  got = tbevents.read_scalars(w.path)
  assert got["train/loss"] == [(1, 2.5), (300, 1.25)]
  assert got["train/lr"][0][0] == 1 and got["train/lr"][0][1] == pytest.approx(1e-3)
  raw = open(w.path, "rb").read()
  corrupt = tmp_path / "bad"
  corrupt.write_bytes(raw[:-5] + bytes([raw[-5] ^ 1]) + raw[-4:])
  with pytest.raises(ValueError, match="bad crc"):
    tbevents.read_records(str(corrupt))


def test_tensorboard_reader_if_installed(tmp_path):
  loader = pytest.importorskip("tensorboard.backend.event_processing.event_file_loader")
  w = tbevents.EventWriter(str(tmp_path))
  w.scalars(7, {"eval/loss": 3.0})
  w.close()
  events = list(loader.EventFileLoader(w.path).Load())
  assert events[0].file_version == "brain.Event:2"
  assert events[1].step == 7 and events[1].summary.value[0].tag == "eval/loss"
