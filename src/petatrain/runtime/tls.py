"""Ray's own TLS: every gRPC connection between the driver, GCS, raylets and workers encrypted and
mutually authenticated with certificates from one CA (Ray's `RAY_USE_TLS` and `RAY_TLS_*`).

Token authentication (on by default) says who may call; TLS keeps what they send private and
proves each end holds a certificate of the cluster's CA. `resources.tls.{ca,cert,key}` in a job
config makes petatrain start or join a cluster with it; every node's `ray start` needs the same
three variables (`petatrain keys tls` writes the files, `env` is what to export).
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from petatrain.errors import PetatrainError

if TYPE_CHECKING:
    from petatrain.config import RayTlsConfig

USE_TLS = "RAY_USE_TLS"
CA = "RAY_TLS_CA_CERT"
CERT = "RAY_TLS_SERVER_CERT"
KEY = "RAY_TLS_SERVER_KEY"


@dataclass(frozen=True, kw_only=True, slots=True)
class TlsFiles:
    ca: str
    cert: str
    key: str

    def env(self) -> dict[str, str]:
        """The variables every Ray process of the cluster reads (driver, GCS, raylets, workers)."""
        for what, path in (("ca", self.ca), ("cert", self.cert), ("key", self.key)):
            if not os.path.isfile(path):
                raise PetatrainError(f"resources.tls.{what}: {path} does not exist")
        mode = stat.S_IMODE(os.stat(self.key).st_mode)
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise PetatrainError(
                f"resources.tls.key: {self.key} may be read by group or others (mode {mode:o}); "
                f"run `chmod 600 {self.key}`"
            )
        return {USE_TLS: "1", CA: self.ca, CERT: self.cert, KEY: self.key}


def enable(tls: RayTlsConfig) -> None:
    """Export Ray's TLS variables in this process, as `resources.tls` says, before Ray starts or is
    joined (a local Ray's processes inherit them); nothing when the config has none."""
    if not tls.enabled:
        return
    wanted = TlsFiles(ca=tls.ca, cert=tls.cert, key=tls.key).env()
    if "ray._raylet" in sys.modules and any(os.environ.get(k) != v for k, v in wanted.items()):
        # Ray's core library reads these once, when it loads: set later, they would be ignored and
        # the connection would hang on a TLS cluster instead of failing.
        raise PetatrainError(
            "resources.tls: Ray was loaded in this process before its TLS settings were known; export "
            + " ".join(f"{k}={v}" for k, v in wanted.items())
            + " before starting it"
        )
    os.environ.update(wanted)


def make_certificates(folder: str, hosts: list[str], *, days: int = 365) -> TlsFiles:
    """A new CA and one certificate for every node (the hosts' names and addresses as
    subject alternative names; localhost and 127.0.0.1 always), in `folder`: ca.pem, ca.key,
    node.pem, node.key (the keys mode 0600). Existing files are never overwritten."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    names = {"ca.pem", "ca.key", "node.pem", "node.key"}
    existing = sorted(n for n in names if (out / n).exists())
    if existing:
        raise PetatrainError(f"{folder} already holds {', '.join(existing)}; choose an empty folder")
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "petatrain ray CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    alt: list[x509.GeneralName] = []
    for host in dict.fromkeys(["localhost", "127.0.0.1", *hosts]):
        # Ray's gRPC clients check the name they dialled, an address, as a DNS name: list both forms.
        alt.append(x509.DNSName(host))
        with contextlib.suppress(ValueError):  # a name, not an address
            alt.append(x509.IPAddress(ipaddress.ip_address(host)))
    node_key = ec.generate_private_key(ec.SECP256R1())
    node = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "petatrain ray node")]))
        .issuer_name(ca_name)
        .public_key(node_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    _write(out / "ca.pem", ca.public_bytes(pem), 0o644)
    _write(out / "node.pem", node.public_bytes(pem), 0o644)
    for name, key in (("ca.key", ca_key), ("node.key", node_key)):
        raw = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        _write(out / name, raw, 0o600)
    return TlsFiles(ca=str(out / "ca.pem"), cert=str(out / "node.pem"), key=str(out / "node.key"))


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
