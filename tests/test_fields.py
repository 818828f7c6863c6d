"""Source fields kept as columns, Hive partitions, re-registering a rewritten Spark folder,
and datasets written before these (manifest version 1)."""

import csv
import io
import json
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import ingest, read_dataset
from petatrain.config import IngestConfig
from petatrain.data import index, lineage, readers
from petatrain.data.ingest.stages import unify_fields
from petatrain.data.inspect import describe
from petatrain.data.loading.stream import StreamingDataset
from petatrain.errors import ConfigError, PetatrainError
from petatrain.storage.checksum import checksum_bytes

pytestmark = pytest.mark.usefixtures("ray_local")


def _jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _records(n, tag, **extra):
    return [{"id": f"{tag}-{i}", "text": f"{tag} document {i} with words {i * 7919} unique", **extra} for i in range(n)]


def test_every_source_field_is_a_typed_column_and_the_users_id_keeps_its_name(tmp_path):
    a = _records(3, "web", lang="en")
    a[0]["score"], a[1]["score"], a[2]["score"] = 1, 2.5, None  # ints and floats: float64
    a[0]["meta"] = {"url": "http://x", "tags": [1, 2]}  # nested: its JSON text
    a[1]["flag"] = True
    _jsonl(tmp_path / "src" / "a.jsonl", a)
    with open(tmp_path / "src" / "b.csv", "w", newline="") as handle:  # CSV's `id` is an integer column
        writer = csv.writer(handle)
        writer.writerow(["id", "text", "year"])
        writer.writerows([[7, "csv document seven, with its own words", 2024]])
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (("s0.txt", b"a webdataset sample and its class"), ("s0.cls", b"3"), ("s0.bin", b"\xff\x00")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (tmp_path / "src" / "c.tar").write_bytes(buf.getvalue())

    ingest([str(tmp_path / "src")], tmp_path / "ds", dedup="none", tokenizer="bytes")
    table = read_dataset(tmp_path / "ds")
    types = {f.name: f.type for f in table.schema}
    assert list(types)[:4] == ["doc_id", "text", "tokens", "num_tokens"]
    assert types["doc_id"] == pa.int64() and types["score"] == pa.float64() and types["flag"] == pa.bool_()
    assert types["year"] == pa.int64() and types["bin"] == pa.large_binary()
    # `id` is a string in one file and an integer in another: one string column, nothing lost.
    assert types["id"] == pa.large_string()
    rows = {r["text"]: r for r in table.to_pylist()}
    first = rows[a[0]["text"]]
    assert first["id"] == "web-0" and first["lang"] == "en" and first["score"] == 1.0
    assert json.loads(first["meta"]) == {"url": "http://x", "tags": [1, 2]}
    assert rows[a[1]["text"]]["flag"] is True and rows[a[2]["text"]]["flag"] is None
    csv_row = rows["csv document seven, with its own words"]
    assert csv_row["id"] == "7" and csv_row["year"] == 2024 and csv_row["lang"] is None
    sample = rows["a webdataset sample and its class"]
    assert sample["cls"] == "3" and sample["bin"] == b"\xff\x00" and sample["__key__"] == "s0"
    assert first["doc_id"] == 0 and csv_row["doc_id"] == 1 << 36

    # The loader reads only the columns asked for; inspect lists the fields.
    ds = StreamingDataset(str(tmp_path / "ds"), columns=["doc_id", "id", "lang"], shuffle=False)
    got = list(ds)
    assert set(got[0]) == {"doc_id", "id", "lang", "index"}
    assert [s["id"] for s in got] == ["web-0", "web-1", "web-2", "7", None]
    report = describe(str(tmp_path / "ds"), samples=1)
    assert {"id", "lang", "score", "meta", "year", "cls"} <= set(report["source_fields"])
    assert report["samples"][0]["id"] == "web-0"
    with pytest.raises(PetatrainError, match="no column 'nope'"):
        StreamingDataset(str(tmp_path / "ds"), columns=["nope"])


def test_fields_and_drop_fields_choose_the_columns_and_an_append_keeps_them(tmp_path):
    _jsonl(tmp_path / "a.jsonl", _records(3, "one", lang="en", url="u"))
    ingest([str(tmp_path / "a.jsonl")], tmp_path / "kept", dedup="none", fields="lang,missing")
    assert read_dataset(tmp_path / "kept").column_names == ["doc_id", "text", "lang", "missing"]
    ingest([str(tmp_path / "a.jsonl")], tmp_path / "dropped", dedup="none", drop_fields="url,id")
    assert read_dataset(tmp_path / "dropped").column_names == ["doc_id", "text", "lang"]
    ingest([str(tmp_path / "a.jsonl")], tmp_path / "none", dedup="none", fields="")
    assert read_dataset(tmp_path / "none").column_names == ["doc_id", "text"]

    # An append writes the dataset's columns: a field it lacks is null, a new one is an error.
    _jsonl(tmp_path / "b.jsonl", [{"text": "second batch without a lang field at all"}])
    ingest([str(tmp_path / "b.jsonl")], tmp_path / "dropped", dedup="none", drop_fields="url,id", append=True)
    table = read_dataset(tmp_path / "dropped")
    assert table.column("lang").to_pylist() == ["en", "en", "en", None]
    _jsonl(tmp_path / "c.jsonl", [{"text": "third batch with a brand new field", "topic": "x"}])
    with pytest.raises(PetatrainError, match="'topic' is not in the dataset"):
        ingest([str(tmp_path / "c.jsonl")], tmp_path / "dropped", dedup="none", drop_fields="url,id", append=True)
    with pytest.raises(PetatrainError, match="fields='lang,missing'; this run has fields='\\*'"):
        ingest([str(tmp_path / "c.jsonl")], tmp_path / "kept", dedup="none", append=True)


def test_a_field_named_like_petatrains_columns_is_a_clear_error(tmp_path):
    _jsonl(tmp_path / "a.jsonl", [{"body": "the text lives in body here", "text": "a summary"}])
    with pytest.raises(PetatrainError, match="source field 'text' has the name of a column petatrain writes"):
        ingest([str(tmp_path / "a.jsonl")], tmp_path / "ds", text_field="body", dedup="none")
    ingest([str(tmp_path / "a.jsonl")], tmp_path / "ds", text_field="body", dedup="none", drop_fields="text")
    assert read_dataset(tmp_path / "ds").column("text").to_pylist() == ["the text lives in body here"]


def test_field_values_are_typed_per_field():
    assert readers.typed_array([1, None, 3]).type == pa.int64()
    assert readers.typed_array([1, 2.5]).to_pylist() == [1.0, 2.5]
    assert readers.typed_array([True, None]).type == pa.bool_()
    assert readers.typed_array([None, None]).type == pa.null()
    assert readers.typed_array([1 << 70]).to_pylist() == [str(1 << 70)]  # beyond int64: exact, as text
    assert readers.typed_array(["a", 5, {"k": [1]}]).to_pylist() == ["a", "5", '{"k": [1]}']
    # A lone surrogate (a JSON \ud800 escape) in a string field rejects its record, as in the text;
    # inside a nested value it stays escaped in the value's JSON text.
    lines = [
        b'{"text": "good one", "note": "caf\\u00e9", "deep": {"k": "x\\ud800"}}',
        b'{"text": "bad one", "note": "lone \\udc00 here"}',
    ]
    got = readers.read_file("a.jsonl", b"\n".join(lines), "jsonl", "text", max_chars=100, fields=readers.FieldChoice())
    assert got.text == ["good one"] and [r.reason for r in got.rejects] == ["invalid_utf8"]
    table = got.fields_table()
    assert table.column("note").to_pylist() == ["café"] and table.column("deep").to_pylist() == ['{"k": "x\\ud800"}']
    with pytest.raises(PetatrainError, match=r"1001 distinct fields .* --fields a,b"):
        unify_fields([pa.schema([(f"k{i}", pa.int64()) for i in range(1001)])])
    with pytest.raises(ConfigError, match="packed rows"):
        IngestConfig(tokenizer="bytes", pack_length=8, fields="lang")
    with pytest.raises(ConfigError, match="give one of them"):
        IngestConfig(fields="a", drop_fields="b")


def _spark_folder(folder, parts):
    """A folder as Spark's partitionBy("src", "year") writes it: the partition values only in folder names."""
    for (src, year, name), texts in parts.items():
        path = folder / f"src={src}" / f"year={year}" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"text": texts, "n": list(range(len(texts)))}), path)
    (folder / "_SUCCESS").write_bytes(b"")


def test_hive_partitions_become_columns_when_registered_and_when_ingested(tmp_path):
    spark = tmp_path / "spark"
    _spark_folder(
        spark,
        {
            ("web", 2024, "part-0.parquet"): ["web page one is here", "web page two is here"],
            ("a%2Fb", 2025, "part-1.parquet"): ["a book chapter with a slash in its source"],
        },
    )
    ingest([str(spark)], tmp_path / "reg", register=True)
    manifest = index.read_manifest(str(tmp_path / "reg"))
    assert manifest.partitions == ["src", "year"] and manifest.column_type("year") == "int64"
    got = sorted(
        (s["text"], s["src"], s["year"])
        for s in StreamingDataset(str(tmp_path / "reg"), columns=["text", "src", "year"])
    )
    assert got == [
        ("a book chapter with a slash in its source", "a/b", 2025),
        ("web page one is here", "web", 2024),
        ("web page two is here", "web", 2024),
    ]
    assert describe(str(tmp_path / "reg"), samples=0)["partitions"] == ["src", "year"]

    ingest([str(spark)], tmp_path / "ing", dedup="none")
    table = read_dataset(tmp_path / "ing")
    assert table.schema.field("year").type == pa.int64()
    assert sorted(zip(table.column("src").to_pylist(), table.column("n").to_pylist(), strict=True)) == [
        ("a/b", 0),
        ("web", 0),
        ("web", 1),
    ]


def test_a_rewritten_spark_folder_is_refreshed_and_append_never_keeps_gone_files(tmp_path):
    spark = tmp_path / "spark"
    spark.mkdir()
    pq.write_table(pa.table({"text": ["one", "two"]}), spark / "part-0000-aaa.parquet")
    pq.write_table(pa.table({"text": ["three"]}), spark / "part-0001-aaa.parquet")
    ingest([str(spark)], tmp_path / "ds", register=True)

    # mode("overwrite"): every file replaced by new names.
    for old in spark.glob("*.parquet"):
        old.unlink()
    pq.write_table(pa.table({"text": ["four", "five"]}), spark / "part-0000-bbb.parquet")
    pq.write_table(pa.table({"text": ["six"]}), spark / "part-0001-bbb.parquet")
    with pytest.raises(PetatrainError, match=r"2 registered file\(s\) .* are gone .*--refresh"):
        ingest([str(spark)], tmp_path / "ds", register=True, append=True)

    summary = ingest([str(spark)], tmp_path / "ds", register=True, refresh=True)
    assert (summary.files_new, summary.files_removed, summary.files_changed) == (2, 2, 0)
    assert "2 file(s) added, 2 removed" in summary.note
    assert sorted(read_dataset(tmp_path / "ds").column("text").to_pylist()) == ["five", "four", "six"]
    dataset = index.open_dataset(str(tmp_path / "ds"))
    assert dataset.num_rows == 3 and not index.verify_shards(dataset)
    assert sorted(lineage.read_sources(str(tmp_path / "ds"), dataset.manifest).column("url").to_pylist()) == sorted(
        str(p) for p in spark.glob("*.parquet")
    )

    # One file rewritten in place and one added: only those are read; the rest stays as it was.
    pq.write_table(pa.table({"text": ["six", "seven", "eight"]}), spark / "part-0001-bbb.parquet")
    pq.write_table(pa.table({"text": ["nine"]}), spark / "part-0002-bbb.parquet")
    summary = ingest([str(spark)], tmp_path / "ds", register=True, refresh=True)
    assert (summary.files_new, summary.files_removed, summary.files_changed) == (1, 0, 1)
    assert summary.files_already_ingested == 1
    assert sorted(read_dataset(tmp_path / "ds").column("text").to_pylist()) == sorted(
        ["four", "five", "six", "seven", "eight", "nine"]
    )
    again = ingest([str(spark)], tmp_path / "ds", register=True, refresh=True)
    assert "nothing changed" in again.note
    with pytest.raises(PetatrainError, match="use it with --register"):
        ingest([str(spark)], tmp_path / "ds", refresh=True)
    with pytest.raises(PetatrainError, match="--register indexes the files as they are"):
        ingest([str(spark)], tmp_path / "ds", register=True, refresh=True, fields="text")


def _version_one_dataset(folder, texts):
    """A dataset as petatrain wrote it before source fields and lineage tables: shards with an
    `id` column, `_index/shards.parquet` unchecksummed, every source inline in the manifest."""
    (folder / "data").mkdir(parents=True)
    (folder / "_index").mkdir()
    shard = pa.table({"id": list(range(len(texts))), "text": pa.array(texts, pa.large_string())})
    pq.write_table(shard, folder / "data" / "part-000000.parquet")
    data = (folder / "data" / "part-000000.parquet").read_bytes()
    shards = pa.table(
        {
            "path": ["data/part-000000.parquet"],
            "rows": [len(texts)],
            "bytes": [len(data)],
            "checksum": [checksum_bytes(data)],
            "first_row": [0],
        }
    )
    pq.write_table(shards, folder / "_index" / "shards.parquet")
    manifest = {
        "format": "petatrain.dataset",
        "version": 1,
        "kind": "text",
        "schema": [{"name": "id", "type": "int64"}, {"name": "text", "type": "large_string"}],
        "totals": {"shards": 1, "rows": len(texts), "bytes": len(data), "documents": len(texts), "rows_in": 3},
        "lineage": {
            "sources": [{"url": "/old/a.jsonl", "size": 10, "fingerprint": "", "checksum": "c", "batch": 1}],
            "batches": [{"batch": 1, "time": "2026-01-01T00:00:00Z", "files": 1, "rows_out": len(texts)}],
            "next_file_ord": 1,
        },
        "ingest": {
            "format": "auto",
            "text_field": "text",
            "dedup": "exact",
            "near_threshold": 0.8,
            "tokenizer": "",
            "pack_length": 0,
            "shard_size": "256MB",
            "max_chars": 1000000,
            "min_chars": 1,
        },
        "file_bits": 36,
    }
    (folder / "_index" / "manifest.json").write_text(json.dumps(manifest))


def test_a_version_one_dataset_reads_and_appends_in_its_own_layout(tmp_path):
    old = tmp_path / "old"
    _version_one_dataset(old, ["an old document", "another old document"])
    report = describe(str(old), samples=1)
    assert report["sources"] == 1 and report["samples"][0]["id"] == 0
    assert [s["text"] for s in StreamingDataset(str(old), columns=["text"], shuffle=False)] == [
        "an old document",
        "another old document",
    ]
    _jsonl(tmp_path / "new.jsonl", _records(2, "new", lang="en"))
    summary = ingest([str(tmp_path / "new.jsonl")], old, append=True, dedup="exact")
    assert "keeps that layout" in summary.note
    table = read_dataset(old)
    assert table.column_names == ["id", "text"] and table.num_rows == 4
    manifest = index.read_manifest(str(old))
    assert manifest.lineage.num_sources == 2 and not manifest.lineage.sources  # moved into a lineage table
    assert lineage.read_sources(str(old), manifest).column("url").to_pylist() == [
        "/old/a.jsonl",
        str(tmp_path / "new.jsonl"),
    ]
    assert json.loads((old / "_index" / "manifest.json").read_text())["version"] == 2


@pytest.mark.s3
def test_a_partitioned_spark_folder_on_s3_registers_refreshes_and_streams(s3_endpoint, s3_bucket, tmp_path):
    from petatrain.storage import resolve

    fs, _ = resolve(s3_bucket)
    bucket = s3_bucket.removeprefix("s3://")

    def put(path, texts):
        with fs.open(f"{bucket}/spark/{path}", "wb") as handle:
            pq.write_table(pa.table({"text": texts}), handle)

    put("src=web/part-0-a.parquet", ["a web page"])
    put("src=books/part-0-a.parquet", ["a book", "another book"])
    ingest([f"{s3_bucket}/spark"], f"{s3_bucket}/reg", register=True)

    def rows():
        loaded = StreamingDataset(f"{s3_bucket}/reg", columns=["text", "src"], cache_dir=str(tmp_path / "cache"))
        return sorted((s["text"], s["src"]) for s in loaded)

    got = rows()
    assert got == [("a book", "books"), ("a web page", "web"), ("another book", "books")]

    fs.rm(f"{bucket}/spark", recursive=True)  # mode("overwrite")
    put("src=web/part-0-b.parquet", ["a new web page"])
    summary = ingest([f"{s3_bucket}/spark"], f"{s3_bucket}/reg", register=True, refresh=True)
    assert (summary.files_new, summary.files_removed) == (1, 2)
    assert rows() == [("a new web page", "web")]
    assert "part-0-b.parquet" in fs.cat(f"{bucket}/reg/README.md").decode()


def test_a_forged_footer_a_reserved_or_repeated_partition_name_is_refused_and_nothing_registered(tmp_path):
    """Attack round 3 (issue 35): a Parquet footer claiming 2^62 rows was committed, verified, and
    failed the loader; Hive partition columns named doc_id or tokens were registered beside
    petatrain's own columns; a path with a=1/a=2 kept the last value silently."""
    import struct

    def varint(value: int) -> bytes:
        out = b""
        while True:
            low, value = value & 0x7F, value >> 7
            if not value:
                return out + bytes([low])
            out += bytes([low | 0x80])

    folder = tmp_path / "forged"
    folder.mkdir()
    pq.write_table(pa.table({"text": ["a", "b", "c"]}), folder / "part-0.parquet")
    data = (folder / "part-0.parquet").read_bytes()
    size = struct.unpack("<I", data[-8:-4])[0]
    footer = data[-8 - size : -8]
    # FileMetaData's num_rows: field 3 (i64, compact protocol: header 0x16), 3 rows zigzag-encoded as 6.
    at = footer.index(b"\x16\x06")  # the first: FileMetaData's own, after its version and schema
    forged = footer[:at] + b"\x16" + varint(2**62 << 1) + footer[at + 2 :]
    (folder / "part-0.parquet").write_bytes(data[: -8 - size] + forged + struct.pack("<I", len(forged)) + b"PAR1")
    assert pq.ParquetFile(folder / "part-0.parquet").metadata.num_rows == 2**62
    with pytest.raises(PetatrainError, match=r"footer claims 4611686018427387904 rows, which its row groups do not"):
        ingest([str(folder)], tmp_path / "reg", register=True)
    assert not (tmp_path / "reg" / "manifest.json").exists()

    for name in ("doc_id", "tokens"):
        spark = tmp_path / f"spark-{name}"
        (spark / f"{name}=7").mkdir(parents=True)
        pq.write_table(pa.table({"text": ["one"]}), spark / f"{name}=7" / "part-0.parquet")
        with pytest.raises(PetatrainError, match=rf"partition folder {name}=\.\.\. takes a name petatrain keeps"):
            ingest([str(spark)], tmp_path / f"reg-{name}", register=True)
    twice = tmp_path / "twice"
    (twice / "a=1" / "a=2").mkdir(parents=True)
    pq.write_table(pa.table({"text": ["one"]}), twice / "a=1" / "a=2" / "part-0.parquet")
    for register in (True, False):
        with pytest.raises(PetatrainError, match="the partition column 'a' appears twice in its folders"):
            ingest([str(twice)], tmp_path / f"twice-{register}", register=register, dedup="none")
