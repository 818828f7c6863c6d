"""A key service over HTTP: OpenStack Barbican (the Key Manager API, v1).

KEYREF `barbican+https://HOST:PORT/v1/containers/UUID` (or `barbican+http://` to a loopback
address) names a generic Barbican container that `petatrain keys create barbican+https://HOST:PORT`
made. It holds named secret references, the same things a keyring file holds:

    master-1, master-2, ...  AES-256 keys that Barbican generated (a `key` order); the highest is primary
    signing                  the Ed25519 seed of the signing pair (Barbican generates no Ed25519 keys)

Data keys are wrapped and unwrapped in this process, exactly as with a keyring file
(`keys.SecretKeys`), with the master keys fetched from Barbican once per process and held in
memory only. Access is Barbican's: its ACLs and project scoping decide who may read the keys.

Credentials never sit in the KEYREF (it is written in a run's config.yaml) nor in any file:
`OS_AUTH_TOKEN` is sent as `X-Auth-Token` (a Keystone token), and `OS_PROJECT_ID` as
`X-Project-Id` (a Barbican run without Keystone takes the project from that header).
`OS_CACERT` names the CAs trusted for an https:// endpoint. `StorageOptions.for_workers()`
carries the driver's values to workers, as it does the S3 credentials.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from petatrain.errors import PetatrainError

SCHEMES = ("barbican+https", "barbican+http")
SIGNING = "signing"
_MASTER = re.compile(r"master-([1-9][0-9]*)$")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_TIMEOUT = 10.0
_ORDER_WAIT = 30.0
_ROTATE_TRIES = 5  # rotations that met another one at the same version before giving up


class BarbicanError(PetatrainError):
    """Barbican refused, or could not be reached; one line, never a credential."""


@dataclass(frozen=True, slots=True)
class Credentials:
    """What a request to Barbican carries; never shown."""

    token: str = field(default="", repr=False)
    project: str = ""
    ca_bundle: str = ""

    @classmethod
    def from_env(cls) -> Credentials:
        env = os.environ
        return cls(
            token=env.get("OS_AUTH_TOKEN", ""), project=env.get("OS_PROJECT_ID", ""), ca_bundle=env.get("OS_CACERT", "")
        )

    def headers(self) -> dict[str, str]:
        made = {}
        if self.token:
            made["X-Auth-Token"] = self.token
        if self.project:
            made["X-Project-Id"] = self.project
        return made

    @property
    def given(self) -> bool:
        return bool(self.token or self.project)


@dataclass(frozen=True, slots=True)
class Ref:
    """A parsed KEYREF: the service's base URL and, once made, the container's id."""

    ref: str
    base: str  # http(s)://HOST:PORT
    container: str  # uuid, "" for a service URL (what `keys create` is given)


def parse(keyref: str, *, container: bool = True) -> Ref:
    """A KEYREF's parts, or a one-line KeyringError-style BarbicanError naming what is wrong."""
    scheme, _, rest = keyref.partition("://")
    if scheme not in SCHEMES:
        raise BarbicanError(f"key reference {keyref!r} is not a Barbican URL ({' or '.join(SCHEMES)}://HOST:PORT/...)")
    parts = urlsplit(f"{scheme.split('+')[1]}://{rest}")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise BarbicanError(
            f"key reference {keyref.split('://')[0]}://…: credentials, queries and fragments do not belong in a "
            "KEYREF (it is written in config.yaml); set OS_AUTH_TOKEN or OS_PROJECT_ID instead"
        )
    if not parts.hostname:
        raise BarbicanError(f"key reference {keyref!r} names no host")
    try:
        port = parts.port
    except ValueError:
        raise BarbicanError(f"key reference {keyref!r} has a bad port") from None
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    base = f"{parts.scheme}://{host}" + (f":{port}" if port else "")
    path = parts.path.rstrip("/")
    found = re.fullmatch(r"/v1/containers/(.+)", path)
    if found and _UUID.match(found.group(1)):
        uuid = found.group(1)
    elif path in ("", "/v1") and not container:
        uuid = ""
    else:
        want = "/v1/containers/UUID" if container else "nothing, or /v1"
        raise BarbicanError(f"key reference {keyref!r}: the path must be {want}")
    if parts.scheme == "http" and not _loopback(parts.hostname):
        raise BarbicanError(
            f"key reference {keyref!r}: master keys are not fetched over plain HTTP from another host; "
            "use barbican+https:// (barbican+http:// is for a loopback address only)"
        )
    return Ref(ref=keyref, base=base, container=uuid)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Client:
    """The few Barbican calls petatrain makes (requests, one session per client)."""

    def __init__(self, ref: Ref, credentials: Credentials):
        import requests

        if not credentials.given:
            where = ref.ref if ref.container else f"Barbican at {ref.base}"
            raise BarbicanError(
                f"{where}: no credentials; set OS_AUTH_TOKEN (a Keystone token) or OS_PROJECT_ID (Barbican "
                "without Keystone)"
            )
        self.ref = ref
        self.credentials = credentials
        self._session = requests.Session()
        self._session.headers.update(credentials.headers())
        # Given with every request: a session's `verify` loses to REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE.
        self._verify: str | bool = credentials.ca_bundle or True
        self._requests = requests

    def call(self, method: str, path: str, what: str, *, ok: tuple[int, ...] = (200,), **kwargs: Any) -> Any:
        url = f"{self.ref.base}{path}"
        where = f"{self.ref.ref}: Barbican" if self.ref.container else f"Barbican at {self.ref.base}"
        try:
            answer = self._session.request(method, url, timeout=_TIMEOUT, verify=self._verify, **kwargs)
        except self._requests.exceptions.SSLError:
            raise BarbicanError(
                f"{where}: its TLS certificate is not trusted (set OS_CACERT to the CA's PEM file)"
            ) from None
        except self._requests.exceptions.RequestException as exc:
            raise BarbicanError(f"{where} cannot be reached to {what} ({type(exc).__name__})") from None
        if answer.status_code not in ok:
            raise BarbicanError(f"{where} refused to {what}: {_why(answer, self.credentials)}")
        return answer

    def json(self, method: str, path: str, what: str, *, ok: tuple[int, ...] = (200,), **kwargs: Any) -> Any:
        answer = self.call(method, path, what, ok=ok, **kwargs)
        try:
            return answer.json()
        except ValueError:
            raise BarbicanError(f"Barbican at {self.ref.base}: the answer to {what} is not JSON") from None

    # ---- secrets ---------------------------------------------------------------------------

    # A secret is named by the href Barbican gives it (which a container must list as given: it is
    # checked against Barbican's configured host, which a client behind a proxy does not reach it
    # by); requests go to this client's URL with the href's uuid, never to the href's host.

    def payload(self, href: str, name: str) -> bytes:
        answer = self.call(
            "GET",
            f"/v1/secrets/{_uuid_of(href, 'secret')}/payload",
            f"read secret {name}",
            headers={"Accept": "application/octet-stream"},
        )
        return bytes(answer.content)

    def generate_key(self, name: str) -> str:
        """A 256-bit AES key generated by Barbican (a `key` order); its secret's href."""
        meta = {"name": name, "algorithm": "aes", "bit_length": 256, "mode": "gcm"}
        meta["payload_content_type"] = "application/octet-stream"
        body = {"type": "key", "meta": meta}
        made = self.json("POST", "/v1/orders", f"generate key {name}", ok=(201, 202), json=body)
        order = _uuid_of(made.get("order_ref"), "order")
        deadline = time.monotonic() + _ORDER_WAIT
        while True:
            state = self.json("GET", f"/v1/orders/{order}", f"read the order for key {name}")
            if state.get("status") == "ACTIVE" and state.get("secret_ref"):
                return _href(state["secret_ref"], "secret")
            if state.get("status") == "ERROR":
                reason = state.get("error_reason") or state.get("error_status_code") or "no reason given"
                raise BarbicanError(f"Barbican at {self.ref.base} could not generate key {name}: {reason}")
            if time.monotonic() > deadline:
                raise BarbicanError(f"Barbican at {self.ref.base} did not generate key {name} in {_ORDER_WAIT:.0f} s")
            time.sleep(0.2)

    def store(self, name: str, data: bytes) -> str:
        body = {
            "name": name,
            "secret_type": "opaque",
            "payload": base64.b64encode(data).decode(),
            "payload_content_type": "application/octet-stream",
            "payload_content_encoding": "base64",
        }
        made = self.json("POST", "/v1/secrets", f"store secret {name}", ok=(201,), json=body)
        return _href(made.get("secret_ref"), "secret")

    def delete_secret(self, href: str, name: str) -> None:
        self.call("DELETE", f"/v1/secrets/{_uuid_of(href, 'secret')}", f"delete secret {name}", ok=(204, 404))

    # ---- the container -----------------------------------------------------------------------

    def create_container(self, refs: dict[str, str]) -> str:
        body = {
            "type": "generic",
            "name": "petatrain-keys",
            "secret_refs": [{"name": name, "secret_ref": href} for name, href in refs.items()],
        }
        made = self.json("POST", "/v1/containers", "create the key container", ok=(201,), json=body)
        return _uuid_of(made.get("container_ref"), "container")

    def members(self) -> list[tuple[str, str]]:
        """(name, secret href) of the container's secrets. Barbican lets two share a name (two
        rotations at once may each add master-N): see `named`."""
        got = self.json("GET", f"/v1/containers/{self.ref.container}", "read the key container")
        refs = got.get("secret_refs")
        if got.get("type") != "generic" or not isinstance(refs, list):
            raise BarbicanError(f"{self.ref.ref} is not a petatrain key container (a generic container)")
        return [(str(r.get("name")), _href(r.get("secret_ref"), "secret")) for r in refs if isinstance(r, dict)]

    def named(self) -> dict[str, str]:
        """name -> secret href; a name held by two secrets is refused rather than one picked."""
        out: dict[str, str] = {}
        for name, href in self.members():
            if name in out:
                raise BarbicanError(
                    f"{self.ref.ref} holds two secrets named {name} (two `keys rotate` at once?); the later "
                    "rotation takes its own out within seconds, so try again"
                )
            out[name] = href
        return out

    def add_member(self, name: str, href: str) -> None:
        body = {"name": name, "secret_ref": href}
        what = f"add {name} to the container"
        self.call("POST", f"/v1/containers/{self.ref.container}/secrets", what, ok=(201,), json=body)

    def remove_member(self, name: str, href: str) -> None:
        body = {"name": name, "secret_ref": href}
        what = f"remove {name} from the container"
        self.call("DELETE", f"/v1/containers/{self.ref.container}/secrets", what, ok=(204,), json=body)


def _href(url: Any, what: str) -> str:
    """A reference Barbican answered with, once it is seen to end in a uuid."""
    _uuid_of(url, what)
    return str(url)


def _uuid_of(url: Any, what: str) -> str:
    tail = str(url or "").rstrip("/").rsplit("/", 1)[-1]
    if not _UUID.match(tail):
        raise BarbicanError(f"Barbican answered without a usable {what} reference")
    return tail


def _why(answer: Any, credentials: Credentials) -> str:
    """Barbican's reason, in one line, with any credential cut out."""
    reason = ""
    try:
        body = answer.json()
        if isinstance(body, dict):
            reason = str(body.get("description") or body.get("title") or body.get("error") or "")
    except ValueError:
        reason = re.sub(r"<[^>]*>", " ", answer.text)  # an HTML error page: its words
    reason = " ".join(reason.split())[:300]
    for secret in (credentials.token,):
        if secret:
            reason = reason.replace(secret, "***")
    return f"HTTP {answer.status_code} {reason}".strip()


# ---- what keys.py opens -------------------------------------------------------------------------


def fetch(keyref: str, credentials: Credentials) -> tuple[dict[int, bytes], bytes | None]:
    """The container's master key versions and the signing seed (None when it has none)."""
    ref = parse(keyref)
    client = Client(ref, credentials)
    members = client.named()
    master: dict[int, bytes] = {}
    for name, href in members.items():
        found = _MASTER.match(str(name))
        if found:
            raw = client.payload(href, name)
            if len(raw) != 32:
                raise BarbicanError(f"{keyref}: {name} is not a 256-bit key")
            master[int(found.group(1))] = raw
    if not master:
        raise BarbicanError(f"{keyref} holds no master key (master-N); it is not a petatrain key container")
    seed = client.payload(members[SIGNING], SIGNING) if SIGNING in members else None
    return master, seed


def create(service: str, credentials: Credentials) -> str:
    """A new container at the Barbican service URL: master-1 (generated by Barbican) and a signing
    seed; its KEYREF."""
    ref = parse(service, container=False)
    client = Client(ref, credentials)
    master = client.generate_key("petatrain master-1")
    signing = client.store("petatrain signing", Ed25519PrivateKey.generate().private_bytes_raw())
    uuid = client.create_container({"master-1": master, SIGNING: signing})
    return f"{service.rstrip('/').removesuffix('/v1')}/v1/containers/{uuid}"


def add_version(keyref: str, credentials: Credentials) -> int:
    """Rotate: Barbican generates master-(N+1), which becomes primary; N+1.

    Barbican cannot add a member only if its name is free, so two rotations at once may both add
    master-(N+1). Each looks again after adding: one that finds another secret of its name takes
    its own out and tries N+2. The first to look alone keeps its version; the other then sees it."""
    client = Client(parse(keyref), credentials)
    for attempt in range(_ROTATE_TRIES):
        versions = [int(m.group(1)) for m in (_MASTER.match(name) for name, _ in client.members()) if m]
        version = max(versions, default=0) + 1
        name = f"master-{version}"
        href = client.generate_key(f"petatrain {name}")
        client.add_member(name, href)
        if [h for n, h in client.members() if n == name] == [href]:
            return version
        client.remove_member(name, href)
        client.delete_secret(href, name)
        time.sleep(random.uniform(0, 0.2 * (attempt + 1)))  # two that both stepped back try apart
    raise BarbicanError(f"{keyref}: {_ROTATE_TRIES} rotations in a row met another one at the same version")


def retire(keyref: str, keep: int, credentials: Credentials) -> list[int]:
    """Remove every master version but `keep` from the container and delete its secret; the dropped."""
    client = Client(parse(keyref), credentials)
    dropped = []
    for name, href in sorted(client.named().items()):
        found = _MASTER.match(str(name))
        if found and int(found.group(1)) != keep:
            client.remove_member(name, href)
            client.delete_secret(href, name)
            dropped.append(int(found.group(1)))
    return sorted(dropped)
