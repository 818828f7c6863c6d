"""Security against the real Ceph RGW: TLS verified with storage.ca_bundle, server-side encryption
(SSE-KMS, SSE-C) on every kind of request, plain HTTP refused for encrypted data, and per-role
identities held to the bucket policies `petatrain access policy` prints; secrets never written."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from conftest import run_cli
from helpers import ingest, read_dataset, tiny
from petatrain import config, storage
from petatrain.data import index
from petatrain.errors import AccessDeniedError, ConfigError, PetatrainError, StorageAccessError
from petatrain.security import access
from petatrain.storage import StorageOptions
from petatrain.storage.fs import copy
from petatrain.storage.sse import ServerSideEncryption, read_customer_key

# A recognisable SSE-C key: grep finds it if it ever lands in a file or a message.
SSEC_RAW = b"SSE-C-TEST-KEY-petatrain-0123456"
SSEC_B64 = base64.b64encode(SSEC_RAW).decode()
SSEC_ENV = "PETATRAIN_TEST_SSEC_KEY"
SECRET_MARKS = (SSEC_B64, SSEC_RAW.decode(), SSEC_RAW.hex())


@pytest.fixture
def ssec(monkeypatch):
    monkeypatch.setenv(SSEC_ENV, SSEC_B64)
    return ServerSideEncryption(mode="customer", customer_key=f"env:{SSEC_ENV}")


@pytest.fixture(scope="module")
def tls(s3_endpoint):
    """(https endpoint, CA bundle) of the test server."""
    endpoint, ca = os.environ.get("PETATRAIN_TEST_S3_TLS_ENDPOINT"), os.environ.get("PETATRAIN_TEST_S3_CA_BUNDLE")
    if not endpoint or not ca:
        pytest.skip("the S3 test server has no TLS endpoint (tests/s3server/rgw.sh env prints it)")
    return endpoint, ca


def kms() -> ServerSideEncryption:
    return ServerSideEncryption(mode="kms", kms_key_id=os.environ.get("PETATRAIN_TEST_S3_KMS_KEY_ID", "testkey-1"))


def opts(tls, *, sse=None, who=None, **kw) -> StorageOptions:
    """Options for the TLS endpoint, as the bucket owner (the AWS_* variables) or identity `who`."""
    creds = {"s3_access_key_id": who["key"], "s3_secret_access_key": who["secret"]} if who else {}
    return StorageOptions(
        s3_endpoint_url=tls[0], ca_bundle=tls[1], sse=sse or ServerSideEncryption(), **creds, **kw
    )  # fmt: skip


def owner(tls):
    """A plain botocore client of the bucket owner: what the store says, not what petatrain says."""
    import botocore.session

    return botocore.session.get_session().create_client("s3", endpoint_url=tls[0], verify=tls[1])


def head(client, url: str, **kw) -> dict:
    bucket, _, key = url.removeprefix("s3://").partition("/")
    return client.head_object(Bucket=bucket, Key=key, **kw)


def other_ca(tmp_path: Path) -> str:
    """A CA that did not issue the server's certificate."""
    pem = tmp_path / "other-ca.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-new", "-nodes", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-keyout", str(tmp_path / "other-ca.key"), "-out", str(pem), "-days", "1", "-subj", "/CN=not the test CA"],
        check=True, capture_output=True,
    )  # fmt: skip
    return str(pem)


# -- policies and configs (no server) ---------------------------------------------------------


def _allowed(doc: dict, action: str) -> list[str]:
    return [r for s in doc["Statement"] if s["Effect"] == "Allow" and action in s["Action"] for r in s["Resource"]]


def test_role_policies_grant_exactly_what_each_role_needs():
    bucket, user = "lake", "arn:aws:iam:::user/{}"
    ingest_doc = access.policy(
        "ingest", bucket=bucket, prefix="datasets", sources=["s3://lake/raw/*.jsonl"], principal=user.format("ingest")
    ).to_dict()
    train_doc = access.policy(
        "train", bucket=bucket, prefix="datasets/", run_prefix="s3://lake/runs/r1", principal=user.format("train")
    ).to_dict()
    serve_doc = access.policy("serve", bucket=bucket, prefix="datasets/", run_prefix="runs/r1/").to_dict()

    for doc in (ingest_doc, train_doc, serve_doc):
        assert doc["Version"] == "2012-10-17"
        sids = [s["Sid"] for s in doc["Statement"]]
        assert len(sids) == len(set(sids)) and all(sid.isalnum() for sid in sids)
    assert {s["Principal"]["AWS"][0] for s in train_doc["Statement"]} == {"arn:aws:iam:::user/train"}
    assert all("Principal" not in s for s in serve_doc["Statement"])  # no principal: an IAM identity policy

    # ingest: writes only the datasets, reads its sources
    assert _allowed(ingest_doc, "s3:PutObject") == ["arn:aws:s3:::lake/datasets/*"]
    assert _allowed(ingest_doc, "s3:GetObject") == ["arn:aws:s3:::lake/datasets/*", "arn:aws:s3:::lake/raw/*"]
    # train: reads the datasets, writes only its run, and a Deny guards the datasets
    assert _allowed(train_doc, "s3:PutObject") == ["arn:aws:s3:::lake/runs/r1/*"]
    assert _allowed(train_doc, "s3:DeleteObject") == ["arn:aws:s3:::lake/runs/r1/*", "arn:aws:s3:::lake"]
    assert set(_allowed(train_doc, "s3:GetObject")) == {"arn:aws:s3:::lake/datasets/*", "arn:aws:s3:::lake/runs/r1/*"}
    denied = [s for s in train_doc["Statement"] if s["Effect"] == "Deny"]
    assert denied and denied[0]["Resource"] == ["arn:aws:s3:::lake/datasets/*"]
    assert {"s3:PutObject", "s3:DeleteObject"} <= set(denied[0]["Action"])
    # listings are limited to the prefixes (IfExists: a HEAD of a missing key stays a 404)
    lists = [s for s in train_doc["Statement"] if s["Action"] == ["s3:ListBucket"]]
    assert [s["Condition"]["StringLikeIfExists"]["s3:prefix"] for s in lists] == [
        ["datasets", "datasets/*"], ["runs/r1", "runs/r1/*"]
    ]  # fmt: skip
    # serve: the committed models and the tokenizers, nothing else, no write
    assert _allowed(serve_doc, "s3:PutObject") == _allowed(serve_doc, "s3:DeleteObject") == []
    assert set(_allowed(serve_doc, "s3:GetObject")) == {
        "arn:aws:s3:::lake/runs/r1/config.yaml",
        "arn:aws:s3:::lake/runs/r1/final/*",
        "arn:aws:s3:::lake/runs/r1/checkpoints/*",
        "arn:aws:s3:::lake/datasets/*_index/manifest.json",
        "arn:aws:s3:::lake/datasets/*_index/versions/*",  # the dataset version a run is pinned to
        "arn:aws:s3:::lake/datasets/*_index/tokenizer.json",
    }
    # merging: another role's statements are kept, the same command's are replaced
    merged = access.merge(access.merge(ingest_doc, train_doc), train_doc)
    assert len(merged["Statement"]) == len(ingest_doc["Statement"]) + len(train_doc["Statement"])


@pytest.mark.parametrize(
    ("role", "kw", "message"),
    [
        ("train", {"prefix": "datasets/"}, "--run-prefix: the train role needs"),
        ("train", {"prefix": "data/", "run_prefix": "data/runs/"}, "overlap"),
        ("ingest", {"prefix": ""}, "--prefix: the ingest role needs"),
        ("ingest", {"prefix": "d/", "principal": "*"}, "never for everyone"),
        ("ingest", {"prefix": "d/", "sources": ["s3://other/raw/"], "principal": "arn:aws:iam:::user/i"}, "not in"),
        ("serve", {"run_prefix": "r/", "sources": ["s3://b/x"]}, "--source is for the ingest role"),
        ("admin", {"prefix": "d/"}, "one of ingest, train, serve"),
    ],
)
def test_policy_arguments_that_would_widen_access_are_refused(role, kw, message):
    with pytest.raises(PetatrainError, match=message):
        access.policy(role, bucket="b", **kw)


def test_the_customer_key_is_named_by_reference_and_never_shown(monkeypatch):
    # The key pasted where its reference belongs: refused, and the error does not repeat it.
    with pytest.raises(ConfigError) as pasted:
        config.load(None, ["storage.sse.mode=customer", f"storage.sse.customer_key={SSEC_B64}"])
    assert "env:NAME or file:PATH" in str(pasted.value) and SSEC_B64 not in str(pasted.value)
    with pytest.raises(ConfigError, match=r"needs storage.sse.customer_key"):
        config.load(None, ["storage.sse.mode=customer"])
    with pytest.raises(ConfigError, match=r"storage.sse.mode: 'aes' is not one of none, s3, kms, customer"):
        config.load(None, ["storage.sse.mode=aes"])

    cfg = config.load(None, ["storage.sse.mode=customer", f"storage.sse.customer_key=env:{SSEC_ENV}"])
    assert f"customer_key: env:{SSEC_ENV}" in cfg.to_yaml()
    monkeypatch.setenv(SSEC_ENV, SSEC_B64)
    # An https endpoint, whatever the S3 tests before this one exported (the test server's is http://).
    monkeypatch.setenv("AWS_ENDPOINT_URL", "https://s3.example")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    resolved = cfg.storage.options().for_workers()
    assert resolved.sse_customer_key == SSEC_RAW  # what a worker on another node is handed
    assert not any(mark in repr(resolved) + repr(cfg) + cfg.to_yaml() for mark in SECRET_MARKS)
    assert resolved.fsspec_kwargs("s3")["s3_additional_kwargs"]["SSECustomerKey"] == SSEC_RAW

    # a reference to something that is not a 256-bit key: named, its content never shown
    monkeypatch.setenv(SSEC_ENV, SSEC_B64[:-8])
    with pytest.raises(PetatrainError, match=f"env:{SSEC_ENV}: expected the base64 of a 256-bit key") as short:
        read_customer_key(f"env:{SSEC_ENV}")
    assert SSEC_B64[:-8] not in str(short.value)
    with pytest.raises(PetatrainError, match="environment variable PETATRAIN_NO_SUCH_KEY is not set"):
        read_customer_key("env:PETATRAIN_NO_SUCH_KEY")


def test_an_encrypted_config_refuses_a_plain_http_endpoint():
    with pytest.raises(ConfigError, match=r"is plain HTTP but storage.sse.mode is kms.*storage.allow_http: true"):
        config.load(None, ["storage.sse.mode=kms", "storage.s3_endpoint_url=http://s3.example:80"])
    allowed = config.load(
        None, ["storage.sse.mode=kms", "storage.s3_endpoint_url=http://s3:80", "storage.allow_http=true"]
    )
    assert not allowed.storage.options().require_tls
    # the endpoint may come from AWS_ENDPOINT_URL: the same rule when a filesystem is made
    options = StorageOptions(s3_endpoint_url="http://127.0.0.1:9", encrypted=True)
    assert options.require_tls
    with pytest.raises(PetatrainError, match=r"refusing the plain-HTTP S3 endpoint http://127.0.0.1:9"):
        storage.resolve("s3://b/k", options)


def test_access_policy_command_prints_a_policy_to_apply_and_merges(tmp_path):
    current = tmp_path / "current.json"
    current.write_text(json.dumps({"Version": "2012-10-17", "Statement": [{"Sid": "Keep", "Effect": "Allow"}]}))
    result = run_cli(
        "access", "policy", "--role", "serve", "--bucket", "lake", "--prefix", "datasets/", "--run-prefix", "runs/r1",
        "--principal", "arn:aws:iam:::user/serve", "--merge", str(current),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["Statement"][0]["Sid"] == "Keep" and len(document["Statement"]) == 5
    assert "serve (arn:aws:iam:::user/serve) in s3://lake" in result.stderr
    assert "read s3://lake/runs/r1/config.yaml, final/ and checkpoints/" in result.stderr
    bad = run_cli("access", "policy", "--role", "train", "--bucket", "lake", "--prefix", "datasets/")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "--run-prefix" in bad.stderr


# -- against the RGW -----------------------------------------------------------------------------

pytest_s3 = pytest.mark.s3


@pytest_s3
def test_tls_endpoint_is_verified_against_storage_ca_bundle(s3_bucket, tls, tmp_path):
    url = storage.join(s3_bucket, "tls", "a.bin")
    storage.atomic_write(url, b"over TLS", opts(tls))
    assert storage.read_bytes(url, opts(tls)) == b"over TLS"

    for ca in ("", other_ca(tmp_path)):  # the system's CAs, then a CA that did not issue it
        started = time.monotonic()
        with pytest.raises(StorageAccessError) as failed:
            storage.read_bytes(url, StorageOptions(s3_endpoint_url=tls[0], ca_bundle=ca))
        message = str(failed.value)
        assert message.startswith(f"read {url}: the TLS certificate of {tls[0]} does not verify"), message
        assert "storage.ca_bundle" in message and "\n" not in message
        assert time.monotonic() - started < 5  # no retries: a certificate does not change
    with pytest.raises(PetatrainError, match=r"storage.ca_bundle .*nope.pem: No such file"):
        storage.exists(url, StorageOptions(s3_endpoint_url=tls[0], ca_bundle=str(tmp_path / "nope.pem")))
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    with pytest.raises(PetatrainError, match=r"junk.pem: not a PEM file of CA certificates"):
        storage.exists(url, StorageOptions(s3_endpoint_url=tls[0], ca_bundle=str(tmp_path / "junk.pem")))

    result = run_cli(
        "inspect", storage.join(s3_bucket, "tls"), "--set", f"storage.s3_endpoint_url={tls[0]}",
        "--set", f"storage.ca_bundle={other_ca(tmp_path)}",
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and tls[0] in lines[0] and "storage.ca_bundle" in lines[0], result.stderr


@pytest_s3
def test_a_wrong_identity_is_one_line_and_writes_nothing(s3_bucket, tls, tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "a document"}\n')
    out = storage.join(s3_bucket, "datasets", "denied")
    result = run_cli(
        "ingest", str(tmp_path / "a.jsonl"), "--out", out, "--set", f"storage.s3_endpoint_url={tls[0]}",
        "--set", f"storage.ca_bundle={tls[1]}", "--set", "storage.s3_access_key_id=NOSUCHUSER",
        "--set", "storage.s3_secret_access_key=not-its-secret",
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and out in lines[0] and "AccessDenied" in lines[0], result.stderr
    assert "not-its-secret" not in result.stderr
    assert storage.listdir(out) == []


@pytest_s3
def test_plain_http_is_refused_for_encrypted_data_unless_allowed(s3_bucket, tls):
    http = os.environ["AWS_ENDPOINT_URL"]
    assert http.startswith("http://")
    url = storage.join(s3_bucket, "plain", "a.bin")
    with pytest.raises(PetatrainError, match=f"refusing the plain-HTTP S3 endpoint {http}.*storage.allow_http"):
        storage.atomic_write(url, b"secret", StorageOptions(s3_endpoint_url=http, sse=kms()))
    assert storage.listdir(storage.join(s3_bucket, "plain")) == []  # nothing was written
    storage.atomic_write(url, b"secret", StorageOptions(s3_endpoint_url=http, sse=kms(), allow_http=True))
    assert head(owner(tls), url)["ServerSideEncryption"] == "aws:kms"


@pytest_s3
def test_a_mode_the_store_ignores_is_an_error_not_a_silent_downgrade(s3_bucket, tls):
    # Ceph RGW Pacific takes `x-amz-server-side-encryption: AES256` (SSE-S3) and stores the
    # object in the clear; a store that honours it passes.
    url = storage.join(s3_bucket, "sse-s3", "a.bin")
    try:
        storage.atomic_write(url, b"meant to be encrypted", opts(tls, sse=ServerSideEncryption(mode="s3")))
    except PetatrainError as exc:
        assert str(exc).startswith(f"{url} was stored unencrypted although storage.sse.mode is s3"), exc
        assert not storage.exists(url, opts(tls))  # not left behind in the clear
    else:
        assert head(owner(tls), url)["ServerSideEncryption"] == "AES256"


@pytest_s3
@pytest.mark.parametrize("mode", ["kms", "customer"])
def test_every_kind_of_request_works_encrypted(mode, s3_bucket, tls, ssec):
    sse = kms() if mode == "kms" else ssec
    options = opts(tls, sse=sse)
    key = {"SSECustomerAlgorithm": "AES256", "SSECustomerKey": SSEC_RAW} if mode == "customer" else {}
    client = owner(tls)

    def encrypted(url: str) -> bool:
        found = head(client, url, **key)
        if mode == "kms":
            return found.get("ServerSideEncryption") == "aws:kms" and found.get("SSEKMSKeyId") == sse.kms_key_id
        return found.get("SSECustomerAlgorithm") == "AES256"

    base = storage.join(s3_bucket, mode)
    small, big = storage.join(base, "small.bin"), storage.join(base, "big.bin")
    storage.atomic_write(small, b"0123456789" * 100, options)  # a put
    fs, path = storage.resolve(big, options)
    data = os.urandom(11 * 2**20)
    fs.pipe_file(path, data, chunksize=5 * 2**20)  # a multipart upload, through the same filesystem
    assert head(client, big, **key)["ETag"].strip('"').endswith("-3")
    assert storage.read_bytes(small, options) == b"0123456789" * 100  # a read
    assert fs.cat_file(path, start=6 * 2**20, end=6 * 2**20 + 100) == data[6 * 2**20 : 6 * 2**20 + 100]  # a range
    with fs.open(path, "rb") as handle:  # a file's buffered ranges
        handle.seek(9 * 2**20)
        assert handle.read(4096) == data[9 * 2**20 : 9 * 2**20 + 4096]
    assert storage.listdir(base, options) == [big, small]  # a listing
    assert fs.info(path)["size"] == len(data)  # a HEAD
    copy(big, storage.join(base, "copy.bin"), options)  # a copy (RGW Pacific: re-written, not server-side)
    assert storage.read_bytes(storage.join(base, "copy.bin"), options) == data
    assert all(encrypted(u) for u in (small, big, storage.join(base, "copy.bin")))

    if mode == "customer":  # without the key, or with another, a read fails in one clear line
        other = base64.b64encode(bytes(32)).decode()
        for reader in (StorageOptions(s3_endpoint_url=tls[0], ca_bundle=tls[1]), None):
            if reader is None:
                os.environ[SSEC_ENV] = other
                reader = opts(tls, sse=ssec)
            with pytest.raises(StorageAccessError) as failed:
                storage.read_bytes(small, reader)
            message = str(failed.value)
            assert (
                message.startswith(f"read {small}: ") and "SSE-C" in message and "storage.sse.customer_key" in message
            )
            assert not any(mark in message for mark in (*SECRET_MARKS, other)), message


@pytest_s3
@pytest.mark.parametrize("mode", ["kms", "customer"])
def test_an_encrypted_dataset_is_ingested_and_read_back(mode, s3_bucket, tls, ssec, ray_local, corpus):
    options = opts(tls, sse=kms() if mode == "kms" else ssec)
    out = storage.join(s3_bucket, "datasets", mode)
    summary = ingest(corpus.files[:1], out, dedup="exact", shard_size="200KB", options=options)
    assert summary.shards >= 2
    assert index.verify_shards(index.open_dataset(out, options)) == []
    assert read_dataset(out, options).num_rows == summary.rows_out
    key = {"SSECustomerAlgorithm": "AES256", "SSECustomerKey": SSEC_RAW} if mode == "customer" else {}
    client = owner(tls)
    files = storage.listdir(out, options)
    assert any("/data/part-" in u for u in files) and any(u.endswith("manifest.json") for u in files)
    for url in files:  # every object of the dataset, shards, index, rejects and manifest alike
        found = head(client, url, **key)
        assert found.get("SSECustomerAlgorithm" if key else "ServerSideEncryption") == (
            "AES256" if key else "aws:kms"
        ), url


# -- identities and bucket policies ---------------------------------------------------------------


@pytest_s3
def test_role_identities_are_held_to_their_policies_and_train_end_to_end(
    s3_bucket, tls, s3_identity, ssec, ray_local, tmp_path
):
    """Ingest as `ingest`, train as `train`, serve as `serve`, over TLS with SSE-C, with the policies
    `petatrain access policy` prints applied to the bucket; secrets never land in a file."""
    from petatrain.data import synth
    from petatrain.runtime.driver import TrainJob, run
    from petatrain.train import weights

    bucket = s3_bucket.removeprefix("s3://")
    who = {role: s3_identity(f"pt-{role}") for role in access.ROLES}
    client = owner(tls)
    document = {"Version": "2012-10-17", "Statement": []}
    for role, kw in (("ingest", {}), ("serve", {"run_prefix": "runs/r1/"})):
        built = access.policy(role, bucket=bucket, prefix="datasets/", principal=who[role]["principal"], **kw)
        document = access.merge(document, built.to_dict())
    (tmp_path / "policy.json").write_text(json.dumps(document))
    printed = run_cli(
        "access", "policy", "--role", "train", "--bucket", bucket, "--prefix", "datasets/", "--run-prefix", "runs/r1/",
        "--principal", who["train"]["principal"], "--merge", str(tmp_path / "policy.json"), "--json",
    )  # fmt: skip
    assert printed.returncode == 0, printed.stderr
    client.put_bucket_policy(Bucket=bucket, Policy=printed.stdout)

    as_ingest, as_train, as_serve = (opts(tls, sse=ssec, who=who[r]) for r in access.ROLES)
    corpus = synth.generate(str(tmp_path / "raw"), documents=240, files=2, bad_records=False, seed=3)
    data = storage.join(s3_bucket, "datasets", "tok")
    ingest(corpus.files, data, dedup="exact", tokenizer="bytes", pack_length=65, shard_size="60KB", options=as_ingest)

    def snapshot() -> dict[str, str]:
        listed = client.list_objects_v2(Bucket=bucket, Prefix="datasets/")["Contents"]
        return {o["Key"]: o["ETag"] for o in listed}

    before = snapshot()
    shard = storage.join(data, index.open_dataset(data, as_train).shards.column("path")[0].as_py())
    manifest = storage.join(data, "_index", "manifest.json")
    shard_index = next(u for u in storage.listdir(storage.join(data, "_index"), as_train) if "/shards-" in u)
    messages = []
    for url in (shard, manifest, shard_index):  # train reads the dataset but never writes it
        assert storage.read_bytes(url, as_train)
        with pytest.raises(AccessDeniedError) as denied:
            storage.atomic_write(url, b"overwritten", as_train)
        assert str(denied.value).startswith(f"write {url}: AccessDenied"), denied.value
        messages.append(str(denied.value))
    with pytest.raises(StorageAccessError, match=f"remove {data}/data: .* still there after the delete"):
        storage.remove_tree(storage.join(data, "data"), as_train)
    for url in (shard, shard_index):  # serve never reads the dataset's rows
        with pytest.raises(AccessDeniedError) as denied:
            storage.read_bytes(url, as_serve)
        assert str(denied.value).startswith(f"read {url}: AccessDenied"), denied.value
        messages.append(str(denied.value))
    with pytest.raises(AccessDeniedError, match=f"list {data}: AccessDenied"):
        storage.listdir(data, as_serve)
    assert snapshot() == before  # the dataset is untouched

    run_url = storage.join(s3_bucket, "runs", "r1")
    cfg = tiny(
        data, "train.steps=6", "checkpoint.every=3", f"storage.s3_endpoint_url={tls[0]}", f"storage.ca_bundle={tls[1]}",
        "storage.sse.mode=customer", f"storage.sse.customer_key=env:{SSEC_ENV}",
        f"storage.s3_access_key_id={who['train']['key']}", f"storage.s3_secret_access_key={who['train']['secret']}",
    )  # fmt: skip
    summary = run(TrainJob(config=cfg, run_url=run_url, options=cfg.storage.options()))
    assert summary["failures"] == [] and storage.exists(summary["final"], as_train)
    served = weights.load(run_url, "final", as_serve)  # config, tokenizer and weights: all serve may read
    assert served.step == 6 and weights.load(run_url, "latest", as_serve).step == 6
    with pytest.raises(AccessDeniedError):
        storage.atomic_write(storage.join(run_url, "final", "model.safetensors"), b"x", as_serve)
    assert snapshot() == before

    # Secrets never leave the process: not in the run, the dataset's index, the logs, or an error.
    secrets = (*SECRET_MARKS, *(w["secret"] for w in who.values()), os.environ["AWS_SECRET_ACCESS_KEY"])
    written = {u: storage.read_bytes(u, as_train) for u in storage.listdir(run_url, as_train)}
    written |= {u: storage.read_bytes(u, as_ingest) for u in storage.listdir(storage.join(data, "_index"), as_ingest)}
    assert any(u.endswith("config.yaml") for u in written) and any(u.endswith("events.jsonl") for u in written)
    for url, blob in written.items():
        assert not any(s.encode() in blob for s in secrets) and SSEC_RAW not in blob, url
    assert not any(s in m for s in secrets for m in messages)
    local = [Path.home() / ".cache" / "petatrain" / "ray-train", Path("/tmp/ray/session_latest/logs")]
    folders = [str(folder) for folder in local if folder.exists()]  # Ray Train's records, Ray's logs
    if folders:
        patterns = [arg for secret in secrets for arg in ("-e", secret)]
        found = subprocess.run(["grep", "-rlF", *patterns, "--", *folders], capture_output=True, text=True)
        assert found.stdout == "", f"a secret was found in {found.stdout}"
