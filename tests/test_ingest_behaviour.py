"""Ingest as a user runs it: formats, bad input, idempotence, append, crash safety."""

import csv
import gzip
import io
import json
import os
import random
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import run_cli
from helpers import ingest, read_dataset, rejects, snapshot
from petatrain.data import index, synth
from petatrain.errors import PetatrainError

pytestmark = pytest.mark.usefixtures("ray_local")


def _jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def _sentences(n, tag):
    """n distinct documents (no two are near duplicates), the same for the same tag."""
    rng = random.Random(tag)
    words = synth._Words(rng, vocab_size=5000)
    return [f"{tag} {i}: " + synth._document(words, rng, 40) for i in range(n)]


def test_every_format_reads_the_same_text(tmp_path):
    texts = _sentences(20, "fmt")
    _jsonl(tmp_path / "a.jsonl", texts[:5])
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as handle:
        handle.write("".join(json.dumps({"text": t}) + "\n" for t in texts[5:8]))
    pq.write_table(pa.table({"text": texts[8:11], "other": [1, 2, 3]}), tmp_path / "c.parquet")
    with open(tmp_path / "d.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", "text"])
        writer.writerows([[i, t] for i, t in enumerate(texts[11:14])])
    (tmp_path / "e.txt").write_text("\n".join(texts[14:17]) + "\n")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i, t in enumerate(texts[17:20]):
            data = t.encode()
            info = tarfile.TarInfo(f"sample{i:03d}.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (tmp_path / "f.tar").write_bytes(buf.getvalue())
    summary = ingest([str(tmp_path)], tmp_path / "ds")
    assert read_dataset(tmp_path / "ds").column("text").to_pylist() == texts
    assert summary.rows_in == summary.rows_out == 20 and not summary.rejected


def test_bad_records_are_quarantined_with_reasons(tmp_path):
    good = _sentences(4, "good")
    lines = [
        json.dumps({"text": good[0]}).encode(),
        b'{"text": "unterminated',
        json.dumps({"body": "wrong field"}).encode(),
        b'{"text": "caf\xe9 latin-1 bytes"}',
        json.dumps({"text": "  \t "}).encode(),
        json.dumps({"text": 42}).encode(),
        json.dumps({"text": "x" * 5000}).encode(),
        b"[1, 2, 3]",
        json.dumps({"text": good[1]}).encode(),
        json.dumps({"text": "lone \ud800 surrogate"}).encode(),
        json.dumps({"text": good[2]}).encode(),
    ]
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (tmp_path / "garbage.jsonl").write_bytes(bytes(range(256)) * 40)
    (tmp_path / "empty.jsonl").write_bytes(b"")
    summary = ingest(
        [str(tmp_path / "in.jsonl"), str(tmp_path / "garbage.jsonl"), str(tmp_path / "empty.jsonl")],
        tmp_path / "ds",
        max_chars=4000,
    )
    assert read_dataset(tmp_path / "ds").column("text").to_pylist() == good[:3]
    quarantined = rejects(tmp_path / "ds").to_pylist()
    by_line = {(r["source"].rsplit("/", 1)[1], r["record"]): r["reason"] for r in quarantined}
    assert by_line[("in.jsonl", 1)] == "malformed_json"
    assert by_line[("in.jsonl", 2)] == "missing_field"
    assert by_line[("in.jsonl", 3)] == "invalid_utf8"
    assert by_line[("in.jsonl", 4)] == "empty"
    assert by_line[("in.jsonl", 5)] == "field_not_string"
    assert by_line[("in.jsonl", 6)] == "too_long"
    assert by_line[("in.jsonl", 7)] == "malformed_record"
    assert by_line[("in.jsonl", 9)] == "invalid_utf8"
    assert any(name == "garbage.jsonl" for name, _ in by_line)
    # The raw bytes are kept, so nothing is lost.
    raw = {(r["source"].rsplit("/", 1)[1], r["record"]): r["raw"] for r in quarantined}
    assert raw[("in.jsonl", 3)] == lines[3]
    assert summary.rows_in == summary.rows_out + sum(summary.rejected.values())


def test_wrong_text_field_rejects_every_record(tmp_path):
    src = _jsonl(tmp_path / "a.jsonl", _sentences(3, "field"))
    summary = ingest([src], tmp_path / "ds", text_field="content")
    assert summary.rows_out == 0 and summary.rejected == {"missing_field": 3}


@pytest.mark.parametrize("source", ["does/not/exist.jsonl", "nosuchproto://bucket/x.jsonl"])
def test_unreachable_sources_are_one_line_errors(tmp_path, source):
    result = run_cli("ingest", source, "--out", str(tmp_path / "ds"))
    assert result.returncode == 2, result.stderr
    assert "error:" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_rerun_is_a_no_op_and_append_adds_only_new_files(tmp_path):
    first = _sentences(30, "first")
    a = _jsonl(tmp_path / "src" / "a.jsonl" if (tmp_path / "src").mkdir() is None else None, first)
    out = tmp_path / "ds"
    ingest([a], out)
    before = snapshot(out)
    again = ingest([a], out)
    assert again.files_new == 0 and again.files_already_ingested == 1 and again.rows_out == 0
    assert snapshot(out) == before, "re-running the same ingest must change nothing"

    b = _jsonl(tmp_path / "src" / "b.jsonl", first[:5] + _sentences(10, "second"))
    with pytest.raises(PetatrainError, match="--append"):
        ingest([a, b], out)
    added = ingest([a, b], out, append=True)
    assert added.files_new == 1 and added.files_already_ingested == 1
    assert added.exact_duplicates == 5, "new copies of committed documents are dropped"
    assert read_dataset(out).column("text").to_pylist() == first + _sentences(10, "second")
    for path, data in before.items():  # committed shards are untouched
        if path.startswith("data/"):
            assert snapshot(out)[path] == data
    ds = index.open_dataset(str(out))
    assert ds.num_rows == 40 and ds.shards.column("first_row").to_pylist()[-1] == 30

    # A dataset's data/ linked to another folder (attack round 3): an append is refused before it
    # writes anything, instead of writing shards into whatever the link points to.
    (out / "data").rename(tmp_path / "elsewhere")
    (out / "data").symlink_to(tmp_path / "elsewhere")
    elsewhere = snapshot(tmp_path / "elsewhere")
    c = _jsonl(tmp_path / "src" / "c.jsonl", _sentences(5, "third"))
    with pytest.raises(PetatrainError, match=r"data is a symbolic link .*never writes or deletes through a link"):
        ingest([a, b, c], out, append=True)
    assert snapshot(tmp_path / "elsewhere") == elsewhere


def test_append_refuses_changed_settings_and_changed_sources(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", _sentences(5, "x"))
    ingest([a], tmp_path / "ds", dedup="exact")
    with pytest.raises(PetatrainError, match="dedup='exact'"):
        ingest([a], tmp_path / "ds", dedup="near", append=True)
    _jsonl(tmp_path / "a.jsonl", _sentences(6, "x"))
    with pytest.raises(PetatrainError, match="changed since it was ingested"):
        ingest([a], tmp_path / "ds", dedup="exact", append=True)


def test_a_crash_before_commit_leaves_the_dataset_as_it_was(tmp_path, monkeypatch):
    a = _jsonl(tmp_path / "a.jsonl", _sentences(20, "keep"))
    out = tmp_path / "ds"
    ingest([a], out)
    before = index.open_dataset(str(out))
    b = _jsonl(tmp_path / "b.jsonl", _sentences(20, "lost"))

    from petatrain.data import index as index_mod

    def crash(*args, **kwargs):
        raise RuntimeError("power cut")

    monkeypatch.setattr(index_mod, "write_manifest", crash)
    with pytest.raises(RuntimeError, match="power cut"):
        ingest([a, b], out, append=True)
    monkeypatch.undo()
    after = index.open_dataset(str(out))
    assert after.manifest == before.manifest
    assert read_dataset(out).column("text").to_pylist() == _sentences(20, "keep")
    retried = ingest([a, b], out, append=True)
    assert retried.files_new == 1
    assert read_dataset(out).column("text").to_pylist() == _sentences(20, "keep") + _sentences(20, "lost")


def test_byte_tokens_packed_into_fixed_width_rows(tmp_path):
    texts = _sentences(50, "tok")
    a = _jsonl(tmp_path / "a.jsonl", texts)
    summary = ingest([a], tmp_path / "ds", tokenizer="bytes", pack_length=64)
    ds = index.open_dataset(str(tmp_path / "ds"))
    meta = ds.manifest.tokenizer
    table = read_dataset(tmp_path / "ds")
    assert table.schema.field("tokens").type == pa.binary(64 * 2)
    stream = np.frombuffer(b"".join(table.column("tokens").to_pylist()), dtype=meta.dtype)
    assert len(stream) == 64 * table.num_rows == summary.tokens + len(texts) - summary.tokens_left_over
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "ds" / meta.path))
    docs = tok.decode(stream.tolist(), skip_special_tokens=False).split("<|endoftext|>")
    assert docs[: len(docs) - 1] == texts[: len(docs) - 1]


def test_trained_bpe_tokens_per_document(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", _sentences(200, "bpe"))
    ingest([a], tmp_path / "ds", tokenizer="train:400")
    ds = index.open_dataset(str(tmp_path / "ds"))
    assert ds.manifest.tokenizer.vocab_size <= 400
    table = read_dataset(tmp_path / "ds")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "ds" / "_index" / "tokenizer.json"))
    row = table.slice(3, 1).to_pylist()[0]
    ids = np.frombuffer(row["tokens"], dtype=ds.manifest.tokenizer.dtype)
    assert len(ids) == row["num_tokens"] and tok.decode(ids.tolist()) == row["text"]
    assert np.mean(table.column("num_tokens").to_numpy()) < np.mean([len(t) for t in table.column("text").to_pylist()])


def test_register_indexes_parquet_in_place(tmp_path):
    folder = tmp_path / "spark"
    folder.mkdir()
    for i in range(3):
        pq.write_table(pa.table({"text": _sentences(4, f"reg{i}")}), folder / f"part-{i:05d}.parquet")
    (folder / "_SUCCESS").write_text("")
    summary = ingest([str(folder)], tmp_path / "ds", register=True)
    assert summary.shards == 3 and summary.rows_out == 12
    ds = index.open_dataset(str(tmp_path / "ds"))
    assert ds.shards.column("path").to_pylist()[0] == str(folder / "part-00000.parquet")
    assert read_dataset(tmp_path / "ds").num_rows == 12
    assert not (tmp_path / "ds" / "data").exists(), "registered files are not copied"


def test_inspect_verify_names_a_flipped_byte(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", _sentences(300, "verify"))
    ingest([a], tmp_path / "ds", shard_size="10KB")
    ok = run_cli("inspect", str(tmp_path / "ds"), "--verify", "--json")
    assert ok.returncode == 0, ok.stderr
    report = json.loads(ok.stdout)
    assert report["verified"] is True and report["shards"] > 2 and report["rows"] == 300
    victim = sorted((tmp_path / "ds" / "data").iterdir())[1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    bad = run_cli("inspect", str(tmp_path / "ds"), "--verify")
    assert bad.returncode == 1
    assert f"corrupt: {victim}" in bad.stderr and "1 of" in bad.stderr


@pytest.mark.slow  # end to end: the same ingest on Ray twice
def test_same_output_with_one_and_with_several_workers(corpus, tmp_path, ray_local):
    """The CLI on a Ray of one CPU, and the same job on the suite's Ray of two (one Ray start, not two)."""
    one = run_cli(
        "ingest", *corpus.files, "--out", str(tmp_path / "ds1"), "--local-cpus", "1", "--shard-size", "200KB", "--json"
    )
    assert one.returncode == 0, one.stderr[-2000:]
    assert ray_local.cluster_resources()["CPU"] == 2
    ingest(corpus.files, tmp_path / "ds2", shard_size="200KB")
    outs = [index.open_dataset(str(tmp_path / name)) for name in ("ds1", "ds2")]
    assert outs[0].shards.to_pylist() == outs[1].shards.to_pylist()
    assert outs[0].num_rows == outs[1].num_rows > 0


def test_corrupt_files_are_quarantined_whole_and_the_rest_goes_on(tmp_path):
    good = _jsonl(tmp_path / "good.jsonl", _sentences(5, "ok"))
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not parquet PAR1")
    (tmp_path / "broken.jsonl.gz").write_bytes(b"\x1f\x8b not really gzip")
    (tmp_path / "rows.csv").write_text('id,text\n1,"fine row"\n2,"too",many,fields\n3,"another fine row"\n')
    summary = ingest(
        [good, str(tmp_path / "broken.parquet"), str(tmp_path / "broken.jsonl.gz"), str(tmp_path / "rows.csv")],
        tmp_path / "ds",
        dedup="exact",
    )
    assert summary.rejected == {"unreadable_file": 2, "malformed_csv_row": 1}
    texts = read_dataset(tmp_path / "ds").column("text").to_pylist()
    assert texts == [*_sentences(5, "ok"), "fine row", "another fine row"]
    details = {r["source"].rsplit("/", 1)[1]: r["detail"] for r in rejects(tmp_path / "ds").to_pylist()}
    assert "ParquetFile" in details["broken.parquet"] or "Parquet" in details["broken.parquet"], details


def test_webdataset_json_members_and_text_field(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i, member in enumerate([{"caption": "a red bicycle"}, {"other": 1}, {"caption": "two cats"}]):
            for ext, data in (("json", json.dumps(member).encode()), ("jpg", b"\xff\xd8fakejpeg")):
                info = tarfile.TarInfo(f"shard/{i:04d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    (tmp_path / "images.tar").write_bytes(buf.getvalue())
    summary = ingest([str(tmp_path / "images.tar")], tmp_path / "ds", text_field="caption", dedup="exact")
    assert read_dataset(tmp_path / "ds").column("text").to_pylist() == ["a red bicycle", "two cats"]
    assert summary.rejected == {"missing_field": 1}


def test_append_to_a_tokenised_dataset_reuses_its_tokenizer(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", _sentences(100, "tok-a"))
    ingest([a], tmp_path / "ds", tokenizer="train:350", pack_length=32)
    before = (tmp_path / "ds" / "_index" / "tokenizer.json").read_bytes()
    b = _jsonl(tmp_path / "b.jsonl", _sentences(100, "tok-b"))
    summary = ingest([a, b], tmp_path / "ds", tokenizer="train:350", pack_length=32, append=True)
    assert summary.rows_out > 0
    assert (tmp_path / "ds" / "_index" / "tokenizer.json").read_bytes() == before


def test_inspect_of_something_that_is_not_a_dataset(tmp_path):
    result = run_cli("inspect", str(tmp_path))
    assert result.returncode == 2
    assert f"no dataset at {tmp_path}" in result.stderr and "Traceback" not in result.stderr


def test_byte_tokenizer_fast_path_matches_the_tokenizer():
    from petatrain.data.ingest import tokenize as tk

    tok = tk.byte_level()
    texts = ["héllo wörld ✓\n\t" * 20, "plain ascii", "", "日本語のテキスト"]
    table = tk.byte_table(tok)
    assert table is not None
    fast, slow = tk.encode(tok, texts, table), tk.encode(tok, texts)
    assert all(np.array_equal(a, b) for a, b in zip(fast, slow, strict=True))
    assert tk.byte_table(tk.train_bpe(["hello world"] * 50, 300)) is None


def test_a_stage_says_how_far_it_is_while_it_runs(tmp_path):
    """Each file (or piece) read and each shard written is a progress event with the rows and bytes
    so far; the console makes a line of them every 10 s in a log (a bar on a terminal), with an ETA."""
    from petatrain import api
    from petatrain.console import IngestProgress
    from petatrain.data import synth
    from petatrain.data.ingest.job import StageProgress

    corpus = synth.generate(str(tmp_path / "corpus"), documents=300, files=3, bad_records=False)
    seen: list[tuple[str, StageProgress]] = []
    summary = api.ingest(corpus.files, str(tmp_path / "ds"), on_progress=lambda stage, p: seen.append((stage, p)))
    read = [p for stage, p in seen if stage == "read_clean_sign"]
    assert [p.items for p in read] == [1, 2, 3] and read[-1].items_total == 3
    assert read[-1].bytes == read[-1].bytes_total == sum(os.path.getsize(f) for f in corpus.files)
    assert read[-1].rows == summary.rows_in and read[-1].eta_s == 0.0
    written = [p for stage, p in seen if stage == "write"]
    assert written and written[-1].items == written[-1].items_total and written[-1].rows == summary.rows_out

    lines: list[str] = []
    now = [0.0]
    console = IngestProgress(lines.append, terminal=False, clock=lambda: now[0])
    console("read_clean_sign", "start")
    half = StageProgress(items=5, items_total=10, rows=1200, bytes=2_000_000_000, bytes_total=4_000_000_000,
                         elapsed_s=80.0)  # fmt: skip
    now[0] = 4.0
    console.progress("read_clean_sign", half)  # quiet: not 10 s yet
    now[0] = 11.0
    console.progress("read_clean_sign", half)
    console.progress("read_clean_sign", half)  # quiet again until the next 10 s
    now[0] = 90.0
    console("read_clean_sign", "done")
    assert lines == [
        "ingest: reading, cleaning, signing: 5/10, 2.0 GB of 4.0 GB, 1,200 rows, about 1m20s left",
        "ingest: read, cleaned and signed (90.0 s)",
    ]
