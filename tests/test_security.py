"""Encryption at rest and signatures: keyrings, sealed files, encrypted and signed checkpoints and
final weights. Every bad key, loose key file, tampered chunk or swapped file is one line, and
nothing is loaded from it."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from helpers import tiny, train, write_checkpoint
from petatrain.errors import CorruptDataError, PetatrainError
from petatrain.security import keys, sealed
from petatrain.security.protection import Protection
from petatrain.storage import StorageOptions


@pytest.fixture(scope="module")
def ring(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("keys") / "ring.json"
    keys.create_keyring(str(path))
    return f"file:{path}"


@pytest.fixture(scope="module")
def other_ring(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("keys-other") / "ring.json"
    keys.create_keyring(str(path))
    return f"file:{path}"


def encrypted(keyref: str, *, verify: bool = False) -> StorageOptions:
    return StorageOptions(protection=Protection(encryption_key=keyref, signing_key=keyref, verify_signatures=verify))


# ---- keyrings -------------------------------------------------------------------------------------


def test_keys_create_writes_a_private_keyring_that_is_never_overwritten(tmp_path):
    path = tmp_path / "ring.json"
    made = run_cli("keys", "create", str(path), "--json")
    assert made.returncode == 0, made.stderr
    info = json.loads(made.stdout)
    assert info["keyref"] == f"file:{path}" and info["primary"] == 1 and info["key_id"].startswith("ed25519:")
    assert path.stat().st_mode & 0o777 == 0o600
    record = json.loads(path.read_text())
    assert not any(secret in made.stdout + made.stderr for secret in record["master"].values())
    before = path.read_bytes()
    again = run_cli("keys", "create", str(path))
    assert again.returncode != 0 and again.stderr.count("\n") == 1 and "never overwritten" in again.stderr
    assert path.read_bytes() == before


@pytest.mark.parametrize("mode", [0o640, 0o604])
def test_a_keyring_others_may_read_is_refused_naming_the_fix(tmp_path, mode):
    path = tmp_path / "ring.json"
    keys.create_keyring(str(path))
    path.chmod(mode)
    with pytest.raises(keys.KeyringError, match=r"may be read by group or others .*chmod 600"):
        keys.open_keys(f"file:{path}")


@pytest.mark.parametrize(
    "keyref, message",
    [
        ("file:/nonexistent/ring.json", "does not exist"),
        ("vault://127.0.0.1/transit/x", "no KMS client for 'vault:'"),
        ("ring.json", "is not file:PATH or a KMS URL"),
    ],
)
def test_bad_key_references_are_one_line_config_errors(tmp_path, keyref, message):
    from petatrain import config

    if "nonexistent" in keyref:
        with pytest.raises(keys.KeyringError, match=message):
            keys.open_keys(keyref)
        return
    with pytest.raises(PetatrainError, match=message):
        config.load(None, [f"storage.encryption.key={keyref}"])


def test_a_public_key_verifies_but_cannot_sign_or_decrypt(tmp_path, ring):
    ring_keys = keys.open_keys(ring)
    out = tmp_path / "pub.json"
    keys.export_public(ring, str(out))
    public = keys.open_keys(f"file:{out}")
    signature = ring_keys.sign(b"record")
    assert public.key_id == ring_keys.key_id and public.verify(b"record", signature)
    assert not public.verify(b"record!", signature)
    assert not public.can_sign
    wrapped = ring_keys.wrap(b"k" * 32, "ctx")
    with pytest.raises(keys.KeyringError, match="only a verification key"):
        public.unwrap(wrapped, "ctx")


def test_wrapped_keys_are_bound_to_their_context_and_keyring(ring, other_ring):
    mine, theirs = keys.open_keys(ring), keys.open_keys(other_ring)
    wrapped = mine.wrap(b"k" * 32, "run a/step 1/rank 0")
    assert mine.unwrap(wrapped, "run a/step 1/rank 0") == b"k" * 32
    with pytest.raises(keys.KeyringError, match="does not unwrap"):
        mine.unwrap(wrapped, "run a/step 2/rank 0")
    with pytest.raises(keys.KeyringError, match="does not unwrap"):
        theirs.unwrap(wrapped, "run a/step 1/rank 0")


def test_under_umask_000_the_keys_folders_are_private_and_the_public_key_is_not_writable_by_others(tmp_path, ring):
    """Attack round 3 LOW (issue 35): under `umask 000` the folders `keys create` made were 0777 (anyone
    could swap the keyring's file in them) and `keys public` wrote 0666."""
    import os

    old = os.umask(0)
    try:
        path = tmp_path / "deep" / "er" / "ring.json"
        keys.create_keyring(str(path))
        out = tmp_path / "pub.json"
        keys.export_public(ring, str(out))
    finally:
        os.umask(old)
    assert [(p.stat().st_mode & 0o777) for p in (path.parent.parent, path.parent, path)] == [0o700, 0o700, 0o600]
    assert out.stat().st_mode & 0o777 == 0o644
    with pytest.raises(keys.KeyringError, match="exists; choose another path"):
        keys.export_public(ring, str(out))


# ---- sealed files ---------------------------------------------------------------------------------


def test_sealed_files_detect_changed_cut_reordered_and_swapped_chunks():
    key = os.urandom(32)
    data = os.urandom(100)
    blob = sealed.seal_bytes(data, key, "file a", chunk=16)
    assert len(blob) == sealed.sealed_size(100, 16) and data not in blob
    assert sealed.open_bytes(blob, key, "file a") == data
    chunk = 16 + sealed.TAG
    body = blob[sealed.HEADER :]
    flipped = bytearray(blob)
    flipped[40] ^= 1
    cases = {
        "changed": bytes(flipped),
        "cut at a chunk boundary": blob[: sealed.HEADER + 3 * chunk + 16 + sealed.TAG],
        "chunks swapped": blob[: sealed.HEADER] + body[chunk : 2 * chunk] + body[:chunk] + body[2 * chunk :],
        "extended": blob + body[:chunk],
    }
    for what, bad in cases.items():
        with pytest.raises(ValueError):
            sealed.open_bytes(bad, key, "file a")
            pytest.fail(what)
    with pytest.raises(ValueError, match="does not authenticate"):
        sealed.open_bytes(blob, key, "file b")  # the same bytes presented as another file
    with pytest.raises(ValueError, match="does not authenticate"):
        sealed.open_bytes(blob, os.urandom(32), "file a")
    assert sealed.open_bytes(sealed.seal_bytes(b"", key, "empty"), key, "empty") == b""


# ---- checkpoints and final weights ------------------------------------------------------------------


def _checkpoint(run: str, step: int, options: StorageOptions, tensors: dict[str, torch.Tensor]) -> None:
    write_checkpoint(run, step, tensors, options=options, world_size=2)


def _load(run: str, step: int, options: StorageOptions) -> dict[str, torch.Tensor]:
    from petatrain.train.checkpoint import read_rank_tensors, verify_checkpoint

    return read_rank_tensors(run, verify_checkpoint(run, step, options), 0, options)


def test_an_encrypted_checkpoint_holds_no_plaintext_and_reads_back_only_with_its_keyring(tmp_path, ring, other_ring):
    from petatrain.train import run_dir

    run = str(tmp_path / "run")
    run_dir.claim(run)
    marker = bytes(range(256)) * 64  # recognisable plaintext
    tensors = {"model/w": torch.frombuffer(bytearray(marker), dtype=torch.uint8), "model/b": torch.arange(7.0)}
    _checkpoint(run, 10, encrypted(ring), tensors)
    stored = (tmp_path / "run/checkpoints/step-00000010/rank-00000.safetensors").read_bytes()
    assert stored.startswith(sealed.MAGIC) and marker[:64] not in stored
    loaded = _load(run, 10, encrypted(ring))
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    with pytest.raises(PetatrainError, match=r"is encrypted; set storage\.encryption\.key") as missing:
        _load(run, 10, StorageOptions())
    # Another keyring verifies signatures too: the checkpoint is refused as not signed by it.
    another = rf"is signed by key ed25519:\w+, not by .*{re.escape(other_ring)}"
    with pytest.raises(PetatrainError, match=another) as wrong:
        _load(run, 10, encrypted(other_ring))
    for exc in (missing, wrong):
        assert "\n" not in str(exc.value)


def test_another_runs_encrypted_checkpoint_copied_in_as_the_newest_is_skipped_not_fatal(tmp_path):
    """Attack round 3 MED (issue 35): a checkpoint of another run under the same keyring, copied in as
    the newest, stopped `train --resume` and `serve --checkpoint latest` (its data keys do not unwrap
    for this run) instead of being skipped like a corrupt one; its COMMITTED names the run its keys are
    bound to, signed with the rest, and a keys rotation keeps it."""
    import shutil

    from petatrain.api import rotate_keys
    from petatrain.train import run_dir
    from petatrain.train.checkpoint import latest_verified, read_rank_tensors

    ring = f"file:{tmp_path / 'ring.json'}"  # its own: the rotation below adds a version
    keys.create_keyring(ring.removeprefix("file:"))
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    options = encrypted(ring)
    for run, value in ((ours, 1.0), (theirs, 2.0)):
        run_dir.claim(run)
        _checkpoint(run, 10 if run == ours else 20, options, {"model/w": torch.full((8, 8), value)})
    shutil.copytree(Path(theirs) / "checkpoints" / "step-00000020", Path(ours) / "checkpoints" / "step-00000020")
    skipped: list[tuple[str, str]] = []
    state = latest_verified(ours, options, on_skip=lambda where, why: skipped.append((where, why)))
    assert state is not None and state.step == 10
    assert float(read_rank_tensors(ours, state, 0, options)["model/w"][0, 0]) == 1.0
    ((where, why),) = skipped
    assert where.endswith("step-00000020") and "bound to run" in why and "not this run" in why
    # A rotation re-wraps the run's own keys and keeps what they are bound to.
    shutil.rmtree(Path(ours) / "checkpoints" / "step-00000020")
    rotate_keys(ring, [ours])
    state = latest_verified(ours, options)
    assert state is not None and state.step == 10
    assert float(read_rank_tensors(ours, state, 0, options)["model/w"][0, 0]) == 1.0


def test_a_tampered_or_swapped_encrypted_checkpoint_file_is_refused(tmp_path, ring):
    from petatrain.train import run_dir
    from petatrain.train.checkpoint import latest_verified

    run = str(tmp_path / "run")
    run_dir.claim(run)
    options = encrypted(ring)
    for step in (10, 20):
        _checkpoint(run, step, options, {"model/w": torch.full((64, 64), float(step))})
    folder = Path(run) / "checkpoints"
    a, b = folder / "step-00000010/rank-00000.safetensors", folder / "step-00000020/rank-00000.safetensors"
    original = b.read_bytes()
    b.write_bytes(a.read_bytes())  # same size: another step's file (its data key is step 10's)
    with pytest.raises(CorruptDataError, match="does not authenticate"):
        _load(run, 20, options)
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x01
    b.write_bytes(bytes(flipped))
    with pytest.raises(CorruptDataError, match="step-00000020 does not verify"):
        _load(run, 20, options)
    b.write_bytes(original)
    assert latest_verified(run, options).step == 20 and torch.equal(
        _load(run, 20, options)["model/w"], torch.full((64, 64), 20.0)
    )


def test_a_checkpoint_rewritten_with_matching_checksums_is_refused_when_signed(tmp_path, ring):
    """The forger rewrites a rank file and updates every checksum that covers it (state.json's
    entry, COMMITTED's checksum of state.json): only the signature catches it."""
    from petatrain.storage.checksum import checksum_bytes
    from petatrain.train.checkpoint import latest_verified

    run = str(tmp_path / "run")
    options = StorageOptions(protection=Protection(signing_key=ring))  # signed, not encrypted
    _checkpoint(run, 10, options, {"model/w": torch.zeros(16)})
    folder = Path(run) / "checkpoints/step-00000010"
    forged_dir = tmp_path / "forged"
    _checkpoint(str(forged_dir), 10, StorageOptions(), {"model/w": torch.ones(16)})
    forged = (forged_dir / "checkpoints/step-00000010/rank-00000.safetensors").read_bytes()
    (folder / "rank-00000.safetensors").write_bytes(forged)
    state = json.loads((folder / "state.json").read_text())
    state["files"]["rank-00000.safetensors"].update(bytes=len(forged), checksum=checksum_bytes(forged))
    raw = json.dumps(state).encode()
    (folder / "state.json").write_bytes(raw)
    committed = json.loads((folder / "COMMITTED").read_text())
    committed["state_checksum"] = checksum_bytes(raw)
    (folder / "COMMITTED").write_text(json.dumps(committed))
    with pytest.raises(CorruptDataError, match="signature does not verify"):
        latest_verified(run, options, on_skip=lambda url, why: (_ for _ in ()).throw(CorruptDataError(why)))
    assert latest_verified(run, StorageOptions()) is not None, "without a key the checksums alone are fooled"
    # The forger simply drops the signature: a reader holding the key refuses it all the same.
    del committed["signature"]
    (folder / "COMMITTED").write_text(json.dumps(committed))
    strict = StorageOptions(protection=Protection(signing_key=ring, verify_signatures=True))
    for reader in (options, strict):
        with pytest.raises(CorruptDataError, match="is not signed"):
            latest_verified(run, reader, on_skip=lambda url, why: (_ for _ in ()).throw(CorruptDataError(why)))


@pytest.mark.slow
def test_an_encrypted_signed_run_recovers_from_a_kill_with_the_plain_runs_weights(
    token_dataset, baseline, tmp_path, ring
):
    """On Ray: every checkpoint and the final weights sealed and signed, a killed worker resumed from
    an encrypted checkpoint, and the weights bit-identical to the unencrypted uninterrupted run's.
    No file the run writes holds key material."""
    from petatrain.train.checkpoint import read_final

    # The shared token dataset is unsigned: a run holding a key reads it only when told that nobody signed it.
    cfg = tiny(token_dataset, f"storage.encryption.key={ring}", f"storage.signing.unsigned=[{token_dataset}]")
    run = tmp_path / "run"
    summary = train(cfg, run, "kill@step=17,rank=1")
    assert summary["attempts"] == 2
    weights = (run / "final/model.safetensors").read_bytes()
    assert weights.startswith(sealed.MAGIC)
    tensors, record = read_final(str(run), cfg.storage.options())
    assert record["signature"]["key_id"] == keys.open_keys(ring).key_id
    plain, _ = read_final(str(baseline))
    assert tensors.keys() == plain.keys() and all(torch.equal(tensors[k], plain[k]) for k in plain)
    with pytest.raises(PetatrainError, match=r"is encrypted; set storage\.encryption\.key"):
        read_final(str(run))
    secrets = list(json.loads(Path(ring.removeprefix("file:")).read_text())["master"].values())
    secrets.append(json.loads(Path(ring.removeprefix("file:")).read_text())["signing"]["private"])
    for path in run.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert not any(s.encode() in data for s in secrets), path
    assert f"key: {ring}" in (run / "config.yaml").read_text()  # the reference, which readers use
    from petatrain.train import weights

    served_options = weights.run_options(str(run), None)  # serve takes the run's keyring from its config
    for checkpoint in ("final", "latest"):
        served = weights.load(str(run), checkpoint, served_options)
        assert all(torch.equal(served.weights[k], plain[k]) for k in plain)


# ---- datasets: Parquet modular encryption ----------------------------------------------------------


@pytest.fixture(scope="module")
def encrypted_tokens(tmp_path_factory, ring, ray_local):
    """The same corpus ingested twice: plaintext and encrypted."""
    from petatrain import config
    from petatrain.data import synth
    from petatrain.data.ingest import IngestJob, run

    root = tmp_path_factory.mktemp("enc-tokens")
    synth.generate(str(root / "corpus"), documents=300, files=2)
    cfg = config.IngestConfig(tokenizer="bytes", pack_length=65, shard_size="60KB", dedup="exact")
    for name, options in (("plain", StorageOptions()), ("enc", encrypted(ring))):
        run(IngestJob(sources=[str(root / "corpus")], out=str(root / name), config=cfg, options=options))
    return root


def test_encrypted_shards_stream_the_same_samples_and_hold_no_plaintext(encrypted_tokens, ring):
    import pyarrow.parquet as pq

    from petatrain.data.index import read_manifest
    from petatrain.data.loading.stream import StreamingDataset

    plain, enc = encrypted_tokens / "plain", encrypted_tokens / "enc"
    manifest = read_manifest(str(enc))
    assert manifest.encryption is not None and set(manifest.encryption["keys"]) == {"k1"}
    shards = sorted((enc / "data").glob("*.parquet"))
    assert len(shards) > 1
    rows = pq.ParquetFile(plain / "data" / shards[0].name).read().column("tokens")[0].as_py()
    for shard in shards:
        data = shard.read_bytes()
        assert data[-4:] == b"PARE", "encrypted footer (Parquet modular encryption's magic)"
        assert rows[:32] not in data
    for staged_text in (enc / "_rejects").rglob("records-*.parquet"):
        assert staged_text.read_bytes()[-4:] == b"PARE", "rejects hold source text: encrypted too"
    with pytest.raises(OSError):
        pq.ParquetFile(shards[0]).read()  # any reader without the key
    read = {}
    for name, options in (("plain", StorageOptions()), ("enc", encrypted(ring))):
        ds = StreamingDataset(str(encrypted_tokens / name), batch_size=16, seed=3, options=options)
        read[name] = torch.cat([b["tokens"] for b in ds.iter_batches()])
    assert torch.equal(read["plain"], read["enc"])
    from petatrain.data.inspect import describe

    shown = describe(str(enc), options=encrypted(ring), verify=True)
    assert shown["verified"] and shown["encryption"]["keys"]["k1"]["shards"] == len(shards)
    assert shown["signature"] == {"key_id": keys.open_keys(ring).key_id, "verified": True}


def test_an_encrypted_dataset_without_or_with_the_wrong_key_is_one_line_and_nothing_is_read(
    encrypted_tokens, other_ring, tmp_path
):
    from petatrain.data.loading.stream import StreamingDataset

    enc = str(encrypted_tokens / "enc")
    with pytest.raises(PetatrainError, match=r"is encrypted; set storage\.encryption\.key") as missing:
        StreamingDataset(enc)
    # Another keyring is refused at the manifest: it is not the key the dataset was signed with.
    another = rf"manifest.json is signed by key ed25519:\w+, not by .*{re.escape(other_ring)}"
    with pytest.raises(PetatrainError, match=another) as wrong:
        StreamingDataset(enc, options=encrypted(other_ring))
    for exc in (missing, wrong):
        assert "\n" not in str(exc.value)
    result = run_cli("inspect", enc, "--verify", "--set", f"storage.encryption.key={other_ring}")
    assert result.returncode != 0 and "is signed by key" in result.stderr and result.stderr.count("\n") == 1


def test_a_replaced_encrypted_shard_with_a_matching_checksum_is_refused(encrypted_tokens, ring, tmp_path):
    """Someone without the key swaps in another dataset's encrypted shard and fixes its checksum and
    size in the index: the shard's footer does not decrypt with this dataset's key."""
    import pyarrow as pa

    from petatrain.data import index as idx
    from petatrain.data.loading.stream import StreamingDataset
    from petatrain.storage.checksum import checksum_bytes

    copy = tmp_path / "enc"
    shutil.copytree(encrypted_tokens / "enc", copy)
    other = tmp_path / "other"
    from petatrain import config
    from petatrain.data.ingest import IngestJob, run

    cfg = config.IngestConfig(tokenizer="bytes", pack_length=65, shard_size="60KB", dedup="exact")
    run(IngestJob(sources=[str(encrypted_tokens / "corpus")], out=str(other), config=cfg, options=encrypted(ring)))
    foreign = (other / "data/part-000000.parquet").read_bytes()
    (copy / "data/part-000000.parquet").write_bytes(foreign)
    manifest = idx.read_manifest(str(copy))
    table = idx.read_shard_index(str(copy), manifest)
    checksums = table.column("checksum").to_pylist()
    sizes = table.column("bytes").to_pylist()
    checksums[0], sizes[0] = checksum_bytes(foreign), len(foreign)
    table = table.set_column(table.schema.get_field_index("checksum"), "checksum", pa.array(checksums))
    table = table.set_column(table.schema.get_field_index("bytes"), "bytes", pa.array(sizes, pa.int64()))
    manifest.index = idx.write_shard_index(str(copy), table)
    idx.write_manifest(str(copy), manifest)  # unsigned: the forger has no key
    with pytest.raises(CorruptDataError, match=r"manifest\.json is not signed, and this reader holds the key"):
        StreamingDataset(str(copy), batch_size=16, options=encrypted(ring), shuffle=False)
    # Even read as a dataset nobody signed, the foreign shard's footer does not decrypt with this key.
    strict_reader = encrypted(ring)
    lenient = dataclasses.replace(
        strict_reader, protection=dataclasses.replace(strict_reader.protection, unsigned_datasets=(str(copy),))
    )
    ds = StreamingDataset(str(copy), batch_size=16, options=lenient, shuffle=False)
    with pytest.raises(CorruptDataError, match="does not decrypt with"):
        list(ds.iter_batches())


def test_keys_rotate_rewraps_datasets_and_runs_without_rewriting_data(encrypted_tokens, tmp_path):
    """After `keys rotate --retire` only the new master key version exists, and the dataset and the
    run still read: their wrapped keys were re-wrapped, while every shard and sealed file kept its bytes."""
    import safetensors.torch

    from petatrain.data.loading.stream import StreamingDataset
    from petatrain.train import run_dir
    from petatrain.train.checkpoint import latest_verified, read_final, write_final

    keyring = tmp_path / "ring.json"
    keys.create_keyring(str(keyring))
    ref = f"file:{keyring}"
    options = encrypted(ref, verify=True)
    dataset = tmp_path / "ds"
    from petatrain import config
    from petatrain.data.ingest import IngestJob, run

    cfg = config.IngestConfig(tokenizer="bytes", pack_length=65, shard_size="60KB", dedup="none")
    run(IngestJob(sources=[str(encrypted_tokens / "corpus")], out=str(dataset), config=cfg, options=options))
    run_url = str(tmp_path / "run")
    run_dir.claim(run_url)
    _checkpoint(run_url, 10, options, {"model/w": torch.arange(10.0)})
    write_final(run_url, safetensors.torch.save({"w": torch.ones(3)}), 10, options)
    data_files = {p: p.read_bytes() for p in [*dataset.rglob("data/*.parquet"), *Path(run_url).rglob("*.safetensors")]}
    before = torch.cat(
        [b["tokens"] for b in StreamingDataset(str(dataset), batch_size=64, options=options).iter_batches()]
    )

    ring_before = keyring.read_bytes()
    refused = run_cli("keys", "rotate", ref, str(dataset), str(tmp_path / "not-a-run"))
    assert refused.returncode != 0 and "neither a petatrain dataset nor a run" in refused.stderr
    assert keyring.read_bytes() == ring_before, "a refused rotation changes nothing"
    result = run_cli("keys", "rotate", ref, str(dataset), run_url, "--retire", "--json")
    assert result.returncode == 0, result.stderr
    done = json.loads(result.stdout)
    assert done["key_version"] == 2 and done["retired"] == [1]
    assert keys.open_keys(ref).versions == [2]
    assert all(p.read_bytes() == data for p, data in data_files.items()), "no data file rewritten"
    after = torch.cat(
        [b["tokens"] for b in StreamingDataset(str(dataset), batch_size=64, options=options).iter_batches()]
    )
    assert torch.equal(before, after)
    state = latest_verified(run_url, options)
    assert state is not None and all(k["key_version"] == 2 for k in state.keys.values())
    assert torch.equal(_load(run_url, 10, options)["model/w"], torch.arange(10.0))
    assert read_final(run_url, options)[1]["encryption"]["key_version"] == 2
    # Attack round 3 MED (issue 35): retiring again with the run left out made it unreadable for good.
    # The keyring records what its rotations re-wrapped, and --retire must name all of it.
    ring_before = keyring.read_bytes()
    refused = run_cli("keys", "rotate", ref, str(dataset), "--retire")
    assert refused.returncode != 0 and f"--retire would leave {run_url} unreadable" in refused.stderr
    assert refused.stderr.count("\n") == 1 and keyring.read_bytes() == ring_before, "nothing was changed"
    again = run_cli("keys", "rotate", ref, str(dataset), run_url, "--retire")
    assert again.returncode == 0 and "can no longer be read" in again.stdout, again.stderr
    assert keys.open_keys(ref).versions == [3] and torch.equal(
        _load(run_url, 10, options)["model/w"], torch.arange(10.0)
    )


def test_a_signed_dataset_rewritten_with_matching_checksums_is_refused(encrypted_tokens, ring, tmp_path):
    """The forger rewrites a shard, then its checksum and size in the index, then the index's in the
    manifest: every xxh3 checksum matches, and only the manifest's signature (over the SHA-256 of the
    index, which holds every shard's) says no."""
    import pyarrow as pa

    from petatrain import config
    from petatrain.data import index as idx
    from petatrain.data.ingest import IngestJob, run
    from petatrain.data.loading.stream import StreamingDataset
    from petatrain.storage.checksum import checksum_bytes

    signer = StorageOptions(protection=Protection(signing_key=ring))
    strict = StorageOptions(protection=Protection(signing_key=ring, verify_signatures=True))
    out = tmp_path / "signed"
    cfg = config.IngestConfig(tokenizer="bytes", pack_length=65, shard_size="60KB", dedup="none")
    run(IngestJob(sources=[str(encrypted_tokens / "corpus")], out=str(out), config=cfg, options=signer))
    assert json.loads((out / "_index/manifest.json").read_text())["signature"]["key_id"] == keys.open_keys(ring).key_id
    assert len(list(StreamingDataset(str(out), batch_size=8, options=strict).iter_batches())) > 0

    shard = out / "data/part-000000.parquet"
    forged = shard.read_bytes().replace(b"\x41\x00", b"\x42\x00")  # other tokens, same size
    assert forged != shard.read_bytes()
    shard.write_bytes(forged)
    manifest = idx.read_manifest(str(out))
    table = idx.read_shard_index(str(out), manifest)
    checksums = table.column("checksum").to_pylist()
    checksums[0] = checksum_bytes(forged)
    table = table.set_column(table.schema.get_field_index("checksum"), "checksum", pa.array(checksums))
    manifest.index = idx.write_shard_index(str(out), table)  # unsigned: the forger has no key
    record = manifest.to_dict()
    record["signature"] = json.loads((out / "_index/manifest.json").read_text())["signature"]  # the old one
    (out / "_index/manifest.json").write_text(json.dumps(record))
    with pytest.raises(CorruptDataError, match="signature does not verify"):
        StreamingDataset(str(out), options=signer)
    result = run_cli("inspect", str(out), "--verify", "--set", f"storage.signing.key={ring}")
    assert result.returncode != 0 and "signature does not verify" in result.stderr
    assert len(list(StreamingDataset(str(out), batch_size=8).iter_batches())) > 0, "checksums alone are fooled"
    # Attack round 3: the forger strips the signature, or names another key in it. A reader holding
    # the key refuses both, with storage.signing.verify at its default, and so does inspect --verify.
    signature = record.pop("signature")
    (out / "_index/manifest.json").write_text(json.dumps(record))
    for options in (signer, strict):
        with pytest.raises(CorruptDataError, match="is not signed, and this reader holds the key"):
            StreamingDataset(str(out), options=options)
    result = run_cli("inspect", str(out), "--verify", "--set", f"storage.signing.key={ring}")
    assert result.returncode != 0 and "is not signed" in result.stderr and result.stderr.count("\n") == 1
    record["signature"] = {**signature, "key_id": "ed25519:0123456789abcdef"}
    (out / "_index/manifest.json").write_text(json.dumps(record))
    with pytest.raises(CorruptDataError, match="is signed by key ed25519:0123456789abcdef, not by"):
        StreamingDataset(str(out), options=signer)


# ---- Ray's TLS, on the two-node network-namespace cluster --------------------------------------------


def test_ray_tls_settings_are_all_or_nothing_and_the_key_must_be_private(tmp_path):
    from petatrain import config
    from petatrain.runtime.tls import TlsFiles, make_certificates

    with pytest.raises(PetatrainError, match=r"set resources\.tls\.cert, resources\.tls\.key too"):
        config.load(None, ["resources.tls.ca=/x/ca.pem"])
    files = make_certificates(str(tmp_path / "tls"), ["10.0.0.1"])
    assert Path(files.key).stat().st_mode & 0o777 == 0o600
    assert files.env()["RAY_USE_TLS"] == "1"
    Path(files.key).chmod(0o644)
    with pytest.raises(PetatrainError, match="may be read by group or others"):
        files.env()
    with pytest.raises(PetatrainError, match="does not exist"):
        TlsFiles(ca=str(tmp_path / "nope.pem"), cert=files.cert, key=files.key).env()
    with pytest.raises(PetatrainError, match="already holds"):
        make_certificates(str(tmp_path / "tls"), [])


@pytest.mark.slow
@pytest.mark.chaos
def test_training_joins_a_tls_cluster_with_the_configs_certificates_and_a_client_without_them_is_refused(
    token_dataset, tmp_path
):
    """Both nodes run Ray with TLS (mutual: every gRPC peer shows a certificate of the cluster's CA)
    and token authentication. `train --address` with `resources.tls` in its config joins and trains
    across the nodes; a driver with the token but without the certificates cannot connect."""
    import sys

    from helpers import ROOT, need_network_namespaces
    from petatrain.chaos.netns import TwoNodeCluster
    from petatrain.observe.ledger import read_events
    from petatrain.runtime.tls import TlsFiles

    need_network_namespaces()
    head, worker = "10.233.0.1", "10.233.0.2"
    made = run_cli("keys", "tls", str(tmp_path / "tls"), "--host", head, "--host", worker, "--json")
    assert made.returncode == 0, made.stderr
    files = TlsFiles(**json.loads(made.stdout)["config"])
    with TwoNodeCluster(head_cpus=1, worker_cpus=1, subnet="10.233.0", node_env=files.env()) as cluster:
        plain = {"RAY_USE_TLS": "0"}  # the driver's own environment has no TLS: the config must turn it on
        argv = [sys.executable, "-m", "petatrain", "train", str(ROOT / "examples" / "tiny.yaml")]
        for override in (f"data.dataset={token_dataset}", "train.steps=12", "parallel.workers=2"):
            argv += ["--set", override]
        tls = [f"resources.tls.ca={files.ca}", f"resources.tls.cert={files.cert}", f"resources.tls.key={files.key}"]
        run_dir = tmp_path / "run"
        done = cluster.run(
            [*argv, *(a for t in tls for a in ("--set", t)), "--address", cluster.address, "--run-dir", str(run_dir)],
            env=plain, timeout=300, capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert [e["step"] for e in read_events(str(run_dir)) if e["event"] == "step"][-1] == 12
        # A joined cluster's ranks are forked too: one fork server on each node (runtime.startup.forkserver).
        served = [p.read_text() for p in cluster.temp_root.glob("*/session_2*/logs/petatrain-fork-*.log")]
        assert len(served) == 2 and all("serving" in log for log in served), served
        # Without the certificates a client never joins: the GCS takes only TLS. Ray's own driver
        # would retry its handshake for minutes, so the probe is one gRPC call of Ray's, plain and
        # then with the config's certificates: refused at the handshake (UNAVAILABLE), answered.
        probe = (
            "import sys, grpc\n"
            "from ray.core.generated import gcs_service_pb2 as pb, gcs_service_pb2_grpc as rpc\n"
            "ca, cert, key = (open(p, 'rb').read() for p in sys.argv[2:5])\n"
            "plain = grpc.insecure_channel(sys.argv[1])\n"
            "tls = grpc.secure_channel(sys.argv[1], grpc.ssl_channel_credentials(ca, key, cert))\n"
            "for channel in (plain, tls):\n"
            "    try:\n"
            "        rpc.NodeInfoGcsServiceStub(channel).GetClusterId(pb.GetClusterIdRequest(), timeout=5)\n"
            "        print('OK')\n"
            "    except grpc.RpcError as exc:\n"
            "        print(exc.code().name)\n"
        )
        argv = [sys.executable, "-c", probe, cluster.address, files.ca, files.cert, files.key]
        answers = cluster.run(argv, env=plain, timeout=60, capture_output=True, text=True)
        assert answers.returncode == 0, answers.stderr[-3000:]
        without, with_certificates = answers.stdout.split()
        assert without == "UNAVAILABLE"  # the TLS handshake failed: the GCS never saw the call
        assert with_certificates in ("OK", "UNAUTHENTICATED")  # through TLS; the token is Ray's next check


def test_a_shard_changed_after_it_was_verified_is_caught_at_its_next_read(encrypted_tokens, tmp_path):
    """Shards are hashed once per process (not once per epoch); a shard rewritten in place after
    that, same size, has another stat and is hashed again."""
    from petatrain.data.loading.stream import StreamingDataset

    copy = tmp_path / "plain"
    shutil.copytree(encrypted_tokens / "plain", copy)
    assert len(list(StreamingDataset(str(copy), batch_size=64).iter_batches())) > 0
    shard = sorted((copy / "data").glob("*.parquet"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptDataError, match="shard corrupt"):
        list(StreamingDataset(str(copy), batch_size=64).iter_batches())
