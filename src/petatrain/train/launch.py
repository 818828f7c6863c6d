"""The driver: launches attempts with Ray Train's TorchTrainer and recovers from every fault.

An explicit supervisor (as in Ray Train v2's controller) around `TorchTrainer.fit()`:
each attempt runs the worker loop on N workers (N chosen from `parallel.workers` and what
the cluster has alive, so a lost node shrinks the next attempt), a watchdog thread reads
the step heartbeats and kills a hung worker group after `faults.hang_timeout_s`, and every
failure is classified, written to the ledger and answered by `RestartPolicy`: retry from
the newest verified checkpoint, or give up after `faults.max_restarts`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from petatrain.chaos.inject import Injection
from petatrain.config import JobConfig
from petatrain.errors import ConfigError, PetatrainError
from petatrain.runtime import spares
from petatrain.storage import StorageOptions, join
from petatrain.storage.fs import atomic_write, is_local, resolve
from petatrain.train import run_dir

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class TrainJob:
    config: JobConfig
    run_url: str
    options: StorageOptions | None = None
    address: str = ""
    injections: list[Injection] = field(default_factory=list)
    on_event: Callable[[dict[str, Any]], None] | None = None  # progress for the CLI
    local_cpus: int = 0
    stop_after_s: float | None = None  # end the run (checkpointed, final weights) this long after it started


@dataclass(slots=True)
class Failure:
    """cause: kill | exception | hang | node_lost | preempt | nonfinite | unknown, or error (a petatrain
    error: bad config, missing or corrupt data; reported, not retried)."""

    cause: str
    detail: str
    rank: int | None = None


class RestartPolicy:
    """Decides what a failure leads to: "retry" or "raise". Preemptions do not use up the budget."""

    def __init__(self, max_restarts: int):
        self.max_restarts = max_restarts
        self.used = 0

    def decide(self, failure: Failure) -> str:
        if failure.cause == "preempt":
            return "retry"
        if failure.cause == "error":
            return "raise"
        self.used += 1
        return "retry" if self.used <= self.max_restarts else "raise"


# What a surviving rank raises when a peer's process is gone in the middle of a collective.
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "remote process exited")


def classify(error: BaseException, *, hang: Failure | None, nodes_lost: bool, died: int | None = None) -> Failure:
    """The cause of a failed attempt, from the watchdog's verdict and Ray Train's error.

    `died`: the rank whose process Ray saw die on its own during the attempt (`_rank_died`),
    when Ray Train's error names only the ranks that survived it.
    """
    if hang is not None:
        return hang
    text = str(error)
    rank = None
    for line in text.splitlines():
        if line.startswith("[Rank ") and "Error" in line:
            with contextlib.suppress(IndexError, ValueError):
                rank = int(line.split()[1].rstrip("]"))
            break
    first = next((ln for ln in reversed(text.splitlines()) if ln.strip() and not ln.startswith(" ")), text)[:300]
    if "Preempted" in text:
        return Failure("preempt", first, rank)
    if "NonFiniteLoss" in text:
        return Failure("nonfinite", first, rank)
    if nodes_lost:
        return Failure("node_lost", first, rank)
    if "health check failed" in text or "ActorDiedError" in text or "actor died" in text.lower():
        rank = _dead_rank(text, rank)
        return Failure("kill", "worker process died: " + first, rank)
    if died is not None:
        return Failure("kill", f"worker process of rank {died} died: " + first, died)
    if "petatrain.errors." in text:  # bad config, missing or corrupt data: a retry would fail the same way
        return Failure("error", first, rank)
    if "Traceback" in text:
        return Failure("exception", first, rank)
    return Failure("unknown", first, rank)


def _dead_rank(text: str, default: int | None) -> int | None:
    """The rank whose snippet says its health check failed (the one that died)."""
    current = None
    for line in text.splitlines():
        if line.startswith("[Rank "):
            try:
                current = int(line.split()[1].rstrip("]"))
            except (IndexError, ValueError):
                current = None
        elif "health check failed" in line and current is not None:
            return current
    return default


def choose_world(cfg: JobConfig, cpus: float, gpus: float) -> int:
    """Largest worker count in parallel.workers that the alive cluster can host and that divides the batch."""
    lo, hi = cfg.parallel.worker_range()
    per = cfg.resources.cpus_per_worker
    fit = int(cpus // per) if per else hi
    if _use_gpu(cfg, gpus):
        fit = min(fit, int(gpus))
    for n in range(min(hi, fit), lo - 1, -1):
        if cfg.train.global_batch % n == 0:
            return n
    raise PetatrainError(
        f"the cluster can host {fit} worker(s) of {per} CPU; parallel.workers={cfg.parallel.workers} "
        f"and train.global_batch={cfg.train.global_batch} need at least {lo} (and a count dividing the batch)"
    )


def _use_gpu(cfg: JobConfig, gpus: float) -> bool:
    return cfg.resources.accelerator == "gpu" or (cfg.resources.accelerator == "auto" and gpus >= 1)


def run(job: TrainJob) -> dict[str, Any]:
    """Train to `train.steps`, recovering from faults; returns a summary (also in the ledger)."""
    with contextlib.ExitStack() as held:  # the run directory's lease, let go however the run ends
        return _supervise(job, held)


def _supervise(job: TrainJob, held: contextlib.ExitStack) -> dict[str, Any]:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from petatrain.runtime.cluster import init_ray
    from petatrain.train.hub import RunHub

    cfg = job.config
    if cfg.parallel.strategy not in ("ddp", "fsdp"):
        raise ConfigError(
            f"parallel.strategy {cfg.parallel.strategy!r}: train runs ddp or fsdp "
            f"({cfg.parallel.strategy} is modelled by `petatrain plan` only)"
        )
    if is_local(cfg.data.dataset):  # Ray workers do not share the driver's working directory
        cfg = dataclasses.replace(
            cfg, data=dataclasses.replace(cfg.data, dataset=os.path.abspath(resolve(cfg.data.dataset)[1]))
        )
    _check_dataset(cfg, job.options)
    _controller_mode()  # a bad PETATRAIN_CONTROLLER fails here, before anything starts
    run_url = job.run_url
    if is_local(run_url):
        run_url = os.path.abspath(resolve(run_url)[1])
    # Before anything is written there: someone else's folder, or a run another driver holds, is refused.
    lease = held.enter_context(run_dir.held(run_url, job.options))
    # Faster failure detection than Ray Train's 2 s poll; propagated to the controller and workers.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    # Preemption notices reach the loop as SIGTERM (PreemptionNotice); Ray Train's drain
    # watcher is one more actor process per attempt that nothing here reads.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    init_ray(job.address or cfg.resources.address, job.local_cpus)
    atomic_write(join(run_url, "config.yaml"), cfg.to_yaml().encode(), job.options)
    run_id = uuid.uuid4().hex[:8]
    # The hub lives on the driver's node, so its metrics endpoint is on this machine's 127.0.0.1.
    node = ray.get_runtime_context().get_node_id()
    hub = RunHub.options(
        name=f"petatrain-hub-{run_id}",
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
    ).remote(run_url, _for_workers(job.options), cfg.observe.metrics_host, cfg.observe.metrics_port)
    started = time.time()

    def emit(event: str, **fields: Any) -> dict[str, Any]:
        record = ray.get(hub.emit.remote(event, fields))
        if job.on_event:
            job.on_event(record)
        return record

    lo, hi = cfg.parallel.worker_range()
    metrics = ray.get(hub.metrics_url.remote())
    if metrics:
        log.info("metrics: %s", metrics)
    emit(
        "run_start",
        run_id=run_id,
        workers=[lo, hi],
        steps=cfg.train.steps,
        metrics=metrics,
        config=cfg.to_dict(),
        t=started,
    )
    policy = RestartPolicy(cfg.faults.max_restarts)
    attempt, failures = 0, []

    def build(attempt: int, world: int):
        payload = _payload(job, cfg, run_url, hub, attempt, started)
        return _make_trainer(cfg, payload, world, run_id, attempt, job)

    standby = _Standby(build, enabled=cfg.faults.standby)
    watch = _Watchdog(hub, cfg.faults.hang_timeout_s, on_training=standby.prepare)
    try:
        while True:
            # Totals of the alive nodes: the failed attempt's workers are still being released.
            resources = ray.cluster_resources()
            world = choose_world(cfg, resources.get("CPU", 0), resources.get("GPU", 0))
            nodes_before = _alive_nodes()
            lease.check()  # a driver that stalled past its lease must not start writing beside the new holder
            trainer = standby.take(attempt, world)
            warm = trainer is not None
            trainer = trainer or build(attempt, world)
            ray.get(hub.new_attempt.remote(attempt))
            emit(
                "attempt_start",
                attempt=attempt,
                world_size=world,
                controller="driver" if getattr(trainer, "controller_in_driver", False) else "actor",
                warm_controller=warm,
            )
            error = _fit(trainer, attempt, world, watch)
            if error is None:
                break
            failure = classify(error, hang=watch.verdict, nodes_lost=_nodes_lost(nodes_before, error))
            if failure.cause in ("exception", "unknown"):  # or a rank died, and a survivor's error came first
                try:
                    beats = ray.get(hub.heartbeats.remote(), timeout=5)
                except Exception:  # a hub that does not answer: the error's own cause stands
                    beats = {}
                died = _rank_died(beats, error)
                if died is not None:
                    failure = classify(error, hang=None, nodes_lost=False, died=died)
            failures.append(failure)
            emit("failure", attempt=attempt, cause=failure.cause, detail=failure.detail, rank=failure.rank)
            if policy.decide(failure) == "raise":
                why = failure.detail if failure.cause == "error" else f"gave up after {policy.used - 1} restarts"
                emit("end", status="failed", step=None, detail=why)
                if failure.cause == "error":
                    raise PetatrainError(failure.detail.split(": ", 1)[-1])
                raise PetatrainError(
                    f"training failed {policy.used} times (faults.max_restarts={cfg.faults.max_restarts}); "
                    f"last cause: {failure.cause}: {failure.detail}"
                )
            attempt += 1
            if failure.cause == "node_lost":
                time.sleep(1.0)  # let the cluster's view of resources settle
            emit("restart", attempt=attempt, world_size=None, reason=failure.cause)
        final = join(run_url, "final", "model.safetensors")
        reached = max((b["step"] for b in ray.get(hub.heartbeats.remote()).values()), default=cfg.train.steps)
        detail = "" if reached >= cfg.train.steps else f"stopped at step {reached}: the time limit was reached"
        emit("end", status="ok", step=reached, detail=detail, final=final)
        return {
            "run": run_url,
            "final": final,
            "steps": reached,
            "attempts": attempt + 1,
            "failures": [{"cause": f.cause, "detail": f.detail, "rank": f.rank} for f in failures],
            "wall_s": time.time() - started,
        }
    finally:
        watch.stop()
        standby.discard()
        try:
            ray.get(hub.close.remote())
            ray.kill(hub)
        except Exception:  # the ledger was flushed on every event; closing is best effort
            log.debug("hub close failed", exc_info=True)


def _check_dataset(cfg: JobConfig, options: StorageOptions | None) -> None:
    from petatrain.storage.fs import exists

    if not exists(join(cfg.data.dataset, "_index", "manifest.json"), options):
        raise PetatrainError(
            f"no dataset at {cfg.data.dataset} (data.dataset); `petatrain demo` builds the demo dataset, "
            "`petatrain ingest SOURCES --out URL --tokenizer bytes --pack-length N` builds yours"
        )


def _payload(job, cfg, run_url, hub, attempt, started):
    from petatrain.train.loop import Payload

    return Payload(
        config=cfg.to_dict(),
        run_url=run_url,
        options=_for_workers(job.options),
        hub=hub,
        attempt=attempt,
        run_started=started,
        injections=list(job.injections),  # the workers leave out those that fired already
        stop_at=started + job.stop_after_s if job.stop_after_s else None,
    )


def _for_workers(options: StorageOptions | None) -> StorageOptions:
    """Options for Ray processes: they may have started before the driver's AWS_* variables were set."""
    return (options or StorageOptions()).for_workers()


def _entry(config: dict[str, Any]) -> None:
    from petatrain.runtime.worker import RankEnv
    from petatrain.train.loop import train_worker

    payload = config["payload"]
    train_worker(payload, RankEnv.from_ray(payload.hub, payload.attempt))


def _make_trainer(cfg, payload, world: int, run_id: str, attempt: int, job: TrainJob):
    """The TorchTrainer of one attempt: N workers, gloo or NCCL, no retries of its own."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    gpu = _use_gpu(cfg, ray.cluster_resources().get("GPU", 0))
    resources = {"CPU": cfg.resources.cpus_per_worker} | ({"GPU": 1} if gpu else {})
    storage = os.path.join(os.path.expanduser("~"), ".cache", "petatrain", "ray-train")
    local = not (job.address or cfg.resources.address or os.environ.get("RAY_ADDRESS"))
    trainer = _trainer_class(local=local, controller=_controller_mode())(
        _entry,
        train_loop_config={"payload": payload},
        torch_config=TorchConfig(
            backend="nccl" if gpu else "gloo", timeout_s=int(max(60, 3 * cfg.faults.hang_timeout_s))
        ),
        scaling_config=ScalingConfig(num_workers=world, use_gpu=gpu, resources_per_worker=resources),
        run_config=RunConfig(
            name=f"petatrain-{run_id}-attempt{attempt}",
            storage_path=storage,
            failure_config=FailureConfig(max_failures=0),  # the supervisor decides, not Ray Train
            worker_runtime_env=spares.worker_runtime_env(cfg.resources.cpus_per_worker) if spares.wanted(cfg) else None,
        ),
    )
    trainer.drain = (payload.hub, attempt)  # a failure lets rank 0 finish its checkpoint write (CommitDrain)
    return trainer


def _controller_mode() -> str:
    """Where Ray Train's controller runs: "driver" (the default) or "actor" (PETATRAIN_CONTROLLER)."""
    mode = os.environ.get("PETATRAIN_CONTROLLER", "driver")
    if mode not in ("driver", "actor"):
        raise ConfigError(f"PETATRAIN_CONTROLLER={mode!r}: driver (the default) or actor")
    return mode


def _fit(trainer, attempt: int, world: int, watch: _Watchdog) -> BaseException | None:
    """One attempt; returns its error or None. The watchdog runs while it trains."""
    watch.start(attempt, world)
    try:
        trainer.fit()
        return None
    except Exception as exc:
        _remove_leftover_placement_groups()
        return exc
    finally:
        watch.pause()


class _Standby:
    """The next attempt's trainer, its Ray Train controller started while this attempt trains.

    A restart used to begin by starting a controller process (Python, Ray, Ray Train and
    torch imports: ~2 s of a ~7.5 s restart on 2 cores) before any worker could start. Once
    an attempt has made its first step, the watchdog asks for the next attempt's controller;
    it waits, idle, until a failure needs it (or the run ends and it is discarded). It is
    used only for the attempt number and world size it was built for: after a lost node the
    next attempt builds a controller for the workers that are left. Its start-up takes
    ~2 s of CPU: free where the driver's node has a core to spare; on a machine whose every
    core trains (2 cores, 2 workers) it slows the attempt's steps by ~1.1-1.7 s, against ~2.8 s
    it saves the restart (benchmarks/recovery.py). `faults.standby: false` turns it off.
    With Ray Train's controller run by the driver (the default, `_trainer_class`) there is
    no controller process to start, and nothing is prepared: the standby acts only where the
    controller is an actor (a Ray Client driver, `PETATRAIN_CONTROLLER=actor`).
    """

    def __init__(self, build: Callable[[int, int], Any], *, enabled: bool = True):
        self._build, self.enabled = build, enabled
        self._lock = threading.Lock()
        self._next: tuple[int, int, Any] | None = None  # (attempt, world size, prepared trainer)

    def prepare(self, attempt: int, world: int) -> None:
        """Called once `attempt` (on `world` workers) trains: start attempt + 1's controller."""
        with self._lock:
            self._discard()
            if not self.enabled:
                return
            trainer = self._build(attempt + 1, world)
            # The stock TorchTrainer (Ray's internals moved) starts on fit(); a driver's controller has no process.
            if hasattr(trainer, "prepare") and trainer.prepare():
                self._next = (attempt + 1, world, trainer)

    def take(self, attempt: int, world: int):
        """The prepared trainer for this attempt and world size, or None (a fresh one is needed)."""
        with self._lock:
            if self._next is not None and self._next[:2] == (attempt, world):
                trainer, self._next = self._next[2], None
                return trainer
            self._discard()
            return None

    def discard(self) -> None:
        with self._lock:
            self._discard()

    def _discard(self) -> None:
        if self._next is not None:
            self._next[2].discard()
            self._next = None


@functools.cache
def _trainer_class(local: bool = False, controller: str = "driver"):
    """TorchTrainer without the per-attempt helper actors petatrain does not use.

    Each attempt is a new `fit()`, and every helper actor is one more Python process that
    imports Ray Train while the workers start: Ray Data's dataset manager (training reads
    the petatrain loader, not `datasets=`) and the placement-group cleaner (for a
    controller that dies: `_remove_leftover_placement_groups` does that job between
    attempts). Measured on 2 cores: 8.9 -> 6.7 s from `fit()` to a trivial train
    function's return. `prepare()` starts the controller ahead of `fit()` (`_Standby`).
    On the local Ray that `petatrain train` starts itself (`local`),
    the scaling policy also leaves out its resource requests to the cluster autoscaler's
    coordinator: there is no autoscaler, and the coordinator is one more Ray process
    (importing Ray Data) on the first attempt's path, 7.4 -> 6.1 s, that then takes
    CPU from training for the whole run. The controller starts its worker groups'
    synchronization actor only if something calls it (`petatrain.train.controller`).
    With `controller="driver"` (the default; `PETATRAIN_CONTROLLER=actor` chooses the
    actor) the controller is an object of the driver, its loop run on the thread that
    calls `fit()` (`DriverController`): no controller process to start on every attempt's
    path (kill -> recovered 8.6-9.8 -> 5.9-6.1 s for examples/tiny.yaml on 2 cores) nor to
    idle beside the workers for the whole run (control plane 0.067 -> 0.056 cores). Where
    it is an actor (also under a Ray Client driver), a finished controller is killed rather
    than left to exit gracefully. Falls back to the stock trainer (or controller) if Ray's
    internals move.
    """
    import ray
    from ray.train.torch import TorchTrainer

    try:
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
        from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
        from ray.train.v2._internal.constants import (
            DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
            RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR,
            get_env_vars_to_propagate,
        )
        from ray.train.v2._internal.execution.controller import TrainController
        from ray.train.v2._internal.execution.scaling_policy import FixedScalingPolicy

        from petatrain.train import controller as lean
    except ImportError:
        return TorchTrainer
    needed = ("_create_default_callbacks", "_initialize_and_run_controller", "_register_sigint_handler")
    if not all(hasattr(TorchTrainer, name) for name in needed):
        return TorchTrainer
    on_demand = hasattr(lean.group_module, "SynchronizationActor") and hasattr(lean.group_state, "_shutdown_sync_actor")
    controller_class = lean.LeanTrainController if on_demand else TrainController
    in_driver = controller == "driver" and on_demand and lean.can_run_in_driver()

    def _new_controller(kwargs):
        """The controller: the driver's object (`run_here()` runs it), or the actor as
        `DataParallelTrainer._initialize_and_run_controller` creates it (`run.remote()`)."""
        if in_driver:
            return lean.DriverController(**kwargs)
        env_vars = get_env_vars_to_propagate()
        env_vars.setdefault(
            RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR, DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE
        )
        return ray.remote(
            num_cpus=0,
            label_selector={ray._raylet.RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()},
            runtime_env={"env_vars": env_vars},
        )(controller_class).remote(**kwargs)

    unused = (DatasetsCallback, PlacementGroupCleanerCallback)

    class NoAutoscalerPolicy(FixedScalingPolicy):
        """A fixed worker count on a cluster without an autoscaler: nothing to request."""

        def _maybe_send_resource_request(self):
            pass

        def _send_resource_request(self):
            pass

        def after_controller_start(self, train_run_context):
            pass

        async def before_controller_shutdown(self):
            pass

        def before_controller_abort(self):
            pass

    class LeanTorchTrainer(TorchTrainer):
        _standby = None  # a controller actor started by prepare(), run by the next fit()
        drain = None  # (hub, attempt) for CommitDrain
        _preparing = False
        controller_in_driver = in_driver
        _start_controller = staticmethod(_new_controller)

        def prepare(self) -> bool:
            """Start this trainer's controller now (its process imports in the background); fit() runs it.

            False when there is nothing to start ahead: a controller run by the driver has no process.
            """
            if self.controller_in_driver:
                return False
            self._preparing = True
            try:
                self.fit()
            finally:
                self._preparing = False
            return True

        def discard(self) -> None:
            if self._standby is not None:
                with contextlib.suppress(Exception):
                    ray.kill(self._standby)
                self._standby = None

        def _create_default_callbacks(self):
            callbacks = [c for c in super()._create_default_callbacks() if not isinstance(c, unused)]
            if self.drain is not None:  # first: before the backend's shutdown destroys the process groups
                callbacks.insert(0, lean.CommitDrain(*self.drain))
            return callbacks

        def _initialize_and_run_controller(self, **kwargs):
            if local and type(kwargs.get("scaling_policy")) is FixedScalingPolicy:
                kwargs["scaling_policy"] = NoAutoscalerPolicy(self.scaling_config)
            if self.controller_in_driver:
                return self._start_controller(kwargs).run_here()
            if self._preparing:
                self._standby = self._start_controller(kwargs)
                return _NOT_RUN
            controller, self._standby = self._standby, None
            if controller is None:
                controller = self._start_controller(kwargs)
            main, interrupt = threading.current_thread() is threading.main_thread(), signal.getsignal(signal.SIGINT)
            if main:
                # Ray Train's handler aborts this controller; it is put back once the attempt ends,
                # or a Ctrl-C after it would call a killed controller and exit with status 0.
                self._register_sigint_handler(controller)
            try:
                ray.get(controller.run.remote())
                result = ray.get(controller.get_result.remote())
            finally:
                if main:
                    signal.signal(signal.SIGINT, interrupt)
            # Dropping the handle would let the finished controller exit gracefully, and a Ray
            # worker's graceful exit imports ray.dag (~0.9 s of CPU), just when the next
            # attempt's workers start. Its work is done: end it at once.
            ray.kill(controller)
            return result

    return LeanTorchTrainer


class _NotRun:
    """What `fit()` returns when `prepare()` only started the controller."""

    error = None


_NOT_RUN = _NotRun()


def _remove_leftover_placement_groups() -> None:
    """Remove this job's placement groups a failed attempt left behind (its controller died
    before releasing them), so the next attempt's workers can be scheduled."""
    import ray
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    job = ray.get_runtime_context().get_job_id()
    for pg_id, info in placement_group_table().items():
        if pg_id.endswith(job) and info.get("state") in ("CREATED", "PENDING", "RESCHEDULING"):
            log.warning("removing placement group %s left by the failed attempt", pg_id)
            with contextlib.suppress(Exception):
                remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))


class _Watchdog:
    """Declares a hang when no rank has made step progress for `timeout_s`, and kills the group.

    Killing the stuck processes (SIGKILL through a task on their node) turns a hang into a
    worker death that Ray Train reports at once, instead of a collective that waits for
    its timeout. Until the first step the allowance is three times longer (start-up, resume).
    Once an attempt has stepped, `on_training(attempt, world_size)` is called (once). It
    waits on the hub's long poll (`RunHub.watch`), which answers when one of these is due.
    """

    WAIT_S = 10.0  # the longest the hub holds a watch() call

    def __init__(self, hub: Any, timeout_s: float, on_training: Callable[[int, int], None] | None = None):
        self.hub, self.timeout_s, self.on_training = hub, timeout_s, on_training
        self.verdict: Failure | None = None
        self._attempt, self._world, self._announced = -1, 0, True
        self._active = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="petatrain-watchdog", daemon=True)
        self._thread.start()

    def start(self, attempt: int, world: int = 0) -> None:
        self.verdict, self._attempt, self._world = None, attempt, world
        self._announced = self.on_training is None
        self._active.set()

    def pause(self) -> None:
        self._active.clear()

    def stop(self) -> None:
        self._stop.set()
        self._active.set()

    def _run(self) -> None:
        import ray

        while not self._stop.is_set():
            self._active.wait()
            attempt, announced = self._attempt, self._announced
            if self._stop.is_set() or self.verdict is not None:  # a hung attempt ends: wait for the next
                self._stop.wait(0.5)
                continue
            try:  # returns when there is something to act on (the hub's long poll), or after WAIT_S
                call = self.hub.watch.remote(attempt, self.timeout_s, announced, self.WAIT_S)
                seen = ray.get(call, timeout=self.WAIT_S + 5)
            except Exception:
                self._stop.wait(0.5)
                continue
            if not self._active.is_set() or attempt != self._attempt:
                continue
            beats = seen["beats"]
            if seen["stale_s"] is not None:
                stale = min(beats.items(), key=lambda kv: (kv[1]["step"], kv[1]["t"]))
                self.verdict = Failure(
                    "hang",
                    f"no step progress for {seen['stale_s']:.1f}s (faults.hang_timeout_s={self.timeout_s:g}); "
                    f"rank {stale[0]} last at step {stale[1]['step']}",
                    stale[0],
                )
                _kill_group(beats)
            elif seen["stepped"] and not self._announced:
                self._announced = True
                try:
                    self.on_training(self._attempt, self._world)
                except Exception:  # a standby is an optimisation: the next attempt starts cold
                    log.warning("preparing the next attempt failed", exc_info=True)


def _kill_group(beats: dict[int, dict[str, Any]]) -> None:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    refs = [
        ray.remote(num_cpus=0)(_kill_pid)
        .options(scheduling_strategy=NodeAffinitySchedulingStrategy(b["node_id"], soft=False))
        .remote(b["pid"])
        for b in beats.values()
    ]
    ray.wait(refs, num_returns=len(refs), timeout=10)


def _rank_died(beats: dict[int, dict[str, Any]], error: BaseException, wait_s: float = 2.0) -> int | None:
    """The rank whose worker process died on its own (SIGKILL, the OOM killer, a crash), if the error hides it.

    Ray Train fails an attempt at the first poll of its workers that shows an error. When a
    rank's process dies, its peers' collective fails at once (the socket closes), and that
    error can reach a poll before the dead rank's failed health check does: the error then
    names only a survivor's `RuntimeError`, and the fault would be counted as an exception.
    GCS's actor table tells the two apart: the dead rank's actor died of its process's exit
    (a system error), the survivors' of Ray Train's `ray.kill`. Asked only when `classify`
    found an exception and the error is a lost peer; GCS may learn of the death a moment later.
    """
    import ray
    import ray._private.state as ray_state

    text = str(error)
    if not any(marker in text for marker in PEER_LOST):
        return None
    ranks = {(b["pid"], b["node_id"]): rank for rank, b in beats.items()}
    job = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
    deadline = time.monotonic() + wait_s
    while True:
        try:
            dead = ray_state.actors(job_id=job, actor_state_name="DEAD").values()
        except Exception:  # without GCS's answer the error's own cause stands
            return None
        for actor in dead:
            rank = ranks.get((actor.get("Pid"), actor.get("Address", {}).get("NodeID")))
            if rank is not None and "worker process has died" in str(actor.get("DeathCause", "")):
                return rank
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.2)


def _nodes_lost(before: set[str], error: BaseException) -> bool:
    """Whether a node of the cluster died during the attempt (Ray marks it dead before the
    worker health check that fails the attempt, both from the same missed heartbeats)."""
    return bool(before - _alive_nodes())


def _alive_nodes() -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def _kill_pid(pid: int) -> None:
    """Dump the stuck worker's stacks to its log (faulthandler on SIGUSR1), then kill it."""
    import signal

    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGUSR1)
        time.sleep(0.1)  # faulthandler writes from its C signal handler, at once (a stopped process: on SIGKILL, never)
        os.kill(pid, signal.SIGKILL)
