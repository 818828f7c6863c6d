"""`petatrain deploy k8s`: KubeRay manifests from a job config and its plan, validated offline.

No Kubernetes runs here; what the manifests say is checked as data (sizes, secrets by reference,
the entrypoint that continues a run), against the schemas (deploy/validate.py), and the
committed examples/k8s/ are what the command writes today.
"""

from __future__ import annotations

import dataclasses
import filecmp
import http.server
import json
import math
import re
import threading
from pathlib import Path
from typing import ClassVar

import pytest
import yaml

from conftest import run_cli
from helpers import ROOT
from petatrain import api, config
from petatrain.deploy import manifests, probe
from petatrain.deploy.manifests import Target
from petatrain.deploy.validate import validate_dir, validate_documents
from petatrain.errors import ConfigError

# What examples/k8s/ holds, and the command that writes each (the README shows them).
EXAMPLES = {
    "tiny": [
        "examples/tiny.yaml", "--run-dir", "s3://petatrain/runs/tiny",
        "--set", "data.dataset=s3://petatrain/datasets/demo", "--set", "parallel.workers=2-4",
    ],
    "plan-70b-64xh100": [
        "examples/plan-70b.yaml", "--from-plan", "--accelerator", "H100-SXM", "--count", "64",
        "--run-dir", "s3://petatrain/runs/70b", "--set", "data.dataset=s3://petatrain/datasets/web",
        "--image", "registry.example.com/petatrain:0.1.0", "--fabric", "efa",
    ],
}  # fmt: skip


def _docs(folder: Path) -> dict[str, dict]:
    return {d["kind"]: d for f in sorted(folder.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())}


def _tiny(*overrides: str):
    return config.load(ROOT / "examples" / "tiny.yaml", ["data.dataset=s3://b/datasets/demo", *overrides])


def test_a_rayjob_continues_its_run_and_scales_between_the_worker_range():
    docs = manifests.build(_tiny("parallel.workers=2-4"), Target(name="tiny", run_dir="s3://b/runs/tiny"))
    assert [d["kind"] for d in docs] == ["ServiceAccount", "ConfigMap", "RayJob", "PodMonitor"]
    assert validate_documents(docs) == []
    job = docs[2]["spec"]
    assert job["entrypoint"].startswith("petatrain train /etc/petatrain/job.yaml --run-dir s3://b/runs/tiny")
    assert "--resume" in job["entrypoint"].split() and "observe.health_port=8079" in job["entrypoint"]
    # The driver's metrics listen on the pod's IP only (the downward API's status.podIP), not on every
    # interface; the submitter runs the line as `bash -c` in its own pod, so nothing in it is a variable.
    assert job["entrypoint"].endswith("--set observe.metrics_host=pod-ip") and "$" not in job["entrypoint"]
    head_env = job["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in head_env
    assert {"name": "GRPC_ENABLE_FORK_SUPPORT", "value": "0"} in head_env  # Ray Client drivers join at once
    assert job["shutdownAfterJobFinishes"] is True and job["backoffLimit"] >= 1
    cluster = job["rayClusterSpec"]
    assert cluster["authOptions"] == {"mode": "token"}
    assert cluster["enableInTreeAutoscaling"] is True and cluster["autoscalerOptions"]["idleTimeoutSeconds"] > 0
    group = cluster["workerGroupSpecs"][0]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (2, 2, 4)
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["livenessProbe"]["exec"]["command"] == ["python", "-m", "petatrain.deploy.probe", "live", "8079"]
    # The ConfigMap holds the resolved config: what the driver reads back is the config deployed.
    assert config.from_yaml(docs[1]["data"]["job.yaml"], "job.yaml") == _tiny("parallel.workers=2-4")


def test_a_fixed_worker_count_does_not_autoscale():
    docs = manifests.build(_tiny(), Target(name="tiny", run_dir="s3://b/r"))
    cluster = docs[2]["spec"]["rayClusterSpec"]
    assert cluster["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in cluster


def test_secrets_are_referenced_never_written(tmp_path, monkeypatch):
    """Credentials in the environment and in the config, keyrings, an SSE-C key and a CA bundle: none
    of their values is in any file written; the pods read them from Secrets by name, the files at a
    path of petatrain's own (a keyring at /etc/ring.json must not hide the pod's /etc), and the config
    they read names them there."""
    secret = "s3cr3t-VALUE-never-written"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    cfg = _tiny(f"storage.s3_secret_access_key={secret}", "storage.s3_access_key_id=AKIAEXAMPLE",
                "storage.encryption.key=file:/etc/ring.json", "storage.signing.key=file:/etc/petatrain/sign.json",
                "storage.ca_bundle=ca/bundle.pem")  # fmt: skip
    target = Target(name="tiny", run_dir="s3://b/r", s3_secret="team-s3")
    done = api.deploy_k8s(cfg, target, str(tmp_path))
    written = "".join(p.read_text() for p in tmp_path.iterdir())
    assert secret not in written and "AKIAEXAMPLE" not in written
    docs = _docs(tmp_path)
    for group in ("headGroupSpec", "workerGroupSpecs"):
        spec = docs["RayJob"]["spec"]["rayClusterSpec"][group]
        pod = (spec if group == "headGroupSpec" else spec[0])["template"]["spec"]
        env = {e["name"]: e for e in pod["containers"][0]["env"]}
        # On S3 the Secret is required: a missing one stops the pod at once, naming it.
        assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {
            "name": "team-s3", "key": "AWS_SECRET_ACCESS_KEY"
        }  # fmt: skip
        keyring = next(v for v in pod["volumes"] if v["name"] == "keyring")
        assert keyring["secret"] == {
            "secretName": "tiny-keyring", "defaultMode": 0o400,
            "items": [{"key": n, "path": n} for n in ("bundle.pem", "ring.json", "sign.json")],
        }  # fmt: skip
        mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "keyring")
        assert mount == {"name": "keyring", "mountPath": "/var/run/petatrain/keys", "readOnly": True}
        assert "OS_AUTH_TOKEN" not in env
    deployed = config.from_yaml(docs["ConfigMap"]["data"]["job.yaml"], "job.yaml").storage
    assert (deployed.encryption.key, deployed.signing.key, deployed.ca_bundle) == (
        "file:/var/run/petatrain/keys/ring.json", "file:/var/run/petatrain/keys/sign.json",
        "/var/run/petatrain/keys/bundle.pem",
    )  # fmt: skip
    # What to create, with the local files named and no value.
    assert done.secrets == [
        "kubectl create secret generic team-s3 -n default --from-literal=AWS_ACCESS_KEY_ID=... "
        "--from-literal=AWS_SECRET_ACCESS_KEY=...",
        "kubectl create secret generic tiny-keyring -n default "
        f"--from-file=bundle.pem={Path('ca/bundle.pem').absolute()} --from-file=ring.json=/etc/ring.json "
        "--from-file=sign.json=/etc/petatrain/sign.json",
    ]
    with pytest.raises(ConfigError, match=r"^storage.signing.key: /b/ring.json and /a/ring.json have the same file"):
        api.deploy_k8s(_tiny("storage.encryption.key=file:/a/ring.json", "storage.signing.key=file:/b/ring.json"),
                       target, str(tmp_path / "clash"))  # fmt: skip

    container = "barbican+https://kms.internal:9311/v1/containers/0b9a3a34-9d35-4c1c-9d1e-6c2b8a0f1e2d"
    monkeypatch.setenv("OS_AUTH_TOKEN", secret)
    monkeypatch.setenv("SSEC_KEY", secret)
    kms = _tiny(
        f"storage.encryption.key={container}", "storage.sse.mode=customer", "storage.sse.customer_key=env:SSEC_KEY"
    )
    api.deploy_k8s(kms, target, str(tmp_path / "kms"))
    assert secret not in "".join(p.read_text() for p in (tmp_path / "kms").iterdir())
    pod = _docs(tmp_path / "kms")["RayJob"]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    for key in ("OS_AUTH_TOKEN", "OS_PROJECT_ID"):
        assert env[key]["valueFrom"]["secretKeyRef"] == {"name": "tiny-kms", "key": key, "optional": True}
    assert env["SSEC_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "tiny-keyring", "key": "SSEC_KEY"}
    assert all(v["name"] != "keyring" for v in pod["volumes"])


def test_paths_the_pods_cannot_see_are_refused_unless_a_volume_holds_them(tmp_path):
    """A dataset, run directory or registry on this machine's disk would fail in the pods at their
    start: refused in one line, naming the key; an absolute path under a volume the user names (an NFS
    share as a PVC) is mounted on every pod at that path."""
    local = config.load(ROOT / "examples" / "tiny.yaml")  # data.dataset: .petatrain/datasets/demo
    s3 = Target(name="tiny", run_dir="s3://b/r")
    for cfg, target, key in [
        (local, s3, "data.dataset '.petatrain/datasets/demo'"),
        (_tiny("promote.registry=/srv/registry"), s3, "promote.registry '/srv/registry'"),
        (_tiny(), Target(name="tiny", run_dir="/tmp/run"), "--run-dir '/tmp/run'"),
        (_tiny("data.dataset=/nfs/../etc/ds"), Target(name="t", run_dir="s3://b/r", volumes=(("nfs", "/nfs"),)),
         "data.dataset '/nfs/../etc/ds'"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError) as refused:
            manifests.build(cfg, target)
        message = str(refused.value)
        assert message.startswith(f"{key} is a path on this machine, which the pods cannot see") and "\n" not in message
    for spec, why in [("nfs:/", "absolute mount path"), ("NFS:/nfs", "RFC 1123"), ("nfs:/var/cache", "overlaps"),
                      ("nfs", "absolute mount path")]:  # fmt: skip
        with pytest.raises(ConfigError, match=f"^--volume {spec!r}: .*{why}"):
            manifests.check_volume(spec)
    shared = Target(name="tiny", run_dir="/nfs/runs/tiny", volumes=(manifests.check_volume("team-nfs:/nfs/"),))
    docs = manifests.build(config.load(ROOT / "examples" / "tiny.yaml", ["data.dataset=/nfs/datasets/demo"]), shared)
    assert validate_documents(docs) == []
    cluster = docs[2]["spec"]["rayClusterSpec"]
    for template in (cluster["headGroupSpec"]["template"], cluster["workerGroupSpecs"][0]["template"]):
        assert {"name": "volume-0", "persistentVolumeClaim": {"claimName": "team-nfs"}} in template["spec"]["volumes"]
        assert {"name": "volume-0", "mountPath": "/nfs"} in template["spec"]["containers"][0]["volumeMounts"]
    # Nothing on S3: the S3 Secret stays optional (a gs:// or NFS run may not have one).
    env = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["env"]
    assert next(e for e in env if e["name"] == "AWS_ACCESS_KEY_ID")["valueFrom"]["secretKeyRef"]["optional"] is True
    done = run_cli("deploy", "k8s", "examples/tiny.yaml", "--run-dir", "s3://b/r", "--out", str(tmp_path))
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "data.dataset" in done.stderr
    assert not any(tmp_path.iterdir())


def test_sizes_from_the_plan_on_gpus(tmp_path):
    """64 H100s as plan lays the 70B model out (8-way tensor parallelism inside each node x 8 FSDP
    replicas): 8 nodes of 8 GPUs, each pod asking for and limited to its node's GPUs, placed on H100
    nodes, and the job config set to the planned layout."""
    cfg = config.load(ROOT / "examples" / "plan-70b.yaml", ["data.dataset=s3://b/datasets/web"])
    target = Target(name="llm", run_dir="s3://b/r", accelerator="H100-SXM")
    done = api.deploy_k8s(cfg, target, str(tmp_path), from_plan=True, count=64)
    assert (done.worker_pods, done.devices_per_node, done.accelerator) == ((8, 8), 8, "H100-SXM")
    assert done.sized_by.startswith("plan: H100-SXM x64 tensor 8x8 fsdp")
    docs = _docs(tmp_path)
    group = docs["RayJob"]["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    pod = group["template"]["spec"]
    resources = pod["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == "8"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    # Ray's object store lives in /dev/shm: as large as Ray makes it, 30% of the pod's 8 x 160 GiB.
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": f"{math.ceil(8 * 160 * 1024 * 0.3)}Mi"}
    deployed = config.from_yaml(docs["ConfigMap"]["data"]["job.yaml"], "job.yaml")
    assert deployed.parallel.strategy == "fsdp" and deployed.parallel.workers == "64"
    assert deployed.parallel.tensor == 8 and deployed.parallel.data_parallel(64) == 8


def test_a_rayservice_carries_serves_autoscaling():
    # Serving reads the run, not the data: the config's local dataset is no concern of its pods.
    cfg = config.load(ROOT / "examples" / "tiny.yaml", ["serve.replicas=1-3", "serve.max_batch=8"])
    docs = manifests.build(cfg, Target(name="tiny-serve", run_dir="s3://b/r", kind="rayservice"))
    assert validate_documents(docs) == []
    service = docs[2]["spec"]
    app = yaml.safe_load(service["serveConfigV2"])["applications"][0]
    assert app["import_path"] == "petatrain.serve.app:build_app" and app["args"] == {
        "run": "s3://b/r",
        "checkpoint": "final",
    }
    scaling = app["deployments"][0]["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"], scaling["target_ongoing_requests"]) == (1, 3, 8)
    assert service["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"] == 3


def test_a_queue_admits_the_job_whole_and_a_fabric_gives_the_gpu_pods_their_rdma_devices():
    """--queue: Kueue's queue-name label, the RayJob created suspended (Kueue unsuspends it on
    admission, all pods at once); --fabric: the device plugin's resource on each GPU pod, NCCL's and
    libfabric's settings and IPC_LOCK (RDMA locks memory); the CPU head gets none."""
    cfg = config.load(ROOT / "examples" / "plan-70b.yaml", ["data.dataset=s3://b/datasets/web"])
    target = Target(name="llm", run_dir="s3://b/r", accelerator="H100-SXM", devices_per_node=8, queue="research")
    docs = manifests.build(cfg, dataclasses.replace(target, fabric="efa"))
    assert validate_documents(docs) == []
    job = docs[2]
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "research" and job["spec"]["suspend"] is True
    cluster = job["spec"]["rayClusterSpec"]
    worker = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["vpc.amazonaws.com/efa"] == "32"
    assert {"name": "FI_PROVIDER", "value": "efa"} in worker["env"]
    assert worker["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "securityContext" not in head and "vpc.amazonaws.com/efa" not in head["resources"]["limits"]
    own = manifests.build(cfg, dataclasses.replace(target, fabric="nvidia.com/hostdev=4", queue=""))
    assert own[2]["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0][
        "resources"]["requests"]["nvidia.com/hostdev"] == "4"  # fmt: skip
    assert "suspend" not in own[2]["spec"]
    for bad, match in [
        (dataclasses.replace(target, fabric="efa=lots"), "count 'lots' is not a positive integer"),
        (dataclasses.replace(target, fabric="myrinet"), "is not efa, infiniband or RESOURCE=COUNT"),
        (Target(name="t", run_dir="s3://b/r", fabric="efa"), "an RDMA fabric is for GPU pods"),
        (dataclasses.replace(target, queue="Team_A"), "--queue 'Team_A': a lowercase RFC 1123 label"),
        (Target(name="t", run_dir="s3://b/r", kind="rayservice", queue="q"), "a RayService is not queued"),
    ]:
        with pytest.raises(ConfigError, match=match):
            manifests.build(cfg, bad)


def test_bad_targets_are_one_line_errors():
    with pytest.raises(ConfigError, match="--name 'Tiny_Job'"):
        manifests.build(_tiny(), Target(name="Tiny_Job", run_dir="s3://b/r"))
    assert manifests.name_from("examples/My Job.v2.yaml") == "petatrain-my-job-v2"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_committed_examples_are_what_deploy_writes_today(tmp_path, name):
    """examples/k8s/NAME is regenerated and compared byte for byte (regenerate with the command below)."""
    done = run_cli("deploy", "k8s", *EXAMPLES[name], "--out", str(tmp_path), timeout=120)
    assert done.returncode == 0, done.stderr
    committed = ROOT / "examples" / "k8s" / name
    files = sorted(p.name for p in tmp_path.iterdir())
    assert sorted(p.name for p in committed.glob("*.yaml")) == files
    _, mismatch, errors = filecmp.cmpfiles(committed, tmp_path, files, shallow=False)
    command = " ".join(["petatrain deploy k8s", *EXAMPLES[name], "--out", f"examples/k8s/{name}"])
    assert not mismatch and not errors, f"examples/k8s/{name} is stale: {command}"
    assert validate_dir(str(committed)) == []


def test_validate_names_the_path_of_a_mistake_in_one_line(tmp_path):
    for f in (ROOT / "examples" / "k8s" / "tiny").glob("*.yaml"):
        (tmp_path / f.name).write_text(f.read_text())
    job = next(tmp_path.glob("*-rayjob.yaml"))
    text = job.read_text().replace("minReplicas:", "minReplica:")
    job.write_text(text.replace("shutdownAfterJobFinishes: true", "shutdownAfterJobFinishes: 'yes'"))
    done = run_cli("deploy", "k8s", "--validate", str(tmp_path), timeout=60)
    assert done.returncode == 1
    lines = done.stdout.strip().splitlines()
    assert any("spec.rayClusterSpec.workerGroupSpecs[0].minReplica" in line for line in lines), lines
    assert any("spec.shutdownAfterJobFinishes" in line for line in lines), lines
    ok = run_cli("deploy", "k8s", "--validate", str(ROOT / "examples" / "k8s" / "tiny"), "--json", timeout=60)
    assert ok.returncode == 0 and json.loads(ok.stdout)["problems"] == []


class _Answers(http.server.BaseHTTPRequestHandler):
    routes: ClassVar[dict[str, tuple[int, bytes]]] = {}

    def do_GET(self):
        code, body = self.routes.get(self.path, (404, b"no"))
        self.send_response(code)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_the_liveness_probe_asks_ray_and_the_driver(monkeypatch):
    """Ray healthy and no driver: live. A driver whose run stopped advancing: not live, with its reason.
    Readiness is Ray's alone. A raylet that does not answer: neither."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(probe, "RAYLET", f"{base}/raylet")
    monkeypatch.setattr(probe, "GCS", f"{base}/gcs")
    _Answers.routes = {"/raylet": (200, b"success"), "/gcs": (200, b"success")}
    try:
        assert probe.check("live", _unused_port()) == ""  # nothing listens on the health port: no driver
        _Answers.routes["/livez"] = (503, b'{"reason": "no step completed for 400 s"}')
        port = server.server_address[1]
        assert probe.check("live", port).startswith("training does not advance: ")
        assert probe.check("ready", port) == ""
        _Answers.routes["/raylet"] = (500, b"")
        assert probe.check("ready", port).endswith("/raylet: 500")
    finally:
        server.shutdown()
        server.server_close()


def _unused_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pod_ip_is_read_where_the_driver_runs(monkeypatch):
    """observe.metrics_host pod-ip: POD_IP of the driver's own environment, else its host name's address."""
    import socket

    from petatrain.runtime.preflight import pod_ip

    monkeypatch.setenv("POD_IP", "10.1.2.3")
    assert pod_ip() == "10.1.2.3"
    monkeypatch.delenv("POD_IP")
    assert pod_ip() == socket.gethostbyname(socket.gethostname())


def test_the_loop_on_kubernetes_is_a_raycronjob_and_a_rayservice_following_the_champion(tmp_path):
    """deploy k8s --loop: a RayCronJob running one cycle (`petatrain loop --once`) in a cluster of its
    own on the schedule, a RayService serving registry://MODEL@champion with follow; valid against
    the built-in schemas and the real v1.7.0 CRDs; what the pods cannot reach is refused in one line."""
    from helpers import missing
    from petatrain.loop import spec as spec_mod
    from test_deploy_validate import REAL_CRDS

    if not REAL_CRDS:
        missing("../shared/k8s-crds is not beside the repository (the real RayCronJob CRD)")

    values = {
        "model": "tiny", "job": str(ROOT / "examples" / "tiny.yaml"), "set": ["ingest.tokenizer=bytes"],
        "source": "s3://lake/incoming/", "dataset": "s3://lake/datasets/web", "runs": "s3://lake/loops/tiny",
        "registry": "s3://lake/registry", "steps": 200,
    }  # fmt: skip
    loop_file = tmp_path / "loop.yaml"
    loop_file.write_text(yaml.safe_dump(values))
    spec = spec_mod.load(loop_file)
    target = Target(name="tiny-loop", run_dir=spec.runs, s3_secret="lake-s3")
    docs = manifests.build_loop(spec, target, "*/30 * * * *", "Europe/Paris")
    kinds = [d["kind"] for d in docs]
    assert kinds == [
        "ServiceAccount", "ConfigMap", "RayCronJob", "ServiceAccount", "ConfigMap", "RayService", "PodMonitor",
        "PodMonitor",
    ]  # fmt: skip
    assert validate_documents(docs) == [] and validate_documents(docs, crds=REAL_CRDS) == []
    cron = docs[2]["spec"]
    assert (cron["schedule"], cron["timeZone"]) == ("*/30 * * * *", "Europe/Paris")
    assert cron["jobTemplate"]["entrypoint"] == "petatrain loop /etc/petatrain/loop.yaml --once --address auto"
    assert cron["jobTemplate"]["backoffLimit"] >= 1  # a retried cycle goes on where it stopped
    files = docs[1]["data"]
    assert yaml.safe_load(files["loop.yaml"]) | {"watch": None} == {
        **values, "job": "/etc/petatrain/job.yaml", "set": [], "watch": None
    }  # fmt: skip
    job = config.from_yaml(files["job.yaml"], "job.yaml")
    assert (job.data.dataset, job.promote.registry, job.ingest.tokenizer) == (
        "s3://lake/datasets/web", "s3://lake/registry", "bytes"
    )  # fmt: skip
    app = yaml.safe_load(docs[5]["spec"]["serveConfigV2"])["applications"][0]
    assert app["args"] == {"run": "registry://tiny@champion", "registry": "s3://lake/registry", "follow": True}
    for doc in (docs[2]["spec"]["jobTemplate"]["rayClusterSpec"], docs[5]["spec"]["rayClusterConfig"]):
        env = doc["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
        key = next(e for e in env if e["name"] == "AWS_ACCESS_KEY_ID")
        assert key["valueFrom"]["secretKeyRef"]["name"] == "lake-s3"

    for change, schedule, zone, match in [
        ({}, "61 * * * *", "", r"^--schedule '61 \* \* \* \*': minute: '61' is beyond 0-59$"),
        ({}, "* * *", "", "expected exactly 5 fields, found 3"),
        ({}, "0 9 * * MON-FRI", "", None),
        ({}, "TZ=UTC 0 9 * * *", "", "cannot use TZ"),
        ({}, "@daily", "Mars/Olympus", "--time-zone 'Mars/Olympus': not a time zone name"),
        ({"source": "/data/incoming"}, "@hourly", "", "^the loop's source '/data/incoming' is a path on this machine"),
        ({"registry": ""}, "@hourly", "", "^the loop's registry is this machine's .petatrain/registry"),
    ]:
        other = tmp_path / "other.yaml"
        other.write_text(yaml.safe_dump({**values, **change}))
        if match is None:
            assert validate_documents(manifests.build_loop(spec_mod.load(other), target, schedule, zone)) == []
            continue
        with pytest.raises(ConfigError, match=match):
            manifests.build_loop(spec_mod.load(other), target, schedule, zone)
    done = run_cli("deploy", "k8s", "examples/tiny.yaml", "--loop", str(loop_file), "--out", str(tmp_path / "k"))
    assert done.returncode == 2 and "needs --out DIR and no CONFIG" in done.stderr


def test_the_loop_for_kubeflow_keeps_the_train_steps_rayjob_in_its_configmap_and_lets_kfp_create_it(tmp_path):
    """deploy k8s --loop --cron kfp: no schedule of its own (a Kubeflow pipeline's recurring run is the
    clock); the ConfigMap holds the loop, its job config and the train step's RayJob (`loop --once
    --only train` in a cluster of its own), which the pipeline creates per run (petatrain.kubeflow),
    and a Role lets KFP's service account read that ConfigMap and create, follow and delete RayJobs.
    All of it valid against the built-in schemas and the real CRDs, the RayJob too."""
    from typer.testing import CliRunner

    from helpers import missing
    from petatrain.cli import app
    from test_deploy_validate import REAL_CRDS

    if not REAL_CRDS:
        missing("../shared/k8s-crds is not beside the repository (the real RayJob CRD)")
    values = {
        "model": "tiny", "job": str(ROOT / "examples" / "tiny.yaml"), "source": "s3://lake/incoming/",
        "dataset": "s3://lake/datasets/web", "runs": "s3://lake/loops/tiny", "registry": "s3://lake/registry",
    }  # fmt: skip
    loop_file = tmp_path / "loop.yaml"
    loop_file.write_text(yaml.safe_dump(values))
    out = tmp_path / "k8s"
    argv = ["deploy", "k8s", "--loop", str(loop_file), "--cron", "kfp", "--kfp-service-account"]
    argv += ["kubeflow/pipeline-runner", "--name", "tiny", "--namespace", "ml", "--out", str(out)]
    done = CliRunner().invoke(app, argv, catch_exceptions=False)
    assert done.exit_code == 0, done.output
    assert "--cluster ml/tiny-config" in done.output  # how to compile the pipeline for it
    docs = [d for path in sorted(out.iterdir()) for d in yaml.safe_load_all(path.read_text())]
    assert [d["kind"] for d in docs] == [
        "ServiceAccount", "ConfigMap", "Role", "RoleBinding", "ServiceAccount", "ConfigMap", "RayService",
        "PodMonitor", "PodMonitor",
    ]  # fmt: skip
    assert validate_documents(docs) == [] and validate_documents(docs, crds=REAL_CRDS) == []
    files = docs[1]["data"]
    assert docs[1]["metadata"]["name"] == "tiny-config" and sorted(files) == [
        "job.yaml",
        "loop.yaml",
        "train-rayjob.yaml",
    ]
    assert yaml.safe_load(files["loop.yaml"])["job"] == "/etc/petatrain/job.yaml"
    template = yaml.safe_load(files["train-rayjob.yaml"])
    assert validate_documents([template]) == [] and validate_documents([template], crds=REAL_CRDS) == []
    # `deploy k8s --validate` checks the RayJob the ConfigMap carries as the manifest it becomes
    broken = {
        **docs[1],
        "data": {
            **files,
            "train-rayjob.yaml": files["train-rayjob.yaml"].replace("backoffLimit: 3", "backoffLimit: many"),
        },
    }
    (line,) = validate_documents([broken], source="01-configmap.yaml", crds=REAL_CRDS)
    where = 'data["train-rayjob.yaml"].spec.backoffLimit'
    assert line.startswith(f"01-configmap.yaml: ConfigMap/tiny-config: {where}: 'many' is not"), line
    assert (template["kind"], template["metadata"]["name"], template["metadata"]["namespace"]) == (
        "RayJob",
        "tiny-train",
        "ml",
    )
    spec = template["spec"]
    assert spec["entrypoint"] == "petatrain loop /etc/petatrain/loop.yaml --once --only train --address auto"
    assert spec["backoffLimit"] >= 1 and spec["shutdownAfterJobFinishes"]  # a cluster of its own, retried
    head = spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert {"name": "job-config", "configMap": {"name": "tiny-config"}} in head["volumes"]
    role, binding = docs[2], docs[3]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["tiny-config"], "verbs": ["get"]},
        {"apiGroups": ["ray.io"], "resources": ["rayjobs"], "verbs": ["get", "create", "delete"]},
    ]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "ml"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pipeline-runner", "namespace": "kubeflow"}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    for bad, match in (
        (["--name", "loop-" + "n" * 30], r"--name 'loop-n+-train-00000000': must be no more than 47"),  # -serve fits
        (["--kfp-service-account", "Pipeline_Runner"], "--kfp-service-account 'Pipeline_Runner'"),
        (
            ["--schedule", "@hourly"],
            "--schedule with --cron kfp: the Kubeflow pipeline's recurring run is the schedule",
        ),
    ):
        done = CliRunner().invoke(app, [*argv, *bad, "--out", str(tmp_path / "bad")])
        assert done.exit_code == 2 and re.search(match, done.output), done.output
    assert not (tmp_path / "bad").exists()
    # Without --cron, a RayCronJob on the default schedule
    done = CliRunner().invoke(app, ["deploy", "k8s", "--loop", str(loop_file), "--out", str(tmp_path / "cron")])
    assert done.exit_code == 0, done.output
    (cron,) = [
        d for p in (tmp_path / "cron").iterdir() for d in yaml.safe_load_all(p.read_text()) if d["kind"] == "RayCronJob"
    ]
    assert cron["spec"]["schedule"] == "*/15 * * * *"


def test_the_loop_without_kuberays_raycronjob_is_a_cronjob_submitting_to_a_standing_cluster(tmp_path):
    """deploy k8s --loop --cron cronjob: for an operator without the RayCronJob feature gate, a
    Kubernetes CronJob (one cycle at a time) whose pod runs `ray job submit` against a standing
    RayCluster (workers autoscaled from none, the loop file on its head) with the token KubeRay made;
    valid against the built-in schemas and the real CRDs."""
    from helpers import missing
    from test_deploy_validate import REAL_CRDS

    if not REAL_CRDS:
        missing("../shared/k8s-crds is not beside the repository (the real RayCluster CRD)")
    values = {
        "model": "tiny", "job": str(ROOT / "examples" / "tiny.yaml"), "set": ["parallel.workers=2-4"],
        "source": "s3://lake/incoming/", "dataset": "s3://lake/datasets/web", "runs": "s3://lake/loops/tiny",
        "registry": "s3://lake/registry",
    }  # fmt: skip
    loop_file = tmp_path / "loop.yaml"
    loop_file.write_text(yaml.safe_dump(values))
    out = tmp_path / "k8s"
    argv = ["deploy", "k8s", "--loop", str(loop_file), "--cron", "cronjob", "--schedule", "@hourly"]
    done = run_cli(*argv, "--time-zone", "UTC", "--name", "tiny", "--namespace", "ml", "--out", str(out), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["kind"] == "cronjob"
    docs = [d for path in sorted(out.iterdir()) for d in yaml.safe_load_all(path.read_text())]
    assert validate_documents(docs) == [] and validate_documents(docs, crds=REAL_CRDS) == []
    by_kind = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], []).append(doc)
    assert "RayCronJob" not in by_kind and len(by_kind["RayCluster"]) == 1 and len(by_kind["RayService"]) == 1
    (cluster,), (cron,) = by_kind["RayCluster"], by_kind["CronJob"]
    workers = cluster["spec"]["workerGroupSpecs"][0]
    assert (workers["minReplicas"], workers["maxReplicas"], cluster["spec"]["enableInTreeAutoscaling"]) == (0, 4, True)
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    assert {"name": "job-config", "configMap": {"name": "tiny-config"}} in head["volumes"]
    config = next(d for d in by_kind["ConfigMap"] if d["metadata"]["name"] == "tiny-config")
    assert yaml.safe_load(config["data"]["loop.yaml"])["job"] == "/etc/petatrain/job.yaml"
    spec = cron["spec"]
    assert (spec["schedule"], spec["timeZone"], spec["concurrencyPolicy"]) == ("@hourly", "UTC", "Forbid")
    job = spec["jobTemplate"]["spec"]
    assert job["backoffLimit"] >= 1  # a failed cycle is submitted again and goes on where it stopped
    (container,) = job["template"]["spec"]["containers"]
    assert container["command"] == [
        "ray", "job", "submit", "--address", "http://tiny-head-svc.ml.svc:8265", "--",
        "petatrain", "loop", "/etc/petatrain/loop.yaml", "--once", "--address", "auto",
    ]  # fmt: skip
    token = next(e for e in container["env"] if e["name"] == "RAY_AUTH_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "tiny", "key": "auth_token"}  # KubeRay's for the cluster
    done = run_cli("deploy", "k8s", "--loop", str(loop_file), "--cron", "kubernetes", "--out", str(tmp_path / "x"))
    assert done.returncode == 2 and "--cron 'kubernetes': raycronjob" in done.stderr
