"""The worker loop that Ray Train runs on every rank (what it needs from Ray: train/rank.py's `RankEnv`).

Reads top down: `train_worker` sets up (arithmetic, model and strategy, optimizer, data, the
checkpoint writer), resumes from the newest verified checkpoint and runs `_train`, the step
loop: gradient accumulation over micro-batches, one all-reduce of the step's decisions (loss,
preemption, checkpoint due, halt, resize), clip, optimizer step, telemetry, injected faults
(`chaos.inject.RankFaults`), asynchronous checkpoint, evaluation. The recipe (optimizer,
schedule, micro-batching, checkpoint interval) is `train.recipe`'s; the parallelism is the
strategy's (`train.strategies`, through `train.parallel`).
"""

from __future__ import annotations

import faulthandler
import functools
import logging
import math
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from petatrain import config as config_mod
from petatrain.chaos import inject
from petatrain.config import JobConfig
from petatrain.errors import CorruptDataError, PetatrainError
from petatrain.models import ModelSpec, build_model
from petatrain.observe import events as ev
from petatrain.storage import StorageOptions
from petatrain.train import checkpoint as ckpt
from petatrain.train import recipe, strategies, trace
from petatrain.train.batches import TokenBatches
from petatrain.train.parallel import load_into, read_for_resume, state_for_save, step_runner
from petatrain.train.rank import HubChannel, NextRanks, Preempted, PreemptionNotice, RankEnv, Resized, Telemetry

log = logging.getLogger(__name__)


class NonFiniteLoss(PetatrainError):
    """Raised when the loss is NaN/inf and faults.nonfinite is rollback."""


@dataclass(slots=True)
class Payload:
    """What the driver hands every worker (plain data: it crosses process boundaries)."""

    config: dict[str, Any]
    run_url: str
    options: StorageOptions | None
    hub: Any  # RunHub actor handle
    attempt: int
    run_started: float
    injections: list[inject.Injection]
    stop_at: float | None = None  # unix time: stop at the first step boundary after it (soak windows, TrainJob.stop)
    # Wait after each evaluation until the driver's owner has taken it (a search's trial: Tune may
    # stop the trial there, or PBT replace its state), so the run never trains past a decision.
    hold_at_eval: bool = False
    # `train --continue`: the checkpoint of this step holds a position in an earlier version of the
    # dataset, carried onto the run's version (data.replay) whenever the run resumes from it.
    carry_step: int | None = None


@dataclass(slots=True)
class Rank:
    """One rank's training state: what the steps of the loop share."""

    cfg: JobConfig
    payload: Payload
    rank: int
    world: int
    device: torch.device
    spec: ModelSpec
    model: nn.Module
    optimizer: torch.optim.Optimizer
    data: TokenBatches
    steps: Any  # train.steps.MicroBatches or PipelineSteps: how a step runs here
    amp: Any  # the forward's autocast context (or none)
    telemetry: Telemetry
    writer: ckpt.CheckpointWriter
    buffers: ckpt.HostBuffers
    digest: str  # of the resolved config, in every checkpoint


def train_worker(payload: Payload, env: RankEnv) -> None:
    """Entry point of one rank; `env` is what Ray Train gave it (runtime.worker.RankEnv.from_ray)."""
    cfg = config_mod.build(JobConfig, payload.config)
    hub = env.hub
    next_ranks = env.next_ranks(cfg)
    preemption = env.preemption_notice()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the watchdog asks for stacks before a kill
    hub.emit(
        ev.WorkerStart(
            attempt=hub.attempt,
            rank=env.rank,
            pid=os.getpid(),
            node=env.node_id,
            warm_up=env.warm_up(),
            torch_threads=torch.get_num_threads(),
            placement_group=env.placement_group,
        )
    )
    hub.beat(-1)

    faults = ckpt.StorageFaults()  # armed by injected `storage` faults
    r = _set_up(cfg, payload, env, faults)
    start = _resume(r, hub)
    chaos = inject.RankFaults(
        payload.injections,
        rank=env.rank,
        fired=hub.fired_keys() if payload.injections else set(),
        claim=hub.fire,
        arm_storage=faults.arm,
        await_notice=lambda: preemption.wait(timeout_s=2.0),
        before_firing=r.telemetry.flush,
    )
    try:
        step = _train(r, start, preemption, chaos, next_ranks)
        r.writer.wait()
        r.writer.raise_if_broken()
        _evaluate(r, step)
        r.telemetry.flush(wait=True)
        _save_final(r.steps, payload, r.rank, step)
    finally:
        r.writer.close()
        r.telemetry.flush()  # the commit of a write that finished while the attempt failed


def _set_up(cfg: JobConfig, payload: Payload, env: RankEnv, faults: ckpt.StorageFaults) -> Rank:
    """Arithmetic, model wrapped by its strategy, optimizer, data, telemetry and checkpoint writer."""
    device = env.device(cfg.resources.accelerator)
    _set_arithmetic(cfg, device)
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    spec = _build_model(cfg)
    strategy = strategies.of(cfg)
    data_rank, data_world, micro = strategy.data_shard(cfg, env.rank, env.world)
    steps = step_runner(spec, cfg, device, env.world)
    model = steps.model
    optimizer = recipe.build_optimizer(model, cfg.train)
    torch.manual_seed(cfg.train.seed * 1000 + strategy.rng_rank(cfg, env.rank) + 1)  # per-rank stream (dropout)
    data = TokenBatches(cfg, rank=data_rank, world=data_world, micro=micro, options=payload.options)
    # Events go to the hub once a second (an actor call per step costs a measurable share of the
    # step rate on a few CPU cores). A rank killed with events still buffered leaves up to a second
    # of steps out of the ledger, so around another rank's injected fault every step is sent at once.
    telemetry = env.hub.telemetry(period_s=1.0)
    writer = ckpt.CheckpointWriter(
        payload.run_url,
        payload.options,
        report_part=env.hub.report_part,
        wait_parts=env.hub.wait_parts,
        on_commit=telemetry.commit,
        keep_last=cfg.checkpoint.keep_last,
        keep_every=cfg.checkpoint.keep_every,
        faults=faults,
        keepalive=telemetry.alive,
        keepalive_s=telemetry.period_s,
    )
    return Rank(
        cfg=cfg,
        payload=payload,
        rank=env.rank,
        world=env.world,
        device=device,
        spec=spec,
        model=model,
        optimizer=optimizer,
        data=data,
        steps=steps,
        amp=recipe.autocast(cfg.train, device),
        telemetry=telemetry,
        writer=writer,
        buffers=snapshot_buffers(cfg),
        digest=_digest(cfg),
    )


def snapshot_buffers(cfg: JobConfig) -> ckpt.HostBuffers:
    """The buffers a rank's snapshots are copied into for the whole run: on a GPU staged on the
    device where it has room, unless checkpoint.staging is "copy" (host buffers only)."""
    return ckpt.HostBuffers(device_staging=cfg.checkpoint.staging != "copy")


def _build_model(cfg: JobConfig) -> ModelSpec:
    """The configured model, its forward compiled when train.compile says so. In place
    (`nn.Module.compile`), not `torch.compile(module)`: that wrapper would prefix every parameter
    name with `_orig_mod.`, and checkpoints, resume and serve name parameters as the model does."""
    spec = build_model(cfg.model, cfg.train)
    if cfg.train.compile:
        spec.module.compile()
    return spec


def _set_arithmetic(cfg: JobConfig, device: torch.device) -> None:
    """Deterministic kernels and denormal handling: the same on every rank and attempt."""
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
        if device.type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.backends.cudnn.benchmark = False
    torch.set_flush_denormal(cfg.train.flush_denormal)  # CPU arithmetic


def _resume(r: Rank, hub: HubChannel) -> int:
    """Load the newest checkpoint every rank verified (model, optimizer, loader, RNG); the step to start from."""
    state, shards = _restore_point(r.payload, r.model, r.rank, r.world, r.cfg, hub)
    start = 0
    if state is not None:
        load_into(r.model, r.optimizer, state, shards, rank=r.rank, cfg=r.cfg)
        carry = r.payload.carry_step is not None and state.step == r.payload.carry_step
        r.data.load_state_dict(state.loader, carry_replay=r.cfg.data.replay if carry else None)
        rng = shards.get(r.rank, {}).get("rng/cpu")
        if rng is not None and state.world_size == r.world:
            torch.set_rng_state(rng)
        start = state.step
    if r.rank == 0:
        checkpoint = ckpt.step_dir(r.payload.run_url, start) if state else None
        hub.emit(ev.Resume(attempt=hub.attempt, step=start, checkpoint=checkpoint))
    return start


def _train(r: Rank, start: int, preemption: PreemptionNotice, chaos: inject.RankFaults, next_ranks: NextRanks) -> int:
    """The step loop from `start` to train.steps (or a halt); returns the last step. Raises
    Preempted once a preemption's checkpoint is settled, NonFiniteLoss for a rollback."""
    cfg, telemetry, writer = r.cfg, r.telemetry, r.writer
    # A synchronous write is all stall already; an asynchronous one on CPU also takes cores from the steps.
    schedule = recipe.CheckpointSchedule(
        cfg, r.world, writer_competes=r.device.type == "cpu" and cfg.checkpoint.asynchronous
    )
    # Live snapshots: forward/backward must not write the weights (the built-in models), or the user says so.
    staging = StagingChoice(
        cfg.checkpoint.staging,
        available=r.device.type == "cpu" and (r.spec.weights_fixed_in_forward or cfg.checkpoint.staging == "live"),
    )
    live_stall: float | None = None  # a live snapshot's stall, until the wait before optimizer.step adds to it
    last_end, wait_mark = time.perf_counter(), r.data.wait_s
    step = last_checkpoint = start
    tracer, next_batch, clip = None, r.data.next, r.steps.clip
    if cfg.observe.profile_at > start:
        steps = min(cfg.observe.profile_steps, cfg.train.steps - cfg.observe.profile_at + 1)  # ends with the run
        tracer = trace.StepTracer(
            cfg.observe.profile_at, steps, rank=r.rank, attempt=telemetry.attempt,
            run_url=r.payload.run_url, options=r.payload.options,
        )  # fmt: skip
        next_batch, clip = trace.spanned("petatrain.data", r.data.next), trace.spanned("petatrain.clip", clip)
    while step < cfg.train.steps:
        if tracer is not None:
            tracer.before(step + 1)
        lr = recipe.set_lr(r.optimizer, step, cfg.train)
        with trace.span("petatrain.forward_backward"):
            loss_sum = r.steps.forward_backward(next_batch, r.amp, poison=chaos.poison_next)
        chaos.poison_next = False
        step += 1
        # One all-reduce per step carries the loss and every decision all ranks must share;
        # it runs while the optimizer steps. Whether to skip the update is decided from the
        # global gradient norm, which every rank already holds after the gradient reduction. On a
        # GPU neither is read before the update (recipe.step_flags, apply_gradients): `read_step`
        # below is the step's one wait for the device.
        due = r.rank == 0 and schedule.due(step)
        halt = r.rank == 0 and (
            (r.payload.stop_at is not None and time.time() >= r.payload.stop_at) or telemetry.stop_requested()
        )
        resize = r.rank == 0 and telemetry.resize_requested() is not None
        decisions = (preemption.received, due, halt, resize)
        with trace.span("petatrain.flags"):
            flags = recipe.step_flags(loss_sum, decisions)
            shared = dist.all_reduce(flags, async_op=True)
        # A live snapshot's tensors are read before the update changes them.
        with trace.span("petatrain.optimizer"):
            norm, staging_wait = recipe.apply_gradients(
                r.model, r.optimizer, cfg.train, before_step=writer.wait_for_staging, clip=clip
            )
        with trace.span("petatrain.flags_wait"):
            shared.wait()
            read, grad_norm = recipe.read_step(flags, norm)  # the step's one host sync
            preempt, checkpoint_due, stop, resize = (read[k] > 0 for k in range(1, 5))
            loss_value = read[0] / r.steps.loss_share
        nonfinite = not math.isfinite(grad_norm)
        if live_stall is not None and not nonfinite:
            staging.observed(True, live_stall + staging_wait)
            live_stall = None
        if nonfinite:
            grad_norm = _on_nonfinite(r, step)
        with trace.span("petatrain.telemetry"):
            if r.rank == 0:
                if staging_wait > 0.0:  # checkpoint stall, not training
                    telemetry.record(
                        ev.CheckpointStaging(attempt=telemetry.attempt, step=last_checkpoint, wait_s=staging_wait)
                    )
                telemetry.record(
                    ev.Step(
                        attempt=telemetry.attempt,
                        step=step,
                        step_s=time.perf_counter() - last_end - staging_wait,
                        data_wait_s=r.data.wait_s - wait_mark,
                        loss=loss_value if not nonfinite and math.isfinite(loss_value) else None,
                        lr=lr,
                        tokens=cfg.train.global_batch * cfg.model.seq_len,
                        grad_norm=grad_norm,
                    )
                )
            elapsed = time.time() - r.payload.run_started
            # Another rank's fault is imminent: the ledger holds every step up to it.
            telemetry.progress(step, now=chaos.imminent_elsewhere(step, elapsed, telemetry.period_s))
            next_ranks.trained()  # the next attempt's processes start while this one trains
        chaos.at_step(step, elapsed)

        if checkpoint_due or preempt or resize or stop or step == cfg.train.steps:
            with trace.span("petatrain.checkpoint"):
                _report_stage(r)
                live = staging.live(refused=writer.live_refused)
                stall = _checkpoint(r, step, schedule, live=live)
            if live:
                live_stall = stall
            else:
                staging.observed(False, stall)
            last_checkpoint = step
        if preempt or resize:
            _leave_for_restart(r, step, preempt=preempt)
        if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < cfg.train.steps:
            with trace.span("petatrain.eval"):
                _evaluate(r, step)
            if r.payload.hold_at_eval:
                _hold(r, step)
        if tracer is not None:
            tracer.after(step)
        last_end, wait_mark = time.perf_counter(), r.data.wait_s
        if stop:
            break
    return step


def _leave_for_restart(r: Rank, step: int, *, preempt: bool) -> NoReturn:
    """Every rank ends the attempt once this step's checkpoint is settled: on a preemption notice, or
    because the driver asked for more workers (the next attempt resumes from it on them)."""
    committed = _leave_together(r.writer, r.telemetry, r.device) == step
    how = f"checkpoint of step {step} " + ("committed" if committed else "failed, resuming from an earlier one")
    if preempt:
        raise Preempted(f"preemption notice: {how}")
    raise Resized(f"the cluster can host more workers: {how}")


def _report_stage(r: Rank) -> None:
    """A pipeline rank's compute since the last checkpoint, for the report's stage table."""
    stage = r.steps.stage_report(r.optimizer)
    if stage is not None:
        r.telemetry.record(ev.PipelineStage(attempt=r.telemetry.attempt, **stage))


def _on_nonfinite(r: Rank, step: int) -> float:
    """The step's update was dropped: record it; roll back (raise) if faults.nonfinite says so; its grad norm."""
    if r.rank == 0:
        r.telemetry.record(ev.NonFinite(attempt=r.telemetry.attempt, step=step, action=r.cfg.faults.nonfinite))
    if r.cfg.faults.nonfinite == "rollback":
        _leave_together(r.writer, r.telemetry, r.device)
        raise NonFiniteLoss(f"non-finite loss at step {step}; rolling back to the last checkpoint")
    return 0.0


def _checkpoint(r: Rank, step: int, schedule: recipe.CheckpointSchedule, *, live: bool) -> float:
    """Hand this step's snapshot to the writer (the live tensors, or host copies); returns the stall."""
    snapshot, stall = _snapshot(
        r.model, r.optimizer, r.data, r.writer, r.buffers, step, r.rank, r.world, r.cfg, r.digest, live=live
    )
    r.writer.raise_if_broken()  # the previous write has finished: a bug in it ends the attempt here
    r.writer.submit(snapshot)
    if not r.cfg.checkpoint.asynchronous:  # the loop waits for the commit: all of it is stall
        stall += r.writer.wait()
    if r.rank == 0:
        r.telemetry.record(ev.CheckpointSnapshot(attempt=r.telemetry.attempt, step=step, stall_s=stall, live=live))
    schedule.taken(stall, r.writer.last_write_s, r.writer.last_write_cpu_s)
    return stall


def _leave_together(writer: ckpt.CheckpointWriter, telemetry: Telemetry, device: torch.device) -> int:
    """Before every rank raises the same error: rank 0's writes are done and the ledger has the
    events; returns the newest step rank 0 committed in this attempt (-1: none).

    Ray Train ends an attempt at the first rank's error and kills the others, so a rank that
    raised once its own checkpoint part was written would cut rank 0's commit short (the
    checkpoint of a preemption lost: tests/test_train_faults.py::test_preemption_waits_for_rank_0_to_commit).
    """
    writer.wait()
    committed = torch.tensor(-1 if writer.committed_step is None else writer.committed_step, device=device)
    dist.broadcast(committed, src=0)
    telemetry.flush(wait=True)
    return int(committed.item())


def _restore_point(
    payload: Payload, model: torch.nn.Module, rank: int, world: int, cfg: JobConfig, hub: HubChannel
) -> tuple[ckpt.CheckpointState | None, dict]:
    """The newest checkpoint every rank can read and verify, and the tensors this rank loads
    from it (`parallel.read_for_resume`: rank file -> tensors); (None, {}) for a fresh start.

    Rank 0 picks the newest committed checkpoint whose state.json and file sizes check out and
    broadcasts its step. Each rank then reads the files it needs, checksummed as they load, so
    no rank reads the whole checkpoint just to choose it. Nothing is loaded until all ranks
    agree: if any rank's file does not verify, all fall back to the previous checkpoint.
    """
    below = None
    while True:
        state = None
        if rank == 0:
            state = ckpt.latest_verified(
                payload.run_url,
                payload.options,
                on_skip=lambda url, why: hub.emit(ev.CheckpointSkipped(attempt=hub.attempt, url=url, reason=why)),
                below=below,
            )
        chosen = torch.tensor([state.step if state else -1], dtype=torch.long)
        dist.broadcast(chosen, src=0)
        step = int(chosen.item())
        if step < 0:
            return None, {}
        problem = None
        try:
            if rank != 0:
                state = ckpt.read_state(payload.run_url, step, payload.options)
            assert state is not None  # rank 0 chose it, the others read it
            shards = read_for_resume(
                state,
                functools.partial(ckpt.read_rank_tensors, payload.run_url, state, options=payload.options),
                model=model,
                rank=rank,
                world=world,
                cfg=cfg,
            )
        except CorruptDataError as exc:
            problem, shards = str(exc), {}
        # The lowest rank that found a problem reports it; world = nobody did.
        first_bad = torch.tensor([rank if problem else world], dtype=torch.long)
        dist.all_reduce(first_bad, op=dist.ReduceOp.MIN)
        if int(first_bad.item()) == world:
            return state, shards
        if problem and int(first_bad.item()) == rank:
            log.warning("skipping checkpoint: %s", problem)
            url = ckpt.step_dir(payload.run_url, step)
            hub.emit(ev.CheckpointSkipped(attempt=hub.attempt, url=url, reason=problem))
        below = step


def _snapshot(
    model, optimizer, data, writer, buffers, step, rank, world, cfg, digest, live=False
) -> tuple[ckpt.Snapshot, float]:
    """Snapshot for the writer: host copies, or with `live` references to the parameters and
    optimizer state (the loop then waits for the writer's staging before `optimizer.step()`).
    Returns it and the stall in seconds (waiting for a previous write still running included)."""
    t0 = time.perf_counter()
    writer.wait()  # the host buffers are free again
    tensors, meta, live_tensors = state_for_save(model, optimizer, rank=rank, cfg=cfg, buffers=buffers, live=live)
    tensors["rng/cpu"] = torch.get_rng_state()
    meta.update(loader=data.state_dict(), strategy=strategies.of(cfg).name, config_digest=digest)
    snap = ckpt.Snapshot(
        step=step,
        rank=rank,
        world_size=world,
        tensors=tensors,
        meta=meta,
        live=live_tensors,
        versions=[t._version for t in live_tensors],
        pending=buffers.pending,
    )
    return snap, time.perf_counter() - t0


class StagingChoice:
    """Whether the next checkpoint is written from the live tensors instead of host copies.

    `checkpoint.staging: copy` always copies, `live` always writes the live tensors; but never
    on GPU (its tensors need a device-to-host copy anyway) and never after a live snapshot
    was seen to change under the writer. `auto` measures both and keeps the cheaper: a copy
    costs its snapshot (a copy of every weight and optimizer state); a live snapshot costs almost
    nothing unless the next step's `optimizer.step()` has to wait for the write to finish
    reading, as it does when writing takes longer than a forward and backward. The first
    checkpoint copies, the second tries live; from then on the cheaper of the last of each,
    with the other retried every `retry_every` checkpoints as conditions change.
    """

    def __init__(self, mode: str, *, available: bool, retry_every: int = 10):
        self.mode, self.available, self.retry_every = mode, available, retry_every
        self.cost: dict[bool, float] = {}  # live? -> stall of the last such checkpoint
        self.taken = 0

    def live(self, refused: bool = False) -> bool:
        if not self.available or refused or self.mode == "copy":
            return False
        if self.mode == "live":
            return True
        if len(self.cost) < 2:
            return False in self.cost  # copy first, then live
        cheaper = self.cost[True] <= self.cost[False]
        return cheaper != (self.taken % self.retry_every == 0)

    def observed(self, live: bool, stall_s: float) -> None:
        """A checkpoint's whole stall: the snapshot, and for a live one the wait before optimizer.step."""
        self.cost[live] = stall_s
        self.taken += 1


def _digest(cfg: JobConfig) -> str:
    from petatrain.storage.checksum import checksum_bytes

    return checksum_bytes(cfg.to_yaml().encode())


@torch.no_grad()
def _evaluate(r: Rank, step: int) -> None:
    """The held-out loss, averaged over the batches every rank that computes one saw."""
    if r.data.eval is None:
        return
    r.model.eval()
    total = torch.zeros(2, device=r.device)
    for tokens in r.data.eval_batches(r.cfg.train.eval_batches):
        loss = r.steps.eval_loss(tokens.to(r.device), r.amp)
        if loss is not None:
            total += torch.stack([loss.float(), torch.ones((), device=r.device)])
    r.model.train()
    dist.all_reduce(total)
    if r.rank == 0 and total[1] > 0:
        r.telemetry.record(ev.Eval(attempt=r.telemetry.attempt, step=step, loss=float(total[0] / total[1])))


def _hold(r: Rank, step: int) -> None:
    """Wait, every rank, until the evaluation of `step` has been taken (`RunHub.release`). The hub
    keeps the watchdog from calling the wait a hang."""
    if r.rank == 0:
        r.telemetry.flush(wait=True)  # the evaluation is in the ledger, where the driver's owner reads it
        r.telemetry.hold(step)
    dist.barrier()


def _save_final(steps: Any, payload: Payload, rank: int, step: int) -> None:
    from safetensors.torch import save

    full = steps.full_state()  # a collective for FSDP and pipelines
    if rank == 0:  # the weights, then the record that commits them (train/checkpoint/final.py)
        ckpt.write_final(payload.run_url, save(full), step, payload.options)
