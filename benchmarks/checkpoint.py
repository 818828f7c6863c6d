"""Training-loop stall per checkpoint: petatrain async vs Ray Train, torch DCP and torch.save.

For GPT models of ~10M, ~100M and ~500M parameters (fp32 weights + AdamW state, i.e.
12 bytes per parameter: ~6 GB at 500M), on this CPU, one run, same model and disk:

- petatrain: the loop's own calls on a real step: forward/backward, AdamW step, then the
  loop's staging decision (`StagingChoice`), `_snapshot()` and submit to the real
  `CheckpointWriter` (single rank, in-process fake hub, local directory), then the next
  step's forward/backward and its wait before `optimizer.step()` (`wait_for_staging`). The
  stall is the snapshot + submit + that wait, taken once the previous write has finished (as
  it has with a 10 s interval); the background write (safetensors, fsync, read-back verify,
  commit) is reported beside it. Row "staging: auto" is the default: the loop's
  `StagingChoice` copies once, tries the live weights once (no copy; the next step's
  optimizer.step waits for the write to have read them), then keeps the cheaper; its two
  probing checkpoints are not timed. Row "staging: copy" always copies (the behaviour before
  live staging);
- Ray Train sync / async: a 1-worker TorchTrainer whose loop does what the Ray docs show:
  `torch.save` of model + optimizer state into a fresh local directory, then
  `ray.train.report(metrics, checkpoint=Checkpoint.from_directory(dir))` with
  `checkpoint_upload_mode` SYNC (default) or ASYNC. The stall is both together: the loop
  pays for writing the directory. Reports are `--interval` seconds apart (the training
  between checkpoints, slept), so an async upload has time to finish; for async, a
  metrics-only report right after the last checkpoint measures how long the upload took;
- DCP: `torch.distributed.checkpoint.save` (sync) and `async_save` (stall = until it returns;
  its future's completion is the background time), gloo process group of world 1;
- torch.save: model + optimizer state dicts to one file (no fsync, as users call it).

State dicts are taken inside the timed region for every peer (the loop pays for them).

Restore: after its checkpoints each peer loads its newest one back into the model and
optimizer, as a resuming worker does (the files were just written: page cache warm, the
disk's read speed left out). petatrain: `loop._restore_point`'s calls for one rank (newest
checkpoint that verifies, its rank file streamed into tensors and checksummed, `load_into`);
DCP: `dcp.load` into the live state dicts, then `set_*_state_dict` (torchtitan's resume);
torch.save and Ray Train: `torch.load(weights_only=True)` and `load_state_dict` (for Ray
Train from the fit result's checkpoint, `Checkpoint.as_directory()`, as its docs show).

Each peer runs in its own process, one at a time (the 500M state does not fit twice in
24 GiB); a row that would not fit in the memory available now is skipped and says why.
The step time is a real forward/backward/AdamW step on a `--batch` x `--seq-len` batch
(or `--step-s`). "% of 10 s" is stall / (the training between two checkpoints): a checkpoint
every 10 s is taken at the first step boundary 10 s or more after the previous one (what
`checkpoint.every: 10s` does), so ceil(10 s / step) steps apart. The issue's target is
petatrain <= 1% and >= 10x less than DCP's synchronous save.

Each stall is the median of `--repeats` checkpoints. The machine has 2 cores shared with
other jobs: expect noise; a row during which other processes used >10% of the CPUs is flagged.

    .venv/bin/python benchmarks/checkpoint.py [--sizes 10M,100M,500M] [--repeats 3] [--quick]

Prints a table per size and writes benchmarks/results/checkpoint.json with the machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import WORK, cpu_by_pid, version, write_results  # benchmarks/ is not a package

# GPT shapes (tied embeddings): params ~ 12 * n_layer * d_model^2 + vocab * d_model.
SIZES = {
    "10M": {"n_layer": 4, "n_head": 6, "d_model": 384, "vocab_size": 8192},
    "100M": {"n_layer": 12, "n_head": 12, "d_model": 768, "vocab_size": 16384},
    "500M": {"n_layer": 24, "n_head": 20, "d_model": 1280, "vocab_size": 16384},
}
PEERS = ["step", "petatrain", "petatrain-copy", "ray-sync", "ray-async", "dcp", "dcp-async", "torch-save"]
TITLES = {
    "step": "training step (fwd + bwd + AdamW)",
    "petatrain": "petatrain async (staging: auto)",
    "petatrain-copy": "petatrain async (staging: copy)",
    "ray-sync": "Ray Train report, sync upload",
    "ray-async": "Ray Train report, async upload",
    "dcp": "torch DCP save (sync)",
    "dcp-async": "torch DCP async_save",
    "torch-save": "torch.save (sync)",
}
# Host copies of the 12 B/param state each peer holds at its peak, besides the model's own
# (weights + AdamW; gradients are freed before checkpointing). petatrain: the snapshot
# buffers, plus gradients and activations of the real steps it runs; DCP async: its staging
# copy; torch.load (the torch.save and Ray Train rows' restore): the loaded state dicts.
PEAK_COPIES = {"step": 0.4, "petatrain": 1.6, "petatrain-copy": 1.6, "dcp": 0.2, "dcp-async": 1.2}
PEAK_COPIES |= {"torch-save": 1.0, "ray-sync": 1.0, "ray-async": 1.0}
RAY_OVERHEAD_GIB = 1.5  # raylet, GCS, controller and worker processes


# -- the model ---------------------------------------------------------------------------------------------


def model_config(size: str, seq_len: int):
    from petatrain.config import ModelConfig

    return ModelConfig(kind="gpt", seq_len=seq_len, **SIZES[size])


def parameters(size: str, seq_len: int) -> int:
    import torch

    from petatrain.models import build_model, count_params

    with torch.device("meta"):
        return count_params(build_model(model_config(size, seq_len)).module)


def trained_model(size: str, seq_len: int):
    """(model, AdamW) with its state filled as after a step; gradients freed, as at a checkpoint."""
    import torch

    from petatrain.models import build_model

    torch.manual_seed(0)
    model = build_model(model_config(size, seq_len)).module
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():  # a fake gradient: the AdamW state is what matters, not its values
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def _median(values: list[float]) -> float:
    return statistics.median(values)


# -- the rows (each runs in its own process) ---------------------------------------------------------------


def row_step(size: str, args: argparse.Namespace) -> dict:
    import torch

    from petatrain.models import build_model

    torch.manual_seed(0)
    spec = build_model(model_config(size, args.seq_len))
    model, optimizer = spec.module, torch.optim.AdamW(spec.module.parameters(), lr=1e-4)
    tokens = torch.randint(0, SIZES[size]["vocab_size"], (args.batch, args.seq_len + 1))
    times = []
    for i in range(args.steps + 1):
        started = time.perf_counter()
        loss = spec.loss_fn(model, tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i:  # the first step allocates the AdamW state
            times.append(time.perf_counter() - started)
    return {"step_s": _median(times), "samples": times, "threads": torch.get_num_threads()}


def row_petatrain(size: str, args: argparse.Namespace, folder: Path, staging: str) -> dict:
    import torch

    from petatrain import config
    from petatrain.models.gpt import next_token_loss
    from petatrain.train import checkpoint as ckpt
    from petatrain.train.loop import StagingChoice, _digest, _snapshot  # the loop's own calls

    model, optimizer = trained_model(size, args.seq_len)
    choice = StagingChoice(staging, available=True)  # CPU, a built-in GPT
    tokens = torch.randint(0, SIZES[size]["vocab_size"], (args.batch, args.seq_len + 1))
    parts: dict[int, dict] = {}
    commits: list[dict] = []
    writer = ckpt.CheckpointWriter(
        str(folder),
        None,
        report_part=lambda step, rank, files: parts.__setitem__(step, files),  # one rank: its files are all
        wait_parts=lambda step, world, timeout: parts.get(step),
        on_commit=commits.append,
        keep_last=1,
    )
    cfg = config.load(None, [f"checkpoint.staging={staging}"])
    digest = _digest(cfg)  # the loop computes it once per attempt

    class Data:  # the loader's resume state is a tiny tuple-like dict
        def state_dict(self) -> dict:
            return {"epoch": 0, "position": 0}

    def forward_backward() -> float:
        started = time.perf_counter()
        next_token_loss(model, tokens).backward()
        return time.perf_counter() - started

    stalls, waits, lives, overlapped, writes, stagings = [], [], [], [], [], []
    buffers = ckpt.HostBuffers()  # the loop keeps its snapshot buffers for the whole run
    # Untimed: the first checkpoint (it allocates the buffers) and, for auto, the second
    # (auto copies once and tries live once before it has a cost for each).
    warmup = 2 if staging == "auto" else 1
    for rep in range(args.repeats + warmup):
        # The step the checkpoint follows (with a 10 s interval the previous write is done).
        writer.wait()
        forward_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        live = choice.live(writer.live_refused)
        # What the loop pays: the snapshot and handing it to the writer, then, in the next step,
        # waiting before optimizer.step until a live snapshot's tensors have been read.
        started = time.perf_counter()
        snapshot, _ = _snapshot(model, optimizer, Data(), writer, buffers, 100 * (rep + 1), 0, 1, cfg, digest, live)
        writer.submit(snapshot)
        stall = time.perf_counter() - started
        forward_s = forward_backward()
        wait = writer.wait_for_staging()
        choice.observed(live, stall + wait)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        writer.wait()
        if writer.error is not None:
            raise writer.error
        if rep >= warmup:
            stalls.append(stall + wait)
            waits.append(wait)
            lives.append(live)
            overlapped.append(forward_s)
            writes.append(writer.last_write_s)
            stagings.append(writer.last_staging_s)
    writer.close()
    del buffers, snapshot  # the snapshot copies; resume happens in a new process
    first = next(iter(optimizer.state.values()))
    steps_taken = float(first["step"])  # one optimizer step after the last checkpoint
    restore_s, step = restore_petatrain(model, optimizer, folder, cfg)
    assert step == 100 * (args.repeats + warmup), f"resumed from step {step}"
    first = next(iter(optimizer.state.values()))
    assert float(first["step"]) == steps_taken - 1, "the optimizer state is not the checkpoint's"
    return {
        "stall_s": _median(stalls),
        "samples": stalls,
        "staging_wait_samples": waits,
        "live": lives,
        "forward_backward_during_write_s": _median(overlapped),
        "staging_samples": stagings,  # the write reading the tensors (serialising them)
        "background_s": _median(writes),
        "background_samples": writes,
        "bytes": commits[-1]["bytes"],
        "restore_s": restore_s,
    }


def restore_petatrain(model, optimizer, folder: Path, cfg) -> tuple[float, int]:
    """What a resuming rank does (loop._restore_point, one rank): choose the newest checkpoint
    that verifies, stream its rank file into tensors (checksummed), load model and optimizer."""
    from petatrain.train import checkpoint as ckpt
    from petatrain.train.parallel import load_into, read_for_resume

    started = time.perf_counter()
    state = ckpt.latest_verified(str(folder))

    def read(rank: int) -> dict:
        return ckpt.read_rank_tensors(str(folder), state, rank)

    shards = read_for_resume(state, read, model=model, rank=0, world=1, cfg=cfg)
    load_into(model, optimizer, state, shards, rank=0, cfg=cfg)
    return time.perf_counter() - started, state.step


def row_ray(size: str, args: argparse.Namespace, folder: Path) -> dict:
    import ray
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = folder / "ray-result.json"
    ray.init(num_cpus=os.cpu_count(), object_store_memory=500 << 20, include_dashboard=False, log_to_driver=False)
    started = time.perf_counter()
    trainer = TorchTrainer(
        _ray_train_fn,
        train_loop_config={
            "size": size,
            "seq_len": args.seq_len,
            "repeats": args.repeats,
            "interval": args.interval,
            "folder": str(folder),
            "out": str(out),
            "src": str(Path(__file__).resolve().parent),
        },
        scaling_config=ScalingConfig(num_workers=1, use_gpu=False),
        run_config=RunConfig(
            name="ckpt-bench",
            storage_path=str(folder / "ray-storage"),
            checkpoint_config=CheckpointConfig(num_to_keep=1),
        ),
    )
    latest = trainer.fit().checkpoint
    total = time.perf_counter() - started
    ray.shutdown()
    result = json.loads(out.read_text())
    result["trainer_s"] = total
    # Resume as the Ray docs show: the checkpoint as a local directory, torch.load from it.
    model, optimizer = trained_model(size, args.seq_len)
    started = time.perf_counter()
    with latest.as_directory() as local:
        restore_torch_load(model, optimizer, Path(local))
    restore_s = time.perf_counter() - started
    for row in result.values():
        if isinstance(row, dict):
            row["restore_s"] = restore_s
    return result


def _ray_train_fn(config: dict) -> None:
    """The Ray worker: torch.save into a fresh directory, then ray.train.report, timed together."""
    import torch
    from ray import train

    sys.path.insert(0, config["src"])
    from checkpoint import trained_model

    model, optimizer = trained_model(config["size"], config["seq_len"])
    scratch = Path(config["folder"]) / "ray-local"
    scratch.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {}
    for mode in (train.CheckpointUploadMode.SYNC, train.CheckpointUploadMode.ASYNC):
        stalls, writes = [], []
        for rep in range(config["repeats"]):
            time.sleep(config["interval"])  # the training between two checkpoints
            started = time.perf_counter()
            local = tempfile.mkdtemp(dir=scratch)  # not a TemporaryDirectory: an async upload outlives the call
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f"{local}/checkpoint.pt")
            written = time.perf_counter()
            train.report({"rep": rep}, checkpoint=train.Checkpoint.from_directory(local), checkpoint_upload_mode=mode)
            stalls.append(time.perf_counter() - started)
            writes.append(written - started)
            if mode == train.CheckpointUploadMode.SYNC:
                shutil.rmtree(local)  # ASYNC deletes it after the upload by default
        row: dict[str, Any] = {
            "stall_s": _median(stalls),
            "samples": stalls,
            "write_dir_s": _median(writes),
            "report_s": _median([s - w for s, w in zip(stalls, writes, strict=True)]),
        }
        if mode == train.CheckpointUploadMode.ASYNC:
            # A report waits for the upload before it: one right after the last checkpoint measures it.
            started = time.perf_counter()
            train.report({"rep": -1})
            row["background_s"] = time.perf_counter() - started
        result["ray-" + mode.value.lower()] = row
    Path(config["out"]).write_text(json.dumps(result))


def row_dcp(size: str, args: argparse.Namespace, folder: Path, asynchronous: bool) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    model, optimizer = trained_model(size, args.seq_len)
    stalls, backgrounds = [], []
    for rep in range(args.repeats):
        target = folder / f"dcp-{rep}"
        started = time.perf_counter()
        state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
        if asynchronous:
            future = dcp.async_save(state, checkpoint_id=str(target))
            stalls.append(time.perf_counter() - started)
            future.result()
            backgrounds.append(time.perf_counter() - started)
        else:
            dcp.save(state, checkpoint_id=str(target))
            stalls.append(time.perf_counter() - started)
        del state
        if rep < args.repeats - 1:
            shutil.rmtree(target)
    # Resume as torchtitan does: state dicts of the live model, loaded in place, then set back.
    started = time.perf_counter()
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=str(target))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    restore_s = time.perf_counter() - started
    dist.destroy_process_group()
    out = {"stall_s": _median(stalls), "samples": stalls, "restore_s": restore_s}
    if backgrounds:
        out |= {"background_s": _median(backgrounds), "background_samples": backgrounds}
    return out


def row_torch_save(size: str, args: argparse.Namespace, folder: Path) -> dict:
    import torch

    model, optimizer = trained_model(size, args.seq_len)
    stalls = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, folder / "checkpoint.pt")
        stalls.append(time.perf_counter() - started)
    return {"stall_s": _median(stalls), "samples": stalls, "restore_s": restore_torch_load(model, optimizer, folder)}


def restore_torch_load(model, optimizer, folder: Path) -> float:
    """Resume from torch.save's file: torch.load (weights_only, the default) and load_state_dict."""
    import torch

    started = time.perf_counter()
    saved = torch.load(folder / "checkpoint.pt", weights_only=True)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    return time.perf_counter() - started


def child(args: argparse.Namespace) -> None:
    folder = Path(args.folder)
    if args.row == "step":
        result = row_step(args.size, args)
    elif args.row in ("petatrain", "petatrain-copy"):
        result = row_petatrain(args.size, args, folder, staging="copy" if args.row == "petatrain-copy" else "auto")
    elif args.row == "ray":
        result = row_ray(args.size, args, folder)
    elif args.row in ("dcp", "dcp-async"):
        result = row_dcp(args.size, args, folder, asynchronous=args.row == "dcp-async")
    else:
        result = row_torch_save(args.size, args, folder)
    Path(args.out).write_text(json.dumps(result, default=float))


# -- the driver --------------------------------------------------------------------------------------------


def available_gib() -> float:
    with open("/proc/meminfo") as handle:
        info = {line.split(":")[0]: line.split()[1] for line in handle}
    return int(info["MemAvailable"]) / 2**20


def run_row(row: str, size: str, state_gib: float, args: argparse.Namespace) -> dict:
    """One row in a fresh process; {'error': ...} when it fails or would not fit in memory now."""
    peers = ["ray-sync", "ray-async"] if row == "ray" else [row]
    need = state_gib * (1 + max(PEAK_COPIES.get(p, 0.2) for p in peers)) + 1.0
    need += RAY_OVERHEAD_GIB if row == "ray" else 0
    free = available_gib()
    if need > free:
        return {"error": f"skipped: needs ~{need:.1f} GiB of memory, {free:.1f} GiB available"}
    folder = Path(tempfile.mkdtemp(prefix=f"ckpt-{row}-{size}-", dir=WORK))
    out = folder / "row.json"
    command = [sys.executable, __file__, "--row", row, "--size", size, "--folder", str(folder), "--out", str(out)]
    command += ["--seq-len", str(args.seq_len), "--batch", str(args.batch), "--steps", str(args.steps)]
    command += ["--repeats", str(args.repeats), "--interval", str(args.interval)]
    started, before = time.perf_counter(), cpu_by_pid()
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=args.row_timeout, check=False)
        if out.exists():
            row_result = json.loads(out.read_text())
        else:
            tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
            row_result = {"error": f"exit {result.returncode}: " + " | ".join(tail)}
    except subprocess.TimeoutExpired:
        row_result = {"error": f"timed out after {args.row_timeout} s"}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    wall = time.perf_counter() - started
    after = cpu_by_pid()
    foreign = sum(after[pid] - cpu for pid, cpu in before.items() if pid in after and pid != os.getpid())
    share = round(max(0.0, foreign) / (wall * (os.cpu_count() or 1)), 3)
    rows = row_result if row == "ray" and "error" not in row_result else {p: dict(row_result) for p in peers}
    for p in peers:
        rows.setdefault(p, {"error": "missing from the Ray worker's result"})
        rows[p] |= {"process_s": round(wall, 1), "foreign_cpu_share": share}
    return rows


def measure(size: str, args: argparse.Namespace) -> dict:
    params = parameters(size, args.seq_len)
    state_gib = params * 12 / 2**30
    print(f"  {size}: {params / 1e6:.0f}M parameters, {state_gib:.2f} GiB of state ...", file=sys.stderr)
    rows: dict[str, dict] = {}
    for row in dict.fromkeys("ray" if p.startswith("ray") else p for p in args.peers):
        if row == "step" and args.step_s:
            rows["step"] = {"step_s": args.step_s, "given": True}
            continue
        print(f"    {row} ...", file=sys.stderr)
        rows |= run_row(row, size, state_gib, args)
    return {"parameters": params, "state_bytes": params * 12, "rows": {p: rows[p] for p in args.peers if p in rows}}


def report(size: str, result: dict, args: argparse.Namespace) -> None:
    """Print the size's table; fill in ratios and the share of a checkpoint interval."""
    rows = result["rows"]
    step_s = rows.get("step", {}).get("step_s")
    steps = max(1, math.ceil(args.interval / step_s)) if step_s else None  # the first boundary >= interval
    result["steps_per_checkpoint"] = steps
    base = rows.get("petatrain", {}).get("stall_s")
    dcp = rows.get("dcp", {}).get("stall_s")
    step_text = f"step {step_s:.2f} s ({args.batch}x{args.seq_len} tokens)" if step_s else "no step time"
    print(
        f"\n{size}: {result['parameters'] / 1e6:.0f}M parameters, {result['state_bytes'] / 1e9:.2f} GB of fp32 "
        f"weights + AdamW state; {step_text}; a checkpoint every {steps or '?'} step(s) (~{args.interval:g} s)\n"
    )
    print(
        f"{'run':<38} {'stall (s)':>10} {'background (s)':>15} {'stall x petatrain':>18} "
        f"{'DCP sync / this':>16} {f'% of {args.interval:g} s':>10} {'restore (s)':>12}"
    )
    for peer, row in rows.items():
        if peer == "step":
            continue
        if "error" in row:
            print(f"{TITLES[peer]:<38} {row['error']}")
            continue
        stall = row["stall_s"]
        row["vs_petatrain"] = round(stall / base, 2) if base else None
        row["dcp_sync_over_this"] = round(dcp / stall, 2) if dcp else None
        row["percent_of_interval"] = round(100 * stall / (steps * step_s), 3) if steps else None
        background = f"{row['background_s']:.3f}" if row.get("background_s") is not None else "-"
        vs = f"{row['vs_petatrain']:.1f}x" if base else "-"
        over = f"{row['dcp_sync_over_this']:.1f}x" if dcp else "-"
        pct = f"{row['percent_of_interval']:.2f}%" if steps else "-"
        restore = f"{row['restore_s']:.3f}" if row.get("restore_s") is not None else "-"
        print(f"{TITLES[peer]:<38} {stall:>10.3f} {background:>15} {vs:>18} {over:>16} {pct:>10} {restore:>12}")
    if base and dcp and step_s:
        pct = rows["petatrain"]["percent_of_interval"]
        result["targets"] = {
            "petatrain_percent_of_interval": pct,
            "petatrain_le_1_percent": pct <= 1.0,
            "dcp_sync_over_petatrain": round(dcp / base, 2),
            "dcp_sync_ge_10x": dcp / base >= 10,
        }
        print(
            f"  targets: petatrain stall {pct:.2f}% of {args.interval:g} s of steps (<= 1%: "
            f"{'met' if pct <= 1 else 'MISSED'}); DCP sync / petatrain {dcp / base:.1f}x (>= 10x: "
            f"{'met' if dcp / base >= 10 else 'MISSED'})"
        )
    for peer, row in rows.items():
        if row.get("foreign_cpu_share", 0) > 0.1:
            print(f"  note: other processes used {row['foreign_cpu_share']:.0%} of the CPUs during {TITLES[peer]!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10M,100M,500M", help=f"comma-separated subset of {','.join(SIZES)}")
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated subset of {','.join(PEERS)}")
    parser.add_argument("--repeats", type=int, default=3, help="checkpoints per peer (the median is reported)")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds of training between checkpoints")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step for the step time")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence for the step time")
    parser.add_argument("--steps", type=int, default=3, help="timed steps for the step time (median)")
    parser.add_argument("--step-s", type=float, default=0.0, help="use this step time instead of measuring one")
    parser.add_argument("--row-timeout", type=int, default=1200, help="seconds one row may take")
    parser.add_argument(
        "--quick", action="store_true", help="10M and 100M, 2 repeats, 2 s interval for Ray: a smoke run"
    )
    for hidden in ("--row", "--size", "--folder", "--out"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row:
        child(args)
        return
    if args.quick:
        args.sizes, args.repeats, args.steps = "10M,100M", 2, 2
    sizes = [s for s in args.sizes.split(",") if s]
    args.peers = [p for p in args.peers.split(",") if p]
    for name, chosen, known in (("size", sizes, SIZES), ("peer", args.peers, PEERS)):
        unknown = [c for c in chosen if c not in known]
        if unknown:
            parser.error(f"unknown {name} {unknown[0]!r}; choose from {','.join(known)}")

    started = time.perf_counter()
    WORK.mkdir(parents=True, exist_ok=True)
    print(f"free disk under {WORK}: {shutil.disk_usage(WORK).free / 2**30:.0f} GiB", file=sys.stderr)
    results = {}
    for size in sizes:
        results[size] = measure(size, args)
        report(size, results[size], args)
    total_s = time.perf_counter() - started
    print(
        f"\n{os.cpu_count()} cores (shared: medians of {args.repeats}); local disk; "
        f"Ray's sync report waits for the controller's poll (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, default 2 s); "
        f"{total_s:.0f} s in all"
    )
    write_results(
        "checkpoint",
        {
            "parameters": {
                "sizes": {s: SIZES[s] for s in sizes},
                "peers": args.peers,
                "repeats": args.repeats,
                "interval_s": args.interval,
                "step_batch": [args.batch, args.seq_len],
                "step_s_given": args.step_s or None,
                "quick": args.quick,
                "storage": "local disk (benchmarks/.work)",
            },
            "results": results,
            "seconds": round(total_s, 1),
        },
        machine_extra={"petatrain": version("petatrain"), "safetensors": version("safetensors")},
    )


if __name__ == "__main__":
    main()
