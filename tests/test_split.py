"""One large source file read as pieces in parallel: the dataset is the one an unsplit read makes.

Same document ids (record numbers in the file), same rows in the same shards, same rejects,
same duplicates and the same lineage, whatever the split size; a record cut by a chunk
boundary is read once, by the piece it starts in.
"""

from __future__ import annotations

import itertools
import json
import random

import pyarrow as pa
import pytest

from conftest import run_cli
from helpers import duplicates, ingest, read_dataset, rejects
from petatrain.config import IngestConfig
from petatrain.data import index, lineage, readers
from petatrain.data.ingest import split


def _records(n: int, seed: int = 0) -> list[str]:
    """Texts of varied length, some exact and some near copies of earlier ones."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(400)]
    texts: list[str] = []
    for i in range(n):
        if i > 10 and i % 17 == 0:
            texts.append(texts[rng.randrange(i)])  # exact copy
        elif i > 10 and i % 23 == 0:
            base = texts[rng.randrange(i)].split()
            texts.append(" ".join([*base[:-1], "changed"]))  # near copy
        else:
            texts.append(" ".join(rng.choice(words) for _ in range(rng.randrange(8, 60))))
    return texts


def _jsonl(n: int) -> bytes:
    lines = []
    for i, text in enumerate(_records(n)):
        if i % 31 == 5:
            lines.append(b'{"text": "broken')  # malformed_json
        elif i % 41 == 7:
            lines.append(b"")  # a blank line: not a record, but it keeps its line number
        elif i % 37 == 3:
            lines.append(json.dumps({"other": text}).encode())  # missing_field
        else:
            lines.append(json.dumps({"text": text, "n": i}).encode() + (b"\r" if i % 5 == 0 else b""))
    return b"\n".join(lines) + b"\n"


def _text(n: int) -> bytes:
    return b"\n".join(t.encode() if i % 29 != 4 else b"\xff\xfe bad utf8" for i, t in enumerate(_records(n)))


def _csv(n: int) -> bytes:
    rows = [b"id,text,lang"]
    for i, text in enumerate(_records(n)):
        if i % 33 == 8:
            rows.append(f"{i},{text}".encode())  # malformed_csv_row: a field short
        elif i % 43 == 2:
            rows.append(b"")  # a blank line: Arrow skips it, it is no row
        else:
            rows.append(f"{i},{text},en".encode())
    return b"\r\n".join(rows) + b"\r\n"


_MAKERS = {"jsonl": _jsonl, "text": _text, "csv": _csv}


def _pieces_of(path, fmt: str, split_bytes: int) -> dict:
    """What ingest's split stage plans for one file, run in this process."""
    size = path.stat().st_size
    scan = split.BoundaryScan(options=None)
    return split.plan_pieces([scan(item) for item in split.chunks(0, str(path), size, fmt, split_bytes)])[0]


def _read_split(path, fmt: str, split_bytes: int) -> readers.FileRecords:
    data = path.read_bytes()
    out = readers.FileRecords()
    for piece in _pieces_of(path, fmt, split_bytes)["pieces"]:
        got = readers.read_piece(
            str(path),
            data[piece["start"] : piece["end"]],
            fmt,
            "text",
            max_chars=IngestConfig().max_chars,
            first_record=piece["first_record"],
            header=data[: piece["header_end"]],
        )
        out.index += got.index
        out.text += got.text
        out.rejects += got.rejects
    return out


@pytest.mark.parametrize("fmt", ["jsonl", "text", "csv"])
def test_every_cut_reads_each_record_once_with_its_number_in_the_file(tmp_path, fmt):
    path = tmp_path / f"big.{fmt}"
    path.write_bytes(_MAKERS[fmt](60))
    whole = readers.read_file(str(path), path.read_bytes(), fmt, "text", max_chars=IngestConfig().max_chars)
    assert len(whole.index) > 40 and whole.rejects
    # Cuts at every few bytes land inside records, on line breaks, between \r and \n, and on blank lines.
    for split_bytes in [*range(7, 120, 7), 997, path.stat().st_size - 1]:
        pieces = _pieces_of(path, fmt, split_bytes)["pieces"]
        assert pieces[0]["start"] == 0 and pieces[-1]["end"] == path.stat().st_size
        assert all(a["end"] == b["start"] for a, b in itertools.pairwise(pieces))
        got = _read_split(path, fmt, split_bytes)
        assert (got.index, got.text) == (whole.index, whole.text), split_bytes
        assert got.rejects == whole.rejects, split_bytes


def test_a_line_over_many_chunks_is_scanned_once_not_once_per_chunk(tmp_path, monkeypatch):
    lines = [json.dumps({"text": f"short {i}"}) for i in range(50)]
    lines[20] = json.dumps({"text": "long " * 40_000})  # 200 KB: two hundred 1 KB chunks inside it
    path = tmp_path / "big.jsonl"
    path.write_bytes(("\n".join(lines) + "\n").encode())
    read = []
    real = split.read_range
    monkeypatch.setattr(split, "read_range", lambda url, a, b, options: read.append(b - a) or real(url, a, b, options))
    assert _read_split(path, "jsonl", 1000).index == list(range(50))
    assert sum(read) < 3 * path.stat().st_size


def test_a_quoted_csv_is_read_whole_with_the_reason(tmp_path):
    path = tmp_path / "quoted.csv"
    path.write_bytes(b'id,text\n1,"one\ntwo"\n' + b"2,plain\n" * 50)
    plan = _pieces_of(path, "csv", 64)
    assert "pieces" not in plan and "quoted field may hold a line break" in plan["whole"]


def test_a_csv_malformed_row_keeps_its_place_in_the_numbering():
    data = b"id,text\n0,a\n1,b,extra\n\n2,c\n"
    got = readers.read_file("in.csv", data, "csv", "text", max_chars=100)
    assert list(zip(got.index, got.text, strict=True)) == [(0, "a"), (2, "c")]
    assert [(r.index, r.reason) for r in got.rejects] == [(1, "malformed_csv_row")]


def test_a_split_file_has_the_checksum_of_a_whole_read(tmp_path, monkeypatch):
    monkeypatch.setattr(split, "CHECKSUM_BLOCK", 100)  # many blocks in a small file: the tree form
    path = tmp_path / "big.jsonl"
    path.write_bytes(_jsonl(40))
    whole = split.whole_file_checksum(path.read_bytes())
    assert whole.startswith("xxh3-128/64MiB:")
    for split_bytes in (90, 100, 333, 1000):
        assert _pieces_of(path, "jsonl", split_bytes)["checksum"] == whole


def _dataset(out) -> dict:
    manifest = index.read_manifest(str(out))
    dups = duplicates(out) if manifest.totals.exact_duplicates + manifest.totals.near_duplicates else pa.table({})
    return {
        "rows": read_dataset(out).to_pylist(),
        "shards": manifest.totals.shards,
        "rejects": sorted(rejects(out).to_pylist(), key=lambda r: r["record"]),
        "duplicates": sorted(dups.to_pylist(), key=lambda r: r["ord"]),
        "sources": lineage.read_sources(str(out), manifest, columns=["url", "size", "checksum"]).to_pylist(),
        "totals": (manifest.totals.rows_in, manifest.totals.rejected, manifest.totals.exact_duplicates),
    }


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_a_file_split_into_pieces_ingests_exactly_as_unsplit(tmp_path, ray_local, fmt):
    path = tmp_path / f"big.{fmt}"
    path.write_bytes(_MAKERS[fmt](600))
    split_bytes = path.stat().st_size // 5 + 1
    # A CSV splits only where no column besides the text is kept (see the fields test below).
    cfg = {"dedup": "near", "shard_size": "20KB", **({"fields": ""} if fmt == "csv" else {})}
    unsplit = ingest([str(path)], tmp_path / "unsplit", split_size="0", **cfg)
    pieces = ingest([str(path)], tmp_path / "split", split_size=str(split_bytes), **cfg)
    assert (unsplit.files_split, unsplit.pieces) == (0, 1)
    assert (pieces.files_split, pieces.pieces) == (1, 5)
    a, b = _dataset(tmp_path / "unsplit"), _dataset(tmp_path / "split")
    assert a["shards"] > 1 and a["rejects"] and a["duplicates"] and len(a["sources"]) == 1
    assert a == b
    assert all(r["source"] == str(path) for r in b["rejects"])  # the lineage names the file, not a piece


def test_a_quoted_csv_over_the_split_size_is_ingested_whole_and_says_why(tmp_path, ray_local):
    path = tmp_path / "quoted.csv"
    path.write_bytes(b'id,text\n1,"one\ntwo"\n' + b"".join(b"%d,row %d\n" % (i, i) for i in range(2, 200)))
    summary = ingest([str(path)], tmp_path / "ds", split_size="256", dedup="none")
    assert (summary.files_split, summary.pieces, summary.rows_out) == (0, 1, 199)
    assert "quoted" in summary.note and str(path) in summary.note


def test_the_cli_splits_at_split_size_and_refuses_a_bad_one(tmp_path, ray_local):
    """In this process on the session's Ray (a subprocess would start one of its own: ~6 s), then
    the refusal as a user sees it: exit code and one line on stderr."""
    from typer.testing import CliRunner

    from petatrain.cli import app

    path = tmp_path / "big.jsonl"
    path.write_bytes(_jsonl(200))
    out = str(tmp_path / "ds")
    argv = ["ingest", str(path), "--out", out, "--split-size", "8KB", "--dedup", "none", "--json"]
    result = CliRunner().invoke(app, argv, env={"PETATRAIN_DEBUG": None}, catch_exceptions=False)
    assert result.exit_code == 0, result.output[-2000:]
    summary = json.loads(result.stdout)
    assert summary["files_split"] == 1 and summary["pieces"] == -(-path.stat().st_size // 8000)
    bad = run_cli("ingest", str(path), "--out", str(tmp_path / "other"), "--split-size", "lots")
    assert bad.returncode != 0 and "ingest.split_size" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def _jsonl_with_fields(n: int) -> bytes:
    """Records whose fields change kind along the file, so no piece sees a field's whole story:
    `score` is an integer early and a float late; `mixed` is integers with one float early and an
    object late; `big` fits int64 until its last value; `note` is null early; `late` first appears
    near the end."""
    lines = []
    for i, text in enumerate(_records(n)):
        record = {"id": f"doc-{i}", "text": f"{text} {i}", "flag": i % 3 == 0, "tags": [i % 5, "t"]}
        record["score"] = i if i < n // 2 else i + 0.25
        record["mixed"] = 2.5 if i == 3 else {"k": i} if i == n - 7 else i
        record["big"] = 2**70 if i == n - 2 else i
        record["note"] = None if i < n // 3 else f"note {i}"
        if i > n - n // 6:
            record["late"] = i
        lines.append(json.dumps(record).encode())
    return b"\n".join(lines) + b"\n"


def test_a_split_jsonl_file_keeps_its_fields_typed_as_the_whole_file(tmp_path, ray_local):
    path = tmp_path / "raw" / "src=web" / "big.jsonl"  # a Hive partition too
    path.parent.mkdir(parents=True)
    path.write_bytes(_jsonl_with_fields(600))
    cfg = {"dedup": "none", "shard_size": "20KB"}
    raw = str(tmp_path / "raw")
    unsplit = ingest([raw], tmp_path / "unsplit", split_size="0", **cfg)
    pieces = ingest([raw], tmp_path / "split", split_size=str(path.stat().st_size // 5 + 1), **cfg)
    assert (unsplit.pieces, pieces.files_split, pieces.pieces) == (1, 1, 5)
    a, b = read_dataset(tmp_path / "unsplit"), read_dataset(tmp_path / "split")
    assert b.schema == a.schema
    assert b.to_pylist() == a.to_pylist()
    types = {f.name: str(f.type) for f in b.schema}
    assert list(types) == ["doc_id", "text", "id", "flag", "tags", "score", "mixed", "big", "note", "late", "src"]
    assert types == {
        "doc_id": "int64",
        "text": "large_string",
        "id": "large_string",
        "flag": "bool",
        "tags": "large_string",
        "score": "double",
        "mixed": "large_string",
        "big": "large_string",
        "note": "large_string",
        "late": "int64",
        "src": "large_string",
    }
    rows = b.to_pylist()
    # A piece alone would have typed `mixed` float64 (its 2.5) and then written 1 as "1.0".
    assert [r["mixed"] for r in rows[:5]] == ["0", "1", "2", "2.5", "4"]
    assert rows[0]["score"] == 0.0 and rows[-2]["big"] == str(2**70) and rows[0]["late"] is None
    assert {r["src"] for r in rows} == {"web"}


def test_a_csv_with_kept_columns_is_read_whole_and_says_why(tmp_path, ray_local):
    path = tmp_path / "big.csv"
    path.write_bytes(_csv(300))
    kept = ingest([str(path)], tmp_path / "kept", split_size="2KB", dedup="none")
    assert (kept.files_split, kept.pieces) == (0, 1)
    assert "columns are kept (id, lang)" in kept.note and str(path) in kept.note
    assert {"id", "lang"} <= set(read_dataset(tmp_path / "kept").column_names)
    text_only = ingest([str(path)], tmp_path / "text-only", split_size="2KB", dedup="none", fields="")
    assert text_only.files_split == 1 and text_only.pieces > 1


def _changing(monkeypatch, path, change, *, when: str) -> None:
    """Call `change(path)` at a fixed point of the ingest's driver: after the listing, before the
    split scans (`chunks`), or after the scans, before any piece is read (`plan_pieces`)."""
    original = getattr(split, when)

    def hooked(*args, **kwargs):
        if when == "chunks":
            change(path)
            return original(*args, **kwargs)
        planned = original(*args, **kwargs)
        change(path)
        return planned

    monkeypatch.setattr(split, when, hooked)


def _replaced(path) -> None:
    """Another version of the file, the same size (a writer replacing it in place)."""
    data = path.read_bytes()
    path.write_bytes(data.replace(b"w1", b"w9"))
    assert path.stat().st_size == len(data)


def _truncated(path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize(
    ("change", "when"),
    [(_replaced, "plan_pieces"), (_truncated, "plan_pieces"), (_replaced, "chunks"), (_truncated, "chunks")],
    ids=["replaced-after-scan", "truncated-after-scan", "replaced-before-scan", "truncated-before-scan"],
)
def test_a_file_that_changes_during_a_split_ingest_is_refused_and_nothing_is_committed(
    tmp_path, ray_local, monkeypatch, change, when
):
    """Attack round 3: a JSONL replaced by a same-size version during a split ingest was committed
    as a mix of both versions; one cut short after the scan lost half its rows, with a lineage
    checksum of the whole file. Each piece now checks the bytes it read against its scan's, and
    the file's listing is checked once the pieces are read."""
    from petatrain import console

    path = tmp_path / "big.jsonl"
    path.write_bytes(_jsonl(400))
    out = tmp_path / "ds"
    _changing(monkeypatch, path, change, when=when)
    with pytest.raises(Exception) as refused:
        ingest([str(path)], out, split_size=str(path.stat().st_size // 4 + 1), dedup="none")
    line, code = console.explain(refused.value)
    assert code == 2 and line.startswith(f"source changed during the ingest: {path} (") and "\n" not in line, line
    assert "nothing was committed" in line
    assert index.read_manifest(str(out)) is None  # no dataset, no lineage claiming the file


def test_a_whole_file_cut_after_it_was_listed_is_refused(tmp_path, ray_local, monkeypatch):
    from petatrain import console
    from petatrain.data.ingest import pipeline as ingest_mod

    path = tmp_path / "small.jsonl"
    path.write_bytes(_jsonl(100))
    original = ingest_mod._pieces

    def cut_then_plan(*args, **kwargs):
        _truncated(path)
        return original(*args, **kwargs)

    monkeypatch.setattr(ingest_mod, "_pieces", cut_then_plan)
    with pytest.raises(Exception) as refused:
        ingest([str(path)], tmp_path / "ds", dedup="none")
    line, code = console.explain(refused.value)
    assert code == 2 and "bytes read" in line and "when it was listed" in line, line
    assert index.read_manifest(str(tmp_path / "ds")) is None
