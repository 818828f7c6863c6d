"""The run hub: one small Ray actor per run, on the driver's node, that outlives worker restarts.

`actor.py` is the actor (`RunHub`): it only delegates, each concern to a plain class that
imports no Ray and is tested without it (tests/test_hub.py):

    ledger.py      Ledger (events in order, flushed every few seconds), StepHold (a finished run's
                   continuation writes nothing until it trains a step)
    phase.py       RunPhase (the state the health endpoint reports), PlacementGroups (the attempts')
    metrics.py     Metrics: the Prometheus endpoint fed by every event, and its last scrape
    attempt.py     Attempt (the current attempt and the one condition every wait uses), Heartbeats,
                   Drain (a failed attempt's lost ranks), Resizes
    watch.py       HangWatch (the watchdog's long poll), EvalHold (rank 0 waits after an evaluation)
    parts.py       PartsRendezvous: every rank's checkpoint part, for rank 0 to commit
    injections.py  FiredInjections: each injected fault fires once per run
    handle.py      HubHandle, start(): the driver's side
"""
