"""Hostile raw input, read by the source readers: one bad record never costs its neighbours.

Every attack must end in kept records that are fine and a one-line reject for what is
not, with the file going on; never in a crash, a silent drop or an unbounded read.
"""

from __future__ import annotations

import io
import json
import tarfile

from petatrain.data import sources


def _read(data: bytes, fmt: str, name: str = "in") -> sources.FileRecords:
    return sources.read_file(f"{name}.{fmt}", data, fmt, "text")


def _tar(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _reasons(records: sources.FileRecords) -> dict[int, tuple[str, str]]:
    return {r.index: (r.reason, r.detail) for r in records.rejects}


# -- 3. a record that breaks the parser is one reject, not the rest of the file -------------
def test_a_record_that_breaks_the_json_parser_costs_only_itself():
    lines = [
        json.dumps({"text": "first"}).encode(),
        b'{"a":' * 100_000,  # RecursionError, not JSONDecodeError
        json.dumps({"text": "second"}).encode(),
        b'{"text": "big int", "n": ' + b"1" * 5000 + b"}",  # ValueError: int digits limit
        json.dumps({"text": "third"}).encode(),
    ]
    records = _read(b"\n".join(lines) + b"\n", "jsonl")
    assert records.text == ["first", "second", "third"] and records.index == [0, 2, 4]
    reasons = _reasons(records)
    assert set(reasons) == {1, 3}
    assert reasons[1][0] == reasons[3][0] == "malformed_json"
    assert "nested too deeply" in reasons[1][1]
    assert "\n" not in reasons[1][1] + reasons[3][1]


def test_a_webdataset_json_member_that_breaks_the_parser_costs_only_its_sample():
    data = _tar(
        [
            ("s0.json", json.dumps({"text": "first"}).encode()),
            ("s1.json", b"[" * 100_000),
            ("s2.json", json.dumps({"text": "second"}).encode()),
        ]
    )
    records = _read(data, "webdataset", "shard")
    assert records.text == ["first", "second"] and records.index == [0, 2]
    assert [(r.index, r.reason) for r in records.rejects] == [(1, "malformed_json")]
    assert "nested too deeply" in records.rejects[0].detail
