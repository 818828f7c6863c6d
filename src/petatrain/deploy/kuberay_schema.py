"""petatrain's own strict schemas of the custom resources it writes, used when no CRDs are given.

Written by hand, as Python data, from the Go API types (field names, types, enums, required
fields, defaults, the kubebuilder validation markers):

- `ray.io/v1` RayCluster, RayJob, RayService and RayCronJob from KubeRay v1.7.0
  (ray-operator/apis/ray/v1),
- `monitoring.coreos.com/v1` PodMonitor from prometheus-operator v0.93.0, the fields petatrain
  writes: selector, podMetricsEndpoints (port, path, interval, relabelings), namespaceSelector
  and jobLabel,
- `keda.sh/v1alpha1` ScaledObject from KEDA v2.20.2, the fields petatrain writes:
  scaleTargetRef, minReplicaCount, maxReplicaCount, pollingInterval, cooldownPeriod and
  triggers (type, metadata, authenticationRef).

Each schema is an OpenAPI v3 schema in the dialect of a CRD's openAPIV3Schema, so that
validate.py reads it as it reads a real CRD (defaults applied first, unknown fields refused, the
`x-kubernetes-validations` rules). Where the Go types embed a Kubernetes type (a pod template, a
Service, ResourceRequirements, an EnvVar, a LabelSelector, ...) the schema refers (`$ref`) to
Kubernetes' own definition in kubernetes-validate's schemas, so containers, volumes, probes and
resources are checked by the real Kubernetes schema, strictly, read as a CRD embeds it
(embedded_kubernetes_definitions: nothing is nullable, quantities are integers or strings,
embedded ObjectMeta keeps five fields).

Objects marked `x-petatrain-partial` cover only part of their type (PodMonitor and ScaledObject):
a field petatrain does not write is reported as unknown there. When the cluster's CRDs are given
(validate.py's `crds`, or PETATRAIN_K8S_CRDS), they are used instead of these schemas, and
tests/test_deploy_validate.py checks that both give the same verdicts on its manifests. Compared
node by node with the v1.7.0, v0.93.0 and v2.20.2 CRDs, the one difference is inside an embedded
Service's `status` (metav1.Condition's patterns and enums, absent from Kubernetes' schema), which
no manifest writes.

`status` is written by the operators, never by a manifest: it is left open here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

Schema = dict[str, Any]

KUBERAY_VERSION = "v1.7.0"
PROMETHEUS_OPERATOR_VERSION = "v0.93.0"
KEDA_VERSION = "v2.20.2"

# Where validate.py registers kubernetes-validate's definitions (the `$defs` of _definitions.json).
K8S_DEFINITIONS = "https://kubernetes.io/api/_definitions.json"

# resource.Quantity in a CRD: an integer or a string of this form (k8s.io/apimachinery's
# api/resource/quantity.go grammar: a signed decimal number, then a binary or decimal SI suffix or
# a decimal exponent).
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


def k8s(name: str) -> Schema:
    """Kubernetes' own definition of a type, e.g. io.k8s.api.core.v1.PodTemplateSpec."""
    return {"$ref": f"{K8S_DEFINITIONS}#/$defs/{name}"}


def _obj(properties: Mapping[str, Schema], required: Iterable[str] = (), extra: Mapping[str, Any] = {}) -> Schema:
    node: Schema = {"type": "object", "properties": dict(properties)}
    if required:
        node["required"] = sorted(required)
    node.update(extra)
    return node


def _string(**more: Any) -> Schema:
    return {"type": "string", **more}


def _int32(**more: Any) -> Schema:
    return {"type": "integer", "format": "int32", **more}


def _int64(**more: Any) -> Schema:
    return {"type": "integer", "format": "int64", **more}


def _float() -> Schema:
    return {"type": "number"}


def _bool() -> Schema:
    return {"type": "boolean"}


def _array(items: Schema, **more: Any) -> Schema:
    return {"type": "array", "items": items, **more}


def _string_map() -> Schema:
    """map[string]string"""
    return {"type": "object", "additionalProperties": {"type": "string"}}


def _open() -> Schema:
    return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def _quantity() -> Schema:
    return {
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "pattern": QUANTITY_PATTERN,
        "x-kubernetes-int-or-string": True,
    }


def embedded_kubernetes_definitions(definitions: Mapping[str, Schema]) -> dict[str, Schema]:
    """Kubernetes' definitions (the `$defs` of kubernetes-validate's _definitions.json) as a CRD
    embeds them, which is how the API server reads a pod template inside a RayCluster:

    - nothing is nullable: the API server drops a field or a map value set to null before it
      validates (validate.py does too), and refuses null anywhere else (a list item),
    - a resource.Quantity is an integer or a string of QUANTITY_PATTERN (`cpu: 0.5` is refused;
      a Pod of the built-in kind accepts it),
    - embedded ObjectMeta keeps name, namespace, labels, annotations and finalizers only
      (controller-gen's embedded ObjectMeta; the API server drops, and strict validation refuses,
      the rest),
    - an embedded object's apiVersion and kind are any strings (a CRD does not pin them).
    """
    out = {name: _not_null(definition) for name, definition in definitions.items()}
    for definition in out.values():
        for field in ("apiVersion", "kind"):
            (definition.get("properties") or {}).get(field, {}).pop("enum", None)
    out["io.k8s.apimachinery.pkg.api.resource.Quantity"] = _quantity()
    out["io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"] = {**_embedded_meta(), "additionalProperties": False}
    return out


def _not_null(node: Any) -> Any:
    """A copy of a JSON schema in which null is no type."""
    if isinstance(node, list):
        return [_not_null(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _not_null(value) for key, value in node.items()}
    types = node.get("type")
    if isinstance(types, list):
        types = [t for t in types if t != "null"]
        out["type"] = types[0] if len(types) == 1 else types
    return out


def _embedded_meta() -> Schema:
    """metav1.ObjectMeta embedded in a CRD: what controller-gen keeps of it."""
    return _obj(
        {
            "annotations": _string_map(),
            "finalizers": _array(_string()),
            "labels": _string_map(),
            "name": _string(),
            "namespace": _string(),
        }
    )


def _root(spec: Schema, *, spec_required: bool = False) -> Schema:
    """The openAPIV3Schema of a kind: apiVersion, kind, metadata (checked against ObjectMeta by
    validate.py), spec, status."""
    return _obj(
        {
            "apiVersion": _string(),
            "kind": _string(),
            "metadata": {"type": "object"},
            "spec": spec,
            "status": _open(),
        },
        required=["spec"] if spec_required else (),
    )


# --- ray.io/v1 (KubeRay v1.7.0, ray-operator/apis/ray/v1) ------------------------------------

_MANAGED_BY = {
    # `self == oldSelf` (immutable) only applies to updates and is left out.
    "x-kubernetes-validations": [
        {
            "rule": "self in ['ray.io/kuberay-operator', 'kueue.x-k8s.io/multikueue']",
            "message": "the managedBy field value must be either 'ray.io/kuberay-operator' or "
            "'kueue.x-k8s.io/multikueue'",
        }
    ]
}


def _autoscaler_options() -> Schema:
    # AutoscalerOptions, raycluster_types.go
    return _obj(
        {
            "resources": k8s("io.k8s.api.core.v1.ResourceRequirements"),
            "image": _string(),
            "imagePullPolicy": _string(),
            "securityContext": k8s("io.k8s.api.core.v1.SecurityContext"),
            "idleTimeoutSeconds": _int32(),
            "upscalingMode": _string(enum=["Default", "Aggressive", "Conservative"]),
            "version": _string(enum=["v1", "v2"]),
            "env": _array(k8s("io.k8s.api.core.v1.EnvVar")),
            "envFrom": _array(k8s("io.k8s.api.core.v1.EnvFromSource")),
            "volumeMounts": _array(k8s("io.k8s.api.core.v1.VolumeMount")),
            "command": _array(_string()),
            "args": _array(_string()),
        }
    )


def _gcs_fault_tolerance_options() -> Schema:
    # GcsFaultToleranceOptions, RedisCredential and GcsEmbeddedStorage, raycluster_types.go
    credential = _obj({"valueFrom": k8s("io.k8s.api.core.v1.EnvVarSource"), "value": _string()})
    storage = _obj(
        {
            "claimName": _string(),
            "size": _quantity(),
            "storageClassName": _string(),
            "accessModes": _array(_string()),
            "subPath": _string(),
            "deletionPolicy": _string(enum=["DeleteWithCluster", "Retain"]),
        }
    )
    return _obj(
        {
            "backend": _string(enum=["redis", "rocksdb"]),  # immutable (an update-only rule)
            "redisUsername": credential,
            "redisPassword": credential,
            "externalStorageNamespace": _string(),
            "redisAddress": _string(),
            "storage": storage,
        }
    )


def _network_policy() -> Schema:
    # NetworkPolicyConfig, NetworkPolicyRules and WorkerGroupNetworkPolicyRules, raycluster_types.go
    rules = {
        "ingressRules": _array(k8s("io.k8s.api.networking.v1.NetworkPolicyIngressRule")),
        "egressRules": _array(k8s("io.k8s.api.networking.v1.NetworkPolicyEgressRule")),
    }
    return _obj(
        {
            "mode": _string(enum=["DenyAll", "DenyAllIngress", "DenyAllEgress"], default="DenyAll"),
            "head": _obj(rules),
            "worker": _obj(rules),
            "workerGroups": _array(
                _obj({"groupName": _string(), **rules}, required=["groupName"]),
                **{"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["groupName"]},
            ),
        }
    )


def _head_group_spec() -> Schema:
    # HeadGroupSpec and IngressOptions, raycluster_types.go
    ingress = _obj(
        {
            "host": _string(),
            "path": _string(),
            "pathType": _string(enum=["Exact", "Prefix", "ImplementationSpecific"]),
            "tls": _array(k8s("io.k8s.api.networking.v1.IngressTLS")),
        }
    )
    return _obj(
        {
            "template": k8s("io.k8s.api.core.v1.PodTemplateSpec"),
            "headService": k8s("io.k8s.api.core.v1.Service"),
            "enableIngress": _bool(),
            "ingressOptions": ingress,
            "resources": _string_map(),
            "labels": _string_map(),
            "rayStartParams": _string_map(),
            "serviceType": _string(),
        },
        required=["template"],
    )


def _worker_group_spec() -> Schema:
    # WorkerGroupSpec and ScaleStrategy, raycluster_types.go
    return _obj(
        {
            "suspend": _bool(),
            "groupName": _string(),
            "replicas": _int32(default=0),
            "minReplicas": _int32(default=0),
            "maxReplicas": _int32(default=2147483647),
            "idleTimeoutSeconds": _int32(),
            "priority": _int32(default=0),
            "resources": _string_map(),
            "labels": _string_map(),
            "rayStartParams": _string_map(),
            "template": k8s("io.k8s.api.core.v1.PodTemplateSpec"),
            "scaleStrategy": _obj({"workersToDelete": _array(_string())}),
            "numOfHosts": _int32(default=1),
        },
        required=["groupName", "minReplicas", "maxReplicas", "template"],
    )


def ray_cluster_spec() -> Schema:
    """RayClusterSpec, raycluster_types.go: a RayCluster's spec, a RayJob's rayClusterSpec, a
    RayService's rayClusterConfig."""
    collector = _obj(
        {
            "image": _string(),
            "imagePullPolicy": _string(),
            "resources": k8s("io.k8s.api.core.v1.ResourceRequirements"),
            "env": _array(k8s("io.k8s.api.core.v1.EnvVar")),
        }
    )
    return _obj(
        {
            "upgradeStrategy": _obj({"type": _string(enum=["Recreate", "None"])}),
            "authOptions": _obj(
                {
                    "enableK8sTokenAuth": _bool(),
                    "secretName": _string(),
                    "mode": _string(enum=["disabled", "token"]),
                }
            ),
            "suspend": _bool(),
            "managedBy": _string(**_MANAGED_BY),
            "autoscalerOptions": _autoscaler_options(),
            "headServiceAnnotations": _string_map(),
            "enableInTreeAutoscaling": _bool(),
            "gcsFaultToleranceOptions": _gcs_fault_tolerance_options(),
            "historyServerOptions": _obj({"collectorOptions": collector}),
            "networkPolicy": _network_policy(),
            "tlsOptions": _obj({"enabled": _bool()}),
            "headGroupSpec": _head_group_spec(),
            "rayVersion": _string(),
            "workerGroupSpecs": _array(_worker_group_spec()),
        },
        required=["headGroupSpec"],
    )


_DELETION_POLICY_TYPES = ["DeleteCluster", "DeleteWorkers", "DeleteSelf", "DeleteNone"]


def _deletion_strategy() -> Schema:
    # DeletionStrategy, DeletionRule, DeletionCondition and DeletionPolicy, rayjob_types.go
    condition = _obj(
        {
            "jobStatus": _string(enum=["SUCCEEDED", "FAILED"]),
            "jobDeploymentStatus": _string(enum=["Failed"]),
            "ttlSeconds": _int32(default=0, minimum=0),
        },
        extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!(has(self.jobStatus) && has(self.jobDeploymentStatus))",
                    "message": "JobStatus and JobDeploymentStatus cannot be used together within the same "
                    "deletion condition.",
                },
                {
                    "rule": "has(self.jobStatus) || has(self.jobDeploymentStatus)",
                    "message": "the deletion condition requires either the JobStatus or the JobDeploymentStatus field.",
                },
            ]
        },
    )
    rule = _obj(
        {"policy": _string(enum=_DELETION_POLICY_TYPES), "condition": condition},
        required=["policy", "condition"],
    )
    legacy = _obj({"policy": _string(enum=_DELETION_POLICY_TYPES)})
    return _obj(
        {
            "onSuccess": legacy,
            "onFailure": legacy,
            "deletionRules": _array(rule, minItems=1, **{"x-kubernetes-list-type": "atomic"}),
        },
        extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!((has(self.onSuccess) || has(self.onFailure)) && has(self.deletionRules))",
                    "message": "legacy policies (onSuccess/onFailure) and deletionRules cannot be used together "
                    "within the same deletionStrategy",
                },
                {
                    "rule": "((has(self.onSuccess) && has(self.onFailure)) || has(self.deletionRules))",
                    "message": "deletionStrategy requires either BOTH onSuccess and onFailure, OR the deletionRules "
                    "field (cannot be empty)",
                },
            ]
        },
    )


def ray_job_spec() -> Schema:
    """RayJobSpec, rayjob_types.go."""
    return _obj(
        {
            "activeDeadlineSeconds": _int32(),
            "backoffLimit": _int32(default=0),
            "rayClusterSpec": ray_cluster_spec(),
            "submitterPodTemplate": k8s("io.k8s.api.core.v1.PodTemplateSpec"),
            "metadata": _string_map(),
            "clusterSelector": _string_map(),
            "submitterConfig": _obj({"backoffLimit": _int32()}),
            "managedBy": _string(**_MANAGED_BY),
            "deletionStrategy": _deletion_strategy(),
            "entrypoint": _string(),
            "runtimeEnvYAML": _string(),
            "jobId": _string(),
            # JobSubmissionMode carries no enum marker: the operator's own rule names the modes.
            "submissionMode": _string(default="K8sJobMode"),
            "entrypointResources": _string(),
            "entrypointNumCpus": _float(),
            "entrypointNumGpus": _float(),
            "ttlSecondsAfterFinished": _int32(default=0),
            "preRunningDeadlineSeconds": _int32(minimum=1),
            "shutdownAfterJobFinishes": _bool(),
            "suspend": _bool(),
        }
    )


def ray_cron_job_spec() -> Schema:
    """RayCronJobSpec, raycronjob_types.go (behind the operator's RayCronJob feature gate)."""
    return _obj(
        {
            "jobTemplate": ray_job_spec(),
            "schedule": _string(),
            "suspend": _bool(),
            "timeZone": _string(minLength=1),
        },
        required=["jobTemplate", "schedule"],
    )


def ray_service_spec() -> Schema:
    """RayServiceSpec, RayServiceUpgradeStrategy and ClusterUpgradeOptions, rayservice_types.go."""
    upgrade_options = _obj(
        {
            "maxSurgePercent": _int32(default=100),
            "stepSizePercent": _int32(),
            "intervalSeconds": _int32(),
            "gatewayClassName": _string(),
        },
        required=["stepSizePercent", "intervalSeconds", "gatewayClassName"],
    )
    return _obj(
        {
            "rayClusterDeletionDelaySeconds": _int32(minimum=0),
            "serviceUnhealthySecondThreshold": _int32(),  # deprecated, unused
            "deploymentUnhealthySecondThreshold": _int32(),  # deprecated, unused
            "serveService": k8s("io.k8s.api.core.v1.Service"),
            "upgradeStrategy": _obj(
                {
                    # RayServiceUpgradeType carries no enum marker: the operator's own rule names the types.
                    "type": _string(),
                    "clusterUpgradeOptions": upgrade_options,
                }
            ),
            "managedBy": _string(**_MANAGED_BY),
            "serveConfigV2": _string(),
            "rayClusterConfig": ray_cluster_spec(),
            "excludeHeadPodFromServeSvc": _bool(),
            "suspend": _bool(),
        },
        required=["rayClusterConfig"],
    )


# --- monitoring.coreos.com/v1 PodMonitor (prometheus-operator v0.93.0, pkg/apis/monitoring/v1) -

# Duration, types.go: what Prometheus' model.ParseDuration reads.
_PROMETHEUS_DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"

_RELABEL_ACTIONS = [
    spelling
    for action in (
        "Replace",
        "Keep",
        "Drop",
        "HashMod",
        "LabelMap",
        "LabelDrop",
        "LabelKeep",
        "Lowercase",
        "Uppercase",
        "KeepEqual",
        "DropEqual",
    )
    for spelling in (action.lower(), action)
]


def pod_monitor_spec() -> Schema:
    """PodMonitorSpec (podmonitor_types.go), the fields petatrain writes."""
    relabel = _obj(
        {
            # RelabelConfig, prometheus_types.go
            "sourceLabels": _array(_string()),
            "separator": _string(),
            "targetLabel": _string(),
            "regex": _string(),
            "modulus": _int64(minimum=0),
            "replacement": _string(),
            "action": _string(enum=_RELABEL_ACTIONS, default="replace"),
        }
    )
    endpoint = _obj(
        {
            "port": _string(),
            "path": _string(),
            "interval": _string(pattern=_PROMETHEUS_DURATION),
            "relabelings": _array(relabel),
        },
        extra={"x-petatrain-partial": True},
    )
    return _obj(
        {
            "jobLabel": _string(),
            "podMetricsEndpoints": _array(endpoint),
            "selector": k8s("io.k8s.apimachinery.pkg.apis.meta.v1.LabelSelector"),
            # NamespaceSelector, types.go
            "namespaceSelector": _obj({"any": _bool(), "matchNames": _array(_string())}),
        },
        required=["selector"],
        extra={"x-petatrain-partial": True},
    )


# --- keda.sh/v1alpha1 ScaledObject (KEDA v2.20.2, apis/keda/v1alpha1) -------------------------


def scaled_object_spec() -> Schema:
    """ScaledObjectSpec (scaledobject_types.go), the fields petatrain writes."""
    target = _obj(
        {
            # ScaleTarget, scaledobject_types.go
            "name": _string(minLength=1),
            "apiVersion": _string(),
            "kind": _string(),
            "envSourceContainerName": _string(),
        },
        required=["name"],
    )
    trigger = _obj(
        {
            # ScaleTriggers and AuthenticationRef, scaletriggers_types.go
            "type": _string(minLength=1),
            "metadata": _string_map(),
            "authenticationRef": _obj(
                {"name": _string(), "kind": _string(enum=["TriggerAuthentication", "ClusterTriggerAuthentication"])},
                required=["name"],
            ),
        },
        required=["type", "metadata"],
        extra={"x-petatrain-partial": True},
    )
    return _obj(
        {
            "scaleTargetRef": target,
            "pollingInterval": _int32(minimum=1),
            "cooldownPeriod": _int32(minimum=0),
            "minReplicaCount": _int32(minimum=0),
            "maxReplicaCount": _int32(minimum=1),
            "triggers": _array(trigger, minItems=1),
        },
        required=["scaleTargetRef", "triggers"],
        extra={
            "x-petatrain-partial": True,
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.minReplicaCount) || self.minReplicaCount <= "
                    "(has(self.maxReplicaCount) ? self.maxReplicaCount : 100)",
                    "message": "minReplicaCount must be less than or equal to maxReplicaCount",
                }
            ],
        },
    )


# (group, kind) → {version: openAPIV3Schema}, with where each was written from.
SCHEMAS: Mapping[tuple[str, str], Mapping[str, Schema]] = {
    ("ray.io", "RayCluster"): {"v1": _root(ray_cluster_spec())},
    ("ray.io", "RayJob"): {"v1": _root(ray_job_spec())},
    ("ray.io", "RayService"): {"v1": _root(ray_service_spec())},
    ("ray.io", "RayCronJob"): {"v1": _root(ray_cron_job_spec())},
    ("monitoring.coreos.com", "PodMonitor"): {"v1": _root(pod_monitor_spec(), spec_required=True)},
    ("keda.sh", "ScaledObject"): {"v1alpha1": _root(scaled_object_spec(), spec_required=True)},
}

SOURCES: Mapping[str, str] = {
    "ray.io": f"KubeRay {KUBERAY_VERSION}",
    "monitoring.coreos.com": f"prometheus-operator {PROMETHEUS_OPERATOR_VERSION}",
    "keda.sh": f"KEDA {KEDA_VERSION}",
}
