"""The only code that talks to Ray.

    driver.py      run(TrainJob) -> RunResult: prepares a run, hands its attempts to the supervisor
    supervisor.py  the attempt loop as a state machine; restart and world-size policies (typed decisions)
    failures.py    FailureCause, per-rank RankError / AttemptFailed (pickle-safe), classify()
    trainer.py     one attempt on Ray Train: the TorchTrainer, the standby controller, fit()
    watchdog.py    hang detection from the ranks' heartbeats
    hub.py         RunHub: the run's actor (ledger, heartbeats, checkpoint parts, fired injections)
    worker.py      what a rank gets from Ray (RankEnv: rank, world, node, device, hub channel)
    spares.py      pre-started worker processes for the next attempt
    cluster.py     start/join Ray, alive nodes, leftover placement groups, killing a process
    constants.py   every Ray tunable and environment variable petatrain sets or reads
    _ray/          the one corner that imports Ray's private modules (tests/test_ray_internals.py)

Modules here import Ray lazily (inside functions) where they can: `import ray` takes a while,
and a command that fails on its config should not pay for it.
"""
