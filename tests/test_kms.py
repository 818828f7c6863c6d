"""Keys in a key manager reached over HTTP: OpenStack Barbican (Debian's packages, started on
127.0.0.1 by tests/kms/barbican.sh, without Keystone: the project comes from X-Project-Id).

`keys create barbican+http://...` makes a container whose master key Barbican generated; an
encrypted ingest, a run on Ray whose workers never saw the credentials' variables, `keys rotate`
and serving's weights all go through it. Another project, no credentials, a server that is down,
a plain-HTTP URL to another host and credentials in the URL are each one line."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import socket
import ssl
import subprocess
import threading
from pathlib import Path

import pytest
import requests
import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from conftest import BARBICAN, ROOT, run_cli
from helpers import tiny, train
from petatrain.errors import ConfigError, PetatrainError
from petatrain.security import keys, sealed
from petatrain.security.protection import Protection
from petatrain.storage import StorageOptions

PROJECT = "petatrain-kms-test"
TOKEN = "tok-3f9a1c-never-written"
UUID = "0b9a3a34-9d35-4c1c-9d1e-6c2b8a0f1e2d"  # a recognisable credential: it must appear in no file


@pytest.fixture(scope="module")
def barbican() -> str:
    """The service URL of a Barbican started for this module (and stopped after it)."""
    folder = os.environ.get("PETATRAIN_BARBICAN_DIR", "/tmp/petatrain-barbican-test")
    port = os.environ.get("PETATRAIN_BARBICAN_PORT", "9311")
    env = {**os.environ, "PETATRAIN_BARBICAN_PORT": port}
    started = subprocess.run(["bash", str(BARBICAN), "start", folder], capture_output=True, text=True, env=env)
    if started.returncode != 0:
        pytest.fail(f"barbican.sh start failed:\n{started.stderr[-3000:]}")
    yield f"http://127.0.0.1:{port}"
    subprocess.run(["bash", str(BARBICAN), "stop", folder], capture_output=True, text=True, env=env)


@pytest.fixture
def project(monkeypatch):
    """This process's Barbican credentials; Ray's workers, started before, never get these variables."""
    monkeypatch.setenv("OS_PROJECT_ID", PROJECT)
    monkeypatch.setenv("OS_AUTH_TOKEN", TOKEN)
    monkeypatch.delenv("OS_CACERT", raising=False)


def _container(url: str, keyref: str) -> dict[str, str]:
    """name -> secret uuid, read straight from Barbican's API."""
    got = requests.get(f"{url}/v1/containers/{keyref.rsplit('/', 1)[1]}", headers={"X-Project-Id": PROJECT}, timeout=10)
    got.raise_for_status()
    return {r["name"]: r["secret_ref"].rsplit("/", 1)[1] for r in got.json()["secret_refs"]}


def _payload(url: str, uuid: str) -> bytes:
    headers = {"X-Project-Id": PROJECT, "Accept": "application/octet-stream"}
    got = requests.get(f"{url}/v1/secrets/{uuid}/payload", headers=headers, timeout=10)
    got.raise_for_status()
    return got.content


def test_bad_barbican_references_are_one_line_config_errors():
    from petatrain import config

    for keyref, message in [
        (
            "barbican+http://10.1.2.3:9311/v1/containers/0b9a3a34-9d35-4c1c-9d1e-6c2b8a0f1e2d",
            "plain HTTP from another host",
        ),
        ("barbican+https://user:pw@kms.example:9311/v1/containers/0b9a3a34-9d35-4c1c-9d1e-6c2b8a0f1e2d", "credentials"),
        ("barbican+https://kms.example:9311/v1/secrets/x", "the path must be /v1/containers/UUID"),
        ("vault+https://kms.example/transit/k", "no KMS client for 'vault+https:'"),
    ]:
        with pytest.raises(ConfigError, match=r"storage\.encryption\.key") as caught:
            config.load(ROOT / "examples" / "tiny.yaml", [f"storage.encryption.key={keyref}"])
        assert message in str(caught.value) and "\n" not in str(caught.value)
        assert "pw@" not in str(caught.value)


def test_a_container_made_by_keys_create_holds_a_key_barbican_generated_and_only_its_project_reads_it(
    barbican, project, tmp_path
):
    made = run_cli("keys", "create", f"barbican+http://127.0.0.1:{barbican.rsplit(':', 1)[1]}", "--json")
    assert made.returncode == 0, made.stderr
    keyref = json.loads(made.stdout)["keyref"]
    assert keyref.startswith("barbican+http://127.0.0.1:") and "/v1/containers/" in keyref
    members = _container(barbican, keyref)
    assert set(members) == {"master-1", "signing"}
    master = _payload(barbican, members["master-1"])
    assert len(master) == 32
    ring = keys.open_keys(keyref)
    assert ring.primary == 1 and ring.can_sign
    assert ring.unwrap(ring.wrap(b"k" * 32, "ctx"), "ctx") == b"k" * 32
    assert TOKEN not in made.stdout + made.stderr

    for env, why in [
        ({"OS_PROJECT_ID": "someone-else", "OS_AUTH_TOKEN": ""}, "refused to read the key container: HTTP 40"),
        (
            {"OS_PROJECT_ID": "", "OS_AUTH_TOKEN": ""},
            "no credentials; set OS_AUTH_TOKEN (a Keystone token) or OS_PROJECT_ID",
        ),
    ]:
        refused = run_cli("keys", "public", keyref, "--out", str(tmp_path / "verify.json"), env=env)
        assert refused.returncode != 0
        line = refused.stderr.strip().splitlines()[-1]
        assert why in line and keyref in line, refused.stderr
        assert not (tmp_path / "verify.json").exists()
    down = "barbican+http://127.0.0.1:9/v1/containers/" + keyref.rsplit("/", 1)[1]
    with pytest.raises(PetatrainError, match=r"cannot be reached to read the key container \(ConnectionError\)"):
        keys.open_keys(down)


@contextlib.contextmanager
def _tls_front(cert: str, key: str, target_port: int):
    """A TLS endpoint on 127.0.0.1 relaying each connection's bytes to Barbican's plain port: what a
    TLS-terminating proxy in front of a Barbican does. Yields its port."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", 0))

    def relay(tls: ssl.SSLSocket, upstream: socket.socket) -> None:
        with tls, upstream:  # one thread per connection: an SSL socket is not read and written at once
            while True:
                ready = [tls] if tls.pending() else select.select([tls, upstream], [], [], 30)[0]
                if not ready:
                    return
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        return
                    (upstream if sock is tls else tls).sendall(data)

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed: the test is over
                return
            try:
                tls = context.wrap_socket(conn, server_side=True)
            except (ssl.SSLError, OSError):  # a client that does not trust the certificate hangs up
                conn.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", target_port))
            threading.Thread(target=relay, args=(tls, upstream), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()


def _containers(url: str) -> int:
    got = requests.get(f"{url}/v1/containers", headers={"X-Project-Id": PROJECT}, timeout=10)
    got.raise_for_status()
    return int(got.json()["total"])


def test_barbican_over_https_is_trusted_only_through_os_cacert(barbican, project, tmp_path, monkeypatch):
    """`barbican+https://`: the certificate is checked against OS_CACERT's CAs. Without it (the
    system's CAs) or with another CA's file, `keys create` is one line and no container is made;
    with it, the container is made and its keys work, in this process and in the CLI's."""
    from petatrain.runtime.tls import make_certificates

    ours = make_certificates(str(tmp_path / "ours"), ["127.0.0.1"])
    other = make_certificates(str(tmp_path / "other"), ["127.0.0.1"])
    with _tls_front(ours.cert, ours.key, int(barbican.rsplit(":", 1)[1])) as port:
        base = f"barbican+https://127.0.0.1:{port}"
        before = _containers(barbican)
        for cacert in ("", other.ca):
            refused = run_cli("keys", "create", base, "--json", env={"OS_CACERT": cacert})
            assert refused.returncode != 0
            line = refused.stderr.strip().splitlines()[-1]
            assert "its TLS certificate is not trusted (set OS_CACERT to the CA's PEM file)" in line, refused.stderr
        assert _containers(barbican) == before, "nothing is made in a Barbican whose certificate was refused"

        made = run_cli("keys", "create", base, "--json", env={"OS_CACERT": ours.ca})
        assert made.returncode == 0, made.stderr
        keyref = json.loads(made.stdout)["keyref"]
        assert keyref.startswith(f"{base}/v1/containers/") and _containers(barbican) == before + 1
        public = run_cli("keys", "public", keyref, "--out", str(tmp_path / "verify.json"), env={"OS_CACERT": ours.ca})
        assert public.returncode == 0, public.stderr
        monkeypatch.setenv("OS_CACERT", ours.ca)
        ring = keys.open_keys(keyref)
        wrapped = ring.wrap(b"k" * 32, "ctx")
        assert ring.unwrap(wrapped, "ctx") == b"k" * 32
        blob = base64.urlsafe_b64decode(wrapped.split(":", 1)[1])  # wrapped with the key Barbican holds
        master = AESGCM(_payload(barbican, _container(barbican, keyref)["master-1"]))
        assert master.decrypt(blob[: keys._NONCE], blob[keys._NONCE :], keys._WRAP_AAD + b"ctx") == b"k" * 32


def test_two_rotations_at_once_take_two_versions_and_a_shared_name_is_refused(barbican, project, monkeypatch):
    """Barbican lets two members share a name, so two `keys rotate` at once could both add master-2.
    Both read the container before either adds (forced): each looks again after adding, and the
    container ends with master-2 and master-3, one secret each; what was stepped back from is
    deleted. A name held twice (made by hand here) is one line for a reader, not a guess."""
    import threading

    from petatrain.security import barbican as kms

    credentials = kms.Credentials.from_env()
    keyref = kms.create(f"barbican+http://127.0.0.1:{barbican.rsplit(':', 1)[1]}", credentials)
    first_look = threading.Barrier(2, timeout=30)
    looked: set[int] = set()
    real_members = kms.Client.members

    def members(self):
        if threading.get_ident() not in looked:  # each rotation's first look waits for the other's
            looked.add(threading.get_ident())
            found = real_members(self)
            first_look.wait()
            return found
        return real_members(self)

    monkeypatch.setattr(kms.Client, "members", members)
    made, stepped_back = [], []
    real_delete = kms.Client.delete_secret
    monkeypatch.setattr(
        kms.Client, "delete_secret", lambda self, href, name: (stepped_back.append(href), real_delete(self, href, name))
    )
    threads = [threading.Thread(target=lambda: made.append(kms.add_version(keyref, credentials))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    monkeypatch.setattr(kms.Client, "members", real_members)
    assert sorted(made) == [2, 3]
    names = [name for name, _ in kms.Client(kms.parse(keyref), credentials).members()]
    assert sorted(names) == ["master-1", "master-2", "master-3", "signing"]
    assert stepped_back, "the forced meeting made at least one rotation step back"
    for href in stepped_back:
        gone = requests.get(f"{barbican}/v1/secrets/{href.rsplit('/', 1)[1]}", headers={"X-Project-Id": PROJECT})
        assert gone.status_code == 404
    assert keys.open_keys(keyref).primary == 3

    client = kms.Client(kms.parse(keyref), credentials)
    client.add_member("master-3", client.generate_key("a second master-3"))
    keys._forget(keyref)
    with pytest.raises(PetatrainError, match="holds two secrets named master-3") as refused:
        keys.open_keys(keyref)
    assert "\n" not in str(refused.value)


@pytest.mark.slow
def test_an_encrypted_dataset_and_run_on_ray_use_the_container_and_rotate_in_it(barbican, project, tmp_path, ray_local):
    """Ingest encrypted with the container's keys, train on Ray (the workers get the credentials from
    the driver, not from their environment), serve's weights, then `keys rotate --retire`: the old
    master key is gone from Barbican and everything still reads. No file holds a key or the token."""
    from petatrain import config
    from petatrain.data import synth
    from petatrain.data.ingest import IngestJob, run
    from petatrain.data.loading.stream import StreamingDataset
    from petatrain.train import weights
    from petatrain.train.checkpoint import read_final

    made = run_cli("keys", "create", f"barbican+http://127.0.0.1:{barbican.rsplit(':', 1)[1]}", "--json")
    assert made.returncode == 0, made.stderr
    keyref = json.loads(made.stdout)["keyref"]
    options = StorageOptions(protection=Protection(encryption_key=keyref, signing_key=keyref))
    corpus, dataset = tmp_path / "corpus", tmp_path / "ds"
    synth.generate(str(corpus), documents=300, files=2)
    cfg = config.IngestConfig(tokenizer="bytes", pack_length=65, shard_size="60KB", dedup="exact")
    run(IngestJob(sources=[str(corpus)], out=str(dataset), config=cfg, options=options))
    shard = next((dataset / "data").glob("*.parquet")).read_bytes()
    assert shard[-4:] == b"PARE"

    job = tiny(
        str(dataset), f"storage.encryption.key={keyref}", "train.steps=12", "checkpoint.every=6", "train.eval_every=0"
    )
    run_url = tmp_path / "run"
    summary = train(job, run_url)
    assert summary["steps"] == 12 and summary["failures"] == [], summary
    assert (run_url / "final/model.safetensors").read_bytes().startswith(sealed.MAGIC)
    served = weights.load(str(run_url), "final", weights.run_options(str(run_url), None))
    before = torch.cat(
        [b["tokens"] for b in StreamingDataset(str(dataset), batch_size=64, options=options).iter_batches()]
    )

    old = _container(barbican, keyref)
    secrets = [_payload(barbican, old["master-1"]), _payload(barbican, old["signing"]), TOKEN.encode()]
    rotated = run_cli("keys", "rotate", keyref, str(dataset), str(run_url), "--retire", "--json")
    assert rotated.returncode == 0, rotated.stderr
    assert json.loads(rotated.stdout)["retired"] == [1]
    members = _container(barbican, keyref)
    assert set(members) == {"master-2", "signing"}
    gone = requests.get(f"{barbican}/v1/secrets/{old['master-1']}", headers={"X-Project-Id": PROJECT}, timeout=10)
    assert gone.status_code == 404, "a retired master key is deleted from Barbican"
    secrets.append(_payload(barbican, members["master-2"]))

    keys._forget(keyref)  # this process held version 1; read as a fresh process would
    after = torch.cat(
        [b["tokens"] for b in StreamingDataset(str(dataset), batch_size=64, options=options).iter_batches()]
    )
    assert torch.equal(before, after)
    tensors, record = read_final(str(run_url), options)
    assert record["encryption"]["key_version"] == 2
    assert all(torch.equal(tensors[k], served.weights[k]) for k in served.weights)
    for path in [*Path(run_url).rglob("*"), *dataset.rglob("*")]:
        if path.is_file():
            data = path.read_bytes()
            assert not any(s in data for s in secrets), path
    assert f"key: {keyref}" in (run_url / "config.yaml").read_text()
