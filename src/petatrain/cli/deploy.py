"""`deploy k8s`: KubeRay manifests from a job config and its plan, and their offline validation."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from petatrain import api, constants, render
from petatrain import config as config_mod
from petatrain.cli.common import Json, Sets, print_json, say, show, verb
from petatrain.errors import ConfigError

deploy_app = typer.Typer(
    no_args_is_help=True, help="Run on Kubernetes: KubeRay manifests from a job config and its plan."
)


@deploy_app.command("k8s")
@verb()
def deploy_k8s(
    config: Annotated[Path | None, typer.Argument(help="Job config YAML (not needed with --validate).")] = None,
    out_dir: Annotated[
        str, typer.Option("--out", help="Folder the manifests are written to (one YAML file each).")
    ] = "",
    run_dir: Annotated[
        str, typer.Option("--run-dir", help="The run directory on the object store (s3://...): what a retry continues.")
    ] = "",
    image: Annotated[str, typer.Option(help="Container image with petatrain installed.")] = "",
    namespace: Annotated[str, typer.Option(help="Kubernetes namespace.")] = "default",
    name: Annotated[
        str, typer.Option(help="Name of the RayJob/RayCluster/RayService (default: petatrain-CONFIG).")
    ] = "",
    accelerator: Annotated[str, typer.Option(help="Catalog accelerator (H100-SXM, ...); default: CPU pods.")] = "",
    count: Annotated[int, typer.Option(help="Accelerators (or CPU workers) to train on; default: the config's.")] = 0,
    from_plan: Annotated[
        bool, typer.Option("--from-plan", help="Size from `petatrain plan`'s recommendation.")
    ] = False,
    kind: Annotated[
        str, typer.Option(help="rayjob (train, then finish), raycluster (interactive) or rayservice (serve --run-dir).")
    ] = "rayjob",
    checkpoint: Annotated[
        str, typer.Option(help="rayservice: the checkpoint served: final, latest (follows new ones) or a step.")
    ] = "final",
    s3_secret: Annotated[
        str, typer.Option(help="Secret holding AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (default: NAME-s3).")
    ] = "",
    volume: Annotated[
        list[str] | None,
        typer.Option(
            help="CLAIM:/PATH: a PersistentVolumeClaim every pod mounts at /PATH (repeatable); local paths of the "
            "config under /PATH (a dataset on NFS) are read there. Without one, they must be on the object store."
        ),
    ] = None,
    loop: Annotated[
        Path | None,
        typer.Option(
            help="A loop file (petatrain loop): write a RayCronJob running one cycle on --schedule, and a "
            "RayService serving registry://MODEL@champion that follows it (instead of CONFIG)."
        ),
    ] = None,
    schedule: Annotated[
        str,
        typer.Option(
            help=f"--loop: when a cycle runs, in cron's syntax (default {constants.LOOP_SCHEDULE!r}; not with kfp)."
        ),
    ] = "",
    time_zone: Annotated[str, typer.Option(help="--loop: the schedule's time zone (default: the operator's).")] = "",
    cron: Annotated[
        str,
        typer.Option(
            help="--loop: raycronjob (KubeRay's RayCronJob, a cluster per cycle; needs its feature gate), cronjob "
            "(a Kubernetes CronJob submitting each cycle to a standing RayCluster whose workers autoscale from none) "
            "or kfp (no schedule: a Kubeflow pipeline's train step creates the cycle's RayJob, kept in the ConfigMap)."
        ),
    ] = "raycronjob",
    kfp_service_account: Annotated[
        str,
        typer.Option(
            help="--cron kfp: the service account the pipeline's pods run as (NAME, or NAMESPACE/NAME where KFP "
            "runs in another namespace), given access to the loop's ConfigMap and to RayJobs."
        ),
    ] = constants.KFP_SERVICE_ACCOUNT,
    queue: Annotated[
        str,
        typer.Option(help="A Kueue LocalQueue: the job is created suspended and Kueue admits all its pods at once."),
    ] = "",
    fabric: Annotated[
        str,
        typer.Option(
            help="GPU pods' RDMA network: efa (AWS, 32 interfaces a node), infiniband (the RDMA shared device "
            "plugin), or RESOURCE=COUNT; with NCCL's and libfabric's settings and IPC_LOCK."
        ),
    ] = "",
    cache_size: Annotated[str, typer.Option(help="Size of each node's shard cache.")] = "100Gi",
    cache_storage_class: Annotated[
        str, typer.Option(help="Storage class for the shard cache (a PVC per pod); default: an emptyDir.")
    ] = "",
    validate: Annotated[
        str, typer.Option("--validate", help="Only check the manifests in this folder, offline; exit 1 on a problem.")
    ] = "",
    set_: Sets = None,
    as_json: Json = False,
) -> None:
    """Write KubeRay manifests (a RayJob, RayCluster or RayService, with its ServiceAccount, ConfigMap and
    PodMonitor) sized from the config or its plan; a RayJob's retry continues the run. --validate DIR checks them."""
    if validate:
        problems = api.validate_k8s(validate)
        if as_json:
            print_json({"folder": validate, "problems": problems})
        else:
            for line in problems:
                render.out.print(escape(line), highlight=False, soft_wrap=True)
        if problems:
            raise typer.Exit(1)
        if not as_json:
            render.out.print(f"{escape(validate)}: every manifest is valid", highlight=False, soft_wrap=True)
        return
    if loop is not None:
        if config is not None or not out_dir:
            raise ConfigError("deploy k8s --loop LOOP.yaml needs --out DIR and no CONFIG (the loop file names its job)")
        done, loop_name = _loop(
            loop, out_dir, name, namespace, image, s3_secret, volume, schedule, time_zone, cron, kfp_service_account,
            set_,
        )  # fmt: skip
        show(done.to_dict(), _written(done, out_dir, namespace, config_map=f"{loop_name}-config"))
        return
    if config is None or not out_dir:
        raise ConfigError("deploy k8s needs a CONFIG and --out DIR (or --validate DIR)")
    if kind not in ("rayjob", "raycluster", "rayservice"):
        raise ConfigError(f"--kind {kind!r}: rayjob, raycluster or rayservice")
    from petatrain.deploy.manifests import Target, check_volume, name_from

    cfg = config_mod.load(config, list(set_ or []))
    # kind: one of the three (checked above); image: the Target's own default unless one is given
    chosen: dict[str, Any] = {"kind": kind, **({"image": image} if image else {})}
    target = Target(
        name=name or name_from(str(config)), run_dir=run_dir or "", namespace=namespace, accelerator=accelerator,
        s3_secret=s3_secret, cache_size=cache_size, checkpoint=checkpoint, cache_storage_class=cache_storage_class,
        volumes=tuple(check_volume(spec) for spec in volume or []), queue=queue, fabric=fabric, **chosen,
    )  # fmt: skip
    if kind != "raycluster" and not run_dir:
        raise ConfigError(
            f"--run-dir s3://BUCKET/runs/NAME: a {kind} trains into (or serves) a run directory on the object store"
        )
    done = api.deploy_k8s(cfg, target, out_dir, from_plan=from_plan, count=count)
    show(done.to_dict(), _written(done, out_dir, namespace))


def _loop(
    loop: Path, out_dir: str, name: str, namespace: str, image: str, s3_secret: str, volume: list[str] | None,
    schedule: str, time_zone: str, cron: str, kfp_service_account: str, set_: list[str] | None,
) -> tuple[api.Deployment, str]:  # fmt: skip
    """What `deploy k8s --loop` wrote, and the loop's name on the cluster."""
    from petatrain.deploy.manifests import Target, check_volume, name_from
    from petatrain.loop import spec as spec_mod

    spec = spec_mod.load(loop, list(set_ or []))
    target = Target(
        name=name or name_from(str(loop)), run_dir=spec.runs, namespace=namespace, s3_secret=s3_secret,
        volumes=tuple(check_volume(v) for v in volume or []),
    )  # fmt: skip
    if image:
        target = dataclasses.replace(target, image=image)
    if not schedule and cron != "kfp":
        schedule = constants.LOOP_SCHEDULE
    done = api.deploy_loop_k8s(
        spec, target, out_dir, schedule=schedule, time_zone=time_zone, cron=cron,
        kfp_service_account=kfp_service_account,
    )  # fmt: skip
    return done, target.name


def _written(done: api.Deployment, out_dir: str, namespace: str, config_map: str = "") -> Any:
    def written(_: object) -> None:  # on stderr, as progress: the manifests are the output
        lo, hi = done.worker_pods
        pods = f"{lo}" if lo == hi else f"{lo}-{hi} (autoscaled)"
        per = f" x {done.devices_per_node} {done.accelerator}" if done.devices_per_node else " (CPU)"
        say(f"{done.kind}: {pods} worker pod(s){per}, sized by {escape(done.sized_by)}")
        for path in done.files:
            say(f"  {path}")
        if done.kind == "raycronjob":
            say("the RayCronJob needs KubeRay's operator started with --feature-gates=RayCronJob=true (v1.7.0: alpha)")
        if done.kind == "cronjob":
            say("the CronJob submits each cycle to the standing RayCluster it names; its workers start for a cycle")
        if done.kind == "kfp":
            say(
                "compile the pipeline with: python examples/kubeflow/continuous.py --compile PIPELINE.yaml "
                f"--cluster {escape(namespace)}/{escape(config_map)}; its steps read the loop from that ConfigMap "
                "and its train step creates the cycle's RayJob from it"
            )
        if done.secrets:
            say("the Secrets they reference (create them first, values not shown):")
            for command in done.secrets:
                say(f"  {escape(command)}")
        watched = "rayjob" if done.kind == "kfp" else done.kind
        say(f"apply: kubectl apply -f {out_dir}   watch: kubectl get {watched} -n {namespace} -w")

    return written
