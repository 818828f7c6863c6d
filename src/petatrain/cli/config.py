"""`config`: the resolved job config, or the error naming a bad key."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from petatrain import config as config_mod
from petatrain.cli.common import Json, Sets, show, verb


@verb()
def show_config(
    config: Annotated[Path | None, typer.Argument(help="Job config YAML (default: built-in defaults).")] = None,
    set_: Sets = None,
    as_json: Json = False,
) -> None:
    """Print the resolved job config (YAML + --set overrides), or the error naming a bad key."""
    cfg = config_mod.load(config, list(set_ or []))
    show(cfg.to_dict(), lambda _: _yaml(cfg))


def _yaml(cfg: config_mod.JobConfig) -> None:
    sys.stdout.write(cfg.to_yaml())
