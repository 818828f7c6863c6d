"""The pods `deploy k8s` describes, run as a kubelet would run them, without Kubernetes.

No Kubernetes runs here, but everything a pod executes can: the head's and the worker group's
`ray start` (their rayStartParams as flags, num-cpus from the container's CPU limit, as KubeRay
passes them), the containers' environment (Secrets resolved by name, mounts mapped to folders)
and the RayJob's entrypoint, in the two network namespaces of `chaos.netns.TwoNodeCluster`, with
the run directory on the local Ceph S3 server. The worker pod is killed and replaced from the same
manifest; then the head pod is lost and the entrypoint runs again on a new cluster, as a RayJob
retry does. The run ends with the weights of an uninterrupted run: one run, several attempts.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import sha256, tiny
from petatrain.deploy import manifests
from petatrain.deploy.manifests import CACHE_PATH, CONFIG_PATH, Target
from petatrain.observe.ledger import read_events
from petatrain.storage import resolve

pytestmark = [pytest.mark.slow, pytest.mark.chaos, pytest.mark.s3]


def _flags(group: dict) -> list[str]:
    """`ray start` flags KubeRay gives a group's pods: rayStartParams, num-cpus from the CPU limit."""
    params = dict(group["rayStartParams"])
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    params.setdefault("num-cpus", str(math.ceil(float(limits["cpu"]))))
    return [f"--{key}={value}" for key, value in params.items()]


def _env(group: dict, secrets: dict[str, dict[str, str]], cache: Path, pod_ip: str) -> dict[str, str]:
    """A container's environment as the kubelet resolves it: values, Secret keys by reference, the pod's IP."""
    env = {}
    for var in group["template"]["spec"]["containers"][0]["env"]:
        if "value" in var:
            env[var["name"]] = var["value"].replace(CACHE_PATH, str(cache))
        elif "fieldRef" in var["valueFrom"]:
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            env[var["name"]] = pod_ip
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            if ref["key"] in secrets.get(ref["name"], {}):
                env[var["name"]] = secrets[ref["name"]][ref["key"]]
            else:
                assert ref.get("optional"), f"Secret {ref['name']} has no key {ref['key']}"
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _readyz(cluster) -> dict:
    """The driver's /readyz, asked from inside the head pod (where the probe runs)."""
    ask = "import json, urllib.request, urllib.error\ntry:\n    r = urllib.request.urlopen('http://127.0.0.1:8079/readyz', timeout=3)\nexcept urllib.error.HTTPError as e:\n    r = e\nexcept OSError:\n    print('{}'); raise SystemExit\nprint(r.read().decode())"  # noqa: E501
    done = cluster.run([sys.executable, "-c", ask], capture_output=True, text=True, timeout=30)
    return json.loads(done.stdout or "{}")


def _wait(cluster, driver, until, what: str, timeout_s: float = 180) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert driver.poll() is None, f"the driver ended before {what}"
        seen = _readyz(cluster)
        if seen and until(seen):
            return seen
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def test_the_manifests_pods_survive_a_worker_pod_and_a_head_pod_loss(baseline, token_dataset, s3_bucket, tmp_path):
    from helpers import need_network_namespaces
    from petatrain.chaos.netns import TwoNodeCluster

    need_network_namespaces()
    port = _free_port()
    endpoint = f"http://10.231.0.1:{port}"  # the S3 server as the pods reach it (TwoNodeCluster's head IP)
    cfg = tiny(token_dataset, f"storage.s3_endpoint_url={endpoint}")
    run_url = f"{s3_bucket}/runs/tiny"
    # The dataset is on a share both pods mount at the same path (here, the one file system they see).
    shared = (("datasets", os.path.dirname(token_dataset)),)
    docs = {d["kind"]: d for d in manifests.build(cfg, Target(name="tiny", run_dir=run_url, volumes=shared))}
    cluster_spec = docs["RayJob"]["spec"]["rayClusterSpec"]
    head, workers = cluster_spec["headGroupSpec"], cluster_spec["workerGroupSpecs"][0]
    secrets = {"tiny-s3": {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}}
    (tmp_path / "cache").mkdir()
    pod_env = _env(workers, secrets, tmp_path / "cache", "10.231.0.2")
    config_file = tmp_path / "job.yaml"  # the ConfigMap, mounted
    config_file.write_text(docs["ConfigMap"]["data"]["job.yaml"])
    head_env = _env(head, secrets, tmp_path / "cache", "10.231.0.1")
    # KubeRay's submitter runs the entrypoint as `bash -c "ray job submit ... -- ENTRYPOINT"` in its own
    # pod, without the head's variables: the arguments the driver gets are what that shell leaves.
    line = docs["RayJob"]["spec"]["entrypoint"].replace(CONFIG_PATH, str(config_file))
    echoed = subprocess.run(
        ["bash", "-c", f"{shlex.quote(sys.executable)} -c 'import json, sys; print(json.dumps(sys.argv[1:]))' {line}"],
        env={"PATH": os.environ["PATH"]}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    argv = [str(Path(sys.executable).with_name("petatrain")), *json.loads(echoed.stdout)[1:]]
    assert "--resume" in argv and "observe.metrics_host=pod-ip" in argv  # the driver reads POD_IP where it runs
    # Each loss lands mid-run: a hang holds the training there (each fires once per run; the watchdog
    # would end it after faults.hang_timeout_s, 6 s), at step 15 for the worker pod's loss and at step
    # 25 for the head pod's. Without them 30 tiny steps could end between a look and the kill (seen
    # once: the worker pod was lost after step 30, its restart found nothing left, the driver ended).
    argv += ["--inject", "hang@step=15,rank=1", "--inject", "hang@step=25"]

    def pods() -> TwoNodeCluster:
        # One pod of the worker group: its 2-CPU limit holds both training workers (parallel.workers 2).
        return TwoNodeCluster(head_args=_flags(head), worker_args=_flags(workers), node_env=pod_env)

    def entrypoint(cluster: TwoNodeCluster, name: str):
        cluster.expose(os.environ["AWS_ENDPOINT_URL"].removeprefix("http://"), port)
        out, err = (tmp_path / f"{name}.out").open("w"), (tmp_path / f"{name}.err").open("w")
        return cluster.popen(argv, env=head_env, stdout=out, stderr=err, text=True)

    with pods() as cluster:
        driver = entrypoint(cluster, "first")
        try:
            _wait(cluster, driver, lambda s: s.get("attempt") == 0 and (s.get("step") or 0) >= 13, "step 13")
            cluster.restart_worker()  # the worker pod is killed; its replacement starts from the same spec
            _wait(cluster, driver, lambda s: s.get("attempt", 0) >= 1 and (s.get("step") or 0) >= 24, "attempt 1")
        finally:
            driver.kill()  # the head pod is lost with everything in it: the driver, Ray's head, the workers
            driver.wait()
    with pods() as cluster:  # a new cluster from the same manifest: the RayJob's retry
        driver = entrypoint(cluster, "retry")
        assert driver.wait(timeout=300) == 0, (tmp_path / "retry.err").read_text()[-3000:]

    fs, path = resolve(f"{run_url}/final/model.safetensors")
    local = tmp_path / "model.safetensors"
    fs.get(path, str(local))
    assert sha256(local) == sha256(baseline / "final" / "model.safetensors")
    events = read_events(run_url)
    assert [e["event"] for e in events].count("run_start") == 1
    cont = [e for e in events if e["event"] == "run_continue"]
    assert len(cont) == 1 and cont[0]["run_id"] == events[0]["run_id"]
    causes = [e["cause"] for e in events if e["event"] == "failure"]
    assert causes[-1] == "driver_lost" and set(causes[:-1]) & {"node_lost", "kill"}, causes
    assert events[-1]["event"] == "end" and events[-1]["status"] == "ok"
