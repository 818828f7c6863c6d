"""The only code that talks to Ray.

    driver.py      run(TrainJob) -> RunResult: sets a run up, then supervises its attempts
    job.py         TrainJob, Branch, EvalGate, RunResult: what a run is asked and how it ended
    setup.py       the set-up: the run directory's lease and prior run, Ray, the run hub
    preflight.py   the checks before anything starts: config, dataset, pinning, may it continue
    endpoints.py   the metrics' discovery file and the health endpoint's server
    supervisor.py  the attempt loop as a state machine; restart and world-size policies (typed decisions)
    attempts.py    RayAttempts: the supervisor's attempts on Ray Train
    failures.py    FailureCause, per-rank RankError / AttemptFailed (pickle-safe), classify()
    trainer.py     one attempt on Ray Train: the TorchTrainer, fit()
    watchdog.py    hang detection from the ranks' heartbeats
    hub/           the run hub: RunHub, the run's actor (hub/actor.py), delegating to plain classes
                   (ledger, heartbeats, checkpoint parts, fired injections, ...)
    health.py      the driver's /livez and /readyz
    worker.py      what a rank gets from Ray (RankEnv: rank, world, node, device, hub channel)
    cluster.py     start/join Ray, alive nodes, leftover placement groups, killing a process
    tls.py         Ray's TLS certificates
    ingest_task.py an ingest's driver run on the cluster (for a Ray Client driver)
    startup/       optional start-up speed-ups (the lean trainer, the standby, spares): skip on a first read
    _ray/          the one corner that imports Ray's private modules (tests/test_ray_internals.py)

Modules here import Ray lazily (inside functions) where they can: `import ray` takes a while,
and a command that fails on its config should not pay for it.
"""
