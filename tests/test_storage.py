import errno
import os

import pytest

from petatrain import storage
from petatrain.errors import PetatrainError
from petatrain.storage import retry


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def base(request, tmp_path):
    if request.param == "local":
        return str(tmp_path)
    return request.getfixturevalue("s3_bucket")


def test_atomic_write_then_verified_read(base):
    url = storage.join(base, "a/b/file.bin")
    payload = os.urandom(3 << 20)
    checksum, size = storage.atomic_write(url, payload)
    assert size == len(payload) and checksum.startswith("xxh3-128:")
    assert storage.read_verified(url, checksum) == payload
    # Only the final name is there: no temporary sibling survives a successful write.
    assert storage.listdir(storage.join(base, "a/b")) == [url]


def test_read_detects_a_flipped_byte(base):
    url = storage.join(base, "f.bin")
    checksum, _ = storage.atomic_write(url, b"x" * 1000)
    storage.atomic_write(url, b"x" * 999 + b"y")
    with pytest.raises(storage.ChecksumMismatch, match="does not match recorded"):
        storage.read_verified(url, checksum)


def test_overwrite_replaces_whole_file(base):
    url = storage.join(base, "g.bin")
    storage.atomic_write(url, b"old" * 10_000)
    storage.atomic_write(url, b"new")
    assert storage.read_bytes(url) == b"new"


def test_expand_sources_globs_folders_and_errors(base):
    for name in ("x/1.jsonl", "x/2.jsonl", "x/sub/3.jsonl", "x/_hidden.jsonl"):
        storage.atomic_write(storage.join(base, name), b"{}\n")
    folder = [s.url for s in storage.expand_sources([storage.join(base, "x")])]
    assert [u.rsplit("x/", 1)[1] for u in folder] == ["1.jsonl", "2.jsonl", "sub/3.jsonl"]
    globbed = storage.expand_sources([storage.join(base, "x/*.jsonl")])
    assert len(globbed) == 2 and all(s.size == 3 for s in globbed)
    with pytest.raises(PetatrainError, match="source not found"):
        storage.expand_sources([storage.join(base, "missing.jsonl")])
    with pytest.raises(PetatrainError, match="matched no files"):
        storage.expand_sources([storage.join(base, "x/*.csv")])


def test_local_write_failure_leaves_previous_file_intact(tmp_path, monkeypatch):
    url = str(tmp_path / "keep.bin")
    storage.atomic_write(url, b"committed")

    def broken_replace(src, dst):
        raise OSError(errno.EIO, "disk on fire")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk on fire"):
        storage.atomic_write(url, b"half-written")
    monkeypatch.undo()
    assert storage.read_bytes(url) == b"committed"
    assert os.listdir(tmp_path) == ["keep.bin"]


def test_retries_transient_errors_and_gives_up_on_others():
    calls = []
    sleeps = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError(errno.ECONNRESET, "reset by peer")
        return "ok"

    assert retry.retrying("op", flaky, sleep=sleeps.append) == "ok"
    assert len(calls) == 3 and len(sleeps) == 2 and sleeps[1] > 0

    def missing():
        calls.append(1)
        raise FileNotFoundError("nope")

    calls.clear()
    with pytest.raises(FileNotFoundError):
        retry.retrying("op", missing, sleep=sleeps.append)
    assert len(calls) == 1  # not transient: no retry

    class SlowDown(Exception):
        def __init__(self):
            super().__init__("slow down")
            self.response = {"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}}

    def throttled():
        calls.append(1)
        raise SlowDown()

    calls.clear()
    with pytest.raises(SlowDown):
        retry.retrying("op", throttled, attempts=4, sleep=lambda s: None)
    assert len(calls) == 4  # bounded


def test_unknown_scheme_is_a_clear_error():
    with pytest.raises(PetatrainError, match="no filesystem for 'nosuchproto://'"):
        storage.resolve("nosuchproto://bucket/key")
