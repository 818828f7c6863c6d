#!/usr/bin/env bash
# A real Airflow 3 (api-server, dag-processor, scheduler; SQLite, LocalExecutor) for
# tests/test_airflow.py, from its own virtual environment: Airflow 3.3.2 requires fastapi < 0.137,
# petatrain pins 0.165.0. petatrain goes in without its dependencies (petatrain.airflow needs none).
#   airflow.sh install          create the environment (once; ~1 minute on a fresh machine)
#   airflow.sh start PORT HOME  serve on 127.0.0.1:PORT with AIRFLOW_HOME=HOME (dags in HOME/dags)
#   airflow.sh stop HOME        stop what start started
set -euo pipefail
VERSION=3.3.2
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
HOME_DIR="${PETATRAIN_AIRFLOW_HOME:-${TMPDIR:-/tmp}/petatrain-airflow}"
VENV="$HOME_DIR/venv-$VERSION"

install() {
  mkdir -p "$HOME_DIR"
  exec 9>"$HOME_DIR/install.lock"
  flock 9
  if [ ! -x "$VENV/bin/airflow" ]; then
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "apache-airflow==$VERSION"
  fi
  # petatrain.airflow (the standard library and Airflow only), from this checkout
  # (without the caller's PYTHONPATH: the tasks run without it, from what is installed)
  if ! env -u PYTHONPATH "$VENV/bin/python" -c "import petatrain.airflow as a, sys; sys.exit(a.__file__ != '$ROOT/src/petatrain/airflow.py')" 2>/dev/null; then
    "$VENV/bin/pip" install -q --no-deps -e "$ROOT"
  fi
}

environment() {
  export AIRFLOW_HOME="$1" AIRFLOW__CORE__LOAD_EXAMPLES=False AIRFLOW__CORE__PARALLELISM=2
  export AIRFLOW__CORE__DAGS_FOLDER="$1/dags" AIRFLOW__CORE__EXECUTION_API_SERVER_URL="http://127.0.0.1:$2/execution/"
  export AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL=5 AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC=1
  export AIRFLOW__API__PORT="$2"
}

case "${1:-}" in
  install) install ;;
  start)
    port="$2"; home="$3"
    install
    environment "$home" "$port"
    mkdir -p "$home/dags" "$home/run"
    "$VENV/bin/airflow" db migrate >"$home/run/migrate.log" 2>&1
    # Each in its own session: stop ends a whole group (gunicorn's and the executor's children too).
    setsid "$VENV/bin/airflow" api-server -H 127.0.0.1 -p "$port" --workers 1 >"$home/run/api.log" 2>&1 &
    echo $! >"$home/run/api.pid"
    setsid "$VENV/bin/airflow" dag-processor >"$home/run/dag-processor.log" 2>&1 &
    echo $! >"$home/run/dag-processor.pid"
    setsid "$VENV/bin/airflow" scheduler >"$home/run/scheduler.log" 2>&1 &
    echo $! >"$home/run/scheduler.pid"
    for _ in $(seq 1 240); do
      if curl -sf "http://127.0.0.1:$port/api/v2/monitor/health" | grep -q '"scheduler": {"status": "healthy"\|"scheduler":{"status":"healthy"'; then
        echo "http://127.0.0.1:$port"; exit 0
      fi
      sleep 0.5
    done
    echo "airflow did not become healthy on port $port in 120 s" >&2; tail -20 "$home/run/api.log" "$home/run/scheduler.log" >&2
    exit 1 ;;
  stop)
    home="$2"; groups=()
    for name in scheduler dag-processor api; do
      pid_file="$home/run/$name.pid"
      [ -f "$pid_file" ] || continue
      groups+=("$(cat "$pid_file")"); rm -f "$pid_file"
    done
    [ ${#groups[@]} -gt 0 ] || exit 0
    # All three at once, two seconds to exit, then no more waiting: a test Airflow's state goes
    # with its folder (the scheduler alone took ~10 s to leave on SIGTERM).
    for pid in "${groups[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
    for _ in $(seq 1 8); do
      alive=0; for pid in "${groups[@]}"; do kill -0 -- "-$pid" 2>/dev/null && alive=1; done
      [ "$alive" = 1 ] || break; sleep 0.25
    done
    for pid in "${groups[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done ;;
  *) echo "usage: airflow.sh install | start PORT HOME | stop HOME" >&2; exit 2 ;;
esac
