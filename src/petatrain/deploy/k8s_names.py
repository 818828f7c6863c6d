"""Kubernetes' rules for names, label keys and label values, as the API server checks them
(k8s.io/apimachinery/pkg/util/validation and pkg/api/validation/path). Each check returns the
reasons a value is invalid, [] when it is valid, with the API server's wording."""

from __future__ import annotations

import re

_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_QUALIFIED_NAME_PART = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")

DNS1123_LABEL_MAX = 63
DNS1123_SUBDOMAIN_MAX = 253
DNS1035_LABEL_MAX = 63
QUALIFIED_NAME_MAX = 63
LABEL_VALUE_MAX = 63


def _name(value: str, pattern: re.Pattern[str], limit: int, rule: str) -> list[str]:
    errs = [] if len(value) <= limit else [f"must be no more than {limit} characters"]
    if not pattern.fullmatch(value):
        errs.append(rule)
    return errs


def dns1123_label(value: str) -> list[str]:
    """IsDNS1123Label: a namespace, a worker group name under a network policy."""
    return _name(
        value, _DNS1123_LABEL, DNS1123_LABEL_MAX,
        "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
        "and must start and end with an alphanumeric character (e.g. 'my-name', or '123-abc')",
    )  # fmt: skip


def dns1123_subdomain(value: str) -> list[str]:
    """IsDNS1123Subdomain: the name of most kinds (ConfigMap, Secret, PersistentVolumeClaim, ...)."""
    return _name(
        value, _DNS1123_SUBDOMAIN, DNS1123_SUBDOMAIN_MAX,
        "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
        "and must start and end with an alphanumeric character (e.g. 'example.com')",
    )  # fmt: skip


def dns1035_label(value: str) -> list[str]:
    """IsDNS1035Label: a Service name, and KubeRay's RayCluster, RayJob and RayService names."""
    return _name(
        value, _DNS1035_LABEL, DNS1035_LABEL_MAX,
        "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an "
        "alphabetic character, and end with an alphanumeric character (e.g. 'my-name', or 'abc-123')",
    )  # fmt: skip


def path_segment_name(value: str) -> list[str]:
    """IsValidPathSegmentName: RBAC names (Role, RoleBinding, ...) may hold ':' and capitals."""
    if value in (".", ".."):
        return [f"may not be {value!r}"]
    return [f"may not contain {c!r}" for c in ("/", "%") if c in value]


def qualified_name(value: str) -> list[str]:
    """IsQualifiedName: a label or annotation key, `[prefix/]name`."""
    parts = value.split("/")
    if len(parts) > 2:
        return ["a qualified name has at most one '/', between an optional DNS subdomain prefix and the name"]
    name = parts[-1]
    errs = []
    if len(parts) == 2:
        errs += (
            [f"prefix part {e}" for e in dns1123_subdomain(parts[0])] if parts[0] else ["prefix part must be non-empty"]
        )
    if not name:
        errs.append("name part must be non-empty")
    elif len(name) > QUALIFIED_NAME_MAX:
        errs.append(f"name part must be no more than {QUALIFIED_NAME_MAX} characters")
    if name and not _QUALIFIED_NAME_PART.fullmatch(name):
        errs.append(
            "name part must consist of alphanumeric characters, '-', '_' or '.', "
            "and must start and end with an alphanumeric character"
        )
    return errs


def label_value(value: str) -> list[str]:
    """IsValidLabelValue: empty, or up to 63 characters of [-A-Za-z0-9_.] in alphanumerics."""
    return _name(
        value, _LABEL_VALUE, LABEL_VALUE_MAX,
        "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', "
        "and must start and end with an alphanumeric character",
    )  # fmt: skip
