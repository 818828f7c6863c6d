"""Optional start-up speed-ups: a restart's attempt reaches its first step sooner with them, and
trains the same without them. A reader following how a run recovers can skip this package.

    lean.py     petatrain's lean TorchTrainer (`runtime/_ray/trainer.py`, `_ray/controller.py`): no Ray
                Train helper processes petatrain does not use, and Ray Train's controller run by the
                driver. No switch: it falls back to Ray's stock TorchTrainer by itself where Ray's
                internals moved (tests/test_ray_internals.py says which); PETATRAIN_CONTROLLER=actor
                runs the controller as an actor, as Ray Train does.
    standby.py  the next attempt's controller, started while this attempt trains (only where the
                controller is an actor). Off: `faults.standby: false`.
    spares.py   the next attempt's worker processes, started and imported while this attempt trains.
                Off: `faults.spares: false` (also off where `faults.max_restarts` is 0).
    forkserver.py every rank process forked from one process per node that imported torch, TorchDynamo
                and Ray Train once (not through Ray Client). Off: `faults.forkserver: false`.

benchmarks/recovery.py measures what each saves.
"""
