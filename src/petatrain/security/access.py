"""Least-privilege S3 policies for the three identities a platform runs as.

- ingest writes datasets: read, write, list and delete under the datasets prefix, and read
  the sources it is given;
- train reads datasets and writes only its run prefix: read and list the datasets, read,
  write, list and delete under the run prefix; an explicit Deny keeps it from writing or
  deleting anything under the datasets prefix even if another policy would allow it;
- serve reads only committed models: the run's config.yaml, `final/` and `checkpoints/`,
  and of the datasets only what decoding needs (each manifest and tokenizer.json), never a
  shard; it writes nothing.

A policy is built as data (statements) and dumped once. With a principal (an IAM ARN, for
Ceph RGW `arn:aws:iam:::user/NAME`) it is a bucket policy for the one bucket; without, an
identity (IAM) policy to attach to the user or role. Several roles share one bucket policy:
`merge` puts their statements together, replacing those of an earlier run of the same command.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from petatrain.errors import PetatrainError

ROLES = ("ingest", "train", "serve")
Role = Literal["ingest", "train", "serve"]
VERSION = "2012-10-17"

READ = ("s3:GetObject",)
WRITE = ("s3:PutObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts")  # a multipart upload is a Put
DELETE = ("s3:DeleteObject",)
LIST = ("s3:ListBucket",)


@dataclass(frozen=True, slots=True)
class Statement:
    """One policy statement. `prefixes` limit a ListBucket to keys under them (s3:prefix)."""

    sid: str
    effect: Literal["Allow", "Deny"]
    actions: tuple[str, ...]
    resources: tuple[str, ...]
    prefixes: tuple[str, ...] = ()
    why: str = ""  # for people: what the statement is for

    def to_dict(self, principal: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {"Sid": self.sid, "Effect": self.effect}
        if principal:
            out["Principal"] = {"AWS": [principal]}
        out["Action"] = list(self.actions)
        out["Resource"] = list(self.resources)
        if self.prefixes:
            # IfExists: a HEAD or GET of a missing key is checked against ListBucket too (404 if
            # allowed, else 403), without an s3:prefix; a plain StringLike would turn every
            # "does it exist?" of petatrain into AccessDenied. Listings always carry a prefix.
            out["Condition"] = {"StringLikeIfExists": {"s3:prefix": list(self.prefixes)}}
        return out


@dataclass(frozen=True, slots=True)
class RolePolicy:
    """What one role may do in one bucket (and its sources), as policy statements."""

    role: str
    bucket: str
    principal: str
    statements: tuple[Statement, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        """The policy document (IAM policy language, version 2012-10-17)."""
        return {"Version": VERSION, "Statement": [s.to_dict(self.principal) for s in self.statements]}

    def describe(self) -> list[str]:
        """One line per statement, for people."""
        return [f"{s.effect.lower()}: {s.why}" for s in self.statements]


def policy(
    role: str,
    *,
    bucket: str,
    prefix: str = "",
    run_prefix: str = "",
    sources: tuple[str, ...] | list[str] = (),
    principal: str = "",
) -> RolePolicy:
    """The least-privilege policy of `role` in `bucket`.

    prefix: the datasets (ingest writes them, train reads them, serve reads their manifest and
    tokenizer only). run_prefix: train's run directory (or a prefix of its runs), which serve
    reads the committed models of. sources: s3:// URLs ingest reads. principal: the identity's
    ARN, which makes this a bucket policy.
    """
    if role not in ROLES:
        raise PetatrainError(f"--role {role!r}: one of {', '.join(ROLES)}")
    bucket = _bucket(bucket)
    if principal and (principal == "*" or not principal.startswith("arn:")):
        raise PetatrainError(
            f"--principal {principal!r}: the identity's ARN, e.g. arn:aws:iam::123456789012:role/train "
            "(Ceph RGW: arn:aws:iam:::user/NAME); a role policy is never for everyone"
        )
    data = _prefix(prefix, bucket, "--prefix")
    run = _prefix(run_prefix, bucket, "--run-prefix")
    if role in ("ingest", "train") and not data:
        raise PetatrainError(f"--prefix: the {role} role needs the datasets prefix, e.g. --prefix datasets/")
    if role in ("train", "serve") and not run:
        raise PetatrainError(f"--run-prefix: the {role} role needs the run's prefix, e.g. --run-prefix runs/exp1/")
    if role == "ingest" and run:
        raise PetatrainError("--run-prefix is for the train and serve roles")
    if sources and role != "ingest":
        raise PetatrainError("--source is for the ingest role")
    if data and run and (run.startswith(data) or data.startswith(run)):
        raise PetatrainError(
            f"--run-prefix {run} and --prefix {data} overlap: runs and datasets need prefixes of their own "
            "(e.g. runs/ and datasets/), else the run could overwrite the dataset"
        )
    # Sids name the role and purpose, and end in a digest of the arguments: statements of
    # another identity or prefix never collide in a merged policy, and re-running the same
    # command replaces its own.
    tag = hashlib.sha256("\0".join((role, bucket, principal, data, run, *sources)).encode()).hexdigest()[:8]

    def sid(what: str) -> str:
        return f"Petatrain{role.title()}{what}{tag}"

    statements: list[Statement] = []
    if role == "ingest":
        statements += _read_write(lambda what: sid(what + "Datasets"), bucket, data, "the datasets")
        for n, url in enumerate(sources):
            src_bucket, src_prefix = _source(url)
            if principal and src_bucket != bucket:
                raise PetatrainError(
                    f"--source {url}: not in bucket {bucket}; a bucket policy (--principal) covers its own bucket "
                    "only: leave --principal out for an identity (IAM) policy that spans buckets, or write one "
                    f"for {src_bucket}"
                )
            statements += _read(lambda what, n=n: sid(f"{what}Source{n}"), src_bucket, src_prefix, "a source")
    elif role == "train":
        statements += _read(lambda what: sid(what + "Datasets"), bucket, data, "the datasets")
        statements += _read_write(lambda what: sid(what + "Run"), bucket, run, "its run")
        statements.append(
            Statement(
                sid("DenyDatasetWrites"), "Deny", WRITE + DELETE, (_arn(bucket, data + "*"),),
                why=f"never write or delete under s3://{bucket}/{data} (the datasets), whatever else allows it",
            )
        )  # fmt: skip
    else:
        models = tuple(_arn(bucket, run + key) for key in ("config.yaml", "final/*", "checkpoints/*"))
        statements.append(
            Statement(
                sid("ReadModels"), "Allow", READ, models,
                why=f"read s3://{bucket}/{run}config.yaml, final/ and checkpoints/ (the committed models)",
            )
        )  # fmt: skip
        statements.append(
            Statement(
                sid("ListCheckpoints"), "Allow", LIST, (_arn(bucket),), (run + "checkpoints/", run + "checkpoints/*"),
                why=f"list s3://{bucket}/{run}checkpoints/ (to find the latest committed one)",
            )
        )  # fmt: skip
        if data:
            names = ("manifest.json", "versions/*", "tokenizer.json")  # a run names its dataset's version
            decoding = tuple(_arn(bucket, data + "*_index/" + name) for name in names)
            statements.append(
                Statement(
                    sid("ReadTokenizer"), "Allow", READ, decoding,
                    why=f"read the manifests and tokenizer.json of datasets under s3://{bucket}/{data} (no shard)",
                )
            )  # fmt: skip
        statements.append(
            Statement(
                sid("DenyWrites"), "Deny", WRITE + DELETE, (_arn(bucket, "*"),),
                why=f"never write or delete anything in s3://{bucket}, whatever else allows it",
            )
        )  # fmt: skip
    return RolePolicy(role=role, bucket=bucket, principal=principal, statements=tuple(statements))


def merge(existing: dict[str, Any], added: dict[str, Any]) -> dict[str, Any]:
    """`existing` policy with `added`'s statements; those with a Sid `added` has are replaced."""
    if not isinstance(existing, dict) or "Statement" not in existing:
        raise PetatrainError("the policy to merge into is not a policy document (no Statement)")
    old = existing["Statement"]
    old = [old] if isinstance(old, dict) else list(old)
    new_sids = {s.get("Sid") for s in added["Statement"]}
    kept = [s for s in old if not (isinstance(s, dict) and s.get("Sid") in new_sids)]
    return {**existing, "Version": existing.get("Version", VERSION), "Statement": kept + list(added["Statement"])}


def dumps(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2)


def _read(sid: Any, bucket: str, prefix: str, what: str) -> list[Statement]:
    return [
        Statement(
            sid("List"), "Allow", LIST, (_arn(bucket),), _listed(prefix),
            why=f"list s3://{bucket}/{prefix} ({what})",
        ),
        Statement(
            sid("Read"), "Allow", READ, (_arn(bucket, prefix + "*"),), why=f"read s3://{bucket}/{prefix}* ({what})"
        ),
    ]  # fmt: skip


def _read_write(sid: Any, bucket: str, prefix: str, what: str) -> list[Statement]:
    return [
        Statement(
            sid("List"), "Allow", LIST, (_arn(bucket),), _listed(prefix),
            why=f"list s3://{bucket}/{prefix} ({what})",
        ),
        Statement(
            sid("ReadWrite"), "Allow", READ + WRITE + DELETE, (_arn(bucket, prefix + "*"),),
            why=f"read, write and delete s3://{bucket}/{prefix}* ({what})",
        ),
        # Ceph RGW (Pacific) lets a multi-object delete (DeleteObjects) in only when DeleteObject
        # is allowed on the bucket itself, then checks every object against the statements as
        # usual; on AWS an object action on a bucket ARN matches nothing.
        Statement(
            sid("MultiDelete"), "Allow", DELETE, (_arn(bucket),),
            why=f"send multi-object deletes to s3://{bucket} (each object is checked as above)",
        ),
    ]  # fmt: skip


def _listed(prefix: str) -> tuple[str, ...]:
    # s3fs lists "p/" for folder p, and the folder's own key without its slash when it checks
    # whether a path is a folder
    return (prefix.rstrip("/"), prefix + "*") if prefix else ("*",)


def _arn(bucket: str, key: str = "") -> str:
    return f"arn:aws:s3:::{bucket}/{key}" if key else f"arn:aws:s3:::{bucket}"


def _bucket(bucket: str) -> str:
    name = bucket.removeprefix("s3://").strip("/")
    if not name or "/" in name or "*" in name:
        raise PetatrainError(f"--bucket {bucket!r}: a bucket name (my-bucket), not a path")
    return name


def _prefix(prefix: str, bucket: str, flag: str) -> str:
    """A key prefix, without a leading slash, ending in one ('' stays '')."""
    text = prefix.strip()
    if text.startswith("s3://"):
        in_bucket, _, text = text[len("s3://") :].partition("/")
        if in_bucket != bucket:
            raise PetatrainError(f"{flag} {prefix}: not in bucket {bucket}")
    text = text.strip("/")
    if any(ch in text for ch in "?[]"):
        raise PetatrainError(f"{flag} {prefix!r}: a key prefix, e.g. datasets/ (only * may stand for a name)")
    return f"{text}/" if text else ""


def _source(url: str) -> tuple[str, str]:
    """(bucket, key prefix) that a source URL or glob reads under."""
    if not url.startswith("s3://"):
        raise PetatrainError(f"--source {url!r}: an s3:// URL (local sources need no bucket policy)")
    bucket, _, key = url[len("s3://") :].partition("/")
    for i, ch in enumerate(key):
        if ch in "*?[":
            key = key[:i]
            break
    return _bucket(bucket), key
