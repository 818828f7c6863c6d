"""Data verbs: `ingest`, `inspect`, and the `demo` that ingests, streams and trains end to end."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

import petatrain
from petatrain import api, render
from petatrain import config as config_mod
from petatrain import console as quiet
from petatrain.cli.common import (
    DEMO_ROOT,
    Address,
    Json,
    Sets,
    StorageConfig,
    console,
    dataclass_flags,
    fail,
    ray_session,
    say,
    show,
    verb,
)
from petatrain.cli.train import run_training


@verb(ray_log="petatrain-ingest.log")
@dataclass_flags(config_mod.IngestConfig, into="settings")
def ingest(
    sources: Annotated[list[str], typer.Argument(help="Files, folders, globs or URLs (s3://...) to ingest.")],
    out_: Annotated[str, typer.Option("--out", help="Dataset URL or path to write.")],
    settings: dict[str, Any],  # --format, --text-field, ...: a flag for each ingest.* key (config.IngestConfig)
    append: Annotated[bool, typer.Option("--append", help="Add new source files to an existing dataset.")] = False,
    register: Annotated[bool, typer.Option("--register", help="Index existing Parquet files in place.")] = False,
    refresh: Annotated[
        bool,
        typer.Option(
            "--refresh", help="With --register: make the index exactly the folder's current files (after a rewrite)."
        ),
    ] = False,
    encrypt: Annotated[
        str | None,
        typer.Option(
            "--encrypt",
            metavar="KEYREF",
            help="Encrypt the shards (Parquet modular encryption) with these keys (file:PATH or barbican+https://...): "
            "shorthand for --set storage.encryption.key=KEYREF.",
        ),
    ] = None,
    address: Address = "",
    local_cpus: Annotated[int, typer.Option(help="CPUs for the local Ray (0: all); unused when joining one.")] = 0,
    config: Annotated[
        Path | None, typer.Option(help="Job config YAML; its ingest and storage sections are used.")
    ] = None,
    set_: Sets = None,
    as_json: Json = False,
) -> None:
    """Ingest raw files into a clean, deduplicated, sharded Parquet dataset (on Ray Data).

    Settings come from the config's `ingest:` section; a flag you give overrides it, and --set overrides both."""
    flags = [f"ingest.{key}={json.dumps(value)}" for key, value in settings.items()]
    if encrypt is not None:
        flags.append(f"storage.encryption.key={json.dumps(encrypt)}")
    job_cfg = config_mod.load(config, flags + list(set_ or []))
    ray_session(job_cfg)
    progress = None if as_json else quiet.IngestProgress(say)
    summary = api.ingest(
        sources,
        out_,
        config=job_cfg.ingest,
        append=append,
        register=register,
        refresh=refresh,
        address=address or job_cfg.resources.address,
        local_cpus=local_cpus,
        options=job_cfg.storage.options(),
        on_stage=progress,
        on_progress=progress.progress if progress else None,
    )
    show(summary.to_dict(), render.ingest)


@verb()
def inspect(
    dataset: Annotated[str, typer.Argument(help="Dataset URL or path.")],
    verify: Annotated[bool, typer.Option("--verify", help="Re-hash every shard; fail naming each bad one.")] = False,
    samples: Annotated[int, typer.Option(help="Sample rows to show.")] = 3,
    config: StorageConfig = None,
    set_: Sets = None,
    as_json: Json = False,
) -> None:
    """Show a dataset's schema, counts and sample rows; --verify checks every shard."""
    options = config_mod.load(config, list(set_ or [])).storage.options()
    report = api.inspect(dataset, options=options, verify=verify, samples=samples)
    show(report.to_dict(), render.inspect)
    if verify and report.problems:
        for line in report.problems:
            console.print(f"[red]{escape(line)}[/red]", highlight=False, soft_wrap=True)
        fail(f"{len(report.problems)} of {report.shards} shards missing or corrupt", 1)


@verb(ray_log="petatrain-demo.log")
def demo(
    root: Annotated[str, typer.Option(help="Where the demo corpus, dataset and run go.")] = DEMO_ROOT,
    documents: Annotated[int, typer.Option(help="Unique documents to generate.")] = 3000,
    train_: Annotated[bool, typer.Option("--train/--no-train", help="End with the training demo.")] = True,
    as_json: Json = False,
) -> None:
    """Generate a corpus with duplicates and bad records, ingest it, stream it with 2 ranks
    resuming half-way with 3, then train a small GPT on 2 workers through a worker kill."""
    corpus_dir = os.path.join(root, "demo-corpus")
    dataset = os.path.join(root, "datasets", "demo")
    if not os.path.isdir(corpus_dir):
        say(f"generating a synthetic corpus in {corpus_dir}")
        api.synthetic_corpus(corpus_dir, documents=documents, files=4)
    # Byte tokens packed into rows of 65 (64 inputs + 1 target), in shards small enough
    # that the last one can be held out for evaluation.
    ingest_cfg = config_mod.IngestConfig(tokenizer="bytes", pack_length=65, shard_size="1MB")
    logs = ray_session(None)
    on_stage = None if as_json else quiet.IngestProgress(say)
    summary = api.ingest(
        [corpus_dir], dataset, config=ingest_cfg, on_stage=on_stage, on_progress=on_stage.progress if on_stage else None
    )
    report = api.inspect(dataset, verify=True, samples=1)
    stream = api.check_resume(dataset)
    result: dict[str, Any] = {"ingest": summary.to_dict(), "inspect": report.to_dict(), "stream": stream.to_dict()}
    if not as_json:
        render.ingest(summary.to_dict())
        render.inspect(report.to_dict())
        render.stream(stream.to_dict())
    if not stream.exactly_once:
        fail("the loader did not deliver every sample exactly once", 1)
    if train_:
        result["train"] = _demo_train(root, dataset, as_json, logs)
    show(result, render.demo_next)


def _demo_train(root: str, dataset: str, as_json: bool, logs: quiet.RayLogs | None) -> dict[str, Any]:
    example = Path(petatrain.__file__).resolve().parents[2] / "examples" / "tiny.yaml"  # in a source checkout
    cfg = config_mod.load(example if example.exists() else None, [f"data.dataset={dataset}"])
    run_dir = os.path.join(root, "runs", "demo")
    api.remove_run(run_dir)  # a fresh run each time: resuming a finished run would train nothing
    if not as_json:
        render.out.print(
            f"\n[bold]training[/bold] a {cfg.model.n_layer}-layer GPT on 2 workers; rank 1 is killed at step 17"
        )
    result = run_training(cfg, run_dir, "", ["kill@step=17,rank=1"], as_json, logs)
    samples = api.sample(cfg, result.run, ["the ", "data "], new_tokens=60)
    if not as_json:
        render.training(result)
        for text in samples:
            render.out.print(f"[bold]sample[/bold] {text!r}", highlight=False)
    return {**result.fields, "goodput": result.report.goodput, "samples": samples}


dataset_app = typer.Typer(
    help="Dataset versions: events (what each commit added), gc (remove old ones nothing names).",
    no_args_is_help=True,
)


@dataset_app.command("events")
@verb()
def dataset_events(
    dataset: Annotated[str, typer.Argument(help="Dataset URL or path.")],
    after: Annotated[int, typer.Option(help="Only the versions after this one (the last a poller handled).")] = 0,
    config: StorageConfig = None,
    set_: Sets = None,
    as_json: Json = False,
) -> None:
    """The dataset's commit log: a dataset.committed event per version (rows, tokens and shards
    added, duplicates dropped, the record's SHA-256), oldest first."""
    options = config_mod.load(config, list(set_ or [])).storage.options()
    show(api.dataset_events(dataset, after=after, options=options), render.dataset_events)


@dataset_app.command("gc")
@verb()
def dataset_gc(
    dataset: Annotated[str, typer.Argument(help="Dataset URL or path.")],
    keep: Annotated[int, typer.Option(help="The latest versions kept whatever names them.")] = 5,
    runs: Annotated[
        list[str] | None,
        typer.Option(
            "--runs",
            help="A folder of run directories whose pinned versions are kept (repeatable; default .petatrain/runs).",
        ),
    ] = None,
    registry: Annotated[str | None, typer.Option(help="The registry whose versions' datasets are kept.")] = None,
    config: StorageConfig = None,
    set_: Sets = None,
    as_json: Json = False,
) -> None:
    """Remove old versions of a dataset (their records and index files; shards are shared), never
    one that a run or a registered model still names: it says which."""
    options = config_mod.load(config, list(set_ or [])).storage.options()
    done = api.dataset_gc(dataset, keep=keep, runs=list(runs or []), registry=registry, options=options)
    show(done, render.dataset_gc)
