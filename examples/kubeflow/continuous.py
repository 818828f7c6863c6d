"""Kubeflow Pipelines (kfp 2.x): petatrain's continuous-training loop as one pipeline
(petatrain.kubeflow): ingest the stable new files of the loop's source as a dataset version; if a
version's cycle is pending, continue the champion onto it, evaluate and promote. Run it from kfp's
own environment (kfp and petatrain pin different protobuf and requests versions), with petatrain
installed there without its dependencies (pip install --no-deps petatrain) and PETATRAIN_BIN naming
the `petatrain` of petatrain's own environment:

    python examples/kubeflow/continuous.py examples/loop.yaml --compile continuous.yaml
        the pipeline's spec, for a KFP cluster (upload it, and schedule it as a recurring run)
    python examples/kubeflow/continuous.py examples/loop.yaml --local
        one run here, on KFP's local runner (each step a subprocess), printing each step's outcome
    python examples/kubeflow/continuous.py --compile continuous.yaml --cluster NAMESPACE/NAME-config
        for a cluster where `petatrain deploy k8s --loop LOOP.yaml --cron kfp` was applied: the steps
        read the loop from that ConfigMap, and the train step creates the cycle's RayJob and waits for it
"""

import argparse
import json
import os
import sys
import tempfile

from petatrain.kubeflow import compile_pipeline, continuous_pipeline


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("loop", nargs="?", default="", help="the loop file (petatrain loop); not with --cluster")
    parser.add_argument("--compile", metavar="PATH", help="write the pipeline's spec (IR YAML) to PATH")
    parser.add_argument("--local", action="store_true", help="run it once here on KFP's local runner")
    parser.add_argument("--image", default="petatrain:latest", help="the components' image (on a cluster)")
    parser.add_argument("--retries", type=int, default=2, help="each step's retries")
    parser.add_argument("--backoff", default="5s", help="the wait before a retry")
    parser.add_argument(
        "--cluster",
        metavar="NAMESPACE/CONFIGMAP",
        default="",
        help="the loop's ConfigMap on the cluster (deploy k8s --loop --cron kfp): train as its RayJob",
    )
    parser.add_argument(
        "--root", help="--local: where the runner keeps its outputs and logs (default: a new temp folder)"
    )
    args = parser.parse_args()
    if bool(args.loop) == bool(args.cluster):
        parser.error("give a loop file, or --cluster NAMESPACE/CONFIGMAP (the loop as deployed), not both")
    if args.cluster and args.local:
        parser.error("--cluster: the steps run on the cluster; --local runs a loop file here")
    loop_file = os.path.abspath(args.loop) if args.loop else ""
    settings = {"image": args.image, "retries": args.retries, "backoff": args.backoff, "cluster": args.cluster}
    if args.compile:
        print(compile_pipeline(args.compile, **settings))
    if args.local:
        from kfp import local

        root = args.root or tempfile.mkdtemp(prefix="petatrain-kfp-")  # the local runner's artifacts and logs
        local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=root)
        run = continuous_pipeline(**settings)(loop_file=loop_file)
        print(json.dumps({"state": "SUCCEEDED", "pipeline_root": root, "outputs": dict(run.outputs)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
