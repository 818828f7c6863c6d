#!/usr/bin/env bash
# `petatrain`, whose first run of each loop step is SIGKILLed with all it started (its session) mid-way (a task's
# first try dies; the orchestrator retries it). Markers of the steps killed are kept in
# PETATRAIN_KILL_DIR. When the step is killed, for STEP = INGEST, TRAIN or PROMOTE:
#   PETATRAIN_KILL_ON_STEP="GLOB" or "GLOB::TEXT"  once a file matching GLOB exists (holding TEXT); a try
#                                                   that ends as it appears is failed as killed (its work
#                                                   done, its answer lost); one that ends before, loudly
#   otherwise                                       after PETATRAIN_KILL_AFTER seconds
#   PETATRAIN_INJECT_STEP="SPEC"                    the first try runs with --inject SPEC (a hang
#                                                   holds a training mid-way for its kill)
set -u
step=""; prev=""
for arg in "$@"; do [ "$prev" = "--only" ] && step="$arg"; prev="$arg"; done
mark="$PETATRAIN_KILL_DIR/$step"
if [ -n "$step" ] && [ ! -e "$mark" ]; then
  touch "$mark"
  name=$(echo "$step" | tr '[:lower:]' '[:upper:]')
  on_var="PETATRAIN_KILL_ON_$name"; inject_var="PETATRAIN_INJECT_$name"
  on="${!on_var:-}"; inject="${!inject_var:-}"
  extra=(); [ -n "$inject" ] && extra=(--inject "$inject")
  setsid "$PETATRAIN_REAL_BIN" "$@" ${extra[@]+"${extra[@]}"} &
  child=$!
  if [ -n "$on" ]; then
    pattern="${on%%::*}"; text=""; [ "$pattern" != "$on" ] && text="${on#*::}"
    # shellcheck disable=SC2086  # the pattern is a glob
    seen() { compgen -G "$pattern" > /dev/null && { [ -z "$text" ] || grep -qsF "$text" $pattern; }; }
    until seen; do
      if ! kill -0 "$child" 2>/dev/null; then
        wait "$child"; ended=$?
        seen && break
        echo "kill_once: the first try of $step ended (exit $ended) before $on" >&2
        exit 1
      fi
      sleep 0.1
    done
  else
    sleep "${PETATRAIN_KILL_AFTER:-6}"
  fi
  # Its whole session: Ray's workers run in process groups of their own, and a worker held by an
  # injected hang (SIGSTOP) never notices its raylet's end.
  pkill -KILL -s "$child"
  echo "killed petatrain loop --only $step" >&2
  exit 137
fi
exec "$PETATRAIN_REAL_BIN" "$@"
