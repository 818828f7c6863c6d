"""TFRecord input: `tf.train.Example` records read without TensorFlow, both checksums checked.

The files are framed here by hand (length, masked CRC32C, data, masked CRC32C) and the
Examples encoded by hand in protobuf's wire format, so the reader is checked against the
format, not against itself.
"""

from __future__ import annotations

import random
import struct

import google_crc32c
import pyarrow.compute as pc
import pytest

from helpers import ingest, read_dataset, rejects
from petatrain.config import IngestConfig
from petatrain.data import index, lineage, readers


def _masked_crc(data: bytes) -> bytes:
    crc = google_crc32c.value(data)
    return ((((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF).to_bytes(4, "little")


def _frame(payload: bytes) -> bytes:
    length = struct.pack("<Q", len(payload))
    return length + _masked_crc(length) + payload + _masked_crc(payload)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:  # a length-delimited field
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _example(**features: bytes | int) -> bytes:
    """Example{features: Features{feature: map<string, Feature>}}: bytes as bytes_list, ints as int64_list."""
    entries = b""
    for key, value in features.items():
        if isinstance(value, int):
            feature = _field(3, _field(1, _varint(value)))  # int64_list, packed
        else:
            feature = _field(1, _field(1, value))  # bytes_list with one value
        entries += _field(1, _field(1, key.encode()) + _field(2, feature))
    return _field(1, entries)


def _read(data: bytes, text_field: str = "text") -> readers.FileRecords:
    return readers.read_file("in.tfrecord", data, "tfrecord", text_field, max_chars=IngestConfig().max_chars)


def _file(n: int) -> tuple[bytes, list[int]]:
    """n framed Examples and the byte offset where each record starts."""
    records = [_frame(_example(text=f"record {i} — ünïcode".encode(), n=i)) for i in range(n)]
    starts = [sum(len(r) for r in records[:i]) for i in range(n)]
    return b"".join(records), starts


def test_examples_are_read_in_order_with_the_named_feature_as_text():
    data, _ = _file(5)
    got = _read(data)
    assert got.index == [0, 1, 2, 3, 4]
    assert got.text == [f"record {i} — ünïcode" for i in range(5)]
    assert got.rejects == []


@pytest.mark.parametrize("where", ["length", "length_crc", "data", "data_crc"])
def test_a_flipped_byte_quarantines_that_record_and_keeps_the_others(where):
    data, starts = _file(5)
    offset = {"length": 0, "length_crc": 9, "data": 20, "data_crc": starts[3] - starts[2] - 2}[where]
    bad = bytearray(data)
    bad[starts[2] + offset] ^= 0x10
    got = _read(bytes(bad))
    assert got.index == [0, 1, 3, 4]
    assert [(r.index, r.reason) for r in got.rejects] == [(2, "corrupt_record")]
    assert "CRC32C" in got.rejects[0].detail


def test_garbage_between_records_is_one_corrupt_record_and_reading_resumes_after_it():
    data, starts = _file(4)
    garbage = random.Random(0).randbytes(1 << 20)
    got = _read(data[: starts[2]] + garbage + data[starts[2] :])
    assert got.text == [f"record {i} — ünïcode" for i in range(4)]
    assert got.index == [0, 1, 3, 4]  # the garbage counts as one record: numbers stay in file order
    assert [(r.index, r.reason) for r in got.rejects] == [(2, "corrupt_record")]


def test_a_truncated_file_keeps_the_records_before_the_cut():
    data, starts = _file(3)
    got = _read(data[: starts[2] + 20])
    assert got.index == [0, 1]
    assert [(r.index, r.reason) for r in got.rejects] == [(2, "corrupt_record")]
    assert "ends inside" in got.rejects[0].detail


def test_records_without_a_text_feature_are_rejected_with_the_reason():
    data = b"".join(
        [
            _frame(_example(text=b"kept")),
            _frame(_example(other=b"x")),
            _frame(_example(text=7)),
            _frame(b"\xff\xff\xff not protobuf"),
            _frame(_example(text=b"\xff\xfe")),
        ]
    )
    got = _read(data)
    assert got.text == ["kept"]
    assert [(r.index, r.reason) for r in got.rejects] == [
        (1, "missing_field"),
        (2, "field_not_string"),
        (3, "malformed_record"),
        (4, "invalid_utf8"),
    ]


def test_ingest_reads_tfrecord_and_quarantines_a_corrupt_record(tmp_path, ray_local):
    data, starts = _file(6)
    bad = bytearray(data)
    bad[starts[4] + 20] ^= 0x01
    path = tmp_path / "part-0.tfrecord"
    path.write_bytes(bytes(bad))
    out = tmp_path / "ds"
    summary = ingest([str(path)], out, dedup="none")  # the format from the name
    assert summary.rows_out == 5
    table = read_dataset(out)
    assert table.column("text").to_pylist() == [f"record {i} — ünïcode" for i in (0, 1, 2, 3, 5)]
    assert table.column("doc_id").to_pylist() == [0, 1, 2, 3, 5]  # record numbers in the file
    quarantined = rejects(out)
    assert quarantined.column("reason").to_pylist() == ["corrupt_record"]
    assert quarantined.column("record").to_pylist() == [4]
    assert pc.all(pc.equal(quarantined.column("source"), str(path))).as_py()
    assert lineage.read_sources(str(out), index.read_manifest(str(out))).column("url").to_pylist() == [str(path)]
