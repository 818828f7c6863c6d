"""Offline validation of Kubernetes manifests: petatrain's built-in schemas of the custom kinds (or
the cluster's CRDs when given), the operator's Go rules, built-in kinds. Every problem is one
line naming the file, the object and the path in the document.

Every manifest here is written in this file. With the real CRDs (PETATRAIN_K8S_CRDS, else ../shared/k8s-crds)
(KubeRay v1.7.0, prometheus-operator v0.93.0, KEDA v2.20.2, e.g. from `kubectl get crd
rayclusters.ray.io rayjobs.ray.io rayservices.ray.io podmonitors.monitoring.coreos.com
scaledobjects.keda.sh -o yaml`), test_built_in_schemas_agree_with_the_real_crds checks that each
of them gets the same verdicts from the built-in schemas as from those CRDs; every other test
runs with the variable unset.
"""

import copy
import os
import socket
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from petatrain.deploy import kuberay_schema, validate
from petatrain.errors import PetatrainError

# The real CRDs: PETATRAIN_K8S_CRDS, else the copy kept beside the repository as data (../shared/k8s-crds,
# never copied into it). Read before the fixture below clears the variable.
_SHARED_CRDS = Path(__file__).resolve().parent.parent.parent / "shared" / "k8s-crds"
REAL_CRDS = os.environ.get(validate.CRDS_ENV) or (str(_SHARED_CRDS) if _SHARED_CRDS.is_dir() else "")


@pytest.fixture
def real_crds() -> str:
    """The real CRDs' path; without them a skip here, a failure in CI."""
    if not REAL_CRDS:
        from helpers import missing

        missing(
            f"{validate.CRDS_ENV} is not set and ../shared/k8s-crds is not beside the repository: point it at the "
            "KubeRay v1.7.0, prometheus-operator v0.93.0 and KEDA v2.20.2 CRDs (kubectl get crd ... -o yaml)"
        )
    return REAL_CRDS


@pytest.fixture(autouse=True)
def _built_in_schemas(monkeypatch):
    monkeypatch.delenv(validate.CRDS_ENV, raising=False)


def problems(*docs, source="m.yaml", crds=None):
    lines = validate.validate_documents(list(docs), source, crds=crds)
    assert all("\n" not in line for line in lines), lines
    return lines


# --- the manifests -----------------------------------------------------------------------------

IMAGE = "rayproject/ray:2.60.0"


def pod(name, **container):
    return {"spec": {"containers": [{"name": name, "image": IMAGE, **container}]}}


def cluster_spec():
    return {
        "rayVersion": "2.60.0",
        "headGroupSpec": {
            "rayStartParams": {},
            "template": {
                "metadata": {"labels": {"app.kubernetes.io/name": "petatrain"}},
                **pod("ray-head", resources={"limits": {"cpu": "1", "memory": "2Gi"}}),
            },
        },
        "workerGroupSpecs": [
            {
                "groupName": "cpu",
                "replicas": 1,
                "minReplicas": 1,
                "maxReplicas": 2,
                "rayStartParams": {},
                "template": pod("ray-worker", resources={"requests": {"cpu": 2, "memory": "4Gi"}}),
            }
        ],
    }


def ray_job():
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": "tiny", "labels": {"app.kubernetes.io/name": "petatrain"}},
        "spec": {
            "entrypoint": "python -m petatrain train",
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 60,
            "rayClusterSpec": cluster_spec(),
        },
    }


def ray_cluster():
    spec = cluster_spec()
    spec["enableInTreeAutoscaling"] = True
    spec["autoscalerOptions"] = {
        "upscalingMode": "Default",
        "idleTimeoutSeconds": 60,
        "resources": {"limits": {"cpu": "500m", "memory": "512Mi"}},
        "env": [{"name": "AUTOSCALER_LOG_LEVEL", "value": "debug"}],
    }
    spec["workerGroupSpecs"][0]["minReplicas"] = 0
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "tiny"}, "spec": spec}


def ray_service():
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": "serve"},
        "spec": {
            "serveConfigV2": "applications:\n  - name: llm\n    import_path: petatrain.serve:app\n",
            "rayClusterConfig": cluster_spec(),
        },
    }


def ray_cron_job():
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCronJob",
        "metadata": {"name": "nightly"},
        "spec": {"schedule": "0 3 * * *", "timeZone": "UTC", "jobTemplate": ray_job()["spec"]},
    }


def service_account():
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "petatrain"}}


def pvc():
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "runs"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "10Gi"}}},
    }


def config_map():
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "job"}, "data": {"job.yaml": "train: {}\n"}}


def pod_monitor():
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": "ray"},
        "spec": {
            "jobLabel": "ray.io/cluster",
            "selector": {"matchLabels": {"ray.io/is-ray-node": "yes"}},
            "namespaceSelector": {"matchNames": ["ml"]},
            "podMetricsEndpoints": [
                {
                    "port": "metrics",
                    "path": "/metrics",
                    "interval": "15s",
                    "relabelings": [
                        {"sourceLabels": ["__meta_kubernetes_pod_label_ray_io_cluster"], "targetLabel": "c"}
                    ],
                }
            ],
        },
    }


def scaled_object():
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": "serve"},
        "spec": {
            "scaleTargetRef": {"apiVersion": "ray.io/v1", "kind": "RayCluster", "name": "tiny"},
            "minReplicaCount": 1,
            "maxReplicaCount": 4,
            "pollingInterval": 15,
            "cooldownPeriod": 120,
            "triggers": [
                {
                    "type": "prometheus",
                    "metadata": {"serverAddress": "http://prometheus:9090", "query": "up", "threshold": "10"},
                    "authenticationRef": {"name": "prometheus"},
                }
            ],
        },
    }


def more_builtins():
    return [
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3"}, "stringData": {"key": "v"}},
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "metrics"},
            "spec": {"selector": {"app": "x"}, "ports": [{"port": 9090, "targetPort": "metrics"}]},
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "petatrain:reader", "namespace": "ml"},
            "rules": [{"apiGroups": ["ray.io"], "resources": ["rayjobs"], "verbs": ["get"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "petatrain-reader"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "petatrain:reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "petatrain"}],
        },
    ]


MANIFESTS = {
    "RayJob": ray_job,
    "RayCluster": ray_cluster,
    "RayService": ray_service,
    "RayCronJob": ray_cron_job,
    "ServiceAccount": service_account,
    "PersistentVolumeClaim": pvc,
    "ConfigMap": config_map,
    "PodMonitor": pod_monitor,
    "ScaledObject": scaled_object,
}


def worker(doc):
    spec = doc["spec"].get("rayClusterSpec") or doc["spec"].get("rayClusterConfig") or doc["spec"]
    return spec["workerGroupSpecs"][0]


def head_pod(doc):
    return doc["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]


def head_container(doc):
    return head_pod(doc)["containers"][0]


# --- valid manifests ---------------------------------------------------------------------------


def test_our_manifests_are_valid():
    assert problems(*(build() for build in MANIFESTS.values()), *more_builtins()) == []


def test_builtin_verdicts_agree_with_kubernetes_validate():
    version = validate.KUBERNETES_VERSION
    for doc in [service_account(), pvc(), config_map(), *more_builtins()]:
        kubernetes_validate.validate(doc, version, strict=True)
    bad = pvc()
    bad["spec"]["storageClas"] = "fast"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, version, strict=True)
    assert problems(bad)


# --- schema problems, one line each --------------------------------------------------------------

WORKER = "spec.rayClusterSpec.workerGroupSpecs[0]"
HEAD = "spec.rayClusterSpec.headGroupSpec.template"


def _set(*keys, value):
    """A mutation setting doc[keys...] = value."""

    def mutate(doc):
        node = doc
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value

    return mutate


def _rename(getter, old, new):
    def mutate(doc):
        node = getter(doc)
        node[new] = node.pop(old)

    return mutate


# (id, manifest, mutation, the one expected line after "m.yaml: KIND/NAME: ", or None for valid)
SCHEMA_CASES = [
    (
        "typo-with-suggestion",
        ray_job,
        _rename(worker, "minReplicas", "minReplica"),
        f"{WORKER}.minReplica: unknown field (did you mean 'minReplicas'?)",
    ),
    (
        "string-for-bool",
        ray_job,
        _set("spec", "shutdownAfterJobFinishes", value="yes"),
        "spec.shutdownAfterJobFinishes: 'yes' is not of type 'boolean'",
    ),
    (
        "string-for-int",
        ray_job,
        lambda doc: worker(doc).update(minReplicas="two"),
        f"{WORKER}.minReplicas: 'two' is not of type 'integer'",
    ),
    (
        "missing-required",
        ray_job,
        lambda doc: worker(doc).pop("groupName"),
        f"{WORKER}.groupName: required field is missing",
    ),
    (
        # minReplicas and maxReplicas are required, with defaults: the API server fills them in.
        "required-with-default",
        ray_job,
        lambda doc: (worker(doc).pop("minReplicas"), worker(doc).pop("maxReplicas")),
        None,
    ),
    (
        "missing-head",
        ray_job,
        lambda doc: doc["spec"]["rayClusterSpec"].pop("headGroupSpec"),
        "spec.rayClusterSpec.headGroupSpec: required field is missing",
    ),
    ("null-is-dropped", ray_job, lambda doc: worker(doc).update(replicas=None), None),
    (
        "null-in-a-pod-template-is-dropped",
        ray_job,
        lambda doc: head_container(doc)["resources"]["limits"].update(cpu=None),
        None,
    ),
    (
        "null-list-item",
        ray_job,
        lambda doc: head_pod(doc)["containers"].append(None),
        f"{HEAD}.spec.containers[1]: None is not of type 'object'",
    ),
    (
        "enum",
        ray_cluster,
        lambda doc: doc["spec"]["autoscalerOptions"].update(upscalingMode="Fast"),
        "spec.autoscalerOptions.upscalingMode: 'Fast' is not one of ['Default', 'Aggressive', 'Conservative']",
    ),
    (
        "autoscaler-typo",
        ray_cluster,
        _rename(lambda doc: doc["spec"]["autoscalerOptions"], "idleTimeoutSeconds", "idleTimeout"),
        "spec.autoscalerOptions.idleTimeout: unknown field (did you mean 'idleTimeoutSeconds'?)",
    ),
    (
        "serve-config-not-a-string",
        ray_service,
        lambda doc: doc["spec"].update(serveConfigV2={"applications": []}),
        "spec.serveConfigV2: {'applications': []} is not of type 'string'",
    ),
    (
        "rayservice-without-cluster",
        ray_service,
        lambda doc: doc["spec"].pop("rayClusterConfig"),
        "spec.rayClusterConfig: required field is missing",
    ),
    (
        "cel-rule",
        ray_job,
        _set("spec", "deletionStrategy", value={"onSuccess": {"policy": "DeleteCluster"}}),
        "spec.deletionStrategy: deletionStrategy requires either BOTH onSuccess and onFailure, "
        "OR the deletionRules field (cannot be empty)",
    ),
    # Inside pod templates: Kubernetes' own PodTemplateSpec, as a CRD embeds it.
    (
        "limits-as-a-list",
        ray_job,
        lambda doc: head_container(doc)["resources"].update(limits=[{"cpu": "1"}]),
        f"{HEAD}.spec.containers[0].resources.limits: [{{'cpu': '1'}}] is not of type 'object'",
    ),
    (
        "container-typo",
        ray_job,
        _rename(head_container, "image", "imag"),
        f"{HEAD}.spec.containers[0].imag: unknown field (did you mean 'image'?)",
    ),
    (
        "container-port-string",
        ray_job,
        lambda doc: head_container(doc).update(ports=[{"containerPort": "http"}]),
        f"{HEAD}.spec.containers[0].ports[0].containerPort: 'http' is not of type 'integer'",
    ),
    (
        "quantity-float",  # a Pod takes cpu: 0.5, a CRD takes integers and strings only
        ray_job,
        lambda doc: head_container(doc)["resources"]["limits"].update(cpu=0.5),
        f"{HEAD}.spec.containers[0].resources.limits.cpu: 0.5 is not of type 'integer' or 'string'",
    ),
    (
        "quantity-malformed",
        ray_job,
        lambda doc: head_container(doc)["resources"]["limits"].update(memory="2 GB"),
        f"{HEAD}.spec.containers[0].resources.limits.memory: '2 GB' is not a quantity (such as 500m, 2Gi, 1.5 or 1e3)",
    ),
    (
        "duplicate-container",
        ray_job,
        lambda doc: head_pod(doc)["containers"].append({"name": "ray-head", "image": "busybox"}),
        f"{HEAD}.spec.containers[1]: duplicate entry (name='ray-head')",
    ),
    (
        "template-metadata-field-a-crd-drops",
        ray_job,
        lambda doc: doc["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["metadata"].update(generateName="x-"),
        f"{HEAD}.metadata.generateName: unknown field",
    ),
    (
        "volume-typo",
        ray_job,
        lambda doc: head_pod(doc).update(
            volumes=[{"name": "runs", "persistentVolumeClaim": {"claimName": "runs", "readOnl": True}}]
        ),
        f"{HEAD}.spec.volumes[0].persistentVolumeClaim.readOnl: unknown field (did you mean 'readOnly'?)",
    ),
    (
        "probe-wrong-type",
        ray_job,
        lambda doc: head_container(doc).update(readinessProbe={"httpGet": {"port": 8265}, "periodSeconds": "5s"}),
        f"{HEAD}.spec.containers[0].readinessProbe.periodSeconds: '5s' is not of type 'integer'",
    ),
    (
        "submitter-template",
        ray_job,
        lambda doc: doc["spec"].update(submitterPodTemplate={"spec": {"containers": [{"name": "s", "imag": "x"}]}}),
        "spec.submitterPodTemplate.spec.containers[0].imag: unknown field (did you mean 'image'?)",
    ),
    (
        "unknown-field-in-metadata",
        ray_cluster,
        lambda doc: doc["metadata"].update(lables={"a": "b"}),
        "metadata.lables: unknown field (did you mean 'labels'?)",
    ),
    (
        "podmonitor-typo",
        pod_monitor,
        _rename(lambda doc: doc["spec"]["podMetricsEndpoints"][0], "interval", "interva"),
        "spec.podMetricsEndpoints[0].interva: unknown field (did you mean 'interval'?)",
    ),
    (
        "podmonitor-duration",
        pod_monitor,
        lambda doc: doc["spec"]["podMetricsEndpoints"][0].update(interval="15 seconds"),
        "spec.podMetricsEndpoints[0].interval: '15 seconds' does not match",
    ),
    (
        "podmonitor-selector",
        pod_monitor,
        lambda doc: doc["spec"]["selector"].update(matchExpressions=[{"key": "a"}]),
        "spec.selector.matchExpressions[0].operator: required field is missing",
    ),
    (
        "podmonitor-without-selector",
        pod_monitor,
        lambda doc: doc["spec"].pop("selector"),
        "spec.selector: required field is missing",
    ),
    (
        "scaledobject-cel-rule",
        scaled_object,
        lambda doc: doc["spec"].update(minReplicaCount=5, maxReplicaCount=2),
        "spec: minReplicaCount must be less than or equal to maxReplicaCount",
    ),
    (
        "scaledobject-count-as-a-string",  # and its CEL rule, comparing the counts, does not run
        scaled_object,
        lambda doc: doc["spec"].update(minReplicaCount="1"),
        "spec.minReplicaCount: '1' is not of type 'integer'",
    ),
    (
        "scaledobject-trigger-without-metadata",
        scaled_object,
        lambda doc: doc["spec"]["triggers"][0].pop("metadata"),
        "spec.triggers[0].metadata: required field is missing",
    ),
    (
        "scaledobject-minimum",
        scaled_object,
        lambda doc: doc["spec"].update(pollingInterval=0),
        "spec.pollingInterval: 0 is less than the minimum of 1",
    ),
]


def _mutated(build, mutate):
    doc = build()
    mutate(doc)
    return doc


@pytest.mark.parametrize(
    ("build", "mutate", "expected"), [c[1:] for c in SCHEMA_CASES], ids=[c[0] for c in SCHEMA_CASES]
)
def test_schema_problem_is_one_line_naming_file_object_and_path(build, mutate, expected):
    doc = _mutated(build, mutate)
    lines = problems(doc)
    if expected is None:
        assert lines == []
    else:
        (line,) = lines
        assert line.startswith(f"m.yaml: {doc['kind']}/{doc['metadata']['name']}: {expected}"), line


def test_every_problem_is_reported():
    doc = ray_job()
    worker(doc)["minReplicas"] = "two"
    doc["spec"]["shutdownAfterJobFinishes"] = "yes"
    head_container(doc)["resources"]["limits"] = [1]
    assert len(problems(doc)) == 3


def test_a_field_the_built_in_podmonitor_leaves_out_says_so():
    doc = pod_monitor()
    doc["spec"]["podMetricsEndpoints"][0]["scheme"] = "https"  # a real PodMonitor field petatrain does not write
    (line,) = problems(doc)
    assert "spec.podMetricsEndpoints[0].scheme: unknown field: petatrain's built-in schema covers only" in line
    assert validate.CRDS_ENV in line


def test_the_built_in_schemas_serve_ray_io_v1_only():
    doc = ray_cluster()
    doc["apiVersion"] = "ray.io/v1alpha1"
    (line,) = problems(doc)
    assert line.startswith("m.yaml: RayCluster/tiny: apiVersion: RayCluster is not served as ray.io/v1alpha1 ")
    assert "built-in schema, from KubeRay v1.7.0, covers ray.io/v1;" in line


def test_every_cel_rule_of_the_built_in_schemas_is_ported():
    rules = set()

    def walk(node):
        if isinstance(node, dict):
            rules.update(r["rule"] for r in node.get("x-kubernetes-validations") or [])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(dict(kuberay_schema.SCHEMAS))
    assert len(rules) == 6
    assert rules <= set(validate._CEL_RULES), rules - set(validate._CEL_RULES)


# --- the operator's Go rules -------------------------------------------------------------------


def _set_worker(**fields):
    return lambda doc: worker(doc).update(fields)


def _set_spec(**fields):
    return lambda doc: doc["spec"].update(fields)


def _set_cluster(**fields):
    return lambda doc: doc["spec"]["rayClusterSpec"].update(fields)


# (id, mutation of ray_job(), path, part of the message; None for valid)
RULE_CASES = [
    (
        "min-above-max",
        _set_worker(minReplicas=3, maxReplicas=2),
        f"{WORKER}.minReplicas",
        "worker group cpu has minReplicas 3 greater than maxReplicas 2",
    ),
    (
        "group-names-unique",
        lambda doc: doc["spec"]["rayClusterSpec"]["workerGroupSpecs"].append(copy.deepcopy(worker(doc))),
        "spec.rayClusterSpec.workerGroupSpecs[1].groupName",
        "worker group names must be unique",
    ),
    (
        "head-without-container",
        lambda doc: head_pod(doc).update(containers=[]),
        f"{HEAD}.spec.containers",
        "headGroupSpec should have at least one container",
    ),
    (
        "resources-twice",
        lambda doc: worker(doc).update(rayStartParams={"num-cpus": "2"}, resources={"CPU": "2"}),
        f"{WORKER}.resources",
        "resource fields should not be set in both rayStartParams and Resources for cpu group",
    ),
    (
        "ttl-without-shutdown",
        _set_spec(shutdownAfterJobFinishes=False),
        "spec.ttlSecondsAfterFinished",
        "shutdownAfterJobFinishes set to false cannot have TTLSecondsAfterFinished",
    ),
    (
        "suspend-without-shutdown",
        _set_spec(shutdownAfterJobFinishes=False, ttlSecondsAfterFinished=0, suspend=True),
        "spec.suspend",
        "shutdownAfterJobFinishes set to false is not allowed to be suspended",
    ),
    (
        "backoff-interactive",
        _set_spec(submissionMode="InteractiveMode", backoffLimit=2),
        "spec.backoffLimit",
        "BackoffLimit is incompatible with InteractiveMode",
    ),
    (
        "backoff-cluster-selector",
        lambda doc: (
            doc["spec"].pop("rayClusterSpec"),
            doc["spec"].update(clusterSelector={"ray.io/cluster": "c"}, backoffLimit=1),
        ),
        "spec.backoffLimit",
        "BackoffLimit is incompatible with ClusterSelector mode",
    ),
    (
        "submission-mode",
        _set_spec(submissionMode="K8sMode"),
        "spec.submissionMode",
        "'K8sMode' is not a submission mode",
    ),
    ("runtime-env", _set_spec(runtimeEnvYAML="- pip"), "spec.runtimeEnvYAML", "failed to unmarshal RuntimeEnvYAML"),
    ("deadline", _set_spec(activeDeadlineSeconds=0), "spec.activeDeadlineSeconds", "must be a positive integer"),
    (
        "name-length",
        lambda doc: doc["metadata"].update(name="x" * 48),
        "metadata.name",
        "RayJob name should be no more than 47 characters",
    ),
    (
        "name-dns1035",
        lambda doc: doc["metadata"].update(name="1tiny"),
        "metadata.name",
        "RayJob name should be a valid DNS1035 label",
    ),
    ("autoscaler-v2", _set_cluster(enableInTreeAutoscaling=True, autoscalerOptions={"version": "v2"}), None, None),
    (
        "autoscaler-v2-restart-policy",
        lambda doc: (
            doc["spec"]["rayClusterSpec"].update(enableInTreeAutoscaling=True, autoscalerOptions={"version": "v2"}),
            head_pod(doc).update(restartPolicy="Always"),
        ),
        f"{HEAD}.spec.restartPolicy",
        "restartPolicy for head Pod should be Never or unset when using autoscaler V2",
    ),
    (
        "idle-timeout-without-v2",
        _set_worker(idleTimeoutSeconds=60),
        f"{WORKER}.idleTimeoutSeconds",
        "idleTimeoutSeconds is set, but autoscaler v2 is not enabled",
    ),
    (
        "v2-env-without-autoscaling",
        lambda doc: head_container(doc).update(env=[{"name": "RAY_enable_autoscaler_v2", "value": "1"}]),
        f"{HEAD}.spec.containers[0].env",
        "cannot be set to '1' when enableInTreeAutoscaling is false",
    ),
    (
        "auth-needs-ray-2.52",
        _set_cluster(authOptions={"mode": "token"}, rayVersion="2.50.0"),
        "spec.rayClusterSpec.rayVersion",
        "authOptions.mode is 'token' but minimum Ray version is 2.52.0, got 2.50.0",
    ),
    (
        "network-policy-gate",
        _set_cluster(networkPolicy={"mode": "DenyAll"}),
        "spec.rayClusterSpec.networkPolicy",
        "requires the RayClusterNetworkPolicy feature gate",
    ),
    (
        "deletion-rule-ttls",
        _set_spec(
            shutdownAfterJobFinishes=False,
            ttlSecondsAfterFinished=0,
            deletionStrategy={
                "deletionRules": [
                    {"policy": "DeleteSelf", "condition": {"jobStatus": "SUCCEEDED", "ttlSeconds": 10}},
                    {"policy": "DeleteCluster", "condition": {"jobStatus": "SUCCEEDED", "ttlSeconds": 60}},
                ]
            },
        ),
        "spec.deletionStrategy.deletionRules",
        "for JobStatus 'SUCCEEDED': DeleteSelf TTL (10) must be >= DeleteCluster TTL (60)",
    ),
]


@pytest.mark.parametrize(("mutate", "path", "message"), [c[1:] for c in RULE_CASES], ids=[c[0] for c in RULE_CASES])
def test_operator_rules_for_rayjob(mutate, path, message):
    doc = _mutated(ray_job, mutate)
    lines = problems(doc)
    if message is None:
        assert lines == []
        return
    assert [line for line in lines if f"RayJob/{doc['metadata']['name']}: {path}: " in line and message in line], lines


def bad_ray_services():
    rolling = ray_service()
    rolling["metadata"]["annotations"] = {"ray.io/initializing-timeout": "soon"}
    rolling["spec"]["upgradeStrategy"] = {"type": "Rolling"}
    rolling["spec"]["rayClusterConfig"]["headGroupSpec"]["headService"] = {"metadata": {"name": "fixed"}}
    incremental = ray_service()
    incremental["metadata"]["annotations"] = {"ray.io/initializing-timeout": "5m"}
    incremental["spec"]["upgradeStrategy"] = {"type": "NewClusterWithIncrementalUpgrade"}
    return rolling, incremental


def test_operator_rules_for_raycronjob():
    """ValidateRayCronJobSpec: the schedule as robfig/cron reads it, no TZ in it, and the job template
    as a RayJob's spec (its findings under spec.jobTemplate)."""
    doc = ray_cron_job()
    doc["spec"]["schedule"] = "0 25 * * *"
    doc["spec"]["jobTemplate"] |= {"suspend": True, "shutdownAfterJobFinishes": False}
    assert problems(doc) == [
        "m.yaml: RayCronJob/nightly: spec.schedule: invalid cron schedule: hour: '25' is beyond 0-23",
        "m.yaml: RayCronJob/nightly: spec.jobTemplate.suspend: a RayJob with shutdownAfterJobFinishes set to false "
        "is not allowed to be suspended",
        "m.yaml: RayCronJob/nightly: spec.jobTemplate.ttlSecondsAfterFinished: a RayJob with "
        "shutdownAfterJobFinishes set to false cannot have TTLSecondsAfterFinished",
    ]
    doc = ray_cron_job()
    doc["spec"]["schedule"] = "CRON_TZ=UTC 0 3 * * *"
    assert problems(doc) == [
        "m.yaml: RayCronJob/nightly: spec.schedule: cannot use TZ or CRON_TZ in schedule, use timeZone field instead"
    ]


def test_operator_rules_for_rayservice():
    rolling, incremental = bad_ray_services()
    assert problems(rolling, source="") == [
        'RayService/serve: metadata.annotations["ray.io/initializing-timeout"]: annotation ray.io/initializing-timeout '
        "has invalid format: soon. Expected Go duration format (e.g., '5m', '1h') or positive integer seconds",
        "RayService/serve: spec.rayClusterConfig.headGroupSpec.headService.metadata.name: "
        "spec.rayClusterConfig.headGroupSpec.headService.metadata.name should not be set",
        "RayService/serve: spec.upgradeStrategy.type: Spec.UpgradeStrategy.Type value Rolling is invalid, "
        "valid options are NewClusterWithIncrementalUpgrade, NewCluster, None",
    ]
    assert problems(incremental, source="") == [
        "RayService/serve: spec.rayClusterConfig.enableInTreeAutoscaling: "
        "Ray Autoscaler is required for NewClusterWithIncrementalUpgrade"
    ]


def test_operator_rules_wait_for_a_schema_valid_spec():
    doc = ray_job()
    worker(doc)["minReplicas"] = "3"  # a string: the Go comparison with maxReplicas is never reached
    worker(doc)["maxReplicas"] = 2
    assert problems(doc) == [f"m.yaml: RayJob/tiny: {WORKER}.minReplicas: '3' is not of type 'integer'"]


# --- built-in kinds ----------------------------------------------------------------------------


def bad_builtins():
    claim = pvc()
    claim["spec"]["resources"]["requests"]["storage"] = [1]
    claim["spec"]["storageClas"] = "fast"
    account = service_account()
    account["automountServiceAccountToken"] = "no"
    service = more_builtins()[1]
    service["metadata"]["name"] = "metrics.v1"  # a Service name is a DNS-1035 label: no dots
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "Creds", "namespace": "ML"}}
    nameless = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {}}
    labelled = config_map()
    labelled["metadata"]["labels"] = {"team/ml/x": "a b"}
    return [claim, account, service, secret, nameless, labelled]


def test_builtin_kinds_with_bad_fields_names_and_labels():
    lines = problems(*bad_builtins(), source="")
    assert lines[:3] == [
        "PersistentVolumeClaim/runs: spec.resources.requests.storage: [1] is not of type 'string' or 'number'",
        "PersistentVolumeClaim/runs: spec.storageClas: unknown field (did you mean 'storageClassName'?)",
        "ServiceAccount/petatrain: automountServiceAccountToken: 'no' is not of type 'boolean'",
    ]
    assert lines[3].startswith(
        "Service/metrics.v1: metadata.name: 'metrics.v1' is not a valid Service name: a DNS-1035"
    )
    assert lines[4].startswith("Secret/Creds: metadata.name: 'Creds' is not a valid Secret name: a lowercase RFC 1123")
    assert lines[5].startswith("Secret/Creds: metadata.namespace: 'ML': a lowercase RFC 1123 label")
    assert lines[6] == "ConfigMap (document 5): metadata.name: required field is missing"
    assert all(line.startswith('ConfigMap/job: metadata.labels["team/ml/x"]: invalid ') for line in lines[7:])
    assert len(lines) == 9


# --- what is not a manifest --------------------------------------------------------------------


def not_manifests():
    return [
        {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}},
        {"apiVersion": "rbac.example.com/v1", "kind": "Role", "metadata": {"name": "r"}},
        {"kind": "ConfigMap", "metadata": {"name": "c"}},
        ["not", "a", "mapping"],
    ]


def test_unknown_kind_and_documents_without_kind():
    lines = problems(*not_manifests(), source="misc.yaml")
    assert lines[0].startswith("misc.yaml: Widget/w: kind: unknown kind Widget in example.com/v1: not a Kubernetes")
    assert "keda.sh/ScaledObject, monitoring.coreos.com/PodMonitor, ray.io/RayCluster" in lines[0]
    assert lines[1].startswith("misc.yaml: Role/r: kind: unknown kind Role in rbac.example.com/v1")
    assert lines[2] == "misc.yaml: ConfigMap/c: apiVersion missing: every manifest names its apiVersion and kind"
    assert lines[3] == "misc.yaml: document 4: a YAML list, not a mapping with apiVersion and kind"
    assert len(lines) == 4


def test_invalid_yaml_is_one_line_and_earlier_documents_are_still_checked(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: ok\ndata: {n: 1}\n---\nkind: [\n")
    assert validate.validate_file(str(path)) == [
        f"{path}: ConfigMap/ok: data.n: 1 is not of type 'string'",
        f"{path}: invalid YAML at line 8, column 1: did not find expected node content",
    ]


def test_duplicate_keys_are_reported(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: a\ndata: {}\ndata: {x: y}\n")
    assert validate.validate_file(str(path)) == [
        f"{path}: line 6: duplicate key 'data' (only the last one would be kept)"
    ]


def test_unreadable_file(tmp_path):
    (line,) = validate.validate_file(str(tmp_path / "missing.yaml"))
    assert line == f"{tmp_path / 'missing.yaml'}: cannot read: No such file or directory"


def test_validate_dir_reads_every_yaml_file_in_order(tmp_path):
    (tmp_path / "b.yml").write_text(yaml.safe_dump_all([ray_job(), pvc()]))
    (tmp_path / "sub").mkdir()
    bad = pvc()
    bad["spec"]["accessModes"] = "ReadWriteOnce"
    (tmp_path / "sub" / "a.yaml").write_text(yaml.safe_dump_all([bad, {"kind": "Thing"}]))
    (tmp_path / "a.yaml").write_text("data: [\n")
    (tmp_path / "notes.txt").write_text("not a manifest")
    assert validate.validate_dir(str(tmp_path)) == [
        "a.yaml: invalid YAML at line 2, column 1: did not find expected node content",
        "sub/a.yaml: PersistentVolumeClaim/runs: spec.accessModes: 'ReadWriteOnce' is not of type 'array'",
        "sub/a.yaml: Thing (document 2): apiVersion missing: every manifest names its apiVersion and kind",
    ]


def test_validate_dir_refuses_what_is_not_a_folder_of_manifests(tmp_path):
    with pytest.raises(PetatrainError, match="holds no"):
        validate.validate_dir(str(tmp_path))
    with pytest.raises(PetatrainError, match="not a directory"):
        validate.validate_dir(str(tmp_path / "nope"))


def test_validation_needs_no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("validation tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    for cached in (
        validate._k8s_definitions,
        validate._k8s_registry,
        validate._embedded_registry,
        validate._builtin_validator,
        validate._custom_resource,
    ):
        cached.cache_clear()
    assert problems(*(build() for build in MANIFESTS.values())) == []


# --- the cluster's CRDs, when given ------------------------------------------------------------


def widget_crd(versions=("v1",)):
    """A CRD of our own, as `kubectl get crd widgets.example.com -o yaml` would print it."""
    schema = {
        "type": "object",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": {
                "type": "object",
                "required": ["size"],
                "properties": {"size": {"type": "integer", "default": 1}, "colour": {"type": "string"}},
            },
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.example.com", "resourceVersion": "1"},
        "spec": {
            "group": "example.com",
            "names": {"kind": "Widget", "plural": "widgets"},
            "scope": "Namespaced",
            "versions": [
                {"name": v, "served": True, "storage": v == versions[0], "schema": {"openAPIV3Schema": schema}}
                for v in versions
            ],
        },
        "status": {"acceptedNames": {"kind": "Widget"}},
    }


def open_ray_job_crd():
    """A RayJob CRD of another release: v1 and v1alpha1, any spec."""
    crd = widget_crd(versions=("v1", "v1alpha1"))
    crd["metadata"]["name"] = "rayjobs.ray.io"
    crd["spec"]["group"] = "ray.io"
    crd["spec"]["names"] = {"kind": "RayJob", "plural": "rayjobs"}
    for version in crd["spec"]["versions"]:
        version["schema"]["openAPIV3Schema"]["properties"]["spec"] = {
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": True,
        }
    return crd


def widget(**spec):
    return {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}, "spec": spec}


def test_crds_from_a_kubectl_list(tmp_path):
    crds = tmp_path / "crds.yaml"
    crds.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [widget_crd(), open_ray_job_crd()]}))
    assert problems(widget(colour="red"), widget(), source="", crds=str(crds)) == []
    assert problems(widget(size="big", shade="red"), source="", crds=str(crds)) == [
        "Widget/w: spec.size: 'big' is not of type 'integer'",
        "Widget/w: spec.shade: unknown field",
    ]
    job = ray_job()
    job["apiVersion"] = "ray.io/v1alpha1"  # served by this CRD, not by the built-in schema
    job["spec"]["anything"] = True
    assert problems(job, crds=str(crds)) == []
    assert problems(job)[0].startswith("m.yaml: RayJob/tiny: apiVersion: RayJob is not served as ray.io/v1alpha1")
    # Kinds without a CRD there keep the built-in schemas.
    monitor = pod_monitor()
    monitor["spec"]["jobLabl"] = "x"
    assert problems(monitor, source="", crds=str(crds)) == [
        "PodMonitor/ray: spec.jobLabl: unknown field (did you mean 'jobLabel'?)"
    ]


def test_crds_from_a_directory_of_documents_and_from_the_environment(tmp_path, monkeypatch):
    (tmp_path / "crds").mkdir()
    (tmp_path / "crds" / "widgets.yaml").write_text(yaml.safe_dump_all([None, widget_crd()]))
    (tmp_path / "crds" / "README").write_text("not read")
    (tmp_path / "manifests").mkdir()
    (tmp_path / "manifests" / "w.yaml").write_text(yaml.safe_dump(widget(size=[2])))
    expected = ["w.yaml: Widget/w: spec.size: [2] is not of type 'integer'"]
    assert validate.validate_dir(str(tmp_path / "manifests"), crds=str(tmp_path / "crds")) == expected
    monkeypatch.setenv(validate.CRDS_ENV, str(tmp_path / "crds"))
    assert validate.validate_dir(str(tmp_path / "manifests")) == expected
    assert validate.validate_file(str(tmp_path / "manifests" / "w.yaml")) == [
        f"{tmp_path / 'manifests' / 'w.yaml'}: Widget/w: spec.size: [2] is not of type 'integer'"
    ]
    monkeypatch.delenv(validate.CRDS_ENV)
    (line,) = validate.validate_dir(str(tmp_path / "manifests"))
    assert line.startswith("w.yaml: Widget/w: kind: unknown kind Widget in example.com/v1")


def test_what_is_not_crds_is_refused(tmp_path):
    with pytest.raises(PetatrainError, match="no such file or directory of CustomResourceDefinitions"):
        problems(ray_job(), crds=str(tmp_path / "nope.yaml"))
    with pytest.raises(PetatrainError, match="holds no CustomResourceDefinition"):
        problems(ray_job(), crds=str(tmp_path))
    (tmp_path / "cm.yaml").write_text(yaml.safe_dump(config_map()))
    with pytest.raises(PetatrainError, match=r"cm.yaml: document 1: a ConfigMap, not a CustomResourceDefinition"):
        validate.validate_dir(str(tmp_path), crds=str(tmp_path / "cm.yaml"))
    old = widget_crd()
    old["apiVersion"] = "apiextensions.k8s.io/v1beta1"
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(old))
    with pytest.raises(PetatrainError, match=r"of apiextensions\.k8s\.io/v1beta1, not apiextensions\.k8s\.io/v1"):
        problems(widget(), crds=str(tmp_path / "old.yaml"))
    (tmp_path / "twice.yaml").write_text(yaml.safe_dump_all([widget_crd(), widget_crd()]))
    with pytest.raises(PetatrainError, match=r"Widget\.example\.com is defined again"):
        problems(widget(), crds=str(tmp_path / "twice.yaml"))


# --- the built-in schemas against the real CRDs ------------------------------------------------


def every_manifest_built_here():
    """id → documents: every manifest the tests above build."""
    cases = {f"valid-{name}": [build()] for name, build in MANIFESTS.items()}
    cases["valid-more-builtins"] = more_builtins()
    cases |= {f"schema-{id_}": [_mutated(build, mutate)] for id_, build, mutate, _ in SCHEMA_CASES}
    cases |= {f"rule-{id_}": [_mutated(ray_job, mutate)] for id_, mutate, _, _ in RULE_CASES}
    cases["rayservice-rules"] = list(bad_ray_services())
    cases["bad-builtins"] = bad_builtins()
    cases["not-manifests"] = not_manifests()
    return cases


def verdicts(docs, crds):
    """Per document, the paths that have problems (the messages may be worded differently)."""
    out = []
    for number, doc in enumerate(docs, start=1):
        label, findings = validate._check_document(doc, number, crds)
        out.append((label, sorted({validate._format_path(path) for path, _ in findings})))
    return out


def test_the_real_crds_hold_the_kinds_of_the_built_in_schemas(real_crds):
    given = validate._given_crds(real_crds)
    assert set(kuberay_schema.SCHEMAS) <= set(given), set(kuberay_schema.SCHEMAS) - set(given)
    rules = set()

    def walk(node):
        if isinstance(node, dict):
            rules.update(r["rule"] for r in node.get("x-kubernetes-validations") or [] if "oldSelf" not in r["rule"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for group, kind in kuberay_schema.SCHEMAS:
        walk(dict(given[(group, kind)].versions))
    assert rules <= set(validate._CEL_RULES), rules - set(validate._CEL_RULES)


@pytest.mark.parametrize("case", sorted(every_manifest_built_here()))
def test_built_in_schemas_agree_with_the_real_crds(case, real_crds):
    docs = every_manifest_built_here()[case]
    assert verdicts(docs, None) == verdicts(docs, real_crds)


def test_a_yaml_bomb_or_a_deep_nest_is_one_line_not_a_crash(tmp_path):
    """A 1 KB billion-laughs file expanded to gigabytes (OOM) and 50,000 levels of nesting crashed
    libyaml (a segfault): both are refused by a scan that builds nothing, before the YAML is loaded."""
    laughs = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for level in range(1, 10):
        prev = chr(ord("a") + level - 1)
        laughs.append(f"{chr(ord('a') + level)}: &{chr(ord('a') + level)} [{','.join(['*' + prev] * 12)}]")
    (tmp_path / "bomb.yaml").write_text("\n".join(laughs) + "\n")
    (tmp_path / "deep.yaml").write_text("[" * 50_000 + "]" * 50_000 + "\n")
    found = validate.validate_dir(str(tmp_path))
    assert len(found) == 2
    assert "bomb.yaml: line 10: more than 100 YAML aliases (a billion-laughs bomb?)" in found[0]
    assert found[1].startswith("deep.yaml: line 1: nested deeper than 100 levels")


def test_absurd_counts_and_negative_sizes_are_refused_as_the_api_server_refuses_them(tmp_path):
    """Attack round 3 MED (issue 35): an int32 field of 10^10, a negative memory or CPU limit, and
    parallel.workers or --count of 10^9 passed `deploy k8s --validate` and the build."""
    from petatrain import config
    from petatrain.api import deploy_k8s
    from petatrain.deploy import manifests
    from petatrain.deploy.manifests import Target
    from petatrain.errors import ConfigError

    cfg = config.load(str(Path(__file__).parent.parent / "examples" / "tiny.yaml"), ["data.dataset=s3://b/ds"])
    docs = manifests.build(cfg, Target(name="tiny", run_dir="s3://b/runs/x"))
    job = next(d for d in docs if d["kind"] == "RayJob")
    bad = copy.deepcopy(job)
    group = bad["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    group["maxReplicas"] = 10**10
    group["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] = "-8Gi"
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"}, "spec": {"ports": [{"port": 2**40}]}}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}}
    pod["spec"] = {"containers": [{"name": "c", "image": "i", "resources": {"requests": {"cpu": "-1"}}}]}
    for crds in (None, REAL_CRDS or None):
        found = validate.validate_documents([bad, service, pod], crds=crds)
        assert found == [
            "RayJob/tiny: spec.rayClusterSpec.workerGroupSpecs[0].maxReplicas: 10000000000 is beyond an int32's range",
            "RayJob/tiny: spec.rayClusterSpec.workerGroupSpecs[0].template.spec.containers[0].resources.limits.memory: "
            "'-8Gi': must be greater than or equal to 0",
            "Service/s: spec.ports[0].port: 1099511627776 is beyond an int32's range",
            "Pod/p: spec.containers[0].resources.requests.cpu: '-1': must be greater than or equal to 0",
        ], found
    with pytest.raises(ConfigError, match=r"parallel.workers: 1000000000 is over 100,000 ranks"):
        config.load(str(Path(__file__).parent.parent / "examples" / "tiny.yaml"), ["parallel.workers=1-1000000000"])
    with pytest.raises(ConfigError, match=r"--count 1000000000: 1 to 100,000 accelerators"):
        deploy_k8s(cfg, Target(name="tiny", run_dir="s3://b/runs/x"), str(tmp_path), count=10**9)
