"""A plain DDP training script, the baseline of benchmarks/overhead.py.

What a person writes without a platform: the same GPT (`petatrain.models`), AdamW with
decay on matrices, warmup + cosine, gradient accumulation with `no_sync`, gradient
clipping; the token rows of a petatrain dataset's Parquet shards read once with pyarrow
into a numpy array and shuffled per epoch. No checkpoints, no ledger, no heartbeats.
Rank 0 records the end time of every step and writes them to --out.

With --ray-train the same loop runs as the train function of a Ray Train `TorchTrainer`
(2 workers, gloo, Ray Train's defaults, a fresh local Ray as `petatrain train` starts):
what the loop costs under Ray Train alone, before anything petatrain adds. With --ray-actors
it runs in two bare Ray actors of 1 CPU each (no Ray Train: the group set up by hand, the
loop in a thread as Ray Train runs it): what Ray's own worker processes cost. One difference
stays: the actor's task waits for that thread, where Ray Train's `run_train_fn` returns and
the actor's main thread idles in Ray's task loop (which takes the GIL every 10 ms to check
for signals); keeping petatrain's worker main thread out of that loop changed nothing
measurable (README, overhead).

    torchrun --standalone --nproc_per_node 2 benchmarks/plain_ddp.py --dataset DS --out times.json
    python benchmarks/plain_ddp.py --ray-train --dataset DS --out times.json
    python benchmarks/plain_ddp.py --ray-actors --dataset DS --out times.json

With --tensor N the ranks are N-way tensor-parallel groups instead (torch's `parallelize_module` with
the GPT's plan, loss_parallel, a group reading the same rows; the groups replicated by FSDP2's
`replicate` when there are several, or with --fsdp sharded again by `fully_shard` per block over
the replicas, 2-D): the plain script of petatrain's `parallel.tensor` layout.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import math
import os
import time
from collections.abc import Callable

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from petatrain.config import ModelConfig
from petatrain.models.gpt import GPT, next_token_loss
from petatrain.train.trace import StepTracer, span


def token_rows(dataset: str, width: int) -> np.ndarray:
    """(rows, width) uint16 tokens of every shard but the last (petatrain holds that one out)."""
    shards = sorted(glob.glob(os.path.join(dataset, "data", "*.parquet")))[:-1]
    parts = []
    for path in shards:
        column = pq.read_table(path, columns=["tokens"]).column("tokens").combine_chunks()
        data = np.frombuffer(column.buffers()[1], dtype=np.uint16)
        parts.append(data.reshape(len(column), -1)[:, :width])
    return np.concatenate(parts)


def batches(rows: np.ndarray, seed: int, size: int, replica: int, replicas: int) -> Callable[[], torch.Tensor]:
    """Batches of `size` rows, a new permutation each epoch, this replica's share of each."""
    epoch, cursor, order = 0, 0, None

    def next_batch() -> torch.Tensor:
        nonlocal epoch, cursor, order
        if order is None or cursor + size > len(order):
            order = np.random.default_rng(seed + epoch).permutation(len(rows))[replica::replicas]
            epoch, cursor = epoch + 1, 0
        batch = rows[order[cursor : cursor + size]]
        cursor += size
        return torch.from_numpy(batch.astype(np.int64))  # (B, T+1)

    return next_batch


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps))
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * progress))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=320)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--min-lr", type=float, default=3e-4)
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ray-train", action="store_true", help="run the loop in a Ray Train TorchTrainer")
    parser.add_argument("--ray-actors", action="store_true", help="run the loop in two bare Ray actors")
    parser.add_argument("--workers", type=int, default=2, help="ranks under --ray-train or --ray-actors")
    parser.add_argument("--tensor", type=int, default=1, help="tensor-parallel degree (1: DDP)")
    parser.add_argument(
        "--fsdp", action="store_true", help="FSDP2 instead of DDP: fully_shard per block, then the root (ZeRO-3)"
    )
    parser.add_argument(
        "--pipeline",
        choices=("1f1b", "interleaved"),
        help="the model in one stage per rank (interleaved: two parts per rank) with torch.distributed.pipelining",
    )
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches of a pipeline step")
    parser.add_argument("--trace-at", type=int, default=0, help="torch.profiler from this step (1-based; 0: off)")
    parser.add_argument("--trace-steps", type=int, default=20, help="steps traced from --trace-at")
    parser.add_argument("--trace-out", default="", help="folder for each rank's trace summary (rank-R.summary.json)")
    parser.add_argument(
        "--keep-denormals", action="store_true", help="do not flush denormals (petatrain's train.flush_denormal=false)"
    )
    args = parser.parse_args()
    if args.ray_train:
        run_in_ray_train(args)
        return
    if args.ray_actors:
        run_in_ray_actors(args)
        return
    dist.init_process_group("gloo")
    loop(args)
    dist.destroy_process_group()


def loop(args: argparse.Namespace) -> None:
    (train_pipeline if getattr(args, "pipeline", None) else train)(args)


def run_in_ray_train(args: argparse.Namespace) -> None:
    import tempfile

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    ray.init(include_dashboard=False, logging_level="WARNING")
    with tempfile.TemporaryDirectory(prefix="plain-ray-train-") as storage:
        TorchTrainer(
            lambda config: loop(argparse.Namespace(**config)),
            train_loop_config=vars(args),
            torch_config=TorchConfig(backend="gloo"),
            scaling_config=ScalingConfig(num_workers=args.workers, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(name=f"plain-{os.getpid()}", storage_path=storage),
        ).fit()
    ray.shutdown()


def run_in_ray_actors(args: argparse.Namespace) -> None:
    import socket
    import threading

    import ray

    @ray.remote(num_cpus=1)
    class Rank:
        def run(self, rank: int, world: int, addr: str, port: int, config: dict) -> None:
            os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
            errors = []

            def train() -> None:  # not `loop`: that is the module's training loop it calls
                try:
                    dist.init_process_group("gloo")
                    loop(argparse.Namespace(**config))
                    dist.destroy_process_group()
                except BaseException as e:  # raised again in the actor's task
                    errors.append(e)

            thread = threading.Thread(target=train, name="training")
            thread.start()
            thread.join()
            if errors:
                raise errors[0]

    ray.init(include_dashboard=False, logging_level="WARNING")
    addr = ray.util.get_node_ip_address()  # as Ray Train sets MASTER_ADDR
    with socket.socket() as s:
        s.bind((addr, 0))
        port = s.getsockname()[1]
    ranks = [Rank.remote() for _ in range(args.workers)]
    ray.get([r.run.remote(i, len(ranks), addr, port, vars(args)) for i, r in enumerate(ranks)])
    ray.shutdown()


def train(args: argparse.Namespace) -> None:
    """The loop, in a process of an initialised gloo group (torchrun's, Ray Train's or the bare actors')."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.use_deterministic_algorithms(True)  # petatrain's default (train.deterministic)
    torch.set_flush_denormal(not args.keep_denormals)  # petatrain's default (train.flush_denormal)
    torch.manual_seed(args.seed)
    cfg = ModelConfig(
        n_layer=args.n_layer,
        n_head=args.n_head,
        d_model=args.d_model,
        vocab_size=args.vocab_size,
        seq_len=args.seq_len,
    )
    tensor, fsdp = getattr(args, "tensor", 1), getattr(args, "fsdp", False)
    model = GPT(cfg) if tensor > 1 or fsdp else DistributedDataParallel(GPT(cfg))
    if fsdp and tensor == 1:  # FSDP2 as its docs wrap a transformer: each block, then the root
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    loss_context = contextlib.nullcontext
    if tensor > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

        from petatrain.models.gpt import gpt_tensor_plan

        mesh = init_device_mesh("cpu", (world // tensor, tensor), mesh_dim_names=("data", "tensor"))
        parallelize_module(model, mesh["tensor"], gpt_tensor_plan(cfg).styles(tensor))
        model.head.weight = model.wte.weight  # tied again: each module got its own DTensor
        if world > tensor and fsdp:  # 2-D: FSDP2 shards each tensor-parallel block again over the replicas
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block, mesh=mesh["data"])
            fully_shard(model, mesh=mesh["data"])
        elif world > tensor:
            from torch.distributed._composable.replicate_with_fsdp import replicate

            replicate(model, mesh=mesh["data"])
        loss_context = loss_parallel
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), foreach=False)
    replicas = world // tensor  # data-parallel replicas: a tensor-parallel group reads the same rows
    accum = args.global_batch // replicas // args.micro_batch

    rows = token_rows(args.dataset, args.seq_len + 1)
    next_batch = batches(rows, args.seed, args.micro_batch, rank // tensor, replicas)

    ends, losses = [], []
    tracer = _tracer(args, rank)
    for step in range(args.steps):
        tracer.before(step + 1)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        loss_sum = 0.0
        for m in range(accum):
            with span("plain.data"):
                tokens = next_batch()
            with span("plain.forward_backward"):
                if m < accum - 1 and tensor == 1 and not fsdp:
                    with model.no_sync():
                        loss = next_token_loss(model, tokens) / accum
                        loss.backward()
                else:
                    with loss_context():
                        loss = next_token_loss(model, tokens) / accum
                        loss.backward()
                loss_sum += loss.item()
        with span("plain.clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with span("plain.optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            ends.append(time.perf_counter())
            losses.append(loss_sum)
        tracer.after(step + 1)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"step_end_s": ends, "loss": losses, "threads": torch.get_num_threads(), "world": world}, f)


def train_pipeline(args: argparse.Namespace) -> None:
    """The loop as a user writes it with torch.distributed.pipelining and Megatron's habits: the GPT
    cut into P x v parts (v = 2 for interleaved), the blocks evenly by count, the first part with
    the embedding and the last with the head (torchtitan's split; petatrain's `uniform`), part k on
    rank k mod P; the embedding and the head stay tied, their gradients summed between the first
    and the last rank after each step, and the gradient norm clipped over all ranks."""
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    from petatrain.models.gpt import logits_loss

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.use_deterministic_algorithms(True)
    torch.set_flush_denormal(not args.keep_denormals)
    torch.manual_seed(args.seed)
    cfg = ModelConfig(
        n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model, vocab_size=args.vocab_size, seq_len=args.seq_len
    )
    model = GPT(cfg)  # the same initial weights on every rank: each keeps its parts
    chunks = 2 if args.pipeline == "interleaved" else 1
    parts = world * chunks
    base, extra = divmod(len(model.blocks), parts)
    bounds, start = [], 0
    for k in range(parts):
        end = start + base + (1 if k < extra else 0)
        bounds.append((start, end))
        start = end

    class Part(nn.Module):
        def __init__(self, k: int) -> None:
            super().__init__()
            self.first, self.last = k == 0, k == parts - 1
            self.blocks = nn.ModuleList(model.blocks[bounds[k][0] : bounds[k][1]])
            if self.first:
                self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
            if self.last:
                self.ln_f, self.head = model.ln_f, model.head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.first:
                x = self.drop(self.wte(x) + self.wpe(torch.arange(x.size(1))))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x)) if self.last else x

    mine_k = range(rank, parts, world)  # "loop" placement: part k on rank k mod P
    mine = [Part(k) for k in mine_k]
    stages = [PipelineStage(part, k, parts, torch.device("cpu")) for part, k in zip(mine, mine_k, strict=True)]
    if chunks == 1:
        schedule = Schedule1F1B(stages[0], n_microbatches=args.microbatches, loss_fn=logits_loss)
    else:
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=args.microbatches, loss_fn=logits_loss)
    first_rank, last_rank = 0, (parts - 1) % world
    tied = dist.new_group([first_rank, last_rank]) if first_rank != last_rank else None
    tied_weight = (
        model.wte.weight if rank == first_rank else model.head.weight if rank == last_rank else None
    )  # this rank's copy of the tied weight (the first part's, or the last part's)
    params = list(dict.fromkeys(p for part in mine for p in part.parameters()))
    counted = [p for p in params if not (rank == last_rank and rank != first_rank and p is tied_weight)]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), foreach=False)

    next_batch = batches(token_rows(args.dataset, args.seq_len + 1), args.seed, args.global_batch, 0, 1)

    ends, losses = [], []
    tracer = _tracer(args, rank)
    for step in range(args.steps):
        tracer.before(step + 1)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        with span("plain.data"):
            tokens = next_batch()
        micro_losses: list[torch.Tensor] = []
        with span("plain.schedule"):
            if rank == first_rank and rank == last_rank:
                schedule.step(tokens[:, :-1], target=tokens[:, 1:], losses=micro_losses)
            elif rank == first_rank:
                schedule.step(tokens[:, :-1])
            elif rank == last_rank:
                schedule.step(target=tokens[:, 1:], losses=micro_losses)
            else:
                schedule.step()
        with span("plain.reduce_gradients"):
            if tied is not None and tied_weight is not None and tied_weight.grad is not None:
                dist.all_reduce(tied_weight.grad, group=tied)  # both copies get the sum, as one tied weight would
        with span("plain.clip"):
            squares = torch.stack([p.grad.pow(2).sum() for p in counted if p.grad is not None]).sum()
            dist.all_reduce(squares)
            norm = squares.sqrt()
            if norm > 1.0:
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(1.0 / (norm + 1e-6))
        with span("plain.optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            ends.append(time.perf_counter())
        if micro_losses:
            losses.append(float(torch.stack(micro_losses).detach().mean()))
        tracer.after(step + 1)
    final = torch.tensor([losses[-1] if losses else 0.0])
    dist.broadcast(final, src=last_rank)  # the loss is the last part's
    if rank == 0:
        with open(args.out, "w") as f:
            result = {"step_end_s": ends, "loss": [float(final)], "threads": torch.get_num_threads()}
            json.dump({**result, "world": world}, f)


def _tracer(args: argparse.Namespace, rank: int) -> StepTracer:
    """petatrain's own tracer, so that both sides are measured alike: torch.profiler over the steps
    from --trace-at, the same summary (its spans named plain.*), in --trace-out/traces/attempt-0/."""
    return StepTracer(
        args.trace_at, args.trace_steps, rank=rank, attempt=0, run_url=args.trace_out or ".", prefix="plain."
    )


if __name__ == "__main__":
    main()
