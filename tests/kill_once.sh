#!/usr/bin/env bash
# `petatrain`, whose first run of each loop step is SIGKILLed with all it started after
# PETATRAIN_KILL_AFTER seconds (a task's first try dies mid-way; Airflow retries it). Markers of the
# steps killed are kept in PETATRAIN_KILL_DIR.
set -u
step=""; prev=""
for arg in "$@"; do [ "$prev" = "--only" ] && step="$arg"; prev="$arg"; done
mark="$PETATRAIN_KILL_DIR/$step"
if [ -n "$step" ] && [ ! -e "$mark" ]; then
  touch "$mark"
  setsid "$PETATRAIN_REAL_BIN" "$@" &
  child=$!
  sleep "${PETATRAIN_KILL_AFTER:-6}"
  kill -KILL -- "-$child" 2>/dev/null
  echo "killed petatrain loop --only $step" >&2
  exit 137
fi
exec "$PETATRAIN_REAL_BIN" "$@"
