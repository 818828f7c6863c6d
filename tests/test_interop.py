"""A dataset read by the tools a data team uses beside petatrain: Hugging Face `datasets`
(through the dataset card), DuckDB and Spark (through `DATASET/data/`)."""

import json
import os
import shutil
import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from helpers import ingest, read_dataset

pytestmark = pytest.mark.usefixtures("ray_local")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A deduplicated, tokenised dataset with source fields, rejects and the index beside its shards:
    the Parquet files a reader of the root must not take."""
    root = tmp_path_factory.mktemp("interop")
    lines = [json.dumps({"text": f"document {i} on topic {i * 31}", "lang": "en", "id": f"u{i}"}) for i in range(6)]
    lines += [lines[0], "{not json"]  # an exact duplicate and a reject
    (root / "a.jsonl").write_text("\n".join(lines) + "\n")
    out = root / "ds"
    ingest([str(root / "a.jsonl")], out, dedup="exact", tokenizer="bytes")
    return out


def test_the_dataset_card_names_the_shards_and_says_what_the_dataset_holds(dataset):
    card = (dataset / "README.md").read_text()
    header = yaml.safe_load(card.split("---")[1])
    assert header["configs"][0]["data_files"] == [{"split": "train", "path": ["data/*.parquet"]}]
    for expected in ("`lang`", "`doc_id`", "records read: 8", "exact duplicates dropped: 1", "malformed_json: 1"):
        assert expected in card
    assert "1 source files in 1 batches" in card and "`bytes`: 257 ids stored as little-endian `uint16`" in card


def test_hugging_face_load_dataset_of_the_root_reads_the_shards(dataset, tmp_path, monkeypatch):
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = datasets.load_dataset(str(dataset), cache_dir=str(tmp_path / "hf-cache"))["train"]
    ours = read_dataset(dataset)
    assert loaded.num_rows == ours.num_rows == 6
    assert sorted(loaded["id"]) == sorted(ours.column("id").to_pylist())
    assert set(loaded.column_names) == set(ours.column_names)


def test_duckdb_reads_the_shards_and_selects_on_source_fields(dataset):
    import duckdb

    rows = duckdb.sql(
        f"SELECT id, lang, doc_id FROM read_parquet('{dataset}/data/*.parquet') WHERE id IN ('u1', 'u4') ORDER BY id"
    ).fetchall()
    assert rows == [("u1", "en", 1), ("u4", "en", 4)]


def _java() -> str | None:
    """Debian's Java for Spark, installed if it is missing (as the S3 tests install Ceph)."""
    if shutil.which("java"):
        return shutil.which("java")
    if shutil.which("apt-get") and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        apt = ["apt-get", "-o", "DPkg::Lock::Timeout=600"]  # another install may hold dpkg's lock: wait
        subprocess.run([*apt, "update", "-qq"], env=env, capture_output=True)
        subprocess.run(
            [*apt, "install", "-y", "-qq", "--no-install-recommends", "openjdk-17-jre-headless"],
            env=env,
            capture_output=True,
        )
    return shutil.which("java")


@pytest.mark.slow
def test_spark_reads_data_and_its_partitioned_output_registers_with_the_partition_column(dataset, tmp_path):
    """Spark reads DATASET/data/, and what it writes with partitionBy registers with its partition column."""
    from helpers import missing

    if _java() is None:
        missing("no Java runtime (Debian's openjdk-17-jre-headless) and it could not be installed")
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[1]")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "1")
        .getOrCreate()
    )
    try:
        frame = spark.read.parquet(f"{dataset}/data/")
        assert frame.count() == 6 and {"doc_id", "text", "id", "lang"} <= set(frame.columns)
        out = tmp_path / "spark-out"
        frame.select("text", "id", "lang").write.partitionBy("lang").parquet(str(out))
    finally:
        spark.stop()
    ingest([str(out)], tmp_path / "registered", register=True)
    table = read_dataset(tmp_path / "registered")
    assert table.num_rows == 6 and "lang" not in table.column_names  # in the folder names only ...
    from petatrain.data.loading.stream import StreamingDataset

    got = list(StreamingDataset(str(tmp_path / "registered"), columns=["id", "lang"]))
    assert sorted((s["id"], s["lang"]) for s in got) == [(f"u{i}", "en") for i in range(6)]  # ... and recovered


def test_a_registered_datasets_card_names_its_files_for_hugging_face(tmp_path, monkeypatch):
    import datasets

    spark = tmp_path / "spark"
    spark.mkdir()
    pq.write_table(pa.table({"text": ["one", "two"]}), spark / "part-0.parquet")
    ingest([str(spark)], tmp_path / "reg", register=True)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = datasets.load_dataset(str(tmp_path / "reg"), cache_dir=str(tmp_path / "hf-cache"))["train"]
    assert sorted(loaded["text"]) == ["one", "two"]
