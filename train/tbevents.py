"""TensorBoard scalar event files written by hand (no TensorFlow): TFRecord framing + Event protobuf.

TFRecord record: uint64 length (LE), uint32 masked crc32c(length bytes), data, uint32 masked crc32c(data).
masked(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8 (mod 2^32). Event protobuf fields used:
Event{1: wall_time double, 2: step int64, 3: file_version string, 5: summary Summary},
Summary{1: repeated Value}, Value{1: tag string, 2: simple_value float}.
`read_scalars` parses the same subset back (checking both crcs) for tests and quick inspection.
"""

from __future__ import annotations

import os
import socket
import struct
import time


def _crc32c_table() -> list[int]:
  table = []
  for n in range(256):
    c = n
    for _ in range(8):
      c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # reflected Castagnoli polynomial
    table.append(c)
  return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
  crc = 0xFFFFFFFF
  for b in data:
    crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
  out = bytearray()
  n &= (1 << 64) - 1  # int64 two's complement, as protobuf encodes negative varints
  while True:
    b = n & 0x7F
    n >>= 7
    if n:
      out.append(b | 0x80)
    else:
      out.append(b)
      return bytes(out)


def _field(num: int, wire: int, payload: bytes) -> bytes:
  return _varint(num << 3 | wire) + payload


def _bytes_field(num: int, data: bytes) -> bytes:
  return _field(num, 2, _varint(len(data)) + data)


def encode_event(wall_time: float, step: int, *, scalars: dict[str, float] | None = None,
                 file_version: str | None = None) -> bytes:
  msg = _field(1, 1, struct.pack("<d", wall_time)) + _field(2, 0, _varint(step))
  if file_version is not None:
    msg += _bytes_field(3, file_version.encode())
  if scalars:
    values = b"".join(
        _bytes_field(1, _bytes_field(1, tag.encode()) + _field(2, 5, struct.pack("<f", float(v))))
        for tag, v in scalars.items())
    msg += _bytes_field(5, values)
  return msg


def frame_record(data: bytes) -> bytes:
  header = struct.pack("<Q", len(data))
  return header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))


class EventWriter:
  """Appends scalar summaries to `logdir/events.out.tfevents.<time>.<host>`."""

  def __init__(self, logdir: str):
    os.makedirs(logdir, exist_ok=True)
    self.path = os.path.join(logdir, f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}")
    self._f = open(self.path, "ab")
    self._f.write(frame_record(encode_event(time.time(), 0, file_version="brain.Event:2")))

  def scalars(self, step: int, values: dict[str, float]) -> None:
    self._f.write(frame_record(encode_event(time.time(), step, scalars=values)))

  def flush(self) -> None:
    self._f.flush()

  def close(self) -> None:
    self._f.close()


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
  shift = n = 0
  while True:
    b = buf[i]
    i += 1
    n |= (b & 0x7F) << shift
    shift += 7
    if not b & 0x80:
      return n, i


def _parse(buf: bytes) -> list[tuple[int, object]]:
  """(field number, value) pairs of one protobuf message: ints, floats/doubles, or raw bytes."""
  i, out = 0, []
  while i < len(buf):
    key, i = _read_varint(buf, i)
    num, wire = key >> 3, key & 7
    if wire == 0:
      v, i = _read_varint(buf, i)
    elif wire == 1:
      v, i = struct.unpack_from("<d", buf, i)[0], i + 8
    elif wire == 5:
      v, i = struct.unpack_from("<f", buf, i)[0], i + 4
    elif wire == 2:
      n, i = _read_varint(buf, i)
      v, i = buf[i:i + n], i + n
    else:
      raise ValueError(f"unsupported protobuf wire type {wire} for field {num}")
    out.append((num, v))
  return out


def read_records(path: str) -> list[bytes]:
  """Record payloads of a TFRecord file; raises ValueError on a bad crc."""
  with open(path, "rb") as f:
    buf = f.read()
  i, out = 0, []
  while i < len(buf):
    header = buf[i:i + 8]
    (n,) = struct.unpack("<Q", header)
    (hcrc,) = struct.unpack_from("<I", buf, i + 8)
    data = buf[i + 12:i + 12 + n]
    (dcrc,) = struct.unpack_from("<I", buf, i + 12 + n)
    if hcrc != masked_crc32c(header) or dcrc != masked_crc32c(data):
      raise ValueError(f"{path}: bad crc in the record at byte {i}")
    out.append(data)
    i += 16 + n
  return out


def read_scalars(path: str) -> dict[str, list[tuple[int, float]]]:
  """{tag: [(step, value), ...]} from an event file written by EventWriter."""
  out: dict[str, list[tuple[int, float]]] = {}
  for rec in read_records(path):
    fields = dict((k, v) for k, v in _parse(rec) if k != 5)
    for k, summary in _parse(rec):
      if k != 5:
        continue
      for _, value in _parse(summary):
        val = dict(_parse(value))
        out.setdefault(val[1].decode(), []).append((fields.get(2, 0), val[2]))
  return out
