"""petatrain's continuous-training loop as a Kubeflow Pipelines (kfp 2.x) pipeline: ingest the stable
new files of the loop's source as a dataset version, then, if a version's cycle is pending, continue
the champion onto it and promote it through the gate. Each step is a component that runs `petatrain
loop LOOP.yaml --once --only STEP --json`, the same code the embedded loop and the Airflow DAGs run;
every step is idempotent, so KFP's retry of a step killed mid-way goes on where it stopped and
nothing is trained twice.

kfp 2.17 pins protobuf < 7 and requests 2.33.0, which petatrain's environment does not resolve
with, so the pipeline is built in kfp's own environment: install petatrain there without its
dependencies (`pip install --no-deps petatrain`: this module needs only the standard library and
kfp) and point `PETATRAIN_BIN` at the `petatrain` of petatrain's own environment. The components
themselves import nothing of petatrain (KFP ships a component as its function's source), so on a
cluster they run in an image that has `petatrain` on its PATH (`image=`; keep petatrain in its own
virtual environment in that image: KFP's launcher installs kfp into the image's `python3`).

KFP has no data-driven trigger like Airflow's assets: schedule the pipeline as a recurring run
(every few minutes, as the embedded loop polls); a run that finds nothing new ends after the ingest
step. Every task's cache is off, since the same loop file gives new results as files land.

On a cluster (`cluster="NAMESPACE/CONFIGMAP"`, the ConfigMap `petatrain deploy k8s --loop LOOP.yaml
--cron kfp` wrote): every step reads the loop file and its job config from the ConfigMap (no file
to bake into the image), and the train step runs no training in its pod: it creates the RayJob the
ConfigMap holds (`petatrain loop --once --only train` in a Ray cluster of its own, as KubeRay runs
any RayJob), named after the pipeline run, and waits for it. A retried train step finds its run's
RayJob and waits for it instead of creating a second; a RayJob that failed is deleted and created
again (the loop goes on where it stopped); one that succeeded is the step's result. It talks to the
Kubernetes API with the `kubernetes` client, which kfp depends on, as the pod's service account
(the Role that `deploy k8s` writes)."""

# No `from __future__ import annotations`: KFP reads the component's annotations as types.
from typing import Any


def loop_step(loop_file: str, step: str, cluster: str = "") -> str:
    """`petatrain loop LOOP --once --only STEP --json`, whose JSON goes to the task's log; the output is
    the cycle's outcome after the step ("trained", "promoted", "rejected", "done", ...), and after
    ingest "pending" when a version's cycle is not over (train and promote run). `cluster`
    "NAMESPACE/CONFIGMAP": the loop file and its job config are the ConfigMap's (`deploy k8s --loop
    --cron kfp`), `loop_file` is not read. KFP ships this function's source as the component:
    everything it needs is imported inside."""
    import json
    import os
    import subprocess

    if cluster:  # the loop as deployed: the ConfigMap's loop.yaml, its `job:` the ConfigMap's job.yaml
        import tempfile

        import yaml
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:  # outside a pod (a local try): the kubeconfig's context
            config.load_kube_config()
        namespace, _, name = cluster.rpartition("/")
        files = client.CoreV1Api().read_namespaced_config_map(name, namespace or "default").data
        folder = tempfile.mkdtemp(prefix="petatrain-loop-")
        loop_file, job_file = os.path.join(folder, "loop.yaml"), os.path.join(folder, "job.yaml")
        with open(job_file, "w") as handle:
            handle.write(files["job.yaml"])
        with open(loop_file, "w") as handle:
            handle.write(yaml.safe_dump({**yaml.safe_load(files["loop.yaml"]), "job": job_file}))

    # constants.BIN_ENV, spelt out: KFP ships this function's source alone
    argv = [os.environ.get("PETATRAIN_BIN", "petatrain"), "loop", loop_file, "--once", "--only", step, "--json"]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:  # petatrain's one-line error; KFP retries the task
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise RuntimeError(f"petatrain loop --only {step} failed ({done.returncode}): {lines[-1] if lines else ''}")
    print(done.stdout)
    result = json.loads(done.stdout)
    # A retried ingest whose killed try committed the version finds it "done" but not handled: pending.
    if step == "ingest" and int(result.get("version") or 0) > 0 and not (result.get("record") or {}).get("handled"):
        return "pending"
    return str(result["outcome"])


def train_rayjob(cluster: str, run: str, poll_s: float = 10.0) -> str:
    """On a cluster, the train step: create the RayJob that the ConfigMap `cluster`
    ("NAMESPACE/CONFIGMAP", `deploy k8s --loop --cron kfp`) holds, named after the pipeline run
    `run` (NAME-train-<8 hex digits>), and wait for it; "trained" once it succeeded. A retry of the
    step finds its run's RayJob: it waits for one still running, returns at once for one that
    succeeded, and deletes one that failed (KubeRay's retries, `backoffLimit`, spent) to create it
    again: the loop goes on where it stopped. A RayJob that fails raises, and KFP retries the step.
    KFP ships this function's source as the component: everything it needs is imported inside."""
    import hashlib
    import json
    import time

    import yaml
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException

    try:
        config.load_incluster_config()
    except config.ConfigException:  # outside a pod (a local try): the kubeconfig's context
        config.load_kube_config()
    namespace, _, config_map = cluster.rpartition("/")
    namespace = namespace or "default"
    data = client.CoreV1Api().read_namespaced_config_map(config_map, namespace).data
    template = yaml.safe_load(data["train-rayjob.yaml"])  # constants.KFP_RAYJOB_KEY, spelt out
    name = f"{template['metadata']['name']}-{hashlib.sha256(run.encode()).hexdigest()[:8]}"
    body = {**template, "metadata": {**template["metadata"], "name": name, "namespace": namespace}}
    api, where = client.CustomObjectsApi(), ("ray.io", "v1", namespace, "rayjobs")

    def status() -> dict | None:
        try:
            return api.get_namespaced_custom_object(*where, name).get("status") or {}
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def ended(now: dict) -> bool:  # IsJobDeploymentTerminal (KubeRay's rayjob_types.go)
        return now.get("jobDeploymentStatus") in ("Complete", "Failed")

    def succeeded(now: dict) -> bool:
        return now.get("jobDeploymentStatus") == "Complete" and now.get("jobStatus") == "SUCCEEDED"

    now = status()
    if now is not None and ended(now) and not succeeded(now):  # an earlier try's RayJob failed: again
        print(f"RayJob {name} ended {now.get('jobDeploymentStatus')} ({now.get('reason', '')}): creating it again")
        api.delete_namespaced_custom_object(*where, name, propagation_policy="Foreground")
        deadline = time.monotonic() + 600  # its cluster's pods go first (Foreground)
        while now is not None:
            if time.monotonic() > deadline:  # a finalizer holds it: KFP retries the step later
                raise RuntimeError(f"RayJob {namespace}/{name} is still being deleted after 600 s")
            time.sleep(min(poll_s, 2.0))
            now = status()
    if now is None:
        try:
            api.create_namespaced_custom_object(*where, body)
            print(f"RayJob {namespace}/{name} created")
        except ApiException as exc:
            if exc.status != 409:  # 409: a try running beside this one created it: wait for it alike
                raise
    told = None
    while True:
        now = status() or {}
        state = (now.get("jobDeploymentStatus"), now.get("jobStatus"))
        if state != told:  # the task's log follows the RayJob: a line per change of state
            print(f"RayJob {namespace}/{name}: {state[0] or 'New'}, job {state[1] or '-'}", flush=True)
            told = state
        if ended(now):
            break
        time.sleep(poll_s)
    print(json.dumps({"rayjob": f"{namespace}/{name}", **{k: v for k, v in now.items() if isinstance(v, str)}}))
    if not succeeded(now):  # KFP retries the step, which creates the RayJob again
        reason = "; ".join(str(now[k]) for k in ("reason", "message") if now.get(k))
        raise RuntimeError(
            f"RayJob {namespace}/{name} ended {now.get('jobDeploymentStatus')}, job {now.get('jobStatus')}: {reason}"
        )
    return "trained"


def continuous_pipeline(
    *,
    image: str = "petatrain:latest",
    retries: int = 2,
    backoff: str = "5s",
    name: str = "petatrain-continuous",
    env: dict[str, str] | None = None,
    cluster: str = "",
    poll_s: float = 10.0,
) -> Any:
    """The loop as one KFP pipeline with a `loop_file` parameter: `ingest`, then, if it says a version
    is pending, `train` and `promote`. Each task retries `retries` times after `backoff`,
    runs with `env` set (e.g. PETATRAIN_BIN) and is never taken from KFP's cache. `cluster`
    "NAMESPACE/CONFIGMAP": on a cluster, the loop is the ConfigMap's and the train step creates its
    RayJob (`train_rayjob`, asking its state every `poll_s`) instead of training in its pod."""
    from kfp import dsl

    # install_kfp_package: KFP's launcher needs kfp beside the function; the image's python3 gets it.
    component = dsl.component(loop_step, base_image=image)
    on_cluster = dsl.component(train_rayjob, base_image=image)

    def step(loop_file: str, which: str) -> Any:
        if cluster and which == "train":
            task = on_cluster(cluster=cluster, run=dsl.PIPELINE_JOB_ID_PLACEHOLDER, poll_s=poll_s)
        else:
            task = component(loop_file=loop_file, step=which, cluster=cluster)
        task.set_display_name(which)
        task.set_retry(num_retries=retries, backoff_duration=backoff)
        task.set_caching_options(False)
        for key, value in (env or {}).items():
            task.set_env_variable(key, value)
        return task

    @dsl.pipeline(name=name, description="petatrain: new files -> a dataset version -> continued -> promoted")
    def continuous(loop_file: str = "") -> None:  # "" on a cluster: the ConfigMap's loop
        ingest = step(loop_file, "ingest")
        with dsl.If(ingest.output == "pending", name="a-version-is-pending"):
            train = step(loop_file, "train")
            step(loop_file, "promote").after(train)

    return continuous


def compile_pipeline(path: str, **kwargs: Any) -> str:
    """Write the pipeline's spec (IR YAML, what a KFP cluster runs) to `path`."""
    from kfp import compiler

    compiler.Compiler().compile(continuous_pipeline(**kwargs), package_path=path)
    return path
