"""Hostile raw input, read by the source readers: one bad record never costs its neighbours.

Every attack must end in kept records that are fine and a one-line reject for what is
not, with the file going on; never in a crash, a silent drop or an unbounded read.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import random
import tarfile
import tracemalloc
import zlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from petatrain.config import IngestConfig
from petatrain.data import index, readers
from petatrain.data.ingest import IngestJob, run
from petatrain.data.ingest.stages import ReadCleanSign, whole_file
from petatrain.storage import read_bytes
from petatrain.storage.fs import expand_sources


def _read(data: bytes, fmt: str, name: str = "in") -> readers.FileRecords:
    return readers.read_file(f"{name}.{fmt}", data, fmt, "text", max_chars=IngestConfig().max_chars)


def _tar(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _stage_one_read(path, **cfg) -> readers.FileRecords:
    """What ingest's first stage reads from one source file, in this process (so a test can
    patch a module constant)."""
    stage = ReadCleanSign(staging=str(path.parent / "staging"), cfg=IngestConfig(**cfg), options=None, lsh=None)
    return stage._read(whole_file(0, str(path), path.stat().st_size))[0]


def _staged(path, **cfg) -> tuple[readers.FileRecords, list[dict], int]:
    """What ingest's first stage stages from one source file, as its task runs it (a compressed
    file of lines streamed in pieces, another read whole), in this process: its records and rejects
    read back from the staging folder, what it said of each piece it staged, and the peak of Python
    allocations while it ran."""
    from petatrain.data.ingest.stages import FILE_BITS, staged_name

    staging = path.parent / "staging"
    stage = ReadCleanSign(staging=str(staging), cfg=IngestConfig(**cfg), options=None, lsh=None)
    done, peak = _peak_bytes(lambda: stage(whole_file(0, str(path), path.stat().st_size)))
    pieces = done if isinstance(done, list) else [done]
    out = readers.FileRecords()
    for stat in pieces:
        name = staged_name(0, stat["piece"])
        docs = pq.read_table(staging / "docs" / name)
        out.index += [o & ((1 << FILE_BITS) - 1) for o in docs.column("ord").to_pylist()]
        out.text += docs.column("text").to_pylist()
        if (staging / "rejects" / name).exists():
            for r in pq.read_table(staging / "rejects" / name).to_pylist():
                out.rejects.append(readers.Reject(r["record"], r["reason"], r["detail"], r["raw"]))
    return out, pieces, peak


def _ingest_rejects(sources_, out, **cfg) -> tuple[object, list[dict]]:
    summary = run(IngestJob(sources=[str(s) for s in sources_], out=str(out), config=IngestConfig(**cfg)))
    files = sorted(glob.glob(os.path.join(str(out), "_rejects", "*", "records-*.parquet")))
    return summary, pa.concat_tables([pq.read_table(f) for f in files]).to_pylist() if files else []


def _gzip_bomb(expanded: int) -> bytes:
    """`expanded` bytes of zeros, gzipped: about 1/1000 of that on disk."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # wbits 31: a gzip header and trailer
    block = bytes(1 << 20)
    return b"".join([*(packer.compress(block) for _ in range(expanded >> 20)), packer.flush()])


def _peak_bytes(fn):
    """fn's result and the peak of Python allocations while it ran."""
    tracemalloc.start()
    try:
        return fn(), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _reasons(records: readers.FileRecords) -> dict[int, tuple[str, str]]:
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


# -- 4. decompression and record size are bounded before anything is parsed ----------------
@pytest.mark.parametrize("name", ["bomb.jsonl.gz", "bomb.csv.gz"])  # streamed (lines), and decompressed whole
def test_a_gzip_bomb_is_unreadable_past_the_cap_and_never_expanded_whole(tmp_path, monkeypatch, name):
    monkeypatch.setattr(readers.registry, "MAX_DECOMPRESSED_BYTES", 4 << 20)
    bomb = tmp_path / name
    bomb.write_bytes(_gzip_bomb(128 << 20))
    assert bomb.stat().st_size < 1 << 20
    records, pieces, peak = _staged(bomb)
    assert records.text == [] and len(pieces) == 1
    assert [(r.reason, r.detail) for r in records.rejects] == [
        ("unreadable_file", "PetatrainError: expands past 4194304 bytes when decompressed")
    ]
    assert peak < 16 << 20, f"peak {peak >> 20} MiB: the decompressor ran past the cap"


@pytest.mark.parametrize(("ending", "last"), [(b"\n", b"\n"), (b"\r\n", b"\r\n"), (b"\n", b"")])  # none at the end
def test_a_streamed_file_reads_as_the_whole_file_does_around_the_record_cap(ending, last):
    """Records, their numbers and every reject (reason and detail) of a compressed JSONL read as a
    stream equal a whole read's, with lines one byte either side of the record cap, a CR before the
    line break, blank and malformed lines, and pieces smaller than a line or holding many."""
    cap = readers.record_byte_cap(2000)
    rng = random.Random(7)
    lines = [b'{"text": "first"}']
    for i in range(400):
        kind = rng.random()
        if kind < 0.1:
            lines.append(b"")
        elif kind < 0.15:
            lines.append(b'{"text": "torn')
        elif kind < 0.25:
            lines.append(b"q" * (cap + rng.choice([-1, 0, 1, 2, cap])) + rng.choice([b"", b"\r"]))
        else:
            lines.append(json.dumps({"text": f"doc {i} " + "w" * rng.randrange(3000)}).encode())
    data = ending.join(lines) + last
    whole = readers.read_file("in.jsonl", data, "jsonl", "text", max_chars=2000)
    for piece_bytes in (1, 3 << 20):
        got = readers.FileRecords()
        for part in readers.read_stream(
            "in.jsonl.gz", io.BytesIO(gzip.compress(data)), "jsonl", "text", max_chars=2000, piece_bytes=piece_bytes
        ):
            got.index += part.index
            got.text += part.text
            got.rejects += part.rejects
        assert (got.index, got.text) == (whole.index, whole.text)
        assert sorted((r.index, r.reason, r.detail, r.raw) for r in got.rejects) == sorted(
            (r.index, r.reason, r.detail, r.raw) for r in whole.rejects
        )


@pytest.mark.parametrize("listed", [-100, 100])  # cut short, or grown, since it was listed
def test_a_streamed_file_that_changed_since_its_listing_is_refused_in_one_line(tmp_path, listed):
    """A streamed source is read in ranges against its listed size, as a split file's pieces are: a
    file that changed is the ingest's error naming it (nothing committed), not a quarantined file."""
    from petatrain.errors import PetatrainError

    path = tmp_path / "in.jsonl.gz"
    path.write_bytes(gzip.compress(b"".join(b'{"text": "doc %d"}\n' % i for i in range(2000))))
    stage = ReadCleanSign(staging=str(tmp_path / "staging"), cfg=IngestConfig(), options=None, lsh=None)
    with pytest.raises(PetatrainError, match=r"^source changed during the ingest: .*in\.jsonl\.gz \(it (ended|is) "):
        stage(whole_file(0, str(path), path.stat().st_size + listed))


def test_a_file_too_large_for_the_workers_memory_is_one_quarantine_record_not_an_oom_loop(tmp_path, monkeypatch):
    """Attack round 3 MED (issue 35): the 4 GiB cap was held whole in one worker's memory, so a pod
    with less OOM-looped with no error. A file read whole (here a compressed CSV: a quoted field may
    hold a line break) may expand to a quarter of what the worker has left (its container's limit,
    else the host's available memory): past it, one record says why."""
    monkeypatch.setattr(readers.registry, "memory_left", lambda: 8 << 20)
    big = tmp_path / "big.csv.gz"
    big.write_bytes(_gzip_bomb(64 << 20))
    records, _, peak = _staged(big)
    assert records.text == [] and [r.reason for r in records.rejects] == ["unreadable_file"]
    detail = records.rejects[0].detail
    assert "expands past 2097152 bytes when decompressed, 1/4 of the 8388608 bytes of memory" in detail
    assert "give the workers more memory" in detail
    assert peak < 8 << 20, f"peak {peak >> 20} MiB"


def test_a_compressed_jsonl_larger_than_the_workers_memory_streams_through_in_pieces(tmp_path, monkeypatch):
    """Issue 35: a compressed file of lines (JSONL, text) is decompressed as it is read, in pieces cut
    at line ends, so a worker holds one piece: a file expanding to 24x what the worker may hold is
    ingested whole, numbered as the file, and its lineage checksum is the file's. (A piece holds at
    least one record of the cap max_chars sets: ~1 MiB here, the share.)"""
    from petatrain.data.ingest.split import whole_file_checksum

    monkeypatch.setattr(readers.registry, "memory_left", lambda: 4 << 20)  # a 1 MiB share
    lines = [json.dumps({"text": f"document {i} " + "w" * (i % 1900)}) for i in range(30_000)]
    lines[25_001] = '{"text": "torn'  # a bad record in a later piece keeps its number in the file
    data = ("\n".join(lines) + "\n").encode()
    assert len(data) > 24 << 20
    path = tmp_path / "big.jsonl.gz"
    path.write_bytes(gzip.compress(data, compresslevel=1))
    records, pieces, peak = _staged(path, max_chars=2000)
    assert records.index == [i for i in range(30_000) if i != 25_001]
    assert records.text[-1] == json.loads(lines[-1])["text"]
    assert [(r.index, r.reason) for r in records.rejects] == [(25_001, "malformed_json")]
    assert len(pieces) >= 12, len(pieces)  # of a share or a little more: what one read adds past it
    assert peak < 12 << 20, f"peak {peak >> 20} MiB for a file of {len(data) >> 20} MiB"
    assert {s["checksum"] for s in pieces} == {whole_file_checksum(path.read_bytes())}
    assert sum(s["size"] for s in pieces) == path.stat().st_size


def test_a_parquet_dictionary_bomb_is_unreadable_before_it_is_decoded(tmp_path, monkeypatch):
    """A 300-byte Parquet file: one 1 MiB value in a dictionary page, its index repeated 4,000 times
    (no Arrow schema stored, so a reader decodes plain strings: 4 GiB). Its expansion is counted on
    the dictionary before anything is decoded: one unreadable_file, no gigabytes allocated."""
    monkeypatch.setattr(readers.parquet, "memory_left", lambda: 256 << 20)  # a 64 MiB share
    values = pa.DictionaryArray.from_arrays(pa.array([0] * 4000, pa.int32()), pa.array(["a" * (1 << 20)]))
    path = tmp_path / "bomb.parquet"
    pq.write_table(
        pa.table({"text": values}), path, compression="zstd", dictionary_pagesize_limit=4 << 20, store_schema=False
    )
    assert path.stat().st_size < 4096
    pool = pa.default_memory_pool()
    before = pool.max_memory()
    records = _stage_one_read(path)
    assert records.text == []
    [reject] = records.rejects
    assert reject.reason == "unreadable_file"
    assert reject.detail.startswith(
        "PetatrainError: expands past 67108864 bytes when read (its strings repeat dictionary values), 1/4 of the "
        "268435456 bytes of memory this ingest worker has left; give the workers more memory, or write it with"
    ), reject.detail
    assert pool.max_memory() < before + (256 << 20), "the strings were decoded"
    # The same values a few times over are read as they always were.
    pq.write_table(pa.table({"text": values[:3]}), path, store_schema=False)
    assert _stage_one_read(path).text == ["a" * (1 << 20)] * 3


@pytest.mark.chaos
def test_a_file_whose_every_reader_is_killed_is_one_quarantine_record_not_a_loop(ray_local, tmp_path):
    """Attack round 3 MED (issue 35): Ray Data runs a task again, forever, when its process dies, so
    a file that takes more memory than a worker has (a pod's cgroup limit: the kernel kills the
    worker) looped an ingest with no error. Here an OOM killer of the test's kills every ingest task
    past 400 MiB, and one file expands to 1 GiB (under the memory-share cap): its task is run three
    times, then the file is one quarantine record and the others are committed."""
    import gzip
    import signal
    import threading
    import time

    import psutil

    from petatrain.constants import TASK_RETRIES

    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "fine.jsonl").write_text("".join(json.dumps({"text": f"document number {i}"}) + "\n" for i in range(50)))
    member = gzip.compress(bytes(1 << 20))  # gzip members concatenate: 1024 of them expand to 1 GiB
    (raw / "huge.csv.gz").write_bytes(member * 1024)  # read whole: a compressed CSV is not streamed
    killed, stop = [], threading.Event()

    def oom_killer():
        while not stop.is_set():
            for proc in psutil.process_iter(["cmdline", "memory_info"]):
                cmd, mem = proc.info["cmdline"] or [""], proc.info["memory_info"]
                if cmd[0].startswith("ray::_ingest_task") and mem is not None and mem.rss > 400 << 20:
                    os.kill(proc.pid, signal.SIGKILL)
                    killed.append(proc.pid)
            time.sleep(0.02)

    killer = threading.Thread(target=oom_killer, daemon=True)
    killer.start()
    started = time.monotonic()
    try:
        summary, rejects = _ingest_rejects([raw], tmp_path / "ds")
    finally:
        stop.set()
        killer.join()
    assert len(killed) == TASK_RETRIES + 1, killed
    assert summary.rows_out == 50 and summary.rejected == {"unreadable_file": 1}
    [reject] = rejects
    assert reject["source"].endswith("huge.csv.gz") and reject["reason"] == "unreadable_file"
    assert "the worker reading it was lost 3 times (its process died)" in reject["detail"]
    assert time.monotonic() - started < 120
    assert index.open_dataset(str(tmp_path / "ds")).num_rows == 50


def test_a_line_over_the_record_cap_is_too_long_unread_and_its_neighbours_kept(tmp_path):
    giant = b'{"text": "' + b"x" * (64 << 20) + b'"}'
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"text": "before"}\n' + giant + b'\n{"text": "after"}\n')
    records, peak = _peak_bytes(lambda: _stage_one_read(path, max_chars=1000))
    assert records.text == ["before", "after"] and records.index == [0, 2]
    [reject] = records.rejects
    assert (reject.index, reject.reason, reject.raw) == (1, "too_long", giant[:4096])
    assert f"{len(giant)} bytes" in reject.detail and "\n" not in reject.detail
    # The file itself is in memory once; the giant line is never copied, decoded or parsed.
    assert peak < path.stat().st_size + (8 << 20), f"peak {peak >> 20} MiB"


@pytest.mark.parametrize("fmt", ["text", "webdataset"])
def test_an_oversized_text_line_or_member_is_too_long_with_a_bounded_raw(tmp_path, fmt):
    big = b"z" * (2 << 20)  # over the record cap for max_chars=1000
    texts = [b"before", big, b"after"]
    path = tmp_path / ("in.txt" if fmt == "text" else "in.tar")
    path.write_bytes(b"\n".join(texts) if fmt == "text" else _tar([(f"s{i}.txt", t) for i, t in enumerate(texts)]))
    records = _stage_one_read(path, max_chars=1000)
    assert records.text == ["before", "after"]
    assert [(r.index, r.reason, r.raw) for r in records.rejects] == [(1, "too_long", big[:4096])]
    assert f"{len(big)} bytes" in records.rejects[0].detail


def test_a_reject_keeps_a_bounded_prefix_of_its_raw_bytes_and_says_how_long_it_was(tmp_path):
    bad = b'{"text": "' + b"y" * 100_000  # unterminated string, under the record cap
    path = tmp_path / "in.jsonl"
    path.write_bytes(bad + b'\n{"text": "fine"}\n')
    records = _stage_one_read(path)
    assert records.text == ["fine"]
    [reject] = records.rejects
    assert (reject.reason, reject.raw) == ("malformed_json", bad[:4096])
    assert f"{len(bad)} bytes" in reject.detail


def test_ingest_stores_a_bounded_raw_for_an_oversized_record(tmp_path, ray_local):
    giant = b'{"text": "' + b"x" * (8 << 20) + b'"}'
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"text": "before"}\n' + giant + b'\n{"text": "after"}\n')
    summary, rejects = _ingest_rejects([path], tmp_path / "ds", max_chars=1000, dedup="none")
    assert summary.rows_out == 2 and summary.rejected == {"too_long": 1}
    [reject] = rejects
    assert (reject["record"], reject["reason"], reject["raw"]) == (1, "too_long", giant[:4096])
    assert f"{len(giant)} bytes" in reject["detail"]


# -- 10. names, keys and quotes are taken as written ---------------------------------------
def test_a_source_that_names_an_existing_path_is_taken_literally_not_as_a_glob(tmp_path):
    for name in ("data[1].jsonl", "data1.jsonl", "run[2]/a.jsonl", "run2/b.jsonl"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(json.dumps({"text": name}) + "\n")

    def urls(pattern):
        return [f.url for f in expand_sources([str(tmp_path / pattern)])]

    assert urls("data[1].jsonl") == [str(tmp_path / "data[1].jsonl")]
    assert urls("run[2]") == [str(tmp_path / "run[2]" / "a.jsonl")]
    assert urls("data[0-9].jsonl") == [str(tmp_path / "data1.jsonl")], "a pattern naming no file is still a glob"


def test_a_webdataset_key_that_comes_back_after_another_is_a_new_sample():
    members = [("a.txt", b"a first"), ("b.txt", b"b"), ("a.txt", b"a again"), ("c.txt", b"c"), ("c.txt", b"c again")]
    records = _read(_tar(members), "webdataset", "shard")
    assert records.text == ["a first", "b", "a again", "c", "c again"] and not records.rejects


def test_a_truncated_webdataset_keeps_the_samples_before_the_cut():
    data = _tar([(f"s{i}.txt", f"sample {i} ".encode() * 200) for i in range(3)])
    records = _read(data[: data.index(b"sample 2") + 100], "webdataset", "shard")  # cut inside s2's data
    assert records.text == ["sample 0 " * 200, "sample 1 " * 200]
    assert [r.reason for r in records.rejects] == ["unreadable_file"]


def test_an_unterminated_csv_quote_rejects_the_rows_it_swallows_and_keeps_the_rows_before():
    data = b'id,text\n1,"fine, quoted"\n2,"multi\nline"\n3,"never closed\n4,swallowed\n\n5,also swallowed\n'
    records = _read(data, "csv")
    assert records.text == ["fine, quoted", "multi\nline"]
    assert [(r.reason, r.raw) for r in records.rejects] == [
        ("malformed_csv_row", b'3,"never closed'),
        ("malformed_csv_row", b"4,swallowed"),
        ("malformed_csv_row", b"5,also swallowed"),
    ]
    assert all("line 5" in r.detail for r in records.rejects)
    indices = records.index + [r.index for r in records.rejects]
    assert len(set(indices)) == len(indices), "every record of a file has its own number"


def test_an_unterminated_csv_quote_before_the_last_column_is_caught_too():
    records = _read(b'text,id\nfine,1\n"never closed,2\nswallowed,3\n', "csv")
    assert records.text == ["fine"]
    assert [(r.reason, r.raw) for r in records.rejects] == [
        ("malformed_csv_row", b'"never closed,2'),
        ("malformed_csv_row", b"swallowed,3"),
    ]


def test_ingest_takes_names_keys_and_quotes_as_written(tmp_path, ray_local):
    (tmp_path / "data[1].jsonl").write_text(json.dumps({"text": "from data[1]"}) + "\n")
    (tmp_path / "data1.jsonl").write_text(json.dumps({"text": "from data1"}) + "\n")
    (tmp_path / "keys.tar").write_bytes(_tar([("a.txt", b"a first"), ("b.txt", b"b"), ("a.txt", b"a again")]))
    (tmp_path / "rows.csv").write_bytes(b'id,text\n1,kept row\n2,"never closed\n3,swallowed\n')
    out = tmp_path / "ds"
    sources_ = [tmp_path / "data[1].jsonl", tmp_path / "keys.tar", tmp_path / "rows.csv"]
    summary, rejects = _ingest_rejects(sources_, out, dedup="none")
    ds = index.open_dataset(str(out))
    shards = [pq.read_table(pa.BufferReader(read_bytes(ds.shard_url(p)))) for p in ds.shards.column("path").to_pylist()]
    texts = pa.concat_tables(shards).column("text").to_pylist()
    assert texts == ["from data[1]", "a first", "b", "a again", "kept row"]
    assert summary.rejected == {"malformed_csv_row": 2}
    assert sorted(r["raw"] for r in rejects) == [b'2,"never closed', b"3,swallowed"]
