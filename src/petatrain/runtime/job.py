"""What a training run is asked to do (`TrainJob`, `Branch`, `EvalGate`) and how it ended (`RunResult`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from petatrain.chaos.inject import Injection
from petatrain.config import JobConfig
from petatrain.runtime.failures import Failure
from petatrain.storage import StorageOptions


@dataclass(kw_only=True, slots=True)
class TrainJob:
    config: JobConfig
    run_url: str
    options: StorageOptions | None = None  # None: the config's `storage` section
    address: str = ""
    injections: list[Injection] = field(default_factory=list)
    local_cpus: int = 0
    stop_after_s: float | None = None  # end the run (checkpointed, final weights) this long after it started
    # Set from any thread to end the run as stop_after_s does: at the step boundary after rank 0 hears
    # it (its next telemetry answer, within ~1 s), checkpointed, final weights written. For a program
    # that embeds the driver.
    stop: threading.Event | None = None
    # Continue the run the run directory holds (a RayJob retry, a lost head pod, a new cluster):
    # same run id, the next attempt number, from its newest committed checkpoint. Without it, a
    # run directory that holds a run is refused.
    resume: bool = False
    # Start from another run's checkpoint instead (`train --from`, PBT's exploit in petatrain.tune).
    branch: Branch | None = None
    # Hold the run after each evaluation until the gate releases it (a search's trial, petatrain.tune).
    gate: EvalGate | None = None

    def __post_init__(self) -> None:
        """An injection that could never fire is refused in one line, not left silent for the run."""
        from petatrain.errors import ConfigError

        most = self.config.parallel.worker_range()[1]
        for injection in self.injections:
            if injection.rank >= most:
                raise ConfigError(
                    f"--inject {injection.key}: rank {injection.rank}, but parallel.workers is at most {most} "
                    f"(ranks 0-{most - 1})"
                )
            if injection.step is not None and injection.step > self.config.train.steps:
                raise ConfigError(
                    f"--inject {injection.key}: step {injection.step} is after the run's last, "
                    f"train.steps {self.config.train.steps}"
                )

    def worker_options(self) -> StorageOptions:
        """Options for Ray processes: they may have started before the driver's AWS_* variables were set."""
        return (self.options or StorageOptions()).for_workers()


class EvalGate:
    """The run waits after each evaluation until `release(step)`: a search's trial lets it go on
    once Tune has taken the evaluation, so the run never trains past a decision it has not had
    (ASHA stopping it, PBT replacing its state)."""

    def __init__(self) -> None:
        self._hub: Any = None
        self._connected = threading.Event()

    def connect(self, hub: Any) -> None:
        self._hub = hub
        self._connected.set()

    def release(self, step: int) -> None:
        self._connected.wait()
        self._hub.release.remote(step)


@dataclass(frozen=True, slots=True)
class Branch:
    """Continue from checkpoint `step` of `source` (a run, or a folder laid out as one): its weights,
    optimizer, loader position and RNG, with this job's config. `label` names the source in the
    ledger ("trial 3f2a_00001", "RUN@STEP"). With `resume`, the run directory may hold a run
    already (a trial that exploits another): `may_change` are the config fields (dotted, or a
    section) that may then differ from that run's, besides what a resume may change."""

    source: str
    step: int
    label: str
    may_change: tuple[str, ...] = ()
    # `train --continue`: the loader's position is carried onto a later version of the dataset (its
    # new rows once, with data.replay of the old), and the run is a new one with its own config.
    carry: bool = False
    carried: dict[str, Any] | None = None  # what the carry-over pass holds (preflight.may_carry), for lineage

    def to_dict(self) -> dict[str, Any]:
        return {"from": self.label, "step": self.step, **({"carry": self.carried or True} if self.carry else {})}


@dataclass(kw_only=True, slots=True)
class RunResult:
    """How a run ended (also in its ledger): the run, its final weights, the step reached, the faults."""

    run: str
    final: str
    steps: int
    attempts: int
    failures: list[Failure]
    wall_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "final": self.final,
            "steps": self.steps,
            "attempts": self.attempts,
            "failures": [f.to_dict() for f in self.failures],
            "wall_s": self.wall_s,
        }

    def __getitem__(self, key: str) -> Any:
        """`result["steps"]`, for callers written when run() returned the dict."""
        return self.to_dict()[key]
