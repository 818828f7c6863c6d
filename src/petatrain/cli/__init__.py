"""`petatrain` command line: parse, call `petatrain.api`, show the result (rich tables or --json).

The verbs live by group (data, train, tune, serve, plan, config, keys, deploy); `common` holds the
ceremony each one shares (`verb`: --json's claim on stdout, one-line errors, Ray's TLS and quiet
logging, the result shown) and the option types. This module builds the typer app from them, in
the order `petatrain --help` lists them."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from petatrain import console as quiet
from petatrain.cli import config, data, deploy, keys, loop, models, plan, serve, train, tune
from petatrain.cli.common import claim_stdout, guarded, print_json

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="petatrain: ingest, stream and train on petabyte-scale data.",
)


@app.callback()
def main(
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Log progress details, and show Ray's own output.")
    ] = False,
) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    quiet.set_verbose(verbose)


for name, verb in (
    ("ingest", data.ingest),
    ("inspect", data.inspect),
    ("demo", data.demo),
    ("config", config.show_config),
    ("train", train.train),
    ("tune", tune.tune),
    ("chaos", train.chaos),
    ("report", train.report),
    ("lineage", train.lineage),
    ("evaluate", models.evaluate),
    ("promote", models.promote),
    ("rollback", models.rollback),
    ("loop", loop.loop),
    ("serve", serve.serve),
    ("plan", plan.plan),
    ("profile", train.profile),
):
    app.command(name)(verb)
del name, verb
app.add_typer(data.dataset_app, name="dataset")
app.add_typer(models.mlflow_app, name="mlflow")
app.add_typer(keys.keys_app, name="keys")
app.add_typer(keys.access_app, name="access")
app.add_typer(deploy.deploy_app, name="deploy")

# The names the single-module CLI had, for scripts and tests that use them.
_guarded = guarded
_claim_stdout = claim_stdout
_print_json = print_json

__all__ = ["app", "main"]
