"""Offline validation of Kubernetes manifests: KubeRay CRDs, the operator's Go rules, built-in
kinds. Every problem is one line naming the file, the object and the path in the document."""

import copy
import socket
from importlib import resources
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from petatrain.deploy import validate
from petatrain.errors import PetatrainError

SAMPLES = Path(__file__).parent / "data" / "kuberay-samples"
CRDS = resources.files("petatrain.deploy") / "crds"

needs_crds = pytest.mark.skipif(
    not (CRDS / "kuberay-v1.7.0" / "ray.io_rayjobs.yaml").is_file(),
    reason="the KubeRay v1.7.0 CRDs are not vendored under src/petatrain/deploy/crds/kuberay-v1.7.0/",
)


def problems(*docs, source="rayjob.yaml"):
    lines = validate.validate_documents(list(docs), source)
    assert all("\n" not in line for line in lines), lines
    return lines


def cluster_spec():
    return {
        "rayVersion": "2.60.0",
        "headGroupSpec": {
            "rayStartParams": {},
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "ray-head",
                            "image": "rayproject/ray:2.60.0",
                            "resources": {"limits": {"cpu": "1", "memory": "2Gi"}},
                        }
                    ]
                }
            },
        },
        "workerGroupSpecs": [
            {
                "groupName": "cpu",
                "replicas": 1,
                "minReplicas": 1,
                "maxReplicas": 2,
                "rayStartParams": {},
                "template": {"spec": {"containers": [{"name": "ray-worker", "image": "rayproject/ray:2.60.0"}]}},
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
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "tiny"}, "spec": cluster_spec()}


def ray_service():
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": "serve"},
        "spec": {"serveConfigV2": "applications: []\n", "rayClusterConfig": cluster_spec()},
    }


def pvc():
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "runs"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "10Gi"}}},
    }


def builtins():
    return [
        pvc(),
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "petatrain"}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3"}, "stringData": {"key": "v"}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "job"}, "data": {"job.yaml": "train: {}\n"}},
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


def worker(doc):
    return doc["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]


# --- valid manifests ---------------------------------------------------------------------------


@needs_crds
@pytest.mark.parametrize(
    "sample",
    sorted(p.name for p in SAMPLES.glob("*.yaml")) or [pytest.param("none", marks=pytest.mark.skip("no samples"))],
)
def test_upstream_kuberay_samples_are_valid(sample):
    assert validate.validate_file(str(SAMPLES / sample)) == []


@needs_crds
def test_our_manifests_are_valid():
    assert problems(ray_job(), ray_cluster(), ray_service(), *builtins()) == []


@needs_crds
def test_deprecated_v1alpha1_is_still_served():
    doc = ray_cluster()
    doc["apiVersion"] = "ray.io/v1alpha1"
    assert problems(doc) == []


# --- CRD schemas -------------------------------------------------------------------------------


@needs_crds
def test_wrong_type_is_one_line_naming_file_object_and_path():
    doc = ray_job()
    worker(doc)["minReplicas"] = "two"
    assert problems(doc) == [
        "rayjob.yaml: RayJob/tiny: spec.rayClusterSpec.workerGroupSpecs[0].minReplicas: 'two' is not of type 'integer'"
    ]


@needs_crds
def test_unknown_field_is_an_error_with_a_suggestion():
    doc = ray_job()
    worker(doc)["minReplica"] = worker(doc).pop("minReplicas")
    (line,) = problems(doc)
    assert "spec.rayClusterSpec.workerGroupSpecs[0].minReplica: unknown field (did you mean 'minReplicas'?)" in line


@needs_crds
def test_unknown_field_in_crd_metadata_is_an_error():
    doc = ray_cluster()
    doc["metadata"]["lables"] = {"a": "b"}
    assert problems(doc) == ["rayjob.yaml: RayCluster/tiny: metadata.lables: unknown field (did you mean 'labels'?)"]


@needs_crds
def test_missing_required_field_names_the_field():
    doc = ray_job()
    del worker(doc)["groupName"]
    assert problems(doc) == [
        "rayjob.yaml: RayJob/tiny: spec.rayClusterSpec.workerGroupSpecs[0].groupName: required field is missing"
    ]


@needs_crds
def test_required_fields_with_a_default_may_be_left_out():
    # The CRD lists minReplicas and maxReplicas as required, with defaults 0 and 2147483647: the
    # API server fills them in before it validates, so a manifest without them is accepted.
    doc = ray_job()
    del worker(doc)["minReplicas"], worker(doc)["maxReplicas"]
    assert problems(doc) == []
    del doc["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert problems(doc) == ["rayjob.yaml: RayJob/tiny: spec.rayClusterSpec.headGroupSpec: required field is missing"]


@needs_crds
def test_string_where_a_bool_belongs():
    doc = ray_job()
    doc["spec"]["shutdownAfterJobFinishes"] = "yes"
    assert problems(doc) == ["rayjob.yaml: RayJob/tiny: spec.shutdownAfterJobFinishes: 'yes' is not of type 'boolean'"]


@needs_crds
def test_int_or_string_quantity():
    doc = ray_job()
    limits = doc["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    limits["cpu"] = 2  # an integer is a quantity too
    assert problems(doc) == []
    limits["cpu"] = [1]
    (line,) = problems(doc)
    path = "spec.rayClusterSpec.headGroupSpec.template.spec.containers[0].resources.limits.cpu"
    assert f"{path}: [1] is not of type 'integer' or 'string'" in line


@needs_crds
def test_list_map_keys_are_unique():
    doc = ray_job()
    doc["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"].append(
        {"name": "ray-head", "image": "busybox"}
    )
    (line,) = problems(doc)
    assert "spec.rayClusterSpec.headGroupSpec.template.spec.containers[1]: duplicate entry (name='ray-head')" in line


@needs_crds
def test_cel_rule_of_the_crd():
    doc = ray_job()
    doc["spec"]["deletionStrategy"] = {"onSuccess": {"policy": "DeleteCluster"}}
    (line,) = problems(doc)
    assert "RayJob/tiny: spec.deletionStrategy: deletionStrategy requires either BOTH onSuccess and onFailure" in line


@needs_crds
def test_every_cel_rule_of_the_vendored_crds_is_ported():
    rules = set()

    def walk(node):
        if isinstance(node, dict):
            rules.update(r["rule"] for r in node.get("x-kubernetes-validations") or [] if "oldSelf" not in r["rule"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for folder in CRDS.iterdir():
        for file in folder.iterdir() if folder.is_dir() else []:
            if file.name.endswith(".yaml"):
                walk(yaml.load(file.read_text(), Loader=validate._BaseLoader))
    assert rules, "the vendored CRDs carry CEL rules"
    assert rules <= set(validate._CEL_RULES), rules - set(validate._CEL_RULES)


@needs_crds
def test_other_vendored_crds():
    monitor = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": "ray"},
        "spec": {"selector": {}, "podMetricsEndpoints": [{"port": "metrics", "interva": "15s"}]},
    }
    scaled = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": "serve"},
        "spec": {
            "scaleTargetRef": {"name": "x"},
            "minReplicaCount": 5,
            "maxReplicaCount": 2,
            "triggers": [{"type": "cpu", "metadata": {"value": "60"}}],
        },
    }
    lines = problems(monitor, scaled)
    assert len(lines) == 2
    assert lines[0].endswith(
        "PodMonitor/ray: spec.podMetricsEndpoints[0].interva: unknown field (did you mean 'interval'?)"
    )
    assert lines[1].endswith("ScaledObject/serve: spec: minReplicaCount must be less than or equal to maxReplicaCount")


# --- the operator's Go rules -------------------------------------------------------------------


def _set_worker(**fields):
    return lambda doc: worker(doc).update(fields)


def _set_spec(**fields):
    return lambda doc: doc["spec"].update(fields)


def _set_cluster(**fields):
    return lambda doc: doc["spec"]["rayClusterSpec"].update(fields)


def _head_pod(doc):
    return doc["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]


@needs_crds
@pytest.mark.parametrize(
    ("mutate", "path", "message"),
    [
        (
            _set_worker(minReplicas=3, maxReplicas=2),
            "spec.rayClusterSpec.workerGroupSpecs[0].minReplicas",
            "worker group cpu has minReplicas 3 greater than maxReplicas 2",
        ),
        (
            lambda doc: doc["spec"]["rayClusterSpec"]["workerGroupSpecs"].append(copy.deepcopy(worker(doc))),
            "spec.rayClusterSpec.workerGroupSpecs[1].groupName",
            "worker group names must be unique",
        ),
        (
            lambda doc: _head_pod(doc).update(containers=[]),
            "spec.rayClusterSpec.headGroupSpec.template.spec.containers",
            "headGroupSpec should have at least one container",
        ),
        (
            lambda doc: worker(doc).update(rayStartParams={"num-cpus": "2"}, resources={"CPU": "2"}),
            "spec.rayClusterSpec.workerGroupSpecs[0].resources",
            "resource fields should not be set in both rayStartParams and Resources for cpu group",
        ),
        (
            _set_spec(shutdownAfterJobFinishes=False),
            "spec.ttlSecondsAfterFinished",
            "shutdownAfterJobFinishes set to false cannot have TTLSecondsAfterFinished",
        ),
        (
            _set_spec(shutdownAfterJobFinishes=False, ttlSecondsAfterFinished=0, suspend=True),
            "spec.suspend",
            "shutdownAfterJobFinishes set to false is not allowed to be suspended",
        ),
        (
            _set_spec(submissionMode="InteractiveMode", backoffLimit=2),
            "spec.backoffLimit",
            "BackoffLimit is incompatible with InteractiveMode",
        ),
        (
            lambda doc: (
                doc["spec"].pop("rayClusterSpec"),
                doc["spec"].update(clusterSelector={"ray.io/cluster": "c"}, backoffLimit=1),
            ),
            "spec.backoffLimit",
            "BackoffLimit is incompatible with ClusterSelector mode",
        ),
        (_set_spec(submissionMode="K8sMode"), "spec.submissionMode", "'K8sMode' is not a submission mode"),
        (_set_spec(runtimeEnvYAML="- pip"), "spec.runtimeEnvYAML", "failed to unmarshal RuntimeEnvYAML"),
        (_set_spec(activeDeadlineSeconds=0), "spec.activeDeadlineSeconds", "must be a positive integer"),
        (
            lambda doc: doc["metadata"].update(name="x" * 48),
            "metadata.name",
            "RayJob name should be no more than 47 characters",
        ),
        (
            lambda doc: doc["metadata"].update(name="1tiny"),
            "metadata.name",
            "RayJob name should be a valid DNS1035 label",
        ),
        (
            _set_cluster(enableInTreeAutoscaling=True, autoscalerOptions={"version": "v2"}),
            None,
            None,
        ),
        (
            lambda doc: (
                doc["spec"]["rayClusterSpec"].update(enableInTreeAutoscaling=True, autoscalerOptions={"version": "v2"}),
                _head_pod(doc).update(restartPolicy="Always"),
            ),
            "spec.rayClusterSpec.headGroupSpec.template.spec.restartPolicy",
            "restartPolicy for head Pod should be Never or unset when using autoscaler V2",
        ),
        (
            _set_worker(idleTimeoutSeconds=60),
            "spec.rayClusterSpec.workerGroupSpecs[0].idleTimeoutSeconds",
            "idleTimeoutSeconds is set, but autoscaler v2 is not enabled",
        ),
        (
            lambda doc: _head_pod(doc)["containers"][0].update(
                env=[{"name": "RAY_enable_autoscaler_v2", "value": "1"}]
            ),
            "spec.rayClusterSpec.headGroupSpec.template.spec.containers[0].env",
            "cannot be set to '1' when enableInTreeAutoscaling is false",
        ),
        (
            _set_cluster(authOptions={"mode": "token"}, rayVersion="2.50.0"),
            "spec.rayClusterSpec.rayVersion",
            "authOptions.mode is 'token' but minimum Ray version is 2.52.0, got 2.50.0",
        ),
        (
            _set_cluster(networkPolicy={"mode": "DenyAll"}),
            "spec.rayClusterSpec.networkPolicy",
            "requires the RayClusterNetworkPolicy feature gate",
        ),
        (
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
    ],
)
def test_operator_rules_for_rayjob(mutate, path, message):
    doc = ray_job()
    mutate(doc)
    lines = problems(doc)
    if message is None:
        assert lines == []
        return
    assert [line for line in lines if f"RayJob/{doc['metadata']['name']}: {path}: " in line and message in line], lines


@needs_crds
def test_operator_rules_for_rayservice():
    doc = ray_service()
    doc["metadata"]["annotations"] = {"ray.io/initializing-timeout": "soon"}
    doc["spec"]["upgradeStrategy"] = {"type": "Rolling"}
    doc["spec"]["rayClusterConfig"]["headGroupSpec"]["headService"] = {"metadata": {"name": "fixed"}}
    assert problems(doc, source="") == [
        'RayService/serve: metadata.annotations["ray.io/initializing-timeout"]: annotation ray.io/initializing-timeout '
        "has invalid format: soon. Expected Go duration format (e.g., '5m', '1h') or positive integer seconds",
        "RayService/serve: spec.rayClusterConfig.headGroupSpec.headService.metadata.name: "
        "spec.rayClusterConfig.headGroupSpec.headService.metadata.name should not be set",
        "RayService/serve: spec.upgradeStrategy.type: Spec.UpgradeStrategy.Type value Rolling is invalid, "
        "valid options are NewClusterWithIncrementalUpgrade, NewCluster, None",
    ]
    doc = ray_service()
    doc["metadata"]["annotations"] = {"ray.io/initializing-timeout": "5m"}
    doc["spec"]["upgradeStrategy"] = {"type": "NewClusterWithIncrementalUpgrade"}
    assert problems(doc, source="") == [
        "RayService/serve: spec.rayClusterConfig.enableInTreeAutoscaling: "
        "Ray Autoscaler is required for NewClusterWithIncrementalUpgrade"
    ]


@needs_crds
def test_operator_rules_wait_for_a_schema_valid_spec():
    doc = ray_job()
    worker(doc)["minReplicas"] = "3"  # a string: the Go comparison with maxReplicas is never reached
    worker(doc)["maxReplicas"] = 2
    assert problems(doc) == [
        "rayjob.yaml: RayJob/tiny: spec.rayClusterSpec.workerGroupSpecs[0].minReplicas: '3' is not of type 'integer'"
    ]


# --- built-in kinds ----------------------------------------------------------------------------


def test_builtin_kind_with_a_bad_field():
    doc = pvc()
    doc["spec"]["resources"]["requests"]["storage"] = [1]
    doc["spec"]["storageClas"] = "fast"
    assert problems(doc, source="") == [
        "PersistentVolumeClaim/runs: spec.resources.requests.storage: [1] is not of type 'string' or 'number'",
        "PersistentVolumeClaim/runs: spec.storageClas: unknown field (did you mean 'storageClassName'?)",
    ]


def test_builtin_verdicts_agree_with_kubernetes_validate():
    version = validate.KUBERNETES_VERSION
    for doc in builtins():
        kubernetes_validate.validate(doc, version, strict=True)
    bad = pvc()
    bad["spec"]["storageClas"] = "fast"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, version, strict=True)
    assert problems(bad)


def test_names_follow_each_kinds_rule():
    service = builtins()[4]
    service["metadata"]["name"] = "metrics.v1"  # a Service name is a DNS-1035 label: no dots
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "Creds", "namespace": "ML"}}
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {}}
    lines = problems(service, secret, config, source="")
    assert lines[0].startswith(
        "Service/metrics.v1: metadata.name: 'metrics.v1' is not a valid Service name: a DNS-1035"
    )
    assert lines[1].startswith("Secret/Creds: metadata.name: 'Creds' is not a valid Secret name: a lowercase RFC 1123")
    assert lines[2].startswith("Secret/Creds: metadata.namespace: 'ML': a lowercase RFC 1123 label")
    assert lines[3] == "ConfigMap (document 3): metadata.name: required field is missing"
    assert len(lines) == 4


def test_bad_label_is_named_by_its_key():
    doc = pvc()
    doc["metadata"]["labels"] = {"team/ml/x": "a b"}
    lines = problems(doc, source="")
    assert len(lines) == 2
    assert all(line.startswith('PersistentVolumeClaim/runs: metadata.labels["team/ml/x"]: invalid ') for line in lines)


# --- what is not a manifest --------------------------------------------------------------------


def test_unknown_kind_and_documents_without_kind():
    lines = problems(
        {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}},
        {"apiVersion": "rbac.example.com/v1", "kind": "Role", "metadata": {"name": "r"}},
        {"kind": "ConfigMap", "metadata": {"name": "c"}},
        ["not", "a", "mapping"],
        source="misc.yaml",
    )
    assert lines[0].startswith("misc.yaml: Widget/w: kind: unknown kind Widget in example.com/v1: not a Kubernetes")
    assert lines[1].startswith("misc.yaml: Role/r: kind: unknown kind Role in rbac.example.com/v1")
    assert lines[2] == "misc.yaml: ConfigMap/c: apiVersion missing: every manifest names its apiVersion and kind"
    assert lines[3] == "misc.yaml: document 4: a YAML list, not a mapping with apiVersion and kind"
    assert len(lines) == 4


@needs_crds
def test_version_the_crd_does_not_serve():
    doc = ray_job()
    doc["apiVersion"] = "ray.io/v2"
    assert problems(doc) == [
        "rayjob.yaml: RayJob/tiny: apiVersion: RayJob is not served as ray.io/v2 "
        "(the CRD ray.io_rayjobs.yaml serves v1, v1alpha1)"
    ]


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
    (tmp_path / "b.yml").write_text(yaml.safe_dump(pvc()))
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


@needs_crds
def test_validation_needs_no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("validation tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    for cached in (validate._k8s_registry, validate._builtin_validator, validate._custom_resource):
        cached.cache_clear()
    assert problems(ray_job(), *builtins()) == []
