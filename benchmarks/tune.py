"""A hyperparameter search: petatrain tune vs a plain Ray Tune function trainable.

The search: examples/tune.yaml's model (the tiny GPT) on one worker per trial, 4 trials of
30 steps, learning rate sampled log-uniformly, no early stopping (every trial runs to the end,
so the rows compare the same work), the dataset on an S3 server (the Ceph RGW the tests use,
started here on its own ports and stopped at the end).

Rows, all in one run:
- **petatrain, shared cache**: `api.tune`; every trial reads through the node's shard cache, so a
  shard crosses the network once per node.
- **petatrain, a cache per trial**: the same search with `shared_cache=False`: each trial fetches
  the dataset into a cache of its own, as each trial of a plain Tune search does.
- **Ray Tune function trainable**: the same model, data order and optimizer in a plain PyTorch
  loop inside a Tune function trainable (one process per trial, no Ray Train, no checkpoints,
  no fault tolerance), reading the same dataset through a cache of its own.

A one-trial search runs first, unrecorded, so that no row pays for a cold start alone.
Bytes fetched = the bytes of shard files the trials' caches hold at the end (what they fetched
from the object store; the index and manifest reads are a few KB and left out). Start-up = from
Tune calling the trial to its first training step done. Wall = the whole search.

    .venv/bin/python benchmarks/tune.py [--trials 4] [--steps 30]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import write_results  # benchmarks/ is not a package

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORK = HERE / ".work" / "tune"
RGW = ROOT / "tests" / "s3server" / "rgw.sh"
RGW_ENV = {"PETATRAIN_RGW_PORT": "7990", "PETATRAIN_RGW_MON_PORT": "3890"}
LR_SPACE = "train.lr=loguniform:3e-4:3e-2"


def start_s3() -> str:
    state = str(WORK / "rgw")
    env = {**os.environ, **RGW_ENV}
    subprocess.run(["bash", str(RGW), "start", state], check=True, capture_output=True, env=env)
    exports = subprocess.run(["bash", str(RGW), "env", state], check=True, capture_output=True, text=True, env=env)
    for line in exports.stdout.splitlines():
        if line.startswith("export "):
            key, _, value = line[len("export ") :].partition("=")
            os.environ[key] = value.strip().strip("'\"")
    return state


def stop_s3(state: str) -> None:
    subprocess.run(["bash", str(RGW), "stop", state], capture_output=True, env={**os.environ, **RGW_ENV})


def dataset() -> str:
    """A packed byte-token dataset on S3 (rows of 65 tokens), ~4 MB in 40 shards."""
    from petatrain import api, config
    from petatrain.data import synth
    from petatrain.storage import resolve

    url = "s3://petatrain-bench-tune/ds"
    fs, _ = resolve(url)
    if not fs.exists("petatrain-bench-tune"):
        fs.mkdir("petatrain-bench-tune")
    if not fs.exists("petatrain-bench-tune/ds/_index/manifest.json"):
        synth.generate(str(WORK / "corpus"), documents=8000, files=4)
        cfg = config.IngestConfig(tokenizer="bytes", pack_length=65, shard_size="100KB", dedup="exact")
        api.ingest([str(WORK / "corpus")], url, config=cfg)
    return url


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*.parquet") if p.is_file())


def run_petatrain(ds: str, trials: int, steps: int, *, shared: bool) -> dict:
    from petatrain import api, config

    name = "shared" if shared else "per-trial"
    out, cache = WORK / f"search-{name}", WORK / f"cache-{name}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    for old in Path("/tmp").glob("petatrain-cache-*"):  # the per-trial caches of an earlier run
        shutil.rmtree(old, ignore_errors=True)
    cfg = config.load(
        ROOT / "examples" / "tune.yaml",
        [
            f"data.dataset={ds}",
            f"data.cache_dir={cache}",
            f"tune.trials={trials}",
            f"tune.max_steps={steps}",
            "tune.scheduler=none",
            "tune.params={}",
        ],
    )
    started = time.perf_counter()
    summary = api.tune(cfg, str(out), params=[LR_SPACE], shared_cache=shared)
    wall = time.perf_counter() - started
    fetched = folder_bytes(cache) if shared else sum(folder_bytes(p) for p in Path("/tmp").glob("petatrain-cache-*"))
    starts = [t["startup_s"] for t in summary["trials"] if t.get("startup_s") is not None]
    return {
        "row": f"petatrain tune, {'shared cache' if shared else 'a cache per trial'}",
        "wall_s": wall,
        "bytes_fetched": fetched,
        "startup_s_median": statistics.median(starts),
        "startup_s": starts,
        "trials_finished": sum(t["status"] == "finished" for t in summary["trials"]),
        "eval_loss": {t["trial"]: t["eval_loss"] for t in summary["trials"]},
    }


def plain_trial(config: dict) -> None:
    """The same training in a plain Tune function trainable: model, data, AdamW, cosine schedule."""
    import math

    import torch
    from ray import tune

    from petatrain import config as job_config
    from petatrain.data.loading.stream import StreamingDataset
    from petatrain.models import build_model

    entered = time.time()
    torch.manual_seed(0)
    cfg = job_config.load(ROOT / "examples" / "tune.yaml")
    spec = build_model(cfg.model, cfg.train)
    opt = torch.optim.AdamW(spec.module.parameters(), lr=config["lr"], weight_decay=cfg.train.weight_decay)
    cache = os.path.join("/tmp", f"petatrain-plain-cache-{tune.get_context().get_trial_id()}")
    data = StreamingDataset(
        config["ds"], batch_size=cfg.train.global_batch, columns=["tokens"], cache_dir=cache, rank=0, world_size=1,
        drop_last=True,
    )  # fmt: skip
    batches, startup = data.iter_batches(), None
    for step in range(1, config["steps"] + 1):
        for group in opt.param_groups:  # cosine from lr to min_lr, as petatrain's recipe (no warm-up)
            frac = step / config["steps"]
            group["lr"] = cfg.train.min_lr + 0.5 * (config["lr"] - cfg.train.min_lr) * (1 + math.cos(math.pi * frac))
        tokens = torch.as_tensor(next(batches)["tokens"])[:, : cfg.model.seq_len + 1].to(torch.long)
        loss = spec.loss_fn(spec.module, tokens)
        opt.zero_grad()
        loss.backward()
        opt.step()
        startup = startup if startup is not None else time.time() - entered
        if step % cfg.train.eval_every == 0:
            tune.report({"train_loss": loss.item(), "step": step, "startup_s": startup})


def run_plain(ds: str, trials: int, steps: int) -> dict:
    from ray import tune

    for old in Path("/tmp").glob("petatrain-plain-cache-*"):
        shutil.rmtree(old, ignore_errors=True)
    out = WORK / "search-plain"
    shutil.rmtree(out, ignore_errors=True)
    tuner = tune.Tuner(
        tune.with_resources(plain_trial, {"cpu": 1}),
        param_space={"lr": tune.loguniform(3e-4, 3e-2), "ds": ds, "steps": steps},
        tune_config=tune.TuneConfig(num_samples=trials, metric="train_loss", mode="min"),
        run_config=tune.RunConfig(storage_path=str(out), name="plain", verbose=0),
    )
    started = time.perf_counter()
    grid = tuner.fit()
    wall = time.perf_counter() - started
    errors = [str(r.error) for r in grid if r.error]
    if errors:
        raise SystemExit(f"the plain Tune search failed: {errors[0][-2000:]}")
    starts = [r.metrics["startup_s"] for r in grid]
    return {
        "row": "Ray Tune function trainable (plain loop)",
        "wall_s": wall,
        "bytes_fetched": sum(folder_bytes(p) for p in Path("/tmp").glob("petatrain-plain-cache-*")),
        "startup_s_median": statistics.median(starts),
        "startup_s": starts,
        "trials_finished": len(grid),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    state = start_s3()
    try:
        from petatrain.runtime.cluster import init_ray

        ds = dataset()
        init_ray("", local_cpus=os.cpu_count() or 2)
        run_petatrain(ds, 1, 10, shared=True)  # warm-up, not recorded: Ray's worker processes, imports
        rows = [
            run_petatrain(ds, args.trials, args.steps, shared=True),
            run_petatrain(ds, args.trials, args.steps, shared=False),
            run_plain(ds, args.trials, args.steps),
        ]
    finally:
        stop_s3(state)
    shard_bytes = rows[0]["bytes_fetched"]  # the shared cache fetched each shard once
    base = rows[0]
    print(f"\n{args.trials} trials x {args.steps} steps, dataset on S3 ({shard_bytes / 1e6:.1f} MB of shards)")
    print(f"{'row':44} {'wall s':>8} {'x wall':>7} {'MB fetched':>11} {'x bytes':>8} {'start-up s':>11}")
    for r in rows:
        print(
            f"{r['row']:44} {r['wall_s']:8.1f} {r['wall_s'] / base['wall_s']:7.2f} {r['bytes_fetched'] / 1e6:11.2f} "
            f"{r['bytes_fetched'] / max(base['bytes_fetched'], 1):8.2f} {r['startup_s_median']:11.2f}"
        )
    write_results(
        "tune",
        {
            "trials": args.trials,
            "steps": args.steps,
            "dataset_shard_bytes": shard_bytes,
            "rows": rows,
            "load_avg_1m": os.getloadavg()[0],
        },
        machine_extra={"python": sys.version.split()[0]},
    )


if __name__ == "__main__":
    main()
