"""What every verb shares: the ceremony around its body (`verb`), one-line errors, --json's claim on
stdout, Ray's TLS and quiet logging (`ray_session`), showing the result (`show`), the option types
several verbs take, and flags generated from a config dataclass's fields (`dataclass_flags`)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import sys
import typing
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from petatrain import api, constants
from petatrain import console as quiet
from petatrain.config import JobConfig

console = Console(stderr=True)
console.soft_wrap = not console.is_terminal  # a CI log: no line (no path) wrapped at 80 columns

DEMO_ROOT = ".petatrain"

F = TypeVar("F", bound=Callable[..., Any])

# -- options several verbs take -------------------------------------------------------------------

Sets = Annotated[list[str] | None, typer.Option("--set", help="Config override a.b=c (repeatable).")]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
Address = Annotated[
    str, typer.Option(help="Ray cluster address (default: RAY_ADDRESS's cluster if set, else start a local Ray).")
]
StorageConfig = Annotated[Path | None, typer.Option(help="Job config YAML; its storage section is used.")]
RunDir = Annotated[str | None, typer.Option("--run-dir", help="Run directory (local path or s3://...).")]
Injects = Annotated[
    list[str] | None, typer.Option("--inject", help="Fault to inject, e.g. kill@step=17,rank=1 (repeatable).")
]


# -- errors and progress: stderr ------------------------------------------------------------------


def fail(message: str, code: int = 2) -> typing.NoReturn:
    """The one `error: ...` line on stderr, and exit `code` (2: the user's error)."""
    console.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def guarded(fn: Callable[[], Any]) -> Any:
    """`fn()`, any error it raises one line on stderr: exit 2 for a PetatrainError (the user's to
    fix), 1 for anything else, 130 for Ctrl-C; PETATRAIN_DEBUG=1 lets the traceback through."""
    try:
        return fn()
    except typer.Exit:
        raise
    except KeyboardInterrupt:
        fail("interrupted", 130)
    except Exception as exc:
        if os.environ.get(constants.DEBUG_ENV):
            raise
        fail(*quiet.explain(exc))


def say(line: str) -> None:
    """A progress line on stderr (markup allowed)."""
    console.print(line, highlight=False, soft_wrap=True)


# -- --json: stdout carries one object ------------------------------------------------------------

_json_out: Any = None  # where --json's object goes once `claim_stdout` moved everything else


def claim_stdout(as_json: bool) -> None:
    """With --json, stdout carries one JSON object. Every verb calls this first: from then on, to
    the end of the process, whatever is written to file descriptor 1 (Ray's log forwarding, also at
    exit; the processes Ray starts; print) goes to stderr, and the object goes to the original stdout."""
    global _json_out
    if not as_json or _json_out is not None:
        return
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (captured, in-process): nothing to move
        return
    sys.stdout.flush()
    _json_out = os.fdopen(os.dup(fd), "w")
    os.dup2(sys.stderr.fileno(), fd)


def print_json(obj: Any, *, line: bool = False) -> None:
    """`obj` as JSON on the claimed stdout; `line`: on one line (JSON Lines, for a verb that goes on)."""
    stream = _json_out or sys.stdout
    stream.write(json.dumps(obj, indent=None if line else 2, default=str) + "\n")
    stream.flush()


# -- the ceremony ---------------------------------------------------------------------------------


@dataclass
class _Running:
    """The verb this process runs: whether it prints JSON, and Ray's log records once it routed them."""

    as_json: bool
    ray_log: str
    logs: quiet.RayLogs | None = None

    def finish_logs(self) -> None:
        if self.logs:
            self.logs.finish(self.ray_log)


_running: ContextVar[_Running | None] = ContextVar("petatrain_cli_verb", default=None)


def _now() -> _Running:
    running = _running.get()
    if running is None:
        raise RuntimeError("petatrain.cli: show() and ray_session() run inside a @verb")
    return running


def verb(*, ray_log: str = "petatrain.log") -> Callable[[F], F]:
    """The ceremony around a verb's body, the same for every verb:

    1. with --json (the verb's `as_json` parameter) stdout is claimed first (`claim_stdout`);
    2. the body runs `guarded`: an error is one `error: ...` line on stderr, exit 2 or 1;
    3. in the body, `ray_session(cfg)` sets Ray's TLS from the config and moves Ray's own logging off
       the console, before anything loads Ray;
    4. `show(result, renderer)` finishes that log (a run's `logs/ray-driver.log` once the run claimed
       it, else `ray_log` in the temp folder's petatrain-logs/) and prints the one JSON object or
       renders the result.

    The decorated function keeps its signature: typer reads its parameters and docstring."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            state = _Running(as_json=bool(kwargs.get("as_json", False)), ray_log=ray_log)

            def body() -> Any:
                claim_stdout(state.as_json)
                token = _running.set(state)
                try:
                    done = fn(*args, **kwargs)
                    state.finish_logs()  # a body that showed nothing: its log is kept all the same
                    return done
                finally:
                    _running.reset(token)

            return guarded(body)

        return typing.cast(F, run)

    return decorate


def ray_session(cfg: JobConfig | None) -> quiet.RayLogs | None:
    """Before anything loads Ray: its TLS as `cfg.resources.tls` says (none without a config), then
    its driver logging off the console into a `RayLogs` (None with --verbose or PETATRAIN_DEBUG)."""
    running = _now()
    if cfg is not None:
        api.use_ray_tls(cfg)
    running.logs = quiet.quiet_ray()
    return running.logs


def show(result: Any, renderer: Callable[[Any], None]) -> None:
    """The verb's result: one JSON object with --json, else `renderer(result)`; Ray's log finished first."""
    running = _now()
    running.finish_logs()
    if running.as_json:
        print_json(result.to_dict() if hasattr(result, "to_dict") else result)
    else:
        renderer(result)


# -- flags from a config dataclass ----------------------------------------------------------------

_FLAG_TYPES = (str, int, float)


def _flag_help(f: dataclasses.Field, hint: Any) -> str:
    text = f.metadata.get("help", "")
    if not text and typing.get_origin(hint) is Literal:
        text = "|".join(str(value) for value in typing.get_args(hint))
    default = f.metadata.get("default_help", f.default)
    return f"{text} (default: {default})" if default not in ("", None) else text


def dataclass_flags(cls: type, *, into: str) -> Callable[[F], F]:
    """One `--FIELD` option (`--text-field` for `text_field`) for every field of the config dataclass
    `cls`, in place of the decorated function's parameter `into`, which receives {field: value} of the
    flags given (a flag left out is not there, so the config's own value holds). Each option's help
    is the field's `help` metadata (a Literal field's values without one) and its default, or its
    `default_help` metadata; a Literal is taken as a string and checked where the config is built."""
    hints = typing.get_type_hints(cls)
    flags: list[inspect.Parameter] = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        kind = str if typing.get_origin(hint) is Literal else hint
        if kind not in _FLAG_TYPES:
            raise TypeError(f"{cls.__name__}.{f.name}: no flag for a {hint}")
        option = typer.Option(f"--{f.name.replace('_', '-')}", help=_flag_help(f, hint))
        annotation = Annotated[kind | None, option]  # type: ignore[valid-type]
        flags.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation))
    names = [p.name for p in flags]

    def decorate(fn: F) -> F:
        signature = inspect.signature(fn, eval_str=True)
        own = list(signature.parameters)
        if into not in own or set(names) & set(own):
            raise TypeError(f"{fn.__name__}: needs a parameter {into!r} and none named like a field of {cls.__name__}")
        at = own.index(into)
        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in signature.parameters.values()]
        params[at : at + 1] = flags

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            values = {name: kwargs.pop(name, None) for name in names}
            return fn(*args, **kwargs, **{into: {k: v for k, v in values.items() if v is not None}})

        call.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        return typing.cast(F, call)

    return decorate
