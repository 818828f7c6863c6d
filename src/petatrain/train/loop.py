"""The worker loop that Ray Train runs on every rank.

Reads top down: set up (device, determinism, model, parallelism, optimizer, data), resume
from the newest verified checkpoint, then steps: gradient accumulation over micro-batches,
one all-reduce of the step's flags (loss, non-finite, preemption, checkpoint due), clip,
optimizer step, heartbeat, injected faults, asynchronous checkpoint, evaluation.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import logging
import math
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from petatrain import config as config_mod
from petatrain.chaos import inject
from petatrain.config import JobConfig
from petatrain.errors import ConfigError, CorruptDataError, PetatrainError
from petatrain.models import ModelSpec, build_model
from petatrain.runtime import failures
from petatrain.runtime.worker import RankEnv, Telemetry
from petatrain.storage import StorageOptions, join
from petatrain.storage.fs import atomic_write
from petatrain.train import checkpoint as ckpt
from petatrain.train.parallel import load_into, parallelize, read_for_resume, state_for_save

log = logging.getLogger(__name__)


Preempted = failures.Preempted  # raised here; the supervisor knows it by type


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
    stop_at: float | None = None  # unix time: stop at the first step boundary after it (soak windows)


class TokenBatches:
    """Micro-batches of token sequences from the petatrain loader, rolling over epochs.

    The held-out split is the dataset's last `data.eval_shards` shards; training reads
    the others. The state is the loader's JSON state.
    """

    def __init__(self, cfg: JobConfig, *, rank: int, world: int, micro: int, options: StorageOptions | None):
        from petatrain.data import index as idx
        from petatrain.data.stream import StreamingDataset

        url = cfg.data.dataset
        n_shards = idx.open_dataset(url, options).manifest["totals"]["shards"]
        held = cfg.data.eval_shards if n_shards > cfg.data.eval_shards else 0
        self.cfg, self.micro, self.seq = cfg, micro, cfg.model.seq_len + 1
        common = {"columns": ["tokens"], "options": options}
        self.train = StreamingDataset(
            url,
            seed=cfg.data.seed,
            rank=rank,
            world_size=world,
            batch_size=micro,
            drop_last=True,
            shards=(0, n_shards - held),
            **common,
        )
        self.eval = (
            StreamingDataset(
                url,
                shuffle=False,
                rank=rank,
                world_size=world,
                batch_size=micro,
                shards=(n_shards - held, n_shards),
                **common,
            )
            if held
            else None
        )
        manifest = self.train.manifest
        width = self._width(manifest)
        if width < self.seq:
            raise ConfigError(
                f"model.seq_len {cfg.model.seq_len} needs rows of >= {self.seq} tokens; {url} has {width} "
                f"(ingest with --pack-length {self.seq})"
            )
        vocab = (manifest.get("tokenizer") or {}).get("vocab_size")
        if vocab and vocab > cfg.model.vocab_size:
            raise ConfigError(f"model.vocab_size {cfg.model.vocab_size} is below the dataset's vocabulary ({vocab})")
        if len(self.train) < micro:
            raise ConfigError(f"{url}: fewer than train.micro_batch samples per rank in the training split")
        self.consumed = 0
        self.wait_s = 0.0
        self._it = None

    def _width(self, manifest: dict[str, Any]) -> int:
        """Tokens per row: packed token rows are fixed_size_binary[bytes]."""
        for col in manifest.get("schema", []):
            if col["name"] == "tokens" and str(col["type"]).startswith("fixed_size_binary["):
                return int(str(col["type"])[len("fixed_size_binary[") : -1]) // self.train.token_dtype.itemsize
        raise ConfigError(
            f"{self.cfg.data.dataset} has no packed tokens column (ingest with --tokenizer and --pack-length)"
        )

    def next(self) -> torch.Tensor:
        t0 = time.perf_counter()
        while True:
            if self._it is None:
                self._it = self.train.iter_batches()
            batch = next(self._it, None)
            if batch is not None:
                break
            self.train.set_epoch(self.train.epoch + 1)
            self.consumed, self._it = 0, None
        self.consumed += len(batch["index"])
        self.wait_s += time.perf_counter() - t0
        return torch.as_tensor(batch["tokens"])[:, : self.seq].to(torch.long)  # (B, T+1)

    def state_dict(self) -> dict[str, Any]:
        return self.train.state_dict(consumed=self.consumed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train.load_state_dict(state)
        self.consumed, self._it = 0, None

    def eval_batches(self, n: int):
        if self.eval is None:
            return
        for i, batch in enumerate(self.eval.iter_batches()):
            if i >= n:
                return
            yield torch.as_tensor(batch["tokens"])[:, : self.seq].to(torch.long)


def lr_at(step: int, cfg: config_mod.TrainConfig) -> float:
    """Linear warmup to train.lr, then cosine decay to train.min_lr at train.steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def build_optimizer(model: torch.nn.Module, cfg: config_mod.TrainConfig) -> torch.optim.Optimizer:
    """AdamW (decay on matrices only, as in GPT-2/nanoGPT) or SGD with momentum."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0}]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.beta1)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), foreach=False)


def micro_batching(cfg: JobConfig, world: int) -> tuple[int, int]:
    """(micro-batch, accumulation steps) that keep train.global_batch fixed on `world` ranks."""
    g = cfg.train.global_batch
    if g % world:
        raise ConfigError(f"train.global_batch {g} is not divisible by {world} workers")
    per_rank = g // world
    micro = max(m for m in range(1, min(cfg.train.micro_batch, per_rank) + 1) if per_rank % m == 0)
    return micro, per_rank // micro


class CheckpointSchedule:
    """When to checkpoint: every N steps, every S seconds, or the Young/Daly interval.

    For `auto` the cost of one checkpoint is what the training loop loses to it: the stall,
    plus, when the writer's thread competes with the loop for the same cores (training on
    CPU), the CPU time the background write took; on a GPU the write runs on host cores the
    loop does not need.
    """

    def __init__(self, cfg: JobConfig, world: int, *, writer_competes: bool = False):
        self.unit, self.value = cfg.checkpoint.interval()
        self.mtbf_s = cfg.faults.mtbf_hours * 3600 / max(1, world)  # job MTBF: any of the nodes fails
        self.writer_competes = writer_competes
        self.last_t = time.time()
        self.cost_s: float | None = None
        self.write_s = 0.0

    def due(self, step: int) -> bool:
        if self.unit == "steps":
            return step % int(self.value) == 0
        elapsed = time.time() - self.last_t
        return elapsed >= self.interval_s()

    def interval_s(self) -> float:
        if self.unit == "seconds":
            return self.value
        if self.cost_s is None:  # auto: take one early checkpoint to measure what it costs
            return 10.0
        # Young/Daly: sqrt(2 * cost * MTBF); checkpoints cannot usefully come faster than
        # they are written.
        return max(math.sqrt(2 * max(self.cost_s, 1e-4) * self.mtbf_s), self.write_s)

    def taken(self, stall_s: float, write_s: float, write_cpu_s: float = 0.0) -> None:
        """A checkpoint was taken; `write_s`/`write_cpu_s` describe the previous write (the last one finished)."""
        self.last_t = time.time()
        cost = stall_s + (write_cpu_s if self.writer_competes else 0.0)
        self.cost_s = cost if self.cost_s is None else 0.8 * self.cost_s + 0.2 * cost
        self.write_s = write_s


def train_worker(payload: Payload, env: RankEnv) -> None:
    """Entry point of one rank; `env` is what Ray Train gave it (runtime.worker.RankEnv.from_ray)."""
    cfg = config_mod.build(JobConfig, payload.config)
    rank, world = env.rank, env.world
    next_ranks = env.next_ranks(cfg)
    hub = env.hub
    preemption = env.preemption_notice()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the watchdog asks for stacks before a kill
    emit = hub.emit
    emit(
        "worker_start",
        rank=rank,
        pid=os.getpid(),
        node=env.node_id,
        warm_up=env.warm_up(),
        torch_threads=torch.get_num_threads(),
    )
    hub.beat(-1)

    device = env.device(cfg.resources.accelerator)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
        if device.type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.backends.cudnn.benchmark = False
    torch.set_flush_denormal(cfg.train.flush_denormal)  # CPU arithmetic; the same on every rank and attempt
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    spec: ModelSpec = build_model(cfg.model, cfg.train)
    model = parallelize(spec, cfg, device)
    optimizer = build_optimizer(model, cfg.train)
    torch.manual_seed(cfg.train.seed * 1000 + rank + 1)  # per-rank stream (dropout)
    micro, accum = micro_batching(cfg, world)
    data = TokenBatches(cfg, rank=rank, world=world, micro=micro, options=payload.options)
    amp = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if cfg.train.precision == "bf16-mixed"
        else contextlib.nullcontext()
    )

    # Events go to the hub once a second (an actor call per step cost ~1.5% of the step rate on
    # two CPU cores). A rank killed with events still buffered leaves up to a second of steps
    # out of the ledger, so around another rank's injected fault every step is sent at once.
    telemetry = hub.telemetry(period_s=1.0)
    faults = ckpt.StorageFaults()
    buffers = ckpt.HostBuffers()
    writer = ckpt.CheckpointWriter(
        payload.run_url,
        payload.options,
        report_part=hub.report_part,
        wait_parts=hub.wait_parts,
        on_commit=telemetry.commit,
        keep_last=cfg.checkpoint.keep_last,
        keep_every=cfg.checkpoint.keep_every,
        faults=faults,
        keepalive=telemetry.alive,
        keepalive_s=telemetry.period_s,
    )

    # -- resume ---------------------------------------------------------------------------------
    start = 0
    state, shards = _restore_point(payload, model, rank, world, cfg, emit)
    if state is not None:
        load_into(model, optimizer, state, shards, rank=rank, cfg=cfg)
        data.load_state_dict(state["loader"])
        rng = shards.get(rank, {}).get("rng/cpu")
        if rng is not None and state["world_size"] == world:
            torch.set_rng_state(rng)
        start = state["step"]
    if rank == 0:
        emit("resume", step=start, checkpoint=ckpt.step_dir(payload.run_url, start) if state else None)

    # A synchronous write is all stall already; an asynchronous one on CPU also takes cores from the steps.
    schedule = CheckpointSchedule(cfg, world, writer_competes=device.type == "cpu" and cfg.checkpoint.asynchronous)
    # Live snapshots: forward/backward must not write the weights (the built-in models), or the user says so.
    staging = StagingChoice(
        cfg.checkpoint.staging,
        available=device.type == "cpu" and (spec.weights_fixed_in_forward or cfg.checkpoint.staging == "live"),
    )
    live_stall: float | None = None  # a live snapshot's stall, until the wait before optimizer.step adds to it
    digest = _digest(cfg)
    tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
    # Each injection fires once per run: drop those an earlier attempt fired (a warm standby's
    # payload is built before the fault that ends the attempt it replaces).
    fired = hub.fired_keys() if payload.injections else set()
    injections = [i for i in payload.injections if i.key not in fired]
    pending = [i for i in injections if i.rank == rank]
    others = [i for i in injections if i.rank != rank]
    nan_next = False
    last_end = time.perf_counter()
    wait_mark = data.wait_s
    step = last_checkpoint = start
    try:
        while step < cfg.train.steps:
            lr = lr_at(step, cfg.train)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=device)
            for m in range(accum):
                tokens = data.next().to(device, non_blocking=True)
                sync = m == accum - 1 or not hasattr(model, "no_sync")
                with contextlib.nullcontext() if sync else model.no_sync(), amp:
                    loss = spec.loss_fn(model, tokens) / accum
                if nan_next:
                    loss = loss * float("nan")
                loss.backward()
                loss_sum += loss.detach().float()
            nan_next = False
            step += 1
            # One all-reduce per step carries the loss and every decision all ranks must share;
            # it runs while the optimizer steps. Whether to skip the update is decided from the
            # global gradient norm, which every rank already holds after the gradient reduction.
            due = 1.0 if rank == 0 and schedule.due(step) else 0.0
            halt = 1.0 if rank == 0 and payload.stop_at is not None and time.time() >= payload.stop_at else 0.0
            flags = torch.stack(
                [
                    loss_sum,
                    torch.tensor(float(preemption.received), device=device),
                    torch.tensor(due, device=device),
                    torch.tensor(halt, device=device),
                ]
            )
            shared = dist.all_reduce(flags, async_op=True)
            grad_norm = _grad_norm(model, cfg.train.grad_clip)
            nonfinite = not math.isfinite(grad_norm)
            staging_wait = 0.0
            if nonfinite:
                optimizer.zero_grad(set_to_none=True)
            else:
                staging_wait = writer.wait_for_staging()  # a live snapshot's tensors are read before they change
                if live_stall is not None:
                    staging.observed(True, live_stall + staging_wait)
                    live_stall = None
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            shared.wait()
            preempt, checkpoint_due, stop = flags[1].item() > 0, flags[2].item() > 0, flags[3].item() > 0
            loss_value = flags[0].item() / world
            if nonfinite:
                if rank == 0:
                    telemetry.record("nonfinite", step=step, action=cfg.faults.nonfinite)
                if cfg.faults.nonfinite == "rollback":
                    _leave_together(writer, telemetry, device)
                    raise NonFiniteLoss(f"non-finite loss at step {step}; rolling back to the last checkpoint")
                grad_norm = 0.0
            now = time.perf_counter()
            if rank == 0:
                if staging_wait > 0.0:  # checkpoint stall, not training
                    telemetry.record("checkpoint_staging", step=last_checkpoint, wait_s=staging_wait)
                telemetry.record(
                    "step",
                    step=step,
                    step_s=now - last_end - staging_wait,
                    data_wait_s=data.wait_s - wait_mark,
                    loss=loss_value if not nonfinite and math.isfinite(loss_value) else None,
                    lr=lr,
                    tokens=tokens_per_step,
                    grad_norm=grad_norm,
                )
            elapsed = time.time() - payload.run_started
            if others and any(i.due(step, elapsed + telemetry.period_s) for i in others):
                # Another rank's fault is imminent: the ledger holds every step up to it.
                telemetry.progress(step, now=True)
                others = [i for i in others if not _passed(i, step, elapsed, telemetry.period_s)]
            else:
                telemetry.progress(step)
            next_ranks.trained()  # the next attempt's processes start while this one trains

            for injection in [i for i in pending if i.due(step, elapsed)]:
                pending.remove(injection)
                telemetry.flush()  # the steps before the fault are in the ledger before it
                if injection.kind == "partition" and not _partitionable():
                    log.warning("%s: rank %d is not on a node the harness can cut; not fired", injection.key, rank)
                    continue
                fields = {"fault": injection.kind, "step": step, "rank": rank, "key": injection.key}
                if not hub.fire(injection.key, fields):
                    continue
                if injection.kind == "storage":
                    faults.arm(injection.count)
                elif injection.kind == "nan":
                    nan_next = True
                else:
                    inject.act(injection)
                    if injection.kind == "preempt":  # noticed at this step's boundary, as it was sent
                        preemption.wait(timeout_s=2.0)

            if checkpoint_due or preempt or stop or step == cfg.train.steps:
                live = staging.live(refused=writer.live_refused)
                snapshot, stall = _snapshot(
                    model, optimizer, data, writer, buffers, step, rank, world, cfg, digest, live=live
                )
                last_checkpoint = step
                writer.submit(snapshot)
                if not cfg.checkpoint.asynchronous:  # the loop waits for the commit: all of it is stall
                    stall += writer.wait()
                if live:
                    live_stall = stall
                else:
                    staging.observed(False, stall)
                if rank == 0:
                    telemetry.record("checkpoint_snapshot", step=step, stall_s=stall, live=live)
                schedule.taken(stall, writer.last_write_s, writer.last_write_cpu_s)
            if preempt:
                if _leave_together(writer, telemetry, device) == step:
                    raise Preempted(f"preemption notice: checkpoint of step {step} committed, exiting")
                raise Preempted(f"preemption notice: checkpoint of step {step} failed, resuming from an earlier one")
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < cfg.train.steps:
                _evaluate(model, spec, data, cfg, device, amp, step, rank, world, telemetry.record)
            last_end = time.perf_counter()
            wait_mark = data.wait_s
            if stop:
                break
        writer.wait()
        _evaluate(model, spec, data, cfg, device, amp, step, rank, world, telemetry.record)
        telemetry.flush(wait=True)
        _save_final(model, payload, rank)
    finally:
        writer.close()
        telemetry.flush()  # the commit of a write that finished while the attempt failed


def _leave_together(writer: ckpt.CheckpointWriter, telemetry: Telemetry, device: torch.device) -> int:
    """Before every rank raises the same error: rank 0's writes are done and the ledger has the
    events; returns the newest step rank 0 committed in this attempt (-1: none).

    Ray Train ends an attempt at the first rank's error and kills the others, so a rank that
    raised once its own checkpoint part was written would cut rank 0's commit short (the
    checkpoint of a preemption lost, tests/test_train.py).
    """
    writer.wait()
    committed = torch.tensor(-1 if writer.committed_step is None else writer.committed_step, device=device)
    dist.broadcast(committed, src=0)
    telemetry.flush(wait=True)
    return int(committed.item())


def _passed(injection: inject.Injection, step: int, elapsed_s: float, margin_s: float) -> bool:
    if injection.step is not None:
        return step >= injection.step
    return injection.at_s is not None and elapsed_s >= injection.at_s + margin_s


def _grad_norm(model: torch.nn.Module, clip: float) -> float:
    """The global gradient norm (identical on every rank), clipping to `clip` if it is set."""
    if clip:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    if hasattr(norm, "full_tensor"):  # FSDP: a DTensor
        norm = norm.full_tensor()
    return float(norm)


def _partitionable() -> bool:
    from petatrain.chaos.netns import on_cuttable_node

    return on_cuttable_node()


def _restore_point(payload: Payload, model: torch.nn.Module, rank: int, world: int, cfg: JobConfig, emit):
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
                on_skip=lambda url, why: emit("checkpoint_skipped", url=url, reason=why),
                below=below,
            )
        chosen = torch.tensor([state["step"] if state else -1], dtype=torch.long)
        dist.broadcast(chosen, src=0)
        step = int(chosen.item())
        if step < 0:
            return None, {}
        problem = None
        try:
            if rank != 0:
                state = ckpt.read_state(payload.run_url, step, payload.options)
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
            emit("checkpoint_skipped", url=ckpt.step_dir(payload.run_url, step), reason=problem)
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
    meta.update(loader=data.state_dict(), strategy=cfg.parallel.strategy, config_digest=digest)
    snap = ckpt.Snapshot(
        step=step,
        rank=rank,
        world_size=world,
        tensors=tensors,
        meta=meta,
        live=live_tensors,
        versions=[t._version for t in live_tensors],
    )
    return snap, time.perf_counter() - t0


class StagingChoice:
    """Whether the next checkpoint is written from the live tensors instead of host copies.

    `checkpoint.staging: copy` always copies, `live` always writes the live tensors; but never
    on GPU (its tensors need a device-to-host copy anyway) and never after a live snapshot
    was seen to change under the writer. `auto` measures both and keeps the cheaper: a copy
    costs its snapshot (0.34 s for a 500M model's 5.9 GB here); a live snapshot costs almost
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
def _evaluate(model, spec, data, cfg, device, amp, step, rank, world, emit) -> None:
    if data.eval is None:
        return
    model.eval()
    total = torch.zeros(2, device=device)
    for tokens in data.eval_batches(cfg.train.eval_batches):
        with amp:
            total[0] += spec.loss_fn(model, tokens.to(device)).float()
        total[1] += 1
    model.train()
    dist.all_reduce(total)
    if rank == 0 and total[1] > 0:
        emit("eval", step=step, loss=float(total[0] / total[1]))


def _save_final(model, payload: Payload, rank: int) -> None:
    from safetensors.torch import save

    from petatrain.train.parallel import full_model_state

    full = full_model_state(model)  # collective for FSDP
    if rank == 0:
        atomic_write(join(payload.run_url, "final", "model.safetensors"), save(full), payload.options)
