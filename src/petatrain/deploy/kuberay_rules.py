"""The checks the KubeRay operator makes in Go that its CRDs' schemas cannot express.

Ported from ray-operator/controllers/ray/utils/validation.go (and the worker-group check of
ray-operator/pkg/webhooks/v1/raycluster_webhook.go) at KubeRay v1.7.0, commit
59d663aeec13760646da3db9c1cf8cfe883e30b7; each rule names the Go function it comes from.

Differences from the operator, on purpose:
- The operator stops at the first failed check and records it in an event; here every failed
  check is returned.
- Each function takes a document that already passed its schema (built-in or CRD), with the
  schema's defaults applied as the API server applies them, so every field present has its
  declared type.
- Checks that need the live cluster are not ported: status checks (ValidateRayClusterStatus,
  ValidateRayJobStatus), cert-manager being installed, the RayCluster a clusterSelector names
  existing, and RayCronJob (behind the RayCronJob feature gate, off in v1.7.0).
- Feature gates are read from FEATURE_GATES, the defaults of KubeRay v1.7.0's
  pkg/features/features.go: an operator started with other --feature-gates accepts more.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import yaml

from petatrain.deploy import k8s_names

Path = tuple[str | int, ...]
Finding = tuple[Path, str]

# pkg/features/features.go defaultFeatureGates at v1.7.0.
FEATURE_GATES: Mapping[str, bool] = {
    "RayClusterStatusConditions": True,
    "RayJobDeletionPolicy": True,
    "RayMultiHostIndexing": True,
    "RayServiceIncrementalUpgrade": True,
    "RayCronJob": False,
    "SidecarSubmitterRestart": False,
    "RayClusterNetworkPolicy": False,
    "GCSFaultToleranceEmbeddedStorage": False,
    "RayClusterMTLS": False,
    "RayClusterHistoryServer": False,
    "KubernetesWAS": False,
}

# controllers/ray/utils/constant.go
MAX_RAY_CLUSTER_NAME_LENGTH = 53
MAX_RAY_SERVICE_NAME_LENGTH = MAX_RAY_CLUSTER_NAME_LENGTH - 6
MAX_RAY_JOB_NAME_LENGTH = MAX_RAY_CLUSTER_NAME_LENGTH - 6
_FT_ENABLED_ANNOTATION = "ray.io/ft-enabled"
_EXTERNAL_STORAGE_NS_ANNOTATION = "ray.io/external-storage-namespace"
_INITIALIZING_TIMEOUT_ANNOTATION = "ray.io/initializing-timeout"
_ORIGINATED_FROM_CRD_LABEL = "ray.io/originated-from-crd"
_CLUSTER_SELECTOR_KEY = "ray.io/cluster"
_RAY_REDIS_ADDRESS = "RAY_REDIS_ADDRESS"
_REDIS_PASSWORD = "REDIS_PASSWORD"
_REDIS_USERNAME = "REDIS_USERNAME"
_RAY_GCS_STORAGE = "RAY_gcs_storage"
_RAY_GCS_STORAGE_PATH = "RAY_gcs_storage_path"
_GCS_STORAGE_VOLUME = "gcs-storage"
_GCS_STORAGE_MOUNT_PATH = "/data/gcs"
_RAY_ENABLE_AUTOSCALER_V2 = "RAY_enable_autoscaler_v2"
_KUBERAY_GEN_AUTOSCALER_START_CMD = "KUBERAY_GEN_AUTOSCALER_START_CMD"
_TLS_ENV_VARS = ("RAY_USE_TLS", "RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")
_TLS_VOLUME = "ray-tls"
_TLS_MOUNT_PATH = "/etc/ray/tls"
_COLLECTOR_CONTAINER = "ray-history-collector"
_COLLECTOR_MANAGED_ENV = (
    "POD_IP",
    "FQ_RAY_IP",
    "RAY_CLUSTER_NAME",
    "RAY_CLUSTER_NAMESPACE",
    "RAY_ROLE",
    "OWNER_KIND",
    "OWNER_NAME",
    "EVENTS_PORT",
)
# apis/ray/v1/rayjob_types.go and rayservice_types.go
_SUBMISSION_MODES = ("K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode")
_RAY_SERVICE_UPGRADE_TYPES = ("NewClusterWithIncrementalUpgrade", "NewCluster", "None")
_DELETION_ORDER = ("DeleteWorkers", "DeleteCluster", "DeleteSelf")


def check_metadata(doc: Mapping[str, Any]) -> list[Finding]:
    """The operator's findings in the metadata of a RayCluster, RayJob or RayService; [] for other kinds."""
    kind = doc.get("kind")
    meta = doc.get("metadata") or {}
    if kind == "RayCluster":
        return list(_metadata(meta, "RayCluster", MAX_RAY_CLUSTER_NAME_LENGTH))
    if kind == "RayJob":
        return list(_metadata(meta, "RayJob", MAX_RAY_JOB_NAME_LENGTH))
    if kind == "RayService":
        annotations = meta.get("annotations") or {}
        return [*_metadata(meta, "RayService", MAX_RAY_SERVICE_NAME_LENGTH), *_initializing_timeout(annotations)]
    return []


def check_spec(doc: Mapping[str, Any]) -> list[Finding]:
    """The operator's findings in the spec of a schema-valid RayCluster, RayJob or RayService."""
    kind = doc.get("kind")
    meta = doc.get("metadata") or {}
    spec = doc.get("spec") or {}
    annotations = meta.get("annotations") or {}
    if kind == "RayCluster":
        return [*_upgrade_options(spec, meta.get("labels") or {}), *_cluster_spec(spec, annotations, ("spec",))]
    if kind == "RayJob":
        return list(_job_spec(spec, annotations))
    if kind == "RayService":
        return list(_service_spec(spec, annotations))
    if kind == "RayCronJob":
        return list(_cron_job_spec(spec))
    return []


def _cron_job_spec(spec: Mapping[str, Any]) -> Iterator[Finding]:
    # ValidateRayCronJobSpec: the schedule as robfig/cron's ParseStandard reads it (no TZ in it: the
    # timeZone field says it), then the job template as a RayJob's spec.
    schedule = str(spec.get("schedule", ""))
    if "TZ" in schedule:
        yield ("spec", "schedule"), "cannot use TZ or CRON_TZ in schedule, use timeZone field instead"
    else:
        problem = cron_problem(schedule)
        if problem:
            yield ("spec", "schedule"), f"invalid cron schedule: {problem}"
    template = spec.get("jobTemplate") or {}
    for path, message in _job_spec(template, {}):  # ValidateRayJobSpec's paths, under spec.jobTemplate
        yield ("spec", "jobTemplate", *path[1:]), message


_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
_CRON_FIELDS: tuple[
    tuple[str, int, int, dict[str, int]], ...
] = (  # robfig/cron/v3 ParseStandard: minute hour day-of-month month day-of-week
    ("minute", 0, 59, {}),
    ("hour", 0, 23, {}),
    ("day of month", 1, 31, {}),
    ("month", 1, 12, {m: i + 1 for i, m in enumerate(_MONTHS)}),
    ("day of week", 0, 6, {d: i for i, d in enumerate(_DAYS)}),
)
_CRON_DESCRIPTORS = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")


def cron_problem(schedule: str) -> str:
    """Why robfig/cron's standard parser refuses `schedule` ("" when it accepts it)."""
    text = schedule.strip()
    if text.startswith("@"):
        if text in _CRON_DESCRIPTORS:
            return ""
        if text.startswith("@every "):
            every = text.removeprefix("@every ").strip()
            return "" if re.fullmatch(r"(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+", every) else f"bad duration {every!r}"
        return f"unrecognized descriptor: {text}"
    fields = text.split()
    if len(fields) != 5:
        return f"expected exactly 5 fields, found {len(fields)}: [{text}]"
    for value, (name, low, high, names) in zip(fields, _CRON_FIELDS, strict=True):
        for part in value.split(","):
            body, _, step = part.partition("/")
            if step and not (step.isdigit() and int(step) > 0):
                return f"{name}: bad step {step!r} in {part!r}"
            if body in ("*", "?"):
                continue
            ends = body.split("-", 1)
            try:
                numbers = [int(e) if e.isdigit() else names[e.lower()] for e in ends]
            except KeyError:
                return f"{name}: {part!r} is not a number or a name"
            if any(n < low or n > high for n in numbers) or (len(numbers) == 2 and numbers[0] > numbers[1]):
                return f"{name}: {part!r} is beyond {low}-{high}"
    return ""


def _metadata(meta: Mapping[str, Any], kind: str, max_length: int) -> Iterator[Finding]:
    # ValidateRayClusterMetadata / ValidateRayJobMetadata / ValidateRayServiceMetadata: the name
    # becomes part of Service and Pod names, hence DNS-1035 and a length below 63.
    name = meta.get("name")
    if not isinstance(name, str):
        return
    if len(name) > max_length:
        yield ("metadata", "name"), f"{kind} name should be no more than {max_length} characters"
    for err in k8s_names.dns1035_label(name):
        yield ("metadata", "name"), f"{kind} name should be a valid DNS1035 label: {err}"


def _upgrade_options(spec: Mapping[str, Any], labels: Mapping[str, Any]) -> Iterator[Finding]:
    # ValidateRayClusterUpgradeOptions
    kind = (spec.get("upgradeStrategy") or {}).get("type")
    if kind is None:
        return
    if kind not in ("Recreate", "None"):
        yield (
            ("spec", "upgradeStrategy", "type"),
            f"value {kind} is invalid, valid options are Recreate or None",
        )
    creator = labels.get(_ORIGINATED_FROM_CRD_LABEL)
    if creator in ("RayJob", "RayService"):
        yield ("spec", "upgradeStrategy"), f"upgradeStrategy cannot be set when RayCluster is created by {creator}"


def _envs(container: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    return list((container or {}).get("env") or [])


def _env(name: str, envs: list[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    # EnvVarByName / EnvVarExists
    return next((e for e in envs if e.get("name") == name), None)


def _autoscaling(spec: Mapping[str, Any]) -> bool:
    # IsAutoscalingEnabled
    return spec.get("enableInTreeAutoscaling") is True


def _autoscaling_v2(spec: Mapping[str, Any]) -> bool:
    # IsAutoscalingV2Enabled
    return (spec.get("autoscalerOptions") or {}).get("version") == "v2"


def _v2_by_env(head: Mapping[str, Any] | None) -> bool:
    env = _env(_RAY_ENABLE_AUTOSCALER_V2, _envs(head))
    return env is not None and env.get("value") in ("1", "true")


def _k8s_auth(auth: Mapping[str, Any] | None) -> bool:
    # IsK8sAuthEnabled
    return (auth or {}).get("enableK8sTokenAuth") is True


def _pod_spec(group: Mapping[str, Any]) -> Mapping[str, Any]:
    return (group.get("template") or {}).get("spec") or {}


def _cluster_spec(spec: Mapping[str, Any], annotations: Mapping[str, Any], at: Path) -> Iterator[Finding]:
    """ValidateRayClusterSpec, for a RayCluster's spec, a RayJob's rayClusterSpec or a RayService's
    rayClusterConfig (`at` is where it sits in the document)."""
    head_group = spec.get("headGroupSpec") or {}
    head_pod = _pod_spec(head_group)
    containers = head_pod.get("containers") or []
    head_at = (*at, "headGroupSpec")
    containers_at = (*head_at, "template", "spec", "containers")
    if not containers:
        yield containers_at, "headGroupSpec should have at least one container"
        return  # every later check reads the head's Ray container (RayContainerIndex = 0)
    head = containers[0]
    head_env = _envs(head)
    head_env_at = (*containers_at, 0, "env")
    start_params = head_group.get("rayStartParams") or {}
    yield from _group_resources("Head", start_params, head_group.get("resources") or {}, head_at)
    yield from _group_labels("Head", start_params, head_group.get("labels") or {}, head_at)

    autoscaling = _autoscaling(spec)
    workers = spec.get("workerGroupSpecs") or []
    seen: dict[str, int] = {}
    for i, group in enumerate(workers):
        group_at = (*at, "workerGroupSpecs", i)
        name = group.get("groupName", "")
        # raycluster_webhook.go validateWorkerGroups (the admission webhook; applied to the specs
        # embedded in RayJob and RayService too, whose RayCluster it would reject).
        if name in seen:
            yield (
                (*group_at, "groupName"),
                f"worker group names must be unique ({name!r} is also workerGroupSpecs[{seen[name]}])",
            )
        seen.setdefault(name, i)
        if not _pod_spec(group).get("containers"):
            yield (*group_at, "template", "spec", "containers"), "workerGroupSpec should have at least one container"
        # The API server defaults minReplicas to 0 and maxReplicas to 2147483647, so this only
        # fires for a document that bypassed defaulting; kept so the port matches the Go.
        if not autoscaling and (group.get("minReplicas") is None or group.get("maxReplicas") is None):
            yield (
                group_at,
                f"worker group {name} must set both minReplicas and maxReplicas when autoscaling is disabled",
            )
        low, high = group.get("minReplicas"), group.get("maxReplicas")
        if low is not None and low < 0:
            yield (*group_at, "minReplicas"), f"worker group {name} has negative minReplicas {low}"
        if high is not None and high < 0:
            yield (*group_at, "maxReplicas"), f"worker group {name} has negative maxReplicas {high}"
        if low is not None and high is not None and low > high:
            yield (
                (*group_at, "minReplicas"),
                f"worker group {name} has minReplicas {low} greater than maxReplicas {high}",
            )
        params = group.get("rayStartParams") or {}
        yield from _group_resources(name, params, group.get("resources") or {}, group_at)
        yield from _group_labels(name, params, group.get("labels") or {}, group_at)
        yield from _worker_idle_timeout(group, spec, head, group_at)
        yield from _worker_priority(group, spec, head, group_at)

    ft_options = spec.get("gcsFaultToleranceOptions")
    if annotations.get(_FT_ENABLED_ANNOTATION) and ft_options is not None:
        yield (
            (*at, "gcsFaultToleranceOptions"),
            f"{_FT_ENABLED_ANNOTATION} annotation and GcsFaultToleranceOptions are both set. "
            "Please use only GcsFaultToleranceOptions to configure GCS fault tolerance",
        )
    # IsGCSFaultToleranceEnabled
    ft_enabled = str(annotations.get(_FT_ENABLED_ANNOTATION, "")).lower() == "true" or ft_options is not None
    if not ft_enabled and _env(_RAY_REDIS_ADDRESS, head_env):
        yield (
            head_env_at,
            f"{_RAY_REDIS_ADDRESS} is set which implicitly enables GCS fault tolerance, but GcsFaultToleranceOptions "
            "is not set. Please set GcsFaultToleranceOptions to enable GCS fault tolerance",
        )
    if ft_options is not None:
        if start_params.get("redis-password"):
            yield (
                (*head_at, "rayStartParams", "redis-password"),
                "cannot set `redis-password` in rayStartParams when GcsFaultToleranceOptions is enabled "
                "- use GcsFaultToleranceOptions.RedisPassword instead",
            )
        if _env(_REDIS_PASSWORD, head_env):
            yield (
                head_env_at,
                "cannot set `REDIS_PASSWORD` env var in head Pod when GcsFaultToleranceOptions is enabled "
                "- use GcsFaultToleranceOptions.RedisPassword instead",
            )
        if _env(_RAY_REDIS_ADDRESS, head_env):
            yield (
                head_env_at,
                "cannot set `RAY_REDIS_ADDRESS` env var in head Pod when GcsFaultToleranceOptions is enabled "
                "- use GcsFaultToleranceOptions.RedisAddress instead",
            )
        if annotations.get(_EXTERNAL_STORAGE_NS_ANNOTATION):
            yield (
                ("metadata", "annotations", _EXTERNAL_STORAGE_NS_ANNOTATION),
                f"cannot set `{_EXTERNAL_STORAGE_NS_ANNOTATION}` annotation when GcsFaultToleranceOptions is "
                "enabled - use GcsFaultToleranceOptions.ExternalStorageNamespace instead",
            )
        yield from _gcs_ft_backend(ft_options, head, head_pod.get("volumes") or [], at, containers_at)
    if start_params.get("redis-username") or _env(_REDIS_USERNAME, head_env):
        yield (
            head_at,
            "cannot set redis username in rayStartParams or environment variables "
            "- use GcsFaultToleranceOptions.RedisUsername instead",
        )

    if not FEATURE_GATES["RayJobDeletionPolicy"]:
        for i, group in enumerate(workers):
            if group.get("suspend") is True:
                yield (
                    (*at, "workerGroupSpecs", i, "suspend"),
                    f"worker group {group.get('groupName', '')} can be suspended only when the "
                    "RayJobDeletionPolicy feature gate is enabled",
                )

    v2_env = _env(_RAY_ENABLE_AUTOSCALER_V2, head_env)
    if not autoscaling and v2_env is not None and v2_env.get("value") in ("1", "true"):
        yield (
            head_env_at,
            f"environment variable {_RAY_ENABLE_AUTOSCALER_V2} cannot be set to '{v2_env.get('value')}' when "
            "enableInTreeAutoscaling is false. Please set enableInTreeAutoscaling: true to use autoscaler v2",
        )
    autoscaler = spec.get("autoscalerOptions") or {}
    if autoscaling:
        for i, group in enumerate(workers):
            if group.get("suspend") is True:
                yield (
                    (*at, "workerGroupSpecs", i, "suspend"),
                    f"worker group {group.get('groupName', '')} cannot be suspended with Autoscaler enabled",
                )
        if autoscaler.get("version") is not None and v2_env is not None:
            yield (
                (*at, "autoscalerOptions", "version"),
                f"both .spec.autoscalerOptions.version and head Pod env var {_RAY_ENABLE_AUTOSCALER_V2} are set, "
                "please only use the former",
            )
        if _autoscaling_v2(spec):
            if head_pod.get("restartPolicy", "") not in ("", "Never"):
                yield (
                    (*head_at, "template", "spec", "restartPolicy"),
                    "restartPolicy for head Pod should be Never or unset when using autoscaler V2",
                )
            for i, group in enumerate(workers):
                if _pod_spec(group).get("restartPolicy", "") not in ("", "Never"):
                    yield (
                        (*at, "workerGroupSpecs", i, "template", "spec", "restartPolicy"),
                        f"restartPolicy for worker group {group.get('groupName', '')} should be Never or unset "
                        "when using autoscaler V2",
                    )
    idle = autoscaler.get("idleTimeoutSeconds")
    if idle is not None and idle < 0:
        yield (
            (*at, "autoscalerOptions", "idleTimeoutSeconds"),
            f"autoscalerOptions.idleTimeoutSeconds must be non-negative, got {idle}",
        )
    if _env(_KUBERAY_GEN_AUTOSCALER_START_CMD, list(autoscaler.get("env") or [])):
        yield (
            (*at, "autoscalerOptions", "env"),
            f"autoscalerOptions.env must not contain {_KUBERAY_GEN_AUTOSCALER_START_CMD}: it is managed by KubeRay "
            "and injected automatically into the autoscaler container",
        )

    history = spec.get("historyServerOptions")
    if history is not None:
        yield from _history_server(history, head_pod, workers, at)
    yield from _auth(spec, at)
    network_policy = spec.get("networkPolicy")
    if network_policy is not None and not FEATURE_GATES["RayClusterNetworkPolicy"]:
        yield (
            (*at, "networkPolicy"),
            "spec.networkPolicy requires the RayClusterNetworkPolicy feature gate to be enabled",
        )
    if network_policy is not None:
        yield from _network_policy(network_policy, workers, at)
    if spec.get("tlsOptions") is not None and not FEATURE_GATES["RayClusterMTLS"]:
        yield (*at, "tlsOptions"), "spec.tlsOptions requires the RayClusterMTLS feature gate to be enabled"
    yield from _tls_options(spec, head, workers, at)


def _group_resources(
    group: str, params: Mapping[str, Any], resources: Mapping[str, Any], at: Path
) -> Iterator[Finding]:
    # validateRayGroupResources
    if any(params.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources")) and resources:
        yield (
            (*at, "resources"),
            f"resource fields should not be set in both rayStartParams and Resources for {group} group; "
            "please use only one",
        )


def _group_labels(group: str, params: Mapping[str, Any], labels: Mapping[str, Any], at: Path) -> Iterator[Finding]:
    # validateRayGroupLabels
    if "labels" in params:
        yield (
            (*at, "rayStartParams", "labels"),
            f"rayStartParams['labels'] is not supported for {group} group; "
            "please use the top-level Labels field instead",
        )
    for key, value in labels.items():
        for err in k8s_names.qualified_name(key):
            yield (*at, "labels", key), f"invalid label key for {group} group: '{key}', error: {err}"
        for err in k8s_names.label_value(str(value)):
            yield (*at, "labels", key), f"invalid label value for key '{key}' in {group} group: '{value}', error: {err}"


def _worker_idle_timeout(
    group: Mapping[str, Any], spec: Mapping[str, Any], head: Mapping[str, Any], at: Path
) -> Iterator[Finding]:
    # validateWorkerGroupIdleTimeout
    idle = group.get("idleTimeoutSeconds")
    if idle is None:
        return
    name = group.get("groupName", "")
    if idle < 0:
        yield (*at, "idleTimeoutSeconds"), f"worker group {name}: idleTimeoutSeconds must be non-negative, got {idle}"
        return
    if not (_autoscaling_v2(spec) or _v2_by_env(head)):
        yield (
            (*at, "idleTimeoutSeconds"),
            f"worker group {name}: idleTimeoutSeconds is set, but autoscaler v2 is not enabled. Please set "
            f".spec.autoscalerOptions.version to 'v2' (or set {_RAY_ENABLE_AUTOSCALER_V2} environment variable to "
            "'true' in the head pod if using KubeRay < 1.4.0)",
        )


def _worker_priority(
    group: Mapping[str, Any], spec: Mapping[str, Any], head: Mapping[str, Any], at: Path
) -> Iterator[Finding]:
    # validateWorkerGroupPriority
    priority = group.get("priority")
    if not priority:
        return
    name = group.get("groupName", "")
    where = (*at, "priority")
    ray_version = spec.get("rayVersion", "")
    if not ray_version:
        yield (
            where,
            f"worker group {name}: priority is set, but RayVersion was not specified. "
            "Ray version 2.56.0 or later is required",
        )
        return
    parsed = _parse_generic_version(ray_version)
    if parsed is None:
        yield where, f"worker group {name}: priority is set, but RayVersion format is invalid: {ray_version}"
        return
    if parsed < (2, 56, 0):
        yield where, f"worker group {name}: priority is set, but minimum Ray version is 2.56.0, got {ray_version}"
        return
    if not (_autoscaling_v2(spec) or _v2_by_env(head)):
        yield (
            where,
            f"worker group {name}: priority is set to {priority}, but autoscaler v2 is not enabled. "
            "Priority is only supported with autoscaler v2 enabled",
        )


def _gcs_ft_backend(
    options: Mapping[str, Any], head: Mapping[str, Any], volumes: list[Mapping[str, Any]], at: Path, containers_at: Path
) -> Iterator[Finding]:
    # validateGcsFaultToleranceBackend
    where = (*at, "gcsFaultToleranceOptions")
    storage = options.get("storage")
    if (options.get("backend") or "redis") != "rocksdb":
        if storage is not None:
            yield (
                (*where, "storage"),
                "cannot set GcsFaultToleranceOptions.Storage when backend is 'redis' - it only applies to the "
                "'rocksdb' backend",
            )
        return
    if not FEATURE_GATES["GCSFaultToleranceEmbeddedStorage"]:
        yield (
            (*where, "backend"),
            "the embedded RocksDB GCS fault tolerance backend (GcsFaultToleranceOptions.Backend: 'rocksdb') requires "
            "the GCSFaultToleranceEmbeddedStorage feature gate to be enabled",
        )
    for field, go_name in (
        ("redisAddress", "RedisAddress"),
        ("redisUsername", "RedisUsername"),
        ("redisPassword", "RedisPassword"),
        ("externalStorageNamespace", "ExternalStorageNamespace"),
    ):
        # Go: the string fields count when non-empty, the pointer fields when present.
        value = options.get(field)
        if value is not None and value != "":
            yield (*where, field), f"cannot set GcsFaultToleranceOptions.{go_name} when backend is 'rocksdb'"
    if (
        storage
        and storage.get("claimName")
        and (
            storage.get("size") is not None or storage.get("storageClassName") is not None or storage.get("accessModes")
        )
    ):
        yield (
            (*where, "storage"),
            "GcsFaultToleranceOptions.Storage.ClaimName is mutually exclusive with size, storageClassName, "
            "and accessModes",
        )
    envs = _envs(head)
    if _env(_RAY_GCS_STORAGE, envs) or _env(_RAY_GCS_STORAGE_PATH, envs):
        yield (
            (*containers_at, 0, "env"),
            f"cannot set `{_RAY_GCS_STORAGE}` or `{_RAY_GCS_STORAGE_PATH}` env var in head Pod when the embedded "
            "GCS FT backend is used - these are managed by KubeRay",
        )
    for i, mount in enumerate(head.get("volumeMounts") or []):
        if mount.get("mountPath") == _GCS_STORAGE_MOUNT_PATH or mount.get("name") == _GCS_STORAGE_VOLUME:
            yield (
                (*containers_at, 0, "volumeMounts", i),
                f"cannot set a volume mount named {_GCS_STORAGE_VOLUME!r} or mounted at {_GCS_STORAGE_MOUNT_PATH} "
                "in the head container when the embedded GCS FT backend is used - it is managed by KubeRay",
            )
    for i, volume in enumerate(volumes):
        if volume.get("name") == _GCS_STORAGE_VOLUME:
            yield (
                (*at, "headGroupSpec", "template", "spec", "volumes", i),
                f"cannot set a volume named {_GCS_STORAGE_VOLUME!r} in the head Pod when the embedded GCS FT "
                "backend is used - it is managed by KubeRay",
            )


def _history_server(
    history: Mapping[str, Any], head_pod: Mapping[str, Any], workers: list[Mapping[str, Any]], at: Path
) -> Iterator[Finding]:
    # ValidateRayClusterSpec, historyServerOptions part
    where = (*at, "historyServerOptions")
    if not FEATURE_GATES["RayClusterHistoryServer"]:
        yield where, "RayClusterHistoryServer feature gate is not enabled"
    collector = history.get("collectorOptions")
    if collector is None:
        yield where, "historyServerOptions.collectorOptions must be set"
        return
    yield from _collector_options(collector, (*where, "collectorOptions"))
    for i, container in enumerate(head_pod.get("containers") or []):
        if container.get("name") == _COLLECTOR_CONTAINER:
            yield (
                (*at, "headGroupSpec", "template", "spec", "containers", i, "name"),
                f"head pod template must not define a container with name '{_COLLECTOR_CONTAINER}' when history "
                "server collector options are enabled",
            )
    for g, group in enumerate(workers):
        for i, container in enumerate(_pod_spec(group).get("containers") or []):
            if container.get("name") == _COLLECTOR_CONTAINER:
                yield (
                    (*at, "workerGroupSpecs", g, "template", "spec", "containers", i, "name"),
                    f"worker group {group.get('groupName', '')} pod template must not define a container with name "
                    f"'{_COLLECTOR_CONTAINER}' when history server collector options are enabled",
                )


def _collector_options(options: Mapping[str, Any], at: Path) -> Iterator[Finding]:
    # validateCollectorOptions
    if not options.get("image"):
        yield (*at, "image"), "historyServerOptions.collectorOptions.image must be set"
        return
    env = {e.get("name"): e for e in options.get("env") or []}

    def has_value(name: str) -> bool:
        e = env.get(name)
        return e is not None and (bool(e.get("value")) or e.get("valueFrom") is not None)

    for name in _COLLECTOR_MANAGED_ENV:
        if name in env:
            yield (
                (*at, "env"),
                f"historyServerOptions.collectorOptions.env must not contain {name}: it is managed by KubeRay and "
                "injected automatically into the collector container",
            )
            return
    backend = (env.get("STORAGE_BACKEND") or {}).get("value") or ""
    if not backend:
        yield (
            (*at, "env"),
            "STORAGE_BACKEND environment variable must be set with a literal string value in "
            "historyServerOptions.collectorOptions.env",
        )
        return
    backend = backend.upper()
    needs: list[str] = []
    if backend == "GCS":
        needs = ["GCS_BUCKET"]
    elif backend == "S3":
        needs = ["S3_REGION"]
    elif backend == "ALIYUNOSS":
        needs = ["OSS_BUCKET", "OSS_ENDPOINT", "OSS_REGION"]
    elif backend == "AZUREBLOB":
        mode = str((env.get("AZURE_STORAGE_AUTH_MODE") or {}).get("value") or "").strip().lower()
        if mode == "connection_string":
            needs = ["AZURE_STORAGE_CONNECTION_STRING"]
        elif mode in ("workload_identity", "default"):
            needs = ["AZURE_STORAGE_ACCOUNT_URL"]
        elif not has_value("AZURE_STORAGE_CONNECTION_STRING") and not has_value("AZURE_STORAGE_ACCOUNT_URL"):
            yield (
                (*at, "env"),
                "either AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_ACCOUNT_URL environment variable must be set "
                "when STORAGE_BACKEND is AZUREBLOB",
            )
    for name in needs:
        if not has_value(name):
            yield (*at, "env"), f"{name} environment variable must be set when STORAGE_BACKEND is {backend}"
            return


def _auth(spec: Mapping[str, Any], at: Path) -> Iterator[Finding]:
    # ValidateRayClusterSpec, authOptions part (IsAuthEnabled: mode 'token')
    auth = spec.get("authOptions")
    where = (*at, "authOptions")
    if (auth or {}).get("mode") != "token":
        if _k8s_auth(auth):
            yield (
                (*where, "enableK8sTokenAuth"),
                "authOptions.enableK8sTokenAuth is enabled but authOptions.mode not set to 'token'",
            )
        return
    ray_version = spec.get("rayVersion", "")
    if not ray_version:
        yield (
            (*at, "rayVersion"),
            "authOptions.mode is 'token' but RayVersion was not specified. Ray version 2.52.0 or later is required",
        )
        return
    parsed = _parse_generic_version(ray_version)
    if parsed is None:
        yield (*at, "rayVersion"), f"authOptions.mode is 'token' but RayVersion format is invalid: {ray_version}"
        return
    if parsed < (2, 52, 0):
        yield (*at, "rayVersion"), f"authOptions.mode is 'token' but minimum Ray version is 2.52.0, got {ray_version}"
        return
    if _k8s_auth(auth):
        if parsed < (2, 55, 0):
            yield (
                (*at, "rayVersion"),
                f"authOptions.enableK8sTokenAuth is enabled but minimum Ray version is 2.55.0, got {ray_version}",
            )
        elif auth and auth.get("secretName"):
            yield (
                (*where, "secretName"),
                "authOptions.enableK8sTokenAuth is enabled and authOptions.secretName is also set",
            )


def _network_policy(policy: Mapping[str, Any], workers: list[Mapping[str, Any]], at: Path) -> Iterator[Finding]:
    # validateNetworkPolicy
    where = (*at, "networkPolicy")
    mode = policy.get("mode") or "DenyAll"
    for role in ("head", "worker"):
        rules = policy.get(role) or {}
        if mode == "DenyAllEgress" and rules.get("ingressRules"):
            yield (
                (*where, role, "ingressRules"),
                f"networkPolicy.{role}.ingressRules cannot be set when mode is {mode!r} (ingress is not restricted)",
            )
        if mode == "DenyAllIngress" and rules.get("egressRules"):
            yield (
                (*where, role, "egressRules"),
                f"networkPolicy.{role}.egressRules cannot be set when mode is {mode!r} (egress is not restricted)",
            )
    names = set()
    for i, group in enumerate(workers):
        name = group.get("groupName", "")
        for err in k8s_names.dns1123_label(name):
            yield (
                (*at, "workerGroupSpecs", i, "groupName"),
                f"worker group name {name!r} must be a valid DNS1123 label when networkPolicy is enabled "
                f"(it is embedded in the NetworkPolicy name): {err}",
            )
        names.add(name)
    for i, group in enumerate(policy.get("workerGroups") or []):
        name = group.get("groupName", "")
        group_at = (*where, "workerGroups", i)
        if mode == "DenyAllEgress" and group.get("ingressRules"):
            yield (
                (*group_at, "ingressRules"),
                f"networkPolicy.workerGroups[{name!r}].ingressRules cannot be set when mode is {mode!r} "
                "(ingress is not restricted)",
            )
        if mode == "DenyAllIngress" and group.get("egressRules"):
            yield (
                (*group_at, "egressRules"),
                f"networkPolicy.workerGroups[{name!r}].egressRules cannot be set when mode is {mode!r} "
                "(egress is not restricted)",
            )
        if name not in names:
            yield (
                (*group_at, "groupName"),
                f"networkPolicy.workerGroups[{name!r}] does not match any group name in workerGroupSpecs",
            )


def _tls_options(
    spec: Mapping[str, Any], head: Mapping[str, Any], workers: list[Mapping[str, Any]], at: Path
) -> Iterator[Finding]:
    # validateTLSOptions and validateNoConflictingTLSVolumeMount (IsTLSEnabled needs the RayClusterMTLS gate)
    if not (FEATURE_GATES["RayClusterMTLS"] and (spec.get("tlsOptions") or {}).get("enabled") is True):
        return
    suffix = "- the operator manages TLS configuration automatically"
    containers: list[tuple[Path, Mapping[str, Any], str]] = [
        ((*at, "headGroupSpec", "template", "spec", "containers", 0), head, "head Pod")
    ]
    for i, group in enumerate(workers):
        pod_containers = _pod_spec(group).get("containers") or []
        if pod_containers:
            where = (*at, "workerGroupSpecs", i, "template", "spec", "containers", 0)
            containers.append((where, pod_containers[0], f"worker group {group.get('groupName', '')!r}"))
    for where, container, location in containers:
        for name in _TLS_ENV_VARS:
            if _env(name, _envs(container)):
                yield (
                    (*where, "env"),
                    f"cannot set {name} environment variable in {location} when tlsOptions is set {suffix}",
                )
        yield from _tls_mounts(container.get("volumeMounts") or [], location, (*where, "volumeMounts"), suffix)
    autoscaler = spec.get("autoscalerOptions")
    if autoscaler is not None:
        for name in _TLS_ENV_VARS:
            if _env(name, list(autoscaler.get("env") or [])):
                yield (
                    (*at, "autoscalerOptions", "env"),
                    f"cannot set {name} environment variable in autoscalerOptions.env when tlsOptions is set "
                    "- the operator manages TLS configuration for the autoscaler automatically",
                )
        mounts_at = (*at, "autoscalerOptions", "volumeMounts")
        yield from _tls_mounts(
            autoscaler.get("volumeMounts") or [], "autoscalerOptions.volumeMounts", mounts_at, suffix
        )


def _tls_mounts(mounts: list[Mapping[str, Any]], location: str, at: Path, suffix: str) -> Iterator[Finding]:
    for i, mount in enumerate(mounts):
        if mount.get("name") == _TLS_VOLUME:
            yield (
                (*at, i),
                f"cannot use volume mount named {_TLS_VOLUME!r} in {location} when tlsOptions is set {suffix}",
            )
        elif mount.get("mountPath") == _TLS_MOUNT_PATH:
            yield (
                (*at, i),
                f"cannot use volume mount at path {_TLS_MOUNT_PATH!r} in {location} when tlsOptions is set {suffix}",
            )


def _job_spec(spec: Mapping[str, Any], annotations: Mapping[str, Any]) -> Iterator[Finding]:
    # ValidateRayJobSpec
    suspend = spec.get("suspend") is True
    shutdown = spec.get("shutdownAfterJobFinishes") is True
    selector = spec.get("clusterSelector") or {}
    mode = spec.get("submissionMode") or "K8sJobMode"
    backoff = spec.get("backoffLimit")
    cluster = spec.get("rayClusterSpec")
    if suspend and not shutdown:
        yield (
            ("spec", "suspend"),
            "a RayJob with shutdownAfterJobFinishes set to false is not allowed to be suspended",
        )
    ttl = spec.get("ttlSecondsAfterFinished") or 0
    if ttl < 0:
        yield ("spec", "ttlSecondsAfterFinished"), "TTLSecondsAfterFinished must be a non-negative integer"
    yield from _deletion_configuration(spec, shutdown, ttl, bool(selector))
    if suspend and selector:
        yield ("spec", "suspend"), "the ClusterSelector mode doesn't support the suspend operation"
    if cluster is None and not selector:
        yield ("spec",), "one of RayClusterSpec or ClusterSelector must be set"
    if selector:
        if not selector.get(_CLUSTER_SELECTOR_KEY):
            yield (
                ("spec", "clusterSelector"),
                f"cluster name in ClusterSelector ({_CLUSTER_SELECTOR_KEY}) should not be empty",
            )
        if mode == "SidecarMode":
            yield ("spec", "clusterSelector"), "ClusterSelector is not supported in SidecarMode"
        if backoff is not None and backoff > 0:
            yield ("spec", "backoffLimit"), "BackoffLimit is incompatible with ClusterSelector mode"
    # Not a Go check: the CRD takes any string, but the controller acts only on these four modes, so a
    # RayJob with another value is accepted and never submits its job.
    if mode not in _SUBMISSION_MODES:
        yield ("spec", "submissionMode"), f"{mode!r} is not a submission mode (one of {', '.join(_SUBMISSION_MODES)})"
    if mode == "InteractiveMode" and backoff is not None and backoff > 0:
        yield ("spec", "backoffLimit"), "BackoffLimit is incompatible with InteractiveMode"
    if mode == "SidecarMode":
        if spec.get("submitterPodTemplate") is not None:
            yield ("spec", "submitterPodTemplate"), "Currently, SidecarMode doesn't support SubmitterPodTemplate"
        if spec.get("submitterConfig") is not None:
            yield ("spec", "submitterConfig"), "Currently, SidecarMode doesn't support SubmitterConfig"
        head_pod = _pod_spec((cluster or {}).get("headGroupSpec") or {})
        if head_pod.get("restartPolicy", "") not in ("", "Never"):
            yield (
                ("spec", "rayClusterSpec", "headGroupSpec", "template", "spec", "restartPolicy"),
                "restartPolicy for head Pod should be Never or unset when using SidecarMode",
            )
    if cluster is not None:
        if _k8s_auth(cluster.get("authOptions")):
            yield (
                ("spec", "rayClusterSpec", "authOptions", "enableK8sTokenAuth"),
                "K8s token auth mode is currently not supported for RayJob",
            )
        yield from _cluster_spec(cluster, annotations, ("spec", "rayClusterSpec"))
    # dashboardclient.UnmarshalRuntimeEnvYAML: YAML for a map[string]interface{}
    runtime_env = spec.get("runtimeEnvYAML") or ""
    try:
        parsed = yaml.safe_load(runtime_env)
    except yaml.YAMLError as exc:
        yield ("spec", "runtimeEnvYAML"), f"failed to unmarshal RuntimeEnvYAML: {' '.join(str(exc).split())}"
    else:
        if parsed is not None and not isinstance(parsed, dict):
            yield (
                ("spec", "runtimeEnvYAML"),
                f"failed to unmarshal RuntimeEnvYAML: a {type(parsed).__name__} is not a mapping",
            )
    for field in ("activeDeadlineSeconds", "preRunningDeadlineSeconds"):
        value = spec.get(field)
        if value is not None and value <= 0:
            yield ("spec", field), f"{field} must be a positive integer"
    if backoff is not None and backoff < 0:
        yield ("spec", "backoffLimit"), "backoffLimit must be a positive integer"


def _deletion_configuration(spec: Mapping[str, Any], shutdown: bool, ttl: int, selector: bool) -> Iterator[Finding]:
    # validateDeletionConfiguration
    if not shutdown and ttl > 0:
        yield (
            ("spec", "ttlSecondsAfterFinished"),
            "a RayJob with shutdownAfterJobFinishes set to false cannot have TTLSecondsAfterFinished",
        )
    strategy = spec.get("deletionStrategy")
    if strategy is None:
        return
    where = ("spec", "deletionStrategy")
    if not FEATURE_GATES["RayJobDeletionPolicy"]:
        yield where, "RayJobDeletionPolicy feature gate must be enabled to use DeletionStrategy"
        return
    legacy = strategy.get("onSuccess") is not None or strategy.get("onFailure") is not None
    rules = strategy.get("deletionRules") or []
    if rules and shutdown:
        yield where, "spec.shutdownAfterJobFinishes and spec.deletionStrategy.deletionRules are mutually exclusive"
    elif rules and legacy:
        yield where, "Cannot use both legacy onSuccess/onFailure fields and deletionRules simultaneously"
    elif legacy:
        yield from _legacy_deletion_policies(spec, strategy, shutdown, selector)
    elif rules:
        yield from _deletion_rules(spec, rules, selector)
    else:
        yield (
            where,
            "DeletionStrategy requires either BOTH onSuccess and onFailure, "
            "OR the deletionRules field (cannot be empty)",
        )


def _legacy_deletion_policies(
    spec: Mapping[str, Any], strategy: Mapping[str, Any], shutdown: bool, selector: bool
) -> Iterator[Finding]:
    # validateLegacyDeletionPolicies
    where = ("spec", "deletionStrategy")
    on_success, on_failure = strategy.get("onSuccess"), strategy.get("onFailure")
    if on_success is None or on_failure is None:
        yield (
            where,
            "both DeletionStrategy.OnSuccess and DeletionStrategy.OnFailure must be set when using the legacy "
            "deletion policy fields of DeletionStrategy",
        )
        return
    success, failure = on_success.get("policy"), on_failure.get("policy")
    if success is None:
        yield (
            (*where, "onSuccess", "policy"),
            "the DeletionPolicyType field of DeletionStrategy.OnSuccess cannot be unset "
            "when DeletionStrategy is enabled",
        )
        return
    if failure is None:
        yield (
            (*where, "onFailure", "policy"),
            "the DeletionPolicyType field of DeletionStrategy.OnFailure cannot be unset "
            "when DeletionStrategy is enabled",
        )
        return
    if selector:
        for field, policy, when in (("onSuccess", success, "success"), ("onFailure", failure, "failure")):
            if policy in ("DeleteCluster", "DeleteWorkers"):
                yield (
                    (*where, field, "policy"),
                    f"the ClusterSelector mode doesn't support DeletionStrategy={policy} on {when}",
                )
    if "DeleteWorkers" in (success, failure) and _autoscaling(spec.get("rayClusterSpec") or {}):
        yield where, "DeletionStrategy=DeleteWorkers currently does not support RayCluster with autoscaling enabled"
    if shutdown and "DeleteNone" in (success, failure):
        yield where, "shutdownAfterJobFinshes is set to 'true' while deletion policy is 'DeleteNone'"


def _deletion_rules(spec: Mapping[str, Any], rules: list[Mapping[str, Any]], selector: bool) -> Iterator[Finding]:
    # validateDeletionRules, validateDeletionCondition and validateTTLConsistency
    by_condition: dict[tuple[str, str], dict[str, int]] = {}
    autoscaling = _autoscaling(spec.get("rayClusterSpec") or {})
    for i, rule in enumerate(rules):
        where = ("spec", "deletionStrategy", "deletionRules", i)
        condition = rule.get("condition") or {}
        policy = rule.get("policy")
        has_job, has_deployment = (
            condition.get("jobStatus") is not None,
            condition.get("jobDeploymentStatus") is not None,
        )
        if has_job and has_deployment:
            yield (*where, "condition"), "cannot set both JobStatus and JobDeploymentStatus at the same time"
            continue
        if not has_job and not has_deployment:
            yield (*where, "condition"), "exactly one of JobStatus and JobDeploymentStatus must be set"
            continue
        ttl = condition.get("ttlSeconds") or 0
        if ttl < 0:
            yield (*where, "condition", "ttlSeconds"), "TTLSeconds must be non-negative"
            continue
        if selector and policy in ("DeleteCluster", "DeleteWorkers"):
            yield (*where, "policy"), f"DeletionPolicyType '{policy}' not supported when ClusterSelector is set"
            continue
        if autoscaling and policy == "DeleteWorkers":
            yield (*where, "policy"), "DeletionPolicyType 'DeleteWorkers' not supported with autoscaling enabled"
            continue
        key = (
            ("JobStatus", condition["jobStatus"])
            if has_job
            else ("JobDeploymentStatus", condition["jobDeploymentStatus"])
        )
        ttls = by_condition.setdefault(key, {})
        if policy in ttls:
            yield (*where, "policy"), f"duplicate rule for DeletionPolicyType '{policy}' and {key[0]} '{key[1]}'"
            continue
        ttls[str(policy)] = ttl
    for (condition_type, value), ttls in by_condition.items():
        previous: tuple[str, int] | None = None
        for policy in _DELETION_ORDER:
            if policy not in ttls:
                continue
            if previous is not None and ttls[policy] < previous[1]:
                yield (
                    ("spec", "deletionStrategy", "deletionRules"),
                    f"for {condition_type} '{value}': {policy} TTL ({ttls[policy]}) "
                    f"must be >= {previous[0]} TTL ({previous[1]})",
                )
            previous = (policy, ttls[policy])


def _initializing_timeout(annotations: Mapping[str, Any]) -> Iterator[Finding]:
    # validateInitializingTimeout: a Go duration ("5m", "1h") or whole seconds, positive
    value = annotations.get(_INITIALIZING_TIMEOUT_ANNOTATION)
    if not value:
        return
    where = ("metadata", "annotations", _INITIALIZING_TIMEOUT_ANNOTATION)
    seconds = _go_duration_seconds(str(value))
    if seconds is None and re.fullmatch(r"[+-]?[0-9]+", str(value)):
        seconds = int(value)
    if seconds is None:
        yield (
            where,
            f"annotation {_INITIALIZING_TIMEOUT_ANNOTATION} has invalid format: {value}. Expected Go duration format "
            "(e.g., '5m', '1h') or positive integer seconds",
        )
    elif seconds <= 0:
        yield where, f"annotation {_INITIALIZING_TIMEOUT_ANNOTATION} must be positive, got: {value}"


def _service_spec(spec: Mapping[str, Any], annotations: Mapping[str, Any]) -> Iterator[Finding]:
    # ValidateRayServiceSpec
    cluster = spec.get("rayClusterConfig") or {}
    at = ("spec", "rayClusterConfig")
    if _k8s_auth(cluster.get("authOptions")):
        yield (
            (*at, "authOptions", "enableK8sTokenAuth"),
            "K8s token auth mode is currently not supported for RayService",
        )
    yield from _cluster_spec(cluster, annotations, at)
    head_service = (cluster.get("headGroupSpec") or {}).get("headService") or {}
    if (head_service.get("metadata") or {}).get("name"):
        yield (
            (*at, "headGroupSpec", "headService", "metadata", "name"),
            "spec.rayClusterConfig.headGroupSpec.headService.metadata.name should not be set",
        )
    strategy = spec.get("upgradeStrategy") or {}
    kind = strategy.get("type")
    if kind is not None and kind not in _RAY_SERVICE_UPGRADE_TYPES:
        yield (
            ("spec", "upgradeStrategy", "type"),
            f"Spec.UpgradeStrategy.Type value {kind} is invalid, "
            f"valid options are {', '.join(_RAY_SERVICE_UPGRADE_TYPES)}",
        )
    delay = spec.get("rayClusterDeletionDelaySeconds")
    if delay is not None and delay < 0:
        yield (
            ("spec", "rayClusterDeletionDelaySeconds"),
            f"Spec.RayClusterDeletionDelaySeconds should be a non-negative integer, got {delay}",
        )
    # IsIncrementalUpgradeEnabled, then ValidateClusterUpgradeOptions
    if FEATURE_GATES["RayServiceIncrementalUpgrade"] and kind == "NewClusterWithIncrementalUpgrade":
        yield from _cluster_upgrade_options(cluster, strategy.get("clusterUpgradeOptions"))


def _cluster_upgrade_options(cluster: Mapping[str, Any], options: Mapping[str, Any] | None) -> Iterator[Finding]:
    # ValidateClusterUpgradeOptions
    where = ("spec", "upgradeStrategy", "clusterUpgradeOptions")
    if not _autoscaling(cluster):
        yield (
            ("spec", "rayClusterConfig", "enableInTreeAutoscaling"),
            "Ray Autoscaler is required for NewClusterWithIncrementalUpgrade",
        )
        return
    if options is None:
        yield where, "ClusterUpgradeOptions are required for NewClusterWithIncrementalUpgrade"
        return
    surge = options.get("maxSurgePercent", 100)
    step = options.get("stepSizePercent")
    interval = options.get("intervalSeconds")
    if not 0 <= surge <= 100:
        yield (*where, "maxSurgePercent"), "maxSurgePercent must be between 0 and 100"
    elif step is None or not 0 <= step <= 100:
        yield (*where, "stepSizePercent"), "stepSizePercent must be between 0 and 100"
    elif step > surge:
        yield (*where, "stepSizePercent"), "stepSizePercent must be less than or equal to maxSurgePercent"
    elif interval is None or interval <= 0:
        yield (*where, "intervalSeconds"), "intervalSeconds must be greater than 0"
    elif not options.get("gatewayClassName"):
        yield (*where, "gatewayClassName"), "gatewayClassName is required for NewClusterWithIncrementalUpgrade"


_GO_DURATION = re.compile(r"([0-9]*(?:\.[0-9]*)?)(ns|us|µs|μs|ms|s|m|h)")  # Go accepts both mu signs
_GO_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def _go_duration_seconds(text: str) -> float | None:
    """time.ParseDuration: '1h30m', '-5s', '0'; None when Go would refuse it."""
    sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.removeprefix("+"))
    if body == "0":
        return 0.0
    total, pos = 0.0, 0
    while pos < len(body):
        match = _GO_DURATION.match(body, pos)
        if not match or match.group(1) in ("", "."):
            return None
        total += float(match.group(1)) * _GO_UNIT_SECONDS[match.group(2)]
        pos = match.end()
    return sign * total if body else None


def _parse_generic_version(text: str) -> tuple[int, ...] | None:
    """k8s.io/apimachinery/pkg/util/version.ParseGeneric: 'v2.52.0', '2.52' (two or more numbers; a
    suffix such as '-rc1' is allowed and ignored by LessThan here); padded to three numbers."""
    match = re.match(r"\s*v?([0-9]+(?:\.[0-9]+)+)(.*)$", text)
    if match is None:
        return None
    numbers = tuple(int(n) for n in match.group(1).split("."))
    return numbers + (0,) * (3 - len(numbers))
