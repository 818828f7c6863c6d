"""KubeRay manifests for a job config: built as data, dumped once (`petatrain deploy k8s`).

`build(cfg, Target) -> list[dict]` returns the documents, in the order `kubectl apply -f DIR`
should meet them: the ServiceAccount, the ConfigMap with the resolved job config, the RayJob
(with its `rayClusterSpec`) or RayCluster, and the Prometheus Operator PodMonitor.

- Sizes: one Ray worker pod is one node. On an accelerator, a node holds the catalog's
  `node_devices` (e.g. 8 H100s); the worker group has as many pods as the worker count
  needs, `minReplicas`/`maxReplicas` from a `parallel.workers` range (in-tree autoscaling on
  when they differ), GPUs requested and limited, a node selector on the GPU product label and
  a toleration for the GPU taint. On CPU, a pod holds one training worker.
- Secrets by reference only: the S3 credentials come from a Secret's keys (`secretKeyRef`); the
  files the config names (keyrings `file:PATH`, an SSE-C key `file:PATH`, a CA bundle) from the
  Secret NAME-keyring, one key per file name, mounted read-only at KEYS_PATH, and the config the pods
  read names them there; an SSE-C key `env:NAME` from that Secret's key NAME; a Barbican key
  container's credentials (OS_AUTH_TOKEN, OS_PROJECT_ID) from the Secret NAME-kms. No value of any
  is ever written here.
- What the pods read and write must be where they can see it: the dataset, the run directory and a
  registry the config names are object-store URLs, or absolute paths under a volume the user names
  (`Target.volumes`: a PersistentVolumeClaim mounted on every pod, e.g. an NFS or Lustre share). A
  path on the machine that wrote the manifests is refused in one line.
- The node-local shard cache (`PETATRAIN_CACHE_DIR`) is an `emptyDir` with a size limit, or,
  with a storage class (local NVMe), a generic ephemeral volume: a PVC per pod, gone with it.
  `/dev/shm` is a memory-backed `emptyDir` as large as Ray's object store, which lives there (30% of
  the pod's memory, Ray's default; Kubernetes' own 64 MiB would make Ray fall back to disk).
- The RayJob's entrypoint is `petatrain train ... --resume` against the run directory on the
  object store: a retry (`backoffLimit`), a lost head pod or a new cluster continues the run
  from its newest committed checkpoint. The driver serves /livez and /readyz on
  `HEALTH_PORT`; the head's liveness probe asks it (deploy/probe.py).
"""

from __future__ import annotations

import dataclasses
import math
import posixpath
import re
import shlex
from dataclasses import dataclass
from typing import Any, Literal

from petatrain import __version__, constants
from petatrain.config import JobConfig
from petatrain.constants import SERVE_APP
from petatrain.deploy.probe import HEALTH_PORT
from petatrain.errors import ConfigError

RAY_VERSION = "2.60.0"
METRICS_PORT = 8078  # the driver's Prometheus endpoint (observe.metrics_port)
RAY_METRICS_PORT = 8080  # Ray's own metrics export port on every node
CONFIG_PATH = "/etc/petatrain/job.yaml"
CACHE_PATH = "/var/cache/petatrain"
KEYS_PATH = "/var/run/petatrain/keys"  # the Secret NAME-keyring's files, read-only
_RESERVED = ("/dev/shm", CACHE_PATH, "/etc/petatrain", KEYS_PATH)  # mount paths a --volume may not take
# The label NVIDIA's GPU feature discovery puts on a node, per catalog accelerator; AMD's for MI300X.
GPU_PRODUCT = {
    "H100-SXM": ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"),
    "H100-PCIe": ("nvidia.com/gpu.product", "NVIDIA-H100-PCIe"),
    "H200": ("nvidia.com/gpu.product", "NVIDIA-H200"),
    "B200": ("nvidia.com/gpu.product", "NVIDIA-B200"),
    "A100-40GB": ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-40GB"),
    "A100-80GB": ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-80GB"),
    "L40S": ("nvidia.com/gpu.product", "NVIDIA-L40S"),
    "L4": ("nvidia.com/gpu.product", "NVIDIA-L4"),
    "A10G": ("nvidia.com/gpu.product", "NVIDIA-A10G"),
    "MI300X": ("amd.com/gpu.product-name", "AMD_Instinct_MI300X_OAM"),
}


@dataclass(kw_only=True, slots=True)
class Target:
    """Where and how the job runs on Kubernetes (the `deploy k8s` options)."""

    name: str
    run_dir: str  # the run directory on the object store (s3://...): what a retry continues, or what is served
    checkpoint: str = "final"  # rayservice: final, latest (follows new checkpoints) or a step
    image: str = f"petatrain:{__version__}"
    namespace: str = "default"
    kind: Literal["rayjob", "raycluster", "rayservice"] = "rayjob"
    accelerator: str = ""  # a catalog name (H100-SXM, ...); "" trains on CPU pods
    devices_per_node: int = 0  # accelerators a node holds (the catalog's node_devices)
    workers: tuple[int, int] = (0, 0)  # training workers, min-max; (0, 0): the config's parallel.workers
    s3_secret: str = ""  # Secret with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY; "" = NAME-s3
    keyring_secret: str = ""  # Secret holding the keyring file; "" = NAME-keyring (when the config encrypts)
    cache_size: str = "100Gi"
    cache_storage_class: str = ""  # "" = emptyDir; else a per-pod ephemeral PVC of this class
    shm_size: str = ""  # "" = Ray's object store: 30% of the pod's memory
    cpu_per_device: int = 12
    memory_per_device: str = "160Gi"
    backoff_limit: int = 3
    active_deadline_s: int = 7 * 24 * 3600
    idle_timeout_s: int = 120
    # (PersistentVolumeClaim, mount path): shared volumes every pod mounts read-write, where local
    # paths of the config (a dataset on NFS or Lustre) are found at the same absolute path
    volumes: tuple[tuple[str, str], ...] = ()
    registry: str = ""  # rayservice of registry://NAME@ALIAS: the registry's URL (follows the alias)
    queue: str = ""  # a Kueue LocalQueue: the job's pods are admitted together, within its quota
    fabric: str = ""  # "", "efa", "infiniband" or RESOURCE=COUNT: the GPU pods' RDMA network devices


def check_name(name: str) -> str:
    """A RayJob/RayCluster/RayService name: a DNS-1035 label short enough for the names KubeRay derives
    from it (47 characters: deploy/kuberay_rules.py)."""
    from petatrain.deploy.k8s_names import dns1035_label

    problems = dns1035_label(name) + ([] if len(name) <= 47 else ["must be no more than 47 characters"])
    if problems:
        raise ConfigError(f"--name {name!r}: {'; '.join(problems)}")
    return name


def name_from(path: str) -> str:
    """A valid default name from a config file's stem ("examples/tiny.yaml" -> "petatrain-tiny")."""
    stem = re.sub(r"[^a-z0-9-]+", "-", path.rsplit("/", 1)[-1].rsplit(".", 1)[0].lower()).strip("-")
    return check_name(f"petatrain-{stem}"[:47].rstrip("-"))


# The RDMA fabrics a GPU pod can ask for: the device plugin's resource and count a node offers, and
# what NCCL and libfabric need to use it (the image carries the NCCL plugin: aws-ofi-nccl for EFA).
FABRICS: dict[str, tuple[str, str, dict[str, str]]] = {
    # AWS p5/p5e/p5en: 32 EFA interfaces a node (p4d: 4; name the count with vpc.amazonaws.com/efa=4)
    "efa": ("vpc.amazonaws.com/efa", "32", {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1"}),
    # Mellanox/NVIDIA InfiniBand or RoCE through the RDMA shared device plugin's default resource
    "infiniband": ("rdma/rdma_shared_device_a", "1", {"NCCL_IB_DISABLE": "0"}),
}


def check_fabric(spec: str) -> str:
    """`--fabric`: efa, infiniband or RESOURCE=COUNT (a device plugin's resource), one-line errors."""
    if spec in ("", *FABRICS):
        return spec
    resource, sep, count = spec.partition("=")
    from petatrain.deploy.k8s_names import qualified_name

    problems = qualified_name(resource) if sep else ["is not efa, infiniband or RESOURCE=COUNT"]
    if sep and not (count.isdigit() and int(count) > 0):
        problems.append(f"count {count!r} is not a positive integer")
    if problems:
        raise ConfigError(f"--fabric {spec!r}: {'; '.join(problems)}")
    return spec


def _fabric(target: Target) -> tuple[str, str, dict[str, str]] | None:
    if not target.fabric:
        return None
    if target.fabric in FABRICS:
        return FABRICS[target.fabric]
    resource, _, count = target.fabric.partition("=")
    return resource, count, {}


def check_volume(spec: str) -> tuple[str, str]:
    """`CLAIM:/PATH` (the `--volume` option) as (claim, path), one-line errors."""
    from petatrain.deploy.k8s_names import dns1123_subdomain

    claim, sep, path = spec.partition(":")
    problems = dns1123_subdomain(claim) if claim else ["names no PersistentVolumeClaim"]
    if not sep or not path.startswith("/") or posixpath.normpath(path) == "/":
        problems.append("needs an absolute mount path other than / (CLAIM:/PATH)")
    elif any(_under(path, taken) or _under(taken, path) for taken in _RESERVED):
        problems.append(f"{path} overlaps a path petatrain mounts ({', '.join(_RESERVED)})")
    if problems:
        raise ConfigError(f"--volume {spec!r}: {'; '.join(problems)}")
    return claim, posixpath.normpath(path)


def _under(path: str, folder: str) -> bool:
    path, folder = posixpath.normpath(path), posixpath.normpath(folder)
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _check_reachable(value: str, what: str, target: Target) -> None:
    """ConfigError unless the pods can reach `value`: an object-store URL, or an absolute path under
    one of the target's volumes."""
    from petatrain.storage.fs import is_local

    if not is_local(value) and not value.startswith("memory://"):
        return
    path = value.removeprefix("file://")
    if path.startswith("/") and any(_under(path, mount) for _, mount in target.volumes):
        return
    where = (
        f"under a volume's mount ({', '.join(mount for _, mount in target.volumes)})"
        if target.volumes
        else "and name the volume that holds it (--volume CLAIM:/PATH)"
    )
    raise ConfigError(
        f"{what} {value!r} is a path on this machine, which the pods cannot see: put it on the object store "
        f"(s3://...), or give an absolute path {where}"
    )


def key_files(cfg: JobConfig) -> dict[str, str]:
    """The files the config names that the pods read from the Secret NAME-keyring: file name -> the
    local path it was read from here (what `kubectl create secret generic NAME-keyring
    --from-file=NAME=PATH` needs)."""
    files: dict[str, str] = {}
    for what, ref in _file_refs(cfg):
        local = ref.removeprefix("file:") if what != "storage.ca_bundle" else ref
        local = posixpath.abspath(posixpath.expanduser(local))
        name = posixpath.basename(local)
        if files.get(name, local) != local:
            raise ConfigError(
                f"{what}: {local} and {files[name]} have the same file name ({name}); the pods read both from the "
                "Secret's key of that name: rename one"
            )
        files[name] = local
    return files


def _file_refs(cfg: JobConfig) -> list[tuple[str, str]]:
    storage = cfg.storage
    refs = [
        ("storage.encryption.key", storage.encryption.key),
        ("storage.signing.key", storage.signing.key),
        ("storage.sse.customer_key", storage.sse.customer_key),
    ]
    found = [(what, ref) for what, ref in refs if ref.startswith("file:")]
    return found + ([("storage.ca_bundle", storage.ca_bundle)] if storage.ca_bundle else [])


def for_pods(cfg: JobConfig, target: Target) -> JobConfig:
    """The config as the pods read it: the files it names at KEYS_PATH, where the Secret is mounted.
    ConfigError (one line) for a dataset, run directory or registry the pods cannot reach."""
    if target.kind != "raycluster" or target.run_dir:
        _check_reachable(target.run_dir, "--run-dir", target)
    if target.kind != "rayservice":  # serving reads the run, not the data
        _check_reachable(cfg.data.dataset, "data.dataset", target)
    if cfg.promote.registry:
        _check_reachable(cfg.promote.registry, "promote.registry", target)
    storage = cfg.storage

    def moved(ref: str, prefix: str = "file:") -> str:
        if not ref.startswith(prefix):
            return ref
        return f"{prefix}{KEYS_PATH}/{posixpath.basename(posixpath.abspath(ref.removeprefix(prefix)))}"

    key_files(cfg)  # names that collide are refused before anything is built
    storage = dataclasses.replace(
        storage,
        encryption=dataclasses.replace(storage.encryption, key=moved(storage.encryption.key)),
        signing=dataclasses.replace(storage.signing, key=moved(storage.signing.key)),
        sse=dataclasses.replace(storage.sse, customer_key=moved(storage.sse.customer_key)),
        ca_bundle=moved(storage.ca_bundle, "") if storage.ca_bundle else "",
    )
    return dataclasses.replace(cfg, storage=storage)


def build(cfg: JobConfig, target: Target) -> list[dict[str, Any]]:
    """Every document `deploy k8s` writes, as data."""
    check_name(target.name)
    check_fabric(target.fabric)
    if target.fabric and not target.accelerator:
        raise ConfigError(f"--fabric {target.fabric}: an RDMA fabric is for GPU pods; name the --accelerator")
    if target.queue:
        from petatrain.deploy.k8s_names import dns1123_label

        problems = dns1123_label(target.queue)
        if problems:
            raise ConfigError(f"--queue {target.queue!r}: {'; '.join(problems)}")
        if target.kind == "rayservice":
            raise ConfigError("--queue: Kueue admits RayJobs and RayClusters; a RayService is not queued")
    for claim, path in target.volumes:
        check_volume(f"{claim}:{path}")
    files = key_files(cfg)
    cfg = for_pods(cfg, target)
    if target.kind == "rayservice":  # a pod per Serve replica, as many as Serve may autoscale to
        lo, hi = target.workers if target.workers != (0, 0) else cfg.serve.replica_range()
    else:
        lo, hi = target.workers if target.workers != (0, 0) else cfg.parallel.worker_range()
    per_pod = target.devices_per_node if target.accelerator else 1
    pods = (math.ceil(lo / per_pod), math.ceil(hi / per_pod))
    labels = {"app.kubernetes.io/name": "petatrain", "app.kubernetes.io/instance": target.name}
    meta = {"name": target.name, "namespace": target.namespace, "labels": labels}
    if target.queue:  # Kueue admits the job (all its pods, as one gang) when its quota has room
        meta = {**meta, "labels": {**labels, "kueue.x-k8s.io/queue-name": target.queue}}
    documents: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta, "automountServiceAccountToken": False},
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {**meta, "name": f"{target.name}-config"},
            "data": {"job.yaml": cfg.to_yaml()},  # to_dict leaves the credentials out
        },
    ]
    cluster = _cluster_spec(cfg, target, pods, labels, files)
    if target.queue:  # created suspended: Kueue unsuspends it once admitted
        cluster = {**cluster, "suspend": True} if target.kind == "raycluster" else cluster
    if target.kind == "rayjob":
        spec = _job_spec(target, _entrypoint(target), cluster)
        if target.queue:
            spec["suspend"] = True
        documents.append({"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": meta, "spec": spec})
    elif target.kind == "rayservice":
        service = {"serveConfigV2": _serve_config(cfg, target), "rayClusterConfig": cluster}
        documents.append({"apiVersion": "ray.io/v1", "kind": "RayService", "metadata": meta, "spec": service})
    else:
        documents.append({"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": meta, "spec": cluster})
    documents.append(_pod_monitor(target, meta, labels))
    return documents


def _job_spec(target: Target, entrypoint: str, cluster: dict[str, Any]) -> dict[str, Any]:
    """A RayJob's spec (a RayCronJob's jobTemplate): each retry is a new cluster whose driver goes on
    where the last stopped (train --resume, loop --once)."""
    return {
        "entrypoint": entrypoint,
        "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": 600,
        "backoffLimit": target.backoff_limit,
        "activeDeadlineSeconds": target.active_deadline_s,
        "rayClusterSpec": cluster,
    }


LOOP_PATH = "/etc/petatrain/loop.yaml"


CRONS = ("raycronjob", "cronjob", "kfp")


def build_loop(
    spec: Any,
    target: Target,
    schedule: str,
    time_zone: str = "",
    cron: str = "raycronjob",
    kfp_service_account: str = constants.KFP_SERVICE_ACCOUNT,
) -> list[dict[str, Any]]:
    """What `deploy k8s --loop LOOP.yaml` writes: what runs one cycle of the loop (`petatrain loop
    --once`) on `schedule`, and a RayService `NAME-serve` that serves `registry://MODEL@champion` and
    follows it. `cron` "raycronjob": a KubeRay RayCronJob, each cycle in a cluster of its own (the
    operator's RayCronJob feature gate); "cronjob": a Kubernetes CronJob whose pod submits the cycle
    to a standing RayCluster `NAME` (its workers autoscaled from none) with `ray job submit` and waits
    for it; "kfp": no schedule here (a Kubeflow pipeline's recurring run is the clock), the train
    step's RayJob (`petatrain loop --once --only train`) as a template in the ConfigMap, which the
    pipeline's train step creates once per pipeline run and waits for (petatrain.kubeflow), and
    the Role that lets KFP's pods (`kfp_service_account`) read the ConfigMap and create, read and
    delete RayJobs. The source, dataset, runs and registry must be where every pod finds them (the
    object store, or a named volume)."""
    from petatrain.deploy.kuberay_rules import cron_problem

    if cron not in CRONS:
        raise ConfigError(
            f"--cron {cron!r}: raycronjob (KubeRay's, feature-gated), cronjob (Kubernetes') or kfp (Kubeflow Pipelines)"
        )
    check_name(target.name)
    check_name(f"{target.name}-serve")
    if cron == "cronjob":
        check_name(f"{target.name}-cycle")
    if cron == "kfp":  # the RayJob of a pipeline run: NAME-train-<8 hex digits>
        check_name(f"{target.name}-train-00000000")
        from petatrain.deploy.k8s_names import dns1123_label, dns1123_subdomain

        where, _, account = kfp_service_account.rpartition("/")
        if problems := dns1123_subdomain(account) + (dns1123_label(where) if where else []):
            raise ConfigError(f"--kfp-service-account {kfp_service_account!r}: {'; '.join(problems)}")
    if cron == "kfp" and (schedule or time_zone):
        given = "--schedule" if schedule else "--time-zone"
        raise ConfigError(f"{given} with --cron kfp: the Kubeflow pipeline's recurring run is the schedule")
    problem = "cannot use TZ or CRON_TZ in it, use --time-zone" if "TZ" in schedule else cron_problem(schedule)
    if problem and cron != "kfp":
        raise ConfigError(f"--schedule {schedule!r}: {problem}")
    if time_zone:
        import zoneinfo

        try:
            zoneinfo.ZoneInfo(time_zone)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise ConfigError(f"--time-zone {time_zone!r}: not a time zone name (e.g. Europe/Paris, UTC)") from None
    cfg = spec.job_config()
    registry = spec.registry or cfg.promote.registry
    if not registry:
        raise ConfigError(
            "the loop's registry is this machine's .petatrain/registry, which the pods cannot see: set registry: "
            "s3://BUCKET/registry in the loop file (or promote.registry in its job config)"
        )
    reach = dataclasses.replace(target, run_dir=spec.runs, kind="rayjob")
    for value, what in ((spec.source, "source"), (spec.runs, "runs"), (registry, "registry")):
        _check_reachable(value, f"the loop's {what}", reach)
    cfg = dataclasses.replace(cfg, promote=dataclasses.replace(cfg.promote, registry=registry))
    if cron == "cronjob":  # a standing cluster whose workers come for a cycle and go after it
        reach = dataclasses.replace(reach, kind="raycluster", workers=(0, cfg.parallel.worker_range()[1]))
    train = build(cfg, reach)  # the job config as the pods read it, checked; its cluster for the cycles
    config_map = next(d for d in train if d["kind"] == "ConfigMap")
    loop_file = {**spec.to_dict(), "job": CONFIG_PATH, "set": [], "registry": registry}
    config_map["data"]["loop.yaml"] = yaml_dump(loop_file)
    cycle = ["petatrain", "loop", LOOP_PATH, "--once", "--address", "auto"]
    documents = [d for d in train if d["kind"] in ("ServiceAccount", "ConfigMap")]
    if cron == "cronjob":
        cluster = next(d for d in train if d["kind"] == "RayCluster")
        documents += [cluster, _cycle_cronjob(target, cluster["metadata"], cycle, schedule, time_zone)]
    elif cron == "kfp":
        job = next(d for d in train if d["kind"] == "RayJob")
        only_train = [*cycle[:4], "--only", "train", *cycle[4:]]
        template = {
            "apiVersion": "ray.io/v1",
            "kind": "RayJob",
            "metadata": {**job["metadata"], "name": f"{target.name}-train"},
            "spec": _job_spec(target, shlex.join(only_train), job["spec"]["rayClusterSpec"]),
        }
        config_map["data"][constants.KFP_RAYJOB_KEY] = yaml_dump(template)  # validated with the ConfigMap
        documents += _kfp_access(target, job["metadata"], config_map["metadata"]["name"], kfp_service_account)
    else:
        job = next(d for d in train if d["kind"] == "RayJob")
        cron_spec: dict[str, Any] = {
            "schedule": schedule,
            "jobTemplate": _job_spec(target, shlex.join(cycle), job["spec"]["rayClusterSpec"]),
        }
        if time_zone:
            cron_spec["timeZone"] = time_zone
        documents.append(
            {"apiVersion": "ray.io/v1", "kind": "RayCronJob", "metadata": job["metadata"], "spec": cron_spec}
        )
    served = dataclasses.replace(
        target, name=f"{target.name}-serve", kind="rayservice", run_dir=f"registry://{spec.model}@champion",
        registry=registry, workers=(0, 0), s3_secret=target.s3_secret or f"{target.name}-s3",
        keyring_secret=target.keyring_secret or f"{target.name}-keyring",
    )  # fmt: skip
    serving = build(cfg, served)
    documents += [d for d in serving if d["kind"] in ("ServiceAccount", "ConfigMap", "RayService")]
    documents += [d for d in (*train, *serving) if d["kind"] == "PodMonitor"]
    return documents


def _kfp_access(target: Target, meta: dict[str, Any], config_map: str, account: str) -> list[dict[str, Any]]:
    """The Role and RoleBinding a Kubeflow pipeline's steps need (petatrain.kubeflow): read the
    ConfigMap that holds the loop and the train step's RayJob, create the RayJob, follow it, and
    delete one a failed try left. `account`: NAME, or NAMESPACE/NAME where KFP runs elsewhere."""
    name = f"{target.name}-kfp"
    where, _, account = account.rpartition("/")
    rules = [
        {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [config_map], "verbs": ["get"]},
        {"apiGroups": ["ray.io"], "resources": ["rayjobs"], "verbs": ["get", "create", "delete"]},
    ]
    subject = {"kind": "ServiceAccount", "name": account, "namespace": where or target.namespace}
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {**meta, "name": name},
            "rules": rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {**meta, "name": name},
            "subjects": [subject],
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        },
    ]


def _cycle_cronjob(
    target: Target, meta: dict[str, Any], cycle: list[str], schedule: str, time_zone: str
) -> dict[str, Any]:
    """A Kubernetes CronJob whose pod submits one cycle (`cycle`) to the RayCluster `meta` names
    through Ray's job API and waits for it: `ray job submit` exits non-zero when the cycle failed,
    so the Job's retries (`backoffLimit`) run it again, and it goes on where the last stopped. One
    at a time (concurrencyPolicy Forbid); the cluster's token comes from the Secret KubeRay made
    for it (`authOptions`). The pod needs no Kubernetes API access, only the head's Service."""
    name = meta["name"]
    head = f"http://{name}-head-svc.{target.namespace}.svc:8265"
    token = {"secretKeyRef": {"name": name, "key": "auth_token"}}
    container = {
        "name": "submit",
        "image": target.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["ray", "job", "submit", "--address", head, "--", *cycle],
        "env": [
            {"name": constants.RAY_AUTH_MODE_ENV, "value": "token"},
            {"name": constants.RAY_AUTH_TOKEN_ENV, "valueFrom": token},
        ],
        "resources": {
            "requests": {"cpu": "100m", "memory": "512Mi"},
            "limits": {"cpu": "1", "memory": "512Mi"},
        },
    }
    labels = {**meta["labels"], "petatrain.io/role": "cycle"}
    pod = {"serviceAccountName": target.name, "restartPolicy": "Never", "containers": [container]}
    job = {
        "backoffLimit": target.backoff_limit,
        "activeDeadlineSeconds": target.active_deadline_s,
        "template": {"metadata": {"labels": labels}, "spec": pod},
    }
    spec: dict[str, Any] = {
        "schedule": schedule,
        "concurrencyPolicy": "Forbid",  # a tick while a cycle runs is skipped; the next one goes on
        "successfulJobsHistoryLimit": 3,
        "failedJobsHistoryLimit": 3,
        "jobTemplate": {"metadata": {"labels": labels}, "spec": job},
    }
    if time_zone:
        spec["timeZone"] = time_zone
    return {
        "apiVersion": "batch/v1",
        "kind": "CronJob",
        "metadata": {**meta, "name": f"{name}-cycle", "labels": meta["labels"]},
        "spec": spec,
    }


def yaml_dump(values: dict[str, Any]) -> str:
    """A manifest (or a file it carries) as a person reads it: no anchors or aliases (an object used
    twice is written twice), multi-line strings as block scalars (`|`), keys in the order built."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
        style = "|" if "\n" in value and not any(c in value for c in "\t\r") else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    return yaml.dump(values, Dumper=Dumper, sort_keys=False)


def _entrypoint(target: Target) -> str:
    """A command line with nothing for a shell to expand: KubeRay's submitter joins it into one
    `bash -c` string run in the submitter's pod, which has none of the head's variables. The driver's
    metrics listen on the head pod's IP only (`pod-ip`: the driver reads POD_IP, from the downward
    API, where it runs), where the PodMonitor's Prometheus scrapes them; the health endpoint stays on
    loopback: the probe runs in the pod."""
    argv = [
        "petatrain", "train", CONFIG_PATH, "--run-dir", target.run_dir, "--address", "auto", "--resume",
        "--set", f"observe.metrics_port={METRICS_PORT}", "--set", f"observe.health_port={HEALTH_PORT}",
        "--set", "observe.metrics_host=pod-ip",
    ]  # fmt: skip
    return shlex.join(argv)


def _serve_config(cfg: JobConfig, target: Target) -> str:
    """Serve's config file (a YAML string, as RayService takes it): the app builder, the run to serve,
    and the deployment's replicas or autoscaling from the config's `serve` section."""
    import yaml

    deployment = {"name": "completions", **cfg.serve.deployment_options()}
    app = {
        "name": SERVE_APP,
        "import_path": "petatrain.serve.app:build_app",
        "route_prefix": "/",
        "args": (
            {"run": target.run_dir, "registry": target.registry, "follow": True}
            if target.run_dir.startswith("registry://")
            else {"run": target.run_dir, "checkpoint": target.checkpoint}
        ),
        "deployments": [deployment],
    }
    # Serve's proxy runs on every node of the cluster, so one config cannot name each pod's IP: it
    # listens on the pod's interfaces (its network namespace is the pod's), where KubeRay's serve
    # Service sends the requests. Serving over the network is what `--kind rayservice` asks for.
    return yaml.safe_dump({"http_options": {"host": "0.0.0.0", "port": 8000}, "applications": [app]}, sort_keys=False)


def _cluster_spec(
    cfg: JobConfig, target: Target, pods: tuple[int, int], labels: dict[str, str], files: dict[str, str]
) -> dict[str, Any]:
    autoscale = pods[0] != pods[1]
    spec: dict[str, Any] = {
        "rayVersion": RAY_VERSION,
        "authOptions": {"mode": "token"},  # KubeRay makes the token Secret; clients need it to reach Ray
        "enableInTreeAutoscaling": autoscale,
        "headGroupSpec": {
            "serviceType": "ClusterIP",
            # The head schedules no training worker: its CPUs are the driver's, the hub's and Ray's.
            "rayStartParams": {"num-cpus": "0", "metrics-export-port": str(RAY_METRICS_PORT)},
            "template": _pod(cfg, target, labels, files, head=True),
        },
        "workerGroupSpecs": [
            {
                "groupName": "train",
                "replicas": pods[0],
                "minReplicas": pods[0],
                "maxReplicas": pods[1],
                "rayStartParams": {"metrics-export-port": str(RAY_METRICS_PORT)},
                "template": _pod(cfg, target, labels, files, head=False),
            }
        ],
    }
    if autoscale:
        spec["autoscalerOptions"] = {"upscalingMode": "Default", "idleTimeoutSeconds": target.idle_timeout_s}
    return spec


def _pod(
    cfg: JobConfig, target: Target, labels: dict[str, str], files: dict[str, str], *, head: bool
) -> dict[str, Any]:
    role = "head" if head else "worker"
    devices = 0 if head or not target.accelerator else target.devices_per_node
    resource = "amd.com/gpu" if target.accelerator == "MI300X" else "nvidia.com/gpu"
    if devices:
        cpu, memory = str(target.cpu_per_device * devices), _times(target.memory_per_device, devices)
    else:
        cpu, memory = ("4", "16Gi") if head else (str(max(1, math.ceil(cfg.resources.cpus_per_worker)) + 1), "8Gi")
    resources: dict[str, Any] = {"requests": {"cpu": cpu, "memory": memory}, "limits": {"cpu": cpu, "memory": memory}}
    if devices:
        resources["requests"][resource] = str(devices)
        resources["limits"][resource] = str(devices)
    fabric = _fabric(target) if devices else None
    if fabric is not None:
        name, count, _ = fabric
        resources["requests"][name] = resources["limits"][name] = count
    mounts: list[dict[str, Any]] = [
        {"name": "shm", "mountPath": "/dev/shm"},
        {"name": "shard-cache", "mountPath": CACHE_PATH},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": target.shm_size or _share(memory, 0.3)}},
        _cache_volume(target),
    ]
    if head:
        mounts.append({"name": "job-config", "mountPath": "/etc/petatrain", "readOnly": True})
        volumes.append({"name": "job-config", "configMap": {"name": f"{target.name}-config"}})
    if files:
        mounts.append({"name": "keyring", "mountPath": KEYS_PATH, "readOnly": True})
        items = [{"key": name, "path": name} for name in sorted(files)]
        secret = target.keyring_secret or f"{target.name}-keyring"
        volumes.append({"name": "keyring", "secret": {"secretName": secret, "defaultMode": 0o400, "items": items}})
    for number, (claim, path) in enumerate(target.volumes):
        mounts.append({"name": f"volume-{number}", "mountPath": path})
        volumes.append({"name": f"volume-{number}", "persistentVolumeClaim": {"claimName": claim}})
    ports = [{"name": "ray-metrics", "containerPort": RAY_METRICS_PORT}]
    if head:
        ports += [
            {"name": "gcs", "containerPort": 6379},
            {"name": "dashboard", "containerPort": 8265},
            {"name": "client", "containerPort": 10001},
            {"name": "train-metrics", "containerPort": METRICS_PORT},
        ]
        if target.kind == "rayservice":
            ports.append({"name": "serve", "containerPort": 8000})
    container: dict[str, Any] = {
        "name": f"ray-{role}",
        "image": target.image,
        "imagePullPolicy": "IfNotPresent",
        "resources": resources,
        "env": _env(cfg, target),
        "ports": ports,
        "volumeMounts": mounts,
    }
    if head:  # the Ray Client server forks a process per driver; gRPC's fork handlers can kill it
        container["env"] = [*container["env"], {"name": "GRPC_ENABLE_FORK_SUPPORT", "value": "0"}]
    if fabric is not None:  # RDMA registers (locks) memory
        container["env"] = [*container["env"], *({"name": k, "value": v} for k, v in fabric[2].items())]
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    if head:
        probe = ["python", "-m", "petatrain.deploy.probe"]
        container["livenessProbe"] = {
            "exec": {"command": [*probe, "live", str(HEALTH_PORT)]},
            "initialDelaySeconds": 30, "periodSeconds": 30, "timeoutSeconds": 20, "failureThreshold": 3,
        }  # fmt: skip
        container["readinessProbe"] = {
            "exec": {"command": [*probe, "ready"]},
            "initialDelaySeconds": 10, "periodSeconds": 10, "timeoutSeconds": 15, "failureThreshold": 6,
        }  # fmt: skip
    pod_spec: dict[str, Any] = {
        "serviceAccountName": target.name,
        "containers": [container],
        "volumes": volumes,
    }
    if devices:
        key, value = GPU_PRODUCT.get(target.accelerator, (f"{resource}.product", target.accelerator))
        pod_spec["nodeSelector"] = {key: value}
        pod_spec["tolerations"] = [{"key": resource, "operator": "Exists", "effect": "NoSchedule"}]
    return {"metadata": {"labels": {**labels, "petatrain.io/role": role}}, "spec": pod_spec}


def _env(cfg: JobConfig, target: Target) -> list[dict[str, Any]]:
    secret = target.s3_secret or f"{target.name}-s3"
    env: list[dict[str, Any]] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},  # what the driver binds
        {"name": constants.CACHE_DIR_ENV, "value": CACHE_PATH},
        {"name": "RAY_USAGE_STATS_ENABLED", "value": "0"},
        {"name": constants.TASK_OOM_RETRIES_ENV, "value": str(constants.TASK_RETRIES)},  # not forever
    ]
    # Required when the run reads or writes S3: a missing Secret stops the pod at its start, with the
    # Secret's name, instead of a run that fails later without credentials.
    optional = {} if on_s3(cfg, target) else {"optional": True}
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        env.append({"name": key, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, **optional}}})
    if cfg.storage.s3_endpoint_url:
        env.append({"name": "AWS_ENDPOINT_URL", "value": cfg.storage.s3_endpoint_url})
    customer_key = cfg.storage.sse.customer_key
    if customer_key.startswith("env:"):  # SSE-C's key from the Secret NAME-keyring's key of that name
        name = customer_key.removeprefix("env:")
        keyring = target.keyring_secret or f"{target.name}-keyring"
        env.append({"name": name, "valueFrom": {"secretKeyRef": {"name": keyring, "key": name}}})
    if any(ref.startswith("barbican+") for ref in (cfg.storage.encryption.key, cfg.storage.signing.key)):
        kms = f"{target.name}-kms"  # the key manager's credentials: a Keystone token, or a project id
        for key in ("OS_AUTH_TOKEN", "OS_PROJECT_ID"):
            env.append({"name": key, "valueFrom": {"secretKeyRef": {"name": kms, "key": key, "optional": True}}})
    return env


def on_s3(cfg: JobConfig, target: Target) -> bool:
    """Whether the pods read or write S3 (and so need the S3 Secret)."""
    urls = (target.run_dir, cfg.data.dataset, cfg.promote.registry)
    return any(url.startswith(("s3://", "s3a://")) for url in urls)


def secrets_needed(cfg: JobConfig, target: Target) -> list[str]:
    """The `kubectl create secret` commands of the Secrets the manifests reference (values elided)."""
    commands = []
    if on_s3(cfg, target):
        secret = target.s3_secret or f"{target.name}-s3"
        commands.append(
            f"kubectl create secret generic {secret} -n {target.namespace} "
            "--from-literal=AWS_ACCESS_KEY_ID=... --from-literal=AWS_SECRET_ACCESS_KEY=..."
        )
    files = key_files(cfg)
    customer = cfg.storage.sse.customer_key
    if files or customer.startswith("env:"):
        keyring = target.keyring_secret or f"{target.name}-keyring"
        sources = [f"--from-file={name}={shlex.quote(path)}" for name, path in sorted(files.items())]
        if customer.startswith("env:"):
            name = customer.removeprefix("env:")
            sources.append(f'--from-literal={name}="${name}"')
        commands.append(f"kubectl create secret generic {keyring} -n {target.namespace} {' '.join(sources)}")
    if any(ref.startswith("barbican+") for ref in (cfg.storage.encryption.key, cfg.storage.signing.key)):
        commands.append(
            f"kubectl create secret generic {target.name}-kms -n {target.namespace} "
            "--from-literal=OS_AUTH_TOKEN=... (or --from-literal=OS_PROJECT_ID=...)"
        )
    return commands


def _cache_volume(target: Target) -> dict[str, Any]:
    if not target.cache_storage_class:
        return {"name": "shard-cache", "emptyDir": {"sizeLimit": target.cache_size}}
    claim = {
        "accessModes": ["ReadWriteOnce"],
        "storageClassName": target.cache_storage_class,
        "resources": {"requests": {"storage": target.cache_size}},
    }
    return {"name": "shard-cache", "ephemeral": {"volumeClaimTemplate": {"spec": claim}}}


def _pod_monitor(target: Target, meta: dict[str, Any], labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": meta,
        "spec": {
            "selector": {"matchLabels": labels},
            "podMetricsEndpoints": [
                {"port": "ray-metrics", "path": "/metrics", "interval": "15s"},
                {"port": "train-metrics", "path": "/metrics", "interval": "15s"},
            ],
        },
    }


def _share(quantity: str, fraction: float) -> str:
    """`fraction` of a Gi/Mi quantity, rounded up to whole Mi ("16Gi", 0.3 -> "4916Mi")."""
    number = re.fullmatch(r"(\d+)(Gi|Mi)", quantity)
    if number is None:
        raise ConfigError(f"cannot read the quantity {quantity!r} (e.g. 160Gi)")
    mib = int(number.group(1)) * (1024 if number.group(2) == "Gi" else 1)
    return f"{math.ceil(mib * fraction)}Mi"


def _times(quantity: str, n: int) -> str:
    number = re.match(r"\d+", quantity)
    if number is None:
        raise ConfigError(f"cannot read the quantity {quantity!r} (e.g. 160Gi)")
    return f"{int(number.group()) * n}{quantity[number.end() :]}"
