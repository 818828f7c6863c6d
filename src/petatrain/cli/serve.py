"""`serve`: a trained run's model over HTTP with Ray Serve, until Ctrl-C."""

from __future__ import annotations

import contextlib
import signal
import time
from typing import Annotated, Any

import typer

from petatrain import api
from petatrain.cli.common import Address, Json, Sets, ray_session, say, show, verb


@verb()
def serve(
    run: Annotated[
        str,
        typer.Argument(help="Run directory URL or path, or registry://NAME@champion (a registered model's version)."),
    ],
    checkpoint: Annotated[str, typer.Option(help="final, latest, or a checkpoint's step.")] = "final",
    host: Annotated[str, typer.Option(help="Address to listen on (loopback unless told otherwise).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port.")] = 8000,
    replicas: Annotated[str | None, typer.Option(help="Replicas: N, or MIN-MAX to autoscale (serve.replicas).")] = None,
    max_batch: Annotated[int | None, typer.Option(help="Requests completed together (serve.max_batch).")] = None,
    follow: Annotated[
        bool,
        typer.Option(
            help="With --checkpoint latest: switch to each new checkpoint; with registry://NAME@ALIAS: "
            "to each version the alias moves to."
        ),
    ] = False,
    registry: Annotated[
        str | None, typer.Option(help="The registry's URL (default: $PETATRAIN_REGISTRY, else .petatrain/registry).")
    ] = None,
    set_: Sets = None,
    address: Address = "",
    as_json: Json = False,
) -> None:
    """Serve a trained run's model with Ray Serve: POST /v1/completions, GET /v1/models, GET /healthz.

    The weights are checked against what the run committed before anything is served. The run's
    `serve:` config sets replicas, batching and autoscaling; the flags and --set serve.KEY=VALUE
    override it. Runs until Ctrl-C."""
    overrides = list(set_ or [])
    overrides += [f"serve.replicas={replicas}"] if replicas is not None else []
    overrides += [f"serve.max_batch={max_batch}"] if max_batch is not None else []
    ray_session(None)  # Ray's own logging into the log file (the run's TLS: api.serve, from its config)
    serving = api.serve(
        run, checkpoint=checkpoint, host=host, port=port, address=address, follow=follow, overrides=overrides,
        registry=registry,
    )  # fmt: skip
    # SIGTERM is how a pod (or systemd, or a supervisor) stops a server: the same as Ctrl-C. Set after
    # Ray's init, whose own handler would exit at once with Ray's C++ stack and leave its agents behind,
    # and before the server says it serves.
    signal.signal(signal.SIGTERM, _interrupt)
    show(serving.to_dict(), _serving)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        say("stopping")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal while the replicas stop
        with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C, likewise
            api.stop_serving(ray_too=True)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _serving(served: dict[str, Any]) -> None:
    m, url = served["model"], served["url"]
    say(f"serving {m['run']} ({m['source']}, step {m['step']}, {m['checksum']}) at {url}")
    say(f'  curl {url}/v1/completions -d \'{{"prompt": "Once", "max_tokens": 32}}\'')
