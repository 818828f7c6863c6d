"""Every private Ray name petatrain relies on (all of them used in src/petatrain/runtime/_ray/ and
runtime/startup/spares.py's warm-up list) is still where petatrain expects it.

After a Ray upgrade this is the test that fails first, naming the attribute that moved; the
runtime falls back to Ray's stock behaviour (slower restarts) rather than break, so without
this test a move would go unnoticed. No cluster is started.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

# (module, dotted attribute path) — a path of "" checks only that the module imports.
PRIVATE = [
    # runtime/_ray/__init__.py
    ("ray._private.ray_constants", "ENABLE_RAY_CLUSTER"),
    ("ray._private.ray_constants", "WORKER_PROCESS_SETUP_HOOK_ENV_VAR"),
    ("ray._private.worker", "raise_sys_exit_with_custom_error_message"),
    ("ray._private.worker", "global_worker"),
    ("ray._private.worker", "_worker_logs_enabled"),
    ("ray._private.worker", "_global_node"),
    ("ray._private.ray_constants", "PROCESS_TYPE_MONITOR"),
    ("ray._private.node", "Node.get_session_dir_path"),
    ("ray._private.node", "Node.node_ip_address"),
    ("ray._private.node", "Node.node_manager_port"),
    ("ray._private.state", "actors"),
    ("ray._private.grpc_utils", "init_grpc_channel"),
    ("ray.core.generated.common_pb2", "PYTHON"),
    ("ray.core.generated.node_manager_pb2", "PrestartWorkersRequest"),
    ("ray.core.generated.node_manager_pb2_grpc", "NodeManagerServiceStub"),
    ("ray.core.generated.gcs_service_pb2", "GetClusterIdRequest"),
    ("ray.core.generated.gcs_service_pb2_grpc", "NodeInfoGcsServiceStub"),
    ("ray.core.generated.ray_client_pb2", "ClusterInfoRequest"),
    ("ray.core.generated.ray_client_pb2", "ClusterInfoType.PING"),
    ("ray.core.generated.ray_client_pb2_grpc", "RayletDriverStub"),
    # runtime/_ray/errors.py
    ("ray.train.v2._internal.exceptions", "WorkerHealthCheckFailedError"),
    ("ray.train.v2._internal.exceptions", "WorkerHealthCheckTimeoutError"),
    ("ray.train", "WorkerGroupError"),
    # runtime/_ray/trainer.py
    ("ray._raylet", "RAY_NODE_ID_KEY"),
    ("ray.train.v2._internal.callbacks.datasets", "DatasetsCallback"),
    ("ray.train.v2._internal.callbacks.placement_group_callback", "PlacementGroupCleanerCallback"),
    ("ray.train.v2._internal.constants", "DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE"),
    ("ray.train.v2._internal.constants", "RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR"),
    ("ray.train.v2._internal.constants", "get_env_vars_to_propagate"),
    ("ray.train.v2._internal.execution.controller", "TrainController"),
    ("ray.train.v2._internal.execution.scaling_policy", "FixedScalingPolicy._maybe_send_resource_request"),
    ("ray.train.v2._internal.execution.scaling_policy", "FixedScalingPolicy._send_resource_request"),
    ("ray.train.v2._internal.execution.scaling_policy", "FixedScalingPolicy.after_controller_start"),
    ("ray.train.v2._internal.execution.scaling_policy", "FixedScalingPolicy.before_controller_shutdown"),
    ("ray.train.v2._internal.execution.scaling_policy", "FixedScalingPolicy.before_controller_abort"),
    ("ray.train.torch", "TorchTrainer._create_default_callbacks"),
    ("ray.train.torch", "TorchTrainer._initialize_and_run_controller"),
    ("ray.train.torch", "TorchTrainer._register_sigint_handler"),
    # runtime/_ray/controller.py
    ("ray.train.v2._internal.constants", "ENABLE_CONTROLLER_STRUCTURED_LOGGING_ENV_VAR"),
    ("ray.train.v2._internal.execution.callback", "WorkerGroupCallback.before_worker_group_shutdown"),
    ("ray.train.v2._internal.execution.controller", "TrainController.run"),
    ("ray.train.v2._internal.execution.controller", "TrainController.get_result"),
    ("ray.train.v2._internal.execution.controller", "TrainController.get_state"),
    ("ray.train.v2._internal.execution.controller", "TrainController._set_state"),
    ("ray.train.v2._internal.execution.controller.state", "AbortedState"),
    ("ray.train.v2._internal.execution.worker_group.state", "_shutdown_sync_actor"),
    ("ray.train.v2._internal.execution.worker_group.worker_group", "ray"),
    ("ray.train.v2._internal.execution.worker_group.worker_group", "SynchronizationActor"),
    ("ray.train.v2._internal.execution.worker_group.worker_group", "WorkerGroup._init_train_context_on_workers"),
    ("ray.train.v2._internal.execution.worker_group.worker_group", "WorkerGroup.get_latest_poll_status"),
    ("ray.train.v2._internal.execution.worker_group.worker_group", "WorkerGroup.get_workers"),
    ("ray.train.v2._internal.execution.worker_group.worker_group", "WorkerGroup.abort"),
    ("ray.train.v2._internal.execution.worker_group.worker", "Worker.execute_async"),
    ("ray.train.v2._internal.execution.worker_group.worker", "Worker.distributed_context"),
    ("ray.train.v2._internal.execution.worker_group.poll", "WorkerGroupPollStatus.worker_statuses"),
    ("ray.util.client", "ray.is_connected"),
    # runtime/_ray/__init__.py, for runtime/startup/forkserver.py
    ("ray._private.workers.default_worker", "__file__"),
    ("ray.actor", "ActorClassID.from_random"),
    ("ray.actor", "ActorClassID.size"),
    ("ray._raylet", "UniqueID.from_random"),
]


def _resolve(module: str, path: str) -> object:
    obj: object = importlib.import_module(module)
    for part in path.split(".") if path else []:
        if isinstance(obj, type) and part not in dir(obj) and _is_dataclass_field(obj, part):
            return obj  # an instance attribute declared on the (data)class
        obj = getattr(obj, part)
    return obj


def _is_dataclass_field(cls: type, name: str) -> bool:
    fields = getattr(cls, "__dataclass_fields__", {})
    annotations = inspect.get_annotations(cls) if hasattr(inspect, "get_annotations") else {}
    return name in fields or name in annotations


@pytest.mark.parametrize(("module", "path"), PRIVATE, ids=[f"{m}:{p}" for m, p in PRIVATE])
def test_private_ray_name_is_where_petatrain_expects_it(module, path):
    try:
        _resolve(module, path)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"Ray moved {module}.{path} (used by petatrain.runtime._ray): {exc}", pytrace=False)


def test_the_setup_hook_variable_is_rays():
    """petatrain.constants spells the worker setup hook's variable as Ray does (spares depend on it)."""
    from ray._private import ray_constants

    from petatrain import constants

    assert constants.WORKER_SETUP_HOOK_ENV == ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR


def test_private_ray_imports_live_only_in_the_ray_corner():
    """Only runtime/_ray/ imports Ray's private modules (spares names them as strings to pre-import)."""
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src" / "petatrain"
    private = ("ray._private", "ray._raylet", "ray.train.v2._internal", "ray.core.generated")
    offenders = []
    for file in src.rglob("*.py"):
        if "_ray" in file.relative_to(src).parts:
            continue
        for number, line in enumerate(file.read_text().splitlines(), 1):
            code = line.split("#", 1)[0].strip()
            if code.startswith(("import ", "from ")) and any(p in code for p in private):
                offenders.append(f"{file.relative_to(src)}:{number}: {code}")
    assert not offenders, "\n".join(offenders)


def test_the_lean_trainer_is_in_use():
    """With every name above in place the lean trainer (not Ray's stock one) runs attempts."""
    from petatrain.runtime.startup.lean import trainer_class

    assert trainer_class().__name__ == "LeanTorchTrainer"


def test_ray_trains_errors_become_typed_rank_errors():
    """fit()'s WorkerGroupError -> one RankError per failing rank, its cause from the exception's type."""
    import pickle

    from ray.exceptions import ActorDiedError
    from ray.train import WorkerGroupError
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError, WorkerHealthCheckTimeoutError

    from petatrain.errors import ConfigError
    from petatrain.runtime._ray.errors import attempt_failed
    from petatrain.runtime.failures import FailureCause, Preempted, RankErrorKind, classify

    died = WorkerHealthCheckFailedError("A worker health check failed.\nWorker info: rank 1", ActorDiedError())
    error = WorkerGroupError(
        "[Rank 0 Error Snippet]: ...",
        {
            2: WorkerHealthCheckTimeoutError("A worker health check has been hanging"),
            1: died,
            0: Preempted("preemption notice: checkpoint of step 7 committed, exiting"),
            3: ConfigError("model.seq_len too long"),
        },
    )
    failed = pickle.loads(pickle.dumps(attempt_failed(error)))
    assert [(e.rank, e.kind) for e in failed.errors] == [
        (0, RankErrorKind.RAISED),
        (1, RankErrorKind.DIED),
        (2, RankErrorKind.UNRESPONSIVE),
        (3, RankErrorKind.RAISED),
    ]
    assert [e.cause for e in failed.errors] == [FailureCause.PREEMPT, None, None, FailureCause.ERROR]
    assert failed.errors[0].summary == (
        "petatrain.train.rank.Preempted: preemption notice: checkpoint of step 7 committed, exiting"
    )
    assert classify(failed, hang=None, nodes_lost=False).cause is FailureCause.PREEMPT
    killed = attempt_failed(WorkerGroupError("...", {1: died}))
    failure = classify(killed, hang=None, nodes_lost=False)
    assert (failure.cause, failure.rank, failure.detail) == (
        "kill",
        1,
        "worker process died: A worker health check failed.",
    )
