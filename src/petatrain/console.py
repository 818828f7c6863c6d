"""A quiet console: Ray's own output goes to log files, the terminal shows petatrain's progress.

Ray prints a lot a user of petatrain did not ask for: Ray Data's progress lines, warnings at
start-up, every worker's stdout and, when a worker is killed on purpose, the raylet's notice
and a traceback from each survivor. By default all of that goes to files (`RayLogs`), and
the console shows what petatrain renders from its own events (`TrainProgress`,
`IngestProgress`): stages, steps with loss and tokens/s, and one line per fault.
`PETATRAIN_DEBUG=1` or `petatrain --verbose` brings Ray's output back to the terminal.

This module imports neither Ray nor rich at the top: `runtime.cluster.init_ray` asks it
whether Ray's output belongs on the console before Ray starts.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any, ClassVar

from petatrain import constants
from petatrain.errors import PetatrainError
from petatrain.observe import events as ev

# Where Ray keeps the logs of the processes it starts (a documented link to the newest session).
RAY_SESSION_LOGS = os.path.join(tempfile.gettempdir(), "ray", "session_latest", "logs")
_BUFFERED = 20_000  # log records kept before a file is chosen (more are dropped, counted)
# What a Ray Client's server logs reaches its driver through this logger, which does not propagate:
# without a handler of its own, Python's last resort printed its warnings on the console.
RAY_CLIENT_SERVER_LOG = "ray.util.client.logsclient"


def set_verbose(flag: bool) -> None:
    """`petatrain --verbose`: Ray's output on the console, for this process and the ones it starts."""
    if flag:
        os.environ[constants.VERBOSE_ENV] = "1"


def ray_output_to_console() -> bool:
    """Whether Ray's own logging and its workers' output belong on the console."""
    return bool(os.environ.get(constants.DEBUG_ENV) or os.environ.get(constants.VERBOSE_ENV))


class RayLogs(logging.Handler):
    """Receives the driver's Ray log records (loggers `ray`, `ray.data`, `ray.train`, ...) in
    place of Ray's console handlers. Records are kept in memory until `attach` names a file
    (a run's folder exists only once the run has claimed it), then written there."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.path: str | None = None
        self._file: logging.FileHandler | None = None
        self._pending: list[logging.LogRecord] = []
        self.dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        if self._file is not None:
            self._file.emit(record)
        elif len(self._pending) < _BUFFERED:
            self._pending.append(record)
        else:
            self.dropped += 1

    def attach(self, path: str) -> str:
        """Write what came so far, and everything from now on, to `path` (appending)."""
        self.acquire()
        try:
            if self._file is None:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                self._file = logging.FileHandler(path, encoding="utf-8")
                self._file.setFormatter(self.formatter)
                self.path = path
                for record in self._pending:
                    self._file.emit(record)
                self._pending.clear()
            return self.path or path
        finally:
            self.release()

    def finish(self, default_name: str) -> str:
        """The file the records went to; with none attached yet, `default_name` (its stem, the
        time and this process's id) in the temp folder's `petatrain-logs/`; "" if none came."""
        if self._file is None and not self._pending:
            return ""
        if self._file is None:
            stem, ext = os.path.splitext(default_name)
            name = f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}{ext}"
            self.attach(os.path.join(tempfile.gettempdir(), "petatrain-logs", name))
        assert self._file is not None
        self._file.flush()
        return self.path or ""

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        super().close()


_ROUTED: RayLogs | None = None


def quiet_ray() -> RayLogs | None:
    """Move the driver's Ray logging off the console into a `RayLogs` (once per process); None
    when Ray's output belongs on the console."""
    global _ROUTED
    if ray_output_to_console():
        return None
    if _ROUTED is not None:
        return _ROUTED
    import ray  # noqa: F401  (importing Ray adds its console handler, taken off below)

    _ROUTED = RayLogs()
    atexit.register(_ROUTED.finish, "petatrain.log")  # a command that failed keeps Ray's records too
    for name in ("ray", "ray.data", "ray.train", "ray.tune", "ray.serve", RAY_CLIENT_SERVER_LOG):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                logger.removeHandler(handler)
        if name in ("ray", "ray.data", RAY_CLIENT_SERVER_LOG):  # the others propagate to `ray`
            logger.addHandler(_ROUTED)
    return _ROUTED


# -- one line for an error -----------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # Ray colours the task tracebacks it forwards
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_DEBUG_HINT = "PETATRAIN_DEBUG=1 shows the traceback"


def explain(exc: Exception) -> tuple[str, int]:
    """The one line the CLI prints for `exc`, and the exit code: 2 for a PetatrainError, even
    one raised in a Ray task; 1, naming the exception and where it was raised, for any other."""
    cause = _cause(exc)
    if isinstance(cause, PetatrainError):
        return one_line(str(cause)), 2
    if cause is not exc and cause.__traceback__ is None:
        # Raised in a Ray task: the exception came back pickled, its traceback only as text. Ray
        # Data wraps what a map raised in a UserCodeException, and pickling dropped __cause__,
        # so the text is all there is of it.
        found = _task_exception(str(exc))
        if found:
            what, where = found
            qualname, _, message = what.partition(": ")
            module, _, name = qualname.rpartition(".")
            raised = getattr(sys.modules.get(module), name, None)
            if isinstance(raised, type) and issubclass(raised, PetatrainError):
                return one_line(message), 2
            return _unexpected(what, where), 1
    if type(cause).__module__.startswith("ray."):  # a process died, a node was lost...
        return f"Ray: {type(cause).__name__}: {_first_line(str(cause))} ({_DEBUG_HINT})", 1
    frames = traceback.extract_tb(cause.__traceback__)
    where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    return _unexpected(f"{type(cause).__name__}: {_first_line(str(cause))}", where), 1


def _cause(exc: BaseException) -> BaseException:
    """What to tell the user about `exc`: the first PetatrainError along its chain (through
    `raise ... from` and Ray's wrappers), else what a Ray task raised, else `exc`."""
    seen: set[int] = set()
    shown = None
    node: BaseException | None = exc
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        inner = getattr(node, "cause", None)
        if isinstance(inner, BaseException):  # RayTaskError(X) is an X, but prints Ray's traceback
            node = inner
            continue
        if isinstance(node, PetatrainError):
            return node
        shown = shown or node
        node = node.__cause__
    return shown or exc


def _task_exception(text: str) -> tuple[str, str] | None:
    """("Type: message", "file:line in function") of the innermost exception in the text of a
    Ray task error, which lists it first: a header, its frames, its line, then any wrappers."""
    lines = _ANSI.sub("", text[:50_000]).split("\n\n")[0].splitlines()
    framed = [i for i, line in enumerate(lines) if _FRAME.search(line)]
    if not framed:
        return None
    what = next((line for line in lines[framed[-1] + 1 :] if line and not line[0].isspace()), "")
    frame = _FRAME.search(lines[framed[-1]])
    assert frame is not None  # framed lists the lines it matches
    file, line, function = frame.groups()
    return what, f"{os.path.basename(file)}:{line} in {function}"


def _unexpected(what: str, where: str) -> str:
    at = f" at {where}" if where else ""
    return f"unexpected {one_line(what)}{at}: a bug in petatrain, or a file it read is corrupt ({_DEBUG_HINT})"


def _first_line(text: str) -> str:
    return next((line for line in _ANSI.sub("", text[:10_000]).splitlines() if line.strip()), "")


def one_line(text: str, limit: int = 1000) -> str:
    """`text` without colour codes, its lines joined, at most `limit` characters."""
    line = " ".join(_ANSI.sub("", text[: 4 * limit]).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


# -- progress, rendered from petatrain's own events -----------------------------------------


def _fmt(value: float | None, digits: int = 4) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


class TrainProgress:
    """Renders a run's ledger events as they arrive: a line every `every` steps (loss, tokens/s),
    one line per fault, one when training resumes after it, and the run's end."""

    def __init__(self, write: Callable[[str], None], *, total_steps: int, every: int = 10, targets: str = ""):
        self.write, self.total, self.every = write, total_steps, every
        self.targets = targets  # the run's Prometheus file_sd file, named beside the metrics' URL
        self._seen: set[tuple[int, int]] = set()
        self._injected: dict[int, ev.FaultInjected] = {}  # attempt -> the fault injected in it
        self._resumed: set[int] = set()
        self._world: dict[int, int] = {}  # attempt -> its worker count

    def __call__(self, e: ev.Event) -> None:
        """Show what an event (from `observe.ledger.LedgerFollower`) says, if anything."""
        if isinstance(e, ev.Step):
            self._on_step(e)
        elif isinstance(e, ev.RunStart | ev.RunContinue) and e.metrics:
            where = f"  (Prometheus file_sd: {self.targets})" if self.targets else ""
            self.write(f"metrics: {e.metrics}{where}")
        elif isinstance(e, ev.FaultInjected):
            self._injected[e.attempt] = e
        elif isinstance(e, ev.AttemptStart):
            self._world[e.attempt] = e.world_size
        elif isinstance(e, ev.Failure):
            self._on_failure(e)
        elif isinstance(e, ev.Resume):
            self._on_resume(e)
        elif isinstance(e, ev.End) and e.status != "ok":
            self.write(f"[red]run failed[/red]: {' '.join(e.detail.split())[:200]}")

    def _on_step(self, e: ev.Step) -> None:
        key = (e.attempt, e.step)
        if key in self._seen:
            return
        self._seen.add(key)
        if e.step % self.every and e.step != self.total:
            return
        rate = e.tokens / e.step_s if e.tokens and e.step_s else None
        speed = f"  {rate:,.0f} tokens/s" if rate else ""
        self.write(f"step {e.step:>6}/{self.total}  loss {_fmt(e.loss)}{speed}")

    def _on_failure(self, e: ev.Failure) -> None:
        if e.cause == "resize":  # not a fault: the cluster grew back
            detail = e.detail.rpartition(": ")[2]
            self.write(f"[cyan]resize[/cyan]: the cluster has room for more workers again ({detail}); restarting")
            return
        injected = self._injected.get(e.attempt)
        if injected is not None and injected.fault == e.cause:
            rank = "" if injected.rank is None else f" on rank {injected.rank}"
            where = f" at step {injected.step}" if injected.step is not None else ""
            self.write(f"[yellow]fault[/yellow] {e.cause}{rank}{where} (injected); recovering")
            return
        rank = "" if e.rank is None else f" on rank {e.rank}"
        detail = " ".join(e.detail.split())[:160]
        self.write(f"[yellow]fault[/yellow] {e.cause}{rank}: {detail}")

    def _on_resume(self, e: ev.Resume) -> None:
        attempt = e.attempt
        if attempt == 0 or attempt in self._resumed:
            return
        self._resumed.add(attempt)
        source = "its latest checkpoint" if e.checkpoint else "the start (no checkpoint yet)"
        world = self._world.get(attempt)
        workers = f" on {world} workers" if world is not None and world != self._world.get(attempt - 1) else ""
        self.write(f"[green]recovered[/green]: attempt {attempt + 1} resumes at step {e.step}{workers} from {source}")


class IngestProgress:
    """One line as each ingest stage ends, with its time."""

    NAMES: ClassVar[dict[str, str]] = {
        "ray_init": "Ray started",
        "split": "large files split at record boundaries",
        "read_clean_sign": "read, cleaned and signed",
        "dedup": "deduplicated",
        "tokenizer": "tokenizer ready",
        "write": "shards written",
        "commit": "committed",
    }

    DOING: ClassVar[dict[str, str]] = {"read_clean_sign": "reading, cleaning, signing", "write": "writing shards"}

    def __init__(
        self,
        write: Callable[[str], None],
        *,
        terminal: bool | None = None,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.write, self.every_s, self.clock = write, every_s, clock
        self.terminal = sys.stderr.isatty() if terminal is None else terminal
        self._started: dict[str, float] = {}
        self._said: dict[str, float] = {}
        self._bar: Any = None

    def __call__(self, stage: str, what: str) -> None:
        if what == "start":
            self._started[stage] = self._said[stage] = self.clock()
            return
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        took = self.clock() - self._started.pop(stage, self.clock())
        self.write(f"ingest: {self.NAMES.get(stage, stage)} ({took:.1f} s)")

    def progress(self, stage: str, p: Any) -> None:
        """While a stage runs (`StageProgress`): a bar on a terminal; elsewhere a line every `every_s`."""
        doing = self.DOING.get(stage, stage)
        if self.terminal:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            if self._bar is None:
                self._bar = Progress(
                    TextColumn(f"ingest: {doing}"), BarColumn(), TextColumn("{task.description}"),
                    TimeRemainingColumn(), transient=True,
                )  # fmt: skip
                self._task = self._bar.add_task("", total=p.bytes_total or p.items_total)
                self._bar.start()
            self._bar.update(self._task, completed=p.bytes or p.items, description=self._counts(p))
            return
        now = self.clock()
        if now - self._said.get(stage, now) < self.every_s:
            return
        self._said[stage] = now
        eta = p.eta_s
        left = f", about {_duration(eta)} left" if eta is not None and p.items < p.items_total else ""
        self.write(f"ingest: {doing}: {self._counts(p)}{left}")

    @staticmethod
    def _counts(p: Any) -> str:
        size = f", {_bytes(p.bytes)} of {_bytes(p.bytes_total)}" if p.bytes_total else f", {_bytes(p.bytes)}"
        return f"{p.items:,}/{p.items_total:,}{size}, {p.rows:,} rows"


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _duration(seconds: float) -> str:
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{(whole % 3600) // 60:02d}m"
