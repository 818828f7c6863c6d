"""Offline validation of Kubernetes manifests (`petatrain deploy k8s --validate DIR`): what
`kubectl apply --validate=strict` and the KubeRay operator would refuse, found without a cluster.

- KubeRay's RayCluster, RayJob and RayService (`ray.io/v1`) are checked against petatrain's own
  schema of the KubeRay v1.7.0 API (kuberay_schema, written from its Go API types; pod templates
  and the other Kubernetes types they embed against Kubernetes' own definitions), then against
  the operator's own rules (kuberay_rules, ported from its v1.7.0 Go code). PodMonitor
  (`monitoring.coreos.com/v1`, prometheus-operator v0.93.0) and KEDA's ScaledObject
  (`keda.sh/v1alpha1`, KEDA v2.20.2) are checked the same way, for the fields petatrain writes.
- The real CRDs are used instead when given: `crds` names a file or a directory of
  CustomResourceDefinition YAML (one CRD per document, or `kind: List` documents of CRDs), and
  falls back to the environment variable PETATRAIN_K8S_CRDS. Get them from the cluster the
  manifests are meant for with

      kubectl get crd rayclusters.ray.io rayjobs.ray.io rayservices.ray.io \
          podmonitors.monitoring.coreos.com scaledobjects.keda.sh -o yaml > crds.yaml

  Every kind that has a CRD there is checked against it (any version it serves, `ray.io/v1alpha1`
  included); the others keep the built-in schemas. A CRD version's openAPIV3Schema is read as the
  API server reads it: fields set to null are dropped and its defaults applied first, fields it
  does not declare are errors, and its x-kubernetes-int-or-string, nullable,
  x-kubernetes-preserve-unknown-fields, x-kubernetes-list-type and the CEL rules of these CRDs
  (x-kubernetes-validations, ported to Python in _CEL_RULES; other rules are not checked) are
  honoured. The built-in schemas are read the same way.
- Built-in kinds (ConfigMap, Secret, Service, PersistentVolumeClaim, Role, ...) are checked
  against the strict JSON schemas that the kubernetes-validate package ships for Kubernetes
  KUBERNETES_VERSION, the version of k8s.io/api that KubeRay v1.7.0 is built with. The package's
  own validate() stops at the first error and re-reads its 1.5 MB of definitions for every
  document, so its schema files are read here once and every error is reported.
- Every document's metadata: a name that is valid for its kind, the namespace, label keys and
  values, and (for the custom kinds, whose schemas leave metadata open) the ObjectMeta schema.

Each problem is one line, `FILE: KIND/NAME: PATH: MESSAGE`, with PATH in the document as
`spec.workerGroupSpecs[0].minReplicas`. Nothing here reaches the network.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import reprlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from referencing import Registry, Resource

from petatrain import constants
from petatrain.config.loading import bounded_yaml
from petatrain.deploy import k8s_names, kuberay_rules, kuberay_schema
from petatrain.deploy.kuberay_rules import Finding
from petatrain.errors import PetatrainError

KUBERAY_VERSION = kuberay_schema.KUBERAY_VERSION
KUBERNETES_VERSION = "v1.36.0"
CRDS_ENV = "PETATRAIN_K8S_CRDS"

_K8S_SCHEMAS = resources.files("kubernetes_validate") / "kubernetes-json-schema" / f"{KUBERNETES_VERSION}-local-strict"
_K8S_DEFINITIONS = kuberay_schema.K8S_DEFINITIONS
_KUBERAY_KINDS = ("RayCluster", "RayJob", "RayService")

# The CEL rules (x-kubernetes-validations) of the built-in schemas and of the KubeRay v1.7.0,
# prometheus-operator v0.93.0 and KEDA v2.20.2 CRDs, as Python. Rules that compare with oldSelf
# only apply to updates and are skipped, as are rules missing here (a CRD of another release may
# carry some).
_CEL_RULES: dict[str, Callable[[Any], bool]] = {
    "self in ['ray.io/kuberay-operator', 'kueue.x-k8s.io/multikueue']": lambda s: (
        s in ("ray.io/kuberay-operator", "kueue.x-k8s.io/multikueue")
    ),
    "!((has(self.onSuccess) || has(self.onFailure)) && has(self.deletionRules))": lambda s: (
        not ((_has(s, "onSuccess") or _has(s, "onFailure")) and _has(s, "deletionRules"))
    ),
    "((has(self.onSuccess) && has(self.onFailure)) || has(self.deletionRules))": lambda s: (
        (_has(s, "onSuccess") and _has(s, "onFailure")) or _has(s, "deletionRules")
    ),
    "!(has(self.jobStatus) && has(self.jobDeploymentStatus))": lambda s: (
        not (_has(s, "jobStatus") and _has(s, "jobDeploymentStatus"))
    ),
    "has(self.jobStatus) || has(self.jobDeploymentStatus)": lambda s: (
        _has(s, "jobStatus") or _has(s, "jobDeploymentStatus")
    ),
    "!has(self.minReplicaCount) || self.minReplicaCount <= (has(self.maxReplicaCount) ? self.maxReplicaCount : 100)": (
        lambda s: not _has(s, "minReplicaCount") or s["minReplicaCount"] <= s.get("maxReplicaCount", 100)
    ),
}


def validate_documents(docs: list[Any], source: str = "", crds: str | None = None) -> list[str]:
    """Every problem in these manifests, one line each; [] when all valid. `crds`: a file or a
    directory of CustomResourceDefinitions to check custom kinds against (default: the
    environment variable PETATRAIN_K8S_CRDS; without either, the built-in schemas)."""
    crds = _crds_path(crds)
    lines = []
    for number, doc in enumerate(docs, start=1):
        if doc is None:  # an empty document between two '---'
            continue
        label, findings = _check_document(doc, number, crds)
        lines += [_line(source, label, path, message) for path, message in dict.fromkeys(findings)]
    return lines


def validate_file(path: str, crds: str | None = None) -> list[str]:
    """Every problem in a YAML file of one or more documents ('---'), one line each."""
    crds = _crds_path(crds)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return [f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}"]
    return _validate_text(text, path, crds)


def validate_dir(path: str, crds: str | None = None) -> list[str]:
    """Every problem in every *.yaml and *.yml under path (sorted; named relative to path)."""
    crds = _crds_path(crds)
    if crds is not None:
        _given_crds(crds)  # a bad CRD path is refused before any manifest is read
    root = Path(path)
    if not root.is_dir():
        raise PetatrainError(f"{path}: not a directory of Kubernetes manifests")
    files = sorted(p for p in root.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())
    if not files:
        raise PetatrainError(f"{path}: holds no *.yaml or *.yml files to validate")
    lines = []
    for file in files:
        source = file.relative_to(root).as_posix()
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            lines.append(f"{source}: cannot read: {getattr(exc, 'strerror', None) or exc}")
            continue
        lines += _validate_text(text, source, crds)
    return lines


def _crds_path(crds: str | None) -> str | None:
    return crds or os.environ.get(CRDS_ENV) or None


# --- reading YAML ----------------------------------------------------------------------------

_BaseLoader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _ManifestLoader(_BaseLoader):
    """PyYAML's safe loader that notes duplicate keys (YAML keeps the last silently; kubectl's
    strict validation refuses them) and reads timestamps as strings, as Kubernetes' reader does."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.duplicates: list[tuple[int, str]] = []

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if (key_node.tag, key_node.value) in seen:
                    self.duplicates.append((key_node.start_mark.line + 1, key_node.value))
                seen.add((key_node.tag, key_node.value))
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
        return mapping


_ManifestLoader.add_constructor("tag:yaml.org,2002:timestamp", _ManifestLoader.construct_yaml_str)


def _validate_text(text: str, source: str, crds: str | None) -> list[str]:
    refused = bounded_yaml(text)
    if refused:
        return [f"{source}: {refused}"]
    loader = _ManifestLoader(text)
    docs: list[Any] = []
    broken = None
    try:
        while loader.check_data():
            docs.append(loader.get_data())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        reason = getattr(exc, "problem", None) or str(exc)
        broken = f"{source}: invalid YAML{where}: {' '.join(str(reason).split())}"
    finally:
        loader.dispose()
    lines = [
        f"{source}: line {line}: duplicate key {key!r} (only the last one would be kept)"
        for line, key in loader.duplicates
    ]
    lines += validate_documents(docs, source, crds)
    return [*lines, broken] if broken else lines


# --- one document -----------------------------------------------------------------------------


def _check_document(doc: Any, number: int, crds: str | None) -> tuple[str, list[Finding]]:
    """(how the problem lines name the document, its findings)."""
    if not isinstance(doc, dict):
        return f"document {number}", [((), f"a YAML {type(doc).__name__}, not a mapping with apiVersion and kind")]
    kind, api_version = doc.get("kind"), doc.get("apiVersion")
    meta = doc.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    what = kind if isinstance(kind, str) and kind else "document"
    label = f"{what}/{name}" if isinstance(name, str) and name else f"{what} (document {number})"
    missing = [field for field in ("apiVersion", "kind") if not isinstance(doc.get(field), str) or not doc.get(field)]
    if missing:
        return label, [((), f"{' and '.join(missing)} missing: every manifest names its apiVersion and kind")]
    assert isinstance(api_version, str) and isinstance(kind, str)
    group, _, version = api_version.rpartition("/")

    custom = _custom_resource(crds, group, version, kind)
    if isinstance(custom, str):
        return label, [(("apiVersion",), custom)]
    if custom is not None:
        doc = copy.deepcopy(doc)
        _apply_defaults(doc, custom.openapi, custom.resolve)
        schema_findings = [*_schema_findings(custom.validator, doc), *_negative_quantities(doc)]
        findings = [*_metadata(doc, kind, _object_meta_validator()), *schema_findings]
        if group == "ray.io":
            findings += kuberay_rules.check_metadata(doc)
            if not schema_findings:  # the operator's rules read typed fields: only a schema-valid spec gets them
                findings += kuberay_rules.check_spec(doc)
        return label, findings

    builtin = _builtin_validator(group, version, kind)
    if builtin is None:
        custom_kinds = {*kuberay_schema.SCHEMAS, *(_given_crds(crds) if crds is not None else ())}
        known = ", ".join(f"{g}/{k}" for g, k in sorted(custom_kinds))
        return label, [
            (
                ("kind",),
                f"unknown kind {kind} in {api_version}: not a Kubernetes {KUBERNETES_VERSION} kind, nor one of {known}",
            )
        ]
    findings = [*_metadata(doc, kind, None), *_schema_findings(builtin, doc), *_negative_quantities(doc)]
    return label, findings + _carried_rayjob(doc, number, crds) if kind == "ConfigMap" else findings


def _carried_rayjob(config_map: dict[str, Any], number: int, crds: str | None) -> list[Finding]:
    """The RayJob a loop's ConfigMap carries for a Kubeflow pipeline to create (`deploy k8s --loop
    --cron kfp`), checked as the manifest it becomes: its problems under `data.train-rayjob.yaml`."""
    data = config_map.get("data")
    text = data.get(constants.KFP_RAYJOB_KEY) if isinstance(data, dict) else None
    if not isinstance(text, str):
        return []
    where: tuple[str | int, ...] = ("data", constants.KFP_RAYJOB_KEY)
    if refused := bounded_yaml(text):
        return [(where, refused)]
    try:
        carried = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        return [(where, f"invalid YAML: {' '.join(str(getattr(exc, 'problem', None) or exc).split())}")]
    if not isinstance(carried, dict) or carried.get("kind") != "RayJob":
        return [(where, "must hold a RayJob (the train step's, which the pipeline creates)")]
    _, findings = _check_document(carried, number, crds)
    return [((*where, *path), message) for path, message in findings]


def _negative_quantities(doc: Any, path: tuple[str | int, ...] = ()) -> Iterable[Finding]:
    """A container's resource requests and limits are never negative (ValidateNonnegativeQuantity): the
    API server refuses the pod, or, in a template a custom resource embeds, the operator's pods."""
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key in ("requests", "limits") and path[-1:] == ("resources",) and isinstance(value, dict):
                for name, amount in value.items():
                    if str(amount).strip().startswith("-"):
                        yield (*path, key, name), f"{_short(amount)}: must be greater than or equal to 0"
            else:
                yield from _negative_quantities(value, (*path, key))
    elif isinstance(doc, list):
        for i, item in enumerate(doc):
            yield from _negative_quantities(item, (*path, i))


def _metadata(doc: Mapping[str, Any], kind: str, object_meta: jsonschema.protocols.Validator | None) -> list[Finding]:
    """The API server's checks of metadata; `object_meta` for kinds whose own schema leaves it open."""
    meta = doc.get("metadata")
    if meta is None:
        return [(("metadata",), "required field is missing")]
    if not isinstance(meta, dict):
        return [(("metadata",), f"{_short(meta)} is not of type 'object'")]
    findings = _schema_findings(object_meta, meta, ("metadata",)) if object_meta is not None else []
    name = meta.get("name")
    if name is None or name == "":
        findings.append((("metadata", "name"), "required field is missing"))
    elif isinstance(name, str) and kind not in _KUBERAY_KINDS:  # kuberay_rules checks those more strictly
        findings += [
            (("metadata", "name"), f"{name!r} is not a valid {kind} name: {e}") for e in _name_rule(kind)(name)
        ]
    namespace = meta.get("namespace")
    if isinstance(namespace, str):
        findings += [(("metadata", "namespace"), f"{namespace!r}: {e}") for e in k8s_names.dns1123_label(namespace)]
    for field in ("labels", "annotations"):
        entries = meta.get(field)
        if not isinstance(entries, dict):
            continue
        for key, value in entries.items():
            key = str(key)
            findings += [(("metadata", field, key), f"invalid key: {e}") for e in k8s_names.qualified_name(key)]
            if field == "labels" and isinstance(value, str):
                findings += [
                    (("metadata", field, key), f"invalid value {value!r}: {e}") for e in k8s_names.label_value(value)
                ]
    return findings


def _name_rule(kind: str) -> Callable[[str], list[str]]:
    # pkg/apis/core/validation and rbac/validation: which name rule each kind's validation uses
    if kind == "Service":
        return k8s_names.dns1035_label
    if kind == "Namespace":
        return k8s_names.dns1123_label
    if kind in ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"):
        return k8s_names.path_segment_name
    return k8s_names.dns1123_subdomain


# --- CRD schemas ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _CustomResource:
    """One served version of a custom kind: its schema as written (for defaults) and as JSON Schema."""

    openapi: Mapping[str, Any]
    validator: jsonschema.protocols.Validator
    resolve: Callable[[str], Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class _CRD:
    """A CustomResourceDefinition given in `crds`: its name, where it was read, and the
    openAPIV3Schema of each version it serves."""

    name: str
    file: str
    versions: Mapping[str, Mapping[str, Any]]


@cache
def _given_crds(path: str) -> dict[tuple[str, str], _CRD]:
    """(group, kind) → its CRD, from a file or a directory (*.yaml, *.yml, *.json) of
    CustomResourceDefinitions, one a document or in `kind: List` documents (`kubectl get crd ...
    -o yaml`). Refuses what is not a CRD: a wrong path must not quietly mean the built-in schemas."""
    root = Path(path)
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.suffix in (".yaml", ".yml", ".json") and p.is_file())
    elif root.is_file():
        files = [root]
    else:
        raise PetatrainError(f"{path}: no such file or directory of CustomResourceDefinitions ({CRDS_ENV})")
    found: dict[tuple[str, str], _CRD] = {}
    for file in files:
        try:
            docs = list(yaml.load_all(file.read_text(encoding="utf-8"), Loader=_BaseLoader))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            reason = getattr(exc, "strerror", None) or " ".join(str(exc).split())
            raise PetatrainError(f"{file}: cannot read CustomResourceDefinitions: {reason}") from exc
        for number, doc in enumerate(docs, start=1):
            if doc is None:
                continue
            listed = isinstance(doc, dict) and str(doc.get("kind", "")).endswith("List") and "items" in doc
            for item in (doc.get("items") or []) if listed else [doc]:
                crd = _read_crd(item, f"{file}: document {number}")
                key = (crd["spec"]["group"], crd["spec"]["names"]["kind"])
                if key in found:
                    raise PetatrainError(f"{file}: {key[1]}.{key[0]} is defined again (first in {found[key].file})")
                versions = {
                    v["name"]: v["schema"]["openAPIV3Schema"]
                    for v in crd["spec"]["versions"]
                    if v.get("served") and isinstance((v.get("schema") or {}).get("openAPIV3Schema"), dict)
                }
                found[key] = _CRD(name=crd["metadata"]["name"], file=str(file), versions=versions)
    if not found:
        raise PetatrainError(f"{path}: holds no CustomResourceDefinition ({CRDS_ENV})")
    return found


def _read_crd(item: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(item, dict) or item.get("kind") != "CustomResourceDefinition":
        what = item.get("kind") if isinstance(item, dict) else type(item).__name__
        raise PetatrainError(f"{where}: a {what}, not a CustomResourceDefinition")
    if item.get("apiVersion") != "apiextensions.k8s.io/v1":
        version = item.get("apiVersion")
        raise PetatrainError(f"{where}: a CustomResourceDefinition of {version}, not apiextensions.k8s.io/v1")
    try:
        item["metadata"]["name"], item["spec"]["group"], item["spec"]["names"]["kind"]
        iter(item["spec"]["versions"])
    except (KeyError, TypeError) as exc:
        raise PetatrainError(f"{where}: a CustomResourceDefinition without {exc}") from exc
    return item


@cache
def _custom_resource(crds: str | None, group: str, version: str, kind: str) -> _CustomResource | str | None:
    """The schema for this apiVersion and kind: its CRD in `crds`, else the built-in one; a problem
    when the kind is known but not in this version; None for a kind neither has."""
    given = _given_crds(crds).get((group, kind)) if crds is not None else None
    if given is not None:
        versions, registry, resolve = given.versions, None, _no_refs
        where = f"the CRD {given.name} in {given.file} serves {', '.join(versions)}"
    elif (group, kind) in kuberay_schema.SCHEMAS:
        versions, registry, resolve = kuberay_schema.SCHEMAS[(group, kind)], _embedded_registry(), _embedded_definition
        where = (
            f"petatrain's built-in schema, from {kuberay_schema.SOURCES[group]}, covers {group}/"
            f"{', '.join(versions)}; give the cluster's CRDs ({CRDS_ENV}) to check others"
        )
    else:
        return None
    if version not in versions:
        return f"{kind} is not served as {group}/{version} ({where})"
    openapi = versions[version]
    schema = _json_schema(openapi)
    schema["properties"]["metadata"] = {"type": "object"}  # checked against ObjectMeta in _metadata
    validator = (
        _CRDValidator(schema, format_checker=_INTEGER_FORMATS)
        if registry is None
        else _CRDValidator(schema, registry=registry, format_checker=_INTEGER_FORMATS)
    )
    return _CustomResource(openapi=openapi, validator=validator, resolve=resolve)


# Keys of an OpenAPI v3 (CRD) schema node that JSON Schema does not validate with.
_NOT_VALIDATING = {
    "description",
    "default",
    "example",
    "externalDocs",
    "format",
    "nullable",
    "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-embedded-resource",
    "x-kubernetes-map-type",
}


def _json_schema(node: Mapping[str, Any]) -> dict[str, Any]:
    """A CRD's structural OpenAPI v3 schema as JSON Schema (draft 7), read as the API server reads it."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: _json_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = _json_schema(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [_json_schema(sub) for sub in value]
        elif key not in _NOT_VALIDATING or (key == "format" and value in ("int32", "int64")):
            out[key] = value  # an integer's format bounds it (_INTEGER_FORMATS)
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable"):
        if "anyOf" in out:
            out["anyOf"] = [*out["anyOf"], {"type": "null"}]
        if "type" in out:
            out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    # Unknown fields are pruned by the API server and refused by strict field validation: an object
    # is closed unless it says otherwise.
    open_ended = node.get("x-kubernetes-preserve-unknown-fields") or node.get("x-kubernetes-embedded-resource")
    if node.get("type") == "object" and "additionalProperties" not in node and not open_ended:
        out["additionalProperties"] = False
    return out


def _apply_defaults(instance: Any, node: Mapping[str, Any], resolve: Callable[[str], Mapping[str, Any]]) -> None:
    """The API server's pruning of nulls and defaulting, before it validates: a field or a map
    value set to null is dropped unless its schema is nullable or has a default, and a missing
    (or null) field whose schema has a default gets it, at every level that is present (so
    `required` fields with defaults may be left out). `resolve` reads a `$ref`."""
    while "$ref" in node:
        node = resolve(node["$ref"])
    if isinstance(instance, dict):
        properties = node.get("properties") or {}
        extra = node.get("additionalProperties")
        for name in list(instance):
            sub = properties.get(name, extra if isinstance(extra, dict) else None)
            if instance[name] is None and sub is not None:
                while "$ref" in sub:
                    sub = resolve(sub["$ref"])
                if "default" in sub:
                    instance[name] = copy.deepcopy(sub["default"])
                elif not sub.get("nullable"):
                    del instance[name]
        for name, sub in properties.items():
            if name not in instance and "default" in sub:
                instance[name] = copy.deepcopy(sub["default"])
        for name, value in instance.items():
            sub = properties.get(name, extra if isinstance(extra, dict) else None)
            if sub is not None:
                _apply_defaults(value, sub, resolve)
    elif isinstance(instance, list) and isinstance(node.get("items"), dict):
        for item in instance:
            _apply_defaults(item, node["items"], resolve)


def _no_refs(ref: str) -> Mapping[str, Any]:
    raise AssertionError(f"a CRD's schema has no $ref, got {ref}")


def _has(obj: Any, field: str) -> bool:
    """CEL's has(self.field) on an object."""
    return isinstance(obj, dict) and obj.get(field) is not None


def _cel_rules(
    validator: jsonschema.protocols.Validator, rules: list[Mapping[str, Any]], instance: Any, schema: Mapping[str, Any]
) -> Iterator[jsonschema.ValidationError]:
    for rule in rules:
        check = _CEL_RULES.get(rule["rule"])
        try:
            failed = check is not None and not check(instance)
        except TypeError:  # a field of the wrong type, reported by the schema: CEL would not run either
            continue
        if failed:
            yield jsonschema.ValidationError(rule.get("message") or f"failed rule: {rule['rule']}")


def _list_type(
    validator: jsonschema.protocols.Validator, list_type: str, instance: Any, schema: Mapping[str, Any]
) -> Iterator[jsonschema.ValidationError]:
    """x-kubernetes-list-type: a 'set' holds no item twice, a 'map' no two items with the same keys."""
    if not isinstance(instance, list) or list_type not in ("set", "map"):
        return
    keys = schema.get("x-kubernetes-list-map-keys") or []
    seen: set[str] = set()
    for i, item in enumerate(instance):
        if list_type == "map" and not isinstance(item, dict):
            continue
        identity = {k: item.get(k) for k in keys} if list_type == "map" else item
        token = json.dumps(identity, sort_keys=True, default=str)
        if token in seen:
            shown = ", ".join(f"{k}={v!r}" for k, v in identity.items()) if list_type == "map" else _short(item)
            yield jsonschema.ValidationError(f"duplicate entry ({shown})", path=[i])
        seen.add(token)


# An integer's `format` bounds it as the API server decodes it (an int32 field of 10^10 is refused);
# other formats are left to the API server.
_INTEGER_FORMATS = jsonschema.FormatChecker(formats=())


@_INTEGER_FORMATS.checks("int32")
def _int32(value: Any) -> bool:
    return not isinstance(value, int) or isinstance(value, bool) or -(2**31) <= value < 2**31


@_INTEGER_FORMATS.checks("int64")
def _int64(value: Any) -> bool:
    return not isinstance(value, int) or isinstance(value, bool) or -(2**63) <= value < 2**63


_CRDValidator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    {"x-kubernetes-validations": _cel_rules, "x-kubernetes-list-type": _list_type},
)


# --- built-in kinds ---------------------------------------------------------------------------


@cache
def _k8s_definitions() -> dict[str, Any]:
    definitions: dict[str, Any] = json.loads((_K8S_SCHEMAS / "_definitions.json").read_text(encoding="utf-8"))
    return definitions


@cache
def _k8s_registry() -> Registry:
    return Registry().with_resource(_K8S_DEFINITIONS, Resource.from_contents(_k8s_definitions()))


@cache
def _embedded_definitions() -> dict[str, Any]:
    """Kubernetes' definitions as a CRD embeds them, for the built-in schemas' `$ref`s."""
    definitions = _k8s_definitions()
    return {**definitions, "$defs": kuberay_schema.embedded_kubernetes_definitions(definitions["$defs"])}


@cache
def _embedded_registry() -> Registry:
    return Registry().with_resource(_K8S_DEFINITIONS, Resource.from_contents(_embedded_definitions()))


def _embedded_definition(ref: str) -> Mapping[str, Any]:
    """The definition a `$ref` of a built-in schema (or of a definition) names."""
    base, _, name = ref.partition("#/$defs/")
    if base not in ("", _K8S_DEFINITIONS) or not name:
        raise AssertionError(f"not a reference to a Kubernetes definition: {ref}")
    definition: Mapping[str, Any] = _embedded_definitions()["$defs"][name]
    return definition


@cache
def _builtin_validator(group: str, version: str, kind: str) -> jsonschema.protocols.Validator | None:
    """kubernetes-validate's strict schema for a built-in kind; None when Kubernetes has no such kind.
    Its files are named `{kind}-{first part of the group}-{version}.json`, so the group-version-kind
    the schema declares is compared too (`rbac.example.com/v1` is not `rbac.authorization.k8s.io/v1`)."""
    prefix = f"{kind.lower()}-{group.split('.')[0]}" if group else kind.lower()
    file = _K8S_SCHEMAS / f"{prefix}-{version}.json"
    if not file.is_file():
        return None
    schema = json.loads(file.read_text(encoding="utf-8"))
    if {"group": group, "version": version, "kind": kind} not in schema.get("x-kubernetes-group-version-kind", []):
        return None
    registry = _k8s_registry().with_resource(schema["$id"], Resource.from_contents(schema))
    return jsonschema.Draft202012Validator(schema, registry=registry, format_checker=_INTEGER_FORMATS)


@cache
def _object_meta_validator() -> jsonschema.protocols.Validator:
    schema = {"$ref": f"{_K8S_DEFINITIONS}#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
    return jsonschema.Draft202012Validator(schema, registry=_k8s_registry())


# --- from schema errors to lines --------------------------------------------------------------


def _schema_findings(
    validator: jsonschema.protocols.Validator, instance: Any, prefix: tuple[str | int, ...] = ()
) -> list[Finding]:
    return [finding for error in validator.iter_errors(instance) for finding in _explain(error, prefix)]


def _explain(error: jsonschema.ValidationError, prefix: tuple[str | int, ...]) -> Iterable[Finding]:
    """One schema error as findings whose path ends at the field concerned."""
    path = (*prefix, *error.absolute_path)
    schema = error.schema if isinstance(error.schema, dict) else {}
    if error.validator == "additionalProperties" and error.validator_value is False:
        known = list(schema.get("properties") or {})
        for key in error.instance:
            if key not in known:
                hint = difflib.get_close_matches(str(key), known, n=1)
                if hint:
                    yield (*path, key), f"unknown field (did you mean {hint[0]!r}?)"
                elif schema.get("x-petatrain-partial"):
                    yield (
                        (*path, key),
                        (
                            "unknown field: petatrain's built-in schema covers only the fields petatrain writes here; "
                            f"give the cluster's CRDs ({CRDS_ENV}) to check the others"
                        ),
                    )
                else:
                    yield (*path, key), "unknown field"
    elif error.validator == "required":
        for name in error.validator_value:
            if name not in error.instance:
                yield (*path, name), "required field is missing"
    elif error.validator == "type":
        yield path, f"{_short(error.instance)} is not of type {_type_names(error.validator_value)}"
    elif error.validator == "format" and error.validator_value in ("int32", "int64"):
        yield path, f"{_short(error.instance)} is beyond an {error.validator_value}'s range"
    elif error.validator == "pattern" and error.validator_value == kuberay_schema.QUANTITY_PATTERN:
        yield path, f"{_short(error.instance)} is not a quantity (such as 500m, 2Gi, 1.5 or 1e3)"
    elif error.validator in ("anyOf", "oneOf") and all(set(s) == {"type"} for s in error.validator_value):
        types = [t for s in error.validator_value for t in ([s["type"]] if isinstance(s["type"], str) else s["type"])]
        yield path, f"{_short(error.instance)} is not of type {_type_names(types)}"
    else:
        yield path, " ".join(error.message.split())


def _type_names(types: str | list[str]) -> str:
    names = [types] if isinstance(types, str) else [t for t in dict.fromkeys(types) if t != "null"]
    return " or ".join(repr(t) for t in names)


_REPR = reprlib.Repr()
_REPR.maxstring = 80
_REPR.maxother = 80


def _short(value: Any) -> str:
    return _REPR.repr(value)


def _line(source: str, label: str, path: tuple[str | int, ...], message: str) -> str:
    parts = [source] if source else []
    parts.append(label)
    if path:
        parts.append(_format_path(path))
    parts.append(" ".join(message.split()))
    return ": ".join(parts)


def _format_path(path: Iterable[str | int]) -> str:
    """spec.workerGroupSpecs[0].rayStartParams.num-cpus, metadata.labels["ray.io/node-type"]."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part and all(c.isalnum() or c in "-_" for c in part):
            out += f".{part}" if out else part
        else:
            out += f"[{json.dumps(part)}]"
    return out
