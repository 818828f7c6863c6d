"""Where `run(TrainJob)` was: the driver is `petatrain.runtime.driver` (the only code that talks to Ray)."""

from petatrain.runtime.driver import RunResult, TrainJob, run

__all__ = ["RunResult", "TrainJob", "run"]
