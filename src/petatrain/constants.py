"""Every Ray tunable and environment variable petatrain sets or reads, in one place.

Set with `os.environ.setdefault` so that a user's own value wins. Names Ray reads are spelled as
Ray spells them; the values are why petatrain differs from Ray's default.
"""

from __future__ import annotations

import os

# -- read by petatrain -------------------------------------------------------------------------
CONTROLLER_ENV = "PETATRAIN_CONTROLLER"  # where Ray Train's controller runs: driver (default) or actor
CONTROLLER_MODES = ("driver", "actor")
RAY_ADDRESS_ENV = "RAY_ADDRESS"  # a cluster to join: the run is not local, so the driver's controller is off
OMP_THREADS_ENV = "OMP_NUM_THREADS"  # the driver's choice, passed to the workers' runtime env
VERBOSE_ENV = "PETATRAIN_VERBOSE"  # Ray's output on the terminal (set by --verbose, for the processes it starts)
DEBUG_ENV = "PETATRAIN_DEBUG"  # the same, and a traceback under every one-line error
REGISTRY_ENV = "PETATRAIN_REGISTRY"  # the model registry when a command names none (else .petatrain/registry)
CACHE_DIR_ENV = "PETATRAIN_CACHE_DIR"  # the node-local shard cache (set in the pods `deploy k8s` writes)
CALIBRATION_DIR_ENV = "PETATRAIN_CALIBRATION_DIR"  # where `profile` saves and `plan` reads calibrations
BIN_ENV = "PETATRAIN_BIN"  # the orchestrators' tasks: the `petatrain` of petatrain's own environment

# -- set for the processes of a Ray cluster petatrain starts itself (chaos/netns.py) -------------
# (the two token variables are also named in the one line for a cluster that refuses a driver's token)
RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"
RAY_AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"
RAY_USAGE_STATS_ENV = "RAY_USAGE_STATS_ENABLED"
# GCS's node health check (Ray `_system_config`): a lost node is marked dead after 3 missed
# 1 s checks instead of Ray's minute, so a partition test sees the loss while it still matters.
FAST_HEALTH_CHECK = {
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_initial_delay_ms": 1000,
    "health_check_failure_threshold": 3,
}

# -- set for Ray before it starts (the driver's environment reaches the controller and workers) --
# Faster failure detection than Ray Train's 2 s poll.
HEALTH_CHECK_INTERVAL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
HEALTH_CHECK_INTERVAL_S = "0.5"
# Ray Train's print patch routes every print of a rank through the driver; petatrain logs instead.
PRINT_PATCH_ENV = "RAY_TRAIN_ENABLE_PRINT_PATCH"
# Preemption notices reach the loop as SIGTERM (runtime.worker.PreemptionNotice); Ray Train's drain
# watcher is one more actor process per attempt that nothing here reads.
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
# A local Ray's log monitor lists its log folder 10 times a second while it holds fewer files than
# this; at 0 it does so every 0.5 s (new workers' output reaches the driver a little later). The
# listing's CPU is taken from the training workers when they fill the machine.
LOG_MONITOR_THRESHOLD_ENV = "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"
# A module path in it is imported and called by every new worker process that has it in its
# environment (WORKER_PROCESS_SETUP_HOOK_ENV_VAR of Ray's private ray_constants; default_worker.py).
WORKER_SETUP_HOOK_ENV = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"


def set_train_defaults() -> None:
    """The Ray Train settings a training driver wants, unless the environment already chose."""
    os.environ.setdefault(HEALTH_CHECK_INTERVAL_ENV, HEALTH_CHECK_INTERVAL_S)
    os.environ.setdefault(PRINT_PATCH_ENV, "0")
    os.environ.setdefault(PREEMPTION_WATCHER_ENV, "0")


# A task whose process died is run again this many times (a lost node, a spot VM), then counted as
# its input's doing (ingest quarantines a file that kills every process reading it). Ray runs a task
# its memory monitor killed again forever by default: RAY_task_oom_retries bounds that alike.
TASK_RETRIES = 2
TASK_OOM_RETRIES_ENV = "RAY_task_oom_retries"


def set_local_cluster_defaults() -> None:
    """Settings for a Ray this process starts on its own machine."""
    os.environ.setdefault(LOG_MONITOR_THRESHOLD_ENV, "0")
    os.environ.setdefault(TASK_OOM_RETRIES_ENV, str(TASK_RETRIES))


def controller_mode() -> str:
    """Where Ray Train's controller runs: "driver" (the default) or "actor" (PETATRAIN_CONTROLLER)."""
    from petatrain.errors import ConfigError

    mode = os.environ.get(CONTROLLER_ENV, "driver")
    if mode not in CONTROLLER_MODES:
        raise ConfigError(f"{CONTROLLER_ENV}={mode!r}: driver (the default) or actor")
    return mode


# The Ray Serve application `petatrain serve` runs (and a RayService's serveConfigV2 names).
SERVE_APP = "petatrain"

# `deploy k8s --loop`: a cycle's schedule where none is given (RayCronJob, CronJob); for a Kubeflow
# pipeline (--cron kfp), the service account its pods run as (standalone KFP's) and the key of the
# ConfigMap that carries the train step's RayJob (petatrain.kubeflow spells it out: KFP ships a
# component's source alone).
LOOP_SCHEDULE = "*/15 * * * *"
KFP_SERVICE_ACCOUNT = "pipeline-runner"
KFP_RAYJOB_KEY = "train-rayjob.yaml"
